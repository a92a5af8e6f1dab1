"""vLLM integration: the ``vllm.general_plugins`` entry point.

:func:`register` overrides vLLM's CPU attention backend (``CPU_ATTN``, the only
slot vLLM's CPU platform selects) with
:class:`attnpolicy.integrations.vllm_backend.AttnPolicyCPUBackend`, whose
forward takes one guarded policy decision per attention step and KV-cache group
(prefill, decode, chunked and prefix-cached prefill, mixed batches; sliding
windows, soft caps and sinks included) and runs the step in that mode: VARLEN on
vLLM's own paged kernel, CAUSAL and MASK on attnpolicy's graphs.
Configuration: see
:mod:`attnpolicy.integrations.runtime`. attnpolicy's log lines go through vLLM's
logging configuration (:func:`route_logs`). Importing this module never imports vLLM.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

BACKEND_PATH = "attnpolicy.integrations.vllm_backend.AttnPolicyCPUBackend"
#: The vLLM logger attnpolicy's records are handed to (vLLM configures its parent ``vllm``).
VLLM_LOGGER = "vllm.attnpolicy"


class _ToVllm(logging.Handler):
    """Hands every record of the ``attnpolicy`` loggers that vLLM's logger
    :data:`VLLM_LOGGER` is enabled for to it: shown where, as and at the levels vLLM's
    own lines are, as vLLM configures them (vLLM configures its logging when it builds
    an engine, after plugins may have loaded). Keeps the ``attnpolicy`` logger's
    settings from before, for :func:`unroute_logs`."""

    def __init__(self, propagate: bool, level: int) -> None:
        super().__init__()
        self.before = (propagate, level)

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(VLLM_LOGGER)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def route_logs() -> bool:
    """Send attnpolicy's log lines (the warm set's, the graph store's, the backend's)
    through vLLM's logging configuration, once each: a handler on the ``attnpolicy``
    logger hands them to :data:`VLLM_LOGGER` at the levels vLLM shows, the logger stops
    propagating to the root (vLLM's own loggers do not either) and, unless it has a
    level, passes INFO and above.
    Returns whether it routed them now: not when done already, nor when the application
    gave the ``attnpolicy`` logger handlers of its own (its configuration stays)."""
    root = logging.getLogger("attnpolicy")
    if root.handlers:
        return False
    root.addHandler(_ToVllm(root.propagate, root.level))
    root.propagate = False
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    return True


def unroute_logs() -> None:
    """Undo :func:`route_logs` (the ``attnpolicy`` logger as it was before)."""
    root = logging.getLogger("attnpolicy")
    for handler in [h for h in root.handlers if isinstance(h, _ToVllm)]:
        root.removeHandler(handler)
        root.propagate, level = handler.before
        root.setLevel(level)


def register() -> None:
    """Install the attnpolicy backend in place of ``CPU_ATTN`` (idempotent).

    Returns quietly (with a debug log) when vLLM cannot be imported; else also routes
    attnpolicy's log lines through vLLM's logging (:func:`route_logs`). The configuration
    the environment gives (``ATTNPOLICY_CONFIG``, ``ATTNPOLICY_POLICY``: names and
    options included) is checked first: a bad one raises :class:`ConfigError` here,
    which vLLM calls in the front-end process before any engine process starts, so
    the error is the line a user sees (not one line of an engine core's traceback).
    """
    try:
        from vllm.v1.attention.backends.registry import (
            AttentionBackendEnum,
            register_backend,
        )
    except ImportError as exc:
        log.debug("vLLM is not importable (%s): attnpolicy's attention backend is not registered", exc)
        return
    from attnpolicy.integrations.environment import from_env
    from attnpolicy.integrations.runtime import install_decision_log
    from attnpolicy.plugins.resolve import validate_names

    validate_names(from_env())
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    _forget_selected_backends()
    install_decision_log()
    route_logs()
    log.info("attnpolicy: %s now runs %s", AttentionBackendEnum.CPU_ATTN.name, BACKEND_PATH)


def unregister() -> None:
    """Give ``CPU_ATTN`` back to vLLM's own backend (for engines built afterwards) and
    attnpolicy's log lines back to the ``attnpolicy`` logger's settings."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return
    AttentionBackendEnum.CPU_ATTN.clear_override()
    _forget_selected_backends()
    unroute_logs()


def is_registered() -> bool:
    """Whether ``CPU_ATTN`` currently resolves to the attnpolicy backend."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return False
    return AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH


def _forget_selected_backends() -> None:
    """vLLM memoises backend selection per process; drop it so the override applies
    to engines built after this call (a no-op on a fresh process)."""
    from vllm.v1.attention import selector

    cached = getattr(selector, "_cached_get_attn_backend", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()

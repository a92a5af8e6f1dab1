"""vLLM integration: the ``vllm.general_plugins`` entry point.

:func:`register` points each attention backend slot the platform can select
(:data:`PLATFORM_SLOTS`: ``CPU_ATTN`` on CPU; ``FLASH_ATTN``, ``TRITON_ATTN`` and
``FLEX_ATTENTION`` on CUDA) at attnpolicy's wrapper of the class the slot held
(:mod:`attnpolicy.integrations.vllm_backend`, class names in :data:`WRAPPERS`): the
wrapped backend's metadata builder, KV-cache layout and writes, with a forward that
takes one guarded policy decision per attention step and KV-cache group (prefill,
decode, chunked and prefix-cached prefill, mixed batches; sliding windows, soft caps
and sinks included) and runs the step in that mode: VARLEN on the wrapped backend's
kernel, CAUSAL, MASK and ROWS on attnpolicy's graphs. The class a slot held stays
reachable (:func:`original_path`, the wrapper's ``wrapped``). Configuration: see
:mod:`attnpolicy.integrations.runtime`. attnpolicy's log lines go through vLLM's
logging configuration (:func:`route_logs`), its runtime warnings too. Importing this
module never imports vLLM.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

#: The module holding the wrapper classes.
BACKEND_MODULE = "attnpolicy.integrations.vllm_backend"
#: The slots of vLLM's ``AttentionBackendEnum`` attnpolicy wraps, and the name of each
#: one's wrapper class in :data:`BACKEND_MODULE` (its implementation: ``...Impl``).
WRAPPERS = {"CPU_ATTN": "AttnPolicyCPUBackend", "FLASH_ATTN": "AttnPolicyFlashAttnBackend",
            "TRITON_ATTN": "AttnPolicyTritonAttnBackend", "FLEX_ATTENTION": "AttnPolicyFlexAttentionBackend"}
#: The slots each platform (vLLM's ``device_type``) selects among that attnpolicy wraps:
#: every non-MLA backend vLLM's CPU and CUDA platforms pick by priority, but FLASHINFER
#: (its metadata keeps no per-request lengths) and the quantised-cache TURBOQUANT.
PLATFORM_SLOTS = {"cpu": ("CPU_ATTN",), "cuda": ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")}
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


_PACKAGE = Path(__file__).resolve().parents[1]  # attnpolicy's own source directory


class _WarningsToLog:
    """``warnings.showwarning`` while attnpolicy's lines go through vLLM's logging: a
    ``RuntimeWarning`` raised in attnpolicy's code (strict mode's compile after warm-up,
    a graph store that cannot be written, ...) becomes one WARNING record of the logger of
    the module it names, with its file and line, so vLLM shows it as one line in its own
    format; every other warning goes to the hook it replaced. Python's warning filters
    still decide first whether a warning is shown at all."""

    def __init__(self, before: Any) -> None:
        self.before = before

    def __call__(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
        path = Path(filename).resolve()
        if not (issubclass(category, RuntimeWarning) and path.is_relative_to(_PACKAGE)):
            self.before(message, category, filename, lineno, file, line)
            return
        module = ".".join(("attnpolicy", *path.relative_to(_PACKAGE).with_suffix("").parts))
        logger = logging.getLogger(module.removesuffix(".__init__"))
        logger.handle(logger.makeRecord(logger.name, logging.WARNING, filename, lineno, str(message), (), None))


def route_logs() -> bool:
    """Send attnpolicy's log lines (the warm set's, the graph store's, the backend's)
    and its runtime warnings through vLLM's logging configuration, once each: a handler on
    the ``attnpolicy`` logger hands them to :data:`VLLM_LOGGER` at the levels vLLM shows,
    the logger stops propagating to the root (vLLM's own loggers do not either) and,
    unless it has a level, passes INFO and above; a ``RuntimeWarning`` raised in
    attnpolicy's code is logged there too, one line (:class:`_WarningsToLog`).
    Returns whether it routed them now: not when done already, nor when the application
    gave the ``attnpolicy`` logger handlers of its own (its configuration stays)."""
    root = logging.getLogger("attnpolicy")
    if root.handlers:
        return False
    root.addHandler(_ToVllm(root.propagate, root.level))
    root.propagate = False
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    warnings.showwarning = _WarningsToLog(warnings.showwarning)
    return True


def unroute_logs() -> None:
    """Undo :func:`route_logs` (the ``attnpolicy`` logger as it was before; warnings shown
    as before, unless another hook replaced :func:`warnings.showwarning` since)."""
    root = logging.getLogger("attnpolicy")
    for handler in [h for h in root.handlers if isinstance(h, _ToVllm)]:
        root.removeHandler(handler)
        root.propagate, level = handler.before
        root.setLevel(level)
    if isinstance(warnings.showwarning, _WarningsToLog):
        warnings.showwarning = warnings.showwarning.before


def register() -> None:
    """Point every slot the platform selects among (:data:`PLATFORM_SLOTS`) at attnpolicy's
    wrapper of the class it held (idempotent).

    Returns quietly (with a debug log) when vLLM cannot be imported; else also routes
    attnpolicy's log lines (and its runtime warnings) through vLLM's logging
    (:func:`route_logs`). The configuration the environment gives (``ATTNPOLICY_CONFIG``,
    ``ATTNPOLICY_POLICY``: names and options included) is checked first: a bad one raises
    :class:`ConfigError` here, which vLLM calls in the front-end process before any engine
    process starts, so the error is the line a user sees (not one line of an engine core's
    traceback). A platform with no slot attnpolicy wraps is warned about, nothing registered.
    """
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import (
            AttentionBackendEnum,
            register_backend,
        )
    except ImportError as exc:
        log.debug("vLLM is not importable (%s): attnpolicy's attention backend is not registered", exc)
        return
    from attnpolicy.integrations.environment import from_env
    from attnpolicy.integrations.runtime import install_decision_log
    from attnpolicy.policies.resolve import validate_names

    validate_names(from_env())
    slots = platform_slots()
    if not slots:
        log.warning("attnpolicy: vLLM's %s platform selects no attention backend attnpolicy wraps (it wraps %s); "
                    "nothing registered", current_platform.device_type,
                    "; ".join(f"{', '.join(s)} on {p}" for p, s in PLATFORM_SLOTS.items()))
        return
    taken = []
    for slot in slots:
        member = AttentionBackendEnum[slot]
        if member.get_path() != wrapper_path(slot):
            _before[slot] = member.get_path() if member.is_overridden() else None
            register_backend(member, wrapper_path(slot))
            taken.append(slot)
    _forget_selected_backends()
    install_decision_log()
    route_logs()
    for slot in taken:
        log.info("attnpolicy: %s now runs %s (wrapping %s)", slot, wrapper_path(slot), original_path(slot))


def platform_slots() -> tuple[str, ...]:
    """The slots of :data:`WRAPPERS` the current vLLM platform selects among (none on a
    platform attnpolicy does not wrap)."""
    from vllm.platforms import current_platform

    return PLATFORM_SLOTS.get(current_platform.device_type, ())


def wrapper_path(slot: str) -> str:
    """The class path of attnpolicy's wrapper for ``slot``."""
    return f"{BACKEND_MODULE}.{WRAPPERS[slot]}"


#: the path each slot's override had before :func:`register` (None: vLLM's own class)
_before: dict[str, str | None] = {}


def original_path(slot: str) -> str:
    """The class the wrapper of ``slot`` wraps: the slot's override from before
    :func:`register` (another plugin's), else vLLM's own class for it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    before = _before.get(slot)
    return before if before is not None else AttentionBackendEnum[slot].value


def unregister() -> None:
    """Give every slot :func:`register` took back the class it held (for engines built
    afterwards) and attnpolicy's log lines back to the ``attnpolicy`` logger's settings."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:
        return
    for slot in WRAPPERS:
        member = AttentionBackendEnum[slot]
        if member.get_path() != wrapper_path(slot):
            continue
        before = _before.pop(slot, None)
        if before is None:
            member.clear_override()
        else:
            register_backend(member, before)
    _forget_selected_backends()
    unroute_logs()


def is_registered() -> bool:
    """Whether every slot the platform selects among resolves to attnpolicy's wrapper."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return False
    slots = platform_slots()
    return bool(slots) and all(AttentionBackendEnum[slot].get_path() == wrapper_path(slot) for slot in slots)


def _forget_selected_backends() -> None:
    """vLLM memoises backend selection per process; drop it so the override applies
    to engines built after this call (a no-op on a fresh process)."""
    from vllm.v1.attention import selector

    cached = getattr(selector, "_cached_get_attn_backend", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()

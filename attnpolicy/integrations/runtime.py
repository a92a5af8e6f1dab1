"""What the runtime integrations share: one dispatcher per config and process, and a
JSON-lines log of decisions and cache stats.

Environment variables (read when an integration builds its dispatcher):

- ``ATTNPOLICY_CONFIG`` and ``ATTNPOLICY_POLICY``: the config, see
  :func:`attnpolicy.integrations.environment.from_env`;
- ``ATTNPOLICY_DECISIONS_LOG``: a file that gets one JSON line per decision
  (``"event": "decision"``) and, at process exit, one line of cache stats per
  dispatcher (``"event": "stats"``). Several processes may append to one file.
  An integration adds fields of its own to the decisions it asks for inside
  :func:`decision_fields` (the vLLM backend: the KV-cache group, window and cap);
  The path is checked when the log is installed: a file that cannot be opened for
  appending raises :class:`~attnpolicy.errors.ConfigError` naming the variable there,
  never later inside an attention call;
- ``ATTNPOLICY_LAYOUT_LOG``: a layout-stream file (see
  :mod:`attnpolicy.workloads.layout_stream`) for integrations that record their steps.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from attnpolicy.config import CONFIG_VERSION, AttnPolicyConfig
from attnpolicy.core import jsonfile
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision
from attnpolicy.dispatch import Builder, Dispatcher
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.workloads.layout_stream import LAYOUT_LOG_ENV, LayoutStreamWriter

DECISIONS_LOG_ENV = "ATTNPOLICY_DECISIONS_LOG"

_lock = threading.Lock()
_dispatchers: dict[tuple[str, Builder | None, bool], tuple[AttnPolicyConfig, Dispatcher]] = {}
_logs: dict[str, DecisionLog] = {}
_streams: dict[int, LayoutStreamWriter | None] = {}
_fields: ContextVar[dict[str, Any] | None] = ContextVar("attnpolicy_decision_fields", default=None)


def dispatcher_for(config: AttnPolicyConfig, builder: Builder | None = None, *,
                   host_varlen: bool = False) -> Dispatcher:
    """The process's dispatcher for ``config``, graph ``builder`` and ``host_varlen``
    (see :class:`~attnpolicy.dispatch.Dispatcher`; built on first use, then shared)."""
    key = (config.model_dump_json(), builder, host_varlen)
    with _lock:
        if key not in _dispatchers:
            _dispatchers[key] = (config, Dispatcher(config, builder=builder, host_varlen=host_varlen))
        return _dispatchers[key][1]


@dataclass(frozen=True)
class RuntimeLimits:
    """What a serving runtime admits: the longest sequence (prompt + output), the
    query tokens and sequences of one step, and its KV-cache block size."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int

    @property
    def max_packed_tokens(self) -> int:
        """The most rows a packed call of one step holds (all sequences' keys)."""
        return max(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)


def fit_to_runtime(config: AttnPolicyConfig, limits: RuntimeLimits, source: str = "config") -> AttnPolicyConfig:
    """``config`` with ``max_seq_len`` and ``max_batch_tokens`` taken from the runtime's
    limits where the user did not set them (``model_fields_set``), so that every
    request the runtime accepts fits the buckets. A limit the user set below the
    runtime's, with ``on_overflow="raise"``, is a :class:`ConfigError` naming it."""
    given = config.model_fields_set
    fields: dict[str, Any] = {}
    needs = {"max_seq_len": limits.max_model_len, "max_batch_tokens": limits.max_packed_tokens}
    for name, need in needs.items():
        if name not in given:
            fields[name] = need
        elif getattr(config, name) < need and config.on_overflow == "raise":
            raise ConfigError(f"{source}: {name}={getattr(config, name)} is below what the runtime admits "
                              f"({need}, from {limits}): requests it accepts would overflow the buckets; "
                              f"raise {name}, leave it unset, or set on_overflow='eager'")
    part = config.partition_len
    if "max_seq_len" in fields and config.attn_impl == "flash" and part:
        fields["max_seq_len"] = -(-fields["max_seq_len"] // part) * part
        fields["max_batch_tokens"] = max(fields.get("max_batch_tokens", 0), fields["max_seq_len"])
    if not fields:
        return config
    data = {**config.model_dump(mode="json", exclude_unset=True), **fields}
    return jsonfile.validate(AttnPolicyConfig, data, f"{source} fitted to {limits}", "config", CONFIG_VERSION)


def layout_stream(dispatcher: Dispatcher, spec: TensorSpec, limits: RuntimeLimits | None = None,
                  environ: Mapping[str, str] = os.environ) -> LayoutStreamWriter | None:
    """The layout-stream writer of ``dispatcher`` for ``ATTNPOLICY_LAYOUT_LOG``
    (opened on first use, one run per dispatcher; ``None`` when the variable is unset)."""
    with _lock:
        if id(dispatcher) not in _streams:
            path = environ.get(LAYOUT_LOG_ENV)
            writer = None
            if path:
                writer = LayoutStreamWriter(path, dispatcher.config, spec,
                                            asdict(limits) if limits else None)
                atexit.register(writer.close)
            _streams[id(dispatcher)] = writer
        return _streams[id(dispatcher)]


def dispatchers() -> tuple[Dispatcher, ...]:
    """Every dispatcher the integrations built in this process."""
    with _lock:
        return tuple(d for _, d in _dispatchers.values())


def _layout_fields(layout: BatchLayout) -> dict[str, Any]:
    return {"num_seqs": layout.num_seqs, "q_lens": list(layout.q_lens),
            "kv_lens": list(layout.kv_lens), "causal": layout.causal, "padded": layout.is_padded}


class DecisionLog:
    """A plugin appending one JSON line per decision to ``path``, and stats at exit."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._write_lock = threading.Lock()
        try:  # fail here, with the path named, rather than in every attend
            with open(self.path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise ConfigError(f"{DECISIONS_LOG_ENV}={path}: cannot append to the decisions log: "
                              f"{type(exc).__name__}: {exc.strerror or exc}") from exc

    def write(self, record: dict[str, Any]) -> None:
        line = jsonfile.dumps({"pid": os.getpid(), **record}, str(self.path), default=str) + "\n"
        with self._write_lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)

    @hookimpl
    def attnpolicy_on_decision(self, layout: BatchLayout, decision: Decision, policy: str,
                               fell_back: bool) -> None:
        self.write({"event": "decision", "policy": policy, "mode": decision.mode.value,
                    "reason": decision.reason, "fell_back": fell_back, **_layout_fields(layout),
                    **(_fields.get() or {})})

    def write_stats(self) -> None:
        with _lock:
            built = list(_dispatchers.values())
        for config, d in built:
            self.write({"event": "stats", "policy": config.policy, "stats": d.stats().to_json()})


@contextmanager
def decision_fields(fields: dict[str, Any]) -> Iterator[None]:
    """Add ``fields`` to every decision record written inside the block (in this thread
    or task): what the integration knows of the call that the layout does not say."""
    token = _fields.set(fields)
    try:
        yield
    finally:
        _fields.reset(token)


def log_event(record: dict[str, Any]) -> None:
    """Append ``record`` (with its ``event``) to every installed decisions log."""
    with _lock:
        logs = list(_logs.values())
    for log in logs:
        log.write(record)


def install_decision_log(environ: Mapping[str, str] = os.environ) -> DecisionLog | None:
    """Register a :class:`DecisionLog` for ``ATTNPOLICY_DECISIONS_LOG`` (once per path)."""
    path = environ.get(DECISIONS_LOG_ENV)
    if not path:
        return None
    key = str(Path(path).resolve())
    pm = get_plugin_manager()
    with _lock:
        log = _logs.get(key)
        if log is None:
            log = _logs[key] = DecisionLog(key)
            atexit.register(log.write_stats)
    if not pm.is_registered(log):
        pm.register(log, name=f"attnpolicy-decision-log:{key}")
    return log

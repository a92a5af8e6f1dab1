"""What the runtime integrations share: one dispatcher per config and process, and a
JSON-lines log of decisions and cache stats.

Environment variables (read when an integration builds its dispatcher):

- ``ATTNPOLICY_CONFIG`` and ``ATTNPOLICY_POLICY``: the config, see
  :func:`attnpolicy.config.from_env`;
- ``ATTNPOLICY_DECISIONS_LOG``: a file that gets one JSON line per decision
  (``"event": "decision"``) and, at process exit, one line of cache stats per
  dispatcher (``"event": "stats"``). Several processes may append to one file.
  The path is checked when the log is installed: a file that cannot be opened for
  appending raises :class:`~attnpolicy.errors.ConfigError` naming the variable there,
  never later inside an attention call.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision
from attnpolicy.dispatcher import Dispatcher
from attnpolicy.errors import ConfigError
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.plugins.registry import get_plugin_manager

DECISIONS_LOG_ENV = "ATTNPOLICY_DECISIONS_LOG"

_lock = threading.Lock()
_dispatchers: dict[str, tuple[AttnPolicyConfig, Dispatcher]] = {}
_logs: dict[str, DecisionLog] = {}


def dispatcher_for(config: AttnPolicyConfig) -> Dispatcher:
    """The process's dispatcher for ``config`` (built on first use, then shared)."""
    key = config.model_dump_json()
    with _lock:
        if key not in _dispatchers:
            _dispatchers[key] = (config, Dispatcher(config))
        return _dispatchers[key][1]


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
        line = json.dumps({"pid": os.getpid(), **record}, default=str) + "\n"
        with self._write_lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)

    @hookimpl
    def attnpolicy_on_decision(self, layout: BatchLayout, decision: Decision, policy: str,
                               fell_back: bool) -> None:
        self.write({"event": "decision", "policy": policy, "mode": decision.mode.value,
                    "reason": decision.reason, "fell_back": fell_back, **_layout_fields(layout)})

    def write_stats(self) -> None:
        with _lock:
            built = list(_dispatchers.values())
        for config, d in built:
            self.write({"event": "stats", "policy": config.policy, "stats": d.stats().to_json()})


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

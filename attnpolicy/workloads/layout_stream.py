"""The layout stream: one JSON line per attention step a runtime ran, to replay later.

A stream file holds one or more *runs*, one per dispatcher that wrote to it (several
processes and dispatchers may append to one file). A run starts with a header line
and continues with one line per step::

    {"event": "header", "run": "8225-0", "config": {...}, "spec": {...}, "runtime": {...}}
    {"event": "step", "run": "8225-0", "step": 0, "q": [5, 17], "kv": [5, 17], "causal": true,
     "mode": "varlen", "keys": ["causal/q16/...", ...], "hits": 0, "misses": 2, "evictions": 0,
     "graphs": 2}

``q`` and ``kv`` are the query and key lengths of the step's sequences (``kv``
includes cached context), ``mode`` the decision that ran, ``keys`` the graph keys a
static-shape runtime compiles for it, and ``hits`` … ``graphs`` the dispatcher's graph
cache counters after the step. ``attnpolicy simulate --layouts FILE`` replays a run.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, TextIO

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core import jsonfile
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode
from attnpolicy.errors import ConfigError, LayoutError
from attnpolicy.graphs.keys import GraphKey, TensorSpec

LAYOUT_LOG_ENV = "ATTNPOLICY_LAYOUT_LOG"
CACHE_COUNTERS = ("hits", "misses", "evictions", "graphs")


@dataclass(frozen=True)
class StepRecord:
    """One recorded step: its layout, the mode that ran, its graph keys, and the
    cache counters after it."""

    step: int
    layout: BatchLayout
    mode: MaskMode
    keys: tuple[str, ...]
    hits: int
    misses: int
    evictions: int
    graphs: int


@dataclass(frozen=True)
class LayoutRun:
    """The steps one dispatcher recorded, with the config and tensor spec it ran with."""

    run: str
    config: AttnPolicyConfig
    spec: TensorSpec
    runtime: dict[str, Any]
    steps: tuple[StepRecord, ...]

    @property
    def layouts(self) -> list[BatchLayout]:
        return [s.layout for s in self.steps]

    @property
    def misses(self) -> int:
        """Graph-cache misses over the run (the counter after its last step)."""
        return self.steps[-1].misses if self.steps else 0


class LayoutStreamWriter:
    """Appends one run (a header, then :meth:`write_step` lines) to ``path``."""

    _runs = count()

    def __init__(self, path: str | os.PathLike[str], config: AttnPolicyConfig, spec: TensorSpec,
                 runtime: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.run = f"{os.getpid()}-{next(self._runs)}"
        self._lock = threading.Lock()
        self._steps = 0
        self._names: dict[GraphKey | str, str] = {}  # str(key) per key: keys repeat every step
        self._file: TextIO = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        self._write({"event": "header", "config": config.model_dump(mode="json"),
                     "spec": _spec_fields(spec), "runtime": dict(runtime or {})})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({**record, "run": self.run}, separators=(",", ":")) + "\n")
        self._file.flush()

    def write_step(self, layout: BatchLayout, mode: MaskMode, keys: Sequence[GraphKey | str],
                   cache: Mapping[str, int]) -> None:
        """Record one step: ``cache`` holds the counters :data:`CACHE_COUNTERS` after it."""
        with self._lock:
            record: dict[str, Any] = {"event": "step", "step": self._steps, "q": list(layout.q_lens),
                                      "kv": list(layout.kv_lens), "causal": layout.causal}
            if layout.is_padded:
                record["q_tokens"] = layout.q_tokens
            record["mode"] = mode.value
            names = self._names
            record["keys"] = [names.get(k) or names.setdefault(k, str(k)) for k in keys]
            record.update({name: cache[name] for name in CACHE_COUNTERS})
            self._write(record)
            self._steps += 1

    def close(self) -> None:
        self._file.close()


def _spec_fields(spec: TensorSpec) -> dict[str, Any]:
    return {"dtype": spec.dtype, "heads": spec.heads, "kv_heads": spec.kv_heads,
            "head_dim": spec.head_dim, "scale": spec.scale, "device": spec.device}


def read_layout_stream(path: str | os.PathLike[str]) -> list[LayoutRun]:
    """Every run of a stream file, in the order their headers appear. Errors
    (:class:`ConfigError`) name the file, the line and the bad field."""
    file = Path(path)
    text = jsonfile.read_text(file, "layout stream")
    heads: dict[str, dict[str, Any]] = {}
    steps: dict[str, list[StepRecord]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{file}:{n}"
        try:
            rec = json.loads(line)
            run = rec["run"]
            if rec["event"] == "header":
                spec = rec["spec"]
                heads[run] = {"config": jsonfile.validate(AttnPolicyConfig, rec["config"], where, "config", 1),
                              "spec": TensorSpec(spec["dtype"], spec["heads"], spec["kv_heads"],
                                                 spec["head_dim"], spec.get("scale"), spec.get("device", "cpu")),
                              "runtime": rec.get("runtime", {})}
                steps[run] = []
            elif rec["event"] == "step":
                if run not in heads:
                    raise ConfigError(f"{where}: step of run {run!r} before its header")
                q_tokens = rec.get("q_tokens")
                layout = BatchLayout.from_lens(rec["q"], rec["kv"], causal=rec["causal"], padded_to=q_tokens)
                steps[run].append(StepRecord(rec["step"], layout, MaskMode(rec["mode"]), tuple(rec["keys"]),
                                             *(int(rec[c]) for c in CACHE_COUNTERS)))
        except ConfigError:
            raise
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not a JSON line: {exc}") from None
        except KeyError as exc:
            raise ConfigError(f"{where}: missing field {exc}") from None
        except (LayoutError, ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return [LayoutRun(run, h["config"], h["spec"], h["runtime"], tuple(steps[run])) for run, h in heads.items()]


def select_run(runs: Sequence[LayoutRun], run: str | None, source: str) -> LayoutRun:
    """The run named ``run``, or the only run when ``run`` is None."""
    if not runs:
        raise ConfigError(f"{source} holds no recorded run")
    if run is None:
        if len(runs) > 1:
            raise ConfigError(f"{source} holds {len(runs)} runs ({', '.join(r.run for r in runs)}): "
                              "choose one with --run")
        return runs[0]
    for r in runs:
        if r.run == run:
            return r
    raise ConfigError(f"run {run!r} is not in {source}; runs: {', '.join(r.run for r in runs)}")

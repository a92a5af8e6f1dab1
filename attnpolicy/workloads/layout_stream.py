"""The layout stream: one JSON line per attention step a runtime ran, to replay later.

A stream file holds one or more *runs*, one per dispatcher that wrote to it (several
processes, hosts and dispatchers may append to one file). A run starts with a header
line and continues with one line per step, numbered from 0::

    {"event": "header", "run": "8225-0-3f9a1c2e", "config": {...}, "spec": {...}, "runtime": {...}}
    {"event": "step", "run": "8225-0-3f9a1c2e", "step": 0, "q": [5, 17], "kv": [5, 17], "causal": true,
     "mode": "varlen", "keys": ["causal/q16/...", ...], "hits": 0, "misses": 2, "evictions": 0,
     "graphs": 2}

A run id is the writer's process id, its number in the process and a random part,
so that recordings appending to one file (two containers with the same pid) never
share one. ``q`` and ``kv`` are the query and key lengths of the step's sequences
(``kv`` includes cached context), ``mode`` the decision that ran, ``keys`` the graph
keys a static-shape runtime compiles for it, and ``hits`` … ``graphs`` the
dispatcher's graph cache counters after the step. ``attnpolicy simulate --layouts
FILE`` replays a run.

Reading trusts nothing: every line is checked, and the first problem is a
:class:`ConfigError` naming the file and the line: a line that is not JSON, a
missing field, an unknown ``event``, a second header for one run id, a step before
its header, a step numbered out of turn (a step dropped, duplicated or moved), a
cache counter that goes down, a mode that is illegal for the step's layout, a key
of another tensor spec than the header's, or a bad spec (unknown dtype, ``heads``,
``kv_heads`` or ``head_dim`` not a positive integer, ``kv_heads`` not dividing
``heads``). A run with no steps is refused when it is selected.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any, TextIO

from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core import jsonfile
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import MaskMode, why_illegal
from attnpolicy.core.names import DTYPES
from attnpolicy.errors import ConfigError, LayoutError
from attnpolicy.graphs.keys import GraphKey, TensorSpec

LAYOUT_LOG_ENV = "ATTNPOLICY_LAYOUT_LOG"
CACHE_COUNTERS = ("hits", "misses", "evictions", "graphs")
#: The counters that never go down over a run (``graphs`` falls on an eviction).
_MONOTONE = ("hits", "misses", "evictions")


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

    @property
    def recorded(self) -> dict[str, int]:
        """The cache counters ``hits``, ``misses`` and ``evictions`` after the last step
        (what a replay under the recorded config must reproduce)."""
        last = self.steps[-1] if self.steps else None
        return {c: getattr(last, c) if last else 0 for c in _MONOTONE}


class LayoutStreamWriter:
    """Appends one run (a header, then :meth:`write_step` lines) to ``path``."""

    _runs = count()

    def __init__(self, path: str | os.PathLike[str], config: AttnPolicyConfig, spec: TensorSpec,
                 runtime: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.run = f"{os.getpid()}-{next(self._runs)}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.Lock()
        self._steps = 0
        self._names: dict[GraphKey | str, str] = {}  # str(key) per key: keys repeat every step
        self._file: TextIO = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        self._write({"event": "header", "config": config.model_dump(mode="json"),
                     "spec": _spec_fields(spec), "runtime": dict(runtime or {})})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(jsonfile.dumps({**record, "run": self.run}, str(self.path), separators=(",", ":")) + "\n")
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


def _spec(fields: Any, where: str) -> TensorSpec:
    """The header's tensor spec, every field checked; errors name ``where`` and the field."""
    if not isinstance(fields, dict):
        raise ConfigError(f"{where}: spec must be an object, got {fields!r}")
    dtype = fields["dtype"]
    if dtype not in DTYPES:
        raise ConfigError(f"{where}: spec.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    sizes = {name: fields[name] for name in ("heads", "kv_heads", "head_dim")}
    for name, value in sizes.items():
        if type(value) is not int or value < 1:
            raise ConfigError(f"{where}: spec.{name} must be an integer >= 1, got {value!r}")
    if sizes["heads"] % sizes["kv_heads"]:
        raise ConfigError(f"{where}: spec.kv_heads {sizes['kv_heads']} must divide spec.heads {sizes['heads']}")
    scale = fields.get("scale")
    if scale is not None and (type(scale) not in (int, float) or not scale > 0):
        raise ConfigError(f"{where}: spec.scale must be a number > 0 or null, got {scale!r}")
    device = fields.get("device", "cpu")
    if not isinstance(device, str) or not device:
        raise ConfigError(f"{where}: spec.device must be a device name, got {device!r}")
    return TensorSpec(dtype, sizes["heads"], sizes["kv_heads"], sizes["head_dim"], scale, device)


def _spec_part(spec: TensorSpec) -> str:
    """The part of every graph key's name that says its tensor spec (see ``GraphKey.__str__``)."""
    return f"/{spec.dtype}/h{spec.heads}kv{spec.kv_heads}d{spec.head_dim}/"


class _Run:
    """A run being read: its header and the steps so far, each step checked against both."""

    def __init__(self, rec: dict[str, Any], line: int, where: str) -> None:
        self.line = line
        self.config = jsonfile.validate(AttnPolicyConfig, rec["config"], where, "config", 1)
        self.spec = _spec(rec["spec"], where)
        self.spec_part = _spec_part(self.spec)
        self.runtime = dict(rec.get("runtime", {}))
        self.steps: list[StepRecord] = []

    def add(self, rec: dict[str, Any], where: str) -> None:
        run, number = rec["run"], rec["step"]
        if number != len(self.steps):
            what = ("a step is missing or moved" if type(number) is int and number > len(self.steps)
                    else "a step is duplicated or moved")
            raise ConfigError(f"{where}: run {run!r} has step {number!r} where step {len(self.steps)} "
                              f"belongs ({what})")
        layout = BatchLayout.from_lens(rec["q"], rec["kv"], causal=rec["causal"], padded_to=rec.get("q_tokens"))
        mode = MaskMode(rec["mode"])
        if (why := why_illegal(mode, layout)) is not None:
            raise ConfigError(f"{where}: recorded mode {mode.value} is illegal for the step's layout: {why}")
        keys = tuple(rec["keys"])
        for key in keys:
            if not isinstance(key, str) or self.spec_part not in key:
                raise ConfigError(f"{where}: graph key {key!r} is not of the header's tensor spec "
                                  f"(line {self.line}: {self.spec_part.strip('/')})")
        counters = {c: rec[c] for c in CACHE_COUNTERS}
        for name, value in counters.items():
            if type(value) is not int or value < 0:
                raise ConfigError(f"{where}: {name} must be an integer >= 0, got {value!r}")
        if self.steps:
            last = self.steps[-1]
            for name in _MONOTONE:
                if counters[name] < getattr(last, name):
                    raise ConfigError(f"{where}: {name} went down from {getattr(last, name)} to "
                                      f"{counters[name]} (steps out of order or from another run)")
        self.steps.append(StepRecord(number, layout, mode, keys, **counters))


def read_layout_stream(path: str | os.PathLike[str]) -> list[LayoutRun]:
    """Every run of a stream file, in the order their headers appear. Errors
    (:class:`ConfigError`) name the file, the line and the bad field (see the module
    docstring for what is checked)."""
    file = Path(path)
    text = jsonfile.read_text(file, "layout stream")
    runs: dict[str, _Run] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{file}:{n}"
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            run, event = rec["run"], rec["event"]
            if event == "header":
                if run in runs:
                    raise ConfigError(f"{where}: a second header for run {run!r} (the first is on line "
                                      f"{runs[run].line}): two recordings share one run id")
                runs[run] = _Run(rec, n, where)
            elif event == "step":
                if run not in runs:
                    raise ConfigError(f"{where}: step of run {run!r} before its header")
                runs[run].add(rec, where)
            else:
                raise ConfigError(f"{where}: unknown event {event!r} (a stream holds 'header' and 'step' lines)")
        except ConfigError:
            raise
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not a JSON line: {exc}") from None
        except KeyError as exc:
            raise ConfigError(f"{where}: missing field {exc}") from None
        except (LayoutError, ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return [LayoutRun(run, r.config, r.spec, r.runtime, tuple(r.steps)) for run, r in runs.items()]


def select_run(runs: Sequence[LayoutRun], run: str | None, source: str) -> LayoutRun:
    """The run named ``run``, or the only run when ``run`` is None; a run without
    steps is an error."""
    if not runs:
        raise ConfigError(f"{source} holds no recorded run")
    if run is None:
        if len(runs) > 1:
            raise ConfigError(f"{source} holds {len(runs)} runs ({', '.join(r.run for r in runs)}): "
                              "choose one with --run")
        chosen = runs[0]
    else:
        found = [r for r in runs if r.run == run]
        if not found:
            raise ConfigError(f"run {run!r} is not in {source}; runs: {', '.join(r.run for r in runs)}")
        chosen = found[0]
    if not chosen.steps:
        raise ConfigError(f"run {chosen.run} of {source} holds no steps (only its header): nothing to replay")
    return chosen

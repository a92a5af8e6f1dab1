"""Workloads: inference requests, a seeded synthetic default, and Azure-format traces.

A trace is a list of :class:`Request` ordered by arrival. ``load_trace("default")``
is the built-in synthetic trace; any other spec is the path of a CSV in the Azure
LLM inference trace format (``TIMESTAMP,ContextTokens,GeneratedTokens``).
See ``docs/workloads.md`` for the distribution and how it compares to real traffic.
"""

from __future__ import annotations

import csv
import math
import random
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, TextIO

from pydantic import Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from attnpolicy.errors import AttnPolicyError


class TraceError(AttnPolicyError, ValueError):
    """A workload trace (file or request) is missing or malformed."""


@dataclass(frozen=True)
class Request:
    """One inference request: arrival (seconds from trace start) and token counts.

    ``output_tokens == 0`` means prefill only (e.g. an embedding request).
    """

    arrival: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        try:
            _REQUEST.validate_python({"arrival": self.arrival, "prompt_tokens": self.prompt_tokens,
                                      "output_tokens": self.output_tokens})
        except ValidationError as exc:
            e = exc.errors(include_url=False)[0]
            name = str(e["loc"][0])
            raise TraceError(f"{name} must be {_RULES[name]}, got {e['input']!r}") from None


class _RequestFields(TypedDict):
    arrival: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
    prompt_tokens: Annotated[int, Field(strict=True, ge=1)]
    output_tokens: Annotated[int, Field(strict=True, ge=0)]


_REQUEST = TypeAdapter(_RequestFields)
_RULES = {"arrival": "a finite number >= 0", "prompt_tokens": "an int >= 1", "output_tokens": "an int >= 0"}


# -- synthetic default ------------------------------------------------------------


@dataclass(frozen=True)
class _Class:
    weight: float
    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float


#: Two request classes (lognormal lengths, parameters as median and log-space sigma).
#: The prompt parameters are a rounded two-component fit to the Azure 2023 code trace;
#: the chat class's longer answers are an assumption (see docs/workloads.md).
_CHAT = _Class(weight=0.3, prompt_median=250, prompt_sigma=1.3, output_median=150, output_sigma=0.8)
_LONG = _Class(weight=0.7, prompt_median=2100, prompt_sigma=0.75, output_median=16, output_sigma=0.85)
PROMPT_RANGE = (8, 8000)
OUTPUT_RANGE = (1, 1000)
ARRIVAL_RATE = 2.5  # requests per second (Poisson), the code trace's mean rate
DEFAULT_TRACE_LEN = 400


def _clamp_round(x: float, bounds: tuple[int, int]) -> int:
    return min(max(round(x), bounds[0]), bounds[1])


def synthetic_default(n: int = DEFAULT_TRACE_LEN, seed: int = 0) -> list[Request]:
    """``n`` requests mixing short chat prompts and long code/document contexts.

    Drawn from ``random.Random(seed)`` one request at a time, so the result is the
    same on every machine and process, and ``synthetic_default(k)`` is a prefix of
    ``synthetic_default(n)`` for ``k <= n``. The first request arrives at 0 s.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise TraceError(f"n must be an int >= 0, got {n!r}")
    rng = random.Random(seed)
    out: list[Request] = []
    t = 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(ARRIVAL_RATE)
        cls = _CHAT if rng.random() < _CHAT.weight else _LONG
        prompt = rng.lognormvariate(math.log(cls.prompt_median), cls.prompt_sigma)
        output = rng.lognormvariate(math.log(cls.output_median), cls.output_sigma)
        out.append(Request(t, _clamp_round(prompt, PROMPT_RANGE), _clamp_round(output, OUTPUT_RANGE)))
    return out


# -- Azure LLM inference trace CSV ---------------------------------------------------

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TIMESTAMP = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
)
_INT = re.compile(r"[+-]?\d+")
_EPOCH = datetime(1970, 1, 1)


def _nanoseconds(text: str) -> int:
    """Nanoseconds since 1970 of a naive ``YYYY-MM-DD HH:MM:SS[.fffffff]`` timestamp (exact)."""
    m = _TIMESTAMP.fullmatch(text.strip())
    if m is None:
        raise ValueError("expected YYYY-MM-DD HH:MM:SS[.fraction]")
    year, month, day, hour, minute, second, frac = m.groups()
    # ValueError on e.g. month 13
    since = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second)) - _EPOCH
    return (since.days * 86_400 + since.seconds) * 10**9 + int((frac or "").ljust(9, "0"))


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise TraceError(f"limit must be an int >= 0 or None, got {limit!r}")


def load_azure_csv(path: str | Path, limit: int | None = None) -> list[Request]:
    """Requests from an Azure LLM inference trace CSV (at most ``limit`` rows).

    The header ``TIMESTAMP,ContextTokens,GeneratedTokens`` is required; timestamps
    must not decrease; arrivals are seconds after the first row. Any malformed row
    raises :class:`TraceError` naming the file, the line and the field.
    """
    _check_limit(limit)
    path = Path(path)
    try:
        handle = path.open(newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise TraceError(f"cannot read trace file {str(path)!r}: {exc.strerror or exc}") from exc
    with handle:
        requests = _read_rows(handle, path, limit)
    if not requests and limit != 0:
        raise TraceError(f"{path}: the trace holds no requests")
    return requests


def _read_rows(handle: TextIO, path: Path, limit: int | None) -> list[Request]:
    reader = csv.reader(handle, strict=True)
    try:
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != AZURE_HEADER:
            raise TraceError(
                f"{path}:1: header must be {','.join(AZURE_HEADER)}, got "
                f"{','.join(header) if header is not None else 'an empty file'!r}"
            )
        requests: list[Request] = []
        first = previous = 0
        for row in reader:
            if limit is not None and len(requests) >= limit:
                break
            if not row:
                continue
            where = f"{path}:{reader.line_num}"
            if len(row) != len(AZURE_HEADER):
                raise TraceError(f"{where}: expected {len(AZURE_HEADER)} columns, got {len(row)}: {row!r}")
            try:
                t = _nanoseconds(row[0])
            except ValueError as exc:
                raise TraceError(f"{where}: TIMESTAMP {row[0]!r} is not a timestamp ({exc})") from exc
            prompt = _field_int(where, "ContextTokens", row[1], low=1)
            output = _field_int(where, "GeneratedTokens", row[2], low=0)
            if not requests:
                first = previous = t
            elif t < previous:
                raise TraceError(f"{where}: TIMESTAMP {row[0]!r} is earlier than the previous row's")
            previous = t
            requests.append(Request((t - first) / 1e9, prompt, output))
        return requests
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}:{_undecodable_line(path)}: not UTF-8 text ({exc.reason})") from exc
    except csv.Error as exc:
        raise TraceError(f"{path}:{reader.line_num}: not a CSV line ({exc})") from exc


def _undecodable_line(path: Path) -> int:
    """The number of the first line of ``path`` that is not UTF-8 (the reader decodes
    ahead in blocks, so its own line count is not where the bad byte is)."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return n
    return 0


def _field_int(where: str, name: str, text: str, *, low: int) -> int:
    if _INT.fullmatch(text.strip()) is None:
        raise TraceError(f"{where}: {name} must be an integer, got {text!r}")
    value = int(text)
    if value < low:
        raise TraceError(f"{where}: {name} must be >= {low}, got {value}")
    return value


def load_trace(spec: str | Path, limit: int | None = None) -> list[Request]:
    """``"default"`` → the synthetic default (its first ``limit`` requests); else a CSV path."""
    if spec == "default":
        _check_limit(limit)
        return synthetic_default(DEFAULT_TRACE_LEN if limit is None else min(limit, DEFAULT_TRACE_LEN))
    path = Path(spec).expanduser()
    if not path.is_file():
        raise TraceError(f"trace {str(spec)!r} is neither 'default' nor an existing file ({path})")
    return load_azure_csv(path, limit)

"""Write a larger Azure-format trace: a trace repeated with jittered lengths and shifted times.

Each copy after the first starts where the previous one ended (plus the trace's mean
gap between requests), and every request's prompt and output lengths are scaled by a
seeded factor drawn uniformly from ``[1 - jitter, 1 + jitter]`` (at least 1 prompt
token, 0 output tokens stay 0). ``--output-scale`` multiplies output lengths too (a
chat-like trace with long answers from a code trace with short ones)::

    python tools/jitter_trace.py TRACE.csv /tmp/trace19k.csv --requests 19000
    python tools/jitter_trace.py TRACE.csv /tmp/conv19k.csv --requests 19000 --output-scale 8

Write the result outside the repository: traces are read from a path the user gives.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
from collections.abc import Sequence
from datetime import datetime

_FORMAT = "%Y-%m-%d %H:%M:%S.%f"


def jittered(rows: Sequence[tuple[datetime, int, int]], requests: int, jitter: float, output_scale: float,
             seed: int) -> list[tuple[datetime, int, int]]:
    """``requests`` rows of ``rows`` repeated in order, each copy shifted after the last."""
    if not rows:
        raise ValueError("the trace holds no requests")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    if output_scale <= 0:
        raise ValueError(f"output_scale must be > 0, got {output_scale}")
    rng = random.Random(seed)
    span = rows[-1][0] - rows[0][0]
    gap = span / max(len(rows) - 1, 1)
    out = []
    for i in range(requests):
        t, prompt, output = rows[i % len(rows)]
        shift = (span + gap) * (i // len(rows))
        p = max(1, round(prompt * rng.uniform(1 - jitter, 1 + jitter)))
        o = round(output * output_scale * rng.uniform(1 - jitter, 1 + jitter)) if output else 0
        out.append((t + shift, p, max(o, 1) if output else 0))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="an Azure-format CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    ap.add_argument("out", help="the CSV to write (outside the repository)")
    ap.add_argument("--requests", type=int, required=True, help="requests to write")
    ap.add_argument("--jitter", type=float, default=0.1, help="relative length jitter (default: 0.1)")
    ap.add_argument("--output-scale", type=float, default=1.0, help="output lengths multiplied by (default: 1)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = ap.parse_args(argv)
    with open(args.trace, newline="") as f:
        rows = [(datetime.strptime(r["TIMESTAMP"][:26], _FORMAT), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                for r in csv.DictReader(f)]
    try:
        out = jittered(rows, args.requests, args.jitter, args.output_scale, args.seed)
    except ValueError as exc:
        print(f"jitter_trace: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
        w.writerows((t.strftime(_FORMAT), p, o) for t, p, o in out)
    print(f"wrote {args.out}: {len(out)} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


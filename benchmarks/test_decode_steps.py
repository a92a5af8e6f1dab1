"""benchmarks/decode_steps.py runs (once, tiny): it must not rot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("decode_steps", Path(__file__).parent / "decode_steps.py")
assert _spec is not None and _spec.loader is not None
decode_steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_steps)


def test_every_mode_is_timed_per_batch_and_context(tmp_path):
    rows = decode_steps.main(["--model", "llama:layers=1,hidden=64,heads=2,kv_heads=1,vocab=64,intermediate=128",
                              "--batches", "1,2", "--contexts", "20", "--backend", "aot_eager", "--repeats", "1",
                              "--json", str(tmp_path / "d.json")])
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "mask"), (1, "varlen"), (1, "causal"),
                                                       (2, "mask"), (2, "varlen")]
    assert all(r["median_ms"] > 0 and r["estimate_mib"] > 0 for r in rows)
    assert rows[2]["key"] == "step/causal/t16c20/aot_eager"

"""benchmarks/device_check.py in its ``--dry-run`` form (CI has no GPU): it must not rot."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("device_check", Path(__file__).parent / "device_check.py")
assert _spec is not None and _spec.loader is not None
device_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(device_check)


def test_the_dry_run_names_what_each_check_would_measure(capsys, tmp_path):
    assert device_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"write {tmp_path / 'device_check.json'}" in out
    for name in device_check.CHECKS:
        assert f"- {name}: {device_check.MEASURES[name]}" in out
    for engine, *_ in device_check.ENGINES:  # every vLLM engine it would start, stock and attnpolicy's
        assert f"    {engine}: policy " in out
    assert "torch.cuda.max_memory_allocated" in out and "Dispatcher.attend on CUDA tensors" in out
    assert "warm set of 6 graphs, backend inductor, twice against one store" in out
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_the_dry_run_validates_its_configs_and_its_arguments(capsys):
    assert device_check.main(["--dry-run", "--only", "warm", "--backend", "aot_eager"]) == 0
    out = capsys.readouterr().out
    assert "- warm:" in out and "- tokens:" not in out and "backend aot_eager" in out
    with pytest.raises(SystemExit):
        device_check.main(["--dry-run", "--only", "tokens,nope"])
    assert "unknown checks ['nope']" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the real run is for it")
def test_without_a_gpu_a_real_run_says_so_and_measures_nothing(capsys, tmp_path):
    assert device_check.main(["--out", str(tmp_path / "out")]) == 2
    assert '"status": "unavailable", "reason": "no CUDA device' in capsys.readouterr().out
    assert not (tmp_path / "out").exists()

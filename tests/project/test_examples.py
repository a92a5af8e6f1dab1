"""The worked examples run in CI, their READMEs' commands as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from docs_blocks import ROOT, blocks

RUNNER = ROOT / "examples/static_runner"


def _commands() -> list[str]:
    return [line for block in blocks(RUNNER / "README.md", "bash") for line in block.splitlines() if line.strip()]


def _masked(line: str) -> str:
    """``line`` with its measured figures (seconds, errors) masked."""
    return re.sub(r"\d+\.\d+(e-\d+)?", "X", line)


def test_the_readme_has_commands():
    assert _commands()[0] == "python examples/static_runner/runner.py"


@pytest.mark.slow
@pytest.mark.parametrize("command", _commands())
def test_the_static_runner_readme_commands_run_as_written(command):
    argv = shlex.split(command)
    assert argv[0] == "python"  # the environment's: this test's interpreter
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[-1].startswith("outputs match the reference") and "compiles after warm-up: 0" in out[-2]
    if command == _commands()[0]:  # the README shows this one's output
        (shown,) = blocks(RUNNER / "README.md", "console")
        printed = {_masked(line) for line in out}
        for line in shown.splitlines():
            assert line == "..." or _masked(line) in printed, line

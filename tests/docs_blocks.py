"""The repository's root and the fenced code blocks of its Markdown files, for tests that
check docs against code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def blocks(path: Path, lang: str) -> list[str]:
    """The bodies of ``path``'s fenced code blocks in ``lang``."""
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), re.S)

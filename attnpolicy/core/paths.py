"""Directory paths a user names (a graph store's): checked before any file is touched."""

from __future__ import annotations

import os


def why_not_a_directory(path: str) -> str | None:
    """Why ``path`` cannot name a directory to keep files in, or ``None``: it is blank
    (which would be the current directory), holds a NUL byte, or starts with ``~user``
    of no known user. A leading ``~`` of a known user is expanded by whoever opens it."""
    if not path.strip():
        return "is blank: name a directory ('.' for the current one)"
    if "\0" in path:
        return "holds a NUL byte"
    if path.startswith("~") and os.path.expanduser(path).startswith("~"):
        return f"starts with {path.split(os.sep, 1)[0]!r}, the home of no known user"
    return None

"""JSON files: one atomic writer for every file attnpolicy writes, and reading
versioned pydantic models with errors that name the file, every bad field and its
value (config files and cost models share this)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from attnpolicy.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically (parents created): a temporary file in the
    same directory, fsynced, then ``os.replace``. A failed write (full disk, a file-size
    limit, an interrupt) leaves the previous file as it was and no temporary behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_json(path: str | os.PathLike[str], data: Any) -> Path:
    """``data`` as indented JSON, written atomically (see :func:`write_text_atomic`).
    Pydantic models and dataclasses are written through their JSON form."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def read_text(file: Path, what: str) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} file {file} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {what} file {file}: {exc}") from None


def parse(cls: type[M], text: str, source: str, what: str, version: int) -> M:
    """``text`` as a ``cls``: JSON object, supported ``version``, every field valid;
    else :class:`ConfigError` naming ``source`` and listing each problem."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: invalid JSON at line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}") from None
    return validate(cls, data, source, what, version)


def validate(cls: type[M], data: object, source: str, what: str, version: int) -> M:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
    got = data.get("version", version)
    if got != version:
        raise ConfigError(f"{source}: unsupported {what} version {got!r} (this attnpolicy reads "
                          f"version {version})")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        lines = "\n".join(f"  - {describe(e)}" for e in errors)
        raise ConfigError(f"{source}: invalid {what} ({len(errors)} error{'s' if len(errors) > 1 else ''}):"
                          f"\n{lines}") from None


def describe(error: Any) -> str:
    """One pydantic error as ``field.path: message (got value)``."""
    loc = ".".join(str(part) for part in error["loc"])
    msg = str(error["msg"]).removeprefix("Value error, ")
    if not loc:
        return msg
    value = repr(error["input"])
    return f"{loc}: {msg} (got {value if len(value) <= 80 else value[:77] + '...'})"

"""JSON files: one atomic writer for every file attnpolicy writes, strict JSON only
(no ``NaN`` or ``Infinity``), and reading versioned pydantic models with errors that
name the file, every bad field and its value (config files and cost models share this)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from attnpolicy.errors import ConfigError, NonFiniteError

M = TypeVar("M", bound=BaseModel)
#: The key of the pydantic validation context that :func:`validate` gives a strict
#: reading (its value: the file's name), for the rules of a file that code may break.
FILE_CONTEXT = "file"


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
    """``data`` as indented strict JSON (:func:`dumps`), written atomically (see
    :func:`write_text_atomic`); a NaN or infinite number writes nothing."""
    return write_text_atomic(path, dumps(data, str(path), indent=2) + "\n")


def dumps(data: Any, where: str, **kwargs: Any) -> str:
    """``data`` as strict JSON (``kwargs``: :func:`json.dumps`'s); pydantic models and
    dataclasses go as their JSON form, anything else unknown as its ``str``. A NaN or
    infinite number raises :class:`NonFiniteError` naming ``where`` and its path."""
    kwargs.setdefault("default", _json_default)
    try:
        return json.dumps(data, allow_nan=False, **kwargs)
    except ValueError:
        found = _non_finite(data, "")
        if found is None:
            raise
        raise NonFiniteError(f"{where}: not written: {found[0] or 'the value'} is {found[1]!r}, and strict JSON "
                             "holds finite numbers only") from None


def _non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """The path and value of the first NaN or infinite number in ``value``, or ``None``."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, dict):
        items: Any = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, BaseModel) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        items = [(path, _json_default(value))]
    else:
        return None
    return next(filter(None, (_non_finite(v, p) for p, v in items)), None)


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


def parse(cls: type[M], text: str, source: str, what: str, version: int, *, strict: bool = False) -> M:
    """``text`` as a ``cls``: JSON object, supported ``version``, every field valid
    (``strict``: see :func:`validate`); else :class:`ConfigError` naming ``source``
    and listing each problem."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: invalid JSON at line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}") from None
    return validate(cls, data, source, what, version, strict=strict)


def validate(cls: type[M], data: object, source: str, what: str, version: int, *, strict: bool = False) -> M:
    """``data`` (a parsed JSON object) as a ``cls``, as :func:`parse`. ``strict``:
    validated as JSON in pydantic's strict mode, so that no value is coerced (``true``
    or ``"0.1"`` for a number: an error), with the context :data:`FILE_CONTEXT`; else
    in lax Python mode."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
    got = data.get("version", version)
    if got != version or isinstance(got, bool):
        raise ConfigError(f"{source}: unsupported {what} version {got!r} (this attnpolicy reads "
                          f"version {version})")
    try:
        if strict:
            return cls.model_validate_json(json.dumps(data), strict=True, context={FILE_CONTEXT: source})
        return cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        lines = "\n".join(f"  - {describe(e)}" for e in errors)
        raise ConfigError(f"{source}: invalid {what} ({len(errors)} error{'s' if len(errors) > 1 else ''}):"
                          f"\n{lines}") from None


def describe(error: Any) -> str:
    """One pydantic error as ``field.path: message (got value)`` (an object or a list
    not echoed: the message says what is wrong in it)."""
    loc = ".".join(str(part) for part in error["loc"])
    msg = str(error["msg"]).removeprefix("Value error, ")
    if not loc or isinstance(error["input"], (dict, list)):
        return f"{loc}: {msg}" if loc else msg
    value = repr(error["input"])
    return f"{loc}: {msg} (got {value if len(value) <= 80 else value[:77] + '...'})"

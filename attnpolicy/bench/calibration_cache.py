"""The calibration cache: cost models calibrated on this machine, kept per machine,
backend and grid so that a later command reuses them instead of calibrating again.

The cache lives in ``$ATTNPOLICY_CACHE_DIR`` (default ``$XDG_CACHE_HOME/attnpolicy``,
else ``~/.cache/attnpolicy``), as torch keeps its own caches. An entry is two files
under ``costmodels/``: ``<hash>.json``, a plain cost model (``--cost-model`` takes
it), and ``<hash>.key.json``, what the fit depends on (:func:`cache_key`: torch's
version, the CPU model and core count, the calibration code's identity and the
calibration settings, backend and grid included) and when it was made. ``<hash>`` is
the key's digest, so a change to any of them misses. Both files are written
atomically, the model first; a file that cannot be read or parsed is ignored, and
said once through the caller's ``warn``.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter

from attnpolicy.bench.settings import CalibrationSettings
from attnpolicy.core import jsonfile
from attnpolicy.core.code_identity import graph_code
from attnpolicy.core.version import __version__
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.modelling.cost_file import CostFile

#: The environment variable naming the cache directory.
CACHE_ENV = "ATTNPOLICY_CACHE_DIR"
_SUBDIR = "costmodels"
_KEY_SUFFIX = ".key.json"


def cache_dir() -> Path:
    """The directory of the calibration cache (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "attnpolicy"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str:
    """The installed torch's version, read from its distribution's metadata (the same
    string as ``torch.__version__``) without importing torch."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # torch built in place: ask it
        import torch

        return str(torch.__version__)


def machine() -> dict[str, Any]:
    """What a calibration's seconds depend on besides its settings: torch, the device
    (calibration runs on the CPU), its model and core count."""
    return {"torch": torch_version(), "device": "cpu", "cpu": cpu_model(), "cores": os.cpu_count()}


@cache
def calibration_code() -> str:
    """The identity of the code a calibration runs: attnpolicy's version, the graph
    layers' sources (:func:`~attnpolicy.core.code_identity.graph_code`) and the
    calibration modules' own (what it runs and its settings), read as files: looking a
    calibration up imports neither them nor torch."""
    here = Path(__file__).parent
    source = b"".join((here / name).read_bytes() for name in ("calibration.py", "settings.py"))
    return hashlib.sha256(f"{__version__}\0{graph_code()}\0".encode() + source).hexdigest()[:16]


def cache_key(s: CalibrationSettings) -> dict[str, Any]:
    """The key of a calibration with settings ``s`` on this machine."""
    settings = TypeAdapter(CalibrationSettings).dump_python(s, mode="json")
    return {"machine": machine(), "code": calibration_code(), "settings": settings}


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Cached:
    """One cache entry: the model, its file and when it was calibrated (UTC)."""

    model: CostModel
    path: Path
    created: str
    settings: dict[str, Any]


def entry_path(s: CalibrationSettings) -> Path:
    """The cost model file of the cache entry of settings ``s`` on this machine (it may not exist)."""
    return cache_dir() / _SUBDIR / f"{_digest(cache_key(s))}.json"


def store(s: CalibrationSettings, model: CostModel) -> Cached:
    """Keep ``model``, calibrated with ``s`` on this machine, in the cache (the model's
    file, then its key file, each atomically); returns its entry. ``OSError`` when
    the cache cannot be written."""
    key = cache_key(s)
    path = entry_path(s)
    created = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    model.save(path)
    jsonfile.write_json(path.with_name(path.stem + _KEY_SUFFIX), {"key": key, "created": created})
    return Cached(model, path, created, key["settings"])


def lookup(s: CalibrationSettings, warn: Callable[[str], None]) -> Cached | None:
    """The cached calibration with settings ``s`` on this machine, or ``None``."""
    key = cache_key(s)
    path = entry_path(s)
    file = path.with_name(path.stem + _KEY_SUFFIX)
    if not file.exists():
        return None
    entry = _read(file, warn)
    if entry is None or entry[0] != key:
        return None
    return _entry(file, entry[1], key["settings"], warn)


def find(backend: str, impl: str, warn: Callable[[str], None]) -> Cached | None:
    """The newest cached calibration on this machine (torch, CPU, calibration code)
    with ``backend`` and ``impl``, or ``None``."""
    here, code = machine(), calibration_code()
    best: Cached | None = None
    for file in _key_files():
        entry = _read(file, warn)
        if entry is None:
            continue
        key, created = entry
        settings = key.get("settings", {})
        if (key.get("machine") != here or key.get("code") != code or settings.get("backend") != backend
                or settings.get("impl") != impl or (best is not None and created <= best.created)):
            continue
        found = _entry(file, created, settings, warn)
        best = found or best
    return best


def _key_files() -> Iterator[Path]:
    root = cache_dir() / _SUBDIR
    try:
        yield from sorted(root.glob(f"*{_KEY_SUFFIX}"))
    except OSError:
        return


def _read(file: Path, warn: Callable[[str], None]) -> tuple[dict[str, Any], str] | None:
    """A key file's key and date, or ``None`` (said through ``warn``) when it cannot be read."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        key, created = data["key"], data["created"]
        if not isinstance(key, dict) or not isinstance(created, str):
            raise ValueError("no key object and created date")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warn(f"ignoring the unreadable calibration cache file {file}: {exc}")
        return None
    return key, created


def _entry(key_file: Path, created: str, settings: dict[str, Any], warn: Callable[[str], None]) -> Cached | None:
    path = key_file.with_name(key_file.name.removesuffix(_KEY_SUFFIX) + ".json")
    try:
        model = CostModel.load(path)
    except ConfigError as exc:
        warn(f"ignoring the unreadable calibration cache file {path}: {exc}")
        return None
    return Cached(model, path, created, settings)


@dataclass(frozen=True)
class Provenance:
    """Which cost model prices a run: ``calibrated`` (on this machine, ``file`` in the
    cache, ``created`` then), ``file`` (given by the user) or ``built-in``."""

    kind: Literal["calibrated", "file", "built-in"]
    file: str | None = None
    created: str | None = None

    def line(self) -> str:
        """The first line of a command that prices with this model."""
        if self.kind == "calibrated":
            return f"cost model: calibrated here {self.created}, {self.file}"
        if self.kind == "file":
            return f"cost model: {self.file} (--cost-model)"
        return ("cost model: built-in (not calibrated on this machine; run `attnpolicy calibrate` or "
                "`attnpolicy report` first; built-in vs this machine: not compared, its seconds may be far off)")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "file": self.file, "created": self.created}


def resolve(given: str | None, backend: str, impl: str, warn: Callable[[str], None]
            ) -> tuple[CostModel, Provenance]:
    """The attention fits of a run: those of the cost-model file ``given`` (a problem,
    or a file without them, raises :class:`ConfigError`),
    else the newest cached calibration for ``backend`` and ``impl`` (:func:`find`),
    else the built-in model."""
    if given is not None:
        return CostFile.load(given).attention_fits(given), Provenance("file", given)
    found = find(backend, impl, warn)
    if found is not None:
        return found.model, Provenance("calibrated", str(found.path), found.created)
    return CostModel.default(), Provenance("built-in")

"""DiskStore: compiled-graph artifacts on disk, bounded by bytes, shared by processes.

One store directory holds torch's own artifact files (whatever a mechanism writes:
the bytes of ``save_compiled_function``, a ``.pt2`` package), each beside a JSON
manifest with its full :class:`ArtifactIdentity`, size and SHA-256. Layout, what
invalidates an artifact and how processes share a store: ``docs/store.md``.

Nothing here compiles or imports torch's compiler: a caller passes a writer
(``path -> None``) to :meth:`DiskStore.save` and a reader (``path -> graph``) to
:meth:`DiskStore.load`; a ``None`` from ``load`` means "compile it".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import inspect
import json
import logging
import os
import platform
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, TypeVar

from attnpolicy.errors import ConfigError
from attnpolicy.graphs.keys import GraphKey

log = logging.getLogger("attnpolicy.cache.disk_store")

T = TypeVar("T")

FORMAT = 1  # of the manifest and the layout; part of every identity
#: store directories this process has warned about an oversize artifact in
_OVERSIZE_WARNED: set[Path] = set()
_OVERSIZE_LOCK = threading.Lock()
_MANIFEST = ".json"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@dataclass(frozen=True, slots=True)
class ArtifactIdentity:
    """Everything that makes an artifact valid; equal identities may share one artifact.

    ``key`` is the graph's stable name (``repr(GraphKey)`` for attention graphs: every
    field, the scale to full precision; the model runner's own for model graphs);
    ``code_hash`` a hash of the model or kernel code (:func:`source_hash`); ``config``
    the compiler settings that change the generated code. ``torch_version``, ``python`` and ``machine`` default to this
    process's.
    """

    key: str
    mechanism: str
    backend: str
    device: str
    dtype: str
    code_hash: str
    config: tuple[tuple[str, str], ...] = ()
    torch_version: str = field(default_factory=_torch_version)
    python: str = f"{sys.version_info.major}.{sys.version_info.minor}"
    machine: str = platform.machine()
    format: int = FORMAT

    @classmethod
    def for_graph(cls, key: GraphKey, *, mechanism: str, code_hash: str,
                  config: Mapping[str, object] | None = None) -> ArtifactIdentity:
        """The identity of an attention graph's artifact (backend, device, dtype from ``key``)."""
        return cls(repr(key), mechanism, key.backend, key.spec.device, key.spec.dtype, code_hash,
                   _config_items(config))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = [list(item) for item in self.config]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ArtifactIdentity:
        fields = dict(data)
        fields["config"] = tuple(tuple(item) for item in fields.get("config", ()))
        return cls(**fields)

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical JSON of every field: the artifact's file name."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _config_items(config: Mapping[str, object] | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), repr(v)) for k, v in (config or {}).items()))


def source_hash(*parts: object) -> str:
    """SHA-256 (hex, 16 digits) of strings, bytes, and the source of functions, classes
    or modules: a ``code_hash`` that changes when the kernel or model code does."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, bytes):
            data = part
        elif isinstance(part, str):
            data = part.encode()
        else:
            try:
                data = inspect.getsource(part).encode()  # type: ignore[arg-type]
            except (OSError, TypeError) as e:
                raise ConfigError(f"code_hash part {part!r} has no source to hash: {e}") from e
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of a :class:`DiskStore`: this process's counters, and the figures on
    disk (``entries``, ``bytes``) counted when the snapshot is taken."""

    hits: int  # loads served from disk
    misses: int  # no valid artifact: the caller compiles
    load_seconds: float  # reading, verifying and the reader's load, over hits
    saves: int
    save_seconds: float
    evictions: int  # artifacts this process removed to stay under max_bytes
    corrupt: int  # truncated, byte-flipped or unreadable artifacts or manifests
    stale: int  # a manifest whose identity differs from the one asked for
    load_failures: int  # the reader raised on a verified artifact
    write_failures: int  # a save that could not write (read-only, full, missing directory)
    oversize: int  # an artifact larger than max_bytes alone: not stored
    entries: int
    bytes: int
    max_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Entry:
    digest: str
    bytes: int
    used: int


class DiskStore:
    """Artifacts by :class:`ArtifactIdentity` under ``root``, at most ``max_bytes`` in all.

    ``root/objects/<digest><suffix>`` is torch's file, ``root/objects/<digest>.json``
    its manifest; ``root/index.json`` records each artifact's last use (a logical
    clock) for least-recently-used eviction; ``root/lock`` is taken with
    ``fcntl.flock`` (shared to read, exclusive to write or evict), so no process reads
    a half-written artifact; ``root/tmp`` holds writes in flight (same filesystem, so
    ``os.replace`` is atomic). The bound counts every file under ``objects/``.

    A store that cannot be written (read-only, full, no directory) degrades: saves
    return False, are counted in ``write_failures`` and warn once; loads of what is
    there still work.
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError(f"max_disk_bytes must be a positive integer, got {max_bytes!r}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._index = self.root / "index.json"
        self._mutex = threading.Lock()
        self._warned = False
        self._counts = dict.fromkeys(("hits", "misses", "saves", "evictions", "corrupt", "stale",
                                      "load_failures", "write_failures", "oversize"), 0)
        self._seconds = {"load": 0.0, "save": 0.0}
        with contextlib.suppress(OSError):  # a read-only store is still readable
            self._objects.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(exist_ok=True)

    def __repr__(self) -> str:
        return f"DiskStore({str(self.root)!r}, max_bytes={self.max_bytes})"

    # --- locking and the index ------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """The store-wide flock (one file description per use, so threads exclude each
        other too). Without a lock file in a store that cannot create one, nobody can
        write there either: reads go ahead unlocked."""
        path = self.root / "lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                if exclusive:
                    raise
                yield
                return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read_index(self) -> dict[str, Any]:
        try:
            data = json.loads(self._index.read_text())
            if isinstance(data, dict) and isinstance(data.get("used"), dict):
                return data
        except (OSError, ValueError):
            pass
        return {"clock": 0, "used": {}}  # missing or unreadable: ages restart, files are the truth

    def _write_index(self, index: dict[str, Any]) -> None:
        self._replace_bytes(self._index, json.dumps(index, sort_keys=True).encode())

    def _replace_bytes(self, path: Path, data: bytes) -> None:
        tmp = self._tmp / f"{path.name}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def _touch(self, index: dict[str, Any], digest: str) -> None:
        index["clock"] = int(index.get("clock", 0)) + 1
        index["used"][digest] = index["clock"]

    def _scan(self, index: dict[str, Any]) -> dict[str, _Entry]:
        """Every artifact on disk (manifest and file sizes summed), by digest."""
        entries: dict[str, _Entry] = {}
        try:
            names = os.listdir(self._objects)
        except OSError:
            return entries
        for name in names:
            digest = name.split(".", 1)[0]
            try:
                size = (self._objects / name).stat().st_size
            except OSError:
                continue
            entry = entries.setdefault(digest, _Entry(digest, 0, int(index["used"].get(digest, 0))))
            entry.bytes += size
        return entries

    def _remove(self, digest: str) -> None:
        for path in self._objects.glob(f"{digest}.*"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # --- load -----------------------------------------------------------------------

    def _paths(self, digest: str, suffix: str) -> tuple[Path, Path]:
        return self._objects / f"{digest}{suffix}", self._objects / f"{digest}{_MANIFEST}"

    def _verify(self, ident: ArtifactIdentity, manifest_path: Path) -> tuple[str, Path | None, str]:
        """("ok" | "missing" | "corrupt" | "stale", artifact path, manifest sha)."""
        try:
            raw = manifest_path.read_bytes()
        except OSError:  # none, or a store that cannot be read: compile
            return "missing", None, ""
        msha = hashlib.sha256(raw).hexdigest()
        try:
            manifest = json.loads(raw)
            found = ArtifactIdentity.from_json(manifest["identity"])
            suffix, size, sha = str(manifest["suffix"]), int(manifest["bytes"]), str(manifest["sha256"])
        except (ValueError, KeyError, TypeError):
            return "corrupt", None, msha
        if found != ident:
            return "stale", None, msha
        path = self._objects / f"{ident.digest()}{suffix}"
        try:
            data = path.read_bytes()
        except OSError:
            return "corrupt", None, msha
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            return "corrupt", None, msha
        return "ok", path, msha

    def load(self, ident: ArtifactIdentity, reader: Callable[[Path], T]) -> T | None:
        """``reader(path)`` of the verified artifact of ``ident``, or None (a miss: the
        caller compiles, then saves).

        The manifest's identity must equal ``ident`` and the file its recorded size and
        SHA-256; a corrupt or stale artifact, or one the reader fails on, is counted,
        removed and reported as a miss, so it is never used as a graph. The reader runs
        under the shared lock: no writer replaces or evicts the file meanwhile.
        """
        digest = ident.digest()
        manifest_path = self._objects / f"{digest}{_MANIFEST}"
        t0 = perf_counter()
        failure: Exception | None = None
        with self._locked(exclusive=False):
            status, path, msha = self._verify(ident, manifest_path)
            if path is not None:
                try:
                    graph = reader(path)
                except Exception as e:
                    failure, status = e, "load_failures"
        seconds = perf_counter() - t0
        if status == "ok":
            self._count("hits", load=seconds)
            self._record_use(digest)
            return graph
        if failure is not None:
            log.warning("the artifact of %s at %s failed to load (%s: %s); compiling it instead",
                        ident.key, path, type(failure).__name__, failure)
        if status != "missing":
            self._count(status)
            self._discard(digest, manifest_path, msha)
        self._count("misses")
        return None

    def _record_use(self, digest: str) -> None:
        with contextlib.suppress(OSError), self._locked(exclusive=True):
            index = self._read_index()
            self._touch(index, digest)
            self._write_index(index)

    def _discard(self, digest: str, manifest_path: Path, msha: str) -> None:
        """Remove a bad artifact unless another process replaced it since it was read."""
        with contextlib.suppress(OSError), self._locked(exclusive=True):
            try:
                if hashlib.sha256(manifest_path.read_bytes()).hexdigest() != msha:
                    return
            except FileNotFoundError:
                pass
            self._remove(digest)

    def holds(self, ident: ArtifactIdentity) -> bool:
        """Whether an artifact of ``ident`` is on disk now (its manifest is there; not
        verified, nothing counted): what the ``cost`` eviction asks before it chooses."""
        return (self._objects / f"{ident.digest()}{_MANIFEST}").exists()

    # --- save -----------------------------------------------------------------------

    def save(self, ident: ArtifactIdentity, writer: Callable[[Path], None], suffix: str = ".bin") -> bool:
        """Store the artifact ``writer(path)`` writes (torch's own file, named with
        ``suffix``), evicting least-recently-used artifacts to stay within ``max_bytes``.

        Returns whether it was stored. A write that fails with an ``OSError``
        (read-only or full store) is counted and warned about once; an artifact larger
        than ``max_bytes`` is counted in ``oversize``. Any other exception of the writer
        propagates. Two processes saving one identity at once store one of the two
        whole artifacts.
        """
        if not suffix.startswith(".") or suffix == _MANIFEST or "/" in suffix:
            raise ConfigError(f"suffix must start with '.' and not be {_MANIFEST!r}, got {suffix!r}")
        digest = ident.digest()
        t0 = perf_counter()
        tmp = self._tmp / f"{digest}.{os.getpid()}.{threading.get_ident()}{suffix}"
        try:
            with self._locked(exclusive=True):
                try:
                    writer(tmp)
                    data = tmp.read_bytes()
                    stored = self._commit(ident, digest, tmp, data, suffix)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        tmp.unlink()
        except OSError as e:
            self._count("write_failures")
            self._warn_once(e)
            return False
        if stored:
            self._count("saves", save=perf_counter() - t0)
        return stored

    def _commit(self, ident: ArtifactIdentity, digest: str, tmp: Path, data: bytes, suffix: str) -> bool:
        """Under the exclusive lock: evict, then move the artifact and its manifest in."""
        manifest = json.dumps({"identity": ident.to_json(), "suffix": suffix, "bytes": len(data),
                               "sha256": hashlib.sha256(data).hexdigest()}, sort_keys=True).encode()
        need = len(data) + len(manifest)
        if need > self.max_bytes:
            self._count("oversize")
            self._warn_oversize(ident, need)
            return False
        for leftover in self._tmp.iterdir():  # a crashed writer's (writes happen under this lock)
            if leftover != tmp:
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
        index = self._read_index()
        entries = self._scan(index)
        entries.pop(digest, None)
        self._remove(digest)  # the old artifact of this identity, whatever its suffix
        total = sum(e.bytes for e in entries.values())
        for victim in sorted(entries.values(), key=lambda e: (e.used, e.digest)):
            if total + need <= self.max_bytes:
                break
            self._remove(victim.digest)
            index["used"].pop(victim.digest, None)
            total -= victim.bytes
            self._count("evictions")
        path, manifest_path = self._paths(digest, suffix)
        os.replace(tmp, path)
        self._replace_bytes(manifest_path, manifest)  # last: a manifest means a whole artifact
        for gone in set(index["used"]) - set(entries) - {digest}:
            del index["used"][gone]
        self._touch(index, digest)
        self._write_index(index)
        return True

    def _warn_oversize(self, ident: ArtifactIdentity, need: int) -> None:
        """One warning per store directory and process, the key shortened; each one
        logged in full at DEBUG and counted in ``oversize``."""
        log.debug("the artifact of %s (%d bytes) is larger than max_disk_bytes=%d; not stored", ident.key, need,
                  self.max_bytes)
        with _OVERSIZE_LOCK:
            first = self.root not in _OVERSIZE_WARNED
            _OVERSIZE_WARNED.add(self.root)
        if first:
            key = ident.key if len(ident.key) <= 64 else f"{ident.key[:63]}…"
            log.warning("graph store %s: the artifact of %s (%d bytes) is larger than max_disk_bytes=%d; not stored "
                        "(further oversize artifacts are counted in stats().disk.oversize, not warned about)",
                        self.root, key, need, self.max_bytes)

    def _warn_once(self, error: OSError) -> None:
        why = {errno.EROFS: "read-only", errno.ENOSPC: "full", errno.EDQUOT: "over quota",
               errno.EACCES: "not writable", errno.EPERM: "not writable"}.get(error.errno or 0, "unusable")
        with self._mutex:
            first, self._warned = not self._warned, True
        if first:
            warnings.warn(f"graph store {self.root} is {why} ({error}); graphs are compiled and not "
                          "stored (further failures are counted in write_failures, not warned about)",
                          RuntimeWarning, stacklevel=3)

    # --- stats ----------------------------------------------------------------------

    def _count(self, name: str, *, load: float = 0.0, save: float = 0.0) -> None:
        with self._mutex:
            self._counts[name] += 1
            self._seconds["load"] += load
            self._seconds["save"] += save

    def stats(self) -> StoreStats:
        """This process's counters and the store's entries and bytes as on disk now."""
        with self._locked(exclusive=False):
            entries = self._scan({"used": {}})
        with self._mutex:
            counts, seconds = dict(self._counts), dict(self._seconds)
        return StoreStats(**counts, load_seconds=seconds["load"], save_seconds=seconds["save"],
                          entries=len(entries), bytes=sum(e.bytes for e in entries.values()),
                          max_bytes=self.max_bytes)

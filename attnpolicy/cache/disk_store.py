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
import re
import stat
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, Protocol, TypeVar

from attnpolicy.core.bounded_order import BoundedOrder
from attnpolicy.core.paths import why_not_a_directory
from attnpolicy.errors import ConfigError

log = logging.getLogger("attnpolicy.cache.disk_store")

T = TypeVar("T")

FORMAT = 1  # of the manifest and the layout; part of every identity
#: store directories this process has warned about an oversize artifact in
_OVERSIZE_WARNED: set[Path] = set()
_OVERSIZE_LOCK = threading.Lock()
_MANIFEST = ".json"
#: The only names the store writes, and so the only ones it ever removes: in objects/
#: ``<digest><suffix>``, in tmp/ ``<digest or "index">.<pid>.<thread><suffix>``.
_OBJECT = re.compile(r"([0-9a-f]{64})\..+", re.DOTALL)
_TMP = re.compile(r"(?:[0-9a-f]{64}|index)\.[0-9]+\.[0-9]+\..+", re.DOTALL)
#: How the store's own index.json starts (json.dumps with sorted keys): another file
#: there is not the store's and is never replaced.
_INDEX_HEAD = b'{"clock": '
#: Why a load found no valid artifact, by status (warned about; "missing" is a plain miss).
_BAD = {"corrupt": "corrupt (truncated, altered or unreadable: its manifest's size or SHA-256 does not match)",
        "stale": "stale (its manifest names another identity)"}
#: What parsing a tampered JSON file can raise (nesting, Infinity, wrong types).
_BAD_JSON = (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError)


class _Spec(Protocol):
    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> str: ...


class GraphName(Protocol):
    """What :meth:`ArtifactIdentity.for_graph` reads of an attention graph's key (a
    ``GraphKey``): its ``repr`` (every field), its backend and its tensor spec."""

    @property
    def backend(self) -> str: ...
    @property
    def spec(self) -> _Spec: ...


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@dataclass(frozen=True, slots=True)
class ArtifactIdentity:
    """Everything that makes an artifact valid; equal identities may share one artifact.

    ``key`` is the graph's stable name (``repr(GraphKey)`` for attention graphs: every
    field, the scale to full precision; the model runner's own for model graphs);
    ``code_hash`` a hash of all the code the graph runs (:mod:`~attnpolicy.core.code_identity`,
    or :func:`source_hash` of a graph's own sources); ``config``
    the settings that change the generated code; ``compiler`` the compiler's identity
    (:func:`~attnpolicy.plugins.compilers.compiler_identity`: its name, version, code and
    options; ``backend`` is its name). ``torch_version``, ``python`` and ``machine``
    default to this process's.
    """

    key: str
    mechanism: str
    backend: str
    device: str
    dtype: str
    code_hash: str
    config: tuple[tuple[str, str], ...] = ()
    compiler: str = ""
    torch_version: str = field(default_factory=_torch_version)
    python: str = f"{sys.version_info.major}.{sys.version_info.minor}"
    machine: str = platform.machine()
    format: int = FORMAT

    @classmethod
    def for_graph(cls, key: GraphName, *, mechanism: str, code_hash: str,
                  config: Mapping[str, object] | None = None, compiler: str = "") -> ArtifactIdentity:
        """The identity of an attention graph's artifact (backend, device, dtype from ``key``)."""
        return cls(repr(key), mechanism, key.backend, key.spec.device, key.spec.dtype, code_hash,
                   _config_items(config), compiler)

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
    corrupt: int  # truncated, byte-flipped or unreadable artifacts, manifests or index
    stale: int  # a manifest whose identity differs from the one asked for
    load_failures: int  # the reader raised on a verified artifact
    write_failures: int  # a save that could not write (read-only, full, missing directory)
    oversize: int  # an artifact larger than max_bytes alone: not stored
    index_failures: int  # index.json not written (full, read-only, not the store's): recency lost
    unidentified: int  # graphs compiled, not stored: their code has no stable identity
    unstorable: int  # graphs compiled, not stored: their compiler declares no reloadable artifacts
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
    names: list[str] = field(default_factory=list)  # its files in objects/


def _short(key: str) -> str:
    """An artifact's key for a warning: its first 64 characters."""
    return key if len(key) <= 64 else f"{key[:63]}…"


def _read(path: Path) -> bytes:
    """The bytes of the regular file ``path``, never through a link (``OSError`` for a
    link, a directory or anything else)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EISDIR, "not a regular file", str(path))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def _own_dir(path: Path) -> None:
    """Raise ``OSError`` unless ``path`` is a directory itself, not a link to one."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise OSError(errno.ELOOP, "a symbolic link, not the store's own directory", str(path))
    if not stat.S_ISDIR(mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))


def _valid_suffix(suffix: object) -> bool:
    return (isinstance(suffix, str) and suffix.startswith(".") and suffix != _MANIFEST
            and "/" not in suffix and "\0" not in suffix)


def _fresh_index() -> dict[str, Any]:
    return {"clock": 0, "used": {}}


def _valid_index(data: object) -> bool:
    def count(n: object) -> bool:
        return type(n) is int and n >= 0
    return (isinstance(data, dict) and set(data) == {"clock", "used"} and count(data["clock"])
            and isinstance(data["used"], dict) and all(count(n) for n in data["used"].values()))


class DiskStore:
    """Artifacts by :class:`ArtifactIdentity` under ``root``, at most ``max_bytes`` in all.

    ``root/objects/<digest><suffix>`` is torch's file, ``root/objects/<digest>.json``
    its manifest; ``root/index.json`` records each artifact's last use (a logical
    clock) for least-recently-used eviction; ``root/lock`` is taken with
    ``fcntl.flock`` (shared to read, exclusive to write or evict), so no process reads
    a half-written artifact; ``root/tmp`` holds writes in flight (same filesystem, so
    ``os.replace`` is atomic). The bound counts the store's files under ``objects/``.

    The store only ever removes or replaces files of its own names in its own
    directories, never through a link: whatever else lies there (a user's files, stray
    directories, links) is left alone and ignored. A store that cannot be written
    (read-only, full, no directory, ``objects/`` or ``tmp/`` a link) degrades: saves
    return False, are counted in ``write_failures`` and warn once; loads of what is
    there still work. Unreadable metadata is a counted miss, never an exception.
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError(f"max_disk_bytes must be a positive integer, got {max_bytes!r}")
        path = os.fspath(root)
        why = why_not_a_directory(path) if isinstance(path, str) else "is not a str"
        if why is not None:
            raise ConfigError(f"store_dir {path!r} {why}")
        self.root = Path(os.path.expanduser(path))
        self.max_bytes = max_bytes
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._index = self.root / "index.json"
        self._mutex = threading.Lock()
        self._warned = False
        self._refused: set[str] = set()
        self._counts = dict.fromkeys(("hits", "misses", "saves", "evictions", "corrupt", "stale", "load_failures",
                                      "write_failures", "oversize", "index_failures", "unidentified",
                                      "unstorable"), 0)
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
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
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

    def _read_index(self) -> tuple[dict[str, Any], bool]:
        """The index and whether it is the store's to replace. Missing: a fresh one.
        Unreadable or malformed: a fresh one, counted corrupt (ages restart, the files
        are the truth). Not the store's (a directory, a link, another file): a fresh one
        that is never written over it."""
        try:
            raw = _read(self._index)
        except FileNotFoundError:
            return _fresh_index(), True
        except OSError:
            return _fresh_index(), False
        if not raw.startswith(_INDEX_HEAD):
            return _fresh_index(), False
        try:
            data = json.loads(raw)
        except _BAD_JSON:
            data = None
        if not _valid_index(data):
            self._count("corrupt")
            return _fresh_index(), True
        return data, True

    def _write_index(self, index: dict[str, Any], ours: bool) -> None:
        """Write the index after a load or a committed save. A failure is counted in
        ``index_failures`` (warned once): every artifact stays whole and valid, only
        the recency eviction goes by is lost (the index is rebuilt from the files)."""
        try:
            if not ours:
                raise FileExistsError(errno.EEXIST, "another file, left as it is", str(self._index))
            self._replace_bytes(self._index, json.dumps(index, sort_keys=True, allow_nan=False).encode())
        except OSError as e:
            self._count("index_failures")
            self._warn_once(e, "its index.json is not written: stored graphs stay valid, least-recently-used "
                               "order restarts (further failures are counted in index_failures)")

    def _tmp_path(self, stem: str, suffix: str) -> Path:
        return self._tmp / f"{stem}.{os.getpid()}.{threading.get_ident()}{suffix}"

    def _replace_bytes(self, path: Path, data: bytes) -> None:
        tmp = self._tmp_path(path.name.removesuffix(_MANIFEST), _MANIFEST)
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _touch(self, index: dict[str, Any], digest: str) -> None:
        index["clock"] += 1
        index["used"][digest] = index["clock"]

    def _scan(self, used: Mapping[str, int]) -> dict[str, _Entry]:
        """Every artifact on disk (the sizes of its regular files of the store's names
        summed), by digest; anything else under objects/ is ignored."""
        entries: dict[str, _Entry] = {}
        try:
            _own_dir(self._objects)
            with os.scandir(self._objects) as found:
                for item in found:
                    match = _OBJECT.fullmatch(item.name)
                    if match is None:
                        continue
                    try:
                        st = item.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        digest = match.group(1)
                        entry = entries.setdefault(digest, _Entry(digest, 0, used.get(digest, 0)))
                        entry.bytes += st.st_size
                        entry.names.append(item.name)
        except OSError:
            pass  # no objects/ (yet), or not the store's own: nothing stored there
        return entries

    def _remove(self, entry: _Entry | None) -> None:
        for name in entry.names if entry is not None else ():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._objects / name)  # unlink never follows a link

    def _sweep_tmp(self, keep: Path) -> None:
        """Remove a crashed writer's files from tmp/ (writes happen under the exclusive
        lock): regular files of the store's own names only."""
        with os.scandir(self._tmp) as found:
            for item in found:
                if (item.name != keep.name and _TMP.fullmatch(item.name) is not None
                        and item.is_file(follow_symlinks=False)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._tmp / item.name)

    # --- load -----------------------------------------------------------------------

    def _paths(self, digest: str, suffix: str) -> tuple[Path, Path]:
        return self._objects / f"{digest}{suffix}", self._objects / f"{digest}{_MANIFEST}"

    def _verify(self, ident: ArtifactIdentity, manifest_path: Path) -> tuple[str, Path | None, str]:
        """("ok" | "missing" | "corrupt" | "stale", artifact path, manifest sha)."""
        try:
            _own_dir(self._objects)
            raw = _read(manifest_path)
        except OSError:  # none, not a file, or a store that cannot be read: compile
            return "missing", None, ""
        msha = hashlib.sha256(raw).hexdigest()
        try:
            manifest = json.loads(raw)
            found = ArtifactIdentity.from_json(manifest["identity"])
            suffix, size, sha = manifest["suffix"], manifest["bytes"], manifest["sha256"]
        except _BAD_JSON:
            return "corrupt", None, msha
        if not (_valid_suffix(suffix) and type(size) is int and isinstance(sha, str)):
            return "corrupt", None, msha
        if found != ident:
            return "stale", None, msha
        path = self._objects / f"{ident.digest()}{suffix}"
        try:
            data = _read(path)
        except OSError:
            return "corrupt", None, msha
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            return "corrupt", None, msha
        return "ok", path, msha

    def load(self, ident: ArtifactIdentity, reader: Callable[[Path], T], name: str | None = None) -> T | None:
        """``reader(path)`` of the verified artifact of ``ident``, or None (a miss: the
        caller compiles, then saves). ``name``: the graph's in warnings (default: its
        key, shortened).

        The manifest's identity must equal ``ident`` and the file its recorded size and
        SHA-256; a corrupt or stale artifact, or one the reader fails on, is counted,
        removed and reported as a miss, so it is never used as a graph (a corrupt or
        stale one, and one the reader fails on, warned about: one line each). The reader runs
        under the shared lock: no writer replaces or evicts the file meanwhile. Bad
        metadata or a lock that cannot be taken never raises: it is a miss.
        """
        digest = ident.digest()
        manifest_path = self._objects / f"{digest}{_MANIFEST}"
        t0 = perf_counter()
        failure: Exception | None = None
        status, path, msha = "missing", None, ""
        with contextlib.suppress(OSError), self._locked(exclusive=False):
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
        elif status in _BAD:
            log.warning("graph store %s: the artifact of %s (%s) is %s; removed, its graph is compiled again "
                        "(counted in stats().disk.%s)", self.root, name or _short(ident.key), digest[:16], _BAD[status],
                        status)
        if status != "missing":
            self._count(status)
            self._discard(digest, manifest_path, msha)
        self._count("misses")
        return None

    def _record_use(self, digest: str) -> None:
        try:
            with self._locked(exclusive=True):
                index, ours = self._read_index()
                self._touch(index, digest)
                self._write_index(index, ours)
        except OSError as e:  # no lock to take: a store that cannot be written
            self._count("index_failures")
            self._warn_once(e, "its index.json is not written (further failures are counted in index_failures)")

    def _discard(self, digest: str, manifest_path: Path, msha: str) -> None:
        """Remove a bad artifact unless another process replaced it since it was read."""
        with contextlib.suppress(OSError), self._locked(exclusive=True):
            try:
                if hashlib.sha256(_read(manifest_path)).hexdigest() != msha:
                    return
            except FileNotFoundError:
                pass
            self._remove(self._scan({}).get(digest))

    def holds(self, ident: ArtifactIdentity) -> bool:
        """Whether an artifact of ``ident`` is on disk now (its manifest is there; not
        verified, nothing counted): what the ``cost`` eviction asks before it chooses."""
        return (self._objects / f"{ident.digest()}{_MANIFEST}").is_file()

    # --- save -----------------------------------------------------------------------

    def save(self, ident: ArtifactIdentity, writer: Callable[[Path], None], suffix: str = ".bin") -> bool:
        """Store the artifact ``writer(path)`` writes (torch's own file, named with
        ``suffix``), evicting least-recently-used artifacts to stay within ``max_bytes``.

        Returns whether it was stored. A write that fails with an ``OSError``
        (read-only or full store) is counted and warned about once; an artifact larger
        than ``max_bytes`` is counted in ``oversize``. Any other exception of the writer
        propagates. Two processes saving one identity at once store one of the two
        whole artifacts. Once its manifest is in place the artifact is stored, whatever
        happens to the index after it (:meth:`_write_index`).
        """
        if not _valid_suffix(suffix):
            raise ConfigError(f"suffix must start with '.', name no directory and not be {_MANIFEST!r}, "
                              f"got {suffix!r}")
        digest = ident.digest()
        t0 = perf_counter()
        tmp = self._tmp_path(digest, suffix)
        try:
            with self._locked(exclusive=True):
                _own_dir(self._tmp)
                _own_dir(self._objects)
                try:
                    writer(tmp)
                    data = _read(tmp)
                    stored = self._commit(ident, digest, tmp, data, suffix)
                finally:
                    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                        os.unlink(tmp)
        except OSError as e:
            self._count("write_failures")
            self._warn_once(e, "graphs are compiled and not stored (further failures are counted in "
                               "write_failures, not warned about)")
            return False
        if stored:
            self._count("saves", save=perf_counter() - t0)
        return stored

    def _commit(self, ident: ArtifactIdentity, digest: str, tmp: Path, data: bytes, suffix: str) -> bool:
        """Under the exclusive lock: evict, then move the artifact and its manifest in. The
        artifacts on disk, least recently used first, are a
        :class:`~attnpolicy.core.bounded_order.BoundedOrder` (the rule the store's model,
        :class:`~attnpolicy.cache.disk_mirror.DiskMirror`, runs too) that admits the new one."""
        manifest = json.dumps({"identity": ident.to_json(), "suffix": suffix, "bytes": len(data),
                               "sha256": hashlib.sha256(data).hexdigest()}, sort_keys=True, allow_nan=False).encode()
        need = len(data) + len(manifest)
        held: BoundedOrder[str, _Entry] = BoundedOrder.lru(max_bytes=self.max_bytes)
        if not held.fits(need):
            self._count("oversize")
            self._warn_oversize(ident, need)
            return False
        self._sweep_tmp(tmp)
        index, ours = self._read_index()
        entries = self._scan(index["used"])
        self._remove(entries.pop(digest, None))  # the old artifact of this identity, whatever its suffix
        for entry in sorted(entries.values(), key=lambda e: (e.used, e.digest)):  # least recently used first
            held.restore(entry.digest, entry, entry.bytes)
        victims: list[tuple[str, _Entry]] = []
        held.admit(digest, _Entry(digest, need, 0), need, 0.0, victims)
        for _, victim in victims:
            self._remove(victim)
            index["used"].pop(victim.digest, None)
            self._count("evictions")
        path, manifest_path = self._paths(digest, suffix)
        os.replace(tmp, path)
        self._replace_bytes(manifest_path, manifest)  # last: a manifest means a whole artifact
        for gone in set(index["used"]) - set(entries) - {digest}:
            del index["used"][gone]
        self._touch(index, digest)
        self._write_index(index, ours)
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
            log.warning("graph store %s: the artifact of %s (%d bytes) is larger than max_disk_bytes=%d; not stored "
                        "(further oversize artifacts are counted in stats().disk.oversize, not warned about)",
                        self.root, _short(ident.key), need, self.max_bytes)

    def _warn_once(self, error: OSError, consequence: str) -> None:
        why = {errno.EROFS: "read-only", errno.ENOSPC: "full", errno.EDQUOT: "over quota",
               errno.EACCES: "not writable", errno.EPERM: "not writable",
               errno.ELOOP: "a symbolic link where its own directory belongs",
               errno.EEXIST: "an index.json that is not its own"}.get(error.errno or 0, "unusable")
        with self._mutex:
            first, self._warned = not self._warned, True
        if first:
            warnings.warn(f"graph store {self.root}: {why} ({error}); {consequence}", RuntimeWarning, stacklevel=3)

    # --- graphs not stored ----------------------------------------------------------

    def refuse(self, name: str, why: str, counter: str = "unidentified") -> None:
        """Count a graph compiled without being stored in ``counter``: ``unidentified``, the
        code of ``name`` (a kernel, a model, a compiler) has no stable identity;
        ``unstorable``, compiler ``name`` declares no reloadable artifacts. ``why`` (naming
        it) is warned once per name."""
        with self._mutex:
            self._counts[counter] += 1
            first = name not in self._refused
            self._refused.add(name)
        if first:
            warnings.warn(f"{why}; its graphs are compiled and not stored in {self.root} (counted in "
                          f"{counter})", RuntimeWarning, stacklevel=3)

    # --- stats ----------------------------------------------------------------------

    def _count(self, name: str, *, load: float = 0.0, save: float = 0.0) -> None:
        with self._mutex:
            self._counts[name] += 1
            self._seconds["load"] += load
            self._seconds["save"] += save

    def stats(self) -> StoreStats:
        """This process's counters and the store's entries and bytes as on disk now."""
        entries: dict[str, _Entry] = {}
        with contextlib.suppress(OSError), self._locked(exclusive=False):
            entries = self._scan({})
        with self._mutex:
            counts, seconds = dict(self._counts), dict(self._seconds)
        return StoreStats(**counts, load_seconds=seconds["load"], save_seconds=seconds["save"],
                          entries=len(entries), bytes=sum(e.bytes for e in entries.values()),
                          max_bytes=self.max_bytes)

"""DiskStore: round trips, every integrity fault, degraded stores, two processes, the bound."""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpolicy.cache.disk_store import ArtifactIdentity, DiskStore, source_hash
from attnpolicy.core.modes import CallKind
from attnpolicy.errors import ConfigError
from attnpolicy.graphs.keys import GraphKey, TensorSpec

ROOT = Path(__file__).resolve().parents[2]


def ident(key: str = "causal/q64/float32", **changes: object) -> ArtifactIdentity:
    fields: dict[str, object] = {"key": key, "mechanism": "bytes", "backend": "aot_eager", "device": "cpu",
                                 "dtype": "float32", "code_hash": "c0", "torch_version": "2.13.0+cpu"}
    fields |= changes
    return ArtifactIdentity(**fields)  # type: ignore[arg-type]


def save_bytes(store: DiskStore, identity: ArtifactIdentity, data: bytes) -> bool:
    return store.save(identity, lambda path: path.write_bytes(data))


def load_bytes(store: DiskStore, identity: ArtifactIdentity) -> bytes | None:
    return store.load(identity, lambda path: path.read_bytes())


def disk_files(store: DiskStore) -> dict[str, int]:
    objects = store.root / "objects"
    return {p.name: p.stat().st_size for p in objects.iterdir()} if objects.is_dir() else {}


def artifact_path(store: DiskStore, identity: ArtifactIdentity) -> Path:
    return store.root / "objects" / f"{identity.digest()}.bin"


# --- identity and round trips --------------------------------------------------------

def test_identity_covers_every_field_and_graph_keys():
    base = ident()
    changed = [ident(key="mask/q64"), ident(mechanism="aoti"), ident(backend="inductor"), ident(device="cuda:0"),
               ident(dtype="bfloat16"), ident(code_hash="c1"), ident(torch_version="2.12.0"),
               ident(python="3.12"), ident(machine="aarch64"), ident(config=(("max_autotune", "True"),))]
    assert len({base.digest(), *(c.digest() for c in changed)}) == len(changed) + 1
    assert ArtifactIdentity.from_json(json.loads(json.dumps(base.to_json()))) == base
    key = GraphKey(CallKind.CAUSAL, 64, 64, True, TensorSpec("bfloat16", 4, 2, 32), "sdpa", None, "inductor")
    g = ArtifactIdentity.for_graph(key, mechanism="aot_compile", code_hash="h", config={"b": 1, "a": 2})
    assert (g.key, g.backend, g.device, g.dtype) == (repr(key), "inductor", "cpu", "bfloat16")
    assert g.config == (("a", "2"), ("b", "1"))
    # scales that print alike are different graphs
    a, b = (GraphKey(CallKind.CAUSAL, 64, 64, True, TensorSpec("float32", 4, 2, 32, s), "sdpa", None, "inductor")
            for s in (0.125, 0.1250001))
    assert str(a) == str(b)
    assert (ArtifactIdentity.for_graph(a, mechanism="m", code_hash="h").digest()
            != ArtifactIdentity.for_graph(b, mechanism="m", code_hash="h").digest())


def test_source_hash_follows_the_code():
    assert source_hash(ident) == source_hash(ident)
    assert source_hash(ident) != source_hash(save_bytes)
    assert source_hash("a", "bc") != source_hash("ab", "c")
    with pytest.raises(ConfigError, match="code_hash part"):
        source_hash(1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_max_disk_bytes_is_checked(tmp_path, bad):
    with pytest.raises(ConfigError, match="max_disk_bytes"):
        DiskStore(tmp_path, bad)


def test_round_trip_counts_and_bytes_match_the_disk(tmp_path):
    store = DiskStore(tmp_path / "s", 10_000)
    assert load_bytes(store, ident()) is None
    assert save_bytes(store, ident(), b"graph-1")
    assert load_bytes(store, ident()) == b"graph-1"
    s = store.stats()
    assert (s.hits, s.misses, s.saves, s.corrupt, s.stale) == (1, 1, 1, 0, 0)
    assert s.entries == 1 and s.bytes == sum(disk_files(store).values())
    assert s.load_seconds > 0 and s.save_seconds > 0
    # a second process's view (a new store object) sees the same artifact
    assert load_bytes(DiskStore(tmp_path / "s", 10_000), ident()) == b"graph-1"


def test_saving_again_replaces_the_artifact(tmp_path):
    store = DiskStore(tmp_path, 10_000)
    save_bytes(store, ident(), b"old")
    assert store.save(ident(), lambda p: p.write_bytes(b"new!"), suffix=".pt2")
    assert store.load(ident(), lambda p: (p.suffix, p.read_bytes())) == (".pt2", b"new!")
    assert store.stats().entries == 1 and len(disk_files(store)) == 2


# --- faults: each gives a counted miss (the caller recompiles), never a wrong graph -----

def test_truncated_artifact_is_detected_counted_warned_and_recompiled(tmp_path, caplog):
    store = DiskStore(tmp_path, 10_000)
    save_bytes(store, ident(), b"x" * 100)
    path = artifact_path(store, ident())
    path.write_bytes(path.read_bytes()[:60])
    with caplog.at_level(logging.WARNING, logger="attnpolicy.cache.disk_store"):
        assert load_bytes(store, ident()) is None
    s = store.stats()
    assert (s.corrupt, s.hits, s.misses, s.entries) == (1, 0, 1, 0)  # removed, not loaded
    [line] = caplog.messages  # one line: which artifact, what is wrong, what happens
    assert line == (f"graph store {tmp_path}: the artifact of causal/q64/float32 ({ident().digest()[:16]}) is "
                    "corrupt (truncated, altered or unreadable: its manifest's size or SHA-256 does not match); "
                    "removed, its graph is compiled again (counted in stats().disk.corrupt)")
    assert save_bytes(store, ident(), b"x" * 100) and load_bytes(store, ident()) == b"x" * 100
    path.write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="attnpolicy.cache.disk_store"):
        assert store.load(ident(), lambda p: p.read_bytes(), name="causal/q64 of a model") is None
    [line] = caplog.messages
    assert "the artifact of causal/q64 of a model (" in line and "is corrupt" in line


@pytest.mark.parametrize("where", ["artifact", "manifest"])
def test_flipped_byte_is_detected(tmp_path, where):
    store = DiskStore(tmp_path, 10_000)
    save_bytes(store, ident(), bytes(range(200)))
    path = artifact_path(store, ident())
    if where == "manifest":
        path = path.with_suffix(".json")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert load_bytes(store, ident()) is None
    s = store.stats()
    # a flipped manifest byte is unreadable JSON (corrupt) or names another identity (stale)
    assert s.corrupt + s.stale == 1 and s.hits == 0 and s.entries == 0


def test_missing_artifact_beside_its_manifest_is_corrupt(tmp_path):
    store = DiskStore(tmp_path, 10_000)
    save_bytes(store, ident(), b"abc")
    artifact_path(store, ident()).unlink()
    assert load_bytes(store, ident()) is None and store.stats().corrupt == 1


@pytest.mark.parametrize("other", [{"torch_version": "2.12.0"}, {"config": (("max_autotune", "True"),)},
                                   {"code_hash": "c1"}, {"backend": "inductor"}])
def test_artifact_of_another_torch_version_or_config_is_never_loaded(tmp_path, other):
    store = DiskStore(tmp_path, 10_000)
    theirs = ident(**other)
    save_bytes(store, theirs, b"their graph")
    # asked for under this identity: a plain miss (another file name) ...
    assert load_bytes(store, ident()) is None
    assert store.stats().misses == 1 and store.stats().hits == 0
    # ... and where their files sit at our name (copied stores), the manifest tells: stale
    for src in artifact_path(store, theirs).parent.glob(f"{theirs.digest()}.*"):
        os.replace(src, src.with_name(ident().digest() + src.suffix))
    assert load_bytes(store, ident()) is None
    s = store.stats()
    assert (s.stale, s.hits, s.entries) == (1, 0, 0)
    assert save_bytes(store, ident(), b"our graph") and load_bytes(store, ident()) == b"our graph"


def test_reader_failure_is_counted_removed_and_a_miss(tmp_path, caplog):
    store = DiskStore(tmp_path, 10_000)
    save_bytes(store, ident(), b"abc")

    def reader(path: Path) -> object:
        raise AttributeError("'function' object has no attribute 'finalize_loading'")

    assert store.load(ident(), reader) is None
    s = store.stats()
    assert (s.load_failures, s.hits, s.misses, s.entries) == (1, 0, 1, 0)
    assert "failed to load" in caplog.text and "finalize_loading" in caplog.text


# --- a store that cannot be written degrades to compiling, with one warning --------------
# Tests run as root, for whom chmod does not make a directory read-only: read-only is
# simulated by a store under a regular file (no directory can be made), by os.replace
# failing with EROFS (a read-only mount), and by a writer failing with ENOSPC (full).

def _two_saves_warn_once(store: DiskStore) -> None:
    saves = store.stats().saves
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not save_bytes(store, ident("a"), b"a")
        assert not save_bytes(store, ident("b"), b"b")
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert store.stats().write_failures == 2 and store.stats().saves == saves


def test_store_under_a_file_degrades(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    store = DiskStore(tmp_path / "file" / "store", 10_000)
    _two_saves_warn_once(store)
    assert load_bytes(store, ident("a")) is None
    s = store.stats()
    assert (s.misses, s.entries, s.bytes) == (1, 0, 0)


def test_read_only_mount_degrades_and_still_serves_what_is_there(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 10_000)
    save_bytes(store, ident("old"), b"old graph")
    before = disk_files(store)

    def read_only(src: object, dst: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", read_only)
    _two_saves_warn_once(store)
    assert disk_files(store) == before  # nothing half-written
    assert load_bytes(store, ident("old")) == b"old graph"
    assert load_bytes(store, ident("a")) is None


def test_full_store_degrades(tmp_path):
    store = DiskStore(tmp_path, 10_000)

    def full(path: Path) -> None:
        path.write_bytes(b"part")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.warns(RuntimeWarning, match="full"):
        assert not store.save(ident(), full)
    assert store.stats().write_failures == 1 and disk_files(store) == {}
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod; simulated above")
def test_chmod_read_only_directory_degrades(tmp_path):
    store = DiskStore(tmp_path / "s", 10_000)
    for d in (store.root, store.root / "objects", store.root / "tmp"):
        d.chmod(0o555)
    try:
        _two_saves_warn_once(store)
    finally:
        for d in (store.root, store.root / "objects", store.root / "tmp"):
            d.chmod(0o755)


def test_artifact_larger_than_the_store_is_not_stored(tmp_path):
    store = DiskStore(tmp_path, 100)
    assert not save_bytes(store, ident(), b"x" * 200)
    s = store.stats()
    assert (s.oversize, s.entries, s.bytes) == (1, 0, 0)


def test_oversize_artifacts_are_warned_about_once_per_store_and_counted(tmp_path, caplog):
    """Five oversize graphs (attention graph keys, whose identity key is the full repr),
    from two store objects on one directory: one short warning, five counted."""
    spec = TensorSpec("float32", 2, 2, 16)
    keys = [GraphKey(CallKind.CAUSAL, n, n, True, spec, "sdpa", None, "aot_eager") for n in (16, 32, 64, 128, 256)]
    stores = [DiskStore(tmp_path, 100), DiskStore(tmp_path, 100)]
    caplog.set_level(logging.WARNING, logger="attnpolicy.cache.disk_store")
    for i, key in enumerate(keys):
        identity = ArtifactIdentity.for_graph(key, mechanism="bytes", code_hash="c0")
        assert not save_bytes(stores[i % 2], identity, b"x" * 200)
    [record] = caplog.records
    message = record.getMessage()
    assert "larger than max_disk_bytes=100; not stored" in message and "counted in stats().disk.oversize" in message
    assert repr(keys[0]) not in message and len(message.replace(str(tmp_path), "")) < 300
    assert sum(store.stats().oversize for store in stores) == 5


# --- two processes share one store ----------------------------------------------------

def _writer(root: str, tag: bytes, rounds: int, go: object) -> None:
    store = DiskStore(root, 1 << 20)
    go.wait()  # type: ignore[attr-defined]

    def slow(path: Path) -> None:  # a half-written file would be visible for a while
        with path.open("wb") as f:
            for _ in range(8):
                f.write(tag * 512)
                f.flush()
                time.sleep(0.001)

    for _ in range(rounds):
        assert store.save(ident(), slow)


def _reader(root: str, rounds: int, go: object, out: object) -> None:
    store = DiskStore(root, 1 << 20)
    go.wait()  # type: ignore[attr-defined]
    seen = set()
    for _ in range(rounds):
        data = load_bytes(store, ident())
        if data is not None:
            seen.add(data)
    s = store.stats()
    out.put((sorted(seen), s.corrupt, s.stale, s.hits))  # type: ignore[attr-defined]


def test_two_processes_writing_one_key_never_expose_half_an_artifact(tmp_path):
    ctx = multiprocessing.get_context("fork")
    go, out = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), tag, 15, go)) for tag in (b"A", b"B")]
    procs.append(ctx.Process(target=_reader, args=(str(tmp_path), 60, go, out)))
    for p in procs:
        p.start()
    seen, corrupt, stale, hits = out.get(timeout=120)
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    whole = {b"A" * 4096, b"B" * 4096}
    assert set(seen) <= whole and (corrupt, stale) == (0, 0)
    assert hits >= len(seen)
    store = DiskStore(tmp_path, 1 << 20)
    assert load_bytes(store, ident()) in whole
    assert store.stats().entries == 1 and list((tmp_path / "tmp").iterdir()) == []


# --- the bound -------------------------------------------------------------------------

ops = st.lists(st.tuples(st.sampled_from(["save", "load"]), st.integers(0, 7), st.integers(0, 600)),
               min_size=1, max_size=40)


@settings(max_examples=60)
@given(ops=ops, bound=st.integers(300, 2500))
def test_store_never_exceeds_its_bound_and_evicts_least_recently_used(ops, bound):
    with tempfile.TemporaryDirectory() as root:
        store = DiskStore(root, bound)
        model: dict[int, int] = {}  # key -> bytes on disk, least recently used first
        payload: dict[int, bytes] = {}
        for op, k, size in ops:
            if op == "save":
                data = bytes([k]) * size
                if save_bytes(store, ident(f"k{k}"), data):  # else (too large) the old one stays
                    model.pop(k, None)
                    need = sum(v for n, v in disk_files(store).items() if n.startswith(ident(f"k{k}").digest()))
                    while model and sum(model.values()) + need > bound:
                        victim = next(iter(model))
                        del model[victim], payload[victim]
                    model[k], payload[k] = need, data
            else:
                got = load_bytes(store, ident(f"k{k}"))
                assert got == payload.get(k)
                if k in model:
                    model[k] = model.pop(k)
            files = disk_files(store)
            s = store.stats()
            assert sum(files.values()) <= bound
            assert s.bytes == sum(files.values()) == sum(model.values())
            assert s.entries == len([n for n in files if n.endswith(".json")]) == len(model)
        s = store.stats()
        assert s.hits + s.misses == sum(op == "load" for op, _, _ in ops)
        assert s.corrupt == s.stale == s.write_failures == 0


# --- end to end: a graph saved by one process loads in another -------------------------

_CHILD = r"""
import json, sys
import torch
from attnpolicy.cache.disk_store import ArtifactIdentity, DiskStore
from attnpolicy.graphs.aot import load_graph
from torch._dynamo.utils import counters
from tiny_models import encoder_stack

ident = ArtifactIdentity.from_json(json.loads(sys.argv[2]))
store = DiskStore(sys.argv[1], 1 << 24)
graph = store.load(ident, load_graph)
inputs = torch.load(sys.argv[3])
if sys.argv[5] == "model":  # the model's weights are inputs: this process builds its own copy
    inputs = (encoder_stack(), *inputs)
with torch.no_grad():
    torch.save(graph(*inputs), sys.argv[4])
print(json.dumps({"stats": store.stats().to_json(), "dynamo_frames": sum(counters["frames"].values())}))
"""


def _load_elsewhere(tmp_path: Path, identity: ArtifactIdentity, inputs: tuple[object, ...], kind: str) -> object:
    """The output of the graph of ``identity`` loaded from the store in a new process,
    after checking the child's stats show one load and no Dynamo frame."""
    import torch

    torch.save(inputs, tmp_path / "in.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "store"), json.dumps(identity.to_json()),
                          str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), kind],
                         env=env, capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert (child["stats"]["hits"], child["stats"]["misses"], child["stats"]["load_failures"]) == (1, 0, 0)
    assert child["dynamo_frames"] == 0  # loaded, not traced or compiled
    return torch.load(tmp_path / "out.pt")


def test_torch_refusing_a_verified_artifact_is_a_counted_miss(tmp_path):
    from attnpolicy.graphs.aot import SUFFIX, load_graph

    store = DiskStore(tmp_path, 10_000)
    store.save(ident(), lambda p: p.write_bytes(b"not a compiled function"), suffix=SUFFIX)
    assert store.load(ident(), load_graph) is None
    s = store.stats()
    assert (s.load_failures, s.corrupt, s.hits, s.entries) == (1, 0, 0, 0)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_graph_saved_by_one_process_loads_in_another(tmp_path, monkeypatch, backend):
    import torch
    from reference import reference_attention

    from attnpolicy.dispatch.call_graphs import example_inputs
    from attnpolicy.graphs import execute
    from attnpolicy.graphs.aot import MECHANISM, SUFFIX, aot_compile_graph, save_graph
    from attnpolicy.graphs.execute import graph_fn
    from attnpolicy.graphs.keys import Call
    from attnpolicy.kernels import attention, masks

    call = Call(CallKind.CAUSAL, 0, 64, 0, 64, 64, 64, True)
    spec = TensorSpec("float32", 4, 2, 32)
    key = GraphKey.for_call(call, spec, "sdpa", None, backend)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # a restart on this machine
    code = source_hash(attention, masks, execute)
    identity = ArtifactIdentity.for_graph(key, mechanism=MECHANISM, code_hash=code)
    fn = graph_fn(call, "sdpa", None, None)
    store = DiskStore(tmp_path / "store", 1 << 24)
    graph = aot_compile_graph(fn, backend, example_inputs(call, spec))
    assert store.save(identity, lambda p: save_graph(graph, p), suffix=SUFFIX)

    torch.manual_seed(0)
    q, k, v = (torch.randn(64, h, 32) for h in (4, 2, 2))
    inputs = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # the strides graph_inputs makes
    got = _load_elsewhere(tmp_path, identity, inputs, "attention")
    with torch.no_grad():
        assert torch.equal(got, graph(*inputs))  # the very graph that was saved
    want = reference_attention(q, k, v, [0], [64], [0], [64], True).transpose(0, 1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_model_graph_saved_by_one_process_loads_in_another(tmp_path):
    import torch
    from tiny_models import encoder_stack

    from attnpolicy.graphs.aot import MECHANISM, SUFFIX, aot_compile_graph, save_graph

    model = encoder_stack()
    x = torch.randn(1, 32, 64)
    identity = ArtifactIdentity("encoder-stack/l2/h64/t32", MECHANISM, "aot_eager", "cpu", "float32",
                                source_hash(torch.nn.TransformerEncoderLayer, encoder_stack))
    graph = aot_compile_graph(type(model).forward, "aot_eager", (model, x))  # the module is an input
    store = DiskStore(tmp_path / "store", 1 << 24)
    assert store.save(identity, lambda p: save_graph(graph, p), suffix=SUFFIX)
    got = _load_elsewhere(tmp_path, identity, (x,), "model")
    with torch.no_grad():
        assert torch.equal(got, graph(model, x))
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["save", "load"]), st.integers(0, 5)), max_size=25),
       st.integers(1, 6))
def test_the_modelled_store_holds_and_evicts_what_the_store_does(ops, room):
    """A :class:`DiskMirror` sized by the store's own bytes holds, after every save and
    load, the artifacts the store holds, and counts its evictions and oversize ones."""
    import tempfile

    from attnpolicy.cache.disk_mirror import DiskMirror

    idents = [ident(f"causal/q{i}") for i in range(6)]
    datas = [b"x" * (40 * i) for i in range(6)]
    with tempfile.TemporaryDirectory() as scratch:
        sizes = []
        for i, (identity, data) in enumerate(zip(idents, datas)):  # each artifact's bytes on disk
            alone = DiskStore(Path(scratch) / str(i), 1 << 20)
            save_bytes(alone, identity, data)
            sizes.append(alone.stats().bytes)
        bound = min(sizes) + room * 90  # some fit together, the largest may not fit at all
        store = DiskStore(Path(scratch) / "bounded", bound)
        mirror = DiskMirror(bound, sizes.__getitem__, lambda key: 0.0)
        for op, i in ops:
            if op == "save":
                assert save_bytes(store, idents[i], datas[i]) == mirror.save(i)
            else:
                assert (load_bytes(store, idents[i]) is not None) == (mirror.load(i) is not None)
            assert {i for i in range(6) if store.holds(idents[i])} == set(mirror)
        stats = store.stats()
        assert (stats.evictions, stats.oversize, stats.bytes) == (mirror.evictions, mirror.oversize, mirror.nbytes)

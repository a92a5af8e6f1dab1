"""The graph store against what it finds on disk: user files beside it, links, stray
directories, malformed metadata, a full disk under the index; and the paths it is given."""

from __future__ import annotations

import errno
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from reference import reference_for
from test_disk_store import disk_files, ident, load_bytes, save_bytes

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.cache.disk_store import DiskStore
from attnpolicy.cli import main
from attnpolicy.errors import ConfigError

USER_FILES = {"tmp/notes.txt": b"my notes\n", "tmp/draft.md": b"# draft\n", "objects/photo.jpg": b"\xff\xd8jpeg",
              "index.json": b'{"name": "my project"}\n', "lock": b"a file of mine called lock\n",
              "tmp/sub/keep.txt": b"nested\n"}


def _user_files(root: Path, files: dict[str, bytes] = USER_FILES) -> dict[str, bytes]:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def _unchanged(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (root / name).read_bytes() == data, name


def _churn(store: DiskStore) -> None:
    """Saves that evict, loads, a corrupt artifact discarded, a crashed writer's leftover."""
    for i in range(12):
        assert save_bytes(store, ident(f"k{i}"), bytes([i]) * 300)
        assert load_bytes(store, ident(f"k{i}")) == bytes([i]) * 300
    (store.root / "objects" / f"{ident('k11').digest()}.bin").write_bytes(b"flipped")
    assert load_bytes(store, ident("k11")) is None
    leftover = store.root / "tmp" / f"{ident('k0').digest()}.99.1.bin"  # a crashed writer's
    leftover.write_bytes(b"half")
    assert save_bytes(store, ident("k12"), b"x" * 300)
    assert not leftover.exists()


def test_a_store_in_a_directory_of_user_files_removes_only_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files = _user_files(tmp_path)
    store = DiskStore(".", 2_000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _churn(store)
    _unchanged(tmp_path, files)
    s = store.stats()
    assert s.evictions > 0 and s.corrupt == 1 and s.write_failures == 0
    assert s.bytes == sum(n for name, n in disk_files(store).items() if name != "photo.jpg") <= 2_000
    # index.json is the user's: never replaced, so recency is not recorded (said once)
    assert s.index_failures > 0 and len([w for w in caught if "index.json" in str(w.message)]) == 1


def test_tmp_or_objects_as_a_link_is_never_written_through(tmp_path):
    elsewhere = tmp_path / "mine"
    files = _user_files(elsewhere, {"notes.txt": b"notes\n", f"{'a' * 64}.1.2.bin": b"looks like a leftover\n"})
    for link in ("tmp", "objects"):
        root = tmp_path / link / "store"
        root.mkdir(parents=True)
        (root / link).symlink_to(elsewhere)
        store = DiskStore(root, 2_000)
        with pytest.warns(RuntimeWarning, match="symbolic link"):
            assert not save_bytes(store, ident(), b"graph")
        assert store.stats().write_failures == 1 and load_bytes(store, ident()) is None
        _unchanged(elsewhere, files)
        assert sorted(p.name for p in elsewhere.iterdir()) == sorted(files)


def test_links_and_stray_directories_in_the_store_are_ignored(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    store = DiskStore(tmp_path / "s", 2_000)
    objects, tmp = store.root / "objects", store.root / "tmp"
    strays = [tmp / "stray", tmp / f"{'b' * 64}.1.2.bin", objects / "stray", objects / f"{'c' * 64}.bin"]
    for d in strays:
        d.mkdir()
    (objects / f"{ident('k0').digest()}.json").symlink_to(outside)  # at an artifact's own name
    (objects / f"{'d' * 64}.bin").symlink_to(outside)
    _churn(store)
    assert outside.read_bytes() == b"precious" and all(d.is_dir() for d in strays)
    s = store.stats()
    assert s.write_failures == 0 and s.evictions > 0
    assert s.bytes == sum(p.stat().st_size for p in objects.iterdir() if p.is_file() and not p.is_symlink())


# --- malformed metadata: a counted miss, removed, compiled; never an exception --------

def _manifest(store: DiskStore) -> Path:
    return store.root / "objects" / f"{ident().digest()}.json"


MANIFESTS = {
    "nested 200k deep": lambda m: "[" * 200_000 + "]" * 200_000,
    "bytes Infinity": lambda m: json.dumps(m).replace(f'"bytes": {m["bytes"]}', '"bytes": Infinity'),
    "bytes true": lambda m: json.dumps({**m, "bytes": True}),
    "bytes a string": lambda m: json.dumps({**m, "bytes": "3"}),
    "suffix out of the store": lambda m: json.dumps({**m, "suffix": "/../../outside.txt"}),
    "suffix a number": lambda m: json.dumps({**m, "suffix": 7}),
    "identity a list": lambda m: json.dumps({**m, "identity": [1, 2]}),
    "identity's config a number": lambda m: json.dumps({**m, "identity": {**m["identity"], "config": 5}}),
    "a list": lambda m: json.dumps([m]),
    "not UTF-8": lambda m: "\udcff",
}


@pytest.mark.parametrize("bad", list(MANIFESTS))
def test_a_malformed_manifest_is_a_counted_miss_and_removed(tmp_path, bad):
    store = DiskStore(tmp_path, 10_000)
    save_bytes(store, ident(), b"abc")
    manifest = _manifest(store)
    manifest.write_bytes(MANIFESTS[bad](json.loads(manifest.read_text())).encode(errors="surrogateescape"))
    assert load_bytes(store, ident()) is None
    s = store.stats()
    assert (s.corrupt, s.misses, s.hits, s.entries) == (1, 1, 0, 0)  # removed
    assert save_bytes(store, ident(), b"abc") and load_bytes(DiskStore(tmp_path, 10_000), ident()) == b"abc"


INDEXES = ['{"clock": null, "used": {}}', '{"clock": "3", "used": {}}', '{"clock": -1, "used": {}}',
           '{"clock": true, "used": {}}', '{"clock": 1, "used": []}', '{"clock": 1, "used": {"x": "y"}}',
           '{"clock": 1, "used": {"x": null}}', '{"clock": 1e400, "used": {}}', '{"clock": 1, "used": {}, "more": 1}',
           '{"clock": ' + "[" * 200_000 + "]" * 200_000 + ', "used": {}}', '{"clock": 1, "used": {']


@pytest.mark.parametrize("bad", INDEXES, ids=range(len(INDEXES)))
def test_a_malformed_index_is_counted_and_rebuilt(tmp_path, bad):
    store = DiskStore(tmp_path, 10_000)
    save_bytes(store, ident("a"), b"a")
    (tmp_path / "index.json").write_text(bad)
    assert load_bytes(store, ident("a")) == b"a"  # the artifacts are the truth
    assert save_bytes(store, ident("b"), b"b")
    s = store.stats()
    assert (s.corrupt, s.hits, s.saves, s.write_failures, s.index_failures) == (1, 1, 2, 0, 0)
    index = json.loads((tmp_path / "index.json").read_text())
    assert set(index["used"]) == {ident("a").digest(), ident("b").digest()} and index["clock"] == 2


def test_an_index_that_is_a_directory_does_not_fail_a_save(tmp_path):
    store = DiskStore(tmp_path, 10_000)
    (tmp_path / "index.json").mkdir()
    (tmp_path / "index.json" / "mine.txt").write_text("mine")
    with pytest.warns(RuntimeWarning, match="index.json"):
        assert save_bytes(store, ident(), b"abc")
    assert load_bytes(store, ident()) == b"abc"
    s = store.stats()
    assert (s.saves, s.write_failures, s.hits, s.entries) == (1, 0, 1, 1) and s.index_failures == 2
    assert (tmp_path / "index.json" / "mine.txt").read_text() == "mine"


def test_a_full_disk_under_the_index_leaves_the_artifact_stored(tmp_path, monkeypatch):
    """The artifact is committed once its manifest is in place; the index only orders
    eviction and is rebuilt from the files, so a failure to write it is no failed save."""
    store = DiskStore(tmp_path, 10_000)
    replace = os.replace

    def full_at_the_index(src: object, dst: object) -> None:
        if Path(str(dst)).name == "index.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", full_at_the_index)
    with pytest.warns(RuntimeWarning, match="full .*stored graphs stay valid"):
        assert save_bytes(store, ident(), b"abc")
    s = store.stats()
    assert (s.saves, s.write_failures, s.index_failures, s.entries) == (1, 0, 1, 1)
    assert list((tmp_path / "tmp").iterdir()) == []  # the index's temporary file is gone
    monkeypatch.setattr(os, "replace", replace)
    assert load_bytes(DiskStore(tmp_path, 10_000), ident()) == b"abc"


SPEC_LAYOUT = BatchLayout.from_lens([12])


def _attend(store: Path) -> Dispatcher:
    d = Dispatcher(AttnPolicyConfig(backend="aot_eager", max_seq_len=64, store_dir=str(store)))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 16, generator=g) for _ in range(3))
    out = d.attend(q, k, v, SPEC_LAYOUT)
    torch.testing.assert_close(out.double(), reference_for(q, k, v, SPEC_LAYOUT), atol=1e-5, rtol=1e-5)
    return d


def test_attend_compiles_past_malformed_metadata_and_a_later_dispatcher_loads(tmp_path):
    first = _attend(tmp_path)
    assert first.stats().disk.saves == 1  # type: ignore[union-attr]
    (manifest,) = (tmp_path / "objects").glob("*.json")
    manifest.write_text("[" * 200_000 + "]" * 200_000)
    (tmp_path / "index.json").write_text('{"clock": null, "used": {}}')
    (tmp_path / "tmp" / "stray").mkdir()
    second = _attend(tmp_path)
    s = second.stats()
    assert s.cache.compiles == 1 and s.cache.loads == 0
    assert s.disk is not None and (s.disk.corrupt, s.disk.saves, s.disk.write_failures) == (2, 1, 0)
    third = _attend(tmp_path).stats()
    assert third.cache.loads == 1 and third.cache.compiles == 0
    assert third.disk is not None and third.disk.corrupt == 0


# --- the paths a store is given ----------------------------------------------------------

@pytest.mark.parametrize(("path", "why"), [("", "blank"), ("  ", "blank"), ("a\0b", "NUL byte"),
                                           ("~no_such_user_here/store", "no known user")])
def test_a_store_path_that_names_no_directory_is_refused(tmp_path, path, why):
    with pytest.raises(ValueError, match=f"store_dir.*{why}"):  # pydantic's, naming the field
        AttnPolicyConfig(store_dir=path)
    with pytest.raises(ConfigError, match=f"store_dir {re.escape(repr(path))} .*{why}"):
        DiskStore(path, 1000)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"store_dir": path}))
    assert main(["config", "validate", str(config)]) == 2


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    store = DiskStore("~/graphs", 1000)
    assert store.root == tmp_path / "home" / "graphs" and (store.root / "objects").is_dir()
    assert not (tmp_path / "~").exists()


def test_run_with_an_empty_store_refuses_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    files = _user_files(tmp_path, {"tmp/notes.txt": b"notes\n", "tmp/draft.md": b"# draft\n"})
    assert main(["run", "--limit", "2", "--backend", "none", "--store", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "store_dir" in err[0] and "blank" in err[0]
    _unchanged(tmp_path, files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]

"""The docs say what the code does: generated samples, complete examples that run,
links that resolve in a clone, nothing a reader outside the project cannot follow."""

from __future__ import annotations

import re
import subprocess
import tomllib
import types
from pathlib import Path

import pytest
from docs_blocks import ROOT, blocks

import attnpolicy
from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.plugins.registry import get_plugin_manager

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_config_sample_is_the_model_dump():
    assert AttnPolicyConfig().model_dump_json(indent=2) + "\n" in blocks(ROOT / "docs/config.md", "json")


def test_plugin_walkthrough_shows_the_whole_plugin():
    plugin = ROOT / "plugins/attnpolicy-length-threshold"
    doc = ROOT / "docs/plugins.md"
    assert (plugin / "attnpolicy_length_threshold.py").read_text() in blocks(doc, "python")
    assert (plugin / "pyproject.toml").read_text() in blocks(doc, "toml")


def test_plugin_doc_lists_every_batch_layout_property():
    table = (ROOT / "docs/plugins.md").read_text()
    public = [n for n, v in vars(attnpolicy.BatchLayout).items()
              if not n.startswith("_") and not isinstance(v, classmethod | staticmethod)]
    public += [f.name for f in attnpolicy.BatchLayout.__dataclass_fields__.values() if not f.name.startswith("_")]
    for name in public:
        assert f"`{name}" in table, name


@pytest.mark.usefixtures("fresh_plugins")
def test_the_eviction_example_runs():
    (code,) = [b for b in blocks(ROOT / "docs/plugins.md", "python") if "class MRUCache" in b]
    module = types.ModuleType("attnpolicy_mru")
    exec(compile(code, "docs/plugins.md", "exec"), module.__dict__)
    get_plugin_manager().register(module, name="mru")
    released = []
    cache = GraphCache(max_graphs=2, eviction="mru", release=lambda key, graph: released.append(key))
    for key in ("a", "b", "a", "c", "b", "a"):
        cache.get_or_compile(key, lambda key=key: key.upper())
    # "a" was used last when "c" arrived: MRU evicts it; "b" was used last when "a" came back
    assert released == ["a", "b"] and set(cache.keys()) == {"a", "c"}
    assert AttnPolicyConfig(eviction="mru", max_graphs=2).eviction == "mru"


def _internal_mentions() -> list[re.Pattern[str]]:
    # built from pieces so that this file does not match itself
    return [re.compile(r"\bissues? #?\d+", re.I), re.compile("the " + "seed", re.I),
            re.compile(r"\.\./" + "shared"), re.compile(r"(?<![\w/-])#\d{3,}")]


def test_no_internal_references_in_docs_code_or_tests():
    files = [*DOCS, *ROOT.glob("attnpolicy/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("plugins/**/*.md")]
    for path in files:
        text = path.read_text()
        for pattern in _internal_mentions():
            match = pattern.search(text)
            assert match is None, f"{path.relative_to(ROOT)}: {match and match[0]!r}"


def _ignored(path: Path) -> bool:
    result = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT, check=False)
    return result.returncode == 0


def test_doc_links_resolve_to_files_a_clone_has():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            assert path.exists(), f"{doc.name} links to missing {target}"
            assert not _ignored(path), f"{doc.name} links to {target}, which .gitignore excludes"


def test_no_package_file_is_ignored_by_git():
    for path in ROOT.glob("attnpolicy/**/*.py"):
        assert not _ignored(path), f"{path.relative_to(ROOT)} is excluded by .gitignore"


def test_readme_first_lines_are_the_setup_and_test_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[3].endswith("attnpolicy report --out report")
    test_command = lines[4].rsplit("&& ", 1)[1]
    assert test_command.startswith("python -m pytest -q")
    ci = (ROOT / ".ci/run").read_text().splitlines()
    assert any(line.split("#")[0].strip() == test_command for line in ci), test_command


def test_package_ships_py_typed_and_exports_every_public_name():
    assert (ROOT / "attnpolicy/py.typed").is_file()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in data["tool"]["setuptools"]["package-data"]["attnpolicy"]
    assert sorted(attnpolicy.__all__) == sorted(attnpolicy._EXPORTS)

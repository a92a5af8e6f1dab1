"""The package's layering, read from its source: no import cycle, no upward import, no long module.

Every module of ``attnpolicy`` is parsed; every import in it (at module level or inside
a function, but not under ``if TYPE_CHECKING:``) is an edge of the import graph. The
layer order is the one docs/design.md "Package layout" lists.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "attnpolicy"

#: Bottom up; a module may import its own layer and those below. A name is a module or
#: a package (every module under it).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("attnpolicy", "errors", "core"),
    ("kernels",),
    ("graphs", "plugins", "cache"),
    ("config",),
    ("policies",),
    ("dispatch",),
    ("workloads", "integrations"),
    ("modelling",),
    ("planning",),
    ("bench",),
    ("report",),
    ("cli", "__main__"),
)


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else parts[0]
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"module {module} is in no layer of LAYERS")


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules ``node`` in ``module`` imports (a name taken from a package
    is its submodule when there is one)."""
    known = modules()
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if modules()[module].name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    if base not in known:
        return []
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    return subs if len(subs) == len(node.names) else [base, *subs]


@cache
def graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}."""
    edges: dict[str, dict[str, int]] = {}
    for module, path in modules().items():
        out: dict[str, int] = {}
        tree = ast.parse(path.read_text(), str(path))
        skipped: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _type_checking(node.test):
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                for target in _imported(module, node):
                    if target != module:
                        out.setdefault(target, node.lineno)
        edges[module] = out
    return edges


def cycles() -> list[list[str]]:
    """The import cycles: every strongly connected component of more than one module."""
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward() -> list[str]:
    """Every import of a module from a higher layer, as ``module:line -> imported``."""
    return [f"{m}:{line} -> {target}" for m, out in sorted(graph().items())
            for target, line in sorted(out.items()) if layer(target) > layer(m)]


def test_the_graph_sees_lazy_imports_and_skips_type_checking():
    edges = graph()
    assert "attnpolicy.plugins.registry" in edges["attnpolicy.cache.graph_cache"]  # module level
    assert "attnpolicy.plugins.registry" in edges["attnpolicy.plugins.kernels"]  # inside a function
    assert "attnpolicy.config" not in edges["attnpolicy.policies.base"]  # under TYPE_CHECKING only
    assert "attnpolicy.plugins.hookspecs" in edges["attnpolicy.policies.builtin"]  # a name from a package


def test_the_config_is_plain_data():
    """config.py resolves no names: it imports nothing from plugins/ or cache/."""
    assert [m for m in graph()["attnpolicy.config"] if m.startswith(("attnpolicy.plugins", "attnpolicy.cache"))] == []


def test_every_module_has_a_layer():
    for module in modules():
        layer(module)


def test_no_import_cycle():
    assert cycles() == []


def test_no_upward_import():
    assert upward() == []


def test_layers_match_the_design_doc():
    text = (ROOT.parent / "docs" / "design.md").read_text()
    section = text.split("## Package layout", 1)[1].split("\n## ", 1)[0]
    for i, names in enumerate(LAYERS[1:], start=2):
        line = next((ln for ln in section.splitlines() if ln.startswith(f"{i}. ")), "")
        assert line, f"docs/design.md Package layout has no layer {i}"
        assert any(f"`{n}" in line for n in names), f"layer {i} of docs/design.md is not {names}: {line}"

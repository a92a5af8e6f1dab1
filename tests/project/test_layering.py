"""The package's layering and encapsulation, read from its source: no import cycle, no
upward import (by an import statement or by a module name in a string), no two modules
and no two packages importing each other, no code writing another object's private
state, no public name defined in two modules.

Every module of ``attnpolicy`` is parsed; every import in it (at module level or inside
a function, but not under ``if TYPE_CHECKING:``) is an edge of the import graph; the
graph of every import (``TYPE_CHECKING`` ones too) has no two modules importing each
other and no cycle between top-level packages. The layer order is the one
docs/design.md "Package layout" lists.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "attnpolicy"

#: Bottom up, one top-level module or package (every module under it) per layer; a
#: module may import its own layer and those below. ``attnpolicy`` is the package's own
#: ``__init__``: the front door, which loads the names it exports from every layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("core",),
    ("kernels",),
    ("plugins",),
    ("cache",),
    ("graphs",),
    ("config",),
    ("policies",),
    ("dispatch",),
    ("workloads",),
    ("engine",),
    ("integrations",),
    ("modelling",),
    ("planning",),
    ("bench",),
    ("report",),
    ("cli",),
    ("__main__",),
    ("attnpolicy",),
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
    for i, names in enumerate(LAYERS):
        if top(module) in names:
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
def tree(module: str) -> ast.Module:
    """The parsed source of ``module``."""
    path = modules()[module]
    return ast.parse(path.read_text(), str(path))


@cache
def graph(type_checking: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}; the imports under
    ``if TYPE_CHECKING:`` are edges only with ``type_checking``."""
    edges: dict[str, dict[str, int]] = {}
    for module in modules():
        out: dict[str, int] = {}
        skipped: set[int] = set()
        for node in ast.walk(tree(module)):
            if not type_checking and isinstance(node, ast.If) and _type_checking(node.test):
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
        for node in ast.walk(tree(module)):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                for target in _imported(module, node):
                    if target != module:
                        out.setdefault(target, node.lineno)
        edges[module] = out
    return edges


def top(module: str) -> str:
    """The top-level module or package of ``module`` (``attnpolicy`` for the package's own ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph() -> dict[str, set[str]]:
    """top-level package -> the top-level packages it imports, counting every import
    (module level, in a function, under ``TYPE_CHECKING``)."""
    edges: dict[str, set[str]] = {}
    for module, out in graph(type_checking=True).items():
        edges.setdefault(top(module), set()).update(top(t) for t in out if top(t) != top(module))
    return edges


def cycles(edges: dict[str, Iterable[str]] | None = None) -> list[list[str]]:
    """The cycles of ``edges`` (default: the module import graph): every strongly
    connected component of more than one node."""
    edges = graph() if edges is None else edges
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
    """Every import of a module from a higher layer (``TYPE_CHECKING`` ones too), as
    ``module:line -> imported``."""
    return [f"{m}:{line} -> {target}" for m, out in sorted(graph(type_checking=True).items())
            for target, line in sorted(out.items()) if layer(target) > layer(m)]


#: Calls that import or load what a string names: ``importlib.import_module``,
#: ``__import__``, ``importlib.util.find_spec``, ``pkgutil.resolve_name``, an entry
#: point's or a plugin manager's ``load``/``load_setuptools_entrypoints``, ``importlib.reload``.
LOADERS = frozenset({"import_module", "__import__", "find_spec", "resolve_name", "load",
                     "load_setuptools_entrypoints", "reload"})


def _named_module(node: ast.expr) -> str | None:
    """The package module a string literal names (``"attnpolicy.x.y"``, ``"attnpolicy.x:attr"``,
    or an f-string's literal ``"attnpolicy.x."`` head), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value.partition(":")[0]
    elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        text = str(node.values[0].value).rpartition(".")[0]
    else:
        return None
    return text if text.startswith("attnpolicy.") and text in modules() else None


def string_loads(module: str, source: ast.Module) -> list[str]:
    """In ``module`` (its parsed ``source``), when it calls a loader (:data:`LOADERS`),
    every string literal naming a module of a higher layer (a name it may load however
    the string reaches the call: a constant, a tuple of names, a dict of exports), as
    ``module:line -> named``."""
    calls = any(isinstance(n, ast.Call) and (getattr(n.func, "attr", None) in LOADERS
                                             or getattr(n.func, "id", None) in LOADERS) for n in ast.walk(source))
    if not calls:
        return []
    found = sorted((n.lineno, named) for n in ast.walk(source)
                   if (named := _named_module(n)) is not None and layer(named) > layer(module))
    return [f"{module}:{line} -> {named}" for line, named in found]


def upward_string_loads() -> list[str]:
    """:func:`string_loads` of every module of the package."""
    return [found for m in modules() for found in string_loads(m, tree(m))]


def mutual() -> list[str]:
    """Every two modules importing each other, at any level (module, function or
    ``TYPE_CHECKING``), as ``a:line <-> b:line``."""
    edges = graph(type_checking=True)
    return [f"{a}:{line} <-> {b}:{edges[b][a]}" for a, out in sorted(edges.items())
            for b, line in sorted(out.items()) if a < b and a in edges[b]]


#: Mutating methods of the builtin containers: calling one on ``x._name`` writes it.
MUTATORS = frozenset({"clear", "append", "update", "pop", "add", "remove", "setdefault", "extend", "insert",
                      "discard", "popitem"})

#: (module, attribute) written from outside its owner because a third-party API requires it.
FOREIGN_PRIVATE = {
    # HF transformers selects a model's attention implementation by its config's
    # ``_attn_implementation`` (what ``PreTrainedModel.set_attn_implementation`` writes)
    ("attnpolicy.engine.runner", "_attn_implementation"),
}


def _private(node: ast.expr) -> ast.Attribute | None:
    """``node`` as ``X._name`` (or ``X._name[...]``) with ``X`` not ``self``/``cls``, else None."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
        return None
    if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
        return None
    return node


def private_writes(module: ast.Module) -> list[tuple[int, str, str]]:
    """Every write of another object's private state in ``module``, as (line, attribute,
    code): an assignment, augmented assignment or ``del`` of ``X._name`` or
    ``X._name[...]``, a mutating method (:data:`MUTATORS`) called on ``X._name``, a
    ``setattr``/``delattr`` of a private name; ``X`` not ``self``/``cls``."""
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(module):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        while any(isinstance(t, ast.Tuple | ast.List | ast.Starred) for t in targets):
            targets = [e for t in targets for e in (
                t.elts if isinstance(t, ast.Tuple | ast.List) else [t.value] if isinstance(t, ast.Starred) else [t])]
        found += [(node.lineno, a.attr, ast.unparse(t)) for t in targets if (a := _private(t)) is not None]
        if not isinstance(node, ast.Call):
            continue
        func, args = node.func, node.args
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS and (a := _private(func.value)) is not None:
            found.append((node.lineno, a.attr, ast.unparse(node)))
        if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(args) >= 2
                and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)
                and _private(ast.Attribute(args[0], args[1].value)) is not None):
            found.append((node.lineno, args[1].value, ast.unparse(node)))
    return found


def foreign_writes() -> list[str]:
    """:func:`private_writes` of every module of the package, less :data:`FOREIGN_PRIVATE`,
    as ``module:line code``."""
    return [f"{m}:{line} {code}" for m in modules() for line, attr, code in private_writes(tree(m))
            if (m, attr) not in FOREIGN_PRIVATE]


#: Public names defined at the top of several modules on purpose, each with its reason.
SHARED_NAMES = {
    "attnpolicy_register_policies": "pluggy matches a hook implementation to its hookspec by name",
    "attnpolicy_register_evictions": "pluggy matches a hook implementation to its hookspec by name",
    "attnpolicy_register_kernels": "pluggy matches a hook implementation to its hookspec by name",
    "attnpolicy_register_compilers": "pluggy matches a hook implementation to its hookspec by name",
    "register": "one entry point per CLI subcommand module (attnpolicy.cli calls each one's register(subparsers)) "
                "and per integration (vLLM's plugin entry point names attnpolicy.integrations.vllm:register)",
}


def public_definitions() -> dict[str, list[str]]:
    """Public (no leading underscore) top-level function and class names of the package,
    each with the ``module:line`` of every definition (a function's ``@overload``
    signatures are not definitions)."""
    found: dict[str, list[str]] = {}
    for module in modules():
        for node in tree(module).body:
            if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith("_")
                    and not any(isinstance(d, ast.Name) and d.id == "overload" for d in node.decorator_list)):
                found.setdefault(node.name, []).append(f"{module}:{node.lineno}")
    return found


def test_the_graph_sees_lazy_imports_and_skips_type_checking():
    edges = graph()
    assert "attnpolicy.plugins.registry" in edges["attnpolicy.cache.eviction_registry"]  # module level
    assert "attnpolicy.plugins.registry" in edges["attnpolicy.plugins.kernels"]  # inside a function
    assert "attnpolicy.config" not in edges["attnpolicy.policies.base"]  # under TYPE_CHECKING only
    assert "attnpolicy.config" in graph(type_checking=True)["attnpolicy.policies.base"]  # counted when asked
    assert "attnpolicy.plugins.hookspecs" in edges["attnpolicy.policies.builtin"]  # a name from a package


def test_the_config_is_plain_data():
    """config.py resolves no names: it imports nothing from plugins/ or cache/."""
    assert [m for m in graph()["attnpolicy.config"] if m.startswith(("attnpolicy.plugins", "attnpolicy.cache"))] == []


def test_every_module_has_a_layer():
    for module in modules():
        layer(module)


def test_no_import_cycle():
    assert cycles() == []


def test_every_package_is_a_layer_of_its_own():
    """No two top-level packages share a layer: between any two, one is below the other."""
    assert [names for names in LAYERS if len(names) != 1] == []
    assert sorted({top(m) for m in modules()}) == sorted(n for names in LAYERS for n in names)  # none stale


def test_no_upward_import():
    assert upward() == []


def test_graph_code_covers_the_layers_up_to_graphs():
    """A stored graph's code identity hashes every layer a graph can run: ``graphs`` and
    everything below it."""
    from attnpolicy.core.code_identity import GRAPH_LAYERS

    below = [n for names in LAYERS[:layer("attnpolicy.graphs") + 1] for n in names]
    assert [n.removesuffix(".py") for n in GRAPH_LAYERS] == below


def test_no_two_packages_import_each_other_at_any_level():
    """The graph of top-level packages (every import counted, ``TYPE_CHECKING`` too) has no
    cycle: no package imports a package that imports it, directly or around a loop."""
    assert cycles(package_graph()) == []


def test_the_package_scan_sees_a_cycle():
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


def test_the_string_scan_sees_a_module_loaded_by_name():
    source = ast.parse("""
import importlib
NAMES = ("attnpolicy.policies.builtin", "attnpolicy.core.modes")
EXPORTS = {"Dispatcher": "attnpolicy.dispatch"}
LOG = "attnpolicy.policies"  # a package: named all the same
HOOK = f"attnpolicy.cli.{name}"
PATH = "attnpolicy.policies.builtin:Varlen"
NOT_A_MODULE = "attnpolicy.policies.nothing"
def load(name):
    return importlib.import_module(name)
""")
    assert string_loads("attnpolicy.plugins.registry", source) == [
        "attnpolicy.plugins.registry:3 -> attnpolicy.policies.builtin",
        "attnpolicy.plugins.registry:4 -> attnpolicy.dispatch",
        "attnpolicy.plugins.registry:5 -> attnpolicy.policies",
        "attnpolicy.plugins.registry:6 -> attnpolicy.cli",
        "attnpolicy.plugins.registry:7 -> attnpolicy.policies.builtin",
    ]
    assert string_loads("attnpolicy.cli.common", source) == []  # cli is above them all
    assert string_loads("attnpolicy.plugins.registry", ast.parse('NAMES = ("attnpolicy.policies.builtin",)')) == []


def test_no_module_loads_a_higher_layer_by_name():
    """A lower layer never reaches a higher one through a name in a string (a built-in
    plugin, an export): the higher layer hands it what it needs."""
    assert upward_string_loads() == []


def test_no_two_modules_import_each_other_at_any_level():
    """A module seeing another through a Protocol of its own imports nothing back: not at
    module level, not lazily in a function, not under ``TYPE_CHECKING``."""
    assert mutual() == []


def test_the_scan_sees_every_write_of_private_state():
    source = """
a._x = 1
a.b._x, c = 1, 2
a._x[k] += 1
del a._x
a._x.clear()
a._x[k].append(1)
setattr(a, "_x", 1)
delattr(a.b, "_x")
self._x = cls._x = 1
self._x.clear()
setattr(self, "_x", 1)
a.x = a.__x__ = 1
a._x.copy()
"""
    assert [line for line, _, _ in private_writes(ast.parse(source))] == [2, 3, 4, 5, 6, 7, 8, 9]


def test_no_code_writes_another_objects_private_state():
    """An object's private state changes only through its own methods (a public method
    of the owner does what another object needs)."""
    assert foreign_writes() == []


def test_layers_match_the_design_doc():
    text = (ROOT.parent / "docs" / "design.md").read_text()
    section = text.split("## Package layout", 1)[1].split("\n## ", 1)[0]
    for i, names in enumerate(LAYERS, start=1):
        line = next((ln for ln in section.splitlines() if ln.startswith(f"{i}. ")), "")
        assert line, f"docs/design.md Package layout has no layer {i}"
        assert any(f"`{n}" in line for n in names), f"layer {i} of docs/design.md is not {names}: {line}"


def test_no_public_name_is_defined_in_two_modules():
    """One name, one concept: a public function or class name is defined once in the
    package (the same meaning is one definition imported where needed; two meanings
    are two names), :data:`SHARED_NAMES` excepted."""
    defined = public_definitions()
    assert {n: where for n, where in defined.items() if len(where) > 1 and n not in SHARED_NAMES} == {}
    assert [n for n in SHARED_NAMES if len(defined.get(n, ())) < 2] == []  # no stale exception


def _type_variable(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) in (
        "TypeVar", "ParamSpec", "TypeVarTuple")


def public_constants(trees: dict[str, ast.Module] | None = None) -> dict[str, list[str]]:
    """Public UPPER_CASE names assigned at the top of each module (default: the
    package's; type variables aside), each with the ``module:line`` of every assignment."""
    trees = {m: tree(m) for m in modules()} if trees is None else trees
    found: dict[str, list[str]] = {}
    for module, source in trees.items():
        for node in source.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and not _type_variable(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                for name in names:
                    if isinstance(name, ast.Name) and name.id.isupper() and not name.id.startswith("_"):
                        found.setdefault(name.id, []).append(f"{module}:{node.lineno}")
    return found


def test_the_constant_scan_sees_a_constant_in_two_modules():
    found = public_constants({"a": ast.parse("KINDS = (1, 2)\nA, B = 1, 2\nT = TypeVar('T')\n_X = 1\nlower = 1"),
                              "b": ast.parse("KINDS: tuple[int, ...] = (1, 2)\nT = TypeVar('T')\n_X = 2")})
    assert {n: w for n, w in found.items() if len(w) > 1} == {"KINDS": ["a:1", "b:1"]}
    assert sorted(found) == ["A", "B", "KINDS"]


def test_no_constant_is_defined_in_two_modules():
    """One constant, one definition: a module-level UPPER_CASE name is assigned in one
    module of the package (the same value is imported where needed; two concepts are
    two names, each saying which)."""
    assert {n: where for n, where in public_constants().items() if len(where) > 1} == {}


#: Modules ``model_X`` allowed beside a module or package ``X``: none, one module holds a
#: concept at both levels; a new pair fails the test below.
MERGING_PAIRS: frozenset[str] = frozenset()


def model_pairs(names: Iterable[str] | None = None) -> list[str]:
    """Every module ``model_X`` of ``names`` (default: the package's modules) whose ``X``
    is also the name of a module or package there (anywhere), as ``model module <-> X modules``."""
    names = list(modules() if names is None else names)
    by_name: dict[str, list[str]] = {}
    for module in names:
        by_name.setdefault(module.rsplit(".", 1)[-1], []).append(module)
    return [f"{m} <-> {', '.join(by_name[x])}" for m in names
            if (x := m.rsplit(".", 1)[-1].removeprefix("model_")) != m.rsplit(".", 1)[-1] and x in by_name]


def test_no_module_is_a_model_copy_of_another():
    """A concept is one module serving both levels, not ``X.py`` and ``model_X.py``:
    no pair outside :data:`MERGING_PAIRS`, and no stale entry there."""
    pairs = model_pairs()
    assert [p for p in pairs if p.split(" <-> ")[0] not in MERGING_PAIRS] == []
    assert sorted(MERGING_PAIRS - {p.split(" <-> ")[0] for p in pairs}) == []  # no stale exception


def test_the_pair_scan_sees_a_pair():
    pairs = model_pairs(["a.sim", "a.b.model_sim", "a.graphs", "a.cli.model_graphs", "a.model_only"])
    assert pairs == ["a.b.model_sim <-> a.sim", "a.cli.model_graphs <-> a.graphs"]  # a package counts as X


def test_tests_live_in_rooms_and_share_helpers_not_test_modules():
    """Every test file stands in the room of what it tests (``tests/<room>/``); what tests of
    two rooms share is a helper module at ``tests/``, never another room's test module."""
    tests = ROOT.parent / "tests"
    assert not list(tests.glob("test_*.py")), "a test file outside the rooms"
    rooms = {path.stem: path.parent.name for path in tests.glob("*/test_*.py")}
    crossing = []
    for path in tests.glob("*/test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            crossing += [f"{path.relative_to(tests)} imports {name}" for name in names
                         if name in rooms and rooms[name] != path.parent.name]
    assert not crossing

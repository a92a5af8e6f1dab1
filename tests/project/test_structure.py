"""One pipeline over the graph families, read from the source: no function or class
that twins another under a family prefix, one place in the CLI that branches on
``--family`` (parsing it), and no code that learns the level from a cost model's type.

A *twin* is a pair of names defined in the package that differ only by ``model_``,
``_model`` or ``_step`` (``simulate`` and ``simulate_model``): one job written once per
family. Pairs that are different jobs sharing a word are listed in :data:`NOT_TWINS`,
each with what tells them apart.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "attnpolicy"
PREFIXES = ("model_", "_model", "_step")

#: Name pairs (by their common stem) that are two jobs, not one job per family.
NOT_TWINS: dict[str, str] = {
    "config": "model_config: the config a whole-model cost model implies; config: a source's config",
    "load": "load_model: builds a model from a spec; load: reads a file",
    "check": "check_model: a cost model against a config; check: a KV cache's slots",
    "layouts": "model_layouts: prefill batches of scheduled steps; layouts: a layout stream's",
    "fits": "model_fits: whether a cost file holds a source's fits; fits: the fits of a timing",
    "_size": "_step_size: a step's calibrated-range dimensions; _size: a cache entry's bytes",
    "cost": "cost_model: the model a dispatcher prices with; cost: a plan's priced total",
    "spec": "model_spec: parses a --model SPEC; spec: a tensor spec",
    "key_for": "model_key_for: the whole-model key rule; key_for: a planner's or runner's method using it",
    "why_illegal": "why_illegal_step: a step's legality (cached context); why_illegal: a prefill's",
    "write": "write_step: one step of a layout stream; write: a runtime's output",
    "_identity": "_step_identity: a vLLM step's identity; _identity: a call graph's stored identity",
    "priced": "the cost model a level is priced with: priced_model reads whole-model fits, which only a "
              "--cost-model file holds; priced falls back to this machine's cached calibration or the built-in model",
}


def _defined() -> dict[str, set[str]]:
    """Every function and class name defined in the package, with the modules defining it."""
    names: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name].add(module)
    return names


def _stem(name: str) -> str:
    for prefix in PREFIXES:
        name = name.replace(prefix, "")
    return name


def twins(names: dict[str, set[str]]) -> dict[str, list[str]]:
    """The names of ``names`` grouped by stem, where a stem has more than one name."""
    groups: dict[str, set[str]] = defaultdict(set)
    for name in names:
        groups[_stem(name)].add(name)
    return {stem: sorted(group) for stem, group in groups.items() if len(group) > 1}


def test_no_job_is_written_once_per_family():
    found = {stem: group for stem, group in twins(_defined()).items() if stem not in NOT_TWINS}
    assert not found, found


def test_every_listed_pair_still_exists():
    assert set(NOT_TWINS) <= set(twins(_defined())), set(NOT_TWINS) - set(twins(_defined()))


def test_the_twin_scan_finds_a_twin():
    assert twins({"simulate": {"m"}, "simulate_model": {"m"}, "run": {"m"}}) == {
        "simulate": ["simulate", "simulate_model"]}


def _family_branches(tree: ast.AST) -> int:
    """Comparisons of a ``family`` value with a family's name."""
    count = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any("family" in ast.unparse(side) for side in sides)
        literal = any(isinstance(side, ast.Constant) and side.value in ("model", "attention") for side in sides)
        count += named and literal
    return count


def test_the_cli_branches_on_the_family_in_one_place():
    places = {path.name: n for path in sorted((ROOT / "cli").glob("*.py"))
              if (n := _family_branches(ast.parse(path.read_text())))}
    assert list(places) == ["common.py"], places
    assert _family_branches(ast.parse("if family_of(args) == 'model': pass")) == 1


#: The cost models of the two levels: a level says its pricing and range check itself.
COST_MODELS = {"CostModel", "ModelCostModel"}


def _cost_model_branches(tree: ast.AST) -> list[str]:
    """``isinstance`` calls whose class (or one of a tuple's) is a level's cost model."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(ast.unparse(k).rsplit(".", 1)[-1] in COST_MODELS for k in kinds):
                found.append(ast.unparse(node))
    return found


def test_no_code_picks_the_level_by_the_cost_models_type():
    places = {str(path.relative_to(ROOT)): found for path in sorted(ROOT.rglob("*.py"))
              if (found := _cost_model_branches(ast.parse(path.read_text())))}
    assert not places, places
    assert _cost_model_branches(ast.parse("if isinstance(m, (int, costmodel.ModelCostModel)): pass")) == [
        "isinstance(m, (int, costmodel.ModelCostModel))"]

"""The glossary in docs/design.md names the code as it is: every backticked name in an
entry is defined in the package (a class, function, constant, field or member, with
each dotted part a member of the one before), every path exists, every CLI flag and
value is one the package parses, so renaming code without the glossary fails here."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

from test_layering import modules, tree

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "attnpolicy"
IDENTIFIER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(\(.*\))?")


def glossary() -> dict[str, list[str]]:
    """Each glossary entry's terms (its bold words) and the code names it backticks."""
    text = (ROOT / "docs/design.md").read_text()
    section = text.split("\n## Glossary\n", 1)[1].split("\n## ", 1)[0]
    entries = {}
    for entry in re.findall(r"^- (.+)$", section, re.MULTILINE):
        terms = ", ".join(re.findall(r"\*\*(.+?)\*\*", entry))
        entries[terms] = re.findall(r"`([^`]+)`", entry)
    return entries


class Package:
    """What the package's source defines, read from its syntax trees."""

    def __init__(self) -> None:
        self.modules: dict[str, set[str]] = {}  # dotted module -> names defined or imported at its top
        self.members: defaultdict[str, set[str]] = defaultdict(set)  # class name -> its members
        self.bases: defaultdict[str, set[str]] = defaultdict(set)  # class name -> its bases' names
        self.strings: set[str] = set()  # string constants that are not docstrings
        for module in modules():
            source = tree(module)
            self.modules[module] = self._top_names(source)
            docstrings = {id(node.body[0].value) for node in ast.walk(source)
                          if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                          and node.body and isinstance(node.body[0], ast.Expr)
                          and isinstance(node.body[0].value, ast.Constant)}
            for node in ast.walk(source):
                if isinstance(node, ast.ClassDef):
                    self._class(node)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    self.strings.add(node.value)
        self.defined = {name for names in self.modules.values() for name in names} | set(self.members)
        self.any_member = {name for names in self.members.values() for name in names}

    @staticmethod
    def _top_names(tree: ast.Module) -> set[str]:
        names = set()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.ImportFrom | ast.Import):
                names |= {a.asname or a.name.split(".")[0] for a in node.names}
        return names

    def _class(self, node: ast.ClassDef) -> None:
        members = self.members[node.name]
        self.bases[node.name] |= {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                                  if isinstance(b, ast.Name | ast.Attribute)}
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                members.add(item.name)
                members |= {t.attr for n in ast.walk(item) if isinstance(n, ast.Assign | ast.AnnAssign)
                            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
            elif isinstance(item, ast.Assign | ast.AnnAssign):
                targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                members |= {t.id for t in targets if isinstance(t, ast.Name)}

    def member(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
        """Whether class ``cls`` (or one of its bases) has ``name``."""
        return name in self.members.get(cls, ()) or any(
            self.member(base, name, seen | {cls}) for base in self.bases.get(cls, ()) if base not in seen)

    def dotted(self, parts: list[str]) -> bool:
        """A module path, then a name at its top, then members of each name before."""
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in self.modules:
                rest = parts[cut:]
                if rest and rest[0] not in self.modules[module]:
                    return False
                return all(self.member(a, b) for a, b in zip(rest, rest[1:]))
        return False

    def knows(self, token: str) -> bool:
        """Whether ``token``, a glossary's backticked code, names something in the package."""
        words = token.split()
        if words[0].startswith("--"):  # a flag and its values
            return all(w in self.strings for w in [words[0], *(v for w in words[1:] for v in w.split("|"))])
        if words[0] == "attnpolicy" and len(words) > 1:  # a subcommand
            return all(w in self.strings for w in words[1:])
        if "/" in token or token.endswith((".py", ".json")):  # a path, or a file the package writes
            return (PACKAGE / token).exists() or (ROOT / token).exists() or any(token in s for s in self.strings)
        if not IDENTIFIER.fullmatch(token):  # a format, such as module:function
            return any(token in s for s in self.strings)
        parts = token.split("(", 1)[0].split(".")
        if self.dotted(parts) or self.dotted(["attnpolicy", *parts]):
            return True
        head, rest = parts[0], parts[1:]
        if head not in self.defined and head not in self.any_member:
            return not rest and head in self.strings  # a value, such as a call kind's
        return all(self.member(a, b) for a, b in zip(parts, rest))


@cache
def package() -> Package:
    return Package()


def test_every_glossary_entry_names_code_that_exists():
    entries = glossary()
    assert len(entries) >= 20 and all(entries.values()), entries  # the section was found and parsed
    missing = [(terms, token) for terms, tokens in entries.items() for token in tokens if not package().knows(token)]
    assert not missing, f"glossary names not in the package: {missing}"


def test_the_check_refuses_names_that_do_not_exist():
    known = package().knows
    assert known("WarmSet") and known("Dispatcher.prepare") and known("dispatch.Step") and known("dispatch/family.py")
    assert known("--family attention|model") and known("causal") and known("PeerWarmSet.scheme")
    for stale in ("WarmSets", "Planner.plan", "Dispatcher.no_such_method", "dispatch.NoSuchStep",
                  "dispatch/no_such.py", "--no-such-flag", "--family attention|no-such-level", "engine.keys.CallKey"):
        assert not known(stale), stale

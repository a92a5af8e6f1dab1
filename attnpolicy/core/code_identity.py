"""Code identities: what a stored graph's ``code_hash`` covers (docs/store.md, "What
makes an artifact valid").

A graph is valid only as long as every line of code it runs is unchanged, so an
identity hashes source files, not one function:

- :func:`graph_code`: attnpolicy's own modules a graph can run, every module of the
  layers at and below ``graphs/`` (``errors``, ``core``, ``kernels``, ``plugins``,
  ``cache``, ``graphs``): ``tests/project/test_layering.py`` keeps graph code from importing
  anything above them;
- :func:`module_code`: a model's module and every module of its top-level package
  that its globals reach (transitively), with that package's installed version;
- :func:`callable_code`: a plugin kernel: every source file of its top-level package,
  that package's installed version, and :func:`stable_repr` of what the function
  captures (closure cells, defaults, the plain-data globals it names). Code outside
  that package is covered by torch's version (part of every identity) or, for any other
  library, by a ``version`` the kernel declares.

Each is computed once per process (per module or function object). A value with no
stable rendering, or code with no source, raises :class:`~attnpolicy.errors.ConfigError`
saying which: the caller compiles such a graph and does not store it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterable
from pathlib import Path

from attnpolicy.errors import ConfigError

_PACKAGE = Path(__file__).resolve().parents[1]
#: The attnpolicy layers graph code lives in and may import (docs/design.md, "Package layout").
GRAPH_LAYERS = ("errors.py", "core", "kernels", "plugins", "cache", "graphs")
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_DATA = (*_PLAIN, enum.Enum, tuple, list, dict, set, frozenset)


def _digest(items: Iterable[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in items:
        for part in (name.encode(), data):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()[:16]


def _sources(root: Path, paths: Iterable[Path]) -> list[tuple[str, bytes]]:
    """``(path relative to root, bytes)`` of every ``.py`` file of ``paths`` (files or trees), sorted."""
    files = sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py"))})
    return [(f.relative_to(root).as_posix(), f.read_bytes()) for f in files]


@functools.cache
def graph_code() -> str:
    """The hash of attnpolicy's modules a graph can run (:data:`GRAPH_LAYERS`)."""
    return _digest(_sources(_PACKAGE, [_PACKAGE / name for name in GRAPH_LAYERS]))


def distribution_version(top: str) -> str:
    """``name==version`` of the installed distribution named like package ``top``, or ``""``."""
    for name in dict.fromkeys((top, top.replace("_", "-"))):
        try:
            return f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def reached(root: types.ModuleType, top: str) -> list[types.ModuleType]:
    """``root`` and every module of package ``top`` its globals reach, transitively: a
    module global, or the module that defines a global function, class or object. A
    package's ``__init__`` counts by its own file; its namespace is not followed (it
    grows with every submodule anyone imports)."""
    found = {root.__name__: root}
    todo = [root]
    while todo:
        module = todo.pop()
        if module is not root and hasattr(module, "__path__"):
            continue
        for value in list(vars(module).values()):
            try:
                name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            except Exception:  # a lazy object that fails to resolve: nothing the model runs
                continue
            if isinstance(name, str) and name not in found and (name == top or name.startswith(top + ".")):
                target = sys.modules.get(name)
                if isinstance(target, types.ModuleType):
                    found[name] = target
                    todo.append(target)
    return sorted(found.values(), key=lambda m: m.__name__)


def _file(module: types.ModuleType, required: bool = True) -> tuple[str, bytes]:
    """``(name, bytes)`` of a module's Python file (an extension module: its name only;
    none, where not ``required``: its name only)."""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        if required:
            raise ConfigError(f"module {module.__name__} has no source file to hash")
        return module.__name__, b""
    return module.__name__, Path(path).read_bytes() if path.endswith((".py", ".pyc")) else b""


@functools.cache
def module_code(name: str) -> str:
    """The hash of module ``name`` (imported), the modules of its top-level package it
    reaches (:func:`reached`), and that package's installed version."""
    top = name.partition(".")[0]
    root = sys.modules[name]
    items = [_file(m, m is root) for m in reached(root, top)]
    return _digest([*items, ("version", distribution_version(top).encode())])


def _package_sources(top: str) -> list[tuple[str, bytes]]:
    """Every ``.py`` file of the imported top-level package (or module) ``top``."""
    module = sys.modules.get(top)
    if module is None:
        raise ConfigError(f"module {top} is not imported")
    paths = sorted(Path(p) for p in getattr(module, "__path__", ()))
    return [item for p in paths for item in _sources(p.parent, [p])] if paths else [_file(module)]


_callables: dict[int, tuple[object, str | ConfigError]] = {}
_callables_lock = threading.Lock()


def callable_code(fn: Callable[..., object]) -> str:
    """The hash of a plugin kernel ``fn``: its top-level package's source files, that
    package's installed version and :func:`stable_repr` of ``fn`` (computed once per
    function object, a refusal too)."""
    with _callables_lock:
        held = _callables.get(id(fn))
    if held is None or held[0] is not fn:
        module = getattr(fn, "__module__", None) or type(fn).__module__
        top = module.partition(".")[0]
        code: str | ConfigError
        try:
            code = _digest([*_package_sources(top), ("version", distribution_version(top).encode()),
                            ("captured", stable_repr(fn).encode())])
        except ConfigError as e:
            code = e
        held = fn, code
        with _callables_lock:
            _callables[id(fn)] = held  # the function is kept: its id is not reused
    if isinstance(held[1], ConfigError):
        raise ConfigError(str(held[1]))
    return held[1]


def stable_repr(value: object) -> str:
    """A rendering of ``value`` equal in every process where the value is: plain data
    (scalars, strings, containers, enums, dataclass instances, torch dtypes and devices),
    modules and classes by name, functions by name, source and what they capture
    (closure cells and defaults, which must render too; the globals they name, where
    those are plain data). Anything else raises :class:`ConfigError` naming it."""
    try:
        return _render(value, set())
    except RecursionError:
        raise ConfigError(f"{type(value).__qualname__} is nested too deeply to render") from None


def _qualified(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _render(value: object, active: set[int]) -> str:
    if isinstance(value, enum.Enum):
        return f"enum {_qualified(type(value))}.{value.name}"
    if isinstance(value, _PLAIN):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type):
        return f"class {_qualified(value)}"
    if type(value).__module__ == "torch" and type(value).__name__ in ("dtype", "device"):
        return f"torch {value}"
    if isinstance(value, types.BuiltinFunctionType):
        return f"builtin {_qualified(value)}"
    if id(value) in active:
        return "cycle"
    active.add(id(value))
    try:
        return _render_composite(value, active)
    finally:
        active.discard(id(value))


def _render_composite(value: object, active: set[int]) -> str:
    def each(items: Iterable[object]) -> list[str]:
        return [_render(v, active) for v in items]

    if isinstance(value, tuple | list):
        return f"{type(value).__name__}[{','.join(each(value))}]"
    if isinstance(value, set | frozenset):
        return f"{type(value).__name__}[{','.join(sorted(each(value)))}]"
    if isinstance(value, dict):
        return f"dict[{','.join(sorted(f'{_render(k, active)}:{_render(v, active)}' for k, v in value.items()))}]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = (f"{f.name}={_render(getattr(value, f.name), active)}" for f in dataclasses.fields(value))
        return f"dataclass {_qualified(type(value))}({','.join(fields)})"
    if isinstance(value, functools.partial):
        return f"partial({_render(value.func, active)},{_render(value.args, active)},{_render(value.keywords, active)})"
    if isinstance(value, types.MethodType):
        return f"method {_render(value.__func__, active)} of {_render(value.__self__, active)}"
    if isinstance(value, types.FunctionType):
        return _render_function(value, active)
    raise ConfigError(f"it captures a {type(value).__qualname__}, which has no stable identity (plain data, "
                      "functions, classes and modules have one)")


def _render_function(fn: types.FunctionType, active: set[int]) -> str:
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError) as e:
        raise ConfigError(f"function {fn.__qualname__} has no source to hash ({e})") from None
    code = fn.__code__
    parts = [f"function {_qualified(fn)}", source]
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not yet assigned
            parts.append(f"{name} empty")
            continue
        parts.append(f"{name}={_render(contents, active)}")
    parts += [_render(fn.__defaults__, active), _render(fn.__kwdefaults__, active)]
    for name in sorted(_global_names(code) & fn.__globals__.keys()):
        value = fn.__globals__[name]
        if isinstance(value, _DATA) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
            try:  # plain data the code reads; other globals are what the source defines
                parts.append(f"{name}={_render(value, active)}")
            except ConfigError:
                continue
    return "\n".join(parts)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names

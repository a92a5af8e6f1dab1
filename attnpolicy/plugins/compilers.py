"""Compilers as plugins: what compiles a graph behind the graph cache, and what it declares.

A config's ``backend`` names a compiler; :func:`resolve_compiler` resolves the name, in
this order:

1. a compiler registered through the ``attnpolicy_register_compilers(register)`` hook
   (``register(CompilerInfo(...))``): the built-ins ``inductor``, ``aot_eager``, ``eager``
   and ``none`` (nothing compiled) register through it too
   (:mod:`attnpolicy.plugins.builtin_compilers`), by name alone;
2. ``module:attribute`` (``attribute`` may be dotted): a backend callable with Dynamo's
   contract, ``backend(gm, example_inputs, **options) -> callable``, which declares
   nothing, or a :class:`CompilerInfo`, which declares what it does;
3. a Dynamo backend registered under that name
   (``torch._dynamo.list_backends(exclude_tags=())``; a runtime's own, registered with
   ``torch._dynamo.register_backend``), which declares nothing.

Anything else is one :class:`~attnpolicy.errors.ConfigError` naming the field, the value
and the known names. A registered or built-in name loads no torch; the other two load
what they name (the Dynamo lookup loads torch).

What a compiler declares (:class:`CompilerInfo`), and what attnpolicy does without it:

- ``release(compiled)``: frees one graph's compiled executable (called with what its
  backend returned, on eviction). Without it the cache frees its own references (and
  Dynamo's code cache entries of the graph), whatever the compiler keeps besides;
- ``device_bytes(compiled)``: the bytes one compiled graph holds on its device; the cache
  bounds those. Without it the cache bounds the bytes it computes from the key;
- ``compiles()``: the compiler's own count of compiles so far (process-wide), reported
  beside the count attnpolicy's wrapper around the backend sees;
- ``storable``: its graphs compiled ahead of time (torch's ``aot_compile``) can be saved
  and reloaded, so a graph store keeps them, keyed by the compiler's identity
  (:func:`compiler_identity`: name, version, code, options). Without it, graphs are
  compiled and not stored (one warning, counted in the store's ``unstorable``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from attnpolicy.core.code_identity import callable_code, stable_repr
from attnpolicy.core.names import BACKENDS
from attnpolicy.errors import ConfigError, PluginError

#: The built-in compilers' names: they register first, without a backend callable
#: (Dynamo's backend of that name; ``none`` compiles nothing), so no plugin can take one.
BUILTIN_COMPILERS = frozenset(BACKENDS)
#: The built-in compilers whose compiled code a graph calls directly, without Dynamo's
#: per-call frame evaluation (:func:`attnpolicy.graphs.compile.compile_graph`).
DIRECT = frozenset({"inductor", "aot_eager", "eager"})


@dataclass(frozen=True)
class CompilerInfo:
    """One compiler: its name (what a config's ``backend`` says), its Dynamo backend and
    what it declares (see the module docstring).

    ``backend``: ``backend(gm, example_inputs, **options) -> callable``; ``None``: the
    Dynamo backend registered under ``name``. ``version``: the compiler's own version,
    part of its stored graphs' identity beside its package's source (give one when it
    runs code of another library). ``release``, ``device_bytes`` and ``compiles``: see
    the module docstring; each may be ``None``."""

    name: str
    backend: Callable[..., Any] | None = None
    version: str = ""
    release: Callable[[Any], None] | None = None
    device_bytes: Callable[[Any], int] | None = None
    compiles: Callable[[], int] | None = None
    storable: bool = False
    description: str = ""
    plugin: str = field(default="", compare=False)

    @property
    def builtin(self) -> bool:
        """Whether this is one of attnpolicy's built-in compilers."""
        return self.name in BUILTIN_COMPILERS and self.backend is None

    @property
    def direct(self) -> bool:
        """Whether its graphs are called directly, without Dynamo (:data:`DIRECT`)."""
        return self.builtin and self.name in DIRECT

    def dynamo_backend(self) -> Callable[..., Any]:
        """The backend callable: ``backend``, else Dynamo's backend named ``name``."""
        if self.backend is not None:
            return self.backend
        import torch._dynamo

        found: Callable[..., Any] = torch._dynamo.lookup_backend(self.name)
        return found


def register_builtin_compilers(register: Callable[[CompilerInfo], None]) -> None:
    """Register the built-in compilers (what :mod:`attnpolicy.plugins.builtin_compilers`'
    hook implementation calls): their graphs are stored (torch's version, part of every
    identity, covers their code); ``none`` compiles nothing."""
    for name, text in _BUILTIN_DESCRIPTIONS.items():
        register(CompilerInfo(name, storable=name != "none", description=text))


_BUILTIN_DESCRIPTIONS = {
    "inductor": "torch.compile's default: generated C++ (CPU) or Triton (GPU) code",
    "aot_eager": "AOTAutograd's traced graph, run eagerly",
    "eager": "Dynamo's traced graph, run eagerly",
    "none": "nothing compiled: the plain function",
}


def _compiler_adder(plugin: str, registry: dict[Any, Any],
                    staged: dict[Any, Any]) -> Callable[[CompilerInfo], None]:
    def register(info: CompilerInfo) -> None:
        if not isinstance(info, CompilerInfo):
            raise PluginError(f"plugin {plugin!r} registered {info!r}, not a CompilerInfo")
        name = info.name
        if not isinstance(name, str) or not name.strip() or ":" in name:
            raise PluginError(f"plugin {plugin!r} registered a compiler named {name!r}: a name is a non-empty "
                              "str without ':' (a ':' names a module:function path)")
        holder = registry.get(name) or staged.get(name)
        if holder is not None:
            raise PluginError(f"compiler {name!r} is registered by two plugins: {holder.plugin!r} and {plugin!r}")
        for what in ("backend", "release", "device_bytes", "compiles"):
            value = getattr(info, what)
            if value is not None and not callable(value):
                raise PluginError(f"plugin {plugin!r}: compiler {name!r} has {what} {value!r}, not callable")
        if not isinstance(info.version, str) or not isinstance(info.storable, bool):
            raise PluginError(f"plugin {plugin!r}: compiler {name!r} needs a str version and a bool storable, got "
                              f"{info.version!r} and {info.storable!r}")
        staged[name] = dataclasses.replace(info, plugin=plugin)
    return register


def compiler_registry() -> dict[str, CompilerInfo]:
    """Every registered compiler by name, cached until the plugins change. Built like the
    policy registry: plugin by plugin, a failing third-party plugin rejected alone."""
    from attnpolicy.plugins.registry import cached_registry

    return cached_registry("attnpolicy_register_compilers", "compilers", _compiler_adder)


def _dynamo_backends() -> list[str]:
    import torch._dynamo

    names: list[str] = torch._dynamo.list_backends(exclude_tags=())
    return names


def _from_path(path: str) -> CompilerInfo:
    """The compiler ``module:attribute`` names: a :class:`CompilerInfo` (named ``path``) or
    a backend callable."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ConfigError(f"backend {path!r} is not a module:function path (one ':' between a module and an "
                          "attribute)")
    try:
        found: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except Exception as e:  # an import that fails, an attribute that is not there
        raise ConfigError(f"backend {path!r}: {type(e).__name__}: {e}") from None
    if isinstance(found, CompilerInfo):
        return dataclasses.replace(found, name=path, plugin=module_name)
    if callable(found):
        return CompilerInfo(path, backend=found, plugin=module_name, description="a backend callable")
    raise ConfigError(f"backend {path!r} names an object of type {type(found).__name__}, not a backend callable "
                      "(backend(gm, example_inputs, **options) -> callable) or a CompilerInfo")


def resolve_compiler(name: str) -> CompilerInfo:
    """The compiler a config's ``backend`` names (the order is the module docstring's), or
    :class:`~attnpolicy.errors.ConfigError` naming the field, the value and the known names."""
    info = compiler_registry().get(name)
    if info is not None:
        return info
    if ":" in name:
        return _from_path(name)
    dynamo = _dynamo_backends()
    if name in dynamo:
        return CompilerInfo(name, plugin="torch._dynamo", description="a Dynamo backend")
    known = ", ".join(dict.fromkeys([*compiler_registry(), *dynamo]))
    raise ConfigError(f"backend {name!r} is not a registered compiler, a Dynamo backend or a module:function "
                      f"path; known: {known}")


def compiler_identity(info: CompilerInfo, options: Mapping[str, Any]) -> str:
    """What identifies ``info``'s stored graphs compiled with ``options``: its name, its
    version, the code of a backend callable of its own
    (:func:`~attnpolicy.core.code_identity.callable_code`; a built-in's or a Dynamo
    backend's code is torch's, whose version every identity holds) and the options.
    Raises :class:`ConfigError` naming the compiler when that has no stable identity."""
    try:
        code = "" if info.backend is None else callable_code(info.backend)
        return repr((info.name, info.version, code, stable_repr(dict(options))))
    except ConfigError as e:
        raise ConfigError(f"compiler {info.name!r}: {e}") from None


def why_unstored(info: CompilerInfo, options: Mapping[str, Any]) -> tuple[str | None, str, str]:
    """``(identity, "", "")`` of ``info``'s graphs compiled with ``options`` when a graph
    store keeps them (:func:`compiler_identity`); else ``(None, why, counter)``: why they
    are compiled and not stored, and the store counter that counts them (``unstorable``:
    the compiler declares no reloadable artifacts; ``unidentified``: its code or options
    have no stable identity)."""
    if not info.storable:
        return None, (f"compiler {info.name!r} declares no artifacts that can be stored and reloaded "
                      "(CompilerInfo.storable)"), "unstorable"
    try:
        return compiler_identity(info, options), "", ""
    except ConfigError as e:
        return None, str(e), "unidentified"


def own_count(info: CompilerInfo) -> int | None:
    """The compiler's own count of compiles now (``None`` where it declares none); a
    count that is not an int >= 0 is a :class:`~attnpolicy.errors.PluginError`."""
    if info.compiles is None:
        return None
    n = info.compiles()
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise PluginError(f"compiler {info.name!r}: compiles() returned {n!r}, not an int >= 0")
    return n

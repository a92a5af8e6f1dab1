"""The plugin manager and the registries of policies and eviction strategies
(:func:`cached_registry` builds those, the kernel and the compiler registries alike).

Built-in plugins (:data:`BUILTIN_PLUGINS`) register through the same hooks as
third-party plugins, which are found through the ``attnpolicy`` entry-point group
the first time the manager is needed. ``ATTNPOLICY_LOAD_PLUGINS`` (comma-separated
entry-point names) restricts which entry points load: unset loads all, set but
empty loads none.

One bad plugin never disables the others. A third-party plugin that fails to load,
whose register hook raises, or that registers a name another plugin (a built-in
first) already holds is rejected alone: it is unregistered, logged once as a
one-line warning on the ``attnpolicy.plugins`` logger, and listed by
:func:`~attnpolicy.plugins.resolve.failed_plugins`; every other plugin stays usable. A *built-in* plugin that
fails is a bug in attnpolicy: :class:`PluginError`.

The register hooks are called through ``pm.hook`` (one plugin at a time, with
:meth:`pluggy.PluginManager.subset_hook_caller`), so pluggy's argument pruning,
tracing and hook wrappers apply, and an error is attributed to its plugin.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any

import cachetools
import pluggy

from attnpolicy.errors import ConfigError, PluginError, PolicyError
from attnpolicy.plugins import hookspecs

BUILTIN_PLUGINS = ("attnpolicy.policies.builtin", "attnpolicy.cache.evictions", "attnpolicy.policies.costaware",
                   "attnpolicy.plugins.builtin_kernels", "attnpolicy.plugins.builtin_compilers")
ENTRY_POINT_GROUP = "attnpolicy"
LOAD_PLUGINS_ENV = "ATTNPOLICY_LOAD_PLUGINS"

log = logging.getLogger("attnpolicy.plugins")


@dataclass(frozen=True)
class PolicyInfo:
    """A registered policy class and the plugin that registered it."""

    name: str
    plugin: str
    description: str
    cls: type


@dataclass(frozen=True)
class EvictionInfo:
    """A registered eviction strategy: ``factory()`` returns an empty ``cachetools.Cache``."""

    name: str
    plugin: str
    factory: Callable[..., Any]


_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_failed: dict[str, str] = {}
# Registries by hook name, each cached with the hook implementations it was built from.
_registries: dict[str, tuple[tuple[object, ...], dict[Any, Any]]] = {}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (built on first use)."""
    global _pm
    with _lock:
        if _pm is None:
            _pm = _build()
        return _pm


def reset_plugin_manager() -> None:
    """Forget the manager, its registries and failures; the next use rebuilds them
    from scratch (re-reading ``ATTNPOLICY_LOAD_PLUGINS``). Meant for tests."""
    global _pm
    with _lock:
        _pm = None
        _registries.clear()
        _failed.clear()


def rejected_plugins() -> Mapping[str, str]:
    """The plugins rejected so far, by the registries built so far: plugin name -> what
    went wrong (:func:`attnpolicy.plugins.resolve.failed_plugins` builds every registry first)."""
    with _lock:
        return MappingProxyType(dict(_failed))


def _fail(name: str, message: str) -> None:
    """Record a rejected plugin; logged once per plugin (one line, no traceback)."""
    if name not in _failed:
        log.warning("%s", message)
    _failed[name] = message


def _register(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register one plugin, undoing it if its hook implementations do not match the specs."""
    pm.register(plugin, name=name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError:
        pm.unregister(name=name)
        raise


def _build() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for module_name in BUILTIN_PLUGINS:
        try:
            _register(pm, importlib.import_module(module_name), module_name)
        except Exception as exc:
            raise PluginError(f"built-in plugin {module_name!r} failed to load: "
                              f"{type(exc).__name__}: {exc}") from exc

    env = os.environ.get(LOAD_PLUGINS_ENV)
    wanted = None if env is None else {n.strip() for n in env.split(",") if n.strip()}
    found = set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if wanted is not None and ep.name not in wanted:
            continue
        found.add(ep.name)
        try:
            _register(pm, ep.load(), ep.name)
        except Exception as exc:
            _fail(ep.name, f"attnpolicy plugin {ep.name!r} (entry point {ep.name} = {ep.value}) failed to "
                           f"load: {type(exc).__name__}: {exc}")
    for missing in sorted((wanted or set()) - found):
        log.warning("%s names %r but no %r entry point has that name", LOAD_PLUGINS_ENV, missing,
                    ENTRY_POINT_GROUP)
    return pm


def _impls(pm: pluggy.PluginManager, hook_name: str) -> list[Any]:
    return list(getattr(pm.hook, hook_name).get_hookimpls())


def _signature(impls: list[Any]) -> tuple[object, ...]:
    return tuple((impl.plugin_name, impl.function) for impl in impls)


def _per_plugin(pm: pluggy.PluginManager, hook_name: str) -> Iterator[tuple[str, Any]]:
    """``(plugin name, hook caller)`` for each plugin implementing ``hook_name``, built-ins
    first: the caller is ``pm.hook``'s with every other plugin's implementation
    removed (hook wrappers stay)."""
    impls = [i for i in _impls(pm, hook_name) if not (i.hookwrapper or i.wrapper)]
    impls.sort(key=lambda i: i.plugin_name not in BUILTIN_PLUGINS)  # stable: registration order
    for impl in impls:
        others = [o.plugin for o in impls if o is not impl]
        yield impl.plugin_name, pm.subset_hook_caller(hook_name, remove_plugins=others)


def _collect(pm: pluggy.PluginManager, hook_name: str, what: str,
             add: Callable[[str, dict[str, Any], dict[str, Any]], Callable[..., None]]) -> dict[str, Any]:
    """Run ``hook_name`` plugin by plugin into one registry. ``add(plugin, registry,
    staged)`` makes the ``register`` callback of one plugin, which stages its entries;
    a plugin's entries are committed only when its hook returned. A failing
    third-party plugin is rejected (unregistered, recorded); a built-in raises."""
    registry: dict[str, Any] = {}
    rejected: list[str] = []
    for plugin, call in _per_plugin(pm, hook_name):
        staged: dict[str, Any] = {}
        try:
            call(register=add(plugin, registry, staged))
        except Exception as exc:
            detail = str(exc) if isinstance(exc, PluginError) else (
                f"plugin {plugin!r}: its {hook_name} hook raised {type(exc).__name__}: {exc}")
            if plugin in BUILTIN_PLUGINS:
                raise PluginError(detail) from exc
            _fail(plugin, f"attnpolicy plugin {plugin!r} rejected ({what}): {detail}")
            rejected.append(plugin)
            continue
        registry.update(staged)
    for plugin in rejected:
        pm.unregister(name=plugin)
    return registry


def _check_policy_class(plugin: str, cls: object) -> None:
    if not isinstance(cls, type):
        raise PluginError(f"plugin {plugin!r} registered {cls!r}, which is not a class")
    for attr in ("name", "description"):
        value = getattr(cls, attr, None)
        if not isinstance(value, str) or not value:
            raise PluginError(
                f"plugin {plugin!r}: policy class {cls.__qualname__} needs a non-empty str "
                f"class attribute {attr!r}, got {value!r}"
            )
    if not callable(getattr(cls, "decide", None)):
        raise PluginError(f"plugin {plugin!r}: policy class {cls.__qualname__} has no decide() method")


def _policy_adder(plugin: str, registry: dict[str, Any], staged: dict[str, Any]) -> Callable[[type], None]:
    def register(cls: type) -> None:
        _check_policy_class(plugin, cls)
        name: str = cls.name  # type: ignore[attr-defined]  # checked above
        holder = registry.get(name) or staged.get(name)
        if holder is not None:
            raise PluginError(f"policy {name!r} is registered by two plugins: "
                              f"{holder.plugin!r} and {plugin!r}")
        staged[name] = PolicyInfo(name, plugin, cls.description, cls)  # type: ignore[attr-defined]
    return register


def _eviction_adder(plugin: str, registry: dict[str, Any],
                    staged: dict[str, Any]) -> Callable[[str, Callable[..., Any]], None]:
    def register(name: str, factory: Callable[..., Any]) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered an eviction with name {name!r}")
        if not callable(factory):
            raise PluginError(f"plugin {plugin!r}: eviction {name!r} factory {factory!r} is not callable")
        holder = registry.get(name) or staged.get(name)
        if holder is not None:
            raise PluginError(f"eviction {name!r} is registered by two plugins: "
                              f"{holder.plugin!r} and {plugin!r}")
        staged[name] = EvictionInfo(name, plugin, factory)
    return register


def cached_registry(hook_name: str, what: str, add: Callable[[str, dict[Any, Any], dict[Any, Any]],
                                                               Callable[..., None]],
                    on_build: Callable[[dict[Any, Any]], None] | None = None) -> dict[Any, Any]:
    """The registry :func:`_collect` builds from ``hook_name``, cached until the set of
    implementations of that hook changes; ``on_build(registry)`` runs once per build.
    Returns a copy."""
    with _lock:
        pm = get_plugin_manager()
        signature = _signature(_impls(pm, hook_name))
        cached = _registries.get(hook_name)
        if cached is not None and cached[0] == signature:
            return dict(cached[1])
        registry = _collect(pm, hook_name, what, add)
        if on_build is not None:
            on_build(registry)
        _registries[hook_name] = (signature, registry)
        return dict(registry)


def policy_registry() -> dict[str, PolicyInfo]:
    """Every registered policy by name (cached until the set of plugins changes)."""
    return cached_registry("attnpolicy_register_policies", "policies", _policy_adder)


def eviction_registry() -> dict[str, EvictionInfo]:
    """Every registered eviction strategy by name (cached until the set of plugins changes)."""
    return cached_registry("attnpolicy_register_evictions", "evictions", _eviction_adder)


def get_policy_info(name: str) -> PolicyInfo:
    """The registered policy ``name``, or :class:`PolicyError` listing the known names
    (and the rejected plugins, one of which may have meant to provide it)."""
    registry = policy_registry()
    try:
        return registry[name]
    except KeyError:
        rejected = f"; rejected plugins: {', '.join(sorted(_failed))}" if _failed else ""
        raise PolicyError(
            f"policy {name!r} is not a registered policy; known policies: "
            f"{', '.join(sorted(registry)) or '(none)'}{rejected}"
        ) from None


def make_policy(name: str, **options: Any) -> Any:
    """Build the registered policy ``name`` with keyword ``options`` (the config's
    ``policy_options``): an instance of its class, which implements the policies
    layer's ``Policy`` protocol. Errors are :class:`PolicyError` naming the field and value."""
    info = get_policy_info(name)
    try:
        return info.cls(**options)
    except Exception as exc:
        raise PolicyError(
            f"policy {name!r} (plugin {info.plugin!r}) rejected policy_options {options!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def make_eviction(name: str, options: dict[str, Any] | None = None) -> cachetools.Cache[Hashable, Any]:
    """An empty ordering structure for the registered eviction strategy ``name``."""
    registry = eviction_registry()
    info = registry.get(name)
    if info is None:
        raise ConfigError(f"unknown eviction {name!r}; known evictions: {', '.join(sorted(registry))}")
    try:
        structure = info.factory(**(options or {}))
    except Exception as exc:
        raise ConfigError(
            f"eviction {name!r} (plugin {info.plugin!r}) rejected eviction_options {options!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(structure, cachetools.Cache) or len(structure):
        raise PluginError(
            f"eviction {name!r} (plugin {info.plugin!r}) factory returned {structure!r}, "
            "not an empty cachetools.Cache"
        )
    return structure

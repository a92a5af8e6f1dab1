"""The plugin manager and the registries built from its register hooks
(:func:`cached_registry`: the policy, eviction, kernel and compiler registries are each
built by the module that owns what they hold).

Built-in plugins register through the same hooks as third-party plugins, which are
found through the ``attnpolicy`` entry-point group the first time the manager is
needed. The built-ins of this package (:data:`BUILTIN_PLUGINS`) register when the
manager is built; those of a higher layer (the built-in policies, the eviction
strategies) are handed to :func:`cached_registry` by the registry that needs them, and
registered then, before the hook is called. ``ATTNPOLICY_LOAD_PLUGINS``
(comma-separated entry-point names) restricts which entry points load: unset loads
all, set but empty loads none.

One bad plugin never disables the others. A third-party plugin that fails to load,
whose register hook raises, or that registers a name another plugin (a built-in
first) already holds is rejected alone: it is unregistered, logged once as a
one-line warning on the ``attnpolicy.plugins`` logger, and listed by
:func:`~attnpolicy.policies.resolve.failed_plugins`; every other plugin stays usable. A *built-in* plugin that
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib.metadata import entry_points
from types import MappingProxyType, ModuleType
from typing import Any

import pluggy

from attnpolicy.errors import PluginError
from attnpolicy.plugins import hookspecs

#: The built-in plugins of this package, registered when the manager is built.
BUILTIN_PLUGINS = ("attnpolicy.plugins.builtin_kernels", "attnpolicy.plugins.builtin_compilers")
ENTRY_POINT_GROUP = "attnpolicy"
LOAD_PLUGINS_ENV = "ATTNPOLICY_LOAD_PLUGINS"

log = logging.getLogger("attnpolicy.plugins")


_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_failed: dict[str, str] = {}
# Names of the built-in plugins registered so far (first among a hook's implementations;
# one that fails raises).
_builtins: set[str] = set()
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
    went wrong (:func:`attnpolicy.policies.resolve.failed_plugins` builds every registry first)."""
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
        _builtins.add(module_name)

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


def _add_builtins(pm: pluggy.PluginManager, plugins: Sequence[ModuleType]) -> None:
    """Register each of ``plugins`` (built-in plugin modules) under its module name,
    unless it is registered already."""
    for plugin in plugins:
        name = plugin.__name__
        if pm.has_plugin(name):
            continue
        try:
            _register(pm, plugin, name)
        except Exception as exc:
            raise PluginError(f"built-in plugin {name!r} failed to register: {type(exc).__name__}: {exc}") from exc
        _builtins.add(name)


def _impls(pm: pluggy.PluginManager, hook_name: str) -> list[Any]:
    return list(getattr(pm.hook, hook_name).get_hookimpls())


def _signature(impls: list[Any]) -> tuple[object, ...]:
    return tuple((impl.plugin_name, impl.function) for impl in impls)


def _per_plugin(pm: pluggy.PluginManager, hook_name: str) -> Iterator[tuple[str, Any]]:
    """``(plugin name, hook caller)`` for each plugin implementing ``hook_name``, built-ins
    first: the caller is ``pm.hook``'s with every other plugin's implementation
    removed (hook wrappers stay)."""
    impls = [i for i in _impls(pm, hook_name) if not (i.hookwrapper or i.wrapper)]
    impls.sort(key=lambda i: i.plugin_name not in _builtins)  # stable: registration order
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
            if plugin in _builtins:
                raise PluginError(detail) from exc
            _fail(plugin, f"attnpolicy plugin {plugin!r} rejected ({what}): {detail}")
            rejected.append(plugin)
            continue
        registry.update(staged)
    for plugin in rejected:
        pm.unregister(name=plugin)
    return registry


def cached_registry(hook_name: str, what: str, add: Callable[[str, dict[Any, Any], dict[Any, Any]],
                                                               Callable[..., None]],
                    on_build: Callable[[dict[Any, Any]], None] | None = None,
                    builtins: Sequence[ModuleType] = ()) -> dict[Any, Any]:
    """The registry :func:`_collect` builds from ``hook_name``, cached until the set of
    implementations of that hook changes; ``on_build(registry)`` runs once per build.
    ``builtins`` are the built-in plugin modules of a higher layer that implement the
    hook, registered first (the layer that owns them passes them). Returns a copy."""
    with _lock:
        pm = get_plugin_manager()
        _add_builtins(pm, builtins)
        signature = _signature(_impls(pm, hook_name))
        cached = _registries.get(hook_name)
        if cached is not None and cached[0] == signature:
            return dict(cached[1])
        registry = _collect(pm, hook_name, what, add)
        if on_build is not None:
            on_build(registry)
        _registries[hook_name] = (signature, registry)
        return dict(registry)

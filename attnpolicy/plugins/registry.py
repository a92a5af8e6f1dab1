"""The plugin manager and the registries of policies and eviction strategies.

Built-in plugins (:data:`BUILTIN_PLUGINS`) register through the same hooks as
third-party plugins, which are found through the ``attnpolicy`` entry-point group
the first time the manager is needed. ``ATTNPOLICY_LOAD_PLUGINS`` (comma-separated
entry-point names) restricts which entry points load: unset loads all, set but
empty loads none. A plugin that fails to load is reported with a warning and in
:func:`failed_plugins`; the manager stays usable.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any

import pluggy

from attnpolicy.errors import PluginError, PolicyError
from attnpolicy.plugins import hookspecs
from attnpolicy.policies.base import Policy

BUILTIN_PLUGINS = ("attnpolicy.policies.builtin", "attnpolicy.cache.evictions", "attnpolicy.policies.costaware",
                   "attnpolicy.plugins.kernels")
ENTRY_POINT_GROUP = "attnpolicy"
LOAD_PLUGINS_ENV = "ATTNPOLICY_LOAD_PLUGINS"


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
# Registries, each cached with the hook implementations it was built from.
_policies: tuple[tuple[object, ...], dict[str, PolicyInfo]] | None = None
_evictions: tuple[tuple[object, ...], dict[str, EvictionInfo]] | None = None


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
    global _pm, _policies, _evictions
    with _lock:
        _pm = None
        _policies = None
        _evictions = None
        _failed.clear()


def failed_plugins() -> Mapping[str, str]:
    """Plugins that failed to load: plugin name -> what went wrong."""
    get_plugin_manager()
    return MappingProxyType(dict(_failed))


def _fail(name: str, what: str, exc: BaseException) -> None:
    message = f"attnpolicy plugin {name!r} ({what}) failed to load: {type(exc).__name__}: {exc}"
    _failed[name] = message
    warnings.warn(message, stacklevel=3)


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
            _fail(module_name, "built-in module", exc)

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
            _fail(ep.name, f"entry point {ep.name} = {ep.value}", exc)
    for missing in sorted((wanted or set()) - found):
        warnings.warn(
            f"{LOAD_PLUGINS_ENV} names {missing!r} but no {ENTRY_POINT_GROUP!r} entry point has that name",
            stacklevel=3,
        )
    return pm


def _impls(pm: pluggy.PluginManager, hook_name: str) -> list[Any]:
    return getattr(pm.hook, hook_name).get_hookimpls()


def _signature(impls: list[Any]) -> tuple[object, ...]:
    return tuple((impl.plugin_name, impl.function) for impl in impls)


def _call_register_hook(impl: Any, register: Callable[..., None], hook_name: str) -> None:
    try:
        impl.function(register=register)
    except PluginError:
        raise
    except Exception as exc:
        raise PluginError(
            f"plugin {impl.plugin_name!r}: its {hook_name} hook raised {type(exc).__name__}: {exc}"
        ) from exc


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


def policy_registry() -> dict[str, PolicyInfo]:
    """Every registered policy by name (cached until the set of plugins changes)."""
    global _policies
    with _lock:
        impls = _impls(get_plugin_manager(), "attnpolicy_register_policies")
        signature = _signature(impls)
        if _policies is not None and _policies[0] == signature:
            return dict(_policies[1])
        registry: dict[str, PolicyInfo] = {}
        for impl in impls:
            plugin = impl.plugin_name

            def register(cls: type, plugin: str = plugin) -> None:
                _check_policy_class(plugin, cls)
                if cls.name in registry:
                    raise PluginError(
                        f"policy {cls.name!r} is registered by two plugins: "
                        f"{registry[cls.name].plugin!r} and {plugin!r}"
                    )
                registry[cls.name] = PolicyInfo(cls.name, plugin, cls.description, cls)

            _call_register_hook(impl, register, "attnpolicy_register_policies")
        _policies = (signature, registry)
        return dict(registry)


def eviction_registry() -> dict[str, EvictionInfo]:
    """Every registered eviction strategy by name (cached until the set of plugins changes)."""
    global _evictions
    with _lock:
        impls = _impls(get_plugin_manager(), "attnpolicy_register_evictions")
        signature = _signature(impls)
        if _evictions is not None and _evictions[0] == signature:
            return dict(_evictions[1])
        registry: dict[str, EvictionInfo] = {}
        for impl in impls:
            plugin = impl.plugin_name

            def register(name: str, factory: Callable[..., Any], plugin: str = plugin) -> None:
                if not isinstance(name, str) or not name:
                    raise PluginError(f"plugin {plugin!r} registered an eviction with name {name!r}")
                if not callable(factory):
                    raise PluginError(
                        f"plugin {plugin!r}: eviction {name!r} factory {factory!r} is not callable"
                    )
                if name in registry:
                    raise PluginError(
                        f"eviction {name!r} is registered by two plugins: "
                        f"{registry[name].plugin!r} and {plugin!r}"
                    )
                registry[name] = EvictionInfo(name, plugin, factory)

            _call_register_hook(impl, register, "attnpolicy_register_evictions")
        _evictions = (signature, registry)
        return dict(registry)


def get_policy_info(name: str) -> PolicyInfo:
    """The registered policy ``name``, or :class:`PolicyError` listing the known names."""
    registry = policy_registry()
    try:
        return registry[name]
    except KeyError:
        raise PolicyError(
            f"unknown policy {name!r}; known policies: {', '.join(sorted(registry)) or '(none)'}"
        ) from None


def make_policy(name: str, **options: Any) -> Policy:
    """Build the registered policy ``name`` with keyword ``options``."""
    info = get_policy_info(name)
    try:
        return info.cls(**options)
    except Exception as exc:
        raise PolicyError(
            f"policy {name!r} (plugin {info.plugin!r}) rejected options {options!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc

"""The eviction registry: every strategy a plugin registers through the
``attnpolicy_register_evictions`` hook, the built-ins (:mod:`~attnpolicy.cache.evictions`)
first, and the ordering structure a cache builds from it."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import cachetools

from attnpolicy.cache import evictions
from attnpolicy.errors import ConfigError, PluginError
from attnpolicy.plugins.registry import cached_registry


@dataclass(frozen=True)
class EvictionInfo:
    """A registered eviction strategy: ``factory()`` returns an empty ``cachetools.Cache``."""

    name: str
    plugin: str
    factory: Callable[..., Any]


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


def eviction_registry() -> dict[str, EvictionInfo]:
    """Every registered eviction strategy by name (cached until the set of plugins changes)."""
    return cached_registry("attnpolicy_register_evictions", "evictions", _eviction_adder,
                           builtins=(evictions,))


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

"""The policy registry: every policy a plugin registers through the
``attnpolicy_register_policies`` hook, the built-ins (:mod:`~attnpolicy.policies.builtin`,
:mod:`~attnpolicy.policies.costaware`) first, and the policy a config names built from it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attnpolicy.errors import PluginError, PolicyError
from attnpolicy.plugins.registry import cached_registry, rejected_plugins
from attnpolicy.policies import builtin, costaware

#: The built-in plugins that register policies.
BUILTIN_POLICY_PLUGINS = (builtin, costaware)


@dataclass(frozen=True)
class PolicyInfo:
    """A registered policy class and the plugin that registered it."""

    name: str
    plugin: str
    description: str
    cls: type


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


def policy_registry() -> dict[str, PolicyInfo]:
    """Every registered policy by name (cached until the set of plugins changes)."""
    return cached_registry("attnpolicy_register_policies", "policies", _policy_adder,
                           builtins=BUILTIN_POLICY_PLUGINS)


def get_policy_info(name: str) -> PolicyInfo:
    """The registered policy ``name``, or :class:`PolicyError` listing the known names
    (and the rejected plugins, one of which may have meant to provide it)."""
    registry = policy_registry()
    try:
        return registry[name]
    except KeyError:
        failed = rejected_plugins()
        rejected = f"; rejected plugins: {', '.join(sorted(failed))}" if failed else ""
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

"""The names a config holds, resolved against the registries.

A config is plain data: its ``policy``, ``eviction``, ``kernels`` and ``backend`` are
strings that only the installed plugins (and, for a backend, Dynamo or the module it
names) give a meaning. :func:`validate_names` resolves them all
(``attnpolicy config validate``/``show``); :func:`check_policy_name` resolves one policy
name (``ATTNPOLICY_POLICY``); :func:`failed_plugins` lists every rejected plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from attnpolicy.cache.eviction_registry import eviction_registry, make_eviction
from attnpolicy.errors import ConfigError, PolicyError
from attnpolicy.plugins.compilers import compiler_registry, resolve_compiler
from attnpolicy.plugins.kernels import check_kernel_names, kernel_registry
from attnpolicy.plugins.registry import rejected_plugins
from attnpolicy.policies.registry import get_policy_info, make_policy, policy_registry


class Named(Protocol):
    """The named fields of a config (an ``AttnPolicyConfig``)."""

    @property
    def policy(self) -> str: ...
    @property
    def policy_options(self) -> Mapping[str, Any]: ...
    @property
    def eviction(self) -> str: ...
    @property
    def kernels(self) -> Mapping[str, str]: ...
    @property
    def backend(self) -> str: ...


def validate_names(config: Named) -> Any:
    """Resolve ``config``'s ``backend``, its ``policy`` and ``eviction``, build the policy
    with its ``policy_options``, then check its ``kernels``; returns the built policy.
    Raises :class:`ConfigError` naming the field and its value (an unknown name lists the
    known ones). Imports the registry (and so the installed plugins; a backend that is no
    registered compiler also what it names)."""
    resolve_compiler(config.backend)
    try:
        policy = make_policy(config.policy, **config.policy_options)
    except PolicyError as exc:
        raise ConfigError(str(exc)) from exc
    make_eviction(config.eviction)
    check_kernel_names(dict(config.kernels))
    return policy


def check_policy_name(name: str) -> None:
    """Raise :class:`PolicyError` listing the known policies unless ``name`` is registered."""
    get_policy_info(name)


def failed_plugins() -> Mapping[str, str]:
    """Plugins that were rejected (failed to load, raised in a register hook, or
    clashed with another plugin's name): plugin name -> what went wrong. Builds the
    registries first, so every rejection is listed."""
    policy_registry()
    eviction_registry()
    kernel_registry()
    compiler_registry()
    return rejected_plugins()

"""Hook specifications: what an attnpolicy plugin can implement.

A plugin is a module (or object) with functions decorated by
``attnpolicy.hookimpl`` and named like the specs below (taking any subset of
their arguments). Built-in policies, eviction strategies, kernels and compilers
register through these same hooks. A plugin whose register hook fails is rejected
alone (see :mod:`attnpolicy.plugins.registry`); an observer hook that raises is
logged and counted, never raised into attention (see :mod:`attnpolicy.plugins.observers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "attnpolicy"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def attnpolicy_register_policies(register: Callable[[type], None]) -> None:
    """Register policy classes by calling ``register(PolicyClass)``.

    A policy class has ``name`` and ``description`` class attributes, takes keyword
    options in ``__init__`` and implements ``decide(layout, ctx) -> Decision``.
    Called once per plugin when the registry is built; the return value is ignored.
    """


@hookspec
def attnpolicy_register_evictions(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Register cache eviction strategies by calling ``register(name, factory)``.

    ``factory()`` returns an empty ``cachetools.Cache`` whose ``popitem()`` yields
    the victim. Called once per plugin; the return value is ignored.
    """


@hookspec
def attnpolicy_on_decision(layout: Any, decision: Any, policy: str, fell_back: bool) -> None:
    """Observe each decision after the guard: ``decision`` is the one that runs.

    ``fell_back`` is true when the guard replaced the policy's answer. Every
    implementation is called, once per batch that runs (never for a preview);
    return values are ignored.
    """


@hookspec
def attnpolicy_on_compile(key: Any, seconds: float, nbytes: int) -> None:
    """Observe each graph compile (a cache miss that built a graph). All implementations run."""


@hookspec
def attnpolicy_on_evict(key: Any, nbytes: int) -> None:
    """Observe each graph eviction from the cache. All implementations run."""


# -- kernels: implementations per call kind (see attnpolicy.plugins.kernels) --------


@hookspec
def attnpolicy_register_kernels(register: Callable[[Any], None]) -> None:
    """Register attention implementations by calling ``register(KernelInfo(...))``
    (:class:`attnpolicy.plugins.kernels.KernelInfo`: name, call kind, the math of one
    call, capabilities). Called once per plugin; the return value is ignored."""


# -- compilers: what compiles a graph behind the cache (see attnpolicy.plugins.compilers) --


@hookspec
def attnpolicy_register_compilers(register: Callable[[Any], None]) -> None:
    """Register compilers by calling ``register(CompilerInfo(...))``
    (:class:`attnpolicy.plugins.compilers.CompilerInfo`: a name, its Dynamo backend,
    and what it declares: how it frees a graph, the bytes a graph holds on its device,
    its own compile count, whether its graphs can be stored). A config's ``backend``
    names one. Called once per plugin; the return value is ignored."""

"""Observer hooks, isolated: a plugin's ``attnpolicy_on_decision``, ``on_compile``
or ``on_evict`` that raises never reaches the attention call.

Each observing plugin is called on its own (through ``pm.hook``, narrowed to that
plugin with :meth:`pluggy.PluginManager.subset_hook_caller`, so pluggy's argument
pruning, tracing and wrappers apply). An exception is logged once per plugin and
hook, as a warning on the ``attnpolicy.plugins`` logger, and counted in
:attr:`Observers.errors`; the other plugins still see the event. With no observer
registered, notifying costs one look-up and calls nothing.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pluggy

log = logging.getLogger("attnpolicy.plugins")


class Observers:
    """Calls the observer hooks of a plugin manager's plugins, one plugin at a time.

    ``errors`` counts the exceptions each plugin raised (plugin name -> count)."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._pm = pm
        self.errors: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        # per hook: (the implementations they were built from, one caller per plugin)
        self._callers: dict[str, tuple[list[Any], list[tuple[str, Any]]]] = {}
        self._decision = pm.hook.attnpolicy_on_decision
        self._compile = pm.hook.attnpolicy_on_compile
        self._evict = pm.hook.attnpolicy_on_evict

    def _per_plugin(self, hook_name: str, impls: list[Any]) -> list[tuple[str, Any]]:
        cached = self._callers.get(hook_name)
        if cached is not None and cached[0] == impls:
            return cached[1]
        plain = [i for i in impls if not (i.hookwrapper or i.wrapper)]
        callers = [(i.plugin_name, self._pm.subset_hook_caller(
            hook_name, remove_plugins=[o.plugin for o in plain if o is not i])) for i in plain]
        self._callers[hook_name] = (impls, callers)
        return callers

    def _notify(self, hook_name: str, impls: list[Any], kwargs: dict[str, Any]) -> None:
        for plugin, call in self._per_plugin(hook_name, impls):
            try:
                call(**kwargs)
            except Exception as exc:
                self.errors[plugin] += 1
                if (plugin, hook_name) not in self._logged:
                    self._logged.add((plugin, hook_name))
                    log.warning("attnpolicy plugin %r: its %s hook raised %s: %s (ignored; further "
                                "errors are only counted)", plugin, hook_name, type(exc).__name__, exc)

    # The three observer hooks: with no implementation, one list copy and nothing else.
    def on_decision(self, layout: Any, decision: Any, policy: str, fell_back: bool) -> None:
        impls = self._decision.get_hookimpls()
        if impls:
            self._notify("attnpolicy_on_decision", impls, {"layout": layout, "decision": decision,
                                                            "policy": policy, "fell_back": fell_back})

    def on_compile(self, key: Any, seconds: float, nbytes: int) -> None:
        impls = self._compile.get_hookimpls()
        if impls:
            self._notify("attnpolicy_on_compile", impls, {"key": key, "seconds": seconds, "nbytes": nbytes})

    def on_evict(self, key: Any, nbytes: int) -> None:
        impls = self._evict.get_hookimpls()
        if impls:
            self._notify("attnpolicy_on_evict", impls, {"key": key, "nbytes": nbytes})

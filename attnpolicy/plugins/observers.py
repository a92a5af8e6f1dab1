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

    def _per_plugin(self, hook_name: str) -> list[tuple[str, Any]]:
        impls = getattr(self._pm.hook, hook_name).get_hookimpls()
        cached = self._callers.get(hook_name)
        if cached is not None and cached[0] == impls:
            return cached[1]
        plain = [i for i in impls if not (i.hookwrapper or i.wrapper)]
        callers = [(i.plugin_name, self._pm.subset_hook_caller(
            hook_name, remove_plugins=[o.plugin for o in plain if o is not i])) for i in plain]
        self._callers[hook_name] = (impls, callers)
        return callers

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call every plugin's ``hook_name`` with ``kwargs``; never raises an
        :class:`Exception` from a plugin."""
        for plugin, call in self._per_plugin(hook_name):
            try:
                call(**kwargs)
            except Exception as exc:  # noqa: BLE001  (isolation: an observer must never break attention)
                self.errors[plugin] += 1
                if (plugin, hook_name) not in self._logged:
                    self._logged.add((plugin, hook_name))
                    log.warning("attnpolicy plugin %r: its %s hook raised %s: %s (ignored; further "
                                "errors are only counted)", plugin, hook_name, type(exc).__name__, exc)

    def on_decision(self, layout: Any, decision: Any, policy: str, fell_back: bool) -> None:
        self.notify("attnpolicy_on_decision", layout=layout, decision=decision, policy=policy,
                    fell_back=fell_back)

    def on_compile(self, key: Any, seconds: float, nbytes: int) -> None:
        self.notify("attnpolicy_on_compile", key=key, seconds=seconds, nbytes=nbytes)

    def on_evict(self, key: Any, nbytes: int) -> None:
        self.notify("attnpolicy_on_evict", key=key, nbytes=nbytes)

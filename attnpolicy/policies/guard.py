"""The guard: the boundary between a policy (possibly a third-party plugin) and the
dispatcher. Whatever the policy does, :meth:`Guard.decide` returns a decision that
is legal for the layout, or raises :class:`PolicyError`.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode, why_illegal
from attnpolicy.core.names import ON_ILLEGAL, OnIllegal
from attnpolicy.errors import IllegalModeError, PolicyError
from attnpolicy.plugins.observers import Observers
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.base import Policy, PolicyContext
from attnpolicy.policies.registry import get_policy_info, make_policy

log = logging.getLogger("attnpolicy.policies.guard")


class Guard:
    """Checks every decision of ``policy`` against the layout.

    A policy that raises, returns something other than a :class:`Decision`, or
    chooses a mode that is illegal for the layout is caught here. With
    ``on_illegal="raise"`` that is a :class:`PolicyError` (chained to the cause);
    with ``"fallback"`` the batch runs in ``fallback`` mode (MASK, VARLEN or ROWS,
    each always legal), the fallback is counted in :attr:`fallbacks` and
    :attr:`fallback_reasons` (``"illegal"``, ``"exception"``, ``"bad-return"``) and
    logged as a warning on the ``attnpolicy.policies.guard`` logger. Each decision that runs
    is reported to the ``attnpolicy_on_decision`` hook through ``observers``
    (default: the global plugin manager's), which isolates a raising observer.

    :meth:`preview` answers the same question without side effects: no hook, no
    count, no log, and a stateful policy's ``preview`` instead of its ``decide``.
    """

    def __init__(
        self,
        policy: Policy,
        policy_name: str,
        plugin: str,
        on_illegal: OnIllegal = "fallback",
        fallback: MaskMode = MaskMode.VARLEN,
        observers: Observers | None = None,
    ) -> None:
        if on_illegal not in ON_ILLEGAL:
            raise PolicyError(f"on_illegal must be 'raise' or 'fallback', got {on_illegal!r}")
        try:
            fallback = MaskMode(fallback)
        except ValueError:
            raise PolicyError(f"fallback must be a MaskMode, got {fallback!r}") from None
        if fallback is MaskMode.CAUSAL:
            raise PolicyError("fallback must be a mode legal for every layout (mask, varlen or rows), got causal")
        self.policy = policy
        self.policy_name = policy_name
        self.plugin = plugin
        self.on_illegal: OnIllegal = on_illegal
        self.fallback = fallback
        self.fallbacks = 0
        self.fallback_reasons: Counter[str] = Counter()
        self.observers = observers if observers is not None else Observers(get_plugin_manager())
        self._on_decision = self.observers.on_decision
        self._preview: Any = getattr(policy, "preview", None)
        self._who = f"policy {policy_name!r} (plugin {plugin!r})"

    @classmethod
    def for_policy(
        cls,
        name: str,
        options: dict[str, Any] | None = None,
        *,
        on_illegal: OnIllegal = "fallback",
        fallback: MaskMode = MaskMode.VARLEN,
        observers: Observers | None = None,
    ) -> Guard:
        """A guard around the registered policy ``name`` built (once) with ``options``;
        an unknown name or rejected options raise :class:`PolicyError` naming them."""
        info = get_policy_info(name)
        return cls(make_policy(name, **(options or {})), name, info.plugin,
                   on_illegal=on_illegal, fallback=fallback, observers=observers)

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        """The policy's decision if it is legal for ``layout``, else see the class doc."""
        try:
            decision = self.policy.decide(layout, ctx)
        except Exception as exc:
            return self._failed("exception", f"{self._who} raised {type(exc).__name__}: {exc}",
                                layout, exc)
        if not isinstance(decision, Decision):
            return self._failed(
                "bad-return",
                f"{self._who} returned {type(decision).__name__} {decision!r:.100}, not a Decision",
                layout, None)
        why = why_illegal(decision.mode, layout)
        if why is not None:
            what = f"{self._who} chose {decision.mode.value} for {layout.describe()}: {why}"
            return self._failed("illegal", what, layout, IllegalModeError(what))
        self._on_decision(layout=layout, decision=decision, policy=self.policy_name, fell_back=False)
        return decision

    def preview(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        """The decision :meth:`decide` would return now, with no side effect (see the
        class doc); an illegal answer previews as the fallback, or raises with
        ``on_illegal="raise"``."""
        try:
            decision = (self._preview or self.policy.decide)(layout, ctx)
        except Exception as exc:
            return self._previewed(f"{self._who} raised {type(exc).__name__}: {exc}", exc)
        if not isinstance(decision, Decision):
            return self._previewed(
                f"{self._who} returned {type(decision).__name__} {decision!r:.100}, not a Decision", None)
        why = why_illegal(decision.mode, layout)
        if why is not None:
            what = f"{self._who} chose {decision.mode.value} for {layout.describe()}: {why}"
            return self._previewed(what, IllegalModeError(what))
        return decision

    def _previewed(self, what: str, cause: BaseException | None) -> Decision:
        if self.on_illegal == "raise":
            raise PolicyError(what) from cause
        return Decision(self.fallback, f"guard: {what}; fell back to {self.fallback.value}")

    @property
    def stateless(self) -> bool:
        """Whether the policy declares (class attribute ``stateless = True``) that its
        decision depends on the layout and the config only, so it may be reused."""
        return getattr(self.policy, "stateless", False) is True

    @property
    def modes(self) -> frozenset[MaskMode]:
        """The modes a batch can run in under this guard: those the policy declares
        (class attribute ``modes``, every mode when it declares none), and the
        fallback when ``on_illegal="fallback"`` (a raising policy falls back too)."""
        declared = getattr(self.policy, "modes", None)
        modes = frozenset(MaskMode) if declared is None else frozenset(MaskMode(m) for m in declared)
        return modes | {self.fallback} if self.on_illegal == "fallback" else modes

    def replay(self, layout: BatchLayout, decision: Decision) -> None:
        """Report a reused decision of a stateless policy, as :meth:`decide` would
        (the observers call nothing when no plugin implements the hook)."""
        self._on_decision(layout=layout, decision=decision, policy=self.policy_name, fell_back=False)

    def _failed(self, category: str, what: str, layout: BatchLayout,
                cause: BaseException | None) -> Decision:
        if self.on_illegal == "raise":
            raise PolicyError(what) from cause
        self.fallbacks += 1
        self.fallback_reasons[category] += 1
        # The first fallback of each kind is a warning; the rest are counted and logged
        # at debug level (a policy that is wrong for a workload is wrong on every batch).
        level = logging.WARNING if self.fallback_reasons[category] == 1 else logging.DEBUG
        log.log(level, "%s; fell back to %s (fallbacks so far: %d)", what, self.fallback.value,
                self.fallbacks)
        decision = Decision(self.fallback, f"guard: {what}; fell back to {self.fallback.value}")
        self._on_decision(layout=layout, decision=decision, policy=self.policy_name, fell_back=True)
        return decision

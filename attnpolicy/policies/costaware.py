"""The built-in ``cost-aware`` policy: the legal mode with the least expected time.

**Pricing.** For each legal mode of a batch the policy prices, with the cost model
(``ctx.cost_model``, else the built-in default), the calls the mode plans
(``ctx.keys_for``): their run seconds, the dispatch overhead per call, the host
mask build of a MASK call (unless that mask was built recently enough for the mask
cache to hold it), and the compile seconds of every graph that is not cached.

**Rent or buy.** The *cheap* mode minimises run + compile now; the *fast* mode
minimises run alone. When they differ, running the cheap mode is renting: its
extra run seconds over the fast mode accumulate as regret on the fast mode's
missing graphs, and the fast mode is bought (its graphs compiled) once that regret
reaches the extra cost of buying now. A one-off batch runs on what is cached; a
graph is compiled once its repeated use has paid for it (ski rental: at most twice
the optimum per episode).

**Hedging.** Rent-or-buy prices one batch at a time; it cannot see that a graph
it compiles evicts one that later batches need, which matters when the working
set is about the cache's size. So the policy replays, alongside, rent-or-buy and
the fixed rules (``varlen``, ``dynamic``, ``always-mask``) each on a private
shadow of the graph cache (same capacity, bytes and eviction as the config),
accumulating each one's modelled seconds. It follows the best fixed rule
(``varlen`` at first), and rent-or-buy while that is ahead of it; a rule is
ahead when its seconds plus the price of switching to it (compiling the graphs
its shadow holds that the real cache lacks) are below ``1 - MARGIN`` times the
followed rule's. The Decision reason gives
the rule followed, the modelled totals and the prices.

Decisions are a pure function of the layout stream, the config, the cache state
and the cost model: no clock, no measurement, so tensor-parallel ranks agree.

**Preview.** :meth:`CostAware.preview` answers as the rule followed now would,
without stepping any shadow or regret: the next real decision differs only when
that batch makes another rule overtake the followed one.

Outside a dispatcher (a context without keys to price) every option costs nothing,
so no rule ever gets ahead and the policy answers as ``varlen``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from attnpolicy.cache.graph_cache import GraphCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import Decision, MaskMode, legal_modes
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import GraphKey
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.policies.base import Policy, PolicyContext

if TYPE_CHECKING:
    from attnpolicy.kernels.masks import MaskCache

from attnpolicy.policies.builtin import (
    AlwaysMask,
    Dynamic,
    Varlen,
)

#: A rule is switched to only when it is ahead by this fraction of the followed
#: rule's modelled seconds (plus the price of switching).
MARGIN = 0.1
RENT_OR_BUY = "rent-or-buy"


class _Option:
    """One candidate mode priced for one batch."""

    __slots__ = ("compile", "keys", "missing", "mode", "run")

    def __init__(self, mode: MaskMode, keys: tuple[GraphKey, ...], run: float,
                 missing: tuple[GraphKey, ...], compile: float) -> None:
        self.mode = mode
        self.keys = keys
        self.run = run
        self.missing = missing
        self.compile = compile

    @property
    def now(self) -> float:
        return self.run + self.compile

    def describe(self) -> str:
        text = f"{self.mode.value} {self.run * 1e3:.3g} ms"
        if self.missing:
            n = len(self.missing)
            text += f" + compile {n} graph{'s' * (n > 1)} {self.compile * 1e3:.3g} ms"
        return text


def _price(layout: BatchLayout, mode: MaskMode, keys: tuple[GraphKey, ...], model: CostModel,
           is_cached: Callable[[GraphKey], bool], masks: MaskCache) -> _Option:
    run = sum(model.run_seconds(k) for k in keys) + model.call_overhead_seconds * len(keys)
    if mode is MaskMode.MASK:
        run += sum(model.mask_build_seconds(k.q_len, k.kv_len) for k in keys
                   if (layout, k.q_len, k.kv_len) not in masks)
    missing = tuple(k for k in dict.fromkeys(keys) if not is_cached(k))
    return _Option(mode, keys, run, missing, sum(model.compile_seconds(k) for k in missing))


def _same(key: GraphKey) -> GraphKey:
    return key


class _Shadow:
    """One rule replayed on a private copy of the graph cache: what it would have
    cost so far (modelled seconds) had it decided every batch."""

    def __init__(self, name: str, config: AttnPolicyConfig, model: CostModel,
                 decide: _Rule) -> None:
        self.name = name
        self.cache: GraphCache[GraphKey] = GraphCache.from_config(config, oversize="uncached", sizeof=model.graph_bytes,
                                                        compile_cost=model.compile_cost)
        # imported here: it imports torch, and the registry imports this module
        from attnpolicy.kernels.masks import MaskCache

        self.masks = MaskCache(config.max_mask_bytes)  # mirrors the dispatcher's
        self.seconds = 0.0
        self._decide = decide

    def step(self, layout: BatchLayout, ctx: PolicyContext, model: CostModel) -> tuple[MaskMode, str]:
        """Decide ``layout`` as this rule would, charge it, and return (mode, reason)."""
        mode, reason = self._decide(layout, ctx, self, True)
        keys = ctx.keys_for(layout, mode)
        option = _price(layout, mode, keys, model, self.cache.__contains__, self.masks)
        self.seconds += option.run
        for key in keys:  # misses counted one by one: a key may be evicted within the batch
            if key not in self.cache:
                self.seconds += model.compile_seconds(key)
            self.cache.get_or_compile(key, _stand_in(key))
        if mode is MaskMode.MASK:
            for k in keys:
                self.masks.lookup((layout, k.q_len, k.kv_len), k.q_len * k.kv_len, bool)
        return mode, reason

    def preview(self, layout: BatchLayout, ctx: PolicyContext) -> tuple[MaskMode, str]:
        """What this rule would decide for ``layout`` now; changes nothing."""
        return self._decide(layout, ctx, self, False)


#: A rule: ``rule(layout, ctx, shadow, commit) -> (mode, reason)``; with ``commit``
#: false it must not change any state.
_Rule = Callable[[BatchLayout, PolicyContext, "_Shadow", bool], tuple[MaskMode, str]]


def _stand_in(key: GraphKey) -> Callable[[], GraphKey]:
    """What a shadow cache holds for a key: the key itself (nothing is compiled)."""
    return lambda: key


def _fixed(policy: Policy) -> _Rule:
    def decide(layout: BatchLayout, ctx: PolicyContext, shadow: _Shadow, commit: bool) -> tuple[MaskMode, str]:
        decision = policy.decide(layout, ctx)
        return decision.mode, decision.reason
    return decide


class _RentOrBuy:
    """The rent-or-buy rule (see the module docstring); keeps the regret per graph."""

    def __init__(self, model: CostModel) -> None:
        self._model = model
        self._regret: dict[GraphKey, float] = {}

    def __call__(self, layout: BatchLayout, ctx: PolicyContext, shadow: _Shadow,
                 commit: bool) -> tuple[MaskMode, str]:
        options: list[_Option] = []
        for mode in legal_modes(layout):
            keys = ctx.keys_for(layout, mode)
            if any(o.keys == keys for o in options):
                continue  # VARLEN of a lone causal sequence plans CAUSAL's very graph
            options.append(_price(layout, mode, keys, self._model, shadow.cache.__contains__, shadow.masks))
        cheap = min(options, key=lambda o: o.now)
        fast = min(options, key=lambda o: o.run)
        if fast is cheap:
            chosen, note = cheap, "cheapest"
        else:
            regret = sum(self._regret.get(k, 0.0) for k in fast.missing)
            premium = fast.now - cheap.now
            if regret >= premium:
                chosen, note = fast, f"bought: regret {regret * 1e3:.3g} ms >= extra {premium * 1e3:.3g} ms"
            else:
                chosen = cheap
                gain = cheap.run - fast.run
                for k in fast.missing if commit else ():
                    self._regret[k] = self._regret.get(k, 0.0) + gain * (
                        self._model.compile_seconds(k) / fast.compile if fast.compile > 0
                        else 1 / len(fast.missing))
                note = f"renting: regret {(regret + gain) * 1e3:.3g} ms < extra {premium * 1e3:.3g} ms"
        for k in chosen.missing if commit else ():
            self._regret.pop(k, None)
        others = "; ".join(o.describe() for o in options if o is not chosen)
        return chosen.mode, f"{chosen.describe()}{' vs ' + others if others else ''}; {note}"


class _Hedge:
    """The shadows (rent-or-buy first, then the fixed rules), the best fixed rule so far
    and the rule followed now (``varlen`` at first)."""

    def __init__(self, shadows: list[_Shadow]) -> None:
        self.shadows = shadows
        self.fixed_leader = self.following = shadows[1]


class CostAware:
    """Rent-or-buy between modes, priced by the cost model, hedged against the fixed
    rules on shadow caches (see the module docstring)."""

    name = "cost-aware"
    description = ("the legal mode with the least expected time: run cost vs compile cost of "
                   "uncached graphs (rent or buy), hedged against the fixed policies")

    def __init__(self) -> None:
        self._hedge: _Hedge | None = None  # built on the first batch
        self._first = Varlen()  # the rule followed before any batch

    @staticmethod
    def _start(layout: BatchLayout, ctx: PolicyContext, model: CostModel) -> _Hedge:
        """The shadows, each holding the graphs of ``layout``'s options that are
        already cached (a warmed-up cache), at no charge."""
        cfg = ctx.config or AttnPolicyConfig()  # no config: an unbounded LRU cache
        shadows = [_Shadow(RENT_OR_BUY, cfg, model, _RentOrBuy(model))]
        shadows += [_Shadow(cls.name, cfg, model, _fixed(cls())) for cls in (Varlen, Dynamic, AlwaysMask)]
        warm = [k for m in legal_modes(layout) for k in ctx.keys_for(layout, m) if ctx.is_cached(k)]
        for shadow in shadows:
            for key in warm:
                shadow.cache.get_or_compile(key, _stand_in(key))
        return _Hedge(shadows)

    @staticmethod
    def _ahead(candidate: _Shadow, leader: _Shadow, ctx: PolicyContext, model: CostModel) -> bool:
        """Whether following ``candidate`` instead of ``leader`` pays: its modelled seconds
        plus the compiles of the graphs it holds that the real cache lacks (the price
        of switching) are below ``(1 - MARGIN)`` times the leader's."""
        if candidate is leader or candidate.seconds >= (1 - MARGIN) * leader.seconds:
            return False
        held: list[GraphKey] = candidate.cache.keys()  # type: ignore[assignment]  # a shadow holds GraphKeys
        switch = sum(model.compile_seconds(k) for k in held if not ctx.is_cached(k))
        return candidate.seconds + switch < (1 - MARGIN) * leader.seconds

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        model = ctx.cost_model or CostModel.default()
        if self._hedge is None:
            self._hedge = self._start(layout, ctx, model)
        h = self._hedge
        rent_or_buy, *fixed = h.shadows
        modes = {s.name: s.step(layout, ctx, model) for s in h.shadows}
        best = min(fixed, key=lambda s: s.seconds)
        if self._ahead(best, h.fixed_leader, ctx, model):
            if h.following is h.fixed_leader:
                h.following = best
            h.fixed_leader = best
        other = h.fixed_leader if h.following is rent_or_buy else rent_or_buy
        if self._ahead(other, h.following, ctx, model):
            h.following = other
        leader = h.following
        mode, reason = modes[leader.name]
        fixed_leader = h.fixed_leader
        text = (f"{leader.name}: {reason} | modelled so far: {RENT_OR_BUY} {rent_or_buy.seconds:.3g} s, "
                f"{fixed_leader.name} {fixed_leader.seconds:.3g} s")
        if leader is not rent_or_buy:
            text += f" | {RENT_OR_BUY} would run {modes[RENT_OR_BUY][1]}"
        return Decision(mode, text)

    def preview(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        """The decision of the rule followed now, without stepping anything (see the
        module docstring)."""
        if self._hedge is None:
            return self._first.decide(layout, ctx)
        following = self._hedge.following
        mode, reason = following.preview(layout, ctx)
        return Decision(mode, f"{following.name}: {reason} (preview)")


@hookimpl
def attnpolicy_register_policies(register: Callable[[type], None]) -> None:
    register(CostAware)

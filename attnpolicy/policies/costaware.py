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

**Cost of a decision.** Each (layout, mode, tensor spec) is priced once whatever
the caches hold (keys, run seconds, mask builds; remembered, and shared by the
cost-aware policies of dispatchers that share a planner, such as a simulated
sweep's), and each shadow adds
what its own caches change. A shadow whose batch finds every graph cached touches
each key once at its last use under ``lru`` and not at all under ``fifo`` (the same
cache state as replaying every use, since hits never evict); other evictions
replay every use. Time decisions with :func:`attnpolicy.bench.overhead.measure_decisions`.

Outside a dispatcher (a context without keys to price) every option costs nothing,
so no rule ever gets ahead and the policy answers as ``varlen``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from attnpolicy.cache.key_stream import StreamCache
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CallKind, Decision, MaskMode, legal_modes
from attnpolicy.graphs.batch_cost import MaskMirror, MaskNeed
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import GraphKey
from attnpolicy.plugins.hookspecs import hookimpl
from attnpolicy.policies.base import Policy, PolicyContext
from attnpolicy.policies.builtin import AlwaysMask, Dynamic, Varlen

#: A rule is switched to only when it is ahead by this fraction of the followed
#: rule's modelled seconds (plus the price of switching).
MARGIN = 0.1
RENT_OR_BUY = "rent-or-buy"
_T = TypeVar("_T")


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


class _Static:
    """What one (layout, mode) costs whatever the cache holds: its keys (in call order,
    distinct, and distinct by last use), run seconds with the dispatch overhead, and
    for a MASK call the mask-cache key and build seconds of each mask it would build."""

    __slots__ = ("distinct", "distinct_set", "keys", "last_used", "masks", "run")

    def __init__(self, layout: BatchLayout, mode: MaskMode, keys: tuple[GraphKey, ...], model: CostModel,
                 run_seconds: Callable[[GraphKey], float]) -> None:
        self.keys = keys
        self.distinct = tuple(dict.fromkeys(keys))
        self.distinct_set = frozenset(keys)
        self.last_used = tuple(dict.fromkeys(keys[::-1]))[::-1]
        self.run = sum(map(run_seconds, keys)) + model.call_overhead_seconds * len(keys)
        self.masks = tuple(MaskNeed(layout, k.q_len, k.kv_len, k.spec.device, model, k.spec.features.window)
                           for k in keys) if mode is MaskMode.MASK else ()


#: How a shadow's batch that finds all its graphs cached touches them, per eviction
#: strategy whose state that leaves as replaying every use would: "last" (each key
#: once, at its last use) or "none" (hits change nothing). Others replay every use.
HIT_TOUCH = {"lru": "last", "fifo": "none"}

#: (layout, mode) pricings a CostAware remembers per tensor spec (cleared when full).
STATIC_MEMO_SIZE = 4096


def _remembered(table: dict[GraphKey, _T], key: GraphKey, compute: Callable[[GraphKey], _T]) -> _T:
    """``compute(key)``, remembered in ``table`` (cleared when it holds
    :data:`STATIC_MEMO_SIZE` entries)."""
    value = table.get(key)
    if value is None:
        if len(table) >= STATIC_MEMO_SIZE:
            table.clear()
        value = table[key] = compute(key)
    return value


class _Pricer:
    """Prices options for the shadows of the CostAwares planning with one planner (kept
    in ``PolicyContext.derived``) and one cost model: the cache-independent part of
    each (layout, mode, spec) once (:class:`_Static`, remembered), then what the asking
    shadow's caches change (mask builds, missing graphs' compiles)."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self._statics: dict[tuple[BatchLayout, MaskMode, object], _Static] = {}
        self._by_keys: dict[tuple[GraphKey, ...], _Static] = {}  # mask-free pricings, shared by layouts
        self._compile: dict[GraphKey, float] = {}
        self._run: dict[GraphKey, float] = {}
        self._bytes: dict[GraphKey, int] = {}

    def static(self, layout: BatchLayout, mode: MaskMode, ctx: PolicyContext) -> _Static:
        memo = (layout, mode, ctx.spec)
        static = self._statics.get(memo)
        if static is None:
            if len(self._statics) >= STATIC_MEMO_SIZE:
                self._statics.clear()
                self._by_keys.clear()
            keys = ctx.keys_for(layout, mode)
            if mode is MaskMode.MASK:  # its masks are the layout's own
                static = _Static(layout, mode, keys, self.model, self.run_seconds)
            else:  # the same keys cost the same: e.g. consecutive decode steps in one set of buckets
                static = self._by_keys.get(keys)
                if static is None:
                    static = self._by_keys[keys] = _Static(layout, mode, keys, self.model, self.run_seconds)
            self._statics[memo] = static
        return static

    def run_seconds(self, key: GraphKey) -> float:
        return _remembered(self._run, key, self.model.run_seconds)

    def compile_seconds(self, key: GraphKey) -> float:
        return _remembered(self._compile, key, self.model.compile_seconds)

    def graph_bytes(self, key: GraphKey) -> int:
        return _remembered(self._bytes, key, self.model.graph_bytes)

    def price(self, static: _Static, mode: MaskMode, cache: StreamCache, masks: MaskMirror) -> _Option:
        run = static.run
        if static.masks:
            run += sum(need.seconds for need in static.masks if not masks.held(need.key))
        held = cache.held
        missing = () if held.keys() >= static.distinct_set else tuple(k for k in static.distinct if k not in held)
        return _Option(mode, static.keys, run, missing, sum(self.compile_seconds(k) for k in missing))


class _Shadow:
    """One rule replayed on a private copy of the graph cache: what it would have
    cost so far (modelled seconds) had it decided every batch."""

    def __init__(self, name: str, config: AttnPolicyConfig, pricer: _Pricer, decide: _Rule) -> None:
        self.name = name
        # the graph cache's bookkeeping without graphs: same bounds and eviction
        self.cache = StreamCache(max_graphs=config.max_graphs, max_bytes=config.max_bytes,
                                 eviction=config.eviction, oversize="uncached")
        self.masks = MaskMirror(config.max_mask_bytes)  # the dispatcher's mask cache, mirrored
        self.seconds = 0.0
        self.run = 0.0  # charged by the last step
        self.quiet = False  # the last step left every cache as it found it (see step)
        self._decide = decide
        self._pricer = pricer
        # how a batch whose graphs are all cached touches them (HIT_TOUCH; hits never evict)
        self._hits = HIT_TOUCH.get(config.eviction, "every")

    def step(self, layout: BatchLayout, ctx: PolicyContext) -> tuple[MaskMode, str]:
        """Decide ``layout`` as this rule would, charge it, and return (mode, reason).
        Sets :attr:`run` (the seconds charged) and :attr:`quiet`: whether a repeat of
        this step would find its caches as this one left them (see :class:`CostAware`)."""
        mode, reason = self._decide(layout, ctx, self, True)
        static = self._pricer.static(layout, mode, ctx)
        option = self._pricer.price(static, mode, self.cache, self.masks)
        self.seconds += option.run
        self.run = option.run
        uses = static.keys
        all_hit = not option.missing and self._hits != "every"
        if all_hit:
            uses = static.last_used if self._hits == "last" else ()
        # all hits, touched idempotently (each key once at its last use, or not at all),
        # every mask cached or too large to cache: repeating the step changes nothing
        # but the seconds
        self.quiet = all_hit and all(map(self.masks.settled, static.masks))
        touch, miss = self.cache.touch, self._miss
        for key in uses:  # misses charged one by one: a key may be evicted within the batch
            try:
                touch(key)  # a hit: touched as the graph cache touches it
            except KeyError:
                self.seconds += miss(key)
        for need in static.masks:
            self.masks.use(need.key, need.nbytes)
        return mode, reason

    def request(self, key: GraphKey) -> float:
        """Request ``key`` from the shadow cache; the modelled compile seconds of a miss
        (0 on a hit)."""
        try:
            self.cache.touch(key)
            return 0.0
        except KeyError:
            return self._miss(key)

    def _miss(self, key: GraphKey) -> float:
        """Serve a miss of ``key`` (not held; a failed touch changes nothing); its compile seconds."""
        seconds = self._pricer.compile_seconds(key)
        self.cache.miss(key, self._pricer.graph_bytes(key), seconds)
        return seconds

    def preview(self, layout: BatchLayout, ctx: PolicyContext) -> tuple[MaskMode, str]:
        """What this rule would decide for ``layout`` now; changes nothing."""
        return self._decide(layout, ctx, self, False)


#: A rule: ``rule(layout, ctx, shadow, commit) -> (mode, reason)``; with ``commit``
#: false it must not change any state.
_Rule = Callable[[BatchLayout, PolicyContext, "_Shadow", bool], tuple[MaskMode, str]]


def _fixed(policy: Policy) -> _Rule:
    def decide(layout: BatchLayout, ctx: PolicyContext, shadow: _Shadow, commit: bool) -> tuple[MaskMode, str]:
        decision = policy.decide(layout, ctx)
        return decision.mode, decision.reason
    return decide


class _RentOrBuy:
    """The rent-or-buy rule (see the module docstring); keeps the regret per graph."""

    def __init__(self, pricer: _Pricer) -> None:
        self._pricer = pricer
        self._regret: dict[GraphKey, float] = {}
        self.regret_changed = False  # by the last committed call

    def __call__(self, layout: BatchLayout, ctx: PolicyContext, shadow: _Shadow,
                 commit: bool) -> tuple[MaskMode, str]:
        options: list[_Option] = []
        pricer = self._pricer
        for mode in legal_modes(layout):
            if mode is MaskMode.ROWS and not pricer.model.prices(CallKind.ROWS):
                continue  # its cost model has no rows fit (calibrated before the rows kind)
            static = pricer.static(layout, mode, ctx)
            if any(o.keys == static.keys for o in options):
                continue  # VARLEN of a lone causal sequence plans CAUSAL's very graph
            options.append(pricer.price(static, mode, shadow.cache, shadow.masks))
        cheap = min(options, key=lambda o: o.now)
        fast = min(options, key=lambda o: o.run)
        if commit:
            self.regret_changed = fast is not cheap or bool(cheap.missing)
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
                        pricer.compile_seconds(k) / fast.compile if fast.compile > 0
                        else 1 / len(fast.missing))
                note = f"renting: regret {(regret + gain) * 1e3:.3g} ms < extra {premium * 1e3:.3g} ms"
        for k in chosen.missing if commit else ():
            self._regret.pop(k, None)
        others = "; ".join(o.describe() for o in options if o is not chosen)
        return chosen.mode, f"{chosen.describe()}{' vs ' + others if others else ''}; {note}"


class _Hedge:
    """The shadows (rent-or-buy first, then the fixed rules), rent-or-buy's rule, the
    best fixed rule so far and the rule followed now (``varlen`` at first)."""

    def __init__(self, shadows: list[_Shadow], rent_or_buy: _RentOrBuy) -> None:
        self.shadows = shadows
        self.rent_or_buy = rent_or_buy
        self.fixed_leader = self.following = shadows[1]


class _Repeat:
    """A batch whose every shadow step left its caches (and rent-or-buy its regret) as
    it found them: the same layout next time decides the same in every shadow and
    charges the same seconds, so it is replayed instead of re-priced."""

    __slots__ = ("layout", "modes", "spec")

    def __init__(self, layout: BatchLayout, spec: object, modes: dict[str, tuple[MaskMode, str]]) -> None:
        self.layout = layout
        self.spec = spec
        self.modes = modes


class CostAware:
    """Rent-or-buy between modes, priced by the cost model, hedged against the fixed
    rules on shadow caches (see the module docstring).

    A batch that repeats the previous one's layout (and tensor spec), when that one
    changed no shadow cache and no regret, is replayed: each shadow is charged the
    same seconds and decides the same, exactly as stepping it again would (a repeat
    of an all-hit step under ``lru`` or ``fifo`` touches nothing that is not already
    in place). Only the comparison of the rules runs again."""

    name = "cost-aware"
    description = ("the legal mode with the least expected time: run cost vs compile cost of "
                   "uncached graphs (rent or buy), hedged against the fixed policies")

    def __init__(self) -> None:
        self._hedge: _Hedge | None = None  # built on the first batch
        self._first = Varlen()  # the rule followed before any batch
        self._repeat: _Repeat | None = None  # the last batch, if a repeat of it replays

    @staticmethod
    def _start(layout: BatchLayout, ctx: PolicyContext, model: CostModel) -> _Hedge:
        """The shadows, each holding the graphs of ``layout``'s options that are
        already cached (a warmed-up cache), at no charge."""
        cfg = ctx.config or AttnPolicyConfig()  # no config: an unbounded LRU cache
        pricer = ctx.derived.get(_Pricer)  # priced once for every dispatcher sharing the planner
        if not isinstance(pricer, _Pricer) or pricer.model is not model:
            pricer = ctx.derived[_Pricer] = _Pricer(model)
        rule = _RentOrBuy(pricer)
        shadows = [_Shadow(RENT_OR_BUY, cfg, pricer, rule)]
        shadows += [_Shadow(cls.name, cfg, pricer, _fixed(cls())) for cls in (Varlen, Dynamic, AlwaysMask)]
        warm = [k for m in legal_modes(layout) for k in ctx.keys_for(layout, m) if ctx.is_cached(k)]
        for shadow in shadows:
            for key in warm:
                shadow.request(key)
        return _Hedge(shadows, rule)

    @staticmethod
    def _ahead(candidate: _Shadow, leader: _Shadow, ctx: PolicyContext, model: CostModel) -> bool:
        """Whether following ``candidate`` instead of ``leader`` pays: its modelled seconds
        plus the compiles of the graphs it holds that the real cache lacks (the price
        of switching) are below ``(1 - MARGIN)`` times the leader's."""
        if candidate is leader or candidate.seconds >= (1 - MARGIN) * leader.seconds:
            return False
        held = cast(list[GraphKey], candidate.cache.keys())  # a shadow holds GraphKeys
        switch = sum(model.compile_seconds(k) for k in held if not ctx.is_cached(k))
        return candidate.seconds + switch < (1 - MARGIN) * leader.seconds

    def decide(self, layout: BatchLayout, ctx: PolicyContext) -> Decision:
        model = ctx.cost_model or CostModel.default()
        if self._hedge is None:
            self._hedge = self._start(layout, ctx, model)
        h = self._hedge
        rent_or_buy, *fixed = h.shadows
        repeat = self._repeat
        if repeat is not None and repeat.spec == ctx.spec and (repeat.layout is layout or repeat.layout == layout):
            modes = repeat.modes
            for shadow in h.shadows:
                shadow.seconds += shadow.run
        else:
            modes = {s.name: s.step(layout, ctx) for s in h.shadows}
            quiet = not h.rent_or_buy.regret_changed and all(s.quiet for s in h.shadows)
            self._repeat = _Repeat(layout, ctx.spec, modes) if quiet else None
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

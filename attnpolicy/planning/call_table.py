"""The calls a stateless policy makes for a workload, found once and bucketed by any list.

A stateless policy decides from the layout alone (the built-in ones read nothing of the
config's buckets; a plugin that did would be decided with the base config's), so its
calls at exact lengths are the same under every bucket list; only their buckets, and with them the graph keys,
change. :class:`CallTable` decides every step once and keeps one row per call (its
kind, exact lengths, causality, the step it belongs to); :meth:`CallTable.recording`
then buckets every row at once (numpy) for a config and gives what a simulating
dispatcher run of that config records (:class:`~attnpolicy.modelling.simulation.Recording`)
and its key stream, in the same order and with the same floating-point sums, so the
rows it makes (:meth:`CallTable.rows`) are those of
:func:`~attnpolicy.modelling.simulation.simulate_layouts`. The planner evaluates its
candidate lists with it instead of a dispatcher run each.

The rows follow the dispatcher's rules, applied to every row at once by the functions its
planner applies to one call (:mod:`attnpolicy.graphs.plan_rules`): VARLEN runs a causal
sequence without context on the CAUSAL graph of its bucket (``runs_causal``); a MASK
call whose bucketed mask is over ``max_mask_bytes`` (``mask_over``) runs its step in
VARLEN (the table holds both); a length above the largest bucket
(:meth:`~attnpolicy.graphs.buckets.Buckets.largest`) runs uncompiled (``uncompiled``,
``on_overflow="eager"``) or raises as the dispatcher does (``"raise"``: the dispatcher
itself is asked to prepare that step). Configs with ``compile_mode="background"``
(pad-up depends on the cache state) are not tabled: :func:`tabled` says so and callers
simulate them with the dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from itertools import chain, repeat

import numpy as np

from attnpolicy.cache.key_stream import StreamStats, replay_stream
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CALL_KINDS, MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.graphs import plan_rules
from attnpolicy.graphs.batch_cost import BatchCost
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.kernels import mask_cache
from attnpolicy.modelling.simulation import Recording, SimRow, sim_row, simulated
from attnpolicy.modelling.streams import KeyStream
from attnpolicy.planning.bucket_search import CallShapes
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard

#: Call kinds by the codes of :attr:`CallTable.kind`.
_CAUSAL, _MASK, _VARLEN = range(3)
_MODES = tuple(MaskMode)
_MODE_CODE = {m: i for i, m in enumerate(_MODES)}


def tabled(config: AttnPolicyConfig) -> bool:
    """Whether :class:`CallTable` models ``config`` exactly (synchronous compiles)."""
    return config.compile_mode == "sync"


@dataclass(frozen=True)
class Bucketed:
    """One config's calls: the key stream (ids in first-request order into ``keys``),
    each key's first call row, its uses and buckets, and the recording a dispatcher run
    makes. ``ids`` is one entry per call; :meth:`CallTable.cached` keeps the stream as
    runs (:class:`~attnpolicy.modelling.streams.KeyStream`) and drops it."""

    ids: np.ndarray
    keys: list[GraphKey]
    first: np.ndarray
    uses: np.ndarray
    q_bucket: np.ndarray  # per key
    kv_bucket: np.ndarray  # per key
    recording: Recording


class CallTable:
    """Every call ``policy`` (guarded as ``base`` configures it) makes for ``layouts``
    at exact lengths; see the module docstring."""

    def __init__(self, layouts: Sequence[BatchLayout], policy: str, base: AttnPolicyConfig, model: CostModel,
                 spec: TensorSpec | None = None) -> None:
        self.layouts = list(layouts)
        self.policy = policy
        self.model = model
        self.spec = spec or model.spec
        options = base.policy_options if policy == base.policy else {}
        guard = Guard.for_policy(policy, options, on_illegal=base.on_illegal, fallback=MaskMode(base.fallback_mode))
        ctx = PolicyContext(config=base, spec=self.spec, cost_model=model)
        layouts = self.layouts
        decided = [guard.decide(layout, ctx).mode for layout in layouts]
        if MaskMode.ROWS in decided:
            raise ConfigError(f"policy {policy!r} runs rows batches, and the planner does not plan rows graph sets "
                              "yet: simulate it (attnpolicy simulate) instead")
        self.guard_fallbacks = guard.fallbacks
        self.modes = np.array([_MODE_CODE[mode] for mode in decided], dtype=np.int64)
        # a CAUSAL step is one call, a VARLEN step one per sequence, a MASK step the MASK
        # call then its VARLEN calls (if the mask is too large); rows in step order
        layout_ids: dict[BatchLayout, int] = {}
        heads = [(s, _CAUSAL, layout.q_tokens, layout.q_tokens, True, False, -1) if mode is MaskMode.CAUSAL
                 else (s, _MASK, layout.q_tokens, layout.kv_tokens, layout.causal, layout.has_context,
                       layout_ids.setdefault(layout, len(layout_ids)))
                 for s, (layout, mode) in enumerate(zip(layouts, decided, strict=True)) if mode is not MaskMode.VARLEN]
        head = [np.array(col, dtype=dtype) for col, dtype in zip(
            zip(*heads, strict=True) if heads else [()] * 7, (np.int64, np.int64, np.int64, np.int64, bool, bool,
                                                                np.int64), strict=True)]
        counts = np.array([len(layout.q_lens) for layout in layouts], dtype=np.int64)
        seq_step = np.repeat(np.arange(len(layouts), dtype=np.int64), counts)
        keep = (self.modes != _MODE_CODE[MaskMode.CAUSAL])[seq_step]
        total = int(counts.sum())
        sq = np.fromiter(chain.from_iterable(layout.q_lens for layout in layouts), np.int64, total)[keep]
        skv = np.fromiter(chain.from_iterable(layout.kv_lens for layout in layouts), np.int64, total)[keep]
        s_step = seq_step[keep]
        s_causal = np.array([layout.causal for layout in layouts], dtype=bool)[s_step]
        s_kind = np.where(plan_rules.runs_causal(s_causal, sq, skv), _CAUSAL, _VARLEN)
        seqs = (s_step, s_kind, sq, skv, s_causal, skv > sq)
        order = np.argsort(np.concatenate((head[0] * 2, s_step * 2 + 1)), kind="stable")
        self.step, self.kind, self.q, self.kv, self.causal, self.context = (
            np.concatenate((h, t)).astype(h.dtype)[order] for h, t in zip(head, seqs))
        self.alt = np.concatenate((np.zeros(len(heads), dtype=bool),
                                   self.modes[s_step] == _MODE_CODE[MaskMode.MASK]))[order]
        self.mask_layout = np.concatenate((head[6], np.full(s_step.size, -1, dtype=np.int64)))[order]
        self.max_kv = np.array([layout.max_kv_len for layout in self.layouts], dtype=np.int64)
        #: mask-cache keys numbered (see :meth:`_mask_ids`), the bytes of each by its
        #: number, and the number of each MASK row's (layout, buckets) code
        self._mask_key_ids: dict[Hashable, int] = {}
        self._mask_bytes: list[int] = []
        self._mask_code_ids: dict[int, int] = {}
        #: results shared by tables whose calls are equal (see :meth:`share`)
        self.memo: dict[object, object] = {}
        #: results keyed by their inputs' content, shared by every table of a plan
        #: (policies that decide differently may still make the same calls)
        self.by_content: dict[object, object] = {}

    def share(self, other: CallTable) -> None:
        """Reuse ``other``'s bucketings and memo when its calls equal this table's, and
        its results keyed by content (candidate lists, replays) whatever its calls."""
        if other is self:
            return
        if other.signature == self.signature:
            self.memo = other.memo
        self.by_content = other.by_content

    @property
    def signature(self) -> bytes:
        """Equal for two tables of the same layouts whose modes are equal (their calls are)."""
        return self.modes.tobytes()

    def shapes(self) -> CallShapes:
        """The exact call shapes of the decided modes (MASK steps' VARLEN rows left out), counted."""
        sel = ~self.alt
        code = self.kind[sel] << 48 | self.q[sel] << 24 | self.kv[sel]
        if not code.size:
            raise ConfigError("a plan needs at least one call shape, got none (empty workload)")
        u, count = np.unique(code, return_counts=True)
        return CallShapes(u >> 48, (u >> 24) & 0xFFFFFF, u & 0xFFFFFF, count)

    def _raise_at(self, config: AttnPolicyConfig, s: int) -> None:
        """Let the dispatcher prepare step ``s`` under ``config``: it raises its own error."""
        from attnpolicy.dispatch import Dispatcher  # only to raise its error: the runtime loads then

        Dispatcher(config, builder=simulated, cost_model=self.model).prepare(self.layouts[s], self.spec)
        raise AssertionError(f"the dispatcher prepared step {s} without the overflow the table found")

    def bucketed(self, config: AttnPolicyConfig) -> Bucketed:
        """The calls of ``config``'s buckets: what its dispatcher requests and records."""
        # the kernel registry (and so torch and the kernels' plugins) loads with the first bucketing
        from attnpolicy.graphs.kernel_choice import KernelChoice

        model, spec = self.model, self.spec
        seq = _table(config, config.max_seq_len)
        batch = _table(config, config.max_batch_tokens)
        eager = config.on_overflow == "eager"
        largest, largest_batch = config.buckets.largest(config.max_seq_len), config.buckets.largest(
            config.max_batch_tokens)
        is_mask = self.kind == _MASK
        qb = np.empty_like(self.q)
        kvb = np.empty_like(self.kv)
        for sel, table, limit in ((is_mask, batch, largest_batch), (~is_mask, seq, largest)):
            for src, dst in ((self.q, qb), (self.kv, kvb)):
                n = src[sel]
                if table is None:
                    b = n.copy()
                else:
                    b = table[np.minimum(np.searchsorted(table, n), table.size - 1)]
                    b = np.where(n > limit, n, b)
                dst[sel] = b
        over = np.asarray(plan_rules.uncompiled(qb, kvb, np.where(is_mask, largest_batch, largest)))
        fell = np.zeros(self.modes.size, dtype=bool)
        primary_mask = is_mask  # MASK rows are always the primary call of a MASK step
        too_large = primary_mask & plan_rules.mask_over(qb, kvb, config.max_mask_bytes)
        if not eager:
            bad = np.zeros(self.modes.size, dtype=bool)
            bad[self.step[(over & ~self.alt) | too_large]] = True
            bad |= self.max_kv > largest
            if bad.any():
                self._raise_at(config, int(np.flatnonzero(bad)[0]))
        fell[self.step[too_large]] = True
        selected = np.where(self.alt, fell[self.step], ~(primary_mask & fell[self.step]))
        rows = np.flatnonzero(selected)
        compiled = ~over[rows]
        fam = self.kind[rows]
        # kinds: (kind, causal, context) -> kernel; key kinds: (kind, key causal, kernel)
        kernels = KernelChoice(config.kernels, config.attn_impl or "sdpa", compiled=config.backend != "none",
                               measured=getattr(model, "kernel_seconds", None))
        kind = (fam * 2 + self.causal[rows]) * 2 + self.context[rows]
        kinds = len(CALL_KINDS) * 4
        first_of = np.full(kinds, rows.size)
        np.minimum.at(first_of, kind, np.arange(rows.size))
        impl_of = np.zeros(kinds, dtype=np.int64)
        impls: dict[str, int] = {}
        for k in np.flatnonzero(first_of < rows.size):  # each kind's kernel, asked of its first call
            r = int(rows[first_of[k]])
            call, layout = self._call(r, int(qb[r]), int(kvb[r]))
            impl_of[k] = impls.setdefault(kernels.impl(call, layout, spec), len(impls))
        impl_code = impl_of[kind]
        key_kind = (impl_code * 3 + fam) * 2 + (self.causal[rows] & (fam != _MASK))
        crow = np.flatnonzero(compiled)
        rc = rows[crow]
        # a compiled call's buckets are in the tables: a dense code of (kind, bucket indices),
        # unless there are no tables or so many buckets that the count would outweigh a sort
        sizes = np.union1d(seq, batch) if seq is not None and batch is not None else None
        span = 2 * len(CALL_KINDS) * len(impls) * sizes.size ** 2 if sizes is not None else 0
        if sizes is None or span > max(4 * crow.size, 1 << 16):
            ids, first_at = _first_order(key_kind[crow] << 48 | qb[rc] << 24 | kvb[rc])
        else:
            at = _positions(sizes, crow.size)
            ids, first_at = _first_order((key_kind[crow] * sizes.size + at(qb[rc])) * sizes.size + at(kvb[rc]), span)
        first = rows[crow[first_at]]
        uses = np.bincount(ids, minlength=first.size)
        keys, per_key = [], np.empty(first.size, dtype=float)
        cost = BatchCost(model, config.max_mask_bytes)  # its per-call seconds; masks are replayed below
        for i, r in enumerate(first.tolist()):
            call, layout = self._call(r, int(qb[r]), int(kvb[r]))
            key = GraphKey.for_call(call, spec, kernels.impl(call, layout, spec), config.partition_len, config.backend)
            keys.append(key)
            per_key[i] = cost.call_seconds(call, key)
        seconds_per_call = np.empty(rows.size, dtype=float)
        seconds_per_call[crow] = per_key[ids]
        for i in np.flatnonzero(~compiled):  # uncompiled: the shape's seconds
            r = int(rows[i])
            seconds_per_call[i] = cost.call_seconds(self._call(r, int(qb[r]), int(kvb[r]))[0], None)
        seconds = float(np.cumsum(seconds_per_call)[-1]) if rows.size else 0.0  # sequential, as a run adds
        builds, build_seconds = self._masks(config, rows[fam == _MASK], qb, kvb)
        ran = np.where(fell, _MODE_CODE[MaskMode.VARLEN], self.modes)
        counts = np.bincount(ran, minlength=len(_MODES))
        stats = {"batches": int(self.modes.size), "calls": int(rows.size),
                 "modes": {m.value: int(counts[i]) for i, m in enumerate(_MODES)}}
        recording = Recording(keys=keys, attention_seconds=seconds + build_seconds, mask_builds=builds,
                              mask_build_seconds=build_seconds, overflow_calls=int((~compiled).sum()), stats=stats)
        return Bucketed(ids, keys, first, uses, qb[first], kvb[first], recording)

    def _call(self, r: int, qb: int, kvb: int) -> tuple[Call, BatchLayout]:
        """Row ``r`` as a call with buckets ``qb``, ``kvb``, and its step's layout."""
        layout = self.layouts[int(self.step[r])]
        call = Call(CALL_KINDS[self.kind[r]], 0, int(self.q[r]), 0, int(self.kv[r]), qb, kvb, bool(self.causal[r]))
        return call, layout

    def _masks(self, config: AttnPolicyConfig, rows: np.ndarray, qb: np.ndarray,
               kvb: np.ndarray) -> tuple[int, float]:
        """Dense mask builds of the MASK ``rows``: the dispatcher's mask cache (LRU within
        ``max_mask_bytes``) replayed as a key stream, its keys and their bytes those of
        :func:`~attnpolicy.kernels.mask_cache.mask_entry` (:meth:`_mask_ids`). When no key
        repeats, every request builds: the builds are the requests and their seconds the
        costs summed in request order, as the replay adds them."""
        if not rows.size:
            return 0, 0.0
        code = self.mask_layout[rows] << 42 | qb[rows] << 21 | kvb[rows]
        calls, calls_first = _first_order(code)  # each distinct (layout, buckets), in request order
        firsts = rows[calls_first]
        numbers = self._mask_ids(code[calls_first], firsts, qb[firsts], kvb[firsts])
        keys, keys_first = _first_order(numbers)
        ids, first = keys[calls], firsts[keys_first]
        window = self.spec.features.window
        shape, which = np.unique(qb[first] << 21 | kvb[first], return_inverse=True)
        build = self.model.mask_build_seconds
        seconds = np.array([build(int(c >> 21), int(c & 0x1FFFFF), window) for c in shape.tolist()])
        costs = seconds[which]
        if first.size == rows.size:  # no repeats
            return int(rows.size), float(np.cumsum(costs)[-1])
        sizes = list(map(self._mask_bytes.__getitem__, numbers[keys_first].tolist()))
        stats = replay_stream(ids.tolist(), sizes, costs.tolist(), max_bytes=config.max_mask_bytes,
                              oversize="uncached")
        return stats.misses, stats.compile_seconds

    def _mask_ids(self, codes: np.ndarray, rows: np.ndarray, qb: np.ndarray, kvb: np.ndarray) -> np.ndarray:
        """The mask-cache key of each MASK row of ``rows`` (its step's layout, bucketed
        ``qb × kvb``, under the table's spec), numbered: equal ids are equal
        :func:`~attnpolicy.kernels.mask_cache.mask_entry` keys, computed by that rule once per
        ``codes`` (the row's layout and buckets) and remembered across configs, with the
        entry's bytes (``_mask_bytes`` by id)."""
        known = self._mask_code_ids
        found = np.fromiter(map(known.get, codes.tolist(), repeat(-1)), dtype=np.int64, count=codes.size)
        new = np.flatnonzero(found < 0)
        if new.size:
            numbered, sizes, entry, layouts = self._mask_key_ids, self._mask_bytes, mask_cache.mask_entry, self.layouts
            device, window = self.spec.device, self.spec.features.window
            for i, c, s, q, k in zip(new.tolist(), codes[new].tolist(), self.step[rows[new]].tolist(),
                                     qb[new].tolist(), kvb[new].tolist(), strict=True):
                key, nbytes = entry(layouts[s], q, k, device, window)
                number = numbered.setdefault(key, len(numbered))
                if number == len(sizes):
                    sizes.append(nbytes)
                found[i] = known[c] = number
        return found

    def cached(self, config: AttnPolicyConfig) -> tuple[Bucketed, KeyStream]:
        """:meth:`bucketed` of ``config`` (without its per-call ``ids``) and its key stream,
        remembered per buckets and limits."""
        memo_key = ("bucketed", config.buckets.model_dump_json(), config.max_seq_len, config.max_batch_tokens,
                    config.max_mask_bytes, config.on_overflow, config.backend, config.attn_impl,
                    tuple(sorted(config.kernels.items())), config.partition_len)
        hit = self.memo.get(memo_key)
        if hit is None:
            b = self.bucketed(config)
            stream = KeyStream.of_ids(b.ids, b.keys, self.model)
            hit = self.memo[memo_key] = (replace(b, ids=b.ids[:0]), stream)
        return hit  # type: ignore[return-value]

    def rows(self, config: AttnPolicyConfig, evictions: Sequence[str], scheme: str,
             rejected: int = 0) -> list[SimRow]:
        """The simulated rows of ``config`` (its bounds) per eviction, as
        :func:`~attnpolicy.modelling.simulation.simulate_layouts` gives them."""
        b, stream = self.cached(config)
        recording = replace(b.recording, stats={**b.recording.stats, "guard_fallbacks": self.guard_fallbacks})
        warmup = self.model.warmup_cost(recording.keys)
        return [sim_row(scheme, self.policy, config, eviction, recording, self._replayed(config, eviction, stream),
                        stream.compulsory, rejected, warmup) for eviction in evictions]

    def _replayed(self, config: AttnPolicyConfig, eviction: str, stream: KeyStream) -> StreamStats:
        """``stream`` through ``config``'s bounds with ``eviction``, remembered."""
        memo_key = ("replay", stream.fingerprint, config.max_graphs, config.max_bytes, config.oversize,
                    config.store_dir is not None, config.max_disk_bytes, eviction)
        hit = self.by_content.get(memo_key)
        if hit is None:
            hit = self.by_content[memo_key] = stream.replay(config, eviction)
        assert isinstance(hit, StreamStats)
        return hit


def _positions(sizes: np.ndarray, n: int) -> Callable[[np.ndarray], np.ndarray]:
    """The position in ascending ``sizes`` of each of ``n`` values, every one of them among
    ``sizes``: read from a table by value when that is not larger than the values, else
    searched."""
    if int(sizes[-1]) > 4 * max(n, 1 << 14):
        def searched(values: np.ndarray) -> np.ndarray:
            return np.searchsorted(sizes, values)
        return searched
    table = np.zeros(int(sizes[-1]) + 1, dtype=np.int64)
    table[sizes] = np.arange(sizes.size)
    return table.__getitem__


def _first_order(code: np.ndarray, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ids of ``code``'s values numbered in order of first occurrence, and each id's first
    position. ``size``: every code is below it (counted densely, without a sort)."""
    if size is None:
        _, first_at, inverse = np.unique(code, return_index=True, return_inverse=True)
        order = np.argsort(first_at, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        return rank[inverse], first_at[order]
    first = np.full(size, code.size)
    np.minimum.at(first, code, np.arange(code.size))
    order = np.flatnonzero(first < code.size)
    order = order[np.argsort(first[order], kind="stable")]
    rank = np.empty(size, dtype=np.int64)
    rank[order] = np.arange(order.size)
    return rank[code], first[order]


def _table(config: AttnPolicyConfig, max_len: int) -> np.ndarray | None:
    """The sorted buckets of ``config`` up to ``max_len`` (None: ``exact``, every length its own)."""
    if config.buckets.kind == "exact":
        return None
    return np.array(config.buckets.sizes_up_to(max_len), dtype=np.int64)

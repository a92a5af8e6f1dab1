"""The calls a stateless policy makes for a workload, found once and bucketed by any list.

A stateless policy decides from the layout and the config: most from the layout alone,
so that their calls at exact lengths are the same under every bucket list; only their
buckets, and with them the graph keys, change. :class:`CallTable` decides every step
once and keeps one row per call (its kind, exact lengths, causality, the step it
belongs to); a policy that reads the config's buckets (``reads_buckets``: ``dynamic``
with its ``rows`` option weighs a rows plan's padding) or asks for plans (``keys_for``)
decides again under each config bucketed, as a dispatcher of that config would.
:meth:`CallTable.bucketed` then buckets every row at once (numpy) for a config and gives what a simulating
dispatcher run of that config records (:class:`~attnpolicy.modelling.simulation.Recording`)
and its key stream, in the same order and with the same floating-point sums, so the
rows it makes (:meth:`CallTable.rows`) are those of
:func:`~attnpolicy.modelling.simulation.simulate_layouts`. The planner evaluates its
candidate lists with it instead of a dispatcher run each.

The rows follow the dispatcher's rules, applied to every row at once by the functions its
planner applies to one call (:mod:`attnpolicy.graphs.plan_rules`): VARLEN runs a causal
sequence without context on the CAUSAL graph of its bucket (``runs_causal``); a ROWS
step runs one call per ``row_groups`` range (the calls
:func:`~attnpolicy.graphs.calls.plan_calls` plans at exact lengths: its longest row's
lengths, its sequences, whose ``rows_bucket`` is its row count); a MASK
call whose bucketed mask is over ``max_mask_bytes`` (``mask_over``) runs its step in
VARLEN (the table holds both); a length above the largest bucket
(:meth:`~attnpolicy.graphs.buckets.Buckets.largest`) runs uncompiled (``uncompiled``,
``on_overflow="eager"``) or raises as the dispatcher does (``"raise"``: the dispatcher
itself is asked to prepare that step). Configs with ``compile_mode="background"``
(pad-up depends on the cache state) are not tabled: :func:`tabled` says so and callers
simulate them with the dispatcher.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from itertools import chain, repeat
from typing import TYPE_CHECKING

import numpy as np

from attnpolicy.cache.key_stream import StreamStats, replay_stream
from attnpolicy.config import AttnPolicyConfig
from attnpolicy.core.layout import BatchLayout
from attnpolicy.core.modes import CALL_KINDS, CallKind, MaskMode
from attnpolicy.errors import ConfigError
from attnpolicy.graphs import plan_rules
from attnpolicy.graphs.batch_cost import BatchCost
from attnpolicy.graphs.calls import plan_calls
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import Call, GraphKey, TensorSpec
from attnpolicy.kernels import mask_cache
from attnpolicy.modelling.simulation import Recording, SimRow, sim_row, simulated
from attnpolicy.modelling.streams import KeyStream
from attnpolicy.planning.bucket_search import CallShapes
from attnpolicy.policies.base import PolicyContext
from attnpolicy.policies.guard import Guard

if TYPE_CHECKING:
    from attnpolicy.dispatch.batch_plan import BatchPlanner
    from attnpolicy.graphs.kernel_choice import KernelChoice

#: Call kinds by the codes of :attr:`CallTable.kind`.
_CAUSAL, _MASK, _VARLEN, _ROWS = map(CALL_KINDS.index, (CallKind.CAUSAL, CallKind.MASK, CallKind.VARLEN,
                                                         CallKind.ROWS))
_MODES = tuple(MaskMode)
_MODE_CODE = {m: i for i, m in enumerate(_MODES)}


def tabled(config: AttnPolicyConfig) -> bool:
    """Whether :class:`CallTable` models ``config`` exactly (synchronous compiles)."""
    return config.compile_mode == "sync"


def _kernels(config: AttnPolicyConfig, model: CostModel) -> KernelChoice:
    """The kernel choice of a dispatcher of ``config`` priced by ``model``."""
    from attnpolicy.graphs.kernel_choice import KernelChoice  # loads the kernel registry (torch, plugins)

    return KernelChoice(config.kernels, config.attn_impl or "sdpa", compiled=config.backend != "none",
                        measured=getattr(model, "kernel_seconds", None))


def _plan_fields(config: AttnPolicyConfig) -> tuple[object, ...]:
    """What a config's calls, keys and prices depend on besides the decisions."""
    return (config.buckets.model_dump_json(), config.max_seq_len, config.max_batch_tokens, config.max_mask_bytes,
            config.on_overflow, config.backend, config.attn_impl, tuple(sorted(config.kernels.items())),
            config.partition_len, config.row_buckets)


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
    causal: np.ndarray  # per key: its first call's causality ...
    context: np.ndarray  # ... and cached context
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
        self.base = base
        options = base.policy_options if policy == base.policy else {}
        self._guard = Guard.for_policy(policy, options, on_illegal=base.on_illegal,
                                       fallback=MaskMode(base.fallback_mode))
        #: whether the policy reads the config's buckets (it says so, or asks for plans):
        #: it then decides again under each config
        self.reads_buckets = bool(getattr(self._guard.policy, "reads_buckets", False))
        decided, self.guard_fallbacks = self._decide(base)
        self._calls(decided, base.row_buckets[-1])
        self._fresh()
        #: results keyed by their inputs' content, shared by every table of a plan
        #: (policies that decide differently may still make the same calls)
        self.by_content: dict[object, object] = {}

    def _decide(self, config: AttnPolicyConfig) -> tuple[list[MaskMode], int]:
        """The mode the guarded policy decides for each step under ``config`` (the plans it
        asks for, a planner of ``config``'s), and the guard's fallbacks meanwhile."""
        planner: list[BatchPlanner] = []  # built when first asked
        spec = self.spec

        def keys_for(layout: BatchLayout, mode: MaskMode) -> tuple[GraphKey, ...]:
            if not planner:
                from attnpolicy.dispatch.batch_plan import BatchPlanner  # the runtime's: loads the kernels

                planner.append(BatchPlanner(config, _kernels(config, self.model)))
                self.reads_buckets = True
            return planner[0].keys_for(layout, mode, spec)

        guard, before = self._guard, self._guard.fallbacks
        ctx = PolicyContext(config=config, spec=spec, keys_for=keys_for, cost_model=self.model)
        return [guard.decide(layout, ctx).mode for layout in self.layouts], guard.fallbacks - before

    def _calls(self, decided: Sequence[MaskMode], max_rows: int) -> None:
        """One row per call of the ``decided`` modes, in step order; a ROWS step's calls
        hold at most ``max_rows`` sequences."""
        layouts = self.layouts
        self.max_rows = max_rows
        self.modes = np.array([_MODE_CODE[mode] for mode in decided], dtype=np.int64)
        # a CAUSAL step is one call, a ROWS step one per row range, a VARLEN step one per
        # sequence, a MASK step the MASK call then its VARLEN calls (if the mask is too
        # large); rows in step order
        layout_ids: dict[BatchLayout, int] = {}
        heads = [(s, _CAUSAL, layout.q_tokens, layout.q_tokens, True, False, -1, 1) if mode is MaskMode.CAUSAL
                 else (s, _MASK, layout.q_tokens, layout.kv_tokens, layout.causal, layout.has_context,
                       layout_ids.setdefault(layout, len(layout_ids)), 1)
                 for s, (layout, mode) in enumerate(zip(layouts, decided, strict=True))
                 if mode in (MaskMode.CAUSAL, MaskMode.MASK)]
        heads += [(s, _ROWS, call.q_bucket, call.kv_bucket, call.causal, call.context, -1, call.seqs)
                  for s, (layout, mode) in enumerate(zip(layouts, decided, strict=True)) if mode is MaskMode.ROWS
                  for call in plan_calls(layout, mode, max_rows=max_rows)]  # exact: its longest row's lengths
        head = [np.array(col, dtype=dtype) for col, dtype in zip(
            zip(*heads, strict=True) if heads else [()] * 8, (np.int64, np.int64, np.int64, np.int64, bool, bool,
                                                                np.int64, np.int64), strict=True)]
        counts = np.array([len(layout.q_lens) for layout in layouts], dtype=np.int64)
        seq_step = np.repeat(np.arange(len(layouts), dtype=np.int64), counts)
        keep = np.isin(self.modes, (_MODE_CODE[MaskMode.VARLEN], _MODE_CODE[MaskMode.MASK]))[seq_step]
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
        #: the sequences of each call (a ROWS call's; 1 for every other)
        self.seqs = np.concatenate((head[7], np.ones(s_step.size, dtype=np.int64)))[order]
        self.max_kv = np.array([layout.max_kv_len for layout in self.layouts], dtype=np.int64)

    def _fresh(self) -> None:
        """Empty memos of this table's calls."""
        #: mask-cache keys numbered (see :meth:`_mask_ids`), the bytes of each by its
        #: number, and the number of each MASK row's (layout, buckets) code
        self._mask_key_ids: dict[Hashable, int] = {}
        self._mask_bytes: list[int] = []
        self._mask_code_ids: dict[int, int] = {}
        #: results shared by tables whose calls are equal (see :meth:`share`)
        self.memo: dict[object, object] = {}
        #: the tables of other configs' calls (see :meth:`of_config`), and a policy's
        #: decisions per config when it reads the buckets
        self._tables: dict[object, CallTable] = {}
        self._decisions: dict[object, tuple[list[MaskMode], int]] = {}

    def of_config(self, config: AttnPolicyConfig) -> CallTable:
        """The table of ``config``'s calls: this one, unless the policy reads the buckets
        (it decides again under ``config``) or ``config``'s largest row bucket splits rows
        batches otherwise; remembered."""
        max_rows = config.row_buckets[-1]
        if not self.reads_buckets and max_rows == self.max_rows:
            return self
        if self.reads_buckets:
            fields = _plan_fields(config)
            if fields not in self._decisions:
                self._decisions[fields] = self._decide(config)
            decided, fallbacks = self._decisions[fields]
        else:
            decided, fallbacks = [_MODES[m] for m in self.modes], self.guard_fallbacks
        modes = np.array([_MODE_CODE[mode] for mode in decided], dtype=np.int64)
        if max_rows == self.max_rows and fallbacks == self.guard_fallbacks and np.array_equal(modes, self.modes):
            return self
        found = self._tables.get((modes.tobytes(), fallbacks, max_rows))
        if found is None:
            found = self._tables[modes.tobytes(), fallbacks, max_rows] = copy.copy(self)
            found.reads_buckets, found.guard_fallbacks = False, fallbacks  # decided: its calls are these
            found._calls(decided, max_rows)
            found._fresh()
        return found

    def share(self, other: CallTable) -> None:
        """Reuse ``other``'s bucketings and memo when its calls equal this table's, and
        its results keyed by content (candidate lists, replays) whatever its calls."""
        if other is self:
            return
        if other.signature == self.signature and not (self.reads_buckets or other.reads_buckets):
            self.memo = other.memo
        self.by_content = other.by_content

    @property
    def signature(self) -> bytes:
        """Equal for two tables of the same layouts whose modes and largest row bucket are
        equal (their calls are)."""
        return self.modes.tobytes() + self.max_rows.to_bytes(8, "little")

    def _row_counts(self, config: AttnPolicyConfig) -> np.ndarray:
        """Each call's row count under ``config``: a ROWS call's ``rows_bucket`` of its
        sequences, 1 for every other call."""
        out: np.ndarray = np.ones_like(self.seqs)
        rows = self.kind == _ROWS
        if rows.any():
            counts, inverse = np.unique(self.seqs[rows], return_inverse=True)
            out[rows] = np.array([config.rows_bucket(n) for n in counts.tolist()], dtype=np.int64)[inverse]
        return out

    def shapes(self) -> CallShapes:
        """The exact call shapes of the base config's decisions (MASK steps' VARLEN rows
        left out; a ROWS call's rows by its ``row_buckets``), counted."""
        sel = ~self.alt
        if not sel.any():
            raise ConfigError("a plan needs at least one call shape, got none (empty workload)")
        columns = np.stack((self.kind[sel], self.q[sel], self.kv[sel], self._row_counts(self.base)[sel]))
        (kind, q, kv, rows), count = np.unique(columns, axis=1, return_counts=True)
        return CallShapes(kind, q, kv, count, rows)

    def _raise_at(self, config: AttnPolicyConfig, s: int) -> None:
        """Let the dispatcher prepare step ``s`` under ``config``: it raises its own error."""
        from attnpolicy.dispatch import Dispatcher  # only to raise its error: the runtime loads then

        Dispatcher(config, builder=simulated, cost_model=self.model).prepare(self.layouts[s], self.spec)
        raise AssertionError(f"the dispatcher prepared step {s} without the overflow the table found")

    def bucketed(self, config: AttnPolicyConfig) -> Bucketed:
        """The calls of ``config``'s buckets: what its dispatcher requests and records."""
        other = self.of_config(config)
        if other is not self:
            return other.bucketed(config)
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
                    b = np.where(self.kind[sel] == _ROWS, plan_rules.rows_length(n, b), b)
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
        n_rows = self._row_counts(config)
        # kinds: (kind, causal, context) -> kernel; key kinds: (kernel, kind, key causal, key
        # context, rows), as GraphKey.for_call keys them
        kernels = _kernels(config, model)
        kind = (fam * 2 + self.causal[rows]) * 2 + self.context[rows]
        kinds = len(CALL_KINDS) * 4
        first_of = np.full(kinds, rows.size)
        np.minimum.at(first_of, kind, np.arange(rows.size))
        impl_of = np.zeros(kinds, dtype=np.int64)
        impls: dict[str, int] = {}
        for k in np.flatnonzero(first_of < rows.size):  # each kind's kernel, asked of its first call
            r = int(rows[first_of[k]])
            call, layout = self._call(r, int(qb[r]), int(kvb[r]), int(n_rows[r]))
            impl_of[k] = impls.setdefault(kernels.impl(call, layout, spec), len(impls))
        impl_code = impl_of[kind]
        key_causal = self.causal[rows] & (fam != _MASK)
        row_counts, row_code = np.unique(n_rows[rows], return_inverse=True)
        key_kind = ((((impl_code * len(CALL_KINDS) + fam) * 2 + key_causal) * 2
                     + (key_causal & self.context[rows] & (fam == _ROWS))) * row_counts.size + row_code.reshape(-1))
        key_kinds = len(impls) * len(CALL_KINDS) * 4 * row_counts.size
        crow = np.flatnonzero(compiled)
        rc = rows[crow]
        # a compiled call's buckets are in the tables, or 1 (a rows call's length where every
        # row holds one: rows_length): a dense code of (kind, bucket indices), unless there
        # are no tables or so many buckets that the count would outweigh a sort
        sizes = np.union1d(np.union1d(seq, batch), 1) if seq is not None and batch is not None else None
        span = key_kinds * sizes.size ** 2 if sizes is not None else 0
        if sizes is None or span > max(4 * crow.size, 1 << 16):
            q_span, kv_span = int(qb.max(initial=0)) + 1, int(kvb.max(initial=0)) + 1
            ids, first_at = _first_order((key_kind[crow] * q_span + qb[rc]) * kv_span + kvb[rc])
        else:
            at = _positions(sizes, crow.size)
            ids, first_at = _first_order((key_kind[crow] * sizes.size + at(qb[rc])) * sizes.size + at(kvb[rc]), span)
        first = rows[crow[first_at]]
        uses = np.bincount(ids, minlength=first.size)
        keys, per_key = [], np.empty(first.size, dtype=float)
        cost = BatchCost(model, config.max_mask_bytes)  # its per-call seconds; masks are replayed below
        for i, r in enumerate(first.tolist()):
            call, layout = self._call(r, int(qb[r]), int(kvb[r]), int(n_rows[r]))
            key = GraphKey.for_call(call, spec, kernels.impl(call, layout, spec), config.partition_len, config.backend)
            keys.append(key)
            per_key[i] = cost.call_seconds(call, key)
        seconds_per_call = np.empty(rows.size, dtype=float)
        seconds_per_call[crow] = per_key[ids]
        for i in np.flatnonzero(~compiled):  # uncompiled: the shape's seconds
            r = int(rows[i])
            seconds_per_call[i] = cost.call_seconds(self._call(r, int(qb[r]), int(kvb[r]), int(n_rows[r]))[0], None)
        seconds = float(np.cumsum(seconds_per_call)[-1]) if rows.size else 0.0  # sequential, as a run adds
        builds, build_seconds = self._masks(config, rows[fam == _MASK], qb, kvb)
        ran = np.where(fell, _MODE_CODE[MaskMode.VARLEN], self.modes)
        counts = np.bincount(ran, minlength=len(_MODES))
        stats = {"batches": int(self.modes.size), "calls": int(rows.size),
                 "modes": {m.value: int(counts[i]) for i, m in enumerate(_MODES)}}
        recording = Recording(keys=keys, attention_seconds=seconds + build_seconds, mask_builds=builds,
                              mask_build_seconds=build_seconds, overflow_calls=int((~compiled).sum()), stats=stats)
        return Bucketed(ids, keys, first, uses, qb[first], kvb[first], self.causal[first], self.context[first],
                        recording)

    def _call(self, r: int, qb: int, kvb: int, rows: int) -> tuple[Call, BatchLayout]:
        """Row ``r`` as a call with buckets ``qb``, ``kvb`` in ``rows`` rows, and its step's layout."""
        layout = self.layouts[int(self.step[r])]
        call = Call(CALL_KINDS[self.kind[r]], 0, int(self.q[r]), 0, int(self.kv[r]), qb, kvb, bool(self.causal[r]),
                    seqs=int(self.seqs[r]), rows=rows, context=bool(self.context[r]))
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
        other = self.of_config(config)
        if other is not self:
            return other.cached(config)
        memo_key = ("bucketed", *_plan_fields(config))
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
        table = self.of_config(config)
        b, stream = table.cached(config)
        recording = replace(b.recording, stats={**b.recording.stats, "guard_fallbacks": table.guard_fallbacks})
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

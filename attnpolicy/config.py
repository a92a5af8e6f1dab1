"""The configuration: everything that affects compiled graphs and decisions.

Validated once (RBLN-style rules between ``attn_impl``, ``partition_len`` and
``max_seq_len``), immutable, saved as ``attnpolicy_config.json`` next to compiled
artefacts and read back at load. See ``docs/config.md``.

The config is plain data: it imports neither torch, the plugin registry nor the
cache. The policy, eviction and backend *names* (and ``policy_options``) are checked
where they are resolved: when a :class:`~attnpolicy.dispatch.Dispatcher` builds its
policy, cache and compiler, or by :func:`attnpolicy.policies.resolve.validate_names`
(``attnpolicy config validate``). The runtime integrations read theirs from the
environment: :func:`attnpolicy.integrations.environment.from_env`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    field_validator,
    model_validator,
)

from attnpolicy.core import jsonfile
from attnpolicy.core.modes import CallKind
from attnpolicy.core.names import (
    DEFAULT_MAX_MASK_BYTES,
    CompileMode,
    FallbackMode,
    Impl,
    OnCompileError,
    OnIllegal,
    OnOverflow,
    Oversize,
    Strict,
)
from attnpolicy.core.paths import why_not_a_directory
from attnpolicy.errors import AttnPolicyError
from attnpolicy.graphs import plan_rules
from attnpolicy.graphs.buckets import Buckets, PositiveInt

CONFIG_FILENAME = "attnpolicy_config.json"
CONFIG_VERSION: Literal[1] = 1

logger = logging.getLogger("attnpolicy.config")


class WarmShape(BaseModel):
    """One graph to compile at warm-up, without its tensor spec (known only at run
    time): the call kind, its query and key buckets, causality and whether keys
    include cached context (``attnpolicy plan`` writes these); a rows graph's row
    count ``rows`` (one of ``row_buckets``; 1 for every other kind)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, serialize_by_alias=True)

    kind: CallKind = Field(alias="family")  # named "family" in the JSON
    q_bucket: PositiveInt
    kv_bucket: PositiveInt
    causal: bool = True
    context: bool = False
    rows: PositiveInt = Field(1, exclude_if=lambda rows: rows == 1)  # written for rows graphs only

    @model_validator(mode="after")
    def _a_planned_call(self) -> WarmShape:
        q, kv = self.q_bucket, self.kv_bucket
        if self.kind is not CallKind.ROWS and self.rows != 1:
            raise ValueError(f"rows {self.rows} is for a rows graph: a {self.kind.value} graph has rows 1")
        if q > kv:
            raise ValueError(f"q_bucket {q} must be <= kv_bucket {kv}")
        if self.kind is CallKind.CAUSAL and (q != kv or not self.causal or self.context):
            raise ValueError(f"a causal graph has q_bucket == kv_bucket, causal true and context false, got "
                             f"q_bucket {q}, kv_bucket {kv}, causal {self.causal}, context {self.context}")
        if self.kind is CallKind.VARLEN and self.causal and not self.context:
            raise ValueError("a causal sequence without context runs the causal graph: a varlen graph "
                             "needs causal false or context true")
        if not self.context and q != kv:
            raise ValueError(f"kv_bucket {kv} > q_bucket {q} needs context true (keys beyond the "
                             "queries are cached context)")
        if self.context and kv < 2:
            raise ValueError(f"context true needs kv_bucket >= 2 (more keys than queries), got {kv}")
        return self


class AttnPolicyConfig(BaseModel):
    """Policy, buckets, cache bounds, eviction, compile backend and attention
    implementation of one runtime. Frozen: build a new one to change a field.

    ``attn_impl`` is resolved at validation and is never ``None`` afterwards:
    ``"flash"`` when ``partition_len`` is given and differs from ``max_seq_len``
    (an INFO notice is logged), ``"sdpa"`` otherwise.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = CONFIG_VERSION
    policy: str = "varlen"
    policy_options: dict[str, JsonValue] = Field(default_factory=dict)
    buckets: Buckets = Buckets()
    max_graphs: PositiveInt | None = None
    max_bytes: PositiveInt | None = None
    eviction: str = "lru"
    #: the compiler: a built-in (inductor, aot_eager, eager, none), a plugin's, a Dynamo
    #: backend's name or a module:function path (see docs/config.md)
    backend: str = "inductor"
    #: keyword options of the compiler's backend (``backend(gm, example_inputs, **options)``)
    backend_options: dict[str, JsonValue] = Field(default_factory=dict)
    attn_impl: Impl | None = None
    partition_len: PositiveInt | None = None
    #: implementation per call kind ("causal", "mask", "varlen"): a registered kernel
    #: name or "auto"; a kind not listed uses attn_impl
    kernels: dict[str, str] = Field(default_factory=dict)
    max_seq_len: PositiveInt = 8192
    max_batch_tokens: PositiveInt = 65536
    #: the rows a ROWS graph may hold (one sequence a row): a batch's sequence count
    #: rounds up to the first of these; a batch with more runs in several calls of the
    #: largest (a runtime's fixed batch size, or its batch buckets)
    row_buckets: tuple[PositiveInt, ...] = (1, 2, 4, 8, 16, 32)
    max_mask_bytes: PositiveInt = DEFAULT_MAX_MASK_BYTES
    on_illegal: OnIllegal = "fallback"
    fallback_mode: FallbackMode = "varlen"
    on_overflow: OnOverflow = "raise"
    on_compile_error: OnCompileError = "raise"
    oversize: Oversize = "raise"
    strict: Strict = "off"
    #: "background": a miss runs on a resident larger bucket (pad-up) while the exact
    #: graph compiles in a worker thread; it enters the cache switch_after batches later
    compile_mode: CompileMode = "sync"
    switch_after: PositiveInt = 8
    #: graphs to compile at warm-up (``Dispatcher.warmup(spec)``; transformers at first use, vLLM at engine start)
    warmup: tuple[WarmShape, ...] = ()
    #: a graph store directory: compiled graphs persist there and a miss loads them
    #: instead of compiling (see docs/store.md); None: graphs live as long as the process.
    #: Kept as written; a leading ``~`` is expanded where the store opens it
    store_dir: str | None = None
    #: the store's bound on disk (artifacts and manifests), least recently used evicted
    max_disk_bytes: PositiveInt = 2 << 30

    @field_validator("policy", "eviction", "backend")
    @classmethod
    def _a_name(cls, name: str) -> str:
        if not name.strip():
            raise ValueError(f"must be a registered name, got {name!r}")
        return name

    @field_validator("eviction")
    @classmethod
    def _live_eviction(cls, name: str) -> str:
        if name == "belady":
            raise ValueError("eviction 'belady' is simulation-only: it needs an oracle of future "
                             "requests (next_use), which a live runtime does not have")
        return name

    @field_validator("store_dir")
    @classmethod
    def _a_directory(cls, path: str | None) -> str | None:
        why = None if path is None else why_not_a_directory(path)
        if why is not None:
            raise ValueError(f"store_dir {why}")
        return path

    @field_validator("kernels")
    @classmethod
    def _kernel_kinds(cls, kernels: dict[str, str]) -> dict[str, str]:
        kinds = tuple(f.value for f in CallKind)
        for kind, name in kernels.items():
            if kind not in kinds:
                raise ValueError(f"kernels: call kind {kind!r} is not one of {', '.join(kinds)}")
            if not name.strip():
                raise ValueError(f"kernels: {kind} must name a registered kernel or 'auto', got {name!r}")
        return kernels

    @field_validator("row_buckets")
    @classmethod
    def _increasing(cls, sizes: tuple[int, ...]) -> tuple[int, ...]:
        if not sizes or any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"must be a non-empty, strictly increasing list of row counts, got {list(sizes)}")
        return sizes

    @model_validator(mode="after")
    def _rules(self) -> AttnPolicyConfig:
        if self.max_batch_tokens < self.max_seq_len:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} must be >= max_seq_len "
                             f"{self.max_seq_len}")
        self._check_buckets()
        self._check_warmup()
        object.__setattr__(self, "attn_impl", self._resolve_attn_impl())
        return self

    def _resolve_attn_impl(self) -> Impl:
        """RBLN's rule: a ``partition_len`` that differs from ``max_seq_len`` means
        flash attention; the default otherwise is ``sdpa``, torch's fused kernel, the
        fastest exact implementation on CPU and CUDA (RBLN defaults to ``eager``
        because its compiler has no fused kernel)."""
        impl, part, max_len = self.attn_impl, self.partition_len, self.max_seq_len
        if part is not None and part > max_len:
            raise ValueError(f"partition_len {part} must be <= max_seq_len {max_len}")
        partitioned = part is not None and part != max_len
        auto = impl is None
        if auto:
            if not partitioned:
                return "sdpa"
            impl = "flash"
        elif partitioned and impl != "flash":
            raise ValueError(f"attn_impl {impl!r} conflicts with partition_len {part}: a partition_len "
                             f"that differs from max_seq_len {max_len} needs attn_impl 'flash'")
        if impl == "flash":
            if part is None:
                raise ValueError("attn_impl 'flash' needs partition_len (the tokens per KV partition), "
                                 "got None")
            if max_len % part:
                raise ValueError(f"max_seq_len {max_len} must be a multiple of partition_len {part} "
                                 f"for attn_impl 'flash'")
        if auto:
            logger.info("partition_len=%d differs from max_seq_len=%d: attn_impl set to 'flash'",
                        part, max_len)
        assert impl is not None  # set above when it was None
        return impl

    def _check_buckets(self) -> None:
        """Buckets must fit the lengths they serve: pow2's ``min`` (when set) and the
        first ``multiple`` fit ``max_seq_len``; a list needs a size that fits
        ``max_seq_len`` and none above ``max_batch_tokens`` (sizes above
        ``max_seq_len`` serve only the packed rows of MASK calls)."""
        b, max_len = self.buckets, self.max_seq_len
        if b.kind == "pow2" and "min" in b.model_fields_set and b.min is not None and b.min > max_len:
            raise ValueError(f"buckets.min has bucket {b.min} > max_seq_len {max_len}")
        if b.kind == "multiple" and b.multiple is not None and b.multiple > max_len:
            raise ValueError(f"buckets.multiple has bucket {b.multiple} > max_seq_len {max_len}")
        if b.kind == "list" and b.sizes:
            if b.sizes[0] > max_len:
                raise ValueError(f"buckets.sizes has no bucket <= max_seq_len {max_len}: {list(b.sizes)}")
            if b.sizes[-1] > self.max_batch_tokens:
                raise ValueError(f"buckets.sizes has bucket {b.sizes[-1]} > max_batch_tokens "
                                 f"{self.max_batch_tokens}")

    def _check_warmup(self) -> None:
        """Every warm-up shape's buckets are buckets of this config (MASK rows: of
        ``max_batch_tokens``, others: of ``max_seq_len``; a ROWS shape's lengths may be 1,
        :func:`~attnpolicy.graphs.plan_rules.rows_length`); a MASK shape's mask fits
        ``max_mask_bytes`` (no batch could use it otherwise); the warm set fits
        ``max_graphs`` (warm-up would evict its own graphs). Its bytes depend on the
        tensor spec: the dispatcher checks them against ``max_bytes`` at warm-up."""
        distinct = len(set(self.warmup))
        if self.max_graphs is not None and distinct > self.max_graphs:
            raise ValueError(f"warmup has {distinct} distinct graphs, more than max_graphs={self.max_graphs}: "
                             "warm-up would evict its own graphs")
        for i, shape in enumerate(self.warmup):
            mask = shape.kind is CallKind.MASK
            if shape.rows not in self.row_buckets:
                raise ValueError(f"warmup.{i}: rows {shape.rows} is not one of row_buckets {list(self.row_buckets)}")
            if mask and plan_rules.mask_over(shape.q_bucket, shape.kv_bucket, self.max_mask_bytes):
                raise ValueError(f"warmup.{i}: a mask graph of {shape.q_bucket} x {shape.kv_bucket} needs a "
                                 f"{shape.q_bucket * shape.kv_bucket}-byte mask, more than "
                                 f"max_mask_bytes={self.max_mask_bytes}: no batch can use it")
            limit = self.max_batch_tokens if mask else self.max_seq_len
            for name in ("q_bucket", "kv_bucket"):
                n = getattr(shape, name)
                try:
                    b = self.buckets.bucket(n, limit)
                    if shape.kind is CallKind.ROWS:  # decode rows (or one-token rows): exactly 1
                        b = int(plan_rules.rows_length(n, b))
                except AttnPolicyError:
                    b = None
                if b != n:
                    rounds = f"it rounds up to {b}" if b else f"above the largest bucket of {limit}"
                    raise ValueError(f"warmup.{i}.{name}: {n} is not a bucket of {self.buckets.describe()} "
                                     f"for {'max_batch_tokens' if mask else 'max_seq_len'} {limit} ({rounds})")

    def bucket(self, n: int) -> int:
        """The compiled length of one sequence of ``n`` tokens (hot path; see
        :meth:`Buckets.bucket`); at most ``max_seq_len``."""
        return self.buckets.bucket(n, self.max_seq_len)

    def batch_bucket(self, n: int) -> int:
        """The compiled row count of a packed MASK call of ``n`` rows (all sequences'
        queries, or all their keys with cached context); at most ``max_batch_tokens``."""
        return self.buckets.bucket(n, self.max_batch_tokens)

    def rows_bucket(self, n: int) -> int:
        """The compiled row count of a ROWS call of ``n`` sequences: the first of
        ``row_buckets`` that holds them (``ValueError`` above the largest: such a batch
        runs in several calls)."""
        for size in self.row_buckets:
            if size >= n:
                return size
        raise ValueError(f"{n} sequences exceed the largest of row_buckets {list(self.row_buckets)}")

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``<directory>/attnpolicy_config.json`` (all fields, resolved) atomically
        as strict JSON (:func:`~attnpolicy.core.jsonfile.write_json`). Creates the directory."""
        return jsonfile.write_json(Path(directory) / CONFIG_FILENAME, self)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AttnPolicyConfig:
        """Read a config from a directory (its ``attnpolicy_config.json``) or a file.

        Any problem (missing or unreadable file, invalid JSON, wrong version, invalid
        or unknown field) raises :class:`ConfigError` naming the file and every bad
        field; nothing is returned unless the whole file is valid."""
        p = Path(path)
        file = p / CONFIG_FILENAME if p.is_dir() else p
        return jsonfile.parse(cls, jsonfile.read_text(file, "config"), str(file), "config", CONFIG_VERSION)

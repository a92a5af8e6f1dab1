"""The configuration: everything that affects compiled graphs and decisions.

Validated once (RBLN-style rules between ``attn_impl``, ``partition_len`` and
``max_seq_len``), immutable, saved as ``attnpolicy_config.json`` next to compiled
artefacts and read back at load. See ``docs/config.md``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
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
from attnpolicy.errors import ConfigError, PolicyError
from attnpolicy.graphs.buckets import Buckets, PositiveInt
from attnpolicy.plugins.registry import eviction_registry, make_policy, policy_registry

CONFIG_FILENAME = "attnpolicy_config.json"
CONFIG_ENV = "ATTNPOLICY_CONFIG"
POLICY_ENV = "ATTNPOLICY_POLICY"
FORMAT_VERSION = 1

logger = logging.getLogger("attnpolicy.config")


class AttnPolicyConfig(BaseModel):
    """Policy, buckets, cache bounds, eviction, compile backend and attention
    implementation of one runtime. Frozen: build a new one to change a field.

    ``attn_impl`` is resolved at validation and is never ``None`` afterwards:
    ``"flash"`` when ``partition_len`` is given and differs from ``max_seq_len``
    (an INFO notice is logged), ``"sdpa"`` otherwise.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = FORMAT_VERSION
    policy: str = "dynamic"
    policy_options: dict[str, JsonValue] = Field(default_factory=dict)
    buckets: Buckets = Buckets()
    max_graphs: PositiveInt | None = None
    max_bytes: PositiveInt | None = None
    eviction: str = "lru"
    backend: Literal["inductor", "aot_eager", "eager", "none"] = "inductor"
    attn_impl: Literal["sdpa", "eager", "flash"] | None = None
    partition_len: PositiveInt | None = None
    #: implementation per graph family ("causal", "mask", "varlen"): a registered kernel
    #: name or "auto"; a family not listed uses attn_impl
    kernels: dict[str, str] = Field(default_factory=dict)
    max_seq_len: PositiveInt = 8192
    max_batch_tokens: PositiveInt = 65536
    on_illegal: Literal["raise", "fallback"] = "fallback"
    fallback_mode: Literal["mask", "varlen"] = "varlen"
    on_overflow: Literal["raise", "eager"] = "raise"
    on_compile_error: Literal["raise", "eager"] = "raise"
    oversize: Literal["raise", "uncached"] = "raise"
    strict: Literal["off", "warn", "raise"] = "off"

    @field_validator("policy")
    @classmethod
    def _registered_policy(cls, name: str) -> str:
        known = policy_registry()
        if name not in known:
            raise ValueError(f"policy {name!r} is not a registered policy; "
                             f"known policies: {', '.join(sorted(known)) or '(none)'}")
        return name

    @field_validator("eviction")
    @classmethod
    def _registered_eviction(cls, name: str) -> str:
        if name == "belady":
            raise ValueError("eviction 'belady' is simulation-only: it needs an oracle of future "
                             "requests (next_use), which a live runtime does not have")
        known = set(eviction_registry()) - {"belady"}
        if name not in known:
            raise ValueError(f"eviction {name!r} is not a registered eviction strategy; "
                             f"known evictions: {', '.join(sorted(known)) or '(none)'}")
        return name

    @field_validator("kernels")
    @classmethod
    def _registered_kernels(cls, kernels: dict[str, str]) -> dict[str, str]:
        from attnpolicy.plugins.kernels import FAMILIES, kernel_registry

        known = kernel_registry()
        for family, name in kernels.items():
            if family not in FAMILIES:
                raise ValueError(f"kernels: family {family!r} is not one of {', '.join(FAMILIES)}")
            if name != "auto" and (family, name) not in known:
                names = ", ".join(n for f, n in known if f == family)
                raise ValueError(f"kernels: {name!r} is not a registered {family} kernel; "
                                 f"known: auto, {names}")
        return kernels

    @model_validator(mode="after")
    def _rules(self) -> AttnPolicyConfig:
        try:
            make_policy(self.policy, **self.policy_options)
        except PolicyError as exc:
            raise ValueError(f"policy_options: {exc}") from exc
        if self.max_batch_tokens < self.max_seq_len:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} must be >= max_seq_len "
                             f"{self.max_seq_len}")
        self._check_buckets()
        object.__setattr__(self, "attn_impl", self._resolve_attn_impl())
        return self

    def _resolve_attn_impl(self) -> str:
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
        return impl

    def _check_buckets(self) -> None:
        """Buckets must fit the lengths they serve: pow2's ``min`` (when set) and the
        first ``multiple`` fit ``max_seq_len``; a list needs a size that fits
        ``max_seq_len`` and none above ``max_batch_tokens`` (sizes above
        ``max_seq_len`` serve only the packed rows of MASK calls)."""
        b, max_len = self.buckets, self.max_seq_len
        if b.kind == "pow2" and "min" in b.model_fields_set and b.min > max_len:
            raise ValueError(f"buckets.min has bucket {b.min} > max_seq_len {max_len}")
        if b.kind == "multiple" and b.multiple > max_len:
            raise ValueError(f"buckets.multiple has bucket {b.multiple} > max_seq_len {max_len}")
        if b.kind == "list":
            if b.sizes[0] > max_len:
                raise ValueError(f"buckets.sizes has no bucket <= max_seq_len {max_len}: {list(b.sizes)}")
            if b.sizes[-1] > self.max_batch_tokens:
                raise ValueError(f"buckets.sizes has bucket {b.sizes[-1]} > max_batch_tokens "
                                 f"{self.max_batch_tokens}")

    def bucket(self, n: int) -> int:
        """The compiled length of one sequence of ``n`` tokens (hot path; see
        :meth:`Buckets.bucket`); at most ``max_seq_len``."""
        return self.buckets.bucket(n, self.max_seq_len)

    def batch_bucket(self, n: int) -> int:
        """The compiled row count of a packed MASK call of ``n`` rows (all sequences'
        queries, or all their keys with cached context); at most ``max_batch_tokens``."""
        return self.buckets.bucket(n, self.max_batch_tokens)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``<directory>/attnpolicy_config.json`` (all fields, resolved) atomically:
        a temporary file in the same directory, then ``os.replace``. Creates the directory."""
        return jsonfile.write_text_atomic(Path(directory) / CONFIG_FILENAME,
                                          self.model_dump_json(indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AttnPolicyConfig:
        """Read a config from a directory (its ``attnpolicy_config.json``) or a file.

        Any problem (missing or unreadable file, invalid JSON, wrong version, invalid
        or unknown field) raises :class:`ConfigError` naming the file and every bad
        field; nothing is returned unless the whole file is valid."""
        p = Path(path)
        file = p / CONFIG_FILENAME if p.is_dir() else p
        return jsonfile.parse(cls, jsonfile.read_text(file, "config"), str(file), "config", FORMAT_VERSION)


def from_env(environ: Mapping[str, str] | None = None) -> AttnPolicyConfig:
    """The config named by the environment (``os.environ`` by default):
    ``ATTNPOLICY_CONFIG`` (a directory or file) if set, else defaults; then
    ``ATTNPOLICY_POLICY``, if set, replaces the policy. Errors: :class:`ConfigError`
    naming the variable."""
    env = os.environ if environ is None else environ
    path = env.get(CONFIG_ENV)
    config = AttnPolicyConfig()
    if path:
        try:
            config = AttnPolicyConfig.load(path)
        except ConfigError as exc:
            raise ConfigError(f"{CONFIG_ENV}={path}: {exc}") from None
    policy = env.get(POLICY_ENV)
    if policy:
        config = _validate({**config.model_dump(mode="json"), "policy": policy}, f"{POLICY_ENV}={policy}")
    return config


def _validate(data: object, source: str) -> AttnPolicyConfig:
    return jsonfile.validate(AttnPolicyConfig, data, source, "config", FORMAT_VERSION)

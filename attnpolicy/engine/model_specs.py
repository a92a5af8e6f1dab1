"""Built-in tiny model architectures, named by a SPEC string, with random weights.

A SPEC is one of:

- an architecture name, ``qwen3`` or ``llama``: the default tiny size (4 layers,
  hidden 256, 8 query heads, 2 KV heads, head dim 32, MLP 768, vocabulary 1024);
- a name with sizes, ``llama:layers=2,hidden=128,heads=4,kv_heads=2`` (fields of
  :class:`ModelSpec`; ``head_dim`` defaults to ``hidden // heads``);
- a local HF model directory (loaded with ``local_files_only``: nothing is downloaded).

Built-in models get seeded random weights, built locally with transformers, in
fp32 and eval mode: the same SPEC always builds the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from attnpolicy.errors import ConfigError

Arch = Literal["qwen3", "llama"]
ARCHS: tuple[Arch, ...] = get_args(Arch)

_Positive = Field(strict=True, ge=1)


class ModelSpec(BaseModel):
    """The sizes of a built-in tiny causal LM (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: Arch = "qwen3"
    layers: int = Field(4, strict=True, ge=1)
    hidden: int = Field(256, strict=True, ge=1)
    heads: int = Field(8, strict=True, ge=1)
    kv_heads: int = Field(2, strict=True, ge=1)
    head_dim: int | None = Field(None, strict=True, ge=1)
    intermediate: int = Field(768, strict=True, ge=1)
    vocab: int = Field(1024, strict=True, ge=2)
    max_positions: int = Field(8192, strict=True, ge=1)
    seed: int = Field(0, strict=True, ge=0)

    @model_validator(mode="after")
    def _shapes(self) -> ModelSpec:
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}) "
                             "unless head_dim is given")
        if self.dim % 2:  # an odd one fails to compile, or (1) silently computes another shape
            given = f"head_dim ({self.dim})" if self.head_dim is not None else (
                f"the head dim hidden/heads ({self.hidden}/{self.heads} = {self.dim})")
            raise ValueError(f"{given} must be even: rotary position embeddings rotate pairs of channels")
        return self

    @property
    def dim(self) -> int:
        """The head dim (``head_dim``, else ``hidden // heads``)."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    def describe(self) -> str:
        """The SPEC string of exactly this spec, e.g. ``qwen3:layers=4,hidden=256,...``."""
        sizes = ",".join(f"{f}={v}" for f, v in self.model_dump(exclude={"arch"}, exclude_none=True).items())
        return f"{self.arch}:{sizes}"

    def hf_config(self, attn_implementation: str = "sdpa") -> Any:
        """The transformers config of these sizes (no weights built)."""
        import transformers

        config_cls = getattr(transformers, _CLASSES[self.arch][0])
        return config_cls(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                          num_hidden_layers=self.layers, num_attention_heads=self.heads,
                          num_key_value_heads=self.kv_heads, head_dim=self.dim,
                          max_position_embeddings=self.max_positions, tie_word_embeddings=False,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, dtype="float32",
                          attn_implementation=attn_implementation)

    def build(self, attn_implementation: str = "sdpa") -> Any:
        """The causal LM of these sizes, random weights seeded by ``seed``, fp32, eval mode."""
        import torch
        import transformers

        cfg = self.hf_config(attn_implementation)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = getattr(transformers, _CLASSES[self.arch][1])(cfg)
        return model.eval()


#: Each built-in architecture's transformers config and model classes.
_CLASSES: dict[Arch, tuple[str, str]] = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                                         "llama": ("LlamaConfig", "LlamaForCausalLM")}


def parse_spec(spec: str) -> ModelSpec | Path:
    """A :class:`ModelSpec` for a built-in SPEC, or the path of a local HF directory.
    A bad SPEC raises :class:`ConfigError` naming the field and value."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"model spec must be an architecture ({', '.join(ARCHS)}) or a local HF "
                          f"directory, got {spec!r}")
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model directory {spec!r} has no config.json")
        return path
    arch, _, rest = spec.partition(":")
    if arch not in ARCHS:
        raise ConfigError(f"model spec {spec!r}: architecture {arch!r} is not built in "
                          f"(built in: {', '.join(ARCHS)}) and {spec!r} is not a local directory")
    fields: dict[str, Any] = {"arch": arch}
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name in fields:
            why = "is given twice" if name in fields else "needs the form field=value"
            raise ConfigError(f"model spec {spec!r}: {item!r} {why}")
        if name not in ModelSpec.model_fields or name == "arch":
            known = ", ".join(f for f in ModelSpec.model_fields if f != "arch")
            raise ConfigError(f"model spec {spec!r}: unknown field {name!r} (fields: {known})")
        try:
            fields[name] = int(value)
        except ValueError:
            raise ConfigError(f"model spec {spec!r}: {name} must be an integer, got {value!r}") from None
    try:
        return ModelSpec(**fields)
    except ValidationError as exc:
        problems = "; ".join(f"{e['loc'][0]} {e['msg'].lower()}, got {e['input']!r}" if e["loc"]
                             else e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise ConfigError(f"model spec {spec!r}: {problems}") from None


def max_positions(spec: str) -> int | None:
    """The most positions the model of a valid SPEC was built for: ``max_positions``
    of a built-in one, ``max_position_embeddings`` of a directory's ``config.json``
    (``None`` when it has none or cannot be read: the model load says why)."""
    parsed = parse_spec(spec)
    if isinstance(parsed, ModelSpec):
        return parsed.max_positions
    try:
        value = json.loads((parsed / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def spec_config(spec: str) -> Any:
    """The transformers config of a valid SPEC's model, without its weights: a built-in
    one's (:meth:`ModelSpec.hf_config`), a directory's (read locally); a directory whose
    config cannot be read raises :class:`ConfigError`."""
    parsed = parse_spec(spec)
    if isinstance(parsed, ModelSpec):
        return parsed.hf_config()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(parsed, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model directory {spec!r}: cannot read its config: {exc}") from None


def load_model(spec: str, attn_implementation: str = "sdpa") -> tuple[Any, str]:
    """The model a SPEC names and a short description of it (built-in: its sizes;
    a directory: its path). A directory loads with ``local_files_only=True``, in fp32."""
    parsed = parse_spec(spec)
    if isinstance(parsed, ModelSpec):
        return parsed.build(attn_implementation), parsed.describe()
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(parsed, local_files_only=True, dtype="float32",
                                                 attn_implementation=attn_implementation)
    return model.eval(), str(parsed)

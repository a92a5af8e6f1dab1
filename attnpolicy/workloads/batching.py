"""The batch former: requests → the stream of attention batches a continuous-batching
server runs (modelled on vLLM V1's scheduler).

Each step schedules the running decodes first (one query token each), then prefill
tokens (continuing partial prefills, then admitting waiting requests in arrival
order) within the token budget. Arrival times only order the queue: the simulation
never waits on the clock, so every request is queued from the start.
See ``docs/workloads.md`` for the full semantics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from attnpolicy.core.layout import BatchLayout
from attnpolicy.errors import ConfigError
from attnpolicy.workloads.traces import Request


@dataclass(frozen=True)
class ScheduledBatch:
    """One engine step's batch as the batch former schedules it: its attention layout
    and which requests it holds (one forward pass).

    ``seq_ids[i]`` is the index (in the list given to :meth:`BatchFormer.steps`) of
    the request owning sequence ``i`` of ``layout``. The first ``num_decode``
    sequences are decodes, the remaining ``num_prefill`` are prefill chunks.
    """

    index: int
    layout: BatchLayout
    seq_ids: tuple[int, ...]
    num_prefill: int
    num_decode: int


class _Knobs(BaseModel):
    """The batch former's knobs, validated (strict types, rules between knobs)."""

    model_config = ConfigDict(strict=True, frozen=True)

    max_num_seqs: Annotated[int, Field(ge=1)]
    max_num_batched_tokens: Annotated[int, Field(ge=1)]
    chunked_prefill: bool
    prefill_only: bool
    max_model_len: Annotated[int, Field(ge=1)]
    causal: bool

    @model_validator(mode="after")
    def _rules(self) -> _Knobs:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_num_seqs={self.max_num_seqs} (every running decode needs a token)")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len="
                             f"{self.max_model_len} without chunked_prefill (a whole prompt must fit one step)")
        if not self.causal and not self.prefill_only:
            raise ValueError("causal=False needs prefill_only=True (decoding is causal)")
        if not self.causal and self.chunked_prefill:
            raise ValueError("causal=False needs chunked_prefill=False (a bidirectional "
                             "prompt must be prefilled in one step)")
        return self

    @classmethod
    def check(cls, **knobs: Any) -> None:
        """:class:`ConfigError` naming the first bad knob and its value."""
        try:
            cls(**knobs)
        except ValidationError as exc:
            e = exc.errors(include_url=False)[0]
            if not e["loc"]:
                raise ConfigError(e["msg"].removeprefix("Value error, ")) from None
            name = str(e["loc"][0])
            kind = "a bool" if cls.model_fields[name].annotation is bool else "an int >= 1"
            raise ConfigError(f"{name} must be {kind}, got {e['input']!r}") from None


class _Running:
    """Progress of one admitted request."""

    __slots__ = ("rid", "prompt", "output", "prefilled", "generated")

    def __init__(self, rid: int, prompt: int, output: int) -> None:
        self.rid = rid
        self.prompt = prompt
        self.output = output
        self.prefilled = 0
        self.generated = 0


class BatchFormer:
    """Forms the batches of a vLLM-V1-like scheduler.

    - ``max_num_seqs``: most requests running (admitted, not finished) at once;
    - ``max_num_batched_tokens``: most query tokens per step (must be >= max_num_seqs);
    - ``chunked_prefill``: split prompts across steps to fill the budget; without it a
      prompt is prefilled in one step, so the budget must hold ``max_model_len``;
    - ``prefill_only``: no decoding (embedding / pooling models);
    - ``max_model_len``: requests with ``prompt + output`` above it are rejected
      (skipped, listed in :attr:`rejected`), as vLLM rejects them;
    - ``causal``: ``False`` gives bidirectional layouts; needs ``prefill_only`` and
      no chunked prefill (a chunk could not see the tokens after it).
    """

    def __init__(
        self,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        chunked_prefill: bool = True,
        prefill_only: bool = False,
        max_model_len: int = 8192,
        causal: bool = True,
    ) -> None:
        _Knobs.check(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     chunked_prefill=chunked_prefill, prefill_only=prefill_only, max_model_len=max_model_len,
                     causal=causal)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.prefill_only = prefill_only
        self.max_model_len = max_model_len
        self.causal = causal
        #: Requests the latest :meth:`steps` call skipped as too long for max_model_len.
        self.rejected: tuple[Request, ...] = ()

    @property
    def knobs(self) -> dict[str, Any]:
        """The keyword arguments that build this former (defaults included)."""
        return {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_model_len": self.max_model_len, "chunked_prefill": self.chunked_prefill,
                "prefill_only": self.prefill_only, "causal": self.causal}

    def rejections(self, requests: int) -> str | None:
        """What the latest :meth:`steps` call rejected of its ``requests`` and why, e.g.
        ``1 of 20 requests rejected: longer than max_model_len=8192 tokens (prompt +
        output; the first: 9000 + 3)``; ``None`` when it rejected none."""
        if not self.rejected:
            return None
        first = self.rejected[0]
        need, tokens = (("prompt", f"{first.prompt_tokens}") if self.prefill_only else
                        ("prompt + output", f"{first.prompt_tokens} + {first.output_tokens}"))
        return (f"{len(self.rejected)} of {requests} requests rejected: longer than max_model_len="
                f"{self.max_model_len} tokens ({need}; the first: {tokens})")

    def fits(self, r: Request) -> bool:
        """Whether ``r`` is admitted (not longer than ``max_model_len``)."""
        need = r.prompt_tokens if self.prefill_only else r.prompt_tokens + r.output_tokens
        return need <= self.max_model_len

    def steps(self, requests: Sequence[Request]) -> Iterator[ScheduledBatch]:
        """The steps serving ``requests`` (admitted in arrival order, ties in list order).

        Rejections are decided here, before the first step: :attr:`rejected` is set
        when this returns.
        """
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        self.rejected = tuple(requests[i] for i in order if not self.fits(requests[i]))
        waiting = deque(
            _Running(i, requests[i].prompt_tokens, 0 if self.prefill_only else requests[i].output_tokens)
            for i in order if self.fits(requests[i])
        )
        return self._run(waiting)

    def _run(self, waiting: deque[_Running]) -> Iterator[ScheduledBatch]:
        running: list[_Running] = []
        index = 0
        while waiting or running:
            q_lens: list[int] = []
            kv_lens: list[int] = []
            ids: list[int] = []
            for r in running:  # decodes: the last generated token attends to everything before
                if r.prefilled == r.prompt:
                    q_lens.append(1)
                    kv_lens.append(r.prompt + r.generated)
                    ids.append(r.rid)
                    r.generated += 1
            num_decode = len(ids)
            budget = self.max_num_batched_tokens - num_decode
            for r in running:  # partial prefills (chunked only), in admission order
                if budget and r.prefilled < r.prompt:
                    budget -= self._prefill(r, budget, q_lens, kv_lens, ids)
            while budget and waiting and len(running) < self.max_num_seqs:
                head = waiting[0]
                if not self.chunked_prefill and head.prompt > budget:
                    break  # first come, first served: nobody overtakes the head
                running.append(waiting.popleft())
                budget -= self._prefill(head, budget, q_lens, kv_lens, ids)
            causal_kv = None if kv_lens == q_lens else kv_lens
            yield ScheduledBatch(
                index=index,
                layout=BatchLayout.from_lens(q_lens, causal_kv, causal=self.causal),
                seq_ids=tuple(ids),
                num_prefill=len(ids) - num_decode,
                num_decode=num_decode,
            )
            index += 1
            running = [r for r in running if r.prefilled < r.prompt or r.generated < r.output]

    @staticmethod
    def _prefill(r: _Running, budget: int, q_lens: list[int], kv_lens: list[int], ids: list[int]) -> int:
        """Schedule the next chunk of ``r``'s prompt; returns its token count."""
        chunk = min(r.prompt - r.prefilled, budget)
        r.prefilled += chunk
        q_lens.append(chunk)
        kv_lens.append(r.prefilled)
        ids.append(r.rid)
        if r.prefilled == r.prompt and r.output:
            r.generated = 1  # the prefill step samples the first output token
        return chunk


#: A default former's knobs (:meth:`Workload.describe` shows the rare ones only when they differ).
_DEFAULTS = BatchFormer().knobs


@dataclass(frozen=True)
class Workload:
    """What a batch former made of a trace: the requests it was given, how many it
    rejected (longer than ``max_model_len``) and why (:meth:`BatchFormer.rejections`),
    the batches it formed and its knobs."""

    requests: int
    rejected: int
    batches: int
    former: dict[str, Any]
    why_rejected: str | None = None

    @classmethod
    def of(cls, requests: int, former: BatchFormer, batches: int) -> Workload:
        """The workload of ``former``'s latest :meth:`~BatchFormer.steps` call."""
        return cls(requests, len(former.rejected), batches, former.knobs, former.rejections(requests))

    @property
    def admitted(self) -> int:
        return self.requests - self.rejected

    def describe(self) -> str:
        """``20 requests (19 admitted, 1 rejected) → 336 batches; batch former
        max_num_seqs=16, ...`` (``prefill_only``, ``causal`` only when not the default)."""
        shown = {k: v for k, v in self.former.items()
                 if k not in ("prefill_only", "causal") or v != _DEFAULTS[k]}
        return (f"{self.requests} requests ({self.admitted} admitted, {self.rejected} rejected) → "
                f"{self.batches} batches; batch former " + ", ".join(f"{k}={v}" for k, v in shown.items()))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "admitted": self.admitted}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Workload:
        """The workload of :meth:`to_json`'s ``data``."""
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def model_former(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> BatchFormer:
    """The batch former of a whole-model prefill workload: prefill only, each prompt in one step."""
    return BatchFormer(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       chunked_prefill=False, prefill_only=True, max_model_len=max_model_len)

"""A static-graph model runner in the style of tt-xla's, on attnpolicy's public API.

The runner brings its own compiler, a Dynamo backend registered under its own name
(``toy_tt``), and serves packed batches: each step's sequences sit one after another in
token-major tensors. Its attention graphs (one per length bucket: static shapes, as a
device compiler needs) come from attnpolicy's graph cache, compiled by ``toy_tt``; the
policy decides once per step how the packed sequences are kept apart. Before the first
request it warms up over its graph set; after that it is strict: a compile raises.

    python examples/static_runner/runner.py --steps 6

See README.md beside it for which call a runtime makes where.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher, Step, TensorSpec

#: The runtime's compiler's name: what the config's ``backend`` says.
BACKEND = "toy_tt"
HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 4, 2, 16, 2, 97
#: The length buckets of the graph set (pow2 from 16 up to max_seq_len).
BUCKETS = (16, 32, 64, 128)


class ToyCompiler:
    """A backend with Dynamo's contract, ``backend(gm, example_inputs, **options) ->
    callable``, counting its compiles. A device compiler lowers ``gm`` to its device;
    this one runs the traced graph as it is."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **options: object):
        self.compiles += 1
        return gm.forward


TOY_TT = ToyCompiler()
if BACKEND not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(TOY_TT, name=BACKEND)


class TinyModel(torch.nn.Module):
    """Token embedding, ``LAYERS`` attention + MLP blocks, a head: attention through
    ``attend(layer, q, k, v)`` on packed ``[tokens, heads, head_dim]`` tensors."""

    def __init__(self) -> None:
        super().__init__()
        width = HEADS * HEAD_DIM
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
                                       for _ in range(LAYERS))
        self.out = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(LAYERS))
        self.mlp = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(LAYERS))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, attend) -> torch.Tensor:
        x = self.embed(ids)
        for layer in range(LAYERS):
            q, k, v = self.qkv[layer](x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            shape = (ids.shape[0], -1, HEAD_DIM)
            a = attend(q.reshape(shape), k.reshape(shape), v.reshape(shape))
            x = x + self.out[layer](a.reshape(ids.shape[0], -1))
            x = x + F.gelu(self.mlp[layer](x))
        return self.head(x)


class Runner:
    """Serves packed prefill steps of ``model`` through attnpolicy on ``device``."""

    def __init__(self, model: TinyModel, device: str) -> None:
        self.model = model.to(device).eval()
        # start-up: the config names the compiler, the graph set and strict mode; the
        # Dispatcher resolves the compiler (an unknown name fails here), builds the policy
        # and the bounded graph cache
        self.config = AttnPolicyConfig(
            backend=BACKEND, policy="varlen", max_seq_len=BUCKETS[-1], max_batch_tokens=4 * BUCKETS[-1],
            strict="raise", max_graphs=len(BUCKETS),
            warmup=[{"family": "causal", "q_bucket": b, "kv_bucket": b} for b in BUCKETS])
        self.dispatcher = Dispatcher(self.config)
        self.spec = TensorSpec("float32", HEADS, KV_HEADS, HEAD_DIM, device=device)
        self.device = device
        self.last: Step | None = None  # the step served last (its decision, its graphs)

    def warm_up(self) -> float:
        """Compile the graph set for the model's tensors; strict from now on."""
        start = time.perf_counter()
        self.dispatcher.warmup(self.spec)
        return time.perf_counter() - start

    @torch.no_grad()
    def step(self, prompts: list[torch.Tensor]) -> torch.Tensor:
        """Logits of one packed step: the prompts one after another, ``[tokens, vocab]``."""
        layout = BatchLayout.from_lens([len(p) for p in prompts])
        ids = torch.cat(prompts).to(self.device)
        step = self.last = self.dispatcher.prepare(layout, self.spec)  # once per step: decided, graphs fetched
        try:
            return self.model(ids, lambda q, k, v: step.run(q, k, v))  # every layer runs the step
        finally:
            self.dispatcher.release_batch()  # the step has run: its graphs may be evicted


@torch.no_grad()
def reference(model: TinyModel, prompts: list[torch.Tensor], device: str) -> torch.Tensor:
    """Each prompt alone through torch's own causal attention, the logits concatenated."""
    def sdpa(q, k, v):
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), is_causal=True)
        return out.transpose(0, 1)
    return torch.cat([model(p.to(device), sdpa) for p in prompts])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="packed steps to serve (default 6)")
    parser.add_argument("--device", default="cpu", help="the device the model and its graphs run on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    runner = Runner(TinyModel(), args.device)
    seconds = runner.warm_up()
    print(f"warm-up: {len(runner.dispatcher.cache)} graphs compiled by {BACKEND} ({TOY_TT.compiles} compiles) "
          f"in {seconds:.1f} s; strict={runner.config.strict!r} from now on")
    worst = 0.0
    for i in range(args.steps):
        lens = torch.randint(1, BUCKETS[-1] + 1, (1 + i % 3,)).tolist()
        prompts = [torch.randint(0, VOCAB, (n,)) for n in lens]
        logits = runner.step(prompts)
        err = (logits - reference(runner.model, prompts, args.device)).abs().max().item()
        worst = max(worst, err)
        assert runner.last is not None
        print(f"step {i}: sequences {lens} ran {runner.last.decision.mode.value} ({len(runner.last)} graph calls)")
    s = runner.dispatcher.stats()
    print(f"served {s.batches} steps: {s.cache.hits} graph hits, {s.cache.misses} misses, {s.cache.compiles} "
          f"compiles ({BACKEND} counted {TOY_TT.compiles}), compiles after warm-up: {s.strict_violations}")
    if not (math.isfinite(worst) and worst < 1e-4):
        raise SystemExit(f"outputs differ from the reference by {worst:g}")
    print(f"outputs match the reference (max abs error {worst:.1e})")


if __name__ == "__main__":
    main()

"""Tensor-parallel consistency: every rank must take the same decisions and use the
same graph keys for the same batches, or the ranks compile and run different graphs
and their collectives deadlock.

Two processes join a gloo group on 127.0.0.1, each replays the same workload
(synthetic trace → BatchFormer steps) through its own Dispatcher exactly as a
server does (one ``attend`` per batch on rank-local random tensors, so cache state
evolves as in a server), records through the observer hooks what each batch
decided, planned, compiled and evicted, and all-gathers a digest of that record
per policy.
"""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnpolicy import AttnPolicyConfig, Decision, Dispatcher, hookimpl
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.plugins.registry import get_plugin_manager
from attnpolicy.policies.registry import policy_registry
from attnpolicy.workloads.batching import BatchFormer
from attnpolicy.workloads.traces import synthetic_default

WORLD = 2
STEPS = 24
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def _workload():
    former = BatchFormer(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=4096)
    steps = former.steps(synthetic_default(n=24, seed=3))
    return [step.layout for _, step in zip(range(STEPS), steps)]


class _Recorder:
    """What the observer hooks saw: the decision of each batch, the compiles and evictions."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.decisions: list[Decision] = []

    @hookimpl
    def attnpolicy_on_decision(self, decision: Decision, fell_back: bool) -> None:
        self.decisions.append(decision)

    @hookimpl
    def attnpolicy_on_compile(self, key) -> None:
        self.events.append(f"compile {key}")

    @hookimpl
    def attnpolicy_on_evict(self, key) -> None:
        self.events.append(f"evict {key}")


def _trace(policy: str, rank: int) -> list[str]:
    """One line per batch, as production runs it (one ``attend`` per batch, nothing
    else asks the policy): the decision the on_decision hook saw, the graph keys that
    decision plans, and the compiles and evictions the batch caused."""
    # a small cache, so evictions change the cache state policies may read
    d = Dispatcher(AttnPolicyConfig(policy=policy, backend="none", max_graphs=4))
    recorder = _Recorder()
    get_plugin_manager().register(recorder)
    gen = torch.Generator().manual_seed(1000 + rank)  # ranks hold different shards of data
    lines = []
    try:
        for layout in _workload():
            q = torch.randn(layout.q_tokens, HEADS, HEAD_DIM, generator=gen)
            k = torch.randn(layout.kv_tokens, KV_HEADS, HEAD_DIM, generator=gen)
            d.attend(q, k, torch.randn_like(k), layout)
            (decision,) = recorder.decisions
            recorder.decisions.clear()
            keys = d.context_for(TensorSpec.of(q, k)).keys_for(layout, decision.mode)  # pure: a plan
            lines.append("|".join([decision.mode.value, decision.reason, *map(str, keys), *recorder.events]))
            recorder.events.clear()
    finally:
        get_plugin_manager().unregister(recorder)
    assert d.stats().batches == len(lines)
    return lines


def _rank(rank: int, port: int, policies: list[str], queue) -> None:
    logging.getLogger("attnpolicy.policies.guard").setLevel(logging.ERROR)  # always-causal falls back a lot
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        mine = {p: _trace(p, rank) for p in policies}
        digests = {p: hashlib.sha256("\n".join(lines).encode()).hexdigest() for p, lines in mine.items()}
        gathered: list[dict[str, str] | None] = [None] * WORLD
        dist.all_gather_object(gathered, digests)
        if rank == 0:
            queue.put((gathered, mine))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_ranks_agree_on_decisions_and_graph_keys():
    policies = sorted(policy_registry())
    assert {"dynamic", "always-mask", "varlen"} <= set(policies)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    # the test process hosts the rendezvous store on a port the OS picks: no port race
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(_rank, args=(store.port, policies, queue), nprocs=WORLD, join=True,
                       start_method="spawn")
    gathered, traces = queue.get()
    assert len(gathered) == WORLD
    for policy in policies:
        assert len(traces[policy]) == STEPS
        assert len({g[policy] for g in gathered}) == 1, f"ranks disagree for policy {policy!r}"
    modes = {line.split("|")[0] for line in traces["dynamic"]}
    assert {"causal", "mask"} <= modes, f"workload too uniform to test anything: {modes}"
    assert any("evict " in line for line in traces["dynamic"]), "no eviction: the cache state never mattered"


@pytest.mark.parametrize("policy", ["dynamic", "varlen"])
def test_tensor_parallel_digest_changes_with_the_decisions(policy):
    """The digest compared above is sensitive: another policy gives another trace."""
    assert _trace(policy, 0) != _trace("always-mask", 0)

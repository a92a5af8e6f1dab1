"""Threads: one dispatcher per thread sharing a graph store, a model runner shared by
threads with a store, a background-mode dispatcher shared by threads (docs/reliability.md).

Each test starts its threads together at a barrier, so their compiles overlap (torch's
ahead-of-time compiles, run at once from several threads, failed), and joins them; nothing
waits on time."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from cost_models import PRICEY
from reference import reference_for
from strategies import random_qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.engine.model_specs import ModelSpec, parse_spec
from attnpolicy.engine.runner import StaticModelRunner, eager_logits
from attnpolicy.graphs.buckets import Buckets
from attnpolicy.graphs.execute import graph_fn
from attnpolicy.graphs.keys import TensorSpec

THREADS = 4


def _run_threads(work: Callable[[int, threading.Barrier], None]) -> None:
    """``work(i, barrier)`` on each of :data:`THREADS` threads, started together at
    ``barrier`` (``work`` may wait at it again, to start a round together); re-raises the
    first exception a thread raised, after joining them all."""
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            work(i, barrier)
        except BaseException as e:
            errors.append(e)
            barrier.abort()  # the others stop at their next wait

    threads = [threading.Thread(target=run, args=(i,), name=f"test-thread-{i}") for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]


def _uncompiled(call, key, spec):
    """A builder that compiles nothing (the background test is about the dispatcher's state)."""
    return graph_fn(call, key.impl, spec.scale, None)


def _qkv(seed: int, n: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of one sequence of ``n`` tokens: 2 heads of 8."""
    return random_qkv(BatchLayout.from_lens([n]), seed, heads=2, kv_heads=2, head_dim=8)


def test_one_dispatcher_per_thread_sharing_a_store(tmp_path):
    """4 threads, a dispatcher each, one store: every round all of them miss the same new
    graph at once (it compiles or loads in each); then each hits it. Every output is the
    float64 reference and every miss is one compile or one load, each counted by the
    store too."""
    rounds, n = 3, 10
    layout = BatchLayout.from_lens([n])
    config = AttnPolicyConfig(backend="aot_eager", max_seq_len=64, store_dir=str(tmp_path))
    dispatchers = [Dispatcher(config) for _ in range(THREADS)]

    def work(i: int, barrier: threading.Barrier) -> None:
        d = dispatchers[i]
        for r in range(rounds):
            scale = 0.25 + r / 8  # part of the graph key: a new graph each round
            barrier.wait()
            for repeat in range(2):  # a miss, then a hit
                q, k, v = _qkv(100 * i + 10 * r + repeat, n)
                out = d.attend(q, k, v, layout, scale)
                torch.testing.assert_close(out.double(), reference_for(q, k, v, layout, scale),
                                           rtol=1e-5, atol=1e-5)

    _run_threads(work)
    compiles = 0
    for d in dispatchers:
        stats = d.stats()
        cache, disk = stats.cache, stats.disk
        assert disk is not None and stats.batches == 2 * rounds
        assert (cache.hits, cache.misses, cache.compile_failures) == (rounds, rounds, 0)
        assert cache.compiles + cache.loads == rounds
        assert (disk.hits, disk.misses, disk.saves) == (cache.loads, cache.compiles, cache.compiles)
        assert (disk.corrupt, disk.stale, disk.load_failures, disk.write_failures) == (0, 0, 0, 0)
        compiles += cache.compiles
    assert compiles >= rounds  # each round's graph compiled at least once, then loaded or compiled
    assert dispatchers[0].stats().disk.entries == rounds


@pytest.fixture(scope="module")
def tiny_model() -> tuple[torch.nn.Module, torch.nn.Module]:
    spec = parse_spec("qwen3:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=64")
    assert isinstance(spec, ModelSpec)
    return spec.build(), spec.build()


def test_a_model_runner_shared_by_threads_with_a_store(tiny_model, tmp_path):
    """4 threads share one runner and its store: each first compiles a graph of its own
    (4 compiles at once), then runs every other thread's layout (hits). Every output is the
    eager model's; each graph compiled once (single flight) and was saved; the batches and
    modes add up."""
    model, reference = tiny_model
    config = AttnPolicyConfig(policy="varlen", backend="aot_eager", buckets=Buckets(kind="pow2", min=16),
                              max_seq_len=64, max_batch_tokens=128, store_dir=str(tmp_path))
    runner = StaticModelRunner(model, config)
    lens = [[5], [20], [40], [5, 5]]  # causal t16, t32, t64 and varlen 16+16: four graphs

    def work(i: int, barrier: threading.Barrier) -> None:
        for step in range(THREADS):
            if step == 1:
                barrier.wait()  # every graph is cached: the rest are hits
            layout = BatchLayout.from_lens(lens[(i + step) % THREADS])
            ids = torch.randint(0, 64, (layout.q_tokens,), generator=torch.Generator().manual_seed(10 * i + step))
            torch.testing.assert_close(runner.logits(ids, layout), eager_logits(reference, ids, layout),
                                       rtol=0, atol=1e-5)

    _run_threads(work)
    stats = runner.stats()
    cache, disk = stats.cache, stats.disk
    assert disk is not None
    assert stats.batches == sum(stats.modes.values()) == THREADS * THREADS
    assert (cache.misses, cache.compiles, cache.loads, cache.compile_failures) == (4, 4, 0, 0)
    assert cache.hits == THREADS * THREADS - 4
    assert (disk.saves, disk.entries, len(stats.memory)) == (4, 4, 4)
    assert cache.held_graphs == 0 and len(runner.cache) == 4
    runner.close()


def test_a_background_dispatcher_shared_by_threads():
    """4 threads share one dispatcher in background mode, its largest bucket warm, and run
    the same lengths in the same order (so they miss each graph together): every miss pads
    up while its graph builds in the worker. Every output is the float64 reference, every
    batch is counted, and each graph is requested, built and switched in exactly once,
    whatever the threads' interleaving. Five fresh dispatchers, one after the other."""
    lengths = (500, 200, 100, 50, 20, 10, 300, 5)  # buckets 512 … 16 below the warm 1024
    config = AttnPolicyConfig(backend="eager", policy="always-causal", max_seq_len=1024,
                              compile_mode="background", switch_after=1)
    spec = TensorSpec("float32", 2, 2, 8)
    for _ in range(5):
        with Dispatcher(config, cost_model=PRICEY, builder=_uncompiled) as d:
            d.warmup([BatchLayout.from_lens([1024])], spec)
            warm = set(d.cache.keys())

            def work(i: int, barrier: threading.Barrier, d: Dispatcher = d) -> None:
                for b, n in enumerate(lengths):
                    layout = BatchLayout.from_lens([n])
                    q, k, v = _qkv(1000 * i + b, n)
                    torch.testing.assert_close(d.attend(q, k, v, layout).double(), reference_for(q, k, v, layout),
                                               rtol=1e-5, atol=1e-5)

            _run_threads(work)
            stats = d.stats()
            bg = stats.background
            built = set(d.cache.keys()) - warm
            assert stats.batches == THREADS * len(lengths)
            assert bg.requested == bg.switched + bg.pending == len(built) + bg.pending
            assert bg.failed == 0 and bg.pad_up_calls >= bg.requested
        assert d.pending() == ()

"""Any device: the device is part of every graph key, and tensors reach the graphs where
they are, without a host round trip but the one isolation check of a masked batch."""

from __future__ import annotations

import pytest
import torch
from reference import reference_for
from strategies import random_qkv

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher, TensorSpec
from attnpolicy.dispatch.call_graphs import identity

#: Tensor methods that copy a value to the host (a device synchronisation off the CPU).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
PACKED = [BatchLayout.from_lens(lens) for lens in ([10, 20, 5], [7, 30], [3, 9, 11, 2])]


def qkv(layout: BatchLayout, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in random_qkv(layout, layout.q_tokens, heads=4, kv_heads=2))


@pytest.fixture
def host_reads(monkeypatch):
    """Every host read of a tensor's values from now on, by method name."""
    seen: list[str] = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, __name=name, __original=original, **kwargs):
            seen.append(__name)
            return __original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


def test_the_device_is_part_of_the_key_and_of_the_stored_identity():
    d = Dispatcher(AttnPolicyConfig(backend="aot_eager", max_seq_len=64))
    layout = PACKED[0]
    cpu = TensorSpec.of(*qkv(layout)[:2])
    meta = TensorSpec.of(*qkv(layout, "meta")[:2])
    assert (cpu.device, meta.device) == ("cpu", "meta")
    on_cpu, on_meta = d.graph_keys_for(layout, cpu), d.graph_keys_for(layout, meta)
    assert len(on_cpu) == len(on_meta) > 0 and not set(on_cpu) & set(on_meta)
    assert [k.spec.device for k in on_meta] == ["meta"] * len(on_meta)
    assert all(str(k).endswith("/meta/aot_eager") for k in on_meta)
    ident = identity(d.config, on_meta[0])
    assert ident is not None and ident.device == "meta" and ident != identity(d.config, on_cpu[0])


@pytest.mark.parametrize("backend", ["none", "eager"])
def test_tensors_of_another_device_reach_the_graphs_unmoved(backend):
    """On ``meta`` (shapes, no values: any read of a value raises) a packed batch runs
    through the policy, the cache and compiled graphs, its output on ``meta``."""
    d = Dispatcher(AttnPolicyConfig(backend=backend, max_seq_len=64))
    for layout in PACKED:
        q, k, v = qkv(layout, "meta")
        out = d.attend(q, k, v, layout)
        assert out.device.type == "meta" and out.shape == q.shape
    s = d.stats()
    assert s.modes == {"causal": 0, "mask": 0, "varlen": 3, "rows": 0} and s.cache.misses == len(s.cache.per_key) > 0


@pytest.mark.parametrize(("policy", "reads"), [
    ("varlen", []),  # causal prefills: mask-free graphs, nothing to isolate
    ("always-causal", []),  # one unpadded sequence each
    ("always-mask", ["tolist"]),  # the one isolation check of a masked batch of several sequences
])
def test_a_batch_reads_nothing_back_but_the_isolation_check(policy, reads, host_reads):
    d = Dispatcher(AttnPolicyConfig(policy=policy, backend="eager", max_seq_len=64, max_batch_tokens=128))
    layouts = [BatchLayout.from_lens([n]) for n in (12, 30)] if policy == "always-causal" else PACKED
    for layout in layouts:  # compiled (and checked) here
        d.attend(*qkv(layout), layout)
    for layout in layouts:
        q, k, v = qkv(layout)
        host_reads.clear()
        out = d.attend(q, k, v, layout)
        assert host_reads == reads, (layout, host_reads)
        torch.testing.assert_close(out.double(), reference_for(q, k, v, layout), atol=1e-5, rtol=1e-5)

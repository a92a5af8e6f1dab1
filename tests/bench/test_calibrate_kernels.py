"""``attnpolicy calibrate --kernels`` end to end, tiny: the cost model it writes holds
every registered kernel's measured seconds per call kind, and ``kernels: auto`` then
runs the fastest one measured."""

from __future__ import annotations

import json

import pytest

from attnpolicy import AttnPolicyConfig, BatchLayout, Dispatcher
from attnpolicy.cli import main
from attnpolicy.graphs.costmodel import CostModel
from attnpolicy.graphs.keys import TensorSpec
from attnpolicy.plugins.kernels import impls_for


@pytest.mark.slow
@pytest.mark.inductor  # the flex kernel is timed compiled with inductor
def test_calibrate_kernels_writes_kernel_seconds_and_auto_takes_the_fastest(tmp_path):
    out = tmp_path / "model.json"
    assert main(["calibrate", "--kernels", "--max-len", "32", "--backend", "eager", "--repeats", "1",
                 "--heads", "2", "--kv-heads", "2", "--head-dim", "8", "--out", str(out)]) == 0
    measured = json.loads(out.read_text())["kernel_seconds"]
    for kind in ("varlen", "mask"):
        assert set(measured[kind]) == {info.name for info in impls_for(kind)}, kind
        assert all(seconds > 0 for seconds in measured[kind].values())

    model = CostModel.load(out)
    assert model.kernel_seconds == measured
    spec = TensorSpec("float32", 2, 2, 8)
    layout = BatchLayout.from_lens([3, 4], [6, 4])  # cached context: VARLEN runs VARLEN graphs
    for kind, policy in (("varlen", "varlen"), ("mask", "always-mask")):
        d = Dispatcher(AttnPolicyConfig(policy=policy, backend="eager", kernels={kind: "auto"}, max_seq_len=32),
                       cost_model=model)
        impls = {key.impl for key in d.graph_keys_for(layout, spec) if key.kind.value == kind}
        assert impls == {min(measured[kind], key=measured[kind].__getitem__)}, (kind, measured[kind])
    # the choice follows the measurements: make another kernel the fastest
    slowest = max(measured["varlen"], key=measured["varlen"].__getitem__)
    faked = model.model_copy(update={"kernel_seconds": {"varlen": {**measured["varlen"], slowest: 1e-9}}})
    d = Dispatcher(AttnPolicyConfig(policy="varlen", backend="eager", kernels={"varlen": "auto"}, max_seq_len=32),
                   cost_model=faked)
    assert {key.impl for key in d.graph_keys_for(layout, spec) if key.kind.value == "varlen"} == {slowest}

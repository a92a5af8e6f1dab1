"""attnpolicy's wrapper of a vLLM attention backend, driven over a stand-in backend
(``tests/vllm_stand_in.py``: its own metadata, cache layout, cache writes and kernel)
without an engine; the registration over the platform's slots; attnpolicy's runtime
warnings in vLLM's log format. Needs vLLM importable (skips without it, fails with
``ATTNPOLICY_REQUIRE_VLLM=1``)."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

if not os.environ.get("ATTNPOLICY_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'attnpolicy[vllm]' (see docs/vllm.md)")

import torch
from reference import reference_attention
from vllm.config import CUDAGraphMode, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.forward_context import ForwardContext, override_forward_context
from vllm_stand_in import StandInBackend, StandInBuilder, StandInImpl, StandInMetadata

from attnpolicy.integrations import vllm as integration
from attnpolicy.integrations.runtime import install_decision_log
from attnpolicy.integrations.vllm_backend import HostAttention, wrap
from attnpolicy.integrations.vllm_paged import flash_views

H, HKV, D, BS, SCALE = 4, 2, 16, 4, 0.25
STAND_IN = HostAttention(flash_views, plain_fields=("prefix_ranges",))
Wrapped = wrap(StandInBackend, STAND_IN)
#: (new tokens, keys) of each sequence per step; 0 new tokens: not in the step
STEPS = (
    ((5, 5), (9, 9), (3, 3), (0, 0)),  # a packed prefill of fresh prompts
    ((1, 6), (4, 13), (1, 4), (0, 0)),  # decodes beside a chunk with cached context
    ((1, 7), (1, 14), (1, 5), (0, 0)),  # decodes
    ((0, 0), (0, 0), (0, 0), (6, 6)),  # a lone fresh prompt
)
#: the mode of each step under each policy (a name, or a key of POLICY_OPTIONS)
MODES = {"varlen": ["varlen", "varlen", "varlen", "causal"], "always-mask": ["mask"] * 4,
         "dynamic": ["mask", "mask", "mask", "causal"], "always-rows": ["rows"] * 4,
         "dynamic-rows": ["mask", "mask", "rows", "causal"]}
#: a label's policy and options: rows where they pad at most the step's tokens: the three decodes
#: ([4, 1]: one padded row), not the packed prefill (4 rows of 16: 47 padded for 17 tokens) nor the
#: chunk beside two decodes (its own [1, 16] forward: 12 padded for 6 tokens)
POLICY_OPTIONS = {"dynamic-rows": ("dynamic", {"rows": 1.0})}


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    import tiny_models

    model = tiny_models.llama(tmp_path_factory.mktemp("wrapper") / "llama")
    return VllmConfig(model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=256))


_configs: list[Path] = []


@pytest.fixture
def env(monkeypatch, tmp_path, fresh_plugins):
    """The wrapper's environment: cheap graphs (no compiler), a decisions log; returns
    a function setting the policy and reading the log's records."""
    config = tmp_path / "config.json"  # a config of this test's own, so a dispatcher of its own (one per
    _configs.append(tmp_path)  # config and process), whose decisions reach this test's log
    fields = {"backend": "none", "max_graphs": 1000 + len(_configs)}
    config.write_text(json.dumps(fields))
    monkeypatch.setenv("ATTNPOLICY_CONFIG", str(config))
    log = tmp_path / "decisions.jsonl"
    install_decision_log({"ATTNPOLICY_DECISIONS_LOG": str(log)})

    def records(policy: str | None = None) -> list[dict]:
        if policy is not None:
            name, options = POLICY_OPTIONS.get(policy, (policy, {}))
            config.write_text(json.dumps({**fields, "policy": name, "policy_options": options}))
            monkeypatch.setenv("ATTNPOLICY_POLICY", name)
        return [json.loads(s) for s in log.read_text().splitlines()] if log.exists() else []
    return records


class _Layer:
    """One attention layer: its wrapped implementation, its own paged cache, its name."""

    def __init__(self, vllm_config, name: str, backend=Wrapped, **kwargs) -> None:
        with set_current_vllm_config(vllm_config):
            self.impl = backend.get_impl_cls()(H, D, SCALE, HKV, kwargs.pop("alibi_slopes", None),
                                              kwargs.pop("sliding_window", None), "auto",
                                              kwargs.pop("logits_soft_cap", None), **kwargs)
        self.module = SimpleNamespace(layer_name=name, impl=self.impl)
        self.kv_cache = torch.zeros(16, HKV, BS, 2 * D)
        self.keys: list[list[torch.Tensor]] = [[], [], [], []]  # per sequence: its keys, values so far
        self.values: list[list[torch.Tensor]] = [[], [], [], []]

    def step(self, step, md, gen) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys, run the layer; its output and the float64 reference."""
        seqs = [i for i, (q, _) in enumerate(step) if q]
        k = torch.randn(md.num_actual_tokens, HKV, D, generator=gen)
        v = torch.randn(md.num_actual_tokens, HKV, D, generator=gen)
        q = torch.randn(md.num_actual_tokens, H, D, generator=gen)
        slots, at = [], 0
        for row, i in enumerate(seqs):
            n, kv = step[i]
            self.keys[i].append(k[at:at + n])
            self.values[i].append(v[at:at + n])
            pos = torch.arange(kv - n, kv)
            slots.append(md.block_table[row, pos // BS].long() * BS + pos % BS)
            at += n
        self.impl.do_kv_cache_update(self.module, k, v, self.kv_cache, torch.cat(slots))
        out = self.impl.forward(self.module, q, k, v, self.kv_cache, md, torch.zeros_like(q))
        ks = [torch.cat(self.keys[i]) for i in seqs]
        vs = [torch.cat(self.values[i]) for i in seqs]
        kv_lens = [step[i][1] for i in seqs]
        q_lens = [step[i][0] for i in seqs]
        impl = self.impl
        feats = impl.attnpolicy.features
        want = reference_attention(q, torch.cat(ks), torch.cat(vs), [sum(q_lens[:j]) for j in range(len(seqs))],
                                   q_lens, [sum(kv_lens[:j]) for j in range(len(seqs))], kv_lens, True, SCALE,
                                   window=feats.window, softcap=feats.softcap, sinks=impl.attnpolicy.facts.sinks)
        return out, want


def _metadata(step, **fields) -> StandInMetadata:
    """The step's metadata: sequence ``i`` holds blocks ``3i, 3i+1, ...`` of every cache,
    backwards (scattered)."""
    seqs = [i for i, (q, _) in enumerate(step) if q]
    q_lens = [step[i][0] for i in seqs]
    table = torch.tensor([[4 * i + 3 - b for b in range(4)] for i in seqs], dtype=torch.int32)
    return StandInMetadata(num_actual_tokens=sum(q_lens),
                           query_start_loc=torch.tensor([sum(q_lens[:j]) for j in range(len(seqs) + 1)],
                                                        dtype=torch.int32),
                           seq_lens=torch.tensor([step[i][1] for i in seqs], dtype=torch.int32),
                           block_table=table, **fields)


def _context(layers: dict[str, _Layer], metadata: dict, mode=CUDAGraphMode.NONE) -> ForwardContext:
    return ForwardContext(no_compile_layers={name: layer.module for name, layer in layers.items()},
                          attn_metadata=metadata, slot_mapping={}, cudagraph_runtime_mode=mode)


def test_the_wrapper_is_the_wrapped_backend_but_for_its_implementation():
    assert Wrapped.wrapped is StandInBackend and issubclass(Wrapped, StandInBackend)
    assert Wrapped.get_name() == "STAND_IN"  # the slot vLLM maps it back to
    assert Wrapped.get_builder_cls() is StandInBuilder
    assert Wrapped.get_kv_cache_shape(7, BS, HKV, D) == StandInBackend.get_kv_cache_shape(7, BS, HKV, D)
    impl = Wrapped.get_impl_cls()
    assert issubclass(impl, StandInImpl) and impl.wrapped is StandInImpl and impl.__name__ == "AttnPolicyStandInImpl"
    assert impl.do_kv_cache_update is StandInImpl.do_kv_cache_update


@pytest.mark.parametrize("policy", sorted(MODES))
def test_every_step_of_every_group_is_decided_and_runs_in_its_mode(vllm_config, env, policy):
    """Two KV-cache groups over the stand-in: a plain one of two layers, and one with a
    window, a soft cap and sinks. Every step of each group is decided once and runs in
    the policy's mode: VARLEN on the stand-in's kernel, CAUSAL, MASK and ROWS on
    attnpolicy's graphs (MASK and ROWS with context gathering the keys from the stand-in's
    cache), each output the float64 reference's."""
    env(policy)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(1))
    plain = {name: _Layer(vllm_config, name) for name in ("model.layers.0.attn", "model.layers.1.attn")}
    featured = {"model.layers.2.attn": _Layer(vllm_config, "model.layers.2.attn", sliding_window=4,
                                              logits_soft_cap=0.5, sinks=sinks)}
    gen = torch.Generator().manual_seed(0)
    calls = StandInImpl.calls
    for step in STEPS:
        md_plain, md_featured = _metadata(step), _metadata(step)
        metadata = {**dict.fromkeys(plain, md_plain), **dict.fromkeys(featured, md_featured)}
        with override_forward_context(_context({**plain, **featured}, metadata)):
            for layers, md in ((plain, md_plain), (featured, md_featured)):
                for layer in layers.values():
                    out, want = layer.step(step, md, gen)
                    assert (out.double() - want).abs().max().item() < 1e-5
    decisions = [r for r in env() if r["event"] == "decision"]
    assert [(d["group"], d["mode"]) for d in decisions] == [
        (group, mode) for mode in MODES[policy] for group in ("model.layers.0.attn", "model.layers.2.attn")]
    assert {(d["window"], d["softcap"], d["sinks"]) for d in decisions if d["group"] == "model.layers.2.attn"} == {
        (4, 0.5, True)}
    # the stand-in's kernel ran the VARLEN steps, for each of the three layers
    assert StandInImpl.calls - calls == 3 * MODES[policy].count("varlen")


def test_what_the_wrapper_cannot_run_goes_to_the_wrapped_kernel_and_is_said(vllm_config, env, caplog):
    """An ALiBi layer and a layer built with an argument attnpolicy does not model run
    the stand-in's kernel, named in one warning at the first forward; a step whose
    metadata sets one of the host's ``plain_fields`` runs it too; none is decided."""
    env("always-mask")
    layers = {"alibi": _Layer(vllm_config, "alibi", alibi_slopes=[0.5] * H),
              "chunked": _Layer(vllm_config, "chunked", chunk_lookback=8),
              "plain": _Layer(vllm_config, "plain")}
    step = STEPS[0]
    md, unplain = _metadata(step), _metadata(step, prefix_ranges={0: [(0, 2)]})
    calls = StandInImpl.calls
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="attnpolicy"), \
            override_forward_context(_context(layers, {"alibi": md, "chunked": md, "plain": unplain})):
        layers["alibi"].step(step, md, gen)
        layers["chunked"].step(step, md, gen)
        layers["plain"].step(step, unplain, gen)
    assert StandInImpl.calls - calls == 3
    [warning] = [r.getMessage() for r in caplog.records if "vLLM's own implementation" in r.getMessage()]
    assert "alibi (ALiBi)" in warning and "chunked (AttnPolicyStandInImpl built with chunk_lookback=8)" in warning
    assert "plain" not in warning.split(":", 1)[1]
    records = env()
    assert not [r for r in records if r["event"] == "decision"]
    assert [r["layers"] for r in records if r["event"] == "layers_elsewhere"] == [
        {"alibi": "ALiBi", "chunked": "AttnPolicyStandInImpl built with chunk_lookback=8"}]


def test_steps_under_a_full_cuda_graph_run_the_wrapped_kernel_undecided(vllm_config, env, caplog):
    """Under a FULL CUDA graph the step's lengths are the graph's, not the host's: the
    stand-in's kernel runs it (what the graph captures and replays), undecided, said
    once per size; the same step outside a FULL graph (PIECEWISE) is decided."""
    env("always-mask")
    layers = {"l": _Layer(vllm_config, "l")}
    gen = torch.Generator().manual_seed(0)
    calls = StandInImpl.calls
    with caplog.at_level(logging.INFO, logger="attnpolicy"):
        for step in STEPS[:2]:
            md = _metadata(step)
            with override_forward_context(_context(layers, {"l": md}, CUDAGraphMode.FULL)):
                out, want = layers["l"].step(step, md, gen)
            assert (out.double() - want).abs().max().item() < 1e-5
    assert StandInImpl.calls - calls == 2
    records = env()
    assert not [r for r in records if r["event"] == "decision"]
    assert [(r["num_tokens"], r["mode"]) for r in records if r["event"] == "full_graph"] == [(17, "varlen"),
                                                                                           (6, "varlen")]
    assert len([r for r in caplog.records if "FULL CUDA graphs" in r.getMessage()]) == 1  # said once
    md = _metadata(STEPS[2])
    with override_forward_context(_context(layers, {"l": md}, CUDAGraphMode.PIECEWISE)):
        out, want = layers["l"].step(STEPS[2], md, gen)
    assert (out.double() - want).abs().max().item() < 1e-5
    assert StandInImpl.calls - calls == 2
    assert [r["mode"] for r in env() if r["event"] == "decision"] == ["mask"]


def test_register_wraps_the_platforms_slot_over_what_it_held_and_unregister_gives_it_back(env):
    """On CPU the platform's one slot, CPU_ATTN: ``register`` points it at the wrapper of
    vLLM's class (or of another plugin's override, kept reachable), ``unregister`` gives
    the slot back what it held."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    slot = AttentionBackendEnum.CPU_ATTN
    integration.unregister()
    assert integration.platform_slots() == ("CPU_ATTN",) and not integration.is_registered()
    try:
        integration.register()
        assert integration.is_registered()
        wrapper = slot.get_class()
        assert wrapper.__name__ == "AttnPolicyCPUBackend" and wrapper.wrapped is CPUAttentionBackend
        assert wrapper.get_name() == "CPU_ATTN" and issubclass(wrapper.get_impl_cls(), wrapper.get_impl_cls().wrapped)
        integration.unregister()
        assert slot.get_class() is CPUAttentionBackend and not slot.is_overridden()
        register_backend(slot, "vllm_stand_in.StandInBackend")  # another plugin's, before ours
        integration.register()
        assert slot.get_class().wrapped is StandInBackend
        assert integration.original_path("CPU_ATTN") == "vllm_stand_in.StandInBackend"
        integration.unregister()
        assert slot.get_path() == "vllm_stand_in.StandInBackend"
    finally:
        integration.unregister()
        slot.clear_override()


def test_attnpolicys_runtime_warnings_are_one_line_in_vllms_format(tmp_path):
    """Inside vLLM, strict mode's compile after warm-up and a graph store that cannot be
    written are one WARNING line each in vLLM's own format (the file and line that
    warned), not a Python warning's two lines; other warnings stay Python's."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG
    from vllm.logging_utils import NewLineFormatter

    from attnpolicy.config import AttnPolicyConfig
    from attnpolicy.core.layout import BatchLayout
    from attnpolicy.dispatch import Dispatcher
    from attnpolicy.graphs.keys import TensorSpec

    vllm_logger = logging.getLogger("vllm")
    vllm_format = DEFAULT_LOGGING_CONFIG["formatters"]["vllm"]  # as vLLM configures its handler, without
    out = io.StringIO()                                       # the process prefix its record factory fills
    capture = logging.StreamHandler(out)
    capture.setFormatter(NewLineFormatter(vllm_format["format"].split(") ", 1)[1], vllm_format["datefmt"]))
    vllm_logger.addHandler(capture)
    level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)
    spec = TensorSpec("float32", 2, 2, 16)
    (tmp_path / "file").write_text("a file where the store's directory would be")
    try:
        with warnings.catch_warnings(record=True) as python_warnings:
            warnings.simplefilter("always")
            assert integration.route_logs()
            try:
                strict = Dispatcher(AttnPolicyConfig(backend="none", max_seq_len=256, strict="warn"))
                strict.warmup([BatchLayout.from_lens([20])], spec)
                strict.prepare(BatchLayout.from_lens([100]), spec)  # compiled after warm-up
                stored = Dispatcher(AttnPolicyConfig(backend="aot_eager", max_seq_len=64,
                                                     store_dir=str(tmp_path / "file" / "store")))
                stored.prepare(BatchLayout.from_lens([20]), spec)  # its graph cannot be saved
                warnings.warn("not attnpolicy's", RuntimeWarning, stacklevel=1)
            finally:
                integration.unroute_logs()
    finally:
        vllm_logger.removeHandler(capture)
        vllm_logger.setLevel(level)
    shown_lines = out.getvalue().splitlines()
    assert [str(w.message) for w in python_warnings] == ["not attnpolicy's"]
    [compiled] = [line for line in shown_lines if "compiled after warm-up" in line]
    [store] = [line for line in shown_lines if "graph store" in line]
    for line in (compiled, store):  # vLLM's format: level, time, [file:line], message
        assert re.fullmatch(r"WARNING \d\d-\d\d [\d:]+ \[\w+\.py:\d+\] graph .*", line), line
    assert "warnings.warn" not in out.getvalue()  # no source line under it

"""attn_implementation="attnpolicy" in HF transformers matches "sdpa" on tiny random models."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install 'attnpolicy[transformers]'")

import tiny_models  # noqa: E402

from attnpolicy import AttnPolicyConfig  # noqa: E402
from attnpolicy.errors import LayoutError  # noqa: E402
from attnpolicy.integrations import transformers as hf  # noqa: E402
from attnpolicy.integrations.hf_layout import layout_from_mask  # noqa: E402
from attnpolicy.plugins.hookspecs import hookimpl  # noqa: E402
from attnpolicy.plugins.registry import get_plugin_manager  # noqa: E402

ATOL = 1e-5


class Recorder:
    def __init__(self) -> None:
        self.decisions: list[tuple[tuple[int, ...], bool, str]] = []

    @hookimpl
    def attnpolicy_on_decision(self, layout, decision, policy, fell_back):
        self.decisions.append((layout.q_lens, layout.causal, decision.mode.value))


@pytest.fixture
def recorder():
    rec = Recorder()
    pm = get_plugin_manager()
    pm.register(rec)
    yield rec
    pm.unregister(rec)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"llama": tiny_models.llama(root / "llama"), "qwen2": tiny_models.qwen2(root / "qwen2"),
            "bert": tiny_models.bert(root / "bert")}


def _load(path, policy="dynamic", **fields):
    hf.register(AttnPolicyConfig(policy=policy, backend="none", **fields))
    auto = transformers.AutoModel if path.name == "bert" else transformers.AutoModelForCausalLM
    return auto.from_pretrained(path, attn_implementation="sdpa").eval()


def _both(model, **inputs):
    """(sdpa output, attnpolicy output): logits, or hidden states of an encoder."""
    def run():
        with torch.no_grad():
            out = model(**inputs)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    model.set_attn_implementation("sdpa")
    ref = run()
    model.set_attn_implementation("attnpolicy")
    try:
        return ref, run()
    finally:
        model.set_attn_implementation("sdpa")


IDS = torch.randint(4, tiny_models.VOCAB, (3, 12), generator=torch.Generator().manual_seed(0))


def _padding(side: str) -> torch.Tensor:
    mask = torch.ones(3, 12, dtype=torch.long)
    if side == "right":
        mask[0, 9:] = 0
        mask[2, 5:] = 0
    else:
        mask[0, :3] = 0
        mask[2, :7] = 0
    return mask


#: the mode each policy runs a batch of several sequences in
SEVERAL = {"dynamic": "mask", "varlen": "varlen", "always-rows": "rows"}


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", sorted(SEVERAL))
@pytest.mark.parametrize("side", ["left", "right"])
def test_transformers_decoder_padded_batch_matches_sdpa(models, recorder, name, policy, side):
    mask = _padding(side)
    ref, out = _both(_load(models[name], policy), input_ids=IDS, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=ATOL, rtol=0)
    assert {d[0] for d in recorder.decisions} == {(9, 12, 5)}
    assert {d[2] for d in recorder.decisions} == {SEVERAL[policy]}
    assert not hf.fallbacks()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_transformers_decoder_single_sequence_runs_causal(models, recorder, name):
    ref, out = _both(_load(models[name]), input_ids=IDS[:1])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert {d[2] for d in recorder.decisions} == {"causal"}


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", sorted(SEVERAL))
def test_transformers_decoder_packed_sequences_match_sdpa(models, recorder, name, policy):
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]])  # restarts: 3 sequences
    ref, out = _both(_load(models[name], policy), input_ids=IDS[:1], position_ids=position_ids,
                     use_cache=False)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert {d[0] for d in recorder.decisions} == {(4, 5, 3)}
    assert {d[2] for d in recorder.decisions} == {SEVERAL[policy]}


def test_transformers_packed_output_differs_from_one_long_sequence(models):
    """The packing is really honoured: without restarts the logits change."""
    model = _load(models["llama"])
    model.set_attn_implementation("attnpolicy")
    with torch.no_grad():
        packed = model(input_ids=IDS[:1], use_cache=False,
                       position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]])).logits
        whole = model(input_ids=IDS[:1]).logits
    assert (packed[0, 4:] - whole[0, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize("policy", sorted(SEVERAL))
def test_transformers_bert_padded_and_single_match_sdpa(models, recorder, policy):
    model = _load(models["bert"], policy)
    mask = _padding("right")
    ref, out = _both(model, input_ids=IDS, attention_mask=mask)
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)
    ref, out = _both(model, input_ids=IDS[:1])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert {(d[0], d[1]) for d in recorder.decisions} == {((9, 12, 5), False), ((12,), False)}


def test_transformers_generate_left_padded_matches_sdpa(models):
    model = _load(models["llama"])
    mask = _padding("left")
    kwargs = dict(input_ids=IDS, attention_mask=mask, max_new_tokens=5, do_sample=False,
                  pad_token_id=0)
    model.set_attn_implementation("sdpa")
    ref = model.generate(**kwargs)
    model.set_attn_implementation("attnpolicy")
    out = model.generate(**kwargs)
    assert torch.equal(out, ref)
    assert not hf.fallbacks()


#: prompt lengths of the batches HF generate pads on the left: one prompt, spread ones, one
#: of a single token, more prompts than the largest row bucket (2 here: several rows calls)
GENERATE_LENS = ((12,), (12, 9, 5), (3, 12, 7, 1, 10), (6, 6))


def _left_padded(lens: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Prompts of ``lens`` tokens (drawn from ``IDS``'s values), left-padded with token 0."""
    width = max(lens)
    ids = torch.randint(4, tiny_models.VOCAB, (len(lens), width), generator=torch.Generator().manual_seed(len(lens)))
    mask = (torch.arange(width) >= width - torch.tensor(lens)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.mark.parametrize("lens", GENERATE_LENS)
def test_transformers_generate_in_rows_matches_sdpa_and_builds_no_host_mask(models, recorder, monkeypatch, lens):
    """HF generate under always-rows: the left-padded prompts, then every decode over the
    cache, run in rows (each sequence gathered into its own right-padded row, its keys
    bounded in the graph from its length), in calls of at most 2 rows: SDPA's greedy
    tokens and every step's logits within 1e-5 (float32), no fallback, and no dense mask
    built on the host (where always-mask builds one for the same prompts)."""
    from attnpolicy.kernels import masks

    built = []
    materialize = masks.BlockDiagonalMask.materialize
    monkeypatch.setattr(masks.BlockDiagonalMask, "materialize",
                        lambda self, *a, **k: built.append(self.layout) or materialize(self, *a, **k))
    hf._fallbacks.clear()
    model = _load(models["llama"], "always-rows", row_buckets=(1, 2))
    kwargs = dict(_left_padded(lens), max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    ref = model.generate(**kwargs)
    model.set_attn_implementation("attnpolicy")
    out = model.generate(**kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits) == 5
    for mine, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(mine, want, atol=ATOL, rtol=0)
    assert not hf.fallbacks()
    assert {d[2] for d in recorder.decisions} == {"rows"}
    assert (tuple(lens), True, "rows") in recorder.decisions  # the prompts, one sequence a row
    assert sum(d[0] == (1,) * len(lens) for d in recorder.decisions) == 4 * 2  # 4 decode steps, 2 layers
    assert built == []
    mask_model = _load(models["llama"], "always-mask")
    mask_model.set_attn_implementation("attnpolicy")
    with torch.no_grad():
        mask_model(**_left_padded(lens))
    assert built  # the count can fail


def test_transformers_unsupported_mask_falls_back_to_sdpa(models):
    """A mask that is no block structure (a sliding window) runs HF's SDPA, counted."""
    model = _load(models["llama"])
    idx = torch.arange(12)
    window = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < 4)
    mask4d = window[None, None].expand(1, 1, 12, 12)
    before = sum(hf.fallbacks().values())
    ref, out = _both(model, input_ids=IDS[:1], attention_mask=mask4d)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert sum(hf.fallbacks().values()) > before


def test_transformers_layout_from_mask_rejects_sliding_window():
    idx = torch.arange(6)
    window = (idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < 2)
    with pytest.raises(LayoutError):
        layout_from_mask(window[None], causal=True)


def test_transformers_layout_from_mask_reads_left_padding_and_context():
    # batch row 0: 2 padding keys, then 4 tokens; the last 2 are the queries (context 2)
    allowed = torch.zeros(1, 2, 6, dtype=torch.bool)
    allowed[0, 0, 2:5] = True
    allowed[0, 1, 2:6] = True
    layout = layout_from_mask(allowed, causal=True)
    assert (layout.q_lens, layout.kv_lens, layout.q_starts, layout.kv_starts) == ((2,), (4,), (0,), (2,))


# -- sliding windows, soft caps, sinks ---------------------------------------------------
POLICIES = ("always-causal", "always-mask", "always-rows", "cost-aware", "dynamic", "varlen")
PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0]])  # restarts: 3 sequences, one longer than 4
#: the model, and the attention HF computes it exactly with (SDPA drops Gemma2's soft cap; GPT-OSS has no SDPA)
FEATURE_MODELS = {"mistral": "sdpa", "gemma2": "eager", "gpt_oss": "eager"}


@pytest.fixture(scope="module")
def feature_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-features")
    return {name: getattr(tiny_models, name)(root / name) for name in FEATURE_MODELS}


def _against(model, ref_impl, **inputs):
    outs = []
    for impl in (ref_impl, "attnpolicy"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs.append(model(**inputs).logits)
    model.set_attn_implementation(ref_impl)
    return outs


@pytest.mark.parametrize("name", list(FEATURE_MODELS))
@pytest.mark.parametrize("policy", POLICIES)
def test_transformers_windowed_capped_and_sink_models_match_hf(feature_models, name, policy):
    """Mistral (window 8), Gemma2 (window 4 and full layers, soft cap 0.5) and GPT-OSS
    (window 4 and full layers, sinks): padded, single and packed batches, no fallback."""
    hf.register(AttnPolicyConfig(policy=policy, backend="none"))
    hf._fallbacks.clear()
    model = transformers.AutoModelForCausalLM.from_pretrained(feature_models[name],
                                                              attn_implementation="eager").eval()
    ref_impl = FEATURE_MODELS[name]
    mask = _padding("right")
    ref, out = _against(model, ref_impl, input_ids=IDS, attention_mask=mask)
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=ATOL, rtol=0)
    ref, out = _against(model, ref_impl, input_ids=IDS[:1])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    ref, out = _against(model, ref_impl, input_ids=IDS[:1], position_ids=PACKED, use_cache=False)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert hf.fallbacks() == {}


def test_transformers_the_features_change_the_output(feature_models):
    """The window and the cap are really applied: without them the logits differ by
    many times the tolerance."""
    hf.register(AttnPolicyConfig(policy="dynamic", backend="none"))

    def logits(name, drop):
        model = transformers.AutoModelForCausalLM.from_pretrained(feature_models[name],
                                                                  attn_implementation="attnpolicy").eval()
        drop(model)
        with torch.no_grad():
            return model(input_ids=IDS[:1]).logits

    def no_window(model):
        model.config.sliding_window = None  # Mistral reads it from the config on every call

    def no_cap(model):
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None

    for name, drop in (("mistral", no_window), ("gemma2", no_cap)):
        assert (logits(name, lambda m: None) - logits(name, drop)).abs().max() > 10 * ATOL, name


def test_transformers_generate_with_a_sliding_window_matches_sdpa(feature_models):
    """Decode steps see the window's keys only (cached context, left padding)."""
    hf.register(AttnPolicyConfig(policy="dynamic", backend="none"))
    hf._fallbacks.clear()
    model = transformers.AutoModelForCausalLM.from_pretrained(feature_models["mistral"],
                                                              attn_implementation="sdpa").eval()
    kwargs = dict(input_ids=IDS, attention_mask=_padding("left"), max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(**kwargs)
    model.set_attn_implementation("attnpolicy")
    assert torch.equal(model.generate(**kwargs), ref)
    assert hf.fallbacks() == {}


def test_transformers_a_fallback_names_the_feature():
    hf.register(AttnPolicyConfig(policy="dynamic", backend="none"))
    hf._fallbacks.clear()
    module = torch.nn.Module()
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8)
    hf.dispatched_attention(module, q, k, k, None, dropout=0.1, sliding_window=8, softcap=None)
    assert hf.fallbacks() == {"sliding window 8 with dropout": 1}


def test_transformers_layout_from_mask_reads_a_sliding_window():
    from attnpolicy.core.layout import BatchLayout
    from attnpolicy.kernels.masks import mask_for

    packed = BatchLayout.from_lens([6, 5])
    assert layout_from_mask(mask_for(packed, 3).materialize()[None], causal=True, window=3) == packed
    decode = torch.zeros(1, 1, 10, dtype=torch.bool)
    decode[0, 0, 7:] = True  # the last 3 of 10 keys: the window's
    layout = layout_from_mask(decode, causal=True, window=3)
    assert (layout.q_lens, layout.kv_lens, layout.kv_starts) == ((1,), (3,), (7,))
    decode[0, 0, 5:] = True  # 5 keys under a window of 3: not a window mask
    with pytest.raises(LayoutError, match="sliding window of 3"):
        layout_from_mask(decode, causal=True, window=3)

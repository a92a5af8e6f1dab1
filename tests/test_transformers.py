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


def _load(path, policy="dynamic"):
    hf.register(AttnPolicyConfig(policy=policy, backend="none"))
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


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["dynamic", "varlen"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_transformers_decoder_padded_batch_matches_sdpa(models, recorder, name, policy, side):
    mask = _padding(side)
    ref, out = _both(_load(models[name], policy), input_ids=IDS, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=ATOL, rtol=0)
    assert {d[0] for d in recorder.decisions} == {(9, 12, 5)}
    expected = "mask" if policy == "dynamic" else "varlen"
    assert {d[2] for d in recorder.decisions} == {expected}
    assert not hf.fallbacks()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_transformers_decoder_single_sequence_runs_causal(models, recorder, name):
    ref, out = _both(_load(models[name]), input_ids=IDS[:1])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert {d[2] for d in recorder.decisions} == {"causal"}


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["dynamic", "varlen"])
def test_transformers_decoder_packed_sequences_match_sdpa(models, recorder, name, policy):
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]])  # restarts: 3 sequences
    ref, out = _both(_load(models[name], policy), input_ids=IDS[:1], position_ids=position_ids,
                     use_cache=False)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert {d[0] for d in recorder.decisions} == {(4, 5, 3)}
    assert {d[2] for d in recorder.decisions} == {"mask" if policy == "dynamic" else "varlen"}


def test_transformers_packed_output_differs_from_one_long_sequence(models):
    """The packing is really honoured: without restarts the logits change."""
    model = _load(models["llama"])
    model.set_attn_implementation("attnpolicy")
    with torch.no_grad():
        packed = model(input_ids=IDS[:1], use_cache=False,
                       position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]])).logits
        whole = model(input_ids=IDS[:1]).logits
    assert (packed[0, 4:] - whole[0, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize("policy", ["dynamic", "varlen"])
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

"""Tiny random HF models (plus a word-level tokenizer) written to a directory, and a
plain torch encoder stack.

Used by the vLLM and transformers integration tests and the graph store's: no downloads. Head dim is
32 (the smallest vLLM's CPU attention supports); weights are seeded.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 128
HEAD_DIM = 32


def _save_tokenizer(path: Path) -> None:
    """A word-level tokenizer over ``VOCAB`` tokens: ``[PAD] [UNK] [CLS] [SEP] w4 .. w127``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {tok: i for i, tok in enumerate(special + [f"w{i}" for i in range(len(special), VOCAB)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", bos_token="[CLS]",
                                   eos_token="[SEP]", model_max_length=512)
    fast.save_pretrained(path)


def _save(model, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _save_tokenizer(path)
    return path


def llama(path: Path, *, kv_heads: int = 2, seed: int = 0, max_positions: int = 512) -> Path:
    """A 2-layer Llama: hidden 128, 4 query heads, ``kv_heads`` kv heads (GQA when < 4),
    positions up to ``max_positions``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                      head_dim=HEAD_DIM, max_position_embeddings=max_positions, bos_token_id=2,
                      eos_token_id=3, pad_token_id=0, tie_word_embeddings=False,
                      dtype="float32")
    return _save(LlamaForCausalLM(cfg).eval(), path)


def qwen2(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer Qwen2 (q/k/v biases, GQA 4:2)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, bos_token_id=2, eos_token_id=3,
                      pad_token_id=0, tie_word_embeddings=False, dtype="float32")
    return _save(Qwen2ForCausalLM(cfg).eval(), path)


def mistral(path: Path, *, seed: int = 0, window: int = 8) -> Path:
    """A 2-layer Mistral (GQA 4:2) with a sliding window of ``window`` keys."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                        sliding_window=window, max_position_embeddings=512, bos_token_id=2, eos_token_id=3,
                        pad_token_id=0, tie_word_embeddings=False, dtype="float32")
    return _save(MistralForCausalLM(cfg).eval(), path)


def gemma2(path: Path, *, seed: int = 0, window: int = 4, softcap: float = 0.5) -> Path:
    """A 2-layer Gemma2 (GQA 4:2): a sliding layer (``window``) then a full one, logits
    soft-capped at ``softcap`` (small, so that a kernel without the cap is far off)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                       sliding_window=window, attn_logit_softcapping=softcap, final_logit_softcapping=30.0,
                       query_pre_attn_scalar=HEAD_DIM, layer_types=["sliding_attention", "full_attention"],
                       max_position_embeddings=512, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                       dtype="float32")
    return _save(Gemma2ForCausalLM(cfg).eval(), path)


def gpt_oss(path: Path, *, seed: int = 0, window: int = 4) -> Path:
    """A 2-layer GPT-OSS (GQA 4:2, 4 experts): a sliding layer (``window``) then a full
    one, each head with a learned sink logit (random, of order 1)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                       num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
                       layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                       bos_token_id=2, eos_token_id=3, pad_token_id=0, tie_word_embeddings=False,
                       dtype="float32")
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return _save(model, path)


def bloom(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer BLOOM (ALiBi position biases, 4 heads)."""
    import torch
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    cfg = BloomConfig(vocab_size=VOCAB, hidden_size=4 * HEAD_DIM, n_layer=2, n_head=4, bos_token_id=2,
                      eos_token_id=3, pad_token_id=0, dtype="float32")
    return _save(BloomForCausalLM(cfg).eval(), path)


def bert(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer BERT encoder: hidden 64, 2 heads of 32."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=2 * HEAD_DIM, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=512,
                     pad_token_id=0, dtype="float32")
    return _save(BertModel(cfg).eval(), path)


def encoder_stack(*, seed: int = 0, layers: int = 2, hidden: int = 64):
    """A seeded stack of ``layers`` pre-norm ``torch.nn.TransformerEncoderLayer`` (4 heads,
    batch first, no dropout), in eval mode: a whole-model graph built from torch alone."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(*(nn.TransformerEncoderLayer(hidden, 4, 2 * hidden, dropout=0.0, batch_first=True,
                                                      norm_first=True) for _ in range(layers))).eval()

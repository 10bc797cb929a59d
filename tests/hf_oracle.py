"""What the transformers tests share: selfattn registered, the float64 oracle, the tiny models.

The oracle is textbook attention on transformers' own dense mask (``oracle_attention``,
independent of selfattn; unlike ``eager`` in float64, it does not turn a fully masked row into
NaN), registered as an attention implementation of its own.
"""

from __future__ import annotations

import copy

import torch
import transformers

from selfattn.integrations import transformers as sa_hf

NAME = sa_hf.register()
ORACLE = "selfattn_test_oracle"


def oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     softcap=None, s_aux=None, **kwargs):
    """Textbook attention on transformers' dense mask: repeat K/V, scale, soft-cap, mask, sink
    column, softmax (a row that sees nothing gives 0), drop the sink, weights @ V."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    s = query @ k.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    lq, lk = s.shape[-2:]
    if attention_mask is None and (getattr(module, "is_causal", True) if is_causal is None else is_causal) and lq > 1:
        attention_mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    if attention_mask is not None:
        s = s.masked_fill(~attention_mask.bool(), float("-inf"))
    if s_aux is not None:
        s = torch.cat([s, s_aux.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    alive = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(alive, s, 0.0), dim=-1) * alive
    p = p[..., :lk]
    return (p @ v).transpose(1, 2).contiguous(), p


def _oracle_mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


transformers.AttentionInterface.register(ORACLE, oracle_attention)
transformers.masking_utils.AttentionMaskInterface.register(ORACLE, _oracle_mask)


L, VOCAB = 24, 101

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
              max_position_embeddings=128)


def configs() -> dict:
    t = transformers
    return {
        "llama": (t.LlamaConfig, dict(COMMON, intermediate_size=128, num_key_value_heads=2)),
        "mistral": (t.MistralConfig, dict(COMMON, intermediate_size=128, num_key_value_heads=2, sliding_window=7)),
        "gemma2": (t.Gemma2Config, dict(COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                        sliding_window=6, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=None,
                                        layer_types=["sliding_attention", "full_attention"])),
        "qwen2": (t.Qwen2Config, dict(COMMON, intermediate_size=128, num_key_value_heads=1)),
        "gpt2": (t.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128)),
        "bert": (t.BertConfig, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                    vocab_size=VOCAB, max_position_embeddings=128)),
        "gpt_oss": (t.GptOssConfig, dict(COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=16,
                                         num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                         layer_types=["sliding_attention", "full_attention"])),
    }


def build(model: str, impl: str, dtype: torch.dtype = torch.float32, experts: str = "eager"):
    """The tiny model ``model`` (a key of :func:`configs`) with ``impl`` attention, seed 0, eval mode;
    ``experts``: gpt-oss's experts implementation (grouped_mm has no float64, eager does not compile)."""
    cls, kwargs = configs()[model]
    cfg = cls(**copy.deepcopy(kwargs))
    auto = transformers.AutoModel if model == "bert" else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    extra = {"experts_implementation": experts} if model == "gpt_oss" else {}
    m = auto.from_config(cfg, attn_implementation=impl, **extra)
    return m.to(dtype).eval()

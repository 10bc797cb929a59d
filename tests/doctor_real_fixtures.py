"""Real attention modules for the doctor's tests, and hand-made buggy variants of each.

transformers' GPT-2 and Llama attention classes (tiny random configs, eager attention, no
download) and torch's nn.MultiheadAttention. Each variant reuses the real module's weights and
projections and changes one thing, named in ``BUGS``:

- "after-softmax": the mask is applied to the weights after the softmax;
- "wrong-sign": the additive mask is subtracted (MultiheadAttention: the key padding mask is
  inverted);
- "broadcast": a (B, L) key mask is reshaped to (B, 1, L, 1), so it hides queries, not keys;
- "no-scale": no 1/sqrt(head_dim);
- "view-merge": heads merged with reshape before the transpose back.

GPT-2 and Llama variants take transformers' additive (B, 1, L, L) mask, except "broadcast",
which takes a (B, L) 1/0 attention mask (1 = real token) and builds the additive mask itself.
Importing this file needs transformers.

Shape legend: B batch, H heads, G kv heads, L length, E embed dim, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

BUGS = ("after-softmax", "wrong-sign", "broadcast", "no-scale", "view-merge")
EXPECTED = {"after-softmax": "mask-after-softmax", "wrong-sign": "mask-inverted", "broadcast": "mask-broadcast",
            "no-scale": "missing-scale", "view-merge": "head-merge"}


def _eager(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bug: str | None) -> Tensor:
    """q, k, v (B, H, L, D); mask additive, broadcastable to (B, H, L, L) -> (B, L, H * D)."""
    b, h, length, d = q.shape
    w = q @ k.transpose(-1, -2) * (1.0 if bug == "no-scale" else d ** -0.5)
    if mask is not None and bug != "after-softmax":
        w = w - mask if bug == "wrong-sign" else w + mask
    w = torch.softmax(w, dim=-1)
    if mask is not None and bug == "after-softmax":
        w = w + mask
    o = w @ v  # (B, H, L, D)
    return o.reshape(b, length, h * d) if bug == "view-merge" else o.transpose(1, 2).reshape(b, length, h * d)


def key_mask_to_additive(mask: Tensor, dtype: torch.dtype, bug: str | None) -> Tensor:
    """(B, L) 1/0 attention mask (1 = real token) -> additive (B, 1, 1, L) (bug "broadcast": (B, 1, L, 1))."""
    hidden = (1.0 - mask.to(dtype)) * torch.finfo(dtype).min
    return hidden[:, None, :, None] if bug == "broadcast" else hidden[:, None, None, :]


def _eager_config(config):
    config._attn_implementation = "eager"
    return config


def gpt2_config() -> GPT2Config:
    return _eager_config(GPT2Config(n_embd=16, n_head=4, n_layer=1, attn_pdrop=0.0, resid_pdrop=0.0, n_positions=64))


def llama_config() -> LlamaConfig:
    return _eager_config(LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=32, num_hidden_layers=1, max_position_embeddings=64))


def gpt2() -> GPT2Attention:
    """transformers' GPT-2 attention, E = 16, 4 heads."""
    return GPT2Attention(gpt2_config(), layer_idx=0)


def llama() -> LlamaAttention:
    """transformers' Llama attention, E = 16, 4 query heads, 2 kv heads (GQA), rotary positions."""
    return LlamaAttention(llama_config(), layer_idx=0)


def llama_call(rope: LlamaRotaryEmbedding):
    """The doctor's ``call(module, x, mask)`` for Llama attention: rotary positions 0..L-1 from ``rope``."""
    def call(m: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
        pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        cos, sin = rope(x, pos)
        return m(x, position_embeddings=(cos.to(x.dtype), sin.to(x.dtype)), attention_mask=mask)[0]
    return call


class BuggyGPT2(GPT2Attention):
    """GPT-2 attention with one bug (``bug``, see :data:`BUGS`), or none (bug=None: the eager math)."""

    def __init__(self, bug: str | None) -> None:
        super().__init__(gpt2_config(), layer_idx=0)
        self.bug = bug

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, None]:
        b, length, _ = hidden_states.shape
        q, k, v = (t.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.c_attn(hidden_states).split(self.split_size, dim=2))
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = key_mask_to_additive(attention_mask, q.dtype, self.bug)
        return self.c_proj(_eager(q, k, v, attention_mask, self.bug)), None


class BuggyLlama(LlamaAttention):
    """Llama attention with one bug (``bug``, see :data:`BUGS`), or none; called through :func:`llama_call`."""

    def __init__(self, bug: str | None) -> None:
        super().__init__(llama_config(), layer_idx=0)
        self.bug = bug

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                attention_mask: Tensor | None = None) -> tuple[Tensor, None]:
        b, length, _ = hidden_states.shape
        shape = (b, length, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        k, v = repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = key_mask_to_additive(attention_mask, q.dtype, self.bug)
        return self.o_proj(_eager(q, k, v, attention_mask, self.bug)), None


class BuggyMHA(nn.MultiheadAttention):
    """nn.MultiheadAttention (batch_first) written out by hand with one bug; key_padding_mask: True = padding."""

    def __init__(self, bug: str | None) -> None:
        super().__init__(16, 4, batch_first=True)
        self.bug = bug

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = False) -> tuple[Tensor, None]:
        b, length, e = query.shape
        q, k, v = (t.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, -1))
        mask = None
        if key_padding_mask is not None:
            pad = ~key_padding_mask if self.bug == "wrong-sign" else key_padding_mask
            pad = pad[:, None, :, None] if self.bug == "broadcast" else pad[:, None, None, :]
            mask = torch.zeros(pad.shape, dtype=q.dtype).masked_fill(pad, torch.finfo(q.dtype).min)
        if self.bug == "after-softmax":  # the usual form for a bool mask: zero the weights of padded keys
            w = torch.softmax(q @ k.transpose(-1, -2) * self.head_dim ** -0.5, dim=-1)
            w = w if key_padding_mask is None else w.masked_fill(key_padding_mask[:, None, None, :], 0.0)
            return self.out_proj((w @ v).transpose(1, 2).reshape(b, length, e)), None
        bug = None if self.bug in ("wrong-sign", "broadcast") else self.bug
        return self.out_proj(_eager(q, k, v, mask, bug)), None

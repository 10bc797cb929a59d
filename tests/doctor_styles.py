"""Attention modules written the way public code bases write them, for the doctor's tests.

Each is correct unless its docstring says "Bug:". They cover what the doctor must handle on code it
did not write: a config object defined next to the class, parameters in float64 or bfloat16, a mask
the forward requires, a fixed window of tokens, a maximum batch, q/k normalisation, a residual and a
norm inside the module, padded query rows zeroed, a built-in sliding window, an unused optional
argument, a causal switch, a norm before the projections, no projections at all; and bugs that only
show in half precision, in a hand-written backward, in the scale of such modules, or for one of two
accepted mask shapes. The file is also loadable by ``selfattn check tests/doctor_styles.py:Class``.

Shape legend: B batch, H heads, L (or N) length, E embed dim, D head dim.
"""

from __future__ import annotations

import math

import corpus_gpt
import torch
import torch.nn.functional as F
from corpus_gpt import GPTConfig  # noqa: F401 - the config class next to the module, as users keep it
from torch import nn


class CausalSelfAttention(corpus_gpt.CausalSelfAttention):
    """The GPT-style module (config dataclass, causal buffer) with an optional ``layer_past=None`` it never uses."""

    def forward(self, x, layer_past=None):
        return super().forward(x)


class Heads(nn.Module):
    """Fused qkv and an output projection; the pieces the modules below share."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def split(self, x):
        b, n, _ = x.shape
        return [t.view(b, n, self.heads, self.dim_head).transpose(1, 2) for t in self.qkv(x).chunk(3, -1)]

    def merge(self, o):
        b, h, n, d = o.shape
        return self.out(o.transpose(1, 2).reshape(b, n, h * d))


class Float64Attention(Heads):
    """Parameters in float64 (a numerics study); forward(x, mask=None), mask (B, L) bool, True = real token."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__(dim, heads)
        self.double()

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        s = q @ k.transpose(-2, -1) * self.dim_head ** -0.5
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class BFloat16Attention(Float64Attention):
    """Parameters in bfloat16, SDPA inside."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__(dim, heads)
        self.to(torch.bfloat16)

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else
                                                         mask[:, None, None, :]))


class RequiredMask(Heads):
    """forward(x, mask) with no default: mask (B, L, L) bool, True = may attend."""

    def forward(self, x, mask):
        q, k, v = self.split(x)
        s = (q @ k.transpose(-2, -1) / math.sqrt(self.dim_head)).masked_fill(~mask[:, None], float("-inf"))
        return self.merge(torch.softmax(s, -1).nan_to_num(0.0) @ v)


class WindowAttention(nn.Module):
    """Swin style: attention inside one 7x7 window (N = 49 tokens), a learned relative-position bias table;
    the mask (num_windows, N, N), 0 or -100, is added per window (batch = images x windows)."""

    def __init__(self, dim: int, window_size: tuple[int, int] = (7, 7), num_heads: int = 4) -> None:
        super().__init__()
        self.window_size, self.num_heads = window_size, num_heads
        head_dim = dim // num_heads
        self.scale = head_dim ** -0.5
        wh, ww = window_size
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * wh - 1) * (2 * ww - 1), num_heads) * 0.5)
        coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)  # (2, N)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)  # (N, N, 2)
        self.register_buffer("relative_position_index", (rel[..., 0] + wh - 1) * (2 * ww - 1) + rel[..., 1] + ww - 1)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b_, n, c = x.shape
        qkv = self.qkv(x).reshape(b_, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = attn + bias.permute(2, 0, 1).contiguous()[None]
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(b_ // nw, nw, self.num_heads, n, n) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, n, n)
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(b_, n, c)
        return self.proj(x)


class CachedAttention(Heads):
    """A KV cache allocated for at most 32 batch rows and 64 positions, written on every call (start at 0)."""

    def __init__(self, dim: int, heads: int = 4, max_batch: int = 32, max_len: int = 64) -> None:
        super().__init__(dim, heads)
        self.register_buffer("cache_k", torch.zeros(max_batch, heads, max_len, dim // heads), persistent=False)
        self.register_buffer("cache_v", torch.zeros(max_batch, heads, max_len, dim // heads), persistent=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.split(x)
        self.cache_k[:b, :, :n] = k.detach()
        self.cache_v[:b, :, :n] = v.detach()
        return self.merge(F.scaled_dot_product_attention(q, k, v))


class QKNormAttention(Heads):
    """q/k RMS normalisation per head before the scores (Qwen3 / OLMo2 style), causal by a flag."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__(dim, heads)
        self.q_norm = nn.RMSNorm(dim // heads, eps=1e-6)
        self.k_norm = nn.RMSNorm(dim // heads, eps=1e-6)
        with torch.no_grad():  # trained norms are not all ones
            self.q_norm.weight.uniform_(0.5, 2.0)
            self.k_norm.weight.uniform_(0.5, 2.0)

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        q, k = self.q_norm(q), self.k_norm(k)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.dim_head)
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None, :], torch.finfo(s.dtype).min)
        return self.merge(s.softmax(-1) @ v)


class PostNormBlock(Heads):
    """An encoder block's attention half: attention, residual, LayerNorm (post-norm, BERT style), (B, L) key mask."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__(dim, heads)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, key_padding_mask=None):
        q, k, v = self.split(x)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.dim_head)
        if key_padding_mask is not None:  # True = padding
            s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        return self.norm(x + self.merge(s.softmax(-1) @ v))


class ZeroPaddedQueries(Heads):
    """A (B, L) bool key mask (True = real token) that also zeroes the outputs of padded positions."""

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.dim_head)
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None, :], torch.finfo(s.dtype).min)
        out = self.merge(s.softmax(-1) @ v)
        return out if mask is None else out.masked_fill(~mask[..., None], 0.0)


class SlidingWindowCausal(Heads):
    """Causal attention that sees the 3 previous tokens and itself (a built-in sliding window)."""

    window = 3

    def forward(self, x):
        q, k, v = self.split(x)
        n = x.shape[1]
        i = torch.arange(n)
        keep = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - self.window)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


class CausalSwitch(Heads):
    """forward(x, is_causal=False): the mask is SDPA's causal switch."""

    def forward(self, x, is_causal: bool = False):
        q, k, v = self.split(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=is_causal))


class PreNormAttention(nn.Module):
    """LayerNorm before the projections, separate to_q / to_kv (vit-pytorch style), scale dim_head ** -0.5."""

    def __init__(self, dim: int, heads: int = 4, dim_head: int = 16) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, self.scale_of(dim, dim_head)
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim)

    @staticmethod
    def scale_of(dim: int, dim_head: int) -> float:
        return dim_head ** -0.5

    def forward(self, x):
        b, n, _ = x.shape
        x = self.norm(x)
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        out = torch.matmul(attn.softmax(dim=-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class PreNormModelDimScale(PreNormAttention):
    """Bug: the scale is dim ** -0.5 (the model width), not dim_head ** -0.5."""

    @staticmethod
    def scale_of(dim: int, dim_head: int) -> float:
        return dim ** -0.5


class NoProjection(nn.Module):
    """No projections: q = k = v = the input split into heads (diffusion-style AttentionBlock core)."""

    def __init__(self, channels: int, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads

    def weight_scale(self, ch: int) -> float:
        return 1 / math.sqrt(math.sqrt(ch))  # applied to q and to k: 1 / sqrt(ch) overall

    def forward(self, x):
        b, n, c = x.shape
        ch = c // self.num_heads
        t = x.view(b, n, self.num_heads, ch).transpose(1, 2)  # (B, H, N, ch)
        scale = self.weight_scale(ch)
        w = torch.einsum("bhtc,bhsc->bhts", t * scale, t * scale).softmax(-1)
        return torch.einsum("bhts,bhsc->bhtc", w, t).transpose(1, 2).reshape(b, n, c)


class NoProjectionScaleByCh(NoProjection):
    """Bug: the scores are scaled by 1 / ch, not 1 / sqrt(ch)."""

    def weight_scale(self, ch: int) -> float:
        return 1 / math.sqrt(ch)


class MaskDroppedInHalf(Heads):
    """Bug: in float16/bfloat16 the (B, L) key mask (True = real token) is skipped ("a fast path")."""

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.dim_head)
        if mask is not None and s.dtype not in (torch.float16, torch.bfloat16):
            s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class _ScaledSoftmax(torch.autograd.Function):
    """softmax over the last dim with a hand-written backward that is 15% off."""

    @staticmethod
    def forward(ctx, s):
        p = torch.softmax(s, -1)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return 1.15 * p * (g - (g * p).sum(-1, keepdim=True))


class WrongBackward(Heads):
    """Bug: a custom autograd.Function for the softmax whose backward is scaled by 1.15."""

    def forward(self, x):
        q, k, v = self.split(x)
        return self.merge(_ScaledSoftmax.apply(q @ k.transpose(-2, -1) / math.sqrt(self.dim_head)) @ v)


class TwoMaskShapes(Heads):
    """Bug: takes an additive mask (B, 1, L, L) or (B, 1, 1, L); the key-only kind is put on the query axis."""

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = self.split(hidden_states)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.dim_head)
        if attention_mask is not None:
            if attention_mask.shape[-2] == 1:  # (B, 1, 1, L): "expand" it, transposed by mistake
                attention_mask = attention_mask.transpose(-1, -2).expand(-1, -1, -1, s.shape[-1])
            s = s + attention_mask
        return self.merge(s.softmax(-1) @ v)


class IgnoreNamedAttentionMask(Heads):
    """Correct, but its bool ``attention_mask`` is True = masked, the opposite of the HF convention (1 = attend)."""

    def forward(self, x, attention_mask=None):
        q, k, v = self.split(x)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.dim_head)
        if attention_mask is not None:
            s = s.masked_fill(attention_mask[:, None], float("-inf"))
        return self.merge(torch.softmax(s, -1).nan_to_num(0.0) @ v)


class Block(nn.Module):
    """A residual block: attention and an MLP; a --call that runs only ``block.attn`` leaves the MLP unused."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = QKNormAttention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class LayerNormHalfCrash(Heads):
    """Bug: a LayerNorm whose weight is cast to float32 while its input and bias stay in half precision
    (no -1e9 anywhere)."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__(dim, heads)
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.norm_bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        q, k, v = self.split(x)
        o = self.merge(F.scaled_dot_product_attention(q, k, v))
        return F.layer_norm(o, (o.shape[-1],), self.norm_weight.float(), self.norm_bias)

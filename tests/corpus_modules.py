"""Correct attention modules in the styles found in public code, each a case the doctor must certify.

Each class is loadable by the command line (``selfattn check tests/corpus_modules.py:WindowAttention``);
``tests/doctor_corpus.py`` holds, for each, the options the doctor needs. Every module here is
right; what makes each one a test is its design:

- :class:`WindowAttention`: Swin-style attention over one fixed 7x7 window (runs only at N = 49
  tokens), with a learned relative-position bias table and an optional additive per-window mask.
- :class:`PostNormEncoderBlock`: attention + residual + LayerNorm inside the module (post-norm).
- :class:`NoProjectionAttention`: no projections at all, q = k = v = per-head slices of x, the
  scale split over q and k (1/sqrt(sqrt(D)) each), einsum scores.
- :class:`QKNormAttention`: RMS-normalised q and k before the scores, SDPA with a bool mask.
- :class:`SlidingWindowCausalAttention`: causal with a built-in window of 4 keys, no mask argument.
- :class:`KVCacheAttention`: keys and values kept in a cache allocated for at most 32 batch rows.
- :class:`RequiredMaskAttention`: ``forward(x, mask)`` with a mask that must be given.
- :class:`Float64Attention`, :class:`BFloat16Attention`: parameters created in that dtype.

Shape legend: B batch, L length, E embed dim, H heads, D head dim, N tokens per window.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _heads(t: Tensor, h: int) -> Tensor:
    """(B, L, H * D) -> (B, H, L, D)."""
    b, length, _ = t.shape
    return t.view(b, length, h, -1).transpose(1, 2)


def _merge(t: Tensor) -> Tensor:
    """(B, H, L, D) -> (B, L, H * D)."""
    b, h, length, d = t.shape
    return t.transpose(1, 2).reshape(b, length, h * d)


class WindowAttention(nn.Module):
    """Swin-style window attention: relative-position bias table indexed by the token offsets in the window.

    Input (B * nW, N, E) with N = window_size[0] * window_size[1]; mask: None or additive (nW, N, N),
    0 = may attend (Swin's shifted-window mask), added per window.
    """

    def __init__(self, dim: int, window_size: tuple[int, int], num_heads: int) -> None:
        super().__init__()
        wh, ww = window_size
        self.window_size, self.num_heads = (wh, ww), num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * wh - 1) * (2 * ww - 1), num_heads) * 0.5)
        coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)  # (2, N)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)  # (N, N, 2)
        index = (rel[..., 0] + wh - 1) * (2 * ww - 1) + (rel[..., 1] + ww - 1)
        self.register_buffer("relative_position_index", index, persistent=False)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b_, n, c = x.shape
        if n != self.window_size[0] * self.window_size[1]:
            raise ValueError(f"expected {self.window_size[0] * self.window_size[1]} tokens per window, got {n}")
        q, k, v = self.qkv(x).reshape(b_, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = (q * self.scale) @ k.transpose(-2, -1)  # (B*nW, H, N, N)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = attn + bias.permute(2, 0, 1)[None]
        if mask is not None:
            nw = mask.shape[0]
            attn = attn.view(b_ // nw, nw, self.num_heads, n, n) + mask[None, :, None]
            attn = attn.view(-1, self.num_heads, n, n)
        attn = attn.softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b_, n, c))


class PostNormEncoderBlock(nn.Module):
    """Post-norm encoder self-attention sublayer: LayerNorm(x + attention(x)); padding_mask (B, L), True = padding."""

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        q, k, v = (_heads(t, self.num_heads) for t in self.in_proj(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if padding_mask is not None:
            scores = scores.masked_fill(padding_mask[:, None, None, :], float("-inf"))
        attended = self.out_proj(_merge(torch.softmax(scores, dim=-1) @ v))
        return self.norm(x + attended)


class NoProjectionAttention(nn.Module):
    """Attention with no projections: q = k = v = the heads' slices of x (the style of diffusion UNets' QKV
    attention); the scale 1/sqrt(D) is split as 1/sqrt(sqrt(D)) on q and on k."""

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads

    def forward(self, x: Tensor) -> Tensor:
        q = k = v = _heads(x, self.num_heads)
        ch = q.shape[-1]
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = torch.einsum("bhtc,bhsc->bhts", q * scale, k * scale)
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        return _merge(torch.einsum("bhts,bhsc->bhtc", weight, v))


class QKNormAttention(nn.Module):
    """q and k RMS-normalised per head before the scores (OLMo 2 / Qwen 3 style), SDPA; mask: bool (B, 1, L, L) or
    broadcastable, True = may attend."""

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        head_dim = embed_dim // num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(embed_dim, embed_dim, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(head_dim), nn.RMSNorm(head_dim)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        q = self.q_norm(_heads(self.q_proj(x), self.num_heads))
        k = self.k_norm(_heads(self.k_proj(x), self.num_heads))
        v = _heads(self.v_proj(x), self.num_heads)
        return self.o_proj(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)))


class SlidingWindowCausalAttention(nn.Module):
    """Causal attention where each query sees itself and the ``window - 1`` keys before it (Mistral-style local
    attention); takes no mask."""

    def __init__(self, embed_dim: int, num_heads: int = 4, window: int = 4) -> None:
        super().__init__()
        self.num_heads, self.window = num_heads, window
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        i = torch.arange(x.shape[1], device=x.device)
        visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)  # (L, L)
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=visible)))


class KVCacheAttention(nn.Module):
    """Causal attention with a key/value cache allocated for ``max_batch`` rows and ``max_len`` positions.

    ``forward(x, start_pos=0)`` attends from the L new tokens to the cached keys before ``start_pos``
    and to the new keys (causally), then stores the new keys and values at ``start_pos``.
    """

    def __init__(self, embed_dim: int, num_heads: int = 4, max_batch: int = 32, max_len: int = 128) -> None:
        super().__init__()
        self.num_heads = num_heads
        head_dim = embed_dim // num_heads
        self.wqkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.wo = nn.Linear(embed_dim, embed_dim, bias=False)
        shape = (max_batch, num_heads, max_len, head_dim)
        self.register_buffer("cache_k", torch.zeros(shape), persistent=False)
        self.register_buffer("cache_v", torch.zeros(shape), persistent=False)

    def forward(self, x: Tensor, start_pos: int = 0) -> Tensor:
        b, length, _ = x.shape
        q, k, v = (_heads(t, self.num_heads) for t in self.wqkv(x).chunk(3, dim=-1))
        keys = torch.cat([self.cache_k[:b, :, :start_pos], k], dim=2)  # (B, H, start + L, D)
        values = torch.cat([self.cache_v[:b, :, :start_pos], v], dim=2)
        self.cache_k[:b, :, start_pos:start_pos + length] = k.detach().to(self.cache_k.dtype)
        self.cache_v[:b, :, start_pos:start_pos + length] = v.detach().to(self.cache_v.dtype)
        i = torch.arange(length, device=x.device)[:, None] + start_pos
        visible = torch.arange(start_pos + length, device=x.device)[None, :] <= i  # (L, start + L)
        return self.wo(_merge(F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)))


class RequiredMaskAttention(nn.Module):
    """``forward(x, mask)``: the mask is required; (B, L) bool, True = real token (may be attended to)."""

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        q, k, v = (_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
        return self.out(_merge(scores.softmax(dim=-1) @ v))


class _TypedAttention(nn.Module):
    """Multi-head attention whose parameters are created in ``DTYPE``; mask: (B, L, L) bool, True = may attend."""

    DTYPE = torch.float32

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, dtype=self.DTYPE)
        self.out = nn.Linear(embed_dim, embed_dim, dtype=self.DTYPE)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        q, k, v = (_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        mask = None if mask is None else mask[:, None]
        return self.out(_merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


class Float64Attention(_TypedAttention):
    """:class:`_TypedAttention` in float64 (input must be float64)."""

    DTYPE = torch.float64


class BFloat16Attention(_TypedAttention):
    """:class:`_TypedAttention` in bfloat16 (input must be bfloat16)."""

    DTYPE = torch.bfloat16

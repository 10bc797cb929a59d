"""Attention modules with one bug each that only a probe which measures (not only runs) can name.

Each class docstring names the bug; ``tests/doctor_corpus.py`` gives the finding id each must get.
They are loadable by the command line (``selfattn check tests/corpus_buggy.py:MaskDroppedInHalf``).

Shape legend: B batch, L length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import math

import torch
from corpus_modules import _heads, _merge
from torch import Tensor, nn


class MaskDroppedInHalf(nn.Module):
    """The mask is applied in float32 only: a float16/bfloat16 copy ignores it (a "fast path" gone wrong).

    mask: (B, L, L) bool, True = may attend.
    """

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        q, k, v = (_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None and scores.dtype == torch.float32:  # bug: half precision skips the mask
            scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
        return self.out(_merge(scores.float().softmax(-1).to(v.dtype) @ v))


class _WeightsTimesValues(torch.autograd.Function):
    """weights @ v with a hand-written backward that is 15% off for both inputs (bug)."""

    @staticmethod
    def forward(ctx, w: Tensor, v: Tensor) -> Tensor:
        ctx.save_for_backward(w, v)
        return w @ v

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        w, v = ctx.saved_tensors
        return 0.85 * (grad @ v.transpose(-2, -1)), 0.85 * (w.transpose(-2, -1) @ grad)


class WrongBackward(nn.Module):
    """Correct forward; a custom autograd.Function for weights @ V whose backward is 15% too small."""

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        q, k, v = (_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
        return self.out(_merge(_WeightsTimesValues.apply(scores.softmax(-1), v)))


class PreNormWrongScale(nn.Module):
    """LayerNorm before the projections (the ViT package style) and the scale dim ** -0.5 (the model width)
    instead of dim_head ** -0.5, as once shipped in a popular ViT package."""

    def __init__(self, dim: int, heads: int = 4, dim_head: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.scale = dim ** -0.5  # bug: dim_head ** -0.5
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        q, k, v = (_heads(t, self.heads) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        return self.to_out(_merge(torch.matmul(dots.softmax(dim=-1), v)))


class NoProjectionScaleByCh(nn.Module):
    """No projections (q = k = v = the heads' slices of x) and the scale 1/ch instead of 1/sqrt(ch): the
    1/sqrt(ch) meant to be split over q and k is put on each of them."""

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads

    def forward(self, x: Tensor) -> Tensor:
        q = k = v = _heads(x, self.num_heads)
        ch = q.shape[-1]
        scale = 1 / math.sqrt(ch)  # bug: 1 / math.sqrt(math.sqrt(ch)) on each of q and k
        weight = torch.einsum("bhtc,bhsc->bhts", q * scale, k * scale)
        return _merge(torch.einsum("bhts,bhsc->bhtc", torch.softmax(weight, dim=-1), v))


class KeyMaskTransposed(nn.Module):
    """Accepts a bool mask (B, 1, L, L) or a key mask (B, 1, 1, L) (True = may attend), but transposes the key
    mask onto the query axis ((B, 1, L, 1)), so it hides queries instead of keys."""

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        q, k, v = (_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] != x.shape[1]:
                raise ValueError(f"mask must be (B, 1, L, L) or (B, 1, 1, L), got {tuple(mask.shape)}")
            if mask.shape[2] == 1:
                mask = mask.transpose(-1, -2)  # bug: a key mask becomes a query mask
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return self.out(_merge(scores.softmax(-1) @ v))

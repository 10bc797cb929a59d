"""What selfattn is measured against: the tutorial's textbook code, torch's own modules and kernels.

Shape legend: B batch, H heads, L length, D head dim, E embed dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn


class TextbookMultiHeadAttention(nn.Module):
    """The tutorial's MultiHeadAttention, as written there (fused qkv, explicit softmax, -1e9 fill)."""

    def __init__(self, embed_dim: int, num_heads: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, embed_dim * 3)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        b, length, _ = x.shape
        q, k, v = (t.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attn = self.dropout(torch.softmax(scores, dim=-1))
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().view(b, length, -1)
        return self.proj(out), attn


def textbook_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None) -> Tensor:
    """The tutorial's core math on (B, H, L, D): full scores, -1e9 fill, softmax, matmul."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if visible is not None:
        scores = scores.masked_fill(~visible, -1e9)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


@functools.cache
def compiled_flex() -> Callable[..., Tensor]:
    """torch.compile'd flex_attention (compiled once per process)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_block_mask(mask_mod: Callable | None, b: int, length: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, b, None, length, length, device=device)

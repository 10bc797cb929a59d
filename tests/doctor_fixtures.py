"""Attention modules with one known bug each, for the doctor's tests.

Each class docstring names the bug; BUGGY maps class -> (expected finding id, check() kwargs).
All take (embed_dim) and forward(x, mask=None) with the tutorial's keep convention (1 = attend),
unless noted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class _Base(nn.Module):
    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.query = nn.Linear(embed_dim, embed_dim)
        self.key = nn.Linear(embed_dim, embed_dim)
        self.value = nn.Linear(embed_dim, embed_dim)

    def qkv(self, x):
        return self.query(x), self.key(x), self.value(x)

    @staticmethod
    def masked(scores, mask):
        return scores if mask is None else scores.masked_fill(mask == 0, -1e9)


class WholeTranspose(_Base):
    """The question's bug 1: keys.T transposes the whole (B, L, E) tensor."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        scores = torch.matmul(q, k.permute(2, 1, 0)) / math.sqrt(self.embed_dim)  # what k.T does on 3-D
        scores = self.masked(scores, mask)
        return torch.matmul(torch.softmax(scores, dim=-1), v)


class MissingScale(_Base):
    """The question's bug 2: no 1/sqrt(d)."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        scores = q @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        return torch.softmax(scores, dim=-1) @ v


class SoftmaxNoDim(_Base):
    """The question's bug 3: softmax without dim (dim 0, the batch, for 3-D input)."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        scores = self.masked(q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim), mask)
        return torch.softmax(scores, dim=0) @ v


class ValuesTimesScores(_Base):
    """The question's bug 4: values @ scores instead of scores @ values."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        w = torch.softmax(self.masked(q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim), mask), dim=-1)
        return torch.matmul(v, w)


class ScaleByD(_Base):
    """Scores divided by d instead of sqrt(d)."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        return torch.softmax(self.masked(q @ k.transpose(-2, -1) / self.embed_dim, mask), dim=-1) @ v


class _MHA(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def heads(self, x):
        b, length, _ = x.shape
        return [t.view(b, length, self.num_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1)]


class MHAScaleByEmbedDim(_MHA):
    """Multi-head attention scaled by 1/sqrt(embed_dim) instead of 1/sqrt(head_dim)."""

    def forward(self, x, mask=None):
        b, length, e = x.shape
        q, k, v = self.heads(x)
        w = torch.softmax(_Base.masked(q @ k.transpose(-2, -1) / math.sqrt(e), mask), dim=-1)
        return self.proj((w @ v).transpose(1, 2).reshape(b, length, e))


class MHAViewMerge(_MHA):
    """Heads merged with view instead of transpose-then-view."""

    def forward(self, x, mask=None):
        b, length, e = x.shape
        q, k, v = self.heads(x)
        w = torch.softmax(_Base.masked(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), mask), dim=-1)
        return self.proj((w @ v).contiguous().view(b, length, e))


class MaskAfterSoftmax(_Base):
    """The mask zeroes weights after the softmax (rows no longer sum to 1)."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim), dim=-1)
        if mask is not None:
            w = w * mask
        return w @ v


class MaskInverted(_Base):
    """Documents 1 = attend, but masks where the mask is 1."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        if mask is not None:
            scores = scores.masked_fill(mask == 1, -1e9)
        return torch.softmax(scores, dim=-1) @ v


class _Causal(_Base):
    diagonal = 1  # triu(diagonal) is hidden

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        length = x.shape[1]
        hidden = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(self.diagonal)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)).masked_fill(hidden, -1e9)
        scores = self.masked(scores, mask)
        return torch.softmax(scores, dim=-1) @ v


class CausalCorrect(_Causal):
    """A correct causal module (passes; with --causal too)."""


class CausalHidesDiagonal(_Causal):
    """The causal mask hides the diagonal: a token cannot see itself (row 0 sees nothing)."""

    diagonal = 0


class CausalShowsNextToken(_Causal):
    """The causal mask shows one future token."""

    diagonal = 2


class FillOverflowsInHalf(_Base):
    """-1e9 kept as a buffer: .half() turns it into -inf, so fully masked rows become NaN in fp16."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__(embed_dim)
        self.register_buffer("fill", torch.tensor(-1e9), persistent=False)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        if mask is not None:
            scores = torch.where(mask.bool(), scores, self.fill)
        return torch.softmax(scores, dim=-1) @ v


class DropoutAlwaysOn(_Base):
    """Dropout applied with F.dropout's default training=True, so it stays on in eval."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        w = torch.softmax(self.masked(q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim), mask), dim=-1)
        return F.dropout(w, 0.1) @ v


class InfFillNaN(_Base):
    """Masked with -inf, so a fully masked row is NaN."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class DetachedValues(_Base):
    """Values detached: the value projection never learns."""

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        w = torch.softmax(self.masked(q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim), mask), dim=-1)
        return w @ v.detach()


BUGGY = {
    WholeTranspose: ("batch-mixing", {}),
    MissingScale: ("missing-scale", {}),
    SoftmaxNoDim: ("softmax-dim", {}),
    ValuesTimesScores: ("matmul-order", {}),
    ScaleByD: ("wrong-scale", {}),
    MHAScaleByEmbedDim: ("wrong-scale", {}),
    MHAViewMerge: ("head-merge", {}),
    MaskAfterSoftmax: ("mask-after-softmax", {}),
    MaskInverted: ("mask-inverted", {"mask_convention": "keep"}),
    CausalHidesDiagonal: ("causal-leak", {}),
    CausalShowsNextToken: ("causal-leak", {}),
    FillOverflowsInHalf: ("half-precision-overflow", {}),
    DropoutAlwaysOn: ("dropout-in-eval", {}),
    InfFillNaN: ("nan-on-masked-row", {}),
    DetachedValues: ("no-grad", {}),
}

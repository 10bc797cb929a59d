"""Attention modules with one known bug each, for the doctor's tests.

Each class docstring names the bug; BUGGY maps class -> (expected finding id, check() kwargs).
All take (embed_dim) and forward(x, mask=None) with the tutorial's keep convention (1 = attend),
unless noted, and fill masked scores with the dtype-safe torch.finfo(dtype).min (the tutorial's
-1e9 does not fit in float16), so that each carries exactly one bug.
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
        return scores if mask is None else scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)


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
            scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)
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
            scores = scores.masked_fill(mask == 1, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1) @ v


class _Causal(_Base):
    diagonal = 1  # triu(diagonal) is hidden

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x)
        length = x.shape[1]
        hidden = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(self.diagonal)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
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
    WholeTranspose: ("batch-mixing", {"embed_dim": 16}),  # runs only at B = L = E: probed at 16, not 64
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


# -- modules the white box must judge: wrong formulas with no black-box symptom, and position terms --
class _Heads(nn.Module):
    """Multi-head attention pieces: fused qkv, out proj, (B, H, L, D) helpers; mask: (B, L, L) bool keep."""

    def __init__(self, embed_dim: int, num_heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.max_len = max_len

    def split(self, x):
        b, length, _ = x.shape
        return [t.view(b, length, self.num_heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1)]

    def finish(self, w, v):
        b, _, length, _ = v.shape
        return self.proj((w @ v).transpose(1, 2).reshape(b, length, self.embed_dim))

    @staticmethod
    def masked(scores, mask):
        return scores if mask is None else scores.masked_fill(~mask.bool()[:, None], torch.finfo(scores.dtype).min)


class EinsumSwappedKV(_Heads):
    """Keys and values swapped in einsum form: softmax(Q V^T) K. With one fused projection this only relabels its
    columns (k|v read as v|k): no behaviour tells it from a correct module (CodeGen orders its fused projection
    q|v|k on purpose), so the doctor certifies it; with named projections the roles are checked."""

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        scores = self.masked(torch.einsum("bhid,bhjd->bhij", q, v) / math.sqrt(self.head_dim), mask)
        return self.finish(torch.softmax(scores, -1), k)


class PrecedenceScale(_Heads):
    """Scale written ``s * hd ** -1 / 2``: operator precedence makes it 1 / (2 hd)."""

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        scores = self.masked(q @ k.transpose(-2, -1) * self.head_dim ** -1 / 2, mask)
        return self.finish(torch.softmax(scores, -1), v)


class VisibleKeysScale(_Heads):
    """Each row divided by sqrt(number of visible keys) instead of sqrt(head_dim)."""

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        b, _, length, _ = q.shape
        visible = torch.full((b, 1, length, 1), float(length), dtype=q.dtype) if mask is None else \
            mask[:, None].sum(-1, True).to(q.dtype)
        scores = self.masked(q @ k.transpose(-2, -1) / visible.clamp(min=1).sqrt(), mask)
        return self.finish(torch.softmax(scores, -1), v)


class RelativeBias(_Heads):
    """Correct: a learned relative-position bias per head (T5/Swin style), added to the scores before softmax."""

    def __init__(self, embed_dim: int, num_heads: int = 4, max_len: int = 64) -> None:
        super().__init__(embed_dim, num_heads, max_len)
        self.rel = nn.Parameter(torch.randn(num_heads, 2 * max_len - 1))

    def bias(self, length):
        i = torch.arange(length)
        return self.rel[:, i[None, :] - i[:, None] + self.max_len - 1]  # (H, L, L)

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + self.bias(x.shape[1])
        return self.finish(torch.softmax(self.masked(scores, mask), -1), v)


class Alibi(_Heads):
    """Correct: ALiBi (bidirectional form), a fixed bias -slope_h * |i - j| added to the scores."""

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        i = torch.arange(x.shape[1])
        slopes = (2.0 ** (-8.0 * torch.arange(1, self.num_heads + 1) / self.num_heads)).to(q.dtype)
        distance = (i[None] - i[:, None]).abs()
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) - slopes[:, None, None] * distance
        return self.finish(torch.softmax(self.masked(scores, mask), -1), v)


class BiasAfterSoftmax(RelativeBias):
    """A relative-position term added to the weights after the softmax (rows no longer sum to 1)."""

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        w = torch.softmax(self.masked(q @ k.transpose(-2, -1) / math.sqrt(self.head_dim), mask), -1)
        return self.finish(w + 0.1 * self.bias(x.shape[1]), v)


class KeyPaddingMask(_Heads):
    """Correct, x-transformers style: forward(x, mask) with a (B, L) bool key mask, True = real token."""

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
        return self.finish(torch.softmax(scores, -1), v)


class HFStyleAdditive(_Heads):
    """Correct, Hugging Face style: forward(hidden_states, attention_mask) with an additive (B, 1, 1, L) mask;
    returns a tuple (output, weights)."""

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        q, k, v = self.split(hidden_states)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            scores = scores + attention_mask
        w = torch.softmax(scores, -1)
        return self.finish(w, v), w


WHITE_BOX_BUGS = {VisibleKeysScale: "definition-mismatch", BiasAfterSoftmax: "definition-mismatch"}

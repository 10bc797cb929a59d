"""Hypothesis strategies that build whole attention calls: shapes, dtypes, a layout per tensor,
masks of every kind and composition, bias, score modifiers, scale, causal alignment and grad flags.

Each tensor is built as a leaf in some storage layout plus a view function, so gradients are
taken with respect to the leaf and the oracle sees the same values.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st
from torch import Tensor

from selfattn import masks, scores
from selfattn.masks import Mask

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LAYOUTS = ["contiguous", "transposed", "from_blhd", "channels_last", "strided_last", "offset_slice",
           "expand_batch", "expand_heads", "fused_buffer"]


@dataclass
class Built:
    """A leaf tensor and the view of it that is passed to attention."""

    leaf: Tensor
    view: Callable[[Tensor], Tensor]
    layout: str

    def make(self, leaf: Tensor | None = None) -> Tensor:
        return self.view(self.leaf if leaf is None else leaf)


def build(shape: tuple[int, int, int, int], layout: str, dtype: torch.dtype, gen: torch.Generator,
          scale: float = 1.0, shift: float = 0.0) -> Built:
    """A (B, H, L, D) tensor in ``layout``; values ``shift + scale * N(0, 1)`` drawn in float64 then cast."""
    b, h, length, d = shape

    def leaf(*s: int) -> Tensor:
        return (torch.randn(*s, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)

    if layout == "transposed":  # stored (B, H, D, L): the last dim has stride L
        return Built(leaf(b, h, d, length), lambda x: x.transpose(-1, -2), layout)
    if layout == "from_blhd":  # a projection's (B, L, H, D) seen as (B, H, L, D)
        return Built(leaf(b, length, h, d), lambda x: x.transpose(1, 2), layout)
    if layout == "channels_last":  # (B, L, D, H).permute(0, 3, 1, 2): last-dim stride H
        return Built(leaf(b, length, d, h), lambda x: x.permute(0, 3, 1, 2), layout)
    if layout == "strided_last":  # every other element of the last dim
        return Built(leaf(b, h, length, 2 * d), lambda x: x[..., ::2], layout)
    if layout == "offset_slice":  # a slice with a storage offset
        return Built(leaf(b, h, length + 2, d + 3), lambda x: x[:, :, 1:length + 1, 2:d + 2], layout)
    if layout == "expand_batch":  # stride 0 over the batch
        return Built(leaf(1, h, length, d), lambda x: x.expand(b, h, length, d), layout)
    if layout == "expand_heads":  # stride 0 over the heads
        return Built(leaf(b, 1, length, d), lambda x: x.expand(b, h, length, d), layout)
    if layout == "fused_buffer":  # the middle third of a fused (B, L, 3 * H * D) projection
        return Built(leaf(b, length, 3 * h * d),
                     lambda x: x[..., h * d:2 * h * d].unflatten(-1, (h, d)).transpose(1, 2), layout)
    return Built(leaf(b, h, length, d), lambda x: x, "contiguous")


@st.composite
def mask_leaf(draw: st.DrawFn, b: int, h: int, lq: int, lk: int) -> Mask:
    kind = draw(st.sampled_from(["causal", "window", "padding", "document", "tensor", "ignore", "mask_mod",
                                 "packed"]))
    if kind == "causal":
        return masks.causal(draw(st.sampled_from(["top_left", "bottom_right"])))
    if kind == "window":
        return masks.sliding_window(draw(st.integers(0, lk + 1)), draw(st.integers(0, 4)))
    if kind == "padding":
        lengths = draw(st.lists(st.integers(0, lk + 1), min_size=b, max_size=b))
        return masks.padding(torch.tensor(lengths), queries=draw(st.booleans()))
    if kind == "document" and lq <= lk:
        ids = torch.tensor(sorted(draw(st.lists(st.integers(0, 4), min_size=lk, max_size=lk))))
        return masks.document(ids if draw(st.booleans()) else ids.expand(b, lk).clone())
    if kind == "packed":  # varlen sequences: Lq and Lk cut into as many parts, some of them empty
        n = draw(st.integers(1, 4))
        cu_q = draw(cu_seqlens(lq, n))
        cu_k = cu_q if lq == lk and draw(st.booleans()) else draw(cu_seqlens(lk, n))
        return masks.packed(cu_q, cu_k, left=draw(st.sampled_from([None, 0, 1, 5])),
                            right=draw(st.sampled_from([None, 0, 2])))
    if kind == "mask_mod":  # an opaque function: a formula, or a lookup into a hidden tensor
        if draw(st.booleans()):
            period, phase = draw(st.integers(2, 5)), draw(st.integers(0, 4))
            return masks.from_mask_mod(lambda bi, hi, q, kv: (q * 3 + kv * 7 + bi + hi + phase) % period != 0,
                                       batch=b, heads=h)
        t = draw(bool_tensor(b, h, lq, lk)).expand(b, h, lq, lk)
        return masks.from_mask_mod(lambda bi, hi, q, kv: t[bi, hi, q, kv], batch=b, heads=h)
    if kind == "ignore":  # nn.MultiheadAttention's polarity (True = hidden), read in place
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        form = draw(st.sampled_from(["key_padding", "attn_2d", "attn_3d"]))
        if form == "key_padding":
            return masks.from_torch_key_padding_mask(torch.rand(b, lk, generator=gen) < 0.3)
        shape = (lq, lk) if form == "attn_2d" else (b * h, lq, lk)
        return masks.from_torch_attn_mask(torch.rand(shape, generator=gen) > 0.6,
                                          num_heads=h if form == "attn_3d" else None)
    return masks.from_tensor(draw(bool_tensor(b, h, lq, lk)))


@st.composite
def cu_seqlens(draw: st.DrawFn, total: int, n: int) -> Tensor:
    """Cumulative lengths (n + 1,) of n sequences of ``total`` tokens in all (some sequences empty)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
    return torch.tensor([0, *cuts, total], dtype=draw(st.sampled_from([torch.int32, torch.int64])))


@st.composite
def bool_tensor(draw: st.DrawFn, b: int, h: int, lq: int, lk: int) -> Tensor:
    """A bool mask of a broadcastable shape, sometimes with whole rows, items or heads hidden."""
    shape = [draw(st.sampled_from([1, n])) for n in (b, h, lq, lk)]
    ndim = draw(st.integers(max(1, 4 - sum(s > 1 for s in shape[:2]) * 4), 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t = torch.rand(shape, generator=gen) < draw(st.sampled_from([0.2, 0.6, 0.95]))
    if draw(st.booleans()):
        t[..., draw(st.integers(0, shape[2] - 1)), :] = False  # a query row that sees nothing
    return t.reshape(shape[4 - ndim:]) if all(s == 1 for s in shape[:4 - ndim]) else t


@st.composite
def mask_tree(draw: st.DrawFn, b: int, h: int, lq: int, lk: int, depth: int = 2) -> Mask:
    if depth == 0 or draw(st.booleans()):
        return draw(mask_leaf(b, h, lq, lk))
    op = draw(st.sampled_from(["&", "|", "~"]))
    a = draw(mask_tree(b, h, lq, lk, depth - 1))
    if op == "~":
        return ~a
    c = draw(mask_tree(b, h, lq, lk, depth - 1))
    return a & c if op == "&" else a | c


def _tilt(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    """Additive, with inexact constants: its bias must be computed in the compute dtype to match."""
    return score + 0.05 * (i - j).to(score.dtype) - 0.1 * h.to(score.dtype)


def _square(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
    return score - 0.02 * score * score + 0.01 * b


def _t5(table: Tensor) -> scores.ScoreMod:
    """A learned T5-style table (9, Hq) read by a bucket of i - j."""
    return scores.custom(lambda s, b, h, i, j: s + table[(i - j).clamp(-4, 4) + 4, h], additive=True)


def _temperature(t: Tensor) -> scores.ScoreMod:
    """A learned per-head temperature exp(t[h]) on the scores (not additive)."""
    return scores.custom(lambda s, b, h, i, j: s * t[h].exp())


# a parameterised score term: its tensor's shape for Hq heads, and the modifier made from the tensor
TERMS: dict[str, tuple[Callable[[int], tuple[int, ...]], Callable[[Tensor], scores.ScoreMod]]] = {
    "t5": (lambda hq: (9, hq), _t5),
    "slopes": (lambda hq: (hq,), scores.alibi),
    "temperature": (lambda hq: (hq,), _temperature),
}


@dataclass
class Case:
    """One attention call, ready to build in any dtype."""

    b: int
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    dv: int
    dtype: torch.dtype
    layouts: dict[str, str]
    seed: int
    mask: Mask | Tensor | None = None
    causal: bool | str = False
    bias_shape: tuple[int, ...] | None = None
    bias_dtype: torch.dtype | None = None
    bias_layout: str = "contiguous"
    bias_grad: bool = False
    score_mod: scores.ScoreMod | None = None
    term: str | None = None  # a key of TERMS: the modifier is made from a tensor, which may want a gradient
    term_grad: bool = False
    scale: float | None = None
    grads: tuple[bool, bool, bool] = (False, False, False)
    return_lse: bool = False
    block_q: int | None = None
    block_k: int = 128
    extras: dict = field(default_factory=dict)

    def tensors(self) -> dict[str, Built]:
        gen = torch.Generator().manual_seed(self.seed)
        out = {n: build(s, self.layouts[n], self.dtype, gen) for n, s in (
            ("q", (self.b, self.hq, self.lq, self.d)), ("k", (self.b, self.hkv, self.lk, self.d)),
            ("v", (self.b, self.hkv, self.lk, self.dv)))}
        if self.bias_shape is not None:
            full = (1,) * (4 - len(self.bias_shape)) + self.bias_shape
            built = build(full, self.bias_layout, self.bias_dtype or self.dtype, gen, scale=2.0,
                          shift=self.extras.get("bias_shift", 0.0))
            n = len(self.bias_shape)
            out["bias"] = Built(built.leaf, lambda x, f=built.view, n=n: f(x).reshape(f(x).shape[4 - n:]),
                                built.layout)
        if self.term is not None:  # a parameter: float32 beside half inputs, as in mixed precision
            dtype = torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype
            values = torch.randn(TERMS[self.term][0](self.hq), generator=gen, dtype=torch.float64) * 0.5
            out["term"] = Built((values.abs() if self.term == "slopes" else values).to(dtype), lambda x: x,
                                "contiguous")
        return out

    def mod(self, term: Tensor | None) -> scores.ScoreMod | None:
        """The call's score modifier: made from ``term`` (the built tensor, in any dtype) for a
        parameterised one."""
        if self.term is None:
            return self.score_mod
        assert term is not None
        return TERMS[self.term][1](term)


@st.composite
def cases(draw: st.DrawFn, max_len: int = 40, dims: tuple[int, ...] = (1, 2, 3, 8, 16, 59, 64, 111, 128, 256),
          dtypes: tuple[torch.dtype, ...] = tuple(DTYPES)) -> Case:
    b, hkv, g = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3]))
    hq = hkv * g
    lq, lk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    d = draw(st.sampled_from(dims))
    dv = d if draw(st.booleans()) else draw(st.sampled_from(dims))
    dtype = draw(st.sampled_from(dtypes))
    layouts = {n: draw(st.sampled_from(LAYOUTS)) for n in "qkv"}
    case = Case(b=b, hq=hq, hkv=hkv, lq=lq, lk=lk, d=d, dv=dv, dtype=dtype, layouts=layouts,
                seed=draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["none", "mask", "tensor", "mask", "tree"]))
    if kind == "mask":
        case.mask = draw(mask_leaf(b, hq, lq, lk))
    elif kind == "tree":
        case.mask = draw(mask_tree(b, hq, lq, lk))
    elif kind == "tensor":
        case.mask = draw(bool_tensor(b, hq, lq, lk))
    case.causal = draw(st.sampled_from([False, False, "top_left", "bottom_right"] + ([True] if lq == lk else [])))
    if draw(st.booleans()):
        shape = tuple(draw(st.sampled_from([1, n])) for n in (b, hq, lq, lk))
        ndim = draw(st.integers(2, 4))
        case.bias_shape = shape[4 - ndim:] if all(s == 1 for s in shape[:4 - ndim]) else shape
        case.bias_dtype = draw(st.sampled_from([dtype, dtype, torch.float32]))
        case.bias_layout = draw(st.sampled_from(["contiguous", "transposed", "expand_batch", "offset_slice"]))
        case.bias_grad = draw(st.booleans())
        case.extras["bias_shift"] = draw(st.sampled_from([0.0, 0.0, 40.0]))  # large values show rounding
    mod = draw(st.sampled_from(["none", "none", "alibi", "softcap", "tilt", "square"]))
    case.score_mod = {
        "none": None,
        "alibi": scores.alibi(scores.alibi_slopes(hq)),
        "softcap": scores.softcap(draw(st.sampled_from([0.5, 3.0, 30.0]))),
        "tilt": scores.custom(_tilt, additive=True),
        "square": scores.custom(_square),
    }[mod]
    if case.score_mod is None and draw(st.integers(0, 3)) == 0:
        case.term = draw(st.sampled_from(sorted(TERMS)))
        case.term_grad = draw(st.booleans())
    case.scale = draw(st.sampled_from([None, None, 0.05, 1.0, 3.0]))
    case.grads = (draw(st.booleans()), draw(st.booleans()), draw(st.booleans()))
    case.return_lse = draw(st.booleans())
    case.block_q = draw(st.sampled_from([None, 1, 3, 8, 16]))
    case.block_k = draw(st.sampled_from([128, 1, 5, 8, 16]))
    return case

"""The block kernel: what every tiled path computes for one block of attention, in one place.

A block is query rows ``rows`` of batch items ``items`` against keys ``keys`` of one call
(:class:`Block`). For a block this module makes its terms from the call's mask, score modifier,
bias and dropout (:meth:`Problem.terms`), computes its output and logsumexp (:func:`forward`: torch's
fused CPU flash kernel, or plain math), its share of the gradients from the merged output and lse
of its rows (:func:`backward`), merges blocks of the same rows by their lse (:class:`Merge`) and
adds attention sinks (:func:`add_sinks`, :func:`sinks_grad`). The chunked backend's loops and the
distributed ring both compute with it; neither restates its arithmetic.

- **Merging keeps the precision of one softmax.** :class:`Merge` keeps the running lse of the
  merged blocks unrounded, as the largest block lse plus the log of a weight, and rescales the
  output by ratios of weights. Rescaling by ``exp(lse_b - logaddexp(...))`` at every merge (the
  textbook way) rounds the running lse each time, an error of ``eps * |lse|`` per merge that grows
  with the number of blocks and that the backward amplifies through ``rowsum(dO * O)``.
- **Dropout is a property of the call, not of a tiling** (:mod:`.dropout`): any block, of any
  size, from any caller (forward, backward, another rank) gets its part of the same pattern.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Lq/Lk lengths, R rows of a
block, C its keys, D/Dv head dims.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..._call import compute_dtype
from ...masks import Causal, Mask, positions
from ...scores import ScoreMod, apply_score_mod, score_mod_bias
from .._common import additive_mask, split_heads, unit_stride
from .dropout import Dropout

__all__ = [
    "Block",
    "Merge",
    "Problem",
    "Terms",
    "add_sinks",
    "backward",
    "forward",
    "fused_available",
    "fused_block",
    "fused_block_backward",
    "grad_buffers",
    "items_of",
    "lse_for_backward",
    "rowsum_dout_out",
    "sinks_grad",
]


@dataclass(frozen=True, slots=True)
class Block:
    """Query rows ``rows`` of batch items ``items`` against keys ``keys``, in the call's coordinates."""

    rows: range
    keys: range
    items: slice = field(default_factory=lambda: slice(None))  # every item


@dataclass(frozen=True)
class Terms:
    """What one block's scores are made of, besides q and k.

    Attributes:
        visible: bool (b|1, Hq|1, R, C), True = may attend; None = every key.
        bias: float, broadcastable to (b, Hq, R, C): the call's bias and an additive modifier's
            (computed in the compute dtype); None = none.
        mod_positions: (b, h, i, j) positions for a non-additive score modifier; None = none.
        keep: bool (b, Hq, R, C), the dropout keep-mask; None = no dropout.
        causal: top-left causal within the block, given to the fused kernel as its own flag
            (``visible`` is then None).
    """

    visible: Tensor | None = None
    bias: Tensor | None = None
    mod_positions: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
    keep: Tensor | None = None
    causal: bool = False

    def additive_mask(self, dtype: torch.dtype) -> Tensor | None:
        """visible and bias as one additive float mask in ``dtype`` (-inf = hidden), as the fused kernel takes them."""
        return additive_mask(self.visible, self.bias, dtype)


def items_of(t: Tensor | None, items: slice) -> Tensor | None:
    """The batch items of a tensor that may broadcast over the batch (size 1)."""
    return t if t is None or t.shape[0] == 1 else t[items]


@dataclass(frozen=True)
class Problem:
    """One attention call as its blocks see it: what every block of the call shares.

    Attributes:
        scale: multiplier of the scores.
        lq, lk: the call's lengths (masks and modifiers read positions of the whole call).
        batch, heads: B and Hq of the whole call (dropout tiles are drawn for all of them).
        compute_dtype: where softmax accumulates (float32, or float64 for float64 inputs).
        mask, score_mod, dropout: None where the call has none.
    """

    scale: float
    lq: int
    lk: int
    batch: int
    heads: int
    compute_dtype: torch.dtype
    mask: Mask | None = None
    score_mod: ScoreMod | None = None
    dropout: Dropout | None = None
    learned: tuple[Tensor, ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, q: Tensor, k: Tensor, *, scale: float, mask: Mask | None = None, score_mod: ScoreMod | None = None,
           dropout_p: float = 0.0, seed: int = 0, lengths: tuple[int, int] | None = None,
           learned: tuple[Tensor, ...] = ()) -> Problem:
        """The problem of a call with q (B, Hq, Lq, D) and k (B, Hkv, Lk, D), or of a larger call of
        ``lengths`` (Lq, Lk) that they are part of; dropout drawn from ``seed``. ``learned``: the
        tensors the modifier's scores depend on that want a gradient
        (:func:`selfattn.scores.learned_tensors`); the math kernel's backward gives theirs."""
        b, hq, lq, _ = q.shape
        lq, lk = (lq, k.shape[2]) if lengths is None else lengths
        return cls(scale=scale, lq=lq, lk=lk, batch=b, heads=hq, compute_dtype=compute_dtype(q.dtype),
                   mask=mask, score_mod=score_mod, dropout=Dropout(dropout_p, seed) if dropout_p > 0 else None,
                   learned=learned)

    @property
    def additive_mod(self) -> bool:
        """Whether the score modifier is a bias folded into each block's bias (an additive one with
        nothing learned: a learned one is applied to the scores, so that autograd reaches its tensors)."""
        return self.score_mod is not None and self.score_mod.additive and not self.learned

    def positions(self, block: Block, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(b, h, i, j) of a block, broadcastable, for score modifiers."""
        items = torch.arange(self.batch)[block.items]
        return positions(items, self.heads, block.rows.start, block.rows.stop, block.keys.start, block.keys.stop,
                         self.lq, self.lk, device)

    def visible(self, block: Block, device: torch.device) -> Tensor | None:
        """The mask's block for the block's items, (b|1, H'|1, R, C); None without a mask."""
        if self.mask is None:
            return None
        rows, keys = block.rows, block.keys
        return items_of(self.mask.block(rows.start, rows.stop, keys.start, keys.stop, self.lq, self.lk, device),
                      block.items)

    def is_diagonal_causal(self, block: Block) -> bool:
        """Whether the block is a square on the diagonal of a mask that is causal alone (exact type,
        see ``Mask.shift_invariant``): then it is the fused kernel's own top-left causal."""
        m = self.mask
        return (type(m) is Causal and block.keys.start == block.rows.start + m.offset(self.lq, self.lk)
                and len(block.keys) == len(block.rows))

    def keep(self, block: Block, device: torch.device) -> Tensor | None:
        """The dropout keep-mask of a block, (b, Hq, R, C), from the call's grid; None without dropout."""
        if self.dropout is None:
            return None
        keep = self.dropout.keep(block.rows, block.keys, (self.batch, self.heads), device)
        return keep[block.items]

    def terms(self, block: Block, device: torch.device, *, partial: bool = True, bias: Tensor | None = None,
              kernel_causal: bool = False) -> Terms:
        """The terms of a block: the mask only where ``partial`` (a block the tile map calls fully
        visible needs none), the call's ``bias`` (B|1, Hq|1, Lq|1, Lk|1) sliced to the block plus an
        additive modifier's bias, a non-additive modifier's positions, the dropout keep-mask. With
        ``kernel_causal``, a diagonal square of a causal mask alone becomes ``causal=True``."""
        rows, keys = block.rows, block.keys
        if bias is not None:
            bias = items_of(bias[:, :, slice(None) if bias.shape[2] == 1 else slice(rows.start, rows.stop),
                               slice(None) if bias.shape[3] == 1 else slice(keys.start, keys.stop)], block.items)
        mod_positions = None
        if self.score_mod is not None:
            idx = self.positions(block, device)
            if self.additive_mod:  # folded into the block's bias, in the compute dtype
                mod_bias = score_mod_bias(self.score_mod, idx, self.compute_dtype)
                bias = mod_bias if bias is None else bias.to(mod_bias.dtype) + mod_bias
            else:
                mod_positions = idx
        visible, causal = None, False
        if partial and self.mask is not None:
            if kernel_causal and self.is_diagonal_causal(block):
                causal = True
            else:
                visible = self.visible(block, device)
        return Terms(visible=visible, bias=bias, mod_positions=mod_positions, keep=self.keep(block, device),
                     causal=causal)


# ----------------------------------------------------------------------------- the fused kernel


def fused_op() -> Callable[..., tuple[Tensor, ...]] | None:
    """torch's fused CPU flash attention, which returns lse (None where this torch lacks it)."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fused_bwd_op() -> Callable[..., tuple[Tensor, Tensor, Tensor]] | None:
    """Its backward, which takes the global out and lse of the rows."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def fused_available(device: torch.device, head_dim: int, v_head_dim: int) -> bool:
    """Whether the fused kernel runs here: on the CPU, with v's head dim equal to q's."""
    return device.type == "cpu" and head_dim == v_head_dim and fused_op() is not None and fused_bwd_op() is not None


def dead_rows(attn_mask: Tensor) -> Tensor:
    """Rows of an additive mask that see no key: bool, the mask's shape without its last dim."""
    return ~(attn_mask != float("-inf")).any(-1)


def fused_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, attn_mask: Tensor | None = None,
                  causal: bool = False, dead: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One call of the fused kernel on (N, Hq, R, D) queries against (N, Hkv, C, D) keys (strided
    views with unit-stride last dims): out (N, Hq, R, Dv) in q's dtype and lse (N, Hq, R), -inf on
    rows that see no key (``dead``, made from ``attn_mask`` when not given; the kernel itself
    leaves them finite)."""
    out, lse = fused_op()(q, k, v, 0.0, causal, attn_mask=attn_mask, scale=scale)[:2]  # type: ignore[misc]
    if attn_mask is not None:
        lse = lse.masked_fill(dead_rows(attn_mask) if dead is None else dead, float("-inf"))
    return out, lse


def fused_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, scale: float,
                   attn_mask: Tensor | None = None, causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The fused kernel's gradients of one call from the merged out and lse of its rows (lse from
    :func:`lse_for_backward`): dq, dk, dv, this call's share."""
    return fused_bwd_op()(dout, q, k, v, out, lse, 0.0, causal, attn_mask=attn_mask, scale=scale)  # type: ignore[misc]


def fused_block(q: Tensor, k: Tensor, v: Tensor, *, scale: float, visible: Tensor | None = None,
                bias: Tensor | None = None, causal: bool = False) -> tuple[Tensor, Tensor]:
    """One block of attention in the fused kernel: queries ``q`` against keys ``k``/``v`` only.

    For callers that merge blocks themselves (context parallelism): merge the pieces of a call with
    :class:`Merge` (exact to the float32 rule at any number of blocks), and give
    :func:`fused_block_backward` the merged (global) out and lse.

    Args:
        q: (B, Hq, R, D); k: (B, Hkv, C, D); v: (B, Hkv, C, D), Hq % Hkv == 0, unit-stride last dims
            not required. Check :func:`fused_available` first.
        scale: multiplier of the scores.
        visible: bool, broadcastable to (B, Hq, R, C), True = may attend; None = every key.
        bias: float, broadcastable to (B, Hq, R, C), added in q's dtype (the kernel's).
        causal: top-left causal within the block (R == C on the diagonal).

    Returns:
        out (B, Hq, R, D) and lse (B, Hq, R), -inf (and out 0) on rows that see no key of this block.
    """
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    return fused_forward(q, k, v, scale=scale, attn_mask=additive_mask(visible, bias, q.dtype), causal=causal)


def fused_block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, scale: float,
                         visible: Tensor | None = None, bias: Tensor | None = None,
                         causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of one block from the merged (global) out and lse of its query rows.

    Args:
        dout, out: (B, Hq, R, D), the gradient and the merged output of these rows.
        lse: (B, Hq, R), their merged logsumexp; +inf on rows that see no key at all (their
            probabilities are then 0; :func:`lse_for_backward` makes it).
        q, k, v, scale, visible, bias, causal: as given to :func:`fused_block`.

    Returns:
        dq (B, Hq, R, D), dk (B, Hkv, C, D), dv (B, Hkv, C, D): this block's share.
    """
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    return fused_backward(dout, q, k, v, out, lse, scale=scale, attn_mask=additive_mask(visible, bias, q.dtype),
                          causal=causal)


# ----------------------------------------------------------------------------- plain math


def _scores(problem: Problem, q: Tensor, k: Tensor, terms: Terms, hkv: int, g: int,
            grad: bool = False) -> tuple[Tensor, Tensor]:
    """(raw, scores) of a block in the compute dtype, (b, Hkv, G, R, C): raw = q k^T * scale + bias;
    scores adds a non-additive modifier (differentiable from raw when ``grad``) and the mask (-inf)."""
    raw = torch.matmul(q, k.transpose(-1, -2)) * problem.scale
    if terms.bias is not None:
        raw = raw + split_heads(terms.bias.to(raw.dtype), hkv, g)
    if grad:
        raw = raw.detach().requires_grad_(True)
    with torch.enable_grad() if grad else contextlib.nullcontext():
        s = raw
        if terms.mod_positions is not None and problem.score_mod is not None:
            b, _, _, r, c = s.shape
            s = apply_score_mod(problem.score_mod, s.reshape(b, hkv * g, r, c), terms.mod_positions).reshape(s.shape)
        if terms.visible is not None:
            s = s.masked_fill(~split_heads(terms.visible, hkv, g), float("-inf"))
    return raw, s


def _math_forward(problem: Problem, q: Tensor, k: Tensor, v: Tensor, terms: Terms) -> tuple[Tensor, Tensor]:
    b, hq, r, _ = q.shape
    hkv, g = k.shape[1], hq // k.shape[1]
    ct = problem.compute_dtype
    _, s = _scores(problem, split_heads(q.to(ct), hkv, g), k.to(ct).unsqueeze(2), terms, hkv, g)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    lsum = p.sum(-1, keepdim=True)
    if terms.keep is not None and problem.dropout is not None:
        p = p * split_heads(terms.keep, hkv, g) / (1.0 - problem.dropout.p)
    o = torch.matmul(p, v.to(ct).unsqueeze(2)) / torch.where(lsum > 0, lsum, torch.ones_like(lsum))
    lse = (m + torch.log(lsum)).squeeze(-1)
    return o.reshape(b, hq, r, -1), lse.reshape(b, hq, r)


def _probabilities(problem: Problem, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor,
                   terms: Terms) -> tuple[Tensor, ...]:
    """A block's backward inputs in the compute dtype, heads split (b, Hkv, G, ...): q5, k5, do5, the
    raw scores and the scores (differentiable from raw for a non-additive modifier), the probabilities p,
    p after dropout, and dP (after dropout)."""
    hkv, g = k.shape[1], q.shape[1] // k.shape[1]
    ct = problem.compute_dtype
    q5 = split_heads(q.to(ct), hkv, g)  # (b, Hkv, G, R, D)
    k5, v5 = k.to(ct).unsqueeze(2), v.to(ct).unsqueeze(2)  # (b, Hkv, 1, C, D|Dv)
    do5 = split_heads(dout.to(ct), hkv, g)  # (b, Hkv, G, R, Dv)
    grad_mod = terms.mod_positions is not None  # a non-additive modifier's derivative comes from autograd
    raw, s = _scores(problem, q5, k5, terms, hkv, g, grad=grad_mod)
    p = torch.exp(s.detach() - split_heads(lse.to(ct), hkv, g).unsqueeze(-1))  # probabilities (b, Hkv, G, R, C)
    dp = torch.matmul(do5, v5.transpose(-1, -2))
    pd = p
    if terms.keep is not None and problem.dropout is not None:
        kept = split_heads(terms.keep, hkv, g).to(ct) / (1.0 - problem.dropout.p)
        pd, dp = p * kept, dp * kept
    return q5, k5, do5, raw, s, p, pd, dp


def math_delta(problem: Problem, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor,
               terms: Terms) -> Tensor:
    """A block's share of rowsum(P * dP), (b, Hq, R) in the compute dtype: summed over a row's blocks it
    is the term dS subtracts, rowsum(dO * O) in exact arithmetic. Computed from the same dP that dS is, it
    leaves dS no trace of out's rounding: what a bias's gradient, which is dS itself, needs."""
    b, hq, r, _ = q.shape
    p, dp = _probabilities(problem, q, k, v, dout, lse, terms)[5::2]
    return (p * dp).sum(-1).reshape(b, hq, r)


def math_backward(problem: Problem, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor,
                  terms: Terms) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor | None, ...]]:
    """The math kernel's backward of one block, as :func:`backward`'s, and also the gradient of the
    block's raw scores q k^T * scale + bias, dS (b, Hq, R, C) in the compute dtype (a bias's gradient is
    its sum over the bias's broadcast dims), and the block's share of the gradient of each of
    ``problem.learned`` (None where the block's scores do not depend on it)."""
    b, hq, r, _ = q.shape
    hkv, g = k.shape[1], hq // k.shape[1]
    q5, k5, do5, raw, s, p, pd, dp = _probabilities(problem, q, k, v, dout, lse, terms)
    ds = p * (dp - split_heads(delta.to(problem.compute_dtype), hkv, g).unsqueeze(-1))
    grad_mod = terms.mod_positions is not None
    learned: tuple[Tensor | None, ...] = ()
    if grad_mod:
        # the modifier's derivative, and its learned tensors' gradients, from autograd over this block;
        # the graph is kept, since a learned tensor may be reached through the caller's own graph
        ds, *rest = torch.autograd.grad(s, (raw, *problem.learned), ds, allow_unused=True,
                                        retain_graph=bool(problem.learned))
        learned = tuple(rest)
    dq = torch.matmul(ds, k5) * problem.scale  # (b, Hkv, G, R, D)
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * problem.scale  # (b, Hkv, C, D)
    dv = torch.matmul(pd.transpose(-1, -2), do5).sum(2)  # (b, Hkv, C, Dv)
    return dq.reshape(b, hq, r, -1), dk, dv, ds.reshape(b, hq, r, -1), learned


# ----------------------------------------------------------------------------- one block, either kernel


def forward(problem: Problem, q: Tensor, k: Tensor, v: Tensor, terms: Terms, *, fused: bool) -> tuple[Tensor, Tensor]:
    """Output and lse of one block: q (b, Hq, R, D) against k (b, Hkv, C, D), v (b, Hkv, C, Dv).

    Returns out (b, Hq, R, Dv) (q's dtype fused, the compute dtype in math) and lse (b, Hq, R), -inf
    (with out 0) on rows that see no key of the block. The fused kernel takes no modifier other than
    a bias and no dropout (the caller checks)."""
    if fused:
        q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
        return fused_forward(q, k, v, scale=problem.scale, attn_mask=terms.additive_mask(q.dtype), causal=terms.causal)
    return _math_forward(problem, q, k, v, terms)


def backward(problem: Problem, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, lse: Tensor,
             terms: Terms, *, fused: bool, delta: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of dq (b, Hq, R, D), dk (b, Hkv, C, D) and dv (b, Hkv, C, Dv) from the merged
    ``out`` and ``lse`` of its rows (lse from :func:`lse_for_backward`) and their gradient ``dout``.
    ``delta`` = rowsum(dout * out) in the compute dtype, when the caller has it already."""
    if fused:
        q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
        return fused_backward(dout, q, k, v, out, lse, scale=problem.scale, attn_mask=terms.additive_mask(q.dtype),
                              causal=terms.causal)
    if delta is None:
        delta = rowsum_dout_out(dout, out, problem.compute_dtype)
    return math_backward(problem, q, k, v, dout, lse, delta, terms)[:3]


def rowsum_dout_out(dout: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """rowsum(dO * O) in ``dtype``: (..., R), the term every row's dS subtracts."""
    return (dout.to(dtype) * out.to(dtype)).sum(-1)


def lse_for_backward(lse: Tensor) -> Tensor:
    """lse with +inf on rows that see no key, so that every probability exp(s - lse) is exactly 0 there."""
    return lse.masked_fill(torch.isneginf(lse), float("inf"))


def grad_buffers(q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Zeroed dq, dk, dv accumulators in ``dtype``, of q's, k's and v's shapes."""
    return tuple(torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v))  # type: ignore[return-value]


# ----------------------------------------------------------------------------- merging blocks


@dataclass(frozen=True)
class Merge:
    """Partial results of the same query rows, merged by their lse without rounding the lse.

    ``acc`` holds the rows' output over the blocks merged so far (normalised), and their lse is kept
    as two exact parts, ``top`` (the largest block lse so far, which is one block's own lse, never a
    rounded sum) and ``weight`` (``sum_b exp(lse_b - top)``, at least 1). A merge rescales ``acc`` by
    ratios of those weights. The textbook merge, rescaling by ``exp(lse_b - logaddexp(...))`` with
    the running lse rounded at every merge, errs by ``eps * |lse|`` per merge, so its error grows
    with the number of blocks (and the backward amplifies it through ``rowsum(dO * O)``). Where
    ``top`` is -inf (no block has reached a row yet) ``acc`` is 0 and ``weight`` 1. A row that one
    block has reached holds that block's (out, lse) with weight 1, so a caller may copy a first block
    in. The tensors are updated in place (they may be views into larger accumulators).

    Attributes:
        acc: (..., R, Dv) in the compute dtype. top, weight: (..., R) in the compute dtype.

    Example:
        >>> merged = Merge.empty((B, H, R), Dv, torch.float32, q.device)
        >>> for k_b, v_b in blocks:
        ...     merged.add(*chunked.fused_block(q, k_b, v_b, scale=s))
        >>> out, lse = merged.result(q.dtype)
    """

    acc: Tensor
    top: Tensor
    weight: Tensor

    @classmethod
    def empty(cls, rows: tuple[int, ...], dv: int, dtype: torch.dtype, device: torch.device | str) -> Merge:
        """No block yet for rows of shape ``rows`` (e.g. (B, H, R)) with values of ``dv`` features."""
        return cls(torch.zeros(*rows, dv, dtype=dtype, device=device),
                   torch.full(rows, float("-inf"), dtype=dtype, device=device),
                   torch.ones(rows, dtype=dtype, device=device))

    def part(self, view: Callable[[Tensor], Tensor]) -> Merge:
        """The same rows of each tensor, through ``view`` (a view, so updates reach this merge)."""
        return Merge(view(self.acc), view(self.top), view(self.weight))

    def add(self, out: Tensor, lse: Tensor) -> None:
        """Merge one more block's result (out, lse) of these rows; rows with lse -inf carry no weight."""
        top = torch.maximum(self.top, lse)
        base = torch.nan_to_num(top, neginf=0.0)  # rows no block reached: weight 0 on both sides
        old = (self.top - base).exp_().mul_(self.weight)  # the weight so far, relative to the new top
        new = (lse - base).exp_()
        total = old + new
        inv = total.clamp(min=torch.finfo(total.dtype).tiny).reciprocal_()  # 0 + 0: both factors stay 0
        self.acc.mul_((old * inv).unsqueeze(-1)).addcmul_(out.to(self.acc.dtype), (new * inv).unsqueeze(-1))
        self.weight.copy_(total)
        self.top.copy_(top)

    def result(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """(out, lse): out in ``dtype`` (default the accumulator's; ``acc`` itself then), 0 on rows no
        block reached; lse = top + log(weight) in the compute dtype, -inf there. It ends the merge:
        the lse is computed in ``weight``'s memory."""
        out = self.acc if dtype in (None, self.acc.dtype) else self.acc.to(dtype)
        return out, self.weight.log_().add_(self.top)


# ----------------------------------------------------------------------------- sinks


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Let each head's sink logit join the softmax of rows already computed without it.

    The sink adds exp(sink) to the denominator and nothing to the numerator, so the output is
    rescaled by exp(lse - lse'), lse' = logaddexp(lse, sink); a row that saw no key keeps output 0.

    Args:
        out: (B, Hq, L, Dv); lse: (B, Hq, L), -inf on rows that see no key; sinks: (Hq,).

    Returns:
        (out', lse') in out's and lse's dtypes; lse' is -inf only where a row sees no key and its sink is -inf.
    """
    ct = lse.dtype
    total = torch.logaddexp(lse, sinks.to(ct).view(1, -1, 1))
    share = torch.exp(lse - total.masked_fill(torch.isneginf(total), 0.0))  # no key and a -inf sink: 0
    return (out.to(ct) * share.unsqueeze(-1)).to(out.dtype), total


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sinks from the final (sink-included) out and lse: the sink's probability
    p = exp(sink - lse) times -rowsum(dout * out), summed over batch and rows: (Hq,)."""
    delta = rowsum_dout_out(dout, out, lse.dtype)  # (B, Hq, L)
    p_sink = torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse.masked_fill(torch.isneginf(lse), 0.0))
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)

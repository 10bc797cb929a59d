"""The float64 oracle: the textbook math ``softmax(q k^T * scale + bias, score_mod, masked) @ v``, written
independently of every selfattn backend. :mod:`selfattn.testing` is its public home (``reference_attention``,
``reference_lse``, ``reference_mask``); it lives apart so that checkers :mod:`selfattn.testing` exposes can
read it without importing :mod:`selfattn.testing` back.

Shape legend: B batch, Hq query heads, Hkv key/value heads (Hq % Hkv == 0), Lq/Lk query/key lengths, D head dim
of q and k, Dv head dim of v.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from .masks import Mask

__all__ = ["Causal", "ScoreFn", "reference_attention", "reference_lse", "reference_mask"]

Causal = bool | Literal["top_left", "bottom_right"]
ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def reference_mask(lq: int, lk: int, *, mask: Mask | Tensor | None = None, causal: Causal = False,
                   device: torch.device | str | None = None) -> Tensor | None:
    """The (query, key) pairs that may attend, as one dense bool tensor.

    Args:
        lq: number of queries Lq.
        lk: number of keys Lk.
        mask: a :class:`selfattn.masks.Mask`, a bool tensor broadcastable to (B, Hq, Lq, Lk)
            (True = may attend), or None (every key visible).
        causal: False, True (top-left, needs Lq == Lk), ``"top_left"`` (query i sees keys j <= i)
            or ``"bottom_right"`` (query i sees keys j <= i + Lk - Lq, as in decoding).
        device: where to build it (default: the mask's device, else the CPU).

    Returns:
        A bool tensor broadcastable to (B, Hq, Lq, Lk), or None when nothing is hidden.

    Example:
        >>> reference_mask(2, 4, causal="bottom_right")[0, 0].int()
        tensor([[1, 1, 1, 0],
                [1, 1, 1, 1]], dtype=torch.int32)
    """
    if causal is True and lq != lk:
        raise ValueError(f"causal=True needs Lq == Lk, got Lq={lq}, Lk={lk}; pass 'top_left' or 'bottom_right'")
    if causal not in (False, True, "top_left", "bottom_right"):
        raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")
    visible: Tensor | None
    if mask is None:
        visible = None
    elif isinstance(mask, Mask):
        visible = mask.dense(lq, lk, device)
    elif isinstance(mask, Tensor) and mask.dtype == torch.bool:
        visible = mask if device is None else mask.to(device)
    else:
        raise TypeError(f"mask must be None, a selfattn.masks.Mask or a bool tensor, got {mask!r:.80}")
    if visible is not None:
        visible = visible.reshape((1,) * (4 - visible.dim()) + tuple(visible.shape))
    if causal is not False:
        where = device if visible is None else visible.device
        shift = lk - lq if causal == "bottom_right" else 0
        i = torch.arange(lq, device=where).view(-1, 1) + shift  # the query's position in key coordinates
        j = torch.arange(lk, device=where).view(1, -1)
        below = (j <= i).view(1, 1, lq, lk)
        visible = below if visible is None else visible & below
    return visible


def _masked_scores(q: Tensor, k: Tensor, mask: Mask | Tensor | None, bias: Tensor | None, causal: Causal,
                   scale: float | None, score_mod: ScoreFn | None, dtype: torch.dtype | None) -> Tensor:
    """Scores (B, Hq, Lq, Lk) in ``dtype`` (None: q's), -inf where the mask hides a key."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D (B, H, L, D), got q {tuple(q.shape)}, k {tuple(k.shape)}")
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"q has {hq} heads and k has {hkv}; Hq must be a multiple of Hkv")
    naive = dtype is None
    dtype = q.dtype if naive else dtype
    q, k = q.to(dtype), k.to(dtype).repeat_interleave(hq // hkv, dim=1)  # GQA: each kv head serves Hq/Hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        if naive:  # torch's type promotion, up to the compute dtype: a float32 bias on half inputs stays float32
            wide = torch.promote_types(s.dtype, bias.dtype)
            s = s.to(torch.float32 if wide == torch.float64 and s.dtype != torch.float64 else wide)
        s = s + bias.to(s.dtype)
    if score_mod is not None:
        bi = torch.arange(b, device=s.device).view(-1, 1, 1, 1)
        hi = torch.arange(hq, device=s.device).view(1, -1, 1, 1)
        i = (torch.arange(lq, device=s.device) + lk - lq).view(1, 1, -1, 1)  # key coordinates, bottom-right
        j = torch.arange(lk, device=s.device).view(1, 1, 1, -1)
        s = score_mod(s, bi, hi, i, j)
    visible = reference_mask(lq, lk, mask=mask, causal=causal, device=s.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None,
                        bias: Tensor | None = None, causal: Causal = False, scale: float | None = None,
                        score_mod: ScoreFn | None = None, safe: bool = True,
                        dtype: torch.dtype | None = torch.float64, sinks: Tensor | None = None) -> Tensor:
    """Textbook attention, the oracle: ``softmax(mask(score_mod(q k^T * scale + bias))) @ v``.

    Written for clarity, not speed: it builds the whole (B, Hq, Lq, Lk) score matrix and repeats
    K/V for grouped-query attention. It is differentiable, so gradients can be checked too.

    Args:
        q: queries (B, Hq, Lq, D).
        k: keys (B, Hkv, Lk, D).
        v: values (B, Hkv, Lk, Dv).
        mask: a :class:`selfattn.masks.Mask`, a bool tensor broadcastable to (B, Hq, Lq, Lk)
            (True = may attend), or None.
        bias: float tensor broadcastable to (B, Hq, Lq, Lk), added to the scaled scores.
        causal: False, True (top-left, needs Lq == Lk), ``"top_left"`` or ``"bottom_right"``, as
            :func:`selfattn.attention` means it.
        scale: multiplies q k^T; None for 1/sqrt(D).
        score_mod: a :mod:`selfattn.scores` modifier or a function ``(score, b, h, i, j) -> score``
            applied to the scores after bias, before masking; b, h, i, j are broadcastable int
            index tensors, i the query's position in key coordinates (row + Lk - Lq), j the key's.
        safe: True gives 0 for a row that sees no key; False is the naive math (NaN there).
        dtype: the dtype to compute in, float64 by default; None computes in q's own dtype (the
            "naive same-dtype" math that :func:`tolerance` measures an implementation against), with
            torch's type promotion for a wider bias up to float32 (the compute dtype).
        sinks: (Hq,) logits, one per query head, that join each row's softmax with no value.

    Returns:
        The output (B, Hq, Lq, Dv) in ``dtype`` (q's dtype when ``dtype`` is None).

    Example:
        >>> ref = reference_attention(q, k, v, causal=True)                 # float64
        >>> naive = reference_attention(q, k, v, causal=True, dtype=None, safe=False)
    """
    s = _with_sinks(_masked_scores(q, k, mask, bias, causal, scale, score_mod, dtype), sinks)
    out_dtype = q.dtype if dtype is None else dtype
    v = v.to(out_dtype).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if sinks is not None:  # the sink column has no value: drop its weight
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[3])], dim=2)
    if not safe:
        return torch.softmax(s, dim=-1).to(out_dtype) @ v
    alive = torch.isfinite(s).any(-1, keepdim=True)
    s = torch.where(alive, s, torch.zeros_like(s))
    return (torch.softmax(s, dim=-1) * alive).to(out_dtype) @ v


def reference_lse(q: Tensor, k: Tensor, *, mask: Mask | Tensor | None = None, bias: Tensor | None = None,
                  causal: Causal = False, scale: float | None = None, score_mod: ScoreFn | None = None,
                  dtype: torch.dtype | None = torch.float64, sinks: Tensor | None = None) -> Tensor:
    """The logsumexp of each row's scores, as returned by ``attention(..., return_lse=True)``.

    Args:
        q, k, mask, bias, causal, scale, score_mod, dtype, sinks: as in :func:`reference_attention`
            (v is not needed); with sinks, the sink term is in the sum.

    Returns:
        (B, Hq, Lq) in ``dtype``; -inf on rows that see no key.

    Example:
        >>> lse = reference_lse(q, k, mask=masks.sliding_window(20))
    """
    return torch.logsumexp(_with_sinks(_masked_scores(q, k, mask, bias, causal, scale, score_mod, dtype), sinks),
                           dim=-1)


def _with_sinks(s: Tensor, sinks: Tensor | None) -> Tensor:
    """Scores (B, Hq, Lq, Lk) with one more column per row holding its head's sink logit."""
    if sinks is None:
        return s
    if sinks.shape != (s.shape[1],):
        raise ValueError(f"sinks must have shape (Hq,) = ({s.shape[1]},), got {tuple(sinks.shape)}")
    return torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)

"""Masks given as data or code: a bool tensor, a FlexAttention-style function, and the conversions from
``nn.MultiheadAttention``'s masks (True = ignore there).

Shape legend: B batch, H heads, Lq query length, Lk key length, bq/bk tile sizes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import Mask, MaskMod, positions, query_offset

__all__ = ["FromMaskMod", "FromTensor", "from_mask_mod", "from_tensor", "from_torch_attn_mask",
           "from_torch_key_padding_mask"]


def _tile_reduce(t: Tensor, dim: int, block: int, fill: bool, reduce: str) -> Tensor:
    """any/all over tiles of ``block`` along ``dim``; a broadcast dim (size 1) stays size 1."""
    size = t.shape[dim]
    if size == 1:
        return t
    n = math.ceil(size / block)
    pad = n * block - size
    if pad:
        shape = list(t.shape)
        shape[dim] = pad
        t = torch.cat([t, torch.full(shape, fill, dtype=torch.bool, device=t.device)], dim=dim)
    shape = list(t.shape)
    shape[dim:dim + 1] = [n, block]
    t = t.reshape(shape)
    return t.any(dim + 1) if reduce == "any" else t.all(dim + 1)


class FromTensor(Mask):
    """Key j is visible from query row r when ``t[b, h, r, j]`` is True (t broadcastable); with
    ``ignore=True``, when it is False (the ``nn.MultiheadAttention`` convention, read in place)."""

    def __init__(self, t: Tensor, ignore: bool = False) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"from_tensor needs a bool tensor, got {type(t).__name__}")
        if t.dtype != torch.bool:
            raise TypeError(f"mask tensors must be bool (True = may attend), got dtype {t.dtype}; "
                            "for an additive float mask pass it as bias=, for 0/1 values use t.bool()")
        if not 1 <= t.dim() <= 4:
            raise ValueError(f"a mask tensor must have 1 to 4 dims (B, H, Lq, Lk), got shape {tuple(t.shape)}")
        self.t = t[(None,) * (4 - t.dim())]  # (B|1, H|1, Lq|1, Lk|1), a view: changes to t are seen
        self.ignore = ignore

    def check(self, batch, heads, lq, lk):
        want = (batch, heads, lq, lk)
        if any(s not in (1, w) for s, w in zip(self.t.shape, want, strict=True)):
            raise ValueError(f"mask of shape {tuple(self.t.shape)} does not broadcast to "
                             f"(B, Hq, Lq, Lk) = {want}; use size 1 for dims that broadcast")

    def predicate(self, lq, lk, device=None):
        t, off, ignore = self.t.to(device), query_offset(lq, lk), self.ignore
        keep = [size > 1 for size in t.shape]  # broadcast dims are read at index 0

        def visible(b, h, i, j):
            x = t[b * keep[0], h * keep[1], (i - off) * keep[2], j * keep[3]]
            return ~x if ignore else x
        return visible

    def block(self, q0, q1, k0, k1, lq, lk, device=None):
        """Fast path: a slice of the tensor (the predicate on a rectangle, without a gather)."""
        t = self.t.to(device) if device is not None else self.t
        rows = slice(None) if t.shape[2] == 1 else slice(q0, q1)
        cols = slice(None) if t.shape[3] == 1 else slice(k0, k1)
        x = t[:, :, rows, cols]
        return ~x if self.ignore else x

    def _tile_bounds(self, lq, lk, bq, bk, device):
        t = self.t.to(device) if device is not None else self.t
        every = _tile_reduce(_tile_reduce(t, 2, bq, True, "all"), 3, bk, True, "all")  # every pair True
        some = _tile_reduce(_tile_reduce(t, 2, bq, False, "any"), 3, bk, False, "any")  # some pair True
        if self.ignore:  # visible = ~t: full where no pair is True, empty where every pair is
            return ~some, every
        return every, ~some

    def batch_heads(self):
        return self.t.shape[0], self.t.shape[1]

    def tensors(self):
        return (self.t,)

    def __repr__(self) -> str:
        return f"from_tensor(shape {tuple(self.t.shape)}{', ignore=True' if self.ignore else ''})"


class FromMaskMod(Mask):
    """Any rule given as a function ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's
    convention: ``q_idx`` is the query row, ``kv_idx`` the key index).

    selfattn cannot see inside the function, so its tile map is computed by evaluating it on
    groups of query rows against all keys, O(rows x Lk) memory at a time, never (Lq, Lk) at once;
    and since the tensors it reads are hidden, no cache trusts it (:meth:`version` is None).
    """

    ELEMENTS_PER_STEP = 1 << 22  # predicate evaluations per step of the tile map

    def __init__(self, fn: MaskMod, batch: int = 1, heads: int = 1) -> None:
        if not callable(fn):
            raise TypeError(f"from_mask_mod needs a function (b, h, q_idx, kv_idx) -> bool, got {type(fn).__name__}")
        for name, value in (("batch", batch), ("heads", heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"from_mask_mod {name} must be an int >= 1, got {value!r}")
        self.fn, self.batch, self.num_heads = fn, batch, heads

    def fields(self):  # ``heads`` is a method of every mask: the count is kept as num_heads
        return (("fn", self.fn), ("batch", self.batch), ("heads", self.num_heads))

    def predicate(self, lq, lk, device=None):
        fn, off = self.fn, query_offset(lq, lk)

        def visible(b, h, i, j):
            out = fn(b, h, i - off, j)
            if not isinstance(out, Tensor) or out.dtype != torch.bool:
                raise TypeError(f"mask_mod {fn!r} must return a bool tensor, got "
                                f"{getattr(out, 'dtype', type(out).__name__)}")
            want = torch.broadcast_shapes(b.shape, h.shape, i.shape, j.shape)
            try:
                ok = out.dim() <= 4 and torch.broadcast_shapes(out.shape, want) == want
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(f"mask_mod {fn!r} returned shape {tuple(out.shape)} for index tensors that "
                                 f"broadcast to {tuple(want)}; it must broadcast over (b, h, q_idx, kv_idx) "
                                 f"(declared batch={self.batch}, heads={self.num_heads}), not return a whole table")
            return out
        return visible

    def _tile_bounds(self, lq, lk, bq, bk, device):
        visible, nb, nh = self.predicate(lq, lk, device), self.batch, self.num_heads
        rows_per_step = max(bq, (self.ELEMENTS_PER_STEP // max(1, nb * nh * lk)) // bq * bq)
        full, empty = [], []
        for r0 in range(0, lq, rows_per_step):  # r0 is a multiple of bq: whole query tiles per step
            r1 = min(r0 + rows_per_step, lq)
            idx = positions(torch.arange(nb), nh, r0, r1, 0, lk, lq, lk, device)
            v = visible(*idx).expand(nb, nh, r1 - r0, lk)
            full.append(_tile_reduce(_tile_reduce(v, 2, bq, True, "all"), 3, bk, True, "all"))
            empty.append(~_tile_reduce(_tile_reduce(v, 2, bq, False, "any"), 3, bk, False, "any"))
        return torch.cat(full, dim=2), torch.cat(empty, dim=2)

    def batch_heads(self):
        return self.batch, self.num_heads

    def version(self):
        return None  # the function may read tensors selfattn cannot see

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", self.fn)
        return f"from_mask_mod({name!r}, batch={self.batch}, heads={self.num_heads})"


def from_tensor(t: Tensor) -> Mask:
    """Wrap a bool tensor broadcastable to (B, H, Lq, Lk); True = may attend."""
    return FromTensor(t)


def from_mask_mod(fn: MaskMod, *, batch: int = 1, heads: int = 1) -> Mask:
    """A mask from any function ``fn(b, h, q_idx, kv_idx) -> bool tensor``, FlexAttention's
    ``mask_mod`` convention (``q_idx`` the query row, ``kv_idx`` the key index).

    ``fn`` receives broadcastable int tensors (b of shape (batch, 1, 1, 1), h (1, heads, 1, 1),
    q_idx (1, 1, rows, 1), kv_idx (1, 1, 1, keys)) and must broadcast over them. Prefer the named
    masks where one fits: their tile maps are computed from their bounds, this one's by evaluating
    ``fn`` (in row groups, O(rows x Lk) memory).

    Args:
        fn: the rule; True = may attend.
        batch: batch items ``fn`` distinguishes (b runs over 0..batch-1); 1 when it ignores b.
        heads: heads ``fn`` distinguishes; 1 when it ignores h.

    Example:
        >>> m = masks.from_mask_mod(lambda b, h, q, kv: (q - kv) % 3 == 0)
    """
    return FromMaskMod(fn, batch, heads)


def from_torch_key_padding_mask(key_padding_mask: Tensor) -> Mask:
    """Convert ``nn.MultiheadAttention``'s ``key_padding_mask`` (B, Lk), where True = IGNORE.

    Example:
        >>> m = masks.from_torch_key_padding_mask(kpm)   # same meaning, selfattn polarity
    """
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
        raise TypeError("key_padding_mask must be a bool tensor (B, Lk) with True = ignore; "
                        f"got {getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}")
    if key_padding_mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be (B, Lk), got shape {tuple(key_padding_mask.shape)}")
    return FromTensor(key_padding_mask[:, None, None, :], ignore=True)


def from_torch_attn_mask(attn_mask: Tensor, num_heads: int | None = None) -> Mask:
    """Convert ``nn.MultiheadAttention``'s bool ``attn_mask``, where True = NOT allowed.

    Args:
        attn_mask: bool (Lq, Lk), or (B * num_heads, Lq, Lk) as nn.MultiheadAttention packs it.
        num_heads: needed for the 3-D form, to unpack batch and heads.

    A float ``attn_mask`` is additive: pass it to ``attention()`` as ``bias=`` instead.
    """
    if not isinstance(attn_mask, Tensor) or attn_mask.dtype != torch.bool:
        raise TypeError("from_torch_attn_mask takes a bool attn_mask (True = not allowed); "
                        "a float attn_mask is additive, pass it to attention() as bias=")
    if attn_mask.dim() == 2:
        return FromTensor(attn_mask, ignore=True)
    if attn_mask.dim() != 3:
        raise ValueError(f"attn_mask must be (Lq, Lk) or (B*H, Lq, Lk), got shape {tuple(attn_mask.shape)}")
    if num_heads is None or num_heads < 1 or attn_mask.shape[0] % num_heads:
        raise ValueError(f"a 3-D attn_mask of shape {tuple(attn_mask.shape)} packs batch and heads; "
                         f"pass num_heads (a divisor of {attn_mask.shape[0]}), got {num_heads!r}")
    lq, lk = attn_mask.shape[1:]
    try:
        packed = attn_mask.view(-1, num_heads, lq, lk)  # a view: changes to attn_mask are seen
    except RuntimeError:  # strides that cannot be split without a copy
        packed = attn_mask.reshape(-1, num_heads, lq, lk)
    return FromTensor(packed, ignore=True)

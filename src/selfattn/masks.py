"""Attention masks as composable predicates.

Everywhere in selfattn, ``True`` means "query i MAY attend to key j" (the SDPA and FlexAttention
convention). Masks are small objects, not tensors: they compose with ``&``, ``|`` and ``~``, turn
into a dense bool tensor on request, and classify (query block, key block) tiles as empty, partly
visible or fully visible so that backends can skip work without ever building an (Lq, Lk) tensor.

One source of truth: each mask states its rule once, as a predicate ``visible(b, h, i, j)`` on
positions (:meth:`Mask.predicate`). The dense form, :meth:`Mask.block` and FlexAttention's
``mask_mod`` are all derived from it; the analytic tile bounds of each mask are a fast path that
the test suite checks against the predicate.

Positions: key j sits at position j; query row r sits at position ``r + query_offset(Lq, Lk)``
(queries are the last Lq of the Lk positions, as when decoding after a cache). Score modifiers
(:mod:`selfattn.scores`) receive the same positions.

Masks read their tensors (padding lengths, document ids, ``from_tensor``) when they are used, so
a tensor changed in place between two calls is seen by the next call; every cache that backends
keep (FlexAttention block masks) is keyed on :meth:`Mask.version`, and a change between a
forward and its backward raises instead of giving the gradient of another mask.

Shape legend: B batch, H heads, Lq query length, Lk key length, bq/bk tile sizes,
nQ/nK numbers of tiles.

Causal alignment, drawn for Lq = 2, Lk = 4 (``1`` = visible)::

    top_left        bottom_right
    1 0 0 0         1 1 1 0
    1 1 0 0         1 1 1 1

Example:
    >>> from selfattn import masks
    >>> m = masks.causal() & masks.padding(torch.tensor([3, 5]))
    >>> m.dense(5, 5).shape
    torch.Size([2, 1, 5, 5])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ._fields import Declared

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Mask",
    "causal",
    "document",
    "from_mask_mod",
    "from_tensor",
    "from_torch_attn_mask",
    "from_torch_key_padding_mask",
    "padding",
    "positions",
    "query_offset",
    "sliding_window",
]

Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (b, h, i, j) -> bool, i and j positions
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (b, h, q_idx, kv_idx) -> bool, q_idx a row
Device = torch.device | str | None

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Tile classes returned by :meth:`Mask.tiles`."""

_ALIGNS = ("top_left", "bottom_right")


def positions(items: Tensor, heads: int, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int,
              device: Device = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcastable 4-D (b, h, i, j) index tensors of a block: batch items ``items`` (1-D),
    heads ``0:heads``, query rows ``q0:q1`` as positions (row + query_offset) and keys ``k0:k1``."""
    off = query_offset(lq, lk)
    if device is not None and items.device != torch.device(device):
        items = items.to(device)
    return (items.view(-1, 1, 1, 1), torch.arange(heads, device=device).view(1, -1, 1, 1),
            torch.arange(q0 + off, q1 + off, device=device).view(1, 1, -1, 1),
            torch.arange(k0, k1, device=device).view(1, 1, 1, -1))


def query_offset(lq: int, lk: int) -> int:
    """The position of query row 0 in key coordinates: query row r sits at ``r + Lk - Lq``.

    The one place selfattn decides how queries line up with keys when Lq != Lk (bottom-right:
    the last query is the last key position, as in decoding).
    """
    return lk - lq


class Mask(Declared):
    """A predicate ``visible(b, h, i, j)``; compose with ``&``, ``|`` and ``~``.

    Subclasses implement :meth:`predicate` (the rule, once) and :meth:`_tile_bounds` (a fast,
    conservative classification of tiles, checked against the predicate by the test suite). A mask
    is made of its constructor's arguments (:meth:`fields`, :meth:`from_fields`): store each under
    its own name, or override both, so that ``torch.compile`` can take the mask apart.
    """

    def predicate(self, lq: int, lk: int, device: Device = None) -> Predicate:
        """The rule for a call with lengths (lq, lk): ``visible(b, h, i, j) -> bool tensor``.

        ``b``, ``h``, ``i``, ``j`` are broadcastable integer tensors; ``i`` is the query's
        position (row + ``query_offset(lq, lk)``), ``j`` the key's. Tensors the mask holds are
        moved to ``device`` once, when the predicate is made.
        """
        raise NotImplementedError

    def _tile_bounds(self, lq: int, lk: int, bq: int, bk: int, device: Device) -> tuple[Tensor, Tensor]:
        """(full, empty): bool tensors broadcastable to (B, H, nQ, nK).

        ``full`` may only be True where every pair in the tile is visible and ``empty`` only
        where none is; both False means "partly visible, or unknown".
        """
        raise NotImplementedError

    def batch_heads(self) -> tuple[int, int]:
        """(B, H) sizes this mask carries; 1 where it broadcasts."""
        return 1, 1

    def shift_invariant(self) -> bool:
        """Whether visibility depends only on the distance j - i between positions (for given
        lengths), as for causal masks, sliding windows and their compositions: then every block
        at one offset from the diagonal has the same pattern, and one block stands for all of
        them. False unless a mask knows better; the built-in masks say so for their exact type
        only, so a subclass that changes a rule does not inherit the answer."""
        return False

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors this mask reads (lengths, ids, a bool tensor), for cache keys."""
        return ()

    def version(self) -> tuple[int, ...] | None:
        """The in-place version of every tensor the mask reads; None when one of them cannot say
        (an inference-mode tensor), so that no cache may trust it."""
        out = []
        for t in self.tensors():
            if t.is_inference():
                return None
            out.append(t._version)
        return tuple(out)

    def check(self, batch: int, heads: int, lq: int, lk: int) -> None:
        """Raise ValueError if this mask cannot describe a call of this shape."""
        b, h = self.batch_heads()
        if b not in (1, batch):
            raise ValueError(f"mask {self!r} is for batch size {b}, but q has batch size {batch}")
        if h not in (1, heads):
            raise ValueError(f"mask {self!r} has {h} heads, but q has {heads} heads; "
                             "give it 1 head (broadcast) or one per query head")

    def block(self, q0: int, q1: int, k0: int, k1: int, lq: int, lk: int, device: Device = None) -> Tensor:
        """Visibility of query rows ``q0:q1`` and keys ``k0:k1`` for a call with lengths (lq, lk).

        Returns a bool tensor broadcastable to (B, H, q1 - q0, k1 - k0), always 4-D.
        """
        nb, nh = self.batch_heads()
        idx = positions(torch.arange(nb), nh, q0, q1, k0, k1, lq, lk, device)
        out = self.predicate(lq, lk, device)(*idx)
        return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))

    def dense(self, lq: int, lk: int, device: Device = None) -> Tensor:
        """The whole mask as a bool tensor broadcastable to (B, H, Lq, Lk)."""
        return self.block(0, lq, 0, lk, lq, lk, device)

    def mask_mod(self, lq: int, lk: int, device: Device = None) -> MaskMod:
        """The predicate as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (q_idx a
        query row) for a call with lengths (lq, lk)."""
        visible, off = self.predicate(lq, lk, device), query_offset(lq, lk)
        return lambda b, h, q_idx, kv_idx: visible(b, h, q_idx + off, kv_idx)

    def heads(self, start: int, count: int) -> Mask:
        """Heads ``start:start + count`` of this mask, as a mask of ``count`` heads: for a call that
        holds only those heads of a larger one (one rank's heads in all-to-all context
        parallelism). A mask that broadcasts over heads is returned as it is.

        Example:
            >>> m = masks.from_tensor(torch.ones(1, 8, 4, 4, dtype=torch.bool)).heads(2, 4)
            >>> m.batch_heads()
            (1, 4)
        """
        for name, value in (("start", start), ("count", count)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "count" else 0):
                raise ValueError(f"heads {name} must be an int >= {1 if name == 'count' else 0}, got {value!r}")
        total = self.batch_heads()[1]
        if total == 1:
            return self
        if start + count > total:
            raise ValueError(f"heads({start}, {count}) reaches past the {total} heads of mask {self!r}")
        return HeadSlice(self, start, count)

    def tiles(self, lq: int, lk: int, block_q: int, block_k: int, device: Device = None) -> Tensor:
        """Classify tiles as :data:`EMPTY`, :data:`PARTIAL` or :data:`FULL`.

        Returns an int8 tensor broadcastable to (B, H, ceil(Lq / block_q), ceil(Lk / block_k)).
        The map is conservative: FULL and EMPTY are exact claims, PARTIAL may hide either.
        """
        full, empty = self._tile_bounds(lq, lk, block_q, block_k, device)
        full, empty = torch.broadcast_tensors(full, empty)
        grid = (-(-lq // block_q), -(-lk // block_k))  # (nQ, nK)
        full, empty = full.expand(*full.shape[:2], *grid), empty.expand(*empty.shape[:2], *grid)
        out = torch.full(full.shape, PARTIAL, dtype=torch.int8, device=full.device)
        out[full] = FULL
        out[empty] = EMPTY
        return out

    def __and__(self, other: Mask) -> Mask:
        return _And(self, _as_mask(other, "&"))

    def __or__(self, other: Mask) -> Mask:
        return _Or(self, _as_mask(other, "|"))

    def __invert__(self) -> Mask:
        return _Not(self)


def _as_mask(other: object, op: str) -> Mask:
    if not isinstance(other, Mask):
        raise TypeError(f"cannot combine a Mask with {type(other).__name__} using {op!r}; "
                        "wrap a bool tensor with masks.from_tensor(t) first")
    return other


def _broadcast_bh(a: tuple[int, int], b: tuple[int, int], what: Mask) -> tuple[int, int]:
    out = []
    for x, y, name in zip(a, b, ("batch", "head"), strict=True):
        if x != y and 1 not in (x, y):
            raise ValueError(f"cannot combine masks with {name} sizes {x} and {y} in {what!r}")
        out.append(max(x, y))
    return out[0], out[1]


def _tile_edges(length: int, block: int, device: Device, offset: int = 0) -> tuple[Tensor, Tensor]:
    """First and last position of every tile of ``block`` along a dimension of ``length``."""
    lo = torch.arange(0, length, block, device=device)
    hi = torch.clamp(lo + block, max=length) - 1
    return lo + offset, hi + offset


def _query_tiles(lq: int, lk: int, bq: int, device: Device) -> tuple[Tensor, Tensor]:
    """First and last query position of every query tile, as (nQ, 1) columns."""
    lo, hi = _tile_edges(lq, bq, device, query_offset(lq, lk))
    return lo[:, None], hi[:, None]


def _key_tiles(lk: int, bk: int, device: Device) -> tuple[Tensor, Tensor]:
    """First and last key position of every key tile, as (1, nK) rows."""
    lo, hi = _tile_edges(lk, bk, device)
    return lo[None, :], hi[None, :]


class _Binary(Mask):
    """Two masks combined element-wise; subclasses say how (``_op``) and how tiles combine."""

    symbol = ""

    def __init__(self, a: Mask, b: Mask) -> None:
        self.a, self.b = a, b
        _broadcast_bh(a.batch_heads(), b.batch_heads(), self)

    @staticmethod
    def _op(x: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def predicate(self, lq, lk, device=None):
        fa, fb, op = self.a.predicate(lq, lk, device), self.b.predicate(lq, lk, device), self._op
        return lambda b, h, i, j: op(fa(b, h, i, j), fb(b, h, i, j))

    def block(self, q0, q1, k0, k1, lq, lk, device=None):  # each side's own block (it may be a fast path)
        return self._op(self.a.block(q0, q1, k0, k1, lq, lk, device), self.b.block(q0, q1, k0, k1, lq, lk, device))

    def batch_heads(self):
        return _broadcast_bh(self.a.batch_heads(), self.b.batch_heads(), self)

    def shift_invariant(self):
        return type(self) in (_And, _Or) and self.a.shift_invariant() and self.b.shift_invariant()

    def version(self):  # None when either side cannot say (a mask that calls a function)
        a, b = self.a.version(), self.b.version()
        return None if a is None or b is None else a + b

    def tensors(self):
        return self.a.tensors() + self.b.tensors()

    def check(self, batch, heads, lq, lk):
        self.a.check(batch, heads, lq, lk)
        self.b.check(batch, heads, lq, lk)

    def __repr__(self) -> str:
        return f"({self.a!r} {self.symbol} {self.b!r})"


class _And(_Binary):
    symbol = "&"

    @staticmethod
    def _op(x, y):
        return x & y

    def _tile_bounds(self, lq, lk, bq, bk, device):
        fa, ea = self.a._tile_bounds(lq, lk, bq, bk, device)
        fb, eb = self.b._tile_bounds(lq, lk, bq, bk, device)
        return fa & fb, ea | eb


class _Or(_Binary):
    symbol = "|"

    @staticmethod
    def _op(x, y):
        return x | y

    def _tile_bounds(self, lq, lk, bq, bk, device):
        fa, ea = self.a._tile_bounds(lq, lk, bq, bk, device)
        fb, eb = self.b._tile_bounds(lq, lk, bq, bk, device)
        return fa | fb, ea & eb


class _Not(Mask):
    def __init__(self, a: Mask) -> None:
        self.a = a

    def predicate(self, lq, lk, device=None):
        fa = self.a.predicate(lq, lk, device)
        return lambda b, h, i, j: ~fa(b, h, i, j)

    def block(self, q0, q1, k0, k1, lq, lk, device=None):
        return ~self.a.block(q0, q1, k0, k1, lq, lk, device)

    def _tile_bounds(self, lq, lk, bq, bk, device):
        full, empty = self.a._tile_bounds(lq, lk, bq, bk, device)
        return empty, full

    def shift_invariant(self):
        return type(self) is _Not and self.a.shift_invariant()

    def version(self):
        return self.a.version()

    def batch_heads(self):
        return self.a.batch_heads()

    def tensors(self):
        return self.a.tensors()

    def check(self, batch, heads, lq, lk):
        self.a.check(batch, heads, lq, lk)

    def __repr__(self) -> str:
        return f"~{self.a!r}"


class Causal(Mask):
    """Key j is visible from query i when ``j <= i`` in positions (bottom-right aligned), or when
    ``j <= row`` (top-left aligned: the first query sees the first key)."""

    def __init__(self, align: str = "top_left") -> None:
        if align not in _ALIGNS:
            raise ValueError(f"causal align must be 'top_left' or 'bottom_right', got {align!r}")
        self.align = align

    def offset(self, lq: int, lk: int) -> int:
        """How far right of a query's row its last visible key lies: 0 (top_left) or Lk - Lq."""
        return 0 if self.align == "top_left" else query_offset(lq, lk)

    def shift_invariant(self):
        return type(self) is Causal

    def _shift(self, lq: int, lk: int) -> int:
        """Visible when ``j <= i - shift`` in positions."""
        return query_offset(lq, lk) - self.offset(lq, lk)

    def predicate(self, lq, lk, device=None):
        shift = self._shift(lq, lk)
        return lambda b, h, i, j: j <= i - shift

    def _tile_bounds(self, lq, lk, bq, bk, device):
        shift = self._shift(lq, lk)
        (qlo, qhi), (klo, khi) = _query_tiles(lq, lk, bq, device), _key_tiles(lk, bk, device)
        return (khi <= qlo - shift)[None, None], (klo > qhi - shift)[None, None]

    def __repr__(self) -> str:
        return f"causal({self.align!r})"


class SlidingWindow(Mask):
    """Key j is visible from query i when ``i - left <= j <= i + right`` (positions)."""

    def __init__(self, left: int, right: int = 0) -> None:
        for name, value in (("left", left), ("right", right)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"sliding_window {name} must be an int >= 0, got {value!r}")
        self.left, self.right = left, right

    def shift_invariant(self):
        return type(self) is SlidingWindow

    def predicate(self, lq, lk, device=None):
        left, right = self.left, self.right
        return lambda b, h, i, j: (j >= i - left) & (j <= i + right)

    def _tile_bounds(self, lq, lk, bq, bk, device):
        (qlo, qhi), (klo, khi) = _query_tiles(lq, lk, bq, device), _key_tiles(lk, bk, device)
        full = (klo >= qhi - self.left) & (khi <= qlo + self.right)
        empty = (khi < qlo - self.left) | (klo > qhi + self.right)
        return full[None, None], empty[None, None]

    def __repr__(self) -> str:
        return f"sliding_window({self.left}, {self.right})"


def _as_int_tensor(x: Tensor | Sequence[int], name: str, ndims: tuple[int, ...]) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}; convert with .long()")
    if t.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dims, got shape {tuple(t.shape)}")
    return t


class Padding(Mask):
    """Key j is visible in batch item b when ``j < lengths[b]`` (right-padded sequences); with
    ``queries=True`` padded queries (positions >= lengths[b]) also see nothing (output 0)."""

    def __init__(self, lengths: Tensor | Sequence[int], queries: bool = False) -> None:
        t = _as_int_tensor(lengths, "padding lengths", (1,))
        if t.numel() and not torch.compiler.is_compiling() and int(t.min()) < 0:  # data: not traceable
            raise ValueError(f"padding lengths must be >= 0, got {t.tolist()}")
        self.lengths, self.queries = t, queries

    def _len(self, device: Device) -> Tensor:
        return self.lengths.to(device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)

    def predicate(self, lq, lk, device=None):
        n = self.lengths.to(device)
        if self.queries:
            return lambda b, h, i, j: (j < n[b]) & (i < n[b])
        return lambda b, h, i, j: j < n[b]

    def _tile_bounds(self, lq, lk, bq, bk, device):
        klo, khi = _tile_edges(lk, bk, device)
        n = self._len(device)
        full, empty = khi.view(1, 1, 1, -1) < n, klo.view(1, 1, 1, -1) >= n
        if self.queries:
            qlo, qhi = _tile_edges(lq, bq, device, query_offset(lq, lk))
            full = full & (qhi.view(1, 1, -1, 1) < n)
            empty = empty | (qlo.view(1, 1, -1, 1) >= n)
        return full, empty

    def batch_heads(self):
        return self.lengths.numel(), 1

    def tensors(self):
        return (self.lengths,)

    def __repr__(self) -> str:
        return f"padding({self.lengths.tolist()}{', queries=True' if self.queries else ''})"


class Document(Mask):
    """Key j is visible from query i when both positions belong to the same document.

    ``ids`` gives a document id per key position, (B, Lk) or (Lk,). When Lq < Lk the queries
    are the last Lq positions (bottom-right aligned, as when decoding after a cache).
    """

    def __init__(self, ids: Tensor | Sequence[int]) -> None:
        t = _as_int_tensor(ids, "document ids", (1, 2))
        self.ids = t if t.dim() == 2 else t.unsqueeze(0)  # (B|1, Lk)

    def check(self, batch, heads, lq, lk):
        super().check(batch, heads, lq, lk)
        if self.ids.shape[1] != lk:
            raise ValueError(f"document ids have length {self.ids.shape[1]}, but k has length {lk}; "
                             "give one id per key position")
        if lq > lk:
            raise ValueError(f"document masks need Lq <= Lk (queries are the last Lq positions), "
                             f"got Lq={lq}, Lk={lk}")

    def predicate(self, lq, lk, device=None):
        ids = self.ids.to(device)
        if ids.shape[0] == 1:
            flat = ids[0]
            return lambda b, h, i, j: flat[i] == flat[j]
        return lambda b, h, i, j: ids[b, i] == ids[b, j]

    @staticmethod
    def _minmax(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
        """Per-tile min and max of (B, L) ids, padding the last tile with its last value."""
        n = math.ceil(x.shape[1] / block)
        pad = n * block - x.shape[1]
        if pad:
            x = torch.cat([x, x[:, -1:].expand(-1, pad)], dim=1)
        x = x.view(x.shape[0], n, block)
        return x.amin(-1), x.amax(-1)  # (B, n)

    def _tile_bounds(self, lq, lk, bq, bk, device):
        ids = self.ids.to(device)
        qmin, qmax = self._minmax(ids[:, query_offset(lq, lk):], bq)
        kmin, kmax = self._minmax(ids, bk)
        qmin, qmax = qmin[:, :, None], qmax[:, :, None]  # (B, nQ, 1)
        kmin, kmax = kmin[:, None, :], kmax[:, None, :]  # (B, 1, nK)
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        empty = (qmax < kmin) | (kmax < qmin)
        return full.unsqueeze(1), empty.unsqueeze(1)

    def batch_heads(self):
        return self.ids.shape[0], 1

    def tensors(self):
        return (self.ids,)

    def __repr__(self) -> str:
        return f"document(ids of shape {tuple(self.ids.shape)})"


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


class HeadSlice(Mask):
    """Heads ``start:start + count`` of a mask of more heads, as local heads 0..count-1
    (:meth:`Mask.heads`)."""

    def __init__(self, inner: Mask, start: int, count: int) -> None:
        self.inner, self.start, self.count = inner, start, count

    def predicate(self, lq, lk, device=None):
        inner, start = self.inner.predicate(lq, lk, device), self.start
        return lambda b, h, i, j: inner(b, h + start, i, j)

    def _cut(self, t: Tensor) -> Tensor:
        return t if t.shape[1] == 1 else t[:, self.start:self.start + self.count]

    def block(self, q0, q1, k0, k1, lq, lk, device=None):
        return self._cut(self.inner.block(q0, q1, k0, k1, lq, lk, device))

    def _tile_bounds(self, lq, lk, bq, bk, device):
        t = self._cut(self.inner.tiles(lq, lk, bq, bk, device))
        return t == FULL, t == EMPTY

    def batch_heads(self):
        return self.inner.batch_heads()[0], self.count

    def tensors(self):
        return self.inner.tensors()

    def version(self):
        return self.inner.version()

    def check(self, batch, heads, lq, lk):
        super().check(batch, heads, lq, lk)
        self.inner.check(batch, self.inner.batch_heads()[1], lq, lk)

    def __repr__(self) -> str:
        return f"{self.inner!r}[heads {self.start}:{self.start + self.count}]"


def causal(align: str = "top_left") -> Mask:
    """Causal mask: key j visible from query i when ``j <= i`` (top_left) or
    ``j <= i + Lk - Lq`` (bottom_right).

    Example:
        >>> masks.causal().dense(3, 3)[0, 0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    return Causal(align)


def padding(lengths: Tensor | Sequence[int], *, queries: bool = False) -> Mask:
    """Key padding: key j visible in batch item b when ``j < lengths[b]``.

    Args:
        lengths: int tensor (B,), the number of real (unpadded) tokens in each batch item.
        queries: also hide everything from padded queries (rows i >= lengths[b], bottom-right
            aligned when Lq != Lk): their output is 0 and backends skip their tiles. Use it when
            the outputs at padded positions are discarded anyway (training on padded batches).
    """
    return Padding(lengths, queries)


def sliding_window(left: int, right: int = 0) -> Mask:
    """Local attention: key j visible from query i when ``i - left <= j <= i + right``.

    Bottom-right aligned when Lq != Lk (query i sits at key position ``i + Lk - Lq``).
    ``sliding_window(w)`` is causal with a window of ``w`` past keys plus the current one.
    """
    return SlidingWindow(left, right)


def document(ids: Tensor | Sequence[int]) -> Mask:
    """Packed variable-length sequences: query i sees key j when ``ids[b, i] == ids[b, j]``.

    Args:
        ids: int tensor (B, L) or (L,), a document id per position. Combine with
            ``causal()`` for packed causal language modelling.
    """
    return Document(ids)


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

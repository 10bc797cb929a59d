"""The Mask type: a predicate on positions, its dense and block forms, its tile map, and how masks
combine (``&``, ``|``, ``~``) or narrow to some heads (:meth:`Mask.heads`).

Shape legend: B batch, H heads, Lq query length, Lk key length, bq/bk tile sizes, nQ/nK numbers
of tiles.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .._fields import Declared

__all__ = ["EMPTY", "FULL", "PARTIAL", "Cropped", "Device", "HeadSlice", "Mask", "MaskMod", "Predicate", "key_tiles",
           "positions", "query_offset", "query_tiles", "tile_edges"]

Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (b, h, i, j) -> bool, i and j positions
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (b, h, q_idx, kv_idx) -> bool, q_idx a row
Device = torch.device | str | None

EMPTY, PARTIAL, FULL = 0, 1, 2
"""Tile classes returned by :meth:`Mask.tiles`."""


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


def tile_edges(length: int, block: int, device: Device, offset: int = 0) -> tuple[Tensor, Tensor]:
    """First and last position of every tile of ``block`` along a dimension of ``length``."""
    lo = torch.arange(0, length, block, device=device)
    hi = torch.clamp(lo + block, max=length) - 1
    return lo + offset, hi + offset


def query_tiles(lq: int, lk: int, bq: int, device: Device) -> tuple[Tensor, Tensor]:
    """First and last query position of every query tile, as (nQ, 1) columns."""
    lo, hi = tile_edges(lq, bq, device, query_offset(lq, lk))
    return lo[:, None], hi[:, None]


def key_tiles(lk: int, bk: int, device: Device) -> tuple[Tensor, Tensor]:
    """First and last key position of every key tile, as (1, nK) rows."""
    lo, hi = tile_edges(lk, bk, device)
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


class Cropped(Mask):
    """A mask of a call of ``length`` positions, on a longer call of the same positions and padding after them:
    the first ``length`` positions see each other as ``inner`` says; a position past them sees no key and is seen
    by no query (self-attention: Lq = Lk). For a sequence padded to a multiple of the ranks' chunks
    (``selfattn.distributed``); ``inner`` None: every real pair is visible."""

    def __init__(self, inner: Mask | None, length: int) -> None:
        self.inner, self.length = inner, length

    def predicate(self, lq, lk, device=None):
        n = self.length
        if self.inner is None:
            return lambda b, h, i, j: (i < n) & (j < n)
        inner = self.inner.predicate(n, n, device)
        return lambda b, h, i, j: (i < n) & (j < n) & inner(b, h, i.clamp(max=n - 1), j.clamp(max=n - 1))

    def _tile_bounds(self, lq, lk, bq, bk, device):
        n, grid = self.length, (-(-lq // bq), -(-lk // bk))
        if self.inner is None:
            t = torch.full((1, 1, -(-n // bq), -(-n // bk)), FULL, dtype=torch.int8, device=device)
        else:
            t = self.inner.tiles(n, n, bq, bk, device)
        t = t.expand(*t.shape[:2], -(-n // bq), -(-n // bk)).clone()
        if n % bq:  # the tile that holds the last real query also holds padding: not full
            t[:, :, -1][t[:, :, -1] == FULL] = PARTIAL
        if n % bk:
            t[..., -1][t[..., -1] == FULL] = PARTIAL
        out = torch.full((*t.shape[:2], *grid), EMPTY, dtype=torch.int8, device=t.device)
        out[:, :, :t.shape[2], :t.shape[3]] = t
        return out == FULL, out == EMPTY

    def batch_heads(self):
        return (1, 1) if self.inner is None else self.inner.batch_heads()

    def tensors(self):
        return () if self.inner is None else self.inner.tensors()

    def version(self):
        return () if self.inner is None else self.inner.version()

    def check(self, batch, heads, lq, lk):
        super().check(batch, heads, lq, lk)
        if lq != lk or lq < self.length:
            raise ValueError(f"a mask of {self.length} positions cropped from a longer call needs Lq = Lk >= "
                             f"{self.length}, got Lq={lq}, Lk={lk}")
        if self.inner is not None:
            self.inner.check(batch, heads, self.length, self.length)

    def __repr__(self) -> str:
        return f"{self.inner!r}[first {self.length} positions]"

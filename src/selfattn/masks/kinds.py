"""The masks of positions: causal (both alignments), sliding windows, padding lengths and documents.

Shape legend: B batch, Lq query length, Lk key length, bq/bk tile sizes, nQ/nK numbers of tiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .base import Device, Mask, key_tiles, query_offset, query_tiles, tile_edges

__all__ = ["Causal", "Document", "Padding", "SlidingWindow", "causal", "document", "padding", "sliding_window"]

_ALIGNS = ("top_left", "bottom_right")


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
        (qlo, qhi), (klo, khi) = query_tiles(lq, lk, bq, device), key_tiles(lk, bk, device)
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
        (qlo, qhi), (klo, khi) = query_tiles(lq, lk, bq, device), key_tiles(lk, bk, device)
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
        klo, khi = tile_edges(lk, bk, device)
        n = self._len(device)
        full, empty = khi.view(1, 1, 1, -1) < n, klo.view(1, 1, 1, -1) >= n
        if self.queries:
            qlo, qhi = tile_edges(lq, bq, device, query_offset(lq, lk))
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

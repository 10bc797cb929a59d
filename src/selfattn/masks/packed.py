"""Packed variable-length sequences given by cumulative lengths (flash-attn's ``cu_seqlens``), each with
an optional band of diagonals aligned to its own bottom-right corner.

Sequence s holds query rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` and keys
``cu_seqlens_k[s]:cu_seqlens_k[s + 1]``; a row sees only keys of its own sequence. Queries and keys
may be packed with different lengths (cross-attention, or queries that are the last tokens of their
sequence), which ``document(ids)`` cannot say: it puts queries and keys on one axis. Within a
sequence of nq queries and nk keys, query row r (counted from the sequence's start) sits on the
diagonal of key ``r + nk - nq``, and ``left``/``right`` bound the keys it sees around that key, as
flash-attn's ``causal`` and ``window_size`` do in its varlen functions.

Every row then sees one contiguous range of keys, ``[lo[r], hi[r])``, and both ends never decrease
from row to row; the tile map is exact from that (a tile is full by its corner rows, empty by two
binary searches and a count of the rows that see any key).

Drawn for one sequence of 2 queries and 4 keys (``1`` = visible)::

    right=0 (causal)    left=1, right=0
    1 1 1 0             0 1 1 0
    1 1 1 1             0 0 1 1

Shape legend: N sequences, Tq/Tk packed query/key tokens (the call's Lq/Lk), bq/bk tile sizes,
nQ/nK numbers of tiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._kept import Snapshot
from .base import Device, Mask, query_offset, tile_edges

__all__ = ["Packed", "check_cu_seqlens", "packed"]

_INT_DTYPES = (torch.int32, torch.int64)


def _shown(t: Tensor) -> str:
    values = t.tolist()
    return str(values) if len(values) <= 12 else f"[{', '.join(map(str, values[:12]))}, ...] ({len(values)} entries)"


def check_cu_seqlens(cu: object, name: str) -> Tensor:
    """``cu`` as a 1-D int32/int64 tensor of N + 1 >= 2 cumulative lengths: 0 first, never decreasing.
    The checks of its values are skipped while compiling (they read data)."""
    t = cu if isinstance(cu, Tensor) else torch.as_tensor(cu)
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor of cumulative sequence lengths, got dtype "
                        f"{t.dtype}; convert it with .to(torch.int32)")
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"{name} must be 1-D with N + 1 >= 2 entries (0, then the running total of the N "
                         f"sequence lengths), got shape {tuple(t.shape)}; build it as "
                         "torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)")
    if torch.compiler.is_compiling():
        return t
    first_nonzero, decreasing = torch.stack([t[0] != 0, (t[1:] < t[:-1]).any()]).tolist()
    if first_nonzero:
        raise ValueError(f"{name} must start at 0, got {_shown(t)}; prepend the 0: "
                         f"torch.nn.functional.pad({name}, (1, 0))")
    if decreasing:
        at = int((t[1:] < t[:-1]).nonzero()[0, 0]) + 1
        raise ValueError(f"{name} must be non-decreasing (it is the running total of the lengths), but entry {at} "
                         f"({int(t[at])}) is below entry {at - 1} ({int(t[at - 1])}) in {_shown(t)}; build it "
                         "from lengths >= 0 with a cumulative sum")
    return t


def check_cu_seqlens_pair(cu_seqlens_q: object, cu_seqlens_k: object = None) -> tuple[Tensor, Tensor]:
    """Both checked with :func:`check_cu_seqlens` (k defaults to q), describing the same number of sequences."""
    cq = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
    ck = cq if cu_seqlens_k is None else check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    if ck.numel() != cq.numel():
        raise ValueError(f"cu_seqlens_q describes {cq.numel() - 1} sequences and cu_seqlens_k "
                         f"{ck.numel() - 1}; give both one entry per sequence plus the leading 0 "
                         "(an empty sequence repeats the previous total)")
    return cq, ck


def _check_band(name: str, value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"packed {name} must be None (unbounded) or an int >= 0, got {value!r}")
    return value


class Packed(Mask):
    """Query row r of sequence s sees key j when j is a key of sequence s and
    ``r + d[s] - left <= j <= r + d[s] + right``, with ``d[s] = cu_seqlens_k[s + 1] - cu_seqlens_q[s + 1]``
    (each sequence bottom-right aligned; None = unbounded on that side)."""

    def __init__(self, cu_seqlens_q: Tensor | Sequence[int], cu_seqlens_k: Tensor | Sequence[int] | None = None,
                 left: int | None = None, right: int | None = None) -> None:
        self.cu_seqlens_q, self.cu_seqlens_k = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k)
        self.left, self.right = _check_band("left", left), _check_band("right", right)

    def check(self, batch, heads, lq, lk):
        super().check(batch, heads, lq, lk)
        if torch.compiler.is_compiling():  # the totals are data
            return
        for name, cu, length, what in (("cu_seqlens_q", self.cu_seqlens_q, lq, "q"),
                                       ("cu_seqlens_k", self.cu_seqlens_k, lk, "k")):
            if (total := int(cu[-1])) != length:
                raise ValueError(f"{name} ends at {total} tokens but {what} has {length}; its last entry must be "
                                 f"the number of packed {what} tokens")

    def lengths(self) -> tuple[list[int], list[int]]:
        """(query lengths, key lengths) of the sequences, on the host: read once from the tensors (a copy
        to the host) and kept while they hold what they held (:class:`~selfattn._kept.Snapshot`)."""
        tensors = (self.cu_seqlens_q, self.cu_seqlens_k)
        kept = self.__dict__.get("_lengths")
        if kept is None or not kept[0].unchanged(tensors):
            q, k = ((cu[1:] - cu[:-1]).tolist() for cu in tensors)
            if not Snapshot.possible(tensors):
                return q, k
            kept = self.__dict__["_lengths"] = (Snapshot(tensors), (q, k))
        return kept[1]

    def longest(self) -> tuple[int, int]:
        """(the longest query sequence, the longest key sequence): what flash-attn's varlen kernels take as
        max_seqlen."""
        q, k = self.lengths()
        return max(q), max(k)

    def bounds(self, rows: Tensor, device: Device = None) -> tuple[Tensor, Tensor]:
        """(lo, hi): query row r sees keys ``lo[r] <= j < hi[r]`` (int64, the shape of ``rows``);
        both never decrease with r, and an empty range has ``lo >= hi``."""
        cq = self.cu_seqlens_q.to(device=device, dtype=torch.int64)
        ck = self.cu_seqlens_k.to(device=device, dtype=torch.int64)
        seq = (torch.searchsorted(cq, rows, right=True) - 1).clamp(0, cq.numel() - 2)  # each row's sequence
        k0, k1 = ck[seq], ck[seq + 1]
        diag = rows + k1 - cq[seq + 1]  # the key on the row's bottom-right aligned diagonal
        lo = k0 if self.left is None else torch.minimum(torch.maximum(diag - self.left, k0), k1)
        hi = k1 if self.right is None else torch.minimum(torch.maximum(diag + self.right + 1, k0), k1)
        return lo, hi

    def predicate(self, lq, lk, device=None):
        lo, hi = self.bounds(torch.arange(lq, device=device), device)
        off = query_offset(lq, lk)
        return lambda b, h, i, j: (j >= lo[i - off]) & (j < hi[i - off])

    def block(self, q0, q1, k0, k1, lq, lk, device=None):  # the block's rows only: O(rows) bounds, not O(Lq)
        lo, hi = self.bounds(torch.arange(q0, q1, device=device), device)
        j = torch.arange(k0, k1, device=device)
        return ((j >= lo[:, None]) & (j < hi[:, None]))[None, None]

    def _tile_bounds(self, lq, lk, bq, bk, device):
        lo, hi = self.bounds(torch.arange(lq, device=device), device)
        (qlo, qhi), (klo, khi) = tile_edges(lq, bq, device), tile_edges(lk, bk, device)
        full = (lo[qhi][:, None] <= klo[None, :]) & (hi[qlo][:, None] > khi[None, :])  # ends never decrease
        first = torch.searchsorted(hi, klo, right=True)  # rows >= first reach past the tile's first key
        last = torch.searchsorted(lo, khi, right=True) - 1  # rows <= last start at or before its last key
        a = torch.maximum(qlo[:, None], first[None, :])  # the tile's rows in [a, b] meet its keys ...
        b = torch.minimum(qhi[:, None], last[None, :])
        alive = torch.nn.functional.pad((lo < hi).cumsum(0), (1, 0))  # ... if they see any key at all
        seen = alive[(b + 1).clamp(0, lq)] - alive[a.clamp(0, lq)]
        empty = (a > b) | (seen == 0)
        return full[None, None], empty[None, None]

    def tensors(self):
        return (self.cu_seqlens_q, self.cu_seqlens_k)

    def __repr__(self) -> str:
        band = "".join(f", {n}={v}" for n, v in (("left", self.left), ("right", self.right)) if v is not None)
        cross = "" if self.cu_seqlens_k is self.cu_seqlens_q else ", cu_seqlens_k"
        return f"packed({self.cu_seqlens_q.numel() - 1} sequences{cross}{band})"


def packed(cu_seqlens_q: Tensor | Sequence[int], cu_seqlens_k: Tensor | Sequence[int] | None = None, *,
           left: int | None = None, right: int | None = None) -> Mask:
    """Packed variable-length sequences (flash-attn's varlen layout): a query sees the keys of its own
    sequence, optionally within a band around the sequence's own bottom-right aligned diagonal.

    Args:
        cu_seqlens_q: int32/int64 (N + 1,): 0, then the running total of the N sequences' query
            lengths; the last entry is the call's Lq. Empty sequences repeat the previous total.
        cu_seqlens_k: the same for the keys (the call's Lk); None: the queries' (self-attention).
        left: a query sees at most this many keys before its diagonal key; None: unbounded.
        right: ... and at most this many after it; None: unbounded. ``right=0`` is causal within each
            sequence (bottom-right aligned when its query and key lengths differ, as in flash-attn).

    A row that sees no key (an empty key sequence, or queries above a short sequence's diagonal) gives
    output 0. The mask broadcasts over batch items and heads.

    Example:
        >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)      # two sequences, of 3 and 2 tokens
        >>> masks.packed(cu, right=0).dense(5, 5)[0, 0].int()
        tensor([[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [0, 0, 0, 1, 0],
                [0, 0, 0, 1, 1]], dtype=torch.int32)
    """
    return Packed(cu_seqlens_q, cu_seqlens_k, left, right)

"""Which tokens each rank holds, and moving between a global tensor and the ranks' shards.

Layouts, drawn for W = 2, L = 8 (``r`` = the rank holding a token)::

    contiguous   0 0 0 0 1 1 1 1      rank r holds tokens [r L/W, (r + 1) L/W)
    zigzag       0 0 1 1 1 1 0 0      2W chunks; rank r holds chunks r and 2W - 1 - r
    balanced     0 1 1 0 0 1 0 1      K W chunks, K per rank, chosen so that every rank gets the
                                      same attention work (:func:`balanced`)

Every layout cuts the row into equal chunks of c tokens and gives each rank the same number of them.
A :class:`Sharding` says which chunks each rank holds for one global length; the names
"contiguous" and "zigzag" stand for theirs when L divides into them. A :class:`Sharding` may hold
more positions than the row (``padded > length``): :func:`shard` pads the row at its end,
:func:`selfattn.distributed.attention` masks the padding out (no real query sees it) and
:func:`unshard` drops it, so a row of any length is exact.

Shape legend: B batch, H heads, L the global length, W the world size, c tokens per chunk, K chunks
per rank, P the padded length (K W c >= L).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .group import Group, group_of

__all__ = ["LAYOUTS", "Layout", "Sharding", "balanced", "check_layout", "chunks_of", "num_chunks", "pair_work",
           "rank_order", "shard", "unshard"]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Sharding:
    """Which chunks of a row of ``length`` tokens each rank holds.

    Attributes:
        kind: "contiguous", "zigzag" or "balanced" (how the chunks were given out).
        length: L, the real tokens of the row.
        chunk: c, tokens per chunk.
        owners: per rank, the global ids of its chunks in its local order (the same count for every rank).

    Example:
        >>> lay = sad.Sharding.of("zigzag", length=1001, world=4)     # 1001 is not a multiple of 8: padded
        >>> lay.padded, lay.per_rank
        (1008, 252)
    """

    kind: str
    length: int
    chunk: int
    owners: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        per = {len(o) for o in self.owners}
        ids = sorted(c for o in self.owners for c in o)
        if len(per) != 1 or ids != list(range(len(ids))) or self.chunk < 1 or not 0 < self.length <= self.padded:
            raise ValueError(f"a Sharding gives every rank the same number of chunks, each chunk once, covering the "
                             f"{self.length} tokens; got chunk {self.chunk} and owners {self.owners}")

    @staticmethod
    def of(kind: str, length: int, world: int) -> Sharding:
        """The "contiguous" or "zigzag" layout of a row of ``length`` tokens on ``world`` ranks, padded at its end
        to the next multiple of W (2W for zigzag) where it is not one."""
        check_layout(kind)
        for name, v in (("length", length), ("world", world)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Sharding.of: {name} must be an int >= 1, got {v!r}")
        parts = num_chunks(kind, world)
        return Sharding(kind, length, -(-length // parts), tuple(tuple(chunks_of(kind, r, world))
                                                                  for r in range(world)))

    @property
    def world(self) -> int:
        return len(self.owners)

    @property
    def per_rank(self) -> int:
        """Tokens each rank holds (padding included)."""
        return len(self.owners[0]) * self.chunk

    @property
    def padded(self) -> int:
        """P: the positions of all chunks (>= length; the last P - L are padding)."""
        return self.chunk * sum(len(o) for o in self.owners)

    def positions(self, rank: int) -> Tensor:
        """(per_rank,) the global positions rank ``rank`` holds, in its local order (padding: >= length)."""
        return torch.cat([torch.arange(c * self.chunk, (c + 1) * self.chunk) for c in self.owners[rank]])


def check_layout(layout: object, world: int | None = None) -> str | Sharding:
    if isinstance(layout, Sharding):
        if world is not None and layout.world != world:
            raise ValueError(f"the Sharding was made for {layout.world} ranks, but the group has {world}")
        return layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous', 'zigzag' or a Sharding (see balanced()), got {layout!r}")
    return layout


def chunks_of(layout: str | Sharding, rank: int, world: int) -> list[int]:
    """The global chunk ids rank ``rank`` holds, in its local order."""
    if isinstance(layout, Sharding):
        return list(layout.owners[rank])
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def num_chunks(layout: str | Sharding, world: int) -> int:
    if isinstance(layout, Sharding):
        return sum(len(o) for o in layout.owners)
    return world if layout == "contiguous" else 2 * world


def rank_order(layout: str | Sharding, world: int) -> list[int]:
    """Global chunk ids in the order the ranks' shards concatenate."""
    return [cid for r in range(world) for cid in chunks_of(layout, r, world)]


def _document_ids(document_ids: Tensor | Sequence[int] | None, cu_seqlens: Tensor | Sequence[int] | None) -> Tensor:
    """(B, L) document ids from ids (L,) or (B, L), or from cu_seqlens (N + 1,) of one packed row."""
    if (document_ids is None) == (cu_seqlens is None):
        raise ValueError("balanced() takes the row's documents as document_ids (B, L) or as cu_seqlens (N + 1,), "
                         "one of the two")
    if cu_seqlens is not None:
        cu = torch.as_tensor(cu_seqlens).long().flatten().cpu()
        if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
            raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu.tolist()[:8]}")
        return torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())[None]
    ids = torch.as_tensor(document_ids)
    if ids.dtype.is_floating_point or ids.dim() not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(f"document_ids must be integers of shape (L,) or (B, L), got {ids.dtype} {tuple(ids.shape)}")
    return (ids if ids.dim() == 2 else ids[None]).long().cpu()


def pair_work(document_ids: Tensor, causal: bool = True, window: int | tuple[int, int] | None = None) -> Tensor:
    """(L,) the query-key pairs each query position attends to, summed over the batch rows: the keys of its
    document (a run of equal ids), before it when ``causal``, within ``window`` (left, or (left, right)) of it."""
    ids = _document_ids(document_ids, None)
    b, length = ids.shape
    if window is None:
        left, right = length, length
    elif isinstance(window, int):
        left, right = window, window
    else:
        left, right = window
    if causal:
        right = 0
    pos = torch.arange(length).expand(b, length)
    first = torch.ones(b, length, dtype=torch.bool)  # a position that starts its document
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    last = torch.ones(b, length, dtype=torch.bool)  # a position that ends it
    last[:, :-1] = ids[:, :-1] != ids[:, 1:]
    start = torch.cummax(torch.where(first, pos, 0), dim=1).values
    end = torch.cummin(torch.where(last, pos, length).flip(1), dim=1).values.flip(1)
    lo = torch.maximum(start, pos - left)
    hi = torch.minimum(end, pos + right)
    return (hi - lo + 1).clamp_min(0).sum(0)


def balanced(world: int, *, document_ids: Tensor | Sequence[int] | None = None,
             cu_seqlens: Tensor | Sequence[int] | None = None, causal: bool = True,
             window: int | tuple[int, int] | None = None, chunks_per_rank: int | None = None,
             tolerance: float = 0.01) -> Sharding:
    """A layout of a packed row that gives every rank the same attention work.

    The row is cut into K W chunks of equal size and each rank gets K of them, so that the query-key pairs
    the mask leaves (:func:`pair_work`: causal within documents, a sliding window) are shared evenly; a
    document may be split over several ranks. Chunks are given out largest work first, each to the rank with
    the least work that still takes chunks, and then pairs of chunks are swapped between the busiest rank and
    the others while that lowers the busiest rank's work. K is the smallest power of two from 2 whose
    max / mean work is within ``tolerance`` of 1 (chunks of at least 16 tokens), unless given.

    Args:
        world: W, the ranks.
        document_ids: (L,) or (B, L) document ids of the row (positions of equal ids in a run: one document).
        cu_seqlens: or (N + 1,) the documents' offsets in the row (the varlen API's form).
        causal: the attention is causal within documents.
        window: a sliding window: ``left`` keys before each query (``(left, right)`` for a bidirectional one).
        chunks_per_rank: K; None to choose it.
        tolerance: the max / mean work above 1 at which K stops growing.

    Returns:
        A :class:`Sharding` (kind "balanced"): pass it as ``layout`` to :func:`shard`, :func:`unshard` and
        :func:`selfattn.distributed.attention`. The row is padded at its end when K W does not divide L.

    Example:
        >>> lay = sad.balanced(4, cu_seqlens=cu)              # the same on every rank: computed from the batch
        >>> q_local = sad.shard(q, layout=lay)
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"balanced: world must be an int >= 1, got {world!r}")
    ids = _document_ids(document_ids, cu_seqlens)
    work = pair_work(ids, causal, window).double()
    length = work.numel()
    if chunks_per_rank is not None:
        if isinstance(chunks_per_rank, bool) or not isinstance(chunks_per_rank, int) or chunks_per_rank < 1:
            raise ValueError(f"balanced: chunks_per_rank must be an int >= 1, got {chunks_per_rank!r}")
        return _assign(work, world, chunks_per_rank)
    best: tuple[float, Sharding] | None = None
    k = 2
    while True:
        lay = _assign(work, world, k)
        loads = _loads(work, lay)
        ratio = float(loads.max() / loads.mean()) if float(loads.mean()) > 0 else 1.0
        if best is None or ratio < best[0] - 1e-12:
            best = (ratio, lay)
        if ratio <= 1 + tolerance or -(-length // (2 * k * world)) < 16:
            return best[1]
        k *= 2


def _loads(work: Tensor, lay: Sharding) -> Tensor:
    """(W,) each rank's work under ``lay``."""
    per_chunk = F.pad(work, (0, lay.padded - work.numel())).view(-1, lay.chunk).sum(1)
    return torch.stack([per_chunk[list(o)].sum() for o in lay.owners])


def _assign(work: Tensor, world: int, k: int) -> Sharding:
    """K chunks per rank: largest first to the least loaded rank with room, then swaps off the busiest rank."""
    length = work.numel()
    chunk = -(-length // (k * world))
    per_chunk = F.pad(work, (0, chunk * k * world - length)).view(-1, chunk).sum(1).tolist()
    loads, owners = [0.0] * world, [[] for _ in range(world)]  # type: ignore[var-annotated]
    for cid in sorted(range(len(per_chunk)), key=lambda c: -per_chunk[c]):
        r = min((r for r in range(world) if len(owners[r]) < k), key=lambda r: loads[r])
        owners[r].append(cid)
        loads[r] += per_chunk[cid]
    for _ in range(64):  # swap a chunk of the busiest rank for a lighter one of another rank
        top = max(range(world), key=lambda r: loads[r])
        best = None
        for r in range(world):
            if r == top:
                continue
            for a in owners[top]:
                for b in owners[r]:
                    d = per_chunk[a] - per_chunk[b]
                    if d > 0 and max(loads[top] - d, loads[r] + d) < loads[top] - 1e-9:
                        gain = loads[top] - max(loads[top] - d, loads[r] + d)
                        if best is None or gain > best[0]:
                            best = (gain, r, a, b, d)
        if best is None:
            break
        _, r, a, b, d = best
        owners[top][owners[top].index(a)], owners[r][owners[r].index(b)] = b, a
        loads[top] -= d
        loads[r] += d
    return Sharding("balanced", length, chunk, tuple(tuple(sorted(o)) for o in owners))


def shard(x: Tensor, *, group: dist.ProcessGroup | DeviceMesh | None = None, layout: Layout | Sharding = "contiguous",
          dim: int = 2, fill: float | int = 0) -> Tensor:
    """This rank's tokens of a global tensor (every rank passes the same ``x``).

    Args:
        x: a global tensor, (B, H, L, D) by default; any tensor with the sequence along ``dim``.
        group: the process group, or a one-dimensional DeviceMesh (``mesh["cp"]``); None for the default group.
        layout: "contiguous" (rank r holds tokens [r L/W, (r+1) L/W)), "zigzag" (2W chunks, rank r holds
            chunks r and 2W-1-r), or a :class:`Sharding` of a row of L tokens (:func:`balanced`,
            :meth:`Sharding.of` for a length the names do not divide).
        dim: the sequence dimension.
        fill: the value of the padding a :class:`Sharding` adds past the row's end (-100 for labels, say).

    Returns:
        (B, H, n, D): this rank's n = P / W tokens in its local order (a copy; differentiable).

    Example:
        >>> q_local = sad.shard(q, layout="zigzag")
    """
    check_layout(layout)
    if not isinstance(x, Tensor):
        raise TypeError(f"shard takes a tensor, got {type(x).__name__}")
    dim = _check_dim("shard", x, dim)
    g = group_of(group, None)
    check_layout(layout, g.world)
    length = x.shape[dim]
    if isinstance(layout, Sharding):
        if length != layout.length:
            raise ValueError(f"shard: the Sharding is for a row of {layout.length} tokens, but dim {dim} has {length}")
        if layout.padded > length:
            pad = [0, 0] * (x.dim() - 1 - dim) + [0, layout.padded - length]
            x = F.pad(x, pad, value=fill)
        c = layout.chunk
    else:
        parts = num_chunks(layout, g.world)
        if length % parts:
            raise ValueError(f"shard: the sequence length {length} (dim {dim}) must be divisible by "
                             f"{'W' if layout == 'contiguous' else '2W'} = {parts} for layout {layout!r} on "
                             f"{g.world} ranks; pass layout=Sharding.of({layout!r}, length={length}, "
                             f"world={g.world}), which pads it")
        c = length // parts
    return torch.cat([x.narrow(dim, cid * c, c) for cid in chunks_of(layout, g.rank, g.world)], dim=dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, g: Group, layout: str | Sharding, dim: int) -> Tensor:
        parts = [torch.empty_like(x) for _ in range(g.world)]
        xs = x.contiguous()
        if g.world > 1:
            work = dist.all_gather(parts, xs, group=g.group, async_op=True)
            g.wait([work], "unshard's all_gather", list(range(g.world)))
        else:
            parts = [xs]
        nc = num_chunks(layout, g.world)
        c = x.shape[dim] // (nc // g.world)
        chunks: list[Tensor | None] = [None] * nc
        for r, part in enumerate(parts):
            for i, cid in enumerate(chunks_of(layout, r, g.world)):
                chunks[cid] = part.narrow(dim, i * c, c)
        ctx.g, ctx.layout, ctx.dim, ctx.c = g, layout, dim, c
        whole = torch.cat(chunks, dim=dim)  # type: ignore[arg-type]
        return whole.narrow(dim, 0, layout.length) if isinstance(layout, Sharding) else whole

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        g: Group = ctx.g
        c, dim = ctx.c, ctx.dim
        if isinstance(ctx.layout, Sharding) and ctx.layout.padded > grad.shape[dim]:  # the padding has no gradient
            grad = F.pad(grad, [0, 0] * (grad.dim() - 1 - dim) + [0, ctx.layout.padded - grad.shape[dim]])
        own = [grad.narrow(dim, cid * c, c) for cid in chunks_of(ctx.layout, g.rank, g.world)]
        return torch.cat(own, dim=dim), None, None, None


def unshard(x_local: Tensor, *, group: dist.ProcessGroup | DeviceMesh | None = None,
            layout: Layout | Sharding = "contiguous", timeout: float | None = None, dim: int = 2) -> Tensor:
    """Gather every rank's tokens back into the global tensor, on every rank (the inverse of :func:`shard`).

    Args:
        x_local: (B, H, n, D) by default, this rank's tokens in the order :func:`shard` gives them; any
            tensor with this rank's tokens along ``dim`` (the same shape on every rank).
        group: the process group, or a one-dimensional DeviceMesh (``mesh["cp"]``); None for the default group.
        layout: the layout the tokens were sharded with.
        timeout: seconds to wait for the other ranks (default ``DEFAULT_TIMEOUT_S``; ``float("inf")``
            for no limit of its own).
        dim: the sequence dimension (as :func:`shard`'s).

    Returns:
        (B, H, L, D), the same on every rank, without the padding a :class:`Sharding` added. Its backward
        hands each rank its own tokens' gradient, which is right when every rank computes the same loss
        from the gathered tensor.

    Example:
        >>> out = sad.unshard(out_local, layout="zigzag")
        >>> logits = sad.unshard(logits_local, layout="zigzag", dim=1)   # (B, L / W, V) -> (B, L, V)
    """
    check_layout(layout)
    if not isinstance(x_local, Tensor):
        raise TypeError(f"unshard takes a tensor, got {type(x_local).__name__}")
    dim = _check_dim("unshard", x_local, dim)
    g = group_of(group, timeout)
    check_layout(layout, g.world)
    per = len(chunks_of(layout, g.rank, g.world))
    if x_local.shape[dim] % per:
        raise ValueError(f"unshard: a {layout if isinstance(layout, str) else layout.kind} shard holds {per} equal "
                         f"chunks, but it has {x_local.shape[dim]} tokens along dim {dim}")
    if isinstance(layout, Sharding) and x_local.shape[dim] != layout.per_rank:
        raise ValueError(f"unshard: the Sharding gives each rank {layout.per_rank} tokens, but this shard has "
                         f"{x_local.shape[dim]} along dim {dim}")
    _same_shape(g, x_local)
    return _Unshard.apply(x_local, g, layout, dim)


def _check_dim(what: str, x: Tensor, dim: object) -> int:
    """``dim`` as a non-negative dimension of ``x``, or ValueError naming the range."""
    rank = x.dim()
    if rank == 0 or isinstance(dim, bool) or not isinstance(dim, int) or not -rank <= dim < rank:
        raise ValueError(f"{what}: dim must be an int in [{-rank}, {rank}) for a tensor of shape {tuple(x.shape)}, "
                         f"got {dim!r}")
    return dim % rank


_SHAPE_FIELDS = 18  # rank, dtype, up to 16 sizes


def _same_shape(g: Group, x: Tensor) -> None:
    """Every rank must pass a tensor of the same shape and dtype (the gather needs it): compare them first, so that a
    mismatch is a ValueError on every rank rather than an abort on one and a wrong shape on another."""
    if g.world == 1:
        return
    fields = [x.dim(), zlib.crc32(str(x.dtype).encode()), *x.shape][:_SHAPE_FIELDS]
    mine = torch.tensor(fields + [-1] * (_SHAPE_FIELDS - len(fields)), dtype=torch.int64,
                        device=x.device if dist.get_backend(g.group) != "gloo" else "cpu")
    everyone = [torch.empty_like(mine) for _ in range(g.world)]
    work = dist.all_gather(everyone, mine, group=g.group, async_op=True)
    g.wait([work], "unshard's shape check", list(range(g.world)))
    if any(not torch.equal(t, everyone[0]) for t in everyone):
        shapes = {r: tuple(int(v) for v in t[2:2 + int(t[0])]) for r, t in enumerate(everyone)}
        raise ValueError(f"unshard: the ranks passed local tensors of different shapes or dtypes {shapes}: every rank "
                         "must pass its shard of the same global tensor (the same shape, and dtype)")

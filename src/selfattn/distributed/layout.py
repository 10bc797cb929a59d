"""Which tokens each rank holds, and moving between a global tensor and the ranks' shards.

Layouts, drawn for W = 2, L = 8 (``r`` = the rank holding a token)::

    contiguous   0 0 0 0 1 1 1 1      rank r holds tokens [r L/W, (r + 1) L/W)
    zigzag       0 0 1 1 1 1 0 0      2W chunks; rank r holds chunks r and 2W - 1 - r

Shape legend: B batch, H heads, L the global length, W the world size, c tokens per chunk.
"""

from __future__ import annotations

import zlib
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .group import Group, group_of

__all__ = ["LAYOUTS", "Layout", "check_layout", "chunks_of", "num_chunks", "rank_order", "shard", "unshard"]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    return layout


def chunks_of(layout: str, rank: int, world: int) -> list[int]:
    """The global chunk ids rank ``rank`` holds, in its local order."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def num_chunks(layout: str, world: int) -> int:
    return world if layout == "contiguous" else 2 * world


def rank_order(layout: str, world: int) -> list[int]:
    """Global chunk ids in the order the ranks' shards concatenate."""
    return [cid for r in range(world) for cid in chunks_of(layout, r, world)]


def shard(x: Tensor, *, group: dist.ProcessGroup | DeviceMesh | None = None, layout: Layout = "contiguous",
          dim: int = 2) -> Tensor:
    """This rank's tokens of a global tensor (every rank passes the same ``x``).

    Args:
        x: a global tensor, (B, H, L, D) by default; any tensor with the sequence along ``dim``.
        group: the process group, or a one-dimensional DeviceMesh (``mesh["cp"]``); None for the default group.
        layout: "contiguous" (rank r holds tokens [r L/W, (r+1) L/W)) or "zigzag" (2W chunks,
            rank r holds chunks r and 2W-1-r).
        dim: the sequence dimension.

    Returns:
        (B, H, L / W, D): this rank's tokens in its local order (a copy; differentiable).

    Example:
        >>> q_local = sad.shard(q, layout="zigzag")
    """
    check_layout(layout)
    if not isinstance(x, Tensor):
        raise TypeError(f"shard takes a tensor, got {type(x).__name__}")
    dim = _check_dim("shard", x, dim)
    g = group_of(group, None)
    length, parts = x.shape[dim], num_chunks(layout, g.world)
    if length % parts:
        raise ValueError(f"shard: the sequence length {length} (dim {dim}) must be divisible by "
                         f"{'W' if layout == 'contiguous' else '2W'} = {parts} for layout {layout!r} on "
                         f"{g.world} ranks; pad the sequence (and mask the padding with masks.padding)")
    c = length // parts
    return torch.cat([x.narrow(dim, cid * c, c) for cid in chunks_of(layout, g.rank, g.world)], dim=dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, g: Group, layout: str, dim: int) -> Tensor:
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
        ctx.g, ctx.layout, ctx.dim = g, layout, dim
        return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        g: Group = ctx.g
        c = grad.shape[ctx.dim] // num_chunks(ctx.layout, g.world)
        own = [grad.narrow(ctx.dim, cid * c, c) for cid in chunks_of(ctx.layout, g.rank, g.world)]
        return torch.cat(own, dim=ctx.dim), None, None, None


def unshard(x_local: Tensor, *, group: dist.ProcessGroup | DeviceMesh | None = None, layout: Layout = "contiguous",
            timeout: float | None = None, dim: int = 2) -> Tensor:
    """Gather every rank's tokens back into the global tensor, on every rank (the inverse of :func:`shard`).

    Args:
        x_local: (B, H, L / W, D) by default, this rank's tokens in the order :func:`shard` gives them; any
            tensor with this rank's tokens along ``dim`` (the same shape on every rank).
        group: the process group, or a one-dimensional DeviceMesh (``mesh["cp"]``); None for the default group.
        layout: the layout the tokens were sharded with.
        timeout: seconds to wait for the other ranks (default ``DEFAULT_TIMEOUT_S``; ``float("inf")``
            for no limit of its own).
        dim: the sequence dimension (as :func:`shard`'s).

    Returns:
        (B, H, L, D), the same on every rank. Its backward hands each rank its own tokens'
        gradient, which is right when every rank computes the same loss from the gathered tensor.

    Example:
        >>> out = sad.unshard(out_local, layout="zigzag")
        >>> logits = sad.unshard(logits_local, layout="zigzag", dim=1)   # (B, L / W, V) -> (B, L, V)
    """
    check_layout(layout)
    if not isinstance(x_local, Tensor):
        raise TypeError(f"unshard takes a tensor, got {type(x_local).__name__}")
    dim = _check_dim("unshard", x_local, dim)
    g = group_of(group, timeout)
    if layout == "zigzag" and x_local.shape[dim] % 2:
        raise ValueError(f"unshard: a zigzag shard holds two equal chunks, but it has {x_local.shape[dim]} tokens "
                         f"along dim {dim}")
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

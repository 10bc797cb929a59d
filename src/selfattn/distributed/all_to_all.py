"""All-to-all (Ulysses) context parallelism: sequence shards become head shards, any backend runs.

``all_to_all_single`` turns each rank's tokens of every head into every token of H / W heads, the
local ``selfattn.attention`` runs with the mask and score modifier sliced to those heads
(``Mask.heads``, ``ScoreMod.heads``: they see their global head index), and the inverse swap
returns the result; each swap's backward is the other swap.

Shape legend: B batch, Hx heads of a tensor, L the global length, W the world size, n = L / W
tokens per rank, c tokens per chunk, Dx its head dim.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional import attention as _local_attention
from ..masks import Mask
from ..scores import ScoreMod
from .group import Group
from .layout import Sharding, num_chunks, rank_order
from .spec import Spec

__all__ = ["all_to_all_attention"]


def _seq_to_heads(g: Group, layout: str | Sharding, x: Tensor) -> Tensor:
    """(B, Hx, n, Dx) sequence shard -> (B, Hx / W, L, Dx) head shard in global order."""
    b, hx, n, dx = x.shape
    w = g.world
    send = x.reshape(b, w, hx // w, n, dx).transpose(0, 1).contiguous()  # (W, B, Hx/W, n, Dx)
    recv = torch.empty_like(send)  # recv[src]: src's tokens of this rank's heads
    work = dist.all_to_all_single(recv, send, group=g.group, async_op=True)
    g.wait([work], "all_to_all (sequence to heads)", list(range(w)))
    nc = num_chunks(layout, w)
    c = w * n // nc
    by_rank = recv.permute(1, 2, 0, 3, 4).reshape(b, hx // w, nc, c, dx)  # chunks in rank order
    order = rank_order(layout, w)
    where = [order.index(cid) for cid in range(nc)]
    return by_rank[:, :, where].reshape(b, hx // w, nc * c, dx)


def _heads_to_seq(g: Group, layout: str | Sharding, x: Tensor) -> Tensor:
    """(B, Hx / W, L, Dx) head shard in global order -> (B, Hx, n, Dx) sequence shard."""
    b, hl, length, dx = x.shape
    w = g.world
    nc = num_chunks(layout, w)
    c = length // nc
    by_rank = x.reshape(b, hl, nc, c, dx)[:, :, rank_order(layout, w)]  # (B, Hx/W, nC, c, Dx)
    send = by_rank.reshape(b, hl, w, length // w, dx).permute(2, 0, 1, 3, 4).contiguous()  # (W, B, Hx/W, n, Dx)
    recv = torch.empty_like(send)  # recv[src]: this rank's tokens of src's heads
    work = dist.all_to_all_single(recv, send, group=g.group, async_op=True)
    g.wait([work], "all_to_all (heads to sequence)", list(range(w)))
    return recv.transpose(0, 1).reshape(b, w * hl, length // w, dx)


class _Swap(torch.autograd.Function):
    """Sequence shards to head shards (``to_heads``) or back; the backward swaps the other way."""

    @staticmethod
    def forward(ctx, x: Tensor, g: Group, layout: str | Sharding, to_heads: bool) -> Tensor:
        ctx.g, ctx.layout, ctx.to_heads = g, layout, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(g, layout, x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # the swap back, itself through this function: a second derivative (create_graph) goes through it too
        return _Swap.apply(grad, ctx.g, ctx.layout, not ctx.to_heads), None, None, None


def all_to_all_attention(g: Group, spec: Spec, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None]:
    """This rank's out (B, H, n, Dv), differentiable in q, k and v, and (with ``return_lse``) its lse."""
    h, w = q.shape[1], g.world
    count = h // w
    h0 = g.rank * count
    qh, kh, vh = (_Swap.apply(t, g, spec.layout, True) for t in (q, k, v))
    # through the classes: an object's own attribute named ``heads`` must not hide the method
    padded = isinstance(spec.layout, Sharding) and spec.layout.padded > spec.layout.length
    whole = spec.full_mask() if padded else spec.mask  # with padding, causal is folded into the cropped mask
    mask = None if whole is None else Mask.heads(whole, h0, count)
    mod = None if spec.score_mod is None else ScoreMod.heads(spec.score_mod, h0, count)
    cpu = q.device.type == "cpu"
    rng = contextlib.nullcontext() if spec.dropout_p == 0 else torch.random.fork_rng(
        devices=[] if cpu else [q.device.index], device_type="cuda" if cpu else q.device.type)
    with rng:
        if spec.dropout_p > 0:  # each head group draws its own pattern from the shared seed
            torch.manual_seed((spec.seed + 7919 * g.rank) % (1 << 62))
        sinks = None if spec.sinks is None else spec.sinks[h0:h0 + count]
        res = _local_attention(qh, kh, vh, mask=mask, causal=spec.causal and not padded, scale=spec.scale,
                               dropout_p=spec.dropout_p, backend=spec.backend, return_lse=spec.return_lse,
                               score_mod=mod, sinks=sinks)
    if not spec.return_lse:
        return _Swap.apply(res, g, spec.layout, False), None
    out_h, lse_h = res
    lse = _heads_to_seq(g, spec.layout, lse_h.detach().unsqueeze(-1)).squeeze(-1)
    return _Swap.apply(out_h, g, spec.layout, False), lse

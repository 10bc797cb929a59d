"""Ring attention: K/V blocks travel around the ring while the current block computes.

Every rank computes its query chunks against one owner's K/V chunks per step; chunk pairs the
tile map calls empty are skipped (their K/V still travel), and within a partial pair each
sub-block of at most ``_ROWS`` rows is trimmed to its non-empty tiles. Each block is computed by
the chunked backend's block kernel (``backends.chunked.kernels``: its terms, its forward and
backward, the merge by lse) on global positions; this module only moves blocks and decides which
to compute. The backward recomputes each block from the saved output and the global lse and sends
dK/dV around the ring back to their owners.

Shape legend: B batch, H query heads, Hkv key/value heads, L the global length, W the world size,
n = L / W tokens per rank, c tokens per chunk, D/Dv head dims, R query rows of one sub-block.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends._common import refuse_create_graph
from ..backends.chunked import kernels
from ..backends.chunked.kernels import Block, Merge, Problem
from ..masks import EMPTY, FULL, PARTIAL, Mask
from .group import Group, Stats, current_stats
from .layout import Sharding, chunks_of, num_chunks
from .spec import Spec

__all__ = ["ring_attention"]

_ROWS = 256  # query rows of one sub-block
_SCORE_BYTES = 1 << 28  # one sub-block's (B, H, R, c) scores stay under 256 MiB in compute dtype
_KEYS = 1024  # keys of one piece of a sub-block (rounded to a multiple of the sub-block's rows)


@dataclass(frozen=True)
class Ring:
    """What every block of one ring call needs.

    Attributes:
        problem: the call as its blocks see it (global lengths, mask with causal folded in).
        classes: EMPTY / PARTIAL / FULL per (query chunk, key chunk), over batch and heads.
        sub: query rows of a sub-block (and keys of a fine tile).
        keys: keys of one piece of a sub-block, a multiple of ``sub`` (a sub-block's keys are cut into
            pieces, merged by lse, so that its (B, H, R, keys) scores do not grow with the chunk).
        fine: classes of (sub x sub) tiles of the whole call, (L / sub, L / sub), or None.
        fused: blocks run in the fused kernel (else in plain math).
        memory: "overlap" or "low", how the backward's dK/dV travel (see :func:`_backward`).
    """

    g: Group
    problem: Problem
    layout: str | Sharding
    chunk: int
    classes: list[list[int]]
    sub: int
    keys: int
    fine: Tensor | None
    fused: bool
    stats: Stats | None
    memory: str = "overlap"


def _classes(mask: Mask, length: int, tile: int, device: torch.device) -> Tensor:
    """EMPTY / PARTIAL / FULL of every (tile x tile) square of the call, over batch and heads: (L / tile,) * 2."""
    t = mask.tiles(length, length, tile, tile, device).cpu()  # (B', H', n, n)
    empty, full = (t == EMPTY).flatten(0, 1).all(0), (t == FULL).flatten(0, 1).all(0)
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL))


def _ring(g: Group, spec: Spec, q: Tensor, v: Tensor) -> Ring:
    """The ring of a call. The sub-block size R is at most ``_ROWS`` (less where (B, H, R, c) scores
    would pass ``_SCORE_BYTES``), and a sub-block's keys are computed in pieces of ``_KEYS``, so the
    scores in flight have a size that does not grow with the chunk; when R divides the chunk, a fine
    tile map trims each sub-block's keys (and skips pieces) to the tiles the mask leaves non-empty."""
    b, h, n, d = q.shape
    length = n * g.world
    c = length // num_chunks(spec.layout, g.world)
    mask = spec.full_mask()
    problem = Problem.of(q, q, scale=spec.scale, mask=mask, score_mod=spec.score_mod, dropout_p=spec.dropout_p,
                         seed=spec.seed, lengths=(length, length))
    most = max(1, min(c, _ROWS, _SCORE_BYTES // max(1, b * h * c * 8)))
    divisor = max(x for x in range(1, most + 1) if c % x == 0)
    sub = divisor if divisor >= min(32, most) else most
    nc = length // c
    classes = [[FULL] * nc for _ in range(nc)] if mask is None else _classes(mask, length, c, q.device).tolist()
    fine = _classes(mask, length, sub, q.device) if mask is not None and c % sub == 0 and sub < c else None
    fused = (problem.dropout is None and (spec.score_mod is None or spec.score_mod.additive)
             and kernels.fused_available(q.device, d, v.shape[3]))
    keys = max(sub, _KEYS // sub * sub)
    return Ring(g, problem, spec.layout, c, classes, sub, keys, fine, fused, current_stats(), spec.memory)


class _Visit(NamedTuple):
    """One sub-block: local query rows and local keys of the block being visited, the same as a
    block of the whole call, and whether its mask is needed."""

    rows: slice
    keys: slice
    block: Block
    partial: bool


def _visit(ring: Ring, owner: int) -> Iterator[_Visit]:
    """Every sub-block to compute against ``owner``'s keys. Pairs of chunks the mask leaves empty are
    skipped, and within a partial pair each sub-block's keys are trimmed to its non-empty tiles."""
    c, sub, g = ring.chunk, ring.sub, ring.g
    for ai, a in enumerate(chunks_of(ring.layout, g.rank, g.world)):
        for bi, kb in enumerate(chunks_of(ring.layout, owner, g.world)):
            cls = ring.classes[a][kb]
            if cls == EMPTY:
                if ring.stats is not None:
                    ring.stats.skipped += 1
                continue
            if ring.stats is not None:
                ring.stats.blocks += 1
            for r0 in range(0, c, sub):
                rows, k0, k1, partial = min(sub, c - r0), 0, c, cls != FULL
                if partial and ring.fine is not None:
                    tiles = ring.fine[(a * c + r0) // sub, kb * c // sub:(kb + 1) * c // sub]
                    live = (tiles != EMPTY).nonzero().flatten().tolist()
                    if not live:
                        continue
                    k0, k1 = live[0] * sub, (live[-1] + 1) * sub
                    partial = bool((tiles[live[0]:live[-1] + 1] != FULL).any())
                if ring.stats is not None:
                    ring.stats.work += rows * (k1 - k0)
                q0 = a * c + r0
                for p0 in range(k0, k1, ring.keys):  # at most ``keys`` keys a piece: the scores' size is fixed
                    p1 = min(k1, p0 + ring.keys)
                    piece_partial = partial
                    if partial and ring.fine is not None:
                        tiles = ring.fine[(a * c + r0) // sub, (kb * c + p0) // sub:(kb * c + p1) // sub]
                        if bool((tiles == EMPTY).all()):
                            continue
                        piece_partial = bool((tiles != FULL).any())
                    yield _Visit(slice(ai * c + r0, ai * c + r0 + rows), slice(bi * c + p0, bi * c + p1),
                                 Block(range(q0, q0 + rows), range(kb * c + p0, kb * c + p1)), piece_partial)


class _Pass:
    """One ring hop in flight: send ``bufs`` to the next rank, receive their twins from the previous one."""

    def __init__(self, ring: Ring, bufs: Sequence[Tensor], what: str) -> None:
        g = ring.g
        self.ring, self.what = ring, what
        self.nxt, self.prv = (g.rank + 1) % g.world, (g.rank - 1) % g.world
        self.incoming = [torch.empty_like(b) for b in bufs]
        # the sends are waited for first: a next rank that is gone is then named even where the previous
        # rank, its own neighbour, failed in turn (and went away) before this rank looked
        ops = [dist.P2POp(dist.isend, b, g.peer(self.nxt), g.group) for b in bufs]
        ops += [dist.P2POp(dist.irecv, b, g.peer(self.prv), g.group) for b in self.incoming]
        self.works = dist.batch_isend_irecv(ops)
        self.peers = [self.nxt] * len(bufs) + [self.prv] * len(bufs)  # of each op (a backend may coalesce them)
        if ring.stats is not None:
            ring.stats.sent_bytes += sum(b.numel() * b.element_size() for b in bufs)

    def result(self) -> list[Tensor]:
        waited = self.ring.g.wait(self.works, self.what, self.peers)
        self.works = []  # a finished transfer holds its tensors: the sent buffers can go
        if self.ring.stats is not None:
            self.ring.stats.wait_s += waited
        return self.incoming


def _rows(rows: slice) -> operator.itemgetter:
    """Rows ``rows`` of a (B, H, n[, E]) tensor."""
    return operator.itemgetter((slice(None), slice(None), rows))


def _forward(ring: Ring, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    p, g = ring.problem, ring.g
    ct = p.compute_dtype
    b, h, n, _ = q.shape
    merged = Merge.empty((b, h, n), v.shape[3], ct, q.device)
    kv = [k.contiguous(), v.contiguous()]  # sent as they are: no packed copy of this rank's block
    for s in range(g.world):
        step = _Pass(ring, kv, "a K/V block") if s < g.world - 1 else None
        kb, vb = kv
        t0 = time.perf_counter()
        for vis in _visit(ring, (g.rank - s) % g.world):
            terms = p.terms(vis.block, q.device, partial=vis.partial, kernel_causal=ring.fused)
            o, lse = kernels.forward(p, q[:, :, vis.rows].to(ct), kb[:, :, vis.keys].to(ct),
                                     vb[:, :, vis.keys].to(ct), terms, fused=ring.fused)
            merged.part(_rows(vis.rows)).add(o, lse)
        if ring.stats is not None:
            ring.stats.compute_s += time.perf_counter() - t0
        if step is not None:
            kv = step.result()
    if sinks is None:
        return merged.result(q.dtype)
    out, lse = kernels.add_sinks(*merged.result(), sinks)  # once, on the merged rows of every key
    return out.to(q.dtype), lse


def _backward(ring: Ring, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of this rank. At step s this rank adds its share of the dK/dV of the block it holds then
    (owned by rank - s) to the accumulator the previous rank sends, and sends it on; after the last hop each
    rank holds its own block's. ``ring.memory`` "overlap": this step's share goes to a buffer of its own
    while the accumulator travels, then is added to it; "low": the accumulator is waited for first and the
    blocks add into it (two K/V-sized buffers fewer; the hop's transfer is not hidden)."""
    p, g = ring.problem, ring.g
    ct = lse.dtype
    delta = kernels.rowsum_dout_out(dout, out, ct)  # (B, H, n)
    lse_b = kernels.lse_for_backward(lse)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    overlap = ring.memory == "overlap"
    grad_step: _Pass | None = None
    acc: list[Tensor] = []
    for s in range(g.world):
        if grad_step is None or overlap:  # a zeroed buffer of this step's own
            acc = [torch.zeros(t.shape, dtype=ct, device=t.device) for t in (k, v)]
        else:  # the dK/dV accumulated so far for this block, added to in place (waited for before the next
            acc = grad_step.result()  # K/V hop is posted, so that the buffer it sent is gone first)
        kv_step = _Pass(ring, kv, "a K/V block (backward)") if s < g.world - 1 else None
        kb, vb = kv
        dk, dv = acc
        t0 = time.perf_counter()
        for vis in _visit(ring, (g.rank - s) % g.world):
            rows, keys = vis.rows, vis.keys
            terms = p.terms(vis.block, q.device, partial=vis.partial, kernel_causal=ring.fused)
            gq, gk, gv = kernels.backward(p, q[:, :, rows].to(ct), kb[:, :, keys].to(ct), vb[:, :, keys].to(ct),
                                          dout[:, :, rows].to(ct), out[:, :, rows].to(ct), lse_b[:, :, rows], terms,
                                          fused=ring.fused, delta=delta[:, :, rows])
            dq[:, :, rows] += gq
            dk[:, :, keys] += gk
            dv[:, :, keys] += gv
        if ring.stats is not None:
            ring.stats.compute_s += time.perf_counter() - t0
        if overlap and grad_step is not None:  # this step's share into the received accumulator
            acc = [got.add_(mine) for got, mine in zip(grad_step.result(), acc, strict=True)]
        del dk, dv, kb, vb
        kv = kv_step.result() if kv_step is not None else []  # after the last step no block is needed
        if g.world > 1:  # the accumulated dK/dV go on to the rank that computes with this block next
            grad_step = _Pass(ring, acc, "a dK/dV block")
    if grad_step is not None:
        acc = grad_step.result()  # after the last hop each rank holds its own block's dK/dV
    dk, dv = acc
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, ring: Ring) -> tuple[Tensor, Tensor]:
        out, lse = _forward(ring, q, k, v, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None, None]:
        refuse_create_graph("the ring's attention")
        q, k, v, out, lse, sinks = ctx.saved_tensors
        with torch.no_grad():  # with sinks, the sink-included out and lse make the blocks' backward that of the
            dq, dk, dv = _backward(ctx.ring, q, k, v, out, lse, dout)  # softmax with the sink: nothing else changes
            dsinks = None if sinks is None else kernels.sinks_grad(dout, out, lse, sinks)  # this rank's rows
        return dq, dk, dv, dsinks, None


def ring_attention(g: Group, spec: Spec, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's (out (B, H, n, Dv) in q's dtype, lse (B, H, n) in the compute dtype), differentiable
    in q, k, v and the sinks (whose gradient is this rank's rows' share, like any replicated parameter's)."""
    return _RingAttention.apply(q, k, v, spec.sinks, _ring(g, spec, q, v))

"""What a chunked call computes: the mask's tile map turned into key spans per query block.

For each query block, the tiles of the mask's tile map group into spans of fully visible tiles
(computed with no mask), partly visible tiles (with the mask of just that span) and empty tiles
(skipped). One schedule is shared by the batch unless per-item schedules skip clearly more.
:class:`Plan` holds a call's schedule with its :class:`~.kernels.Problem`, for the forward and the
backward alike.

Plan once, run many: the part of a plan that depends only on the mask, the lengths and the tile sizes
(its :class:`Layout`: schedule, query block, share of empty tiles, the fused kernel's runs) is made once
and kept on the mask object, keyed on the lengths, tile options and device, and trusted only while
the mask's tensors hold what they held (:class:`~selfattn._kept.Snapshot`: their versions, and the
values of those on the CPU, which NumPy may have written). Dispatch's cost model reads the same layout
(:func:`layout`), so a call builds its tile maps once, and the layers and steps that pass the same mask
object build none (as FlexAttention's BlockMask or FlashInfer's ``plan()`` / ``run()``).

Shape legend: B batch, Lq/Lk lengths, bq/bk block sizes, nQ/nK numbers of blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..._kept import Snapshot
from ...masks import EMPTY, FULL, PARTIAL, Mask
from .kernels import Block, Problem
from .options import ChunkedOptions, current_options

__all__ = ["Layout", "Plan", "QueryBlock", "Schedule", "Span", "layout", "schedule"]


class Span(NamedTuple):
    """Keys ``k0:k1`` of one query block, masked only when ``partial``."""

    k0: int
    k1: int
    partial: bool

    @property
    def keys(self) -> range:
        return range(self.k0, self.k1)


@dataclass(frozen=True)
class Schedule:
    """Batch items that share one schedule: for each query block, the key spans it computes."""

    batch: slice
    spans: list[list[Span]]


@dataclass(frozen=True)
class QueryBlock:
    """One query block of one schedule: batch items, query rows and the key spans they compute."""

    items: slice
    rows: range
    spans: list[Span]

    def block(self, span: Span) -> Block:
        """The kernel's block of one of these spans."""
        return Block(self.rows, span.keys, self.items)


def _tile_classes(mask: Mask | None, lq: int, lk: int, bq: int, bk: int, device: torch.device) -> Tensor:
    """EMPTY / PARTIAL / FULL per (batch item or 1, query block, key tile), over all heads."""
    nq, nk = -(-lq // bq), -(-lk // bk)
    if mask is None:
        return torch.full((1, nq, nk), FULL, dtype=torch.int8)
    tiles = mask.tiles(lq, lk, bq, bk, device).cpu()  # (B', H', nQ, nK)
    empty, full = (tiles == EMPTY).all(1), (tiles == FULL).all(1)
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)


def _coarsen(classes: Tensor, r: int) -> Tensor:
    """The classes of query blocks r times taller, from (B', nQ, nK) ones: a tall block's tile is EMPTY
    (FULL) only where each of its r tiles is; the last tall block takes the blocks that are left."""
    if r == 1:
        return classes
    b, nq, nk = classes.shape
    pad = -nq % r
    if pad:  # rows past Lq: they neither see a key nor hide one
        filler = classes[:, -1:].expand(b, pad, nk)
        classes = torch.cat([classes, filler], dim=1)
    grouped = classes.view(b, -1, r, nk)
    empty, full = (grouped == EMPTY).all(2), (grouped == FULL).all(2)
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)


def _union(classes: Tensor) -> Tensor:
    """One tile map valid for every batch item: (nQ, nK)."""
    empty, full = (classes == EMPTY).all(0), (classes == FULL).all(0)
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL))


def schedule(mask: Mask | None, lq: int, lk: int, *, block_q: int, fused: bool = True,
             device: torch.device | str = "cpu", opts: ChunkedOptions | None = None,
             classes: Tensor | None = None) -> list[Schedule]:
    """The key spans each query block of a call computes, per group of batch items.

    One schedule is shared across the batch unless per-item schedules skip >= 10% more tiles
    (e.g. padding masks with very different lengths). Key tiles come from ``opts`` (default:
    the :func:`~.options.options` in force); ``classes``: the tile classes at ``block_q`` when
    they are already known, else read from the mask's tile map.
    """
    opts = opts or current_options()
    if classes is None:
        classes = _tile_classes(mask, lq, lk, block_q, opts.block_k, torch.device(device))
    max_keys = None if fused else opts.math_span_keys
    union = _union(classes)
    if classes.shape[0] > 1:
        shared = int((union != EMPTY).sum()) * classes.shape[0]
        separate = int((classes != EMPTY).sum())
        if separate <= 0.9 * shared:
            return [Schedule(slice(b, b + 1), _spans(classes[b].tolist(), lk, opts.block_k, max_keys))
                    for b in range(classes.shape[0])]
    return [Schedule(slice(None), _spans(union.tolist(), lk, opts.block_k, max_keys))]


def _spans(classes: list[list[int]], lk: int, bk: int, max_keys: int | None) -> list[list[Span]]:
    """Group each query block's key tiles into spans of one class, skipping empty tiles."""
    out = []
    for row in classes:
        spans: list[Span] = []
        for kb, c in enumerate(row):
            if c == EMPTY:
                continue
            k0, k1, partial = kb * bk, min((kb + 1) * bk, lk), c != FULL
            last = spans[-1] if spans else None
            if (last is not None and last.k1 == k0 and last.partial == partial
                    and (max_keys is None or k1 - last.k0 <= max_keys)):
                spans[-1] = Span(last.k0, k1, partial)
            else:
                spans.append(Span(k0, k1, partial))
        out.append(spans)
    return out


def _block_q(mask: Mask | None, lq: int, lk: int, fused: bool, device: torch.device,
             opts: ChunkedOptions) -> tuple[int, Tensor | None]:
    """Query block size: small where the mask leaves few keys per row (finer skipping), large
    where rows see many keys (the fused kernel is up to 1.4x faster on 1024-row calls than on
    128-row ones, measured on a 2-core CPU). With it, the tile classes at that size when the
    choice read them (made once from the mask's tile map at the smallest size, then coarsened)."""
    if opts.block_q is not None:
        return opts.block_q, None
    if not fused:
        return opts.math_block_q, None
    classes = _tile_classes(mask, lq, lk, opts.math_block_q, opts.block_k, device)
    visible_keys = opts.block_k * float((classes != EMPTY).sum(-1).float().mean())
    bq = opts.math_block_q
    while bq < 1024 and bq * 2 <= visible_keys / 2:
        bq *= 2
    return bq, _coarsen(classes, bq // opts.math_block_q)


@dataclass(frozen=True)
class Layout:
    """What a plan takes from the mask, the lengths and the tile sizes alone (no tensor values of q, k,
    v): the schedule, the query block, the share of (query block, key tile) pairs no item computes, and
    the fused kernel's runs per batch size and device (filled by :func:`.runs.runs` on first use)."""

    groups: list[Schedule]
    bq: int
    bk: int
    fused: bool
    empty_fraction: float
    runs: dict[tuple[Any, ...], Any] = field(default_factory=dict, compare=False, repr=False)


_LAYOUTS_ATTR = "_selfattn_layouts"
_LAYOUTS_KEPT = 8  # layouts kept per mask object (lengths x tile options x devices), oldest dropped first
_NO_MASK: dict[tuple[Any, ...], Layout] = {}  # the layouts of unmasked calls


def _make_layout(mask: Mask | None, lq: int, lk: int, fused: bool, device: torch.device,
                 opts: ChunkedOptions) -> Layout:
    bq, classes = _block_q(mask, lq, lk, fused, device, opts)
    groups = schedule(mask, lq, lk, block_q=bq, fused=fused, device=device, opts=opts, classes=classes)
    nq, nk, bk = -(-lq // bq), -(-lk // opts.block_k), opts.block_k
    computed: list[set[int]] = [set() for _ in range(nq)]  # per query block: the key tiles some batch item computes
    for group in groups:
        for qi, spans in enumerate(group.spans):
            for span in spans:
                computed[qi].update(range(span.k0 // bk, -(-span.k1 // bk)))
    return Layout(groups, bq, bk, fused, 1.0 - sum(map(len, computed)) / max(nq * nk, 1))


def layout(mask: Mask | None, lq: int, lk: int, *, fused: bool, device: torch.device,
           opts: ChunkedOptions) -> Layout:
    """The layout of a call, made once per (mask object, lengths, tile options, device) and reused while
    the mask's tensors hold what they held (their versions, and the values of those on the CPU: a
    :class:`~selfattn._kept.Snapshot`); made afresh when a tensor cannot say its version (inference
    mode) and under ``torch.compile`` (whose op makes its plan inside)."""
    tensors = () if mask is None else mask.tensors()
    if not Snapshot.possible(tensors):
        return _make_layout(mask, lq, lk, fused, device, opts)
    store: dict[tuple[Any, ...], Layout]
    if mask is None:
        store = _NO_MASK
    else:
        kept = mask.__dict__.get(_LAYOUTS_ATTR)
        if kept is None or not kept[0].unchanged(tensors):
            kept = mask.__dict__[_LAYOUTS_ATTR] = (Snapshot(tensors), {})
        store = kept[1]
    key = (lq, lk, fused, device, opts)
    if (hit := store.get(key)) is not None:
        return hit
    made = store[key] = _make_layout(mask, lq, lk, fused, device, opts)
    while len(store) > _LAYOUTS_KEPT:
        store.pop(next(iter(store)))
    return made


@dataclass(frozen=True)
class Plan:
    """Everything the forward and backward of one chunked call share: the problem its blocks
    solve, the layout made from the mask's tensors as they were when the plan was built (schedule,
    tile sizes, kernel), and the mask's version then (checked again by the backward)."""

    problem: Problem
    groups: list[Schedule]
    bq: int
    bk: int
    fused: bool
    mask_version: tuple[int, ...] | None = None
    layout: Layout | None = field(default=None, compare=False, repr=False)
    deterministic: bool = False  # the backward runs a score modifier's own backward in torch's deterministic mode

    @classmethod
    def build(cls, problem: Problem, device: torch.device, *, fused: bool, opts: ChunkedOptions,
              mask_version: tuple[int, ...] | None = None, deterministic: bool = False) -> Plan:
        """The plan of ``problem`` under ``opts`` on ``device``; its layout from :func:`layout`."""
        made = layout(problem.mask, problem.lq, problem.lk, fused=fused, device=device, opts=opts)
        return cls(problem, made.groups, made.bq, made.bk, fused, mask_version, made, deterministic)

    def steps(self) -> Iterator[QueryBlock]:
        """Every query block of every group, with the spans it computes."""
        lq = self.problem.lq
        for group in self.groups:
            for qi, spans in enumerate(group.spans):
                yield QueryBlock(group.batch, range(qi * self.bq, min((qi + 1) * self.bq, lq)), spans)

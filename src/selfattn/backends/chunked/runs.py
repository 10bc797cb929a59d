"""The fused kernel's runs: the spans of a plan grouped into batched calls.

Each span as its own call pays a fixed cost: Python, the op's set-up and waking the thread pool
for the call and for every small merge after it, which on a busy 2-core machine reaches
milliseconds per parallel region (an add of 64K floats: 7.6 ms loaded, 0.05 ms idle). A sliding
window is hundreds of small spans, so the fused path groups the spans that share a shape and a
verified visibility pattern into :class:`Run` s, each computed in one call with its spans stacked in
the kernel's batch dim as strided views (:mod:`.views`). A band's spans in one query block first
become one span; a causal mask alone is one call, the kernel's own causal.

Shape legend: B batch, Hq query heads, R rows of a span, C its keys.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Literal

import torch
from torch import Tensor

from ...masks import EMPTY, FULL, PARTIAL, Causal
from .kernels import Block, items_of
from .plan import Plan, QueryBlock, Span

__all__ = ["Run", "run_mask", "runs"]

_PATTERN_ELEMENTS = 1 << 24
"""The most block-mask elements kept while spans are compared (16 MiB of bools): spans whose
pattern finds no room get a pattern of their own and run alone."""

_COALESCE_KEYS = 8
"""A query block's spans become one masked span only when they cover at most this many keys per
query row: a band such as a sliding window, where one larger call and no merge of partial results
beat three calls that skip some masked work (sliding_window(256) at L = 16384, 128-row blocks: a
128 x 384 masked span is 1.6x faster in the forward than the three 128 x 128 spans it replaces,
1.3x in the backward, whose kernel barely skips a causal diagonal); never a causal staircase."""

RunKind = Literal["full", "causal", "masked", "biased"]


@dataclass(frozen=True)
class Run:
    """Spans that one batched call of the fused kernel computes: ``n`` spans of ``rows`` query rows
    and ``keys`` keys, the i-th at rows ``q0 + i * dq`` and keys ``k0 + i * dk``. Equal steps let one
    strided view of q, k, v (and of the accumulators) stand for all of them, with no copy.

    kind: "full" (no mask), "causal" (the kernel's top-left causal flag, no mask), "masked" (the
    mask's block of the first span, verified equal for every span when the run was formed) or
    "biased" (one span, with its own bias; ``partial`` says whether it is masked too).
    """

    batch: slice
    q0: int
    k0: int
    dq: int
    dk: int
    n: int
    rows: int
    keys: int
    kind: RunKind
    partial: bool = False
    visible: Tensor | None = field(default=None, compare=False, repr=False)  # a masked run's block, if kept

    def members(self, i0: int, i1: int) -> Run:
        """Spans i0:i1 of this run."""
        return replace(self, q0=self.q0 + i0 * self.dq, k0=self.k0 + i0 * self.dk, n=i1 - i0)

    def first_block(self) -> Block:
        """The kernel's block of the first span."""
        return Block(range(self.q0, self.q0 + self.rows), range(self.k0, self.k0 + self.keys), self.batch)


class _Patterns:
    """Classifies the visibility of partial spans: nothing visible (skipped), every key (no mask),
    top-left causal (the kernel's causal flag, no mask), or a block mask. Spans get one pattern id
    only when their blocks are verified equal: for shift-invariant masks by their offset from the
    diagonal, for masks with tensors by comparing the blocks themselves.

    Masks with tensors are also looked at item by item and tile by tile: a span of a schedule
    shared by items of different padded lengths is often fully visible then causal for one item
    and empty for the other, and needs no mask once cut there."""

    FULL, CAUSAL = 0, 1

    def __init__(self, plan: Plan, device: torch.device) -> None:
        mask = plan.problem.mask
        self.plan, self.device = plan, device
        self.shift_invariant = mask is not None and mask.shift_invariant()
        self.by_offset: dict[tuple[int, int, int], int | None] = {}  # (rows, keys, k0 - q0) -> id
        self.kept: dict[tuple[object, ...], list[int]] = {}  # (shape, visible keys per row) -> ids
        self.blocks: dict[int, Tensor] = {}  # id -> its block, while they fit in _PATTERN_ELEMENTS
        self.kept_elements = 0
        self.next_id = 2

    def find(self, block: Block) -> list[tuple[Block, int]]:
        """The pieces of a partial span with their pattern ids: the whole span and batch group, or
        (masks with tensors) the span cut where its items' blocks differ and where its tiles change
        between empty, fully visible and partly visible. Pieces that see nothing are left out; two
        pieces of one shape get one id only when their visibility is the same."""
        rows, keys = len(block.rows), len(block.keys)
        if self.shift_invariant:
            offset = (rows, keys, block.keys.start - block.rows.start)
            if offset not in self.by_offset:
                self.by_offset[offset] = self._classify(self._block(block), rows, keys, keep=False)
            pid = self.by_offset[offset]
            return [] if pid is None else [(block, pid)]
        visible = self._block(block)
        if visible.shape[0] > 1 and torch.equal(visible, visible[:1].expand_as(visible)):
            visible = visible[:1]
        first = block.items.indices(self.plan.problem.batch)[0]
        items = ([block.items] if visible.shape[0] == 1
                 else [slice(first + i, first + i + 1) for i in range(visible.shape[0])])
        out = []
        k0 = block.keys.start
        for i, item in enumerate(items):
            vis = visible[i:i + 1]
            for a, b in self._stretches(vis, keys):
                pid = self._classify(vis if b - a == keys else vis[..., a:b], rows, b - a, keep=True)
                if pid is not None:
                    out.append((Block(block.rows, range(k0 + a, k0 + b), item), pid))
        return out

    def _stretches(self, visible: Tensor, keys: int) -> list[tuple[int, int]]:
        """The span's keys cut into stretches of whole tiles of one class (empty ones left out):
        the fully visible stretches then need no mask."""
        bk = self.plan.bk
        if keys <= bk or visible.shape[3] == 1:
            return [(0, keys)]
        tiles = -(-keys // bk)
        flat = visible.expand(*visible.shape[:3], keys).flatten(0, 2)
        counts = torch.cat([flat.sum(0, dtype=torch.int32),  # rows that see each key; padded: every row
                            flat.new_full((tiles * bk - keys,), flat.shape[0], dtype=torch.int32)]).view(tiles, bk)
        some, full = (counts > 0).any(1).tolist(), (counts == flat.shape[0]).all(1).tolist()
        out: list[tuple[int, int, int]] = []
        for t in range(tiles):
            c = FULL if full[t] else PARTIAL if some[t] else EMPTY
            if out and out[-1][2] == c:
                out[-1] = (out[-1][0], min((t + 1) * bk, keys), c)
            else:
                out.append((t * bk, min((t + 1) * bk, keys), c))
        return [(a, b) for a, b, c in out if c != EMPTY]

    def _block(self, block: Block) -> Tensor:
        visible = self.plan.problem.visible(block, self.device)
        assert visible is not None
        return visible

    def _classify(self, visible: Tensor, rows: int, keys: int, keep: bool) -> int | None:
        """The id of a block's pattern. One pass counts each row's visible keys: that says empty,
        full and "maybe causal", and is the fingerprint under which equal blocks are looked for
        (then compared element by element), so a span with a pattern of its own costs no
        comparison."""
        visible = visible.expand(*visible.shape[:2], rows, keys)
        counts = visible.sum(-1, dtype=torch.int32)  # (b, h, rows)
        if not bool(counts.any()):
            return None
        if bool((counts == keys).all()):
            return self.FULL
        tril = torch.arange(1, rows + 1, dtype=torch.int32, device=counts.device).clamp_(max=keys)
        if torch.equal(counts, tril.expand_as(counts)) and torch.equal(
                visible, torch.ones(rows, keys, dtype=torch.bool, device=visible.device).tril().expand_as(visible)):
            return self.CAUSAL
        new = self.next_id
        self.next_id += 1
        if not keep:
            return new
        same = self.kept.setdefault((tuple(visible.shape), tuple(counts.flatten().tolist())), [])
        for pid in same:
            if pid in self.blocks and torch.equal(visible, self.blocks[pid]):
                return pid
        if self.kept_elements + visible.numel() <= _PATTERN_ELEMENTS:  # past it: a pattern of its own
            same.append(new)
            self.blocks[new] = visible
            self.kept_elements += visible.numel()
        return new


def _coalesced(steps: list[QueryBlock]) -> list[QueryBlock]:
    """Each query block's spans merged into one partial span where that span is a band: gap-free,
    at most _COALESCE_KEYS keys per row, and at the same offset from the diagonal in at least two
    blocks (so that it forms a run). For shift-invariant masks, whose merged spans then share a
    pattern: a sliding window becomes one call over every query block, with no merge."""
    keys: list[tuple[int | None, ...] | None] = []
    for step in steps:
        spans, key = step.spans, None
        if (len(spans) > 1 and any(s.partial for s in spans)
                and all(a.k1 == b.k0 for a, b in pairwise(spans))
                and spans[-1].k1 - spans[0].k0 <= _COALESCE_KEYS * len(step.rows)):
            key = (step.items.start, step.items.stop, len(step.rows), spans[-1].k1 - spans[0].k0,
                   spans[0].k0 - step.rows.start)
        keys.append(key)
    counts = Counter(keys)
    return [replace(step, spans=[Span(step.spans[0].k0, step.spans[-1].k1, True)])
            if key is not None and counts[key] > 1 else step for step, key in zip(steps, keys, strict=True)]


def _progressions(xs: list[int]) -> list[list[int]]:
    """Sorted distinct ints split, left to right, into maximal runs of equal steps."""
    out: list[list[int]] = []
    i = 0
    while i < len(xs):
        j = i + 1
        while j + 1 < len(xs) and xs[j + 1] - xs[j] == xs[i + 1] - xs[i]:
            j += 1
        j = min(j, len(xs) - 1)
        out.append(xs[i:j + 1])
        i = j + 1
    return out


def _chains(spans: list[tuple[int, int]]) -> list[tuple[int, int, int, int, int]]:
    """(q0, k0, dq, dk, n) chains of equal steps covering spans (q0, k0) of one shape and pattern:
    first along diagonals (k0 - q0 fixed: bands, diagonal squares, aligned documents), then what is
    left along columns (k0 fixed: the rows past a padded length, which all see the same keys)."""
    out, alone = [], []
    by_offset: dict[int, list[int]] = defaultdict(list)
    for q0, k0 in spans:
        by_offset[k0 - q0].append(q0)
    for d, q0s in by_offset.items():
        for seq in _progressions(sorted(q0s)):
            if len(seq) > 1:
                out.append((seq[0], seq[0] + d, seq[1] - seq[0], seq[1] - seq[0], len(seq)))
            else:
                alone.append((seq[0], seq[0] + d))
    by_key: dict[int, list[int]] = defaultdict(list)
    for q0, k0 in alone:
        by_key[k0].append(q0)
    for k0, q0s in by_key.items():
        for seq in _progressions(sorted(q0s)):
            out.append((seq[0], k0, seq[1] - seq[0] if len(seq) > 1 else 0, 0, len(seq)))
    return out


def _whole_runs(plan: Plan) -> list[Run] | None:
    """The runs of a call with no mask or a causal mask alone (not bottom-right with Lq > Lk):
    every query row at once, in the kernel's own causal (plus, bottom-right, one fully visible
    span of the keys before the diagonal). The kernel skips the hidden half itself, so this is the
    one grouping of the diagonal squares and the full spans beside them that leaves nothing to
    merge and no call to set up per block; its memory is the kernel's, O(L)."""
    m, lq, lk = plan.problem.mask, plan.problem.lq, plan.problem.lk
    if len(plan.groups) != 1 or not (m is None or type(m) is Causal):
        return None
    batch = plan.groups[0].batch
    if m is None:
        return [Run(batch, 0, 0, 0, 0, 1, lq, lk, "full")]
    assert isinstance(m, Causal)
    off = m.offset(lq, lk)
    if off < 0 or off >= lk:
        return None
    return [Run(batch, 0, off, 0, 0, 1, lq, lk - off, "causal")] + (
        [Run(batch, 0, 0, 0, 0, 1, lq, off, "full")] if off else [])


def covers_all(runs: list[Run], plan: Plan) -> bool:
    """Whether the runs are one unmasked call over every row, key and batch item: then the kernel
    takes q, k, v as they are and its results are the whole answer (nothing to accumulate)."""
    if len(runs) != 1:
        return False
    r, p = runs[0], plan.problem
    return (r.kind in ("full", "causal") and r.n == 1 and r.q0 == 0 and r.rows == p.lq and r.k0 == 0
            and r.keys == p.lk and r.batch.indices(p.batch)[:2] == (0, p.batch))


def runs(plan: Plan, bias: Tensor | None, device: torch.device) -> list[Run]:
    """The fused kernel's calls for a plan: the spans of each batch group that share a shape and a
    visibility pattern, in chains of equal steps (bands coalesced first, see _COALESCE_KEYS), or
    the whole call at once where :func:`_whole_runs` can. Spans with a bias (or an
    additive modifier's) run alone: each has its own. Without a bias they are kept in the plan's
    layout (per batch size and device), for the backward and for later calls with the same mask."""
    shared = bias is None and not plan.problem.additive_mod and plan.layout is not None
    key = (plan.problem.batch, device)
    if shared and (kept := plan.layout.runs.get(key)) is not None:  # type: ignore[union-attr]
        return kept
    made = _runs(plan, bias, device)
    if shared:
        plan.layout.runs[key] = made  # type: ignore[union-attr]
    return made


def _runs(plan: Plan, bias: Tensor | None, device: torch.device) -> list[Run]:
    steps = list(plan.steps())
    if bias is not None or plan.problem.additive_mod:
        return [Run(step.items, step.rows.start, span.k0, 0, 0, 1, len(step.rows), span.k1 - span.k0, "biased",
                    span.partial) for step in steps for span in step.spans]
    if (whole := _whole_runs(plan)) is not None:
        return whole
    patterns = _Patterns(plan, device)
    if patterns.shift_invariant:
        steps = _coalesced(steps)
    groups: dict[tuple[int | None, int | None, int, int, int], list[tuple[int, int]]] = defaultdict(list)
    batches: dict[tuple[int | None, int | None], slice] = {}
    for step in steps:
        batches[step.items.start, step.items.stop] = step.items
        for span in step.spans:
            block = step.block(span)
            for piece, pid in patterns.find(block) if span.partial else [(block, _Patterns.FULL)]:
                batches[piece.items.start, piece.items.stop] = piece.items
                groups[piece.items.start, piece.items.stop, len(step.rows), len(piece.keys), pid].append(
                    (step.rows.start, piece.keys.start))
    out = []
    for (b0, b1, rows, keys, pid), spans_of_group in groups.items():
        kind: RunKind = "full" if pid == _Patterns.FULL else "causal" if pid == _Patterns.CAUSAL else "masked"
        for q0, k0, dq, dk, n in _chains(spans_of_group):
            out.append(Run(batches[b0, b1], q0, k0, dq, dk, n, rows, keys, kind, visible=patterns.blocks.get(pid)))
    return out


def run_mask(plan: Plan, run: Run, bias: Tensor | None, dtype: torch.dtype,
             device: torch.device) -> tuple[Tensor | None, bool]:
    """(additive mask, causal) of every span of a run, made from its first span: the others were
    verified to share its visibility when the run was formed."""
    block = run.first_block()
    if run.kind == "biased":
        terms = plan.problem.terms(block, device, partial=run.partial, bias=bias, kernel_causal=True)
        return terms.additive_mask(dtype), terms.causal
    if run.kind == "masked":  # the run's items were verified to see the same: its first item stands for all
        visible = run.visible
        if visible is None:
            visible = plan.problem.visible(Block(block.rows, block.keys), device)
            assert visible is not None
            first = run.batch.indices(plan.problem.batch)[0]
            visible = items_of(visible, slice(first, first + 1))
            assert visible is not None
        # in one pass (additive_mask fills zeros, then masks them)
        zero, hidden = (torch.full((), x, dtype=dtype, device=device) for x in (0.0, float("-inf")))
        return torch.where(visible, zero, hidden), False
    return None, run.kind == "causal"

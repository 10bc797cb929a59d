"""The chunked backend: exact attention over (query block, key tile) pairs, O(L * block) memory.

For each query block, the mask's tile map splits the keys into spans of fully visible tiles
(computed with no mask at all), partly visible tiles (with the mask of just that span) and empty
tiles (skipped). Each span yields a partial output and its logsumexp; spans are merged exactly by
online softmax. The backward recomputes every span from the saved (out, lse), so no (Lq, Lk)
tensor is ever built, in the forward or the backward.

Two kernels compute a span, and they are the same function: torch's fused CPU flash op (which
returns lse and has a backward that accepts the global out and lse), and plain torch math, used
on other devices, for dropout, when v's head dim differs from q's, for non-additive score
modifiers, and for a bias wider than half-precision inputs (the fused op would round it).
:func:`options` sets the block sizes and forces a kernel.

The fused kernel takes spans in runs, not one by one (a call costs a fixed set-up, and a sliding
window is hundreds of small spans): spans of one shape whose visibility is verified to be the
same (by their offset from the diagonal for causal masks and sliding windows, by comparing their
blocks for masks with tensors, item by item) run as one call, stacked in the kernel's batch dim
as strided views of q, k and v. A band's spans in one query block first become one span; a
causal mask alone is one call, the kernel's own causal.

Dropout draws its keep-mask per (query block, key tile) from a generator seeded by
(seed, tile), so the backward regenerates exactly the forward's pattern. Additive score
modifiers (ALiBi) are folded into each span's bias; other modifiers run in the math kernel, and
the backward takes their derivative from autograd, span by span.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Lq/Lk lengths, D/Dv head
dims, bq/bk block sizes, sk the keys of one span.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Literal

import torch
from torch import Tensor

from .._call import AttentionCall, compute_dtype
from ..masks import EMPTY, FULL, PARTIAL, Causal, Mask, positions
from ..scores import ScoreMod, apply_score_mod, score_mod_bias
from ._common import additive_mask, split_heads, unit_stride
from .base import Backend, bias_rounds_in_kernel

__all__ = [
    "ChunkedBackend",
    "ChunkedOptions",
    "Schedule",
    "current_options",
    "draw_seed",
    "dropout_pattern",
    "fused_block",
    "fused_block_available",
    "fused_block_backward",
    "options",
    "schedule",
]

Kernel = Literal["auto", "fused", "math"]
Span = tuple[int, int, bool]  # (k0, k1, partial): keys k0:k1, masked only when partial


@dataclass(frozen=True)
class ChunkedOptions:
    """How the chunked backend tiles a call.

    Attributes:
        block_k: keys per tile, the granularity at which empty tiles are skipped.
        block_q: query rows per block; None chooses it per call (larger where rows see many keys).
        kernel: "auto" (fused where it computes the call exactly, else math), "fused" or "math".
        math_block_q: query rows per block of the math kernel (dropout patterns depend on it).
        math_span_keys: the most keys in one span of the math kernel, which holds (B, Hq, bq, sk)
            scores.
    """

    block_k: int = 128
    block_q: int | None = None
    kernel: Kernel = "auto"
    math_block_q: int = 128
    math_span_keys: int = 2048

    def __post_init__(self) -> None:
        for name in ("block_k", "block_q", "math_block_q", "math_span_keys"):
            value = getattr(self, name)
            if value is None and name == "block_q":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"chunked option {name} must be an int >= 1, got {value!r}")
        if self.kernel not in ("auto", "fused", "math"):
            raise ValueError(f"chunked option kernel must be 'auto', 'fused' or 'math', got {self.kernel!r}")


_DEFAULT_OPTIONS = ChunkedOptions()
_OPTIONS: contextvars.ContextVar[ChunkedOptions | None] = contextvars.ContextVar("selfattn_chunked", default=None)
# What torch.compile reads instead (it cannot trace ContextVar.get): the options last set or restored by
# options() in any thread; dynamo guards on it, so a compiled function retraces when it changes.
_TRACED_OPTIONS = _DEFAULT_OPTIONS


def current_options() -> ChunkedOptions:
    """The options in force (see :func:`options`)."""
    if torch.compiler.is_compiling():
        return _TRACED_OPTIONS
    return _OPTIONS.get() or _DEFAULT_OPTIONS


@contextlib.contextmanager
def options(**changes: object) -> Iterator[ChunkedOptions]:
    """Change the chunked backend's options inside the block (restored on exit, also on error).

    Example:
        >>> with selfattn.backends.chunked.options(block_q=64, block_k=64, kernel="math"):
        ...     out = selfattn.attention(q, k, v, mask=m, backend="chunked")
    """
    global _TRACED_OPTIONS
    new = replace(current_options(), **changes)  # type: ignore[arg-type]
    token = _OPTIONS.set(new)
    _TRACED_OPTIONS = new
    try:
        yield new
    finally:
        _OPTIONS.reset(token)
        _TRACED_OPTIONS = current_options()


def _fused_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused_bwd_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused_obstacles(call: AttentionCall) -> list[str]:
    """Why the fused kernel cannot compute this call exactly (empty: it can)."""
    out = []
    if not fused_block_available(call.device, call.head_dim, call.v_head_dim):
        out.append(f"no fused kernel with lse on {call.device.type} for D={call.head_dim}, Dv={call.v_head_dim}")
    if call.dropout_p > 0:
        out.append("dropout")
    if call.score_mod is not None and not call.score_mod.additive:
        out.append(f"{call.score_mod!r} is not additive")
    if rounding := bias_rounds_in_kernel(call):
        out.append(f"{rounding} (the fused op would round it to q's dtype)")
    return out


class ChunkedBackend(Backend):
    """Tiles with online softmax; skips empty tiles; O(L * block) memory for every mask."""

    name = "chunked"
    supports_bias_grad = False
    supports_sinks = True

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        if current_options().kernel == "fused" and (obstacles := _fused_obstacles(call)):
            reasons.append(f"kernel='fused' was forced, but it cannot run: {', '.join(obstacles)}")
        return reasons

    def block_k(self) -> int:
        """The key tile size in force: the unit at which this backend skips work."""
        return current_options().block_k

    def run(self, call: AttentionCall) -> tuple[Tensor, Tensor, None]:
        opts = current_options()
        fused = opts.kernel == "fused" or (opts.kernel == "auto" and not _fused_obstacles(call))
        if torch.compiler.is_compiling():  # one custom op, its schedule made inside from the real mask
            from . import _ops
            return _ops.chunked_attention(call, opts, fused)
        seed = draw_seed() if call.dropout_p > 0 else 0
        plan = _Plan.build(call.mask, call.score_mod, call.q.shape, call.k.shape[2], call.dtype, call.device,
                           scale=call.scale, dropout_p=call.dropout_p, seed=seed, fused=fused, opts=opts,
                           mask_version=None if call.mask is None else call.mask.version())
        out, lse = _ChunkedAttention.apply(call.q, call.k, call.v, call.bias, call.sinks, plan)
        return out, lse.float(), None


@dataclass
class Schedule:
    """Batch items that share one schedule: for each query block, the key spans it computes."""

    batch: slice
    spans: list[list[Span]]


@dataclass
class _Plan:
    """Everything the forward and backward share: what to compute, tile by tile."""

    mask: Mask | None
    mask_version: tuple[int, ...] | None
    scale: float
    dropout_p: float
    seed: int
    fused: bool
    groups: list[Schedule]
    lq: int
    lk: int
    bq: int
    bk: int
    score_mod: ScoreMod | None
    batch_size: int
    hq: int
    compute_dtype: torch.dtype

    @classmethod
    def build(cls, mask: Mask | None, score_mod: ScoreMod | None, q_shape: tuple[int, ...], lk: int,
              dtype: torch.dtype, device: torch.device, *, scale: float, dropout_p: float, seed: int,
              fused: bool, opts: ChunkedOptions, mask_version: tuple[int, ...] | None = None) -> _Plan:
        """The plan of a call with q of shape (B, Hq, Lq, D) and Lk keys under ``opts``: the
        schedule comes from the mask's tensors as they are now."""
        b, hq, lq = q_shape[0], q_shape[1], q_shape[2]
        bq = _block_q(mask, lq, lk, fused, device, opts)
        return cls(mask=mask, mask_version=mask_version, scale=scale, dropout_p=dropout_p, seed=seed, fused=fused,
                   groups=schedule(mask, lq, lk, block_q=bq, fused=fused, device=device, opts=opts),
                   lq=lq, lk=lk, bq=bq, bk=opts.block_k, score_mod=score_mod,
                   batch_size=b, hq=hq, compute_dtype=compute_dtype(dtype))

    def positions(self, batch: slice, q0: int, q1: int, k0: int, k1: int,
                  device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(b, h, i, j) of a span, for score modifiers."""
        items = torch.arange(self.batch_size)[batch]
        return positions(items, self.hq, q0, q1, k0, k1, self.lq, self.lk, device)

    def steps(self) -> Iterator[tuple[slice, int, int, list[Span]]]:
        """(batch items, q0, q1, spans) for every query block of every group."""
        for group in self.groups:
            for qi, spans in enumerate(group.spans):
                yield group.batch, qi * self.bq, min((qi + 1) * self.bq, self.lq), spans


def _tile_classes(mask: Mask | None, lq: int, lk: int, bq: int, bk: int, device: torch.device) -> Tensor:
    """EMPTY / PARTIAL / FULL per (batch item or 1, query block, key tile), over all heads."""
    nq, nk = -(-lq // bq), -(-lk // bk)
    if mask is None:
        return torch.full((1, nq, nk), FULL, dtype=torch.int8)
    tiles = mask.tiles(lq, lk, bq, bk, device).cpu()  # (B', H', nQ, nK)
    empty, full = (tiles == EMPTY).all(1), (tiles == FULL).all(1)
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)


def _union(classes: Tensor) -> Tensor:
    """One tile map valid for every batch item: (nQ, nK)."""
    empty, full = (classes == EMPTY).all(0), (classes == FULL).all(0)
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL))


def schedule(mask: Mask | None, lq: int, lk: int, *, block_q: int, fused: bool = True,
             device: torch.device | str = "cpu", opts: ChunkedOptions | None = None) -> list[Schedule]:
    """The key spans each query block of a call computes, per group of batch items.

    One schedule is shared across the batch unless per-item schedules skip >= 10% more tiles
    (e.g. padding masks with very different lengths). Key tiles come from ``opts`` (default:
    the :func:`options` in force).
    """
    opts = opts or current_options()
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
            if spans and spans[-1][1] == k0 and spans[-1][2] == partial and (
                    max_keys is None or k1 - spans[-1][0] <= max_keys):
                spans[-1] = (spans[-1][0], k1, partial)
            else:
                spans.append((k0, k1, partial))
        out.append(spans)
    return out


def _block_q(mask: Mask | None, lq: int, lk: int, fused: bool, device: torch.device, opts: ChunkedOptions) -> int:
    """Query block size: small where the mask leaves few keys per row (finer skipping), large
    where rows see many keys (the fused kernel is up to 1.4x faster on 1024-row calls than on
    128-row ones, measured on a 2-core CPU)."""
    if opts.block_q is not None:
        return opts.block_q
    if not fused:
        return opts.math_block_q
    classes = _tile_classes(mask, lq, lk, opts.math_block_q, opts.block_k, device)
    visible_keys = opts.block_k * float((classes != EMPTY).sum(-1).float().mean())
    bq = opts.math_block_q
    while bq < 1024 and bq * 2 <= visible_keys / 2:
        bq *= 2
    return bq


def _items(t: Tensor | None, batch: slice) -> Tensor | None:
    """The batch items of a tensor that may broadcast over the batch (size 1)."""
    return t if t is None or t.shape[0] == 1 else t[batch]


def _slice_bias(bias: Tensor | None, q0: int, q1: int, k0: int, k1: int) -> Tensor | None:
    if bias is None:
        return None
    rows = slice(None) if bias.shape[2] == 1 else slice(q0, q1)
    cols = slice(None) if bias.shape[3] == 1 else slice(k0, k1)
    return bias[:, :, rows, cols]


def keep_mask(seed: int, shape: tuple[int, int, int, int], p: float, qb: int, kb: int,
              device: torch.device) -> Tensor:
    """The dropout keep-mask of tile (qb, kb): bool (B, Hq, rows, cols), True = kept.

    A pure function of (seed, tile), so forward and backward draw the same pattern.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + qb * 65_537 + kb) % (1 << 63))
    return torch.rand(shape, generator=gen, device=device) >= p


def dropout_pattern(seed: int, b: int, hq: int, lq: int, lk: int, p: float, device: torch.device) -> Tensor:
    """The whole keep-mask (B, Hq, Lq, Lk) that a call with this seed uses under the options in
    force (for tests and debugging)."""
    opts = current_options()
    bq, bk = opts.block_q or opts.math_block_q, opts.block_k  # dropout always runs the math kernel
    rows = [torch.cat([keep_mask(seed, (b, hq, min(q0 + bq, lq) - q0, min(k0 + bk, lk) - k0), p,
                                 q0 // bq, k0 // bk, device) for k0 in range(0, lk, bk)], dim=-1)
            for q0 in range(0, lq, bq)]
    return torch.cat(rows, dim=-2)


def draw_seed() -> int:
    """The dropout seed of one call, drawn from torch's global generator (so manual_seed rules it)."""
    return int(torch.randint(0, 1 << 62, (1,)).item())


def _span_keep(plan: _Plan, shape: tuple[int, int], batch: slice, q0: int, q1: int, k0: int, k1: int,
               device: torch.device) -> Tensor | None:
    """Keep-mask of a span for these batch items, assembled from its tiles: (b, Hq, q1 - q0, k1 - k0).

    shape: (B, Hq) of the whole call, so a tile's pattern does not depend on the grouping.
    """
    if plan.dropout_p == 0:
        return None
    qb, bk = q0 // plan.bq, plan.bk
    parts = [keep_mask(plan.seed, (*shape, q1 - q0, min(kk + bk, k1) - kk), plan.dropout_p,
                       qb, kk // bk, device) for kk in range(k0, k1, bk)]
    return torch.cat(parts, dim=-1)[batch]


def _span_mask(plan: _Plan, bias: Tensor | None, batch: slice, q0: int, q1: int, k0: int, k1: int,
               partial: bool, device: torch.device) -> tuple[Tensor | None, Tensor | None, bool]:
    """(visible, bias, causal) of one span: the mask only on partial spans, the bias on every span,
    and causal=True (no mask tensor) for a diagonal square of a pure causal mask."""
    bias = _items(_slice_bias(bias, q0, q1, k0, k1), batch)
    if plan.score_mod is not None and plan.score_mod.additive:  # folded into the span's bias, in compute dtype
        idx = plan.positions(batch, q0, q1, k0, k1, device)
        mod_bias = score_mod_bias(plan.score_mod, idx, plan.compute_dtype)
        bias = mod_bias if bias is None else bias.to(mod_bias.dtype) + mod_bias
    m = plan.mask
    if not partial or m is None:
        return None, bias, False
    if (plan.fused and type(m) is Causal and k0 == q0 + m.offset(plan.lq, plan.lk)  # exact type: see shift_invariant
            and k1 - k0 == q1 - q0):
        return None, bias, True
    return _items(m.block(q0, q1, k0, k1, plan.lq, plan.lk, device), batch), bias, False


def _raw_scores(plan: _Plan, q: Tensor, k: Tensor, bias: Tensor | None, hkv: int, g: int) -> Tensor:
    """Scaled and biased scores of one span in compute dtype: (B, Hkv, G, bq, sk)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * plan.scale
    if bias is not None:
        s = s + split_heads(bias.to(s.dtype), hkv, g)
    return s


def _modified(plan: _Plan, s: Tensor, idx: tuple[Tensor, ...] | None, visible: Tensor | None,
              hkv: int, g: int) -> Tensor:
    """A non-additive score modifier (additive ones are already in the bias), then the mask."""
    if idx is not None and plan.score_mod is not None:
        b, _, _, bq, sk = s.shape
        s = apply_score_mod(plan.score_mod, s.reshape(b, hkv * g, bq, sk), idx).reshape(s.shape)  # type: ignore[arg-type]
    if visible is not None:
        s = s.masked_fill(~split_heads(visible, hkv, g), float("-inf"))
    return s


def _mod_positions(plan: _Plan, batch: slice, q0: int, q1: int, k0: int, k1: int,
                   device: torch.device) -> tuple[Tensor, ...] | None:
    if plan.score_mod is None or plan.score_mod.additive:
        return None
    return plan.positions(batch, q0, q1, k0, k1, device)


def _merge(o1: Tensor, l1: Tensor, o2: Tensor, l2: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial softmax outputs with their logsumexps (rows of -inf carry no weight)."""
    lse = torch.logaddexp(l1, l2)
    ref = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w1, w2 = torch.exp(l1 - ref).unsqueeze(-1), torch.exp(l2 - ref).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


# The fused kernel's runs. Each span as its own call pays a fixed cost: Python, the op's set-up and
# waking the thread pool for the call and for every small merge after it, which on a busy 2-core
# machine reaches milliseconds per parallel region (an add of 64K floats: 7.6 ms loaded, 0.05 ms
# idle). A sliding window is hundreds of small spans, so the fused path groups the spans that share
# a shape and a verified visibility pattern and computes each group in one call, its spans stacked
# in the kernel's batch dim as strided views.

_CALL_ELEMENTS = 1 << 22
"""The most elements one batched call returns (its output in the forward, its three gradients in
the backward), 16 MiB in float32: past a few million elements there is no fixed cost left to save,
only the memory of the call's results. Backward spans longer than that are cut along their keys."""

_PATTERN_ELEMENTS = 1 << 24
"""The most block-mask elements kept while spans are compared (16 MiB of bools): spans whose
pattern finds no room get a pattern of their own and run alone."""

_COALESCE_KEYS = 8
"""A query block's spans become one masked span only when they cover at most this many keys per
query row: a band such as a sliding window, where one larger call and no merge of partial results
beat three calls that skip some masked work (sliding_window(256) at L = 16384, 128-row blocks: a
128 x 384 masked span is 1.6x faster in the forward than the three 128 x 128 spans it replaces,
1.3x in the backward, whose kernel barely skips a causal diagonal); never a causal staircase."""

_RunKind = Literal["full", "causal", "masked", "biased"]


@dataclass(frozen=True)
class _Run:
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
    kind: _RunKind
    partial: bool = False
    visible: Tensor | None = field(default=None, compare=False, repr=False)  # a masked run's block, if kept

    def members(self, i0: int, i1: int) -> _Run:
        """Spans i0:i1 of this run."""
        return replace(self, q0=self.q0 + i0 * self.dq, k0=self.k0 + i0 * self.dk, n=i1 - i0)


class _Patterns:
    """Classifies the visibility of partial spans: nothing visible (skipped), every key (no mask),
    top-left causal (the kernel's causal flag, no mask), or a block mask. Spans get one pattern id
    only when their blocks are verified equal: for shift-invariant masks by their offset from the
    diagonal, for masks with tensors by comparing the blocks themselves.

    Masks with tensors are also looked at item by item and tile by tile: a span of a schedule
    shared by items of different padded lengths is often fully visible then causal for one item
    and empty for the other, and needs no mask once cut there."""

    FULL, CAUSAL = 0, 1

    def __init__(self, plan: _Plan, device: torch.device) -> None:
        self.plan, self.device = plan, device
        self.shift_invariant = plan.mask is not None and plan.mask.shift_invariant()
        self.by_offset: dict[tuple[int, int, int], int | None] = {}  # (rows, keys, k0 - q0) -> id
        self.kept: dict[tuple[object, ...], list[int]] = {}  # (shape, visible keys per row) -> ids
        self.blocks: dict[int, Tensor] = {}  # id -> its block, while they fit in _PATTERN_ELEMENTS
        self.kept_elements = 0
        self.next_id = 2

    def find(self, batch: slice, q0: int, q1: int, k0: int, k1: int) -> list[tuple[slice, int, int, int]]:
        """(batch items, k0, k1, pattern id) of the pieces of a partial span: the whole span and
        batch group, or (masks with tensors) the span cut where its items' blocks differ and
        where its tiles change between empty, fully visible and partly visible. Pieces that see
        nothing are left out; two pieces of one shape get one id only when their visibility is
        the same."""
        rows, keys = q1 - q0, k1 - k0
        if self.shift_invariant:
            offset = (rows, keys, k0 - q0)
            if offset not in self.by_offset:
                self.by_offset[offset] = self._classify(self._block(batch, q0, q1, k0, k1), rows, keys, keep=False)
            pid = self.by_offset[offset]
            return [] if pid is None else [(batch, k0, k1, pid)]
        visible = self._block(batch, q0, q1, k0, k1)
        if visible.shape[0] > 1 and torch.equal(visible, visible[:1].expand_as(visible)):
            visible = visible[:1]
        first = batch.indices(self.plan.batch_size)[0]
        items = [batch] if visible.shape[0] == 1 else [slice(first + i, first + i + 1) for i in range(visible.shape[0])]
        out = []
        for i, item in enumerate(items):
            vis = visible[i:i + 1]
            for a, b in self._stretches(vis, keys):
                pid = self._classify(vis if b - a == keys else vis[..., a:b], rows, b - a, keep=True)
                if pid is not None:
                    out.append((item, k0 + a, k0 + b, pid))
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

    def _block(self, batch: slice, q0: int, q1: int, k0: int, k1: int) -> Tensor:
        m = self.plan.mask
        assert m is not None
        out = _items(m.block(q0, q1, k0, k1, self.plan.lq, self.plan.lk, self.device), batch)
        assert out is not None
        return out

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


def _coalesced(steps: list[tuple[slice, int, int, list[Span]]]) -> list[tuple[slice, int, int, list[Span]]]:
    """Each query block's spans merged into one partial span where that span is a band: gap-free,
    at most _COALESCE_KEYS keys per row, and at the same offset from the diagonal in at least two
    blocks (so that it forms a run). For shift-invariant masks, whose merged spans then share a
    pattern: a sliding window becomes one call over every query block, with no merge."""
    keys: list[tuple[int, ...] | None] = []
    for batch, q0, q1, spans in steps:
        key = None
        if (len(spans) > 1 and any(p for _, _, p in spans)
                and all(a[1] == b[0] for a, b in pairwise(spans))
                and spans[-1][1] - spans[0][0] <= _COALESCE_KEYS * (q1 - q0)):
            key = (batch.start, batch.stop, q1 - q0, spans[-1][1] - spans[0][0], spans[0][0] - q0)
        keys.append(key)
    counts = Counter(keys)
    return [(batch, q0, q1, [(spans[0][0], spans[-1][1], True)] if key is not None and counts[key] > 1 else spans)
            for (batch, q0, q1, spans), key in zip(steps, keys, strict=True)]


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


def _whole_runs(plan: _Plan) -> list[_Run] | None:
    """The runs of a call with no mask or a causal mask alone (not bottom-right with Lq > Lk):
    every query row at once, in the kernel's own causal (plus, bottom-right, one fully visible
    span of the keys before the diagonal). The kernel skips the hidden half itself, so this is the
    one grouping of the diagonal squares and the full spans beside them that leaves nothing to
    merge and no call to set up per block; its memory is the kernel's, O(L)."""
    m = plan.mask
    if len(plan.groups) != 1 or not (m is None or type(m) is Causal):
        return None
    batch = plan.groups[0].batch
    if m is None:
        return [_Run(batch, 0, 0, 0, 0, 1, plan.lq, plan.lk, "full")]
    assert isinstance(m, Causal)
    off = m.offset(plan.lq, plan.lk)
    if off < 0 or off >= plan.lk:
        return None
    return [_Run(batch, 0, off, 0, 0, 1, plan.lq, plan.lk - off, "causal")] + (
        [_Run(batch, 0, 0, 0, 0, 1, plan.lq, off, "full")] if off else [])


def _covers_all(runs: list[_Run], plan: _Plan) -> bool:
    """Whether the runs are one unmasked call over every row, key and batch item: then the kernel
    takes q, k, v as they are and its results are the whole answer (nothing to accumulate)."""
    if len(runs) != 1:
        return False
    r = runs[0]
    return (r.kind in ("full", "causal") and r.n == 1 and r.q0 == 0 and r.rows == plan.lq and r.k0 == 0
            and r.keys == plan.lk and r.batch.indices(plan.batch_size)[:2] == (0, plan.batch_size))


def _runs(plan: _Plan, bias: Tensor | None, device: torch.device) -> list[_Run]:
    """The fused kernel's calls for a plan: the spans of each batch group that share a shape and a
    visibility pattern, in chains of equal steps (bands coalesced first, see _COALESCE_KEYS), or
    the whole call at once where :func:`_whole_runs` can. Spans with a bias (or an
    additive modifier's) run alone: each has its own."""
    steps = list(plan.steps())
    if bias is not None or (plan.score_mod is not None and plan.score_mod.additive):
        return [_Run(batch, q0, k0, 0, 0, 1, q1 - q0, k1 - k0, "biased", partial)
                for batch, q0, q1, spans in steps for k0, k1, partial in spans]
    if (runs := _whole_runs(plan)) is not None:
        return runs
    patterns = _Patterns(plan, device)
    if patterns.shift_invariant:
        steps = _coalesced(steps)
    groups: dict[tuple[int | None, int | None, int, int, int], list[tuple[int, int]]] = defaultdict(list)
    batches: dict[tuple[int | None, int | None], slice] = {}
    for batch, q0, q1, spans in steps:
        batches[batch.start, batch.stop] = batch
        for k0, k1, partial in spans:
            pieces = patterns.find(batch, q0, q1, k0, k1) if partial else [(batch, k0, k1, _Patterns.FULL)]
            for items, p0, p1, pid in pieces:
                batches[items.start, items.stop] = items
                groups[items.start, items.stop, q1 - q0, p1 - p0, pid].append((q0, p0))
    runs = []
    for (b0, b1, rows, keys, pid), spans_of_group in groups.items():
        kind: _RunKind = "full" if pid == _Patterns.FULL else "causal" if pid == _Patterns.CAUSAL else "masked"
        for q0, k0, dq, dk, n in _chains(spans_of_group):
            runs.append(_Run(batches[b0, b1], q0, k0, dq, dk, n, rows, keys, kind, visible=patterns.blocks.get(pid)))
    return runs


def _run_mask(plan: _Plan, run: _Run, bias: Tensor | None, dtype: torch.dtype,
              device: torch.device) -> tuple[Tensor | None, bool]:
    """(additive mask, causal) of every span of a run, made from its first span: the others were
    verified to share its visibility when the run was formed."""
    q1, k1 = run.q0 + run.rows, run.k0 + run.keys
    if run.kind == "biased":
        visible, span_bias, causal = _span_mask(plan, bias, run.batch, run.q0, q1, run.k0, k1, run.partial, device)
        return additive_mask(visible, span_bias, dtype), causal
    if run.kind == "masked":  # the run's items were verified to see the same: its first item stands for all
        assert plan.mask is not None
        visible = run.visible
        if visible is None:
            visible = plan.mask.block(run.q0, q1, run.k0, k1, plan.lq, plan.lk, device)
            visible = visible[run.batch.indices(plan.batch_size)[0]:][:1] if visible.shape[0] > 1 else visible
        # in one pass (additive_mask fills zeros, then masks them)
        zero, hidden = (torch.full((), x, dtype=dtype, device=device) for x in (0.0, float("-inf")))
        return torch.where(visible, zero, hidden), False
    return None, run.kind == "causal"


def _folds(t: Tensor, items: int) -> bool:
    """Whether ``items`` batch items of t (B, H, ...) read as one dim of items * H heads."""
    return items == 1 or t.shape[1] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


def _span_view(t: Tensor, items: tuple[int, int], start: int, step: int, n: int, length: int) -> Tensor:
    """``n`` spans of ``length`` positions along dim 2 of t (B, H, L[, E]), the i-th starting at
    ``start + i * step``, of batch items ``items`` = (first, count) folded into the heads:
    (n, count * H, length[, E]), a strided view (:func:`_folds` says whether the items fold)."""
    first, count = items
    st = t.stride()
    heads = st[0] if t.shape[1] == 1 else st[1]
    return t.as_strided((n, count * t.shape[1], length, *t.shape[3:]), (step * st[2], heads, st[2], *st[3:]),
                        t.storage_offset() + first * st[0] + start * st[2])


def _add_spans(acc: Tensor, items: tuple[int, int], start: int, step: int, n: int, length: int, g: Tensor) -> None:
    """acc's spans (as :func:`_span_view`) += g (n, items * H, length, E), where spans may overlap:
    then in slices of ``step`` positions, which do not."""
    if n == 1 or step >= length:
        _span_view(acc, items, start, step, n, length).add_(g)
    elif step == 0:
        _span_view(acc, items, start, 0, 1, length).add_(g.sum(0, keepdim=True, dtype=acc.dtype))
    else:
        for p0 in range(0, length, step):
            p1 = min(p0 + step, length)
            _span_view(acc, items, start + p0, step, n, p1 - p0).add_(g[:, :, p0:p1])


def _calls(run: _Run, batch_size: int, tensors: tuple[Tensor, ...], attn_mask: Tensor | None,
           per_span: int) -> Iterator[tuple[tuple[int, int], int, int]]:
    """(batch items as (first, count), i0, i1) of each kernel call of a run. The group's items fold
    into the heads where every tensor's strides allow it and the mask is the same for every item
    and head, else one call per item; each call returns at most _CALL_ELEMENTS (``per_span`` per
    span and item), at least one span."""
    b0, b1, _ = run.batch.indices(batch_size)
    fold = (attn_mask is None or attn_mask.shape[:2] == (1, 1)) and all(_folds(t, b1 - b0) for t in tensors)
    for items in [(b0, b1 - b0)] if fold else [(b, 1) for b in range(b0, b1)]:
        step = max(1, _CALL_ELEMENTS // (per_span * items[1]))
        for i0 in range(0, run.n, step):
            yield items, i0, min(i0 + step, run.n)


def _for_items(t: Tensor | None, first: int, items: tuple[int, int]) -> Tensor | None:
    """A run's mask (or dead rows) for the call's items: its own rows when it differs per item."""
    return t if t is None or t.shape[0] == 1 else t[items[0] - first:items[0] - first + items[1]]


def _segments(flags: list[bool]) -> list[tuple[int, int, bool]]:
    """(i0, i1, flag) of each maximal stretch of equal flags."""
    out: list[tuple[int, int, bool]] = []
    for i, f in enumerate(flags):
        if out and out[-1][2] == f:
            out[-1] = (out[-1][0], i + 1, f)
        else:
            out.append((i, i + 1, f))
    return out


def _merge_into(o_acc: Tensor, l_acc: Tensor, o: Tensor, lse: Tensor) -> None:
    """:func:`_merge` in place, into views of the accumulators (the same arithmetic, so the same bits)."""
    total = torch.logaddexp(l_acc, lse)
    ref = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    w1, w2 = torch.exp(l_acc - ref).unsqueeze(-1), torch.exp(lse - ref).unsqueeze(-1)
    o_acc.mul_(w1).add_(o.to(o_acc.dtype) * w2)
    l_acc.copy_(total)


def _fused_forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The forward in the fused kernel, run by run: a span that is the first of its query block to
    finish is copied into the accumulators, later ones are merged by their lse."""
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    b, hq, lq, _ = q.shape
    ct = compute_dtype(q.dtype)
    runs = _runs(plan, bias, q.device)
    if _covers_all(runs, plan):
        o, l_s = _fused_op()(q, k, v, 0.0, runs[0].kind == "causal", scale=plan.scale)[:2]
        return o, l_s.to(ct)
    out = torch.empty(b, hq, lq, v.shape[3], dtype=q.dtype, device=q.device)
    acc = out if ct == q.dtype else torch.empty(out.shape, dtype=ct, device=q.device)
    lse = torch.empty(b, hq, lq, dtype=ct, device=q.device)
    written: set[tuple[int, int]] = set()  # (batch item, q0) of the query blocks holding a partial result
    for run in runs:
        attn_mask, causal = _run_mask(plan, run, bias, q.dtype, q.device)
        dead = None if attn_mask is None else ~(attn_mask != float("-inf")).any(-1)  # rows seeing no key
        first = run.batch.indices(b)[0]
        for items, i0, i1 in _calls(run, b, (q, k, v), attn_mask, hq * run.rows * v.shape[3]):
            part = run.members(i0, i1)
            o, l_s = _fused_op()(_span_view(q, items, part.q0, part.dq, part.n, part.rows),
                                 _span_view(k, items, part.k0, part.dk, part.n, part.keys),
                                 _span_view(v, items, part.k0, part.dk, part.n, part.keys), 0.0, causal,
                                 attn_mask=_for_items(attn_mask, first, items), scale=plan.scale)[:2]
            if dead is not None:
                l_s = l_s.masked_fill(_for_items(dead, first, items), float("-inf"))  # type: ignore[arg-type]
            starts = [part.q0 + i * part.dq for i in range(part.n)]
            # which spans are new, item by item: items folded into one call may differ (an earlier
            # run may have covered a span for one item only), and are then stored one by one
            fresh = [[(item, s) not in written for s in starts] for item in range(items[0], items[0] + items[1])]
            stores = ([(items, slice(None), fresh[0])] if all(f == fresh[0] for f in fresh) else
                      [((items[0] + i, 1), slice(i * hq, (i + 1) * hq), f) for i, f in enumerate(fresh)])
            for its, heads, flags in stores:
                for j0, j1, new in _segments(flags):
                    seg = part.members(j0, j1)
                    o_acc = _span_view(acc, its, seg.q0, seg.dq, seg.n, seg.rows)
                    l_acc = _span_view(lse, its, seg.q0, seg.dq, seg.n, seg.rows)
                    if new:
                        o_acc.copy_(o[j0:j1, heads])
                        l_acc.copy_(l_s[j0:j1, heads])
                    else:
                        _merge_into(o_acc, l_acc, o[j0:j1, heads], l_s[j0:j1, heads])
            written.update((item, t) for item in range(items[0], items[0] + items[1])  # every query block
                           for s in starts for t in range(s, s + part.rows, plan.bq))  # a whole-call run covers
    for batch, q0, q1, _ in plan.steps():  # query blocks that see no key at all: output 0, lse -inf
        for item in range(*batch.indices(b)[:2]):
            if (item, q0) not in written:
                acc[item, :, q0:q1] = 0
                lse[item, :, q0:q1] = float("-inf")
    if acc is not out:
        out.copy_(acc)
    return out, lse


def _key_pieces(run: _Run, per_row_span: int, per_key: int, bk: int) -> list[_Run]:
    """A run cut along its keys so that one span's gradients fit in _CALL_ELEMENTS (a long full
    span would otherwise return dk and dv as large as k and v). Full and masked runs only: a causal
    run's diagonal would move, and a biased span keeps its bias whole. Nor where the rows alone
    nearly fill the budget (a whole-call run): cutting keys would then not bound the call."""
    room = _CALL_ELEMENTS - per_row_span
    if run.kind not in ("full", "masked") or per_key * run.keys <= room or room < 4 * per_key * bk:
        return [run]
    width = room // per_key // bk * bk
    return [replace(run, k0=run.k0 + c0, keys=min(width, run.keys - c0),
                    visible=None if run.visible is None else run.visible[..., c0:c0 + width])
            for c0 in range(0, run.keys, width)]


def _fused_backward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor,
                    dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward in the fused kernel, run by run, from the merged (out, lse) of each query row."""
    q, k, v, out, dout = (unit_stride(t) for t in (q, k, v, out, dout))
    b, hq, _, d = q.shape
    hkv, dv_dim = k.shape[1], v.shape[3]
    ct = compute_dtype(q.dtype)
    # Rows that see no key: lse = +inf makes every probability exp(s - lse) exactly 0.
    lse_b = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    runs = _runs(plan, bias, q.device)
    if _covers_all(runs, plan):  # the kernel's gradients are the answer: no accumulators
        return _fused_bwd_op()(dout, q, k, v, out, lse_b, 0.0, runs[0].kind == "causal", scale=plan.scale)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    for whole in runs:
        n_items = len(range(*whole.batch.indices(b)))  # that may fold into one call
        for run in _key_pieces(whole, n_items * hq * whole.rows * d, n_items * hkv * (d + dv_dim), plan.bk):
            attn_mask, causal = _run_mask(plan, run, bias, q.dtype, q.device)
            first = run.batch.indices(b)[0]
            per_span = hq * run.rows * d + hkv * run.keys * (d + dv_dim)
            for items, i0, i1 in _calls(run, b, (q, k, v, out, dout, lse_b), attn_mask, per_span):
                p = run.members(i0, i1)
                rows = [_span_view(t, items, p.q0, p.dq, p.n, p.rows) for t in (dout, q)]
                keys = [_span_view(t, items, p.k0, p.dk, p.n, p.keys) for t in (k, v)]
                gq, gk, gv = _fused_bwd_op()(*rows, *keys, _span_view(out, items, p.q0, p.dq, p.n, p.rows),
                                             _span_view(lse_b, items, p.q0, p.dq, p.n, p.rows), 0.0, causal,
                                             attn_mask=_for_items(attn_mask, first, items), scale=plan.scale)
                _add_spans(dq, items, p.q0, p.dq, p.n, p.rows, gq)
                _add_spans(dk, items, p.k0, p.dk, p.n, p.keys, gk)
                _add_spans(dv, items, p.k0, p.dk, p.n, p.keys, gv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    if plan.fused:
        return _fused_forward(plan, q, k, v, bias)
    b, hq, lq, _ = q.shape
    dv = v.shape[3]
    ct = compute_dtype(q.dtype)
    out = torch.empty(b, hq, lq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, lq, dtype=ct, device=q.device)
    for batch, q0, q1, spans in plan.steps():
        qb = q[batch, :, q0:q1]  # (b, Hq, bq, D)
        o_acc = torch.zeros(*qb.shape[:3], dv, dtype=ct, device=q.device)
        l_acc = torch.full(qb.shape[:3], float("-inf"), dtype=ct, device=q.device)
        for k0, k1, partial in spans:
            visible, span_bias, _ = _span_mask(plan, bias, batch, q0, q1, k0, k1, partial, q.device)
            ks, vs = k[batch, :, k0:k1], v[batch, :, k0:k1]
            keep = _span_keep(plan, (b, hq), batch, q0, q1, k0, k1, q.device)
            idx = _mod_positions(plan, batch, q0, q1, k0, k1, q.device)
            o_s, l_s = _math_span(plan, qb, ks, vs, visible, span_bias, keep, idx)
            o_acc, l_acc = _merge(o_acc, l_acc, o_s.to(ct), l_s.to(ct))
        out[batch, :, q0:q1] = o_acc.to(q.dtype)
        lse[batch, :, q0:q1] = l_acc
    return out, lse


def fused_block_available(device: torch.device, head_dim: int, v_head_dim: int) -> bool:
    """Whether :func:`fused_block` runs here: torch's fused CPU flash op, which returns lse and has a
    backward that takes the global out and lse, with v's head dim equal to q's."""
    return (device.type == "cpu" and head_dim == v_head_dim
            and _fused_op() is not None and _fused_bwd_op() is not None)


def fused_block(q: Tensor, k: Tensor, v: Tensor, *, scale: float, visible: Tensor | None = None,
                bias: Tensor | None = None, causal: bool = False) -> tuple[Tensor, Tensor]:
    """One block of attention in the fused kernel: queries ``q`` against keys ``k``/``v`` only.

    For callers that merge blocks themselves (context parallelism): the pieces of a call merge exactly
    by their lse, and :func:`fused_block_backward` takes the merged (global) out and lse.

    Args:
        q: (B, Hq, R, D); k: (B, Hkv, C, D); v: (B, Hkv, C, D), Hq % Hkv == 0, unit-stride last dims
            not required. Check :func:`fused_block_available` first.
        scale: multiplier of the scores.
        visible: bool, broadcastable to (B, Hq, R, C), True = may attend; None = every key.
        bias: float, broadcastable to (B, Hq, R, C), added in q's dtype (the kernel's).
        causal: top-left causal within the block (R == C on the diagonal).

    Returns:
        out (B, Hq, R, D) and lse (B, Hq, R), -inf (and out 0) on rows that see no key of this block.
    """
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    attn_mask = additive_mask(visible, bias, q.dtype)
    o, lse = _fused_op()(q, k, v, 0.0, causal, attn_mask=attn_mask, scale=scale)
    if attn_mask is not None:
        dead = ~(attn_mask != float("-inf")).any(-1)  # rows of this block that see no key
        lse = lse.masked_fill(dead, float("-inf"))
    return o, lse


def fused_block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, scale: float,
                         visible: Tensor | None = None, bias: Tensor | None = None,
                         causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of one block from the merged (global) out and lse of its query rows.

    Args:
        dout, out: (B, Hq, R, D), the gradient and the merged output of these rows.
        lse: (B, Hq, R), their merged logsumexp; +inf on rows that see no key at all (their
            probabilities are then 0).
        q, k, v, scale, visible, bias, causal: as given to :func:`fused_block`.

    Returns:
        dq (B, Hq, R, D), dk (B, Hkv, C, D), dv (B, Hkv, C, D): this block's share.
    """
    q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
    attn_mask = additive_mask(visible, bias, q.dtype)
    return _fused_bwd_op()(dout, q, k, v, out, lse, 0.0, causal, attn_mask=attn_mask, scale=scale)


def _math_span(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
               bias: Tensor | None, keep: Tensor | None, idx: tuple[Tensor, ...] | None) -> tuple[Tensor, Tensor]:
    b, hq, bq, _ = q.shape
    hkv, g = k.shape[1], hq // k.shape[1]
    ct = compute_dtype(q.dtype)
    q5 = split_heads(q.to(ct), hkv, g)  # (B, Hkv, G, bq, D)
    s = _modified(plan, _raw_scores(plan, q5, k.to(ct).unsqueeze(2), bias, hkv, g), idx, visible, hkv, g)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    lsum = p.sum(-1, keepdim=True)
    if keep is not None:
        p = p * split_heads(keep, hkv, g) / (1.0 - plan.dropout_p)
    o = torch.matmul(p, v.to(ct).unsqueeze(2)) / torch.where(lsum > 0, lsum, torch.ones_like(lsum))
    lse = (m + torch.log(lsum)).squeeze(-1)
    return o.reshape(b, hq, bq, -1), lse.reshape(b, hq, bq)


def _backward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor,
              dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if plan.fused:
        return _fused_backward(plan, q, k, v, bias, out, lse, dout)
    b, hq = q.shape[:2]
    ct = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    # Rows that see no key: lse = +inf makes every probability exp(s - lse) exactly 0.
    lse_b = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    for batch, q0, q1, spans in plan.steps():
        qb, ob, dob, lb = (t[batch, :, q0:q1] for t in (q, out, dout, lse_b))
        delta = (dob.to(ct) * ob.to(ct)).sum(-1)  # (b, Hq, bq): rowsum(dO * O)
        for k0, k1, partial in spans:
            visible, span_bias, _ = _span_mask(plan, bias, batch, q0, q1, k0, k1, partial, q.device)
            ks, vs = k[batch, :, k0:k1], v[batch, :, k0:k1]
            keep = _span_keep(plan, (b, hq), batch, q0, q1, k0, k1, q.device)
            idx = _mod_positions(plan, batch, q0, q1, k0, k1, q.device)
            gq, gk, gv = _math_span_backward(plan, qb, ks, vs, dob, lb, delta, visible, span_bias, keep, idx)
            dq[batch, :, q0:q1] += gq.to(ct)
            dk[batch, :, k0:k1] += gk.to(ct)
            dv[batch, :, k0:k1] += gv.to(ct)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _math_span_backward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor,
                        delta: Tensor, visible: Tensor | None, bias: Tensor | None,
                        keep: Tensor | None, idx: tuple[Tensor, ...] | None) -> tuple[Tensor, Tensor, Tensor]:
    b, hq, bq, _ = q.shape
    hkv, g = k.shape[1], hq // k.shape[1]
    ct = compute_dtype(q.dtype)
    q5 = split_heads(q.to(ct), hkv, g)  # (B, Hkv, G, bq, D)
    k5, v5 = k.to(ct).unsqueeze(2), v.to(ct).unsqueeze(2)  # (B, Hkv, 1, sk, D|Dv)
    do5 = split_heads(dout.to(ct), hkv, g)  # (B, Hkv, G, bq, Dv)
    raw = _raw_scores(plan, q5, k5, bias, hkv, g)
    with torch.enable_grad():  # a non-additive modifier's derivative comes from autograd
        raw = raw.detach().requires_grad_(idx is not None)
        s = _modified(plan, raw, idx, visible, hkv, g)
    p = torch.exp(s.detach() - split_heads(lse, hkv, g).unsqueeze(-1))  # probabilities (B, Hkv, G, bq, sk)
    dp = torch.matmul(do5, v5.transpose(-1, -2))
    if keep is not None:
        kept = split_heads(keep, hkv, g).to(ct) / (1.0 - plan.dropout_p)
        pd, dp = p * kept, dp * kept
    else:
        pd = p
    ds = p * (dp - split_heads(delta, hkv, g).unsqueeze(-1))
    if idx is not None:
        (ds,) = torch.autograd.grad(s, raw, ds)
    dq = torch.matmul(ds, k5) * plan.scale  # (B, Hkv, G, bq, D)
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * plan.scale  # (B, Hkv, sk, D)
    dv = torch.matmul(pd.transpose(-1, -2), do5).sum(2)  # (B, Hkv, sk, Dv)
    return dq.reshape(b, hq, bq, -1), dk, dv


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Let each head's sink logit join the softmax of rows already computed without it.

    The sink adds exp(sink) to the denominator and nothing to the numerator, so the output is
    rescaled by exp(lse - lse'), lse' = logaddexp(lse, sink); a row that saw no key keeps output 0.

    Args:
        out: (B, Hq, L, Dv); lse: (B, Hq, L), -inf on rows that see no key; sinks: (Hq,).

    Returns:
        (out', lse') in out's and lse's dtypes; lse' is -inf only where a row sees no key and its sink is -inf.
    """
    ct = lse.dtype
    total = torch.logaddexp(lse, sinks.to(ct).view(1, -1, 1))
    share = torch.exp(lse - total.masked_fill(torch.isneginf(total), 0.0))  # no key and a -inf sink: 0
    return (out.to(ct) * share.unsqueeze(-1)).to(out.dtype), total


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sinks from the final (sink-included) out and lse: the sink's probability
    p = exp(sink - lse) times -rowsum(dout * out), summed over batch and rows: (Hq,)."""
    ct = lse.dtype
    delta = (dout.to(ct) * out.to(ct)).sum(-1)  # (B, Hq, L)
    p_sink = torch.exp(sinks.to(ct).view(1, -1, 1) - lse.masked_fill(torch.isneginf(lse), 0.0))
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,  # type: ignore[override]
                sinks: Tensor | None, plan: _Plan) -> tuple[Tensor, Tensor]:
        if plan.fused:  # the fused op reads the last dim as unit-stride
            q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
        out, lse = _forward(plan, q, k, v, bias)
        if sinks is not None:
            # The backward needs nothing else: with the sink-included (out, lse) its probabilities
            # exp(s - lse) and rowsum(dout * out) are those of the softmax with the sink.
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, bias, sinks, out, lse)  # torch checks they are not changed in place
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor) -> tuple[Tensor, Tensor, Tensor, None, Tensor | None, None]:  # type: ignore[override]
        q, k, v, bias, sinks, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        if plan.mask is not None and plan.mask_version is not None and plan.mask.version() != plan.mask_version:
            raise RuntimeError(f"the tensors of mask {plan.mask!r} were changed in place between the forward and "
                               "the backward of chunked attention, so the gradient would belong to another mask; "
                               "change them only after backward(), or pass a copy")
        dout = dout.contiguous()
        dq, dk, dv = _backward(plan, q, k, v, bias, out, lse, dout)
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[4] else None
        return dq, dk, dv, None, dsinks, None


BACKEND = ChunkedBackend()

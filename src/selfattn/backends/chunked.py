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
from collections.abc import Iterator
from dataclasses import dataclass, replace
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


def current_options() -> ChunkedOptions:
    """The options in force (see :func:`options`)."""
    return _OPTIONS.get() or _DEFAULT_OPTIONS


@contextlib.contextmanager
def options(**changes: object) -> Iterator[ChunkedOptions]:
    """Change the chunked backend's options inside the block (restored on exit, also on error).

    Example:
        >>> with selfattn.backends.chunked.options(block_q=64, block_k=64, kernel="math"):
        ...     out = selfattn.attention(q, k, v, mask=m, backend="chunked")
    """
    new = replace(current_options(), **changes)  # type: ignore[arg-type]
    token = _OPTIONS.set(new)
    try:
        yield new
    finally:
        _OPTIONS.reset(token)


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
        seed = draw_seed() if call.dropout_p > 0 else 0
        bq = _block_q(call.mask, call.lq, call.lk, fused, call.device, opts)
        plan = _Plan(mask=call.mask, mask_version=None if call.mask is None else call.mask.version(),
                     scale=call.scale, dropout_p=call.dropout_p, seed=seed, fused=fused,
                     groups=schedule(call.mask, call.lq, call.lk, block_q=bq, fused=fused, device=call.device),
                     lq=call.lq, lk=call.lk, bq=bq, bk=opts.block_k, score_mod=call.score_mod,
                     batch_size=call.batch, hq=call.hq, compute_dtype=compute_dtype(call.dtype))
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
             device: torch.device | str = "cpu") -> list[Schedule]:
    """The key spans each query block of a call computes, per group of batch items.

    One schedule is shared across the batch unless per-item schedules skip >= 10% more tiles
    (e.g. padding masks with very different lengths). Key tiles come from :func:`options`.
    """
    opts = current_options()
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
    if (plan.fused and isinstance(m, Causal) and k0 == q0 + m.offset(plan.lq, plan.lk)
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


def _forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
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
            visible, span_bias, causal = _span_mask(plan, bias, batch, q0, q1, k0, k1, partial, q.device)
            ks, vs = k[batch, :, k0:k1], v[batch, :, k0:k1]
            if plan.fused:
                o_s, l_s = _fused_span(plan, qb, ks, vs, visible, span_bias, causal)
            else:
                keep = _span_keep(plan, (b, hq), batch, q0, q1, k0, k1, q.device)
                idx = _mod_positions(plan, batch, q0, q1, k0, k1, q.device)
                o_s, l_s = _math_span(plan, qb, ks, vs, visible, span_bias, keep, idx)
            o_acc, l_acc = _merge(o_acc, l_acc, o_s.to(ct), l_s.to(ct))
        out[batch, :, q0:q1] = o_acc.to(q.dtype)
        lse[batch, :, q0:q1] = l_acc
    return out, lse


def _fused_span(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None,
                bias: Tensor | None, causal: bool) -> tuple[Tensor, Tensor]:
    return fused_block(q, k, v, scale=plan.scale, visible=visible, bias=bias, causal=causal)


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
    b, hq = q.shape[:2]
    ct = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    # Rows that see no key: lse = +inf makes every probability exp(s - lse) exactly 0.
    lse_b = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    for batch, q0, q1, spans in plan.steps():
        qb, ob, dob, lb = (t[batch, :, q0:q1] for t in (q, out, dout, lse_b))
        delta = None if plan.fused else (dob.to(ct) * ob.to(ct)).sum(-1)  # (b, Hq, bq): rowsum(dO * O)
        for k0, k1, partial in spans:
            visible, span_bias, causal = _span_mask(plan, bias, batch, q0, q1, k0, k1, partial, q.device)
            ks, vs = k[batch, :, k0:k1], v[batch, :, k0:k1]
            if plan.fused:
                gq, gk, gv = fused_block_backward(dob, qb, ks, vs, ob, lb, scale=plan.scale, visible=visible,
                                                  bias=span_bias, causal=causal)
            else:
                keep = _span_keep(plan, (b, hq), batch, q0, q1, k0, k1, q.device)
                idx = _mod_positions(plan, batch, q0, q1, k0, k1, q.device)
                gq, gk, gv = _math_span_backward(plan, qb, ks, vs, dob, lb, delta, visible,  # type: ignore[arg-type]
                                                 span_bias, keep, idx)
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

"""The chunked backend's drivers: the forward and the backward over a plan's blocks, and its one
autograd function. Eager calls go through :class:`_ChunkedAttention`; the compiled path's custom
ops (:mod:`.compiled`) call the same :func:`forward` and :func:`backward`.

Two kernels compute a span (:mod:`.kernels`): the fused kernel, which takes the spans in runs
(:mod:`.runs`), each run one call over strided views (:mod:`.views`); and plain math, span by span,
used on other devices, for dropout, when v's head dim differs from q's, for non-additive score
modifiers, and for a bias wider than half-precision inputs (the fused op would round it). Partial
results merge by their lse (:class:`~.kernels.Merge`); the backward recomputes every span from the
saved (out, lse), so no (Lq, Lk) tensor is ever built.

Shape legend: B batch, Hq query heads, Hkv kv heads, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._common import refuse_create_graph, unit_stride
from . import kernels
from .kernels import Merge, fused_backward, fused_forward, grad_buffers, lse_for_backward, rowsum_dout_out
from .plan import Plan
from .runs import Run, covers_all, run_mask, runs
from .views import CALL_ELEMENTS, add_spans, calls, for_items, segments, span_view

__all__ = ["Grads", "attention", "backward", "check_mask_unchanged", "forward", "kernel_inputs"]


def kernel_inputs(plan: Plan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v as the plan's kernel reads them: the fused op reads the last dim as unit-stride."""
    if plan.fused:
        return unit_stride(q), unit_stride(k), unit_stride(v)
    return q, k, v


def forward(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
            sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """out (B, Hq, Lq, Dv) in q's dtype and lse (B, Hq, Lq) in the compute dtype, with the sinks'
    term when given; q, k, v from :func:`kernel_inputs`."""
    out, lse = (_fused_forward if plan.fused else _math_forward)(plan, q, k, v, bias)
    if sinks is not None:
        # The backward needs nothing else: with the sink-included (out, lse) its probabilities
        # exp(s - lse) and rowsum(dout * out) are those of the softmax with the sink.
        out, lse = kernels.add_sinks(out, lse, sinks)
    return out, lse


@dataclass
class Grads:
    """What the backward gives: dq, dk, dv (q's, k's and v's dtypes); dsinks, dbias (the sinks' and the
    bias's shape and dtype) where asked for, else None; and one gradient (or None) per tensor of
    ``plan.problem.learned``."""

    dq: Tensor
    dk: Tensor
    dv: Tensor
    dsinks: Tensor | None = None
    dbias: Tensor | None = None
    dlearned: tuple[Tensor | None, ...] = ()


def backward(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None, out: Tensor,
             lse: Tensor, dout: Tensor, *, want_dsinks: bool = True, want_dbias: bool = False) -> Grads:
    """The gradients (:class:`Grads`) from the forward's (out, lse) and a contiguous ``dout``: dsinks
    unless ``want_dsinks`` is False; dbias with ``want_dbias`` and the learned tensors' gradients only
    from the math kernel (the plan's, see :func:`.backend.fused_obstacles`)."""
    if plan.fused:
        assert not want_dbias and not plan.problem.learned, "the fused kernel gives no bias or learned gradients"
        grads = Grads(*_fused_backward(plan, q, k, v, bias, out, lse, dout))
    else:
        grads = _math_backward(plan, q, k, v, bias, out, lse, dout, want_dbias=want_dbias)
    grads.dsinks = kernels.sinks_grad(dout, out, lse, sinks) if sinks is not None and want_dsinks else None
    return grads


def check_mask_unchanged(plan: Plan) -> None:
    """Refuse a backward whose mask tensors changed in place since the forward."""
    mask = plan.problem.mask
    if mask is not None and plan.mask_version is not None and mask.version() != plan.mask_version:
        raise RuntimeError(f"the tensors of mask {mask!r} were changed in place between the forward and "
                           "the backward of chunked attention, so the gradient would belong to another mask; "
                           "change them only after backward(), or pass a copy")


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """torch's deterministic mode for the block (restored after): the modifier's own backward (indexing's
    backward accumulates in any order, on the CPU as with CUDA's atomic adds) then runs in a fixed order,
    or raises if some op of it has no deterministic version."""
    if torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False, warn_only=warn_only)


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                sinks: Tensor | None, plan: Plan, *learned: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v = kernel_inputs(plan, q, k, v)
        out, lse = forward(plan, q, k, v, bias, sinks)
        ctx.save_for_backward(q, k, v, bias, sinks, out, lse)  # torch checks they are not changed in place
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor) -> tuple[Tensor | None, ...]:
        refuse_create_graph("chunked attention")
        q, k, v, bias, sinks, out, lse = ctx.saved_tensors
        plan = ctx.plan
        check_mask_unchanged(plan)
        strict = plan.deterministic and bool(plan.problem.learned)
        with deterministic_algorithms() if strict else contextlib.nullcontext():
            grads = backward(plan, q, k, v, bias, sinks, out, lse, dout.contiguous(),
                             want_dsinks=ctx.needs_input_grad[4], want_dbias=ctx.needs_input_grad[3])
        return grads.dq, grads.dk, grads.dv, grads.dbias, grads.dsinks, None, *grads.dlearned


def attention(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
              sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """The chunked attention of an eager call, differentiable in q, k, v, sinks, bias (math kernel) and
    the score modifier's learned tensors (``plan.problem.learned``): (out, lse)."""
    return _ChunkedAttention.apply(q, k, v, bias, sinks, plan, *plan.problem.learned)


# ----------------------------------------------------------------------------- the fused kernel, run by run


def _fused_forward(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The forward in the fused kernel, run by run: a span that is the first of its query block to
    finish is copied into the accumulators, later ones are merged by their lse."""
    p = plan.problem
    b, hq, lq, _ = q.shape
    dv = v.shape[3]
    ct = p.compute_dtype
    todo = runs(plan, bias, q.device)
    if covers_all(todo, plan):
        o, l_s = fused_forward(q, k, v, scale=p.scale, causal=todo[0].kind == "causal")
        return o, l_s.to(ct)
    acc = torch.empty(b, hq, lq, dv, dtype=ct, device=q.device)  # the output itself when ct is q's dtype
    top = torch.empty(b, hq, lq, dtype=ct, device=q.device)  # each row's largest span lse: its lse until a merge
    weight: Tensor | None = None  # Merge's weights, made at the first merge: until then every row's is 1
    written: set[tuple[int, int]] = set()  # (batch item, q0) of the query blocks holding a partial result
    for run in todo:
        attn_mask, causal = run_mask(plan, run, bias, q.dtype, q.device)
        dead = None if attn_mask is None else kernels.dead_rows(attn_mask)
        first = run.batch.indices(b)[0]
        for items, i0, i1 in calls(run, b, (q, k, v), attn_mask, hq * run.rows * dv):
            part = run.members(i0, i1)
            o, l_s = fused_forward(span_view(q, items, part.q0, part.dq, part.n, part.rows),
                                   span_view(k, items, part.k0, part.dk, part.n, part.keys),
                                   span_view(v, items, part.k0, part.dk, part.n, part.keys), scale=p.scale,
                                   attn_mask=for_items(attn_mask, first, items), causal=causal,
                                   dead=for_items(dead, first, items))
            starts = [part.q0 + i * part.dq for i in range(part.n)]
            # which spans are new, item by item: items folded into one call may differ (an earlier
            # run may have covered a span for one item only), and are then stored one by one
            fresh = [[(item, s) not in written for s in starts] for item in range(items[0], items[0] + items[1])]
            stores = ([(items, slice(None), fresh[0])] if all(f == fresh[0] for f in fresh) else
                      [((items[0] + i, 1), slice(i * hq, (i + 1) * hq), f) for i, f in enumerate(fresh)])
            for its, heads, flags in stores:
                for j0, j1, new in segments(flags):
                    seg = part.members(j0, j1)
                    rows = functools.partial(span_view, items=its, start=seg.q0, step=seg.dq, n=seg.n, length=seg.rows)
                    if new:  # the first span of these rows: its result as it is (weight 1)
                        rows(acc).copy_(o[j0:j1, heads])
                        rows(top).copy_(l_s[j0:j1, heads])
                        continue
                    if weight is None:
                        weight = torch.ones(b, hq, lq, dtype=ct, device=q.device)
                    Merge(rows(acc), rows(top), rows(weight)).add(o[j0:j1, heads], l_s[j0:j1, heads])
            written.update((item, t) for item in range(items[0], items[0] + items[1])  # every query block
                           for s in starts for t in range(s, s + part.rows, plan.bq))  # a whole-call run covers
    for step in plan.steps():  # query blocks that see no key at all: output 0, lse -inf
        for item in range(*step.items.indices(b)[:2]):
            if (item, step.rows.start) not in written:
                acc[item, :, step.rows.start:step.rows.stop] = 0
                top[item, :, step.rows.start:step.rows.stop] = float("-inf")
    if weight is None:  # nothing was merged: each row holds one span's (out, lse)
        return acc.to(q.dtype), top
    return Merge(acc, top, weight).result(q.dtype)


def _key_pieces(run: Run, per_row_span: int, per_key: int, bk: int) -> list[Run]:
    """A run cut along its keys so that one span's gradients fit in CALL_ELEMENTS (a long full
    span would otherwise return dk and dv as large as k and v). Full and masked runs only: a causal
    run's diagonal would move, and a biased span keeps its bias whole. Nor where the rows alone
    nearly fill the budget (a whole-call run): cutting keys would then not bound the call."""
    room = CALL_ELEMENTS - per_row_span
    if run.kind not in ("full", "masked") or per_key * run.keys <= room or room < 4 * per_key * bk:
        return [run]
    width = room // per_key // bk * bk
    return [replace(run, k0=run.k0 + c0, keys=min(width, run.keys - c0),
                    visible=None if run.visible is None else run.visible[..., c0:c0 + width])
            for c0 in range(0, run.keys, width)]


def _fused_backward(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor,
                    dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The backward in the fused kernel, run by run, from the merged (out, lse) of each query row."""
    p = plan.problem
    q, k, v, out, dout = (unit_stride(t) for t in (q, k, v, out, dout))
    b, hq, _, d = q.shape
    hkv, dv_dim = k.shape[1], v.shape[3]
    lse_b = lse_for_backward(lse)
    todo = runs(plan, bias, q.device)
    if covers_all(todo, plan):  # the kernel's gradients are the answer: no accumulators
        return fused_backward(dout, q, k, v, out, lse_b, scale=p.scale, causal=todo[0].kind == "causal")
    dq, dk, dv = grad_buffers(q, k, v, p.compute_dtype)
    for whole in todo:
        n_items = len(range(*whole.batch.indices(b)))  # that may fold into one call
        for run in _key_pieces(whole, n_items * hq * whole.rows * d, n_items * hkv * (d + dv_dim), plan.bk):
            attn_mask, causal = run_mask(plan, run, bias, q.dtype, q.device)
            first = run.batch.indices(b)[0]
            per_span = hq * run.rows * d + hkv * run.keys * (d + dv_dim)
            for items, i0, i1 in calls(run, b, (q, k, v, out, dout, lse_b), attn_mask, per_span):
                s = run.members(i0, i1)
                dout_s, q_s, out_s, lse_s = (span_view(t, items, s.q0, s.dq, s.n, s.rows)
                                             for t in (dout, q, out, lse_b))
                k_s, v_s = (span_view(t, items, s.k0, s.dk, s.n, s.keys) for t in (k, v))
                gq, gk, gv = fused_backward(dout_s, q_s, k_s, v_s, out_s, lse_s, scale=p.scale,
                                            attn_mask=for_items(attn_mask, first, items), causal=causal)
                add_spans(dq, items, s.q0, s.dq, s.n, s.rows, gq)
                add_spans(dk, items, s.k0, s.dk, s.n, s.keys, gk)
                add_spans(dv, items, s.k0, s.dk, s.n, s.keys, gv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------- plain math, span by span


def _math_forward(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    p = plan.problem
    b, hq, lq, _ = q.shape
    out = torch.empty(b, hq, lq, v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, lq, dtype=p.compute_dtype, device=q.device)
    for step in plan.steps():
        items, rows = step.items, slice(step.rows.start, step.rows.stop)
        qb = q[items, :, rows]  # (b, Hq, bq, D)
        merged = Merge.empty(tuple(qb.shape[:3]), v.shape[3], p.compute_dtype, q.device)
        for span in step.spans:
            terms = p.terms(step.block(span), q.device, partial=span.partial, bias=bias)
            keys = slice(span.k0, span.k1)
            merged.add(*kernels.forward(p, qb, k[items, :, keys], v[items, :, keys], terms, fused=False))
        out[items, :, rows], lse[items, :, rows] = merged.result(q.dtype)
    return out, lse


def _math_backward(plan: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, out: Tensor, lse: Tensor,
                   dout: Tensor, *, want_dbias: bool) -> Grads:
    """Span by span; a bias's gradient is each block's dS summed over the bias's broadcast dims into its
    slice of the bias (so the peak is the bias and its gradient, plus the usual blocks), and a learned
    tensor's is summed over the blocks."""
    p = plan.problem
    ct = p.compute_dtype
    dq, dk, dv = grad_buffers(q, k, v, ct)
    dbias = torch.zeros(bias.shape, dtype=ct, device=bias.device) if want_dbias and bias is not None else None
    dlearned: list[Tensor | None] = [None] * len(p.learned)
    lse_b = lse_for_backward(lse)
    # dS is a bias's or a learned term's whole gradient: its row term comes from the same dP (one more
    # pass over the row's blocks), not from rowsum(dO * O), whose rounding of out would stay in it
    exact_delta = dbias is not None or bool(p.learned)
    for step in plan.steps():
        items, rows = step.items, slice(step.rows.start, step.rows.stop)
        qb, ob, dob, lb = (t[items, :, rows] for t in (q, out, dout, lse_b))
        if exact_delta:
            delta = sum(kernels.math_delta(p, qb, k[items, :, span.k0:span.k1], v[items, :, span.k0:span.k1], dob,
                                           lb, p.terms(step.block(span), q.device, partial=span.partial, bias=bias))
                        for span in step.spans)
            if not isinstance(delta, Tensor):  # a row block with no span: nothing to subtract
                delta = torch.zeros(lb.shape, dtype=ct, device=q.device)
        else:
            delta = rowsum_dout_out(dob, ob, ct)  # (b, Hq, bq)
        for span in step.spans:
            terms = p.terms(step.block(span), q.device, partial=span.partial, bias=bias)
            keys = slice(span.k0, span.k1)
            gq, gk, gv, gs, gl = kernels.math_backward(p, qb, k[items, :, keys], v[items, :, keys], dob, lb, delta,
                                                       terms)
            dq[items, :, rows] += gq.to(ct)
            dk[items, :, keys] += gk.to(ct)
            dv[items, :, keys] += gv.to(ct)
            if dbias is not None:
                _add_bias_grad(dbias, gs, items, rows, keys)
            for n, g in enumerate(gl):
                if g is not None:
                    dlearned[n] = g.to(ct) if dlearned[n] is None else dlearned[n] + g.to(ct)  # type: ignore[operator]
    return Grads(dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                 dbias=None if dbias is None else dbias.to(bias.dtype),  # type: ignore[union-attr]
                 # a tensor no computed tile reads (every key masked) gets 0, as autograd gives it elsewhere
                 dlearned=tuple(torch.zeros_like(t) if g is None else g.to(t.dtype)
                                for g, t in zip(dlearned, p.learned, strict=True)))


def _add_bias_grad(dbias: Tensor, ds: Tensor, items: slice, rows: slice, keys: slice) -> None:
    """Add a block's dS (b, Hq, R, C) to the gradient of a bias (B|1, Hq|1, Lq|1, Lk|1), summed over the
    dims the bias broadcasts."""
    at = (slice(None) if dbias.shape[0] == 1 else items, slice(None),
          slice(None) if dbias.shape[2] == 1 else rows, slice(None) if dbias.shape[3] == 1 else keys)
    target = dbias[at]
    target += ds.sum_to_size(target.shape)

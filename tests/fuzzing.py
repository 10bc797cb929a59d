"""Differential checking of one attention call: every backend against the float64 oracle.

``check_call`` runs a :class:`strategies.Case` through one backend (or ``auto``) and holds its
output, lse and every gradient (q, k, v, bias) to the rule of :mod:`selfattn.testing`; a backend
that declines must say why (``explain`` raises ValueError naming it) and ``auto`` must then run.
The naive same-dtype math follows torch's type promotion (a float32 bias on half inputs stays
float32), so rounding a wider bias to the input dtype is caught, not excused.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import Counter

import torch
from strategies import Case
from torch import Tensor

import selfattn
from selfattn import testing
from selfattn.backends import chunked
from selfattn.masks import positions

BACKENDS = ["reference", "sdpa", "chunked", "auto"]
AUTOCAST = torch.bfloat16
COUNTS: Counter[str] = Counter()  # examples run per backend (declines counted apart)


def visible_of(case: Case) -> Tensor | None:
    return testing.reference_mask(case.lq, case.lk, mask=case.mask, causal=case.causal)


def naive(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, case: Case, term: Tensor | None = None) -> Tensor:
    """The plain math in the inputs' dtype with torch's type promotion; NaN on dead rows."""
    return testing.reference_attention(q, k, v, bias=bias, mask=case.mask, causal=case.causal, scale=case.scale,
                                       score_mod=case.mod(term), safe=False, dtype=None)


class _FlashFormula(torch.autograd.Function):
    """The same plain math, differentiated the way fused kernels do it (dS = P * (dP - rowsum(dO * O)))
    in the inputs' dtype: a second naive yardstick for gradients, since autograd through softmax can be
    exact by accident (one visible key gives an exactly zero dk) where any kernel shows rounding noise."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, case: Case,  # type: ignore[override]
                prescale: bool) -> Tensor:
        scale = 1 / math.sqrt(q.shape[-1]) if case.scale is None else case.scale
        with torch.enable_grad():
            if prescale:  # another summation order kernels use: (q * scale) @ k^T
                raw = (q.detach() * scale) @ k.detach().transpose(-1, -2)
            else:
                raw = q.detach() @ k.detach().transpose(-1, -2) * scale
            if bias is not None:
                raw = raw + bias.detach()
            raw = raw.detach().requires_grad_()
            s = raw
            if case.score_mod is not None:
                idx = positions(torch.arange(case.b), case.hq, 0, case.lq, 0, case.lk, case.lq, case.lk)
                s = case.score_mod(s, *idx)
            visible = visible_of(case)
            if visible is not None:
                s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s.detach(), -1).nan_to_num(0)
        out = (p.to(v.dtype) @ v).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, p, raw, s)
        ctx.scale, ctx.bias_shape = scale, None if bias is None else bias.shape
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        q, k, v, out, p, raw, s = ctx.saved_tensors
        dp = dout @ v.transpose(-1, -2)
        delta = (dout * out).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        if s.grad_fn is not None:
            (ds,) = torch.autograd.grad(s, raw, ds.to(s.dtype))
        dsq = ds.to(q.dtype)
        dq = dsq @ k * ctx.scale
        dk = dsq.transpose(-1, -2) @ q * ctx.scale
        dv = p.to(v.dtype).transpose(-1, -2) @ dout
        dbias = None if ctx.bias_shape is None else ds.sum_to_size(ctx.bias_shape)
        return dq, dk, dv, dbias, None, None


def naive_flash(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, case: Case, prescale: bool) -> Tensor:
    g = q.shape[1] // k.shape[1]
    return _FlashFormula.apply(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), bias, case, prescale)


def _finite_error(naive_value: Tensor, ref: Tensor) -> float:
    """The naive error where the naive math is finite (overflow and dead rows never widen a tolerance)."""
    finite = torch.isfinite(naive_value)
    return testing.max_error(naive_value[finite], ref[finite]) if bool(finite.any()) else 0.0


def _score_magnitude(t: dict[str, Tensor], case: Case) -> float:
    """The largest |score|: a weight exp(s - max) carries a relative rounding error of about eps * |s|."""
    g = case.hq // case.hkv
    scale = 1 / math.sqrt(case.d) if case.scale is None else case.scale
    s = (t["q"] @ t["k"].repeat_interleave(g, 1).transpose(-1, -2) * scale).abs().max().item()
    return max(1.0, s + (t["bias"].abs().max().item() if "bias" in t else 0.0))


def _ulps(dtype: torch.dtype) -> float:
    return (64 if dtype == torch.float64 else 16) * torch.finfo(dtype).eps


def _accidental(case: Case) -> bool:
    """Whether the naive yardstick can be exact by accident: in float32 and float64, where the inputs'
    dtype is the compute dtype (in float64 the naive math is the oracle itself). In float16/bfloat16 the
    rounding of the inputs' dtype is in every naive value, and the plain rule stands alone."""
    return case.dtype in (torch.float32, torch.float64)


def output_floor(t: dict[str, Tensor], case: Case) -> float:
    """A few ulps of |v| times the largest score, where the naive math can avoid that rounding by accident."""
    return _ulps(case.dtype) * t["v"].abs().max().item() * _score_magnitude(t, case) if _accidental(case) else 0.0


def _gradient_floor(name: str, t: dict[str, Tensor], dout: Tensor, case: Case) -> float:
    """A few ulps of the magnitude a gradient is computed from, not of its result, times the largest
    score: in a saturated softmax dS = P * (dP - rowsum(dO * O)) cancels to ~0 and P itself carries
    eps * |s| of rounding, which any kernel shows while a naive formula can be exact by accident."""
    amax = {n: x.detach().abs().max().item() for n, x in t.items()}
    scale = 1 / math.sqrt(case.d) if case.scale is None else case.scale
    dp = dout.abs().max().item() * amax["v"] * math.sqrt(case.dv)  # |dO . v| of one (query, key)
    magnitude = {"q": scale * amax["k"] * dp * math.sqrt(case.lk), "k": scale * amax["q"] * dp * math.sqrt(case.lq),
                 "v": dout.abs().max().item() * math.sqrt(case.lq), "bias": dp,
                 "term": dp * math.sqrt(case.b * case.lq * case.lk) * _term_slope(t, case)}[name]
    if not _accidental(case):
        return 0.0
    term_dtype = torch.float32 if case.dtype in (torch.float16, torch.bfloat16) else case.dtype  # as it is built
    dtype = {"bias": case.bias_dtype or case.dtype, "term": term_dtype}.get(name, case.dtype)
    return _ulps(dtype) * magnitude * _score_magnitude(t, case)


def _term_slope(t: dict[str, Tensor], case: Case) -> float:
    """How much one score moves per unit of the term's tensor: 1 for a table, |i - j| for ALiBi slopes,
    the score itself times exp(t) for a temperature."""
    if case.term is None:
        return 0.0
    return {"t5": 1.0, "slopes": float(max(case.lq, case.lk)),
            "temperature": _score_magnitude(t, case) * math.exp(t["term"].detach().abs().max().item())}[case.term]


def call_kwargs(case: Case, bias: Tensor | None, term: Tensor | None = None) -> dict:
    return dict(mask=case.mask, bias=bias, causal=case.causal, scale=case.scale, score_mod=case.mod(term))


@contextlib.contextmanager
def _grad_mode(mode: str):
    if mode == "autocast":
        with torch.autocast("cpu", dtype=AUTOCAST):
            yield
    elif mode == "inference":
        with torch.inference_mode():
            yield
    elif mode == "no_grad":
        with torch.no_grad():
            yield
    else:
        yield


def check_call(case: Case, backend: str, *, grad_mode: str = "grad") -> str:
    """Run ``case`` on ``backend`` and assert the rule; returns "ran" or "declined: <why>"."""
    built = case.tensors()
    wants = dict(zip("qkv", case.grads, strict=True)) | {"bias": case.bias_grad, "term": case.term_grad}
    use_grad = grad_mode in ("grad", "autocast")
    leaves = {n: b.leaf.detach().clone().requires_grad_(use_grad and wants[n]) for n, b in built.items()}
    inputs = {n: built[n].make(leaves[n]) for n in built}
    bias = inputs.get("bias")
    kwargs = call_kwargs(case, bias, inputs.get("term"))
    with chunked.options(block_q=case.block_q, block_k=case.block_k), _grad_mode(grad_mode):
        try:
            selfattn.explain(inputs["q"], inputs["k"], inputs["v"], return_lse=case.return_lse, backend=backend,
                             **kwargs)
        except ValueError as e:
            assert backend != "auto", f"auto found no backend: {e}"
            assert f"backend={backend!r} cannot run this call" in str(e)
            try:
                selfattn.attention(inputs["q"], inputs["k"], inputs["v"], backend=backend, **kwargs)
            except ValueError:
                pass
            else:
                if not case.return_lse:
                    raise
            COUNTS[f"{backend} declined"] += 1
            return f"declined: {e}"
        result = selfattn.attention(inputs["q"], inputs["k"], inputs["v"], return_lse=case.return_lse,
                                    backend=backend, **kwargs)
    out, lse = result if case.return_lse else (result, None)
    COUNTS[backend] += 1

    # Under autocast the inputs are cast first (float64 excepted): the oracle and the naive math see
    # the cast values, and the rule is that of the autocast dtype.
    casts = {n: grad_mode == "autocast" and b.leaf.dtype != torch.float64 and n != "term" for n, b in built.items()}
    case = dataclasses.replace(case, dtype=AUTOCAST if casts["q"] else case.dtype,
                               bias_dtype=AUTOCAST if casts.get("bias") else case.bias_dtype)

    def made(n: str, leaf: Tensor, dtype: torch.dtype | None) -> Tensor:
        x = built[n].make(leaf)
        x = x.to(AUTOCAST) if casts[n] else x
        return x if dtype is None else x.to(dtype)

    want_shape = (case.b, case.hq, case.lq, case.dv)
    assert out.shape == want_shape and out.dtype == case.dtype, (out.shape, out.dtype)
    leaves64 = {n: b.leaf.detach().double().requires_grad_(leaves[n].requires_grad) for n, b in built.items()}
    in64 = {n: made(n, leaves64[n], torch.float64) for n in built}
    ref = testing.reference_attention(in64["q"], in64["k"], in64["v"],
                                      **call_kwargs(case, in64.get("bias"), in64.get("term")))
    leaves_n = {n: b.leaf.detach().clone().requires_grad_(leaves[n].requires_grad) for n, b in built.items()}
    in_n = {n: made(n, leaves_n[n], None) for n in built}
    nv = naive(in_n["q"], in_n["k"], in_n["v"], in_n.get("bias"), case, in_n.get("term"))
    result = testing.compare_to_reference(out, ref, nv, name=f"{backend}: out")
    assert result.finite, f"{backend}: out has non-finite values"
    floor = output_floor(in64, case)
    assert result.error <= max(result.tolerance, floor), f"{result} (score-magnitude floor {floor:.3g})"

    if lse is not None:
        assert lse.shape == want_shape[:3] and lse.dtype == torch.float32
        lse_ref = testing.reference_lse(in64["q"], in64["k"], **call_kwargs(case, in64.get("bias"), in64.get("term")))
        assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref)), "lse: -inf on the wrong rows"
        finite = torch.isfinite(lse_ref)
        if finite.any():
            err = (lse.double() - lse_ref)[finite].abs().max().item()
            # lse carries the score rounding of the input dtype: allow the naive score error
            s_err = 0 if case.dtype == torch.float64 else torch.finfo(case.dtype).eps * 8 * (
                1 + lse_ref[finite].abs().max().item())
            assert err <= s_err + 1e-5 * (1 + lse_ref[finite].abs().max().item()), f"{backend}: lse error {err:.3g}"

    names = [n for n in leaves if leaves[n].requires_grad]
    if names and out.requires_grad:
        dout = torch.randn(want_shape, generator=torch.Generator().manual_seed(case.seed + 1), dtype=torch.float64)
        got = torch.autograd.grad(out, [leaves[n] for n in names], dout.to(out.dtype))
        want = torch.autograd.grad(ref, [leaves64[n] for n in names], dout)
        nvg = torch.autograd.grad(nv, [leaves_n[n] for n in names], dout.to(nv.dtype), allow_unused=True)
        yardsticks = [nvg]
        for prescale in (False, True):
            leaves_f = {n: b.leaf.detach().clone().requires_grad_(leaves[n].requires_grad) for n, b in built.items()}
            in_f = {n: made(n, leaves_f[n], None) for n in built}
            case_f = dataclasses.replace(case, score_mod=case.mod(in_f.get("term")), term=None)
            nf = naive_flash(in_f["q"], in_f["k"], in_f["v"], in_f.get("bias"), case_f, prescale)
            if not nf.requires_grad:  # only the term wants a gradient, and this formula gives it none
                continue
            yardsticks.append(torch.autograd.grad(nf, [leaves_f[n] for n in names], dout.to(nf.dtype),
                                                  allow_unused=True))
        for index, (n, a, r) in enumerate(zip(names, got, want, strict=True)):
            # the flash formula gives no gradient to a term's tensor: only the yardsticks that do count for it
            err_naive = max(_finite_error(torch.zeros_like(a) if y[index] is None else y[index], r)
                            for y in yardsticks if n != "term" or y[index] is not None)
            err = testing.max_error(a, r)
            dtype = AUTOCAST if casts[n] else a.dtype  # under autocast the gradient has bf16 precision
            tol = max(testing.tolerance(err_naive, r, dtype, 3.0), _gradient_floor(n, in64, dout, case))
            assert torch.isfinite(a).all(), f"{backend}: d{n} non-finite"
            assert err <= tol, f"{backend}: d{n}: error {err:.3g} > tolerance {tol:.3g} (naive {err_naive:.3g})"
    return "ran"

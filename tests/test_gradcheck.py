"""Numerical gradient checks (float64, small shapes) of every differentiable input on every backend
that accepts it: q, k, v, a bias (whole and broadcast), sinks, and the tensors of learned score terms
(a T5 bucket table, ALiBi slopes, a per-head temperature, a learned soft-cap). Second derivatives
where a backend has them (reference everywhere, sdpa's math path with a bias), and a clear error
where it has none (chunked, the ring), never a silently wrong one.

flex has no backward on the CPU (inference only) and is skipped here; its CUDA backward is torch's.

Shape legend: B batch, H query heads, Hkv kv heads, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import selfattn
from selfattn import masks, scores
from selfattn.backends import chunked

B, H, HKV, LQ, LK, D = 1, 2, 1, 6, 7, 3


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(4)


def _leaf(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()


def _term(name: str, gen: torch.Generator) -> tuple[list[torch.Tensor], object]:
    """(the term's learned tensors, a function of them giving attention's keyword arguments)."""
    if name == "none":
        return [], lambda: {}
    if name == "bias":
        return [_leaf(B, H, LQ, LK, gen=gen)], lambda t: {"bias": t}
    if name == "bias (1, H, Lq, Lk)":
        return [_leaf(1, H, LQ, LK, gen=gen)], lambda t: {"bias": t}
    if name == "bias (B, 1, 1, Lk)":
        return [_leaf(B, 1, 1, LK, gen=gen)], lambda t: {"bias": t}
    if name == "sinks":
        return [_leaf(H, gen=gen)], lambda t: {"sinks": t}
    if name == "t5 table":
        def t5(table):
            return {"score_mod": scores.custom(lambda s, b, h, i, j: s + table[(i - j).clamp(-3, 3) + 3, h],
                                               additive=True)}
        return [_leaf(7, H, gen=gen)], t5
    if name == "alibi slopes":
        return [_leaf(H, gen=gen, scale=0.3)], lambda slopes: {"score_mod": scores.alibi(slopes)}
    if name == "temperature":
        def temperature(t):
            return {"score_mod": scores.custom(lambda s, b, h, i, j: s * t[h].exp())}
        return [_leaf(H, gen=gen, scale=0.3)], temperature
    if name == "learned softcap":
        def cap(c):
            return {"score_mod": scores.custom(lambda s, b, h, i, j: c.exp() * torch.tanh(s / c.exp()))}
        return [_leaf(1, gen=gen, scale=0.3)], cap
    raise AssertionError(name)


TERMS = ("none", "bias", "bias (1, H, Lq, Lk)", "bias (B, 1, 1, Lk)", "sinks", "t5 table", "alibi slopes",
         "temperature", "learned softcap")
ACCEPTS = {  # backend -> the terms it gives gradients for (the others it declines, with the reason)
    "reference": set(TERMS),
    "sdpa": {"none", "bias", "bias (1, H, Lq, Lk)", "bias (B, 1, 1, Lk)", "t5 table", "alibi slopes"},
    "chunked": set(TERMS),
    "chunked (fused)": {"none"},
}
RUNS = [(b, t, m) for b in ACCEPTS for t in TERMS if t in ACCEPTS[b] for m in ("none", "causal+window")]


def _call(backend: str, term: str, mask: str):
    name = "chunked" if backend.startswith("chunked") else backend
    kernel = "fused" if backend == "chunked (fused)" else "math"
    gen = _gen()
    q = _leaf(B, H, LQ, D, gen=gen)
    k, v = _leaf(B, HKV, LK, D, gen=gen), _leaf(B, HKV, LK, D, gen=gen)
    tensors, kwargs_of = _term(term, gen)
    extra = {"mask": masks.sliding_window(3) & masks.causal("bottom_right")} if mask != "none" else {}

    def fn(q, k, v, *learned):
        opts = chunked.options(block_q=2, block_k=3, kernel=kernel) if name == "chunked" else contextlib.nullcontext()
        with opts:
            return selfattn.attention(q, k, v, backend=name, **kwargs_of(*learned), **extra)
    return fn, (q, k, v, *tensors)


@pytest.mark.parametrize(("backend", "term", "mask"), RUNS, ids=[f"{b}-{t}-{m}" for b, t, m in RUNS])
def test_gradcheck(backend, term, mask):
    """catches: any input's gradient (q, k, v, a bias reduced over broadcast dims, sinks, a learned term's
    tensors) that is not the derivative of the forward, in the backend's own backward, with GQA, Lq != Lk,
    several tiles and a window that empties some."""
    fn, inputs = _call(backend, term, mask)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("term", TERMS)
def test_reference_second_derivative(term):
    """catches: the reference backend (autograd all the way, what a gradient penalty must use) with a second
    derivative that is wrong for some input or term."""
    fn, inputs = _call("reference", term, "causal+window")
    assert torch.autograd.gradgradcheck(fn, inputs, eps=1e-6, atol=1e-5)


def test_sdpa_second_derivative_with_a_bias():
    """catches: sdpa's math path (a float mask) with a wrong second derivative."""
    fn, inputs = _call("sdpa", "bias", "causal+window")
    assert torch.autograd.gradgradcheck(fn, inputs, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("kernel", ["math", "fused"])
def test_chunked_refuses_a_second_derivative(kernel):
    """catches: chunked's custom backward giving, under create_graph=True, gradients that a second backward
    treats as constants: a gradient penalty that is silently wrong (it was, before it raised)."""
    fn, (q, k, v) = _call("chunked" if kernel == "math" else "chunked (fused)", "none", "none")
    out = fn(q, k, v)
    with pytest.raises(RuntimeError, match=r"chunked attention has no second derivative.*backend='reference'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    dq, = torch.autograd.grad(fn(q, k, v).sum(), q)  # a first derivative is unaffected
    assert torch.isfinite(dq).all()

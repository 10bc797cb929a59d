"""Test oracle and tolerance rule.

The oracle is plain math in float64 written here, independent of every backend. A backend's
error must stay within twice (outputs) or three times (gradients) the error of the same plain
math done in the input's dtype, plus a few ulps of the output's magnitude (for float64, where
the naive math is the oracle itself).

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import selfattn
from selfattn.masks import Mask

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def make_qkv(b: int, hq: int, hkv: int, lq: int, lk: int, d: int, dv: int | None = None, *,
             dtype: torch.dtype = torch.float32, seed: int = 0, noncontiguous: bool = False,
             requires_grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Random q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); optionally non-contiguous
    (built as (B, L, H, D) and transposed, the layout a module's projection gives)."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv

    def t(h: int, length: int, dim: int) -> Tensor:
        if noncontiguous:
            x = torch.randn(b, length, h, dim, generator=g, dtype=torch.float64).transpose(1, 2)
        else:
            x = torch.randn(b, h, length, dim, generator=g, dtype=torch.float64)
        return x.to(dtype).requires_grad_(requires_grad)

    return t(hq, lq, d), t(hkv, lk, d), t(hkv, lk, dv)


def plain_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor | None, bias: Tensor | None,
                    scale: float | None, *, safe: bool, mod=None) -> Tensor:
    """The textbook math in q's dtype; ``safe`` gives 0 (not NaN) for rows that see no key."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.to(s.dtype)
    if mod is not None:  # the oracle's own dense form of a score modifier: (B, H, Lq, Lk) -> same
        s = mod(s)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if safe:
        alive = torch.isfinite(s).any(-1, keepdim=True)
        s = torch.where(alive, s, torch.zeros_like(s))
        w = torch.softmax(s, dim=-1) * alive
    else:
        w = torch.softmax(s, dim=-1)
    return w @ v


def dense_of(mask: Mask | Tensor | None, causal: bool | str, lq: int, lk: int) -> Tensor | None:
    m = selfattn.masks.from_tensor(mask) if isinstance(mask, Tensor) else mask
    if causal:
        c = selfattn.masks.causal("top_left" if causal is True else causal)
        m = c if m is None else c & m
    return None if m is None else m.dense(lq, lk)


def tolerance(err_naive: float, ref: Tensor, dtype: torch.dtype, factor: float) -> float:
    """factor x the naive error, plus a floor of a few ulps of the largest value. In float64 the
    naive math is the oracle itself (error 0), so the floor is all there is: 64 ulps there, room
    for summing one row in several runs; 16 ulps elsewhere, where the naive error dominates."""
    ulps = 64 if dtype == torch.float64 else 16
    return factor * err_naive + ulps * torch.finfo(dtype).eps * max(1.0, ref.abs().max().item())


def check_against_reference(q: Tensor, k: Tensor, v: Tensor, *, backend: str, mask=None, bias=None,
                            causal: bool | str = False, scale: float | None = None,
                            grads: bool = True, seed: int = 0, score_mod=None, oracle_mod=None) -> None:
    """Assert DESIGN.md's rule for out and (optionally) dq, dk, dv (and lse where returned)."""
    lq, lk = q.shape[2], k.shape[2]
    visible = dense_of(mask, causal, lq, lk)
    q64, k64, v64 = (t.detach().double().requires_grad_(grads) for t in (q, k, v))
    b64 = None if bias is None else bias.double()
    ref = plain_attention(q64, k64, v64, visible, b64, scale, safe=True, mod=oracle_mod)
    qn, kn, vn = (t.detach().clone().requires_grad_(grads) for t in (q, k, v))
    naive = plain_attention(qn, kn, vn, visible, bias, scale, safe=False, mod=oracle_mod)

    out = selfattn.attention(q, k, v, mask=mask, bias=bias, causal=causal, scale=scale, backend=backend,
                             score_mod=score_mod)
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), f"{backend}: non-finite output"
    err = (out.double() - ref).abs().max().item()
    err_naive = (naive.double().nan_to_num(0) - ref).abs().max().item()
    tol = tolerance(err_naive, ref, q.dtype, 2)
    assert err <= tol, f"{backend}: output error {err:.3g} > {tol:.3g} (naive {err_naive:.3g})"

    if not grads:
        return
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    gref = torch.autograd.grad(ref, (q64, k64, v64), dout)
    gnaive = torch.autograd.grad(naive, (qn, kn, vn), dout.to(q.dtype))
    gout = torch.autograd.grad(out, (q, k, v), dout.to(q.dtype))
    for name, a, n, r in zip("qkv", gout, gnaive, gref, strict=True):
        assert torch.isfinite(a).all(), f"{backend}: non-finite d{name}"
        err = (a.double() - r).abs().max().item()
        err_naive = (n.double().nan_to_num(0) - r).abs().max().item()
        tol = tolerance(err_naive, r, q.dtype, 3)
        assert err <= tol, f"{backend}: d{name} error {err:.3g} > {tol:.3g} (naive {err_naive:.3g})"


def lse_reference(q: Tensor, k: Tensor, visible: Tensor | None, scale: float | None = None) -> Tensor:
    hq, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q.double() @ k.transpose(-1, -2) * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return torch.logsumexp(s, dim=-1)

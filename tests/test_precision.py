"""Blocks merged by lse keep the float32 rule, at any number of blocks.

The public block API (``chunked.fused_block``, ``Merge``, ``fused_block_backward``) is what the
distributed ring and anyone tiling attention themselves compute with: the pieces of one call,
merged, must be as close to the float64 oracle as one softmax is, for the output, the lse and every
gradient (the backward reads the merged output through rowsum(dO * O), which amplifies its
rounding). tests/test_distributed.py holds the ring itself to the same rule across world sizes.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D head dim, n key blocks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from selfattn import masks, testing
from selfattn.backends import chunked

pytestmark = pytest.mark.skipif(not chunked.fused_block_available(torch.device("cpu"), 8, 8),
                                reason="no fused CPU kernel in this torch")


def _blocks(q, k, v, n, visible, scale):
    """out, lse, dq, dk, dv of attention computed as n key blocks merged by lse."""
    lk = k.shape[2]
    edges = [round(i * lk / n) for i in range(n + 1)]
    pieces = [(a, b) for a, b in itertools.pairwise(edges) if b > a]
    merged = chunked.Merge.empty(tuple(q.shape[:3]), v.shape[3], torch.float32, q.device)
    for a, b in pieces:
        vis = None if visible is None else visible[..., a:b]
        merged.add(*chunked.fused_block(q, k[:, :, a:b], v[:, :, a:b], scale=scale, visible=vis))
    out, lse = merged.result(q.dtype)
    return out, lse, pieces


def _grads(q, k, v, out, lse, dout, pieces, visible, scale):
    lse_b = lse.masked_fill(torch.isneginf(lse), float("inf"))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in pieces:
        vis = None if visible is None else visible[..., a:b]
        gq, gk, gv = chunked.fused_block_backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse_b, scale=scale,
                                                  visible=vis)
        dq += gq
        dk[:, :, a:b] += gk
        dv[:, :, a:b] += gv
    return dq, dk, dv


@settings(max_examples=40)
@example(n=4, b=2, hkv=2, g=2, lq=38, extra=214, d=16, magnitude=2.0, causal=False, seed=4047)  # found by the search
@example(n=32, b=2, hkv=2, g=2, lq=64, extra=224, d=8, magnitude=2.0, causal=False, seed=0)
@given(n=st.integers(1, 32), b=st.integers(1, 2), hkv=st.integers(1, 2), g=st.sampled_from([1, 2]),
       lq=st.integers(1, 96), extra=st.integers(0, 256), d=st.sampled_from([8, 16, 64]),
       magnitude=st.sampled_from([1.0, 2.0]), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_merged_blocks_keep_the_rule(n, b, hkv, g, lq, extra, d, magnitude, causal, seed):
    """catches: partial outputs merged by rescaling a normalised float32 output with a rounded running
    lse at every merge: its error grows with the number of blocks and crosses the rule from about 8
    blocks on, in the output and (through rowsum(dO * O)) in dq, dk and dv."""
    lk = n + extra
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hkv * g, lq, d, generator=gen, dtype=torch.float64) * magnitude).float()
    k = (torch.randn(b, hkv, lk, d, generator=gen, dtype=torch.float64) * magnitude).float()
    v = torch.randn(b, hkv, lk, d, generator=gen, dtype=torch.float64).float()
    dout = torch.randn(b, hkv * g, lq, d, generator=gen, dtype=torch.float64)
    scale = d ** -0.5
    mask = masks.causal("bottom_right") if causal else None
    visible = None if mask is None else mask.dense(lq, lk)

    out, lse, pieces = _blocks(q, k, v, n, visible, scale)
    dq, dk, dv = _grads(q, k, v, out, lse, dout.float(), pieces, visible, scale)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = testing.reference_attention(q64, k64, v64, mask=mask, scale=scale)
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    naive = testing.reference_attention(qn, kn, vn, mask=mask, scale=scale, dtype=None, safe=False)
    gref = torch.autograd.grad(ref, (q64, k64, v64), dout)
    gnaive = torch.autograd.grad(naive, (qn, kn, vn), dout.float())
    lse_ref = testing.reference_lse(q64, k64, mask=mask, scale=scale)
    lse_naive = testing.reference_lse(q, k, mask=mask, scale=scale, dtype=None)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isneginf(lse), ~finite)
    checks = [testing.compare_to_reference(out, ref, naive, name="out"),
              testing.compare_to_reference(lse[finite], lse_ref[finite], lse_naive[finite], name="lse")]
    checks += [testing.compare_to_reference(a, r, nv, factor=testing.GRADIENT_FACTOR, name=name)
               for name, a, r, nv in zip(("dq", "dk", "dv"), (dq, dk, dv), gref, gnaive, strict=True)]
    assert all(c.ok for c in checks), "\n".join(map(str, checks))


def test_merge_of_nothing_is_zero_with_lse_minus_inf():
    """catches: rows that no block reached (or only blocks that hide them) giving NaN instead of 0."""
    merged = chunked.Merge.empty((1, 2, 3), 4, torch.float32, "cpu")
    o = torch.zeros(1, 2, 3, 4)
    merged.add(o, torch.full((1, 2, 3), float("-inf")))
    out, lse = merged.result()
    assert torch.equal(out, torch.zeros(1, 2, 3, 4)) and bool(torch.isneginf(lse).all())

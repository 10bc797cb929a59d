"""The public oracle and tolerance rule in selfattn.testing, checked against torch's own SDPA.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import make_qkv

import selfattn
from selfattn import masks, scores, testing


def _sdpa(q, k, v, **kwargs):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kwargs)


def _keys_up_to(lq: int, lk: int, shift: int) -> torch.Tensor:
    """(Lq, Lk) bool: query r sees keys j <= r + shift, built with tril as SDPA users write it."""
    return torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=shift)


@pytest.mark.parametrize("lq,lk", [(37, 37), (23, 61), (61, 23)])
def test_oracle_matches_sdpa_float64_gqa_bool_mask(lq, lk):
    """guards: an oracle that maps GQA heads wrongly (interleaved vs blocked), reads a bool mask
    with the opposite polarity, or breaks when Lq != Lk."""
    q, k, v = make_qkv(2, 6, 2, lq, lk, 16, 12, dtype=torch.float64, requires_grad=False)
    keep = torch.rand(2, 1, lq, lk, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[..., 0] = True  # every row sees a key: SDPA's answer on dead rows is not the point here
    out = testing.reference_attention(q, k, v, mask=keep)
    assert out.dtype == torch.float64 and out.shape == (2, 6, lq, 12)
    torch.testing.assert_close(out, _sdpa(q, k, v, attn_mask=keep), rtol=1e-12, atol=1e-12)
    as_mask = testing.reference_attention(q, k, v, mask=masks.from_tensor(keep))
    torch.testing.assert_close(as_mask, out, rtol=0, atol=0)


@pytest.mark.parametrize("lq,lk", [(23, 61), (40, 40)])
def test_oracle_causal_alignments_match_sdpa(lq, lk):
    """guards: causal alignment swapped (bottom-right drawn top-left) or off by one at the diagonal."""
    q, k, v = make_qkv(1, 4, 4, lq, lk, 8, dtype=torch.float64, requires_grad=False)
    top = testing.reference_attention(q, k, v, causal="top_left")
    torch.testing.assert_close(top, _sdpa(q, k, v, is_causal=True), rtol=1e-12, atol=1e-12)
    bottom = testing.reference_attention(q, k, v, causal="bottom_right")
    torch.testing.assert_close(bottom, _sdpa(q, k, v, attn_mask=_keys_up_to(lq, lk, lk - lq)),
                               rtol=1e-12, atol=1e-12)
    if lq == lk:
        torch.testing.assert_close(testing.reference_attention(q, k, v, causal=True), top, rtol=0, atol=0)
    else:
        with pytest.raises(ValueError, match="Lq == Lk"):
            testing.reference_attention(q, k, v, causal=True)


def test_oracle_bias_scale_and_composed_mask_match_sdpa():
    """guards: bias added after masking or before the scale, or a custom scale ignored."""
    q, k, v = make_qkv(2, 4, 2, 30, 45, 8, dtype=torch.float64, requires_grad=False)
    bias = torch.randn(1, 4, 30, 45, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mask = masks.sliding_window(7) & masks.padding([45, 20])
    out = testing.reference_attention(q, k, v, mask=mask, bias=bias, scale=0.3, causal="bottom_right")
    visible = mask.dense(30, 45) & _keys_up_to(30, 45, 15)
    additive = bias.masked_fill(~visible, float("-inf"))
    torch.testing.assert_close(out, _sdpa(q, k, v, attn_mask=additive, scale=0.3), rtol=1e-12, atol=1e-12)


def test_oracle_score_mod_indices_are_key_coordinates():
    """guards: a score modifier given the query's row instead of its position in key coordinates
    (ALiBi then penalises the wrong distance when Lq != Lk), or the wrong head index."""
    lq, lk, hq = 5, 12, 4
    q, k, v = make_qkv(1, hq, 2, lq, lk, 8, dtype=torch.float64, requires_grad=False)
    slopes = scores.alibi_slopes(hq).double()
    rows = torch.arange(lq).view(-1, 1) + lk - lq
    bias = -slopes.view(1, -1, 1, 1) * (rows - torch.arange(lk).view(1, -1)).abs()
    want = testing.reference_attention(q, k, v, bias=bias, causal="bottom_right")
    for mod in (scores.alibi(slopes), lambda s, b, h, i, j: s - slopes[h] * (i - j).abs()):
        got = testing.reference_attention(q, k, v, score_mod=mod, causal="bottom_right")
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_dead_rows_give_zero_and_minus_inf_lse():
    """guards: a row that sees no key giving NaN (safe) or hiding the NaN of the naive math
    (safe=False), and an lse that is finite on such a row."""
    q, k, v = make_qkv(2, 2, 2, 6, 6, 4, dtype=torch.float64, requires_grad=False)
    mask = masks.padding([6, 3], queries=True)  # item 1: rows 3.. see nothing
    out = testing.reference_attention(q, k, v, mask=mask)
    assert torch.isfinite(out).all() and (out[1, :, 3:] == 0).all() and (out[0] != 0).all()
    assert torch.isnan(testing.reference_attention(q, k, v, mask=mask, safe=False)[1, :, 3:]).all()
    lse = testing.reference_lse(q, k, mask=mask)
    assert lse.shape == (2, 2, 6) and torch.isneginf(lse[1, :, 3:]).all() and torch.isfinite(lse[0]).all()
    s = q @ k.transpose(-1, -2) / 2  # D = 4: scale 1/2
    torch.testing.assert_close(lse[0], torch.logsumexp(s[0], -1), rtol=1e-12, atol=1e-12)


def test_dtype_none_is_the_naive_same_dtype_math():
    """guards: a "naive" result silently computed in float64, which would make the rule demand
    float64 accuracy from a bfloat16 kernel (tolerance far too tight)."""
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, dtype=torch.bfloat16, requires_grad=False)
    naive = testing.reference_attention(q, k, v, dtype=None, safe=False)
    assert naive.dtype == torch.bfloat16
    ref = testing.reference_attention(q, k, v)
    assert ref.dtype == torch.float64 and 0 < testing.max_error(naive, ref) < 0.1


def test_tolerance_formula():
    """guards: the rule drifting from its definition (factor x naive error + 64 ulps in float64,
    16 in float32, 2 in float16/bfloat16, of max(1, the largest value))."""
    ref = torch.tensor([0.5, -3.0], dtype=torch.float64)
    assert testing.tolerance(0.0, ref, torch.float64, 2) == 64 * torch.finfo(torch.float64).eps * 3.0
    assert testing.tolerance(1e-3, ref, torch.float32, 2) == 2e-3 + 16 * torch.finfo(torch.float32).eps * 3.0
    small = torch.tensor([0.25], dtype=torch.float64)
    assert testing.tolerance(0.0, small, torch.bfloat16, 3) == 2 * torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_check_accepts_a_correct_implementation(dtype):
    """guards: a rule so tight that torch's own SDPA fails it (in any dtype, gradients included)."""
    q, k, v = make_qkv(2, 6, 2, 33, 47, 16, dtype=dtype)
    results = testing.check_against_reference(_sdpa_masked, q, k, v, mask=_keys_up_to(33, 47, 14))
    assert [r.name for r in results] == [f"_sdpa_masked: {x}" for x in ("out", "dq", "dk", "dv")]
    assert all(r.ok for r in results)
    testing.check_against_reference(selfattn.attention, q, k, v, causal="bottom_right", backend="chunked")


def _sdpa_masked(q, k, v, mask):
    return _sdpa(q, k, v, attn_mask=mask)


def _missing_scale(q, k, v):
    return _sdpa(q, k, v, scale=1.0)


def _top_left_causal(q, k, v, causal):
    return _sdpa(q, k, v, is_causal=True)


def _dv_detached(q, k, v):
    return _sdpa(q, k, v.detach()) + 0 * v.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bug,kwargs,where", [
    (_missing_scale, {}, "out"),
    (_top_left_causal, {"causal": "bottom_right"}, "out"),
    (_dv_detached, {}, "dv"),
])
def test_check_flags_a_buggy_implementation(bug, kwargs, where, dtype):
    """guards: a rule too loose to notice a missing 1/sqrt(D) scale, a causal mask with the wrong
    alignment, or a value gradient that never flows (a forward-only check)."""
    q, k, v = make_qkv(2, 4, 4, 20, 50, 64, dtype=dtype)
    with pytest.raises(AssertionError, match=rf"{bug.__name__}: d?{where}: error .* > tolerance .* \(naive"):
        testing.check_against_reference(bug, q, k, v, **kwargs)


def test_compare_and_assert_close():
    """guards: a comparison that passes non-finite output, or an assertion without the numbers."""
    q, k, v = make_qkv(1, 2, 2, 8, 8, 4, requires_grad=False)
    ref = testing.reference_attention(q, k, v)
    naive = testing.reference_attention(q, k, v, dtype=None, safe=False)
    good = testing.assert_close_to_reference(_sdpa(q, k, v), ref, naive)
    assert good.ok and good.error <= good.tolerance and good.naive_error >= 0
    bad = _sdpa(q, k, v).clone()
    bad[0, 0, 0, 0] = float("nan")
    assert not testing.compare_to_reference(bad, ref, naive).ok
    with pytest.raises(AssertionError, match=r"out: error .* > tolerance"):
        testing.assert_close_to_reference(_missing_scale(q, k, v), ref, naive)
    assert testing.max_error(ref + 0.5, ref) == pytest.approx(0.5)


def test_check_gives_fn_only_the_arguments_that_are_set():
    """guards: a checker that cannot test a function without mask/bias/scale parameters."""
    q, k, v = make_qkv(1, 2, 1, 8, 8, 4)

    def plain(q, k, v):
        s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(s, -1) @ v.repeat_interleave(2, 1)

    testing.check_against_reference(plain, q, k, v)
    with pytest.raises(AssertionError, match=r"wrong dtype: expected a torch\.float32 tensor of shape"):
        testing.check_against_reference(lambda q, k, v: plain(q, k, v).double(), q, k, v, name="wrong dtype")


def test_naive_overflow_does_not_widen_the_tolerance():
    """catches: a plain float16 result that overflows (inf, then NaN) being counted as error max|ref|,
    so that an implementation returning zeros passed."""
    q = k = torch.full((1, 1, 4, 64), 40.0, dtype=torch.float16)  # q.k = 102400 > 65504
    v = torch.randn(1, 1, 4, 64, generator=torch.Generator().manual_seed(0)).half()

    def zeros(q, k, v, **kwargs):
        return torch.zeros_like(q) + 0 * (q.sum() + k.sum() + v.sum())

    with pytest.raises(AssertionError):
        testing.check_against_reference(zeros, q, k, v, grads=False)
    testing.check_against_reference(lambda q, k, v, **kw: torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float()).half(), q, k, v, grads=False)

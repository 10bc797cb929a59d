"""Attention sinks: one learned logit per head that joins every row's softmax and has no value.

Checked against the float64 oracle (``testing.reference_attention(sinks=)``) on drawn calls of
every kind (shapes, GQA, layouts, masks, bias, score modifiers, tile sizes), with the gradient of
the sinks; plus the identities that pin the definition down.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_qkv
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import cases

import selfattn
from selfattn import masks, testing
from selfattn.backends import chunked

SINK_BACKENDS = ["reference", "chunked"]


@settings(max_examples=60)
@given(case=cases(max_len=40), backend=st.sampled_from(SINK_BACKENDS), spread=st.sampled_from([0.5, 3.0, 20.0]))
def test_sinks_match_the_oracle_on_drawn_calls(case, backend, spread):
    """catches: a sink added to the numerator, counted once per tile instead of once per row,
    taken from the wrong head under GQA, or a wrong sink gradient."""
    built = case.tensors()
    q, k, v = (built[n].make() for n in "qkv")
    bias = built["bias"].make().detach() if "bias" in built else None
    gen = torch.Generator().manual_seed(case.seed)
    sinks = (torch.randn(case.hq, generator=gen, dtype=torch.float64) * spread).to(case.dtype)
    with chunked.options(block_q=case.block_q, block_k=case.block_k):
        testing.check_against_reference(selfattn.attention, q, k, v, mask=case.mask, bias=bias,
                                        causal=case.causal, scale=case.scale, score_mod=case.score_mod,
                                        sinks=sinks, backend=backend, seed=case.seed)


@pytest.mark.parametrize("backend", SINK_BACKENDS)
def test_sinks_of_minus_infinity_change_nothing(backend, small_tiles):
    """catches: a sink term that leaks into the output when its weight is exp(-inf) = 0."""
    q, k, v = make_qkv(2, 4, 2, 70, 90, 16, requires_grad=False)
    sinks = torch.full((4,), float("-inf"))
    mask = masks.sliding_window(20) & masks.padding([90, 40])
    plain, lse = selfattn.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    with_sinks, lse_s = selfattn.attention(q, k, v, mask=mask, backend=backend, sinks=sinks, return_lse=True)
    torch.testing.assert_close(with_sinks, plain, rtol=0, atol=0)
    torch.testing.assert_close(lse_s, lse, rtol=0, atol=0)


@pytest.mark.parametrize("backend", SINK_BACKENDS)
def test_sink_scales_the_output_by_its_share(backend, small_tiles):
    """With lse the logsumexp over keys, out_sinks = out * exp(lse) / (exp(lse) + exp(sink)), and
    the returned lse is logaddexp(lse, sink); a row that sees no key gives 0, never NaN."""
    q, k, v = make_qkv(2, 4, 1, 70, 70, 16, dtype=torch.float64, requires_grad=False)
    sinks = torch.tensor([-3.0, 0.0, 2.0, 8.0], dtype=torch.float64)
    mask = masks.padding([70, 0])  # the second item sees no key at all
    out, lse = selfattn.attention(q, k, v, mask=mask, causal=True, backend=backend, return_lse=True)
    out_s, lse_s = selfattn.attention(q, k, v, mask=mask, causal=True, backend=backend, return_lse=True,
                                      sinks=sinks)
    total = torch.logaddexp(lse, sinks.view(1, -1, 1))
    torch.testing.assert_close(lse_s, total.float())
    torch.testing.assert_close(out_s, out * torch.exp(lse - total).unsqueeze(-1))
    assert torch.equal(out_s[1], torch.zeros_like(out_s[1]))
    torch.testing.assert_close(lse_s[1], sinks.float().view(-1, 1).expand(4, 70))


def test_sink_gradient_of_a_dead_row_is_zero(small_tiles):
    """A row that sees no key gives the sink probability 1: its gradient must be 0, not NaN."""
    q, k, v = make_qkv(1, 2, 2, 40, 40, 8)
    sinks = torch.zeros(2, requires_grad=True)
    out = selfattn.attention(q, k, v, mask=masks.padding([0]), sinks=sinks, backend="chunked")
    out.sum().backward()
    assert torch.equal(sinks.grad, torch.zeros(2))
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (q, k, v))


def test_weights_leave_the_sink_out():
    """attention_with_weights: rows sum to 1 - p_sink, and out = weights @ v."""
    q, k, v = make_qkv(1, 2, 2, 5, 7, 8, dtype=torch.float64, requires_grad=False)
    sinks = torch.tensor([0.0, 1.5], dtype=torch.float64)
    out, w = selfattn.attention_with_weights(q, k, v, sinks=sinks)
    lse = testing.reference_lse(q, k)
    p_sink = torch.exp(sinks.view(1, -1, 1) - torch.logaddexp(lse, sinks.view(1, -1, 1)))
    torch.testing.assert_close(w.sum(-1), 1 - p_sink)
    torch.testing.assert_close(out, w @ v)


def test_sinks_with_dropout_match_the_pattern_used(small_tiles):
    """Dropout drops key weights, never the sink's share of the denominator, in output and gradients."""
    p = 0.3
    q, k, v = make_qkv(2, 4, 2, 70, 90, 16, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    torch.manual_seed(7)
    out = selfattn.attention(q, k, v, dropout_p=p, sinks=sinks, backend="chunked")
    torch.manual_seed(7)
    keep = chunked.dropout_pattern(chunked.draw_seed(), 2, 4, 70, 90, p, q.device)
    q64, k64, v64, s64 = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
    g = 2
    s = q64 @ k64.repeat_interleave(g, 1).transpose(-1, -2) / math.sqrt(16)
    s = torch.cat([s, s64.view(1, -1, 1, 1).expand(2, 4, 70, 1)], dim=-1)
    w = torch.softmax(s, -1)[..., :-1]
    ref = (w * keep / (1 - p)) @ v64.repeat_interleave(g, 1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    dout = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    want = torch.autograd.grad(ref, (q64, k64, v64, s64), dout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_backends_without_sinks_say_so():
    q = torch.randn(1, 2, 8, 4)
    sinks = torch.zeros(2)
    why = selfattn.explain(q, q, q, sinks=sinks)
    assert why.backend == "chunked"
    assert "sinks" in why.not_chosen["sdpa"]
    with pytest.raises(ValueError, match="sinks"):
        selfattn.attention(q, q, q, sinks=sinks, backend="sdpa")


@pytest.mark.parametrize(("sinks", "error", "match"), [
    (torch.zeros(3), ValueError, r"shape \(Hq,\) = \(2,\)"),
    (torch.zeros(1, 2), ValueError, r"shape \(Hq,\)"),
    (torch.zeros(2, dtype=torch.long), TypeError, "float tensor"),
    ([0.0, 0.0], TypeError, "float tensor of shape"),
])
def test_bad_sinks_are_refused(sinks, error, match):
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(error, match=match):
        selfattn.attention(q, q, q, sinks=sinks)


@pytest.mark.parametrize("backend", SINK_BACKENDS)
def test_a_nan_sink_gives_nan_not_a_finite_answer(backend):
    """catches: a NaN sink hidden by the dead-row guard (weights left unnormalised, finite garbage)."""
    q, k, v = make_qkv(1, 2, 2, 4, 4, 8, requires_grad=False)
    sinks = torch.tensor([float("nan"), 0.0])
    out = selfattn.attention(q, k, v, sinks=sinks, backend=backend)
    assert out[:, 0].isnan().all() and not out[:, 1].isnan().any()
    _, w = selfattn.attention_with_weights(q, k, v, sinks=sinks)
    assert w[:, 0].isnan().all()

"""Modules against the seed tutorial's classes and torch.nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch
from seed_models import (
    CorrectedSelfAttention,
    TutorialMultiHeadAttention,
    TutorialOptimizedSelfAttention,
    TutorialSelfAttention,
)
from torch import nn

import selfattn
from selfattn import masks, testing


def _within_float32_rule(ours: torch.Tensor, theirs: torch.Tensor, ref64: torch.Tensor) -> None:
    """The rule with the other float32 code as the naive yardstick: we may not be worse than it."""
    testing.assert_close_to_reference(ours, ref64, theirs)


def _x(b=4, length=10, e=64, seed=0):
    return torch.randn(b, length, e, generator=torch.Generator().manual_seed(seed))


def _causal01(length):
    return torch.ones(length, length).tril()  # the tutorial's 0/1 mask, 1 = keep


def test_self_attention_equals_tutorial():
    """catches: a different scale (sqrt(E)), projection naming or mask polarity than the tutorial."""
    torch.manual_seed(0)
    theirs = TutorialSelfAttention(64, dropout=0.0).eval()
    ours = selfattn.SelfAttention(64).eval()
    ours.load_state_dict(theirs.state_dict())
    x = _x()
    ref64 = TutorialSelfAttention(64, dropout=0.0).double().eval()
    ref64.load_state_dict(theirs.state_dict())
    for mask01 in (None, _causal01(10)):
        t_out, t_w = theirs(x, mask01)
        r_out, r_w = ref64(x.double(), mask01)
        bool_mask = None if mask01 is None else mask01.bool()
        o, w = ours(x, bool_mask, need_weights=True)
        _within_float32_rule(o, t_out, r_out)
        _within_float32_rule(w, t_w, r_w)
        _within_float32_rule(ours(x, bool_mask), t_out, r_out)


def test_self_attention_equals_tutorial_optimized():
    torch.manual_seed(1)
    theirs = TutorialOptimizedSelfAttention(64, dropout=0.0).eval()
    ours = selfattn.SelfAttention(64).eval()
    wq, wk, wv = theirs.qkv.weight.chunk(3)
    bq, bk, bv = theirs.qkv.bias.chunk(3)
    with torch.no_grad():
        for lin, w, b in ((ours.query, wq, bq), (ours.key, wk, bk), (ours.value, wv, bv)):
            lin.weight.copy_(w)
            lin.bias.copy_(b)
    ref64 = TutorialOptimizedSelfAttention(64, dropout=0.0).double().eval()
    ref64.load_state_dict(theirs.state_dict())
    x = _x(seed=1)
    mask01 = _causal01(10).expand(4, 10, 10)
    _within_float32_rule(ours(x, mask01.bool()), theirs(x, mask01)[0], ref64(x.double(), mask01)[0])


def test_self_attention_equals_corrected_answer():
    torch.manual_seed(2)
    theirs = CorrectedSelfAttention(32)
    ours = selfattn.SelfAttention(32)
    with torch.no_grad():
        for a, b in ((ours.query, theirs.queries), (ours.key, theirs.keys), (ours.value, theirs.values)):
            a.weight.copy_(b.weight)
            a.bias.copy_(b.bias)
    ref64 = CorrectedSelfAttention(32).double()
    ref64.load_state_dict(theirs.state_dict())
    x = _x(e=32, seed=2)
    _within_float32_rule(ours(x), theirs(x), ref64(x.double()))


@pytest.mark.parametrize("masked", [False, True])
def test_multi_head_equals_tutorial(masked):
    torch.manual_seed(3)
    theirs = TutorialMultiHeadAttention(64, 8, dropout=0.0).eval()
    ours = selfattn.MultiHeadAttention(64, 8).eval()
    ours.load_state_dict(theirs.state_dict())
    ref64 = TutorialMultiHeadAttention(64, 8, dropout=0.0).double().eval()
    ref64.load_state_dict(theirs.state_dict())
    x = _x(seed=3)
    mask01 = _causal01(10) if masked else None
    t_out, t_w = theirs(x, mask01)
    r_out, r_w = ref64(x.double(), mask01)
    o, w = ours(x, None if mask01 is None else mask01.bool(), need_weights=True)
    _within_float32_rule(o, t_out, r_out)
    _within_float32_rule(w, t_w, r_w)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_equals_nn_multihead_attention(padded, bias):
    """catches: q/k/v rows of in_proj_weight taken in the wrong order, or the padding polarity flipped."""
    torch.manual_seed(4)
    m = nn.MultiheadAttention(64, 8, batch_first=True, bias=bias).eval()
    m64 = nn.MultiheadAttention(64, 8, batch_first=True, bias=bias).double().eval()
    m64.load_state_dict(m.state_dict())
    ours = selfattn.MultiHeadAttention.from_torch(m).eval()
    x = _x(seed=4)
    kpm = None
    if padded:
        kpm = torch.zeros(4, 10, dtype=torch.bool)
        kpm[1, 6:] = True
        kpm[3, 2:] = True
    theirs = m(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
    ref64 = m64(x.double(), x.double(), x.double(), key_padding_mask=kpm, need_weights=False)[0]
    mask = None if kpm is None else masks.from_torch_key_padding_mask(kpm)
    _within_float32_rule(ours(x, mask), theirs, ref64)


def test_gqa_mqa_and_cross_attention_shapes_and_math():
    torch.manual_seed(5)
    for kv_heads in (8, 2, 1):
        mha = selfattn.MultiHeadAttention(64, 8, num_kv_heads=kv_heads)
        x, ctx = _x(2, 7, 64), _x(2, 13, 64, seed=9)
        out, w = mha(x, context=ctx, need_weights=True)
        assert out.shape == (2, 7, 64) and w.shape == (2, 8, 7, 13)
        # the output equals the weights applied to the projected context, then proj
        v = nn.functional.linear(ctx, mha.qkv.weight[64 + 8 * kv_heads:], mha.qkv.bias[64 + 8 * kv_heads:])
        v = v.view(2, 13, kv_heads, 8).transpose(1, 2).repeat_interleave(8 // kv_heads, dim=1)
        manual = mha.proj((w @ v).transpose(1, 2).reshape(2, 7, 64))
        torch.testing.assert_close(out, manual)


def test_module_dropout_only_in_training():
    mha = selfattn.MultiHeadAttention(32, 4, dropout=0.5)
    x = _x(2, 6, 32)
    mha.eval()
    assert torch.equal(mha(x), mha(x))
    mha.train()
    assert not torch.equal(mha(x), mha(x))


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: selfattn.MultiHeadAttention(30, 8), ValueError, "divisible"),
    (lambda: selfattn.MultiHeadAttention(32, 8, num_kv_heads=3), ValueError, "num_kv_heads"),
    (lambda: selfattn.MultiHeadAttention(32, 4)(torch.randn(2, 5, 16)), ValueError, r"\(B, L, E\)"),
    (lambda: selfattn.MultiHeadAttention(32, 4)(torch.randn(2, 5, 32), context=torch.randn(2, 5)),
     ValueError, "context"),
    (lambda: selfattn.SelfAttention(8)(torch.randn(2, 5, 8), torch.ones(5, 5)), TypeError, "bool"),
    (lambda: selfattn.MultiHeadAttention.from_torch(nn.Linear(3, 3)), TypeError, "MultiheadAttention"),
    (lambda: selfattn.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, kdim=4)), ValueError, "kdim"),
])
def test_module_errors(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()

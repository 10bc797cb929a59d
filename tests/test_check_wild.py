"""The doctor on attention modules from code bases it has not seen (tests/doctor_corpus_wild.py).

One test per module or buggy variant: a correct one must be certified (verdict "passed"; warnings are
allowed), a buggy one must fail naming its bug's id. What the doctor gets wrong today is in
:data:`NOT_YET` with the reason, marked xfail(strict=True): each entry flips to XPASS, a failure, once
the doctor handles it, and then leaves the table. Entries whose package (fair-esm, litgpt) is not
installed are skipped.

The other tests check the corpus itself: its correct modules compute what their style computes (a
wrong "correct" module would make a right verdict look wrong).

Shape legend: B batch, L length, E embed dim, H heads, D head dim, S cache length.
"""

from __future__ import annotations

import importlib.util
import math

import doctor_corpus_wild as dw
import pytest
import torch
import torch.nn.functional as F

from selfattn.check import FINDING_IDS, CannotRun

# entry -> why the doctor's verdict is wrong today (measured)
NOT_YET: dict[str, str] = {
}


def _param(name: str) -> object:
    entry = dw.WILD[name]
    marks = [pytest.mark.skipif(not entry.available, reason=f"{entry.needs} is not installed")]
    if name in NOT_YET:
        marks.append(pytest.mark.xfail(strict=True, reason=NOT_YET[name]))
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", [_param(n) for n in dw.WILD])
def test_wild_verdict(name):
    """catches: a false alarm, an inconclusive verdict or a crash on a correct module from a code base the corpus
    had not seen, and a shipped bug certified or named under another id."""
    entry = dw.WILD[name]
    try:
        report = dw.check_wild(entry)
    except CannotRun as err:
        pytest.fail(f"the doctor could not run it: {err}")
    details = (report.verdict, sorted(report.ids), report.not_verified,
               [(f.id, f.message) for f in report.findings if f.severity == "error"])
    if entry.expected is None:
        assert report.verdict == "passed", details
    else:
        assert report.verdict == "failed" and entry.expected in report.ids, details


def test_wild_table_is_complete():
    """catches: an expected id the doctor does not have (its test would wait forever), or a stale NOT_YET entry."""
    assert {w.expected for w in dw.WILD.values()} - {None} <= set(FINDING_IDS)
    assert set(NOT_YET) <= set(dw.WILD)


# -- the corpus modules compute what their style computes


def test_rel_shifts_put_position_i_minus_j_at_i_j():
    """catches: a wrong rel_shift in the ESPnet or Transformer-XL module (its "correct" verdict would be wrong)."""
    t = 5
    i = torch.arange(t)
    want = (i[:, None] - i[None, :]).double()
    espnet = dw.RelPositionSelfAttention.rel_shift(torch.arange(2 * t - 1.0).double().expand(1, 1, t, -1))
    assert torch.equal((t - 1) - espnet[0, 0], want)  # index m holds relative position t - 1 - m
    txl = dw.RelPartialLearnableMultiHeadAttn._rel_shift(torch.arange(t + 0.0).double()[None, :, None, None]
                                                           .expand(t, t, 1, 1).contiguous())[..., 0, 0]
    seen = i[:, None] >= i[None, :]  # the causal part; the rest is masked
    assert torch.equal(((t - 1) - txl)[seen], want[seen])


def test_gpt_fast_module_is_causal_rotary_attention():
    """catches: the gpt-fast style module (cache, interleaved rotary, GQA) not computing causal attention."""
    torch.manual_seed(0)
    m = dw.GptFastAttention(dw.E, dw.H, 2)
    x = torch.randn(4, 6, dw.E)
    q, k, v = m.wqkv(x).split([dw.E, dw.E // 2, dw.E // 2], dim=-1)
    freqs = dw._precompute_freqs_cis(6, dw.D)
    q = dw._apply_rotary_emb(q.view(4, 6, dw.H, dw.D), freqs).transpose(1, 2)
    k = dw._apply_rotary_emb(k.view(4, 6, 2, dw.D), freqs).transpose(1, 2).repeat_interleave(2, 1)
    v = v.view(4, 6, 2, dw.D).transpose(1, 2).repeat_interleave(2, 1)
    want = m.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(4, 6, dw.E))
    torch.testing.assert_close(dw._gpt_fast_call(m, x), want)


def test_swin_windows_partition_round_trip_and_one_window():
    """catches: the Swin map module not attending within windows (partition/reverse wrong)."""
    x = torch.randn(2, 4, 4, 3)
    assert torch.equal(dw._window_reverse(dw._window_partition(x, 2), 2, 4, 4), x)
    torch.manual_seed(0)
    m = dw.SwinWindowAttention(dw.E, dw.H, 2, 0)
    tokens = torch.randn(2, 16, dw.E)
    out = dw._square_map(m, tokens)
    first = torch.tensor([0, 1, 4, 5])  # the top-left 2 x 2 window, in raster order
    alone = m.attention(tokens[:, first], None)
    torch.testing.assert_close(out[:, first], alone)


@pytest.mark.skipif(importlib.util.find_spec("litgpt") is None, reason="litgpt is not installed")
def test_litgpt_style_module_equals_litgpt():
    """catches: the hand-written litgpt-style module differing from litgpt's CausalSelfAttention."""
    torch.manual_seed(0)
    real = dw._litgpt()()
    mine = dw.PartialRotaryCausalSelfAttention(dw.E, dw.H)
    mine.load_state_dict(real.state_dict())
    x = torch.randn(2, 7, dw.E)
    torch.testing.assert_close(dw._litgpt_style_call(mine, x, None), dw._litgpt_call(real, x, None))


def test_pair_bias_module_is_gated_attention_with_the_bias():
    """catches: the AlphaFold-style module not computing softmax(q k^T / sqrt(c) + pair bias) v, gated."""
    torch.manual_seed(0)
    m = dw.PairBiasQFirst(dw.E, dw.C_Z, dw.D, dw.H)
    x = torch.randn(3, 5, dw.E)
    z = dw._pair(5, x.dtype, x.device)
    h = m.layer_norm_m(x)
    q, k, v = (lin(h).view(3, 5, dw.H, dw.D).transpose(1, 2) for lin in (m.linear_q, m.linear_k, m.linear_v))
    bias = m.linear_z(m.layer_norm_z(z)).permute(2, 0, 1)[None]
    o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dw.D) + bias, dim=-1) @ v
    want = m.linear_o(o.transpose(1, 2).reshape(3, 5, -1) * torch.sigmoid(m.linear_g(h)))
    torch.testing.assert_close(m(x, z), want)

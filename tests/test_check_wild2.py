"""The doctor on a second round of modules from code bases it had not seen (tests/doctor_corpus_wild2.py).

As tests/test_check_wild.py: a correct module must be certified, a buggy one must fail naming its bug's id;
what the doctor gets wrong today is in :data:`NOT_YET` (xfail, strict) with the measured reason. Entries whose
package is not installed are skipped.

Shape legend: B batch, L length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import math

import doctor_corpus_wild2 as dw2
import pytest
import torch
import torch.nn.functional as F
from doctor_corpus_wild import check_wild

from selfattn.check import FINDING_IDS, CannotRun

# entry -> why the doctor's verdict is wrong today (measured)
NOT_YET: dict[str, str] = {}

# the entries that take more than a few seconds on a 2-core machine
SLOW: frozenset[str] = frozenset({"onmt-shaw/softmax over queries"})


def _param(name: str) -> object:
    entry = dw2.WILD2[name]
    marks = [pytest.mark.skipif(not entry.available, reason=f"{entry.needs} is not installed")]
    if name in NOT_YET:
        marks.append(pytest.mark.xfail(strict=True, reason=NOT_YET[name]))
    if name in SLOW:
        marks.append(pytest.mark.slow)
    return pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", [_param(n) for n in dw2.WILD2])
def test_wild2_verdict(name):
    """catches: a false alarm, an inconclusive verdict or a crash on a correct module from a code base the corpus
    had not seen (a published design read as a bug), and a shipped bug certified or named under another id."""
    entry = dw2.WILD2[name]
    try:
        report = check_wild(entry)
    except CannotRun as err:
        pytest.fail(f"the doctor could not run it: {err}")
    details = (report.verdict, sorted(report.ids), report.not_verified, report.doctor_errors,
               [(f.id, f.message) for f in report.findings if f.severity == "error"])
    assert not report.doctor_errors, details
    if entry.expected is None:
        assert report.verdict == "passed", details
    else:
        assert report.verdict == "failed" and entry.expected in report.ids, details


def test_wild2_table_is_complete():
    """catches: an expected id the doctor does not have, or a stale NOT_YET / SLOW entry."""
    assert {w.expected for w in dw2.WILD2.values()} - {None} <= set(FINDING_IDS)
    assert set(NOT_YET) <= set(dw2.WILD2) and SLOW <= set(dw2.WILD2)


# -- the corpus modules compute what their style computes


def test_shaw_module_is_attention_with_relations_on_keys_and_values():
    """catches: the OpenNMT-style module not computing softmax((q k^T + q a_ij^K) / sqrt(d)) (v + a_ij^V)."""
    torch.manual_seed(0)
    m = dw2.ShawMultiHeadedAttention(dw2.H, dw2.E)
    x = torch.randn(2, 5, dw2.E)
    q, k, v = (m.shape(lin(x)) for lin in (m.linear_query, m.linear_keys, m.linear_values))
    a = m.relative_positions_embeddings(dw2._relative_positions_matrix(5, m.max_relative_positions, x.device))
    scores = (q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, a)) / math.sqrt(dw2.D)
    p = scores.softmax(-1)
    want = m.final_linear(m.unshape(p @ v + torch.einsum("bhij,ijd->bhid", p, a)))
    torch.testing.assert_close(m(x), want)


def test_skew_puts_relative_position_j_minus_i_at_i_j():
    """catches: a wrong skew in the Music Transformer module (its "correct" verdict would be wrong)."""
    t = 4
    qe = torch.arange(t, dtype=torch.float64).expand(1, 1, t, t)  # column m holds relative position m - (t - 1)
    skewed = dw2.SkewedRelativeAttention.skew(qe)[0, 0]
    i = torch.arange(t)
    causal = i[:, None] >= i[None, :]
    assert torch.equal((skewed - (t - 1))[causal], (i[None, :] - i[:, None]).double()[causal])


def test_talking_heads_module_mixes_heads_before_and_after_the_softmax():
    """catches: the talking-heads module not computing its published formula."""
    torch.manual_seed(0)
    m = dw2.TalkingHeadsAttention(dw2.E, dw2.H, dw2.D)
    x = torch.randn(2, 5, dw2.E)
    q, k, v = (t.view(2, 5, dw2.H, -1).transpose(1, 2) for t in m.to_qkv(x).chunk(3, -1))
    logits = torch.einsum("hk,bhij->bkij", m.pre_softmax_proj, q @ k.transpose(-1, -2) / math.sqrt(dw2.D))
    w = torch.einsum("hk,bhij->bkij", m.post_softmax_proj, logits.softmax(-1))
    torch.testing.assert_close(m(x), m.to_out((w @ v).transpose(1, 2).reshape(2, 5, -1)))


def test_llama_reference_module_is_causal_gqa_rotary_attention():
    """catches: the llama-reference module (cache at start_pos, complex rotary, repeat_kv) not being causal GQA."""
    torch.manual_seed(0)
    m = dw2.LlamaReferenceAttention(dw2.E, dw2.H, 2)
    x = torch.randn(2, 6, dw2.E)
    xq, xk = dw2._apply_rotary(m.wq(x).view(2, 6, dw2.H, dw2.D), m.wk(x).view(2, 6, 2, dw2.D),
                               dw2._freqs_cis(dw2.D, 64)[:6])
    k = xk.transpose(1, 2).repeat_interleave(2, 1)
    v = m.wv(x).view(2, 6, 2, dw2.D).transpose(1, 2).repeat_interleave(2, 1)
    want = m.wo(F.scaled_dot_product_attention(xq.transpose(1, 2), k, v, is_causal=True).transpose(1, 2)
                .reshape(2, 6, dw2.E))
    torch.testing.assert_close(dw2._llama_call(m, x), want)


def test_a_doctor_bug_in_the_projections_reading_is_a_doctor_error_not_no_formula(monkeypatch):
    """catches: an IndexError or KeyError raised by the doctor's own projections reading caught as "no formula
    reproduces the output" (a LookupError) and a verdict given from the other reading; it is a doctor error,
    so the white box is not verified and the verdict inconclusive."""
    import importlib

    probe = importlib.import_module("selfattn.check.whitebox.probe")

    def broken(*args, **kwargs):
        raise IndexError("a doctor bug")
    monkeypatch.setattr(probe, "identify", broken)
    report = check_wild(dw2.WILD2["einops-attention/correct"])
    assert report.verdict == "inconclusive", (report.verdict, report.not_verified)
    assert report.coverage["white_box"].startswith("not verified") and "IndexError: a doctor bug" in \
        report.coverage["white_box"], report.coverage["white_box"]

"""Score modifiers (ALiBi, soft-capping, user functions) in every backend that runs them."""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPES, check_against_reference, make_qkv

import selfattn
from selfattn import masks, scores

SLOPES = scores.alibi_slopes(6)


def _alibi_dense(lq: int, lk: int):
    i = torch.arange(lq).view(-1, 1) + (lk - lq)
    j = torch.arange(lk).view(1, -1)
    bias = -SLOPES.double().view(1, -1, 1, 1) * (i - j).abs()  # (1, H, Lq, Lk)
    return lambda s: s + bias.to(s.dtype)


def _softcap_dense(cap: float):
    return lambda s: cap * torch.tanh(s / cap)


def _dist2(lq: int, lk: int) -> torch.Tensor:
    return (torch.arange(lq).view(-1, 1) + lk - lq - torch.arange(lk)) ** 2


CASES = {
    "alibi": (lambda: scores.alibi(SLOPES), lambda lq, lk: _alibi_dense(lq, lk)),
    "softcap": (lambda: scores.softcap(2.0), lambda lq, lk: _softcap_dense(2.0)),
    "alibi-then-softcap": (lambda: scores.chain(scores.alibi(SLOPES), scores.softcap(3.0)),
                           lambda lq, lk: (lambda s: _softcap_dense(3.0)(_alibi_dense(lq, lk)(s)))),
    "custom": (lambda: (lambda s, b, h, i, j: s * (1 + 0.1 * h.to(s.dtype))
                        - 0.01 * ((i - j) ** 2).to(s.dtype)),
               lambda lq, lk: (lambda s: s * (1 + 0.1 * torch.arange(6, dtype=s.dtype).view(1, -1, 1, 1))
                               - 0.01 * _dist2(lq, lk).to(s.dtype))),
}


def _refusal(backend: str, name: str, dtype: torch.dtype) -> str | None:
    """SDPA takes tensors only: additive modifiers become a dense bias, the others are refused; on
    half inputs the bias (float32) would be rounded to q's dtype in SDPA's kernel, so it is refused too."""
    if backend != "sdpa":
        return None
    if name in ("softcap", "alibi-then-softcap", "custom"):
        return "not additive"
    return "would round it" if dtype in (torch.float16, torch.bfloat16) else None


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_mod_matches_dense_formula(name, backend, dtype, small_tiles):
    """catches: a modifier applied before the scale, after the mask, at the wrong (i, j) alignment,
    to the wrong head, or without its derivative in the chunked backward."""
    make_mod, oracle = CASES[name]
    q, k, v = make_qkv(2, 6, 2, 57, 83, 16, dtype=dtype)
    kwargs = dict(score_mod=make_mod(), oracle_mod=oracle(57, 83), mask=masks.padding([83, 40]), causal="bottom_right")
    if (refusal := _refusal(backend, name, dtype)) is not None:
        with pytest.raises(ValueError, match=refusal):
            selfattn.attention(q, k, v, backend=backend, score_mod=make_mod())
        return
    check_against_reference(q, k, v, backend=backend, **kwargs)


@pytest.mark.parametrize("lq,lk", [(256, 256), (128, 384)])
def test_alibi_with_causal_default_tiles(lq, lk):
    """catches: the diagonal is_causal fast path dropping the ALiBi bias."""
    q, k, v = make_qkv(1, 6, 3, lq, lk, 32, dtype=torch.float64)
    check_against_reference(q, k, v, backend="chunked", causal="bottom_right",
                            score_mod=scores.alibi(SLOPES), oracle_mod=_alibi_dense(lq, lk))


def test_softcap_gradcheck_chunked():
    """catches: a wrong autograd derivative of a non-additive modifier in the chunked backward."""
    from selfattn.backends import chunked

    q, k, v = make_qkv(1, 2, 1, 7, 9, 3, dtype=torch.float64)
    mod = scores.softcap(0.7)
    with chunked.options(block_q=3, block_k=4):
        assert torch.autograd.gradcheck(
            lambda q, k, v: selfattn.attention(q, k, v, backend="chunked", score_mod=mod, causal="bottom_right"),
            (q, k, v), eps=1e-6, atol=1e-5)


def test_explain_covers_score_mods():
    q, k, v = make_qkv(1, 6, 6, 64, 64, 8, requires_grad=False)
    ex = selfattn.explain(q, k, v, score_mod=scores.softcap(5.0))
    assert ex.backend == "chunked" and "not additive" in ex.not_chosen["sdpa"]
    assert selfattn.explain(q, k, v, score_mod=scores.alibi(SLOPES)).backend == "sdpa"
    big = torch.randn(1, 6, 4096, 8)
    ex = selfattn.explain(big, big, big, score_mod=scores.alibi(SLOPES))
    assert ex.backend == "chunked"


def test_score_mod_errors():
    q, k, v = make_qkv(1, 4, 4, 8, 8, 8, requires_grad=False)
    with pytest.raises(ValueError, match="heads"):
        selfattn.attention(q, k, v, score_mod=scores.alibi(SLOPES))
    with pytest.raises(TypeError, match="score_mod"):
        selfattn.attention(q, k, v, score_mod=3.0)
    with pytest.raises(ValueError, match="cap"):
        scores.softcap(0)
    assert scores.alibi_slopes(8)[0] == 0.5 and scores.alibi_slopes(6).shape == (6,)


def test_heads_of_a_modifier_see_their_global_head():
    """catches: a modifier for H heads applied to a slice of heads with local head indices (ALiBi
    slopes of heads 0..count-1 instead of start..start+count-1), in its call and in its bias."""
    slopes = scores.alibi_slopes(8)
    part = scores.alibi(slopes).heads(4, 4)
    assert part.num_heads() == 4 and part.additive
    idx = masks.positions(torch.arange(1), 4, 0, 5, 0, 7, 5, 7)
    want = scores.alibi(slopes[4:]).bias(*idx)
    torch.testing.assert_close(part.bias(*idx), want)
    s = torch.randn(1, 4, 5, 7)
    torch.testing.assert_close(part(s, *idx), s + want)
    shifted = scores.custom(lambda s, b, h, i, j: s + h).heads(2, 3)
    assert shifted.num_heads() is None and not shifted.additive
    torch.testing.assert_close(shifted(torch.zeros(1, 3, 1, 1), *masks.positions(torch.arange(1), 3, 0, 1, 0, 1, 1, 1)),
                               torch.tensor([2.0, 3.0, 4.0]).view(1, 3, 1, 1))
    with pytest.raises(ValueError, match="reaches past"):
        scores.alibi(slopes).heads(6, 4)

"""The flex backend on the CPU (inference only there), where torch.compile works; skipped elsewhere."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import check_against_reference, make_qkv

import selfattn
from selfattn import masks, scores


@functools.cache
def _compile_works() -> str | None:
    try:
        q = torch.randn(1, 1, 16, 16)
        selfattn.attention(q, q, q, backend="flex")
    except Exception as e:  # no compiler, no inductor: the reason to skip
        return f"{type(e).__name__}: {e}"[:200]
    return None


@pytest.fixture
def flex_cpu():
    why = _compile_works()
    if why is not None:
        pytest.skip(f"torch.compile of FlexAttention does not work here: {why}")


CASES = {
    "causal+padding": dict(mask=masks.causal("bottom_right") & masks.padding([150, 97], queries=True)),
    "window|tensor": dict(mask=masks.sliding_window(20, 3) | masks.from_tensor(
        torch.rand(1, 6, 113, 150, generator=torch.Generator().manual_seed(0)) > 0.9)),
    "document+alibi": dict(mask=masks.document(torch.arange(150) // 40), causal="bottom_right",
                           score_mod=scores.alibi(scores.alibi_slopes(6))),
    "softcap+bias": dict(score_mod=scores.softcap(3.0), bias=torch.randn(1, 6, 1, 150)),
}


@pytest.mark.filterwarnings("ignore:backend='flex'")
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in ("window|tensor", "softcap+bias")
                                  else c for c in CASES])  # each compiles: two in the default run
def test_flex_matches_reference_forward(case, flex_cpu):
    """catches: a mask_mod that disagrees with the mask's dense form (alignment, broadcast dims),
    or score modifiers / bias applied at the wrong indices in FlexAttention."""
    kwargs = dict(CASES[case])
    q, k, v = make_qkv(2, 6, 2, 113, 150, 32, requires_grad=False)
    oracle_mod = None
    if "score_mod" in kwargs:
        mod = kwargs["score_mod"]
        i = torch.arange(113).view(-1, 1) + 150 - 113
        j = torch.arange(150).view(1, -1)
        hidx = torch.arange(6).view(1, -1, 1, 1)
        oracle_mod = lambda s: mod(s, torch.zeros(1, 1, 1, 1, dtype=torch.long), hidx, i, j)  # noqa: E731
    check_against_reference(q, k, v, backend="flex", grads=False, oracle_mod=oracle_mod, **kwargs)


@pytest.mark.filterwarnings("ignore:backend='flex'")
def test_flex_block_mask_is_cached_and_dead_rows_are_zero(flex_cpu):
    from selfattn.backends import flex

    q, k, v = make_qkv(2, 4, 4, 64, 64, 16, requires_grad=False)
    mask = masks.padding([64, 20], queries=True) & masks.causal()
    a = selfattn.attention(q, k, v, mask=mask, backend="flex")
    n = flex.BACKEND.cached_block_masks()
    b = selfattn.attention(q, k, v, mask=mask, backend="flex")
    assert flex.BACKEND.cached_block_masks() == n and torch.equal(a, b)
    assert (a[1, :, 20:] == 0).all() and torch.isfinite(a).all()


def test_flex_explains_what_it_cannot_do_on_cpu():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8)
    ex = selfattn.explain(q, k, v, mask=masks.sliding_window(4))
    assert ex.backend != "flex"
    assert "backward" in ex.not_chosen["flex"] or "ask for it" in ex.not_chosen["flex"]
    with torch.no_grad():
        ex = selfattn.explain(q, k, v, mask=masks.sliding_window(4))
    assert "backend='flex'" in ex.not_chosen["flex"]
    with pytest.raises(ValueError, match="no CPU backward"):
        selfattn.attention(q, k, v, backend="flex")
    with pytest.raises(ValueError, match="float64"), torch.no_grad():
        selfattn.attention(q.double(), k.double(), v.double(), backend="flex")


@pytest.mark.filterwarnings("ignore:backend='flex'")
def test_flex_sees_a_mask_tensor_changed_in_place(flex_cpu):
    """catches: a cached BlockMask served after the mask's lengths were changed in place (stale mask,
    error 0.7 against the oracle)."""
    q, k, v = make_qkv(2, 2, 2, 256, 256, 16, requires_grad=False)  # two 128-key blocks per row
    lengths = torch.tensor([256, 100])
    mask = masks.padding(lengths) & masks.causal()
    selfattn.attention(q, k, v, mask=mask, backend="flex")  # item 1's second key block: empty
    lengths[1] = 200  # now partly visible: a stale block mask would still skip it
    got = selfattn.attention(q, k, v, mask=mask, backend="flex")
    want = selfattn.attention(q, k, v, mask=mask, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

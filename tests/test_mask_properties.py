"""Every mask's fast paths against its one predicate, over random masks, compositions and shapes.

Each mask states its rule once (``Mask.predicate``); the dense form, ``block``, ``mask_mod`` and
the analytic tile bounds must all agree with it for every kind, every composition with & | ~,
Lq != Lk both ways and tiles that divide no length.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import mask_tree

from selfattn import masks
from selfattn.masks import Mask, positions

B, H = 2, 3


@st.composite
def case(draw):
    lq, lk = draw(st.integers(1, 23)), draw(st.integers(1, 23))
    return lq, lk, draw(mask_tree(B, H, lq, lk))


def _from_predicate(mask: Mask, lq: int, lk: int) -> torch.Tensor:
    idx = positions(torch.arange(B), H, 0, lq, 0, lk, lq, lk)
    return mask.predicate(lq, lk)(*idx).expand(B, H, lq, lk)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case(), st.integers(1, 9), st.integers(1, 9))
def test_every_form_agrees_with_the_predicate(c, bq, bk):
    """catches: a mask whose dense form, block slices, FlexAttention mask_mod or tile map drift from its
    rule (off-by-one alignments when Lq != Lk, a composition that combines tiles wrongly)."""
    lq, lk, mask = c
    want = _from_predicate(mask, lq, lk)
    assert torch.equal(mask.dense(lq, lk).expand(B, H, lq, lk), want)

    q0, k0 = lq // 3, lk // 2
    assert torch.equal(mask.block(q0, lq, k0, lk, lq, lk).expand(B, H, lq - q0, lk - k0), want[:, :, q0:, k0:])

    mod = mask.mask_mod(lq, lk)
    b, h, r, j = (t.view(*s) for t, s in zip(
        (torch.arange(B), torch.arange(H), torch.arange(lq), torch.arange(lk)),
        ((-1, 1, 1, 1), (1, -1, 1, 1), (1, 1, -1, 1), (1, 1, 1, -1)), strict=True))
    assert torch.equal(mod(b, h, r, j).expand(B, H, lq, lk), want)

    tiles = mask.tiles(lq, lk, bq, bk).expand(B, H, -1, -1)
    nq, nk = -(-lq // bq), -(-lk // bk)
    assert tiles.shape[-2:] == (nq, nk)
    pad = torch.zeros(B, H, nq * bq, nk * bk, dtype=torch.int8)
    pad[:, :, :lq, :lk] = want.to(torch.int8) + 1  # 0 outside the call, 1 hidden, 2 visible
    blocks = pad.view(B, H, nq, bq, nk, bk).transpose(3, 4).flatten(-2)
    inside = blocks > 0
    any_visible = (blocks == 2).any(-1)
    all_visible = ((blocks == 2) | ~inside).all(-1)
    assert not any_visible[tiles == masks.EMPTY].any(), "an EMPTY tile shows a key"
    assert all_visible[tiles == masks.FULL].all(), "a FULL tile hides a key"


def test_in_place_change_of_a_mask_tensor_is_seen_and_versioned():
    """catches: a mask that keeps a stale copy of its tensor, or a version that does not change, so
    caches keyed on it (flex block masks) serve the old mask."""
    lengths = torch.tensor([3, 5])
    m = masks.padding(lengths) & masks.causal()
    v0 = m.version()
    before = m.dense(5, 5).clone()
    lengths[0] = 5
    assert m.version() != v0
    assert not torch.equal(m.dense(5, 5), before)
    t = torch.ones(5, 5, dtype=torch.bool)
    ft = masks.from_tensor(t)
    t[0, 1] = False
    assert not bool(ft.dense(5, 5)[0, 0, 0, 1])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(case())
def test_a_shift_invariant_mask_is_constant_along_diagonals(c):
    """catches: a mask that claims shift_invariant() while its visibility depends on more than
    j - i; the chunked backend would then reuse one block for spans whose patterns differ."""
    lq, lk, mask = c
    if mask.shift_invariant():
        dense = mask.dense(lq, lk).expand(B, H, lq, lk)
        assert torch.equal(dense[:, :, 1:, 1:], dense[:, :, :-1, :-1])
        assert torch.equal(dense, dense[:1, :1].expand_as(dense))


def test_shift_invariance_of_the_built_in_masks():
    c, w = masks.causal(), masks.sliding_window(4, 2)
    assert all(m.shift_invariant() for m in (c, w, masks.causal("bottom_right"), c & w, c | ~w, ~c))
    lengths = torch.tensor([3, 5])
    assert not any(m.shift_invariant() for m in (
        masks.padding(lengths), c & masks.padding(lengths), masks.document(torch.tensor([0, 0, 1])),
        masks.from_tensor(torch.ones(3, 3, dtype=torch.bool)) | c))

    class Shifted(type(c)):  # a subclass may change the rule: it must say so itself
        pass

    assert not Shifted().shift_invariant()

"""Every mask's fast paths against its one predicate, over random masks, compositions and shapes.

Each mask states its rule once (``Mask.predicate``); the dense form, ``block``, ``mask_mod`` and
the analytic tile bounds must all agree with it for every kind, every composition with & | ~,
Lq != Lk both ways and tiles that divide no length.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from selfattn import masks
from selfattn.masks import Mask, positions

B, H = 2, 3


@st.composite
def leaf(draw, lq: int, lk: int) -> Mask:
    kind = draw(st.sampled_from(["causal", "window", "padding", "document", "tensor", "ignore"]))
    if kind == "causal":
        return masks.causal(draw(st.sampled_from(["top_left", "bottom_right"])))
    if kind == "window":
        return masks.sliding_window(draw(st.integers(0, lk + 1)), draw(st.integers(0, 3)))
    if kind == "padding":
        lengths = draw(st.lists(st.integers(0, lk + 1), min_size=B, max_size=B))
        return masks.padding(torch.tensor(lengths), queries=draw(st.booleans()))
    if kind == "document" and lq <= lk:
        ids = torch.tensor(sorted(draw(st.lists(st.integers(0, 4), min_size=lk, max_size=lk))))
        return masks.document(ids if draw(st.booleans()) else ids.expand(B, lk).clone())
    seed = draw(st.integers(0, 2**31 - 1))
    if kind == "ignore":  # True = hidden, as nn.MultiheadAttention's masks
        shape = draw(st.sampled_from([(lq, lk), (B * H, lq, lk)]))
        t = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.6
        return masks.from_torch_attn_mask(t, num_heads=H if len(shape) == 3 else None)
    shape = draw(st.sampled_from([(B, H, lq, lk), (1, 1, lq, lk), (B, 1, 1, lk), (lq, lk), (1, H, lq, 1)]))
    return masks.from_tensor(torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.4)


@st.composite
def mask_tree(draw, lq: int, lk: int, depth: int = 2) -> Mask:
    if depth == 0 or draw(st.booleans()):
        return draw(leaf(lq, lk))
    op = draw(st.sampled_from(["&", "|", "~"]))
    a = draw(mask_tree(lq, lk, depth - 1))
    if op == "~":
        return ~a
    b = draw(mask_tree(lq, lk, depth - 1))
    return a & b if op == "&" else a | b


@st.composite
def case(draw):
    lq, lk = draw(st.integers(1, 23)), draw(st.integers(1, 23))
    return lq, lk, draw(mask_tree(lq, lk))


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

"""Mask semantics against their definitions, written as explicit loops, and tile-map soundness."""

from __future__ import annotations

import pytest
import torch

import selfattn
from selfattn import masks


def _loop(pred, b: int, h: int, lq: int, lk: int) -> torch.Tensor:
    out = torch.zeros(b, h, lq, lk, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                for j in range(lk):
                    out[bi, hi, i, j] = bool(pred(bi, hi, i, j))
    return out


IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3],
                    [5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7]])
RAND = torch.rand(2, 3, 11, 11, generator=torch.Generator().manual_seed(3)) > 0.5

DEFINITIONS = {
    "causal-top_left": (masks.causal(), lambda b, h, i, j, lq, lk: j <= i),
    "causal-bottom_right": (masks.causal("bottom_right"), lambda b, h, i, j, lq, lk: j <= i + lk - lq),
    "padding": (masks.padding(torch.tensor([4, 11])), lambda b, h, i, j, lq, lk: j < [4, 11][b]),
    "padding-queries": (masks.padding(torch.tensor([4, 9]), queries=True),
                        lambda b, h, i, j, lq, lk: j < [4, 9][b] and i + lk - lq < [4, 9][b]),
    "sliding_window": (masks.sliding_window(3, 1),
                       lambda b, h, i, j, lq, lk: i + lk - lq - 3 <= j <= i + lk - lq + 1),
    "document": (masks.document(IDS), lambda b, h, i, j, lq, lk: IDS[b, i + lk - lq] == IDS[b, j]),
    "from_tensor": (masks.from_tensor(RAND[..., :11, :11]), lambda b, h, i, j, lq, lk: RAND[b, h, i, j]),
}


@pytest.mark.parametrize("name", list(DEFINITIONS))
@pytest.mark.parametrize("lq", [11, 5])
def test_dense_matches_definition(name, lq):
    """catches: off-by-one and alignment errors in each mask's predicate."""
    lk = 11
    mask, pred = DEFINITIONS[name]
    if name == "from_tensor":
        mask = masks.from_tensor(RAND[:, :, :lq, :])
    want = _loop(lambda b, h, i, j: pred(b, h, i, j, lq, lk), 2, 3, lq, lk)
    got = mask.dense(lq, lk).expand(2, 3, lq, lk)
    assert torch.equal(got, want)


def test_composition_operators():
    """catches: & | ~ wired to the wrong boolean operation."""
    a, b = masks.causal(), masks.sliding_window(2, 2)
    da, db = a.dense(9, 9), b.dense(9, 9)
    assert torch.equal((a & b).dense(9, 9), da & db)
    assert torch.equal((a | b).dense(9, 9), da | db)
    assert torch.equal((~a).dense(9, 9), ~da)
    assert torch.equal((~(a | b) & a).dense(9, 9), ~(da | db) & da)


ALL = [DEFINITIONS[n][0] for n in DEFINITIONS] + [
    masks.causal() & masks.padding(torch.tensor([4, 11])),
    masks.sliding_window(2) | masks.document(IDS),
    ~masks.causal("bottom_right") & masks.from_tensor(RAND),
    ~(masks.padding(torch.tensor([0, 7])) | masks.sliding_window(0, 3)),
    masks.padding(torch.tensor([5, 10]), queries=True) & masks.causal(),
]


@pytest.mark.parametrize("mask", ALL, ids=repr)
@pytest.mark.parametrize("bq,bk", [(1, 1), (2, 3), (4, 4), (5, 2), (16, 16)])
def test_tile_map_is_sound(mask, bq, bk):
    """catches: a FULL tile that hides a key or an EMPTY tile that shows one (wrong results),
    and a map that is not the (nQ, nK) grid."""
    lq = lk = 11
    dense = mask.dense(lq, lk).expand(2, 3, lq, lk)
    tiles = mask.tiles(lq, lk, bq, bk).expand(2, 3, -1, -1)
    nq, nk = -(-lq // bq), -(-lk // bk)
    assert tiles.shape[-2:] == (nq, nk)
    for qi in range(nq):
        for kj in range(nk):
            block = dense[:, :, qi * bq:(qi + 1) * bq, kj * bk:(kj + 1) * bk]
            t = tiles[:, :, qi, kj]
            assert block.flatten(2).all(-1)[t == masks.FULL].all()
            assert (~block.flatten(2).any(-1))[t == masks.EMPTY].all()


def test_tile_map_is_exact_for_structured_masks():
    """catches: a tile map so conservative that nothing is ever skipped."""
    t = masks.causal().tiles(8, 8, 2, 2)[0, 0]
    want = torch.full((4, 4), masks.EMPTY, dtype=torch.int8)
    want[torch.ones(4, 4, dtype=torch.bool).tril(-1)] = masks.FULL
    want.fill_diagonal_(masks.PARTIAL)
    assert torch.equal(t, want)
    w = masks.sliding_window(4).tiles(64, 64, 4, 4)[0, 0]
    assert (w == masks.EMPTY).sum() > 0.8 * w.numel()


def test_torch_convention_converters():
    """catches: polarity not flipped when converting nn.MultiheadAttention masks."""
    kpm = torch.tensor([[False, False, True], [False, True, True]])  # True = ignore
    m = masks.from_torch_key_padding_mask(kpm)
    assert torch.equal(m.dense(2, 3)[:, 0, 0], ~kpm)
    am = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)  # True = not allowed
    assert torch.equal(masks.from_torch_attn_mask(am).dense(3, 3)[0, 0], masks.causal().dense(3, 3)[0, 0])
    packed = am.expand(4, 3, 3)  # (B * H, L, L) with B = 2, H = 2
    assert masks.from_torch_attn_mask(packed, num_heads=2).dense(3, 3).shape == (2, 2, 3, 3)
    with pytest.raises(ValueError, match="num_heads"):
        masks.from_torch_attn_mask(packed)
    with pytest.raises(TypeError, match="bias"):
        masks.from_torch_attn_mask(torch.zeros(3, 3))


@pytest.mark.parametrize("bad,exc,match", [
    (lambda: masks.causal("left"), ValueError, "align"),
    (lambda: masks.sliding_window(-1), ValueError, "left"),
    (lambda: masks.sliding_window(2, right=1.5), ValueError, "right"),
    (lambda: masks.padding(torch.tensor([1.0, 2.0])), TypeError, "lengths"),
    (lambda: masks.padding(torch.tensor([-1, 2])), ValueError, "lengths"),
    (lambda: masks.document(torch.zeros(2, 2, 2, dtype=torch.long)), ValueError, "ids"),
    (lambda: masks.from_tensor(torch.ones(3, 3)), TypeError, "bool"),
    (lambda: masks.causal() & torch.ones(3, 3, dtype=torch.bool), TypeError, "from_tensor"),
    (lambda: masks.padding([1, 2]) & masks.padding([1, 2, 3]), ValueError, "batch"),
    (lambda: masks.packed(torch.tensor([0.0, 3.0])), TypeError, "cu_seqlens_q must be an int32 or int64"),
    (lambda: masks.packed([0, 3], [1, 3]), ValueError, "cu_seqlens_k must start at 0"),
    (lambda: masks.packed([0, 3, 2]), ValueError, "cu_seqlens_q must be non-decreasing"),
    (lambda: masks.packed([0]), ValueError, "N \\+ 1 >= 2 entries"),
    (lambda: masks.packed([0, 3], right=1.5), ValueError, "right"),
])
def test_mask_constructor_errors(bad, exc, match):
    """catches: bad mask arguments accepted and failing later with an obscure error."""
    with pytest.raises(exc, match=match):
        bad()


@pytest.mark.parametrize("fn", [
    lambda b, h, q, kv: torch.ones(40, 40, dtype=torch.bool),  # a whole table, not indexed
    lambda b, h, q, kv: torch.ones(3, dtype=torch.bool),
    lambda b, h, q, kv: (q >= kv).unsqueeze(0),  # 5-D
    lambda b, h, q, kv: (q >= kv).expand(2, 1, -1, -1),  # batch 2, declared 1
])
def test_from_mask_mod_refuses_a_predicate_of_the_wrong_shape(fn):
    """catches: a predicate whose output does not broadcast over its indices, which would give a
    dense mask of the wrong shape or a raw broadcasting error deep in a backend."""
    m = masks.from_mask_mod(fn)
    with pytest.raises(ValueError, match=r"mask_mod .* returned shape"):
        m.dense(5, 7)
    q = torch.randn(1, 1, 5, 8)
    with pytest.raises(ValueError, match="returned shape"):
        selfattn.attention(q, torch.randn(1, 1, 7, 8), torch.randn(1, 1, 7, 8), mask=m, backend="chunked")


def test_from_mask_mod_matches_its_predicate_and_never_claims_wrongly():
    """Dense form equals the predicate; FULL and EMPTY tiles are exact, also when the tile map is
    built in many small steps."""
    fn = lambda b, h, q, kv: ((q * 5 + kv * 3 + b + 2 * h) % 7 != 0) & (kv <= q + 40)  # noqa: E731
    m = masks.from_mask_mod(fn, batch=2, heads=3)
    lq, lk = 70, 110
    b, h, q, kv = torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(lq), torch.arange(lk), indexing="ij")
    assert torch.equal(m.dense(lq, lk).expand(2, 3, lq, lk), fn(b, h, q, kv))  # q: the query row
    dense = masks.from_tensor(m.dense(lq, lk))
    for step in (1 << 22, 100):
        m.ELEMENTS_PER_STEP = step
        tiles = m.tiles(lq, lk, 16, 24)
        ref = dense.tiles(lq, lk, 16, 24)
        assert torch.equal(tiles == masks.FULL, ref == masks.FULL)
        assert torch.equal(tiles == masks.EMPTY, ref == masks.EMPTY)


def test_a_composition_with_a_function_mask_has_no_version():
    """catches: & | ~ of a from_mask_mod mask claiming a version from its tensors alone, so a
    cache would trust a mask whose function reads a tensor changed in place."""
    fm = masks.from_mask_mod(lambda b, h, q, kv: kv <= q)
    n = torch.tensor([3, 5])
    for m in (fm & masks.causal(), masks.padding(n) | fm, ~fm, ~(fm & masks.padding(n))):
        assert m.version() is None, m
    assert (masks.padding(n) & masks.causal()).version() == (n._version,)


def test_heads_of_a_mask_are_those_heads_of_its_dense_form():
    """catches: a head slice that reads other heads (an offset dropped in the predicate, the block or
    the tile map) or that claims the wrong number of heads."""
    t = torch.rand(2, 6, 9, 11) < 0.5
    whole = masks.from_tensor(t) & masks.causal("bottom_right")
    part = whole.heads(2, 3)
    assert part.batch_heads() == (2, 3)
    torch.testing.assert_close(part.dense(9, 11), whole.dense(9, 11)[:, 2:5])
    torch.testing.assert_close(part.block(2, 7, 1, 10, 9, 11), whole.block(2, 7, 1, 10, 9, 11)[:, 2:5])
    torch.testing.assert_close(part.tiles(9, 11, 4, 3), whole.tiles(9, 11, 4, 3)[:, 2:5])
    idx = masks.positions(torch.arange(2), 3, 0, 9, 0, 11, 9, 11)
    torch.testing.assert_close(part.predicate(9, 11)(*idx), whole.dense(9, 11)[:, 2:5])
    c = masks.causal()
    assert c.heads(1, 2) is c  # a mask that broadcasts over heads is its own slice
    with pytest.raises(ValueError, match="reaches past"):
        whole.heads(4, 3)
    with pytest.raises(ValueError, match="count"):
        whole.heads(0, 0)


def test_masks_declare_what_they_are_made_of():
    """catches: a mask that cannot be taken apart and built again from its fields (what the compiled
    path and the distributed agreement read instead of vars())."""
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    for m in (masks.causal("bottom_right"), masks.sliding_window(3, 1), masks.padding([4], queries=True),
              masks.document(ids), masks.from_tensor(torch.rand(1, 2, 5, 5) < 0.5), ~masks.causal(),
              masks.from_mask_mod(lambda b, h, q, kv: q >= kv, heads=2),
              (masks.document(ids) & masks.causal()) | masks.sliding_window(1),
              masks.from_tensor(torch.rand(1, 4, 5, 5) < 0.5).heads(1, 2),
              masks.packed([0, 2, 5], right=0), masks.packed([0, 1, 5], [0, 4, 5], left=1, right=2)):
        again = type(m).from_fields(**dict(m.fields()))
        assert type(again) is type(m)
        torch.testing.assert_close(again.dense(5, 5), m.dense(5, 5))


# (cu_seqlens_q, cu_seqlens_k): equal lengths; queries shorter and longer than keys; empty sequences
PACKS = {
    "self": ([0, 4, 4, 11], None),
    "cross": ([0, 2, 9, 9, 11], [0, 6, 8, 12, 12]),
}


def _packed_definition(cu_q, cu_k, left, right):
    """Visible when both tokens belong to sequence s and, with nq, nk its lengths and r, c the row and
    key counted from its start, -left <= c - (r + nk - nq) <= right (None: unbounded)."""
    def seq(cu, x):
        return next(s for s in range(len(cu) - 1) if cu[s] <= x < cu[s + 1])

    def visible(b, h, i, j):
        s = seq(cu_q, i)
        if seq(cu_k, j) != s:
            return False
        d = (j - cu_k[s]) - (i - cu_q[s] + (cu_k[s + 1] - cu_k[s]) - (cu_q[s + 1] - cu_q[s]))
        return (left is None or d >= -left) and (right is None or d <= right)
    return visible


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize(("left", "right"), [(None, None), (None, 0), (1, 0), (2, 1), (0, None), (0, 0)])
def test_packed_matches_its_definition(pack, left, right):
    """catches: off-by-one in a sequence's bottom-right diagonal, a key of the neighbouring sequence seen
    across a boundary, and empty sequences shifting the ones after them."""
    cu_q, cu_k = PACKS[pack]
    cu_k_ = cu_q if cu_k is None else cu_k
    lq, lk = cu_q[-1], cu_k_[-1]
    m = masks.packed(torch.tensor(cu_q, dtype=torch.int32), None if cu_k is None else torch.tensor(cu_k),
                     left=left, right=right)
    want = _loop(_packed_definition(cu_q, cu_k_, left, right), 1, 1, lq, lk)
    assert torch.equal(m.dense(lq, lk), want)
    assert torch.equal(m.block(3, lq, 2, lk, lq, lk), want[:, :, 3:, 2:])
    for bq, bk in [(1, 1), (2, 3), (4, 4), (5, 2)]:
        tiles = m.tiles(lq, lk, bq, bk)[0, 0]
        for qi in range(tiles.shape[0]):
            for kj in range(tiles.shape[1]):
                block = want[0, 0, qi * bq:(qi + 1) * bq, kj * bk:(kj + 1) * bk]
                assert tiles[qi, kj] != masks.FULL or block.all()
                assert tiles[qi, kj] != masks.EMPTY or not block.any()


def test_packed_self_attention_is_document_and_causal():
    """catches: packed(cu) (right=0) not being document(ids) (& causal) when queries and keys are one axis."""
    cu = torch.tensor([0, 3, 3, 7, 8])
    ids = torch.tensor([0, 0, 0, 2, 2, 2, 2, 3])
    assert torch.equal(masks.packed(cu).dense(8, 8), masks.document(ids).dense(8, 8))
    assert torch.equal(masks.packed(cu, right=0).dense(8, 8), (masks.document(ids) & masks.causal()).dense(8, 8))
    assert torch.equal(masks.packed(cu, left=2, right=1).dense(8, 8),
                       (masks.document(ids) & masks.sliding_window(2, 1)).dense(8, 8))


def test_packed_reads_its_tensors_when_used():
    """catches: a packed mask that keeps a stale copy of cu_seqlens, or a version that does not change."""
    cu = torch.tensor([0, 4, 8])
    m = masks.packed(cu, right=0)
    v0, before = m.version(), m.dense(8, 8).clone()
    cu[1] = 2
    assert m.version() != v0 and not torch.equal(m.dense(8, 8), before)
    assert repr(m) == "packed(2 sequences, right=0)"

"""Metamorphic properties that need no oracle, at sizes where chunked spans several tiles.

- permuting keys and values together (and the mask's and bias's key axis) leaves the output unchanged;
- permuting queries permutes the output;
- huge values of keys that no query may see never leak into the output;
- adding a constant to a row's scores through bias leaves that row unchanged;
- splitting a batch gives the same rows.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import selfattn
from selfattn import masks, testing

BACKENDS = ["reference", "sdpa", "chunked"]
B, HQ, HKV, D = 2, 4, 2, 16


@st.composite
def calls(draw):
    lq = draw(st.integers(200, 420))
    lk = draw(st.integers(lq, 480))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, HQ, lq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, HKV, lk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, HKV, lk, D, generator=gen, dtype=torch.float64)
    kind = draw(st.sampled_from(["causal", "window", "padding", "document"]))
    mask = {
        "causal": masks.causal("bottom_right"),
        "window": masks.sliding_window(draw(st.integers(1, 150)), draw(st.integers(0, 20))),
        "padding": masks.padding(torch.tensor([lk, draw(st.integers(1, lk))])),
        "document": masks.document(torch.arange(lk) // draw(st.integers(20, 200))),
    }[kind]
    dense = mask.dense(lq, lk).expand(B, HQ, lq, lk)
    return q, k, v, dense, draw(st.sampled_from(BACKENDS)), mask


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return testing.max_error(a, b) <= 1e-10 * max(1.0, b.abs().max().item())


@settings(max_examples=12)
@given(calls(), st.integers(0, 2**31 - 1))
def test_permuting_keys_and_values_together(c, seed):
    """catches: a backend whose result depends on where a key sits beyond what the mask says (tiles
    skipped or merged wrongly)."""
    q, k, v, dense, backend, _mask = c
    perm = torch.randperm(k.shape[2], generator=torch.Generator().manual_seed(seed))
    a = selfattn.attention(q, k, v, mask=dense, backend=backend)
    b = selfattn.attention(q, k[:, :, perm], v[:, :, perm], mask=dense[..., perm], backend=backend)
    assert _close(b, a)


@settings(max_examples=12)
@given(calls(), st.integers(0, 2**31 - 1))
def test_permuting_queries_permutes_the_output(c, seed):
    """catches: query rows that see other rows' keys or outputs (wrong row offsets in a tile)."""
    q, k, v, dense, backend, _mask = c
    perm = torch.randperm(q.shape[2], generator=torch.Generator().manual_seed(seed))
    a = selfattn.attention(q, k, v, mask=dense, backend=backend)
    b = selfattn.attention(q[:, :, perm], k, v, mask=dense[:, :, perm], backend=backend)
    assert _close(b, a[:, :, perm])


@settings(max_examples=12)
@given(calls())
def test_hidden_keys_never_leak(c):
    """catches: masked keys that still carry weight (a fill value that is not -inf in the dtype, a skipped
    tile that was not empty): their values, set to 1e10, would dominate the output."""
    q, k, v, dense, backend, mask = c
    hidden = ~dense.any(2, keepdim=True)[:, ::HQ // HKV].transpose(-1, -2)  # (B, Hkv, Lk, 1): seen by no query
    a = selfattn.attention(q, k, v, mask=mask, backend=backend)  # the mask object: its tile map is used
    b = selfattn.attention(q, k.masked_fill(hidden, 1e3), v.masked_fill(hidden, 1e10), mask=mask, backend=backend)
    assert _close(b, a)


@settings(max_examples=12)
@given(calls(), st.integers(0, 2**31 - 1))
def test_a_constant_added_to_a_row_changes_nothing(c, seed):
    """catches: a bias applied to the wrong rows or only to some tiles of a row."""
    q, k, v, _dense, backend, mask = c
    shift = 50 * torch.randn(B, HQ, q.shape[2], 1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    a = selfattn.attention(q, k, v, mask=mask, backend=backend)
    b = selfattn.attention(q, k, v, mask=mask, bias=shift, backend=backend)
    assert _close(b, a)


@settings(max_examples=12)
@given(calls())
def test_splitting_the_batch(c):
    """catches: batch items that mix (per-item schedules, broadcast masks indexed with the wrong item)."""
    q, k, v, dense, backend, _mask = c
    whole = selfattn.attention(q, k, v, mask=dense, backend=backend)
    for i in range(B):
        one = selfattn.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask=dense[i:i + 1], backend=backend)
        assert _close(one, whole[i:i + 1])

"""Every backend against the float64 oracle with DESIGN.md's relative rule (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPES, check_against_reference, dense_of, lse_reference, make_qkv

import selfattn
from selfattn import masks

BACKENDS = ["reference", "sdpa", "chunked"]

# (B, Hq, Hkv, Lq, Lk, D, Dv): GQA 6/2 and MQA 6/1, Lq != Lk both ways, head dims 1, 59, 111.
SHAPES = {
    "gqa-113x203-d59": (2, 6, 2, 113, 203, 59, 59),
    "mqa-203x113-d111": (1, 6, 1, 203, 113, 111, 111),
    "1x1-d1": (2, 2, 2, 1, 1, 1, 1),
    "dv-differs": (1, 4, 2, 77, 77, 16, 9),
}


def _mask_cases(b: int, hq: int, lq: int, lk: int):
    g = torch.Generator().manual_seed(lq * 7 + lk)
    lengths = torch.tensor([max(1, lk - 50 * i) for i in range(b)])
    rand = torch.rand(b, 1, lq, lk, generator=g) > 0.3
    cases = {
        "none": dict(),
        "causal-top_left": dict(causal="top_left"),
        "causal-bottom_right": dict(causal="bottom_right"),
        "padding": dict(mask=masks.padding(lengths)),
        "padding-queries": dict(mask=masks.padding(lengths, queries=True), causal="bottom_right"),
        "sliding_window": dict(mask=masks.sliding_window(17, 5)),
        "from_tensor": dict(mask=rand),
        "composed": dict(mask=(masks.sliding_window(9) | masks.padding(lengths // 3)) & ~masks.from_tensor(~rand)),
        "bias+padding": dict(mask=masks.padding(lengths),
                             bias=torch.randn(1, hq, lq, lk, generator=g, dtype=torch.float64)),
    }
    if lq <= lk:
        ids = torch.arange(lk).repeat(b, 1) // max(1, lk // 4)
        cases["document+causal"] = dict(mask=masks.document(ids), causal="bottom_right")
    if lq == lk:
        cases["causal-true"] = dict(causal=True)
    return cases


def _grid():
    for sname, shape in SHAPES.items():
        b, hq, _, lq, lk, _, _ = shape
        for mname in _mask_cases(b, hq, lq, lk):
            for dtype in DTYPES:
                for be in BACKENDS:
                    yield pytest.param(be, dtype, sname, mname, id=f"{be}-{str(dtype)[6:]}-{sname}-{mname}")


@pytest.mark.parametrize("backend,dtype,shape_name,mask_name", list(_grid()))
def test_backend_matches_float64_oracle(backend, dtype, shape_name, mask_name, small_tiles):
    """catches: wrong masking, GQA head mapping, alignment or precision in any backend."""
    b, hq, hkv, lq, lk, d, dv = SHAPES[shape_name]
    q, k, v = make_qkv(b, hq, hkv, lq, lk, d, dv, dtype=dtype, noncontiguous=shape_name.startswith("gqa"))
    kwargs = _mask_cases(b, hq, lq, lk)[mask_name]
    if "bias" in kwargs:
        kwargs["bias"] = kwargs["bias"].to(dtype)
    check_against_reference(q, k, v, backend=backend, **kwargs)


LONG_MASKS = {
    "none": dict(),
    "causal-bottom_right": dict(causal="bottom_right"),
    "sliding_window": dict(mask=masks.sliding_window(100, 0)),
    "document+causal": dict(mask=masks.document(torch.arange(1024) // 300), causal="bottom_right"),
}


@pytest.mark.parametrize("mask_name", list(LONG_MASKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_long_1023x1024_default_tiles(backend, mask_name):
    """catches: errors that only appear with many default-size tiles and a ragged last tile."""
    q, k, v = make_qkv(1, 4, 2, 1023, 1024, 64, dtype=torch.float32)
    check_against_reference(q, k, v, backend=backend, **LONG_MASKS[mask_name])


@pytest.mark.slow
@pytest.mark.parametrize("mask_name", list(LONG_MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_long_1023x1024_half(backend, dtype, mask_name):
    """catches: half-precision accumulation errors on long rows."""
    q, k, v = make_qkv(1, 4, 2, 1023, 1024, 59, dtype=dtype)
    check_against_reference(q, k, v, backend=backend, **LONG_MASKS[mask_name])


@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_matches_logsumexp(backend, dtype, small_tiles):
    """catches: lse computed without the scale, with the wrong mask, or finite on dead rows."""
    q, k, v = make_qkv(2, 4, 2, 113, 203, 16, dtype=dtype, requires_grad=False)
    mask = masks.sliding_window(20) & masks.padding([203, 60])
    _, lse = selfattn.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    ref = lse_reference(q, k, dense_of(mask, False, 113, 203))
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 113)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "rows that see no key must give -inf"
    finite = torch.isfinite(ref)
    err = (lse.double() - ref)[finite].abs().max().item()
    assert err <= 1e-5 * max(1.0, ref[finite].abs().max().item()) + (0.05 if dtype.itemsize == 2 else 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["none", "causal", "padding+window", "bias"])
def test_gradcheck_float64(backend, case):
    """catches: an analytically wrong backward (custom autograd in chunked, masking in all)."""
    from selfattn.backends import chunked

    q, k, v = make_qkv(1, 2, 1, 7, 9, 3, dtype=torch.float64)
    kwargs = {
        "none": dict(),
        "causal": dict(causal="bottom_right"),
        "padding+window": dict(mask=masks.padding([6]) & masks.sliding_window(3, 1)),
        "bias": dict(bias=torch.randn(1, 2, 7, 9, dtype=torch.float64)),
    }[case]

    def f(q, k, v):
        return selfattn.attention(q, k, v, backend=backend, **kwargs)

    with chunked.options(block_q=3, block_k=4):
        assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_is_used(backend, small_tiles):
    """catches: a backend ignoring a custom scale."""
    q, k, v = make_qkv(1, 2, 2, 50, 60, 8)
    check_against_reference(q, k, v, backend=backend, scale=0.37, mask=masks.sliding_window(10))


@pytest.mark.parametrize("lq,lk", [(1024, 1024), (512, 1536)])
def test_chunked_causal_diagonal_fast_path(lq, lk):
    """catches: the is_causal shortcut for square diagonal runs misaligned with bottom-right causal."""
    from selfattn.backends import chunked

    q, k, v = make_qkv(1, 4, 2, lq, lk, 32, dtype=torch.float64)
    call_mask = masks.causal("bottom_right")
    (group,) = chunked.schedule(call_mask, lq, lk, block_q=256)
    assert any(partial for row in group.spans for _, _, partial in row)
    check_against_reference(q, k, v, backend="chunked", mask=call_mask)

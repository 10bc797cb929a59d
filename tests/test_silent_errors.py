"""Regression tests for classes of silent wrong answers: layouts, mixed-dtype bias, masks changed in
place, autocast, and score modifiers of the wrong shape. The property-based search (test_fuzz.py)
covers the open space around each of these."""

from __future__ import annotations

import pytest
import torch
from helpers import make_qkv

import selfattn
from selfattn import masks, scores, testing
from selfattn.backends import chunked

BACKENDS = ["reference", "sdpa", "chunked"]


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
@pytest.mark.parametrize("layout", ["transposed", "strided", "channels_last"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_any_strides(backend, layout, return_lse):
    """catches: fused CPU ops fed a q, k or v whose last dim is not unit-stride, which they read as if
    it were (errors up to 1.8)."""
    g = torch.Generator().manual_seed(0)
    base = {
        "transposed": lambda: torch.randn(2, 3, 8, 9, generator=g).transpose(-1, -2),
        "strided": lambda: torch.randn(2, 3, 9, 16, generator=g)[..., ::2],
        "channels_last": lambda: torch.randn(2, 9, 8, 3, generator=g).permute(0, 3, 1, 2),
    }[layout]
    q, k, v = base(), base(), base()
    assert q.stride(-1) != 1
    with chunked.options(block_q=4, block_k=4):
        try:
            result = selfattn.attention(q, k, v, backend=backend, return_lse=return_lse, causal=True)
        except ValueError:
            assert return_lse and backend == "reference"  # every other combination must run
            return
    out = result[0] if return_lse else result
    ref = testing.reference_attention(q.double(), k.double(), v.double(), causal=True)
    assert testing.max_error(out, ref) < 1e-5
    if return_lse:
        lse_ref = testing.reference_lse(q.double(), k.double(), causal=True)
        assert testing.max_error(result[1], lse_ref) < 1e-5


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_bias_on_half_inputs_is_not_rounded(backend, dtype):
    """catches: a float32 bias rounded to bf16/fp16 before it is added (error 0.11 where plain math with
    torch's type promotion has 0.006): selfattn adds bias in the compute dtype in every backend."""
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, dtype=dtype, requires_grad=False)
    bias = 40 + torch.randn(1, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    try:
        out = selfattn.attention(q, k, v, bias=bias, backend=backend)
    except ValueError as e:
        assert backend == "sdpa" and "bias" in str(e)
        return
    ref = testing.reference_attention(q.double(), k.double(), v.double(), bias=bias.double())
    promoted = (torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + bias, -1).to(dtype) @ v)
    assert testing.max_error(out, ref) <= 2 * testing.max_error(promoted, ref) + 1e-2


def test_chunked_backward_refuses_a_mask_changed_since_the_forward():
    """catches: the chunked backward re-reading a mask tensor that the training loop changed in place
    after the forward, giving the gradient of another mask (dq off by 1.3)."""
    q, k, v = make_qkv(1, 2, 2, 40, 40, 8, dtype=torch.float64)
    buf = torch.ones(40, 40, dtype=torch.bool).tril()
    out = selfattn.attention(q, k, v, mask=masks.from_tensor(buf), backend="chunked")
    buf.fill_(True)
    with pytest.raises(RuntimeError, match="changed in place"):
        out.sum().backward()


def test_chunked_backward_refuses_a_bias_changed_since_the_forward():
    """catches: the chunked backward reading a bias changed in place after the forward."""
    q, k, v = make_qkv(1, 2, 2, 40, 40, 8, dtype=torch.float64)
    bias = torch.randn(1, 1, 40, 40, dtype=torch.float64)
    out = selfattn.attention(q, k, v, bias=bias, backend="chunked")
    bias.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mask_changed_between_calls_is_used(backend):
    """catches: a mask that keeps a stale copy of its tensor (a training loop reusing one buffer)."""
    q, k, v = make_qkv(2, 2, 2, 30, 30, 8, dtype=torch.float64, requires_grad=False)
    lengths = torch.tensor([30, 10])
    m = masks.padding(lengths) & masks.causal()
    selfattn.attention(q, k, v, mask=m, backend=backend)
    lengths[1] = 25
    got = selfattn.attention(q, k, v, mask=m, backend=backend)
    want = testing.reference_attention(q, k, v, mask=masks.padding(torch.tensor([30, 25])), causal=True)
    assert testing.max_error(got, want) < 1e-12


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
@pytest.mark.parametrize("size", [16, 600])
def test_autocast_gives_one_dtype_in_every_backend(backend, size):
    """catches: under CPU autocast, reference and chunked returning float32 while sdpa returns bfloat16,
    so that auto changed dtype with the mask's size."""
    q, k, v = make_qkv(1, 2, 2, size, size, 16, requires_grad=False)
    m = masks.sliding_window(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = selfattn.attention(q, k, v, mask=m, backend=backend)
        assert selfattn.explain(q, k, v, mask=m).backend in ("sdpa", "chunked")
    assert out.dtype == torch.bfloat16
    qb, kb, vb = (t.to(torch.bfloat16).double() for t in (q, k, v))
    ref = testing.reference_attention(qb, kb, vb, mask=m)
    assert testing.max_error(out, ref) < 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn,additive", [
    (lambda s, b, h, i, j: s.sum(-1), False),  # reduces the scores
    (lambda s, b, h, i, j: s + torch.zeros(3, 1, 1), False),  # broadcasts to a larger shape
    (lambda s, b, h, i, j: s + torch.zeros(3, 1, 1), True),
    (lambda s, b, h, i, j: s + torch.zeros(3, 5), False),  # cannot broadcast at all
    (lambda s, b, h, i, j: s + torch.zeros(3, 5), True),
])
def test_score_mod_of_the_wrong_shape_is_a_value_error(backend, fn, additive):
    """catches: a score_mod that returns (or cannot build) the scores' shape surfacing as a bare reshape
    or broadcast RuntimeError instead of a ValueError that names score_mod and the shapes."""
    q, k, v = make_qkv(1, 2, 2, 12, 12, 8, requires_grad=False)
    mod = scores.custom(fn, additive=additive)
    declines = backend == "sdpa" and not additive  # sdpa takes modifiers only as a bias
    want = "not additive" if declines else r"score_mod .*(returned shape|failed in) .*\(1, 2, 12, 12\)"
    with pytest.raises(ValueError, match=want):
        selfattn.attention(q, k, v, score_mod=mod, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_additive_modifier_keeps_float64(backend):
    """catches: an additive modifier's bias computed in float32 (error 2e-8 on float64 inputs, where
    the reference has 3e-16)."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.float64, requires_grad=False)
    mod = scores.custom(lambda s, b, h, i, j: s + (j % 7).to(s.dtype) / 3, additive=True)
    ref = testing.reference_attention(q, k, v, score_mod=mod)
    assert testing.max_error(selfattn.attention(q, k, v, score_mod=mod, backend=backend), ref) < 1e-13


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
def test_additive_modifier_is_not_rounded_on_half_inputs(backend):
    """catches: an additive modifier's float32 bias rounded to bfloat16 inside a fused kernel (error 0.27
    where the reference, which adds it in float32, has 0.002)."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.bfloat16, requires_grad=False)
    mod = scores.custom(lambda s, b, h, i, j: s + 256.0 + 0.3 * (j % 4).to(s.dtype), additive=True)
    try:
        out = selfattn.attention(q, k, v, score_mod=mod, backend=backend)
    except ValueError as e:
        assert backend == "sdpa" and "round" in str(e)
        return
    ref = testing.reference_attention(q.double(), k.double(), v.double(), score_mod=mod)
    assert testing.max_error(out, ref) < 0.02


@pytest.mark.parametrize("fn", [lambda s, b, h, i, j: s.sum(), lambda s, b, h, i, j: s[..., :1]])
def test_score_mod_that_reduces_is_a_value_error(fn):
    """catches: a modifier that reduces the scores to a broadcastable shape, silently accepted."""
    q, k, v = make_qkv(1, 2, 2, 4, 8, 8, requires_grad=False)
    with pytest.raises(ValueError, match="returned shape"):
        selfattn.attention(q, k, v, score_mod=fn, backend="reference")


def test_score_mod_that_raises_is_named():
    """catches: any exception inside the user's modifier surfacing raw, without its name and the shapes."""
    def broken(s, b, h, i, j):
        return s * (1 / int(h.min()))  # h starts at 0: ZeroDivisionError

    q, k, v = make_qkv(1, 2, 2, 4, 8, 8, requires_grad=False)
    with pytest.raises(ValueError, match=r"score_mod .* failed .*ZeroDivisionError"):
        selfattn.attention(q, k, v, score_mod=broken, backend="reference")


def test_torch_convention_masks_are_live():
    """catches: from_torch_key_padding_mask / from_torch_attn_mask keeping a copy, so a training loop
    that changes its padding mask in place keeps the old one."""
    q, k, v = make_qkv(2, 2, 2, 6, 6, 8, dtype=torch.float64, requires_grad=False)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    am = torch.zeros(6, 6, dtype=torch.bool)
    m = masks.from_torch_key_padding_mask(kpm) & masks.from_torch_attn_mask(am)
    selfattn.attention(q, k, v, mask=m)
    kpm[0, 3:] = True
    am[:, 0] = True
    want = testing.reference_attention(q, k, v, mask=~(kpm[:, None, None, :] | am))
    for backend in BACKENDS:
        assert testing.max_error(selfattn.attention(q, k, v, mask=m, backend=backend), want) < 1e-12

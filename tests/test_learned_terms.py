"""Gradients of learned score terms and of a dense bias, in every backend that runs them.

A score modifier may close over tensors that are trained (a T5 bucket table, ALiBi slopes, per-head
temperatures or soft-caps); a bias may require grad (a pair bias). Every backend that accepts such a
call must give those tensors their exact gradient, or decline the call with a reason: a missing
gradient is a silent wrong answer (the parameter never trains).

Shape legend: B batch, H heads, L length, D head dim, NB buckets.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import selfattn
from selfattn import masks, scores
from selfattn.backends import chunked

BACKENDS = ["reference", "sdpa", "chunked", "flex"]


def _bucket(i: torch.Tensor, j: torch.Tensor, nb: int) -> torch.Tensor:
    """T5-style: (i - j) clamped to nb buckets, the sign kept in the upper half."""
    rel = (j - i).clamp(-(nb // 2 - 1), nb // 2 - 1)
    return rel + nb // 2


class _T5Bias(nn.Module):
    """A learned (NB, H) table of score offsets by bucketed relative position, as T5's encoder has."""

    def __init__(self, heads: int, nb: int = 8) -> None:
        super().__init__()
        self.table = nn.Embedding(nb, heads)
        self.nb = nb

    def score_mod(self) -> scores.ScoreMod:
        def t5(score, b, h, i, j):
            return score + self.table.weight[_bucket(i, j, self.nb), h]
        return scores.custom(t5, additive=True)


def _terms(heads: int, dtype: torch.dtype,
           gen: torch.Generator) -> dict[str, tuple[scores.ScoreMod, list[torch.Tensor]]]:
    """name -> (modifier, the leaf tensors that must get a gradient)."""
    t5 = _T5Bias(heads).to(dtype)
    with torch.no_grad():
        t5.table.weight.copy_(torch.randn(t5.table.weight.shape, generator=gen, dtype=dtype))
    slopes = (torch.rand(heads, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    log_slopes = torch.randn(heads, generator=gen, dtype=dtype).mul(0.3).requires_grad_()
    temp = (1 + torch.rand(heads, generator=gen, dtype=dtype)).requires_grad_()
    cap = (2 + torch.rand(heads, generator=gen, dtype=dtype)).requires_grad_()
    derived = log_slopes.exp() * 0.1  # made before the call: the gradient must reach log_slopes through it
    return {
        "t5 buckets": (t5.score_mod(), [t5.table.weight]),
        "learned alibi": (scores.alibi(slopes), [slopes]),
        "alibi from log slopes": (scores.alibi(derived), [log_slopes]),
        "per-head temperature": (scores.custom(lambda s, b, h, i, j: s * temp[h]), [temp]),
        "learned softcap": (scores.custom(lambda s, b, h, i, j: cap[h] * torch.tanh(s / cap[h])), [cap]),
        "chain": (scores.chain(scores.alibi(slopes), scores.custom(lambda s, b, h, i, j: s * temp[h])),
                  [slopes, temp]),
    }


def _grads(backend: str, name: str, mask: masks.Mask | None, hkv: int, dtype: torch.dtype = torch.float64,
           seed: int = 0) -> list[torch.Tensor | None]:
    """out, dq, dk, dv and the learned tensors' gradients of one call, from fresh tensors."""
    gen = torch.Generator().manual_seed(seed)
    h, length, d = 4, 37, 8
    q = torch.randn(2, h, length, d, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, hkv, length, d, generator=gen, dtype=dtype, requires_grad=True) for _ in range(2))
    mod, leaves = _terms(h, dtype, gen)[name]
    dout = torch.randn(2, h, length, d, generator=gen, dtype=dtype)
    out = selfattn.attention(q, k, v, mask=mask, score_mod=mod, backend=backend)
    grads = torch.autograd.grad(out, [q, k, v, *leaves], dout, allow_unused=True)
    return [out, *grads]


@contextlib.contextmanager
def _small_tiles():
    with chunked.options(block_q=8, block_k=8):
        yield


@pytest.mark.parametrize("mask", [None, "causal", "window"])
@pytest.mark.parametrize("name", ["t5 buckets", "learned alibi", "alibi from log slopes", "per-head temperature",
                                  "learned softcap", "chain"])
def test_learned_score_terms_get_their_gradient_in_chunked_tile_by_tile(name, mask):
    """catches: chunked dropping the gradient of a tensor its score modifier closes over (the parameter
    never trains), a gradient summed over only some tiles, an additive term folded into the fused
    kernel's bias (which gives no gradient), a tensor made before the call not reached; GQA, masks."""
    m = {None: None, "causal": masks.causal(), "window": masks.sliding_window(5, 0)}[mask]
    want = _grads("reference", name, m, hkv=2)
    with _small_tiles():
        got = _grads("chunked", name, m, hkv=2)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g is not None, f"gradient {n} missing"
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["t5 buckets", "learned alibi", "per-head temperature"])
def test_no_backend_that_runs_a_learned_term_drops_its_gradient(name):
    """catches: any backend (or auto's choice) that accepts a call whose modifier has trained tensors
    and returns no gradient, or a wrong one, for them: it must give the reference's or decline."""
    want = _grads("reference", name, masks.causal(), hkv=4, dtype=torch.float32)
    for backend in [*BACKENDS, "auto"]:
        try:
            got = _grads(backend, name, masks.causal(), hkv=4, dtype=torch.float32)
        except ValueError as e:
            assert "cannot run this call" in str(e) and backend != "auto"
            continue
        for g, w in zip(got, want, strict=True):
            assert g is not None, backend
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 4, 37, 37), (1, 4, 37, 37), (2, 1, 1, 37), (1, 1, 37, 1)])
def test_a_bias_that_requires_grad_gets_it_in_chunked_summed_over_its_broadcast_dims(shape):
    """catches: chunked declining or dropping a trained bias (a pair bias (B, H, L, L), a per-head one
    (1, H, L, L), a key bias (B, 1, 1, L)), or summing its gradient over the wrong dims or tiles."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 37, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    bias0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, 4, 37, 8, generator=gen, dtype=torch.float64)
    results = []
    for backend in ("reference", "chunked"):
        q_, k_, v_, bias = (t.clone().requires_grad_() for t in (q, k, v, bias0))
        with _small_tiles():
            out = selfattn.attention(q_, k_, v_, bias=bias, causal=True, backend=backend)
        results.append(torch.autograd.grad(out, [q_, k_, v_, bias], dout))
    for g, w in zip(*results[::-1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_gradcheck_of_chunked_over_bias_and_a_learned_table():
    """catches: any term of chunked's backward (q, k, v, bias, a learned bucket table) that is not the
    derivative of its forward, checked numerically in float64 on a small call with several tiles."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 3, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 2, 9, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    table = torch.randn(8, 2, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, bias, table):
        mod = scores.custom(lambda s, b, h, i, j: s + table[_bucket(i, j, 8), h], additive=True)
        with chunked.options(block_q=4, block_k=4):
            return selfattn.attention(q, k, v, bias=bias, causal=True, score_mod=mod, backend="chunked")

    assert torch.autograd.gradcheck(fn, (q, k, v, bias, table))


def test_ring_refuses_a_learned_term_it_cannot_differentiate():
    """catches: context parallelism's ring silently training a modifier's tensors on no gradient."""
    from selfattn.distributed.group import Group
    from selfattn.distributed.spec import validate

    solo = Group(group=None, rank=0, world=1, timeout=None)
    slopes = torch.rand(4, requires_grad=True)
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match="ring gives no gradient"):
        validate(q, q, q, solo, "contiguous", "ring", None, True, None, 0.0, scores.alibi(slopes), False,
                 "auto", None)
    with torch.no_grad():
        validate(q, q, q, solo, "contiguous", "ring", None, True, None, 0.0, scores.alibi(slopes), False,
                 "auto", None)


_TEMP = torch.tensor([1.2, 0.8], requires_grad=True)


def _tempered(s, b, h, i, j):
    return s * _TEMP[h]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["auto", "chunked"])
def test_under_compile_a_learned_term_gets_its_gradient_or_a_clear_refusal(backend):
    """catches: torch.compile running a modifier whose function reads a trained tensor through the
    chunked op, whose compiled form gives no gradient for it: the tensor must get the eager gradient,
    or the backward must say why it cannot, never train on nothing."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return selfattn.attention(q, k, v, causal=True, score_mod=scores.custom(_tempered), backend=backend)

    want = torch.autograd.grad(fn(q, k, v).sum(), [_TEMP])[0]
    try:  # aot_eager traces the backward with the forward: a refusal comes from either
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
        got = torch.autograd.grad(out.sum(), [_TEMP])[0]
    except Exception as e:  # dynamo wraps what the backward raised
        assert "gives no gradient for it" in str(e)
    else:
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()


def test_sdpa_declines_lse_with_a_learned_term_instead_of_crashing():
    """catches: sdpa taking return_lse with learned ALiBi slopes through the CPU op that returns lse, which
    cannot differentiate its mask: a RuntimeError from torch instead of a reason (found by the fuzz suite)."""
    slopes = torch.tensor([0.3, 0.1], requires_grad=True)
    q = k = v = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="return_lse with alibi"):
        selfattn.attention(q, k, v, score_mod=scores.alibi(slopes), return_lse=True, backend="sdpa")
    out, _ = selfattn.attention(q, k, v, score_mod=scores.alibi(slopes), return_lse=True)
    ref = selfattn.attention(q, k, v, score_mod=scores.alibi(slopes), backend="reference")
    torch.testing.assert_close(out, ref)
    (g,) = torch.autograd.grad(out.sum(), slopes)
    (want,) = torch.autograd.grad(ref.sum(), slopes)
    torch.testing.assert_close(g, want)


def test_a_learned_term_no_tile_reads_gets_a_zero_gradient():
    """catches: chunked returning None for a learned tensor when every key is masked (no tile runs), so
    torch.autograd.grad raised where the reference gives 0 (found by the fuzz suite)."""
    slopes = torch.tensor([0.3], requires_grad=True)
    q, k, v = torch.randn(1, 1, 2, 1), torch.randn(1, 1, 1, 1), torch.randn(1, 1, 1, 1)
    out = selfattn.attention(q, k, v, mask=torch.zeros(1, 1, 1, 1, dtype=torch.bool), score_mod=scores.alibi(slopes),
                             backend="chunked")
    (g,) = torch.autograd.grad(out.sum(), slopes)
    assert torch.equal(g, torch.zeros(1))


def _t5_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "t5_encoder.py"
    spec = importlib.util.spec_from_file_location("t5_encoder", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_t5_example_layer_equals_transformers_t5_block_with_its_gradients():
    """catches: the example's T5 layer (the bucket table as a score modifier, run tile by tile) drifting
    from transformers' T5Block in its buckets, its output or any weight's gradient, the table's
    included, with offsets past max_distance."""
    pytest.importorskip("transformers")
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention, T5Block

    mod = _t5_example()
    rel = torch.arange(-400, 400)
    for nb, md in [(32, 128), (16, 20)]:
        theirs = T5Attention._relative_position_bucket(rel, bidirectional=True, num_buckets=nb, max_distance=md)
        assert torch.equal(mod.relative_bucket(rel, nb, md), theirs)
    cfg = T5Config(d_model=32, d_kv=8, num_heads=4, d_ff=64, dropout_rate=0.0, feed_forward_proj="relu")
    torch.manual_seed(0)
    block = T5Block(cfg, has_relative_attention_bias=True).double().eval()
    with torch.no_grad():  # a table far from its zero-mean init, so a lost or misplaced entry shows
        block.layer[0].SelfAttention.relative_attention_bias.weight.normal_(0, 2)
    layer = mod.T5Layer.from_hf(block).double()
    x = torch.randn(2, 300, 32, dtype=torch.float64)
    grad = torch.randn(2, 300, 32, dtype=torch.float64)
    out = block(x)[0]
    params = dict(block.named_parameters())
    theirs = dict(zip(params, torch.autograd.grad(out, list(params.values()), grad), strict=True))
    names = {"q": "layer.0.SelfAttention.q", "k": "layer.0.SelfAttention.k", "v": "layer.0.SelfAttention.v",
             "o": "layer.0.SelfAttention.o", "relative_attention_bias": "layer.0.SelfAttention.relative_attention_bias",
             "wi": "layer.1.DenseReluDense.wi", "wo": "layer.1.DenseReluDense.wo",
             "norm1": "layer.0.layer_norm", "norm2": "layer.1.layer_norm"}
    # T5Attention takes its softmax in float32, whatever the input's dtype: float32 tolerances
    for backend in ["chunked", "reference"]:
        ours = layer(x, backend=backend)
        torch.testing.assert_close(ours, out, rtol=1e-5, atol=1e-6)
        grads = torch.autograd.grad(ours, [getattr(layer, n).weight for n in names], grad)
        for (name, hf), g in zip(names.items(), grads, strict=True):
            torch.testing.assert_close(g, theirs[hf + ".weight"], rtol=1e-5, atol=1e-6, msg=f"{backend}: {name}")


def test_t5_example_quick_learns_an_offset_through_the_table():
    """catches: the table's gradient not reaching the optimizer through chunked (the task is only
    learnable through the relative-position term)."""
    summary = _t5_example().main(["--quick", "--steps", "30"])
    assert summary["loss_last"] < 0.3 * summary["loss_first"]

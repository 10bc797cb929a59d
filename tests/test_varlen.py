"""selfattn.varlen_attention against the float64 oracle run on each sequence alone.

The oracle is ``selfattn.testing.reference_attention`` on one sequence at a time, (1, H, n, D), with
that sequence's causal mask and window drawn here from their definition (bottom-right aligned per
sequence, as flash-attn does), so nothing of masks.packed is trusted. Outputs, lse and gradients are
held to the suite's rule (2x / 3x the error of the same plain math in the input dtype).

Shape legend: N sequences, Tq/Tk packed tokens, Hq/Hkv heads, D/Dv head dims.
"""

from __future__ import annotations

import numpy
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import cu_seqlens

import selfattn
from selfattn import functional, masks, testing
from selfattn import varlen as varlen_module
from selfattn.backends import chunked

BACKENDS = ["reference", "chunked", "sdpa", "auto"]


def _cu(lengths: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)


def _tokens(t: int, h: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(t, h, d, generator=gen, dtype=torch.float64).to(dtype)


def _band(nq: int, nk: int, causal: bool, window: tuple[int, int] | None) -> torch.Tensor | None:
    """One sequence's visibility (nq, nk), its own definition: query r on key r + nk - nq."""
    diag = torch.arange(nq).view(-1, 1) + nk - nq
    j = torch.arange(nk).view(1, -1)
    visible = torch.ones(nq, nk, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    if causal:
        visible &= j <= diag
    if left != -1:
        visible &= j >= diag - left
    if right != -1:
        visible &= j <= diag + right
    return None if bool(visible.all()) else visible


def oracle(q, k, v, lq, lk, *, causal=False, window=None, softcap=None, sinks=None, scale=None, dtype=torch.float64):
    """(out (Tq, Hq, Dv), lse (Hq, Tq)): each sequence alone through the reference math in ``dtype``
    (None: the inputs' own dtype, the naive yardstick)."""
    hq, dv = q.shape[1], v.shape[2]
    mod = None if softcap is None else (lambda s, b, h, i, j: softcap * torch.tanh(s / softcap))
    outs, lses, a, c = [], [], 0, 0
    for nq, nk in zip(lq, lk, strict=True):
        qs, ks, vs = q[a:a + nq], k[c:c + nk], v[c:c + nk]
        a, c = a + nq, c + nk
        if nq == 0:
            continue
        if nk == 0:  # every row sees no key: 0, and lse -inf (the sink alone with sinks)
            outs.append(qs.new_zeros(nq, hq, dv, dtype=dtype or q.dtype) + 0 * qs.sum().to(dtype or q.dtype))
            lse = torch.full((hq, nq), float("-inf"), dtype=torch.float64)
            lses.append(lse if sinks is None else sinks.detach().double()[:, None].expand(hq, nq))
            continue
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
        kw = dict(mask=_band(nq, nk, causal, window), scale=scale, score_mod=mod, dtype=dtype, sinks=sinks)
        outs.append(testing.reference_attention(qs, ks, vs, **kw)[0].transpose(0, 1))
        lses.append(testing.reference_lse(qs, ks, **kw)[0].double())
    out = torch.cat(outs) if outs else q.new_zeros(0, hq, dv, dtype=dtype or q.dtype)
    return out, torch.cat(lses, dim=1) if lses else torch.zeros(hq, 0, dtype=torch.float64)


def check(lq, lk=None, *, backend, hq=4, hkv=2, d=16, dv=None, dtype=torch.float32, causal=False, window=None,
          softcap=None, sinks=False, scale=None, return_lse=True, grads=True, seed=0, layout="contiguous",
          cu_dtype=torch.int32) -> str:
    """Run one packed call on ``backend`` and hold out, lse and dq, dk, dv (dsinks) to the rule; returns
    "ran", or "declined" when the backend says it cannot run the call (with the error it must then raise)."""
    lk = lq if lk is None else lk
    dv = d if dv is None else dv
    gen = torch.Generator().manual_seed(seed)
    if layout == "fused":  # q, k, v as views into one (T, 3, H, D) buffer
        assert lq == lk and hq == hkv and d == dv
        q, k, v = _tokens(sum(lq), 3 * hq, d, dtype, gen).view(sum(lq), 3, hq, d).unbind(1)
    else:
        q, k, v = _tokens(sum(lq), hq, d, dtype, gen), _tokens(sum(lk), hkv, d, dtype, gen), \
            _tokens(sum(lk), hkv, dv, dtype, gen)
    s = torch.randn(hq, generator=gen, dtype=torch.float64).to(dtype) if sinks else None
    kwargs = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    cu_q, cu_k = _cu(lq, cu_dtype), (None if lk is lq else _cu(lk, cu_dtype))
    try:
        selfattn.varlen_explain(q, k, v, cu_q, cu_k, sinks=s, return_lse=return_lse, backend=backend, **kwargs)
    except ValueError as e:
        assert backend != "auto" and f"backend={backend!r} cannot run this call" in str(e)
        with pytest.raises(ValueError, match="cannot run this call"):
            selfattn.varlen_attention(q, k, v, cu_q, cu_k, sinks=s, return_lse=return_lse, backend=backend, **kwargs)
        return "declined"

    leaves = [t.detach().clone().requires_grad_(grads) for t in (q, k, v) + ((s,) if s is not None else ())]
    with chunked.options(block_q=16, block_k=24):  # several tiles per sequence, none dividing a length
        result = selfattn.varlen_attention(leaves[0], leaves[1], leaves[2], cu_q, cu_k,
                                           sinks=leaves[3] if sinks else None, return_lse=return_lse,
                                           backend=backend, **kwargs)
    out, lse = result if return_lse else (result, None)
    assert out.shape == (sum(lq), hq, dv) and out.dtype == dtype and out.is_contiguous()

    def run_oracle(wide: torch.dtype | None):
        ins = [t.detach().to(wide or t.dtype).requires_grad_(grads) for t in leaves]
        o, l_ = oracle(ins[0], ins[1], ins[2], lq, lk, sinks=ins[3] if sinks else None, dtype=wide, **kwargs)
        return ins, o, l_

    ins64, ref, ref_lse = run_oracle(torch.float64)
    ins_n, naive, naive_lse = run_oracle(None)
    results = [testing.compare_to_reference(out, ref, naive, name=f"{backend}: out")]
    if lse is not None:
        assert lse.shape == (hq, sum(lq)) and lse.dtype == torch.float32
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf on the wrong rows"
        finite = torch.isfinite(ref_lse)
        if bool(finite.any()):
            results.append(testing.compare_to_reference(lse[finite], ref_lse[finite], naive_lse[finite].float(),
                                                        name=f"{backend}: lse"))
    if grads:
        dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        got = torch.autograd.grad(out, leaves, dout.to(dtype))
        want = torch.autograd.grad(ref, ins64, dout, allow_unused=True)
        nv = torch.autograd.grad(naive, ins_n, dout.to(dtype), allow_unused=True)
        for name, a, r, n in zip(["dq", "dk", "dv", "dsinks"], got, want, nv, strict=False):
            r = torch.zeros_like(a, dtype=torch.float64) if r is None else r
            n = torch.zeros_like(a) if n is None else n
            if a.numel():
                results.append(testing.compare_to_reference(a, r, n, factor=3.0, name=f"{backend}: {name}"))
    failed = [str(r) for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    return "ran"


SELF = [37, 0, 61, 1, 23]  # an empty sequence, a single token, lengths that divide no tile
CROSS_Q, CROSS_K = [5, 30, 0, 17, 9, 12], [40, 3, 11, 0, 9, 12]  # nq < nk, nq > nk, no queries, no keys, equal

CASES = {
    "self": dict(lq=SELF),
    "cross": dict(lq=CROSS_Q, lk=CROSS_K),
    "gqa": dict(lq=SELF, hq=6, hkv=2),
    "mqa-cross": dict(lq=CROSS_Q, lk=CROSS_K, hq=3, hkv=1),
    "causal": dict(lq=SELF, causal=True),
    "causal-cross": dict(lq=CROSS_Q, lk=CROSS_K, causal=True),
    "window": dict(lq=SELF, window=(7, 3)),
    "window-cross": dict(lq=CROSS_Q, lk=CROSS_K, window=(4, 2)),
    "window-causal-cross": dict(lq=CROSS_Q, lk=CROSS_K, window=(6, -1), causal=True),
    "window-right-only": dict(lq=CROSS_Q, lk=CROSS_K, window=(-1, 1)),
    "softcap": dict(lq=SELF, causal=True, softcap=1.5, scale=1.0),
    "sinks": dict(lq=CROSS_Q, lk=CROSS_K, causal=True, sinks=True),
    "head-dims": dict(lq=CROSS_Q, lk=CROSS_K, d=59, dv=13, causal=True),
    "fused-layout": dict(lq=SELF, hq=2, hkv=2, causal=True, layout="fused", cu_dtype=torch.int64),
    "bfloat16": dict(lq=CROSS_Q, lk=CROSS_K, dtype=torch.bfloat16, causal=True),
    "float16-sinks": dict(lq=SELF, dtype=torch.float16, window=(9, 0), sinks=True),
    "float64": dict(lq=CROSS_Q, lk=CROSS_K, dtype=torch.float64, window=(3, 3)),
    "no-lse": dict(lq=SELF, causal=True, return_lse=False, d=8, dv=24),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_each_sequence_alone(case, backend):
    """catches: a sequence that sees another one's keys, causal or windows aligned to the whole pack
    instead of each sequence's own bottom-right corner, rows without keys that are not 0 / -inf, lse in
    the wrong layout, and gradients that leak across sequences, in every backend that takes the call."""
    check(**CASES[case], backend=backend)


def test_sdpa_declines_what_it_cannot_run_and_the_rest_runs():
    """catches: the test grid passing because every backend declined: each declines only for a reason."""
    runs = {(c, b): check(**CASES[c], backend=b, grads=False) for c in CASES for b in ("sdpa", "chunked")}
    assert {key for key, r in runs.items() if r == "declined"} == {
        ("sinks", "sdpa"), ("float16-sinks", "sdpa"),  # no sinks in SDPA
        ("softcap", "sdpa"),  # softcap is not additive: SDPA takes a modifier only as a bias
        ("head-dims", "sdpa")}  # its CPU op that returns lse needs Dv == D


def test_auto_runs_a_pack_without_a_dense_mask_and_matches_the_oracle(monkeypatch):
    """catches: dispatch giving a long pack a dense (T, T) SDPA mask: on the CPU causal or full sequences
    run one fused SDPA call each, windowed ones chunked's tiles (at default tile sizes); and a route
    that differs from the oracle per sequence, forward or backward."""
    monkeypatch.setattr(masks.Packed, "dense", lambda *a, **k: pytest.fail("a dense packed mask was built"))
    lengths = [300, 17, 250, 0, 129, 411, 64]
    q = k = v = torch.randn(sum(lengths), 2, 16)
    for causal, window, backend in ((True, None, "sdpa"), (False, None, "sdpa"), (True, (40, 0), "chunked")):
        explanation = selfattn.varlen_explain(q, k, v, _cu(lengths), causal=causal, window=window)
        assert explanation.backend == backend, explanation
        check(lengths, backend="auto", causal=causal, window=window, hq=2, hkv=2, grads=True)


def test_one_fused_call_per_sequence_takes_only_what_it_computes_exactly():
    """catches: the CPU's per-sequence route taking a call it would get wrong (a causal sequence with
    fewer queries than keys: SDPA's is_causal is top-left), or one of too many sequences."""
    from selfattn.backends import sdpa

    def reasons(lq, lk, **kw):
        q, k = torch.randn(sum(lq), 2, 8), torch.randn(sum(lk), 2, 8)
        built = varlen_module._build(q, k, k, _cu(lq), _cu(lk), None, None, kw.get("causal", True),
                                     kw.get("window"), None, 0.0, None, None, False, "auto")
        call = functional._validate(built.q, built.k, built.v, built.kwargs["mask"], None, False, None, 0.0, False,
                                    None)
        return sdpa.varlen_kernel_obstacles(call)

    assert reasons([3, 4], [3, 4]) == [] and reasons([3, 4], [5, 4], causal=False) == []
    assert reasons([3, 0], [3, 2]) == []  # keys with no query: no row to get wrong
    assert "is_causal is top-left" in reasons([3, 4], [5, 4])[0]
    assert "a window" in reasons([3, 4], [3, 4], window=(2, 0))[0]
    many = [1] * (sdpa.CPU_SEQUENCES_MAX + 1)
    assert "sequences" in reasons(many, many)[0]
    check([3, 4], [5, 4], backend="auto", causal=True, grads=True)  # then chunked runs it


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


@pytest.mark.parametrize("backend", ["reference", "chunked", "sdpa"])
@pytest.mark.parametrize("band", ["none", "causal", "window"])
def test_equals_the_document_mask_form(backend, band):
    """catches: varlen drifting from what it is, the document mask's fast path: for self-attention the
    call equals attention over (1, H, T, D) with document(ids) (& causal / sliding_window)."""
    lengths = [37, 0, 61, 1, 23]
    cu, ids = _cu(lengths), _doc_ids(lengths)
    kw, doc = {"none": ({}, masks.document(ids)),
               "causal": (dict(causal=True), masks.document(ids) & masks.causal()),
               "window": (dict(window=(5, 2)), masks.document(ids) & masks.sliding_window(5, 2))}[band]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 4, 16, generator=gen) for _ in range(3))
    left, right = kw.get("window", (None, 0 if kw else None))
    packed = masks.packed(cu, left=left, right=right)
    assert torch.equal(packed.dense(sum(lengths), sum(lengths)), doc.dense(sum(lengths), sum(lengths)))
    with chunked.options(block_q=16, block_k=24):
        out, lse = selfattn.varlen_attention(q, k, v, cu, backend=backend, return_lse=True, **kw)
        want, want_lse = selfattn.attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), mask=doc,
                                            backend=backend, return_lse=True)
    if backend == "reference":
        assert torch.equal(out, want[0].transpose(0, 1)) and torch.equal(lse, want_lse[0])
    else:  # other tile maps may sum in another order: within a few ulps
        torch.testing.assert_close(out, want[0].transpose(0, 1), rtol=0, atol=16 * torch.finfo(torch.float32).eps)
        torch.testing.assert_close(lse, want_lse[0], rtol=0, atol=16 * torch.finfo(torch.float32).eps * 8)


def test_chunked_builds_no_dense_mask_and_skips_the_tiles_between_sequences(monkeypatch):
    """catches: the chunked path materialising the (Tq, Tk) mask (O(T^2) memory for a long pack), and a
    tile map that computes tiles between sequences."""
    lengths = [100, 3, 0, 250, 47]
    cu = _cu(lengths)
    tiles = masks.packed(cu).tiles(400, 400, 32, 32)[0, 0]
    dense = masks.packed(cu).dense(400, 400)[0, 0]
    pad = torch.zeros(13 * 32, 13 * 32, dtype=torch.bool)
    pad[:400, :400] = dense
    any_visible = pad.view(13, 32, 13, 32).any(-1).any(1)
    assert torch.equal(tiles == masks.EMPTY, ~any_visible)  # exact

    def refuse(*args, **kwargs):
        raise AssertionError("the chunked path asked for the packed mask's dense form")

    monkeypatch.setattr(masks.Packed, "dense", refuse)
    monkeypatch.setattr(masks.Packed, "predicate", refuse)
    q = torch.randn(400, 2, 16, requires_grad=True)
    out = selfattn.varlen_attention(q, q, q, cu, causal=True, backend="chunked")
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("sinks", [False, True])
def test_no_query_or_no_key_tokens_at_all(sinks):
    """catches: a pack whose sequences are all empty on one side crashing in a backend (length 0), or
    giving rows that are not 0 with lse -inf (the sink alone with sinks) and gradient 0."""
    q = torch.randn(7, 4, 8, requires_grad=True)
    kv = torch.randn(0, 2, 8, requires_grad=True)
    s = torch.randn(4, requires_grad=True) if sinks else None
    out, lse = selfattn.varlen_attention(q, kv, kv, _cu([3, 4]), _cu([0, 0]), sinks=s, return_lse=True)
    assert out.shape == (7, 4, 8) and torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full((4, 7), float("-inf")) if s is None else s.detach()[:, None].expand(4, 7))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and (s is None or torch.equal(s.grad, torch.zeros_like(s)))

    k = torch.randn(9, 2, 8)
    out, lse = selfattn.varlen_attention(q[:0], k, k, _cu([0, 0]), _cu([4, 5]), return_lse=True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0)
    assert selfattn.varlen_explain(q[:0], k, k, _cu([0, 0]), _cu([4, 5])).backend == "none"


def test_dropout_is_reproducible_and_spares_rows_without_keys():
    """catches: dropout drawn differently on two runs with one seed, or reaching rows that see no key."""
    lq, lk = [5, 30, 9], [40, 3, 0]
    q, k, v = torch.randn(44, 2, 8), torch.randn(43, 2, 8), torch.randn(43, 2, 8)
    runs = []
    for backend in ("chunked", "chunked", "reference"):
        torch.manual_seed(3)
        runs.append(selfattn.varlen_attention(q, k, v, _cu(lq), _cu(lk), causal=True, dropout_p=0.3,
                                              backend=backend))
    assert torch.equal(runs[0], runs[1])
    dead = torch.cat([torch.zeros(5, dtype=torch.bool), torch.arange(30) < 27, torch.ones(9, dtype=torch.bool)])
    assert all(torch.equal(r[dead], torch.zeros_like(r[dead])) for r in runs)
    assert not torch.equal(runs[0], selfattn.varlen_attention(q, k, v, _cu(lq), _cu(lk), causal=True))


def test_explain_names_the_packed_mask_and_each_reason():
    """catches: varlen_explain not being explain() of the call varlen_attention makes."""
    lengths = [20, 30]
    q = k = v = torch.randn(50, 2, 8)
    e = selfattn.varlen_explain(q, k, v, _cu(lengths), causal=True, sinks=torch.zeros(2))
    assert e.backend == "reference" or e.backend == "chunked"
    assert "sinks" in e.not_chosen["sdpa"]
    with pytest.raises(ValueError, match=r"backend='sdpa' cannot run this call: sinks"):
        selfattn.varlen_attention(q, k, v, _cu(lengths), causal=True, sinks=torch.zeros(2), backend="sdpa")
    # one sequence: the global mask it equals, so SDPA's own causal kernel runs it
    one = selfattn.varlen_explain(q, k, v, _cu([50]), causal=True)
    assert one.backend == "sdpa" and "without a dense mask" in one.why


# ---- validation: each bad argument is a ValueError (TypeError for a dtype) naming it and the fix ----

def _good():
    q = torch.randn(10, 4, 8)
    kv = torch.randn(12, 2, 8)
    return q, kv, kv, torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)


def _call(**changes):
    q, k, v, cu_q, cu_k = _good()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k) | changes
    return selfattn.varlen_attention(**args)


@pytest.mark.parametrize(("changes", "error", "match"), [
    (dict(cu_seqlens_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must be non-decreasing .* entry 2 \(4\) is below entry 1 \(6\).*cumulative sum"),
    (dict(cu_seqlens_q=torch.tensor([[0, 4, 10]], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must be 1-D with N \+ 1 >= 2 entries.*got shape \(1, 3\).*cumsum"),
    (dict(cu_seqlens_k=torch.tensor([12], dtype=torch.int32)), ValueError, r"cu_seqlens_k must be 1-D with N \+ 1"),
    (dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must start at 0.*prepend the 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q ends at 9 tokens but q holds 10 .*q.shape\[0\]"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 13], dtype=torch.int32)), ValueError,
     r"cu_seqlens_k ends at 13 tokens but k holds 12"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 4.0, 10.0])), TypeError,
     r"cu_seqlens_q must be an int32 or int64 tensor .* got dtype torch.float32.*\.to\(torch.int32\)"),
    (dict(cu_seqlens_q=[0, 4, 10]), TypeError, r"cu_seqlens_q must be an int32 tensor.*torch.tensor"),
    (dict(max_seqlen_q=5), ValueError, r"sequence 1 of cu_seqlens_q has 6 tokens, more than max_seqlen_q=5.*6"),
    (dict(max_seqlen_k=6), ValueError, r"sequence 1 of cu_seqlens_k has 7 tokens, more than max_seqlen_k=6"),
    (dict(max_seqlen_k=2.5), ValueError, r"max_seqlen_k must be None or an int >= 0"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 5, 12], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q describes 2 sequences and cu_seqlens_k 3; .*empty sequence repeats"),
    (dict(q=torch.randn(1, 10, 4, 8)), ValueError,
     r"q must be 3-D \(Tq, Hq, D\).*got shape \(1, 10, 4, 8\).*cu_seqlens"),
    (dict(k=torch.randn(12, 16)), ValueError, r"k must be 3-D \(Tk, Hkv, D\)"),
    (dict(v=torch.randn(12, 2, 8, 1)), ValueError, r"v must be 3-D \(Tk, Hkv, Dv\)"),
    (dict(k=torch.randn(12, 3, 8), v=torch.randn(12, 3, 8)), ValueError,
     r"q has 4 heads and k/v have 3; Hq must be a multiple of Hkv"),
    (dict(v=torch.randn(12, 1, 8)), ValueError, r"k and v must have the same heads: k has 2, v has 1"),
    (dict(v=torch.randn(11, 2, 8)), ValueError, r"k and v must hold the same tokens: k has Tk=12, v has 11"),
    (dict(k=torch.randn(12, 2, 7)), ValueError, r"q and k must have the same head dim D: q has 8, k has 7"),
    (dict(k=torch.randn(12, 2, 8).double()), TypeError, r"q, k and v must share a dtype.*\.to\(q.dtype\)"),
    (dict(causal="top_left"), ValueError, r"bottom-right .*call selfattn.attention on each sequence"),
    (dict(causal=1), ValueError, r"causal must be False, True or 'bottom_right'"),
    (dict(window=(3,)), ValueError, r"window must be None or \(left, right\), two ints >= -1.*window=\(255, 0\)"),
    (dict(window=(-2, 0)), ValueError, r"window must be None or \(left, right\)"),
    (dict(softcap=-1.0), ValueError, r"softcap needs a finite cap > 0"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \(Hq,\) = \(4,\)"),
    (dict(backend="flash"), ValueError, r"unknown backend 'flash'"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_invalid_input_names_the_argument_and_the_fix(changes, error, match):
    """catches: bad packing metadata reaching a backend (wrong rows attending, an index error deep in a
    kernel) instead of an error at the entry that names the argument, what was expected, what was given."""
    with pytest.raises(error, match=match):
        _call(**changes)


def test_masks_packed_names_its_own_errors():
    """catches: masks.packed accepting totals that do not describe the call, or a band of the wrong type."""
    m = masks.packed(torch.tensor([0, 4, 10]), torch.tensor([0, 5, 12]))
    with pytest.raises(ValueError, match=r"mask: cu_seqlens_k ends at 12 tokens but k has 11"):
        selfattn.attention(torch.randn(1, 1, 10, 4), torch.randn(1, 1, 11, 4), torch.randn(1, 1, 11, 4), mask=m)
    with pytest.raises(ValueError, match=r"packed left must be None \(unbounded\) or an int >= 0"):
        masks.packed(torch.tensor([0, 4]), left=-1)
    with pytest.raises(ValueError, match="cu_seqlens_q describes 1 sequences and cu_seqlens_k 2"):
        masks.packed([0, 4], [0, 2, 4])


# ---- properties ----

@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_packs_match_each_sequence_alone(data):
    """catches: any pack (empty sequences, cross lengths both ways, GQA, causal, windows, softcap, sinks,
    both cu dtypes) on which a backend disagrees with the per-sequence oracle in output, lse or gradients."""
    n = data.draw(st.integers(1, 5))
    lq = data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n).filter(lambda x: sum(x) > 0))
    lk = lq if data.draw(st.booleans()) else data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    hkv = data.draw(st.integers(1, 2))
    window = data.draw(st.sampled_from([None, None, (0, 0), (3, -1), (-1, 2), (5, 1)]))
    check(lq, lk, backend=data.draw(st.sampled_from(BACKENDS)), hq=hkv * data.draw(st.integers(1, 3)), hkv=hkv,
          d=data.draw(st.sampled_from([1, 8, 13])), dtype=data.draw(st.sampled_from([torch.float32, torch.float64])),
          causal=data.draw(st.booleans()), window=window, softcap=data.draw(st.sampled_from([None, 2.0])),
          sinks=data.draw(st.booleans()), seed=data.draw(st.integers(0, 1000)),
          cu_dtype=data.draw(st.sampled_from([torch.int32, torch.int64])), grads=data.draw(st.booleans()))


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_packed_tile_map_is_exact(data):
    """catches: a tile map that only bounds emptiness loosely (chunked computing the tiles between
    sequences, or tiles of rows above a short sequence's diagonal), beyond the soundness that
    tests/test_mask_properties.py checks."""
    lq, lk, n = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40)), data.draw(st.integers(1, 4))
    mask = masks.packed(data.draw(cu_seqlens(lq, n)), data.draw(cu_seqlens(lk, n)),
                        left=data.draw(st.sampled_from([None, 0, 3])), right=data.draw(st.sampled_from([None, 0, 2])))
    bq, bk = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    dense = mask.dense(lq, lk)[0, 0]
    nq, nk = -(-lq // bq), -(-lk // bk)
    pad = torch.zeros(nq * bq, nk * bk, dtype=torch.bool)
    pad[:lq, :lk] = dense
    any_visible = pad.view(nq, bq, nk, bk).any(-1).any(1)
    all_visible = (pad | _outside(lq, lk, nq * bq, nk * bk)).view(nq, bq, nk, bk).all(-1).all(1)
    tiles = mask.tiles(lq, lk, bq, bk)[0, 0]
    assert torch.equal(tiles == masks.FULL, all_visible)
    assert torch.equal(tiles == masks.EMPTY, ~any_visible)


def _outside(lq: int, lk: int, pq: int, pk: int) -> torch.Tensor:
    out = torch.ones(pq, pk, dtype=torch.bool)
    out[:lq, :lk] = False
    return out


# ---- torch.compile ----

@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["chunked", pytest.param("auto", marks=pytest.mark.slow),
                                     pytest.param("sdpa", marks=pytest.mark.slow)])
def test_compiles_without_graph_break_and_new_lengths_do_not_recompile(backend, _fresh_dynamo):
    """catches: data-dependent Python on a compiled varlen call (a graph break under fullgraph), results that
    differ from eager, and a recompile for every new set of lengths: cu_seqlens are tensors, so new lengths
    with the same N and T reuse the graph (a new N or T recompiles once, then is dynamic)."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def fn(q, k, v, cu):
        return selfattn.varlen_attention(q, k, v, cu, causal=True, window=(20, 0), backend=backend, return_lse=True)

    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for lengths in ([30, 50, 16], [10, 0, 86], [96, 0, 0]):
        q, k, v = (torch.randn(96, 4 if i == 0 else 2, 16, requires_grad=True) for i in range(3))
        out, lse = compiled(q, k, v, _cu(lengths))
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want, want_lse = fn(q, k, v, _cu(lengths))
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        assert all(torch.equal(g, w) for g, w in zip(grads, torch.autograd.grad(want.sum(), (q, k, v)), strict=True))
    assert counter.frame_count == 1



def test_the_same_cu_seqlens_reuse_one_checked_mask_and_its_plan(monkeypatch):
    """catches: every layer of a packed step re-checking cu_seqlens (a copy to the host) and re-planning;
    a mask kept past an in-place change of the cu_seqlens it was made from."""
    made = []
    original = masks.Mask.tiles
    monkeypatch.setattr(masks.Mask, "tiles", lambda self, *a, **kw: made.append(a) or original(self, *a, **kw))
    checked = []
    original_check = varlen_module.check_cu_seqlens_pair
    monkeypatch.setattr(varlen_module, "check_cu_seqlens_pair", lambda *a: checked.append(a) or original_check(*a))
    gen = torch.Generator().manual_seed(0)
    lengths = [600, 1, 0, 900, 547]
    cu = _cu(lengths)
    q, k, v = (_tokens(sum(lengths), 2, 16, torch.float32, gen) for _ in range(3))
    first = selfattn.varlen_attention(q, k, v, cu, causal=True, backend="chunked")
    for _ in range(2):  # the next layers
        assert torch.equal(selfattn.varlen_attention(q, k, v, cu, causal=True, backend="chunked"), first)
    assert len(checked) == 1 and len(made) == 1
    torch.testing.assert_close(first.double(), oracle(q, k, v, lengths, lengths, causal=True)[0],
                               rtol=1e-4, atol=1e-5)
    cu[1:] = _cu([1000, 1047, 0, 1, 0])[1:]  # changed in place: checked and planned again
    moved = selfattn.varlen_attention(q, k, v, cu, causal=True, backend="chunked")
    assert len(checked) == 2 and len(made) == 2
    torch.testing.assert_close(moved.double(), oracle(q, k, v, [1000, 1047, 0, 1, 0], [1000, 1047, 0, 1, 0],
                                                      causal=True)[0], rtol=1e-4, atol=1e-5)


def _flash_like_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                       return_aux=None):
    """A CPU stand-in with torch.nn.attention.varlen.varlen_attn's signature and flash-attn's conventions
    (window (left, right) around each sequence's bottom-right diagonal; lse (Tq, Hq)), written from those
    conventions: per sequence, dense math. Rows that see no key are left NaN, which a real kernel may do."""
    assert q.dtype == k.dtype and cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32 and enable_gqa
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
    out = torch.full(q.shape[:2] + v.shape[2:], float("nan"), dtype=q.dtype)
    lse = torch.full(q.shape[:2], float("nan"))
    rep = q.shape[1] // k.shape[1]
    for s in range(cu_q.numel() - 1):
        a, b, c, e = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if b == a:
            continue
        scores = torch.einsum("ihd,jhd->hij", q[a:b].double(), k[c:e].repeat_interleave(rep, 1).double()) * scale
        diag = torch.arange(b - a)[:, None] + (e - c) - (b - a)
        j = torch.arange(e - c)[None, :]
        left, right = window_size
        keep = ((j >= diag - left) if left >= 0 else True) & ((j <= diag + right) if right >= 0 else True)
        scores = scores.masked_fill(~torch.as_tensor(keep), float("-inf"))
        out[a:b] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v[c:e].repeat_interleave(rep, 1).double()).to(
            q.dtype)
        lse[a:b] = scores.logsumexp(-1).T.float()
    return (out, lse) if return_aux is not None else out


@pytest.mark.parametrize("window", [None, (3, 0), (2, 1)])
def test_the_cuda_varlen_kernel_route_maps_the_call_as_the_kernel_reads_it(window):
    """catches: the CUDA route to torch's varlen flash kernel passing its window, scale, GQA, cu_seqlens or
    max_seqlen wrongly, mislaying the lse's (Tq, Hq) layout, or leaving rows that see no key as the kernel
    left them: run on the CPU through a stand-in with the kernel's signature and conventions."""
    from selfattn.backends import sdpa

    gen = torch.Generator().manual_seed(0)
    lq, lk = [5, 0, 3, 2], [9, 4, 3, 0]  # fewer queries than keys; keys with no query; queries with no key
    q, k, v = _tokens(sum(lq), 4, 8, torch.float32, gen), _tokens(sum(lk), 2, 8, torch.float32, gen), \
        _tokens(sum(lk), 2, 8, torch.float32, gen)
    built = varlen_module._build(q, k, v, _cu(lq), _cu(lk), None, None, window is None, window, 0.3, 0.0, None,
                                 None, True, "auto")
    call = functional._validate(built.q, built.k, built.v, built.kwargs["mask"], None, False, 0.3, 0.0, True, None)
    out, lse = sdpa.run_varlen(call, _flash_like_kernel)
    want, want_lse = oracle(q, k, v, lq, lk, causal=window is None, window=window, scale=0.3)
    torch.testing.assert_close(out[0].transpose(0, 1).double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse[0].double(), want_lse, rtol=1e-5, atol=1e-6)
    assert not out.isnan().any()


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "auto"])
def test_cu_seqlens_written_through_numpy_are_read_again(backend):
    """catches: the kept mask (and its plan) trusted by torch's version counter alone, which a write through
    NumPy (a data loader refilling the buffer a torch.from_numpy tensor wraps) or .data does not move."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_tokens(12, 2, 8, torch.float32, gen) for _ in range(3))
    buf = numpy.array([0, 5, 12], dtype=numpy.int32)
    cu = torch.from_numpy(buf)
    first = selfattn.varlen_attention(q, k, v, cu, causal=True, backend=backend)
    torch.testing.assert_close(first.double(), oracle(q, k, v, [5, 7], [5, 7], causal=True)[0], rtol=1e-5, atol=1e-6)
    buf[:] = [0, 9, 12]
    moved = selfattn.varlen_attention(q, k, v, cu, causal=True, backend=backend)
    torch.testing.assert_close(moved.double(), oracle(q, k, v, [9, 3], [9, 3], causal=True)[0], rtol=1e-5, atol=1e-6)
    cu.data[1] = 4
    again = selfattn.varlen_attention(q, k, v, cu, causal=True, backend=backend)
    torch.testing.assert_close(again.double(), oracle(q, k, v, [4, 8], [4, 8], causal=True)[0], rtol=1e-5, atol=1e-6)

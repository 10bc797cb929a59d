"""The chunked backend: dropout, memory, and agreement between its two kernels."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import check_against_reference, make_qkv

import selfattn
from selfattn import masks
from selfattn.backends import chunked
from selfattn.backends.chunked import kernels, runs


def _dropout_reference(q, k, v, keep, p, visible=None):
    """Plain float64 math with the given keep-mask: (softmax(s) * keep / (1 - p)) @ v."""
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, -1).nan_to_num(0) * keep / (1 - p)) @ v64  # dead rows: 0


@pytest.mark.parametrize("dv", [16, 11])
def test_dropout_same_seed_same_output_and_grads(dv, small_tiles):
    """catches: a backward that draws a new dropout pattern (wrong gradients)."""
    results = []
    for _ in range(2):
        q, k, v = make_qkv(2, 4, 2, 70, 90, 16, dv)
        torch.manual_seed(123)
        out = selfattn.attention(q, k, v, dropout_p=0.25, backend="chunked", causal="bottom_right")
        out.sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    torch.manual_seed(124)
    q, k, v = make_qkv(2, 4, 2, 70, 90, 16, dv)
    other = selfattn.attention(q, k, v, dropout_p=0.25, backend="chunked", causal="bottom_right")
    assert not torch.equal(other, results[0][0])


def test_dropout_matches_reference_with_the_pattern_it_used(small_tiles):
    """catches: dropout applied to unnormalised scores, or scaled by p instead of 1 / (1 - p),
    in the output or the gradients."""
    p = 0.3
    q, k, v = make_qkv(2, 4, 2, 70, 90, 16, dtype=torch.float64)
    mask = masks.sliding_window(30) & masks.padding([90, 55])
    torch.manual_seed(7)
    out = selfattn.attention(q, k, v, mask=mask, dropout_p=p, backend="chunked")
    torch.manual_seed(7)
    keep = chunked.dropout_pattern(chunked.draw_seed(), 2, 4, 70, 90, p, q.device)
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = _dropout_reference(q64, k64, v64, keep, p, mask.dense(70, 90))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    dout = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q64, k64, v64), dout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_dropout_fraction_within_binomial_bounds():
    """catches: a drop rate other than dropout_p (e.g. keep and drop swapped)."""
    p = 0.3
    keep = chunked.dropout_pattern(99, 2, 4, 300, 300, p, torch.device("cpu"))
    n = keep.numel()
    dropped = n - int(keep.sum())
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(dropped - n * p) < 5 * sigma
    # tiles are independent: no two tiles share a pattern
    assert not torch.equal(keep[..., :128, :128], keep[..., :128, 128:256])


def test_fused_and_math_kernels_agree(small_tiles):
    """catches: the fused per-run kernel and the plain-math kernel computing different functions."""
    q, k, v = make_qkv(2, 6, 2, 100, 130, 32, dtype=torch.float64)
    mask = masks.document(torch.arange(130) // 40) & masks.causal("bottom_right")
    bias = torch.randn(1, 6, 100, 130, dtype=torch.float64)
    out_f, lse_f = selfattn.attention(q, k, v, mask=mask, bias=bias, backend="chunked", return_lse=True)
    gf = torch.autograd.grad(out_f.sum(), (q, k, v))
    with chunked.options(kernel="math"):
        out_m, lse_m = selfattn.attention(q, k, v, mask=mask, bias=bias, backend="chunked", return_lse=True)
        gm = torch.autograd.grad(out_m.sum(), (q, k, v))
    torch.testing.assert_close(out_f, out_m)
    torch.testing.assert_close(lse_f, lse_m)
    for a, b in zip(gf, gm, strict=True):
        torch.testing.assert_close(a, b)


def test_chunked_skips_empty_tiles():
    """catches: the tile map being ignored (every tile computed)."""
    (group,) = chunked.schedule(masks.sliding_window(256), 16384, 16384, block_q=128)
    keys = sum(k1 - k0 for row in group.spans for k0, k1, _ in row)
    assert keys <= 128 * (256 + 2 * 128)  # each query block reads about a window plus a block


_MEMORY_SCRIPT = """
import json, resource, torch, selfattn
from selfattn import masks
torch.set_num_threads(2)
def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
L, H, D = {L}, 1, 64
q, k, v = (torch.randn(1, H, L, D, requires_grad=True) for _ in range(3))
w = selfattn.attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], mask=masks.sliding_window(64), backend="chunked")
w.sum().backward()
before = peak()
out = selfattn.attention(q, k, v, mask=masks.sliding_window(256), backend="chunked")
out.sum().backward()
print(json.dumps({{"extra": peak() - before, "finite": bool(torch.isfinite(q.grad).all())}}))
"""


def test_16k_sliding_window_fwd_bwd_memory_is_linear():
    """catches: an O(L^2) buffer (a dense mask or score matrix) anywhere in forward or backward."""
    length = 16384
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT.format(L=length)],
                         capture_output=True, text=True, timeout=600, check=True)
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    l2_bool = length * length  # the smallest L^2 buffer: one byte per (query, key) pair
    assert stats["finite"]
    assert stats["extra"] < l2_bool / 4, f"peak grew by {stats['extra'] / 2**20:.0f} MiB"


def test_padding_with_unequal_lengths_schedules_each_item():
    """catches: one schedule for the whole batch computing the padded tiles of short items."""
    mask = masks.padding([4096, 1024]) & masks.causal()
    groups = chunked.schedule(mask, 4096, 4096, block_q=256)
    assert [g.batch for g in groups] == [slice(0, 1), slice(1, 2)]
    assert max(k1 for row in groups[1].spans for _, k1, _ in row) <= 1024


@pytest.mark.parametrize("lengths", [[203, 40], [203, 203], [1, 150]])
def test_per_item_schedules_match_reference(lengths, small_tiles):
    """catches: batch items mixed up when each has its own schedule (outputs and gradients)."""
    from helpers import check_against_reference

    q, k, v = make_qkv(2, 4, 2, 113, 203, 16, dtype=torch.float64)
    check_against_reference(q, k, v, backend="chunked", mask=masks.padding(lengths), causal="bottom_right")


def _periodic_with_a_defect(b: int, lq: int, lk: int) -> masks.Mask:
    """A tensor mask whose visibility repeats along the diagonal (so spans of one offset share a
    pattern and can run together), except one flipped pair that only comparing blocks can see."""
    base = torch.rand(17, generator=torch.Generator().manual_seed(3)) > 0.4
    d = torch.arange(lq)[:, None] + (lk - lq) - torch.arange(lk)[None, :]
    t = base[d % 17] & (d.abs() < 60)
    t[lq // 2, lq // 2 + (lk - lq) - 5] ^= True
    return masks.from_tensor(t.expand(b, 1, lq, lk).clone())


_UNEVEN_DOCS = torch.tensor([[0] * 96 + [1] * 96 + [2] * 41 + [3] * 67,
                             [0] * 30 + [1] * 96 + [2] * 96 + [3] * 78])
# (mask, Lq): masks whose spans form runs of several spans with the small tiles (32-row query
# blocks, 48-key tiles, so offsets from the diagonal repeat every 96 rows); Lk = 300. A causal
# mask alone runs as one call (two bottom-right, merged): _WHOLE_CALL.
_RUN_CASES = {
    "window": (lambda lq, lk: masks.sliding_window(40), 300),
    "band with a hole": (lambda lq, lk: masks.sliding_window(50, 20) & ~masks.sliding_window(2, 2), 300),
    "causal&window bottom_right": (lambda lq, lk: masks.causal("bottom_right") & masks.sliding_window(120), 200),
    "causal top_left": (lambda lq, lk: masks.causal(), 300),
    "causal bottom_right": (lambda lq, lk: masks.causal("bottom_right"), 200),
    "padding+causal": (lambda lq, lk: masks.padding([300, 170]) & masks.causal(), 300),
    "padding(queries)+window": (lambda lq, lk: masks.padding([300, 130], queries=True) & masks.sliding_window(64),
                                300),
    "uneven documents+causal": (lambda lq, lk: masks.document(_UNEVEN_DOCS) & masks.causal(), 300),
    "periodic tensor with a defect": (lambda lq, lk: _periodic_with_a_defect(2, lq, lk), 250),
}
_WHOLE_CALL = {"causal top_left", "causal bottom_right"}


@pytest.fixture
def kernel_batches(monkeypatch):
    """The batch size of every call of the fused kernel, forward and backward, the query rows and
    keys of each, and the batch sizes of the calls that had a mask."""
    seen: dict[str, list[int]] = {"fwd": [], "bwd": [], "masked": [], "rows": [], "keys": []}
    ops = {"fwd": kernels.fused_op(), "bwd": kernels.fused_bwd_op()}

    def recording(name, arg):
        def op(*args, **kwargs):
            seen[name].append(args[arg].shape[0])
            seen["rows"].append(args[arg].shape[2])
            seen["keys"].append(args[arg + 1].shape[2])
            if kwargs.get("attn_mask") is not None:
                seen["masked"].append(args[arg].shape[0])
            return ops[name](*args, **kwargs)
        return lambda: op
    monkeypatch.setattr(kernels, "fused_op", recording("fwd", 0))
    monkeypatch.setattr(kernels, "fused_bwd_op", recording("bwd", 1))
    return seen


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "BLHD"])
@pytest.mark.parametrize("case", list(_RUN_CASES))
def test_batched_runs_match_reference(case, noncontiguous, small_tiles, kernel_batches):
    """catches: spans run together that do not share a visibility pattern (a mask's block taken
    for another span's, one batch item's for another's, the wrong offset from the diagonal),
    strided views off by a step, overlapping key gradients added twice or lost, and partial
    results of a query block copied over instead of merged; in the output and the gradients,
    with GQA, per-item masks and (BLHD) strides that keep batch items from folding together;
    and rows that no span reaches left unwritten (lse must be -inf there, output 0)."""
    from helpers import check_against_reference, dense_of, lse_reference

    make_mask, lq = _RUN_CASES[case]
    q, k, v = make_qkv(2, 4, 2, lq, 300, 16, noncontiguous=noncontiguous, seed=5)
    mask = make_mask(lq, 300)
    check_against_reference(q, k, v, backend="chunked", mask=mask)
    with torch.no_grad():
        _, lse = selfattn.attention(q, k, v, mask=mask, backend="chunked", return_lse=True)
    ref = lse_reference(q, k, dense_of(mask, False, lq, 300))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref))
    torch.testing.assert_close(lse.double()[torch.isfinite(ref)], ref[torch.isfinite(ref)], rtol=1e-5, atol=1e-5)
    # the check ran batched calls (else it would prove nothing about them), or the whole call at once
    if case in _WHOLE_CALL:
        assert set(kernel_batches["rows"]) == {lq} and not kernel_batches["masked"]
    else:
        assert max(kernel_batches["fwd"]) > 1 and max(kernel_batches["bwd"]) > 1, kernel_batches


@pytest.mark.parametrize("first", [0, 1])
def test_items_folded_into_one_call_after_runs_of_one_item(first):
    """catches: the copy-or-merge choice of a call that folds several batch items made from the
    first item's state alone: an item whose span was covered earlier got overwritten, or an item
    whose span was not got merged into uninitialised memory (garbage, NaN)."""
    ids = torch.zeros(2, 128, dtype=torch.long)
    ids[first, 8:] = 1
    q, k, v = make_qkv(2, 1, 1, 128, 128, 8, seed=3)
    with chunked.options(block_q=8, block_k=8):
        check_against_reference(q, k, v, backend="chunked", mask=masks.document(ids))


@pytest.mark.parametrize("case", ["padding+causal", "padding(queries)+window", "uneven documents+causal",
                                  "periodic tensor with a defect"])
def test_batched_runs_match_reference_with_no_block_kept(case, small_tiles, monkeypatch):
    """catches: a run's mask remade from the wrong span or batch item when its block was not kept
    from the comparison (no room left for it)."""
    from helpers import check_against_reference

    monkeypatch.setattr(runs, "_PATTERN_ELEMENTS", 0)
    make_mask, lq = _RUN_CASES[case]
    q, k, v = make_qkv(2, 4, 2, lq, 300, 16, seed=6)
    check_against_reference(q, k, v, backend="chunked", mask=make_mask(lq, 300))


def test_sliding_window_is_a_few_calls(kernel_batches):
    """catches: a sliding window computed span by span again (hundreds of calls at L = 4096), or
    each query block's band split into three spans (three calls and two merges per block)."""
    q, k, v = make_qkv(1, 2, 2, 4096, 4096, 16, seed=1)
    out = selfattn.attention(q, k, v, mask=masks.sliding_window(256), backend="chunked")
    out.sum().backward()
    assert len(kernel_batches["fwd"]) <= 4, kernel_batches["fwd"]
    assert len(kernel_batches["bwd"]) <= 16, kernel_batches["bwd"]
    assert max(kernel_batches["keys"]) == 384  # 128 rows see a band of 256 + 128 keys, in one span


def test_items_of_a_shared_schedule_split_by_pattern(kernel_batches):
    """catches: one item's padding applied to another item that shares its schedule (the long
    item's keys past the short one's length), or a mask built where none is needed."""
    from helpers import check_against_reference

    q, k, v = make_qkv(2, 2, 1, 1024, 1024, 16, seed=2)
    mask = masks.padding([1024, 768]) & masks.causal()
    assert len(chunked.schedule(mask, 1024, 1024, block_q=128)) == 1  # one schedule for both items
    with chunked.options(block_q=128):
        check_against_reference(q, k, v, backend="chunked", mask=mask)
    assert not kernel_batches["masked"]  # every span is causal, full or empty for each item


def test_dropout_pattern_does_not_depend_on_the_tiles():
    """catches: a dropout pattern drawn per tile of the chunked options in force, so that changing the
    tiles (or computing the same call elsewhere, as the distributed ring does) drops other weights."""
    q, k, v = make_qkv(2, 4, 2, 150, 170, 16, dtype=torch.float64, requires_grad=False)
    outs = []
    for tiles in ({}, {"block_q": 32, "block_k": 48}, {"block_q": 64, "block_k": 128, "math_block_q": 16}):
        torch.manual_seed(3)
        with chunked.options(**tiles):
            outs.append(selfattn.attention(q, k, v, mask=masks.sliding_window(60), dropout_p=0.4, backend="chunked"))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(outs[2], outs[0], rtol=0, atol=1e-12)



def _count_tile_maps(monkeypatch) -> list[tuple]:
    """Every tile map a mask builds, by (lq, lk, block_q, block_k)."""
    made: list[tuple] = []
    original = masks.Mask.tiles

    def tiles(self, lq, lk, block_q, block_k, device=None):
        made.append((lq, lk, block_q, block_k))
        return original(self, lq, lk, block_q, block_k, device)

    monkeypatch.setattr(masks.Mask, "tiles", tiles)
    return made


def _oracle(q, k, v, mask):
    """out and (q, k, v) gradients of out.square().sum() in float64."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = selfattn.testing.reference_attention(q64, k64, v64, mask=mask)
    out.square().sum().backward()
    return out, (q64.grad, k64.grad, v64.grad)


def test_a_call_plans_once_and_the_next_layer_reuses_the_plan(monkeypatch):
    """catches: dispatch's cost model, the query block choice and the schedule each building the mask's
    tile map (and copying it to the host); a model's layers that pass one mask object re-planning each
    call; a plan kept past an in-place change of the mask's tensors."""
    made = _count_tile_maps(monkeypatch)
    torch.manual_seed(0)
    lengths = [700, 300, 900, 148]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    mask = masks.document(ids) & masks.causal()
    q, k, v = (torch.randn(1, 2, 2048, 16) for _ in range(3))
    out = selfattn.attention(q, k, v, mask=mask)
    assert len(made) == 1  # the cost model's tile map is the plan's
    assert selfattn.explain(q, k, v, mask=mask).backend == "chunked" and len(made) == 1
    again = selfattn.attention(q, k, v, mask=mask)  # the next layer, the same mask object
    assert len(made) == 1 and torch.equal(out, again)
    torch.testing.assert_close(out.double(), _oracle(q, k, v, mask)[0], rtol=1e-4, atol=1e-5)
    ids[:1000] = 0  # the mask's tensor changed in place: a new plan, the new documents
    changed = selfattn.attention(q, k, v, mask=mask)
    assert len(made) == 2
    torch.testing.assert_close(changed.double(), _oracle(q, k, v, mask)[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(changed, out)


def test_a_kept_plan_serves_forward_and_backward_of_later_calls(monkeypatch):
    """catches: a plan reused across calls (its runs kept for the backward and the next call) that
    gives a later call another output or gradient than the oracle's."""
    made = _count_tile_maps(monkeypatch)
    torch.manual_seed(0)
    mask = masks.sliding_window(100, 0)
    for _ in range(2):
        q, k, v = (torch.randn(1, 2, 1024, 16, requires_grad=True) for _ in range(3))
        with chunked.options(block_k=64):
            out = selfattn.attention(q, k, v, mask=mask, backend="chunked")
        out.square().sum().backward()
        want, grads = _oracle(q, k, v, mask)
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
        for got, ref in zip((q.grad, k.grad, v.grad), grads, strict=True):
            torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    assert len(made) == 1


def test_a_kept_plan_sees_mask_tensors_written_through_numpy():
    """catches: a plan kept on the mask object and trusted by torch's version counter alone, which a write
    through NumPy does not move: the next call would skip the new documents' tiles as the old ones'."""
    import numpy

    torch.manual_seed(0)
    buf = numpy.repeat(numpy.arange(4), 256)
    mask = masks.document(torch.from_numpy(buf)) & masks.causal()
    q, k, v = (torch.randn(1, 2, 1024, 16) for _ in range(3))
    with chunked.options(block_k=64):
        selfattn.attention(q, k, v, mask=mask, backend="chunked")
        buf[:] = numpy.repeat(numpy.arange(2), 512)
        out = selfattn.attention(q, k, v, mask=mask, backend="chunked")
    torch.testing.assert_close(out.double(), _oracle(q, k, v, mask)[0], rtol=1e-4, atol=1e-5)

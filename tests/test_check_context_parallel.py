"""The context-parallel checker on hand-written ring attentions: a right one passes, each known mistake is named.

The rings are written here as a user would: K/V blocks sent around the ring with isend/irecv, each block's mask
built from the :class:`Case`, the partial results merged by their lse (forward only: autograd differentiates the
ring, its sends and receives cut the graph, so the gradient of the keys is gathered back by an all-gather of the
keys themselves). Each bug is one flag.

Shape legend: B batch, H heads, n tokens per rank, L the global length, W the world size, D head dim.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from selfattn.distributed.verify import Case, check_context_parallel


class _Gather(torch.autograd.Function):
    """Every rank's (B, H, n, D) as (W, B, H, n, D); the backward sums each rank's gradient back to it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, world: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[dist.get_rank()], None


def _block_mask(case: Case, qpos: torch.Tensor, kpos: torch.Tensor, window_inverted: bool = False) -> torch.Tensor:
    """(B, 1, n, n) visibility of keys at ``kpos`` from queries at ``qpos``."""
    i, j = qpos[:, None], kpos[None, :]
    vis = torch.ones(len(qpos), len(kpos), dtype=torch.bool)[None, None].expand(2, 1, -1, -1).clone()
    if case.causal:
        vis &= (j <= i)[None, None]
    if case.window is not None:
        left, right = case.window
        inside = (j >= i - left) & (j <= i + right)
        vis &= (~inside if window_inverted else inside)[None, None]
    if case.document_ids is not None:
        ids = case.document_ids
        vis &= (ids[:, qpos][:, :, None] == ids[:, kpos][:, None, :])[:, None]
    if case.lengths is not None:
        vis &= (kpos[None, :] < case.lengths[:, None])[:, None, None, :]
    return vis


def _ring(q, k, v, case: Case, *, window: bool = True, inverted: bool = False, local: bool = False,
          low_precision: bool = False, reversed_ring: bool = False) -> torch.Tensor:
    world, rank = case.world, case.rank
    ks, vs = _Gather.apply(k, world), _Gather.apply(v, world)  # (W, B, H, n, D): the blocks the ring would pass
    n = q.shape[2]
    qpos = torch.arange(n) if local else case.positions
    out = lse = None
    for s in range(world):
        src = (rank - s) % world  # the keys that arrive at step s
        labelled = (rank + s) % world if reversed_ring else src
        kpos = torch.arange(n) if local else case.all_positions[labelled]
        c = case
        if not window:
            c = Case(**{**vars(case), "window": None})
        vis = _block_mask(c, qpos, kpos, inverted)
        scores = (q @ ks[src].transpose(-1, -2)) * case.scale
        scores = scores.masked_fill(~vis, float("-inf"))
        b_lse = torch.logsumexp(scores, -1)
        b_out = torch.nan_to_num(torch.softmax(scores, -1)) @ vs[src]
        if low_precision:
            b_out, b_lse = b_out.to(torch.bfloat16).double(), b_lse.to(torch.bfloat16).double()
        if out is None:
            out, lse = b_out, b_lse
            continue
        new = torch.logaddexp(lse, b_lse)
        wa = torch.nan_to_num(torch.exp(lse - new))[..., None]
        wb = torch.nan_to_num(torch.exp(b_lse - new))[..., None]
        out, lse = wa * out + wb * b_out, new
    return out


def ring_right(q, k, v, case):
    return _ring(q, k, v, case)


def ring_ignores_window(q, k, v, case):
    return _ring(q, k, v, case, window=False)


def ring_inverts_window(q, k, v, case):
    return _ring(q, k, v, case, inverted=True)


def ring_local_positions(q, k, v, case):
    return _ring(q, k, v, case, local=True)


def ring_low_precision_merge(q, k, v, case):
    return _ring(q, k, v, case, low_precision=True)


def ring_reversed(q, k, v, case):
    return _ring(q, k, v, case, reversed_ring=True)


def ring_detached_keys(q, k, v, case):
    return _ring(q, k.detach(), v, case)


def ring_raises(q, k, v, case):
    raise RuntimeError("boom")


@pytest.mark.parametrize("layout", [pytest.param("contiguous", marks=pytest.mark.slow), "zigzag"])
def test_a_right_ring_passes(layout):
    """catches: the checker calling a right implementation wrong (its oracle, its shards, its gathering)."""
    report = check_context_parallel(ring_right, world_size=2, layout=layout)
    assert report.ok, str(report)
    assert set(report.errors) == {"none", "causal", "window", "documents", "padding"}


@pytest.mark.parametrize("fn, case, expected, world", [
    (ring_ignores_window, "window", "window-ignored", 2),
    pytest.param(ring_inverts_window, "window", "window-inverted", 2, marks=pytest.mark.slow),
    (ring_local_positions, "causal", "local-positions", 2),
    pytest.param(ring_low_precision_merge, "none", "merge-precision", 2, marks=pytest.mark.slow),
    pytest.param(ring_reversed, "causal", "ring-order", 3, marks=pytest.mark.slow),
    pytest.param(ring_detached_keys, "none", "wrong-gradient", 2, marks=pytest.mark.slow),
    (ring_raises, "causal", "crashed", 2),
], ids=lambda x: x if isinstance(x, str) else getattr(x, "__name__", str(x)))
def test_each_buggy_ring_is_named(fn, case, expected, world):
    """catches: a buggy ring certified, or its bug named as another (each mistake's own output explains it)."""
    report = check_context_parallel(fn, world_size=world, layout="zigzag", cases=[case])
    assert [f.id for f in report.findings] == [expected], str(report)


def test_the_testing_form_raises_with_the_findings():
    """catches: assert_context_parallel_correct passing a buggy ring, or failing without saying why."""
    import selfattn.testing

    with pytest.raises(AssertionError, match="local-positions"):
        selfattn.testing.assert_context_parallel_correct(ring_local_positions, cases=["causal"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="layout"):
        check_context_parallel(ring_right, layout="diagonal")
    with pytest.raises(ValueError, match="cases"):
        check_context_parallel(ring_right, cases=["sideways"])
    with pytest.raises(ValueError, match="multiple"):
        check_context_parallel(ring_right, length=9)

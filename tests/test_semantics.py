"""Fully masked rows, backend choice, explain() and use_backend()."""

from __future__ import annotations

import pytest
import torch
from helpers import make_qkv

import selfattn
from selfattn import masks

BACKENDS = ["reference", "sdpa", "chunked"]


def _dead_masks(b: int, h: int, lq: int, lk: int) -> dict[str, torch.Tensor]:
    row = torch.ones(b, h, lq, lk, dtype=torch.bool)
    row[0, 1, 3] = False
    item = torch.ones(b, h, lq, lk, dtype=torch.bool)
    item[1] = False
    head = torch.ones(b, h, lq, lk, dtype=torch.bool)
    head[:, 2] = False
    return {"row": row, "batch-item": item, "head": head}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("where", ["row", "batch-item", "head"])
def test_fully_masked_rows_give_zero_output_zero_grad_and_neg_inf_lse(backend, dtype, where, small_tiles):
    """catches: NaN from softmax over an all -inf row, in the output or in the gradients."""
    b, h, lq, lk = 2, 4, 37, 50
    q, k, v = make_qkv(b, h, h, lq, lk, 16, dtype=dtype)
    mask = _dead_masks(b, h, lq, lk)[where]
    dead = ~mask.any(-1)  # (B, H, Lq)
    kw = dict(mask=mask, backend=backend)
    out = selfattn.attention(q, k, v, **kw)
    assert torch.isfinite(out).all()
    assert (out[dead] == 0).all()
    out.float().pow(2).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[dead] == 0).all()
    _, lse = selfattn.attention(q.detach(), k.detach(), v.detach(), return_lse=True, **kw)
    assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_rows_from_structured_masks(backend, small_tiles):
    """catches: bottom-right causal with Lq > Lk (leading rows see nothing) producing NaN."""
    q, k, v = make_qkv(1, 2, 2, 90, 40, 8)
    out = selfattn.attention(q, k, v, causal="bottom_right", backend=backend)
    assert (out[:, :, :50] == 0).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, :, :50] == 0).all()


def test_explain_names_every_other_backend():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, requires_grad=False)
    ex = selfattn.explain(q, k, v, causal=True)
    assert ex.backend == "sdpa"
    assert set(ex.not_chosen) == {"reference", "chunked", "flex"}
    assert "auto picks: sdpa" in str(ex)
    ex = selfattn.explain(q, k, torch.randn(1, 2, 16, 5), return_lse=True)
    assert ex.backend != "sdpa" and "head dim" in ex.not_chosen["sdpa"]


def test_auto_uses_chunked_for_large_structured_masks():
    """catches: auto building an L^2 dense mask where chunked would skip tiles."""
    q, k, v = make_qkv(1, 1, 1, 4096, 4096, 8, requires_grad=False)
    ex = selfattn.explain(q, k, v, mask=masks.sliding_window(64))
    assert ex.backend == "chunked"
    assert "dense mask" in ex.not_chosen["sdpa"]
    small = selfattn.explain(q[:, :, :64], k[:, :, :64], v[:, :, :64], mask=masks.sliding_window(8))
    assert small.backend == "sdpa"
    q, k, v = q[:, :, :1024], k[:, :, :1024], v[:, :, :1024]
    dense_random = torch.rand(1024, 1024, generator=torch.Generator().manual_seed(0)) > 0.5
    assert selfattn.explain(q, k, v, mask=dense_random).backend == "sdpa"  # no tile to skip
    assert selfattn.explain(q, k, v, mask=masks.document(torch.arange(1024) // 128)).backend == "chunked"


def test_use_backend_forces_and_restores():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8, requires_grad=False)
    assert selfattn.explain(q, k, v).backend == "sdpa"
    with selfattn.use_backend("reference"):
        assert selfattn.explain(q, k, v).backend == "reference"
        with selfattn.use_backend("chunked"):
            assert selfattn.explain(q, k, v).backend == "chunked"
        assert selfattn.explain(q, k, v).backend == "reference"
    with pytest.raises(RuntimeError), selfattn.use_backend("chunked"):
        raise RuntimeError("boom")
    assert selfattn.explain(q, k, v).backend == "sdpa"


def test_need_weights_weights_sum_to_one_and_reproduce_output():
    q, k, v = make_qkv(2, 4, 2, 9, 11, 8, requires_grad=False)
    out, w = selfattn.attention_with_weights(q, k, v, mask=masks.padding([11, 4]))
    assert w.shape == (2, 4, 9, 11)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 9))
    assert (w[1, :, :, 4:] == 0).all()
    kv = v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(w @ kv, out)


def test_auto_policy_on_cuda(monkeypatch):
    """catches: auto on CUDA not preferring flex for structured masks, or falling back to an L^2
    dense mask when flex cannot run (dropout). Checked on the CPU by presenting the call as CUDA."""
    from selfattn import _call

    monkeypatch.setattr(_call.AttentionCall, "device", property(lambda self: torch.device("cuda")))
    q, k, v = make_qkv(1, 1, 1, 512, 512, 8, requires_grad=False)
    assert selfattn.explain(q, k, v, mask=masks.sliding_window(16)).backend == "flex"
    assert selfattn.explain(q, k, v, causal=True).backend == "sdpa"
    big = torch.empty(1, 1, 16385, 8, device="meta")
    ex = selfattn.explain(big, big, big, mask=masks.sliding_window(16), dropout_p=0.1)
    assert ex.backend == "chunked" and "dropout" in ex.not_chosen["flex"]

"""Malformed calls raise ValueError/TypeError at the entry point, naming the argument."""

from __future__ import annotations

import pytest
import torch

import selfattn
from selfattn import masks

Q = torch.randn(2, 4, 5, 8)
K = torch.randn(2, 2, 7, 8)
V = torch.randn(2, 2, 7, 8)


def call(q=Q, k=K, v=V, **kw):
    return selfattn.attention(q, k, v, **kw)


BAD = {
    "q-rank-3": (lambda: call(q=torch.randn(2, 5, 8)), ValueError, r"\bq\b.*4-D"),
    "k-rank-5": (lambda: call(k=torch.randn(1, 2, 2, 7, 8)), ValueError, r"\bk\b.*4-D"),
    "q-not-tensor": (lambda: call(q=[[1.0]]), TypeError, r"\bq\b"),
    "v-int-dtype": (lambda: call(v=torch.ones(2, 2, 7, 8, dtype=torch.long)), TypeError, r"\bv\b"),
    "mixed-dtypes": (lambda: call(k=K.double()), TypeError, "dtype"),
    "batch-mismatch": (lambda: call(k=torch.randn(3, 2, 7, 8)), ValueError, "batch"),
    "head-dim-mismatch": (lambda: call(k=torch.randn(2, 2, 7, 9)), ValueError, "head dim"),
    "kv-length-mismatch": (lambda: call(v=torch.randn(2, 2, 6, 8)), ValueError, r"k and v"),
    "kv-heads-mismatch": (lambda: call(v=torch.randn(2, 1, 7, 8)), ValueError, r"k and v"),
    "gqa-not-multiple": (lambda: call(k=torch.randn(2, 3, 7, 8), v=torch.randn(2, 3, 7, 8)),
                         ValueError, "multiple of Hkv"),
    "empty-length": (lambda: call(q=torch.randn(2, 4, 0, 8)), ValueError, r"\bq\b.*empty"),
    "mask-not-broadcastable": (lambda: call(mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, "mask"),
    "mask-batch-3": (lambda: call(mask=torch.ones(3, 1, 5, 7, dtype=torch.bool)), ValueError, "mask"),
    "float-mask": (lambda: call(mask=torch.zeros(5, 7)), TypeError, "mask.*bias"),
    "mask-wrong-type": (lambda: call(mask="causal"), TypeError, "mask"),
    "padding-wrong-batch": (lambda: call(mask=masks.padding([1, 2, 3])), ValueError, "mask"),
    "document-wrong-length": (lambda: call(mask=masks.document(torch.zeros(2, 9, dtype=torch.long))),
                              ValueError, "document ids"),
    "bool-bias": (lambda: call(bias=torch.ones(5, 7, dtype=torch.bool)), TypeError, "bias.*mask"),
    "bias-bad-shape": (lambda: call(bias=torch.zeros(4, 4, 5, 7)), ValueError, "bias"),
    "bias-not-tensor": (lambda: call(bias=0.5), TypeError, "bias"),
    "dropout-1": (lambda: call(dropout_p=1.0), ValueError, "dropout_p"),
    "dropout-negative": (lambda: call(dropout_p=-0.1), ValueError, "dropout_p"),
    "dropout-str": (lambda: call(dropout_p="0.1"), TypeError, "dropout_p"),
    "scale-zero": (lambda: call(scale=0.0), ValueError, "scale"),
    "scale-negative": (lambda: call(scale=-1.0), ValueError, "scale"),
    "scale-nan": (lambda: call(scale=float("nan")), ValueError, "scale"),
    "scale-inf": (lambda: call(scale=float("inf")), ValueError, "scale"),
    "scale-tensor": (lambda: call(scale=torch.tensor(0.5)), TypeError, "scale"),
    "causal-true-lq-ne-lk": (lambda: call(causal=True), ValueError, "top_left.*bottom_right"),
    "causal-bad-string": (lambda: call(causal="upper"), ValueError, "causal"),
    "causal-int": (lambda: call(causal=1), ValueError, "causal"),
    "unknown-backend": (lambda: call(backend="flash9"), ValueError, "backend"),
    "backend-not-str": (lambda: call(backend=None), TypeError, "backend"),
    "return-lse-not-bool": (lambda: call(return_lse=1), TypeError, "return_lse"),
    "mixed-devices": (lambda: call(k=K.to("meta")), ValueError, "device"),
    "mask-other-device": (lambda: call(mask=torch.ones(5, 7, dtype=torch.bool, device="meta")),
                          ValueError, "mask"),
    "backend-cannot-run": (lambda: selfattn.attention(Q, K, torch.randn(2, 2, 7, 5), backend="sdpa",
                                                      return_lse=True), ValueError, "sdpa.*cannot"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_rejected_with_a_named_argument(name):
    """catches: bad input reaching a kernel (obscure error, or silently wrong output)."""
    fn, exc, match = BAD[name]
    with pytest.raises(exc, match=match):
        fn()


def test_there_are_at_least_twenty_cases():
    assert len(BAD) >= 20


def test_use_backend_rejects_unknown_name():
    with pytest.raises(ValueError, match="backend"):
        with selfattn.use_backend("nope"):
            pass

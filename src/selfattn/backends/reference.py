"""The reference backend: the textbook math, upcast to at least float32.

The only backend that returns attention weights, and the one that runs every call.
Memory is O(B * Hq * Lq * Lk).

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .._call import AttentionCall, compute_dtype
from ..masks import positions
from ..scores import apply_score_mod
from ._common import safe_softmax, split_heads
from .base import Backend, learned_term_order

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    """``softmax(q k^T * scale + bias, score_mod, masked) @ v`` on the whole score matrix."""

    name = "reference"
    supports_weights: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = True

    def nondeterministic(self, call: AttentionCall) -> str | None:
        return learned_term_order(call)

    def run(self, call: AttentionCall) -> tuple[Tensor, Tensor, Tensor | None]:
        """Returns (out (B, Hq, Lq, Dv), lse (B, Hq, Lq) float32, weights (B, Hq, Lq, Lk) or None)."""
        b, hq, hkv, g, lq, lk = call.batch, call.hq, call.hkv, call.groups, call.lq, call.lk
        ct = compute_dtype(call.dtype)
        q = split_heads(call.q.to(ct), hkv, g)  # (B, Hkv, G, Lq, D)
        k = call.k.to(ct).unsqueeze(2)  # (B, Hkv, 1, Lk, D)
        v = call.v.to(ct).unsqueeze(2)  # (B, Hkv, 1, Lk, Dv)
        s = torch.matmul(q, k.transpose(-1, -2)) * call.scale  # (B, Hkv, G, Lq, Lk)
        if call.bias is not None:
            s = s + split_heads(call.bias.to(ct), hkv, g)
        if call.score_mod is not None:
            idx = positions(torch.arange(b), hq, 0, lq, 0, lk, lq, lk, call.device)
            s = apply_score_mod(call.score_mod, s.reshape(b, hq, lq, lk), idx).reshape(s.shape)
        if call.mask is not None:
            visible = split_heads(call.mask.dense(lq, lk, call.device), hkv, g)
            s = s.masked_fill(~visible, float("-inf"))
        if call.sinks is not None:  # one more logit per row, with no value: dropped after the softmax
            sink = call.sinks.to(ct).reshape(1, hkv, g, 1, 1).expand(*s.shape[:-1], 1)
            w, lse = safe_softmax(torch.cat([s, sink], dim=-1))
            w = w[..., :-1]
        else:
            w, lse = safe_softmax(s)
        w_used = F.dropout(w, call.dropout_p) if call.dropout_p > 0 else w
        out = torch.matmul(w_used, v)  # (B, Hkv, G, Lq, Dv)
        out = out.reshape(b, hq, lq, call.v_head_dim).to(call.dtype)
        weights = w_used.reshape(b, hq, lq, lk).to(call.dtype) if call.need_weights else None
        return out, lse.reshape(b, hq, lq).float().detach(), weights


BACKEND = ReferenceBackend()

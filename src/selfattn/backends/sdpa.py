"""The sdpa backend: torch's ``scaled_dot_product_attention``.

Fast paths: ``is_causal`` for top-left causal masks and ``enable_gqa`` for GQA/MQA, so K/V are
never repeated. Any other mask is passed as a dense tensor (O(Lq * Lk) memory). Rows whose keys
are all hidden are given every key inside the kernel and zeroed afterwards, so no NaN reaches
the output or the gradients. With ``return_lse`` on the CPU it calls the fused CPU flash op that
SDPA itself dispatches to, which returns the logsumexp (its inputs get a unit-stride last dim:
that op reads them as if they had one).

Shape legend: B batch, Hq query heads, Hkv kv heads, Lq/Lk lengths, Dv value head dim.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .._call import AttentionCall, compute_dtype
from ..masks import Causal, positions
from ..scores import score_mod_bias
from ._common import additive_mask, unit_stride
from .base import Backend, bias_rounds_in_kernel

__all__ = ["DENSE_BIAS_LIMIT", "SdpaBackend"]

DENSE_BIAS_LIMIT = 1 << 26  # elements of a dense bias built from an additive score modifier (256 MiB fp32)


def _cpu_lse_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class SdpaBackend(Backend):
    """One call of torch's fused SDPA; masks other than top-left causal become a dense tensor."""

    name = "sdpa"
    score_mods: ClassVar = "additive"

    def fused_causal(self, call: AttentionCall) -> bool:
        """True when SDPA's ``is_causal`` (top-left aligned) expresses the whole mask."""
        m = call.mask
        return (call.bias is None and call.score_mod is None and isinstance(m, Causal)
                and m.offset(call.lq, call.lk) == 0)

    def needs_dense_mask(self, call: AttentionCall) -> bool:
        """True when this call costs SDPA an (Lq, Lk) mask or bias tensor."""
        plain = call.mask is None and call.bias is None and call.score_mod is None
        return not (plain or self.fused_causal(call))

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        if call.score_mod is not None and call.score_mod.additive and (
                elements := call.batch * call.hq * call.lq * call.lk) > DENSE_BIAS_LIMIT:
            reasons.append(f"{call.score_mod!r} as a dense bias would have {elements:,} elements "
                           f"(> {DENSE_BIAS_LIMIT:,}); chunked applies it tile by tile")
        if rounding := bias_rounds_in_kernel(call):
            reasons.append(f"SDPA adds its mask in q's dtype, which would round it: {rounding}")
        if call.return_lse:
            if call.device.type != "cpu" or _cpu_lse_op() is None:
                reasons.append(f"return_lse on {call.device.type} (torch has no SDPA op that returns lse "
                               "with any mask there)")
            else:
                if call.dropout_p > 0:
                    reasons.append("return_lse with dropout (torch's CPU op that returns lse has no dropout)")
                if call.head_dim != call.v_head_dim:
                    reasons.append("return_lse with Dv != D (the CPU op that returns lse needs v's head dim "
                                   "equal to q's)")
                if call.bias is not None and call.bias.requires_grad and torch.is_grad_enabled():
                    reasons.append("return_lse with a bias that requires grad (the CPU op that returns lse "
                                   "gives no gradient for bias)")
        return reasons

    def run(self, call: AttentionCall) -> tuple[Tensor, Tensor | None, None]:
        q, k, v = call.q, call.k, call.v
        if call.mask is None and call.bias is None and call.score_mod is None:
            is_causal, attn_mask, dead = False, None, None  # an unmasked layer, a decode step: nothing to build
        else:
            is_causal, attn_mask, dead = self._mask(call)

        lse = None
        if call.return_lse:
            q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
            out, lse = _cpu_lse_op()(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=call.scale)
            lse = lse.float().detach()
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, is_causal=is_causal,
                scale=call.scale, enable_gqa=call.hq != call.hkv)
        if dead is not None:
            out = out.masked_fill(dead, 0.0)
            if lse is not None:
                lse = lse.masked_fill(dead.squeeze(-1), float("-inf"))
        return out, lse, None

    def _mask(self, call: AttentionCall) -> tuple[bool, Tensor | None, Tensor | None]:
        """(is_causal, the mask SDPA is given, the rows that see no key (B|1, Hq|1, Lq, 1) or None).
        Dead rows are given every key in the mask; run() zeroes them afterwards."""
        is_causal = self.fused_causal(call)
        visible = None
        if call.mask is not None and not is_causal:
            visible = call.mask.dense(call.lq, call.lk, call.device)  # (B|1, Hq|1, Lq, Lk)
        bias = call.bias
        if call.score_mod is not None:  # additive (checked): with the bias, summed in the compute dtype
            idx = positions(torch.arange(call.batch), call.hq, 0, call.lq, 0, call.lk, call.lq, call.lk, call.device)
            mod_bias = score_mod_bias(call.score_mod, idx, compute_dtype(call.dtype))
            bias = mod_bias if bias is None else bias.to(mod_bias.dtype) + mod_bias
        needs_float = bias is not None or call.return_lse
        attn_mask = additive_mask(visible, bias, call.dtype) if needs_float else visible
        dead = None
        if attn_mask is not None:
            alive = (attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf"))
            alive = alive.any(-1, keepdim=True)
            if torch.compiler.is_compiling() or not bool(alive.all()):  # compiled: no branch on data
                dead = ~alive
                attn_mask = attn_mask | dead if attn_mask.dtype == torch.bool else attn_mask.masked_fill(dead, 0.0)
        return is_causal, attn_mask, dead


BACKEND = SdpaBackend()

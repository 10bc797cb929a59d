"""The sdpa backend: torch's ``scaled_dot_product_attention``.

Fast paths: ``is_causal`` for top-left causal masks and ``enable_gqa`` for GQA/MQA, so K/V are
never repeated. Any other mask is passed as a dense tensor (O(Lq * Lk) memory). Rows whose keys
are all hidden are given every key inside the kernel and zeroed afterwards, so no NaN reaches
the output or the gradients. With ``return_lse`` on the CPU it calls the fused CPU flash op that
SDPA itself dispatches to, which returns the logsumexp.

Shape legend: B batch, Hq query heads, Hkv kv heads, Lq/Lk lengths, Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._call import AttentionCall
from ..masks import Causal
from ..scores import indices
from ._common import additive_mask

NAME = "sdpa"


def _cpu_lse_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def is_fast_causal(call: AttentionCall) -> bool:
    """True when SDPA's ``is_causal`` (top-left aligned) expresses the whole mask."""
    _, _, _, lq, lk, _, _ = call.shape
    m = call.mask
    return (call.bias is None and call.score_mod is None and isinstance(m, Causal)
            and (m.align == "top_left" or lq == lk))


DENSE_BIAS_LIMIT = 1 << 26  # elements of a dense bias built from an additive score modifier (256 MiB fp32)


def supports(call: AttentionCall) -> str | None:
    if call.need_weights:
        return "does not return attention weights (only reference does)"
    if call.score_mod is not None:
        b, hq, _, lq, lk, _, _ = call.shape
        if not call.score_mod.additive:
            return f"SDPA takes only tensors, and {call.score_mod!r} is not additive (not a bias)"
        if b * hq * lq * lk > DENSE_BIAS_LIMIT:
            return (f"{call.score_mod!r} as a dense bias would have {b * hq * lq * lk:,} elements "
                    f"(> {DENSE_BIAS_LIMIT:,}); chunked applies it tile by tile")
    if call.return_lse:
        if call.device.type != "cpu" or _cpu_lse_op() is None:
            return f"torch has no SDPA op that returns lse on {call.device.type} with any mask"
        if call.dropout_p > 0:
            return "torch's CPU op that returns lse has no dropout"
        if call.q.shape[-1] != call.v.shape[-1]:
            return "torch's CPU op that returns lse needs v's head dim equal to q's"
        if call.bias is not None and call.bias.requires_grad:
            return "the lse-returning CPU op gives no gradient for bias"
    return None


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None, None]:
    _, hq, hkv, lq, lk, _, _ = call.shape
    q, k, v = call.q, call.k, call.v
    is_causal = is_fast_causal(call)
    visible = None
    if call.mask is not None and not is_causal:
        visible = call.mask.dense(lq, lk, call.device)  # (B|1, Hq|1, Lq, Lk)
    bias = call.bias
    if call.score_mod is not None:  # additive (supports() checked): a dense bias
        b = call.shape[0]
        mod_bias = call.score_mod.bias(*indices(torch.arange(b), hq, 0, lq, 0, lk, lk - lq, call.device))
        bias = mod_bias if bias is None else bias + mod_bias
    needs_float = bias is not None or call.return_lse
    attn_mask = additive_mask(visible, bias, q.dtype) if needs_float else visible
    dead = None  # (B|1, Hq|1, Lq, 1): rows that see no key
    if attn_mask is not None:
        alive = (attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf"))
        alive = alive.any(-1, keepdim=True)
        if not bool(alive.all()):
            dead = ~alive  # give dead rows every key inside the kernel, zero them below
            attn_mask = attn_mask | dead if attn_mask.dtype == torch.bool else attn_mask.masked_fill(dead, 0.0)

    lse = None
    if call.return_lse:
        out, lse = _cpu_lse_op()(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=call.scale)
        lse = lse.float().detach()
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, is_causal=is_causal,
            scale=call.scale, enable_gqa=hq != hkv)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
        if lse is not None:
            lse = lse.masked_fill(dead.squeeze(-1), float("-inf"))
    return out, lse, None

"""The sdpa backend: torch's ``scaled_dot_product_attention``.

Fast paths: ``is_causal`` for top-left causal masks and ``enable_gqa`` for GQA/MQA, so K/V are
never repeated. Any other mask is passed as a dense tensor (O(Lq * Lk) memory). Rows whose keys
are all hidden are given every key inside the kernel and zeroed afterwards, so no NaN reaches
the output or the gradients. With ``return_lse`` on the CPU it calls the fused CPU flash op that
SDPA itself dispatches to, which returns the logsumexp (its inputs get a unit-stride last dim:
that op reads them as if they had one).

A packed mask (``masks.packed``, what ``varlen_attention`` passes) over a batch of one needs no dense
mask either, where :func:`varlen_kernel_obstacles` finds none: on CUDA it goes to torch's own varlen
flash kernel, ``torch.nn.attention.varlen.varlen_attn`` (the call mapped by :func:`run_varlen`, which
the tests run on the CPU with a stand-in for the kernel); on the CPU each sequence is one fused SDPA
call on its own rows and keys, causal by ``is_causal`` (:func:`run_sequences`): no padding, no mask,
and 2x faster than chunked's tiles for 8 documents in 16k tokens, fwd+bwd.

Shape legend: B batch, Hq query heads, Hkv kv heads, Lq/Lk lengths, Dv value head dim, Tq/Tk packed
tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._call import AttentionCall, compute_dtype
from ..masks import Causal, Packed, positions
from ..scores import score_mod_bias
from ._common import additive_mask, unit_stride
from .base import Backend, bias_rounds_in_kernel, has_learned_term, learned_term_order

__all__ = ["DENSE_BIAS_LIMIT", "SdpaBackend", "math_for_determinism", "run_varlen", "varlen_kernel_obstacles"]

DENSE_BIAS_LIMIT = 1 << 26  # elements of a dense bias built from an additive score modifier (256 MiB fp32)


def _cpu_lse_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _torch_varlen() -> Callable[..., Any] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10
        return None
    return varlen_attn


CPU_SEQUENCES_MAX = 256
"""The most sequences of a packed call the CPU runs as one fused call each (past it, the Python loop
would cost more than it saves: chunked or the dense mask run it)."""


def varlen_kernel_obstacles(call: AttentionCall) -> list[str] | None:
    """Why this backend cannot run a packed call without a dense mask (torch's varlen flash kernel on
    CUDA, one fused call per sequence on the CPU): None when the call has no packed mask (the question
    does not arise), [] when it can."""
    if type(call.mask) is not Packed:
        return None
    if call.device.type == "cpu":
        return _sequence_obstacles(call)
    out = []
    if call.device.type != "cuda":
        out.append(f"torch's varlen kernel runs on CUDA, not {call.device.type}")
    if _torch_varlen() is None:
        out.append("this torch has no torch.nn.attention.varlen")
    if call.batch != 1:
        out.append(f"a packed mask over a batch of {call.batch} (the kernel packs one row)")
    if call.dtype not in (torch.float16, torch.bfloat16):
        out.append(f"{call.dtype} (the flash kernel takes float16 and bfloat16)")
    if call.head_dim != call.v_head_dim or call.head_dim % 8 or call.head_dim > 256:
        out.append(f"D={call.head_dim}, Dv={call.v_head_dim} (the flash kernel needs D == Dv, a multiple of 8, "
                   "<= 256)")
    for what, present in (("a bias", call.bias is not None), ("a score modifier", call.score_mod is not None),
                          ("dropout", call.dropout_p > 0), ("sinks", call.sinks is not None)):
        if present:
            out.append(f"{what} (the varlen kernel has none)")
    if call.deterministic and call.requires_grad:
        out.append("deterministic=True with a gradient (the varlen flash kernel promises no fixed order in its "
                   "backward)")
    return out


def math_for_determinism(call: AttentionCall) -> bool:
    """True when this call must run SDPA's math kernel to be deterministic: off the CPU, with a gradient,
    when torch's own deterministic mode is off. (The fused kernels' forwards are deterministic; their
    backwards there may accumulate in a different order each run, unless that mode makes torch pick
    deterministic ones.)"""
    return (call.device.type != "cpu" and call.requires_grad
            and not torch.are_deterministic_algorithms_enabled())


def _sequence_obstacles(call: AttentionCall) -> list[str]:
    mask = call.mask
    assert isinstance(mask, Packed)
    out = []
    if call.batch != 1:
        out.append(f"a packed mask over a batch of {call.batch} (one fused call per sequence of one row)")
    for what, present in (("a bias", call.bias is not None), ("a score modifier", call.score_mod is not None),
                          ("sinks", call.sinks is not None), ("a window", mask.left is not None
                                                                or mask.right not in (None, 0))):
        if present:
            out.append(f"{what} (one fused call per sequence takes only causal or full sequences)")
    if out:
        return out
    nq, nk = mask.lengths()
    if len(nq) > CPU_SEQUENCES_MAX:
        out.append(f"{len(nq)} sequences (one fused call each is for at most {CPU_SEQUENCES_MAX})")
    elif mask.right == 0 and any(a != b for a, b in zip(nq, nk, strict=True) if a and b):
        out.append("causal sequences with fewer or more queries than keys (SDPA's is_causal is top-left)")
    if call.return_lse and (call.dropout_p > 0 or call.head_dim != call.v_head_dim or _cpu_lse_op() is None):
        out.append("return_lse with dropout or Dv != D (torch's CPU op that returns lse)")
    return out


def run_sequences(call: AttentionCall) -> tuple[Tensor, Tensor | None]:
    """A packed call on the CPU, one fused SDPA call per sequence on its rows and keys (views, no copy):
    (out (1, Hq, Tq, Dv), lse (1, Hq, Tq) float32 or None). A sequence with queries and no key gives 0
    and lse -inf."""
    mask = call.mask
    assert isinstance(mask, Packed)
    causal, gqa = mask.right == 0, call.hq != call.hkv
    outs, lses = [], []
    a = c = 0
    for nq, nk in zip(*mask.lengths(), strict=True):
        q, k, v = call.q[:, :, a:a + nq], call.k[:, :, c:c + nk], call.v[:, :, c:c + nk]
        a, c = a + nq, c + nk
        if nq == 0:
            continue
        if nk == 0:
            outs.append(q.new_zeros(1, call.hq, nq, call.v_head_dim))
            lses.append(torch.full((1, call.hq, nq), float("-inf"), device=call.device))
            continue
        if call.return_lse:
            o, lse = _cpu_lse_op()(unit_stride(q), unit_stride(k), unit_stride(v), 0.0, causal, scale=call.scale)
            outs.append(o)
            lses.append(lse.float().detach())
        else:
            outs.append(F.scaled_dot_product_attention(q, k, v, dropout_p=call.dropout_p, is_causal=causal,
                                                       scale=call.scale, enable_gqa=gqa))
    out = torch.cat(outs, dim=2) if outs else call.q.new_zeros(1, call.hq, 0, call.v_head_dim)
    return out, (torch.cat(lses, dim=2) if call.return_lse else None)


def run_varlen(call: AttentionCall, kernel: Callable[..., Any]) -> tuple[Tensor, Tensor | None]:
    """A packed call through a kernel with torch's ``varlen_attn`` signature: (out (1, Hq, Tq, Dv), lse
    (1, Hq, Tq) float32 or None). Rows that see no key give 0 and lse -inf, whatever the kernel leaves
    there."""
    mask = call.mask
    assert isinstance(mask, Packed)
    cu_q, cu_k = mask.cu_seqlens_q.to(call.device, torch.int32), mask.cu_seqlens_k.to(call.device, torch.int32)
    max_q, max_k = mask.longest()
    window = (-1 if mask.left is None else mask.left, -1 if mask.right is None else mask.right)
    q, k, v = (t[0].transpose(0, 1) for t in (call.q, call.k, call.v))  # (T, H, D): varlen's own layout again
    kwargs: dict[str, Any] = dict(scale=call.scale, window_size=window, enable_gqa=call.hq != call.hkv)
    if call.return_lse:
        from torch.nn.attention.varlen import AuxRequest
        kwargs["return_aux"] = AuxRequest(lse=True)
    result = kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    out, lse = result if call.return_lse else (result, None)
    lo, hi = mask.bounds(torch.arange(call.lq, device=call.device), call.device)
    dead = (lo >= hi)[:, None, None]  # (Tq, 1, 1)
    out = out.masked_fill(dead, 0.0).transpose(0, 1)[None]
    if lse is not None:
        lse = lse.float().detach().masked_fill(dead[:, :, 0], float("-inf")).transpose(0, 1)[None]
    return out, lse


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
        return not (plain or self.fused_causal(call) or varlen_kernel_obstacles(call) == [])

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        if call.score_mod is not None and call.score_mod.additive and (
                elements := call.batch * call.hq * call.lq * call.lk) > DENSE_BIAS_LIMIT:
            reasons.append(f"{call.score_mod!r} as a dense bias would have {elements:,} elements "
                           f"(> {DENSE_BIAS_LIMIT:,}); chunked applies it tile by tile")
        if rounding := bias_rounds_in_kernel(call):
            reasons.append(f"SDPA adds its mask in q's dtype, which would round it: {rounding}")
        if call.return_lse and varlen_kernel_obstacles(call) != []:
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
                elif has_learned_term(call):
                    reasons.append(f"return_lse with {call.score_mod!r}'s tensors that require grad (the CPU op "
                                   "that returns lse gives no gradient for its mask, which carries them)")
        return reasons

    def nondeterministic(self, call: AttentionCall) -> str | None:
        if (why := learned_term_order(call)) is not None:
            return why
        if call.deterministic or not math_for_determinism(call):
            return None  # deterministic: run() takes the math kernel where it has to
        return (f"torch's fused SDPA backward on {call.device.type} may accumulate gradients in a different "
                "order each run")

    def run(self, call: AttentionCall) -> tuple[Tensor, Tensor | None, None]:
        if call.deterministic and math_for_determinism(call):
            with sdpa_kernel([SDPBackend.MATH]):
                return self._run(call)
        return self._run(call)

    def _run(self, call: AttentionCall) -> tuple[Tensor, Tensor | None, None]:
        if varlen_kernel_obstacles(call) == []:
            if call.device.type == "cpu":
                return (*run_sequences(call), None)
            kernel = _torch_varlen()
            assert kernel is not None
            return (*run_varlen(call, kernel), None)
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

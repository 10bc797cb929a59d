"""The flex backend: torch's compiled FlexAttention.

selfattn masks become BlockMasks (cached per mask, shape and device, so a training loop that
reuses its mask object builds it once) and score modifiers and bias become ``score_mod``.
``flex_attention`` is compiled once per process; on CUDA torch recompiles once more when lengths
change and then treats them as dynamic, so new lengths do not each compile again (on the CPU
each new shape compiles once: see ``_compiled``).

On the CPU FlexAttention runs inference only (no backward, no lse) in float32/16/bf16, and
compiling takes tens of seconds, so ``auto`` picks it only on CUDA; elsewhere ask for it.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

from .._call import AttentionCall
from ..masks import Mask

NAME = "flex"

_BLOCK_MASKS: OrderedDict[tuple, tuple[Mask, object]] = OrderedDict()
_CACHE_SIZE = 32


@functools.cache
def _flex() -> tuple[Callable, Callable] | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return flex_attention, create_block_mask


@functools.cache
def _compiled(device_type: str) -> Callable:
    """flex_attention compiled once per process and device type. On the CPU with static shapes:
    there, the dynamic-shape recompile that follows a change of length generates C++ that does
    not build (torch 2.13), so each new shape compiles once instead."""
    flex_attention = _flex()[0]  # type: ignore[index]
    return torch.compile(flex_attention, dynamic=False if device_type == "cpu" else None)


@functools.cache
def _warn_cpu_compile() -> None:
    warnings.warn("backend='flex' on the CPU compiles FlexAttention first (tens of seconds, once per "
                  "process and shape family); it runs inference only", stacklevel=4)


def supports(call: AttentionCall) -> str | None:
    if _flex() is None:
        return "this torch has no torch.nn.attention.flex_attention"
    if call.need_weights:
        return "does not return attention weights (only reference does)"
    if call.dropout_p > 0:
        return "FlexAttention has no dropout"
    if call.bias is not None and call.bias.requires_grad:
        return "gives no gradient for bias"
    if call.device.type == "cpu":
        if call.dtype == torch.float64:
            return "FlexAttention on the CPU takes float32, float16 and bfloat16, not float64"
        if call.return_lse:
            return "FlexAttention on the CPU does not return lse"
        if call.requires_grad:
            return "FlexAttention has no CPU backward (inference only)"
    return None


def _block_mask(mask: Mask, b: int, hq: int, lq: int, lk: int, device: torch.device):
    mb, mh = mask.batch_heads()
    key = (id(mask), lq, lk, mb, mh, str(device))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None and hit[0] is mask:  # the mask object itself, not a reused id
        _BLOCK_MASKS.move_to_end(key)
        return hit[1]
    create = _flex()[1]  # type: ignore[index]
    bm = create(mask.mask_mod(lq, lk, device), b if mb > 1 else None, hq if mh > 1 else None, lq, lk,
                device=device)
    _BLOCK_MASKS[key] = (mask, bm)
    if len(_BLOCK_MASKS) > _CACHE_SIZE:
        _BLOCK_MASKS.popitem(last=False)
    return bm


def _score_mod(call: AttentionCall) -> Callable | None:
    _, _, _, lq, lk, _, _ = call.shape
    off, mod, bias = lk - lq, call.score_mod, call.bias
    if mod is None and bias is None:
        return None
    if bias is not None:
        keep = [size > 1 for size in bias.shape]  # broadcast dims are read at index 0

    def score_mod(score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        if bias is not None:
            score = score + bias[b * keep[0], h * keep[1], i * keep[2], j * keep[3]].to(score.dtype)
        if mod is not None:
            score = mod(score, b, h, i + off, j)
        return score
    return score_mod


def run(call: AttentionCall) -> tuple[Tensor, Tensor | None, None]:
    b, hq, hkv, lq, lk, _, _ = call.shape
    flex = _compiled(call.device.type)
    if call.device.type == "cpu":
        _warn_cpu_compile()
    block_mask = None if call.mask is None else _block_mask(call.mask, b, hq, lq, lk, call.device)
    kwargs = dict(block_mask=block_mask, score_mod=_score_mod(call), scale=call.scale, enable_gqa=hq != hkv)
    if call.return_lse:
        out, lse = flex(call.q, call.k, call.v, return_lse=True, **kwargs)
        return out, lse.float().detach(), None
    return flex(call.q, call.k, call.v, **kwargs), None, None

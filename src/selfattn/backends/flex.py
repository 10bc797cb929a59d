"""The flex backend: torch's compiled FlexAttention.

selfattn masks become BlockMasks (cached per mask, its tensors' in-place versions, shape and
device, so a training loop that reuses its mask object builds it once, and one that changes the
mask's tensors gets a new one) and score modifiers and bias become ``score_mod``.
``flex_attention`` is compiled once per process; on CUDA torch recompiles once more when lengths
change and then treats them as dynamic, so new lengths do not each compile again (on the CPU
each new shape compiles once: see ``_compiled``).

On the CPU FlexAttention runs inference only (no backward, no lse) in float32/16/bf16, and
compiling takes tens of seconds, so dispatch picks it only on CUDA; elsewhere ask for it.

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
from ..masks import Mask, query_offset
from .base import Backend

__all__ = ["FlexBackend"]

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


class FlexBackend(Backend):
    """Compiled FlexAttention with BlockMasks built from selfattn masks."""

    name = "flex"
    supports_dropout = False
    supports_bias_grad = False

    def unavailable(self) -> str | None:
        return None if _flex() is not None else "this torch has no torch.nn.attention.flex_attention"

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        if reasons and self.unavailable() is not None:
            return reasons
        if call.device.type == "cpu":
            if call.dtype == torch.float64:
                reasons.append("dtype=float64 on the CPU (FlexAttention there takes float32, float16, bfloat16)")
            if call.return_lse:
                reasons.append("return_lse on the CPU (FlexAttention there does not return lse)")
            if call.requires_grad:
                reasons.append("gradients on the CPU (FlexAttention has no CPU backward: inference only)")
        return reasons

    def nondeterministic(self, call: AttentionCall) -> str | None:
        if call.device.type != "cpu" and call.requires_grad:
            return (f"FlexAttention's backward on {call.device.type} may accumulate gradients with atomic adds "
                    "(in a different order each run)")
        return None

    def cached_block_masks(self) -> int:
        """How many BlockMasks are cached (at most 32; keyed on mask, tensor versions, shape, device)."""
        return len(_BLOCK_MASKS)

    def run(self, call: AttentionCall) -> tuple[Tensor, Tensor | None, None]:
        flex = _compiled(call.device.type)
        if call.device.type == "cpu":
            _warn_cpu_compile()
        block_mask = None if call.mask is None else _block_mask(call.mask, call)
        kwargs = dict(block_mask=block_mask, score_mod=_score_mod(call), scale=call.scale,
                      enable_gqa=call.hq != call.hkv)
        if call.return_lse:
            out, lse = flex(call.q, call.k, call.v, return_lse=True, **kwargs)
            return out, lse.float().detach(), None
        return flex(call.q, call.k, call.v, **kwargs), None, None


def _block_mask(mask: Mask, call: AttentionCall):
    mb, mh = mask.batch_heads()
    version = mask.version()
    key = (id(mask), version, call.lq, call.lk, mb, mh, str(call.device))
    hit = _BLOCK_MASKS.get(key) if version is not None else None
    if hit is not None and hit[0] is mask:  # the mask object itself, not a reused id
        _BLOCK_MASKS.move_to_end(key)
        return hit[1]
    create = _flex()[1]  # type: ignore[index]
    bm = create(mask.mask_mod(call.lq, call.lk, call.device), call.batch if mb > 1 else None,
                call.hq if mh > 1 else None, call.lq, call.lk, device=call.device)
    if version is not None:
        _BLOCK_MASKS[key] = (mask, bm)
        if len(_BLOCK_MASKS) > _CACHE_SIZE:
            _BLOCK_MASKS.popitem(last=False)
    return bm


def _score_mod(call: AttentionCall) -> Callable | None:
    off, mod, bias = query_offset(call.lq, call.lk), call.score_mod, call.bias
    if mod is None and bias is None:
        return None
    if bias is not None:
        keep = [size > 1 for size in bias.shape]  # broadcast dims are read at index 0

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if bias is not None:
            score = score + bias[b * keep[0], h * keep[1], q_idx * keep[2], kv_idx * keep[3]].to(score.dtype)
        if mod is not None:
            score = mod(score, b, h, q_idx + off, kv_idx)
        return score
    return score_mod


BACKEND = FlexBackend()

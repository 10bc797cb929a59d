"""What a backend is: what it supports, declared as data, and the reasons it cannot run a call.

Every backend subclasses :class:`Backend`, fills in the class attributes, and extends
:meth:`Backend.not_supported_reasons` through ``super()`` for what data cannot say. Dispatch
(``backends/dispatch.py``) asks these reasons; ``explain()`` prints them. Backends trust their
input (``functional`` validated it) and never pick another backend.

Shape legend: B batch, Hq query heads, Hkv kv heads, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from torch import Tensor

from .._call import FLOAT_DTYPES, AttentionCall

__all__ = ["ALL_DTYPES", "Backend", "bias_rounds_in_kernel", "has_learned_term", "learned_term_order"]

ALL_DTYPES = FLOAT_DTYPES


def bias_rounds_in_kernel(call: AttentionCall) -> str | None:
    """Why a kernel that adds its mask in q's dtype would round this call's additive terms, or
    None. selfattn adds bias and additive score modifiers in the compute dtype (at least
    float32), so on float16/bfloat16 inputs only a kernel that upcasts them is exact: a bias of
    another dtype, or any additive modifier (its bias is computed in float32)."""
    if call.dtype not in (torch.float16, torch.bfloat16):
        return None
    if call.bias is not None and call.bias.dtype != call.dtype:
        return f"bias is {call.bias.dtype} but q is {call.dtype} (cast bias to q's dtype to accept the rounding)"
    if call.score_mod is not None and call.score_mod.additive:
        return (f"{call.score_mod!r} is a float32 bias and q is {call.dtype} (pass it as bias= in q's dtype "
                "to accept the rounding)")
    return None


def has_learned_term(call: AttentionCall) -> bool:
    """Whether the call's score modifier reads tensors that want a gradient (probed on one block; False
    out of grad mode and while compiling, where it is not probed)."""
    from ..scores import learned_tensors  # scores imports masks, which import the call

    if call.score_mod is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    dtype = torch.float64 if call.dtype == torch.float64 else torch.float32
    return bool(learned_tensors(call.score_mod, call.hq, call.device, dtype, lq=call.lq, lk=call.lk))


def learned_term_order(call: AttentionCall) -> str | None:
    """Why autograd's gradient of the call's learned score-term tensors (a T5 table read by bucket, for
    one) may differ between runs or thread counts: torch's indexing backward accumulates in any order, on
    the CPU as on CUDA, unless torch's deterministic mode is on. None when that mode is on, or the call has
    no such tensor (not probed while compiling)."""
    mod = call.score_mod
    if mod is None or torch.are_deterministic_algorithms_enabled() or not has_learned_term(call):
        return None
    return (f"the gradient of {mod!r}'s learned tensors goes through torch's own backward of the modifier, "
            "whose indexing accumulates in any order unless torch.use_deterministic_algorithms(True) is on")


class Backend:
    """One way to compute attention. Subclasses declare what they support and implement :meth:`run`."""

    name: ClassVar[str]
    devices: ClassVar[frozenset[str] | None] = None  # device types it runs on; None = every one
    dtypes: ClassVar[frozenset[torch.dtype]] = ALL_DTYPES
    supports_dropout: ClassVar[bool] = True
    supports_lse: ClassVar[bool] = True
    supports_weights: ClassVar[bool] = False
    supports_bias_grad: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = False
    score_mods: ClassVar[Literal["any", "additive", "none"]] = "any"

    def nondeterministic(self, call: AttentionCall) -> str | None:
        """Why this backend, running ``call`` as it would (``call.deterministic`` included), may give
        other bits on another run or thread count; None when it gives the same ones."""
        return None

    def unavailable(self) -> str | None:
        """Why this backend cannot run at all in this process (a missing torch feature), or None."""
        return None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        """Every reason this backend cannot run ``call``; empty when it can."""
        if (why := self.unavailable()) is not None:
            return [why]
        reasons = []
        device = call.device.type
        if self.devices is not None and device not in self.devices:
            reasons.append(f"device={device} (supported: {', '.join(sorted(self.devices))})")
        if call.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))
            reasons.append(f"dtype={str(call.dtype).removeprefix('torch.')} (supported: {names})")
        if call.dropout_p > 0 and not self.supports_dropout:
            reasons.append(f"dropout_p={call.dropout_p} (this backend has no dropout)")
        if call.return_lse and not self.supports_lse:
            reasons.append("return_lse=True (this backend does not return lse)")
        if call.need_weights and not self.supports_weights:
            reasons.append("need_weights (only the reference backend returns attention weights)")
        if (not self.supports_bias_grad and call.bias is not None and call.bias.requires_grad
                and torch.is_grad_enabled()):
            reasons.append("bias requires grad (this backend gives no gradient for bias)")
        if call.sinks is not None and not self.supports_sinks:
            reasons.append("sinks (this backend has no sink term in its softmax)")
        if call.deterministic and (why := self.nondeterministic(call)) is not None:
            reasons.append(f"deterministic=True, but {why}")
        mod = call.score_mod
        if mod is not None and self.score_mods == "none":
            reasons.append(f"score_mod={mod!r} (this backend takes no score modifiers)")
        elif mod is not None and self.score_mods == "additive" and not mod.additive:
            reasons.append(f"score_mod={mod!r} is not additive (this backend takes a modifier only as a bias)")
        return reasons

    def run(self, call: AttentionCall) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq) float32 or None, weights or None)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name!r}>"

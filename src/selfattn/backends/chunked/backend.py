"""The chunked backend as dispatch sees it: what it supports, and :meth:`ChunkedBackend.run`.

Eager calls build a :class:`~.plan.Plan` and run the autograd function of :mod:`.loops`; under
``torch.compile`` the call becomes one custom op (:mod:`.compiled`), whose plan is made inside from
the real mask tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._call import AttentionCall, compute_dtype
from ...scores import learned_tensors
from ..base import Backend, bias_rounds_in_kernel, learned_term_order
from . import compiled, loops
from .dropout import draw_seed
from .kernels import Problem, fused_available
from .options import current_options
from .plan import Layout, Plan, layout

__all__ = ["BACKEND", "ChunkedBackend", "fused_obstacles", "learned"]


def learned(call: AttentionCall) -> tuple[Tensor, ...]:
    """The tensors of the call's score modifier that want a gradient (see
    :func:`selfattn.scores.learned_tensors`); empty without a modifier, out of grad mode, or while compiling."""
    if call.score_mod is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return ()
    opts = current_options()
    return learned_tensors(call.score_mod, call.hq, call.device, compute_dtype(call.dtype), lq=call.lq, lk=call.lk,
                           rows=opts.block_q or opts.math_block_q, keys=opts.block_k)


def _bias_grad(call: AttentionCall) -> bool:
    return call.bias is not None and call.bias.requires_grad and torch.is_grad_enabled()


def fused_obstacles(call: AttentionCall) -> list[str]:
    """Why the fused kernel cannot compute this call exactly (empty: it can)."""
    out = []
    if _bias_grad(call):
        out.append("a bias that requires grad (the fused op gives no gradient for it)")
    # only an additive modifier can run fused: probe for learned tensors there alone (the probe runs the
    # modifier on a block, and dispatch asks this more than once per call)
    if call.score_mod is not None and call.score_mod.additive and learned(call):
        out.append(f"{call.score_mod!r} has tensors that require grad (the fused op gives no gradient for them)")
    if not fused_available(call.device, call.head_dim, call.v_head_dim):
        out.append(f"no fused kernel with lse on {call.device.type} for D={call.head_dim}, Dv={call.v_head_dim}")
    if call.dropout_p > 0:
        out.append("dropout")
    if call.score_mod is not None and not call.score_mod.additive:
        out.append(f"{call.score_mod!r} is not additive")
    if rounding := bias_rounds_in_kernel(call):
        out.append(f"{rounding} (the fused op would round it to q's dtype)")
    return out


class ChunkedBackend(Backend):
    """Tiles with online softmax; skips empty tiles; O(L * block) memory for every mask."""

    name = "chunked"
    supports_bias_grad = True  # in the math kernel, block by block
    supports_sinks = True

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        if torch.compiler.is_compiling() and call.requires_grad and (
                _bias_grad(call) or (call.score_mod is not None and compiled.may_learn(call.score_mod))):
            reasons.append("under torch.compile, a bias or a score modifier's tensors that require grad (chunked "
                           "gives their gradients in eager mode only)")
        if current_options().kernel == "fused" and (obstacles := fused_obstacles(call)):
            reasons.append(f"kernel='fused' was forced, but it cannot run: {', '.join(obstacles)}")
        return reasons

    def nondeterministic(self, call: AttentionCall) -> str | None:
        if call.deterministic:
            return None  # the backward runs the modifier's own backward in torch's deterministic mode
        return learned_term_order(call)

    def block_k(self) -> int:
        """The key tile size in force: the unit at which this backend skips work."""
        return current_options().block_k

    def _fused(self, call: AttentionCall) -> bool:
        opts = current_options()
        return opts.kernel == "fused" or (opts.kernel == "auto" and not fused_obstacles(call))

    def layout(self, call: AttentionCall) -> Layout:
        """The layout this backend would run ``call`` with (schedule, share of empty tiles), made once
        per mask object, lengths and tile options (:func:`.plan.layout`): what dispatch's cost model
        reads, and what :meth:`run` then finds made."""
        return layout(call.mask, call.lq, call.lk, fused=self._fused(call), device=call.device,
                      opts=current_options())

    def run(self, call: AttentionCall) -> tuple[Tensor, Tensor, None]:
        opts = current_options()
        fused = self._fused(call)
        if torch.compiler.is_compiling():  # one custom op, its schedule made inside from the real mask
            return compiled.chunked_attention(call, opts, fused)
        problem = Problem.of(call.q, call.k, scale=call.scale, mask=call.mask, score_mod=call.score_mod,
                             dropout_p=call.dropout_p, seed=draw_seed() if call.dropout_p > 0 else 0,
                             learned=learned(call))
        plan = Plan.build(problem, call.device, fused=fused, opts=opts,
                          mask_version=None if call.mask is None else call.mask.version(),
                          deterministic=call.deterministic)
        out, lse = loops.attention(plan, call.q, call.k, call.v, call.bias, call.sinks)
        return out, lse.float(), None


BACKEND = ChunkedBackend()

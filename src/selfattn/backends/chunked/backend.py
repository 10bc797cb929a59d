"""The chunked backend as dispatch sees it: what it supports, and :meth:`ChunkedBackend.run`.

Eager calls build a :class:`~.plan.Plan` and run the autograd function of :mod:`.loops`; under
``torch.compile`` the call becomes one custom op (:mod:`.compiled`), whose plan is made inside from
the real mask tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._call import AttentionCall
from ..base import Backend, bias_rounds_in_kernel
from . import compiled, loops
from .dropout import draw_seed
from .kernels import Problem, fused_available
from .options import current_options
from .plan import Layout, Plan, layout

__all__ = ["BACKEND", "ChunkedBackend", "fused_obstacles"]


def fused_obstacles(call: AttentionCall) -> list[str]:
    """Why the fused kernel cannot compute this call exactly (empty: it can)."""
    out = []
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
    supports_bias_grad = False
    supports_sinks = True

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        if current_options().kernel == "fused" and (obstacles := fused_obstacles(call)):
            reasons.append(f"kernel='fused' was forced, but it cannot run: {', '.join(obstacles)}")
        return reasons

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
                             dropout_p=call.dropout_p, seed=draw_seed() if call.dropout_p > 0 else 0)
        plan = Plan.build(problem, call.device, fused=fused, opts=opts,
                          mask_version=None if call.mask is None else call.mask.version())
        out, lse = loops.attention(plan, call.q, call.k, call.v, call.bias, call.sinks)
        return out, lse.float(), None


BACKEND = ChunkedBackend()

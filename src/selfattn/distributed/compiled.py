"""Context-parallel attention as torch.library custom ops, so that ``torch.compile`` (``fullgraph=True``
included) sees one op per call and none of the communication.

Under ``torch.compile``, :func:`selfattn.distributed.attention` calls :func:`compiled_attention`, which
calls ``selfattn::cp_fwd`` (its backward is ``selfattn::cp_bwd``). Inside the op the eager path runs
as it is: the process group and its timeouts, the ranks' agreement, the ring's or the all-to-all's
transfers. The ops take only tensors and primitives, as the chunked backend's ops do (both take the
mask and the score modifier apart with :mod:`selfattn._ops`):

- q, k, v, the sinks, and ``tensors``: every tensor the mask and the score modifier read;
- ``key``: an entry of :data:`_REGISTRY`, the call's non-tensor structure (the group, the layout, the
  strategy, the mask's and the modifier's structures, causal, the local backend, the timeout),
  registered while dynamo traces the call;
- ``scale``, ``dropout_p`` and the dropout seed as a tensor drawn in the graph (every rank takes rank
  0's, as in eager).

The forward op returns the agreed seed beside out and lse, so that the backward neither agrees again
nor draws another pattern. The ring's backward is the eager one (``ring._backward``: blocks recomputed
from the saved output and lse, dK/dV sent back round the ring); the all-to-all's backward recomputes
its forward under autograd and takes the gradients from it (one more forward's transfers).

A ``layout`` computed from a batch's tensors (:func:`~selfattn.distributed.balanced` from its
``cu_seqlens``) is Python work on data: compute it outside the compiled function and pass the
:class:`~selfattn.distributed.Sharding`, a constant of the graph (a new Sharding is a new graph).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import replace

import torch
from torch import Tensor

from .._call import compute_dtype, specialized
from .._ops import autograd_inside, describe, flatten, rebuild
from ..backends._common import refuse_create_graph
from ..backends.chunked import kernels
from .agree import agree
from .all_to_all import all_to_all_attention
from .group import Group, group_of, process_group
from .ring import _backward as ring_backward
from .ring import _forward as ring_forward
from .ring import _ring
from .spec import Spec, check_local_length, validate

__all__ = ["compiled_attention", "cp_bwd", "cp_fwd", "register"]

_REGISTRY: dict[str, tuple] = {}
"""key -> (group, layout, strategy, mask structure, score modifier structure, causal, backend, timeout,
return_lse, memory)."""


@torch.compiler.assume_constant_result
def register(group: object, layout: object, strategy: str, mask: tuple, score_mod: tuple, causal: object,
             backend: str, timeout: object, return_lse: bool, memory: str) -> str:
    """Register a call's structure and return its key; under torch.compile it runs while dynamo traces the
    call, so the key is a constant of the graph and exists before the op runs."""
    pg = process_group(group)  # None (the default group), a ProcessGroup, or a one-dimensional DeviceMesh's
    text = (f"group={id(pg)}; layout={layout!r}; strategy={strategy}; mask={describe(mask)}; "
            f"score_mod={describe(score_mod)}; causal={causal!r}; backend={backend}; timeout={timeout!r}; "
            f"return_lse={return_lse}; memory={memory}")
    key = hashlib.sha256(text.encode()).hexdigest()[:32]  # a Sharding's chunk lists make the text long
    _REGISTRY[key] = (pg, layout, strategy, mask, score_mod, causal, backend, timeout, return_lse, memory)
    return key


def _spec(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, tensors: list[Tensor], key: str,
          scale: float | None, dropout_p: float) -> tuple[Group, Spec]:
    try:
        group, layout, strategy, mask, mod, causal, backend, timeout, return_lse, memory = _REGISTRY[key]
    except KeyError:
        raise RuntimeError(f"selfattn context-parallel op called with the unregistered key {key!r}: keys are "
                           "registered when selfattn.distributed.attention is traced; call the op only through "
                           "it") from None
    g = group_of(group, timeout)
    spec = validate(q, k, v, g, layout, strategy, rebuild(mask, tensors), causal, scale, dropout_p,
                    rebuild(mod, tensors), return_lse, backend, sinks, memory)
    return g, spec


@torch.library.custom_op("selfattn::cp_fwd", mutates_args=())
def cp_fwd(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, tensors: list[Tensor], key: str,
           scale: float | None, dropout_p: float, seed: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's out (B, H, n, Dv) in q's dtype, lse (B, H, n) in the compute dtype (empty for all_to_all
    without ``return_lse``) and the dropout seed every rank used (rank 0's), as a (1,) int64 tensor."""
    g, spec = _spec(q, k, v, sinks, tensors, key, scale, dropout_p)
    if seed is not None:
        spec = replace(spec, seed=int(seed.item()))
    spec = agree(g, spec, q, k, v)
    check_local_length(spec.layout, q.shape[2], g.world)
    if spec.strategy == "all_to_all":
        out, lse = all_to_all_attention(g, spec, q, k, v)
        lse = q.new_empty(0, dtype=compute_dtype(q.dtype)) if lse is None else lse.to(compute_dtype(q.dtype))
    else:
        out, lse = ring_forward(_ring(g, spec, q, v), q, k, v, spec.sinks)
    return out.contiguous(), lse.contiguous(), torch.tensor([spec.seed], dtype=torch.int64)


@cp_fwd.register_fake
def _cp_fwd_fake(q, k, v, sinks, tensors, key, scale, dropout_p, seed):
    b, h, n, _ = q.shape
    lse_shape = (0,) if _REGISTRY[key][2] == "all_to_all" and not _REGISTRY[key][8] else (b, h, n)
    return (q.new_empty(b, h, n, v.shape[3]), q.new_empty(lse_shape, dtype=compute_dtype(q.dtype)),
            torch.empty(1, dtype=torch.int64))


@torch.library.custom_op("selfattn::cp_bwd", mutates_args=())
def cp_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, out: Tensor, lse: Tensor,
           tensors: list[Tensor], key: str, scale: float | None, dropout_p: float,
           seed: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (shapes and dtypes of q, k, v) and this rank's share of dsinks ((H,), or empty without
    sinks), with the forward's seed."""
    g, spec = _spec(q, k, v, sinks, tensors, key, scale, dropout_p)
    spec = replace(spec, seed=int(seed.item()))
    if spec.strategy == "all_to_all":  # recomputed under autograd: its swaps' backward is autograd's
        with autograd_inside(), torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            if spec.sinks is not None:
                learned = spec.sinks.detach().requires_grad_()
                spec = replace(spec, sinks=learned)
                leaves.append(learned)
            again, _ = all_to_all_attention(g, spec, *leaves[:3])
            grads = torch.autograd.grad(again, leaves, dout)
        dsinks = grads[3] if len(grads) > 3 else q.new_empty(0)
        return grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous(), dsinks.contiguous()
    mod = spec.score_mod  # a non-additive modifier's derivative comes from autograd, which an op runs without
    with autograd_inside() if mod is not None and not mod.additive else contextlib.nullcontext():
        dq, dk, dv = ring_backward(_ring(g, spec, q, v), q, k, v, out, lse, dout.contiguous())
    dsinks = q.new_empty(0) if sinks is None else kernels.sinks_grad(dout, out, lse, sinks)
    # dK and dV come back as views of one received buffer: an op's outputs may not alias each other
    return dq.clone(), dk.clone(), dv.clone(), dsinks.clone()


@cp_bwd.register_fake
def _cp_bwd_fake(dout, q, k, v, sinks, out, lse, tensors, key, scale, dropout_p, seed):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, sinks, tensors, key, scale, dropout_p, _ = inputs
    out, lse, seed = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, seed, *tensors)
    ctx.key, ctx.scale, ctx.dropout_p = key, scale, dropout_p
    ctx.mark_non_differentiable(lse, seed)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None, _dseed: Tensor | None) -> tuple:
    refuse_create_graph("the context-parallel attention")
    q, k, v, sinks, out, lse, seed, *tensors = ctx.saved_tensors
    dq, dk, dv, dsinks = cp_bwd(dout, q, k, v, sinks, out, lse, tensors, ctx.key, ctx.scale, ctx.dropout_p, seed)
    return dq, dk, dv, None if sinks is None else dsinks, [None] * len(tensors), None, None, None, None


cp_fwd.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(q: Tensor, k: Tensor, v: Tensor, *, group: object, layout: object, mask: object,
                       causal: object, scale: float | None, dropout_p: float, score_mod: object, return_lse: bool,
                       strategy: str, backend: str, timeout: float | None,
                       sinks: Tensor | None, memory: str = "overlap") -> Tensor | tuple[Tensor, Tensor]:
    """:func:`selfattn.distributed.attention` as one ``selfattn::cp_fwd`` call (see the module docstring)."""
    tensors: list[Tensor] = []
    key = register(group, layout, strategy, flatten(mask, tensors), flatten(score_mod, tensors), causal,
                   backend, timeout, bool(return_lse), memory)
    seed = torch.randint(0, 1 << 62, (1,)) if dropout_p > 0 else None
    out, lse, _ = cp_fwd(q, k, v, sinks, tensors, key, None if scale is None else specialized(scale),
                         specialized(dropout_p), seed)
    return (out, lse.float()) if return_lse else out


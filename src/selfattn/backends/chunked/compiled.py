"""The chunked backend as torch.library custom ops, so that ``torch.compile`` sees one op per call.

Under ``torch.compile``, :meth:`~selfattn.backends.chunked.ChunkedBackend.run` calls
:func:`chunked_attention`, which calls ``selfattn::chunked_fwd`` (its backward is
``selfattn::chunked_bwd``) instead of the Python loops over tiles. The ops take only tensors and
primitives:

- the call's tensors (q, k, v, bias, sinks) and ``tensors``: every tensor that the mask and the
  score modifier read (padding lengths, document ids, a mask tensor, ALiBi slopes);
- ``key``: an entry of :data:`_REGISTRY`, the call's non-tensor structure (the mask and the score
  modifier with their tensors taken out, the chunked options, the kernel). The key is derived from
  that structure, so masks of one structure share it (two ``padding(lengths)`` masks with different
  tensors) and a compiled graph never depends on one mask object; it is registered while dynamo
  traces the call (:func:`register` runs then, for real);
- ``scale``, ``dropout_p`` and the dropout seed as a tensor, drawn inside the compiled graph.

Masks and modifiers are taken apart through what they declare they are made of
(``Mask.fields()``, ``ScoreMod.fields()``) and built again with ``from_fields``
(:mod:`selfattn._ops`), so a user's subclass works here as long as it declares its fields (by
default: its constructor's arguments, stored under their names).

At run time the op rebuilds the mask and the modifier from the structure and the tensors it is
given, and computes the schedule (the tile map) from the real tensors, so no data-dependent Python
reaches dynamo; the forward and the backward are the eager path's own (:mod:`.loops`). The
backward op recomputes the same schedule from the saved tensors; torch's saved-tensor check
refuses mask tensors changed in place between the forward and the backward.

The same structure gives dispatch its static cost model under compile
(:func:`static_empty_fraction`).

Shape legend: B batch, Hq query heads, Lq/Lk lengths, Dv value head dim.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from ..._call import AttentionCall, compute_dtype, specialized
from ..._ops import Struct, autograd_inside, describe, flatten, rebuild
from ...masks import EMPTY, Mask
from . import loops
from .kernels import Problem
from .options import ChunkedOptions
from .plan import Plan

__all__ = ["chunked_attention", "chunked_bwd", "chunked_fwd", "register", "static_empty_fraction"]

_REGISTRY: dict[str, Struct] = {}
"""key -> (mask structure, score modifier structure, chunked options, fused kernel)."""

def _closes_over_grad(fn: object) -> bool:
    """Whether a function (a custom modifier's) reaches, through its closure, defaults, bound object or
    the globals it names, a tensor that requires grad (directly, or as a parameter of a module)."""
    seen: set[int] = set()
    todo = [fn]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, Tensor):
            if x.requires_grad:
                return True
        elif isinstance(x, torch.nn.Module):
            todo.extend(x.parameters())
        elif isinstance(x, (tuple, list)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif callable(x):
            todo.extend(cell.cell_contents for cell in (getattr(x, "__closure__", None) or ()))
            todo.extend(getattr(x, "__defaults__", None) or ())
            if (owner := getattr(x, "__self__", None)) is not None:
                todo.append(owner)
            code, names = getattr(x, "__code__", None), getattr(x, "__globals__", {})
            for name in getattr(code, "co_names", ()):  # the globals it reads: tensors and modules only
                if isinstance(value := names.get(name), (Tensor, torch.nn.Module)):
                    todo.append(value)
    return False


def _functions(struct: Struct) -> list[object]:
    kind = struct[0]
    if kind == "function":
        return [struct[1]]
    if kind in ("tuple", "list"):
        return [f for x in struct[1] for f in _functions(x)]
    if kind == "object":
        return [f for _, value in struct[2] for f in _functions(value)]
    return []


def may_learn(obj: object) -> bool:
    """While compiling: whether a score modifier's own tensors (its fields) require grad. What its
    functions close over cannot be read while tracing; the op's backward checks it (:func:`_backward`)."""
    tensors: list[Tensor] = []
    flatten(obj, tensors)
    return any(t.requires_grad for t in tensors)


@torch.compiler.assume_constant_result
def register(mask: Struct, score_mod: Struct, options: tuple, fused: bool) -> str:
    """Register a call's structure (of its mask, its score modifier, the chunked options as (name,
    value) pairs, the kernel) and return its key. Under torch.compile it runs while dynamo traces the
    call (its result becomes a constant of the graph), so the key exists before the op runs."""
    key = (f"mask={describe(mask)}; score_mod={describe(score_mod)}; "
           f"options={', '.join(f'{n}={v!r}' for n, v in options)}; fused={fused}")
    _REGISTRY[key] = (mask, score_mod, options, fused)  # a key names one structure (functions by identity)
    return key


def _plan(q: Tensor, k: Tensor, tensors: Sequence[Tensor], key: str, scale: float, dropout_p: float,
          seed: Tensor | None) -> Plan:
    try:
        mask_struct, mod_struct, opts_struct, fused = _REGISTRY[key]
    except KeyError:
        raise RuntimeError(f"selfattn chunked op called with the unregistered key {key!r}: keys are registered "
                           "when selfattn.attention is traced; call the op only through selfattn.attention") from None
    problem = Problem.of(q, k, scale=scale, mask=rebuild(mask_struct, tensors),  # type: ignore[arg-type]
                         score_mod=rebuild(mod_struct, tensors), dropout_p=dropout_p,  # type: ignore[arg-type]
                         seed=0 if seed is None else int(seed.item()))
    opts = ChunkedOptions(**dict(opts_struct))  # the options traced with, whatever is in force now
    return Plan.build(problem, q.device, fused=fused, opts=opts)


@torch.library.custom_op("selfattn::chunked_fwd", mutates_args=())
def chunked_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None, tensors: list[Tensor],
                key: str, scale: float, dropout_p: float, seed: Tensor | None) -> tuple[Tensor, Tensor]:
    """Chunked attention: out (B, Hq, Lq, Dv) in q's dtype and lse (B, Hq, Lq) in the compute dtype,
    with the sinks' term when given. ``key`` and ``tensors`` describe the mask and score modifier."""
    plan = _plan(q, k, tensors, key, scale, dropout_p, seed)
    out, lse = loops.forward(plan, *loops.kernel_inputs(plan, q, k, v), bias, sinks)
    return out.contiguous(), lse.contiguous()


@chunked_fwd.register_fake
def _chunked_fwd_fake(q, k, v, bias, sinks, tensors, key, scale, dropout_p, seed):
    b, hq, lq, _ = q.shape
    return q.new_empty(b, hq, lq, v.shape[3]), q.new_empty(b, hq, lq, dtype=compute_dtype(q.dtype))


@torch.library.custom_op("selfattn::chunked_bwd", mutates_args=())
def chunked_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None,
                out: Tensor, lse: Tensor, tensors: list[Tensor], key: str, scale: float, dropout_p: float,
                seed: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (shapes and dtypes of q, k, v) and dsinks ((Hq,), or empty without sinks), from the
    forward's (out, lse) with the sinks' term: its probabilities exp(s - lse) are then the sinks'."""
    plan = _plan(q, k, tensors, key, scale, dropout_p, seed)
    mod = plan.problem.score_mod
    with autograd_inside() if mod is not None and not mod.additive else contextlib.nullcontext():
        grads = loops.backward(plan, *loops.kernel_inputs(plan, q, k, v), bias, sinks, out, lse, dout.contiguous())
    dq, dk, dv = grads.dq, grads.dk, grads.dv
    dsinks = q.new_empty(0) if grads.dsinks is None else grads.dsinks
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks.contiguous()


@chunked_bwd.register_fake
def _chunked_bwd_fake(dout, q, k, v, bias, sinks, out, lse, tensors, key, scale, dropout_p, seed):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, sinks, tensors, key, scale, dropout_p, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, sinks, out, lse, seed, *tensors)  # torch refuses in-place changes
    ctx.key, ctx.scale, ctx.dropout_p = key, scale, dropout_p
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None) -> tuple:
    q, k, v, bias, sinks, out, lse, seed, *tensors = ctx.saved_tensors
    learning = [f for f in _functions(_REGISTRY[ctx.key][1]) if _closes_over_grad(f)]
    if learning:  # refused rather than trained on no gradient
        name = getattr(learning[0], "__qualname__", repr(learning[0]))
        raise RuntimeError(f"the score modifier's function {name} reads a tensor that requires grad, and the chunked "
                           "backend's compiled op gives no gradient for it; run the call outside torch.compile "
                           "(chunked gives it there), or use backend='reference' inside")
    dq, dk, dv, dsinks = chunked_bwd(dout, q, k, v, bias, sinks, out, lse, tensors, ctx.key, ctx.scale,
                                     ctx.dropout_p, seed)
    return dq, dk, dv, None, None if sinks is None else dsinks, [None] * len(tensors), None, None, None, None


chunked_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunked_attention(call: AttentionCall, opts: ChunkedOptions, fused: bool) -> tuple[Tensor, Tensor, None]:
    """``ChunkedBackend.run`` as one ``selfattn::chunked_fwd`` call: (out, lse float32, None)."""
    tensors: list[Tensor] = []
    key = register(flatten(call.mask, tensors), flatten(call.score_mod, tensors), opts.as_pairs(), fused)
    # the draw of dropout.draw_seed, kept a tensor (.item() would break the graph); the op reads it
    seed = torch.randint(0, 1 << 62, (1,)) if call.dropout_p > 0 else None
    out, lse = chunked_fwd(call.q, call.k, call.v, call.bias, call.sinks, tensors, key, specialized(call.scale),
                           specialized(call.dropout_p), seed)
    return out, lse.float(), None


@torch.compiler.assume_constant_result
def _empty_fraction(struct: Struct, lq: int, lk: int, block: int) -> float:
    mask = rebuild(struct, None)
    if mask is None:
        return 0.0
    assert isinstance(mask, Mask)
    return float((mask.tiles(lq, lk, block, block) == EMPTY).float().mean())


def static_empty_fraction(mask: Mask | None, lq: int, lk: int, block: int) -> float:
    """The share of (block x block) tiles that ``mask`` leaves empty whatever its tensors hold: the
    parts that read a tensor or call a function (padding, document, from_tensor, from_mask_mod) count
    as partly visible, the others (causal, sliding_window) exactly. It depends only on the mask's
    structure and the lengths (specialized when dynamic), so a compiled graph can be guarded on it."""
    return _empty_fraction(flatten(mask, []), operator.index(lq), operator.index(lk), block)

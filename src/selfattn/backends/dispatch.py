"""Backend dispatch: the one place that decides which backend runs a call.

The order of preference and the cost model live here; what each backend can do lives in the
backend (its declared support and ``not_supported_reasons``). ``attention()`` calls
:func:`choose`; ``explain()`` formats the :class:`Choice` it returns with ``explain=True``.

The cost model, measured on a 2-core CPU (fwd+bwd, H=8, D=64): when SDPA would need a dense
(Lq, Lk) mask, its single fused call wins at 256^2 mask elements (chunked 1.2-1.6x slower);
from 512^2 up, chunked wins wherever the mask leaves tiles empty (padding + causal 0.93x,
sliding window 0.84x, 8 packed documents 0.59x; at 1024^2: 0.67x, 0.39x, 0.24x), while a
dense random mask with no empty tile stays 1.2x slower in chunked.

Shape legend: B batch, Hq query heads, Lq/Lk lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._call import AttentionCall
from . import REGISTRY
from .chunked import ChunkedBackend
from .chunked import compiled as _compiled
from .sdpa import SdpaBackend

__all__ = ["DENSE_MASK_LIMIT", "DENSE_MASK_MEMORY_LIMIT", "SKIP_FRACTION", "Choice", "choose", "choose_plain",
           "preferences"]

DENSE_MASK_LIMIT = 1 << 18  # up to this many dense-mask elements (B' * H' * Lq * Lk), SDPA with the mask
SKIP_FRACTION = 0.25  # beyond it, chunked when at least this share of its key tiles is empty
DENSE_MASK_MEMORY_LIMIT = 1 << 28  # ... or past this size anyway: the mask alone is 1 GiB as float32


@dataclass(frozen=True)
class Choice:
    """The backend that runs a call, why, and (with ``explain``) why not each of the others."""

    backend: str
    why: str
    not_chosen: dict[str, list[str]] = field(default_factory=dict)


def _dense_mask_elements(call: AttentionCall) -> int:
    """Elements of the (B', H', Lq, Lk) mask or bias SDPA would be given."""
    bm, hm = call.mask.batch_heads() if call.mask is not None else (1, 1)
    if call.score_mod is not None:
        bm, hm = call.batch, call.hq
    if call.bias is not None:
        bm, hm = max(bm, call.bias.shape[0]), max(hm, call.bias.shape[1])
    return bm * hm * call.lq * call.lk


def _empty_tile_fraction(call: AttentionCall, chunked: ChunkedBackend) -> float:
    """Share of the tiles chunked would skip: read from the layout it would run the call with (made
    once, and then found made by chunked itself)."""
    if call.mask is None:
        return 0.0
    if torch.compiler.is_compiling():  # no data-dependent decision in a graph: the mask's structure only
        return _compiled.static_empty_fraction(call.mask, call.lq, call.lk, chunked.block_k())
    return chunked.layout(call).empty_fraction


def preferences(call: AttentionCall) -> list[tuple[str, str]]:
    """Backends in the order ``auto`` tries them for this call, each with why it comes there."""
    sdpa, chunked = REGISTRY["sdpa"], REGISTRY["chunked"]
    assert isinstance(sdpa, SdpaBackend) and isinstance(chunked, ChunkedBackend)
    on_cuda = call.device.type == "cuda"
    order: list[tuple[str, str]] = []
    if call.need_weights:
        order.append(("reference", "only reference returns attention weights"))
    if not sdpa.needs_dense_mask(call):
        order.append(("sdpa", "SDPA runs this call in a fused kernel without a dense mask"))
    else:
        if on_cuda:
            order.append(("flex", "on CUDA, compiled FlexAttention skips empty blocks and applies score "
                                  "modifiers in its fused kernel"))
        elements = _dense_mask_elements(call)
        shown = f"{elements:,}" if not torch.compiler.is_compiling() else "a traced number of"  # may be symbolic
        if elements > DENSE_MASK_MEMORY_LIMIT:
            order.append(("chunked", f"a dense mask would have {shown} elements "
                                     f"(> {DENSE_MASK_MEMORY_LIMIT:,}); chunked needs O(L * block) memory"))
        elif (elements > DENSE_MASK_LIMIT
              and (skipped := _empty_tile_fraction(call, chunked)) >= SKIP_FRACTION):
            order.append(("chunked", f"{skipped:.0%} of the tiles are empty and a dense mask would have "
                                     f"{shown} elements (> {DENSE_MASK_LIMIT:,}); chunked skips them "
                                     "in O(L * block) memory"))
        order.append(("sdpa", f"the dense mask ({shown} elements) is small or leaves few tiles empty: "
                              "one fused call"))
    if on_cuda:
        order.append(("flex", "SDPA cannot run this call"))
    order += [("chunked", "SDPA cannot run this call"),
              ("reference", "no faster backend can run this call")]
    return order


def _cpu_flex_note(call: AttentionCall) -> str:
    return (f"auto does not pick flex on {call.device.type} (it compiles for tens of seconds and runs "
            "inference only there): ask for it with backend='flex'")


def choose(call: AttentionCall, forced: str | None = None, *, explain: bool = False) -> Choice:
    """The backend for ``call``: ``forced`` if given (ValueError when it cannot run the call),
    else the first of :func:`preferences` that can. Without ``explain``, only the backends tried
    are asked; with it, every other backend's reasons are collected too."""
    asked: dict[str, list[str]] = {}

    def reasons(name: str) -> list[str]:
        if name not in asked:
            asked[name] = REGISTRY[name].not_supported_reasons(call)
        return asked[name]

    if forced is not None:
        if why_not := reasons(forced):
            raise ValueError(f"backend={forced!r} cannot run this call: {'; '.join(why_not)}; "
                             "use backend='auto' or see selfattn.explain(...)")
        name, why = forced, f"backend {forced!r} was requested"
    else:
        tried = ((n, w) for n, w in preferences(call) if n in REGISTRY)
        picked = next(((n, w) for n, w in tried if not reasons(n)), None)
        if picked is None:  # reference runs every call; reaching here is a bug in a backend's reasons
            raise RuntimeError("no backend can run this call: "
                               + "; ".join(f"{n}: {', '.join(r)}" for n, r in asked.items()))
        name, why = picked
    if not explain:
        return Choice(name, why)
    not_chosen = {}
    for other in REGISTRY:
        if other == name:
            continue
        if reasons(other):
            not_chosen[other] = reasons(other)
        elif other == "flex" and call.device.type != "cuda" and forced is None:
            not_chosen[other] = [_cpu_flex_note(call)]
        else:
            not_chosen[other] = [f"supported, but {name} is preferred: {why}"]
    return Choice(name, why, not_chosen)


# choose_plain's answers: one per set of facts a plain call's reasons can read
_PLAIN: dict[tuple, str] = {}


def _plain_facts(call: AttentionCall) -> tuple:
    """Everything about a plain call that a backend's declared support or reasons can read: the
    rest of such a call (its sizes, strides, values) is for the backend's kernel, not its choice."""
    q, k, v = call.q, call.k, call.v
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (q.device.type, q.dtype, call.hq != call.hkv, call.head_dim != call.v_head_dim, call.dropout_p > 0, grad,
            call.deterministic, grad and torch.are_deterministic_algorithms_enabled())


def choose_plain(call: AttentionCall) -> str:
    """``choose(call).backend`` for a call of q, k and v with nothing else (no mask, bias, score
    modifier, sinks, lse or weights; scale and dropout allowed), the common call of an unmasked
    layer and of a decode step on a full cache. The answer is remembered per set of facts
    (:func:`_plain_facts`), so a step pays one dictionary lookup instead of asking every backend."""
    facts = _plain_facts(call)
    name = _PLAIN.get(facts)
    if name is None:
        name = _PLAIN[facts] = choose(call).backend
    return name

"""Checking a whole model: every attention submodule found by behaviour, probed with the call the model makes.

:func:`check_model` runs the model once on the user's example inputs and records, for every
submodule, how the model called it (its positional and keyword arguments: position embeddings,
masks, cache positions, flags). A submodule is an attention layer when, during its own forward,
softmax weights are multiplied into another tensor (``softmax(...) @ v``, an einsum, ``bmm``) or
an attention kernel runs (``scaled_dot_product_attention``, ``flex_attention``), and it maps the
hidden states (B, L, E), or an image (B, H, W, E), to an output of that shape; the innermost such
module is the layer, so a decoder block is not mistaken for its attention, and a core that only
takes q, k, v is checked through its parent. Each layer is then checked by :func:`~selfattn.check.check` with its real
weights and the recorded call replayed: the doctor's input in place of the hidden states, the
doctor's mask (in the convention it finds) in place of the model's, every other tensor as the
model gave it (cut to the doctor's batch and length, in the probe's dtype), and caches left out.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ._seams import untraced
from .doctor import check
from .findings import (
    BATCH_MIXING,
    CAUSAL_LEAK,
    HEAD_MERGE,
    HEAD_SPLIT,
    MASK_BROADCAST,
    MASK_IGNORED,
    MASK_INVERTED,
    MISSING_SCALE,
    NO_GRAD,
    NON_FINITE,
    SHAPE_DEPENDENT,
    SOFTMAX_DIM,
    WRONG_GRADIENT,
    Finding,
)
from .probes.masking import band
from .report import Report, merge, render
from .subject.building import CannotRun, copy_module, dequantized, draw_zeros, num_heads_of
from .subject.caller import LENGTH_NAMES, MASK_NAMES, SWITCH_NAMES, block_mask_named, dependency, module_state, restore
from .subject.context import future
from .subject.flex import NO_BACKWARD_HERE, flex_written_out

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["Layer", "ModelReport", "check_model", "find_attention", "render_model"]

_SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax"})
_KERNELS = frozenset({"scaled_dot_product_attention", "flex_attention", "_scaled_dot_product_attention_math",
                      "multi_head_attention_forward"})  # a mode sees the call, not the operations inside
_PRODUCTS = frozenset({"matmul", "__matmul__", "__rmatmul__", "bmm", "einsum", "baddbmm"})
# what weights pass through on their way to the product (dropout, a cast, a mask put on or a bias added after the
# softmax, a 1 x 1 convolution or a linear map mixing the heads: talking heads, a renormalisation over the other
# axis: PCT's offset attention)
_PASSING = frozenset({"dropout", "to", "type", "type_as", "float", "half", "bfloat16", "double", "contiguous",
                      "conv1d", "conv2d", "linear",
                      "masked_fill", "masked_fill_", "mul", "__mul__", "where", "nan_to_num", "clone", "view",
                      "reshape", "transpose", "permute", "unsqueeze", "squeeze", "flatten", "expand", "detach",
                      "__getitem__", "pad", "narrow", "as_strided", "roll", "add", "__add__", "__radd__",
                      "div", "__truediv__", "div_", "__itruediv__"})


@dataclass
class Layer:
    """An attention submodule found in the model, and the call the model made to it.

    ``x``: where the hidden states went (a positional index or a keyword; several for forward(q, k, v)
    called with one tensor); ``mask``: the forward parameter that takes the mask, or None; ``batch``,
    ``length``: the recorded call's sizes (the hidden states are (B, L, E)).
    """

    name: str
    module: nn.Module
    args: tuple
    kwargs: dict
    x: tuple[int | str, ...]
    mask: str | int | None
    batch: int
    length: int
    tokens: int = 0  # the recorded hidden states' token count: L, or H * W for an image (B, H, W, E)
    sequence_first: bool = False  # the model calls it with (L, B, E) (torch's batch_first=False layers)
    channels_first: bool = False  # the model calls it with (B, E, L) (a point cloud's or a 1-D conv net's layers)
    # the recorded tensors whose dim 0 stayed when the model ran one item alone: tables (a (2, L, D) stack of rotary
    # cos and sin), not per item, whatever their first size
    shared: frozenset[int] = frozenset()
    # why it is no self-attention, once judged (the model finder asks, and check_model again): None, or (why or None,)
    not_self: tuple[str | None] | None = field(default=None, repr=False)
    # the same layer's call when the model ran its first item alone, (args, kwargs); None when it did not
    alone: tuple[tuple, dict] | None = field(default=None, repr=False)
    # what the layer returned in the model's run
    output: object = field(default=None, repr=False)

    @property
    def hidden(self) -> Tensor:
        """The hidden states the model called the layer with (the first slot they took), as (B, L, E) for a layer
        called channels first."""
        found = next(a for k, a in [*enumerate(self.args), *self.kwargs.items()] if k in self.x)
        return found.transpose(1, 2) if self.channels_first and found.dim() == 3 else found

    @property
    def extras(self) -> list[Tensor]:
        """The tensors of the recorded call other than the hidden states and the mask."""
        skip = {*self.x, self.mask}
        found: list[Tensor] = []
        for key, value in [*enumerate(self.args), *self.kwargs.items()]:
            if key not in skip:
                tree_map(lambda t: found.append(t) if isinstance(t, Tensor) else None, value)
        return found

    @property
    def sizes(self) -> bool:
        """Does the recorded call carry numbers besides the tensors (a feature map's (H, W), a token count), which
        may tie the layer to the recorded length?"""
        skip = {*self.x, self.mask}
        found: list[int] = []
        for key, value in [*enumerate(self.args), *self.kwargs.items()]:
            if key not in skip:
                tree_map(lambda v: found.append(v) if isinstance(v, int) and not isinstance(v, bool) else None, value)
        return bool(found)

    def recorded_mask(self) -> object:
        """What the model passed as the mask argument (None when the layer takes none)."""
        if isinstance(self.mask, int):
            return self.args[self.mask] if self.mask < len(self.args) else None
        return self.kwargs.get(self.mask) if self.mask is not None else None

    def adapter(self, causal: bool = False, pad: Tensor | None = None) -> Callable:
        """``call(module, x[, mask])`` replaying the recorded call (with a mask argument when the layer takes one).
        ``causal``: the model is causal (the user said so) and passes the layer a causal mask: a call without the
        doctor's mask keeps the model's, cut to x's length, as the layer's own pattern (a mask replaces it).
        ``pad``: the model's padding (B, L), True = padding, when known."""
        copies: dict = {}  # the modules the call passes, cast to the probe's dtype (a half-precision run)
        own = _causal_like(self.recorded_mask(), self.length) if causal else None

        def replay(module: nn.Module, x: Tensor, mask: object = None) -> object:
            fit = _fitter(x, self.batch, self.length, copies, self.sequence_first, num_heads_of(module),
                          self.shared)
            if mask is None and own is not None:  # the plain causal mask at x's length (a buffer larger than the
                mask = fit(own if own.shape[-1] > self.length else _causal_at(own, x.shape[1]))  # call: at its size)
            if self.sequence_first:
                x = x.transpose(0, 1)
            if self.channels_first:
                x = x.transpose(1, 2)
            args = [x if i in self.x else (mask if i == self.mask else tree_map(fit, a))
                    for i, a in enumerate(self.args)]
            kwargs = {k: x if k in self.x else (mask if k == self.mask else tree_map(fit, v))
                      for k, v in self.kwargs.items()}
            if self.mask is not None and _carries_pattern(mask):  # the doctor's (..., L, L) mask carries the whole
                # pattern: a causal switch the model set goes off; with no mask, or a key mask, which cannot carry
                # causality, it stays as the model set it (MPT's is_causal beside its attention_mask)
                kwargs.update({k: False for k, v in kwargs.items() if k in SWITCH_NAMES and v is True})
            if isinstance(self.mask, str) and self.mask not in kwargs and mask is not None:
                kwargs[self.mask] = mask
            if not self.sequence_first and not self.channels_first:
                return module(*args, **kwargs)
            out = module(*args, **kwargs)  # the doctor's (B, L, E) went in as (L, B, E) or (B, E, L): it comes back so
            dims = (0, 1) if self.sequence_first else (1, 2)
            if isinstance(out, Tensor):
                return out.transpose(*dims)
            if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
                return (out[0].transpose(*dims), *out[1:])
            return out

        call = (lambda module, x: replay(module, x)) if self.mask is None else replay
        # the recorded per-item tensors (a residual of scores, a text sequence) are cut to x's batch from the
        # first row: an item alone is given the first item's, which the batch probe must know
        heads = num_heads_of(self.module) or 1  # or heads folded into the batch, item-major (a per-graph (B * H, N, N)
        rows = any(t.dim() > 1 and (self.batch in t.shape[:1 + self.sequence_first] or  # mask): cut alike
                                    (heads > 1 and t.shape[0] == self.batch * heads != self.length))
                   for t in self.extras)
        setattr(call, "rows_from_the_start", rows)  # noqa: B010 (an attribute of a function)
        setattr(call, "sequence_first", self.sequence_first)  # noqa: B010 (its masks in that layout: (L, L, B))
        # the model's causal mask stands for the layer's own pattern: a key mask (B, L) cannot carry it
        setattr(call, "own_causal", own is not None)  # noqa: B010
        # a bool causal mask with True = masked (MPT's): the doctor's masks are tried in that polarity first
        flipped = own is not None and own.dtype == torch.bool and bool(own.reshape(-1, *own.shape[-2:])[0, 0, -1])
        setattr(call, "own_kind", "ignore" if flipped else None)  # noqa: B010
        # the parameter the doctor's mask goes to, by name (each item's length, as d2l's valid_lens, is sent so)
        params = _parameters(self.module)
        name = params[self.mask] if isinstance(self.mask, int) and self.mask < len(params) else self.mask
        setattr(call, "mask_name", name if isinstance(name, str) else None)  # noqa: B010
        # tables the model computed in half precision (rotary cos and sin in bfloat16) keep their rounding in the
        # float64 replay: a rotation by them is orthogonal to that precision only
        eps = [torch.finfo(t.dtype).eps for t in self.extras if t.is_floating_point()]
        setattr(call, "recorded_eps", max(eps, default=0.0))  # noqa: B010
        # the model's padding added into an argument other than the mask (MPT's attn_bias, T5's position bias): the
        # doctor's mask does not replace it, so the padded rows stay the model's in every run, not the layer's
        carried = pad is not None and tuple(pad.shape) == (self.batch, self.length) and any(
            _carries_padding(v, pad) or _pads_queries(v, pad) for k, v in [*enumerate(self.args), *self.kwargs.items()]
            if k not in self.x and k != self.mask)
        setattr(call, "padded_rows", pad if carried else None)  # noqa: B010
        setattr(call, "carries_padding", carried)  # noqa: B010 (each item's own pattern is read in the white box)
        return call


def _parameters(module: nn.Module) -> list[str]:
    """The names of ``module.forward``'s parameters, in order (none when they cannot be read)."""
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _carries_pattern(mask: object) -> bool:
    """Is ``mask`` one that can carry a pattern over the queries: a tensor (..., Lq, Lk) with Lq > 1 and Lk > 1, not
    a key mask (B, L), (B, 1, 1, L) or a key column (B, 1, L, 1)? (Read outside the doctor's watch on the mask: this
    look is not the module's.)"""
    if not isinstance(mask, Tensor):
        return False
    with untraced():
        return mask.dim() >= 3 and mask.shape[-2] > 1 and mask.shape[-1] > 1


def _causal_like(mask: object, length: int) -> Tensor | None:
    """For a mask over ``length`` tokens that hides every later key of every query in every item ((..., L, L), bool
    True = may attend or additive 0 / large negative; a window or padding may hide more): the plain causal mask in
    its shape, kind and fill, which stands for the layer's own pattern; else None. A square mask over more positions
    (Whisper's (n_ctx, n_ctx) buffer, which the layer cuts to the tokens) is read whole and kept at its size."""
    if not isinstance(mask, Tensor) or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2] or \
            mask.shape[-1] < length or length < 2:
        return None
    length = mask.shape[-1]
    lower = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()

    def causal(seen: Tensor) -> bool:  # no later key seen; each query sees its own key unless no query does (padding)
        own = seen.diagonal(dim1=-2, dim2=-1) | ~seen.any(-2)
        return not bool((seen & ~lower).any()) and bool(own.all())

    shape = (1, *mask.shape[1:]) if mask.dim() > 2 else mask.shape  # one for every item: the batch broadcasts
    if _ones_and_zeros(mask):  # 1 = may attend, in integers or floats (Keras's masks: padding merged by a minimum)
        return lower.expand(shape).to(mask.dtype).clone() if causal(mask != 0) else None
    if mask.dtype == torch.bool:  # True = may attend, or True = masked (MPT's, Hugging Face's older layers)
        if causal(mask):
            return lower.expand(shape).clone()
        return (~lower).expand(shape).clone() if causal(~mask) else None
    if not mask.is_floating_point() or not causal(torch.isfinite(mask) & (mask > -1e3)):
        return None
    hidden = float(mask.min())
    return torch.zeros(shape, dtype=mask.dtype, device=mask.device).masked_fill(~lower, hidden)


def _ones_and_zeros(mask: Tensor) -> bool:
    """Is ``mask`` a keep-mask of 1 and 0 in integers or floats (not bool, not an additive 0 / large negative)?"""
    if mask.dtype == torch.bool or mask.is_complex():
        return False
    with untraced():
        return bool(((mask == 0) | (mask == 1)).all()) and bool((mask == 1).any())


def _causal_at(own: Tensor, length: int) -> Tensor:
    """The plain causal mask ``own`` (from :func:`_causal_like`) in its kind, fill and leading shape, over ``length``
    tokens."""
    lower = torch.ones(length, length, dtype=torch.bool, device=own.device).tril()
    shape = (*own.shape[:-2], length, length)
    if _ones_and_zeros(own):
        return lower.expand(shape).to(own.dtype).clone()
    if own.dtype == torch.bool:  # True = may attend when the first query sees its own key
        return (lower if bool(own.reshape(-1, *own.shape[-2:])[0, 0, 0]) else ~lower).expand(shape).clone()
    return torch.zeros(shape, dtype=own.dtype, device=own.device).masked_fill(~lower, float(own.min()))


def _fitter(x: Tensor, batch: int, length: int, copies: dict | None = None, sequence_first: bool = False,
            heads: int | None = None, shared: frozenset[int] = frozenset()) -> Callable[[object], object]:
    """Cut a recorded tensor to x's batch (dim 0 of size ``batch``, or of ``batch`` times the layer's ``heads``, item
    by item: BLOOM's (B * H, 1, L) ALiBi; for a layer called sequence first, dim 1 when dim 0 is not: XLNet's (2L,
    B, D) positions) and length (every other dim of size ``length``), in x's floating dtype and on its device; a
    module the model passes (a shared position-bias module) as a copy in x's floating dtype, kept in ``copies``;
    other values pass as they are. ``shared``: the ids of recorded tensors that are not per item (not cut on the
    batch)."""
    b, n = x.shape[0], x.shape[1]

    def fit(t: object) -> object:
        if isinstance(t, nn.Module) and copies is not None and x.is_floating_point() and \
                any(p.is_floating_point() and p.dtype != x.dtype for p in [*t.parameters(), *t.buffers()]):
            key = (id(t), x.dtype)
            if key not in copies:
                try:
                    copies[key] = copy.deepcopy(t).to(x.dtype)
                except Exception:  # a module that cannot be copied goes as it is
                    copies[key] = t
            return copies[key]
        if not isinstance(t, Tensor):
            return t
        at = None
        if t.dim() > 1 and batch != length and id(t) not in shared:
            at = 0 if t.shape[0] == batch else 1 if sequence_first and t.shape[1] == batch else None
        per = 1
        if at is None and heads and heads > 1 and t.dim() > 1 and t.shape[0] == batch * heads != length:
            at, per = 0, heads
        if at is not None and b != batch:
            if b > batch:
                raise ValueError(f"the model called this layer with batch {batch}; it cannot be replayed at {b}")
            t = t.narrow(at, 0, b * per)
        for d in range(t.dim()):  # every token axis: an (L, L) mask has two
            if d != at and t.shape[d] == length and n != length:
                if n > length:
                    raise ValueError(f"the model called this layer at length {length}; it cannot be replayed at {n}")
                t = t.narrow(d, 0, n)
        if t.is_floating_point() and x.is_floating_point() and t.dtype != x.dtype:
            top = torch.finfo(x.dtype).max
            if torch.finfo(t.dtype).max > top:  # a fill made in the model's dtype (finfo.min) is the narrower
                t = torch.where(t.isinf(), t, t.clamp(-top, top))  # dtype's, as the model in it makes it, not -inf
            t = t.to(dtype=x.dtype)
        return t.to(x.device)

    return fit


class _Watch(TorchFunctionMode):
    """Which modules' own forward multiplies softmax weights into a tensor, or runs an attention kernel."""

    def __init__(self, stack: list[str]) -> None:
        super().__init__()
        self.stack = stack
        self.weights: set[int] = set()
        self.lse: set[int] = set()  # logsumexp of scores, and scores less it
        self.kept: list[Tensor] = []
        self.found: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        given = [*args, *(kwargs or {}).values()]
        given += [t for a in given if isinstance(a, (tuple, list)) for t in a]  # einsum(eq, (a, b)): a tuple
        tensors = [a for a in given if isinstance(a, Tensor)]
        if self.stack and (name in _KERNELS or (name in _PRODUCTS and any(id(t) in self.weights for t in tensors))):
            self.found.add(self.stack[-1])
        if isinstance(out, Tensor) and (name in _SOFTMAX or (name in _PASSING and tensors and
                                                             id(tensors[0]) in self.weights)):
            self.weights.add(id(out))
            self.kept.append(out)  # alive until the run ends, so that no other tensor takes its id
        elif isinstance(out, Tensor) and name == "logsumexp":  # softmax written out: exp(scores - logsumexp(scores))
            self.lse.add(id(out))  # (Reformer's attention)
            self.kept.append(out)
        elif isinstance(out, Tensor) and name in ("sub", "__sub__", "sub_", "__isub__") and \
                any(id(t) in self.lse for t in tensors):
            self.lse.add(id(out))
            self.kept.append(out)
        elif isinstance(out, Tensor) and name in ("exp", "exp_") and tensors and id(tensors[0]) in self.lse:
            self.weights.add(id(out))
            self.kept.append(out)
        return out


def _detached(value: object, memo: dict[int, Tensor]) -> object:
    """``value`` with each tensor copied (one copy per tensor: forward(x, x, x) keeps one tensor thrice)."""
    def copy(t: object) -> object:
        if not isinstance(t, Tensor):
            return t
        if id(t) not in memo:
            with torch.inference_mode(False):  # a model run under inference_mode (Meta's reference forward) made
                memo[id(t)] = t.detach().clone()  # inference tensors; their copies are plain, for autograd's replays
        return memo[id(t)]

    return tree_map(copy, value)


def _is_cache(value: object) -> bool:
    return value is not None and "cache" in type(value).__name__.lower() and not isinstance(value, (bool, Tensor))


def _first_tensor(out: object) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, Tensor)), None)
    if isinstance(out, Mapping):
        return next((o for o in out.values() if isinstance(o, Tensor)), None)
    return None


def _mask_parameter(module: nn.Module, kwargs: dict, taken: set, given: dict | None = None) -> str | None:
    """The forward parameter the mask goes to: the first named like a mask in the signature's order (the one
    :func:`~selfattn.check.check` tries first, so that a layer is read the same way alone and in its model),
    else a recorded keyword named like one."""
    params = [p for p in _parameters(module) if p not in taken]
    names = [k for k in [*params, *kwargs] if k in MASK_NAMES or ("mask" in k.lower() and k not in SWITCH_NAMES)]
    values = {**kwargs, **(given or {})}  # what the model passed, by parameter name
    # not one that takes FlexAttention's BlockMask, which no tensor the doctor sends can be (stable-audio's
    # flex_attention_block_mask before its padding_mask), unless the model gave it a tensor
    names = [k for k in names if not block_mask_named(k) or isinstance(values.get(k), Tensor)] or names
    # else padding given as each item's length (d2l's valid_lens), when the model gives one per item (a decoder's
    # (B, L) lengths, one per query, carry its causal pattern: they stay as recorded)
    names = names or [k for k in [*params, *kwargs] if k in LENGTH_NAMES and
                      (not isinstance(values.get(k), Tensor) or values[k].dim() == 1)]
    # else a tensor over (query, key) pairs whose values are only 0 and a large negative: a mask under another name
    # (an additive ``attn_bias`` built from the causal pattern and the padding), not a position bias
    names = names or [k for k in [*params, *kwargs] if _additive_mask(values.get(k))]
    return (names or [None])[0]


def _additive_mask(t: object) -> bool:
    """Is ``t`` a floating (..., L, L) tensor holding 0 and one or more large negative values (-inf, finfo.min,
    -1e4 and below), and nothing else?"""
    if not isinstance(t, Tensor) or not t.is_floating_point() or t.dim() < 2 or t.shape[-1] != t.shape[-2] or \
            t.shape[-1] < 2:
        return False
    flat = t.detach().flatten()
    zero, hidden = flat == 0, flat <= -1e4
    return bool((zero | hidden).all()) and bool(zero.any()) and bool(hidden.any())


def _keys_and_values(slots: list[tuple[int | str, object]], hidden: Tensor, params: list[str]) -> tuple:
    """The slots of forward(query, key, value) (or forward(queries, keys)) that take one other tensor of the query's
    shape as the keys and values: self-attention whose query alone went through a norm (SASRec's
    ``mha(LayerNorm(x), x, x)``), or whose keys and values did. The doctor's input goes to all of them, as it does
    for a module checked alone; else ()."""
    def named(k: int | str) -> str:
        return (params[k] if k < len(params) else "") if isinstance(k, int) else k

    same = [(k, a) for k, a in slots if isinstance(a, Tensor) and a is not hidden and a.shape == hidden.shape]
    if not same or len(same) > 2 or any(a is not same[0][1] for _, a in same):
        return ()
    if all(named(k).lower() in _KEY_VALUE_NAMES for k, _ in same) and \
            (_normed_from(hidden, same[0][1]) or _normed_from(same[0][1], hidden)):  # or the keys and values normed
        return tuple(k for k, _ in same)
    return ()


def _normed_from(q: Tensor, k: Tensor) -> bool:
    """Is ``q`` a layer or RMS norm of ``k``, token by token (with any per-feature gain and bias)? Tells a query
    normed apart from its keys (SASRec) from a cross-attention over another sequence of the same shape."""
    if not (q.is_floating_point() and k.is_floating_point()) or q.shape[-1] < 2:
        return False
    q2, k2 = q.detach().double().reshape(-1, q.shape[-1]), k.detach().double().reshape(-1, k.shape[-1])
    if q2.shape[0] < 3 or not (bool(torch.isfinite(q2).all()) and bool(torch.isfinite(k2).all())):
        return False
    centred = k2 - k2.mean(-1, keepdim=True)
    for normed in (centred / centred.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt(),
                   k2 / k2.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()):
        # per feature, the least-squares fit q = a * normed + c over the tokens
        dn, dq = normed - normed.mean(0), q2 - q2.mean(0)
        a = (dn * dq).sum(0) / dn.pow(2).sum(0).clamp_min(1e-24)
        residual = dq - a * dn
        if float(residual.abs().max()) <= 1e-4 * (1 + float(q2.abs().max())):
            return True
    return False


_KEY_VALUE_NAMES = frozenset({"key", "k", "keys", "value", "v", "values", "kv", "key_value"})


def _layer(name: str, module: nn.Module, args: tuple, kwargs: dict, out: object,
           batch: int | None = None) -> Layer | None:
    """The layer for this recorded call, when it maps hidden states (B, L, E) to an output of that shape. Hidden
    states (L, B, E), passed sequence first, are told by the module's ``batch_first = False`` (torch's layers) or
    by ``batch``, the model's batch, on their second dim."""
    y = _first_tensor(out)
    if y is None or y.dim() not in (3, 4) or not y.is_floating_point():  # (B, L, E), or an image (B, H, W, E)
        return None
    slots = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
    hidden = next((a for _, a in slots if isinstance(a, Tensor) and a.shape == y.shape), None)
    if hidden is None:
        return None
    x = tuple(k for k, a in slots if a is hidden)
    params = _parameters(module)
    x = x + _keys_and_values(slots, hidden, params)
    if y.dim() == 4 and any(isinstance(a, Tensor) and a is not hidden and a.dim() == 4 and a.shape[0] == y.shape[0]
                            and a.shape[-1] == y.shape[-1] for _, a in slots):
        return None  # q, k and v (B, H, L, D), k and v with more keys (memory) or fewer heads (grouped): an
        # attention core, checked through its parent
    if len(x) == 1 and not any(True for _ in module.parameters()) and sum(
            isinstance(a, Tensor) and a is not hidden and a.dim() == y.dim() and a.shape[0] == y.shape[0] and
            a.shape[-1] == y.shape[-1] for _, a in slots) >= 2:
        return None  # a module with no weights of its own given q, k and v apart (d2l's DotProductAttention on the
        # heads folded into the batch): the core, checked through its parent
    taken = {params[k] if isinstance(k, int) and k < len(params) else k for k in x}
    given = {**{params[i]: a for i, a in enumerate(args) if i < len(params)}, **kwargs}
    mask = _mask_parameter(module, kwargs, taken, given)
    if mask is not None and mask not in kwargs and mask in params and params.index(mask) < len(args):
        mask_slot: str | int | None = params.index(mask)  # passed positionally
    else:
        mask_slot = mask
    kwargs = {k: (None if _is_cache(v) else v) for k, v in kwargs.items()}
    args = tuple(None if _is_cache(a) else a for a in args)
    # a layer built sequence first is called so when its states' dim 1 is the model's batch, or an (L, L) mask the
    # model passes says dim 0 holds the tokens (token ids given (L, B)); one the model hands its (B, L, E) states is
    # replayed so: it attends over the batch
    square = any(isinstance(a, Tensor) and a.dim() >= 2 and a.shape[-1] == a.shape[-2] == hidden.shape[0] !=
                 hidden.shape[1] for _, a in slots)
    # or a (B, L) key padding mask beside (L, B, E) states (the model's inputs given (L, B), so that its batch reads
    # as their length)
    keyed = hidden.dim() == 3 and hidden.shape[0] != hidden.shape[1] and any(
        isinstance(a, Tensor) and a.dim() == 2 and tuple(a.shape) == (hidden.shape[1], hidden.shape[0])
        for _, a in slots)
    told = getattr(module, "batch_first", None) is False and (batch is None or hidden.shape[1] == batch or
                                                             hidden.shape[0] != batch or square or keyed)
    # one token of each item sequence first, unless the layer attends over them: the model's items folded into one
    # sequence (SAINT's attention between samples, (1, B, L * E)) is a batch of one
    folded = hidden.dim() == 3 and hidden.shape[0] == 1 and not told and \
        _mixes_along(module, args, kwargs, hidden, y)
    if hidden.dim() == 3 and not folded and \
            (told or (batch is not None and hidden.shape[1] == batch != hidden.shape[0])):
        return Layer(name, module, args, kwargs, x, mask_slot, hidden.shape[1], hidden.shape[0], hidden.shape[0],
                     sequence_first=True)
    if hidden.dim() == 3 and not folded and _channels_first(module, hidden):
        return Layer(name, module, args, kwargs, x, mask_slot, hidden.shape[0], hidden.shape[2], hidden.shape[2],
                     channels_first=True)
    if hidden.dim() == 4 and _channels_first(module, hidden):  # a feature map (B, C, H, W): H x W tokens
        return Layer(name, module, args, kwargs, x, mask_slot, hidden.shape[0], hidden.shape[2],
                     hidden.shape[2] * hidden.shape[3])
    return Layer(name, module, args, kwargs, x, mask_slot, hidden.shape[0], hidden.shape[1],
                 math.prod(hidden.shape[1:-1]))


def _channels_first(module: nn.Module, hidden: Tensor) -> bool:
    """Is the (B, ?, ?) ``hidden`` a layer's (B, E, L) input: its first layer a 1-D convolution over dim 1, and no
    Linear of the module taking dim 2 as its features (PCT's point-cloud attention, (B, C, N))? Or the (B, ?, ?, ?)
    ``hidden`` a feature map (B, C, H, W): its first layer a 2-D convolution over dim 1, and no Linear taking the
    last dim as its features (bottleneck transformers' attention on a ResNet's map)?"""
    conv = nn.Conv1d if hidden.dim() == 3 else nn.Conv2d
    first = next((m for m in module.modules() if isinstance(m, (nn.Linear, conv))), None)
    return isinstance(first, conv) and first.in_channels == hidden.shape[1] != hidden.shape[-1] and \
        not any(isinstance(m, nn.Linear) and m.in_features == hidden.shape[-1] for m in module.modules())


def _mixes_along(module: nn.Module, args: tuple, kwargs: dict, hidden: Tensor, out: Tensor) -> bool:
    """Does the layer's output at other indices of dim 1 change with its hidden states at index 0 (it attends over
    dim 1)? The layer is run once more on the recorded call, in eval mode, its state put back after."""
    changed = hidden.clone()
    changed[:, 0] += torch.randn(changed[:, 0].shape, generator=torch.Generator().manual_seed(7)).to(changed)
    again_args = tuple(changed if a is hidden else a for a in args)
    again_kwargs = {k: changed if a is hidden else a for k, a in kwargs.items()}
    state = module_state(module)
    try:
        with _evaluated(module):
            again = _first_tensor(module(*again_args, **again_kwargs))
    except Exception:  # a layer that does not run alone on its recorded call: read as the model calls it
        return False
    finally:
        restore(state)
    if again is None or again.shape != out.shape:
        return False
    diff = (again.double() - out.double()).abs().nan_to_num(0.0)
    return bool(diff[:, 1:].max() > 1e-6 * (1 + float(out.double().abs().nan_to_num(0.0).max())))


def find_attention(model: nn.Module, example_inputs: object, missed: list[str] | None = None) -> list[Layer]:
    """Run ``model`` on ``example_inputs`` and return its attention layers, in the order they ran. With a batch of
    several items the model also runs on the first item alone, which tells the recorded tensors that are per item
    (their first size follows the batch) from tables whose first size is the batch's by chance.

    Args:
        model: any module.
        example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments.
        missed: when given, the names of the modules that ran an attention but have no such ancestor are added
            to it.

    Returns:
        One :class:`Layer` per attention submodule (the innermost module whose own forward multiplies
        softmax weights into a tensor or runs an attention kernel, or its nearest ancestor that maps the
        hidden states (B, L, E) to an output of that shape).

    Raises:
        CannotRun: the model fails on the example inputs.
    """
    args, kwargs = _inputs(example_inputs)
    calls, parents, found = _record_calls(model, args, kwargs)
    order = list(calls)
    first = next((t for t in [*args, *kwargs.values()] if isinstance(t, Tensor) and t.dim() >= 1), None)
    batch = None if first is None else first.shape[0]  # the model's batch: token ids (B, L), pixels (B, C, H, W)
    axis = 0
    if first is not None and _batch_second(model, args, kwargs, first, calls, found):
        batch, axis = first.shape[1], 1  # token ids given (L, B)
    alone = None
    if batch is not None and batch > 1:  # one item alone: which recorded tensors are per item
        one = tree_map(lambda t: t.narrow(axis, 0, 1) if isinstance(t, Tensor) and t.dim() > axis and
                       t.shape[axis] == batch else t, (args, kwargs))
        try:
            alone = _record_calls(model, *one)[0]
        except CannotRun:  # a model that runs only at its batch: every tensor of that first size is per item
            alone = None
    layers: dict[str, Layer] = {}
    for inner in found:
        name: str | None = inner
        while name is not None:
            if name in calls:
                layer = _layer(name, model.get_submodule(name), *calls[name], batch=batch)
                if layer is not None:
                    name, layer = _self_attention_above(model, name, layer, calls, parents, found, batch)
                    if alone is not None and name in alone and batch is not None:
                        layer.shared = _shared(calls[name][:2], alone[name][:2], batch)
                        layer.alone = alone[name][:2]
                    layer.output = calls[name][2]
                    layers.setdefault(name, layer)
                    break
            name = parents.get(name)
        if name is None and missed is not None and inner:  # no module on the way up maps (B, L, E) to itself
            missed.append(inner)
    return sorted(layers.values(), key=lambda layer: order.index(layer.name))


def _batch_second(model: nn.Module, args: tuple, kwargs: dict, first: Tensor,
                  calls: dict[str, tuple[tuple, dict, object]], found: list[str]) -> bool:
    """Does the model take its items on dim 1 of its first input (token ids (L, B), as sequence-first models take
    them)? Told by behaviour: the first input changed at index 0 of dim 1 changes the first attention's output at
    that index of dim 1 only; in a batch-first model it changes the other tokens too. A model whose attention says
    its layout (``batch_first``) is read by it instead."""
    if first.dim() < 2 or first.shape[0] == first.shape[1] or first.shape[1] < 2:
        return False
    if any(hasattr(model.get_submodule(n), "batch_first") for n in found):
        return False  # torch's layers say their layout: one left sequence first and handed (B, L, E) attends over
        # the batch, which the same behaviour would read as ids given (L, B)
    name = next((n for n in found if n in calls), None)
    y = None if name is None else _first_tensor(calls[name][2])
    if y is None or y.dim() != 3 or tuple(y.shape[:2]) != tuple(first.shape[:2]):
        return False
    def moved(index: tuple) -> Tensor | None:
        """How much the first attention's output moves when the first input changes at ``index``; None when the
        model cannot say."""
        changed = first.clone()
        if first.is_floating_point():
            changed[index] = changed[index] + torch.randn(changed[index].shape,
                                                          generator=torch.Generator().manual_seed(5))
        else:
            changed[index] = (changed[index] + 1) % (int(first.max()) + 1)
        if torch.equal(changed, first):
            return None
        swapped = tree_map(lambda t, changed=changed: changed if t is first else t, (args, kwargs))
        try:
            again = _record_calls(model, *swapped)[0]
        except CannotRun:
            return None
        y2 = _first_tensor(again[name][2]) if name in again else None
        if y2 is None or y2.shape != y.shape:
            return None
        return (y2.double() - y.double()).abs().nan_to_num(0.0)

    scale = 1e-6 * (1 + float(y.double().abs().nan_to_num(0.0).max()))
    # the first index and the last: in a batch-first model whose first attention sees the future only (a causal
    # mask transposed), a change at token 0 reaches row 0 alone, as an item's would sequence first
    for at in (0, first.shape[1] - 1):
        diff = moved((slice(None), at))
        if diff is None:
            return False
        others = torch.tensor([i for i in range(diff.shape[1]) if i != at], dtype=torch.long)
        if not bool(diff[:, at].max() > scale) or bool(diff.index_select(1, others).max() > scale):
            return False
    # and the tokens of that item mix: one of its first or last token's changes reaches another row of dim 0. A
    # batch-first model whose first attention mixes nothing yet (a zero-initialised output projection: the block is
    # x + a feed-forward) keeps every change at its own (item, token)
    for row in (0, first.shape[0] - 1):
        diff = moved((row, 0))
        if diff is not None and bool(torch.cat([diff[:row, 0], diff[row + 1:, 0]]).max() > scale):
            return True
    return False


def _self_attention_above(model: nn.Module, name: str, layer: Layer,
                          calls: dict[str, tuple[tuple, dict, object]], parents: dict[str, str | None],
                          found: list[str], batch: int | None) -> tuple[str, Layer]:
    """(name, layer) of the parent instead of ``layer`` when the layer is no self-attention on its own, or a cell given
    its keys and values apart (Sockeye's ``DotAttentionCell``), while its parent, holding no other attention, maps the
    hidden states to themselves and is one; else ``layer`` itself."""
    parent = parents.get(name)
    if not parent or parent not in calls or any(f != name and f.startswith(f"{parent}.") for f in found) or \
            (not _given_keys_apart(layer) and _not_self_attention(layer) is None):
        return name, layer
    args, kwargs, out = calls[parent]
    up = _layer(parent, model.get_submodule(parent), args, kwargs, out, batch=batch)
    if up is None or _not_self_attention(up) is not None:
        return name, layer
    return parent, up


def _given_keys_apart(layer: Layer) -> bool:
    """Is the layer a cell with no weights of its own given, beside the hidden states, the keys and values as a
    sequence of their own (Sockeye's ``DotAttentionCell``: (B, L, 2E) packed)? Its parent made them from the same
    states; whatever its rows depend on (a softmax over the queries makes them depend on each other), the cell
    cannot be called on (B, L, E) alone."""
    if any(True for _ in layer.module.parameters()):
        return False
    hidden = layer.hidden
    return any(t.dim() == hidden.dim() and t.shape[:-1] == hidden.shape[:-1] and t.shape[-1] % hidden.shape[-1] == 0
               for t in layer.extras)


def _shared(call: tuple, alone: tuple, batch: int) -> frozenset[int]:
    """The ids of ``call``'s tensors of first size ``batch`` whose first size stayed in the call ``alone`` (the same
    layer's call with one item): tables, not per item."""
    ours: list[Tensor] = []
    theirs: list[Tensor] = []
    tree_map(lambda t: ours.append(t) if isinstance(t, Tensor) else None, call)
    tree_map(lambda t: theirs.append(t) if isinstance(t, Tensor) else None, alone)
    if len(ours) != len(theirs):
        return frozenset()
    return frozenset(id(a) for a, b in zip(ours, theirs, strict=True)
                     if a.dim() > 0 and b.dim() > 0 and a.shape[0] == batch and b.shape[0] == batch)


def _first_item(t: Tensor, batch: int, heads: int, alone: Tensor) -> tuple[Tensor, Tensor] | None:
    """``t`` of the batch's call cut to its first item, beside ``alone`` (the call with that item alone), when their
    shapes say how: a first size of the batch (1 alone), or of the batch times the heads, item-major (H alone)."""
    if t.dim() == 0 or alone.dim() != t.dim() or t.shape[1:] != alone.shape[1:]:
        return None
    if t.shape[0] == batch and alone.shape[0] == 1:
        return t[:1], alone
    if heads > 1 and t.shape[0] == batch * heads and alone.shape[0] == heads:
        return t[:heads], alone
    return None


def _differs(a: Tensor, b: Tensor) -> bool:
    if a.dtype == torch.bool or not a.is_floating_point():
        return not torch.equal(a, b.to(a.dtype))
    a, b = a.double(), b.double()
    seen = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return True
    size = 1 + float(a[seen].abs().max()) if bool(seen.any()) else 1.0
    return bool(seen.any()) and float((a[seen] - b[seen]).abs().max()) > 1e-4 * size


def items_mixed_on_the_way(layer: Layer) -> Finding | None:
    """batch-mixing when the model hands this layer, for its first item, the same hidden states in the batch and
    alone, but another tensor (a mask, a bias, position terms) that differs: the model lays it out across items
    wrongly on its way to the layer (a pair bias (H, B, L, L) reshaped to (B * H, L, L) without its permute, ALiBi
    built head-major for an item-major fold), which the layer's own probes, replaying one call, cannot see."""
    if layer.alone is None or layer.batch < 2:
        return None
    heads = num_heads_of(layer.module) or 1
    ours: list[tuple[str, Tensor]] = []
    theirs: list[tuple[str, Tensor]] = []
    for (args, kwargs), into in (((layer.args, layer.kwargs), ours), (layer.alone, theirs)):
        for key, value in [*enumerate(args), *kwargs.items()]:
            tree_map(lambda t, key=key, into=into: into.append((str(key), t)) if isinstance(t, Tensor) else None,
                     value)
    if len(ours) != len(theirs):
        return None
    hidden = {str(k) for k in layer.x}
    pairs = [(key, _first_item(t, layer.batch, heads, other)) for (key, t), (_, other) in zip(ours, theirs,
                                                                                              strict=True)]
    if any(key in hidden and (cut is None or _differs(*cut)) for key, cut in pairs):
        return None  # the hidden states already differ (an earlier layer mixed items): not this layer's call
    mixed = [key for (key, cut), (_, t) in zip(pairs, ours, strict=True)
             if key not in hidden and cut is not None and id(t) not in layer.shared and _differs(*cut)]
    if not mixed:
        return None
    return Finding.of(BATCH_MIXING, f"the model passes this layer {', '.join(repr(k) for k in mixed)} with other "
                      "values for its first item in the batch than when that item runs alone, the hidden states "
                      "being the same: another item's values reach it (a bias or mask laid out across items wrongly "
                      "on its way to the layer: a (H, B, ...) tensor reshaped to (B * H, ...) without its permute?)",
                      {"layer": layer.name, "arguments": mixed})


def _record_calls(model: nn.Module, args: tuple,
                  kwargs: dict) -> tuple[dict[str, tuple[tuple, dict, object]], dict[str, str | None], list[str]]:
    """Run ``model`` once: each submodule's first call (args, kwargs, output), each one's parent, and the innermost
    modules that ran an attention.

    Raises:
        CannotRun: the model fails on these inputs.
    """
    names = {m: n for n, m in model.named_modules()}
    stack: list[str] = []
    calls: dict[str, tuple[tuple, dict, object]] = {}
    pending: dict[str, tuple[tuple, dict]] = {}
    parents: dict[str, str | None] = {}
    hooks = []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        name = names[module]
        parents.setdefault(name, stack[-1] if stack else None)
        stack.append(name)
        if name not in calls and name not in pending:
            memo: dict[int, Tensor] = {}
            pending[name] = (_detached(args, memo), _detached(kwargs, memo))  # type: ignore[assignment]

    def after(module: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
        name = stack.pop()
        if name in pending:
            a, k = pending.pop(name)
            calls[name] = (a, k, _detached(out, {}))

    for m in model.modules():
        hooks.append(m.register_forward_pre_hook(before, with_kwargs=True))
        hooks.append(m.register_forward_hook(after, with_kwargs=True))
    watch = _Watch(stack)
    was_training = model.training
    # the run writes into buffers in place (a KV cache filled by the prefill), with autograd on: each layer is checked
    # as the model holds it, so every buffer gets its value back, without the run's autograd history
    kept = [(b, b.detach().clone()) for b in model.buffers()]
    # and every attribute a call replaces (a memory of the last segment kept in an object of the model's own, as
    # GTrXL's; a cache grown by torch.cat): each run meets the model as it was given
    state = module_state(model)
    try:
        model.eval()
        try:
            with watch:  # with autograd on: torch's fused inference paths (nn.TransformerEncoderLayer's) stay off
                model(*args, **kwargs)
        except NotImplementedError as err:  # a kernel with no backward on this device (FlexAttention on CPU):
            if not NO_BACKWARD_HERE.search(str(err)):  # run with it written out in plain operations
                raise
            with flex_written_out(model), watch:
                model(*args, **kwargs)
    except Exception as err:
        raise CannotRun(f"the model failed on the example inputs: {type(err).__name__}: {err}") from err
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
        with torch.no_grad():
            restore(state)
            for buffer, value in kept:
                if buffer.grad_fn is not None or buffer.requires_grad:
                    try:
                        buffer.detach_()
                    except RuntimeError:  # a view of another tensor: that one's history is its own
                        continue
                if buffer.shape == value.shape:
                    buffer.copy_(value)
    return calls, parents, list(watch.found)


def _nan_on_real_tokens(layer: Layer, pad: Tensor | None) -> Finding | None:
    """non-finite when, in the model's own run, the layer gave NaN or inf on real tokens (every token when the model's
    inputs mark no padding) whose input was finite: what an earlier layer left NaN in the padded positions (a query
    with every key hidden, filled with -inf) reaches them through the keys and values, since a weight of 0 times NaN
    is NaN; or the model's own mask, read the other way round (a 0 / -inf causal mask subtracted), lifts keys to
    +inf."""
    y = _first_tensor(layer.output)
    hidden = layer.hidden
    if y is None or not isinstance(hidden, Tensor) or y.shape != hidden.shape or y.dim() != 3 or \
            not y.is_floating_point():
        return None
    fresh = (~torch.isfinite(y) & torch.isfinite(hidden)).any(-1)
    if layer.sequence_first:
        fresh = fresh.transpose(0, 1)
    if pad is None:
        pad = torch.zeros(fresh.shape, dtype=torch.bool)
    if tuple(fresh.shape) != tuple(pad.shape):
        return None
    real = fresh.cpu() & ~pad.cpu()
    if not bool(real.any()):
        return None
    return Finding.of(NON_FINITE, "as the model runs it on its example inputs, the layer's output is NaN or inf on "
                      f"{int(real.sum())} real token(s) whose input is finite: NaN in the padded positions' keys or "
                      "values (a padded query left with no visible key by an earlier layer, its scores filled with "
                      "-inf) reaches them, since a weight of 0 times NaN is NaN, or the mask the model passes, read "
                      "the other way round, lifts some keys to +inf",
                      {"real tokens with NaN or inf (item, token)": real.nonzero().tolist()[:10],
                       "padded positions' inputs non-finite": int((~torch.isfinite(hidden)).any(-1).sum())})


def _sibling_key(name: str) -> str:
    """The layer's place with its indices left out: the blocks of one stack share it (``layers.0.attn``,
    ``layers.1.attn``), an encoder's and a decoder's do not."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _width(layer: Layer) -> int | None:
    """E of the (B, L, E) (or (L, B, E)) hidden states the model called the layer with; None for another shape."""
    hidden = layer.hidden
    return int(hidden.shape[-1]) if isinstance(hidden, Tensor) and hidden.dim() == 3 else None


def _not_self_attention(layer: Layer) -> str | None:
    """Why the layer is not self-attention (its output rows do not depend on the other tokens of its input: a
    cross-attention over a sequence the model passes in), or None; judged once per layer."""
    if layer.not_self is None:
        layer.not_self = (_judge_self_attention(layer),)
    return layer.not_self[0]


def _judge_self_attention(layer: Layer) -> str | None:
    """:func:`_not_self_attention`, run. A layer whose all-zero parameters (a norm's weight initialised at 0, as
    LeViT's) silence its output is judged on a copy with them drawn at random."""
    hidden = layer.hidden
    if hidden.dim() >= 2 and hidden.shape[0 if layer.sequence_first else 1] == 1:
        return ("called with one token: an attention pooling's query over tokens the model passes in (a "
                "cross-attention), or one decoding step; no tokens of its own to attend between")
    if not _rows_independent(layer, layer.module):
        return None
    zeros = [p for p in layer.module.parameters() if p.numel() and not p.any()]
    if zeros:
        module = copy_module(layer.module)
        draw_zeros(module, torch.Generator().manual_seed(0))
        if not _rows_independent(layer, module):
            return None
    return ("its output rows do not depend on the other tokens of its input: a cross-attention over another "
            "sequence, or a mixture of per-token parts (a router)")


@contextmanager
def _evaluated(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode (dropout on would make every run differ) and autograd off, its mode put back after."""
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


def _floats_of(value: object) -> list[Tensor]:
    """The floating tensors in a model's output (a tensor, tuples, lists, dicts and ModelOutput), in order."""
    if isinstance(value, Tensor):
        return [value] if value.is_floating_point() or value.is_complex() else []
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _floats_of(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _floats_of(v)]
    return []


def _model_zeros_drawn(model: nn.Module) -> nn.Module:
    """``model`` itself, or a copy whose all-zero parameters are drawn (:func:`draw_zeros`): a gain initialised at 0
    (LayerScale, adaLN-Zero) silences what follows it in a fresh model, which is not what the model does trained."""
    if not any(p.numel() and not bool(p.any()) for p in model.parameters()):
        return model
    try:
        drawn = copy_module(model)
    except Exception:  # a model that cannot be copied is read as it is
        return model
    draw_zeros(drawn, torch.Generator().manual_seed(0))
    return drawn


def _model_outputs(model: nn.Module, args: tuple, kwargs: dict, layer: str | None = None) -> list[Tensor] | None:
    """The floating outputs of the model run in eval mode, its buffers (a cache the run writes in place) given their
    values back; with ``layer``, that layer's output changed by a hook (None when the hook could not change it, or
    the run fails: the model ran on these inputs before, so such a failure says nothing of the layer)."""
    hit: list[bool] = []

    def changed(mod: nn.Module, inputs: tuple, out: object) -> object:
        if isinstance(out, Tensor) and out.is_floating_point():
            hit.append(True)
            return out + 1.0 + out.abs()
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor) and out[0].is_floating_point():
            hit.append(True)
            return type(out)([out[0] + 1.0 + out[0].abs(), *out[1:]])
        return out  # an output this hook cannot change (a dict, a dataclass): nothing is concluded

    kept = [(b, b.detach().clone()) for b in model.buffers()]
    state = module_state(model)
    handle = None if layer is None else model.get_submodule(layer).register_forward_hook(changed)
    try:
        with _evaluated(model):
            outputs = _floats_of(model(*args, **kwargs))
    except Exception:
        return None
    finally:
        if handle is not None:
            handle.remove()
        with torch.no_grad():
            restore(state)
            for buffer, value in kept:
                if buffer.shape == value.shape:
                    buffer.copy_(value)
    return None if layer is not None and not hit else outputs


def _output_unused(base: list[Tensor] | None, other: list[Tensor] | None) -> bool:
    """Are the model's outputs ``other``, with a layer's output changed, the same as ``base`` (the layer's attention
    never reaches them: a block that drops it, a residual that adds the input twice)? Only finite outputs, and a
    change the hook made, conclude (:func:`_model_outputs`)."""
    if not base or other is None or len(base) != len(other) or not all(bool(torch.isfinite(t).all()) for t in base):
        return False  # an output with NaN or inf says nothing of what reaches it
    return all(a.shape == b.shape and bool(torch.equal(a.nan_to_num(), b.nan_to_num()))
               for a, b in zip(base, other, strict=True))


def _rows_independent(layer: Layer, module: nn.Module) -> bool:
    """Does each output row of ``module`` (the layer or a copy of it), called as the model called the layer, stay
    the same when another token of its input changes?"""
    hidden = layer.hidden
    if layer.sequence_first and hidden.dim() == 3:  # the replay takes (B, L, E) and hands the layer (L, B, E)
        hidden = hidden.transpose(0, 1)
    if hidden.shape[1] < 2:
        return False
    call = layer.adapter()
    try:
        with _evaluated(module):
            a = _first_tensor(call(module, hidden))
            # the tokens on dim 1 (batch first), dim 0 (sequence first, as torch's default), or, in a 4-D input,
            # dim 2 (groups of tokens: MaxViT's (B, G, P, E) partitions)
            for dim in (1, 0, *range(2, hidden.dim() - 1)):
                for at in (0, hidden.shape[dim] - 1):  # the first token and the last (a mask that shows the future
                    changed = hidden.clone()  # only: the last one reaches every row)
                    changed.select(dim, at).add_(1.0)
                    b = _first_tensor(call(module, changed))
                    if a is None or b is None or a.shape != b.shape:
                        return False
                    others = torch.tensor([i for i in range(a.shape[dim]) if i != at], dtype=torch.long)
                    kept_a, kept_b = a.index_select(dim, others.to(a.device)), b.index_select(dim, others.to(b.device))
                    # NaN where it was NaN is unchanged (a query the mask hides entirely, LoFTR's padded rows); an
                    # output all NaN says nothing (NaN an earlier layer spread everywhere)
                    if not bool(torch.isfinite(a).any()) or \
                            not bool(((kept_a == kept_b) | (kept_a.isnan() & kept_b.isnan())).all()):
                        return False
    except Exception:  # the doctor's own run will say what fails
        return False
    return True


def _padding(kwargs: dict) -> Tensor | None:
    """(B, L) bool, True = padding, from a padding mask among the model's keyword inputs (``attention_mask`` 1 =
    token, as transformers takes it; ``key_padding_mask`` / ``padding_mask`` True = padding), or from each item's
    length beside token ids (B, L), when it pads some positions of some item and not all; else None."""
    for key, value in kwargs.items():
        if key not in MASK_NAMES or not isinstance(value, Tensor) or value.dim() != 2:
            continue
        pad = value.bool() if "padding" in key else ~value.bool()
        if bool(pad.any()) and bool((~pad).any(-1).all()):
            return pad
        if "padding" not in key and "attention" not in key and _at_the_ends(~pad):
            # a name that says no polarity (`mask`): True = padding, as torch's key_padding_mask, when that is the
            # reading that pads a run at one end of some items and leaves every item a token
            return ~pad
    tokens = next((v for v in kwargs.values() if isinstance(v, Tensor) and v.dim() == 2 and not v.is_floating_point()),
                  None)  # token ids (B, L) beside each item's length (d2l's valid_lens)
    for key, value in kwargs.items():
        if key in LENGTH_NAMES and isinstance(value, Tensor) and value.dim() == 1 and tokens is not None and \
                value.shape[0] == tokens.shape[0] and not value.is_floating_point():
            at = torch.arange(tokens.shape[1], device=value.device)[None, :]
            # padded on the right (d2l) or on the left (fairseq's encoders): the side whose padded positions all
            # hold one token id, the padding's
            for pad in (at >= value[:, None], at < tokens.shape[1] - value[:, None]):
                held = tokens.to(value.device)[pad]
                if bool(pad.any()) and bool((~pad).any(-1).all()) and bool((held == held[0]).all()):
                    return pad.cpu()
    return None


def _at_the_ends(pad: Tensor) -> bool:
    """Does (B, L) bool ``pad`` pad a run at one end of some items, and leave every item a token?"""
    if not bool(pad.any()) or not bool((~pad).any(-1).all()):
        return False
    return all(not at or (at == list(range(at[0], at[-1] + 1)) and (at[0] == 0 or at[-1] == len(item) - 1))
               for item in pad for at in [item.nonzero().flatten().tolist()])


def _padding_of_ids(model: nn.Module, kwargs: dict) -> Tensor | None:
    """(B, L) bool, True = padding, from token ids (B, L) among the model's inputs (when none of them is a mask or
    lengths) and the ``padding_idx`` of an embedding of the model: the positions holding it, when they are a run at
    one end of some items, two or more in one, and every item keeps a real token; else None."""
    if any(k in MASK_NAMES or k in LENGTH_NAMES for k in kwargs):  # the inputs say where the padding is
        return None
    indices = {m.padding_idx: m.num_embeddings for m in model.modules()
               if isinstance(m, nn.Embedding) and m.padding_idx is not None}
    ids = [v for v in kwargs.values() if isinstance(v, Tensor) and v.dim() == 2 and not v.is_floating_point() and
           v.dtype != torch.bool]
    for value in ids if len(ids) == 1 else []:  # two sequences of ids (a source and a target): whose is unknown
        for index, size in indices.items():
            if int(value.min()) < 0 or int(value.max()) >= size:
                continue
            pad = (value == index).cpu()
            # a run of two or more somewhere: one id at an item's end may be a token drawn at random
            if int(pad.sum(-1).max()) < 2 or not bool((~pad).any(-1).all()):
                continue
            if _at_the_ends(pad):
                return pad
    return None


def _padding_in_mask(layer: Layer) -> Tensor | None:
    """(B, L) bool, True = padding, read from the mask the model passes the layer when the model's inputs name none
    (a speech encoder given lengths, a model that pads inside): per item, the last query row of a mask (B, ..., L)
    with two values, the keep value being the one that fills a whole item, the other a run of keys at one end of
    some item; else None."""
    params = _parameters(layer.module)
    # the mask argument first; then any other the model passes under a mask's name (SpeechBrain's wrapper of
    # nn.MultiheadAttention: attn_mask is the mask argument, the padding goes to key_padding_mask)
    named = [v for k, v in [*((params[i] if i < len(params) else None, a) for i, a in enumerate(layer.args)),
                            *layer.kwargs.items()] if k in MASK_NAMES and k != layer.mask]
    for given in (layer.recorded_mask(), *named):
        pad = _padding_in(given, layer)
        if pad is not None:
            return pad
    return None


def _padding_in(given: object, layer: Layer) -> Tensor | None:
    """:func:`_padding_in_mask` for one recorded tensor; a column (B, ..., L, 1) is read as its row (a padding mask
    the model lays out on the query axis is still the model's padding)."""
    if isinstance(given, Tensor) and given.dim() >= 3 and given.shape[-1] == 1 and given.shape[-2] == layer.length:
        given = given[..., 0]
    if not isinstance(given, Tensor) or given.dim() < 2 or given.shape[0] != layer.batch or layer.batch < 2 or \
            given.shape[-1] != layer.length or given.is_complex():
        return None
    rows = given.detach().reshape(given.shape[0], -1, given.shape[-1])[:, -1].cpu()
    whole = [r for r in rows if bool((r == r[0]).all())]
    if not whole or len(whole) == len(rows):
        return None
    pad = rows != whole[0][0]
    for item in pad:
        at = item.nonzero().flatten().tolist()
        if at and (at != list(range(at[0], at[-1] + 1)) or (at[0] > 0 and at[-1] < len(item) - 1)):
            return None  # not one run at the start or the end
    if not bool((~pad).any(-1).all()):
        return None
    return pad


def _carries_padding(t: object, pad: Tensor) -> bool:
    """Is ``t`` the model's padding in some form: a tensor (B or 1, ..., L), or (B * H, L, L), whose last query row
    marks exactly the padded keys of each item (bool either way round, 1/0, or an additive 0 / large negative), or a
    column (B, ..., L, 1) that does?"""
    b = pad.shape[0]
    if isinstance(t, Tensor) and t.dim() >= 3 and t.shape[-1] == 1 and t.shape[-2] == pad.shape[1] != 1:
        t = t.transpose(-1, -2)  # a column (B, ..., L, 1): the padding as a row the layer turns it into
    if not isinstance(t, Tensor) or t.dim() < 2 or t.shape[-1] != pad.shape[1] or t.is_complex() or \
            not (t.shape[0] in (1, b) or (t.dim() >= 3 and t.shape[0] > b and t.shape[0] % b == 0)):
        return False
    # (B, ..., L), or (B * H, L, L) with the heads folded into the batch item-major (nn.MultiheadAttention's attn_mask)
    items = t.shape[0] if t.shape[0] in (1, b) else b
    rows = t.detach().reshape(items, -1, t.shape[-1])[:, -1].expand(b, -1).cpu()
    for item, padded in zip(rows, pad.cpu(), strict=True):
        if not bool(padded.any()):
            continue
        at_pad, at_real = item[padded], item[~padded]
        two_valued = bool((at_pad == at_pad[0]).all()) and bool((at_real == at_real[0]).all()) and \
            bool(at_pad[0] != at_real[0])
        # or a bias with the padding added into it (T5's position_bias): hidden keys far below every visible one
        added = at_pad.is_floating_point() and bool((at_pad <= -1e4).all()) and bool((at_real > -1e4).all())
        if not (two_valued or added):
            return _columns_pad(t, pad)
    return True


def _columns_pad(t: Tensor, pad: Tensor) -> bool:
    """Is ``t`` a float bias (B or 1, ..., L, L) that hides each padded item's padded keys from every query and shows
    each of its real keys to some query: padding added into a windowed causal bias, whose last query no longer reaches
    the padded keys on the left?"""
    b, length = pad.shape
    if not t.is_floating_point() or t.dim() < 3 or t.shape[-2] != length or t.shape[0] not in (1, b):
        return False
    hidden = (t.detach().reshape(t.shape[0], -1, length, length)[:, 0] <= -1e4).expand(b, -1, -1).cpu()
    for item, padded in zip(hidden, pad.cpu(), strict=True):
        if bool(padded.any()) and not (bool(item[:, padded].all()) and bool((~item[:, ~padded]).any(0).all())):
            return False
    return True


def _column_form(layer: Layer, pad: Tensor | None) -> str | None:
    """The mask form (``"keep (B,1,L,1)"``) of a model that hands its layer the padding as a column (B, 1, L, 1), one
    flag per key, which the layer turns into a row itself (``mask.transpose(-1, -2)``); None for any other mask. The
    layer alone reads a (B, 1, 1, L) or (B, 1, L, L) mask transposed, which only the column explains."""
    t = layer.recorded_mask()
    if pad is None or not isinstance(t, Tensor) or t.dim() != 4 or t.shape[1] != 1 or t.shape[-1] != 1 or \
            tuple(t.shape[::2]) != tuple(pad.shape) or not bool(pad.any()):
        return None
    col, pad = t[:, 0, :, 0].detach().cpu(), pad.cpu()
    at_pad, at_real = col[pad], col[~pad]
    if col.dtype == torch.bool:
        kind = "ignore" if bool(at_pad.all()) and not bool(at_real.any()) else \
            "keep" if bool(at_real.all()) and not bool(at_pad.any()) else None
    elif col.is_floating_point():
        kind = "keep-float" if bool((at_pad == 0).all()) and bool((at_real == 1).all()) else \
            "additive" if bool((at_pad <= -1e4).all()) and bool((at_real == 0).all()) else None
    else:
        kind = "keep-int" if bool((at_pad == 0).all()) and bool((at_real == 1).all()) else None
    return None if kind is None else f"{kind} (B,1,L,1)"


def _pads_queries(t: object, pad: Tensor) -> bool:
    """Is ``t`` a mask (B, ..., L, L) that hides every key of exactly the padded queries of each padded item, and
    leaves some padded key visible to a real query: the model's padding laid out on the query axis?"""
    if not isinstance(t, Tensor) or t.dim() < 3 or t.shape[0] != pad.shape[0] or \
            t.shape[-1] != t.shape[-2] or t.shape[-1] != pad.shape[1] or t.is_complex():
        return False
    first = t.detach().reshape(t.shape[0], -1, *t.shape[-2:])[:, 0].cpu()  # (B, L, L): the first head's
    items = [b for b in range(pad.shape[0]) if bool(pad[b].any())]
    readings = [first, ~first] if first.dtype == torch.bool else [first <= -1e4] if first.is_floating_point() else []
    for hidden in readings:
        if items and all(torch.equal(hidden[b].all(-1), pad[b].cpu()) for b in items) and \
                any(not bool(hidden[b][~pad[b].cpu()][:, pad[b].cpu()].all()) for b in items):
            return True
    return False


def _replay(layer: Layer) -> Callable[[Tensor], Tensor | None]:
    """The layer's recorded call as the model made it (its own mask and arguments, in their own dtypes), on other
    hidden states."""
    def run(x: Tensor) -> Tensor | None:
        args = [x if i in layer.x else a for i, a in enumerate(layer.args)]
        kwargs = {k: x if k in layer.x else v for k, v in layer.kwargs.items()}
        return _first_tensor(layer.module(*args, **kwargs))

    return run


# the longest recorded call whose dependencies are read token by token (one run of the layer per token: a model
# that pads to a window of 512, as Longformer does, is left to the layer's own probes)
_READ_AS_CALLED = 256


def _as_called(layer: Layer, pad: Tensor | None) -> tuple[Tensor, Tensor, Tensor, int] | None:
    """Replay the layer's recorded call as the model made it (its own mask, switches and arguments) and read which
    tokens each output row of the first item without padding depends on: (dep (L, L), the output, the hidden states
    used, that item); None when the call cannot be replayed so (fewer than 4 tokens, every item padded, or the layer
    fails). A layer called sequence first is read batch first. Hidden states an earlier layer left NaN are replaced
    by other states."""
    slots = [*enumerate(layer.args), *layer.kwargs.items()]
    hidden = next(a for k, a in slots if k in layer.x)
    if hidden.dim() != 3:
        return None
    if layer.sequence_first:  # (L, B, E) as called (ChatGLM's, torch's batch_first=False): read batch first
        hidden = hidden.transpose(0, 1)
    if not 4 <= hidden.shape[1] <= _READ_AS_CALLED:
        return None
    items = [b for b in range(hidden.shape[0]) if pad is None or b >= pad.shape[0] or not bool(pad[b].any())]
    if not items:
        return None
    if not bool(torch.isfinite(hidden).all()):
        hidden = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5)).to(hidden)
    replayed = _replay(layer)

    def run(x: Tensor) -> Tensor | None:
        if not layer.sequence_first:
            return replayed(x)
        out = replayed(x.transpose(0, 1))
        return None if out is None else out.transpose(0, 1)

    try:
        with _evaluated(layer.module):
            base = run(hidden)
            if base is None:
                return None
            dep = dependency(lambda x: run(x), hidden, item=items[0],  # type: ignore[arg-type,return-value]
                             rtol=1e-5 if hidden.dtype == torch.float32 else 1e-2)
    except Exception:  # the layer's own report says what fails
        return None
    return dep, base, hidden, items[0]


def _stack_of(name: str) -> str:
    """The layer's place in its stack, without the layer's index: ``decoder.block.#.SelfAttention``."""
    return ".".join("#" if part.isdigit() else part for part in name.split("."))


def _odd_one_out(report: ModelReport, causal_as_called: dict[str, bool]) -> dict[str, Finding]:
    """Layers of one class in one stack that see future keys as the model calls them, where another layer of that
    stack is causal as the model calls it: the model left out one layer's causal mask (or that layer ignores the
    causal switch the model passes). Stacks that differ by name stay apart (T5's bidirectional encoder and causal
    decoder share a class)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in causal_as_called:
        groups.setdefault((report.classes.get(name, ""), _stack_of(name)), []).append(name)
    found: dict[str, Finding] = {}
    for names in groups.values():
        causal = [n for n in names if causal_as_called[n]]
        if not causal or len(causal) == len(names):
            continue
        for name in names:
            if not causal_as_called[name]:
                found[name] = Finding.of(CAUSAL_LEAK, "called as the model calls it, this layer sees future keys while "
                                         f"{len(causal)} other layer(s) of its stack are causal "
                                         f"({', '.join(causal[:3])}): the model leaves out this layer's causal mask, "
                                         "or the layer ignores the causal switch the model passes",
                                         {"causal layers of this stack": causal})
    return found


def _models_causal_mask(layer: Layer, read: tuple[Tensor, Tensor, Tensor, int] | None,
                        causal: bool = False) -> Finding | None:
    """Read ``read``, the layer's recorded call replayed with the model's own mask (:func:`_as_called`: which tokens
    each output row of an item without padding depends on): a mask that hides most of the future but shows the next
    tokens (a causal mask
    built off by one, ``triu(2)`` for ``triu(1)``), one that hides the diagonal too (``triu(0)``), or the causal
    pattern transposed, is a causal-leak the model builds; the layer's own probes, which replace that mask with the
    doctor's, cannot see it. ``causal``: the user said the model is causal, so any future key seen is a leak (a
    model that passes only its key padding mask to layers that drop their own causal pattern when given one)."""
    given = layer.recorded_mask()
    if read is None or not isinstance(given, Tensor):
        return None
    dep, base, hidden, item = read
    length = dep.shape[0]
    what = f"{given.dtype} {tuple(given.shape)}"
    # a causal mask that hides the diagonal too (triu(0) for triu(1)) leaves the first query no key: NaN with a -inf
    # fill, every key alike with a finite one; the later rows see only the past (row 1 key 0 alone, whatever q_1)
    later = dep[1:] & future(length)[1:]
    if length > 2 and not bool(later.any()) and not bool(dep[1, 1]) and bool(dep[1, 0]):
        empty = base.shape == hidden.shape and not bool(torch.isfinite(base[item, 0]).all())
        if empty or bool(dep[0].all()):
            return Finding.of(CAUSAL_LEAK, "called as the model calls it, with the model's own mask, no query sees its "
                              "own key: the causal mask the model builds hides the diagonal (triu(0) for triu(1)), so "
                              "the first query has no key at all" + (" (its output is NaN)" if empty else
                                                                     " and its weight spreads over every key"),
                              {"query 1 depends on": "token 0 only", "mask the model passes": what})
    ahead = band(dep)
    if causal and bool((dep & future(length)).any()) and not (ahead is not None and ahead[0] == length - 1 and
                                                              0 < ahead[1] < length - 1):
        return Finding.of(CAUSAL_LEAK, "called as the model calls it, with the model's own mask, queries see future "
                          "keys: the mask the model passes does not carry causality, and the layer drops its own "
                          "causal pattern when it gets a mask (or the model's causal mask is built wrong)",
                          {"future (query, key) pairs seen": (dep & future(length)).nonzero().tolist()[:10],
                           "mask the model passes": what})
    if ahead is not None and ahead[0] == length - 1 and 0 < ahead[1] < length - 1:
        return Finding.of(CAUSAL_LEAK, f"called as the model calls it, with the model's own mask, each query sees the "
                          f"next {ahead[1]} token(s) and no later one: the causal mask the model builds is off by "
                          "one", {"each query sees": f"keys <= i + {ahead[1]}", "mask the model passes": what})
    behind = band(dep.T)
    if not torch.equal(dep, dep.T) and behind is not None and behind[1] == 0 and behind[0] > 0:
        return Finding.of(CAUSAL_LEAK, "called as the model calls it, with the model's own mask, queries see later "
                          "keys and miss earlier ones: the model's causal mask is transposed",
                          {"mask the model passes": what})
    # the causal mask's complement (``> 0.5`` for ``< 0.5``): each query sees only the keys after it (its own token
    # reaches it through its query, unless one key is all it sees), and the last one, with no key left, weighs every
    # key alike under a finite fill (NaN under -inf)
    after = future(length).to(dep.device)
    before = after.T
    last_empty = bool(dep[-1].all()) or (base.shape == hidden.shape and not bool(torch.isfinite(base[item, -1]).all()))
    if length > 3 and bool(dep[:-1][after[:-1]].all()) and not bool(dep[:-1][before[:-1]].any()) and last_empty:
        return Finding.of(CAUSAL_LEAK, "called as the model calls it, with the model's own mask, each query sees only "
                          "the keys after it, and the last query none: the model's causal mask is read the other way "
                          "round (it hides the past and the query's own key, and shows the future)",
                          {"mask the model passes": what, "last query": "weighs every key alike"})
    return None


def _padding_moves(layer: Layer, pad: Tensor) -> tuple[float, float] | None:
    """Replay the layer's recorded call as the model made it with the hidden states of the padded positions changed:
    (the largest change of a real token's output, the largest output); None when the call cannot be replayed so
    (not the model's tokens, or the layer fails)."""
    hidden = layer.hidden
    pad = pad.T if layer.sequence_first else pad  # the states (L, B, E): the padding on their first two axes
    if tuple(hidden.shape[:2]) != tuple(pad.shape) or hidden.dim() != 3:
        return None
    if not bool(torch.isfinite(hidden).all()):  # an earlier layer's NaN rows (this bug's own): other states
        hidden = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5)).to(hidden)
    run = _replay(layer)
    try:
        with _evaluated(layer.module):
            base = run(hidden)
            noise = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3)).to(hidden)
            moved = run(torch.where(pad.to(hidden.device)[..., None], hidden + noise * hidden.std(), hidden))
    except Exception:  # the layer's own report says what fails
        return None
    if base is None or moved is None or base.shape != hidden.shape or moved.shape != hidden.shape:
        return None
    real = ~pad.to(base.device)[..., None] & torch.isfinite(base) & torch.isfinite(moved)  # a row with no key: NaN
    if not bool(real.any()):
        return None
    return float((moved - base)[real].abs().max()), float(base[real].abs().max())


def _real_rows_empty(layer: Layer, pad: Tensor) -> bool:
    """Replay the layer's recorded call as the model made it: is every real token's output of the padded items NaN
    or inf, or every token's of an item the model does not pad (the model's mask leaves them no key: a padding mask
    read the other way round)?"""
    hidden = layer.hidden
    p = pad.T if layer.sequence_first else pad
    if tuple(hidden.shape[:2]) != tuple(p.shape) or hidden.dim() != 3 or not bool(torch.isfinite(hidden).all()):
        return False
    try:
        with _evaluated(layer.module):
            base = _replay(layer)(hidden)
    except Exception:  # the layer's own report says what fails
        return False
    if base is None or base.shape != hidden.shape:
        return False
    padded = p.any(0 if layer.sequence_first else 1)  # the items with padding
    items = padded.nonzero().flatten().tolist()
    if not items:
        return False
    finite = torch.isfinite(base).all(-1).cpu()  # (B, L) or (L, B)
    real = ~p.cpu()
    rows = [finite[:, b][real[:, b]] if layer.sequence_first else finite[b][real[b]] for b in items]
    if all(r.numel() and not bool(r.any()) for r in rows):
        return True
    # or an item with no padding whose every token gets NaN, or one output for all its tokens (a kernel that gives 0
    # where no key is seen): the mask hides all its keys (a keep-mask handed to torch's src_key_padding_mask: all
    # True for an item the model does not pad). One output for every token of every item is no mask's doing: an
    # output projection at 0 (initialised so) gives its bias everywhere
    def one_output(out: Tensor, given: Tensor) -> bool:
        flat = float((out - out[:1]).abs().max()) <= 1e-6 * (1 + float(out.abs().max()))
        varied = float((given - given[:1]).abs().max()) > 1e-3 * (1 + float(given.abs().max()))
        return bool(torch.isfinite(out).all()) and flat and varied

    constant = one_output(base.reshape(-1, base.shape[-1]), hidden.reshape(-1, hidden.shape[-1]))
    for b in (~padded).nonzero().flatten().tolist():
        out, given = (base[:, b], hidden[:, b]) if layer.sequence_first else (base[b], hidden[b])
        if not bool(torch.isfinite(out).any()):
            return True
        if not constant and one_output(out, given):
            return True
    return False


def _padded_item_as_called(layer: Layer, pad: Tensor) -> tuple[int, Tensor] | None:
    """Replay the layer's recorded call as the model made it: (item, which tokens each token's output depends on,
    (L, L)) for the first padded item with two real tokens; None when there is none or the replay fails."""
    hidden = layer.hidden
    if layer.sequence_first or hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(pad.shape) or \
            not bool(torch.isfinite(hidden).all()) or hidden.shape[1] > _READ_AS_CALLED:
        return None
    items = [b for b in range(pad.shape[0]) if bool(pad[b].any()) and int((~pad[b]).sum()) >= 2]
    if not items:
        return None
    run = _replay(layer)
    try:
        with _evaluated(layer.module):
            dep = dependency(lambda x: run(x), hidden, item=items[0],  # type: ignore[arg-type,return-value]
                             rtol=1e-5 if hidden.dtype == torch.float32 else 1e-2)
    except Exception:  # the layer's own report says what fails
        return None
    return items[0], dep.cpu()


def _real_keys_seen(layer: Layer, pad: Tensor) -> bool:
    """Replay the layer's recorded call as the model made it: does a real token of a padded item depend on another
    real token there? Then the mask the model passes does not hide the real tokens: it leaves the padding visible
    (built from another item's padding, or given in a form the layer does not read as a mask), which is not a mask
    read the other way round."""
    found = _padded_item_as_called(layer, pad)
    if found is None:
        return False
    item, dep = found
    real = ~pad[item].cpu()
    among = dep[real][:, real] & ~torch.eye(int(real.sum()), dtype=torch.bool)
    return bool(among.any())


def _bias_read_inverted(layer: Layer, pad: Tensor, bias: Tensor) -> bool:
    """Is ``bias``, an additive (B, ..., L, L) bias carrying the model's padding in an argument other than the mask,
    read the other way round (subtracted): as the model calls the layer, does each real token of a padded item
    depend on exactly the other keys the bias hides?"""
    length = pad.shape[1]
    if not isinstance(bias, Tensor) or not bias.is_floating_point() or bias.dim() < 3 or \
            bias.shape[-1] != length or bias.shape[-2] not in (1, length) or bias.shape[0] not in (1, pad.shape[0]):
        return False
    found = _padded_item_as_called(layer, pad)
    if found is None:
        return False
    item, dep = found
    rows = bias.detach().reshape(bias.shape[0], -1, *bias.shape[-2:])[min(item, bias.shape[0] - 1), 0]
    hides = (rows <= -1e4).expand(length, length).cpu()  # a key bias (.., 1, L): the same for every query
    off = ~torch.eye(length, dtype=torch.bool)
    real = [i for i in (~pad[item]).nonzero().flatten().tolist() if bool((hides[i] & off[i]).any())]
    return bool(real) and all(torch.equal(dep[i] & off[i], hides[i] & off[i]) for i in real)


def _padding_elsewhere(layer: Layer, pad: Tensor, report: Report) -> str | None:
    """The argument through which the layer takes the model's padding when its own mask argument is read by no
    operation (T5's later layers: the padding added into the ``position_bias`` the first layer returns), and the
    replay with the padded tokens changed leaves the real tokens' outputs as they were; else None."""
    if not any(_unread(f) for f in report.findings):
        return None
    slots = [*enumerate(layer.args), *layer.kwargs.items()]
    name = next((k for k, v in slots if k not in layer.x and k != layer.mask and _carries_padding(v, pad)), None)
    moved = None if name is None else _padding_moves(layer, pad)
    if name is None or moved is None or moved[0] > 1e-4 * (1 + moved[1]):
        return None
    return _parameter_name(layer, name)


def _unread(finding: Finding) -> bool:
    """Is ``finding`` a mask-ignored whose mask no operation of the layer read?"""
    return finding.id == MASK_IGNORED.id and any("no operation read it" in str(v) for v in finding.evidence.values())


def _parameter_name(layer: Layer, key: int | str) -> str:
    """The forward parameter a recorded argument went to: its keyword, or the name of its position."""
    params = _parameters(layer.module)
    return str(params[key] if isinstance(key, int) and key < len(params) else key)


def _mask_carried_by(layer: Layer, report: Report) -> str | None:
    """The argument that carries the model's mask into the layer when the layer's own mask argument is read by no
    operation: another recorded tensor that hides exactly the keys the recorded mask hides (T5's later decoder
    layers: the causal mask and the padding added into the ``position_bias`` the first layer returns); else None."""
    given = layer.recorded_mask()
    if not any(_unread(f) for f in report.findings) or not isinstance(given, Tensor) or given.dim() < 2 or \
            given.is_complex():
        return None
    hidden = given <= -1e4 if given.is_floating_point() else None
    if hidden is None or not bool(hidden.any()):
        return None
    for key, value in [*enumerate(layer.args), *layer.kwargs.items()]:
        if key in layer.x or key == layer.mask or not isinstance(value, Tensor) or value is given or \
                not value.is_floating_point() or value.dim() < 2:
            continue
        try:
            shape = torch.broadcast_shapes(hidden.shape, value.shape)
        except RuntimeError:
            continue
        if torch.equal(hidden.expand(shape), (value <= -1e4).expand(shape)):
            return _parameter_name(layer, key)
    return None


def _mask_unused(layer: Layer, report: Report) -> bool:
    """Is ``report``'s mask-ignored only that no operation read the doctor's mask, where the model passes this layer
    no mask, or one that hides nothing (one value throughout: T5's later layers, given the padding in their position
    bias; a layer built with masking off, as TSLib's ``FullAttention(mask_flag=False)``)?"""
    ignored = [f for f in report.findings if f.id == MASK_IGNORED.id]
    if not ignored or not all(_unread(f) for f in ignored):
        return False
    given = layer.recorded_mask()
    if given is None:
        return True
    if not isinstance(given, Tensor) or given.numel() == 0 or given.is_complex():
        return False
    return bool((given == given.flatten()[0]).all())


def _amended(report: Report, notes: dict | None = None, drop: str | None = None, add: Finding | None = None,
             coverage: dict | None = None) -> Report:
    """``report`` with ``notes`` added to what it inferred, the findings of id ``drop`` taken out, ``add`` added
    (unless one of its id is there) and ``coverage`` updated."""
    findings = [f for f in report.findings if f.id != drop]
    if add is not None and all(f.id != add.id for f in findings):
        findings = merge([*findings, add])  # a symptom the layer's own diagnosis explains is folded into it
    return Report.of({**report.inferred, **(notes or {})}, findings, report.not_verified,
                     {**report.coverage, **(coverage or {})}, report.seconds)


def _t5_sibling(report: Report, done: dict[str, Report], classes: dict[str, str], name: str) -> bool:
    """Is ``report``'s one error missing-scale, with a position term, where a layer of the same class in this model
    has T5's unscaled design (the one that owns the bucketed bias table; the others are given its bias)?"""
    if [f.id for f in report.findings if f.severity == "error"] != [MISSING_SCALE.id] or \
            "position term" not in str(report.inferred):
        return False
    return any(classes.get(other) == classes.get(name) and "T5" in str(r.inferred.get("design", {}).get("scale", ""))
               for other, r in done.items() if other != name)


# errors of a layer that mix tokens or items whatever the mask (the padding then reaches the real tokens)
_MIXERS = frozenset({HEAD_MERGE.id, HEAD_SPLIT.id, SOFTMAX_DIM.id, BATCH_MIXING.id})


def _reads_the_models_padding(layer: Layer, pad: Tensor, report: Report) -> Finding | None:
    """Replay the layer's recorded call as the model made it (its own mask, in its own dtype and values) with the
    hidden states of the padded positions changed: the real tokens' outputs must not change. The model's mask is
    what the layer's mask argument got, or else any argument that carries the padding (a bias named ``attn_bias``).
    A layer whose own mask convention is right reads the model's mask the other way round when they do (a bool
    keep-mask read as True = masked, an additive mask subtracted); a layer that reads no mask (``report``, the
    layer's own, found none, or found it ignored) ignores the model's."""
    slots = [*enumerate(layer.args), *layer.kwargs.items()]
    given = next((v for k, v in slots if k == layer.mask), None)
    if given is None:
        given = next((v for k, v in slots if k not in layer.x and _carries_padding(v, pad)), None)
    on_queries = None if given is not None else \
        next((v for k, v in slots if k not in layer.x and _pads_queries(v, pad)), None)
    if not isinstance(given, Tensor):  # the model's inputs carry padding and this layer gets none of it (or only
        moved = _padding_moves(layer, pad)  # on the queries' axis): the padded tokens must still not reach the real
        if moved is None or not moved[0] > 1e-4 * (1 + moved[1]):  # ones (a causal layer hides right padding)
            return None
        change, scale = moved
        if isinstance(on_queries, Tensor):
            return Finding.of(MASK_BROADCAST, "called as the model calls it, the layer lets the padded tokens change "
                              "the real tokens' outputs: the mask the model builds hides the padded queries' rows "
                              "and no key (laid out on the query axis)", {
                                  "mask the model passes": f"{on_queries.dtype} {tuple(on_queries.shape)}",
                                  "largest change of a real token's output": change, "output scale": scale})
        return Finding.of(MASK_IGNORED, "called as the model calls it, the layer lets the padded tokens change the "
                          "real tokens' outputs: the model's inputs mark padding, and the model passes this layer "
                          "nothing that hides it", {"largest change of a real token's output": change,
                                                    "output scale": scale})
    what = f"{given.dtype} {tuple(given.shape)}"
    if _real_rows_empty(layer, pad):
        return Finding.of(MASK_INVERTED, "called as the model calls it, every real token of the padded items (or of "
                          "an item with no padding) gets a NaN output: the mask the model passes hides all their keys "
                          "(the padding kept, the tokens hidden: a padding mask read the other way round)",
                          {"mask the model passes": what})
    moved = _padding_moves(layer, pad)
    if moved is None:
        return None
    change, scale = moved
    if not change > 1e-4 * (1 + scale):
        return None
    column = given.dim() >= 3 and given.shape[-1] == 1 and given.shape[-2] == pad.shape[1] > 1
    if column or _pads_queries(given, pad):
        return Finding.of(MASK_BROADCAST, "called as the model calls it, the layer lets the padded tokens change the "
                          "real tokens' outputs: the model's mask is laid out on the query axis ((B, 1, L, 1), or "
                          "(B, 1, L, L) with the padded queries' rows hidden), so it hides padded queries' rows and "
                          "no key", {"mask the model passes": what, "largest change of a real token's output": change})
    reads = report.inferred.get("mask")
    # padding carried in another argument (an attn_bias) whose hidden keys are the only ones a real token sees: that
    # bias is read the other way round (subtracted), whatever the layer's own mask argument does
    carried_inverted = all(v is not given for k, v in slots if k == layer.mask) and \
        _bias_read_inverted(layer, pad, given)
    if (MASK_IGNORED.id in report.ids or not (isinstance(reads, dict) and "convention" in reads) or
            _real_keys_seen(layer, pad)) and not carried_inverted:
        name = next((k for k, v in slots if v is given), None)
        return Finding.of(MASK_IGNORED, "called as the model calls it, the layer lets the padded tokens change the "
                          f"real tokens' outputs: the model passes its padding (argument {name!r}) and the layer does "
                          "not apply it", {"mask the model passes": what, "output scale": scale,
                                           "largest change of a real token's output": change})
    return Finding.of(MASK_INVERTED, "called as the model calls it, the layer lets the padded tokens change the real "
                      "tokens' outputs: it reads the mask the model passes the other way round (its own convention "
                      "differs from the model's: polarity or sign)",
                      {"mask the model passes": what, "largest change of a real token's output": change,
                       "output scale": scale})


def _inputs(example_inputs: object) -> tuple[tuple, dict]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, Tensor):
        return (example_inputs,), {}
    raise TypeError("example_inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
                    f"arguments, got {type(example_inputs).__name__}")


@dataclass
class ModelReport:
    """What :func:`check_model` found: one :class:`~selfattn.check.Report` per attention layer.

    ``layers``: qualified name -> report; ``classes``: name -> the layer's class; ``could_not_run``: the
    layers the doctor could not call (name -> why); ``not_self_attention``: attention layers whose output does not
    mix the tokens of their own input (cross-attention over another sequence), not checked; ``findings``: what the
    whole model does wrong outside its layers (with ``causal=True``: earlier outputs that change with a later token);
    ``verdict``: "failed" when a layer failed or the model has an error finding, else
    "inconclusive" when a layer is inconclusive or could not run, or none was checked, else "passed".
    """

    layers: dict[str, Report] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)
    could_not_run: dict[str, str] = field(default_factory=dict)
    not_self_attention: dict[str, str] = field(default_factory=dict)
    # what the whole model does wrong outside its attention layers (a causal model whose pooling sees ahead)
    findings: list[Finding] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """"passed", "failed" or "inconclusive"."""
        verdicts = {r.verdict for r in self.layers.values()}
        if "failed" in verdicts or any(f.severity == "error" for f in self.findings):
            return "failed"
        return "inconclusive" if "inconclusive" in verdicts or self.could_not_run or not self.layers else "passed"

    @property
    def passed(self) -> bool:
        """Every attention layer was checked and passed."""
        return self.verdict == "passed"

    def summary(self) -> list[dict]:
        """One row per layer: {"layer", "class", "verdict", "findings"}."""
        rows = [{"layer": n, "class": self.classes[n], "verdict": r.verdict, "findings": sorted(r.ids)}
                for n, r in self.layers.items()]
        rows += [{"layer": n, "class": self.classes[n], "verdict": "could not run", "findings": [], "why": why}
                 for n, why in self.could_not_run.items()]
        rows += [{"layer": n, "class": self.classes[n], "verdict": "not checked", "findings": [], "why": why}
                 for n, why in self.not_self_attention.items()]
        return rows

    def to_dict(self) -> dict:
        """{"passed", "verdict", "summary", "layers": {name: report dict}, "could_not_run", "not_self_attention",
        "findings": the model's own, outside its layers}."""
        return {"passed": self.passed, "verdict": self.verdict, "summary": self.summary(),
                "layers": {n: r.to_dict() for n, r in self.layers.items()}, "could_not_run": self.could_not_run,
                "not_self_attention": self.not_self_attention, "findings": [f.to_dict() for f in self.findings]}

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=1, default=str)


def check_model(model: nn.Module, example_inputs: object, *, layers: int | Sequence[str] | None = None,
                **options: Any) -> ModelReport:
    """Find every attention layer of ``model`` by behaviour and check each with the call the model makes.

    Args:
        model: the model, with its real weights (they are not changed; the probes run in eval mode).
        example_inputs: what the model's forward takes: a tensor, a tuple of positional arguments, or a
            dict of keyword arguments (e.g. ``{"input_ids": ids}``). Use a batch of 2 or more and a
            length other than the batch size: the layers are probed at those sizes when their call carries
            tensors of them (position embeddings, cache positions).
        layers: check only the first ``layers`` attention layers, or those of these qualified names
            (default: every one).
        **options: :func:`~selfattn.check.check`'s options (``causal``, ``mask``, ``seed``, ...), the same for
            every layer; ``call`` is not one (the model's own call is replayed).

    Returns:
        The :class:`ModelReport`.

    Raises:
        CannotRun: the model fails on the example inputs, or no attention layer was found.
        ValueError: an option is not one :func:`~selfattn.check.check` takes, or is ``call``.

    Example:
        >>> report = selfattn.check_model(model, {"input_ids": torch.randint(0, 100, (2, 7))})
        >>> report.verdict, report.summary()
    """
    if "call" in options:
        raise ValueError("check_model replays the call the model makes to each layer: do not give call= (check the "
                         "layer with selfattn.check(layer, call=...) instead)")
    allowed = set(inspect.signature(check).parameters) - {"target", "call", "init"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"check_model does not take {', '.join(unknown)}; its options are "
                         f"{', '.join(sorted(allowed))}")
    with _in_eval(model):  # closures the model passes its layers (a sublayer's lambda) reach modules in eval mode
        return _checked(model, example_inputs, layers, options)


@contextmanager
def _in_eval(model: nn.Module) -> Iterator[None]:
    """``model`` and every submodule in eval mode while inside, each given back its own mode after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _checked(model: nn.Module, example_inputs: object, layers: int | Sequence[str] | None,
             options: dict[str, Any]) -> ModelReport:
    """:func:`check_model` with its options checked, the model in eval mode."""
    missed: list[str] = []
    model, quantized = dequantized(model)  # the model's own runs too (its padding read as it calls each layer)
    found = find_attention(model, example_inputs, missed)
    if not found and len(list(model.modules())) == 1 and hasattr(model, "get_layer"):
        raise CannotRun("no attention layer found: the model registers no torch submodule (a Keras functional model "
                        "keeps its layers apart from torch's), so the doctor cannot see inside it; check its "
                        "attention layers one by one (model.get_layer(name)), or a block built as a layer")
    if not found:
        raise CannotRun("no attention layer found: no submodule multiplied softmax weights into a tensor or ran an "
                        "attention kernel on the example inputs, while mapping hidden states (B, L, E) to that shape")
    crossing = {layer.name: why for layer in found if (why := _not_self_attention(layer)) is not None}
    if isinstance(layers, int):
        found = [layer for layer in found if layer.name not in crossing][:layers]
    elif layers is not None:
        wanted = set(layers)
        missing = wanted - {layer.name for layer in found}
        if missing:
            raise ValueError(f"no attention layer named {', '.join(sorted(missing))}; found: "
                             f"{', '.join(layer.name for layer in found)}")
        found = [layer for layer in found if layer.name in wanted]
    report = ModelReport()
    for name in missed if layers is None else []:  # attention the doctor cannot call on (B, L, E) -> (B, L, E)
        report.classes[name] = type(model.get_submodule(name)).__name__
        report.could_not_run[name] = ("it runs an attention, but neither it nor a module above it maps hidden "
                                      "states (B, L, E) to an output of that shape (a width that changes, E_in -> "
                                      "E_out, as Set Transformer's first block): the doctor checks attention that "
                                      "keeps the width; check the module alone with --call")
    args, kwargs = _inputs(example_inputs)
    try:  # the model's inputs by name, positional ones too
        signature = inspect.signature(model.forward)
        named = dict(signature.bind_partial(*args, **kwargs).arguments)
        for name, param in signature.parameters.items():  # what a forward(..., **kw) takes by name, by its name
            if param.kind is param.VAR_KEYWORD and isinstance(named.get(name), dict):
                named = {**{k: v for k, v in named.items() if k != name}, **named[name]}
    except (TypeError, ValueError):
        named = kwargs
    pad = _padding(named)
    if pad is None:  # token ids holding an embedding's padding index
        pad = _padding_of_ids(model, named)
    siblings_pad: dict[str, Tensor] = {}  # per stack of layers: the padding the model passes one of them
    for layer in found:
        if layer.name not in crossing and (own := _padding_in_mask(layer)) is not None:
            siblings_pad.setdefault(_sibling_key(layer.name), own)
    causal_as_called: dict[str, bool] = {}  # per layer: does it hide every future key as the model calls it?
    drawn: nn.Module | None = None  # the model with its all-zero parameters drawn, made when first needed
    outputs: dict[int, list[Tensor] | None] = {}  # the outputs of the model and of that copy, by id
    for layer in found:
        report.classes[layer.name] = type(layer.module).__name__
        if layer.name in crossing:
            report.not_self_attention[layer.name] = crossing[layer.name]
            continue
        pad_here = pad if pad is not None and tuple(pad.shape) == (layer.batch, layer.length) else \
            _padding_in_mask(layer)
        pad_here = pad if pad_here is None else pad_here
        sibling = siblings_pad.get(_sibling_key(layer.name))
        if pad_here is None and sibling is not None and tuple(sibling.shape) == (layer.batch, layer.length):
            pad_here = sibling  # none in its own call: the padding the model passes the other blocks of its stack
        # a call that carries tensors of the recorded sizes is replayed at them: (B, L), or (L, B) for a layer
        # the model calls sequence first (XLNet's); one that carries numbers (a feature map's (H, W)) at the
        # recorded length first, so that a size that lines up with them by chance is not a shape limit; any
        # other at the doctor's own sizes, then at the recorded ones
        recorded = {"length": layer.tokens or layer.length}
        if layer.extras:
            tries = [{"batch": layer.batch, "length": layer.length}, {"batch": layer.length, "length": layer.batch}]
        elif layer.sizes:
            tries = [recorded, {}]
        else:
            tries = [{}, recorded]
        for sized in tries:
            try:
                given = {k: v for k, v in options.items() if v is not None or k not in sized}
                if given.get("embed_dim") is None and (width := _width(layer)) is not None:
                    given["embed_dim"] = width  # the hidden states' width as the model called it
                if given.get("mask") is None and (column := _column_form(layer, pad_here)) is not None:
                    given["mask"] = column  # the padding as a column, which the layer lays on its keys
                causal = bool(options.get("causal"))
                done = check(layer.module, call=layer.adapter(causal, pad_here), **{**sized, **given})
                if "length" not in sized and options.get("length") is None and _shape_limited(done):
                    # it runs only at sizes that line up with its heads or width, and the model called it at one
                    # of them: the recorded length is the layer's own (a fixed window), as --length states it
                    retry = check(layer.module, call=layer.adapter(causal, pad_here), **{**given, **recorded})
                    done = retry if not _shape_limited(retry) else done
                report.layers[layer.name] = done
                report.could_not_run.pop(layer.name, None)
                done = report.layers[layer.name]
                elsewhere = None if pad_here is None else _padding_elsewhere(layer, pad_here, done)
                if elsewhere is not None:
                    done = _amended(done, {"model's padding": (
                        f"taken through {elsewhere!r}, which the model passes with its padding added in; the mask "
                        "argument is not read when it is given")}, drop=MASK_IGNORED.id, coverage={
                        "mask": "verified: the model's padding, through another argument",
                        "padding": "verified: as the model calls it, the padded tokens do not reach the real ones"})
                carried = _mask_carried_by(layer, done)
                if carried is not None:
                    done = _amended(done, {"model's mask": (
                        f"taken through {carried!r}, which the model passes with its mask added in (every key the "
                        "mask hides, hidden there too); the mask argument is not read when it is given")},
                        drop=MASK_IGNORED.id, coverage={
                            "mask": "verified: the model's mask, through another argument",
                            "padding": f"not applicable: the layer takes the model's mask through {carried!r}, not "
                                       "through its mask argument"})
                if _mask_unused(layer, done):
                    done = _amended(done, {"model's mask": (
                        "the model passes this layer no mask (or one that hides nothing), and the layer reads none: "
                        "not judged as the model calls it (give the model padded inputs to check its padding)")},
                        drop=MASK_IGNORED.id, coverage={
                            "mask": "not applicable: the model passes no mask that hides a key, and the layer reads "
                                    "none",
                            "padding": "not applicable: the model passes no mask that hides a key"})
                if pad_here is None and layer.mask is not None and layer.recorded_mask() is None and \
                        str(done.coverage.get("mask", "")).startswith("not verified"):
                    # a mask argument no tensor the doctor builds fits (a pair map's (B, N, N) mask), which the model
                    # leaves empty: as the model calls the layer, nothing is masked
                    done = _amended(done, {"model's mask": (
                        "the model passes this layer no mask, and it pads nothing; the layer's mask argument takes "
                        "no mask the doctor builds: not judged as the model calls it")}, coverage={
                            "mask": "not applicable: the model passes this layer no mask",
                            "padding": "not applicable: the model pads nothing"})
                if _t5_sibling(done, report.layers, report.classes, layer.name):
                    done = _amended(done, {"design": {**done.inferred.get("design", {}), "scale": (
                        "none on the scores, with the relative-position bias the model's first layer of this class "
                        "computes and passes on: T5's design")}}, drop=MISSING_SCALE.id)
                read = _as_called(layer, pad_here)
                if read is not None:  # a causal pattern (each row its own token and some earlier one), a leak, or
                    dep, ahead = read[0], future(read[0].shape[0])  # neither (rows left empty: not judged here)
                    if bool((dep & ahead).any()):
                        causal_as_called[layer.name] = False
                    elif bool(dep.diagonal().all()) and bool((dep & ~ahead).sum() > dep.shape[0]):
                        causal_as_called[layer.name] = True
                misread = None if pad_here is None else _reads_the_models_padding(layer, pad_here, done)
                if misread is not None and _MIXERS & done.ids:
                    # a layer that mixes tokens or items on its own (a merge without the transpose, a softmax over
                    # the heads and batch) lets the padding reach the real tokens whatever its mask: its own error
                    # says why, and the mask is not read the other way round for it
                    misread = None
                if misread is not None and misread.id == MASK_INVERTED.id:
                    # the symptoms of a padding read the other way round in every probe's call: padded keys seen,
                    # and the real keys' scores rounded away under the fill (a gradient autograd sees and no step
                    # does)
                    done = _amended(_amended(done, drop=MASK_IGNORED.id), drop=WRONG_GRADIENT.id)
                if drawn is None:  # the model's outputs, with its weights and with its all-zero ones drawn
                    drawn = _model_zeros_drawn(model)
                    outputs = {id(m): _model_outputs(m, args, kwargs) for m in (model, drawn)}
                # unused with the model's weights and with its all-zero ones drawn (a gain at 0 silences a layer)
                unused = None if not all(_output_unused(outputs[id(m)], _model_outputs(m, args, kwargs, layer.name))
                                         for m in dict.fromkeys((model, drawn))) else Finding.of(
                    NO_GRAD, "the model never uses this layer's output: changing it leaves every output of the model "
                    "as it was (a block that drops the attention's result, or adds its input in its place)",
                    {"layer": layer.name})
                for extra in (misread, _models_causal_mask(layer, read, causal), unused,
                              items_mixed_on_the_way(layer), _nan_on_real_tokens(layer, pad_here)):
                    done = _amended(done, add=extra)
                if quantized:
                    done = _amended(done, {"quantized": (
                        f"the model's {len(quantized)} Linear layer(s) of torch's dynamic quantization are checked "
                        "with their int8 weights dequantized into float layers (activations quantized per tensor "
                        "on the fly tie each item to the batch's range and make the output a step function)")})
                report.layers[layer.name] = done
                break
            except CannotRun as err:
                report.could_not_run.setdefault(layer.name, str(err))
    for name, extra in _odd_one_out(report, causal_as_called).items():
        odd = report.layers.get(name)
        if odd is not None:
            report.layers[name] = _amended(odd, add=extra)
    if options.get("causal") and args:
        leak = _sees_ahead(model, args, kwargs, sequence_first=bool(found) and found[0].sequence_first)
        if leak is not None:
            report.findings.append(leak)
    return report


def _sees_ahead(model: nn.Module, args: tuple, kwargs: dict, sequence_first: bool = False) -> Finding | None:
    """For a model the user says is causal: do its outputs at earlier positions change when a later token of its
    first input changes? Its attention layers may each be causal while a step between them (a pooling or a
    convolution without its causal shift, a shortening that averages a token with the next) lets the future in."""
    first = args[0]
    if not isinstance(first, Tensor) or first.dim() < 2:
        return None
    axis = 0 if sequence_first else 1
    length = first.shape[axis]
    if length < 3:
        return None

    def outputs(given: Tensor) -> list[Tensor]:
        with torch.no_grad():
            out = model(given, *args[1:], **kwargs)
        leaves: list[Tensor] = []
        tree_map(lambda t: leaves.append(t) if isinstance(t, Tensor) and t.is_floating_point() else None, out)
        return leaves

    try:
        base = outputs(first)
        for at in sorted({length // 2, length - 2, length - 1}):  # the last two: pairs pooled at an odd length
            changed = first.clone()
            where = (slice(None),) * axis + (at,)
            if first.is_floating_point():
                changed[where] = changed[where] + torch.randn(changed[where].shape, generator=torch.Generator()
                                                              .manual_seed(3)).to(changed)
            else:
                changed[where] = (changed[where] + 1) % (int(first.max()) + 1)
            for a, b in zip(base, outputs(changed), strict=False):
                if a.shape != b.shape or a.dim() <= axis or a.shape[axis] != length:
                    continue
                before = (a.narrow(axis, 0, at).double() - b.narrow(axis, 0, at).double()).abs().nan_to_num(0.0)
                size = 1e-5 * (1 + float(a.double().abs().nan_to_num(0.0).max()))
                moved = before.movedim(axis, 0).reshape(at, -1).amax(-1)  # per earlier position
                if bool((moved > size).any()):
                    return Finding.of(CAUSAL_LEAK, f"the model's outputs at earlier positions change when token {at} "
                                      "changes, though each attention layer hides the future on its own: a step "
                                      "between them sees ahead (a pooling or convolution without its causal shift, "
                                      "tokens merged with later ones)",
                                      {"changed token": at, "earlier positions that change":
                                       (moved > size).nonzero().flatten().tolist()[:10],
                                       "largest change": float(before.max())})
    except Exception:  # a model that refuses the changed input: nothing to say
        return None
    return None


def _shape_limited(report: Report) -> bool:
    """Did the layer run only at some of the sizes tried (a shape-dependent or batch-mixing finding with the
    sizes it failed for)?"""
    return any(f.id in (SHAPE_DEPENDENT.id, BATCH_MIXING.id) and "fails for" in f.evidence for f in report.findings)


def render_model(report: ModelReport, console: Console) -> None:
    """Print the summary table, then each layer's report that did not pass.

    Args:
        report: what :func:`check_model` returned.
        console: a ``rich.console.Console`` to print to.
    """
    from rich.table import Table

    table = Table(title="attention layers")
    for col in ("layer", "class", "verdict", "findings"):
        table.add_column(col)
    colours = {"passed": "green", "failed": "red"}
    for row in report.summary():
        colour = colours.get(row["verdict"], "yellow")
        table.add_row(row["layer"], row["class"], f"[{colour}]{row['verdict']}[/{colour}]",
                      ", ".join(row["findings"]) or row.get("why", "")[:120])
    console.print(table)
    for name, r in report.layers.items():
        if r.verdict != "passed":
            console.rule(name)
            render(r, console)
    for finding in report.findings:
        console.rule("the whole model")
        console.print(f"[red]{finding.id}[/red]: {finding.message}\nevidence: {finding.evidence}\nfix: {finding.fix}")
    console.print(f"verdict: {report.verdict} ({len(report.layers)} layer(s) checked, "
                  f"{len(report.could_not_run)} could not run)")

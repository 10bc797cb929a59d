"""A record of every torch operation a module runs, as a graph the white box can walk.

:class:`Trace` is a ``TorchFunctionMode``: while the module runs it records each operation's name,
its tensor inputs and outputs and its other arguments. A tensor is known by its identity *and its
version* (torch bumps a tensor's version at every in-place change), so the graph can be walked from
a tensor to the operation that made the value it held when it was read: after ``q /= sqrt(d)`` or an
in-place rotary (``q[..., :d] = ...``), the product reads the new q, made by that operation, while an
operation that ran before reads the old one. Every recorded value is a copy taken when the
operation ran (the inputs of an in-place operation before it ran), so later in-place changes
(``scores.masked_fill_``, ``mask.eq_(0)``) rewrite nothing recorded. Weight-carrying leaf modules
that do not go through ``F.linear`` (transformers' ``Conv1D``) are recorded by a forward hook.

Walking back from a tensor through layout operations (view, transpose, split, ...),
multiplications by a number and by zeros and ones (padded positions zeroed) finds where it came
from and by how much it was scaled on the way.

Shape legend: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .._seams import base_of, version
from ..subject.building import name_role
from ..subject.flex import flex_written_out

__all__ = ["LAYOUT", "PRODUCTS", "SOFTMAX", "Linear", "Op", "Origin", "Trace", "fused_order", "key", "linears",
           "normalises", "record"]

PRODUCTS = frozenset({"matmul", "bmm", "einsum", "baddbmm", "rmatmul"})
SOFTMAX = frozenset({"softmax", "_softmax"})
# operations that move or copy values without changing them (a view, a cast, a copy, a slice)
LAYOUT = frozenset({"view", "reshape", "transpose", "permute", "contiguous", "clone", "to", "float", "double", "half",
                    "bfloat16", "type", "type_as", "expand", "expand_as", "unsqueeze", "squeeze", "flatten",
                    "unflatten", "movedim", "swapaxes", "swapdims", "t", "split", "chunk", "unbind", "getitem",
                    "narrow", "select", "repeat_interleave", "detach", "dropout", "view_as", "reshape_as", "mT",
                    "tensor_split", "split_with_sizes",
                    # their in-place forms change the tensor's shape, not its values (y.transpose_(1, 2))
                    "transpose_", "t_", "squeeze_", "unsqueeze_", "swapaxes_", "swapdims_"})
_SCALARS = frozenset({"mul", "rmul", "div", "truediv", "mul_", "div_", "imul", "itruediv"})
_TEMPLATE_ONLY = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like",
                            "empty_like", "full_like", "rand_like", "randn_like", "randint_like"})
_TEMPLATE_SECOND = frozenset({"to", "type_as", "expand_as", "view_as", "reshape_as"})
_KEEP = PRODUCTS | SOFTMAX | {"scaled_dot_product_attention", "linear", "addmm", "multi_head_attention_forward"}


_VERSION_BITS = 32
# operations that write into their first argument (besides the torch names ending in "_")
_IN_PLACE = frozenset({"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "ipow", "iand", "ior", "ixor",
                       "imod", "ilshift", "irshift", "imatmul"})


def _wrapped(t: Tensor) -> bool:
    """Is ``t`` a tensor of a torch.func transform (a vmap's batched tensor), which no record may keep?"""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(t))


def key(t: Tensor, at: int | None = None) -> int:
    """The identity of ``t`` at its version ``at`` (default: now) in a :class:`Trace`."""
    return id(t) << _VERSION_BITS | (version(t) if at is None else at)


def _raw(k: int) -> int:
    return k >> _VERSION_BITS


def _in_place(name: str, kwargs: dict) -> bool:
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE or "out" in kwargs


def _with_tensors(obj: Any, values: Iterator[Tensor]) -> Any:
    """``obj`` with its tensors (in :func:`_tensors` order) replaced by the next of ``values``."""
    if isinstance(obj, Tensor):
        return next(values)
    if isinstance(obj, (list, tuple)):
        items = [_with_tensors(o, values) for o in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: _with_tensors(v, values) for k, v in obj.items()}
    return obj


# torch's other names for one operation (torch.multiply, torch.divide: Keras's ops on its torch backend call them),
# read as the name the doctor knows it by
_ALIASES = {"multiply": "mul", "divide": "div", "true_divide": "div", "subtract": "sub", "negative": "neg",
            "multiply_": "mul_", "divide_": "div_", "true_divide_": "div_", "subtract_": "sub_", "negative_": "neg_",
            "concat": "cat", "concatenate": "cat", "swapaxes": "transpose", "swapdims": "transpose",
            "moveaxis": "movedim", "clip": "clamp", "absolute": "abs"}


def _name(func: Callable) -> str:
    name = getattr(func, "__name__", str(func))
    name = name.strip("_") if name.startswith("__") else name
    return _ALIASES.get(name, name)


def _tensors(obj: object) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


@dataclass(eq=False)  # compared by identity: their tensors make == ambiguous
class Op:
    """One recorded operation: its name, arguments (tensors detached; copied for the operations that matter),
    outputs, and the identities of the tensors it read and made (to walk the graph by)."""

    name: str
    args: tuple
    kwargs: dict
    outputs: list[Tensor]
    in_ids: list[int]
    out_ids: list[int]
    module: str = ""  # for hooked modules: the module's name

    @property
    def inputs(self) -> list[Tensor]:
        """The tensor arguments, in order (the same order as ``in_ids``)."""
        return [*_tensors(self.args), *_tensors(self.kwargs)]

    def number(self) -> float | None:
        """For a multiplication or division by a number: the factor it applies (1 / d for a division), else None."""
        if self.name not in _SCALARS or len(self.args) < 2:
            return None
        main = self.args[0] if isinstance(self.args[0], Tensor) and self.args[0].numel() > 1 else self.args[1]
        other = self.args[1] if main is self.args[0] else self.args[0]
        if isinstance(other, Tensor):
            if other.numel() == 0 or other.is_complex() or not other.is_floating_point():
                return None
            # a vector over the features broadcast onto the operand whose entries are all one number (TimesFM's
            # per-dimension scale at its initial value, 1/sqrt(D) in every entry) scales it by that number; not a
            # tensor over other axes (a count of visible keys per row), nor a vector of zeros (a gain at 0)
            if other.numel() > 1 and (not isinstance(main, Tensor) or other.numel() >= main.numel() or
                                      other.shape[-1] != main.shape[-1] or other.numel() != other.shape[-1] or
                                      not bool((other == other.reshape(-1)[0]).all()) or not bool(other.any())):
                return None
            other = float(other.reshape(-1)[0])
        if not isinstance(other, (int, float)) or isinstance(other, bool):
            return None
        if self.name in ("div", "truediv", "div_", "itruediv"):
            return 1.0 / other if other else None
        return float(other)

    def zeroed_input(self) -> int | None:
        """For a multiplication by a tensor of zeros and ones no larger than the other operand (padded positions
        zeroed: ``q *= 1 - padding_mask``): the identity of the other operand, else None."""
        if self.name not in ("mul", "rmul", "mul_", "imul") or len(self.in_ids) != 2:
            return None
        tensors = self.inputs
        if len(tensors) != 2:
            return None
        for at in (0, 1):
            ones, other = tensors[at], tensors[1 - at]
            if 0 < ones.numel() <= other.numel() and ones.numel() > 1 and not ones.is_complex() and \
                    bool(((ones == 0) | (ones == 1)).all()) and not bool(((other == 0) | (other == 1)).all()):
                return self.in_ids[1 - at]
        return None

    def value_inputs(self) -> list[int]:
        """The identities of the tensors whose values this operation reads: not a tensor it takes only as a template
        for a shape, dtype or device (``x.new_zeros(...)``, ``zeros_like(x)``, ``t.to(x)``, ``t.expand_as(x)``)."""
        if self.name in _TEMPLATE_ONLY:
            return []
        if self.name in _TEMPLATE_SECOND:
            return self.in_ids[:1]
        return list(self.in_ids)

    def mha_arguments(self) -> dict[str, Any]:
        """For a record of ``nn.functional.multi_head_attention_forward``: its arguments by name."""
        signature = inspect.signature(nn.functional.multi_head_attention_forward)
        return dict(signature.bind(*self.args, **self.kwargs).arguments)

    def main_input(self) -> int | None:
        """The identity of the tensor this operation transforms: the first tensor argument, or for a
        multiplication by a number the tensor one."""
        tensors = [(i, t) for i, t in zip(self.in_ids, self.inputs, strict=False)]
        if not tensors:
            return None
        if self.number() is not None:
            return max(tensors, key=lambda it: it[1].numel())[0]
        return tensors[0][0]


@dataclass
class Origin:
    """Where a tensor came from: the tensor at the end of a walk back through layout operations and
    multiplications by numbers, the product of those numbers, and the operation that made that tensor."""

    id: int
    factor: float
    op: Op | None
    part: int | None = None  # the index of this tensor among the outputs of a split / chunk / unbind / [i]
    parts: int | None = None  # how many parts that operation made
    after_rotation: float = 1.0  # of ``factor``, the numbers multiplied in right after a rotation (YaRN's mscale)


class Trace(TorchFunctionMode):
    """Records every torch operation while active; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        # id(tensor) -> [(version, op index, output index)] in the order made; per version the first maker wins
        self.made_by: dict[int, list[tuple[int, int, int]]] = {}
        self._alive: list[object] = []  # keeps recorded tensors alive, so that ids are not reused
        self.names: dict[int, str] = {}  # key of the output of an nn.Linear, a norm or hooked leaf -> its name
        self.parameters: set[int] = set()  # ids of the trained parameters (nn.Parameter, requires_grad) read
        self.transformed = False  # some operations ran inside torch.vmap (or another torch.func transform): unrecorded
        # the roles of a fused projection's parts, in order, as the module's source unpacks them (key, query, value =
        # self.kqv(x).chunk(3)); None when its source says nothing
        self.fused_order: tuple[str, ...] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        read = [*_tensors(args), *_tensors(kwargs)]
        if any(_wrapped(t) for t in read):  # inside torch.vmap or grad: values that do not outlive the transform
            self.transformed = True
            return func(*args, **kwargs)
        at = [version(t) for t in read]
        in_place = _in_place(name, kwargs)
        values = [t.detach().clone() for t in read] if in_place else None  # before it writes
        base = base_of(read[0]) if in_place and read else None
        base_before = base.detach().clone() if base is not None else None
        out = func(*args, **kwargs)
        if "axis" in kwargs and "dim" not in kwargs:  # torch's NumPy alias (softmax(x, axis=-1)): recorded as dim
            kwargs = {("dim" if k == "axis" else k): v for k, v in kwargs.items()}
        self.add(name, args, kwargs, out, read_at=at, read_values=values)
        if base is not None and base_before is not None:
            self._written_through_view(base, base_before, read[0], at[0])
        return out

    def _written_through_view(self, base: Tensor, before: Tensor, view: Tensor, at: int) -> None:
        """An in-place write into a view of ``base`` (``k[..., :d].copy_(k_pass)``, ``cache[:, pos].copy_(k)``)
        changed ``base`` too: recorded as a ``setitem`` that made its new version from its old one and the view
        written, so that a walk back from ``base`` finds what was written into it."""
        written = self.ops[-1]
        if not written.out_ids or version(base) == at:
            return
        self._alive.append(base)
        op = Op("setitem", (before, "view", written.outputs[0]), {}, [base.detach().clone()],
                [key(base, at), written.out_ids[0]], [key(base)])
        self.ops.append(op)
        entries = self.made_by.setdefault(id(base), [])
        if all(e[0] != version(base) for e in entries):
            entries.append((version(base), len(self.ops) - 1, 0))

    def add(self, name: str, args: tuple, kwargs: dict, out: object, module: str = "",
            read_at: list[int] | None = None, read_values: list[Tensor] | None = None) -> None:
        """Record one operation (also used by forward hooks): its inputs as they were read (``read_at``: their
        versions then, ``read_values``: their values then, for an operation that changed them in place)."""
        originals = [*_tensors(args), *_tensors(kwargs)]
        self.parameters.update(id(t) for t in originals if isinstance(t, torch.nn.Parameter) and t.requires_grad)
        made = list(_tensors(out))
        if not made and originals and _in_place(name, kwargs) and isinstance(args[0], Tensor):
            made = [args[0]]  # x[i] = y, x.index_copy_(...) returning None: the new value of x
        self._alive += [originals, made]
        at = read_at if read_at is not None else [version(t) for t in originals]
        values = iter(read_values if read_values is not None else [t.detach().clone() for t in originals])
        args, kwargs = _with_tensors(args, values), _with_tensors(kwargs, values)
        outputs = [t.detach().clone() for t in made]
        op = Op(name, args, kwargs, outputs, [key(t, v) for t, v in zip(originals, at, strict=True)],
                [key(t) for t in made], module)
        self.ops.append(op)
        index = len(self.ops) - 1
        for i, t in enumerate(made):
            entries, v = self.made_by.setdefault(id(t), []), version(t)
            same = [n for n, e in enumerate(entries) if e[0] == v]
            if not same:
                entries.append((v, index, i))
            elif module:  # a hooked module's output stands for the operations inside it
                entries[same[0]] = (v, index, i)

    def learned(self, tid: int, depth: int = 12) -> bool:
        """Whether the tensor ``tid`` is, or is computed from, a trained parameter of the module (a learned
        temperature ``logit_scale.exp()``, say), within ``depth`` operations."""
        if _raw(tid) in self.parameters:
            return True
        found = self.maker(tid)
        if found is None or depth == 0:
            return False
        return any(self.learned(i, depth - 1) for i in found[0].in_ids)

    def learned_number(self, op: Op) -> bool:
        """For a multiplication or division by a one-element tensor: whether that tensor is learned."""
        if op.number() is None:
            return False
        small = [(i, t) for i, t in zip(op.in_ids, op.inputs, strict=False) if t.numel() == 1]
        return len(small) == 1 and len(op.inputs) == 2 and self.learned(small[0][0])

    @staticmethod
    def identity(tid: int) -> int:
        """The ``id`` of the tensor a key (identity and version) names."""
        return _raw(tid)

    def maker(self, tid: int) -> tuple[Op, int] | None:
        """The operation that made the value the tensor ``tid`` (a key: identity and version) held, and its index
        among that operation's outputs, or None. A version bumped by an in-place change of another view of the
        same storage is still the value its last writer made."""
        found = self._made(tid)
        return None if found is None else (self.ops[found[0]], found[1])

    def _made(self, tid: int) -> tuple[int, int] | None:
        """(op index, output index) of the maker of ``tid``'s value, or None."""
        v = tid & ((1 << _VERSION_BITS) - 1)
        made = [e for e in self.made_by.get(_raw(tid), ()) if e[0] <= v]
        return max(made, key=lambda e: e[0])[1:] if made else None

    def origin(self, tid: int) -> Origin:
        """Walk back from a tensor through layout operations and multiplications by numbers."""
        factor, part, parts = 1.0, None, None
        for _ in range(200):
            found = self.maker(tid)
            if found is None:
                return Origin(tid, factor, None, part, parts)
            op, index = found
            number = op.number()
            src = op.main_input()
            if number is not None:
                factor *= number
            elif op.zeroed_input() is not None:  # padded positions zeroed: the values that stay are as they were
                src = op.zeroed_input()
            elif op.name not in LAYOUT or src is None:
                return Origin(tid, factor, op, part, parts)
            if op.name in ("split", "chunk", "unbind", "tensor_split", "split_with_sizes") and part is None:
                part, parts = index, len(op.outputs)
            elif op.name in ("getitem", "select") and part is None and len(op.args) > 1:
                key = op.args[1]
                first = key[0] if isinstance(key, tuple) and key else key
                if isinstance(first, int) and not isinstance(first, bool) and isinstance(op.args[0], Tensor) and \
                        op.args[0].dim() > 0:
                    part, parts = first % op.args[0].shape[0], op.args[0].shape[0]
            if src is None:
                return Origin(tid, factor, op, part, parts)
            tid = src
        return Origin(tid, factor, None, part, parts)

    def ancestors(self, tid: int, limit: int | None = None) -> Iterator[int]:
        """The tensors ``tid`` was computed from (keys), nearest first (breadth first), each once; at most
        ``limit`` of them."""
        todo, seen, count = [tid], {tid}, 0
        while todo:
            found = self.maker(todo.pop(0))
            for i in found[0].value_inputs() if found is not None else ():
                if i not in seen:
                    if limit is not None and count >= limit:
                        return
                    seen.add(i)
                    todo.append(i)
                    count += 1
                    yield i

    def consumers(self, tid: int) -> Iterator[tuple[Op, int]]:
        """The operations after the tensor ``tid`` was made that read it or a layout view of it (walking forward
        through layout operations), in order, each with the identity of the view it read; reads after an
        in-place change of that tensor read another value and are not its consumers."""
        raws = {_raw(tid)}
        found = self._made(tid)
        start = found[0] + 1 if found is not None else 0
        for op in self.ops[start:]:
            read = [i for i in op.in_ids if _raw(i) in raws]
            if read and op.out_ids:  # shape, size, dim(): reads no values
                if op.name in LAYOUT:
                    raws |= {_raw(o) for o in op.out_ids}
                else:
                    yield op, read[0]
            if _in_place(op.name, op.kwargs) and op.name not in LAYOUT:  # a layout in place: the same values
                raws -= {_raw(o) for o in op.out_ids}

    def value(self, tid: int) -> Tensor | None:
        """The recorded value of the tensor ``tid`` (an output of a recorded operation), or None."""
        found = self.maker(tid)
        return None if found is None else found[0].outputs[found[1]]

    def read_written_out_softmaxes(self) -> None:
        """Stand a softmax written out by hand (``e = exp(s - s.max(-1, keepdim=True)); e / e.sum(-1, keepdim=True)``)
        in for the division that ends it, so that it is read as the softmax it computes: over the summed dim, of the
        scores before a row maximum was subtracted (a softmax ignores a shift that is the same along its dim); and one
        written through its log (``exp(s - s.logsumexp(-1, keepdim=True))``) in for the exp."""
        for index, op in enumerate(self.ops):
            written = self._written_out_softmax(op)
            if written is not None:
                self.ops[index] = written

    def _log_normalised(self, op: Op) -> Op | None:
        """``exp(s - logsumexp(s, dim, keepdim=True))``: the softmax of s over dim, written through its log."""
        if op.name != "exp" or len(op.in_ids) != 1 or not op.outputs:
            return None
        shifted = self.maker(op.in_ids[0])
        if shifted is None or shifted[0].name != "sub" or len(shifted[0].in_ids) != 2:
            return None
        peak = self.maker(shifted[0].in_ids[1])
        if peak is None or peak[0].name != "logsumexp" or not peak[0].in_ids:
            return None
        dim = peak[0].args[1] if len(peak[0].args) > 1 else peak[0].kwargs.get("dim")
        dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
        keepdim = peak[0].args[2] if len(peak[0].args) > 2 else peak[0].kwargs.get("keepdim", False)
        if not isinstance(dim, int) or not keepdim:
            return None
        rank = op.outputs[0].dim()
        sink = peak[0].in_ids[0] != shifted[0].in_ids[0] and self._beside_sinks(peak[0].in_ids[0],
                                                                                shifted[0].in_ids[0], dim % rank)
        if peak[0].in_ids[0] != shifted[0].in_ids[0] and not sink:
            return None
        scores = shifted[0].inputs[0]
        return Op("softmax", (scores, dim % rank), {"sink": True} if sink else {}, op.outputs, [shifted[0].in_ids[0]],
                  op.out_ids, op.module)

    def _beside_sinks(self, joined: int, scores: int, dim: int) -> bool:
        """Is ``joined`` the scores ``scores`` with a few logits set beside them along ``dim`` (``cat((s, sink),
        -1)``: the log of a softmax's sum with sink logits in it, gpt-oss's attention sinks)?"""
        made = self.maker(joined)
        if made is None or made[0].name != "cat" or scores not in made[0].in_ids or not made[0].outputs:
            return False
        at = made[0].args[1] if len(made[0].args) > 1 else made[0].kwargs.get("dim", 0)
        parts = made[0].args[0] if made[0].args and isinstance(made[0].args[0], (tuple, list)) else ()
        rank = made[0].outputs[0].dim()
        if not isinstance(at, int) or at % rank != dim or len(parts) < 2:
            return False
        shown = [t for t in parts if isinstance(t, Tensor)]
        width = max(t.shape[dim] for t in shown)  # the scores' keys; the sinks a few logits beside them
        return sum(t.shape[dim] for t in shown) - width <= max(1, width // 4)

    def _written_out_softmax(self, op: Op) -> Op | None:
        if op.name == "exp":
            return self._log_normalised(op)
        if op.name != "div" or len(op.in_ids) != 2 or len(op.args) < 2 or \
                not all(isinstance(a, Tensor) for a in op.args[:2]) or not op.outputs:
            return None
        numerator, denominator = op.in_ids
        exp = self.maker(numerator)
        if exp is None or exp[0].name != "exp" or len(exp[0].in_ids) != 1:
            return None
        made = self.maker(denominator)
        sink = False  # one more term per row in the sum (softmax_1's 1, exp(-max) once shifted: a sink logit)
        if made is not None and made[0].name in ("add", "radd") and len(made[0].in_ids) == 2 and \
                all(isinstance(a, Tensor) for a in made[0].inputs[:2]):
            parts = [(i, t, self.maker(i)) for i, t in zip(made[0].in_ids, made[0].inputs[:2], strict=False)]
            summed = [m for _, _, m in parts if m is not None and m[0].name in ("sum", "unsqueeze")]
            extra = [t for _, t, m in parts if m is None or m[0].name not in ("sum", "unsqueeze")]
            if len(summed) == 1 and len(extra) == 1 and extra[0].dim() >= 1 and extra[0].shape[-1] == 1 and \
                    bool((extra[0] >= 0).all()):
                sink, made = True, summed[0]
        back_at = None  # a sum without keepdim, given its dim back by unsqueeze
        if made is not None and made[0].name == "unsqueeze" and len(made[0].args) > 1 and made[0].in_ids:
            back_at, made = made[0].args[1], self.maker(made[0].in_ids[0])
        if made is None or made[0].name != "sum" or made[0].in_ids[:1] != [numerator]:
            return None
        total = made[0]
        dim = total.args[1] if len(total.args) > 1 else total.kwargs.get("dim")
        dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
        keepdim = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
        rank = op.outputs[0].dim()
        if not isinstance(dim, int) or not isinstance(back_at, (int, type(None))) or \
                (back_at is None) == (not keepdim) or (back_at is not None and back_at % rank != dim % rank):
            return None
        scores_id, scores = exp[0].in_ids[0], exp[0].inputs[0]
        shifted = self.maker(scores_id)
        if shifted is not None and shifted[0].name == "sub" and len(shifted[0].in_ids) == 2:
            peak = self.maker(shifted[0].in_ids[1])
            if peak is not None and peak[0].name in ("max", "amax", "logsumexp") and \
                    peak[0].in_ids[:1] == shifted[0].in_ids[:1]:
                over = peak[0].args[1] if len(peak[0].args) > 1 else peak[0].kwargs.get("dim")
                over = over[0] if isinstance(over, (tuple, list)) and len(over) == 1 else over
                if over is None or (isinstance(over, int) and over % rank == dim % rank):
                    scores_id, scores = shifted[0].in_ids[0], shifted[0].inputs[0]
        return Op("softmax", (scores, dim % rank), {"sink": True} if sink else {}, op.outputs, [scores_id], op.out_ids,
                  op.module)


_UNPACKED = re.compile(r"^\s*\(?\s*(\w+)\s*,\s*(\w+)\s*,\s*(\w+)\s*\)?\s*=(?!=)(.*)$", re.M)
# what a right-hand side that takes a packed projection apart says (rather than a call returning three tensors
# already unpacked elsewhere: ``q, k, v = self.to_qkv(x)``)
_SPLITS = re.compile(r"\b(chunk|split|unbind|rearrange|unflatten|tensor_split|map)\s*\(|\[\s*0\s*\]|\.permute\s*\(")
_CALLED = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\s*\(")


@dataclass(frozen=True)
class _Unpacking:
    """An assignment to three names for three roles: where it is (file, line), the roles in order, and what its
    right-hand side says of the packed tensor: 2 it takes it apart, 1 it unpacks a name (``k, q, v = parts``), 0
    it names what a call returns (``q, k, v = self.to_qkv(x)``: unpacked elsewhere)."""

    where: tuple[str, int]
    order: tuple[str, ...]
    splits: int


def fused_order(module: nn.Module, ran: frozenset[tuple[str, int]] | None = None) -> tuple[str, ...] | None:
    """The roles (q, k, v) of a fused projection's three parts in the order the module's forward (or a submodule's,
    guided-diffusion's attention core, or a function of its file the forward calls) unpacks them (``key, query, value
    = self.kqv(x).chunk(3, dim=-1)`` gives k, q, v; an einops ``rearrange``, a ``map`` or ``kqv[0], kqv[1], kqv[2]``
    alike), else None. An assignment that takes a tensor apart is read before one that names what a call returns;
    where those disagree, the one on a line the run executed (``ran``: (file, line)), else the first."""
    splitting = _closest(module)
    if len({u.order for u in splitting}) > 1 and ran:
        splitting = [u for u in splitting if u.where in ran] or splitting
    return splitting[0].order if splitting else None


def _closest(module: nn.Module) -> list[_Unpacking]:
    """The unpackings of the module and its submodules that say most of the packed tensor (:class:`_Unpacking`)."""
    found = [u for part in module.modules() for u in _unpackings_of(type(part))]
    best = max((u.splits for u in found), default=0)
    return [u for u in found if u.splits == best]


def unpacking_files(module: nn.Module) -> frozenset[str] | None:
    """The files whose executed lines settle :func:`fused_order` (its candidates disagree), else None."""
    splitting = _closest(module)
    if len({u.order for u in splitting}) < 2:
        return None
    return frozenset(u.where[0] for u in splitting)


# class -> its forward's unpackings, read once a class (weakly: classes made on the fly may go)
_UNPACKINGS: weakref.WeakKeyDictionary[type, tuple[_Unpacking, ...]] = weakref.WeakKeyDictionary()


def _unpackings_of(cls: type) -> tuple[_Unpacking, ...]:
    """The unpackings in one class's forward and in the functions of its file that forward calls (read once per
    class: the record runs many times a check)."""
    if cls in _UNPACKINGS:
        return _UNPACKINGS[cls]
    found: list[_Unpacking] = []
    forward = getattr(cls, "forward", None)
    sources = [forward]
    try:
        own = inspect.getsource(forward)  # type: ignore[arg-type]
    except Exception:  # no Python source: a built-in, a TorchScript module's compiled forward
        own = ""
    namespace = vars(inspect.getmodule(cls)) if own and inspect.getmodule(cls) is not None else {}
    for name in dict.fromkeys(_CALLED.findall(own)):  # a function of the module's file that the forward calls
        fn = namespace.get(name)
        if inspect.isfunction(fn) and fn.__module__ == cls.__module__:
            sources.append(fn)
    for fn in sources:
        try:
            lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
            # the name the interpreter runs it under, as the line tracer sees it
            file = getattr(getattr(fn, "__code__", None), "co_filename", "")
        except Exception:
            continue
        text = "".join(lines)
        for m in _UNPACKED.finditer(text):
            roles = tuple(name_role(n) for n in m.groups()[:3])
            if None not in roles and len(set(roles)) == 3:
                line = first + text.count("\n", 0, m.start(1))
                rhs = m.group(4).split("#")[0]
                says = 2 if _SPLITS.search(rhs) else 1 if re.fullmatch(r"\s*\w+\s*", rhs) else 0
                found.append(_Unpacking((file, line), tuple(r for r in roles if r is not None), says))
    _UNPACKINGS[cls] = tuple(found)
    return _UNPACKINGS[cls]


@contextmanager
def _lines_run(files: frozenset[str] | None) -> Iterator[set[tuple[str, int]]]:
    """The (file, line) pairs of ``files`` that run inside the block; nothing is watched when ``files`` is None or
    another tracer (a debugger, coverage) is set, which is left alone."""
    ran: set[tuple[str, int]] = set()
    if not files or sys.gettrace() is not None:
        yield ran
        return

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            ran.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if event == "call" and frame.f_code.co_filename in files else None

    sys.settrace(calls)
    try:
        yield ran
    finally:
        sys.settrace(None)


def record(module: nn.Module, call: Callable[[], Tensor]) -> tuple[Trace, Tensor]:
    """Run ``call`` (which runs ``module``) under a :class:`Trace`, without gradients; returns (trace, output)."""
    trace = Trace()
    files = unpacking_files(module)  # the unpacking that ran settles the order where the source's disagree
    handles = []

    def named(mod: nn.Module, inp: tuple, out: object, name: str = "") -> None:
        if isinstance(out, Tensor):
            trace.names[key(out)] = name

    def leaf(mod: nn.Module, inp: tuple, out: object, name: str = "") -> None:
        trace.add("module", (inp[0],), {}, out, module=name)
        if isinstance(out, Tensor):
            trace.names[key(out)] = name

    for name, m in module.named_modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) or (name and "norm" in type(m).__name__.lower()):  # a norm of its own class
            handles.append(m.register_forward_hook(functools.partial(named, name=name)))  # too: its output named
        elif not list(m.children()) and isinstance(weight, Tensor) and weight.dim() == 2 and \
                not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):  # weight leaves not going through F.linear
            handles.append(m.register_forward_hook(functools.partial(leaf, name=name)))
    try:
        with torch.no_grad(), flex_written_out(module), trace, _lines_run(files) as ran:
            out = call()
    finally:
        for h in handles:
            h.remove()
    trace.fused_order = fused_order(module, frozenset(ran))
    trace.read_written_out_softmaxes()
    return trace, out


def normalises(module: nn.Module, call: Callable[[], Tensor]) -> bool:
    """Does a run of the module normalise its weights with a softmax (or an op that may: an attention kernel, a
    custom autograd function the trace does not enter)? False when it runs products and none of those (ReLU^2,
    sigmoid or linear attention, whose weights are exactly 0 wherever their scores say so); True when unsure."""
    try:
        trace, _ = record(module, call)
    except Exception:
        return True
    names = {op.name.lower() for op in trace.ops}
    if any("softmax" in n or "attention" in n or n == "apply" for n in names):
        return True
    return not names & PRODUCTS


def module_map(module: nn.Module, name: str) -> Callable[[Tensor], Tensor]:
    """A float64 copy of the submodule ``name`` of ``module``, as a function."""
    twin = copy.deepcopy(module.get_submodule(name)).double()
    return lambda t: twin(t)


@dataclass(eq=False)
class Linear:
    """A recorded linear map: its name, input (and the input's identity), output, and the map itself (float64)."""

    name: str
    input: Tensor
    input_id: int
    output: Tensor | None
    apply: Callable[[Tensor], Tensor] = field(repr=False)


_ADAPTER = re.compile(r"(^|\.)lora_(A|B)(\.|$)")  # peft's low-rank adapter factors: part of a projection, not one


def linears(trace: Trace, module: nn.Module) -> list[Linear]:
    """Every linear map in the record (``F.linear`` and hooked weight-carrying leaves), in order; the factors of a
    low-rank adapter beside a projection (peft's ``lora_A``, ``lora_B``) are left out."""
    found = []
    for op in trace.ops:
        if op.name == "linear" and len(op.args) >= 2:
            w = op.args[1].detach().double()
            b = op.args[2] if len(op.args) > 2 else op.kwargs.get("bias")
            bias = None if b is None else b.detach().double()
            name = trace.names.get(op.out_ids[0], "F.linear")
            if _ADAPTER.search(name):
                continue

            def apply(t: Tensor, w: Tensor = w, b: Tensor | None = bias) -> Tensor:
                return nn.functional.linear(t, w, b)
            found.append(Linear(name, op.args[0], op.in_ids[0], op.outputs[0], apply))
        elif op.module:
            found.append(Linear(op.module, op.args[0], op.in_ids[0], op.outputs[0], module_map(module, op.module)))
    return found

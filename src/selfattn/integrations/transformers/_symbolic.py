"""What a mask predicate computes, found by running it on symbolic positions.

transformers describes a mask as a predicate ``fn(batch_idx, head_idx, q_idx, kv_idx) -> bool``
written for index tensors (it must broadcast, or work under ``torch.vmap``). :func:`trace` calls
it once with :class:`Sym` stand-ins for the four indices; every operation on them (arithmetic,
comparisons, ``&``/``|``/``~``, indexing a tensor the predicate holds) records a node instead of
computing a value, so the result is the predicate's expression, whatever the functions that
built it are called or however they are wrapped. :func:`evaluate` runs an expression (or any
part of it) on real index tensors, elementwise, as ``torch.vmap`` would run the predicate.

Expressions are nested tuples (immutable, constants and tensors only):

- ``("b",)``, ``("h",)``, ``("q",)``, ``("kv",)``: the batch, head, query and key positions;
- ``("const", x)``: a number, a bool or a 0-dim tensor;
- ``("index", t, (e1, e2, ...))``: ``t[e1, e2, ...]`` elementwise (a tensor the predicate reads);
- ``(op, e1, e2)`` for ``add sub mul floordiv mod le lt ge gt eq ne and or xor``;
  ``(op, e)`` for ``neg abs not``.

A predicate that branches on a value (``if q_idx > 3``), calls an operation not listed here, or
returns something else raises :class:`Untraceable`; its caller evaluates it as it is instead.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["BINARY", "UNARY", "Sym", "Untraceable", "evaluate", "trace"]

Expr = tuple


class Untraceable(Exception):
    """The predicate does something a symbolic position cannot stand in for."""


BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "floordiv": operator.floordiv,
    "mod": operator.mod, "le": operator.le, "lt": operator.lt, "ge": operator.ge, "gt": operator.gt,
    "eq": operator.eq, "ne": operator.ne, "and": operator.and_, "or": operator.or_, "xor": operator.xor,
}
UNARY: dict[str, Callable[[Any], Any]] = {"neg": operator.neg, "abs": abs, "not": operator.invert}
_FLIP = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq", "ne": "ne"}


def _node(x: object) -> Expr:
    """The expression of an operand: a Sym's node, or a constant."""
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, Tensor):
        if x.dim() == 0:
            return ("const", x)
        raise Untraceable(f"a tensor of shape {tuple(x.shape)} used as a value, not indexed")
    if isinstance(x, (bool, int, float)):
        return ("const", x)
    raise Untraceable(f"an operand of type {type(x).__name__}")


class _Device:
    """What ``sym.device`` returns: ``.to(sym.device)`` and ``device=`` accept it and change nothing."""


_DEVICE = _Device()


class Sym:
    """A symbolic index (or a value computed from indices): operations record expression nodes."""

    __slots__ = ("node",)

    def __init__(self, node: Expr) -> None:
        self.node = node

    # arithmetic and comparisons, both operand orders
    def _bin(self, op: str, other: object, reflected: bool = False) -> Sym:
        a, b = self.node, _node(other)
        return Sym((op, b, a) if reflected else (op, a, b))

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __floordiv__(self, o): return self._bin("floordiv", o)
    def __rfloordiv__(self, o): return self._bin("floordiv", o, True)
    def __mod__(self, o): return self._bin("mod", o)
    def __rmod__(self, o): return self._bin("mod", o, True)
    def __and__(self, o): return self._bin("and", o)
    def __rand__(self, o): return self._bin("and", o, True)
    def __or__(self, o): return self._bin("or", o)
    def __ror__(self, o): return self._bin("or", o, True)
    def __xor__(self, o): return self._bin("xor", o)
    def __rxor__(self, o): return self._bin("xor", o, True)
    def __le__(self, o): return self._bin("le", o)
    def __lt__(self, o): return self._bin("lt", o)
    def __ge__(self, o): return self._bin("ge", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __eq__(self, o): return self._bin("eq", o)
    def __ne__(self, o): return self._bin("ne", o)
    def __neg__(self): return Sym(("neg", self.node))
    def __abs__(self): return Sym(("abs", self.node))
    def __invert__(self): return Sym(("not", self.node))

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        raise Untraceable("the predicate branches on a value")

    def __getitem__(self, idx: object) -> Sym:  # a row of an indexed tensor, indexed again (vmap style)
        node = self.node
        if node[0] != "index":
            raise Untraceable("indexing a computed value")
        more = idx if isinstance(idx, tuple) else (idx,)
        return Sym(("index", node[1], node[2] + tuple(_node(i) for i in more)))

    # the tensor methods transformers' predicates call
    @property
    def device(self) -> _Device:
        return _DEVICE

    def to(self, *args: Any, **kwargs: Any) -> Sym:
        return self

    def bool(self) -> Sym:
        return self

    def new_ones(self, size: Any = (), *, dtype: Any = None, **_: Any) -> Sym:
        return Sym(("const", True if dtype == torch.bool else 1))

    def new_zeros(self, size: Any = (), *, dtype: Any = None, **_: Any) -> Sym:
        return Sym(("const", False if dtype == torch.bool else 0))

    def abs(self) -> Sym:
        return abs(self)

    def logical_and(self, o: object) -> Sym:
        return self._bin("and", o)

    def logical_or(self, o: object) -> Sym:
        return self._bin("or", o)

    def logical_not(self) -> Sym:
        return ~self


def _symbolic(x: object) -> bool:
    return isinstance(x, Sym) or (isinstance(x, (tuple, list)) and any(_symbolic(i) for i in x))


class _Recording(TorchFunctionMode):
    """While a predicate runs on symbols: a torch operation with a symbolic operand (tensor indexing and the
    elementwise ops above) records a node; every other operation runs as it is.

    A mode rather than ``Sym.__torch_function__``: torch.compile traces a mode's ``__torch_function__``, but
    not indexing a tensor with an object that is not one (``position_ids[b, q]`` in transformers' packed-sequence
    predicates broke the graph)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not (_symbolic(args) or _symbolic(tuple(kwargs.values()))):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__getitem__" and isinstance(args[0], Tensor):
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            return Sym(("index", args[0], tuple(_node(i) for i in idx)))
        name = name.strip("_").removeprefix("logical_")
        if name in ("abs", "not", "neg", "bitwise_not", "invert") and len(args) == 1:
            return Sym(({"bitwise_not": "not", "invert": "not"}.get(name, name), _node(args[0])))
        name = {"add": "add", "sub": "sub", "mul": "mul", "floor_divide": "floordiv", "remainder": "mod",
                "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor", "rsub": "rsub"}.get(name, name)
        if len(args) == 2 and not kwargs and (name in BINARY or name in ("radd", "rsub", "rmul")):
            a, b = _node(args[0]), _node(args[1])
            if name.startswith("r") and name not in BINARY:
                return Sym((name[1:], b, a))
            return Sym((name, a, b))
        raise Untraceable(f"the predicate calls {getattr(func, '__qualname__', func)}")


def trace(fn: Callable) -> Expr:
    """The expression ``fn(b, h, q, kv)`` computes, or raise :class:`Untraceable`."""
    b, h, q, kv = Sym(("b",)), Sym(("h",)), Sym(("q",)), Sym(("kv",))
    try:
        with _Recording():
            out = fn(b, h, q, kv)
    except Untraceable:
        raise
    except Exception as e:  # the predicate did something a symbol cannot do (vmap-only code, data access)
        raise Untraceable(f"{type(e).__name__}: {e}") from e
    return _node(out)


def evaluate(expr: Expr, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """``expr`` on broadcastable index tensors (positions), elementwise; a bool or int tensor."""
    kind = expr[0]
    if kind == "b":
        return b
    if kind == "h":
        return h
    if kind == "q":
        return q
    if kind == "kv":
        return kv
    if kind == "const":
        value = expr[1]
        return value.to(q.device) if isinstance(value, Tensor) else torch.tensor(value, device=q.device)
    if kind == "index":
        t = expr[1].to(q.device)
        idx = [evaluate(e, b, h, q, kv) for e in expr[2]]
        return t[tuple(torch.broadcast_tensors(*idx))]
    if kind in UNARY:
        return UNARY[kind](evaluate(expr[1], b, h, q, kv))
    return BINARY[kind](evaluate(expr[1], b, h, q, kv), evaluate(expr[2], b, h, q, kv))


def flip(op: str) -> str:
    """The comparison that holds with its operands swapped (``a <= b`` is ``b >= a``)."""
    return _FLIP[op]

"""What a ``torch.library`` custom op needs of an attention call, shared by every compiled path.

An op takes only tensors and primitives. A mask or a score modifier is therefore taken apart into
its structure (:func:`flatten`: nested tuples of constants, each tensor replaced by its index in a
list) and built again inside the op (:func:`rebuild`). :func:`describe` turns a structure into the
string that keys an op's registry. Masks and modifiers are taken apart through what they declare
they are made of (``Mask.fields()``, ``ScoreMod.fields()``), so a user's subclass works as long as
it declares its fields.

:func:`autograd_inside` is the one private torch seam here: autograd inside an op's implementation.

Users: the chunked backend's ops (:mod:`selfattn.backends.chunked.compiled`) and the
context-parallel ops (:mod:`selfattn.distributed.compiled`).
"""

from __future__ import annotations

import contextlib
import enum
import operator
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from ._call import specialized
from ._fields import Declared
from .masks import Mask

__all__ = ["Struct", "autograd_inside", "describe", "flatten", "rebuild"]

Struct = tuple  # nested tuples of constants, see flatten()

_CONSTANTS = (type(None), bool, str, torch.dtype, torch.device, enum.Enum)


def flatten(obj: object, tensors: list[Tensor]) -> Struct:
    """The structure of a mask, a score modifier or None: nested tuples of constants in which each
    tensor is replaced by its index in ``tensors`` (appended to). Masks and modifiers are taken
    apart by their declared fields (tensors, masks, modifiers, tuples and lists, numbers, strings,
    dtypes, devices, enums, functions)."""
    if isinstance(obj, Tensor):
        tensors.append(obj)
        return ("tensor", len(tensors) - 1)
    if isinstance(obj, Declared):
        return ("object", type(obj), tuple((name, flatten(value, tensors)) for name, value in obj.fields()))
    if isinstance(obj, (tuple, list)):
        return ("tuple" if isinstance(obj, tuple) else "list", tuple(flatten(x, tensors) for x in obj))
    if isinstance(obj, _CONSTANTS):
        return ("const", obj)
    if isinstance(obj, int):
        return ("const", operator.index(obj))  # an int dynamo made dynamic (a window size) is specialized
    if isinstance(obj, float):
        return ("const", specialized(obj))
    if callable(obj):  # a custom score modifier's or from_mask_mod's function
        return ("function", obj)
    raise TypeError(f"under torch.compile selfattn takes masks and score modifiers apart by the fields "
                    f"they declare (tensors, masks, modifiers, tuples, lists, numbers, strings, dtypes, devices, "
                    f"functions); it cannot take a {type(obj).__name__}: keep it out of fields(), or run the call "
                    "outside torch.compile")


def rebuild(struct: Struct, tensors: Sequence[Tensor] | None) -> object:
    """The object that :func:`flatten` took apart, reading ``tensors``. With ``tensors=None``, a mask
    in which every part that reads a tensor or calls a function is :class:`_Unknown`."""
    kind = struct[0]
    if kind == "const" or kind == "function":
        return struct[1]
    if kind == "tensor":
        assert tensors is not None
        return tensors[struct[1]]
    if kind in ("tuple", "list"):
        items = [rebuild(x, tensors) for x in struct[1]]
        return tuple(items) if kind == "tuple" else items
    cls, fields = struct[1], struct[2]
    if tensors is None and issubclass(cls, Mask) and any(_reads_data(value) for _, value in fields):
        return _Unknown()
    return cls.from_fields(**{name: rebuild(value, tensors) for name, value in fields})


def _reads_data(struct: Struct) -> bool:
    if struct[0] in ("tuple", "list"):
        return any(_reads_data(x) for x in struct[1])
    return struct[0] in ("tensor", "function")


def describe(struct: Struct) -> str:
    """A readable string that determines the structure (functions by qualified name and identity)."""
    kind = struct[0]
    if kind == "const":
        return repr(struct[1])
    if kind == "tensor":
        return f"#{struct[1]}"
    if kind == "function":
        fn = struct[1]
        name = getattr(fn, "__qualname__", type(fn).__name__)
        return f"{getattr(fn, '__module__', None)}.{name}@{id(fn):#x}"
    if kind in ("tuple", "list"):
        inside = ", ".join(describe(x) for x in struct[1])
        return f"({inside})" if kind == "tuple" else f"[{inside}]"
    cls, fields = struct[1], struct[2]
    return f"{cls.__module__}.{cls.__qualname__}(" + ", ".join(f"{n}={describe(v)}" for n, v in fields) + ")"


class _Unknown(Mask):
    """A part of a mask whose tiles cannot be known without its data: every tile partly visible."""

    def _tile_bounds(self, lq, lk, bq, bk, device):
        unknown = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device)
        return unknown, unknown

    def __repr__(self) -> str:
        return "unknown"


@contextlib.contextmanager
def autograd_inside() -> Iterator[None]:
    """Autograd inside an op's implementation, which torch runs with autograd's dispatch keys
    excluded: the backward takes a non-additive score modifier's derivative from autograd."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield

"""The selfattn mask carried through transformers' code as a 4-D "attention mask" tensor."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from ... import masks as _masks

__all__ = ["MaskTensor"]

# Tensor methods that only read metadata (no values): a mask carrier answers them as a tensor would.
_METADATA = frozenset({
    "dim", "size", "stride", "storage_offset", "is_contiguous", "numel", "nelement", "element_size",
    "is_floating_point", "is_complex", "is_signed", "get_device", "is_inference", "_is_view", "__len__",
    "__hash__", "__format__", "_is_zerotensor", "is_neg", "is_conj", "data_ptr", "untyped_storage",
    "_typed_storage", "__dlpack_device__", "has_names", "__reduce_ex__",
})
# Methods that would copy or convert the values: the carrier is returned as it is (same dtype only).
_PASS = frozenset({"detach", "clone", "contiguous", "bool", "to", "requires_grad_", "cpu", "cuda"})


class MaskTensor(Tensor):
    """A selfattn mask carried through transformers' code as a (B, 1, Lq, Lk) bool tensor with no data.

    transformers passes prepared masks around as 4-D tensors (``generate`` with a static cache
    builds them ahead and feeds them back to ``forward``, which passes a 4-D tensor through
    untouched). This tensor has that shape but holds no (Lq, Lk) values (its one element is
    broadcast with zero strides): ``.mask`` is the selfattn mask, which the attention function
    unwraps. Shape, dtype and device read as a tensor's; ``detach``, ``clone``, ``contiguous`` and
    ``to`` (same dtype) give it back; every operation on its values raises ``TypeError``, whichever
    operand it is. It is an ordinary ``__torch_function__`` subclass, so ``torch.compile`` traces
    code that builds it (``fullgraph=True``) and guards a graph that takes it on its mask's structure.
    """

    mask: _masks.Mask

    @staticmethod
    def __new__(cls, mask: _masks.Mask, shape: tuple[int, int, int, int], device: torch.device | str) -> MaskTensor:
        # no storage for (B, 1, Lq, Lk): one element, zero strides (a fresh tensor, not a view)
        base = torch.empty_strided(tuple(shape), (0,) * len(shape), dtype=torch.bool, device=device)
        t = base.as_subclass(cls)
        t.mask = mask
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # an attribute: metadata reads as a tensor's; a tensor-valued one has no values
            attr = getattr(getattr(func, "__self__", None), "__name__", "")
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            if not isinstance(out, Tensor) or attr == "_base":
                return out
            name = attr
        elif name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        elif name in _PASS and isinstance(args[0], MaskTensor) and _keeps_dtype(args[1:], kwargs):
            return args[0]._moved(args[1:], kwargs)
        carrier = next((a for a in (*args, *kwargs.values()) if isinstance(a, MaskTensor)), None)
        raise _no_values(name or str(func), carrier)

    def _moved(self, args: tuple, kwargs: dict) -> MaskTensor:
        device = kwargs.get("device", next((a for a in args if isinstance(a, (torch.device, str))), None))
        if device is None or torch.device(device) == self.device:
            return self
        return MaskTensor(self.mask, cast(tuple[int, int, int, int], tuple(self.shape)), device)  # a carrier is 4-D

    # mypy rejects any override of a dunder method with a keyword-only parameter, Tensor's own signature included
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"MaskTensor({self.mask!r}, shape={tuple(self.shape)})"


def _no_values(what: str, carrier: MaskTensor | None) -> TypeError:
    mask = f" ({carrier.mask!r})" if carrier is not None and hasattr(carrier, "mask") else ""
    return TypeError(f"{what} was applied to a selfattn mask{mask} standing in for a 4-D attention mask; it has no "
                     "values: pass it to selfattn's attention function, or build a dense mask with "
                     ".mask.dense(lq, lk), or load the model with attn_implementation='sdpa' or 'eager'")


def _refuse(name: str) -> Any:
    def op(self: MaskTensor, *args: Any, **kwargs: Any) -> Any:
        raise _no_values(name, self)
    op.__name__ = name
    return op


# torch turns a TypeError raised under a tensor's binary operator into NotImplemented, which Python
# reports as "unsupported operand type(s)": the carrier's own operators (tried first, and as the
# reflected operand) raise the explanation instead.
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
              "rshift"):
    for _form in (f"__{_name}__", f"__r{_name}__", f"__i{_name}__"):
        setattr(MaskTensor, _form, _refuse(_form))
for _form in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__neg__", "__pos__", "__abs__",
              "__invert__"):
    setattr(MaskTensor, _form, _refuse(_form))
MaskTensor.__hash__ = Tensor.__hash__  # type: ignore[method-assign]  # defining __eq__ would unset it


def _keeps_dtype(args: tuple, kwargs: dict) -> bool:
    """``.to(...)`` / ``.bool()`` arguments that keep a bool tensor bool (a device move, or nothing)."""
    dtypes = [a for a in (*args, kwargs.get("dtype")) if isinstance(a, torch.dtype)]
    dtypes += [a.dtype for a in args if isinstance(a, Tensor)]
    return all(d == torch.bool for d in dtypes)

"""The doctor's uses of torch beyond its public API, one small function each, with the version checked.

``tests/test_check.py`` (``test_doctor_seams_are_where_they_were``) fails loudly when one of them moves.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["base_of", "untraced", "version"]


def base_of(t: Tensor) -> Tensor | None:
    """The tensor ``t`` is a view of (the one an in-place write into ``t`` changes too), or None.

    torch 2.13: ``Tensor._base``, set on every view; there is no public equivalent.
    """
    base = t._base
    return base if isinstance(base, Tensor) else None


def version(t: Tensor) -> int:
    """How many in-place changes ``t`` (or a view sharing its storage) has seen.

    torch 2.13: ``Tensor._version``, the counter autograd checks saved tensors against; there is no
    public equivalent.
    """
    return int(t._version)


def untraced() -> contextlib.AbstractContextManager:
    """A context in which torch operations skip every active ``TorchFunctionMode`` (the doctor's own
    bookkeeping between a module's operations is not recorded as the module's).

    torch 2.13: ``torch._C.DisableTorchFunction``; there is no public equivalent.
    """
    return torch._C.DisableTorchFunction()

"""What a cache may trust about the tensors it was made from.

A cache of something made from tensors (a checked packed mask, a chunked plan) must not outlive a
change of their values. torch's in-place version counter sees every write made through torch, but
not one made through memory it shares: a NumPy array (``torch.from_numpy``, ``.numpy()``, a data
loader refilling its buffer) or ``.data``. So a :class:`Snapshot` holds, with the versions, a copy
of every CPU tensor's values, and is unchanged only while both agree (comparing a few thousand
indices costs microseconds). A CUDA tensor shares no memory with NumPy, so its version alone is
trusted (comparing would synchronise the device); a ``.data`` write to one is not seen.

Nothing is kept under ``torch.compile`` or for inference-mode tensors, which cannot say their
version.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["MISSING", "KeptByTensors", "Snapshot"]

MISSING: Any = object()


class Snapshot:
    """The versions of some tensors and a copy of the values of those on the CPU."""

    __slots__ = ("copies", "versions")

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.versions = tuple(t._version for t in tensors)
        self.copies = tuple(t.detach().clone() if t.device.type == "cpu" else None for t in tensors)

    @staticmethod
    def possible(tensors: Sequence[Tensor]) -> bool:
        """Whether these tensors can be kept at all (no compile, no inference-mode tensor)."""
        return not torch.compiler.is_compiling() and not any(t.is_inference() for t in tensors)

    def unchanged(self, tensors: Sequence[Tensor]) -> bool:
        """Whether ``tensors`` (the same ones, in order) still hold what they held."""
        if len(tensors) != len(self.versions) or tuple(t._version for t in tensors) != self.versions:
            return False
        return all(c is None or (c.shape == t.shape and torch.equal(c, t)) for c, t in zip(self.copies, tensors,
                                                                                          strict=True))


class KeptByTensors:
    """Values made from a few tensors in the last few calls, found again by the tensors' identity and a
    :class:`Snapshot` of them (and a key of plain values)."""

    def __init__(self, kept: int = 4) -> None:
        self._kept = kept
        self._entries: list[tuple[tuple[Any, ...], tuple[weakref.ref, ...], Snapshot, Any]] = []

    def find(self, tensors: tuple[Tensor, ...], key: tuple[Any, ...]) -> Any:
        """The value kept for these tensors, unchanged since, and this key; else :data:`MISSING`."""
        if not Snapshot.possible(tensors):
            return MISSING
        ids = tuple(id(t) for t in tensors)
        for k, refs, snap, value in self._entries:
            if k == (ids, key) and all(r() is t for r, t in zip(refs, tensors, strict=True)):
                return value if snap.unchanged(tensors) else MISSING
        return MISSING

    def keep(self, tensors: tuple[Tensor, ...], key: tuple[Any, ...], value: Any) -> Any:
        """Keep ``value`` for these tensors and this key (dropping the oldest entry); returns it."""
        if Snapshot.possible(tensors):
            ids = tuple(id(t) for t in tensors)
            entries = [e for e in self._entries if e[0] != (ids, key)]
            self._entries = [((ids, key), tuple(weakref.ref(t) for t in tensors), Snapshot(tensors), value),
                             *entries[:self._kept - 1]]
        return value

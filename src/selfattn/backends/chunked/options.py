"""How the chunked backend tiles a call: :class:`ChunkedOptions`, set in a ``with`` block by :func:`options`.

The options are a ``ContextVar`` (per thread and task); under ``torch.compile``, which cannot trace
``ContextVar.get``, :func:`current_options` reads a process-wide copy of the last value set.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

import torch

__all__ = ["ChunkedOptions", "Kernel", "current_options", "options"]

Kernel = Literal["auto", "fused", "math"]


@dataclass(frozen=True)
class ChunkedOptions:
    """How the chunked backend tiles a call.

    Attributes:
        block_k: keys per tile, the granularity at which empty tiles are skipped.
        block_q: query rows per block; None chooses it per call (larger where rows see many keys).
        kernel: "auto" (fused where it computes the call exactly, else math), "fused" or "math".
        math_block_q: query rows per block of the math kernel.
        math_span_keys: the most keys in one span of the math kernel, which holds (B, Hq, bq, sk)
            scores.
    """

    block_k: int = 128
    block_q: int | None = None
    kernel: Kernel = "auto"
    math_block_q: int = 128
    math_span_keys: int = 2048

    def __post_init__(self) -> None:
        for name in ("block_k", "block_q", "math_block_q", "math_span_keys"):
            value = getattr(self, name)
            if value is None and name == "block_q":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"chunked option {name} must be an int >= 1, got {value!r}")
        if self.kernel not in ("auto", "fused", "math"):
            raise ValueError(f"chunked option kernel must be 'auto', 'fused' or 'math', got {self.kernel!r}")

    def as_pairs(self) -> tuple[tuple[str, object], ...]:
        """(name, value) of every option, in declaration order (a hashable form)."""
        return tuple((name, getattr(self, name)) for name in self.__dataclass_fields__)


_DEFAULT_OPTIONS = ChunkedOptions()
_OPTIONS: contextvars.ContextVar[ChunkedOptions | None] = contextvars.ContextVar("selfattn_chunked", default=None)
# What torch.compile reads instead (it cannot trace ContextVar.get): the options last set or restored by
# options() in any thread; dynamo guards on it, so a compiled function retraces when it changes.
_TRACED_OPTIONS = _DEFAULT_OPTIONS


def current_options() -> ChunkedOptions:
    """The options in force (see :func:`options`)."""
    if torch.compiler.is_compiling():
        return _TRACED_OPTIONS
    return _OPTIONS.get() or _DEFAULT_OPTIONS


@contextlib.contextmanager
def options(**changes: object) -> Iterator[ChunkedOptions]:
    """Change the chunked backend's options inside the block (restored on exit, also on error).

    Example:
        >>> with selfattn.backends.chunked.options(block_q=64, block_k=64, kernel="math"):
        ...     out = selfattn.attention(q, k, v, mask=m, backend="chunked")
    """
    global _TRACED_OPTIONS
    new = replace(current_options(), **changes)  # type: ignore[arg-type]
    token = _OPTIONS.set(new)
    _TRACED_OPTIONS = new
    try:
        yield new
    finally:
        _OPTIONS.reset(token)
        _TRACED_OPTIONS = current_options()

"""Attention masks as composable predicates.

Everywhere in selfattn, ``True`` means "query i MAY attend to key j" (the SDPA and FlexAttention
convention). Masks are small objects, not tensors: they compose with ``&``, ``|`` and ``~``, turn
into a dense bool tensor on request, and classify (query block, key block) tiles as empty, partly
visible or fully visible so that backends can skip work without ever building an (Lq, Lk) tensor.

One source of truth: each mask states its rule once, as a predicate ``visible(b, h, i, j)`` on
positions (:meth:`Mask.predicate`). The dense form, :meth:`Mask.block` and FlexAttention's
``mask_mod`` are all derived from it; the analytic tile bounds of each mask are a fast path that
the test suite checks against the predicate.

Positions: key j sits at position j; query row r sits at position ``r + query_offset(Lq, Lk)``
(queries are the last Lq of the Lk positions, as when decoding after a cache). Score modifiers
(:mod:`selfattn.scores`) receive the same positions.

Masks read their tensors (padding lengths, document ids, ``from_tensor``) when they are used, so
a tensor changed in place between two calls is seen by the next call; every cache that backends
keep (FlexAttention block masks) is keyed on :meth:`Mask.version`, and a change between a
forward and its backward raises instead of giving the gradient of another mask.

Shape legend: B batch, H heads, Lq query length, Lk key length, bq/bk tile sizes,
nQ/nK numbers of tiles.

Causal alignment, drawn for Lq = 2, Lk = 4 (``1`` = visible)::

    top_left        bottom_right
    1 0 0 0         1 1 1 0
    1 1 0 0         1 1 1 1

Example:
    >>> from selfattn import masks
    >>> m = masks.causal() & masks.padding(torch.tensor([3, 5]))
    >>> m.dense(5, 5).shape
    torch.Size([2, 1, 5, 5])
"""

from __future__ import annotations

# the mask classes and types are importable from here too (for isinstance checks and subclassing);
# the functions in __all__ are the API that builds them
from .base import EMPTY, FULL, PARTIAL, Mask, positions, query_offset
from .base import HeadSlice as HeadSlice
from .base import MaskMod as MaskMod
from .base import Predicate as Predicate
from .kinds import Causal as Causal
from .kinds import Document as Document
from .kinds import Padding as Padding
from .kinds import SlidingWindow as SlidingWindow
from .kinds import causal, document, padding, sliding_window
from .packed import Packed as Packed
from .packed import packed
from .tensors import FromMaskMod as FromMaskMod
from .tensors import FromTensor as FromTensor
from .tensors import (
    from_mask_mod,
    from_tensor,
    from_torch_attn_mask,
    from_torch_key_padding_mask,
)

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Mask",
    "causal",
    "document",
    "from_mask_mod",
    "from_tensor",
    "from_torch_attn_mask",
    "from_torch_key_padding_mask",
    "packed",
    "padding",
    "positions",
    "query_offset",
    "sliding_window",
]

"""The chunked backend: exact attention over (query block, key tile) pairs, O(L * block) memory.

For each query block, the mask's tile map splits the keys into spans of fully visible tiles
(computed with no mask at all), partly visible tiles (with the mask of just that span) and empty
tiles (skipped). Each span yields a partial output and its logsumexp; spans merge exactly by their
lse. The backward recomputes every span from the saved (out, lse), so no (Lq, Lk) tensor is ever
built, in the forward or the backward.

The package, along its seams (each layer imports only those below it)::

    options.py   ChunkedOptions and options(): tile sizes and the kernel
    dropout.py   the dropout keep-masks of a call, tile by tile of a fixed grid
    kernels.py   one block: its terms, forward, backward, merge by lse, sinks
    plan.py      the tile map turned into key spans per query block (schedule, Plan)
    runs.py      spans grouped into batched calls of the fused kernel; views.py, their strided views
    loops.py     the forward and backward drivers and the one autograd function
    compiled.py  the same loops as torch.library custom ops, for torch.compile
    backend.py   ChunkedBackend: what dispatch sees

Public here: the backend's options (:func:`options`, :func:`schedule`) and the block API for
callers that tile attention themselves (:func:`fused_block`, :func:`fused_block_backward`,
:class:`Merge`), which the distributed ring uses.

Shape legend: B batch, Hq query heads, Hkv kv heads, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

from .backend import BACKEND, ChunkedBackend
from .dropout import draw_seed, dropout_pattern, keep_mask
from .kernels import Merge, add_sinks, fused_block, fused_block_backward, sinks_grad
from .kernels import fused_available as fused_block_available
from .options import ChunkedOptions, current_options, options
from .plan import Schedule, Span, schedule

__all__ = [
    "BACKEND",
    "ChunkedBackend",
    "ChunkedOptions",
    "Merge",
    "Schedule",
    "Span",
    "add_sinks",
    "current_options",
    "draw_seed",
    "dropout_pattern",
    "fused_block",
    "fused_block_available",
    "fused_block_backward",
    "keep_mask",
    "options",
    "schedule",
    "sinks_grad",
]

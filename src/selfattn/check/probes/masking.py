"""The doctor's probes of what each query sees: the module's own structure (causal, a sliding or local
window) and its mask (which argument, shape and kind; every accepted shape read the same way; padding;
rows with no visible key).

A module's built-in structure is read from which tokens each output row depends on; a band of
diagonals (a causal window, a local window) is a design, reported as a fact; a causal mask that hides
the diagonal, shows some future tokens or follows no band is a causal-leak. The mask is inferred from
behaviour over every mask argument, shape and kind; an argument that is not named like a mask and
changes nothing is not a mask, and a mask the user's adapter never passes on is no mask.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import linecache
import math
import re
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..findings import (
    BATCH_MIXING,
    CAUSAL_LEAK,
    DEFINITION_MISMATCH,
    KEYS_HIDDEN,
    MASK_BROADCAST,
    MASK_CONVENTION,
    MASK_ERROR,
    MASK_IGNORED,
    MASK_INVERTED,
    NAN_ON_EMPTY_SEQUENCE,
    NAN_ON_MASKED_ROW,
    Finding,
)
from ..subject.building import from_keras, num_heads_of
from ..subject.caller import (
    LENGTH_NAMES,
    MASK_SHAPES,
    Caller,
    MaskSpec,
    MaskWatch,
    block_mask_parameters,
    dependency,
    forward_signature,
    mask_parameters,
    module_state,
    named_like_mask,
    restore,
    switch_parameter,
    token_grids,
)
from ..subject.calling import KIND_ORDER, SHAPE_ORDER
from ..subject.context import (
    Context,
    Outcome,
    close,
    empty_row_keep,
    future,
    padded_rows,
    probe_keep,
    raised_inside_doctor,
    rel,
    tolerance,
)

__all__ = ["LENGTH_NAMES", "PADDING_LENGTHS", "band", "causality", "mask_convention", "masked_rows", "padding",
           "twin_reads_masks_alike"]


PADDING_LENGTHS = (16, 64, 300)
"""Lengths the padding probe also runs at: past the thresholds and chunk sizes where code takes another path."""


def band(dep: Tensor) -> tuple[int, int] | None:
    """(left, right) when row i sees exactly the keys i - left .. i + right (whole diagonals), else None.

    ``left`` (``right``) is L - 1 when nothing in the past (future) is hidden; right is -1 when the
    diagonal itself is hidden.
    """
    length = dep.shape[0]
    visible = []
    for d in range(-(length - 1), length):
        diagonal = dep.diagonal(d)
        if bool(diagonal.all()):
            visible.append(d)
        elif bool(diagonal.any()):
            return None
    if not visible or visible != list(range(visible[0], visible[-1] + 1)):
        return None
    return -visible[0], visible[-1]


def _causal_sparse(dep: Tensor) -> str | None:
    """The Sparse Transformer's causal patterns, or None: each query sees itself and keys at a set of distances
    before it that is the same for every query (strided, dilated), or its own block up to itself and a set of
    summary columns after their blocks (fixed)."""
    length = dep.shape[0]
    if length < 4 or not bool(dep.diagonal().all()):
        return None
    offsets = [o for o in range(length) if bool(dep.diagonal(-o).all())]
    if all(bool(dep.diagonal(-o).all()) or not bool(dep.diagonal(-o).any()) for o in range(length)):
        strided = any(offsets == [o for o in range(length) if o < step or o % step == 0] for step in range(2, length))
        dilated = any(offsets == list(range(0, offsets[-1] + 1, step)) for step in range(2, length))
        if strided or dilated:  # not any set of distances: one skipped by mistake (a self mask below the diagonal)
            return (f"a causal pattern by distance: each query sees the keys {offsets} positions before it "
                    f"({'strided' if strided else 'dilated'} attention, as in the Sparse Transformer)")
    i = torch.arange(length)
    causal = i[None, :] <= i[:, None]
    for size in range(2, length):
        block = (i[:, None] // size) == (i[None, :] // size)
        later = causal & ~block  # pairs whose key is in an earlier block
        columns = torch.stack([dep[:, j][later[:, j]].all() if bool(later[:, j].any()) else torch.tensor(False)
                               for j in range(length)])
        if bool(columns.any()) and torch.equal(dep, causal & (block | columns[None, :])):
            return (f"the Sparse Transformer's fixed pattern: each query sees its own block of {size} up to itself "
                    f"and the summary columns {columns.nonzero().flatten().tolist()} of earlier blocks")
    return None


def _length_dependent(ctx: Context) -> dict | None:
    """A causal module's outputs may not depend on how many tokens follow them: run on the first L - 2 tokens, its
    outputs must be the first L - 2 rows of the run on all L. The evidence where they are not; None where they are,
    or where the module does not run at that length (a fixed length, an image's grid)."""
    x, call = ctx.analysis_x, ctx.analysis
    short = x.shape[1] - 2
    if short < 2 or call.layout in ("channels-first", "channels-last"):
        return None
    try:
        with torch.no_grad():
            full, part = call(x), call(x[:, :short].clone())
    except Exception:  # a length the module does not take: its limit is the sizes probe's
        return None
    if not isinstance(full, Tensor) or not isinstance(part, Tensor) or full.dim() < 2 or \
            full.shape[1] != x.shape[1] or part.shape != full[:, :short].shape:
        return None
    head = full[:, :short].double()
    padded = padded_rows(call, head)
    if padded is not None:  # rows the model pads, which see every key alike: not the layer's outputs
        head, part = head[~padded], part[~padded]
    same = (part == head) | (part.isnan() & head.isnan())
    diff = float((part.double() - head).abs().masked_fill(same, 0).nan_to_num(float("inf")).max())
    size = float(full.double().abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max())
    if diff <= tolerance(x.dtype) * (1 + size):  # as "the same output" everywhere: a float32 product inside the
        return None  # float64 copy rounds differently at another length
    return {"largest change of the first rows": f"{diff:.3g} (outputs up to {size:.3g})",
            "lengths": [x.shape[1], short]}


def _hides_the_diagonal(dep: Tensor) -> bool:
    """Does ``dep`` read as a causal mask that hides the diagonal (``triu(0)``)? Row i sees keys < i; its output still
    depends on its own token through its query wherever two keys weigh against each other (rows 2 on), not where one
    key takes all the weight (row 1); row 0 has no key left, and a large finite fill weighs every key alike there (or
    -inf leaves it NaN)."""
    lower = torch.ones_like(dep).tril()
    return (bool(dep[0].all()) or not dep[0].any()) and torch.equal(dep[2:], lower[2:]) and \
        bool(dep[1, 0]) and not dep[1, 1:].any()


def _transposed(dep: Tensor) -> str | None:
    """What causal design ``dep`` is the transpose of (a causal mask, a sliding window, streaming chunks, causal
    chunks), when ``dep`` itself is not symmetric: the mask was built or applied the other way round."""
    flipped = dep.T
    if torch.equal(dep, flipped):
        return None
    shape = band(flipped)
    if shape is not None and shape[1] == 0 and shape[0] > 0:
        return "causal mask" if shape[0] == dep.shape[0] - 1 else f"sliding window of {shape[0]} tokens"
    if _streaming_chunks(flipped) is not None and _streaming_chunks(dep) is None:
        return "streaming chunk mask"
    if _causal_chunks(flipped) is not None:
        return "chunked causal mask"
    return None


def _sinks_and_window(dep: Tensor) -> tuple[int, int] | None:
    """(sink tokens s, window w) when each query i sees exactly the keys j <= i with j < s or i - j < w (the first
    tokens kept as attention sinks beside a causal sliding window, as StreamingLLM keeps them), else None."""
    length = dep.shape[0]
    i = torch.arange(length, device=dep.device)
    causal, behind = i[None, :] <= i[:, None], i[:, None] - i[None, :]
    for window in range(2, length - 1):  # a window of the query alone beside the sinks is no design (a cache
        for sinks in range(1, length - window):  # that is never updated: each step sees the first key and itself)
            if torch.equal(dep, causal & ((i[None, :] < sinks) | (behind < window))):
                return sinks, window
    return None


def _streaming_chunks(dep: Tensor) -> tuple[int, int] | None:
    """(chunk size, chunks seen before its own) when each query sees exactly the whole of its own chunk and some
    chunks before it (a streaming encoder's chunk mask), else None."""
    length = dep.shape[0]
    i = torch.arange(length, device=dep.device)
    for size in range(2, length):
        behind = i[:, None] // size - i[None, :] // size  # query's chunk - key's chunk
        for left in range(0, (length - 1) // size + 1):
            if torch.equal(dep, (behind >= 0) & (behind <= left)):
                return size, left
    return None


def _chunks_with_right_context(dep: Tensor) -> tuple[int, int, int] | None:
    """(chunk size, chunks seen before its own, right context r) when each query sees its own chunk whole, some
    chunks before it, and the first r < size tokens of the next chunk (Emformer's segments with right context,
    a streaming Conformer's look-ahead), else None."""
    length = dep.shape[0]
    i = torch.arange(length, device=dep.device)
    for size in range(2, min(length, 17)):
        behind = i[:, None] // size - i[None, :] // size
        ahead = (behind == -1) & (i[None, :] % size < torch.arange(1, size, device=dep.device)[:, None, None])
        for left in range(0, (length - 1) // size + 1):
            own = (behind >= 0) & (behind <= left)
            for r in range(1, size):
                if torch.equal(dep, own | ahead[r - 1]):
                    return size, left, r
    return None


def _neighbourhood(dep: Tensor) -> str | None:
    """Neighbourhood attention (NAT's, or a sliding window clamped at the ends): each query sees one rectangle of
    keys of a fixed size around it, on the line or on the tokens' square grid, moved inwards at the borders (so a
    query near a border sees keys that do not see it). The description, or None."""
    length = dep.shape[0]
    side = math.isqrt(length)
    grids = [(1, length)] + ([(side, side)] if side * side == length and side >= 3 else [])
    for rows, cols in grids:
        sizes = set()
        for q in range(length):
            keys = dep[q].nonzero().flatten().cpu()
            if not keys.numel():
                sizes.add((0, 0))
                break
            r, c = keys // cols, keys % cols
            tall, wide = int(r.max() - r.min()) + 1, int(c.max() - c.min()) + 1
            if tall * wide != keys.numel() or not (int(r.min()) <= q // cols <= int(r.max()) and
                                                   int(c.min()) <= q % cols <= int(c.max())):
                sizes.add((0, 0))
                break
            sizes.add((tall, wide))
        if len(sizes) == 1 and (0, 0) not in sizes and next(iter(sizes)) != (rows, cols):
            tall, wide = next(iter(sizes))
            where = f"{wide} neighbouring tokens" if rows == 1 else f"a {tall} x {wide} neighbourhood on the " \
                                                                     f"{rows} x {cols} grid"
            return (f"neighbourhood attention: each query sees {where} around it, moved inwards at the borders "
                    "(NAT's, or a window clamped at the ends)")
    return None


def _cyclic_interval(values: Tensor, size: int) -> bool:
    """Whether the distinct ``values`` in range(size) are consecutive on a ring of ``size`` (size - 1 next to 0)."""
    present = torch.zeros(size, dtype=torch.bool)
    present[values] = True
    starts = present & ~present.roll(1)  # a run begins where its predecessor on the ring is absent
    return bool(present.all()) or int(starts.sum()) == 1


def _wrapped_windows(dep: Tensor) -> tuple[bool, str] | None:
    """Windows that join tokens of opposite borders: a pattern of blocks (each pair of tokens sees each other or
    neither), each a box of the line or of a grid only once the grid wraps around, with no grid on which every
    block is a box of the plain one. Shifted windows (Swin's cyclic shift) without the mask that keeps the tokens
    the roll brought together apart compute exactly this, wrapping around along every axis they were shifted on:
    (True, description). Windows that wrap around along some axes of a grid and are cut by a mask along the others
    are a periodic axis (Pangu-Weather's longitude, the Earth being round): (False, description). None otherwise."""
    length = dep.shape[0]
    dep = dep.cpu()
    blocks = {tuple(row.nonzero().flatten().tolist()) for row in dep}
    if len(blocks) < 2 or any(not torch.equal(dep[list(b)], dep[list(b)[:1]].expand(len(b), -1)) for b in blocks):
        return None  # not blocks
    readings = []
    for grid in token_grids(length):
        boxes, wraps, whole = True, [False] * len(grid), [True] * len(grid)
        for block in blocks:
            coords = torch.tensor(block)
            axes = []
            for size in reversed(grid):
                axes.append(coords % size)
                coords = coords // size
            axes.reverse()
            if math.prod(int(c.unique().numel()) for c in axes) != len(block):
                boxes = False
                break
            for a, (c, size) in enumerate(zip(axes, grid, strict=True)):
                whole[a] = whole[a] and int(c.unique().numel()) == size
                if int(c.max() - c.min()) + 1 != int(c.unique().numel()):  # not an interval of the plain axis
                    if not _cyclic_interval(c, size):
                        boxes = False
                        break
                    wraps[a] = True
            if not boxes:
                break
        if boxes and not any(wraps):
            return None  # windows of the plain line or grid
        if boxes:
            readings.append((grid, [w or h for w, h in zip(wraps, whole, strict=True)], wraps))
    if not readings:
        return None
    for grid, around, _ in readings:  # an axis each window spans whole cannot show a wrap
        if all(around):
            where = "the line" if len(grid) == 1 else f"the {' x '.join(map(str, grid))} grid"
            return True, f"windows on {where} join tokens of opposite borders (a cyclic shift without its mask)"
    grid, _, wraps = readings[0]
    sides = " and ".join(f"the side of {grid[a]}" for a in range(len(grid)) if wraps[a])
    return False, (f"shifted windows on the {' x '.join(map(str, grid))} grid that wrap around along {sides} only, "
                   "cut by a mask along the others: a periodic axis (as Pangu-Weather's longitude)")


def _blocks_with_halo(dep: Tensor) -> str | None:
    """Blocked local attention with a halo (HaloNet): the queries fall into blocks of two or more that see the same
    keys, each block its own tokens and some around them, the blocks overlapping in what they see. What was seen,
    else None."""
    rows, block_of = torch.unique(dep, dim=0, return_inverse=True)
    sizes = torch.bincount(block_of, minlength=rows.shape[0])
    if rows.shape[0] < 2 or int(sizes.min()) < 2:
        return None
    own = torch.zeros_like(rows)
    own[block_of, torch.arange(dep.shape[0], device=dep.device)] = True  # row b: the tokens of block b
    if not bool((rows | ~own).all()) or torch.equal(rows, own):  # each block sees itself; not blocks alone
        return None
    # a halo is local: some block misses a key before its own tokens (streaming chunks see every earlier key, and a
    # look-ahead past them is read by the chunk patterns)
    first = torch.tensor([int(own[b].nonzero()[0]) for b in range(rows.shape[0])], device=dep.device)
    earlier = torch.arange(dep.shape[0], device=dep.device)[None, :] < first[:, None]
    if not bool((earlier & ~rows).any()):
        return None
    return (f"blocked local attention with a halo: the queries fall into {rows.shape[0]} blocks of "
            f"{sorted(set(sizes.tolist()))} tokens, each sees its own block and keys around it (HaloNet)")


def _triangle(dep: Tensor) -> str | None:
    """Triangle attention over a pair map of n x n tokens (AlphaFold's): pair (i, j) attends along its row i with a
    bias made from pair (j, k), so that it depends on rows i and j (around the starting node); or along its column j
    with the bias from pair (k, i): columns j and i (around the ending node). What it is, or None."""
    n = math.isqrt(dep.shape[0])
    if n < 3 or n * n != dep.shape[0]:
        return None
    i = torch.arange(n * n, device=dep.device)
    row, col = (i // n)[:, None], (i % n)[:, None]
    key_row, key_col = (i // n)[None, :], (i % n)[None, :]
    if torch.equal(dep, (key_row == row) | (key_row == col)):
        return (f"triangle attention around the starting node: each pair (i, j) of a {n} x {n} pair map attends "
                "along its row i with a bias from the pairs (j, k) (AlphaFold's)")
    if torch.equal(dep, (key_col == col) | (key_col == row)):
        return (f"triangle attention around the ending node: each pair (i, j) of a {n} x {n} pair map attends "
                "along its column j with a bias from the pairs (k, i) (AlphaFold's)")
    return None


def _local_design(dep: Tensor) -> str | None:
    """The published pattern a dependency matrix that sees some future keys follows, or None: symmetric with the
    diagonal seen (blocks, windows of an image, shifted windows: each pair of tokens sees each other or neither), or
    a prefix LM (the first p tokens see each other, the others are causal)."""
    length = dep.shape[0]
    eye = torch.eye(length, dtype=torch.bool, device=dep.device)
    if bool(dep.diagonal().all()) and torch.equal(dep, dep.T):
        return "local pattern: each query sees a symmetric set of keys, itself among them (blocks or windows; " \
               "bidirectional within each)"
    # global tokens (Longformer, BigBird, ETC): keys every query sees, queries that see every key; the others local
    seen_by_all, sees_all = dep.all(0), dep.all(1)
    core = (~seen_by_all & ~sees_all).nonzero().flatten()  # tokens neither global key nor global query
    rest = dep[core][:, core]
    if (seen_by_all.any() or sees_all.any()) and bool(dep.diagonal().all()) and core.numel() > 2 and \
            torch.equal(rest, rest.T) and not bool(rest.all()):
        return (f"local pattern with global tokens: keys {seen_by_all.nonzero().flatten().tolist()} are seen by every "
                f"query, queries {sees_all.nonzero().flatten().tolist()} see every key, the others a symmetric local "
                "set (Longformer's or BigBird's global attention)")
    others = ~sees_all
    if sees_all.any() and int(others.sum()) > 2 and bool(dep[others][:, others].all()) and \
            not bool(dep[others][:, sees_all].any()):
        return (f"read-out tokens: queries {sees_all.nonzero().flatten().tolist()} see every key, and the other "
                "tokens attend among themselves, not to them (a class token with an attention of its own)")
    chunks = _streaming_chunks(dep)
    if chunks is not None:
        size, left = chunks
        before = "every chunk" if left >= (length - 1) // size else f"{left} chunk(s)" if left else "no chunk"
        return (f"streaming chunks: each query sees its own chunk of {size} tokens (later tokens of the chunk "
                f"too) and {before} before it (the chunk masks of streaming speech encoders, WeNet's or ESPnet's)")
    ahead = _chunks_with_right_context(dep)
    if ahead is not None:
        size, left, r = ahead
        before = "every chunk" if left >= (length - 1) // size else f"{left} chunk(s)" if left else "no chunk"
        return (f"streaming chunks with right context: each query sees its own chunk of {size} tokens, {before} "
                f"before it and the first {r} token(s) of the next (Emformer's segments with look-ahead)")
    neighbourhood = _neighbourhood(dep)
    if neighbourhood is not None:
        return neighbourhood
    halo = _blocks_with_halo(dep)
    if halo is not None:
        return halo
    triangle = _triangle(dep)
    if triangle is not None:
        return triangle
    causal = ~future(length).to(dep.device) | eye
    for prefix in range(2, length):
        block = torch.zeros_like(dep)
        block[:prefix, :prefix] = True
        if torch.equal(dep, causal | block):
            return f"prefix LM: the first {prefix} tokens see each other, every later token is causal"
    return None


def _recorded_padding(ctx: Context, dep: Tensor) -> tuple[int, int] | None:
    """For a layer replayed as its model calls it, the tokens [start, stop) whose rows are written when the others,
    a run at one end, depend on no token at all (Longformer's ``is_index_masked``, which zeroes the rows of its
    input padded to the window) or are rows the model pads through a bias it passes (:func:`padded_rows`): the
    padding the model added and passes to the layer in its call. A module checked
    alone gets no such pass: rows it leaves empty without a mask are its own pattern, judged as such."""
    if getattr(ctx.call.adapter, "sequence_first", None) is None:
        return None
    padded = padded_rows(ctx.call, ctx.analysis_x)
    # the first item's rows the model pads through a bias (every key hidden: they weigh all keys alike), or rows
    # that depend on no token
    dead = padded[0].tolist() if padded is not None and bool(padded[0].any()) else (~dep.any(dim=1)).tolist()
    live = [i for i, d in enumerate(dead) if not d]
    if len(live) < 2 or len(live) == len(dead) or live != list(range(live[0], live[-1] + 1)):
        return None
    return live[0], live[-1] + 1


def causality(ctx: Context) -> Outcome[Tensor]:
    """Which tokens each output row depends on; a causal module must hide exactly the future.

    Returns:
        Note causal (True when no query sees a later key), and the window when the module sees a
        band of diagonals (a sliding window, a local window); at most a causal-leak finding (the
        causal mask hides the diagonal or past keys outside any window, shows some future keys, or
        the user requires causality); value: dep (L, L) bool, row i depends on token j.
    """
    full = dependency(ctx.analysis, ctx.analysis_x, rtol=ctx.dependency_rtol)
    live = _recorded_padding(ctx, full)
    start, stop = live if live is not None else (0, full.shape[0])
    dep = full[start:stop, start:stop]  # the model's own padding, carried by its recorded call, is left out
    moved = ""
    if band(dep) is None and _local_design(dep) is None and not dep.all():
        # a mask hides the same positions whatever the tokens; zeros that follow the values (a ReLU or a top-k in
        # place of the softmax) move with them: the union over the same tokens in other orders is the pattern
        x, seen = ctx.analysis_x, dep.clone()
        orders = 12 if x.shape[1] <= 64 else 4  # a grid grown past one window: each reading costs L runs
        for seed in range(1, orders + 1):
            order = torch.arange(x.shape[1])
            order[start:stop] = start + torch.randperm(stop - start, generator=ctx.gen)
            seen |= dependency(ctx.analysis, x[:, order], rtol=ctx.dependency_rtol, seed=seed)[start:stop, start:stop]
            if band(seen) is not None or _local_design(seen) is not None:
                break
        if not torch.equal(seen, dep):
            moved = ("which keys a row depends on changes with the order of the tokens (zeros that follow the "
                     f"values, as a ReLU or a top-k in place of the softmax make): read over {seed + 1} orders")
            dep = seen
            full = full.clone()
            full[start:stop, start:stop] = seen
    length = dep.shape[0]
    whole = length - 1
    seen_future = dep & future(length)
    causal = not seen_future.any()
    found = Outcome[Tensor](notes={"causal": causal, "sees every key": bool(dep.all())}, value=full)
    if live is not None:
        found.notes["recorded padding"] = (f"tokens {start}..{stop - 1} of {full.shape[0]} are read; the others' rows "
                                           "depend on no token: the model pads them in the call it makes "
                                           f"(the positions below count from token {start})")
    shape = band(dep)
    if shape is None and length > 2 and _hides_the_diagonal(dep):
        shape = (whole, -1)
    if not ctx.normalised and shape is None and not moved:
        moved = ("the weights go through no softmax (ReLU^2, sigmoid or linear attention): a key a row does not "
                 "depend on may be a zero of its scores, not a mask")
    flipped = None if causal or moved else _transposed(dep)
    if flipped is not None:
        found.findings.append(Finding.of(CAUSAL_LEAK, f"queries see later keys and miss earlier ones: the pattern is "
                                         f"a {flipped} read the other way round (the mask transposed)",
                                         {"future (query, key) pairs seen": seen_future.nonzero().tolist()[:10],
                                          "past (query, key) pairs hidden":
                                              (~dep & ~future(length)).nonzero().tolist()[:10]}))
    elif moved and shape is None:  # what is seen is certain, what is not may be a zero of the values
        found.notes["keys seen"] = moved
        ahead = {j - i for i, j in seen_future.nonzero().tolist()}
        if ahead == {1} and length > 2:
            found.findings.append(Finding.of(CAUSAL_LEAK, "queries see the next token and no later one: a causal "
                                             "mask off by one", {"future (query, key) pairs seen":
                                                                 seen_future.nonzero().tolist()[:10]}))
    elif shape is not None:
        left, right = shape
        if right < 0:
            found.findings.append(Finding.of(CAUSAL_LEAK, "the causal mask hides the diagonal: a query does not "
                                             "see its own token", {"each query sees": f"keys i - {left} .. i - 1"}))
        elif left == 0 and right == 0:  # a causal module hides too much; any other attends over another axis
            found.findings.append(Finding.of(CAUSAL_LEAK if ctx.causal else DEFINITION_MISMATCH, "each query sees only "
                                             "its own token: no attention between tokens" + (
                                                 "" if ctx.causal else " (the softmax runs over another axis: the "
                                                 "heads, or the features)"), {"each query sees": "key i only"}))
        elif right == 0 and left < whole:
            found.notes["window"] = f"sliding window: each query sees itself and the {left} previous tokens"
        elif left == whole and 0 < right < whole:
            found.findings.append(Finding.of(CAUSAL_LEAK, f"queries see the next {right} token(s) and no later "
                                             "one: a causal mask off by one", {"each query sees": f"keys <= i + "
                                                                                                  f"{right}"}))
        elif 0 < right and left < whole:
            found.notes["window"] = f"local window: each query sees the {left} previous and {right} next tokens"
    elif causal and (sinks := _sinks_and_window(dep)) is not None:
        found.notes["window"] = (f"attention sinks and a sliding window: each query sees the first {sinks[0]} "
                                 f"token(s) and itself with the {sinks[1] - 1} previous ones (StreamingLLM)")
    elif causal and (chunk := _causal_chunks(dep)) is not None:
        found.notes["window"] = (f"causal within chunks of {chunk[0]} tokens: each query sees the tokens of its chunk "
                                 "up to itself (chunked attention, as Llama 4's local layers)") if not chunk[1] else (
            f"blocked local attention: each query sees the tokens of its chunk of {chunk[0]} up to itself and the "
            f"{chunk[1]} chunk(s) before it whole (local-attention's causal windows that look back)")
    elif causal and (sparse := _causal_sparse(dep)) is not None:
        found.notes["window"] = sparse
    elif causal and (~dep & ~future(length)).nonzero().tolist() == [[1, 1]] and length > 2:
        # only query 1 misses its own token, and every later query depends on its own: its own key is hidden unless
        # nothing else is visible (shared-QK's self mask), so query 1 puts weight 1 on key 0 whatever its own token.
        # A causal mask that hides the diagonal does the same; the white box tells them apart by the scores
        found.notes["self mask"] = "query 1 does not depend on its own token, every later query does (its own key " \
                                   "hidden unless no other is visible?): read from the scores by the white box"
    elif causal and (~dep & ~future(length)).any():
        pairs = (~dep & ~future(length)).nonzero().tolist()[:10]
        found.findings.append(Finding.of(CAUSAL_LEAK, "the causal mask hides more than the future (the diagonal "
                                         "or past keys, in no window)", {"hidden (query, key) pairs with key <= "
                                                                         "query": pairs}))
    elif not causal and seen_future.sum() < future(length).sum():
        design = _local_design(dep)
        wrapped = None if design is None or moved else _wrapped_windows(dep)
        if wrapped is not None and wrapped[0]:
            found.findings.append(Finding.of(DEFINITION_MISMATCH, f"{wrapped[1]}: each window of the shifted grid "
                                             "mixes tokens the roll brought together from the far side, which are "
                                             "not neighbours", {"windows that wrap around": wrapped[1]}))
        elif wrapped is not None:
            found.notes["window"] = wrapped[1]
        elif design is not None:
            found.notes["window"] = design
        elif not dep.diagonal().all():  # no mask hides a token from itself in a pattern that also shows the future
            found.findings.append(Finding.of(DEFINITION_MISMATCH, "some outputs do not depend on their own token, in "
                                             "no causal, window or block pattern: outputs land at other tokens' "
                                             "positions (windows or heads put back without their permute)",
                                             {"outputs that do not depend on their own token":
                                              (~dep.diagonal()).nonzero().flatten().tolist()[:10]}))
        elif (~dep & ~future(length)).any():  # no causal mask either: it would show every past key
            found.findings.append(Finding.of(DEFINITION_MISMATCH, "queries see some future keys and miss some past "
                                             "ones, in no causal, window, block or global pattern: outputs put back at "
                                             "other tokens' positions, or a mask built wrong",
                                             {"future (query, key) pairs seen": seen_future.nonzero().tolist()[:10],
                                              "past (query, key) pairs hidden":
                                                  (~dep & ~future(length)).nonzero().tolist()[:10]}))
        else:
            found.findings.append(Finding.of(CAUSAL_LEAK, "queries see some future keys and not others",
                                             {"future (query, key) pairs seen": seen_future.nonzero().tolist()[:10]}))
    elif not causal and (~dep & ~future(length)).any():  # every later key seen, some earlier one missed
        design = _local_design(dep)
        if design is not None:
            found.notes["window"] = design
        else:
            found.findings.append(Finding.of(DEFINITION_MISMATCH, "queries see every later key but miss some "
                                             "earlier ones, in no causal, window, block or global pattern: a mask "
                                             "built wrong (a self mask written off the diagonal?)",
                                             {"past (query, key) pairs hidden":
                                              (~dep & ~future(length)).nonzero().tolist()[:10]}))
    if causal and not moved and not found.findings and ctx.normalised:  # weights with no softmax may be divided
        grown = _length_dependent(ctx)  # by the length by design (FLASH's relu^2 / n)
        if grown is not None:
            found.findings.append(Finding.of(CAUSAL_LEAK, "earlier outputs change when the last tokens are dropped: "
                                             "an output depends on how many tokens follow it (positions counted "
                                             "from the end, a relative table cut by the length?)", grown))
    if ctx.bidirectional and not dep.all() and not moved:
        hidden = (~dep).nonzero().tolist()[:10]
        found.findings.append(Finding.of(KEYS_HIDDEN, "queries do not see every key although the module must be "
                                         "bidirectional", {"hidden (query, key) pairs": hidden}))
    if ctx.causal and not causal and not any(f.id == CAUSAL_LEAK for f in found.findings):
        found.findings.append(Finding.of(CAUSAL_LEAK, "queries see future keys",
                                         {"future (query, key) pairs seen": seen_future.nonzero().tolist()[:10]}))
    if ctx.allow_nonstandard:  # a pattern no attention design follows is the user's choice to make (triangle
        # attention over pairs): said, not judged
        odd = [f for f in found.findings if f.id == DEFINITION_MISMATCH]
        if odd:
            found.findings = [f for f in found.findings if f.id != DEFINITION_MISMATCH]
            found.notes["pattern"] = f"{odd[0].message} (not judged: --allow-nonstandard)"
    return found


def _candidates(ctx: Context) -> list[Caller]:
    """Every (mask argument, kind, shape) to try, most specific first; the user's statement if any."""
    if ctx.call.style == "adapter":
        args: list[str | None] = [None]
    else:
        args = [ctx.call.mask_arg] if ctx.call.required else mask_parameters(ctx.module, ctx.call.style)
    if ctx.call.make_mask is not None or ctx.spec is not None:
        spec = ctx.spec or MaskSpec(ctx.declared or "keep", "BLL")
        return [ctx.call.with_mask(spec, arg) for arg in args]
    kinds = [ctx.declared] if ctx.declared else list(KIND_ORDER)
    if not ctx.declared and getattr(ctx.call.adapter, "own_kind", None) == "ignore":
        kinds = ["ignore", *kinds]  # a replayed layer whose model's causal mask is bool, True = masked
    shapes: tuple[str, ...] = SHAPE_ORDER
    if num_heads_of(ctx.module) == ctx.x.shape[0]:  # a (B, L, L) mask broadcast onto B heads (SDPA aligns it to
        shapes = ("B1LL", *(s for s in SHAPE_ORDER if s != "B1LL"))  # the heads) would read as per-item
    if ctx.call.layout == "sequence-first" or getattr(ctx.call.adapter, "sequence_first", False):
        # its own shapes: a (L, L, B) or (L, L, B, 1) mask, a (B, L) key mask (torch's MultiheadAttention), one (L, L)
        # or (L, L, 1) for every item
        shapes = ("LLB", "LLB1", "BL", "LL", "LL1")
    if getattr(ctx.call.adapter, "own_causal", False):  # a layer replayed with its model's causal mask: the
        shapes = tuple(s for s in shapes if not MaskSpec("keep", s).key_only)  # doctor's masks must carry it too
    # lengths go to an argument named for them, or through a replayed layer's call to its parameter so named
    lengths = [ctx.call.with_mask(MaskSpec("lengths", "B"), arg) for arg in args if arg in LENGTH_NAMES or
               (arg is None and getattr(ctx.call.adapter, "mask_name", None) in LENGTH_NAMES)]
    return lengths + [ctx.call.with_mask(MaskSpec(kind, shape), arg) for arg in args for shape in shapes
                      for kind in kinds]


class _Plain(TorchFunctionMode):
    """Every torch function as it is; a mode on the stack turns torch's fused inference paths off, as the float64
    copy's run has them off."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _refused_on_the_other_path(native: Caller, x: Tensor, keep: Tensor) -> bool:
    """Does the module itself refuse this mask when its fused paths are off (as they are for its float64 copy)?"""
    try:
        with torch.no_grad(), _Plain():
            native(x, native.module_mask(keep))
    except Exception:
        return True
    return False


def twin_reads_masks_alike(ctx: Context) -> bool:
    """Does the float64 copy give what the module gives under the masks it accepts? (A module that branches on
    its dtype, dropping its mask outside float32, must be analysed as it is.)"""
    if ctx.exact is None or ctx.no_mask or not ctx.call.takes_mask:
        return True
    b, length, _ = ctx.x.shape
    kinds: dict[str, int] = {}  # the masks compared, by kind: a dtype branch drops every form of a kind alike
    for native in _candidates(ctx):
        kind = native.spec.kind if native.spec is not None else ""
        if kinds.get(kind, 0) >= 2:
            continue
        keep = probe_keep(b, length, native.key_only, native.at_end)
        try:
            with torch.no_grad():
                out = native(ctx.x, native.module_mask(keep))
        except Exception:  # not a mask this module accepts
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
        twin = ctx.exact_of(native)
        try:
            with torch.no_grad():
                out64 = twin(ctx.analysis_x, twin.module_mask(keep))
        except Exception:  # a mask the module takes and its copy refuses (GPT-2's upcast asserts float32 weights)
            if not _refused_on_the_other_path(native, ctx.x, keep):
                return False
            continue  # nn.MultiheadAttention's fast path takes a 3-D key_padding_mask its other path refuses: the
            # module refuses it too when run as its copy is (under a function mode, which turns fast paths off)
        if out.shape != out64.shape or not torch.isfinite(out).all():
            continue
        # rows the copy leaves NaN where the module does not (every key hidden: torch's MultiheadAttention gives NaN
        # there on one path and not on the other) say nothing of a dtype branch; the other rows must agree
        finite = torch.isfinite(out64).all(-1, keepdim=True).expand_as(out64)
        if bool(finite.any()) and not close(out64[finite], out.to(out64.device)[finite], 64 * ctx.rtol):
            return False
    return True


def _replaces_its_own(caller: Caller, x: Tensor, plain: Tensor, dep: Tensor) -> bool:
    """Does a mask replace the pattern the module applies without one (``is_causal=mask is None``): a mask that
    hides nothing changes the output, and one that hides what the module hides on its own does not?"""
    everything = torch.ones(x.shape[0], x.shape[1], x.shape[1], dtype=torch.bool)
    with torch.no_grad():
        if close(caller(x, caller.module_mask(everything)), plain):
            return False
        based = replace(caller, base=dep)
        return close(based(x, based.module_mask(everything)), plain)


def _beyond_its_own(keep: Tensor, dep: Tensor) -> Tensor:
    """The probe's (B, L, L) band, or a narrower one when the module's own pattern ``dep`` already hides all the band
    hides (a causal sliding window of 3, as wide as the band): a mask that replaces that pattern must hide more."""
    if not torch.equal(keep[0].to(dep.device) & dep, dep):
        return keep
    i = torch.arange(keep.shape[-1])
    for width in (2, 1):
        band = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - width)).expand_as(keep)
        if not torch.equal(band[0].to(dep.device) & dep, dep):
            return band
    return keep


def _drops_its_causal_mask(ctx: Context, caller: Caller, keep: Tensor, mask: object,
                           dep: Tensor) -> tuple[Finding, bool] | None:
    """A causal module that drops its causal mask when given a key padding mask (SDPA takes attn_mask or
    is_causal, and ``is_causal=mask is None`` keeps only the first): with the mask, rows see future keys while the
    hidden keys stay hidden. A (B, L) mask cannot carry causality, so this is a leak, not a design. Returns the
    finding and whether the bool mask reads True = padding."""
    length = dep.shape[0]
    if bool((dep & future(length)).any()) or bool(dep.all()):
        return None
    x = ctx.analysis_x
    d = dependency(partial(caller, mask=mask), x, rtol=ctx.dependency_rtol)
    k0, off = keep[0].cpu(), ~torch.eye(length, dtype=torch.bool)
    flipped = bool((d & ~k0 & off).any()) and not bool((d & k0 & off).any())
    if flipped:
        k0 = ~k0  # a bool mask read True = padding
    seen_future = d & future(length) & k0
    if not bool(seen_future.any()) or bool((d & ~k0 & off).any()):
        return None
    return Finding.of(CAUSAL_LEAK, f"given a key padding mask ({_label(caller)}), the module drops its causal mask: "
                      "queries see future keys (a (B, L) mask cannot carry causality; pass both, e.g. an attn_mask "
                      "that is the causal mask and the padding together)",
                      {"future (query, key) pairs seen with the mask": seen_future.nonzero().tolist()[:10],
                       "without a mask": "causal"}), flipped


def _describe(caller: Caller) -> dict:
    note = {"convention": caller.spec.describe() if caller.spec else "your make_mask(keep)"}
    if caller.base is not None:
        note["own pattern"] = ("without a mask the module applies its own pattern (causal, or a window), and a mask "
                               "replaces it: the doctor's masks keep that pattern")
    if caller.spec is not None:  # the old fields, kept for users who read them
        note["shape"] = caller.spec.describe().rpartition("shape ")[2]
        note["kind"] = caller.spec.kind
    if caller.mask_arg:
        note["argument"] = caller.mask_arg
    return note


REFUSED = "refused by the module: "
_LIBRARIES = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[2]))  # torch, selfattn


# words of a refusal, not of a form checked and found wrong ("attn_mask must be (B * H, L, L)" is a mask taken in a
# form the doctor does not send: the mask stays not verified)
_REFUSING = re.compile(r"(not|n't|un)\s*support|not (be )?(allowed|implemented|available|used)|must be none|"
                       r"\bis none\b|cannot be (used|given|passed)|^assert not\b")


def _refusal(err: Exception, words: tuple[str, ...] = ("mask",)) -> str | None:
    """What the module said when its own code refused a mask (monai's ``ValueError("Causal attention does not
    support attention masks.")``, an ``assert mask is None``): a ValueError, NotImplementedError or AssertionError
    raised in the module's file, not torch's, or a RuntimeError the module's own code raises there (the Galerkin
    transformer's "linear attention does not support casual mask."), whose message (or, for a bare assert, whose
    line) refuses a mask in so many words; None for any other failure (a shape that does not fit is the doctor's
    form, not a refusal; an operation's RuntimeError comes from torch's kernels, not from a raise)."""
    if not isinstance(err, (ValueError, NotImplementedError, AssertionError, RuntimeError)) or \
            err.__traceback__ is None:
        return None
    tb = err.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename
    if where.startswith(_LIBRARIES):  # torch's own checks of a form it cannot take
        return None
    if type(err) is RuntimeError and not linecache.getline(where, tb.tb_lineno).lstrip().startswith("raise"):
        return None  # raised by an operation the line runs, not by the module's own code
    return next((said for said in (str(err), linecache.getline(where, tb.tb_lineno).strip())
                 if any(w in said.lower() for w in words) and _REFUSING.search(said.lower())), None)


def _no_mask(why: str) -> Outcome[Caller]:
    return Outcome(notes={"mask": f"none: {why}"}, coverage={"mask": f"not applicable: {why}",
                                                             "padding": f"not applicable: {why}"})


def _of_shape(error: str) -> bool:
    """Does an error a mask raised speak of its shape (a rank or a size the argument does not take)?"""
    return any(word in error.lower() for word in ("shape", "size", "dimension", "rank"))


def _mask_unseen(why: str, tried: dict[str, str]) -> Outcome[Caller]:
    """A mask argument the doctor cannot send in the form it takes: the mask and padding are not verified."""
    return Outcome(notes={"mask": {"not verified": why, "tried": tried}},
                   coverage={"mask": f"not verified: {why}", "padding": f"not verified: {why}"})


def _label(caller: Caller) -> str:
    return f"{caller.mask_arg or 'positional'} {caller.spec.kind if caller.spec else 'make_mask'} " \
           f"{caller.spec.shape if caller.spec else ''}".strip()


def mask_convention(ctx: Context, dep: Tensor) -> Outcome[Caller]:
    """Find the mask argument, shape and kind the module takes, from which tokens each row then depends on.

    Every mask argument of forward (mask, attn_mask, attention_mask, key_padding_mask, ... or the
    next positional one) is tried with shapes (B, L, L), (B, 1, L, L), (B, L), (B, 1, 1, L), (L, L)
    and kinds bool, integer 1/0, float 1/0 and additive (0 / large negative), or only what the user
    stated. A mask that hides a band (key-only masks: a set of keys per item) must hide exactly those
    keys; every other shape of the found kind that the module accepts must act the same way.

    Args:
        ctx: the probe context.
        dep: (L, L) from :func:`causality` (the keys the module sees without a mask).

    Returns:
        Note mask (convention found, "none: <why>", "accepted but ignored", or what was tried);
        findings mask-inverted (not the declared convention, or an additive mask with the wrong sign),
        mask-broadcast (a key mask spread over queries), mask-ignored, mask-convention (a warning:
        ``attention_mask`` read True = masked); value: the caller that passes a mask, or None.
    """
    if ctx.no_mask:
        return _no_mask("you said the module takes no mask (--no-mask)")
    if not ctx.call.takes_mask:
        return _no_mask(getattr(ctx.call.adapter, "why_no_mask", "your call(module, x) passes no mask"))
    candidates = _candidates(ctx)
    switch = switch_parameter(ctx.module) if ctx.call.style != "adapter" else None
    if not candidates:
        if switch is not None:
            return _switch(ctx, switch, dep)
        blocks = block_mask_parameters(ctx.module) if ctx.call.style != "adapter" else []
        if blocks:
            return _no_mask(f"forward takes no tensor mask: {', '.join(blocks)} takes FlexAttention's BlockMask, which "
                            "the doctor does not build (check the mask_mod itself through a module that builds it "
                            "from a tensor mask)")
        return _no_mask("forward takes no mask argument")
    x = ctx.analysis_x
    b, length, _ = x.shape
    with torch.no_grad():
        plain = ctx.analysis(x)
    tried: dict[str, str] = {}
    inverted: Caller | None = None
    leaky: Caller | None = None
    blew_up = False  # the first reading that matched no convention gave NaN or inf
    untouched: set[str] = set()  # labels whose mask reached no operation
    takes_bool: set[tuple[str | None, str]] = set()  # (argument, shape) where a bool mask was accepted
    takes_full: set[str | None] = set()  # arguments where a full (query by key) mask ran
    # a key mask that hides query rows: named once no other argument takes the mask as a key mask (PyG's
    # MultiheadAttentionBlock takes the queries' mask first, x_mask, and the keys' second, y_mask)
    broadcast: tuple[Caller, Tensor] | tuple[Caller, Tensor, str] | None = None
    for native in candidates:
        caller = ctx.exact_of(native)
        if broadcast is not None and caller.mask_arg == broadcast[0].mask_arg:
            continue
        if leaky is not None and not (caller.spec and leaky.spec and caller.spec.kind == "additive" and
                                      (caller.mask_arg, caller.spec.shape) == (leaky.mask_arg, leaky.spec.shape)) \
                and not (caller.key_only and not leaky.key_only and caller.mask_arg == leaky.mask_arg and
                         inverted is None):
            continue  # once a mask acts, only its additive reading may still fit exactly, or a key mask where a
            # full one acted (a module reading row 0 of a (B, 1, 1, L) mask, mask[:, 0, 0]): no more shapes
        label = _label(caller)
        keep = probe_keep(b, length, caller.key_only, caller.at_end)
        try:
            if caller.spec is not None and not caller.key_only and not bool(dep.all()):
                if _replaces_its_own(caller, x, plain, dep):
                    native = replace(native, base=dep)
                elif caller.spec.kind == "keep" and ctx.spec is None and not ctx.declared and not any(
                        c.mask_arg in _PADDING_NAMES and c.mask_arg != caller.mask_arg for c in candidates) and \
                        _replaces_its_own(ctx.exact_of(flip := native.with_mask(MaskSpec("ignore", caller.spec.shape))),
                                          x, plain, dep):  # a bool mask with True = masked that replaces the pattern
                    native = replace(flip, base=dep)  # (Falcon's remote code: causal only when given no mask; a
                    # padding argument beside it, as torch's layers have, is still the one the padding goes to)
                if native.base is not None:
                    caller = ctx.exact_of(native)
                    keep = _beyond_its_own(keep, dep)
                else:  # a mask the module joins to its own pattern (a causal window of 3, as wide as the band)
                    keep = _beyond_its_own(keep, dep)  # must hide more than that pattern too
            mask = caller.module_mask(keep)
            watch = MaskWatch(mask, caller.module)
            with torch.no_grad(), watch:
                masked_out = caller(x, mask)
            if masked_out.shape != x.shape:
                raise ValueError(f"output shape {tuple(masked_out.shape)} with this mask")
            with torch.no_grad():
                # zeros: a module reading the mask inverted; a convention the user stated is read as stated (a module
                # that zeroes the rows its mask empties, reading the mask inverted, matches neither)
                stated = ctx.declared is not None or ctx.spec is not None
                if caller.spec is not None and not stated and not any(
                        close(caller(x, caller.module_mask(k)), plain) for k in (torch.ones_like(keep),
                                                                                 torch.zeros_like(keep))):
                    dropped = _drops_its_causal_mask(ctx, caller, keep, mask, dep) if caller.key_only else None
                    if dropped is not None and any(c.mask_arg in _PADDING_NAMES and c.mask_arg != caller.mask_arg
                                                   for c in candidates):
                        # the mask replaces the module's causal pattern, and the padding has an argument of its own
                        # (attn_mask beside key_padding_mask, as torch's layers take them): that one is the padding's
                        raise ValueError("a padding mask here replaces the causal pattern; the padding argument "
                                         "is tried instead")
                    if dropped is not None:
                        finding, flipped = dropped
                        if flipped and caller.spec is not None and caller.spec.kind == "keep":
                            native = native.with_mask(MaskSpec("ignore", caller.spec.shape))
                        return Outcome[Caller]([finding], {"mask": _describe(native)}, native, {"mask": "verified"})
                    raise ValueError(f"{_SWITCHED}: "
                                     "it broadcasts into other dimensions")
        except Exception as err:  # not this argument, shape or kind: try the next one
            refusal = _refusal(err)
            tried[label] = f"{REFUSED}{refusal}"[:160] if refusal else f"{type(err).__name__}: {err}"[:120]
            continue
        if caller.spec is not None and caller.spec.kind == "keep":
            takes_bool.add((caller.mask_arg, caller.spec.shape))
        if not caller.key_only:
            takes_full.add(caller.mask_arg)
        # in float64, a mask's effect scaled down by a residual branch's gain (LayerScale at 1e-5 or 1e-6) still counts
        if _unchanged(masked_out, plain, 1e-9 if x.dtype == torch.float64 else 1e-4):
            tried[label] = "accepted, but changed nothing" + ("" if watch.used else " (no operation read it)")
            if not watch.used and not watch.reached:
                untouched.add(label)
            continue
        d = dependency(partial(caller, mask=mask), x, rtol=ctx.dependency_rtol)
        off = ~torch.eye(length, dtype=torch.bool)  # a row's own token is its query too: not compared
        k0 = keep[0]
        as_keep, as_ignore = k0 & dep & off, ~k0 & dep & off
        rows = (k0 & dep).any(-1) & (~k0 & dep).any(-1)  # rows where the two readings differ
        flipped_rows = rows
        if caller.key_only:  # a padded position's own row may be zeroed (x-transformers), or left to its own token
            seen = (d & off).any(-1)  # through a residual (flash-attn's padded rows, 0 before a post-norm block)
            rows = rows & (k0.diagonal() | seen)
            flipped_rows = flipped_rows & (~k0.diagonal() | seen)  # read the other way round, its pads' rows
        if torch.equal((d & off)[rows], as_keep[rows]):
            return _found(ctx, native, d, candidates, plain, tried)
        # a mask added after softmax blows up; a row the other reading leaves without keys (a causal query whose
        # keys are all kept, read True = padding) may be NaN, as the module's own reading would give there
        emptied = ~(~keep & dep).any(-1)
        sane = bool(masked_out[~emptied].abs().max() < 100 * (1 + plain.abs().max())) if not bool(emptied.all()) \
            else False
        if sane and torch.equal((d & off)[flipped_rows], as_ignore[flipped_rows]):
            if caller.spec is not None and caller.spec.kind == "keep" and ctx.spec is None and not ctx.declared:
                return _found(ctx, native.with_mask(MaskSpec("ignore", caller.spec.shape)), d, candidates, plain,
                              tried)
            # a bool module reads 0/-10000 inverted; one whose bool reading gave NaN or inf does not (an additive
            # mask subtracted: a bool mask turned into 0/-inf then gives +inf scores)
            leaked_here = leaky is not None and leaky.spec is not None and caller.spec is not None and blew_up \
                and (leaky.mask_arg, leaky.spec.shape) == (caller.mask_arg, caller.spec.shape)
            if caller.spec is None or caller.spec.kind == "keep" or ctx.spec is not None or leaked_here or \
                    (caller.mask_arg, caller.spec.shape) not in takes_bool:
                inverted = inverted or native
            tried[label] = "acts the other way round: hides what the mask keeps"
            continue
        if caller.key_only and _hides_queries(masked_out, plain, k0[0]):
            # a module that takes no (B, L, L) mask in that argument reads (B, 1, L) as its key mask
            if not _query_axis_judged(caller, ctx.spec is not None or caller.mask_arg not in takes_full):
                tried[label] = "read as (B, Lq, Lk): (B, 1, L) is not this module's key mask"
                continue
            if _names_the_queries(ctx.module, caller.mask_arg, ctx.call.style):
                tried[label] = "hides query rows: the mask of the queries' input, beside the keys' own"
                continue
            blank = ("the hidden rows are blank whatever the input and no key is hidden from any query: the mask "
                     "laid on the query axis, or only the padded rows' outputs zeroed while the keys were never "
                     "masked") if _rows_blanked(caller, x, mask, masked_out, k0[0]) else ""
            broadcast = broadcast or (native, k0[0], blank)
            tried[label] = "hides query rows instead of keys"
            continue
        if _query_axis_judged(caller) and caller.spec is not None and caller.spec.kind == "keep" and \
                ctx.spec is None and not ctx.declared and \
                _hides_queries(masked_out, plain, ~k0[0]):  # True = padding, on the queries
            broadcast = broadcast or (native.with_mask(MaskSpec("ignore", caller.spec.shape)), ~k0[0])
            tried[label] = "hides query rows instead of keys (True = padding)"
            continue
        tried[label] = "accepted; its effect matches no convention"
        if leaky is None:
            leaky, blew_up = native, not bool(torch.isfinite(masked_out).all())
    if broadcast is not None:
        return _broadcast_finding(*broadcast)
    if inverted is not None:
        return Outcome([Finding.of(MASK_INVERTED, "the module hides the tokens its mask keeps (declared or "
                                   "additive convention, used the other way round: wrong sign or flipped polarity)",
                                   {"mask": _describe(inverted), "tried": tried})],
                       {"mask": _describe(inverted)}, None,
                       {"mask": "verified", "padding": "not verified: the mask acts the other way round"})
    if leaky is not None and not named_like_mask(leaky.mask_arg) and not leaky.at_end and ctx.spec is None and \
            ctx.call.make_mask is None \
            and ctx.call.style != "adapter":  # an argument not named like a mask, read as no mask is: another input
        why = (f"forward's argument '{leaky.mask_arg or 'positional'}' is not named like a mask, changes the output "
               "and reads no mask the doctor sends the way a mask does (document or segment ids, positions?): give "
               "call= turning the keep-mask into what it takes, with mask='keep (B,L)' (or make_mask)")
        return _mask_unseen(why, tried)
    if leaky is not None:  # the mask acts, but leaks (e.g. applied after the softmax): padding and the white box tell
        return Outcome(notes={"mask": {**_describe(leaky), "note": "its effect matches no convention", "tried": tried}},
                       value=replace(leaky, unmatched=True), coverage={"mask": "verified"})
    return _nothing_acted(ctx, candidates, tried, untouched, switch, dep)


def _unchanged(out: Tensor, plain: Tensor, rtol: float = 1e-4) -> bool:
    """Is ``out`` the output ``plain`` to within ``rtol`` of the larger of 1 and the largest |plain|, or, for an
    output tiny in size (weights initialised at 1e-10, as Pix2Struct's config does), of that size itself?"""
    if close(out, plain, rtol):
        size = float(plain.double().abs().max()) if plain.numel() else 0.0
        return not 0 < size < 1e-3 or bool(((out.double() - plain.double()).abs() <= 1e-4 * size).all())
    return False


def _nothing_acted(ctx: Context, candidates: list[Caller], tried: dict[str, str], untouched: set[str],
                   switch: str | None, dep: Tensor) -> Outcome[Caller]:
    """No candidate mask changed the output: no mask (an argument not named like one, a mask the adapter never
    passes on), a causal switch, mask-ignored (a mask argument that changes nothing), or not understood."""
    accepted = {label for label, why in tried.items() if "changed nothing" in why}
    said = sorted({why[len(REFUSED):] for why in tried.values() if why.startswith(REFUSED)})
    if tried and all(why.startswith(REFUSED) for why in tried.values()) and ctx.spec is None and \
            ctx.call.make_mask is None and ctx.call.style != "adapter" and not ctx.call.required:
        # every form refused by the module's own checks (an assert per mask argument): it takes no mask as configured;
        # nor, when its causal switch is refused too (AudioCraft's assert not is_causal), a switch
        if switch is not None:
            try:
                return _switch(ctx, switch, dep)
            except Exception as err:
                refused = _refusal(err, (switch.lower(), "causal", "mask"))
                if refused is None:
                    raise
                said.append(refused)
        return _no_mask(f"the module refuses every mask ({'; '.join(said)}); it runs without one")
    if ctx.call.style == "adapter" and accepted and accepted <= untouched and ctx.spec is None and \
            ctx.call.make_mask is None:
        return _no_mask("your call(module, x, mask) does not pass the mask to anything")
    named = {c.mask_arg for c in candidates if named_like_mask(c.mask_arg)} or ctx.call.style == "adapter" or \
        ctx.spec is not None or ctx.call.make_mask is not None or ctx.call.required
    if accepted and not named:
        if switch is not None:
            return _switch(ctx, switch, dep)
        arg = next(iter({c.mask_arg or "positional" for c in candidates}))
        return _no_mask(f"forward's argument '{arg}' is not named like a mask and changes nothing")
    if switch is not None and not accepted:
        return _switch(ctx, switch, dep)
    if not accepted and not named and tried:  # every try raised, on an argument not named like a mask (a context)
        arg = next(iter({c.mask_arg or "positional" for c in candidates}))
        if arg in LENGTH_NAMES:  # padding given as lengths: a mask the doctor cannot send, so nothing was looked at
            why = (f"forward's argument '{arg}' is named like padding lengths (B,), a form the doctor does not send: "
                   "give call= turning its keep-mask into lengths, with mask='keep (B,L)' (or make_mask)")
            return _mask_unseen(why, tried)
        return _no_mask(f"forward's argument '{arg}' is not named like a mask and takes none of the masks tried")
    if not accepted and tried and (ctx.spec is not None or ctx.call.make_mask is not None):
        return Outcome([Finding.of(MASK_ERROR, "the module raises whenever it is given the mask you stated",
                                   tried)], {"mask": {"raises with the stated mask": tried}},
                       coverage={"mask": "verified: the module raises with its mask",
                                 "padding": "not verified: the module raises with its mask"})
    unread = {label for label, why in tried.items() if "no operation read it" in why}
    if accepted and accepted <= unread and getattr(ctx.call.adapter, "own_causal", False) and \
            torch.equal(dep.cpu(), torch.ones_like(dep.cpu()).tril()):
        # replayed as its model calls it, with a mask that stands for its causal pattern: a layer that reads only
        # whether a mask is given (Whisper's is_causal=mask is not None) is causal, and has no mask to judge (the
        # model's padding, where it has one, is judged as the model calls it)
        return _no_mask("the layer reads its mask argument only as given or not (no operation reads its values): "
                        "given one, as the model gives it, it is causal")
    bools = {label: why for label, why in tried.items() if label.split(" ")[1:2] in (["keep"], ["ignore"])}
    if accepted and bools and all("Error" in why and _of_shape(why) for why in bools.values()) and \
            all("changed nothing" in tried.get(label, "") for label in accepted) and ctx.spec is None and \
            ctx.call.make_mask is None and not ctx.call.required:
        # a bool mask of every shape raises on its shape, and only an integer or float one runs, changing nothing:
        # the argument takes something else than a mask over the tokens (video-diffusion's focus_present_mask, one
        # flag per item). A bool refused for its dtype (1.0 - mask) is a mask all the same
        arg = next(iter({c.mask_arg or "positional" for c in candidates}))
        return _mask_unseen(f"forward's argument '{arg}' raises on every bool mask the doctor sends, and changes "
                            "nothing given numbers: it takes no mask over the tokens (state one with --mask, or say "
                            "--no-mask)", tried)
    if accepted and all("changed nothing" in v or "Error" in v for v in tried.values()):
        return Outcome([Finding.of(MASK_IGNORED, "the module accepts a mask but its output does not depend on it",
                                   tried, direct=True)],
                       {"mask": {"accepted but ignored": tried}},
                       coverage={"mask": "verified: the module ignores its mask",
                                 "padding": "not verified: the mask changes nothing"})
    if (accepted and accepted <= unread) or (tried and all(_SWITCHED in why for why in tried.values())):
        # a switch read from the mask (Whisper's is_causal=mask is not None): given or not is all that counts
        replayed = hasattr(ctx.call.adapter, "own_causal")  # a model's layer: --causal replays the model's mask
        say = "say --causal (causal=True)" if replayed else \
            "give a --call that always passes the module the mask it is given in use (lambda m, x: m(x, " \
            "mask=...)) and say --causal"
        return Outcome(notes={"mask": {"not understood": tried}},
                       coverage={"mask": "not verified: the module reads its mask argument as a switch (no operation "
                                         "reads its values, or a mask that hides nothing changes the output, as "
                                         "is_causal=mask is not None does); when the mask it is given stands for a "
                                         f"causal pattern, {say}",
                                 "padding": "not verified: no mask understood"})
    return Outcome(notes={"mask": {"not understood": tried}},
                   coverage={"mask": "not verified: no mask argument, shape or kind the doctor tries was accepted; "
                                     "state it with --mask, give --call, or say --no-mask",
                             "padding": "not verified: no mask understood"})


_SWITCHED = "a mask that hides nothing (or everything) does not give the unmasked output"


def _causal_chunks(dep: Tensor) -> tuple[int, int] | None:
    """(c, b) when ``dep`` is causal within consecutive chunks of c tokens (1 < c < L) and sees the b chunks before
    its own whole, hiding every other (b = 0: chunked attention; b > 0: blocked local attention that looks back, as
    local-attention's causal windows); else None."""
    length = dep.shape[0]
    i = torch.arange(length, device=dep.device)
    causal = i[None, :] <= i[:, None]
    for c in range(2, length):
        for back in range(0, (length - 1) // c):
            if torch.equal(dep, causal & (i[None, :] // c >= i[:, None] // c - back)):
                return c, back
    return None


def _switch(ctx: Context, name: str, dep: Tensor) -> Outcome[Caller]:
    """A bool causal switch (``is_causal``): True must hide exactly the future of what the module sees."""
    caller = ctx.call.with_mask(None)
    caller.switch = name
    analysis = ctx.exact_of(caller)
    length = ctx.x.shape[1]
    d = dependency(lambda t: analysis(t, True), ctx.analysis_x, rtol=ctx.dependency_rtol)
    want = dep & ~future(length)
    note = {"convention": f"a causal switch: {name}=True hides the future", "argument": name}
    found = Outcome[Caller](notes={"mask": note}, value=caller,
                            coverage={"mask": "verified", "padding": f"not applicable: the mask is the causal "
                                                                     f"switch {name}"})
    if not torch.equal(d, want):
        found.findings.append(Finding.of(CAUSAL_LEAK, f"with {name}=True the module does not hide exactly the "
                                         "future", {"hidden (query, key) pairs": (want & ~d).nonzero().tolist()[:10],
                                                    "future pairs seen": (d & ~want).nonzero().tolist()[:10]}))
    return found


def _hides_queries(masked_out: Tensor, plain: Tensor, kv: Tensor) -> bool:
    """Did a key mask with keys ``kv`` (L,) visible change exactly the rows of the hidden *queries* of item 0?"""
    diff = (masked_out[0].double() - plain[0].double()).abs().amax(-1)
    changed_rows = ((diff > 1e-4 * (1 + plain.abs().max())) | diff.isnan()).cpu()
    return bool(torch.equal(changed_rows, ~kv))


def _rows_blanked(caller: Caller, x: Tensor, mask: object, masked_out: Tensor, kv: Tensor) -> bool:
    """Are the rows a key mask changed, those of its hidden tokens, blank (the same whatever the input: every key
    hidden from them by a mask on the query axis, which a kernel gives 0, or a padded query's output zeroed, as
    x-transformers does, beside keys never masked)? The two give one output; the finding says both."""
    hidden = ~kv.cpu()
    if not bool(hidden.any()):
        return False
    other = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(11), dtype=x.dtype).to(x.device)
    try:
        with torch.no_grad():
            again = caller(other, mask)
    except Exception:
        return False
    if again.shape != masked_out.shape:
        return False
    size = 1e-6 * (1 + float(masked_out.abs().max()))
    return bool(((again[0] - masked_out[0]).abs()[hidden] <= size).all())


def _query_axis_judged(caller: Caller, stated: bool = False) -> bool:
    """Is a key mask in this caller's form that hides query rows a broadcast bug? Not in (B, 1, L): a module that
    reads every 3-D mask as (B, Lq, Lk), as XLM does, puts it on its query axis by design; that form only serves
    a module that takes no other: ``stated`` when the user said it is the module's key mask (ESPnet's (B, 1, T)),
    or when the module refuses every (B, L, L) mask in that argument."""
    return caller.key_only and (caller.spec is None or caller.spec.shape != "B1L" or stated)


def _broadcast_finding(caller: Caller, kv: Tensor, how: str = "") -> Outcome[Caller]:
    what = caller.spec.describe() if caller.spec else "key mask"
    hidden = (~kv).nonzero().flatten().tolist()
    message = f"the key mask ({what}) hides query rows instead of keys: it is broadcast over the query axis"
    return Outcome([Finding.of(MASK_BROADCAST, message + (f"; {how}" if how else ""),
                               {"rows changed by the mask (item 0)": hidden, "keys it should hide": hidden})],
                   {"mask": _describe(caller)}, None,
                   {"mask": "verified", "padding": "not verified: the mask is applied along the wrong axis"})


def _other_shapes(ctx: Context, found: Caller, candidates: list[Caller], plain: Tensor) -> Outcome[Caller] | None:
    """Every other shape of the found argument and kind that the module accepts must read a key mask the same
    way (a (B, 1, 1, L) mask put on the query axis while (B, 1, L, L) works is a mask-broadcast)."""
    if found.spec is None or found.at_end:  # lengths are the one form of their argument
        return None
    x = ctx.analysis_x
    b, length, _ = x.shape
    keep = probe_keep(1, length, True).expand(b, length, length)  # a key mask every shape can express
    ref_caller = ctx.exact_of(found)
    with torch.no_grad():
        ref = ref_caller(x, ref_caller.module_mask(keep))
    for native in candidates:
        spec = native.spec
        if spec is None or native.mask_arg != found.mask_arg or spec.shape == found.spec.shape or \
                spec.kind != ("keep" if found.spec.kind == "ignore" else found.spec.kind):
            continue
        if not _query_axis_judged(native) and spec.key_only:
            continue
        if {spec.shape, found.spec.shape} == {"LLB", "LLB1"}:  # Transformer-XL's layout or XLNet's, never both: the
            continue  # other one broadcasts against the module's heads axis into another shape
        other = ctx.exact_of(native.with_mask(MaskSpec(found.spec.kind, spec.shape), native.mask_arg))
        try:
            with torch.no_grad():
                out = other(x, other.module_mask(keep))
                if out.shape != ref.shape or not close(other(x, other.module_mask(torch.ones_like(keep))), plain):
                    continue  # not accepted: a mask that hides nothing must give the unmasked output
                if bool((torch.isfinite(ref) & ~torch.isfinite(out)).any()):
                    continue  # NaN where the found shape gives numbers: broadcast into another shape (a 4-D mask
                    # given to nn.MultiheadAttention's key_padding_mask beside a 3-D attn_mask), not a reading
        except Exception:  # this shape is not accepted: nothing to check
            continue
        finite = torch.isfinite(ref)  # rows the call's own mask leaves without a key are NaN in both
        if close(out[finite], ref[finite]):
            continue
        if _hides_queries(out, plain, keep[0, 0]):
            return _broadcast_finding(other, keep[0, 0])
        if spec.key_only and found.spec.kind == "additive" and close(out, plain):  # a constant per query row
            return _broadcast_finding(other, keep[0, 0], "an additive mask put on the query axis adds a constant to "
                                                         "each query row, which the softmax cancels")
        return Outcome([Finding.of(MASK_IGNORED, f"the mask in shape {MASK_SHAPES[spec.shape]} is accepted but "
                                   f"does not hide the keys that shape {MASK_SHAPES[found.spec.shape]} hides",
                                   {"relative difference": rel(out, ref), "mask": _describe(other)})],
                       {"mask": _describe(found)}, None, {"mask": "verified"})
    return _key_mask_broadcast(ctx, candidates, plain)


def _names_the_queries(module: nn.Module, arg: str | None, style: str) -> bool:
    """For a forward that takes the queries and the keys apart (``style`` "qk" or "qkv"): is ``arg`` the mask of its
    first input, the queries', beside another mask argument (PyG's ``MultiheadAttentionBlock.forward(x, y, x_mask,
    y_mask)``, a ``query_mask`` beside a ``key_mask``)? A query mask hides query rows by design."""
    if style not in ("qk", "qkv"):
        return False
    try:
        names = [p.name for p in forward_signature(module).parameters.values()]
    except (TypeError, ValueError):
        return False
    if arg is None or not names or sum(named_like_mask(n) for n in names) < 2:
        return False
    return arg.startswith(f"{names[0]}_") or arg in ("query_mask", "q_mask", "queries_mask")


def _key_mask_broadcast(ctx: Context, candidates: list[Caller], plain: Tensor) -> Outcome[Caller] | None:
    """A module that takes a full mask may also take a (B, L) key mask of another kind (a 1/0 HF attention
    mask beside an additive (B, 1, L, L) one); check that it hides keys, not queries."""
    x = ctx.analysis_x
    b, length, _ = x.shape
    keep = probe_keep(b, length, True)
    for native in candidates:
        if not _query_axis_judged(native) or _names_the_queries(ctx.module, native.mask_arg, ctx.call.style):
            continue
        caller = ctx.exact_of(native)
        try:
            with torch.no_grad():
                out = caller(x, caller.module_mask(keep))
        except Exception:  # this key-only form is not accepted: nothing to check
            continue
        if out.shape == plain.shape and _hides_queries(out, plain, keep[0, 0]):
            return _broadcast_finding(native, keep[0, 0])
    return None


def _found(ctx: Context, caller: Caller, d: Tensor, candidates: list[Caller], plain: Tensor,
           tried: dict[str, str] | None = None) -> Outcome[Caller]:
    other = _other_shapes(ctx, caller, candidates, plain)
    if other is not None:
        return other
    found = Outcome[Caller](notes={"mask": _describe(caller)}, value=caller, coverage={"mask": "verified"})
    later = _later_padding(ctx, caller, candidates, plain, tried or {}) or \
        _padding_ignored(tried or {}, caller.mask_arg)
    broken = _raises_always(tried or {}, caller.mask_arg)
    if broken is not None:  # the padding goes through the argument that fails: the one that works carries no padding
        arg, error = broken
        found.notes["mask"]["raises"] = {arg: error}
        found.coverage["padding"] = f"not verified: every padding mask sent as {arg} raised ({error})"
    elif later is not None:  # a padding argument after the one found, which the module accepts and never applies
        found.findings.append(Finding.of(MASK_IGNORED, f"the module takes {later} and accepts a (B, L) padding mask "
                                         "there, but the keys it marks still change the other tokens' outputs (it "
                                         f"changes nothing, or zeroes rows only; the mask found, {caller.mask_arg}, "
                                         "works)", {"argument": later, "tried": {
                                             k: v for k, v in (tried or {}).items() if k.startswith(later)}}))
    flipped = next((label.split(" ")[0] for label, said in (tried or {}).items()
                    if said.endswith("hiding the keys where it is False")), None)
    if flipped is not None and not ctx.declared:  # a padding argument beside the mask found, read True = keep
        found.findings.append(Finding.of(
            MASK_CONVENTION, f"the argument {flipped}, which in torch's code means True = padding (hidden), hides the "
            "positions where it is False (True = may attend): a padding mask inverted (~mask) before it is applied?",
            {"argument": flipped, "module reads": "True = may attend", "the name suggests": "True = padding"}))
    kind = caller.spec.kind if caller.spec else None
    if ctx.declared and kind in ("keep", "ignore") and ctx.declared != kind:
        found.findings.append(Finding.of(
            MASK_INVERTED, f"you declared the '{ctx.declared}' convention, but the module treats the "
            f"mask the other way ('{kind}')",
            {"row 3 sees keys (declared mask keeps 1, 2, 3)": d[3].nonzero().flatten().tolist()}))
    elif not ctx.declared and kind == "ignore" and caller.mask_arg in ("attention_mask", "encoder_attention_mask"):
        found.findings.append(Finding.of(
            MASK_CONVENTION, f"the argument is called {caller.mask_arg}, which in Hugging Face code means 1 = attend, "
            "but this module hides the positions where it is True (True = masked)",
            {"argument": caller.mask_arg, "module reads": "True = masked", "the name suggests": "1 = attend"}))
    elif not ctx.declared and kind == "ignore" and from_keras(ctx.module):
        found.findings.append(Finding.of(
            MASK_CONVENTION, "a Keras layer's mask means True = keep (a valid timestep, as Keras's own layers and its "
            "masking read it), but this module hides the positions where it is True (True = masked)",
            {"argument": caller.mask_arg or "mask", "module reads": "True = masked", "Keras means": "True = keep"}))
    elif not ctx.declared and kind == "keep" and (caller.mask_arg in _PADDING_NAMES or
                                                  str(caller.mask_arg).endswith("_key_padding_mask")):
        found.findings.append(Finding.of(
            MASK_CONVENTION, f"the argument is called {caller.mask_arg}, which in torch's code means True = padding "
            "(hidden), but this module hides the positions where it is False (True = may attend): a padding mask "
            "passed to scaled_dot_product_attention's attn_mask without its ~?",
            {"argument": caller.mask_arg, "module reads": "True = may attend", "the name suggests": "True = padding"}))
    return found


_PADDING_NAMES = ("key_padding_mask", "padding_mask", "src_key_padding_mask", "pad_mask")
"""Mask arguments named for padding: in torch's MultiheadAttention and its descendants, True = padding."""


def _later_padding(ctx: Context, found: Caller, candidates: list[Caller], plain: Tensor,
                   tried: dict[str, str]) -> str | None:
    """A padding argument (:data:`_PADDING_NAMES`) that comes after the mask argument found and was not tried, sent
    (B, L) masks in each kind: what each did goes into ``tried``; the argument when no mask it accepted acted as
    padding (changed nothing: a key_padding_mask beside a working attn_mask, never applied; or changed the output
    while the padded keys still change the real tokens': padded rows zeroed only, or the mask put on the queries),
    else None."""
    later = [c for c in candidates if c.mask_arg in _PADDING_NAMES and c.mask_arg != found.mask_arg and
             c.spec is not None and c.spec.shape == "BL" and _label(c) not in tried]
    accepted: dict[str, bool] = {}  # argument -> some mask it took acted as padding (its padded keys hidden)
    for native in later:
        caller = ctx.exact_of(native)
        keep = probe_keep(plain.shape[0], plain.shape[1], caller.key_only, caller.at_end)
        try:
            with torch.no_grad():
                out = caller(ctx.analysis_x, caller.module_mask(keep))
        except Exception as err:  # not a form it takes
            tried[_label(native)] = f"{type(err).__name__}: {err}"[:120]
            continue
        rtol = 1e-9 if out.dtype == torch.float64 else 1e-4
        moved = out.shape != plain.shape or not _unchanged(out, plain, rtol)
        side = _hides_its_padding(caller, ctx.analysis_x, keep, out, rtol) if moved and out.shape == plain.shape \
            else None
        if moved and out.shape == plain.shape and side is None:
            tried[_label(native)] = "accepted; it changes the output, but padded keys still change real tokens"
            accepted.setdefault(str(native.mask_arg), False)
            continue
        kind = native.spec.kind if native.spec is not None else None
        if side is not None and (kind, side) in (("keep", "as sent"), ("ignore", "inverted")):
            tried[_label(native)] = "accepted; it changes the output, hiding the keys where it is False"
            accepted[str(native.mask_arg)] = True
            continue
        tried[_label(native)] = "accepted; it changes the output" if moved else "accepted, but changed nothing"
        accepted[str(native.mask_arg)] = accepted.get(str(native.mask_arg), False) or moved
    return next((arg for arg, moved in accepted.items() if not moved), None)


def _hides_its_padding(caller: Caller, x: Tensor, keep: Tensor, out: Tensor, rtol: float) -> str | None:
    """Do the keys a (B, L) mask marks as padding, read either way round, stay hidden: changing those tokens leaves
    the other tokens' outputs (the rows not zeroed) as they were? "as sent", "inverted" (the module hides the other
    side), or None."""
    marked = ~keep.any(1)  # (B, L): keys no query may see, in the doctor's convention
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(x)
    for padded, side in ((marked, "as sent"), (~marked, "inverted")):  # read True = padding: the other side
        other = torch.where(padded[..., None].to(x.device), x + noise, x)
        with torch.no_grad():
            again = caller(other, caller.module_mask(keep))
        real = ~padded.to(out.device) & out.abs().amax(-1).gt(0)  # rows the module keeps (not zeroed)
        if bool(real.any()) and _unchanged(again[real], out[real], rtol):
            return side
    return None


def _padding_ignored(tried: dict[str, str], working: str | None) -> str | None:
    """A padding argument (:data:`_PADDING_NAMES`) other than ``working`` that accepted some of the masks the doctor
    sent it and changed the output with none of them; else None."""
    for arg in _PADDING_NAMES:
        said = [v for label, v in tried.items() if label.split(" ")[0] == arg]
        if arg != working and any(v.startswith("accepted, but changed nothing") for v in said) and \
                not any(v.startswith(("accepted;", "acts")) for v in said):
            return arg
    return None


def _raises_always(tried: dict[str, str], working: str | None) -> tuple[str, str] | None:
    """(argument, its first error) for a padding argument (:data:`_PADDING_NAMES`) other than ``working`` that raised
    on every mask the doctor sent it (fairseq's key_padding_mask not widened for the zero key it adds); else None."""
    for arg in _PADDING_NAMES:
        said = [v for label, v in tried.items() if label.split(" ")[0] == arg]
        if arg != working and said and not any(v.startswith(("accepted", "acts")) for v in said):
            return arg, said[0]
    return None


def padding(ctx: Context, masked: Caller | None, dep: Tensor | None = None) -> Outcome[None]:
    """Changing masked (padding) keys must not change the outputs of real tokens (else: mask-ignored).

    Each batch item has padding of its own length (2, 3, 2, ...: a module that applies item 0's mask to every
    item leaves others' padding visible); checked without and with autograd (a mask dropped on the training path
    only), on one item alone (a batch-1 path), and again at each of :data:`PADDING_LENGTHS` longer than the probe
    input where the module runs (a long-sequence path that drops the mask, keys in chunks that reuse the first
    chunk's mask).

    A module that hides some keys on its own (``dep``: causal, local) is padded on the left too, where the padded
    keys are earlier than the real tokens and its own pattern does not hide them; not through the user's call,
    which may turn the mask into something padding on the left cannot be (lengths).

    Args:
        ctx: the probe context.
        masked: the caller from :func:`mask_convention`; None: nothing is checked.
        dep: (L, L) from :func:`causality` (the keys each query sees without a mask), or None.

    Returns:
        At most a mask-ignored finding.
    """
    if masked is None or masked.switch is not None:
        return Outcome()
    caller, x = ctx.exact_of(masked), ctx.analysis_x
    found = Outcome[None](coverage={"padding": "verified"})
    shared = caller.spec is not None and caller.spec.shape in ("LL", "LL1")  # one mask for every item: one padding
    inputs = [x]
    if x.shape[0] > 1:  # one item alone too (a path for batch 1 that drops the mask), where the module runs at batch 1
        try:
            with torch.no_grad():
                caller(x[:1], caller.module_mask(_own_padding(1, x.shape[1], shared)))
            inputs.append(x[:1])
        except Exception:  # a cache made for exactly B rows (gpt-fast's, torchtune's): the batch probe said so
            pass
    for length in (n for n in PADDING_LENGTHS if n > x.shape[1]):
        longer = ctx.randn(x.shape[0], length, x.shape[2]).to(x.dtype)
        try:
            with torch.no_grad():
                caller(longer, caller.module_mask(_own_padding(x.shape[0], length, shared)))
            inputs.append(longer)
        except Exception:  # the module runs at its own lengths only
            pass
    # padding on the left too (a causal module never sees keys padded at the end), where a mask can say it: not
    # lengths, not one mask for every item, not through the user's call; the padded tokens' values change, never
    # where the real tokens are
    left = dep is not None and not bool(dep.all()) and not shared and caller.style != "adapter" and \
        not (caller.spec is not None and caller.spec.kind == "lengths")
    for t, at_start in [*((t, False) for t in inputs), *((t, True) for t in (inputs if left else []))]:
        b, length, _ = t.shape
        pads = _pads(b, length, shared)
        keep = _own_padding(b, length, shared)
        if at_start:
            keep = keep.flip(-1)
        mask = caller.module_mask(keep)
        t2 = t.clone()
        for i, p in enumerate(pads):
            t2[i, slice(0, p) if at_start else slice(length - p, length)] = ctx.randn(p, t.shape[2]).to(t.dtype)
        real = [slice(p, length) if at_start else slice(0, length - p) for p in pads]
        for grad in (False, True):
            try:
                with torch.set_grad_enabled(grad):
                    a, c = caller(t, mask).detach(), caller(t2, mask).detach()
            except RuntimeError:
                if not grad:
                    raise
                break  # autograd refuses the module's in-place work: it has no training path to drop the mask on
            padded = padded_rows(caller, a)  # the rows the model pads through its call are not real tokens
            rows = [slice(None) if padded is None else ~padded[i, real[i]] for i in range(b)]
            moved = [i for i in range(b) if not close(c[i, real[i]][rows[i]], a[i, real[i]][rows[i]])]
            if moved and _through_token_statistics(partial(caller, t, mask), partial(caller, t2, mask), pads, grad):
                found.notes["statistics over the tokens"] = (
                    "a group or instance norm before the attention normalises each channel over the tokens (a "
                    "U-Net's GroupNorm): padded tokens move its statistics, and through them the real tokens' "
                    "outputs; with those statistics held, the mask hides the padded keys")
                moved = []
            if moved:
                i = moved[0]
                where = (f"batch item {i}" + (" (item 0's padding is hidden: another item's mask is applied?)"
                                              if 0 not in moved else "")
                         + (", padded on the left" if at_start else "")
                         + (f", at {length} tokens" if length != x.shape[1] else "")
                         + (", with one item alone in the batch" if b == 1 < x.shape[0] else "")
                         + (", with autograd on (without it the mask holds)" if grad else ""))
                found.findings.append(Finding.of(MASK_IGNORED, "changing padded (masked) keys changes the outputs "
                                                 f"of real tokens ({where})",
                                                 {"relative change": rel(c[i, real[i]], a[i, real[i]]),
                                                  "items whose real tokens change": moved}))
                return found
    cached = _mask_kept_from_an_earlier_call(caller, x, shared)
    if cached is not None:
        found.findings.append(cached)
        return found
    if x.shape[0] > 1:  # with the mask on, an item's tokens must not reach another item (packed sequences cut at
        b, length, _ = x.shape  # the wrong offsets: a varlen path whose cu_seqlens are off)
        mask = caller.module_mask(_own_padding(b, length, shared))
        x2 = x.clone()
        x2[0] = ctx.randn(length, x.shape[2]).to(x.dtype)
        with torch.no_grad():
            a, c = caller(x, mask), caller(x2, mask)
        pads = _pads(b, length, shared)
        moved = [i for i in range(1, b) if not close(c[i, :length - pads[i]], a[i, :length - pads[i]])]
        if moved:
            found.findings.append(Finding.of(BATCH_MIXING, "with a padding mask, changing one batch item changes the "
                                             "real tokens of another (sequences packed or cut at the wrong offsets?)",
                                             {"items whose real tokens change": moved}))
    return found


def unlike_alone(ctx: Context, caller: Caller, x: Tensor) -> Finding | None:
    """Under a padding mask that hides its last tokens, an item's real tokens must come out as they do alone, run on
    those tokens without the padded ones: else the positions depend on the sequence's length (a relative shift
    that keeps the wrong half of its 2L - 1 columns, a table cut by the length). For modules with relative
    positions, whose padded tokens' values the padding probe found hidden; those that normalise over the tokens
    are not judged."""
    if any(isinstance(m, (nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.BatchNorm1d, nn.BatchNorm2d))
           for m in caller.module.modules()):
        return None
    b, length, _ = x.shape
    pads = _pads(b, length)
    with torch.no_grad():
        padded = caller(x, caller.module_mask(_own_padding(b, length, False)))
    for p in sorted(set(pads)):
        items = [i for i, q in enumerate(pads) if q == p]
        short = x[items, :length - p].clone()
        try:
            with torch.no_grad():
                alone = ctx.analysis(short)
        except Exception:  # not a length the module runs at
            continue
        real = padded[items, :length - p]
        if alone.shape != real.shape or close(alone, real):
            continue
        return Finding.of(DEFINITION_MISMATCH, f"the relative positions depend on the length: under a padding mask "
                          f"hiding the last {p} tokens, the real tokens' outputs differ from those of the same "
                          f"{length - p} tokens run alone (a relative shift that keeps the wrong half of its 2L - 1 "
                          "columns, positions counted from the end)",
                          {"relative difference": rel(alone, real), "tokens": [length - p, length]})
    return None


class _TokenStatistics(TorchFunctionMode):
    """Group and instance norms that record their statistics on one run and reuse them, call by call, on the next:
    what normalises each channel over the tokens then no longer carries one token's change to the others."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: list[tuple[Tensor, Tensor]] = []
        self.replay: int | None = None
        self.seen = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (F.group_norm, F.instance_norm) or not args or not isinstance(args[0], Tensor) or \
                (func is F.instance_norm and not kwargs.get("use_input_stats", args[5] if len(args) > 5 else True)):
            return func(*args, **kwargs)
        self.seen += 1
        x = args[0]
        groups = (args[1] if len(args) > 1 else kwargs["num_groups"]) if func is F.group_norm else x.shape[1]
        flat = x.reshape(x.shape[0], groups, -1)
        if self.replay is None:
            self.stats.append((flat.mean(-1, keepdim=True), flat.var(-1, unbiased=False, keepdim=True)))
            return func(*args, **kwargs)
        if self.replay >= len(self.stats) or self.stats[self.replay][0].shape[0] != x.shape[0]:
            raise RuntimeError("the second run normalised other tensors")
        mean, var = self.stats[self.replay]
        self.replay += 1
        names = ("weight", "bias", "eps") if func is F.group_norm else ("running_mean", "running_var", "weight",
                                                                         "bias", "use_input_stats", "momentum", "eps")
        given = dict(zip(names, args[2:], strict=False)) | kwargs
        eps = given.get("eps", 1e-5)
        y = ((flat - mean) / torch.sqrt(var + eps)).reshape(x.shape)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        if given.get("weight") is not None:
            y = y * given["weight"].reshape(shape)
        if given.get("bias") is not None:
            y = y + given["bias"].reshape(shape)
        return y


def _through_token_statistics(base: Callable[[], Tensor], changed: Callable[[], Tensor], pads: list[int],
                              grad: bool) -> bool:
    """Does a change of the padded tokens reach the real tokens' outputs only through a group or instance norm's
    statistics over the tokens (``changed`` rerun with ``base``'s statistics leaves them as they were)?"""
    mode = _TokenStatistics()
    try:
        with torch.set_grad_enabled(grad):
            with mode:
                a = base().detach()
            if not mode.seen:
                return False
            mode.replay = 0
            with mode:
                c = changed().detach()
    except Exception:  # the runs normalised differently: nothing is read from them
        return False
    return all(close(c[i, :c.shape[1] - p], a[i, :a.shape[1] - p]) for i, p in enumerate(pads))


def _mask_kept_from_an_earlier_call(caller: Caller, x: Tensor, shared: bool) -> Finding | None:
    """For a module whose calls replace its own state (which every probe's call puts back): called in a row, with a
    padding mask and then with one that hides nothing, the second call must read its own mask (else: mask-ignored,
    a mask cached by its shape)."""
    if not caller.replaced:
        return None
    b, length, _ = x.shape
    first = caller.module_mask(_own_padding(b, length, shared))
    second = caller.module_mask(torch.ones(b, length, length, dtype=torch.bool))
    again = _second_of_two(caller, x, first, second)
    if again is None:
        return None
    with torch.no_grad():
        fresh = caller(x, second)
    if close(again, fresh):
        return None
    # a cache continues the first call's sequence (its outputs differ from a call alone by design); the second call
    # must still read its own mask: given the padding mask again instead, it gives other outputs
    padded_again = _second_of_two(caller, x, first, first)
    if padded_again is None or not close(padded_again, again):
        return None
    names = ", ".join(caller.replaced)
    return Finding.of(MASK_IGNORED, f"called in a row, the second call does not read its own mask: after a call with "
                      f"a padding mask, a call with a mask that hides nothing gives another output than alone (the "
                      f"module keeps its {names} from the first call: a mask cached by its shape?)",
                      {"relative change": rel(again, fresh), "state the calls replace": names})


def _second_of_two(caller: Caller, x: Tensor, first: object, second: object) -> Tensor | None:
    """The output of a second call on ``x`` with mask ``second`` after one with ``first``, the module keeping its state
    between them (put back after); None when the calls fail (the state probe reports calls in a row)."""
    kept = replace(caller, keep_state=True)
    state = module_state(caller.module)
    try:
        with torch.no_grad():
            kept(x, first)
            return kept(x, second)
    except Exception:
        return None
    finally:
        restore(state)


def _own_padding(b: int, length: int, shared: bool = False) -> Tensor:
    """(B, L, L) keep-mask: item i's last :func:`_pads` keys are padding."""
    keep = torch.ones(b, length, length, dtype=torch.bool)
    for i, p in enumerate(_pads(b, length, shared)):
        keep[i, :, length - p:] = False
    return keep


def _pads(b: int, length: int, shared: bool = False) -> list[int]:
    """How many keys of each item the padding probes pad: 2 + i % 2 (2 for every item when ``shared``), leaving each
    item one real token at least (a module of 3 tokens: ACT's encoder)."""
    return [min(2 if shared else 2 + i % 2, length - 1) for i in range(b)]


def masked_rows(ctx: Context, masked: Caller | None) -> Outcome[None]:
    """A query row whose keys are all masked must give a finite output (else: nan-on-masked-row).

    With a key-only mask the doctor pads a whole sequence instead; NaN there is the warning
    nan-on-empty-sequence (torch's MultiheadAttention does it). ``masked`` is the caller from
    :func:`mask_convention`; without one (or with a causal switch), nothing is checked.
    """
    if masked is None or masked.switch is not None:
        return Outcome()
    b, length, _ = ctx.x.shape
    try:
        with torch.no_grad():
            o = masked(ctx.x, masked.module_mask(empty_row_keep(b, length, masked.key_only)))
    except Exception as err:
        if raised_inside_doctor(err):
            raise
        return Outcome(notes={"fully masked rows": f"refused by the module (no NaN): {type(err).__name__}: "
                                                   f"{err}"[:200]})
    if torch.isfinite(o).all():
        return Outcome()
    if masked.key_only:  # torch's own MultiheadAttention and SDPA do this: a warning, not a bug
        return Outcome([Finding.of(NAN_ON_EMPTY_SEQUENCE, "a sequence whose keys are all padding gives NaN or inf",
                                   {"non-finite outputs": int((~torch.isfinite(o)).sum()), "masked": "all of item 0"})])
    return Outcome([Finding.of(NAN_ON_MASKED_ROW, "a query row whose keys are all masked gives NaN or inf",
                               {"non-finite outputs": int((~torch.isfinite(o)).sum()), "masked": "row 1"})])

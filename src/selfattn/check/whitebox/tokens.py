"""Which token each row of q, k and v holds: a run with two tokens swapped must change two rows of each.

The module is run twice, on the probe input and on a copy with two neighbouring tokens swapped in every item
(a swap leaves statistics over the tokens, as a GroupNorm's, as they were), and the two records are read side by
side (the same code on the same shapes records the same operations). Each score and value operand must then
change on at most two positions of its token axis within each item, head or window. Where one changes on more,
the way back from it is followed: a tensor is *by token* when its changes lie on at most two indices of an axis of
the sequence's length (or of each of two axes whose sizes multiply to it: a (B, C, H, W) grid), and *mixed* when
they do not. A view, reshape, transpose or permute that turns a tensor by token into a mixed one put features of
one token on the rows of others: heads split with ``view(B, H, L, D)`` instead of ``view(B, L, H, D).transpose(1,
2)``, a (B, C, H, W) map flattened to (B, H*W, C) without its permute. Products, convolutions and pools that mix
tokens are designs (Linformer's projected keys, CvT's convolutional projections, PVT's reduction) and are not
judged.

Shape legend: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

from .products import core_operands
from .trace import LAYOUT, PRODUCTS, SOFTMAX, Op, Trace

__all__ = ["mixed_after", "mixed_rows", "normed_over_tokens", "put_back_elsewhere"]


def _state(changed: Tensor, length: int, last: bool = False, pairs: bool = True) -> bool | None:
    """True: the changes lie on the two swapped tokens (at most two indices of an axis of size L, or, with ``pairs``,
    of each of two axes whose sizes multiply to L); False: on more along every such axis; None: nothing changed, or
    no such axis."""
    if not bool(changed.any()):
        return None
    dims = range(changed.dim())
    hit = [int(changed.movedim(a, 0).reshape(changed.shape[a], -1).any(1).sum()) for a in dims]
    # the last axis holds features (a head dim of L), unless ``last``: a norm's input, its tokens moved last
    axes = [a for a in (dims if last else dims[:-1]) if changed.shape[a] == length]
    two = [(a, b) for a in dims for b in dims if a < b and changed.shape[a] > 1 and changed.shape[b] > 1 and
           changed.shape[a] * changed.shape[b] == length] if pairs else []
    runs = _runs(changed.shape, length) if pairs else []
    if not axes and not two and not runs:
        return None
    # by token when any reading says so: an axis of size L may be channels ((B, C, H, W) with C = L)
    return any(hit[a] <= 2 for a in axes) or any(hit[a] <= 2 and hit[b] <= 2 for a, b in two) or \
        any(_on_run(changed, a, b) <= 2 for a, b in runs)


def _runs(shape: tuple[int, ...], length: int) -> list[tuple[int, int]]:
    """Runs of three or more neighbouring axes, each of more than one, whose sizes multiply to L: a grid cut into
    windows ((B, H/s, s, W/s, s, E): the tokens of a window partition before its permute)."""
    return [(a, b) for a in range(len(shape)) for b in range(a + 2, len(shape))
            if all(shape[i] > 1 for i in range(a, b + 1)) and math.prod(shape[a:b + 1]) == length]


def _on_run(changed: Tensor, a: int, b: int) -> int:
    """How many positions of the axes a..b, read together as the tokens, hold a change."""
    flat = changed.flatten(a, b)
    return int(flat.movedim(a, 0).reshape(flat.shape[a], -1).any(1).sum())


def mixed_rows(first: Trace, second: Trace, length: int, tokens: tuple[int, int]) -> str | None:
    """Where a layout operation on the way to a q, k or v operand spreads one token's features over the rows of
    other tokens, comparing the record ``first`` with ``second`` (the same run with ``tokens`` swapped); None
    when none does or the records differ in their operations."""
    def said(role: str, op: Op, out: Tensor, before: str) -> str:
        return (f"{role}'s rows mix tokens: swapping tokens {tokens[0]} and {tokens[1]} changes {before} "
                f"before a {op.name}() on the way to {role} and {_rows_changed(out, length)} after it: that "
                f"{op.name}() puts one token's features on the rows of others (heads split with view(B, H, L, D) "
                "instead of view(B, L, H, D).transpose(1, 2), keys laid out by view(B, H, D, L) instead of a "
                "transpose, or a (B, C, H, W) map flattened without its permute)")

    # the tokens may be on the last axis (keys laid out (B, H, D, L) for q @ k): a view that puts features there
    # instead of a permute spreads them (a feature axis of L, B x L x L inputs, is read as tokens too)
    return _first_spread(first, second, length, lambda op: op.name in LAYOUT and not _picked_by_values(first, op),
                         said, last=True, counted=True)


# operations whose result orders or picks positions by the values (a top-k of queries, a sort, a random sample)
_BY_VALUES = frozenset({"topk", "sort", "argsort", "argmax", "argmin", "nonzero", "randint", "randperm",
                        "multinomial"})


def _picked_by_values(trace: Trace, op: Op) -> bool:
    """Is ``op`` an indexing whose index was chosen by the values (Informer's ProbSparse queries gathered in the order
    of a top-k)? The rows it gathers follow the data, not a layout: they are put back by the same index."""
    if op.name not in ("getitem", "index_select", "gather"):
        return False
    main = op.main_input()
    return any((made := trace.maker(a)) is not None and made[0].name in _BY_VALUES
               for tid in op.in_ids if tid != main for a in (tid, *trace.ancestors(tid, 24)))


def mixed_after(first: Trace, second: Trace, out: int, length: int, tokens: tuple[int, int]) -> str | None:
    """Where a layout operation between the attention and the module's output ``out`` (a key in ``first``) puts one
    token's features on the rows of others, comparing ``first`` with ``second`` (the same run with ``tokens``
    swapped): heads merged with a view before their transpose back, tokens put back into a (B, C, H, W) map by a
    reshape without its permute. Only a tensor changed on the swapped tokens' rows alone can be spread: an attention
    with positions changes every row and is not judged; a layout operation that leaves more token positions
    changed than it was given (on every reading of its axes) spreads them. None when none does or the records
    differ."""
    if len(first.ops) != len(second.ops) or any(a.name != b.name for a, b in zip(first.ops, second.ops,
                                                                                 strict=True)):
        return None
    at = {id(op): i for i, op in enumerate(first.ops)}
    todo, seen = [out], {out}
    while todo and len(seen) < 400:
        found = first.maker(todo.pop(0))
        if found is None:
            continue
        op, index = found
        if op.name in _CORE:
            continue  # the attention and what comes before it: the operands' own check
        other = second.ops[at[id(op)]]
        main = op.main_input()
        if op.name in LAYOUT and main is not None and main in op.in_ids and index < len(other.outputs):
            k = op.in_ids.index(main)
            spread = _changed(op.outputs[index], other.outputs[index])
            into = _changed(op.inputs[k], other.inputs[k]) if k < len(other.inputs) else None
            before, after = _counts(into, length), _counts(spread, length)
            if before and after and min(after) > max(before):
                return (f"the output's rows mix tokens: swapping tokens {tokens[0]} and {tokens[1]} changes "
                        f"{max(before)} token rows before a {op.name}() after the attention and {min(after)} of the "
                        f"{length} after it: that {op.name}() puts one token's features on the rows of others "
                        "(heads merged with a view before the transpose back, or tokens put back into a (B, C, H, "
                        "W) map without their permute)")
        for i in op.in_ids:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return None


def put_back_elsewhere(before: Tensor, moved: Tensor, tokens: tuple[int, int]) -> str | None:
    """When the module's (B, L, E) output on the input with ``tokens`` swapped (``moved``) differs from its output
    ``before`` on exactly two token rows of every item, and not on the swapped tokens' rows in some item: each
    token's row is computed and then put back at another token's place (a map rebuilt as (W, H) from tokens laid
    out (H, W), a sequence put back reversed). None otherwise: a module with positions, a causal mask or a window
    changes more rows, and an equivariant one changes the swapped tokens' rows."""
    changed = _changed(before, moved)
    if changed is None or before.dim() != 3:
        return None
    rows = changed.any(-1)  # (B, L)
    counts = rows.sum(-1)
    if not bool(((counts > 0) & (counts <= 2)).all()):
        return None
    wrong = [b for b in range(rows.shape[0]) if set(rows[b].nonzero().flatten().tolist()) != set(tokens)]
    if not wrong:
        return None
    at = sorted(rows[wrong[0]].nonzero().flatten().tolist())
    return (f"the output's rows are put back at other tokens' places: swapping tokens {tokens[0]} and {tokens[1]} "
            f"changes the output's rows {at} (of item {wrong[0]}), not the swapped tokens' own rows: each token's "
            "row is computed and then written where another token's belongs (a map put back as (W, H) from tokens "
            "laid out (H, W), or heads and tokens merged in another order)")


def _counts(changed: Tensor | None, length: int) -> list[int]:
    """How many token positions hold a change, on each reading of ``changed``'s axes as the tokens (an axis of size
    L, the last one too: channels-first attention keeps its tokens there, or two axes whose sizes multiply to L);
    empty when none can be read so."""
    if changed is None or not bool(changed.any()):
        return []
    dims = range(changed.dim())
    found = [int(changed.movedim(a, 0).reshape(changed.shape[a], -1).any(1).sum()) for a in dims
             if changed.shape[a] == length]
    sizes = changed.shape
    for a in dims:
        for b in dims:
            if a < b and sizes[a] > 1 and sizes[b] > 1 and sizes[a] * sizes[b] == length:
                grid = changed.movedim((a, b), (0, 1)).reshape(sizes[a], sizes[b], -1)
                found.append(int(grid.any(-1).sum()))
    found += [_on_run(changed, a, b) for a, b in _runs(tuple(sizes), length)]
    return found


_CORE = PRODUCTS | SOFTMAX | {"scaled_dot_product_attention", "multi_head_attention_forward"}


def _changed(a: Tensor, b: Tensor) -> Tensor | None:
    """Where ``a`` and ``b`` differ (beyond rounding), for two real floating tensors of one shape; else None."""
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.shape != b.shape or a.is_complex() or \
            not a.is_floating_point() or a.numel() == 0:  # an empty tensor (an attention over no queries) holds none
        return None
    diff = (a.double() - b.double()).abs()
    return diff > 1e-6 * (1 + float(a.double().abs().max()))


def normed_over_tokens(first: Trace, second: Trace, length: int, token: int) -> str | None:
    """Where a layer or RMS norm on the way to a q, k or v operand normalises over the tokens (its statistics mix
    every token's features into each row), comparing the record ``first`` with ``second`` (the same run with one
    ``token`` changed: a swap keeps statistics over the tokens as they were); None when none does."""
    def said(role: str, op: Op, out: Tensor, before: str) -> str:
        return (f"{role}'s rows mix tokens: changing token {token} changes its own row before a {op.name}() on the "
                f"way to {role} and {_rows_changed(out, length)} after it: that {op.name}() normalises over the "
                "tokens (a q/k norm applied after the heads or tokens were moved onto its last axis)")

    return _first_spread(first, second, length, lambda op: op.name in _NORMS, said, last=True)


_NORMS = frozenset({"layer_norm", "rms_norm"})


def _first_spread(first: Trace, second: Trace, length: int, judged: Callable[[Op], bool],
                  said: Callable[[str, Op, Tensor, str], str], last: bool = False, counted: bool = False) -> str | None:
    """The first operation ``judged`` on the way back from a q, k or v operand that turns a tensor changed on the
    changed tokens' rows only into one changed on the rows of others, described by ``said``; None when none does
    or the records differ in their operations. ``last``: the tokens may be on the judged input's last axis.
    ``counted``: an operation given a tensor changed on more rows (a convolution before it spread the swap to the
    tokens' neighbours) that leaves more token positions changed than it was given, on every reading of its axes,
    spreads them too (layout operations move rows, they never add any)."""
    if len(first.ops) != len(second.ops) or any(a.name != b.name for a, b in zip(first.ops, second.ops,
                                                                                 strict=True)):
        return None
    at = {id(op): i for i, op in enumerate(first.ops)}
    changed = _changed
    for role, tid, (token_axis, feature_axis) in core_operands(first):
        own = first.maker(tid)
        if own is None:
            continue
        mine = changed(own[0].outputs[own[1]], second.ops[at[id(own[0])]].outputs[own[1]]) \
            if own[1] < len(second.ops[at[id(own[0])]].outputs) else None
        if mine is None or mine.dim() < 2 or not _spread(mine, token_axis, feature_axis):
            continue  # the operand holds each token on one row of its token axis (per head, window, item)
        cur: int | None = tid
        for _ in range(40):
            found = None if cur is None else first.maker(cur)
            if found is None:
                break
            op, index = found
            other = second.ops[at[id(op)]]
            main = op.main_input()
            if main is None or main not in op.in_ids or index >= len(other.outputs):
                break
            k = op.in_ids.index(main)
            if judged(op) and k < len(other.inputs):
                out = changed(op.outputs[index], other.outputs[index])
                into = changed(op.inputs[k], other.inputs[k])
                # a view or reshape that keeps the last axis as it was regroups the others only: its last axis holds
                # the features it was given (a window partition of a (B, H, W, E) map with E = L)
                tail = last and not (op.name in ("view", "reshape") and out is not None and into is not None and
                                     out.shape[-1] == into.shape[-1])
                # the operand itself is read on its axes of L first: two axes whose sizes multiply to L may hold
                # the two tokens by chance (LeViT's keys viewed (B, H, D, L) from (B, L, H, D) with H * D = L)
                state = None if out is None or cur != tid else _state(out, length, tail, pairs=False)
                state = _state(out, length, tail) if state is None and out is not None else state
                if out is not None and into is not None and state is False:
                    if _state(into, length, tail) is True:
                        return said(role, op, out, "their own rows")
                    before, after = _counts(into, length), _counts(out, length)
                    if counted and before and after and min(after) > max(before):
                        return said(role, op, out, f"{max(before)} token rows")
            cur = main
    return None


def _spread(changed: Tensor, token_axis: int, feature_axis: int) -> bool:
    """Does some row of the operand's other axes (an item, head or window) hold the two swapped tokens on more than
    two positions of its token axis, or do the rows together hold them on more than two (each head holding two,
    but other ones: a heads-first tensor re-viewed as (B, L, H, D) at a length that is no multiple of the heads)?"""
    rows = changed.movedim((token_axis, feature_axis), (-2, -1)).any(-1)  # (..., positions)
    flat = rows.reshape(-1, rows.shape[-1])
    return bool((flat.sum(-1) > 2).any()) or int(flat.any(0).sum()) > 2


def _rows_changed(changed: Tensor, length: int) -> str:
    counts = [int(changed.movedim(a, 0).reshape(changed.shape[a], -1).any(1).sum())
              for a in range(changed.dim()) if changed.shape[a] == length]
    return f"{min(counts)} of its {length} token rows" if counts else "the rows of more than two tokens"

"""Strided views that let one fused call stand for the ``n`` spans of a :class:`~.runs.Run`.

The spans of a run start at equal steps, so one ``as_strided`` view of q, k, v (and of the
accumulators) stacks them in the kernel's batch dim with no copy, and batch items fold into the
heads where the strides allow.

Shape legend: B batch, H heads (Hq or Hkv), L length, E features (D or Dv).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from .runs import Run

__all__ = ["CALL_ELEMENTS", "add_spans", "calls", "for_items", "segments", "span_view"]

CALL_ELEMENTS = 1 << 22
"""The most elements one batched call returns (its output in the forward, its three gradients in
the backward), 16 MiB in float32: past a few million elements there is no fixed cost left to save,
only the memory of the call's results. Backward spans longer than that are cut along their keys."""


def _folds(t: Tensor, items: int) -> bool:
    """Whether ``items`` batch items of t (B, H, ...) read as one dim of items * H heads."""
    return items == 1 or t.shape[1] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


def span_view(t: Tensor, items: tuple[int, int], start: int, step: int, n: int, length: int) -> Tensor:
    """``n`` spans of ``length`` positions along dim 2 of t (B, H, L[, E]), the i-th starting at
    ``start + i * step``, of batch items ``items`` = (first, count) folded into the heads:
    (n, count * H, length[, E]), a strided view (:func:`calls` says whether the items fold)."""
    first, count = items
    st = t.stride()
    heads = st[0] if t.shape[1] == 1 else st[1]
    return t.as_strided((n, count * t.shape[1], length, *t.shape[3:]), (step * st[2], heads, st[2], *st[3:]),
                        t.storage_offset() + first * st[0] + start * st[2])


def add_spans(acc: Tensor, items: tuple[int, int], start: int, step: int, n: int, length: int, g: Tensor) -> None:
    """acc's spans (as :func:`span_view`) += g (n, items * H, length, E), where spans may overlap:
    then in slices of ``step`` positions, which do not."""
    if n == 1 or step >= length:
        span_view(acc, items, start, step, n, length).add_(g)
    elif step == 0:
        span_view(acc, items, start, 0, 1, length).add_(g.sum(0, keepdim=True, dtype=acc.dtype))
    else:
        for p0 in range(0, length, step):
            p1 = min(p0 + step, length)
            span_view(acc, items, start + p0, step, n, p1 - p0).add_(g[:, :, p0:p1])


def calls(run: Run, batch_size: int, tensors: tuple[Tensor, ...], attn_mask: Tensor | None,
          per_span: int) -> Iterator[tuple[tuple[int, int], int, int]]:
    """(batch items as (first, count), i0, i1) of each kernel call of a run. The group's items fold
    into the heads where every tensor's strides allow it and the mask is the same for every item
    and head, else one call per item; each call returns at most CALL_ELEMENTS (``per_span`` per
    span and item), at least one span."""
    b0, b1, _ = run.batch.indices(batch_size)
    fold = (attn_mask is None or attn_mask.shape[:2] == (1, 1)) and all(_folds(t, b1 - b0) for t in tensors)
    for items in [(b0, b1 - b0)] if fold else [(b, 1) for b in range(b0, b1)]:
        step = max(1, CALL_ELEMENTS // (per_span * items[1]))
        for i0 in range(0, run.n, step):
            yield items, i0, min(i0 + step, run.n)


def for_items(t: Tensor | None, first: int, items: tuple[int, int]) -> Tensor | None:
    """A run's mask (or dead rows) for the call's items: its own rows when it differs per item."""
    return t if t is None or t.shape[0] == 1 else t[items[0] - first:items[0] - first + items[1]]


def segments(flags: list[bool]) -> list[tuple[int, int, bool]]:
    """(i0, i1, flag) of each maximal stretch of equal flags."""
    out: list[tuple[int, int, bool]] = []
    for i, f in enumerate(flags):
        if out and out[-1][2] == f:
            out[-1] = (out[-1][0], i + 1, f)
        else:
            out.append((i, i + 1, f))
    return out

"""The black-box probes that need no mask: determinism, finite outputs, extreme logits, batch
independence, permutation equivariance.

A probe is a plain function of a :class:`~selfattn.check.subject.context.Context` (what every probe
may read: the module, how it is called, the probe input) and of the results of earlier probes it
needs, passed in explicitly (the module's output, the dependency matrix from
:func:`~selfattn.check.probes.masking.causality`, the positions the white box found). It returns an
:class:`~selfattn.check.subject.context.Outcome` and changes nothing the other probes read. The
table that declares and orders them is :data:`selfattn.check.doctor.PROBES`.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from .._seams import version
from ..findings import BATCH_MIXING, DROPOUT_IN_EVAL, NON_FINITE, NOT_EQUIVARIANT, Finding
from ..subject.context import Context, Outcome, close, padded_rows, rel

__all__ = [
    "batch_independence",
    "determinism",
    "equivariance",
    "extreme_logits",
    "finite_outputs",
]

T = TypeVar("T")


# two runs of one computation whose sums are taken in another order differ by this many roundings of the output's
# dtype (relative to its largest value); dropout changes whole terms
_ROUNDINGS = 64


def determinism(ctx: Context) -> Outcome[None]:
    """Two eval-mode calls on the same input must agree (else: dropout-in-eval). A NaN in the same place in both
    agrees (a row with no visible key is the finite-output probes' finding, not randomness), and so do values a few
    roundings apart: a sampling that only changes the order of a sum (Informer's ProbSparse attention at a length
    where it selects every query) is no dropout."""
    with torch.no_grad():
        a, b = ctx.call(ctx.x), ctx.call(ctx.x)
    if torch.equal(a, b) or (a.shape == b.shape and a.is_floating_point() and
                             _close_or_both_nan(a, b, _ROUNDINGS * torch.finfo(a.dtype).eps)):
        return Outcome()
    differ = (a - b).abs().nan_to_num(float("inf")) if a.shape == b.shape else torch.tensor(float("inf"))
    return Outcome([Finding.of(DROPOUT_IN_EVAL, "two calls in eval mode on the same input differ: something "
                               "random (dropout) is still active", {"max difference": float(differ.max())})])


def finite_outputs(ctx: Context) -> Outcome[None]:
    """The output on ordinary random input must be finite (else: non-finite)."""
    with torch.no_grad():
        out = ctx.call(ctx.x)
    if torch.isfinite(out).all():
        return Outcome()
    return Outcome([Finding.of(NON_FINITE, "the output has NaN or inf on ordinary random input",
                               {"non-finite values": int((~torch.isfinite(out)).sum())})])


def extreme_logits(ctx: Context, out: Tensor) -> Outcome[None]:
    """Large logits (input x 50) must stay finite where ``out``, the output on x, is (else: non-finite)."""
    with torch.no_grad():
        out_big = ctx.call(ctx.x * 50)
    if not torch.isfinite(out).all() or torch.isfinite(out_big).all():
        return Outcome()
    return Outcome([Finding.of(NON_FINITE, "large logits (input x 50) give NaN or inf",
                               {"non-finite values": int((~torch.isfinite(out_big)).sum())})])


def _close_or_both_nan(a: Tensor, b: Tensor, rtol: float) -> bool:
    """:func:`close`, where a NaN in the same place in both agrees: an item's row with no visible key is NaN
    whatever the other items are (the finite-output probes report it), which is no mixing of items."""
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    return close(a.nan_to_num(0.0), b.nan_to_num(0.0), rtol)


def batch_independence(ctx: Context, out: Tensor) -> Outcome[None]:
    """Changing one batch item, or running an item alone, must not change the others (else: batch-mixing).

    Args:
        ctx: the probe context; needs B >= 2 (otherwise nothing is checked).
        out: (B, L, E) the module's output on ``ctx.x``.

    Returns:
        At most a batch-mixing finding.
    """
    x = ctx.x
    if x.shape[0] < 2:
        return Outcome(coverage={"batch_independence": "not applicable: the module runs only with batch size 1"})
    x2 = x.clone()
    x2[0] = ctx.randn(*x.shape[1:])
    notes: dict = {}
    with torch.no_grad():
        out2 = ctx.call(x2)
        try:
            single: Tensor | None = ctx.call(x[1:2])
        except Exception as err:  # a module that runs only at its batch size (a cache allocated for it): a limit,
            single = None  # like a fixed length; changing one item must still leave the others alone
            notes["batch size"] = (f"runs at batch size {x.shape[0]} but not on one item alone (a shape limit: "
                                   f"{type(err).__name__}: {err})"[:240])
    if single is not None and single.shape != out[1:2].shape:  # the call's other arguments carry the batch
        notes["batch size"] = (f"one item alone gives an output of shape {tuple(single.shape)}: the call's other "
                               f"arguments fix the batch at {x.shape[0]} (a shape limit)")
        single = None
    mixed = not _close_or_both_nan(out2[1:], out[1:], ctx.rtol)
    alone = single is not None and not _close_or_both_nan(single, out[1:2], ctx.rtol)
    if alone and not mixed and single is not None and _follows_its_row(ctx, single):
        notes["state per batch row"] = (
            "an item's output depends on its row in the batch, not on the other items: the module keeps a state "
            "per row that the call writes (a cache with a slot per batch row, filled before this call), so an item "
            "alone reads row 0's state")
        return Outcome(notes=notes)
    if alone and not mixed and getattr(ctx.call.adapter, "rows_from_the_start", False):
        with torch.no_grad():  # the call gives an item alone the first item's arguments: the first item is compared
            first = ctx.call(x[0:1])
        if _close_or_both_nan(first, out[0:1], ctx.rtol):
            notes["an item alone"] = ("checked on the first item: the call's per-item arguments are cut to the "
                                      "batch from the first row")
            return Outcome(notes=notes)
    if not mixed and not alone:
        return Outcome(notes=notes)
    evidence = {"change in other items": rel(out2[1:], out[1:]),
                **({"item alone vs in batch": rel(single, out[1:2])} if single is not None else {})}
    return Outcome([Finding.of(BATCH_MIXING, "changing one batch item changes the output of another" if mixed else
                               "an item alone gives another output than in the batch", evidence)], notes=notes)


def _per_row_state(ctx: Context) -> list[Tensor]:
    """The module's tensors (buffers or plain attributes) of three or more dims with a first dim of at least the
    probe's batch: where a cache with a slot per batch row would be."""
    batch = ctx.x.shape[0]
    found: dict[int, Tensor] = {}
    for sub in ctx.module.modules():
        for t in [*sub.buffers(recurse=False), *(v for v in vars(sub).values() if isinstance(v, Tensor))]:
            if t.dim() >= 3 and t.shape[0] >= batch and not isinstance(t, torch.nn.Parameter):
                found[id(t)] = t
    return list(found.values())


def _follows_its_row(ctx: Context, single: Tensor) -> bool:
    """Does an item's output follow its row in the batch and not the other items: with items 0 and 1 swapped,
    item 1 at row 0 gives what item 1 alone gave, and the module wrote into a per-row state while it ran (a
    cache filled before the call, as at a decode step)? A term indexed by the batch row that the call does not
    write (a position table read along the wrong axis) is no such state."""
    state = _per_row_state(ctx)
    if not state:
        return False
    versions = [version(t) for t in state]
    order = torch.arange(ctx.x.shape[0])
    order[0], order[1] = 1, 0
    with torch.no_grad():
        swapped = ctx.call(ctx.x[order])
    written = any(version(t) != v for t, v in zip(state, versions, strict=True))
    return written and _close_or_both_nan(swapped[0:1], single, ctx.rtol)


def equivariance(ctx: Context, out: Tensor, dep: Tensor, positions: str | None) -> Outcome[None]:
    """Permuting the tokens must permute the output (else: not-equivariant).

    Args:
        ctx: the probe context.
        out: (B, L, E) the module's output on ``ctx.x``.
        dep: (L, L) from :func:`causality`; when some key is hidden (causal or local attention)
            permutations need not commute, and nothing is checked.
        positions: the position term the white box recognised (rotary, relative bias), or None;
            a module with one is not expected to be equivariant.

    Returns:
        At most a not-equivariant finding; coverage "not applicable" with the reason.
    """
    if positions:
        return Outcome(coverage={"equivariance": f"not applicable: the module has {positions}"})
    if not dep.all():
        return Outcome(coverage={"equivariance": "not applicable: some keys are hidden without a mask "
                                                 "(causal or local attention)"})
    perm = torch.randperm(ctx.x.shape[1], generator=ctx.gen)
    with torch.no_grad():
        out_p = ctx.call(ctx.x[:, perm])
    # the items a replayed layer's model pads through its call (a key_padding_mask beside the mask argument) keep
    # their padding where it was, under any permutation of the tokens: only the others are compared
    padded = padded_rows(ctx.call, out)
    whole = torch.ones(out.shape[0], dtype=torch.bool, device=out.device) if padded is None else ~padded.any(-1)
    if not bool(whole.any()):
        return Outcome(coverage={"equivariance": "not applicable: every item is padded by the model's own call"})
    if close(out_p[whole], out[whole][:, perm], ctx.rtol):
        return Outcome()
    return Outcome([Finding.of(NOT_EQUIVARIANT, "permuting the input tokens does not permute the output the "
                               "same way", {"relative difference": rel(out_p[whole], out[whole][:, perm])})])

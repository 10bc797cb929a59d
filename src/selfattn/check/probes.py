"""The doctor's probes: each one question put to the module, answered with findings, notes and coverage.

A probe is a plain function of a :class:`Context` (what every probe may read: the module, how it
is called, the probe input) and of the results of earlier probes it needs, passed in explicitly
(the dependency matrix from :func:`causality`, the mask caller from :func:`mask_convention`, the
positions the white box found). It returns an :class:`Outcome` and changes nothing the other
probes read. :func:`examine` runs them in order; a probe that raises is reported as "not verified:
<why>" (in ``not_verified`` and in the coverage of its property) and the others still run.

Black-box probes: shapes, determinism, finite outputs, extreme logits, batch independence,
causality, mask convention (every common shape and kind), padding, fully masked rows, half
precision, gradients, permutation equivariance. White box: Q, K, V captured from the module's
linear maps and the attention recomputed under the definition and under each known bug (see
:mod:`.whitebox`).

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from torch import Tensor, nn

from . import whitebox
from .report import COVERED, Finding, Report, merge
from .target import (
    Caller,
    CannotRun,
    MaskSpec,
    dependency,
    embed_dim_of,
    find_call_style,
    mask_parameters,
    num_heads_of,
)

__all__ = [
    "Context",
    "Outcome",
    "batch_independence",
    "calling",
    "causality",
    "determinism",
    "equivariance",
    "examine",
    "extreme_logits",
    "finite_outputs",
    "gradients",
    "half_precision",
    "mask_convention",
    "masked_rows",
    "not_verified",
    "padding",
    "white_box",
]

T = TypeVar("T")

_RTOL = 1e-4
_SHAPE_ORDER = ("BLL", "B1LL", "BL", "B11L", "LL")  # per-item shapes first: padding differs per item
_KIND_ORDER = ("keep", "keep-int", "keep-float", "additive")  # bool "keep" also finds bool "ignore"


@dataclass(frozen=True)
class Context:
    """What every probe may read; no probe changes it, nor anything another probe reads.

    The one thing probes share is ``gen``, which draws their random inputs: the draws follow the
    order :func:`examine` runs the probes in, so a report is reproducible from its seed.
    """

    module: nn.Module
    call: Caller  # forward(x) or forward(q, k, v) (or the user's adapter), without a mask
    x: Tensor  # (B, L, E) the probe input
    gen: torch.Generator
    declared: str | None  # the bool mask convention the user declared: "keep", "ignore" or None
    causal: bool  # the user requires a causal module
    spec: MaskSpec | None = None  # the mask kind and shape the user stated
    allow_nonstandard: bool = False  # the module says it is not textbook attention

    def randn(self, *shape: int) -> Tensor:
        """Standard normal values of ``shape`` from :attr:`gen`."""
        return torch.randn(*shape, generator=self.gen)


@dataclass
class Outcome(Generic[T]):
    """What a probe returns: findings, notes for ``Report.inferred``, coverage, and a value later probes use."""

    findings: list[Finding] = field(default_factory=list)
    notes: dict = field(default_factory=dict)
    value: T | None = None
    coverage: dict[str, str] = field(default_factory=dict)


def not_verified(err: Exception) -> str:
    """How a probe that raised ``err`` is reported.

    Args:
        err: the exception the probe raised.

    Returns:
        "not verified: <exception type>: <message>", the part after "not verified: " cut to 200 characters.
    """
    return f"not verified: {f'{type(err).__name__}: {err}'[:200]}"


def _close(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= _RTOL * (1 + b.abs().max())).all())


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / (1 + b.abs().max()))


def _future(length: int) -> Tensor:
    """(L, L) bool: True where the key comes after the query."""
    return torch.ones(length, length, dtype=torch.bool).triu(1)


def _padding_keep(b: int, length: int) -> Tensor:
    """(B, L, L) keep-mask: the last two keys of item 0 are padding, everything else is visible."""
    keep = torch.ones(b, length, length, dtype=torch.bool)
    keep[0, :, length - 2:] = False
    return keep


def _empty_row_keep(b: int, length: int, key_only: bool) -> Tensor:
    """(B, L, L) keep-mask: :func:`_padding_keep` with query row 1 (key-only masks: all of item 0) seeing no key."""
    keep = _padding_keep(b, length)
    if key_only:
        keep[0] = False
    else:
        keep[:, 1] = False
    return keep


def _probe_keep(b: int, length: int, key_only: bool) -> Tensor:
    """(B, L, L) keep-mask no module has built in: a band (key-only: a different set of hidden keys per item)."""
    i = torch.arange(length)
    if not key_only:
        band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 2)
        return band.expand(b, length, length)
    hidden = (i[None, :] == (torch.arange(b)[:, None] + 1) % length) | (i[None, :] == (torch.arange(b)[:, None] + 4)
                                                                        % length)
    return (~hidden)[:, None, :].expand(b, length, length)


def _as_tensor(m: object) -> Tensor | None:
    return m if isinstance(m, Tensor) else None


# -- shapes and calling ------------------------------------------------------------------------
def calling(module: nn.Module, embed_dim: int, gen: torch.Generator,
            adapter: Callable | None = None) -> Outcome[tuple[Caller, Tensor]]:
    """Find how the module is called and which shapes it runs for; pick the probe input.

    Args:
        module: the module, in eval mode.
        embed_dim: E, the size of the input's last dimension.
        gen: the probes' random generator (first draws).
        adapter: the user's ``call(module, x, mask)``, used instead of guessing.

    Returns:
        Findings wrong-output-shape, batch-mixing or shape-dependent; notes call, output and
        probe shape; value (caller without a mask, probe input x (B, L, E)).

    Raises:
        CannotRun: the module runs for no shape, or never returns a (B, L, E) output.
    """
    e = embed_dim
    shapes = [(3, 7), (2, 5), (1, 6), (2, e), (1, e)] + ([(e, e)] if e <= 64 else [])
    ran, failed, wrong, reasons = [], [], [], []
    call: Caller | None = Caller(module, "adapter", adapter=adapter) if adapter is not None else None
    for b, length in shapes:
        x = torch.randn(b, length, e, generator=gen)
        if call is None:
            style, why = find_call_style(module, x)
            if not style:
                failed.append(((b, length, e), why))
                reasons.append(why)
                continue
            call = Caller(module, style)
        try:
            with torch.no_grad():
                out = call(x)
        except Exception as err:
            failed.append(((b, length, e), f"{type(err).__name__}: {err}"))
            continue
        (ran if tuple(out.shape) == (b, length, e) else wrong).append(((b, length, e), tuple(out.shape)))
    if call is None or (not ran and not wrong):
        last = reasons[-1] if reasons else failed[-1][1]
        raise CannotRun(f"the module failed on every input shape tried: {last}")
    how = {"x": "forward(x)", "qkv": "forward(q, k, v) with q = k = v = x", "adapter": "your call(module, x, mask)"}
    found = Outcome[tuple[Caller, Tensor]](notes={"call": how[call.style],
                                                  "output": "tensor (or first tensor of a tuple or dict)"})
    if wrong:
        found.findings.append(Finding.of("wrong-output-shape", "the output shape differs from the input shape "
                                         "(B, L, E)", {"input -> output": {str(i): str(o) for i, o in wrong}}))
    if failed:
        evidence = {"runs for": [str(s) for s, _ in ran + wrong],
                    "fails for": {str(s): why[:200] for s, why in failed}}
        if all(len({*s}) < 3 for s, _ in ran + wrong):  # two of B, L, E coincide
            found.findings.append(Finding.of("batch-mixing", "the module runs only when batch, length and embed "
                                             "sizes line up: it mixes the batch or sequence dimension with another",
                                             evidence))
        else:
            found.findings.append(Finding.of("shape-dependent", "the module runs for some valid shapes and fails "
                                             "for others", evidence))
    good = [s for s, _ in ran]
    if not good:
        raise CannotRun("the module never returned a (B, L, E) output; see wrong-output-shape")
    b, length, e = (3, 7, e) if (3, 7, e) in good else good[0]
    found.notes["probe shape"] = (b, length, e)
    found.value = (call, torch.randn(b, length, e, generator=gen))
    return found


# -- black-box probes --------------------------------------------------------------------------
def determinism(ctx: Context) -> Outcome[None]:
    """Two eval-mode calls on the same input must agree (else: dropout-in-eval)."""
    with torch.no_grad():
        a, b = ctx.call(ctx.x), ctx.call(ctx.x)
    if torch.equal(a, b):
        return Outcome()
    return Outcome([Finding.of("dropout-in-eval", "two calls in eval mode on the same input differ: something "
                               "random (dropout) is still active", {"max difference": float((a - b).abs().max())})])


def finite_outputs(ctx: Context) -> Outcome[None]:
    """The output on ordinary random input must be finite (else: non-finite)."""
    with torch.no_grad():
        out = ctx.call(ctx.x)
    if torch.isfinite(out).all():
        return Outcome()
    return Outcome([Finding.of("non-finite", "the output has NaN or inf on ordinary random input",
                               {"non-finite values": int((~torch.isfinite(out)).sum())})])


def extreme_logits(ctx: Context, out: Tensor) -> Outcome[None]:
    """Large logits (input x 50) must stay finite where ``out``, the output on x, is (else: non-finite)."""
    with torch.no_grad():
        out_big = ctx.call(ctx.x * 50)
    if not torch.isfinite(out).all() or torch.isfinite(out_big).all():
        return Outcome()
    return Outcome([Finding.of("non-finite", "large logits (input x 50) give NaN or inf",
                               {"non-finite values": int((~torch.isfinite(out_big)).sum())})])


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
        return Outcome(coverage={"batch_independence": "not verified: the module runs only with batch size 1"})
    x2 = x.clone()
    x2[0] = ctx.randn(*x.shape[1:])
    with torch.no_grad():
        out2 = ctx.call(x2)
        try:
            single = ctx.call(x[1:2])
        except Exception as err:  # the symptom itself: runs on the batch, not on one item
            return Outcome([Finding.of("batch-mixing", "the module fails on one batch item alone but runs on the "
                                       "batch", {"error on x[1:2]": f"{type(err).__name__}: {err}"[:200]})])
    if _close(out2[1:], out[1:]) and _close(single, out[1:2]):
        return Outcome()
    return Outcome([Finding.of("batch-mixing", "changing one batch item changes the output of another",
                               {"change in other items": _rel(out2[1:], out[1:]),
                                "item alone vs in batch": _rel(single, out[1:2])})])


def causality(ctx: Context) -> Outcome[Tensor]:
    """Which tokens each output row depends on; a causal module must hide exactly the future.

    Returns:
        Note causal (True when no query sees a later key); at most a causal-leak finding (the
        causal mask hides the past or the diagonal, hides only some future keys, or the user
        requires causality); value: dep (L, L) bool, row i depends on token j.
    """
    dep = dependency(ctx.call, ctx.x)
    upper = _future(dep.shape[0])
    seen_future = dep & upper
    hidden = ~dep & ~upper  # past or self hidden
    causal = not seen_future.any()
    found = Outcome[Tensor](notes={"causal": causal}, value=dep)
    if causal and hidden.any():
        pairs = hidden.nonzero().tolist()[:10]
        found.findings.append(Finding.of("causal-leak", "the causal mask hides more than the future (the diagonal "
                                         "or past keys)", {"hidden (query, key) pairs with key <= query": pairs}))
    elif not causal and (seen_future.sum() < upper.sum() or ctx.causal):
        found.findings.append(Finding.of("causal-leak", "queries see future keys" +
                                         ("" if ctx.causal else " (some future keys are hidden, others not)"),
                                         {"future (query, key) pairs seen": seen_future.nonzero().tolist()[:10]}))
    return found


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
    if _close(out_p, out[:, perm]):
        return Outcome()
    return Outcome([Finding.of("not-equivariant", "permuting the input tokens does not permute the output the "
                               "same way", {"relative difference": _rel(out_p, out[:, perm])})])


def _candidates(ctx: Context) -> list[Caller]:
    """Every (mask argument, kind, shape) to try, most specific first; the user's statement if any."""
    if ctx.call.style == "adapter":
        args: list[str | None] = [None]
    else:
        args = mask_parameters(ctx.module, ctx.call.style)
    if ctx.call.make_mask is not None or ctx.spec is not None:
        spec = ctx.spec or MaskSpec(ctx.declared or "keep", "BLL")
        return [ctx.call.with_mask(spec, arg) for arg in args]
    kinds = [ctx.declared] if ctx.declared else list(_KIND_ORDER)
    return [ctx.call.with_mask(MaskSpec(kind, shape), arg) for arg in args for shape in _SHAPE_ORDER for kind in kinds]


def _describe(caller: Caller) -> dict:
    note = {"convention": caller.spec.describe() if caller.spec else "your make_mask(keep)"}
    if caller.spec is not None:  # the old fields, kept for users who read them
        note["shape"] = caller.spec.describe().rpartition("shape ")[2]
        note["kind"] = caller.spec.kind
    if caller.mask_arg:
        note["argument"] = caller.mask_arg
    return note


def mask_convention(ctx: Context, dep: Tensor) -> Outcome[Caller]:
    """Find the mask argument, shape and kind the module takes, from which tokens each row then depends on.

    Every mask argument of forward (mask, attn_mask, attention_mask, key_padding_mask, ... or the
    next positional one) is tried with shapes (B, L, L), (B, 1, L, L), (B, L), (B, 1, 1, L), (L, L)
    and kinds bool, integer 1/0, float 1/0 and additive (0 / large negative), or only what the user
    stated. A mask that hides a band (key-only masks: a set of keys per item) must hide exactly those keys.

    Args:
        ctx: the probe context.
        dep: (L, L) from :func:`causality` (the keys the module sees without a mask).

    Returns:
        Note mask (convention found, "not accepted", or what was tried); findings mask-inverted
        (not the declared convention, or an additive mask with the wrong sign), mask-broadcast (a
        key mask spread over queries) or mask-ignored; value: the caller that passes a mask, or None.
    """
    candidates = _candidates(ctx)
    if not candidates:
        return Outcome(notes={"mask": "not accepted"}, coverage={"mask": "not applicable: forward takes no mask",
                                                                 "padding": "not applicable: forward takes no mask"})
    x = ctx.x
    b, length, _ = x.shape
    with torch.no_grad():
        plain = ctx.call(x)
    tried: dict[str, str] = {}
    inverted: Caller | None = None
    leaky: Caller | None = None
    takes_bool: set[tuple[str | None, str]] = set()  # (argument, shape) where a bool mask was accepted
    for caller in candidates:
        if leaky is not None and not (caller.spec and leaky.spec and caller.spec.kind == "additive" and
                                      (caller.mask_arg, caller.spec.shape) == (leaky.mask_arg, leaky.spec.shape)):
            continue  # once a mask acts, only its additive reading may still fit exactly: no more shapes
        label = f"{caller.mask_arg or 'positional'} {caller.spec.kind if caller.spec else 'make_mask'} " \
                f"{caller.spec.shape if caller.spec else ''}".strip()
        keep = _probe_keep(b, length, caller.key_only)
        try:
            mask = caller.module_mask(keep)
            with torch.no_grad():
                masked_out = caller(x, mask)
                if masked_out.shape != x.shape:
                    raise ValueError(f"output shape {tuple(masked_out.shape)} with this mask")
                if caller.spec is not None and not any(_close(caller(x, caller.module_mask(k)), plain) for k in (
                        torch.ones_like(keep), torch.zeros_like(keep))):  # zeros: a module reading the mask inverted
                    raise ValueError("a mask that hides nothing (or everything) does not give the unmasked output: "
                                     "it broadcasts into other dimensions")
        except Exception as err:  # not this argument, shape or kind: try the next one
            tried[label] = f"{type(err).__name__}: {err}"[:120]
            continue
        if caller.spec is not None and caller.spec.kind == "keep":
            takes_bool.add((caller.mask_arg, caller.spec.shape))
        if _close(masked_out, plain):
            tried[label] = "accepted, but changed nothing"
            continue
        d = dependency(lambda t, c=caller, mk=mask: c(t, mk), x)
        off = ~torch.eye(length, dtype=torch.bool)  # a row's own token is its query too: not compared
        k0 = keep[0]
        as_keep, as_ignore = k0 & dep & off, ~k0 & dep & off
        rows = (k0 & dep).any(-1) & (~k0 & dep).any(-1)  # rows where the two readings differ
        if torch.equal((d & off)[rows], as_keep[rows]):
            broadcast = None if caller.key_only else _key_mask_broadcast(ctx, candidates, plain)
            return broadcast or _found(ctx, caller, d)
        sane = bool(masked_out.abs().max() < 100 * (1 + plain.abs().max()))  # a mask added after softmax blows up
        if sane and torch.equal((d & off)[rows], as_ignore[rows]):
            if caller.spec is not None and caller.spec.kind == "keep" and ctx.spec is None and not ctx.declared:
                return _found(ctx, caller.with_mask(MaskSpec("ignore", caller.spec.shape)), d)
            if caller.spec is None or caller.spec.kind == "keep" or ctx.spec is not None or \
                    (caller.mask_arg, caller.spec.shape) not in takes_bool:  # a bool module reads 0/-10000 inverted
                inverted = inverted or caller
            tried[label] = "acts the other way round: hides what the mask keeps"
            continue
        if caller.key_only and _hides_queries(masked_out, plain, k0[0]):
            return _broadcast_finding(caller, k0[0])
        tried[label] = "accepted; its effect matches no convention"
        leaky = leaky or caller
    if inverted is not None:
        return Outcome([Finding.of("mask-inverted", "the module hides the tokens its mask keeps (declared or "
                                   "additive convention, used the other way round: wrong sign or flipped polarity)",
                                   {"mask": _describe(inverted), "tried": tried})],
                       {"mask": _describe(inverted)}, None,
                       {"mask": "verified", "padding": "not verified: the mask acts the other way round"})
    if leaky is not None:  # the mask acts, but leaks (e.g. applied after the softmax): padding and the white box tell
        return Outcome(notes={"mask": {**_describe(leaky), "note": "its effect matches no convention", "tried": tried}},
                       value=leaky, coverage={"mask": "verified"})
    found = Outcome[Caller](notes={"mask": {"not understood": tried}},
                            coverage={"mask": "not verified: no mask argument, shape or kind the doctor tries was "
                                              "accepted; state it with --mask or give --call",
                                      "padding": "not verified: no mask understood"})
    if tried and all("changed nothing" in v or "Error" in v for v in tried.values()) and \
            any("changed nothing" in v for v in tried.values()):
        found.findings.append(Finding.of("mask-ignored", "the module accepts a mask but its output does not "
                                         "depend on it", tried))
        found.coverage = {"mask": "verified", "padding": "not verified: the mask changes nothing"}
    return found


def _hides_queries(masked_out: Tensor, plain: Tensor, kv: Tensor) -> bool:
    """Did a key mask with keys ``kv`` (L,) visible change exactly the rows of the hidden *queries* of item 0?"""
    diff = (masked_out[0] - plain[0]).abs().amax(-1)
    changed_rows = (diff > _RTOL * (1 + plain.abs().max())) | diff.isnan()
    return bool(torch.equal(changed_rows, ~kv))


def _broadcast_finding(caller: Caller, kv: Tensor) -> Outcome[Caller]:
    what = caller.spec.describe() if caller.spec else "key mask"
    return Outcome([Finding.of("mask-broadcast", f"the key mask ({what}) hides query rows instead of keys: it is "
                               "broadcast over the query axis", {"rows changed by the mask (item 0)": (~kv).nonzero()
                                                                 .flatten().tolist(), "keys it should hide":
                                                                 (~kv).nonzero().flatten().tolist()})],
                   {"mask": _describe(caller)}, None,
                   {"mask": "verified", "padding": "not verified: the mask is applied along the wrong axis"})


def _key_mask_broadcast(ctx: Context, candidates: list[Caller], plain: Tensor) -> Outcome[Caller] | None:
    """A module that takes a full mask may also take a (B, L) key mask; check that one hides keys, not queries."""
    b, length, _ = ctx.x.shape
    keep = _probe_keep(b, length, True)
    for caller in candidates:
        if not caller.key_only:
            continue
        try:
            with torch.no_grad():
                out = caller(ctx.x, caller.module_mask(keep))
        except Exception:  # this key-only form is not accepted: nothing to check
            continue
        if out.shape == plain.shape and _hides_queries(out, plain, keep[0, 0]):
            return _broadcast_finding(caller, keep[0, 0])
    return None


def _found(ctx: Context, caller: Caller, d: Tensor) -> Outcome[Caller]:
    found = Outcome[Caller](notes={"mask": _describe(caller)}, value=caller, coverage={"mask": "verified"})
    kind = caller.spec.kind if caller.spec else None
    if ctx.declared and kind in ("keep", "ignore") and ctx.declared != kind:
        found.findings.append(Finding.of(
            "mask-inverted", f"you declared the '{ctx.declared}' convention, but the module treats the "
            f"mask the other way ('{kind}')",
            {"row 3 sees keys (declared mask keeps 1, 2, 3)": d[3].nonzero().flatten().tolist()}))
    return found


def padding(ctx: Context, masked: Caller | None) -> Outcome[None]:
    """Changing masked (padding) keys must not change the outputs of real tokens (else: mask-ignored).

    Args:
        ctx: the probe context.
        masked: the caller from :func:`mask_convention`; None: nothing is checked.

    Returns:
        At most a mask-ignored finding.
    """
    if masked is None:
        return Outcome(coverage={"padding": "not verified: no mask understood"})
    x = ctx.x
    b, length, _ = x.shape
    n = length - 2
    mask = masked.module_mask(_padding_keep(b, length))
    x2 = x.clone()
    x2[0, n:] = ctx.randn(length - n, x.shape[2])
    with torch.no_grad():
        a, c = masked(x, mask), masked(x2, mask)
    found = Outcome[None](coverage={"padding": "verified"})
    if not _close(c[0, :n], a[0, :n]):
        found.findings.append(Finding.of("mask-ignored", "changing padded (masked) keys changes the outputs of real "
                                         "tokens", {"relative change": _rel(c[0, :n], a[0, :n])}))
    return found


def masked_rows(ctx: Context, masked: Caller | None) -> Outcome[None]:
    """A query row whose keys are all masked must give a finite output (else: nan-on-masked-row).

    With a key-only mask the doctor pads a whole sequence instead; NaN there is the warning
    nan-on-empty-sequence (torch's MultiheadAttention does it). ``masked`` is the caller from
    :func:`mask_convention`; without one, nothing is checked.
    """
    if masked is None:
        return Outcome()
    b, length, _ = ctx.x.shape
    with torch.no_grad():
        o = masked(ctx.x, masked.module_mask(_empty_row_keep(b, length, masked.key_only)))
    if torch.isfinite(o).all():
        return Outcome()
    if masked.key_only:  # torch's own MultiheadAttention and SDPA do this: a warning, not a bug
        return Outcome([Finding.of("nan-on-empty-sequence", "a sequence whose keys are all padding gives NaN or inf",
                                   {"non-finite outputs": int((~torch.isfinite(o)).sum()), "masked": "all of item 0"})])
    return Outcome([Finding.of("nan-on-masked-row", "a query row whose keys are all masked gives NaN or inf",
                               {"non-finite outputs": int((~torch.isfinite(o)).sum()), "masked": "row 1"})])


def half_precision(ctx: Context, masked: Caller | None) -> Outcome[None]:
    """A copy in float16 and bfloat16 must run and stay finite where float32 does (else: half-precision-overflow).

    Args:
        ctx: the probe context.
        masked: the caller from :func:`mask_convention`; when given, each dtype is also run with
            a mask that leaves a query row without keys.

    Returns:
        Note half precision (per dtype: ok with the difference to float32); at most one
        half-precision-overflow finding, with what raised or how many values were not finite.
    """
    x = ctx.x
    notes, failures = {}, {}
    keep = None if masked is None else _empty_row_keep(x.shape[0], x.shape[1], masked.key_only)
    with torch.no_grad():
        ref_plain = ctx.call(x)
        ref_masked = masked(x, masked.module_mask(keep)) if masked is not None else None
    for dtype in (torch.float16, torch.bfloat16):
        m = copy.deepcopy(ctx.module).to(dtype).eval()
        for with_mask in ((False, True) if masked is not None else (False,)):
            label = f"{str(dtype)[6:]}{' with mask' if with_mask else ''}"
            ref = ref_masked if with_mask else ref_plain
            if ref is None or not torch.isfinite(ref).all():
                continue
            try:
                with torch.no_grad():
                    if with_mask and masked is not None:
                        out = masked.for_module(m)(x.to(dtype), masked.module_mask(keep, dtype))
                    else:
                        out = ctx.call.for_module(m)(x.to(dtype))
            except Exception as err:  # float32 runs: the half copy should too
                failures[label] = f"raises {type(err).__name__}: {err}"[:200]
                continue
            if not torch.isfinite(out).all():
                failures[label] = f"{int((~torch.isfinite(out)).sum())} non-finite values"
            else:
                notes[label] = f"ok (max difference to float32 {_rel(out.float(), ref):.2g})"
    found = Outcome[None](notes={"half precision": {**notes, **failures}})
    if failures:
        found.findings.append(Finding.of("half-precision-overflow", "in half precision the module raises or gives "
                                         "NaN/inf where float32 runs and is finite", failures))
    return found


def gradients(ctx: Context) -> Outcome[None]:
    """Every trainable parameter and the input must get a gradient (else: no-grad).

    The module's gradients are cleared before and after; :func:`selfattn.check` restores the user's.
    """
    m = ctx.module
    m.zero_grad(set_to_none=True)
    xg = ctx.x.clone().requires_grad_()
    out = ctx.call(xg)
    if not out.requires_grad:
        return Outcome([Finding.of("no-grad", "the output carries no gradient", {})])
    out.float().square().sum().backward()
    missing = [n for n, p in m.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    m.zero_grad(set_to_none=True)
    if not missing and xg.grad is not None and xg.grad.any():
        return Outcome()
    return Outcome([Finding.of("no-grad", "some parameters (or the input) receive no gradient",
                               {"parameters without gradient": missing, "input gets gradient": xg.grad is not None})])


# -- white box ---------------------------------------------------------------------------------
def _raw(caller: Caller, mask: object, keep: Tensor) -> Tensor | None:
    """The mask the module received, as float64 (B, 1, L, L), for formulas that use its values."""
    m = _as_tensor(mask)
    if m is None or caller.spec is None:
        return None
    m = m.double()
    shaped = {"LL": lambda: m[None, None], "BLL": lambda: m[:, None], "B1LL": lambda: m,
              "BL": lambda: m[:, None, None, :], "B11L": lambda: m}[caller.spec.shape]()
    return shaped.expand(keep.shape[0], 1, *keep.shape[-2:])


def _informative_input(ctx: Context, heads: list[int]) -> Tensor:
    """ctx.x, scaled up (at most 3 times) while the scores Q K^T / sqrt(D) are too small (std < 0.5) to tell the
    scale, the softmax axis and the other formulas apart (small initialisations: GPT-2's std 0.02)."""
    x = ctx.x
    for _ in range(3):
        cap = whitebox.capture(ctx.module, lambda t=x: ctx.call(t), x)
        split = None if isinstance(cap, str) else whitebox.qkv_heads(cap, heads[0])
        if split is None:
            return x
        qh, kh, _ = split
        spread = float((qh @ kh.transpose(-1, -2)).std() / qh.shape[-1] ** 0.5)
        if not spread < 0.5:
            return x
        x = x * min(30.0, (1.0 / max(spread, 1e-6)) ** 0.5)
    return x


def white_box(ctx: Context, masked: Caller | None, dep: Tensor) -> Outcome[str]:
    """Recompute the attention from the captured Q, K, V and name the formula the output follows.

    Args:
        ctx: the probe context.
        masked: the caller from :func:`mask_convention`; when given, a run with a causal mask
            (key-only masks: a padding mask) is added.
        dep: (L, L) from :func:`causality`; a module that sees no future key is recomputed causally.

    Returns:
        Note white box (per run: matches the definition, matches a bug, or nothing matched; or
        why it was skipped); a finding for each known bug the output follows, definition-mismatch
        when no formula does (unless ``ctx.allow_nonstandard``); value: the position term found
        (rotary, relative bias) or None.
    """
    b, length, e = ctx.x.shape
    hint = num_heads_of(ctx.module)
    heads = [hint] if hint else [h for h in (1, 2, 4, 8, 16, 32) if e % h == 0]
    x = _informative_input(ctx, heads)
    runs: list[tuple[str, Tensor | None]] = [("without mask", None)]
    if masked is not None:
        if masked.key_only:
            runs.append(("with a padding mask", _padding_keep(b, length)))
        else:
            i = torch.arange(length)
            runs.append(("with a causal mask", (i[None, :] <= i[:, None]).expand(b, length, length)))
    if not (dep & _future(length)).any():
        own = torch.ones(length, length, dtype=torch.bool).tril()
        runs = [(label, own.expand(b, length, length) if k is None else k & own) for label, k in runs]
    findings, results, positions, bias = [], {}, None, None
    for label, keep in runs:
        with_mask = label != "without mask" and masked is not None
        mask = masked.module_mask(keep) if with_mask and masked is not None and keep is not None else None

        def call(mask: object = mask, with_mask: bool = with_mask) -> Tensor:
            return masked(x, mask) if with_mask and masked is not None else ctx.call(x)

        cap = whitebox.capture(ctx.module, call, x)
        if isinstance(cap, str):
            return Outcome(findings, {"white box": f"skipped: {cap}"},
                           coverage={"white_box": f"not verified: {cap}"})
        with torch.no_grad():
            out = call()
        k4 = None if keep is None else keep.reshape(-1, 1, *keep.shape[-2:])
        raw = _raw(masked, mask, k4) if with_mask and masked is not None and k4 is not None else None
        try:
            fid, evidence = whitebox.identify(cap, out, heads, k4, raw, bias)
        except LookupError as err:
            results[label] = str(err)
            if not ctx.allow_nonstandard:
                findings.append(Finding.of("definition-mismatch", f"the output ({label}) follows no formula of "
                                           f"attention: {err}", {"closest": str(err), "projections": cap.how}))
            continue
        bias = evidence.pop("_bias", bias)
        positions = positions or evidence.get("positions")
        results[label] = f"matches the definition: {evidence['formula']}" if fid is None else \
            f"matches {fid}: {evidence.get('matches')}"
        if fid is not None:
            findings.append(Finding.of(fid, f"the output follows a known bug ({label}): {evidence['matches']}",
                                       {**evidence, "projections": cap.how}))
    if x is not ctx.x:
        results["input scale"] = f"x times {float(x[0, 0, 0] / ctx.x[0, 0, 0]):.3g} (the scores were too small to " \
                                 "tell formulas apart)"
    cover = "verified" if not ctx.allow_nonstandard or all("matches" in r for r in results.values()) else \
        "not verified: --allow-nonstandard and no formula matched"
    return Outcome(findings, {"white box": results}, positions, {"white_box": cover})


# -- orchestration -----------------------------------------------------------------------------
_COVERS = {"batch independence": "batch_independence", "causality": "causal", "permutation equivariance":
           "equivariance", "mask convention": "mask", "padding": "padding", "half precision": "half_precision",
           "gradients": "gradients", "white box": "white_box"}


@dataclass
class _Collected:
    """What the probes returned so far, in the order they ran."""

    inferred: dict
    findings: list[Finding] = field(default_factory=list)
    not_verified: dict[str, str] = field(default_factory=dict)
    coverage: dict[str, str] = field(default_factory=dict)

    def take(self, outcome: Outcome[T]) -> T | None:
        self.findings += outcome.findings
        self.inferred.update(outcome.notes)
        for prop, status in outcome.coverage.items():
            self.coverage.setdefault(prop, status)
        return outcome.value

    def run(self, name: str, probe: Callable[..., Outcome[T]], *args: object, default: T | None = None) -> T | None:
        try:
            outcome = probe(*args)
        except Exception as err:  # the property stays unchecked and the report says so; the other probes run
            self.not_verified[name] = not_verified(err)
            if name in _COVERS:
                self.coverage.setdefault(_COVERS[name], self.not_verified[name])
            return default
        if name in _COVERS:
            outcome.coverage.setdefault(_COVERS[name], "verified")
        return self.take(outcome)


def examine(module: nn.Module, inferred: dict, *, declared: str | None, causal: bool, seed: int,
            spec: MaskSpec | None = None, adapter: Callable | None = None,
            make_mask: Callable[[Tensor], Tensor] | None = None, allow_nonstandard: bool = False) -> Report:
    """Run every probe on ``module`` (in eval mode), in order, passing each the results it needs.

    Args:
        module: the module; its gradients are cleared (the caller restores them).
        inferred: what is known before the probes run (module name, how it was built); the
            probes' notes are added after it.
        declared: the bool mask convention the user declared ("keep", "ignore") or None.
        causal: the user requires a causal module.
        seed: seed of the probe inputs and of torch's global generator during the probes.
        spec: the mask kind and shape the user stated, or None (inferred).
        adapter: ``call(module, x, mask)`` replacing the guessed call, or None.
        make_mask: ``make_mask(keep)`` turning a keep-mask into the module's mask, or None.
        allow_nonstandard: no definition-mismatch finding when no formula matches.

    Returns:
        The report.

    Raises:
        CannotRun: the module could not be called on any input shape.
    """
    gen = torch.Generator().manual_seed(seed)
    e = embed_dim_of(module, 16)
    got = _Collected({**inferred, "embed_dim": e})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        call, x = got.take(calling(module, e, gen, adapter))
        call.make_mask = make_mask
        ctx = Context(module, call, x, gen, declared, causal, spec, allow_nonstandard)
        try:
            with torch.no_grad():
                out = call(x)
        except Exception as err:
            raise CannotRun(f"the module failed on the probe input: {type(err).__name__}: {err}") from err
        got.run("eval determinism", determinism, ctx)
        got.run("finite outputs", finite_outputs, ctx)
        got.run("extreme logits", extreme_logits, ctx, out)
        got.run("batch independence", batch_independence, ctx, out)
        dep = got.run("causality", causality, ctx, default=torch.ones(x.shape[1], x.shape[1], dtype=torch.bool))
        masked = got.run("mask convention", mask_convention, ctx, dep)
        got.run("padding", padding, ctx, masked)
        got.run("fully masked rows", masked_rows, ctx, masked)
        got.run("half precision", half_precision, ctx, masked)
        got.run("gradients", gradients, ctx)
        positions = got.run("white box", white_box, ctx, masked, dep)
        got.run("permutation equivariance", equivariance, ctx, out, dep, positions)
    if masked is None:
        got.coverage.setdefault("padding", "not verified: no mask understood")
    findings = merge(got.findings)
    coverage = {prop: got.coverage.get(prop, "not verified: the probe did not run") for prop in COVERED}
    return Report(passed=not any(f.severity == "error" for f in findings), inferred=got.inferred, findings=findings,
                  not_verified=got.not_verified, coverage=coverage)

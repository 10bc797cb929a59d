"""The doctor's probes: each one question put to the module, answered with findings and notes.

A probe is a plain function of a :class:`Context` (what every probe may read: the module, how it
is called, the probe input) and of the results of earlier probes it needs, passed in explicitly
(the dependency matrix from :func:`causality`, the mask caller from :func:`mask_convention`). It
returns an :class:`Outcome` and changes nothing the other probes read. :func:`examine` runs them in
order; a probe that raises is reported as "not verified: <why>" and the others still run.

Black-box probes: shapes, determinism, finite outputs, extreme logits, batch independence,
causality, permutation equivariance, mask convention, padding, fully masked rows, half precision,
gradients. White box: Q, K, V captured from the module's nn.Linear layers and the attention
recomputed under the correct definition and under each known bug (see :mod:`.whitebox`).

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
from .report import Finding, Report, merge
from .target import Caller, CannotRun, accepts_mask, dependency, embed_dim_of, find_call_style, num_heads_of

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
_MASK_SHAPES = {"BLL": "(B, L, L)", "LL": "(L, L)", "B1LL": "(B, 1, L, L)"}


@dataclass(frozen=True)
class Context:
    """What every probe may read; no probe changes it, nor anything another probe reads.

    The one thing probes share is ``gen``, which draws their random inputs: the draws follow the
    order :func:`examine` runs the probes in, so a report is reproducible from its seed.
    """

    module: nn.Module
    call: Caller  # forward(x) or forward(q, k, v), without a mask
    x: Tensor  # (B, L, E) the probe input
    gen: torch.Generator
    declared: str | None  # the mask convention the user declared: "keep", "ignore" or None
    causal: bool  # the user requires a causal module

    def randn(self, *shape: int) -> Tensor:
        """Standard normal values of ``shape`` from :attr:`gen`."""
        return torch.randn(*shape, generator=self.gen)


@dataclass
class Outcome(Generic[T]):
    """What a probe returns: its findings, its notes for ``Report.inferred``, and a value later probes use."""

    findings: list[Finding] = field(default_factory=list)
    notes: dict = field(default_factory=dict)
    value: T | None = None


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


def _empty_row_keep(b: int, length: int) -> Tensor:
    """(B, L, L) keep-mask: :func:`_padding_keep` with query row 1 seeing no key at all."""
    keep = _padding_keep(b, length)
    keep[:, 1] = False
    return keep


# -- shapes and calling ------------------------------------------------------------------------
def calling(module: nn.Module, embed_dim: int, gen: torch.Generator) -> Outcome[tuple[Caller, Tensor]]:
    """Find how the module is called and which shapes it runs for; pick the probe input.

    Args:
        module: the module, in eval mode.
        embed_dim: E, the size of the input's last dimension.
        gen: the probes' random generator (first draws).

    Returns:
        Findings wrong-output-shape, batch-mixing or shape-dependent; notes call, output and
        probe shape; value (caller without a mask, probe input x (B, L, E)).

    Raises:
        CannotRun: the module runs for no shape, or never returns a (B, L, E) output.
    """
    e = embed_dim
    shapes = [(3, 7), (2, 5), (1, 6), (2, e), (1, e)] + ([(e, e)] if e <= 64 else [])
    ran, failed, wrong, reasons = [], [], [], []
    call: Caller | None = None
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
    found = Outcome[tuple[Caller, Tensor]](notes={
        "call": "forward(x)" if call.style == "x" else "forward(q, k, v) with q = k = v = x",
        "output": "tensor (or first item of a tuple)"})
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
        return Outcome()
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


def equivariance(ctx: Context, out: Tensor, dep: Tensor) -> Outcome[None]:
    """Permuting the tokens must permute the output (else: not-equivariant).

    Args:
        ctx: the probe context.
        out: (B, L, E) the module's output on ``ctx.x``.
        dep: (L, L) from :func:`causality`; when some key is hidden (causal or local attention)
            permutations need not commute, and nothing is checked.

    Returns:
        At most a not-equivariant finding.
    """
    if not dep.all():
        return Outcome()
    perm = torch.randperm(ctx.x.shape[1], generator=ctx.gen)
    with torch.no_grad():
        out_p = ctx.call(ctx.x[:, perm])
    if _close(out_p, out[:, perm]):
        return Outcome()
    return Outcome([Finding.of("not-equivariant", "permuting the input tokens does not permute the output the "
                               "same way", {"relative difference": _rel(out_p, out[:, perm])})])


def mask_convention(ctx: Context, dep: Tensor) -> Outcome[Caller]:
    """Find the mask shape and convention the module takes, from what a band mask hides.

    Args:
        ctx: the probe context.
        dep: (L, L) from :func:`causality` (the keys the module sees without a mask).

    Returns:
        Note mask (shape and convention, "not accepted", or why it was not understood);
        findings mask-inverted (the module's convention is not the declared one) or mask-ignored;
        value: the caller that passes a mask, or None if no mask is understood.
    """
    if not accepts_mask(ctx.module, ctx.call.style):
        return Outcome(notes={"mask": "not accepted"})
    x = ctx.x
    b, length, _ = x.shape
    i = torch.arange(length)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 2)  # a band: no module has it built in
    keep_b = keep.expand(b, length, length)
    tried = {}
    for shape in ("BLL", "LL", "B1LL"):
        caller = Caller(ctx.module, ctx.call.style, shape, "keep")
        mask = caller.module_mask(keep_b)
        try:
            d = dependency(lambda t, c=caller, mk=mask: c(t, mk), x)
        except Exception as err:  # this shape is not the module's: try the next one
            tried[shape] = f"{type(err).__name__}: {err}"[:160]
            continue
        eye = torch.eye(length, dtype=torch.bool)  # a row always depends on its own query
        as_keep, as_ignore = (keep & dep) | eye, (~keep & dep) | eye
        rows = (keep & dep).any(-1) & (~keep & dep).any(-1)  # rows where the two readings differ
        with torch.no_grad():
            changed = not _close(caller(x, mask), ctx.call(x))
        if torch.equal(d[rows], as_keep[rows]):
            convention = "keep"
        elif torch.equal(d[rows], as_ignore[rows]):
            convention = "ignore"
        elif not changed:
            tried[shape] = "accepted, but changed nothing"
            continue
        else:  # the mask acts, but leaks (e.g. applied after the softmax): the white box tells
            convention = ctx.declared or "keep"
            tried[shape] = "accepted; its effect matches neither convention, assumed " + convention
        note = {"shape": _MASK_SHAPES[shape],
                "convention": "True/1 = may attend" if convention == "keep" else "True = masked"}
        if shape in tried:
            note["note"] = tried[shape]
        found = Outcome[Caller](notes={"mask": note}, value=Caller(ctx.module, ctx.call.style, shape, convention))
        if ctx.declared and ctx.declared != convention:
            found.findings.append(Finding.of(
                "mask-inverted", f"you declared the '{ctx.declared}' convention, but the module treats the "
                f"mask the other way ('{convention}')",
                {"row 3 sees keys (declared mask keeps 1, 2, 3)": d[3].nonzero().flatten().tolist()}))
        return found
    found = Outcome[Caller](notes={"mask": {"not understood": tried}})
    if any("changed nothing" in v for v in tried.values()):
        found.findings.append(Finding.of("mask-ignored", "the module accepts a mask but its output does not "
                                         "depend on it", tried))
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
        return Outcome()
    x = ctx.x
    b, length, _ = x.shape
    n = length - 2
    mask = masked.module_mask(_padding_keep(b, length))
    x2 = x.clone()
    x2[0, n:] = ctx.randn(length - n, x.shape[2])
    with torch.no_grad():
        a, c = masked(x, mask), masked(x2, mask)
    if _close(c[0, :n], a[0, :n]):
        return Outcome()
    return Outcome([Finding.of("mask-ignored", "changing padded (masked) keys changes the outputs of real tokens",
                               {"relative change": _rel(c[0, :n], a[0, :n])})])


def masked_rows(ctx: Context, masked: Caller | None) -> Outcome[None]:
    """A query row whose keys are all masked must give a finite output (else: nan-on-masked-row).

    Args:
        ctx: the probe context.
        masked: the caller from :func:`mask_convention`; None: nothing is checked.

    Returns:
        At most a nan-on-masked-row finding.
    """
    if masked is None:
        return Outcome()
    b, length, _ = ctx.x.shape
    with torch.no_grad():
        o = masked(ctx.x, masked.module_mask(_empty_row_keep(b, length)))
    if torch.isfinite(o).all():
        return Outcome()
    return Outcome([Finding.of("nan-on-masked-row", "a query row whose keys are all masked gives NaN or inf",
                               {"non-finite outputs": int((~torch.isfinite(o)).sum()), "masked row": 1})])


def half_precision(ctx: Context, masked: Caller | None) -> Outcome[None]:
    """A copy in float16 and bfloat16 must stay finite where float32 is (else: half-precision-overflow).

    Args:
        ctx: the probe context.
        masked: the caller from :func:`mask_convention`; when given, each dtype is also run with
            a mask that leaves one query row without keys.

    Returns:
        Note half precision (per dtype: ok with the difference to float32, or what it raised);
        at most a half-precision-overflow finding.
    """
    x = ctx.x
    notes, findings = {}, []
    mask = None if masked is None else masked.module_mask(_empty_row_keep(x.shape[0], x.shape[1]))
    with torch.no_grad():
        ref_plain = ctx.call(x)
        ref_masked = masked(x, mask) if masked is not None else None
    for dtype in (torch.float16, torch.bfloat16):
        m = copy.deepcopy(ctx.module).to(dtype).eval()
        for with_mask in ((False, True) if masked is not None else (False,)):
            label = f"{str(dtype)[6:]}{' with mask' if with_mask else ''}"
            c = Caller(m, ctx.call.style, masked.mask_shape if masked else None, masked.convention if masked else None)
            ref = ref_masked if with_mask else ref_plain
            try:
                with torch.no_grad():
                    out = c(x.to(dtype), mask) if with_mask else c(x.to(dtype))
            except Exception as err:  # many modules are float32 only: a note, not a finding
                notes[label] = f"raises {type(err).__name__}: {err}"[:200]
                continue
            if torch.isfinite(ref).all() and not torch.isfinite(out).all():
                findings.append(Finding.of("half-precision-overflow", f"in {label} the output has NaN or inf where "
                                           "float32 is finite",
                                           {"dtype": label, "non-finite values": int((~torch.isfinite(out)).sum())}))
            else:
                notes[label] = f"ok (max difference to float32 {_rel(out.float(), ref):.2g})"
    return Outcome(findings, {"half precision": notes})


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
def white_box(ctx: Context, masked: Caller | None, dep: Tensor) -> Outcome[None]:
    """Recompute the attention from the captured Q, K, V and name the formula the output follows.

    Args:
        ctx: the probe context.
        masked: the caller from :func:`mask_convention`; when given, a run with a causal mask is added.
        dep: (L, L) from :func:`causality`; a module that sees no future key is recomputed causally.

    Returns:
        Note white box (per run: matches the definition, matches a bug, or why nothing matched;
        or why it was skipped); a finding for each known bug the output follows.
    """
    x = ctx.x
    b, length, e = x.shape
    hint = num_heads_of(ctx.module)
    heads = [hint] if hint else [h for h in (1, 2, 4, 8, 16, 32) if e % h == 0]
    runs: list[tuple[str, Tensor | None]] = [("without mask", None)]
    if masked is not None:
        i = torch.arange(length)
        runs.append(("with a causal mask", (i[None, :] <= i[:, None]).expand(b, length, length)))
    if not (dep & _future(length)).any():
        own = torch.ones(length, length, dtype=torch.bool).tril()
        runs = [(label, own if k is None else k & own) for label, k in runs]
    findings, results = [], {}
    for label, keep in runs:
        def call(keep: Tensor | None = keep, with_mask: bool = label != "without mask") -> Tensor:
            return masked(x, masked.module_mask(keep)) if with_mask and masked is not None else ctx.call(x)

        cap = whitebox.capture(ctx.module, call, x)
        if isinstance(cap, str):
            return Outcome(findings, {"white box": f"skipped: {cap}"})
        with torch.no_grad():
            out = call()
        k4 = None if keep is None else keep.reshape(-1, 1, *keep.shape[-2:])
        try:
            fid, evidence = whitebox.identify(cap, out, heads, k4)
        except LookupError as err:  # no formula matches: said in the note, no finding
            results[label] = str(err)
            continue
        results[label] = "matches the definition" if fid is None else f"matches {fid}: {evidence.get('matches')}"
        if fid is not None:
            findings.append(Finding.of(fid, f"the output follows a known bug ({label}): {evidence['matches']}",
                                       {**evidence, "projections": cap.how}))
    return Outcome(findings, {"white box": results})


# -- orchestration -----------------------------------------------------------------------------
@dataclass
class _Collected:
    """What the probes returned so far, in the order they ran."""

    inferred: dict
    findings: list[Finding] = field(default_factory=list)
    not_verified: dict[str, str] = field(default_factory=dict)

    def take(self, outcome: Outcome[T]) -> T | None:
        self.findings += outcome.findings
        self.inferred.update(outcome.notes)
        return outcome.value

    def run(self, name: str, probe: Callable[..., Outcome[T]], *args: object, default: T | None = None) -> T | None:
        try:
            outcome = probe(*args)
        except Exception as err:  # the property stays unchecked and the report says so; the other probes run
            self.not_verified[name] = not_verified(err)
            return default
        return self.take(outcome)


def examine(module: nn.Module, inferred: dict, *, declared: str | None, causal: bool, seed: int) -> Report:
    """Run every probe on ``module`` (in eval mode), in order, passing each the results it needs.

    Args:
        module: the module; its gradients are cleared (the caller restores them).
        inferred: what is known before the probes run (module name, how it was built); the
            probes' notes are added after it.
        declared: the mask convention the user declared ("keep", "ignore") or None.
        causal: the user requires a causal module.
        seed: seed of the probe inputs and of torch's global generator during the probes.

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
        call, x = got.take(calling(module, e, gen))
        ctx = Context(module, call, x, gen, declared, causal)
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
        got.run("permutation equivariance", equivariance, ctx, out, dep)
        masked = got.run("mask convention", mask_convention, ctx, dep)
        got.run("padding", padding, ctx, masked)
        got.run("fully masked rows", masked_rows, ctx, masked)
        got.run("half precision", half_precision, ctx, masked)
        got.run("gradients", gradients, ctx)
        got.run("white box", white_box, ctx, masked, dep)
    findings = merge(got.findings)
    return Report(passed=not findings, inferred=got.inferred, findings=findings, not_verified=got.not_verified)


"""The doctor's probes and the order they run in.

A probe is a plain function of a :class:`~selfattn.check.context.Context` (what every probe may
read: the module, how it is called, the probe input) and of the results of earlier probes it needs,
passed in explicitly (the dependency matrix from :func:`~selfattn.check.masking.causality`, the mask
caller from :func:`~selfattn.check.masking.mask_convention`, the positions the white box found). It
returns an :class:`~selfattn.check.context.Outcome` and changes nothing the other probes read.
:func:`examine` runs them in order; a probe that raises is reported as "not verified: <why>" (in
``not_verified`` and in the coverage of its property) and the others still run.

Here: the black-box probes that need no mask (determinism, finite outputs, extreme logits, batch
independence, permutation equivariance) and the orchestration. Elsewhere: :mod:`.calling` (how the
module is called, its sizes and layout), :mod:`.masking` (causality, windows, the mask, padding,
masked rows), :mod:`.numerics` (half precision, gradients), :mod:`.whitebox` (the formula).

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch
from torch import Tensor, nn

from .building import Sizes, param_device, param_dtype
from .calling import calling
from .context import Context, Outcome, close, not_verified, rel, tolerance
from .masking import causality, mask_convention, masked_rows, padding, twin_reads_masks_alike
from .numerics import gradients, half_precision
from .report import COVERED, Finding, Report, merge
from .target import Caller, CannotRun, MaskSpec
from .whitebox import white_box

__all__ = [
    "batch_independence",
    "determinism",
    "equivariance",
    "examine",
    "extreme_logits",
    "finite_outputs",
]

T = TypeVar("T")


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
    notes: dict = {}
    with torch.no_grad():
        out2 = ctx.call(x2)
        try:
            single: Tensor | None = ctx.call(x[1:2])
        except Exception as err:  # a module that runs only at its batch size (a cache allocated for it): a limit,
            single = None  # like a fixed length; changing one item must still leave the others alone
            notes["batch size"] = (f"runs at batch size {x.shape[0]} but not on one item alone (a shape limit: "
                                   f"{type(err).__name__}: {err})"[:240])
    mixed = not close(out2[1:], out[1:], ctx.rtol)
    alone = single is not None and not close(single, out[1:2], ctx.rtol)
    if not mixed and not alone:
        return Outcome(notes=notes)
    evidence = {"change in other items": rel(out2[1:], out[1:]),
                **({"item alone vs in batch": rel(single, out[1:2])} if single is not None else {})}
    return Outcome([Finding.of("batch-mixing", "changing one batch item changes the output of another" if mixed else
                               "an item alone gives another output than in the batch", evidence)], notes=notes)


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
    if close(out_p, out[:, perm], ctx.rtol):
        return Outcome()
    return Outcome([Finding.of("not-equivariant", "permuting the input tokens does not permute the output the "
                               "same way", {"relative difference": rel(out_p, out[:, perm])})])


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


def _float64_twin(call: Caller, x: Tensor, out: Tensor) -> Caller | None:
    """The caller on a float64 copy of the module, when the copy runs and agrees with the module (else None)."""
    if x.dtype == torch.float64 or not x.dtype.is_floating_point:
        return None
    try:
        copied = copy.deepcopy(call.module).double()
        copied.eval()  # not chained: some modules' train() returns None
        twin = call.for_module(copied)
        with torch.no_grad():
            out64 = twin(x.double())
    except Exception:  # a module that cannot run in float64 is analysed in its own dtype
        return None
    if out64.dtype != torch.float64 or not close(out64, out, 64 * tolerance(x.dtype)):
        return None
    return twin


def _constant(call: Caller, x: Tensor, out: Tensor) -> bool:
    """Is the module's output the same for another input (a zero-initialised output projection or norm)?"""
    g = torch.Generator().manual_seed(4321)  # its own draws: the probes' generator is left as it was
    other = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype=x.dtype, device=x.device)
    try:
        with torch.no_grad():
            return bool(torch.equal(call(other), out))
    except Exception:
        return False


def _with_zeros_drawn(call: Caller, x: Tensor, gen: torch.Generator) -> tuple[nn.Module, Caller, Tensor, list[str]]:
    """A copy of the module whose all-zero parameters are drawn from N(0, 0.02^2) (weights of the scale real
    models initialise), its caller and output; CannotRun when there is none to draw or the output stays constant."""
    module = copy.deepcopy(call.module)
    drawn = []
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.numel() and not p.any():
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p))
                drawn.append(name)
    if not drawn:
        raise CannotRun("the module's output does not depend on its input (the same for two random inputs), and no "
                        "parameter is all zeros to explain it: check what the forward returns")
    new = call.for_module(module)
    with torch.no_grad():
        out = new(x)
    if _constant(new, x, out):
        raise CannotRun("the module's output does not depend on its input, even with its all-zero parameters "
                        f"({', '.join(drawn)}) drawn at random: check what the forward returns")
    return module, new, out, drawn


def examine(module: nn.Module, inferred: dict, *, declared: str | None, causal: bool, seed: int,
            spec: MaskSpec | None = None, adapter: Callable | None = None,
            make_mask: Callable[[Tensor], Tensor] | None = None, allow_nonstandard: bool = False,
            sizes: Sizes | None = None, no_mask: bool = False, scale: float | None = None,
            bidirectional: bool = False) -> Report:
    """Run every probe on ``module`` (in eval mode), in order, passing each the results it needs.

    Args:
        module: the module; its gradients are cleared (the caller restores them).
        inferred: what is known before the probes run (module name, how it was built); the
            probes' notes are added after it.
        declared: the bool mask convention the user declared ("keep", "ignore") or None.
        causal: the user requires a causal module.
        seed: seed of the probe inputs and of torch's global generator during the probes.
        spec: the mask kind and shape the user stated, or None (inferred).
        adapter: ``call(module, x[, mask])`` replacing the guessed call, or None.
        make_mask: ``make_mask(keep)`` turning a keep-mask into the module's mask, or None.
        allow_nonstandard: no definition-mismatch finding when no formula matches.
        sizes: the embed dim, and the batch and lengths the user fixed.
        no_mask: the user says the module takes no mask.
        scale: the score scale the user says the module uses on purpose (default 1/sqrt(head dim)).
        bidirectional: the user requires every query to see every key.

    Returns:
        The report.

    Raises:
        CannotRun: the module could not be called on any input shape.
    """
    from .building import embed_dim_of

    gen = torch.Generator().manual_seed(seed)
    dtype, device = param_dtype(module), param_device(module)
    sizes = sizes or Sizes()
    e = embed_dim_of(module, sizes.embed_dim)
    sizes = Sizes(e, sizes.heads, sizes.batch, sizes.lengths)
    got = _Collected({**inferred, "embed_dim": e, **({"dtype": str(dtype)[6:]} if dtype != torch.float32 else {}),
                      **({"device": str(device)} if device.type != "cpu" else {})})
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        called = got.take(calling(module, sizes, gen, adapter, dtype, device))
        assert called is not None  # calling() gives the caller and its input, or raises CannotRun
        call, x = called
        call.make_mask = make_mask
        try:
            with torch.no_grad():
                out = call(x)
        except Exception as err:
            raise CannotRun(f"the module failed on the probe input: {type(err).__name__}: {err}") from err
        if _constant(call, x, out):  # a zero-initialised output layer: probe a copy with those values drawn
            module, call, out, drawn = _with_zeros_drawn(call, x, gen)
            got.inferred["drawn"] = (f"the output does not depend on the input with these weights; the probes ran on "
                                     f"a copy whose all-zero parameters were drawn at random: {', '.join(drawn)}")
        exact = _float64_twin(call, x, out)
        got.inferred["analysed in"] = "a float64 copy" if exact is not None else str(x.dtype)[6:]
        ctx = Context(module, call, x, gen, declared, causal, spec, allow_nonstandard, exact, no_mask, scale,
                      bidirectional)
        got.run("eval determinism", determinism, ctx)
        got.run("finite outputs", finite_outputs, ctx)
        got.run("extreme logits", extreme_logits, ctx, out)
        got.run("batch independence", batch_independence, ctx, out)
        if not twin_reads_masks_alike(ctx):
            ctx = replace(ctx, exact=None)
            got.inferred["analysed in"] = f"{str(x.dtype)[6:]} (its float64 copy reads masks differently)"
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
    if call.mutated:  # every probe's call went through a copy of the input and a restored mask
        got.findings.append(Finding.of("mutates-input", f"the module changes {' and '.join(sorted(call.mutated))} "
                                       "in place (the doctor gave every call a copy of its input and restored the "
                                       "mask after each call)", {"changed": sorted(call.mutated)}))
    findings = merge(got.findings)
    coverage = {prop: got.coverage.get(prop, "not verified: the probe did not run") for prop in COVERED}
    return Report.of(got.inferred, findings, got.not_verified, coverage)

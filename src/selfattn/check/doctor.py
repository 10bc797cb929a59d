"""The doctor's probe table, and :func:`examine`, which runs it on a module.

Each :class:`Probe` is declared once: its name (as reports print it), the function, the property
of :data:`~selfattn.check.report.COVERED` it verifies, the finding kinds it may emit, and the
results of earlier probes it reads (``needs``) or gives to later ones (``gives``). :func:`examine`
runs the table in order. A probe that raises is reported as "not verified: <why>" (in
``not_verified`` and in the coverage of its property) and the others still run; a probe that emits
a kind it does not declare is a doctor bug, reported as one (the verdict is then inconclusive).

The layers, each importing only those before it: :mod:`.findings` (the catalogue) →
:mod:`.subject` (building the module, how it is called, its sizes; what probes share) →
:mod:`.probes` (black box, masking, numerics) → :mod:`.whitebox` (trace, projections, products,
positions) → :mod:`.report` → this module.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from .findings import (
    BATCH_MIXING,
    CAUSAL_LEAK,
    DEFINITION_MISMATCH,
    DROPOUT_IN_EVAL,
    HALF_PRECISION_MISMATCH,
    HALF_PRECISION_OVERFLOW,
    HEAD_MERGE,
    KEYS_HIDDEN,
    MASK_AFTER_SOFTMAX,
    MASK_BROADCAST,
    MASK_CONVENTION,
    MASK_ERROR,
    MASK_IGNORED,
    MASK_INVERTED,
    MATMUL_ORDER,
    MISSING_SCALE,
    MUTATES_INPUT,
    NAN_ON_EMPTY_SEQUENCE,
    NAN_ON_MASKED_ROW,
    NO_GRAD,
    NON_FINITE,
    NOT_EQUIVARIANT,
    SHAPE_DEPENDENT,
    SOFTMAX_DIM,
    VALUES_CHANGED,
    WRONG_GRADIENT,
    WRONG_OUTPUT_SHAPE,
    WRONG_SCALE,
    Finding,
    Kind,
)
from .probes.blackbox import batch_independence, determinism, equivariance, extreme_logits, finite_outputs
from .probes.masking import causality, mask_convention, masked_rows, padding, twin_reads_masks_alike
from .probes.numerics import gradients, half_precision
from .report import COVERED, Report, merge
from .subject.building import CannotRun, Sizes, embed_dim_of, param_device, param_dtype
from .subject.caller import Caller, MaskSpec
from .subject.calling import calling
from .subject.context import Context, Outcome, close, not_verified, tolerance
from .whitebox.probe import white_box

__all__ = ["CALLING_EMITS", "DOCTOR_EMITS", "PROBES", "Probe", "examine"]


@dataclass(frozen=True)
class Probe:
    """One probe of the table.

    ``run(ctx, *needs)`` returns an :class:`~selfattn.check.subject.context.Outcome`; ``needs`` names
    earlier results ("out": the module's output on the probe input, or what an earlier probe
    ``gives``); ``default`` is what a later probe reads when this one raised.
    """

    name: str
    run: Callable[..., Outcome]
    emits: frozenset[Kind]
    covers: str | None = None
    needs: tuple[str, ...] = ()
    gives: str | None = None
    default: Callable[[Context], Any] | None = None


def _sees_everything(ctx: Context) -> Tensor:
    return torch.ones(ctx.x.shape[1], ctx.x.shape[1], dtype=torch.bool)


PROBES: tuple[Probe, ...] = (
    Probe("eval determinism", determinism, frozenset({DROPOUT_IN_EVAL})),
    Probe("finite outputs", finite_outputs, frozenset({NON_FINITE})),
    Probe("extreme logits", extreme_logits, frozenset({NON_FINITE}), needs=("out",)),
    Probe("batch independence", batch_independence, frozenset({BATCH_MIXING}), "batch_independence", ("out",)),
    Probe("causality", causality, frozenset({CAUSAL_LEAK, KEYS_HIDDEN}), "causal", gives="dep",
          default=_sees_everything),
    Probe("mask convention", mask_convention,
          frozenset({MASK_INVERTED, MASK_IGNORED, MASK_ERROR, MASK_BROADCAST, MASK_CONVENTION, CAUSAL_LEAK}),
          "mask", ("dep",), gives="masked"),
    Probe("padding", padding, frozenset({MASK_IGNORED}), "padding", ("masked",)),
    Probe("fully masked rows", masked_rows, frozenset({NAN_ON_MASKED_ROW, NAN_ON_EMPTY_SEQUENCE}), needs=("masked",)),
    Probe("half precision", half_precision, frozenset({HALF_PRECISION_OVERFLOW, HALF_PRECISION_MISMATCH}),
          "half_precision", ("masked",)),
    Probe("gradients", gradients, frozenset({NO_GRAD, WRONG_GRADIENT}), "gradients"),
    Probe("white box", white_box,
          frozenset({MISSING_SCALE, WRONG_SCALE, SOFTMAX_DIM, MATMUL_ORDER, HEAD_MERGE, VALUES_CHANGED,
                     MASK_AFTER_SOFTMAX, MASK_INVERTED, MASK_IGNORED, CAUSAL_LEAK, DEFINITION_MISMATCH}),
          "white_box", ("masked", "dep"), gives="positions"),
    Probe("permutation equivariance", equivariance, frozenset({NOT_EQUIVARIANT}), "equivariance",
          ("out", "dep", "positions")),
)
"""Every probe, in the order :func:`examine` runs them."""

CALLING_EMITS: frozenset[Kind] = frozenset({SHAPE_DEPENDENT, WRONG_OUTPUT_SHAPE, BATCH_MIXING})
"""What finding how the module is called (:func:`~selfattn.check.subject.calling.calling`) may give."""
DOCTOR_EMITS: frozenset[Kind] = frozenset({MUTATES_INPUT})
"""What :func:`examine` itself reports, from every call the probes made."""


@dataclass
class _Collected:
    """What the probes returned so far, in the order they ran."""

    inferred: dict
    findings: list[Finding] = field(default_factory=list)
    not_verified: dict[str, str] = field(default_factory=dict)
    coverage: dict[str, str] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)

    def take(self, outcome: Outcome) -> Any:
        self.findings += outcome.findings
        self.inferred.update(outcome.notes)
        for prop, status in outcome.coverage.items():
            self.coverage.setdefault(prop, status)
        return outcome.value

    def run(self, probe: Probe, ctx: Context) -> None:
        try:
            outcome = probe.run(ctx, *(self.results.get(n) for n in probe.needs))
            undeclared = sorted({f.id for f in outcome.findings} - probe.emits)
            if undeclared:
                raise _Undeclared(f"the {probe.name} probe emitted {', '.join(undeclared)}, which its entry in "
                                  "the doctor's probe table does not declare")
        except Exception as err:  # the property stays unchecked and the report says so; the other probes run
            self.not_verified[probe.name] = not_verified(err)
            if probe.covers:
                self.coverage.setdefault(probe.covers, self.not_verified[probe.name])
            value = probe.default(ctx) if probe.default is not None else None
        else:
            if probe.covers:
                outcome.coverage.setdefault(probe.covers, "verified")
            value = self.take(outcome)
        if probe.gives:
            self.results[probe.gives] = value


class _Undeclared(RuntimeError):
    """A probe emitted a finding kind its table entry does not declare (a doctor bug)."""


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
        if not twin_reads_masks_alike(ctx):
            ctx = replace(ctx, exact=None)
            got.inferred["analysed in"] = f"{str(x.dtype)[6:]} (its float64 copy reads masks differently)"
        got.results["out"] = out
        for probe in PROBES:
            got.run(probe, ctx)
    if got.results.get("masked") is None:
        got.coverage.setdefault("padding", "not verified: no mask understood")
    if call.mutated:  # every probe's call went through a copy of the input and a restored mask
        got.findings.append(Finding.of(MUTATES_INPUT, f"the module changes {' and '.join(sorted(call.mutated))} "
                                       "in place (the doctor gave every call a copy of its input and restored the "
                                       "mask after each call)", {"changed": sorted(call.mutated)}))
    findings = merge(got.findings)
    coverage = {prop: got.coverage.get(prop, "not verified: the probe did not run") for prop in COVERED}
    return Report.of(got.inferred, findings, got.not_verified, coverage)

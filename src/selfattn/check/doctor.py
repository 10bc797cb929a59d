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

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from .findings import (
    BATCH_MIXING,
    CAUSAL_LEAK,
    DEFINITION_MISMATCH,
    DROPOUT_IN_EVAL,
    GROUP_MISMATCH,
    HALF_PRECISION_MISMATCH,
    HALF_PRECISION_OVERFLOW,
    HEAD_MERGE,
    HEAD_SPLIT,
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
    ROTARY_MISMATCH,
    ROTARY_ONE_SIDE,
    SHAPE_DEPENDENT,
    SOFTMAX_DIM,
    STATE_DEPENDENT,
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
from .subject.building import (
    CannotRun,
    Sizes,
    WrongShape,
    build,
    cast_module,
    copy_module,
    dequantized,
    draw_zeros,
    embed_dims_of,
    load_file,
    param_device,
    param_dtype,
    user_callable,
    width_given,
)
from .subject.caller import Caller, MaskSpec, parse_mask
from .subject.calling import calling, calls_in_a_row
from .subject.context import Context, Outcome, close, not_verified, tolerance
from .whitebox.probe import white_box
from .whitebox.products import every_key_hidden
from .whitebox.trace import SOFTMAX, normalises, record

__all__ = ["CALLING_EMITS", "DOCTOR_EMITS", "PROBES", "Probe", "check", "examine"]


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
    Probe("causality", causality, frozenset({CAUSAL_LEAK, KEYS_HIDDEN, DEFINITION_MISMATCH}), "causal", gives="dep",
          default=_sees_everything),
    Probe("mask convention", mask_convention,
          frozenset({MASK_INVERTED, MASK_IGNORED, MASK_ERROR, MASK_BROADCAST, MASK_CONVENTION, CAUSAL_LEAK}),
          "mask", ("dep",), gives="masked"),
    Probe("padding", padding, frozenset({MASK_IGNORED, BATCH_MIXING}), "padding", ("masked", "dep")),
    Probe("fully masked rows", masked_rows, frozenset({NAN_ON_MASKED_ROW, NAN_ON_EMPTY_SEQUENCE}), needs=("masked",)),
    Probe("half precision", half_precision, frozenset({HALF_PRECISION_OVERFLOW, HALF_PRECISION_MISMATCH}),
          "half_precision", ("masked",)),
    Probe("gradients", gradients, frozenset({NO_GRAD, WRONG_GRADIENT, STATE_DEPENDENT}), "gradients"),
    Probe("white box", white_box,
          frozenset({MISSING_SCALE, WRONG_SCALE, SOFTMAX_DIM, MATMUL_ORDER, HEAD_MERGE, VALUES_CHANGED,
                     ROTARY_ONE_SIDE, ROTARY_MISMATCH, HEAD_SPLIT, GROUP_MISMATCH, MASK_AFTER_SOFTMAX, MASK_INVERTED,
                     MASK_IGNORED,
                     CAUSAL_LEAK, DEFINITION_MISMATCH}),
          "white_box", ("masked", "dep"), gives="positions"),
    Probe("permutation equivariance", equivariance, frozenset({NOT_EQUIVARIANT}), "equivariance",
          ("out", "dep", "positions")),
)
"""Every probe, in the order :func:`examine` runs them."""

CALLING_EMITS: frozenset[Kind] = frozenset({SHAPE_DEPENDENT, WRONG_OUTPUT_SHAPE, BATCH_MIXING})
"""What finding how the module is called (:func:`~selfattn.check.subject.calling.calling`) may give."""
DOCTOR_EMITS: frozenset[Kind] = frozenset({MUTATES_INPUT, STATE_DEPENDENT})
"""What :func:`examine` itself reports, from every call the probes made."""


@dataclass
class _Collected:
    """What the probes returned so far, in the order they ran."""

    inferred: dict
    findings: list[Finding] = field(default_factory=list)
    not_verified: dict[str, str] = field(default_factory=dict)
    coverage: dict[str, str] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def take(self, outcome: Outcome) -> Any:
        self.findings += outcome.findings
        self.inferred.update(outcome.notes)
        for prop, status in outcome.coverage.items():
            self.coverage.setdefault(prop, status)
        return outcome.value

    def run(self, probe: Probe, ctx: Context) -> None:
        start = time.perf_counter()
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
        self.seconds[probe.name] = time.perf_counter() - start


class _Undeclared(RuntimeError):
    """A probe emitted a finding kind its table entry does not declare (a doctor bug)."""


def _weighed(call: Caller, x: Tensor) -> tuple[int, int] | None:
    """How many keys the module's first attention weighs in a run on ``x``, and over how many rows (every query of
    every item, head and window); None when no attention was recorded."""
    try:
        trace, _ = record(call.module, lambda: call(x))
    except Exception:
        return None
    for op in trace.ops:
        if op.name == "scaled_dot_product_attention" and len(op.inputs) > 1 and op.inputs[1].dim() >= 2:
            q = op.inputs[0]
            return int(op.inputs[1].shape[-2]), q.numel() // max(int(q.shape[-1]), 1)
        if op.name in SOFTMAX and op.outputs:  # the axis it normalises (an einsum's 'bijh' weights: dim 2)
            dim = op.args[1] if len(op.args) > 1 and isinstance(op.args[1], int) else op.kwargs.get("dim", -1)
            out = op.outputs[0]
            keys = int(out.shape[dim]) if isinstance(dim, int) and -out.dim() <= dim < out.dim() else \
                int(out.shape[-1])
            if keys == 1 and sum(size == x.shape[1] for size in out.shape) >= 2:
                keys = x.shape[1]  # (L, L) weights normalised over an axis of one (a heads axis): not one key
            return keys, out.numel() // max(keys, 1)
    return None


def _keys(call: Caller, x: Tensor) -> int | None:
    """How many keys the module's first attention weighs in a run on ``x`` (None: none recorded)."""
    weighed = _weighed(call, x)
    return None if weighed is None else weighed[0]


def _enough_keys(call: Caller, x: Tensor, gen: torch.Generator, inferred: dict) -> Tensor:
    """An image input whose attention weighs more than one key: a reduction by 7 (Twins' global attention) turns
    a 7 x 7 grid into one key, whose weight is 1 whatever its score (no scale to read, no gradient for q); the
    grid's sides are doubled while that is so and the module runs."""
    b, n, e = x.shape
    while _keys(call, x) == 1 and 4 * n <= 1024:
        bigger = torch.randn(b, 4 * n, e, generator=gen).to(x)
        try:
            with torch.no_grad():
                call(bigger)
        except Exception:
            break
        x, n = bigger, 4 * n
        inferred["probe shape"] = (b, n, e)
        inferred["keys"] = "a grid with one key after the module's reduction was doubled on each side"
    weighed = _weighed(call, x)
    side = math.isqrt(n)
    if weighed is None or weighed[0] < n or side * side != n:
        return x
    keys, rows = weighed
    # one window may cover the whole grid (Swin's 4 x 4 window on a 4 x 4 grid cuts nothing and shifts nothing): the
    # grid's sides are doubled, or made twice the window's side, so that whole windows tile it (a grid padded up to
    # the windows, 8 x 8 in windows of 7, would hold padding the run's pattern does not show)
    tried: set[int] = set()
    for sides in (2 * side, 2 * math.isqrt(keys)):
        if sides * sides > 256 or sides <= side or sides in tried:
            continue
        tried.add(sides)
        bigger = torch.randn(b, sides * sides, e, generator=gen).to(x)
        more = _weighed(call, bigger)
        if more is not None and more[0] == keys and more[1] == rows:
            # weights of the same size over a grid four times as big: their axes are no tokens (Restormer's and
            # XCiT's attention over the channels); the grid is grown until its tokens outnumber every row of the
            # weights, which then cannot be read as windows of tokens
            grown = _outnumbering(call, x, rows, gen)
            if grown is not None:
                inferred["probe shape"] = tuple(grown.shape)
                inferred["keys"] = (f"the module's weights keep their size ({rows} rows of {keys} keys) on a grid of "
                                    f"{n} tokens and on one of {sides * sides}: they are not over the tokens; "
                                    f"probed on {grown.shape[1]} tokens")
                return grown
            return x
        window = math.isqrt(more[0]) if more is not None else 0
        if more is not None and more[0] < sides * sides and window * window == more[0] and sides % window == 0:
            inferred["probe shape"] = (b, sides * sides, e)
            inferred["keys"] = (f"a grid whose {n} tokens fit one of the module's windows was grown to {sides} x "
                                f"{sides}: its queries weigh {more[0]} keys of {sides * sides}")
            return bigger
    return x


def _outnumbering(call: Caller, x: Tensor, rows: int, gen: torch.Generator) -> Tensor | None:
    """The smallest square grid, up to 32 x 32, whose tokens over the batch outnumber ``rows`` and on which the module
    runs (None: none)."""
    b, n, e = x.shape
    side = math.isqrt(n)
    while side <= 32:
        side += 1
        if b * side * side <= rows:
            continue
        bigger = torch.randn(b, side * side, e, generator=gen).to(x)
        try:
            with torch.no_grad():
                call(bigger)
        except Exception:
            continue
        return bigger
    return None


def _float64_twin(call: Caller, x: Tensor, out: Tensor) -> Caller | None:
    """The caller on a float64 copy of the module, when the copy runs and agrees with the module (else None)."""
    if x.dtype == torch.float64 or not x.dtype.is_floating_point:
        return None
    try:
        copied = cast_module(copy_module(call.module), torch.float64)
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
    """Is the module's output the same for another input (a zero-initialised output projection or norm), or its
    input plus the same (a residual block whose attention branch ends in a zero-initialised projection, as DiT's
    adaLN-Zero and the diffusion models' attention blocks initialise it)?"""
    g = torch.Generator().manual_seed(4321)  # its own draws: the probes' generator is left as it was
    other = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype=x.dtype, device=x.device)
    try:
        with torch.no_grad():
            new = call(other)
    except Exception:
        return False
    if torch.equal(new, out):
        return True
    if new.shape != x.shape or out.shape != x.shape:
        return False
    branch, branch_other = (out - x).double(), (new - other).double()
    size = 1 + float(torch.cat([x.double().abs().flatten(), out.double().abs().flatten()]).max())
    if not bool(((branch - branch_other).abs() <= 4 * torch.finfo(x.dtype).eps * size).all()):
        return False
    # the same branch on a small input too: weights that put all their mass on each token's own key (no projection,
    # a wide model: x x^T dominated by its diagonal) give the input back on large inputs only
    small = other * 0.05
    try:
        with torch.no_grad():
            new_small = call(small)
    except Exception:
        return True
    if new_small.shape != small.shape:
        return True
    return bool(((new_small - small).double() - branch).abs().max() <= 4 * torch.finfo(x.dtype).eps * size)


def _shrink_to_mix(call: Caller, x: Tensor, out: Tensor) -> float | None:
    """When the output is the input itself (to the dtype's precision) but not on smaller inputs, the factor to scale
    the probe input by so that the tokens mix: the weights of a module with no projection (d2l's
    DotProductAttention called with x thrice, a teaching module's x x^T without a scale) are one-hot on N(0, 1)
    tokens of a wide model. None when the output is not the input, or stays it."""
    if out.shape != x.shape or not torch.allclose(out.double(), x.double(), rtol=0.0,
                                                  atol=64 * torch.finfo(x.dtype).eps * (1 + float(x.abs().max()))):
        return None
    for factor in (0.25, 0.1, 0.03, 0.01):
        try:
            with torch.no_grad():
                small = call(x * factor)
        except Exception:
            return None
        if small.shape == x.shape and float((small - x * factor).abs().max()) > 1e-3 * factor * float(x.abs().max()):
            return factor
    return None


def _silent_attention(call: Caller, x: Tensor, out: Tensor) -> bool:
    """Does each output row depend on its own token only while some parameter is all zeros: a block whose attention
    branch ends in a zero-initialised projection, followed by a feed-forward on each token (make-a-video's
    spatio-temporal block: x + attn(x), then ff(x) + x)? Its attention is probed on a copy with those zeros drawn."""
    if out.shape != x.shape or x.dim() != 3 or x.shape[1] < 3 or \
            not any(p.numel() and not bool(p.any()) for p in call.module.parameters()):
        return False
    t = x.shape[1] // 2
    other = x.clone()
    other[:, t] = torch.flip(x[:, t], dims=(-1,)) + 1.0
    try:
        with torch.no_grad():
            new = call(other)
    except Exception:
        return False
    if new.shape != out.shape or not bool(torch.isfinite(new).all()) or not bool(torch.isfinite(out).all()):
        return False
    changed = (new - out).double().abs().amax(dim=-1) > 1e-6 * (1 + float(out.double().abs().max()))
    return bool(changed[:, t].all()) and not bool(changed[:, torch.arange(x.shape[1]) != t].any())


def _with_zeros_drawn(call: Caller, x: Tensor, gen: torch.Generator) -> tuple[nn.Module, Caller, Tensor, list[str]]:
    """A copy of the module whose all-zero parameters are drawn from N(0, 0.02^2) (weights of the scale real
    models initialise), its caller and output; CannotRun when there is none to draw or the output stays constant."""
    module = copy_module(call.module)
    drawn = draw_zeros(module, gen)
    if not drawn:
        try:
            hidden = every_key_hidden(record(call.module, lambda: call(x))[0])
        except Exception:  # the reason is a hint: without it, the message stands
            hidden = None
        why = f"{hidden} (a mask the module builds for itself when given none, read the other way round: " \
              "mask-inverted)" if hidden else "check what the forward returns"
        raise CannotRun("the module's output does not depend on its input (the same for two random inputs), and no "
                        f"parameter is all zeros to explain it: {why}")
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
    sizes = sizes or Sizes(0)
    # E: the one the user gave, else the module's (an attribute, its first layer); when the module runs at none of
    # the shapes tried with it, the input sizes of its other layers are tried in turn (OpenFold declares a pair
    # projection first)
    dims = [sizes.embed_dim] if sizes.embed_dim else embed_dims_of(module)
    if not sizes.embed_dim and sizes.given:  # the width the user built it with (a grouped first layer's input can
        dims = [sizes.given, *(d for d in dims if d != sizes.given)]  # be a multiple of it: mixture of attention)
    got = _Collected({**inferred, **({"dtype": str(dtype)[6:]} if dtype != torch.float32 else {}),
                      **({"device": str(device)} if device.type != "cpu" else {})})
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        start = time.perf_counter()
        for i, e in enumerate(dims):
            try:
                found = calling(module, Sizes(e, sizes.heads, sizes.batch, sizes.lengths), gen, adapter, dtype, device,
                                stated=spec, declared=declared)
                break
            except WrongShape as err:  # it runs, but never gives a row per token: reported, nothing else probed
                if i == len(dims) - 1:
                    assert isinstance(err.finding, Finding)
                    why = "not verified: the module never returns (B, L, E) for input (B, L, E)"
                    return Report.of(got.inferred, [err.finding], {}, dict.fromkeys(COVERED, why),
                                     {"calling": time.perf_counter() - start})
            except CannotRun:
                if i == len(dims) - 1:
                    raise
            except Exception as err:  # the module ran at some shape, then failed on one it had run at
                raise CannotRun(f"the module failed while the doctor was finding how to call it, on a call like one "
                                f"it had answered before: {type(err).__name__}: {str(err)[:300]}") from err
        got.inferred["embed_dim"] = e
        called = got.take(found)
        assert called is not None  # calling() gives the caller and its input, or raises CannotRun
        call, x = called
        call.make_mask = make_mask
        # an image, or tokens the module lays out on a square grid itself (it runs only at a square length)
        if sizes.lengths is None and (call.layout in ("channels-first", "channels-last", "channels-first-1d") or
                                      math.isqrt(x.shape[1]) ** 2 == x.shape[1] > 4):
            x = _enough_keys(call, x, gen, got.inferred)
        try:
            with torch.no_grad():
                out = call(x)
        except Exception as err:
            raise CannotRun(f"the module failed on the probe input: {type(err).__name__}: {err}") from err
        shrink = _shrink_to_mix(call, x, out)
        if shrink is not None:  # no projection before the scores: x x^T is dominated by its diagonal
            x = x * shrink
            with torch.no_grad():
                out = call(x)
            got.inferred["input scale"] = (f"x times {shrink:g}: on N(0, 1) tokens each token's weight on its own key "
                                           "is 1 to the dtype's precision and the output is the input (scores with "
                                           "no projection, or no scale, dominated by their diagonal)")
        if _constant(call, x, out) or _silent_attention(call, x, out):  # a zero-initialised output layer: probe a
            # copy with those values drawn
            module, call, out, drawn = _with_zeros_drawn(call, x, gen)
            got.inferred["drawn"] = ("the output does not depend on the input (or is the input plus a constant: a "
                                     "residual around a zero-initialised branch) with these weights; the probes ran "
                                     f"on a copy whose all-zero parameters were drawn at random: {', '.join(drawn)}")
        exact = _float64_twin(call, x, out)
        got.inferred["analysed in"] = "a float64 copy" if exact is not None else str(x.dtype)[6:]
        ctx = Context(module, call, x, gen, declared, causal, spec, allow_nonstandard, exact, no_mask, scale,
                      bidirectional)
        analysis = ctx.analysis
        ctx = replace(ctx, normalised=normalises(analysis.module, lambda: analysis(ctx.analysis_x)))
        if not twin_reads_masks_alike(ctx):
            ctx = replace(ctx, exact=None)
            got.inferred["analysed in"] = f"{str(x.dtype)[6:]} (its float64 copy reads masks differently)"
        got.results["out"] = out
        got.seconds["calling"] = time.perf_counter() - start
        for probe in PROBES:
            got.run(probe, ctx)
        try:
            got.take(calls_in_a_row(call, x, gen, got.results.get("dep")))
        except Exception as err:  # the module failed on an input it ran before: nothing certified
            got.not_verified["calls in a row"] = not_verified(err)
    if got.results.get("masked") is None:
        got.coverage.setdefault("padding", "not verified: no mask understood")
    if call.mutated:  # every probe's call went through a copy of the input and a restored mask
        got.findings.append(Finding.of(MUTATES_INPUT, f"the module changes {' and '.join(sorted(call.mutated))} "
                                       "in place (the doctor gave every call a copy of its input and restored the "
                                       "mask after each call)", {"changed": sorted(call.mutated)}))
    findings = merge(got.findings)
    coverage = {prop: got.coverage.get(prop, "not verified: the probe did not run") for prop in COVERED}
    return Report.of(got.inferred, findings, got.not_verified, coverage, got.seconds)


def check(target: nn.Module | type | str | Callable[[], nn.Module], *, init: dict | None = None,
          embed_dim: int | None = None,
          batch: int | None = None, length: int | Sequence[int] | None = None, mask_convention: str | None = None,
          mask: str | MaskSpec | None = None, no_mask: bool = False, call: Callable | str | None = None,
          make_mask: Callable[[Tensor], Tensor] | None = None, causal: bool = False, bidirectional: bool = False,
          scale: float | None = None, allow_nonstandard: bool = False, seed: int = 0) -> Report:
    """Run every probe on an attention module and return a :class:`Report`.

    Args:
        target: a module instance, an nn.Module subclass, "path/to/file.py:ClassName" (the file is
            imported and run, never modified), or a factory: a function of no argument returning
            the module (for constructors that need a config object the doctor cannot guess).
        init: constructor keyword arguments for a class (for a ``cls(config, ...)`` constructor:
            the config's fields); default: the constructor's arguments guessed by name (an embed
            dim, a head count, dropouts) or a config class next to it built the same way.
        embed_dim: E, the input's last dim: used to build a class when ``init`` is not given (default 64), and
            to probe an instance (default: the module's own, from an attribute or its layers).
        batch: the batch size to probe with (a module allocated for a maximum batch); default: several.
        length: the sequence length, or lengths, to probe with (a module that runs at one length, such
            as window attention over 49 tokens); default: several short ones.
        mask_convention: "keep" (True/1 = may attend) or "ignore" (True = masked), if the
            module documents a bool mask; a module that behaves the other way gets ``mask-inverted``.
        mask: the module's mask as "KIND (SHAPE)", e.g. "additive (B,1,1,L)" or "keep (B,L)" (kinds
            and shapes: :data:`MASK_KINDS`, :data:`MASK_SHAPES`); default: inferred from behaviour.
        no_mask: the module takes no mask: no argument is tried as one.
        call: ``call(module, x, mask)`` -> output, replacing the guessed call (x: (B, L, E); mask:
            what ``make_mask`` or ``mask`` produce, or None), or ``call(module, x)`` for a module
            without a mask; a string is evaluated as Python (with torch, nn, F and, for a file
            target, the file's names in scope).
        make_mask: ``make_mask(keep)`` -> the module's mask, from keep (B, L, L) bool, True = may
            attend ((B, L) when ``mask`` names a key-only shape).
        causal: the module must be causal (queries never see later keys).
        bidirectional: every query must see every key (an encoder: no causal mask, window or is_causal).
        scale: the score scale the module uses on purpose (T5's 1.0, say), instead of 1/sqrt(head dim);
            a scale stated by the module's config (``query_pre_attn_scalar``) is read without it.
        allow_nonstandard: the module is not textbook attention on purpose: an output that no
            formula reproduces is noted, not a definition-mismatch.
        seed: seed of the random probe inputs and of the module's construction (when the doctor builds it).

    Returns:
        The report: findings with severities (``passed`` when none is an error), coverage of each
        property, what was inferred, and the probes that raised ("not verified: <why>").

    Raises:
        CannotRun: the module could not be loaded, built or called at all.
        ValueError: an option is not one the doctor knows (``mask_convention``, ``mask``, sizes).

    Example:
        >>> report = selfattn.check(MyAttention(64))
        >>> report.passed, [f.id for f in report.findings], report.coverage["mask"]
        >>> selfattn.check(llama_attention, call=lambda m, x, mask: m(x, rope(x), attention_mask=mask)[0],
        ...                mask="additive (B,1,L,L)")
    """
    if causal and bidirectional:
        raise ValueError("a module cannot be both causal and bidirectional: give one of causal, bidirectional")
    if mask_convention not in (None, "keep", "ignore"):
        raise ValueError(f"mask_convention must be 'keep', 'ignore' or None, got {mask_convention!r}")
    lengths = (length,) if isinstance(length, int) else tuple(length) if length is not None else None
    for name, value in (("embed_dim", (embed_dim,) if embed_dim is not None else ()),
                        ("batch", (batch,) if batch is not None else ()),
                        ("length", lengths or ())):
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in value):
            raise ValueError(f"{name} must be a positive integer (or a list of them for length), got {value}")
    if no_mask and (mask is not None or mask_convention is not None or make_mask is not None):
        raise ValueError("no_mask says the module takes no mask; do not also give mask, mask_convention or make_mask")
    spec = parse_mask(mask) if isinstance(mask, str) else mask
    built, namespace = None, {}
    if isinstance(target, str):
        path, sep, name = target.rpartition(":")
        if not sep or not path or not name:
            raise CannotRun(f"expected path/to/file.py:ClassName, got {target!r}")
        namespace = vars(load_file(path))
        found = namespace.get(name)
        if not isinstance(found, type) or not issubclass(found, nn.Module):
            raise CannotRun(f"{path} has no nn.Module subclass named {name!r}")
        target = found
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # the module's weights follow the seed too
        if isinstance(target, type):
            target, built = build(target, init, embed_dim or 64)
        elif not isinstance(target, nn.Module) and callable(target):
            try:
                target, built = target(), "your factory"
            except Exception as e:
                raise CannotRun(f"the factory failed: {type(e).__name__}: {e}") from e
    if not isinstance(target, nn.Module):
        raise TypeError(f"check needs an nn.Module, a class, a factory or 'file.py:Class', got {type(target).__name__}")
    adapter = user_callable(call, namespace) if isinstance(call, str) else call
    was_training = target.training
    grads = {n: p.grad for n, p in target.named_parameters()}  # the probes' backward must not eat these
    inferred = {"module": type(target).__name__, **({"built as": built} if built else {})}
    examined, quantized = dequantized(target)
    if quantized:
        inferred["quantized"] = (f"{', '.join(quantized)}: Linear layers of torch's dynamic quantization, checked "
                                 "with their int8 weights dequantized into float layers (their activations, quantized "
                                 "per tensor on the fly, tie each item to the batch's range and make the output a "
                                 "step function of the input: no probe could read the attention through them)")
    try:
        target.eval()  # not chained: some modules' train() returns None (timm's LeViT)
        examined.eval()
        return examine(examined, inferred, declared=mask_convention, causal=causal, seed=seed, spec=spec,
                       adapter=adapter, make_mask=make_mask, allow_nonstandard=allow_nonstandard,
                       sizes=Sizes(embed_dim or 0, 4, batch, lengths, width_given(init if isinstance(init, dict)
                                                                                 else None)),
                       no_mask=no_mask, scale=scale,
                       bidirectional=bidirectional)
    finally:
        target.train(was_training)
        for n, p in target.named_parameters():
            p.grad = grads.get(n)

"""Helpers for users' own test suites: a float64 oracle, the tolerance rule, and checkers.

The oracle (:func:`reference_attention`) is the textbook math ``softmax(q k^T * scale + bias,
score_mod, masked) @ v`` written here, independently of every selfattn backend, and computed in
float64 by default. The rule (:func:`tolerance`) judges an implementation against it: its error
may be at most ``factor`` times the error of the same plain math done in the implementation's own
dtype (the "naive" error), plus a floor of a few ulps of the largest value. So a bfloat16 kernel is
held to what bfloat16 can do, and a float32 kernel to what float32 can do.

:func:`check_against_reference` applies the rule to any attention function ``fn(q, k, v, **kw)``
for outputs (factor 2) and gradients (factor 3); :func:`assert_attention_correct` runs
:func:`selfattn.check` on a whole module.

Shape legend: B batch, Hq query heads, Hkv key/value heads (Hq % Hkv == 0), Lq/Lk query/key
lengths, D head dim of q and k, Dv head dim of v.

Example:
    >>> from selfattn import testing
    >>> q, k, v = torch.randn(2, 8, 100, 64), torch.randn(2, 2, 100, 64), torch.randn(2, 2, 100, 64)
    >>> testing.check_against_reference(my_attention, q, k, v, causal=True)   # raises if it is off
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._oracle import Causal, ScoreFn, reference_attention, reference_lse, reference_mask
from .check import Report, check
from .check.report import unseen
from .masks import Mask

__all__ = [
    "Comparison",
    "assert_attention_correct",
    "assert_close_to_reference",
    "assert_context_parallel_correct",
    "check_against_reference",
    "compare_to_reference",
    "max_error",
    "reference_attention",
    "reference_lse",
    "reference_mask",
    "tolerance",
]

OUTPUT_FACTOR = 2.0  # outputs may be off by twice the naive error (plus the ulp floor)
GRADIENT_FACTOR = 3.0  # gradients go through one more matmul chain: three times


def tolerance(err_naive: float, ref: Tensor, dtype: torch.dtype, factor: float) -> float:
    """The rule: ``factor`` x the naive error, plus a floor of a few ulps of the largest value.

    In float64 the naive math is the oracle itself (error 0), so the floor is all there is: 64 ulps
    there, room for summing one row in several runs; 16 ulps in float32. In float16 and bfloat16 an
    ulp is coarse (1/1024, 1/128) and the naive error always carries it, so the floor is 2 ulps: a
    wider one would excuse rounding a float32 term (a bias of 40 rounded to bfloat16 is off by 0.1).

    Args:
        err_naive: max abs error of the plain math done in ``dtype``, against ``ref``.
        ref: the float64 reference values (any shape).
        dtype: the dtype of the implementation under test.
        factor: how many times the naive error is allowed (2 for outputs, 3 for gradients).

    Returns:
        The largest max abs error allowed.

    Example:
        >>> tolerance(1e-3, ref, torch.bfloat16, 2.0)
    """
    ulps = {torch.float64: 64, torch.float32: 16}.get(dtype, 2)
    return factor * err_naive + ulps * torch.finfo(dtype).eps * max(1.0, ref.abs().max().item())


def max_error(a: Tensor, ref: Tensor) -> float:
    """Max abs difference of ``a`` and ``ref``, in float64 (NaN if ``a`` has a NaN)."""
    return (a.double() - ref.double()).abs().max().item()


@dataclass(frozen=True)
class Comparison:
    """One tensor held to the rule: its error, the tolerance, and the naive error behind it."""

    name: str
    error: float
    tolerance: float
    naive_error: float
    finite: bool

    @property
    def ok(self) -> bool:
        """All values finite and the error within the tolerance."""
        return self.finite and self.error <= self.tolerance

    def __str__(self) -> str:
        if not self.finite:
            return f"{self.name}: non-finite values"
        verdict = "<=" if self.ok else ">"
        return (f"{self.name}: error {self.error:.3g} {verdict} tolerance {self.tolerance:.3g} "
                f"(naive {self.naive_error:.3g})")


def compare_to_reference(actual: Tensor, ref: Tensor, naive: Tensor, *, factor: float = OUTPUT_FACTOR,
                         name: str = "out") -> Comparison:
    """Measure ``actual`` against the oracle with the rule, without raising.

    Args:
        actual: the implementation's result, in its own dtype (any shape).
        ref: the float64 oracle's result, same shape.
        naive: the plain math's result in ``actual``'s dtype, same shape. Only its finite values
            count: NaN on rows that see no key (``safe=False``) or inf/NaN where the plain math
            overflows never widen the tolerance.
        factor: multiple of the naive error allowed (2 for outputs, 3 for gradients).
        name: what ``actual`` is, for messages.

    Returns:
        A :class:`Comparison`; ``.ok`` says whether it passes.
    """
    finite = torch.isfinite(naive)
    err_naive = max_error(naive[finite], ref[finite]) if bool(finite.any()) else 0.0
    return Comparison(name=name, error=max_error(actual, ref), naive_error=err_naive,
                      tolerance=tolerance(err_naive, ref, actual.dtype, factor),
                      finite=bool(torch.isfinite(actual).all()))


def assert_close_to_reference(actual: Tensor, ref: Tensor, naive: Tensor, *, factor: float = OUTPUT_FACTOR,
                              name: str = "out") -> Comparison:
    """Like :func:`compare_to_reference`, but raise AssertionError when the rule is broken.

    The message gives the error, the tolerance and the naive error.

    Example:
        >>> ref = reference_attention(q, k, v)
        >>> naive = reference_attention(q, k, v, dtype=None, safe=False)
        >>> assert_close_to_reference(my_attention(q, k, v), ref, naive)
    """
    result = compare_to_reference(actual, ref, naive, factor=factor, name=name)
    if not result.ok:
        raise AssertionError(str(result))
    return result


def check_against_reference(fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, *,
                            mask: Mask | Tensor | None = None, bias: Tensor | None = None,
                            causal: Causal = False, scale: float | None = None,
                            score_mod: ScoreFn | None = None, sinks: Tensor | None = None,
                            grads: bool = True, seed: int = 0,
                            reference_score_mod: ScoreFn | None = None, name: str | None = None,
                            **fn_kwargs: object) -> list[Comparison]:
    """Hold an attention function to the rule: output (factor 2) and, with ``grads``, dq, dk, dv
    (factor 3), each against the float64 oracle and the naive math in q's dtype.

    ``fn`` is called as ``fn(q, k, v, **kwargs)`` with only the attention arguments that are set
    (a function without mask support can be checked without masks), plus ``fn_kwargs``.

    Args:
        fn: the attention function under test; returns (B, Hq, Lq, Dv) in q's dtype.
        q: queries (B, Hq, Lq, D), any float dtype and device.
        k: keys (B, Hkv, Lk, D).
        v: values (B, Hkv, Lk, Dv).
        mask, bias, causal, scale, score_mod, sinks: as in :func:`reference_attention`; given to both.
        grads: also check the gradients, for a random upstream gradient drawn from ``seed + 1``
            (and the gradient of ``sinks`` when given).
        seed: seeds that upstream gradient.
        reference_score_mod: the modifier the oracle applies instead of ``score_mod`` (e.g. an
            independent dense formula of the same modifier); default ``score_mod``.
        name: label for messages (default: fn's name).
        **fn_kwargs: passed to ``fn`` only (e.g. ``backend="chunked"`` for selfattn.attention).

    Returns:
        The :class:`Comparison` of each checked tensor ("out", then "dq", "dk", "dv", "dsinks").

    Raises:
        AssertionError: wrong dtype or shape, non-finite values, or an error over the tolerance.

    Example:
        >>> check_against_reference(selfattn.attention, q, k, v, causal="bottom_right", backend="chunked")
        >>> check_against_reference(my_flash_attention, q, k, v, causal=True)
    """
    label = name or getattr(fn, "__name__", "fn")
    given = dict(mask=mask, bias=bias, causal=causal, scale=scale, score_mod=score_mod)
    call_kwargs = {key: val for key, val in given.items() if val is not None and val is not False}
    oracle_kwargs = dict(given, score_mod=score_mod if reference_score_mod is None else reference_score_mod)
    if "bias" in call_kwargs:
        oracle_kwargs["bias"] = bias.double()  # type: ignore[union-attr]
    grad_sinks = grads and sinks is not None
    s64 = sn = sa = None
    if sinks is not None:
        s64 = sinks.detach().double().requires_grad_(grad_sinks)
        sn = sinks.detach().clone().requires_grad_(grad_sinks)
        sa = sinks.detach().clone().requires_grad_(grad_sinks)
        call_kwargs["sinks"] = sa

    q64, k64, v64 = (t.detach().double().requires_grad_(grads) for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, **oracle_kwargs, sinks=s64)  # type: ignore[arg-type]
    qn, kn, vn = (t.detach().clone().requires_grad_(grads) for t in (q, k, v))
    naive_kwargs = dict(oracle_kwargs, bias=bias, safe=False, dtype=None)
    naive = reference_attention(qn, kn, vn, **naive_kwargs, sinks=sn)  # type: ignore[arg-type]

    qa, ka, va = (t.detach().requires_grad_(True) for t in (q, k, v)) if grads else (q, k, v)
    out = fn(qa, ka, va, **call_kwargs, **fn_kwargs)
    if not isinstance(out, Tensor) or out.dtype != q.dtype or out.shape != ref.shape:
        got = f"{out.dtype} {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise AssertionError(f"{label}: expected a {q.dtype} tensor of shape {tuple(ref.shape)}, got {got}")
    results = [compare_to_reference(out, ref, naive, factor=OUTPUT_FACTOR, name=f"{label}: out")]
    if grads:
        g = torch.Generator().manual_seed(seed + 1)
        dout = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(q.device)
        names = ["q", "k", "v"] + (["sinks"] if grad_sinks else [])
        ins64, insn, insa = [q64, k64, v64], [qn, kn, vn], [qa, ka, va]
        if grad_sinks:
            assert s64 is not None and sn is not None and sa is not None
            ins64, insn, insa = [*ins64, s64], [*insn, sn], [*insa, sa]
        gref = torch.autograd.grad(ref, ins64, dout)
        gnaive = torch.autograd.grad(naive, insn, dout.to(q.dtype))
        gout = torch.autograd.grad(out, insa, dout.to(q.dtype))
        results += [compare_to_reference(a, r, n, factor=GRADIENT_FACTOR, name=f"{label}: d{x}")
                    for x, a, n, r in zip(names, gout, gnaive, gref, strict=True)]
    failed = [str(r) for r in results if not r.ok]
    if failed:
        raise AssertionError("\n".join(failed))
    return results


def assert_attention_correct(module: nn.Module | type | str, **kwargs: object) -> Report:
    """Fail (AssertionError) with every finding of :func:`selfattn.check` if there is any, and when the verdict
    is inconclusive (a probe could not run or a property was not verified, so the module is not certified), with
    the probes that did not run and the properties not verified.

    Example:
        >>> def test_my_attention():
        ...     selfattn.testing.assert_attention_correct(MyAttention(64), causal=True)
    """
    report = check(module, **kwargs)  # type: ignore[arg-type]
    if report.verdict == "failed":
        lines = [f"- {f.id}: {f.message}\n  evidence: {f.evidence}\n  fix: {f.fix}" for f in report.findings]
        raise AssertionError("attention module has findings:\n" + "\n".join(lines))
    if report.verdict == "inconclusive":
        lines = [f"- {probe}: {why}" for probe, why in report.not_verified.items()]
        lines += [f"- {prop}: {report.coverage[prop]}" for prop in unseen(report.coverage)
                  if report.coverage[prop] not in report.not_verified.values()]
        raise AssertionError("the doctor's verdict is inconclusive: no error found, but these probes could not run "
                             "or these properties were not verified, so the module is not certified:\n" +
                             "\n".join(lines))
    return report


def assert_context_parallel_correct(fn: Callable[..., Tensor], *, world_size: int = 2, layout: str = "contiguous",
                                    cases: tuple[str, ...] | list[str] | None = None, length: int | None = None,
                                    seed: int = 0, timeout: float = 300.0) -> object:
    """Fail (AssertionError) unless a user's own context-parallel attention equals one process in every case:
    :func:`selfattn.distributed.verify.check_context_parallel` spawns ``world_size`` gloo ranks, hands ``fn``
    its shards of random q, k, v with each mask (none, causal, a sliding window, packed documents, padding) and
    compares the gathered output and gradients with the float64 oracle; each case that differs is named (window
    ignored or inverted, local positions, the ring's order, a low-precision merge, a wrong gradient, ...).

    Args:
        fn: ``fn(q, k, v, case) -> out``, a module-level function; ``case`` is a
            :class:`selfattn.distributed.verify.Case` (the group, every rank's positions, the mask's parts).
        world_size, layout, cases, length, seed, timeout: as ``check_context_parallel``'s.

    Returns:
        The :class:`~selfattn.distributed.verify.ContextParallelReport`, when every case is right.

    Example:
        >>> def test_my_ring():
        ...     selfattn.testing.assert_context_parallel_correct(my_ring, world_size=2, layout="zigzag")
    """
    from .distributed.verify import CASES, check_context_parallel  # it spawns processes: imported when used

    report = check_context_parallel(fn, world_size=world_size, layout=layout, cases=CASES if cases is None else cases,
                                    length=length, seed=seed, timeout=timeout)
    if not report.ok:
        raise AssertionError(str(report))
    return report

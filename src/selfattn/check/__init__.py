"""The attention doctor: run a user's attention module and certify it, or name each bug.

``selfattn.check(module)`` (or ``selfattn check file.py:Class``) runs black-box probes (shapes,
batch independence, permutation equivariance, mask convention over every common shape and kind,
padding, causality, fully masked rows, extreme logits, half precision, eval determinism,
gradients) and a white-box probe (Q, K, V captured from the module's linear maps, the attention
recomputed under the definition and under each known bug, rotary positions and relative-position
biases recognised). The report gives each finding a severity and each property a coverage state.
It depends on the public selfattn API only.

Parts: :mod:`.findings` (the catalogue of finding ids), :mod:`.probes` (the probes and the order
they run in), :mod:`.report` (the report and its rendering), :mod:`.target` (loading, building and
calling the module, mask conventions), :mod:`.whitebox` (the recomputation from Q, K, V),
:mod:`.mutate` (the doctor's own mutation score).

Shape legend: B batch, L length, E embed dim, H heads.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .findings import FINDING_IDS, FIXES, SEVERITY
from .probes import examine
from .report import COVERED, Finding, Report, render
from .target import MASK_KINDS, MASK_SHAPES, CannotRun, MaskSpec, build, load_file, parse_mask, user_callable

__all__ = ["COVERED", "FINDING_IDS", "FIXES", "MASK_KINDS", "MASK_SHAPES", "SEVERITY", "CannotRun", "Finding",
           "MaskSpec", "Report", "check", "parse_mask", "render"]


def check(target: nn.Module | type | str | Callable[[], nn.Module], *, init: dict | None = None, embed_dim: int = 16,
          mask_convention: str | None = None, mask: str | MaskSpec | None = None,
          call: Callable | str | None = None, make_mask: Callable[[Tensor], Tensor] | None = None,
          causal: bool = False, allow_nonstandard: bool = False, seed: int = 0) -> Report:
    """Run every probe on an attention module and return a :class:`Report`.

    Args:
        target: a module instance, an nn.Module subclass, "path/to/file.py:ClassName" (the file is
            imported and run, never modified), or a factory: a function of no argument returning
            the module (for constructors that need a config object the doctor cannot guess).
        init: constructor keyword arguments for a class (for a ``cls(config, ...)`` constructor:
            the config's fields); default: try the usual signatures with ``embed_dim``.
        embed_dim: E used to build a class when ``init`` is not given.
        mask_convention: "keep" (True/1 = may attend) or "ignore" (True = masked), if the
            module documents a bool mask; a module that behaves the other way gets ``mask-inverted``.
        mask: the module's mask as "KIND (SHAPE)", e.g. "additive (B,1,1,L)" or "keep (B,L)" (kinds
            and shapes: :data:`MASK_KINDS`, :data:`MASK_SHAPES`); default: inferred from behaviour.
        call: ``call(module, x, mask)`` -> output, replacing the guessed call (x: (B, L, E); mask:
            what ``make_mask`` or ``mask`` produce, or None); a string is evaluated as Python (with
            torch, nn, F and, for a file target, the file's names in scope).
        make_mask: ``make_mask(keep)`` -> the module's mask, from keep (B, L, L) bool, True = may
            attend ((B, L) when ``mask`` names a key-only shape).
        causal: the module must be causal (queries never see later keys).
        allow_nonstandard: the module is not textbook attention on purpose: an output that no
            formula reproduces is noted, not a definition-mismatch.
        seed: seed of the random probe inputs.

    Returns:
        The report: findings with severities (``passed`` when none is an error), coverage of each
        property, what was inferred, and the probes that raised ("not verified: <why>").

    Raises:
        CannotRun: the module could not be loaded, built or called at all.
        ValueError: ``mask_convention`` or ``mask`` is not one the doctor knows.

    Example:
        >>> report = selfattn.check(MyAttention(64))
        >>> report.passed, [f.id for f in report.findings], report.coverage["mask"]
        >>> selfattn.check(llama_attention, call=lambda m, x, mask: m(x, rope(x), attention_mask=mask)[0],
        ...                mask="additive (B,1,L,L)")
    """
    if mask_convention not in (None, "keep", "ignore"):
        raise ValueError(f"mask_convention must be 'keep', 'ignore' or None, got {mask_convention!r}")
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
    if isinstance(target, type):
        target, built = build(target, init, embed_dim)
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
    try:
        return examine(target.eval(), inferred, declared=mask_convention, causal=causal, seed=seed, spec=spec,
                       adapter=adapter, make_mask=make_mask, allow_nonstandard=allow_nonstandard)
    finally:
        target.train(was_training)
        for n, p in target.named_parameters():
            p.grad = grads.get(n)

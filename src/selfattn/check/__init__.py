"""The attention doctor: run a user's attention module and certify it, or name each bug.

``selfattn.check(module)`` (or ``selfattn check file.py:Class``) runs black-box probes (shapes,
batch independence, permutation equivariance, mask convention and isolation, causality, fully
masked rows, extreme logits, half precision, eval determinism, gradients) and a white-box probe
(Q, K, V captured from the module's nn.Linear layers, the attention recomputed under the correct
definition and under each known bug). It depends on the public selfattn API only.

Parts: :mod:`.findings` (the catalogue of finding ids), :mod:`.probes` (the probes and the order
they run in), :mod:`.report` (the report and its rendering), :mod:`.target` (loading, building and
calling the module), :mod:`.whitebox` (the recomputation from Q, K, V).

Shape legend: B batch, L length, E embed dim, H heads.
"""

from __future__ import annotations

from torch import nn

from .findings import FINDING_IDS, FIXES, SEVERITY
from .probes import examine
from .report import Finding, Report, render
from .target import CannotRun, build, load_class

__all__ = ["FINDING_IDS", "FIXES", "SEVERITY", "CannotRun", "Finding", "Report", "check", "render"]


def check(target: nn.Module | type | str, *, init: dict | None = None, embed_dim: int = 16,
          mask_convention: str | None = None, causal: bool = False, seed: int = 0) -> Report:
    """Run every probe on an attention module and return a :class:`Report`.

    Args:
        target: a module instance, an nn.Module subclass, or "path/to/file.py:ClassName"
            (the file is imported and run, never modified).
        init: constructor keyword arguments for a class; default: try the usual signatures
            with ``embed_dim``.
        embed_dim: E used to build a class when ``init`` is not given.
        mask_convention: "keep" (True/1 = may attend) or "ignore" (True = masked), if the
            module documents one; a module that behaves the other way gets ``mask-inverted``.
        causal: the module must be causal (queries never see later keys).
        seed: seed of the random probe inputs.

    Returns:
        The report: findings (empty when the module passes), what was inferred, and the probes
        that raised ("not verified: <why>").

    Raises:
        CannotRun: the module could not be loaded, built or called at all.

    Example:
        >>> report = selfattn.check(MyAttention(64))
        >>> report.passed, [f.id for f in report.findings]
    """
    if mask_convention not in (None, "keep", "ignore"):
        raise ValueError(f"mask_convention must be 'keep', 'ignore' or None, got {mask_convention!r}")
    built = None
    if isinstance(target, str):
        target = load_class(target)
    if isinstance(target, type):
        target, built = build(target, init, embed_dim)
    if not isinstance(target, nn.Module):
        raise TypeError(f"check needs an nn.Module, a class or 'file.py:Class', got {type(target).__name__}")
    was_training = target.training
    grads = {n: p.grad for n, p in target.named_parameters()}  # the probes' backward must not eat these
    inferred = {"module": type(target).__name__, **({"built as": built} if built else {})}
    try:
        return examine(target.eval(), inferred, declared=mask_convention, causal=causal, seed=seed)
    finally:
        target.train(was_training)
        for n, p in target.named_parameters():
            p.grad = grads.get(n)

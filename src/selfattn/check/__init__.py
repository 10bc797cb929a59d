"""The attention doctor: run a user's attention module and certify it, or name each bug.

``selfattn.check(module)`` (or ``selfattn check file.py:Class``) runs black-box probes (shapes,
batch independence, permutation equivariance, mask convention over every common shape and kind,
padding, causality, fully masked rows, extreme logits, half precision, eval determinism,
gradients) and a white-box probe (Q, K, V captured from the module's linear maps, the attention
recomputed under the definition and under each known bug, rotary positions and relative-position
biases recognised). The report gives each finding a severity and each property a coverage state.
It depends on the public selfattn API only.

The layers, each importing only those before it: :mod:`.findings` (the catalogue of finding
kinds and :class:`Finding`) → :mod:`.subject` (building the module, how it is called, its sizes,
what probes share) → :mod:`.probes` (black box, masking, numerics) → :mod:`.whitebox` (trace,
projections, products, positions) → :mod:`.report` (the report and its rendering) →
:mod:`.doctor` (the declared probe table and the run). The doctor's own mutation score is apart,
in :mod:`selfattn.mutation`.

Shape legend: B batch, L length, E embed dim, H heads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .doctor import examine
from .findings import FINDING_IDS, FIXES, SEVERITY
from .report import COVERED, Finding, Report, render
from .subject.building import CannotRun, Sizes, build, load_file, user_callable
from .subject.caller import MASK_KINDS, MASK_SHAPES, MaskSpec, parse_mask

__all__ = ["COVERED", "FINDING_IDS", "FIXES", "MASK_KINDS", "MASK_SHAPES", "SEVERITY", "CannotRun", "Finding",
           "MaskSpec", "Report", "check", "parse_mask", "render"]


def check(target: nn.Module | type | str | Callable[[], nn.Module], *, init: dict | None = None, embed_dim: int = 64,
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
        embed_dim: E used to build a class when ``init`` is not given (a module instance tells its own).
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
    for name, value in (("embed_dim", (embed_dim,)), ("batch", (batch,) if batch is not None else ()),
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
        target.eval()  # not chained: some modules' train() returns None (timm's LeViT)
        return examine(target, inferred, declared=mask_convention, causal=causal, seed=seed, spec=spec,
                       adapter=adapter, make_mask=make_mask, allow_nonstandard=allow_nonstandard,
                       sizes=Sizes(embed_dim, 4, batch, lengths), no_mask=no_mask, scale=scale,
                       bidirectional=bidirectional)
    finally:
        target.train(was_training)
        for n, p in target.named_parameters():
            p.grad = grads.get(n)

"""``attention()``: validate once, ask ``backends.dispatch`` for a backend, run it.

Shape legend: B batch, Hq query heads, Hkv key/value heads (Hq % Hkv == 0), Lq/Lk query/key
lengths, D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, overload

import torch
from torch import Tensor

from . import scores as _scores
from ._call import FLOAT_DTYPES, AttentionCall
from ._checks import build_call, check_backend, check_deterministic, check_dropout, check_scale
from .backends import REGISTRY, dispatch
from .masks import Mask

__all__ = ["Explanation", "attention", "attention_with_weights", "explain", "use_backend"]

Causal = bool | Literal["top_left", "bottom_right"]
ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("selfattn_backend", default=None)
# What torch.compile reads instead (it cannot trace ContextVar.get): the name last set or restored by
# use_backend() in any thread; dynamo guards on it, so a compiled function retraces when it changes.
_TRACED_FORCED: str | None = None


def _plain_call(q: object, k: object, v: object, scale: object, dropout_p: object,
                deterministic: object = None) -> AttentionCall | None:
    """The call for ``attention(q, k, v)`` with at most scale and dropout (an unmasked layer, a
    decode step on a full cache), in a few operations: None unless q, k and v pass every check
    :func:`_validate` makes and nothing (autocast) needs the full path. A None sends the call down
    :func:`_validate`, which gives the precise error for bad input. Not for use while compiling."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    dtype, device = q.dtype, q.device
    if not (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and dtype in FLOAT_DTYPES
            and k.dtype == dtype and v.dtype == dtype and k.device == device and v.device == device
            and qs[0] == ks[0] == vs[0] and ks[1] == vs[1] and ks[2] == vs[2] and ks[3] == qs[3]
            and min(qs) > 0 and min(ks) > 0 and vs[3] > 0 and qs[1] % ks[1] == 0):
        return None
    if _autocasting(device.type):
        return None
    return AttentionCall(q=q, k=k, v=v, mask=None, bias=None, scale=check_scale(scale, qs[3]),
                         dropout_p=check_dropout(dropout_p), return_lse=False,
                         deterministic=check_deterministic(deterministic))


_validate = build_call  # the full path's checks (a module attribute, so tests can watch it)


@dataclass(frozen=True)
class Explanation:
    """What ``attention(backend='auto')`` would do with these inputs.

    Attributes:
        backend: the backend that runs the call.
        not_chosen: for every other backend, why it does not (its reasons joined by "; ").
        why: why ``backend`` was picked.
        reasons: for every other backend, the list of its reasons.
        determinism: whether ``backend`` gives the same bits on every run of this call, and if not why
            (see ``deterministic`` in :func:`attention`).
    """

    backend: str
    not_chosen: dict[str, str] = field(default_factory=dict)
    why: str = ""
    reasons: dict[str, list[str]] = field(default_factory=dict)
    determinism: str = ""

    def __str__(self) -> str:
        lines = [f"auto picks: {self.backend}" + (f" ({self.why})" if self.why else "")]
        lines += [f"  {name}: {why}" for name, why in self.not_chosen.items()]
        if self.determinism:
            lines.append(self.determinism)
        return "\n".join(lines)


def _determinism(call: AttentionCall, name: str) -> str:
    why = REGISTRY[name].nondeterministic(call)
    if why is None:
        return f"deterministic: {name} gives the same bits on every run of this call"
    return f"not deterministic: {why} (pass deterministic=True, or call torch.use_deterministic_algorithms(True))"


def explain(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None,
            bias: Tensor | None = None, causal: Causal = False, scale: float | None = None,
            dropout_p: float = 0.0, backend: str = "auto", return_lse: bool = False,
            score_mod: _scores.ScoreMod | ScoreFn | None = None, sinks: Tensor | None = None,
            deterministic: bool | None = None) -> Explanation:
    """Which backend ``attention(q, k, v, **same_kwargs)`` would run, and why not the others.

    Example:
        >>> print(selfattn.explain(q, k, v, causal=True))
        auto picks: sdpa (SDPA runs this call in a fused kernel without a dense mask)
          reference: supported, but sdpa is preferred: ...
    """
    q, k, v, bias = _autocast(q, k, v, bias)
    call = _validate(q, k, v, mask, bias, causal, scale, dropout_p, return_lse, score_mod, sinks=sinks,
                     deterministic=deterministic)
    choice = dispatch.choose(call, _forced_name(backend), explain=True)
    return Explanation(choice.backend, {n: "; ".join(r) for n, r in choice.not_chosen.items()},
                       choice.why, choice.not_chosen, _determinism(call, choice.backend))


def _forced_name(backend: object) -> str | None:
    if (name := check_backend(backend, REGISTRY)) != "auto":
        return name
    return _TRACED_FORCED if torch.compiler.is_compiling() else _FORCED.get()


def _autocast(q: object, k: object, v: object, bias: object) -> tuple:
    """Under ``torch.autocast`` for q's device, cast the floating inputs (not float64) to the
    autocast dtype, as torch does for its own SDPA; backends then run with autocast off, so
    every backend computes the same thing and returns that dtype."""
    if not isinstance(q, Tensor) or not _autocasting(q.device.type):
        return q, k, v, bias
    dtype = torch.get_autocast_dtype(q.device.type)

    def cast(t: object) -> object:
        if isinstance(t, Tensor) and t.dtype.is_floating_point and t.dtype != torch.float64:
            return t.to(dtype)
        return t
    return cast(q), cast(k), cast(v), cast(bias)


def _autocasting(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def _run(call: AttentionCall, name: str) -> tuple[Tensor, Tensor | None, Tensor | None]:
    backend = REGISTRY[name]
    if _autocasting(call.device.type):
        with torch.autocast(call.device.type, enabled=False):
            return backend.run(call)
    return backend.run(call)


@overload
def attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = ...,
              bias: Tensor | None = ..., causal: Causal = ..., scale: float | None = ...,
              dropout_p: float = ..., backend: str = ..., return_lse: Literal[False] = ...,
              score_mod: _scores.ScoreMod | ScoreFn | None = ..., sinks: Tensor | None = ...,
              deterministic: bool | None = ...) -> Tensor: ...
@overload
def attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = ...,
              bias: Tensor | None = ..., causal: Causal = ..., scale: float | None = ...,
              dropout_p: float = ..., backend: str = ..., return_lse: Literal[True],
              score_mod: _scores.ScoreMod | ScoreFn | None = ...,
              sinks: Tensor | None = ..., deterministic: bool | None = ...) -> tuple[Tensor, Tensor]: ...
@overload
def attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = ...,
              bias: Tensor | None = ..., causal: Causal = ..., scale: float | None = ...,
              dropout_p: float = ..., backend: str = ..., return_lse: bool,
              score_mod: _scores.ScoreMod | ScoreFn | None = ...,
              sinks: Tensor | None = ..., deterministic: bool | None = ...) -> Tensor | tuple[Tensor, Tensor]: ...
def attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None,
              bias: Tensor | None = None, causal: Causal = False, scale: float | None = None,
              dropout_p: float = 0.0, backend: str = "auto", return_lse: bool = False,
              score_mod: _scores.ScoreMod | ScoreFn | None = None,
              sinks: Tensor | None = None, deterministic: bool | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention, ``softmax(q @ k^T * scale + bias, masked) @ v``.

    Args:
        q: (B, Hq, Lq, D). k: (B, Hkv, Lk, D). v: (B, Hkv, Lk, Dv). Hq must be a multiple of
            Hkv (grouped-query / multi-query attention; K/V are not copied). Any strides.
        mask: None, a :mod:`selfattn.masks` object, or a bool tensor broadcastable to
            (B, Hq, Lq, Lk). True = this query MAY attend to this key. A mask's tensors are read
            when the call runs (and again by its backward: don't change them in between).
        bias: float tensor broadcastable to (B, Hq, Lq, Lk), added to the scaled scores in the
            compute dtype (at least float32), whatever its own dtype.
        causal: False, True (needs Lq == Lk), "top_left" or "bottom_right".
        scale: multiplier of the scores; default 1 / sqrt(D).
        dropout_p: dropout on the attention weights (applied whenever > 0).
        backend: "auto", "reference", "sdpa", "chunked" or "flex"; see :func:`explain`.
        return_lse: also return the logsumexp of each row's scores, (B, Hq, Lq) float32
            (-inf on rows that see no key); it carries no gradient.
        score_mod: a :mod:`selfattn.scores` modifier (alibi, softcap, custom) or a function
            ``(score, b, h, i, j) -> score``, applied to the scaled (+ bias) scores before the mask.
        sinks: attention sinks, a float tensor (Hq,): one learned logit per query head that joins
            every row's softmax denominator and carries no value, so a row's weights sum to less
            than 1 (as in gpt-oss). Differentiable. With sinks, lse includes the sink term.
        deterministic: True: the output and every gradient are the same bits on every run, whatever
            the thread count; ``auto`` skips a backend that cannot promise it (FlexAttention's
            backward off the CPU) and ``explain`` says why, and a forced one raises. False: the
            fastest kernel, which off the CPU may accumulate gradients in a different order each
            run. None (default): ``torch.are_deterministic_algorithms_enabled()``. On the CPU every
            backend is deterministic either way. Dropout draws from torch's generator: same seed,
            same bits.

    Returns:
        out (B, Hq, Lq, Dv) in q's dtype, or (out, lse). A query row that sees no key gives
        output 0 and gradient 0, never NaN. Under ``torch.autocast``, q, k, v and bias are first
        cast to the autocast dtype (float64 excepted), as for torch's own SDPA, in every backend.

    Example:
        >>> q = k = v = torch.randn(2, 8, 128, 64)
        >>> out = selfattn.attention(q, k, v, causal=True)
    """
    if (mask is None and bias is None and causal is False and score_mod is None and sinks is None
            and return_lse is False and type(backend) is str and backend == "auto"
            and not torch.compiler.is_compiling() and _FORCED.get() is None
            and (call := _plain_call(q, k, v, scale, dropout_p, deterministic)) is not None):
        return REGISTRY[dispatch.choose_plain(call)].run(call)[0]  # no autocast here (_plain_call)
    q, k, v, bias = _autocast(q, k, v, bias)
    call = _validate(q, k, v, mask, bias, causal, scale, dropout_p, return_lse, score_mod, sinks=sinks,
                     deterministic=deterministic)
    out, lse, _ = _run(call, dispatch.choose(call, _forced_name(backend)).backend)
    return (out, lse) if return_lse else out  # type: ignore[return-value]


def attention_with_weights(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None,
                           bias: Tensor | None = None, causal: Causal = False,
                           scale: float | None = None, dropout_p: float = 0.0,
                           score_mod: _scores.ScoreMod | ScoreFn | None = None,
                           sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Like :func:`attention`, also returning the weights (B, Hq, Lq, Lk) (after dropout).

    Materialises the (Lq, Lk) weights, so it always runs the reference backend. With ``sinks``,
    the sink's own weight is left out, so rows sum to less than 1.
    """
    q, k, v, bias = _autocast(q, k, v, bias)
    call = _validate(q, k, v, mask, bias, causal, scale, dropout_p, False, score_mod, need_weights=True,
                     sinks=sinks)
    out, _, weights = _run(call, dispatch.choose(call).backend)
    if weights is None:
        raise RuntimeError("the backend chosen for need_weights returned no weights")
    return out, weights


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``backend='auto'`` calls inside the block to use ``name``.

    Under ``torch.compile`` it is read while tracing and guarded on: enter it around a compiled
    call (a change retraces), not inside the compiled function.

    Example:
        >>> with selfattn.use_backend("reference"):
        ...     out = selfattn.attention(q, k, v)
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(REGISTRY)}")
    global _TRACED_FORCED
    token = _FORCED.set(name)
    _TRACED_FORCED = name
    try:
        yield
    finally:
        _FORCED.reset(token)
        _TRACED_FORCED = _FORCED.get()

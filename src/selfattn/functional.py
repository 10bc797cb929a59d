"""``attention()``: validate once, ask ``backends.dispatch`` for a backend, run it.

Shape legend: B batch, Hq query heads, Hkv key/value heads (Hq % Hkv == 0), Lq/Lk query/key
lengths, D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, overload

import torch
from torch import Tensor

from . import masks as _masks
from . import scores as _scores
from ._call import AttentionCall
from .backends import REGISTRY, dispatch
from .backends._common import specialized
from .backends.base import ALL_DTYPES
from .masks import Mask

__all__ = ["Explanation", "attention", "attention_with_weights", "explain", "use_backend"]

Causal = bool | Literal["top_left", "bottom_right"]
ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("selfattn_backend", default=None)
# What torch.compile reads instead (it cannot trace ContextVar.get): the name last set or restored by
# use_backend() in any thread; dynamo guards on it, so a compiled function retraces when it changes.
_TRACED_FORCED: str | None = None


def _name(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else repr(x)


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        layout = "(B, Hkv, Lk, Dv)" if name == "v" else f"(B, H, L, D) for {name}"
        raise ValueError(f"{name} must be 4-D {layout}, got {_name(t)}; "
                         "for (B, L, D) input use .unsqueeze(1), for (B, L, H, D) use .transpose(1, 2)")
    if t.dtype not in ALL_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {t.dtype}")
    if 0 in t.shape:
        raise ValueError(f"{name} has an empty dimension, got {_name(t)}")
    return t


def _check_scale(scale: object, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be None or a positive number, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}; "
                         f"leave it None for 1/sqrt(D) = {1 / math.sqrt(d):.4g}")
    return float(scale)


def _check_dropout(dropout_p: object) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a number in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def _plain_call(q: object, k: object, v: object, scale: object, dropout_p: object) -> AttentionCall | None:
    """The call for ``attention(q, k, v)`` with at most scale and dropout (an unmasked layer, a
    decode step on a full cache), in a few operations: None unless q, k and v pass every check
    :func:`_validate` makes and nothing (autocast) needs the full path. A None sends the call down
    :func:`_validate`, which gives the precise error for bad input. Not for use while compiling."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    dtype, device = q.dtype, q.device
    if not (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and dtype in ALL_DTYPES
            and k.dtype == dtype and v.dtype == dtype and k.device == device and v.device == device
            and qs[0] == ks[0] == vs[0] and ks[1] == vs[1] and ks[2] == vs[2] and ks[3] == qs[3]
            and min(qs) > 0 and min(ks) > 0 and vs[3] > 0 and qs[1] % ks[1] == 0):
        return None
    if _autocasting(device.type):
        return None
    return AttentionCall(q=q, k=k, v=v, mask=None, bias=None, scale=_check_scale(scale, qs[3]),
                         dropout_p=_check_dropout(dropout_p), return_lse=False)


def _validate(q: Tensor, k: Tensor, v: Tensor, mask: object, bias: object, causal: object,
              scale: object, dropout_p: object, return_lse: object, score_mod: object = None,
              need_weights: bool = False, sinks: object = None) -> AttentionCall:
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v)
    b, hq, lq, d = q.shape
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
                        "cast them with .to(q.dtype)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    hkv, lk = k.shape[1], k.shape[2]
    if v.shape[1] != hkv or v.shape[2] != lk:
        raise ValueError(f"k and v must have the same heads and length: k {_name(k)}, v {_name(v)}")
    if k.shape[3] != d:
        raise ValueError(f"q and k must have the same head dim D: q has {d}, k has {k.shape[3]}")
    if hq % hkv:
        raise ValueError(f"q has {hq} heads and k/v have {hkv}; Hq must be a multiple of Hkv (GQA)")

    if isinstance(causal, bool):
        align = "top_left" if causal else None
        if causal and lq != lk:
            raise ValueError(f"causal=True needs Lq == Lk, got Lq={lq}, Lk={lk}; name the alignment: "
                             "causal='top_left' (query i sees keys <= i) or causal='bottom_right' "
                             "(the last query sees every key, as in decoding)")
    elif causal in ("top_left", "bottom_right"):
        align = causal
    else:
        raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")

    m: Mask | None
    if mask is None:
        m = None
    elif isinstance(mask, Mask):
        m = mask
    elif isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
                            "pass an additive float mask as bias=, and 0/1 values as mask.bool()")
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}; move it with .to(q.device)")
        m = _masks.from_tensor(mask)
    else:
        raise TypeError(f"mask must be None, a selfattn.masks.Mask or a bool tensor, got {type(mask).__name__}")
    if m is not None:
        try:
            m.check(b, hq, lq, lk)
        except ValueError as e:
            raise ValueError(f"mask: {e}") from None
    if align is not None:
        c = _masks.causal(align)
        m = c if m is None else c & m

    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be None or a float tensor, got {type(bias).__name__}")
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias must be a float tensor added to the scores, got dtype {bias.dtype}; "
                            "pass a bool visibility tensor as mask= instead")
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device} but q is on {q.device}; move it with .to(q.device)")
        want = (b, hq, lq, lk)
        shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
        if bias.dim() > 4 or any(s not in (1, w) for s, w in zip(shape, want, strict=True)):
            raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to "
                             f"(B, Hq, Lq, Lk) = {want}; use size 1 for dims that broadcast")
        bias = bias.reshape(shape)

    if torch.compiler.is_compiling() and (scale is not None or dropout_p):
        scale, dropout_p = specialized(scale), specialized(dropout_p)  # a float dynamo made dynamic: a constant
    scale_f, dropout_f = _check_scale(scale, d), _check_dropout(dropout_p)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")

    mod: _scores.ScoreMod | None
    if score_mod is None or isinstance(score_mod, _scores.ScoreMod):
        mod = score_mod
    elif callable(score_mod):
        mod = _scores.custom(score_mod)
    else:
        raise TypeError(f"score_mod must be None, a selfattn.scores modifier or a callable (score, b, h, i, j), "
                        f"got {type(score_mod).__name__}")
    if mod is not None and mod.num_heads() not in (None, hq):
        raise ValueError(f"score_mod {mod!r} is built for {mod.num_heads()} heads, but q has {hq}")

    if sinks is not None:
        if not isinstance(sinks, Tensor):
            raise TypeError(f"sinks must be None or a float tensor of shape (Hq,), got {type(sinks).__name__}")
        if not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks must be a float tensor (one logit per query head), got dtype {sinks.dtype}")
        if tuple(sinks.shape) != (hq,):
            raise ValueError(f"sinks must have shape (Hq,) = ({hq},), one logit per query head, "
                             f"got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}; move it with .to(q.device)")

    return AttentionCall(q=q, k=k, v=v, mask=m, bias=bias, scale=scale_f,  # type: ignore[arg-type]
                         dropout_p=dropout_f, return_lse=return_lse, need_weights=need_weights,
                         score_mod=mod, sinks=sinks)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Explanation:
    """What ``attention(backend='auto')`` would do with these inputs.

    Attributes:
        backend: the backend that runs the call.
        not_chosen: for every other backend, why it does not (its reasons joined by "; ").
        why: why ``backend`` was picked.
        reasons: for every other backend, the list of its reasons.
    """

    backend: str
    not_chosen: dict[str, str] = field(default_factory=dict)
    why: str = ""
    reasons: dict[str, list[str]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"auto picks: {self.backend}" + (f" ({self.why})" if self.why else "")]
        lines += [f"  {name}: {why}" for name, why in self.not_chosen.items()]
        return "\n".join(lines)


def explain(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None,
            bias: Tensor | None = None, causal: Causal = False, scale: float | None = None,
            dropout_p: float = 0.0, backend: str = "auto", return_lse: bool = False,
            score_mod: _scores.ScoreMod | ScoreFn | None = None, sinks: Tensor | None = None) -> Explanation:
    """Which backend ``attention(q, k, v, **same_kwargs)`` would run, and why not the others.

    Example:
        >>> print(selfattn.explain(q, k, v, causal=True))
        auto picks: sdpa (SDPA runs this call in a fused kernel without a dense mask)
          reference: supported, but sdpa is preferred: ...
    """
    q, k, v, bias = _autocast(q, k, v, bias)
    call = _validate(q, k, v, mask, bias, causal, scale, dropout_p, return_lse, score_mod, sinks=sinks)
    choice = dispatch.choose(call, _forced_name(backend), explain=True)
    return Explanation(choice.backend, {n: "; ".join(r) for n, r in choice.not_chosen.items()},
                       choice.why, choice.not_chosen)


def _forced_name(backend: object) -> str | None:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != "auto" and backend not in REGISTRY:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto' or one of {sorted(REGISTRY)}")
    if backend != "auto":
        return backend
    return _TRACED_FORCED if torch.compiler.is_compiling() else _FORCED.get()


def _autocast(q: object, k: object, v: object, bias: object) -> tuple:
    """Under ``torch.autocast`` for q's device, cast the floating inputs (not float64) to the
    autocast dtype, as torch does for its own SDPA; backends then run with autocast off, so
    every backend computes the same thing and returns that dtype."""
    if not isinstance(q, Tensor) or not _autocasting(q.device.type):
        return q, k, v, bias
    dtype = torch.get_autocast_dtype(q.device.type)

    def cast(t: object) -> object:
        ok = isinstance(t, Tensor) and t.dtype.is_floating_point and t.dtype != torch.float64
        return t.to(dtype) if ok else t  # type: ignore[union-attr]
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
              score_mod: _scores.ScoreMod | ScoreFn | None = ..., sinks: Tensor | None = ...) -> Tensor: ...
@overload
def attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = ...,
              bias: Tensor | None = ..., causal: Causal = ..., scale: float | None = ...,
              dropout_p: float = ..., backend: str = ..., return_lse: Literal[True],
              score_mod: _scores.ScoreMod | ScoreFn | None = ...,
              sinks: Tensor | None = ...) -> tuple[Tensor, Tensor]: ...
def attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None,
              bias: Tensor | None = None, causal: Causal = False, scale: float | None = None,
              dropout_p: float = 0.0, backend: str = "auto", return_lse: bool = False,
              score_mod: _scores.ScoreMod | ScoreFn | None = None,
              sinks: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
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
            and (call := _plain_call(q, k, v, scale, dropout_p)) is not None):
        return REGISTRY[dispatch.choose_plain(call)].run(call)[0]  # no autocast here (_plain_call)
    q, k, v, bias = _autocast(q, k, v, bias)
    call = _validate(q, k, v, mask, bias, causal, scale, dropout_p, return_lse, score_mod, sinks=sinks)
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

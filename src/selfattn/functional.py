"""``attention()``: validate once, choose a backend, run it. The only place a backend is chosen.

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
from .backends import REGISTRY
from .backends.sdpa import is_fast_causal
from .masks import Mask

__all__ = ["Explanation", "attention", "attention_with_weights", "explain", "use_backend"]

Causal = bool | Literal["top_left", "bottom_right"]
ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("selfattn_backend", default=None)

# When SDPA would need a dense mask, `auto` weighs it against the chunked backend. Measured on a
# 2-core CPU (fwd+bwd, H=8, D=64): at 256^2 mask elements SDPA's single fused call wins (chunked
# 1.2-1.6x slower); from 512^2 up, chunked wins wherever the mask leaves tiles empty (padding +
# causal 0.93x, sliding window 0.84x, 8 packed documents 0.59x; at 1024^2: 0.67x, 0.39x,
# 0.24x), while a dense random mask with no empty tile stays 1.2x slower in chunked.
DENSE_MASK_LIMIT = 1 << 18  # below this many elements (B' * H' * Lq * Lk), SDPA with the dense mask
SKIP_FRACTION = 0.25  # above it, chunked when at least this share of 128 x 128 tiles is empty
# ... or in any case past this size: the dense mask alone is 1 GiB as float32 (8 GiB at L=32k)
DENSE_MASK_MEMORY_LIMIT = 1 << 28


def _name(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else repr(x)


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        layout = "(B, Hkv, Lk, Dv)" if name == "v" else f"(B, H, L, D) for {name}"
        raise ValueError(f"{name} must be 4-D {layout}, got {_name(t)}; "
                         "for (B, L, D) input use .unsqueeze(1), for (B, L, H, D) use .transpose(1, 2)")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {t.dtype}")
    if 0 in t.shape:
        raise ValueError(f"{name} has an empty dimension, got {_name(t)}")
    return t


def _validate(q: Tensor, k: Tensor, v: Tensor, mask: object, bias: object, causal: object,
              scale: object, dropout_p: object, return_lse: object, score_mod: object = None,
              need_weights: bool = False) -> AttentionCall:
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

    if scale is None:
        scale_f = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be None or a positive number, got {type(scale).__name__}")
    elif not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}; "
                         f"leave it None for 1/sqrt(D) = {1 / math.sqrt(d):.4g}")
    else:
        scale_f = float(scale)

    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a number in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
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

    return AttentionCall(q=q, k=k, v=v, mask=m, bias=bias, scale=scale_f,  # type: ignore[arg-type]
                         dropout_p=float(dropout_p), return_lse=return_lse, need_weights=need_weights,
                         score_mod=mod)


def _dense_mask_elements(call: AttentionCall) -> int:
    _, _, _, lq, lk, _, _ = call.shape
    bm, hm = call.mask.batch_heads() if call.mask is not None else (1, 1)
    if call.score_mod is not None:
        hm = call.shape[1]
    if call.bias is not None:
        bm, hm = max(bm, call.bias.shape[0]), max(hm, call.bias.shape[1])
    return bm * hm * lq * lk


def _empty_tile_fraction(call: AttentionCall) -> float:
    """Share of 128 x 128 (query, key) tiles that the mask leaves empty."""
    if call.mask is None:
        return 0.0
    _, _, _, lq, lk, _, _ = call.shape
    tiles = call.mask.tiles(lq, lk, 128, 128, call.device)
    return float((tiles == _masks.EMPTY).float().mean())


def _choose(call: AttentionCall, forced: str | None, reasons: bool = False) -> tuple[str, dict[str, str]]:
    """Pick a backend; with ``reasons``, also say for every other backend why it was not picked
    (without, only the backends considered are asked whether they support the call)."""
    asked: dict[str, str | None] = {}

    def why_not(name: str) -> str | None:
        if name not in asked:
            asked[name] = REGISTRY[name].supports(call)
        return asked[name]

    if forced is not None:
        if (why := why_not(forced)) is not None:
            raise ValueError(f"backend={forced!r} cannot run this call: {why}; "
                             "use backend='auto' or see selfattn.explain(...)")
        note = f"not picked: backend {forced!r} was requested"
        return forced, {n: why_not(n) or note for n in REGISTRY if n != forced} if reasons else {}

    plain = call.mask is None and call.bias is None and call.score_mod is None
    fast = plain or is_fast_causal(call)
    elements = _dense_mask_elements(call)
    preferences: list[tuple[str, str]] = []
    if call.need_weights:
        preferences.append(("reference", "only reference returns attention weights"))
    on_cuda = call.device.type == "cuda"
    if fast:
        preferences.append(("sdpa", "SDPA runs this mask in a fused kernel without a dense mask"))
    else:
        if on_cuda:
            preferences.append(("flex", "on CUDA, compiled FlexAttention skips empty blocks and applies score "
                                        "modifiers in its fused kernel"))
        if elements > DENSE_MASK_MEMORY_LIMIT:
            preferences.append(("chunked", f"a dense mask would have {elements:,} elements "
                                           f"(> {DENSE_MASK_MEMORY_LIMIT:,}); chunked needs O(L * block) memory"))
        elif elements > DENSE_MASK_LIMIT and (skipped := _empty_tile_fraction(call)) >= SKIP_FRACTION:
            preferences.append(("chunked", f"{skipped:.0%} of the tiles are empty and a dense mask would have "
                                           f"{elements:,} elements (> {DENSE_MASK_LIMIT:,}); chunked skips them "
                                           "in O(L * block) memory"))
    preferences += [
        ("sdpa", f"the dense mask ({elements:,} elements) is small or leaves few tiles empty: "
                 "one fused call"),
        *([("flex", "SDPA cannot run this call")] if on_cuda else []),
        ("chunked", "SDPA cannot run this call"),
        ("reference", "no faster backend can run this call"),
    ]
    picked = next(((n, w) for n, w in preferences if n in REGISTRY and why_not(n) is None), None)
    if picked is None:
        raise RuntimeError("no backend can run this call")  # reference supports every call
    name, why = picked
    if not reasons:
        return name, {}
    if not on_cuda and "flex" in REGISTRY and why_not("flex") is None:
        asked["flex"] = (f"auto does not pick flex on {call.device.type} (it compiles for tens of seconds "
                         "and runs inference only there): ask for it with backend='flex'")
    return name, {n: why_not(n) or f"supported, but {name} is preferred: {why}" for n in REGISTRY if n != name}


@dataclass(frozen=True)
class Explanation:
    """What ``attention(backend='auto')`` would do with these inputs."""

    backend: str
    not_chosen: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"auto picks: {self.backend}"]
        lines += [f"  {name}: {why}" for name, why in self.not_chosen.items()]
        return "\n".join(lines)


def explain(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None,
            bias: Tensor | None = None, causal: Causal = False, scale: float | None = None,
            dropout_p: float = 0.0, backend: str = "auto", return_lse: bool = False,
            score_mod: _scores.ScoreMod | ScoreFn | None = None) -> Explanation:
    """Which backend ``attention(q, k, v, **same_kwargs)`` would run, and why not the others.

    Example:
        >>> print(selfattn.explain(q, k, v, causal=True))
        auto picks: sdpa
          reference: supported, but sdpa is preferred: ...
    """
    call = _validate(q, k, v, mask, bias, causal, scale, dropout_p, return_lse, score_mod)
    name, reasons = _choose(call, _forced_name(backend), reasons=True)
    return Explanation(name, reasons)


def _forced_name(backend: object) -> str | None:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != "auto" and backend not in REGISTRY:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto' or one of {sorted(REGISTRY)}")
    return _FORCED.get() if backend == "auto" else backend


@overload
def attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = ...,
              bias: Tensor | None = ..., causal: Causal = ..., scale: float | None = ...,
              dropout_p: float = ..., backend: str = ..., return_lse: Literal[False] = ...,
              score_mod: _scores.ScoreMod | ScoreFn | None = ...) -> Tensor: ...
@overload
def attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = ...,
              bias: Tensor | None = ..., causal: Causal = ..., scale: float | None = ...,
              dropout_p: float = ..., backend: str = ..., return_lse: Literal[True],
              score_mod: _scores.ScoreMod | ScoreFn | None = ...) -> tuple[Tensor, Tensor]: ...
def attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None,
              bias: Tensor | None = None, causal: Causal = False, scale: float | None = None,
              dropout_p: float = 0.0, backend: str = "auto", return_lse: bool = False,
              score_mod: _scores.ScoreMod | ScoreFn | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention, ``softmax(q @ k^T * scale + bias, masked) @ v``.

    Args:
        q: (B, Hq, Lq, D). k: (B, Hkv, Lk, D). v: (B, Hkv, Lk, Dv). Hq must be a multiple of
            Hkv (grouped-query / multi-query attention; K/V are not copied).
        mask: None, a :mod:`selfattn.masks` object, or a bool tensor broadcastable to
            (B, Hq, Lq, Lk). True = this query MAY attend to this key.
        bias: float tensor broadcastable to (B, Hq, Lq, Lk), added to the scaled scores.
        causal: False, True (needs Lq == Lk), "top_left" or "bottom_right".
        scale: multiplier of the scores; default 1 / sqrt(D).
        dropout_p: dropout on the attention weights (applied whenever > 0).
        backend: "auto", "reference", "sdpa", "chunked" or "flex"; see :func:`explain`.
        return_lse: also return the logsumexp of each row's scores, (B, Hq, Lq) float32
            (-inf on rows that see no key); it carries no gradient.
        score_mod: a :mod:`selfattn.scores` modifier (alibi, softcap, custom) or a function
            ``(score, b, h, i, j) -> score``, applied to the scaled (+ bias) scores before the mask.

    Returns:
        out (B, Hq, Lq, Dv) in q's dtype, or (out, lse). A query row that sees no key gives
        output 0 and gradient 0, never NaN.

    Example:
        >>> q = k = v = torch.randn(2, 8, 128, 64)
        >>> out = selfattn.attention(q, k, v, causal=True)
    """
    call = _validate(q, k, v, mask, bias, causal, scale, dropout_p, return_lse, score_mod)
    name, _ = _choose(call, _forced_name(backend))
    out, lse, _ = REGISTRY[name].run(call)
    return (out, lse) if return_lse else out


def attention_with_weights(q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None,
                           bias: Tensor | None = None, causal: Causal = False,
                           scale: float | None = None, dropout_p: float = 0.0,
                           score_mod: _scores.ScoreMod | ScoreFn | None = None) -> tuple[Tensor, Tensor]:
    """Like :func:`attention`, also returning the weights (B, Hq, Lq, Lk) (after dropout).

    Materialises the (Lq, Lk) weights, so it always runs the reference backend.
    """
    call = _validate(q, k, v, mask, bias, causal, scale, dropout_p, False, score_mod, need_weights=True)
    name, _ = _choose(call, None)
    out, _, weights = REGISTRY[name].run(call)
    assert weights is not None
    return out, weights


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``backend='auto'`` calls inside the block to use ``name``.

    Example:
        >>> with selfattn.use_backend("reference"):
        ...     out = selfattn.attention(q, k, v)
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(REGISTRY)}")
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)

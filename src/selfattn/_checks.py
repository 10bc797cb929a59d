"""The call builder: every argument of an attention call checked once, by small checkers that
``selfattn.attention`` (:func:`build_call`) and ``selfattn.distributed.attention`` share, so the
same bad input gets the same error type and text from both.

Each checker names the argument, what was expected, what was given and the fix, and returns the
value in the form the backends take (a Mask for a bool tensor, a float scale, ...).

Shape legend: B batch, Hq query heads, Hkv key/value heads, Lq/Lk lengths, D head dim of q and k,
Dv head dim of v.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import Tensor

from . import masks as _masks
from . import scores as _scores
from ._call import FLOAT_DTYPES, AttentionCall, specialized
from .masks import Mask

__all__ = [
    "build_call",
    "check_backend",
    "check_bias",
    "check_causal",
    "check_dropout",
    "check_mask",
    "check_qkv",
    "check_return_lse",
    "check_scale",
    "check_score_mod",
    "check_sinks",
    "check_tensor",
]


def _name(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else repr(x)


def check_tensor(name: str, t: object) -> Tensor:
    """q, k or v: a 4-D floating tensor with no empty dimension."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        layout = "(B, Hkv, Lk, Dv)" if name == "v" else f"(B, H, L, D) for {name}"
        raise ValueError(f"{name} must be 4-D {layout}, got {_name(t)}; "
                         "for (B, L, D) input use .unsqueeze(1), for (B, L, H, D) use .transpose(1, 2)")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {t.dtype}")
    if 0 in t.shape:
        raise ValueError(f"{name} has an empty dimension, got {_name(t)}")
    return t


def check_qkv(q: object, k: object, v: object) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv): one dtype, one device, Hq % Hkv == 0."""
    q, k, v = check_tensor("q", q), check_tensor("k", k), check_tensor("v", v)
    b, hq, _, d = q.shape
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
    return q, k, v


def check_causal(causal: object, lq: int, lk: int) -> str | None:
    """The causal alignment ("top_left", "bottom_right") or None for no causal mask."""
    if isinstance(causal, bool):
        if causal and lq != lk:
            raise ValueError(f"causal=True needs Lq == Lk, got Lq={lq}, Lk={lk}; name the alignment: "
                             "causal='top_left' (query i sees keys <= i) or causal='bottom_right' "
                             "(the last query sees every key, as in decoding)")
        return "top_left" if causal else None
    if causal in ("top_left", "bottom_right"):
        return causal
    raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")


def check_mask(mask: object, device: torch.device, batch: int, heads: int, lq: int, lk: int) -> Mask | None:
    """None, a Mask or a bool tensor (on q's device) that describes a call of this shape, as a Mask."""
    m: Mask | None
    if mask is None:
        return None
    if isinstance(mask, Mask):
        m = mask
    elif isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
                            "pass an additive float mask as bias=, and 0/1 values as mask.bool()")
        if mask.device != device:
            raise ValueError(f"mask is on {mask.device} but q is on {device}; move it with .to(q.device)")
        m = _masks.from_tensor(mask)
    else:
        raise TypeError(f"mask must be None, a selfattn.masks.Mask or a bool tensor, got {type(mask).__name__}")
    try:
        m.check(batch, heads, lq, lk)
    except ValueError as e:
        raise ValueError(f"mask: {e}") from None
    return m


def check_bias(bias: object, device: torch.device, batch: int, heads: int, lq: int, lk: int) -> Tensor | None:
    """None or a float tensor broadcastable to (B, Hq, Lq, Lk), as a 4-D view."""
    if bias is None:
        return None
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be None or a float tensor, got {type(bias).__name__}")
    if not bias.dtype.is_floating_point:
        raise TypeError(f"bias must be a float tensor added to the scores, got dtype {bias.dtype}; "
                        "pass a bool visibility tensor as mask= instead")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but q is on {device}; move it with .to(q.device)")
    want = (batch, heads, lq, lk)
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    if bias.dim() > 4 or any(s not in (1, w) for s, w in zip(shape, want, strict=True)):
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to "
                         f"(B, Hq, Lq, Lk) = {want}; use size 1 for dims that broadcast")
    return bias.reshape(shape)


def check_scale(scale: object, d: int) -> float:
    """None (1 / sqrt(D)) or a finite number > 0."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be None or a positive number, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}; "
                         f"leave it None for 1/sqrt(D) = {1 / math.sqrt(d):.4g}")
    return float(scale)


def check_dropout(dropout_p: object) -> float:
    """A number in [0, 1)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a number in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def check_return_lse(return_lse: object) -> bool:
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    return return_lse


def check_deterministic(deterministic: object) -> bool:
    """True or False as given; None follows ``torch.use_deterministic_algorithms``."""
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True, False or None, got {deterministic!r}")
    return deterministic


def check_score_mod(score_mod: object, heads: int) -> _scores.ScoreMod | None:
    """None, a ScoreMod or a function (score, b, h, i, j) -> score, for a call of ``heads`` query heads."""
    mod: _scores.ScoreMod | None
    if score_mod is None or isinstance(score_mod, _scores.ScoreMod):
        mod = score_mod
    elif callable(score_mod):
        mod = _scores.custom(score_mod)
    else:
        raise TypeError(f"score_mod must be None, a selfattn.scores modifier or a callable (score, b, h, i, j), "
                        f"got {type(score_mod).__name__}")
    if mod is not None and mod.num_heads() not in (None, heads):
        raise ValueError(f"score_mod {mod!r} is built for {mod.num_heads()} heads, but q has {heads}")
    return mod


def check_sinks(sinks: object, heads: int, device: torch.device) -> Tensor | None:
    """None or a float tensor (Hq,) on q's device."""
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be None or a float tensor of shape (Hq,), got {type(sinks).__name__}")
    if not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a float tensor (one logit per query head), got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (Hq,) = ({heads},), one logit per query head, "
                         f"got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {device}; move it with .to(q.device)")
    return sinks


def check_backend(backend: object, known: Collection[str]) -> str:
    """"auto" or the name of a backend in ``known``."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != "auto" and backend not in known:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto' or one of {sorted(known)}")
    return backend


def build_call(q: object, k: object, v: object, mask: object, bias: object, causal: object, scale: object,
               dropout_p: object, return_lse: object, score_mod: object = None, need_weights: bool = False,
               sinks: object = None, deterministic: object = None) -> AttentionCall:
    """The validated call of ``selfattn.attention``: every argument checked, causal folded into the mask."""
    q, k, v = check_qkv(q, k, v)
    b, hq, lq, d = q.shape
    lk = k.shape[2]
    align = check_causal(causal, lq, lk)
    m = check_mask(mask, q.device, b, hq, lq, lk)
    if align is not None:
        c = _masks.causal(align)
        m = c if m is None else c & m
    bias_t = check_bias(bias, q.device, b, hq, lq, lk)
    if torch.compiler.is_compiling() and (scale is not None or dropout_p):
        scale, dropout_p = specialized(scale), specialized(dropout_p)  # type: ignore[arg-type]  # constants again
    return AttentionCall(q=q, k=k, v=v, mask=m, bias=bias_t, scale=check_scale(scale, d),
                         dropout_p=check_dropout(dropout_p), return_lse=check_return_lse(return_lse),
                         need_weights=need_weights, score_mod=check_score_mod(score_mod, hq),
                         sinks=check_sinks(sinks, hq, q.device), deterministic=check_deterministic(deterministic))

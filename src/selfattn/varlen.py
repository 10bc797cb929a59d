"""``varlen_attention()``: packed variable-length sequences in flash-attn's varlen layout.

The tokens of N sequences are packed along one dim, with no padding: q (Tq, Hq, D), k (Tk, Hkv, D),
v (Tk, Hkv, Dv), and ``cu_seqlens`` (N + 1,) says where each sequence starts. The call is one
:func:`selfattn.attention` over a batch of one, (1, H, T, D) views of the same memory, with a
:func:`selfattn.masks.packed` mask: the document mask's fast path. So every backend that takes masks
runs it (chunked computes each sequence's tiles and skips the tiles between sequences, with no
padding and no dense (Tq, Tk) mask), dispatch chooses as for any masked call, :func:`varlen_explain`
says why, and autograd goes through the chosen backend.

Shape legend: N sequences, Tq/Tk packed query/key tokens, Hq query heads, Hkv key/value heads
(Hq % Hkv == 0), D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, overload

import torch
from torch import Tensor

from . import functional as _functional
from . import masks as _masks
from . import scores as _scores
from ._call import FLOAT_DTYPES
from ._checks import check_backend
from ._kept import MISSING, KeptByTensors
from .backends import REGISTRY
from .masks import Mask
from .masks.packed import check_cu_seqlens_pair

__all__ = ["varlen_attention", "varlen_explain"]

Causal = bool | Literal["bottom_right"]
Window = tuple[int, int] | None


def _check_packed(name: str, t: object, layout: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D {layout}, every sequence's tokens packed along dim 0, got shape "
                         f"{tuple(t.shape)}; for a padded (B, L, H, D) batch take its real tokens "
                         "(x[keep] with keep a (B, L) bool tensor) and their cu_seqlens, or call selfattn.attention")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {t.dtype}")
    if t.shape[1] == 0 or t.shape[2] == 0:
        raise ValueError(f"{name} {layout} has no heads or an empty head dim, got shape {tuple(t.shape)}")
    return t


def check_qkv(q: object, k: object, v: object) -> tuple[Tensor, Tensor, Tensor]:
    q = _check_packed("q", q, "(Tq, Hq, D)")
    k = _check_packed("k", k, "(Tk, Hkv, D)")
    v = _check_packed("v", v, "(Tk, Hkv, Dv)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
                        "cast them with .to(q.dtype)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must hold the same tokens: k has Tk={k.shape[0]}, v has {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same heads: k has {k.shape[1]}, v has {v.shape[1]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must have the same head dim D: q has {q.shape[2]}, k has {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads and k/v have {k.shape[1]}; Hq must be a multiple of Hkv (GQA)")
    return q, k, v


def _check_lengths(name: str, cu: Tensor, tokens: int, what: str, max_seqlen: object) -> None:
    """The last entry is the token count; no sequence is longer than ``max_seqlen`` (when given)."""
    max_name = name.replace("cu_seqlens", "max_seqlen")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                   or max_seqlen < 0):
        raise ValueError(f"{max_name} must be None or an int >= 0 (the longest sequence), got {max_seqlen!r}")
    if torch.compiler.is_compiling():  # the values are data
        return
    if (total := int(cu[-1])) != tokens:
        raise ValueError(f"{name} ends at {total} tokens but {what} holds {tokens} (dim 0); its last entry must be "
                         f"the number of packed tokens, {what}.shape[0]")
    if max_seqlen is not None:
        lengths = cu[1:] - cu[:-1]
        if (longest := int(lengths.max())) > max_seqlen:
            at = int(lengths.argmax())
            raise ValueError(f"sequence {at} of {name} has {longest} tokens, more than {max_name}={max_seqlen}; "
                             f"pass the longest length, int((cu[1:] - cu[:-1]).max()) = {longest}, or None")


def _check_causal(causal: object) -> bool:
    if causal is True or causal is False:
        return causal
    if causal == "bottom_right" and isinstance(causal, str):
        return True
    if causal == "top_left" and isinstance(causal, str):
        raise ValueError("varlen_attention aligns each sequence's causal mask bottom-right (flash-attn's varlen "
                         "convention); top-left per sequence is not supported: call selfattn.attention on each "
                         "sequence with causal='top_left'")
    raise ValueError(f"causal must be False, True or 'bottom_right' (the same here), got {causal!r}")


def _check_window(window: object) -> tuple[int | None, int | None]:
    """flash-attn's window_size (left, right) as masks.packed's bounds: -1 is unbounded (None)."""
    if window is None:
        return None, None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ValueError(f"window must be None or (left, right), two ints >= -1 (-1: unbounded on that side, as in "
                         f"flash-attn's window_size), got {window!r}; e.g. window=(255, 0) for 255 past keys")
    left, right = window
    return (None if left == -1 else left), (None if right == -1 else right)


def softcap_mod(softcap: object) -> _scores.ScoreMod | None:
    """None or 0 (flash-attn's "off"): no modifier; else scores.softcap, which checks the cap."""
    if softcap is None or (type(softcap) in (int, float) and softcap == 0):
        return None
    return _scores.softcap(softcap)  # type: ignore[arg-type]  # a wrong type is its ValueError


def _mask(cu_q: Tensor, cu_k: Tensor, left: int | None, right: int | None) -> Mask | None:
    """The packed mask, or for one sequence the global mask it equals (so SDPA's causal kernel can run it)."""
    if cu_q.numel() == 2 and left is None:  # one sequence spans the whole call
        if right is None:
            return None
        if right == 0:
            return _masks.causal("bottom_right")
    return _masks.packed(cu_q, cu_k, left=left, right=right)


# The checked packed masks of the last few calls: the layers of a model, or the forward and backward of
# a step, that pass the same cu_seqlens tensors reuse one mask, so its lengths are checked once and the
# chunked backend's plan, kept on the mask, is made once.
_MASKS = KeptByTensors()


def packed_mask(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None, tq: int, tk: int, *, causal: object,
                window: object, max_seqlen_q: object = None, max_seqlen_k: object = None) -> Mask | None:
    """The checked mask of a varlen call on ``tq`` packed queries and ``tk`` keys (None: every key of the one
    sequence visible), kept for the next call with the same cu_seqlens tensors. Shared with
    :func:`selfattn.distributed.varlen_attention`, whose row is given on global positions."""
    left, right = _check_window(window)
    if _check_causal(causal):
        right = 0  # causal & a window: keys up to the diagonal (flash-attn's right bound is 0 then too)
    given = (cu_seqlens_q,) if cu_seqlens_k is None else (cu_seqlens_q, cu_seqlens_k)
    key = (cu_seqlens_k is None, tq, tk, max_seqlen_q, max_seqlen_k, left, right)
    mask = _MASKS.find(given, key)
    if mask is MISSING:
        cu_q, cu_k = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k)
        _check_lengths("cu_seqlens_q", cu_q, tq, "q", max_seqlen_q)
        _check_lengths("cu_seqlens_k", cu_k, tk, "k", max_seqlen_k)
        mask = _MASKS.keep(given, key, _mask(cu_q, cu_k, left, right))
    return mask


@dataclass(frozen=True)
class _Call:
    """A validated varlen call: the (1, H, T, D) views and the keyword arguments of selfattn.attention."""

    q: Tensor  # (1, Hq, Tq, D)
    k: Tensor  # (1, Hkv, Tk, D)
    v: Tensor  # (1, Hkv, Tk, Dv)
    kwargs: dict[str, Any]

    @property
    def empty(self) -> bool:
        """Tq = 0 or Tk = 0: no row sees a key, and no backend is asked."""
        return self.q.shape[2] == 0 or self.k.shape[2] == 0


def _build(q: object, k: object, v: object, cu_seqlens_q: object, cu_seqlens_k: object, max_seqlen_q: object,
           max_seqlen_k: object, causal: object, window: object, scale: object, dropout_p: object,
           softcap: object, sinks: object, return_lse: object, backend: object,
           deterministic: object = None) -> _Call:
    q, k, v = check_qkv(q, k, v)
    if not isinstance(cu_seqlens_q, Tensor):
        raise TypeError(f"cu_seqlens_q must be an int32 tensor (N + 1,), got {type(cu_seqlens_q).__name__}; "
                        "build it with torch.tensor(..., dtype=torch.int32)")
    if cu_seqlens_k is not None and not isinstance(cu_seqlens_k, Tensor):
        raise TypeError(f"cu_seqlens_k must be None or an int32 tensor (N + 1,), got {type(cu_seqlens_k).__name__}")
    mask = packed_mask(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], causal=causal, window=window,
                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    kwargs: dict[str, Any] = dict(mask=mask, scale=scale, dropout_p=dropout_p,
                                  score_mod=softcap_mod(softcap), sinks=sinks, return_lse=return_lse, backend=backend,
                                  deterministic=deterministic)
    return _Call(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2),
                 kwargs)


class _NoKeys(torch.autograd.Function):
    """Zeros (Tq, Hq, Dv) for a call with Tq = 0 or Tk = 0, where no row sees a key: gradient 0 for
    every input (sinks included: a row with no key gives 0 whatever its sink)."""

    @staticmethod
    def forward(ctx, shape: tuple[int, ...], q: Tensor, *others: Tensor | None) -> Tensor:
        ctx.specs = [None if t is None else (t.shape, t.dtype, t.device) for t in (q, *others)]
        return q.new_zeros(shape)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple:
        zeros = [None if s is None else torch.zeros(s[0], dtype=s[1], device=s[2]) for s in ctx.specs]
        return (None, *zeros)


def _empty(call: _Call) -> tuple[Tensor, Tensor]:
    """(out (Tq, Hq, Dv), lse (Hq, Tq)) of a call with no key for any row, with attention's checks of the
    other arguments (as if one token were there) and its autocast."""
    q, k, v = call.q, call.k, call.v
    check_backend(call.kwargs["backend"], REGISTRY)
    probe = [t.new_empty(1, t.shape[1], 1, t.shape[3]) for t in (q, k, v)]
    kwargs = {n: a for n, a in call.kwargs.items() if n not in ("mask", "backend")}
    _functional.explain(*probe, **kwargs)  # the same errors for scale, dropout_p, sinks, return_lse
    q, k, v, _ = _functional._autocast(q, k, v, None)
    hq, tq, dv = q.shape[1], q.shape[2], v.shape[3]
    sinks = kwargs["sinks"]
    out = _NoKeys.apply((tq, hq, dv), q, k, v, sinks)
    lse = q.new_full((hq, tq), float("-inf"), dtype=torch.float32)
    if sinks is not None:  # logaddexp(-inf, sink): the sink alone
        lse = sinks.detach().float()[:, None].expand(hq, tq).clone()
    return out, lse


@overload
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = ..., *,
                     max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., causal: Causal = ...,
                     window: Window = ..., scale: float | None = ..., dropout_p: float = ...,
                     softcap: float | None = ..., sinks: Tensor | None = ..., return_lse: Literal[False] = ...,
                     backend: str = ..., deterministic: bool | None = ...) -> Tensor: ...
@overload
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = ..., *,
                     max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., causal: Causal = ...,
                     window: Window = ..., scale: float | None = ..., dropout_p: float = ...,
                     softcap: float | None = ..., sinks: Tensor | None = ..., return_lse: Literal[True],
                     backend: str = ..., deterministic: bool | None = ...) -> tuple[Tensor, Tensor]: ...
@overload
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = ..., *,
                     max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., causal: Causal = ...,
                     window: Window = ..., scale: float | None = ..., dropout_p: float = ...,
                     softcap: float | None = ..., sinks: Tensor | None = ..., return_lse: bool,
                     backend: str = ..., deterministic: bool | None = ...) -> Tensor | tuple[Tensor, Tensor]: ...
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None, *,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: Causal = False,
                     window: Window = None, scale: float | None = None, dropout_p: float = 0.0,
                     softcap: float | None = None, sinks: Tensor | None = None, return_lse: bool = False,
                     backend: str = "auto", deterministic: bool | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over N packed sequences of different lengths, each attending only to itself
    (flash-attn's ``flash_attn_varlen_func``).

    Sequence s holds query tokens ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of q and key tokens
    ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` of k and v. When a sequence has nq queries and nk keys,
    its causal mask and window are aligned to its own bottom-right corner: query r of the sequence
    sits on key ``r + nk - nq``, as in flash-attn. Drawn for one sequence with nq = 2, nk = 4::

        causal=True         window=(1, 0)       window=(0, 1)
        1 1 1 0             0 1 1 0             0 0 1 1
        1 1 1 1             0 0 1 1             0 0 0 1

    Args:
        q: (Tq, Hq, D). k: (Tk, Hkv, D). v: (Tk, Hkv, Dv). Hq must be a multiple of Hkv (GQA / MQA;
            K/V are not copied). Any strides (views into a fused QKV buffer too).
        cu_seqlens_q: int32 or int64 (N + 1,): 0, then the running total of the sequences' query
            lengths, ending at Tq. Empty sequences repeat the previous total (they give no rows).
        cu_seqlens_k: the same for the keys, ending at Tk, with as many sequences; None: cu_seqlens_q
            (self-attention).
        max_seqlen_q, max_seqlen_k: the longest sequence, as flash-attn takes it; only checked here
            (a sequence longer than it raises), never needed. None: not checked.
        causal: True (or "bottom_right"): each query sees the keys of its sequence up to its diagonal.
        window: flash-attn's ``window_size``, (left, right): a query sees at most ``left`` keys before
            its diagonal key and ``right`` after it; -1 is unbounded on that side. With ``causal``
            the right bound is the diagonal.
        scale: multiplier of the scores; default 1 / sqrt(D).
        dropout_p: dropout on the attention weights (applied whenever > 0).
        softcap: ``cap * tanh(score / cap)`` on the scaled scores (selfattn.scores.softcap); None or 0: off.
        sinks: attention sinks, a float tensor (Hq,), as in :func:`selfattn.attention`; differentiable.
        return_lse: also return the logsumexp of each row's scores, (Hq, Tq) float32 (flash-attn's varlen
            layout: selfattn.attention's (B, Hq, Lq) for the batch of one), -inf on rows that see no key
            (with sinks, it includes the sink term). It carries no gradient.
        backend: "auto", "reference", "sdpa", "chunked" or "flex", as in :func:`selfattn.attention`;
            :func:`varlen_explain` says which one auto runs and why not the others.
        deterministic: the same bits on every run, as in :func:`selfattn.attention`; None (default)
            follows ``torch.are_deterministic_algorithms_enabled()``.

    Returns:
        out (Tq, Hq, Dv) in q's dtype (contiguous), or (out, lse). A query row that sees no key (an
        empty key sequence, or rows above a short key sequence's diagonal) gives 0, gradient 0, lse -inf.

    Example:
        >>> cu = torch.tensor([0, 100, 250, 256], dtype=torch.int32)      # three sequences
        >>> q = k = v = torch.randn(256, 8, 64)                            # (T, H, D)
        >>> out = selfattn.varlen_attention(q, k, v, cu, causal=True)      # (256, 8, 64)
    """
    call = _build(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale,
                  dropout_p, softcap, sinks, return_lse, backend, deterministic)
    lse: Tensor | None
    if call.empty:
        out, lse = _empty(call)
    else:
        result = _functional.attention(call.q, call.k, call.v, **call.kwargs)
        out4, lse4 = result if call.kwargs["return_lse"] else (result, None)
        out, lse = out4[0].transpose(0, 1).contiguous(), None if lse4 is None else lse4[0]
    return (out, lse) if return_lse else out  # type: ignore[return-value]  # lse is a tensor with return_lse


def varlen_explain(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None, *,
                   max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: Causal = False,
                   window: Window = None, scale: float | None = None, dropout_p: float = 0.0,
                   softcap: float | None = None, sinks: Tensor | None = None, return_lse: bool = False,
                   backend: str = "auto", deterministic: bool | None = None) -> _functional.Explanation:
    """Which backend ``varlen_attention(q, k, v, cu_seqlens_q, ..., **same_kwargs)`` runs, and why not the
    others (:func:`selfattn.explain` of the batch-of-one call with its packed mask). A call with
    Tq = 0 or Tk = 0 runs no backend: its backend is "none".

    Example:
        >>> print(selfattn.varlen_explain(q, k, v, cu, causal=True))
        auto picks: sdpa (SDPA runs this call in a fused kernel without a dense mask)
    """
    call = _build(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window, scale,
                  dropout_p, softcap, sinks, return_lse, backend, deterministic)
    if call.empty:
        _empty(call)  # its checks
        return _functional.Explanation("none", why="no query row sees a key (Tq = 0 or Tk = 0): the output is zeros")
    return _functional.explain(call.q, call.k, call.v, **call.kwargs)

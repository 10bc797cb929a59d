"""selfattn as an attention implementation of Hugging Face ``transformers`` models.

>>> from selfattn.integrations import transformers as sa_hf
>>> sa_hf.register()                                  # once per process
>>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="selfattn")

:func:`register` adds two functions under one name:

- a **mask function** (``AttentionMaskInterface``): transformers describes the mask it wants as
  a predicate ``mask_function(batch, head, q_idx, kv_idx)`` plus a 2-D padding ``attention_mask``,
  packed sequences (from ``position_ids``) and the offsets of the queries and keys in a cache. It
  is turned into a :mod:`selfattn.masks` object, never an (Lq, Lk) tensor: the predicates
  transformers builds (causal, sliding window, bidirectional, padding, packed sequences) become
  the named masks, so backends skip empty tiles; any other predicate becomes
  :func:`selfattn.masks.from_mask_mod`, exact but with its tile map computed by evaluation.
- an **attention function** (``AttentionInterface``): ``selfattn.attention`` with the module's
  ``scaling``, ``dropout``, soft-capping, attention sinks (``s_aux``), GQA without repeating K/V;
  ``output_attentions=True`` returns the weights through the reference backend.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import masks as _masks
from .. import scores as _scores
from ..functional import attention, attention_with_weights

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("selfattn.integrations.transformers needs the transformers package: "
                      "pip install 'selfattn[transformers]'") from e

__all__ = ["MaskTensor", "attention_forward", "mask_from_predicate", "mask_function", "register", "selfattn_mask"]

_HF = "transformers.masking_utils"
MaskFunction = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class MaskTensor(Tensor):
    """A selfattn mask carried through transformers' code as a (B, 1, Lq, Lk) bool tensor with no data.

    transformers passes prepared masks around as 4-D tensors (``generate`` with a static cache
    builds them ahead and feeds them back to ``forward``, which passes a 4-D tensor through
    untouched). This wrapper has that shape but holds no (Lq, Lk) values: ``.mask`` is the
    selfattn mask, which the attention function unwraps. Any operation on its values raises.
    """

    mask: _masks.Mask

    @staticmethod
    def __new__(cls, mask: _masks.Mask, shape: tuple[int, int, int, int], device: torch.device) -> MaskTensor:
        t = Tensor._make_wrapper_subclass(cls, shape, dtype=torch.bool, device=device)
        t.mask = mask
        return t

    _PASS = ("detach", "alias", "clone", "contiguous", "_to_copy")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name, kwargs = func.overloadpacket.__name__, kwargs or {}
        same_dtype = kwargs.get("dtype") in (None, torch.bool)  # .to(device) or .bool(), not a cast
        if name in cls._PASS and isinstance(args[0], MaskTensor) and same_dtype:
            return args[0]
        raise TypeError(f"{func} was applied to a selfattn mask standing in for a 4-D attention mask "
                        f"({args[0].mask!r}); it has no values: pass it to selfattn's attention function, or "
                        "build a dense mask with .mask.dense(lq, lk)")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"MaskTensor({self.mask!r}, shape={tuple(self.shape)})"


def register(name: str = "selfattn") -> str:
    """Register selfattn with transformers under ``name``; returns ``name``.

    Afterwards ``attn_implementation=name`` works in ``from_config``, ``from_pretrained`` and
    ``model.set_attn_implementation``. Registering again is harmless.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_function)
    return name


# --- the mask ---------------------------------------------------------------------------------

def mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: int | Tensor = 0,
                  kv_offset: int = 0, mask_function: MaskFunction | None = None,
                  attention_mask: Tensor | None = None, device: torch.device | str = "cpu",
                  **_: Any) -> MaskTensor | None:
    """transformers' mask interface: the mask of one call as a :class:`selfattn.masks.Mask`,
    carried in a :class:`MaskTensor` (its ``.mask``).

    Args:
        batch_size, q_length, kv_length: the sizes of the attention call.
        q_offset, kv_offset: positions of the first query and the first key (a cache's past).
        mask_function: the predicate ``(batch_idx, head_idx, q_idx, kv_idx) -> bool`` on those
            positions; None means causal.
        attention_mask: the 2-D padding mask (B, past + Lq), True/1 = a real token.

    Returns:
        The mask in a :class:`MaskTensor` of shape (B, 1, Lq, Lk), or None when every key is visible.
    """
    mask = selfattn_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
    if mask is None:
        return None
    where = attention_mask.device if attention_mask is not None else torch.device(device)
    return MaskTensor(mask, (batch_size, 1, q_length, kv_length), where)


def selfattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | Tensor = 0, kv_offset: int = 0,
                  mask_function: MaskFunction | None = None,
                  attention_mask: Tensor | None = None) -> _masks.Mask | None:
    """The selfattn mask equal to transformers' mask of one call (arguments as in :func:`mask_function`),
    or None when every key is visible."""
    q_off = int(q_offset) if isinstance(q_offset, Tensor) else q_offset
    fn = mask_function if mask_function is not None else _hf_causal
    padding = prepare_padding_mask(attention_mask.bool() if attention_mask is not None else None,
                                   kv_length, kv_offset)
    try:
        mask = _recognise(fn, q_off - kv_offset == kv_length - q_length, batch_size, q_length, kv_length)
    except _Unrecognised:
        mask = None
        rule = fn
    else:
        rule = None
    if mask is _ALL:
        mask = None
    keys = None if padding is None else padding[:, kv_offset:kv_offset + kv_length]  # (B, Lk) True = real
    if keys is not None and (torch.compiler.is_compiling() or not bool(keys.all())):
        pad_mask = _masks.FromTensor(keys[:, None, None, :])
        if rule is None:
            mask = pad_mask if mask is None else mask & pad_mask
        else:
            rule = _and_padding(rule, padding)
    if rule is not None:
        mask = mask_from_predicate(rule, batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                   q_offset=q_off, kv_offset=kv_offset)
    return mask


def mask_from_predicate(fn: MaskFunction, *, batch_size: int, q_length: int, kv_length: int,
                        q_offset: int = 0, kv_offset: int = 0) -> _masks.Mask:
    """Any transformers mask predicate as a selfattn mask (tile map by evaluation, no L x L tensor).

    The predicate sees positions: query row r is ``q_offset + r``, key column c ``kv_offset + c``.
    Predicates that only broadcast under ``torch.vmap`` (transformers' ``use_vmap``) are evaluated
    that way.
    """
    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return _evaluate(fn, b, h, q + q_offset, kv + kv_offset)
    return _masks.from_mask_mod(mask_mod, batch=batch_size)


def _evaluate(fn: MaskFunction, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """``fn`` on broadcastable index tensors; a predicate written for scalar indices (it fails,
    or returns another shape, under broadcasting) is evaluated under ``torch.vmap`` instead, as
    transformers does for it."""
    shape = torch.broadcast_shapes(b.shape, h.shape, q.shape, kv.shape)
    try:
        out = torch.as_tensor(fn(b, h, q, kv), device=q.device)
        if out.dim() <= 4 and torch.broadcast_shapes(out.shape, shape) == shape:
            return out.bool().expand(shape)
    except (IndexError, RuntimeError, TypeError, ValueError):
        pass
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from transformers.masking_utils import _vmap_expansion_sdpa
    with TransformGetItemToIndex():
        out = _vmap_expansion_sdpa(fn)(b.flatten(), h.flatten(), q.flatten(), kv.flatten())
    return out.bool().reshape(shape)


def _and_padding(fn: MaskFunction, padding: Tensor) -> MaskFunction:
    return lambda b, h, q, kv: fn(b, h, q, kv) & padding[b, kv]


def _hf_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return kv <= q


class _Unrecognised(Exception):
    """A predicate with no named selfattn mask: evaluate it instead."""


_ALL: Any = object()  # a recognised part that hides nothing ("every key visible"); never returned
_BIG = 1 << 40  # an unbounded side of a window


def _closure(fn: Callable) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells, strict=False)}


def _recognise(fn: Callable, aligned: bool, batch: int, lq: int, lk: int) -> _masks.Mask:
    """The named mask equal to transformers' predicate ``fn``, or raise :class:`_Unrecognised`.

    ``aligned``: the queries are the last Lq key positions (q_offset - kv_offset == Lk - Lq), as
    selfattn lines them up; relative rules (causal, windows) are named only then.
    """
    if getattr(fn, "__module__", None) != _HF:
        raise _Unrecognised
    name, env = fn.__qualname__, _closure(fn)
    if name == "causal_mask_function" and aligned:
        return _masks.causal("bottom_right")
    if name == "bidirectional_mask_function":
        return _ALL
    if name == "sliding_window_overlay.<locals>.inner_mask" and aligned:
        return _masks.sliding_window(int(env["sliding_window"]) - 1, _BIG)  # kv > q - w, no upper bound
    if name == "sliding_window_bidirectional_overlay.<locals>.inner_mask" and aligned:
        w = int(env["sliding_window"])
        return _masks.sliding_window(w, w)
    if name == "packed_sequence_mask_function.<locals>.inner_mask" and lq == lk and aligned:
        ids = env["packed_sequence_mask"]
        if isinstance(ids, Tensor) and ids.dim() == 2 and ids.shape[1] == lk:
            return _masks.document(ids)
    if name in ("and_masks.<locals>.and_mask", "or_masks.<locals>.or_mask"):
        return _combine(list(env["mask_functions"]), name.startswith("and"), aligned, batch, lq, lk)
    raise _Unrecognised


def _combine(fns: list[Callable], conjunction: bool, aligned: bool, batch: int, lq: int, lk: int) -> _masks.Mask:
    """``and_masks`` / ``or_masks`` of recognised parts. Under a packed-sequence mask (same
    document), ``remap_positions_for_packed_sequence`` only shifts both positions by the same
    amount, which a relative rule (causal, window) does not see: it is dropped there."""
    packed = [_closure(f)["packed_sequence_mask"] for f in fns if conjunction and getattr(f, "__qualname__", "")
              == "packed_sequence_mask_function.<locals>.inner_mask"]
    parts: list[_masks.Mask] = []
    for f in fns:
        if packed and getattr(f, "__qualname__", "") == "remap_positions_for_packed_sequence.<locals>.inner_mask":
            env = _closure(f)
            part = _recognise(env["mask_function"], aligned, batch, lq, lk)
            if not (_relative(part) and _shifts_within_documents(env["position_ids"], packed[0], lk)):
                raise _Unrecognised
        else:
            part = _recognise(f, aligned, batch, lq, lk)
        parts.append(part)
    if conjunction:
        parts = [p for p in parts if p is not _ALL]
        if not parts:
            return _ALL
        parts = _fold_window(parts)
    elif any(p is _ALL for p in parts):
        return _ALL
    out = parts[0]
    for p in parts[1:]:
        out = out & p if conjunction else out | p
    return out


def _shifts_within_documents(position_ids: object, ids: object, lk: int) -> bool:
    """True when, inside every document, positions are the indices plus a constant (what
    transformers' packed-sequence detection guarantees), so a relative rule reads the same on both."""
    if not (isinstance(position_ids, Tensor) and isinstance(ids, Tensor) and position_ids.dim() == ids.dim() == 2
            and position_ids.shape[-1] == ids.shape[-1] == lk):
        return False
    if torch.compiler.is_compiling():
        return True  # cannot read data while tracing; transformers builds both from position_ids
    pos, ids = torch.broadcast_tensors(position_ids, ids.to(position_ids.device))
    shift = pos - torch.arange(lk, device=pos.device)
    same_doc = ids[:, 1:] == ids[:, :-1]
    return bool(((shift[:, 1:] == shift[:, :-1]) | ~same_doc).all())


def _relative(m: _masks.Mask) -> bool:
    """Does the rule depend only on the distance between positions (so a common shift keeps it)?"""
    return m is _ALL or m.shift_invariant()


def _fold_window(parts: list[_masks.Mask]) -> list[_masks.Mask]:
    """causal & sliding_window(w - 1, unbounded) -> sliding_window(w - 1): one mask whose bands
    the chunked backend runs as such."""
    causal = [p for p in parts if isinstance(p, _masks.Causal) and p.align == "bottom_right"]
    windows = [p for p in parts if isinstance(p, _masks.SlidingWindow) and p.right == _BIG]
    if not causal or not windows:
        return parts
    left = min(w.left for w in windows)
    rest = [p for p in parts if p is not causal[0] and not any(p is w for w in windows)]
    return [_masks.sliding_window(left, 0), *rest]


# --- the attention ----------------------------------------------------------------------------

def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: _masks.Mask | Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: Tensor | None = None, position_bias: Tensor | None = None,
                      output_attentions: bool = False, **_: Any) -> tuple[Tensor, Tensor | None]:
    """transformers' attention interface: ``selfattn.attention`` for one attention module.

    Args:
        module: the calling attention module (its ``is_causal`` is the default causality).
        query: (B, Hq, Lq, D); key, value: (B, Hkv, Lk, D), Hkv dividing Hq (not repeated).
        attention_mask: what the mask function returned (a :class:`MaskTensor` or None), a
            selfattn mask, or a tensor a caller prepared itself: bool (True = attend) or additive float.
        dropout: dropout on the attention weights.
        scaling: the score scale (default 1 / sqrt(D)).
        is_causal: causality when there is no mask (default ``module.is_causal``, else True).
        sliding_window: keys a query sees (itself included) when there is no mask; with a mask
            the window is already in it.
        softcap: ``softcap * tanh(score / softcap)`` on the scaled scores (Gemma 2).
        s_aux: attention sinks, one logit per query head (gpt-oss).
        position_bias: an additive score bias (T5-style).
        output_attentions: also return the weights (B, Hq, Lq, Lk), via the reference backend.

    Returns:
        (out (B, Lq, Hq, D) contiguous, weights or None).
    """
    lq, lk = query.shape[2], key.shape[2]
    mask: _masks.Mask | Tensor | None = None
    bias = position_bias
    causal: bool | str = False
    if isinstance(attention_mask, MaskTensor):
        mask = attention_mask.mask
    elif isinstance(attention_mask, _masks.Mask):
        mask = attention_mask
    elif isinstance(attention_mask, Tensor):
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask if bias is None else bias + attention_mask
    elif attention_mask is None:
        causal_default = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if causal_default and lq > 1:
            causal = True if lq == lk else "bottom_right"
        if sliding_window is not None:
            mask = _masks.sliding_window(int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    else:
        raise TypeError("attention_mask must be a selfattn mask, a tensor or None, "
                        f"got {type(attention_mask).__name__}")
    score_mod = _scores.softcap(float(softcap)) if softcap is not None else None
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
    kwargs = dict(mask=mask, bias=bias, causal=causal, scale=scale, dropout_p=float(dropout),
                  score_mod=score_mod, sinks=s_aux)
    if output_attentions:
        out, weights = attention_with_weights(query, key, value, **kwargs)  # type: ignore[arg-type]
    else:
        out, weights = attention(query, key, value, **kwargs), None  # type: ignore[arg-type]
    return out.transpose(1, 2).contiguous(), weights


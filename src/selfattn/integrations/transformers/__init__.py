"""selfattn as an attention implementation of Hugging Face ``transformers`` models.

>>> from selfattn.integrations import transformers as sa_hf
>>> sa_hf.register()                                  # once per process
>>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="selfattn")

:func:`register` adds two functions under one name, and a check:

- a **mask function** (``AttentionMaskInterface``): transformers describes the mask it wants as
  a predicate ``mask_function(batch, head, q_idx, kv_idx)`` plus a 2-D padding ``attention_mask``,
  packed sequences (from ``position_ids``) and the offsets of the queries and keys in a cache. It
  is turned into a :mod:`selfattn.masks` object, never an (Lq, Lk) tensor, from what the
  predicate computes: it is run once on symbolic positions (:mod:`._symbolic`) and its parts
  become the named masks (:mod:`._lower`: causal, sliding windows, bands, documents, key masks),
  so backends skip empty tiles, whatever transformers' functions are called; a part with no
  named mask is evaluated (:func:`selfattn.masks.from_mask_mod`), still exact. Offsets that a
  static cache gives as tensors stay tensors, so every decoding step has the same mask structure
  and a compiled forward is reused. The mask travels in a :class:`MaskTensor`.
- an **attention function** (``AttentionInterface``): ``selfattn.attention`` with the module's
  ``scaling``, ``dropout``, soft-capping, attention sinks (``s_aux``), GQA without repeating K/V;
  ``output_attentions=True`` returns the weights through the reference backend.
- a **check** when a model is built or switched to the name: a model class whose attention does
  not go through transformers' attention interface is refused with a ``ValueError``
  (:func:`unsupported_reason`).

:func:`context_parallel` trains such a model on sequences split across the ranks of a process group
(:mod:`._context`).

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ... import masks as _masks

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("selfattn.integrations.transformers needs the transformers package: "
                      "pip install 'selfattn[transformers]'") from e

from . import _families, _lower, _symbolic, _upstream
from ._attention import attention_forward
from ._carrier import MaskTensor
from ._context import ContextParallel, context_parallel

__all__ = ["ContextParallel", "MaskTensor", "attention_forward", "context_parallel", "mask_from_predicate",
           "mask_function", "register", "selfattn_mask", "unsupported_reason"]

MaskFunction = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def register(name: str = "selfattn") -> str:
    """Register selfattn with transformers under ``name``; returns ``name``.

    Afterwards ``attn_implementation=name`` works in ``from_config``, ``from_pretrained`` and
    ``model.set_attn_implementation`` for every model class whose attention goes through
    transformers' attention interface; the others raise ``ValueError`` there
    (:func:`unsupported_reason` says why). Registering again is harmless.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_function)
    _upstream.guard_model_checks(name, _families.check_model_class)
    _upstream.allow_continuous_batching(name)
    return name


def unsupported_reason(model_class: type) -> str | None:
    """Why the transformers model class ``model_class`` cannot run selfattn, or None when it can.

    Example:
        >>> sa_hf.unsupported_reason(transformers.BloomForCausalLM)
        "its attention modules compute attention themselves instead of calling transformers' ..."
    """
    return _families.unsupported_reason(model_class)


# --- the mask ---------------------------------------------------------------------------------

def mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: int | Tensor = 0,
                  kv_offset: int = 0, mask_function: MaskFunction | None = None,
                  attention_mask: Tensor | None = None, device: torch.device | str = "cpu",
                  **_: Any) -> MaskTensor | None:
    """transformers' mask interface: the mask of one call as a :class:`selfattn.masks.Mask`,
    carried in a :class:`MaskTensor` (its ``.mask``).

    Args:
        batch_size, q_length, kv_length: the sizes of the attention call.
        q_offset, kv_offset: positions of the first query and the first key (a cache's past); a
            tensor offset (a static cache's) is kept a tensor.
        mask_function: the predicate ``(batch_idx, head_idx, q_idx, kv_idx) -> bool`` on those
            positions; None means causal.
        attention_mask: the 2-D padding mask (B, past + Lq), True/1 = a real token.

    Returns:
        The mask in a :class:`MaskTensor` of shape (B, 1, Lq, Lk), or None when every key is visible.
    """
    where = attention_mask.device if attention_mask is not None else torch.device(device)
    mask = selfattn_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                         device=where)
    if mask is None:
        return None
    return MaskTensor(mask, (batch_size, 1, q_length, kv_length), where)


def _hf_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return kv <= q


def selfattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | Tensor = 0, kv_offset: int = 0,
                  mask_function: MaskFunction | None = None, attention_mask: Tensor | None = None, *,
                  device: torch.device | str | None = None) -> _masks.Mask | None:
    """The selfattn mask equal to transformers' mask of one call (arguments as in :func:`mask_function`),
    or None when every key is visible.

    The structure of the result (its mask types and Python numbers) depends only on the sizes,
    the Python-int offsets and the predicate, never on tensor values, so a compiled graph that
    takes it is reused for every call of the same structure.
    """
    fn = mask_function if mask_function is not None else _hf_causal
    if isinstance(q_offset, Tensor):  # a static cache's length, which its updates change in place: read it now
        q_offset = q_offset.clone()
    dev = torch.device(device) if device is not None else (
        attention_mask.device if attention_mask is not None else torch.device("cpu"))
    eager = not torch.compiler.is_compiling()
    geometry = _lower.Geometry(batch_size, q_length, kv_length, q_offset, kv_offset, dev, eager)
    try:
        mask = _lower.lower(_symbolic.trace(fn), geometry)
    except _symbolic.Untraceable:
        mask = mask_from_predicate(fn, batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                   q_offset=q_offset, kv_offset=kv_offset)
    if mask is _lower.ALL:
        mask = None
    padding = prepare_padding_mask(attention_mask.bool() if attention_mask is not None else None,
                                   kv_length, kv_offset)
    if padding is not None:
        keys = padding[:, kv_offset:kv_offset + kv_length]  # (B, Lk) True = real
        # a static cache's mask (tensor offset) keeps its padding part whatever it holds: same structure each step
        if not eager or isinstance(q_offset, Tensor) or not bool(keys.all()):
            pad = _masks.from_tensor(keys[:, None, None, :])
            mask = pad if mask is None else mask & pad
    return mask


def mask_from_predicate(fn: MaskFunction, *, batch_size: int, q_length: int, kv_length: int,
                        q_offset: int | Tensor = 0, kv_offset: int = 0) -> _masks.Mask:
    """Any transformers mask predicate as a selfattn mask evaluated as it is (tile map by
    evaluation, no L x L tensor).

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
    vmapped = fn
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        vmapped = torch.vmap(vmapped, in_dims=dims, out_dims=0)
    with _upstream.getitem_as_index():
        out = vmapped(b.flatten(), h.flatten(), q.flatten(), kv.flatten())
    return out.bool().reshape(shape)

"""transformers' attention interface: ``selfattn.attention`` for one attention module.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D head dim.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

import torch
from torch import Tensor

from ... import functional as _functional
from ... import masks as _masks
from ... import scores as _scores
from ... import varlen as _varlen
from ..._kept import MISSING, KeptByTensors
from ._carrier import MaskTensor

__all__ = ["attention_forward"]

# The attribute context_parallel sets on every module of the model it runs (its ContextParallel): read
# by getattr, which torch.compile traces, where a global context variable would break the graph.
CONTEXT_ATTR = "_selfattn_context_parallel"

DENSE_LIMIT = 1 << 16
"""Mask elements (B * Lq * Lk) up to which a carried mask is made dense once and the tensor shared
by every layer of the forward (a decode step's (B, 1, 1, Lk)): below this no tile is worth
skipping and the sdpa backend would build the same tensor in each layer."""


def _shared_dense(carrier: MaskTensor, lq: int, lk: int, device: torch.device) -> _masks.Mask | Tensor | None:
    """The carried mask, or, when it is small, its dense form made once per carrier (every layer of
    a forward gets the same carrier) and kept while the tensors it reads are unchanged; None when
    that dense form hides nothing (a decode step without padding), so the call is a plain one."""
    mask = carrier.mask
    if torch.compiler.is_compiling() or carrier.shape[0] * lq * lk > DENSE_LIMIT:
        return mask
    version = mask.version()
    if version is None:
        return mask
    key = (lq, lk, device, version)
    cached = getattr(carrier, "_dense", None)
    if cached is None or cached[0] != key:
        dense = mask.dense(lq, lk, device)
        cached = (key, None if bool(dense.all()) else dense)
        carrier._dense = cached  # type: ignore[attr-defined]
    return cached[1]


class _Options(TypedDict):
    """The keyword arguments :func:`attention_forward` gives the attention function."""

    mask: _masks.Mask | Tensor | None
    bias: Tensor | None
    causal: _functional.Causal
    scale: float
    dropout_p: float
    score_mod: _scores.ScoreMod | None
    sinks: Tensor | None


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: _masks.Mask | Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: Tensor | None = None, position_bias: Tensor | None = None,
                      output_attentions: bool = False, cu_seq_lens_q: Tensor | None = None,
                      cu_seq_lens_k: Tensor | None = None, **_: Any) -> tuple[Tensor, Tensor | None]:
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
        cu_seq_lens_q, cu_seq_lens_k: with no mask and a batch of one, the row packs sequences
            (continuous batching, flash-style packed training): the call is
            :func:`selfattn.varlen_attention` on them (see :func:`_packed_forward`).

    Returns:
        (out (B, Lq, Hq, D) contiguous, weights or None).
    """
    cp = getattr(module, CONTEXT_ATTR, None)
    if cp is not None:  # inside context_parallel: this rank's shards, the global mask
        if output_attentions or position_bias is not None:
            raise ValueError("under context_parallel, attention weights (output_attentions) and position biases "
                             "are not available: the scores of a row are spread over the ranks")
        return cp.attend(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                         s_aux), None
    if attention_mask is None and cu_seq_lens_q is not None and cu_seq_lens_k is not None:
        if output_attentions or position_bias is not None:
            raise ValueError("packed sequences (cu_seq_lens_q / cu_seq_lens_k) run through varlen_attention, "
                             "which returns no attention weights (output_attentions) and takes no position bias")
        causal_default = getattr(module, "is_causal", True) if is_causal is None else is_causal
        return _packed_forward(query, key, value, cu_seq_lens_q, cu_seq_lens_k, bool(causal_default),
                               sliding_window, dropout, scaling, softcap, s_aux), None
    lq, lk = query.shape[2], key.shape[2]
    mask: _masks.Mask | Tensor | None = None
    bias = position_bias
    causal: _functional.Causal = False
    if isinstance(attention_mask, MaskTensor):
        mask = _shared_dense(attention_mask, lq, lk, query.device)
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
    kwargs: _Options = dict(mask=mask, bias=bias, causal=causal, scale=scale, dropout_p=float(dropout),
                            score_mod=score_mod, sinks=s_aux)
    if output_attentions:
        out, weights = _functional.attention_with_weights(query, key, value, **kwargs)
    else:
        out, weights = _functional.attention(query, key, value, **kwargs), None
    return out.transpose(1, 2).contiguous(), weights



_PADDED = KeptByTensors()  # a step's cu_seq_lens with the padding's entry, for each layer of the step


def _packed_forward(query: Tensor, key: Tensor, value: Tensor, cu_q: Tensor, cu_k: Tensor, causal: bool,
                    sliding_window: int | None, dropout: float, scaling: float | None, softcap: float | None,
                    sinks: Tensor | None) -> Tensor:
    """One row of packed sequences, as transformers' flash integration runs it: sequence s is query tokens
    ``cu_q[s]:cu_q[s + 1]`` and key tokens ``cu_k[s]:cu_k[s + 1]``, causal (and the window) aligned to
    its own bottom-right corner. Tokens past the last entry are padding (continuous batching pads a step
    to a fixed size): they form one more sequence, whose rows are dropped by the caller.

    query (1, Hq, Tq, D), key/value (1, Hkv, Tk, D) -> (1, Tq, Hq, D) contiguous.
    """
    if query.shape[0] != 1:
        raise ValueError(f"cu_seq_lens_q / cu_seq_lens_k pack sequences into one row, but the batch is "
                         f"{query.shape[0]}: pass a batch of one, or an attention mask instead")
    if not (isinstance(cu_q, Tensor) and isinstance(cu_k, Tensor)):
        raise TypeError(f"cu_seq_lens_q and cu_seq_lens_k must be tensors here, got {type(cu_q).__name__} and "
                        f"{type(cu_k).__name__} (continuous batching's cache selects the layer type's lengths)")
    tq, tk = query.shape[2], key.shape[2]
    given = (cu_q, cu_k)
    padded = _PADDED.find(given, (tq, tk))
    if padded is MISSING:  # made once per step: every layer gets the same tensors
        padded = _PADDED.keep(given, (tq, tk), (torch.cat([cu_q.reshape(-1), cu_q.new_full((1,), tq)]),
                                                torch.cat([cu_k.reshape(-1).to(cu_q.dtype), cu_q.new_full((1,), tk)])))
    cu_q, cu_k = padded
    window = None
    if sliding_window is not None:
        window = (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)
    out = _varlen.varlen_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                   cu_q, cu_k, causal=causal, window=window, scale=scaling, dropout_p=float(dropout),
                                   softcap=softcap, sinks=sinks)
    return out.unsqueeze(0).contiguous()

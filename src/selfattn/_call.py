"""The validated description of one attention call, handed from functional to dispatch and a backend.

Shape legend: B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv, Lq/Lk lengths,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .masks import Mask
from .scores import ScoreMod


def _dim(tensor: str, index: int, doc: str) -> property:
    """A read-only size of one of the call's tensors."""
    return property(lambda self: getattr(self, tensor).shape[index], doc=doc)


@dataclass(frozen=True)
class AttentionCall:
    """Everything a backend needs; built only by ``functional`` after validation."""

    q: Tensor  # (B, Hq, Lq, D)
    k: Tensor  # (B, Hkv, Lk, D)
    v: Tensor  # (B, Hkv, Lk, Dv)
    mask: Mask | None  # causal folded in; None = every key visible
    bias: Tensor | None  # float, 4-D, broadcastable to (B, Hq, Lq, Lk)
    scale: float
    dropout_p: float
    return_lse: bool
    need_weights: bool = False
    score_mod: ScoreMod | None = None  # applied to the scaled (+ bias) scores, before the mask

    batch = _dim("q", 0, "B")
    hq = _dim("q", 1, "Hq, the query heads")
    hkv = _dim("k", 1, "Hkv, the key/value heads")
    lq = _dim("q", 2, "Lq, the query length")
    lk = _dim("k", 2, "Lk, the key length")
    head_dim = _dim("q", 3, "D, the head dim of q and k")
    v_head_dim = _dim("v", 3, "Dv, the head dim of v (and of the output)")

    @property
    def groups(self) -> int:
        """G = Hq // Hkv query heads per key/value head."""
        return self.hq // self.hkv

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (self.q, self.k, self.v, self.bias))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax accumulates in at least float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32

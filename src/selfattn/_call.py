"""The validated description of one attention call, handed from functional to dispatch and a backend.

Shape legend: B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv, Lq/Lk lengths,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .masks import Mask
from .scores import ScoreMod

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""The dtypes an attention call takes."""


@dataclass(slots=True)
class AttentionCall:
    """Everything a backend needs; built only by ``functional`` after validation. Read-only by
    convention: nothing changes a call after it is built. (Not a frozen dataclass: building one
    costs a quarter as much without, and a decode step builds one per layer.)"""

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
    sinks: Tensor | None = None  # (Hq,) float: one logit per head in every row's softmax, with no value
    deterministic: bool = False  # the same bits on every run: backends that cannot promise it decline

    # sizes, set once from the tensors: B, Hq, Hkv, Lq, Lk, D (q and k), Dv (v and the output)
    batch: int = field(init=False)
    hq: int = field(init=False)
    hkv: int = field(init=False)
    lq: int = field(init=False)
    lk: int = field(init=False)
    head_dim: int = field(init=False)
    v_head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        self.batch, self.hq, self.lq, self.head_dim = self.q.shape
        _, self.hkv, self.lk, self.v_head_dim = self.v.shape  # v has k's heads and length (validated)

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
            t is not None and t.requires_grad for t in (self.q, self.k, self.v, self.bias, self.sinks))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax accumulates in at least float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def specialized(x: float) -> float:
    """``x``; under torch.compile a float that dynamo made dynamic (it changed between calls) becomes
    a constant again, guarded on its value: a set's element is specialized, and ops take plain floats."""
    return next(iter({x}))

"""One distributed call, validated: :class:`Spec`, what every rank computes with and must agree on.

The arguments that ``selfattn.attention`` also takes are checked by its own checkers
(``selfattn._checks``), so the same bad input gets the same error from both; what only context
parallelism needs (one local length, the layout, the strategy, heads divisible by W) is checked here.

Shape legend: B batch, H query heads, Hkv key/value heads, L the global length, W the world size,
n = L / W tokens per rank, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .. import masks as _masks
from .._checks import (
    check_backend,
    check_causal,
    check_dropout,
    check_mask,
    check_qkv,
    check_return_lse,
    check_scale,
    check_score_mod,
    check_sinks,
)
from ..backends import REGISTRY
from ..masks import Mask
from ..masks.base import Cropped
from ..scores import ScoreMod, learned_tensors
from .group import Group
from .layout import Sharding, check_layout, num_chunks

__all__ = ["MEMORY", "STRATEGIES", "Memory", "Spec", "Strategy", "check_local_length", "validate"]

Strategy = Literal["ring", "all_to_all"]
STRATEGIES = ("ring", "all_to_all")
Memory = Literal["overlap", "low"]
MEMORY = ("overlap", "low")


@dataclass(frozen=True)
class Spec:
    """A validated call: the layout, the strategy and the attention's arguments (the mask as given,
    on global positions; ``causal`` apart), and the dropout seed every rank uses (rank 0's)."""

    layout: str | Sharding
    strategy: str
    mask: Mask | None
    score_mod: ScoreMod | None
    causal: bool
    scale: float
    dropout_p: float
    return_lse: bool
    backend: str
    seed: int = 0
    sinks: Tensor | None = None  # (H,) attention sinks, one logit per query head
    memory: str = "overlap"  # the ring backward's dK/dV: "overlap" (hidden hops) or "low" (two buffers fewer)

    def full_mask(self) -> Mask | None:
        """The mask with causal folded in (self-attention: both alignments are the same), on the padded
        positions of a :class:`Sharding` that pads the row (the padding sees nothing and is seen by none)."""
        mask = self.mask
        if self.causal:
            mask = _masks.causal() if mask is None else _masks.causal() & mask
        if isinstance(self.layout, Sharding) and self.layout.padded > self.layout.length:
            return Cropped(mask, self.layout.length)
        return mask


def check_local_length(layout: str | Sharding, n: int, world: int) -> None:
    """This rank's n tokens fit the layout. Called once the ranks agree (:func:`~selfattn.distributed.agree.agree`
    compares their local lengths), so that a rank whose shard is wrong makes every rank raise the same error
    instead of raising alone while the others wait for it."""
    if isinstance(layout, Sharding):
        if n != layout.per_rank:
            raise ValueError(f"the Sharding gives each rank {layout.per_rank} tokens (a row of {layout.length}, padded "
                             f"to {layout.padded}), but the ranks' q, k and v hold {n}: shard them with it")
    elif n % (num_chunks(layout, world) // world):
        raise ValueError(f"layout 'zigzag' needs L divisible by 2W = {2 * world}: each rank holds {n} tokens, "
                         "an odd number, so the global length is not; pad the sequence to a multiple of 2W, or "
                         "shard it with layout=Sharding.of('zigzag', length=L, world=W), which pads it")


def validate(q: object, k: object, v: object, g: Group, layout: object, strategy: object, mask: object,
             causal: object, scale: object, dropout_p: object, score_mod: object, return_lse: object,
             backend: object, sinks: object = None, memory: object = "overlap") -> Spec:
    """The :class:`Spec` of a call, or the error ``selfattn.attention`` gives for the same argument."""
    q, k, v = check_qkv(q, k, v)
    check_layout(layout, g.world)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be 'ring' or 'all_to_all', got {strategy!r}")
    if not isinstance(memory, str) or memory not in MEMORY:
        raise ValueError(f"memory must be 'overlap' (the ring's dK/dV travel while blocks compute) or 'low' (two "
                         f"K/V-sized buffers fewer per rank), got {memory!r}")
    b, h, n, d = q.shape
    if k.shape[2] != n:
        raise ValueError(f"context-parallel self-attention needs q (B, H, n, D), k (B, Hkv, n, D) and "
                         f"v (B, Hkv, n, Dv) with one local length n; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if strategy == "all_to_all" and (h % g.world or k.shape[1] % g.world):
        raise ValueError(f"strategy 'all_to_all' splits heads across the {g.world} ranks: q heads ({h}) and "
                         f"k/v heads ({k.shape[1]}) must be divisible by W = {g.world}; use strategy='ring'")
    length = layout.length if isinstance(layout, Sharding) else n * g.world  # the real tokens of the row
    align = check_causal(causal, length, length)
    m = check_mask(mask, q.device, b, h, length, length)
    spec = Spec(layout=layout, strategy=strategy, mask=m, causal=align is not None,  # type: ignore[arg-type]
                scale=check_scale(scale, d), dropout_p=check_dropout(dropout_p),
                return_lse=check_return_lse(return_lse), score_mod=check_score_mod(score_mod, h),
                backend=check_backend(backend, REGISTRY), sinks=check_sinks(sinks, h, q.device), memory=memory)
    if strategy == "ring" and backend != "auto":
        raise ValueError(f"backend={backend!r} applies to strategy='all_to_all', whose local attention runs "
                         "any backend; the ring computes its blocks itself: leave backend='auto'")
    if (strategy == "ring" and spec.score_mod is not None and not torch.compiler.is_compiling()
            and (learned := learned_tensors(spec.score_mod, h, q.device, torch.float32, lq=length, lk=length))):
        raise ValueError(f"score_mod {spec.score_mod!r} has {len(learned)} tensor(s) that require grad, and the ring "
                         "gives no gradient for them; use strategy='all_to_all' (its local attention does), or "
                         "detach them (under torch.no_grad() nothing is asked)")
    return spec

"""``varlen_attention()`` across ranks: a packed row of sequences in flash-attn's varlen layout, split
over the ranks of a group.

Each rank passes its tokens of the row, (n, H, D), in the layout's order (:func:`shard` with
``dim=0``), and the row's global ``cu_seqlens``, the same on every rank. The call is one
:func:`selfattn.distributed.attention` over a batch of one, (1, H, n, D) views of the same memory,
with the :func:`selfattn.masks.packed` mask on global positions: the mask that
:func:`selfattn.varlen_attention` runs in one process. So a rank's output is its tokens of
``selfattn.varlen_attention`` on the whole row, and :func:`balanced` (``cu_seqlens=``) gives every
rank the same work.

Shape legend: N sequences, L the row's tokens, W the world size, n tokens per rank (L / W, or a
:class:`Sharding`'s ``per_rank``), H query heads, Hkv key/value heads, D/Dv head dims.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .. import varlen as _varlen
from ..masks.packed import check_cu_seqlens
from .group import group_of
from .layout import Layout, Sharding, check_layout, num_chunks
from .spec import Memory, Strategy

__all__ = ["varlen_attention"]


def _row_length(length: int, n: int, world: int, layout: Layout | Sharding) -> None:
    """The row of ``length`` tokens that ``cu_seqlens`` describes is the one the ranks hold: raise naming
    the fix otherwise."""
    if isinstance(layout, Sharding):
        if layout.length != length:
            raise ValueError(f"cu_seqlens describes a row of {length} tokens but the Sharding is for {layout.length}; "
                             "build the layout from the same cu_seqlens (balanced(W, cu_seqlens=cu) or "
                             "Sharding.of(kind, length=int(cu[-1]), world=W))")
        return
    if n * world != length:
        raise ValueError(f"cu_seqlens describes a row of {length} tokens, but {world} ranks of {n} tokens hold "
                         f"{n * world}; pass every rank its shard of the whole row (shard(x, layout=..., dim=0)), or "
                         f"layout=Sharding.of({layout!r}, length={length}, world={world}) for a row the layout "
                         "does not divide")
    if n % (num_chunks(layout, world) // world):
        raise ValueError(f"layout {layout!r} needs the row's {length} tokens divisible by 2W = {2 * world}; pass "
                         f"layout=Sharding.of({layout!r}, length={length}, world={world}), which pads it")


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *,
                     group: dist.ProcessGroup | DeviceMesh | None = None, layout: Layout | Sharding = "contiguous",
                     max_seqlen: int | None = None, causal: bool | Literal["bottom_right"] = False,
                     window: tuple[int, int] | None = None, scale: float | None = None, dropout_p: float = 0.0,
                     softcap: float | None = None, sinks: Tensor | None = None, return_lse: bool = False,
                     strategy: Strategy = "ring", backend: str = "auto", timeout: float | None = None,
                     memory: Memory = "overlap") -> Tensor | tuple[Tensor, Tensor]:
    """Packed variable-length self-attention over a row split across the ranks of ``group``
    (flash-attn's ``flash_attn_varlen_func`` under context parallelism).

    Sequence s of the row holds its tokens ``cu_seqlens[s]:cu_seqlens[s + 1]``, on global positions;
    its tokens may sit on several ranks. Each query sees only keys of its own sequence, with the
    causal mask and window of :func:`selfattn.varlen_attention`. The result on each rank equals this
    rank's tokens of ``selfattn.varlen_attention`` on the gathered row (output, lse, the gradients of
    q, k, v and this rank's share of the sinks' gradient).

    Args:
        q: (n, H, D), this rank's tokens of the row in the layout's order (``shard(x, layout=..., dim=0)``).
        k: (n, Hkv, D); H % Hkv == 0 (GQA). v: (n, Hkv, Dv). Any strides (views into a fused QKV buffer).
        cu_seqlens: int32 or int64 (N + 1,), the row's sequences (global offsets, ending at L), the same on
            every rank.
        group: the process group, or a one-dimensional DeviceMesh (``mesh["cp"]``); None for the default group.
        layout: "contiguous" or "zigzag" (L divisible by W, 2W), or a :class:`Sharding` of the row's L tokens:
            ``balanced(W, cu_seqlens=cu, causal=..., window=...)`` gives every rank the same work.
        max_seqlen: the longest sequence, checked when given (as flash-attn takes it).
        causal: True (or "bottom_right"): each query sees its sequence's keys up to itself.
        window: flash-attn's ``window_size`` (left, right); -1 is unbounded on that side.
        scale: multiplier of the scores; None for 1 / sqrt(D).
        dropout_p: dropout on the attention weights (see :func:`selfattn.distributed.attention`).
        softcap: ``cap * tanh(score / cap)`` on the scaled scores; None or 0: off.
        sinks: (H,) attention sinks, the same on every rank; its gradient on each rank is that rank's share.
        return_lse: also return this rank's lse, (H, n) float32 (-inf on rows that see no key).
        strategy: "ring" or "all_to_all" (H and Hkv divisible by W).
        backend: the local backend of "all_to_all"; "auto" for "ring".
        timeout: seconds any transfer may wait for another rank (see :func:`selfattn.distributed.attention`).
        memory: "overlap" or "low", how the ring's backward moves dK/dV (see :func:`selfattn.distributed.attention`).

    Returns:
        out (n, H, Dv) in q's dtype (contiguous), or (out, lse). The padding a :class:`Sharding` adds past
        the row's end gives output 0; :func:`unshard` (``dim=0``) drops it.

    Example:
        >>> lay = sad.balanced(W, cu_seqlens=cu, causal=True)              # the same on every rank
        >>> q_local, k_local, v_local = (sad.shard(t, layout=lay, dim=0) for t in (q, k, v))
        >>> out_local = sad.varlen_attention(q_local, k_local, v_local, cu, layout=lay, causal=True)
        >>> out = sad.unshard(out_local, layout=lay, dim=0)                # (L, H, Dv) on every rank
    """
    from . import attention  # the package's entry point, defined after this module is imported

    q, k, v = _varlen.check_qkv(q, k, v)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"context-parallel self-attention needs q, k and v with this rank's same tokens; got q with "
                         f"{q.shape[0]} tokens and k, v with {k.shape[0]}")
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be an int32 tensor (N + 1,), got {type(cu_seqlens).__name__}; build it "
                        "with torch.tensor(..., dtype=torch.int32)")
    if q.shape[0] == 0:  # a row of empty sequences: nothing to send, the single-process answer (zeros) and checks
        return _varlen.varlen_attention(q, k, v, cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                        causal=causal, window=window, scale=scale, dropout_p=dropout_p,
                                        softcap=softcap, sinks=sinks, return_lse=return_lse)
    cu = check_cu_seqlens(cu_seqlens, "cu_seqlens")
    length = 0  # under compile the row's length is data, and the group is the op's (distributed.compiled)
    if not torch.compiler.is_compiling():
        world = group_of(group, timeout).world
        check_layout(layout, world)
        length = int(cu[-1])
        _row_length(length, q.shape[0], world, layout)
    mask = _varlen.packed_mask(cu_seqlens, None, length, length, causal=causal, window=window,
                               max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
    result = attention(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
                       v.unsqueeze(0).transpose(1, 2), group=group, layout=layout, mask=mask, scale=scale,
                       dropout_p=dropout_p, score_mod=_varlen.softcap_mod(softcap), sinks=sinks,
                       return_lse=return_lse, strategy=strategy, backend=backend, timeout=timeout, memory=memory)
    out4, lse4 = result if return_lse else (result, None)
    out = out4[0].transpose(0, 1).contiguous()
    return (out, lse4[0]) if lse4 is not None else out

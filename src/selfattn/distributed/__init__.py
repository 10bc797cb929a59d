"""Context parallelism: one attention over a sequence split across the ranks of a torch.distributed group.

Each rank holds L / W tokens of every sequence (its *shard*); :func:`attention` gives each rank the
output (and lse, and through autograd the gradients of q, k, v) for the tokens it holds, equal to
the single-process :func:`selfattn.attention` on the whole sequence. Transport is torch.distributed
(gloo on the CPU, NCCL on GPUs); masks and score modifiers are given on global positions.

Layouts (which tokens a rank holds), drawn for W = 2, L = 8 (``r`` = the rank holding a token)::

    contiguous   0 0 0 0 1 1 1 1      rank r holds tokens [r L/W, (r + 1) L/W)
    zigzag       0 0 1 1 1 1 0 0      2W chunks; rank r holds chunks r and 2W - 1 - r

    balanced     0 1 1 0 0 1 0 1      K W chunks, K per rank (balanced(): packed documents)

Zigzag gives every rank the same causal work on one sequence; on a row of packed documents the
causal work sits in the long documents, and :func:`balanced` gives out K chunks per rank by their
counted pairs instead. A :class:`Sharding` (``Sharding.of("zigzag", length=L, world=W)``, or
:func:`balanced`) takes a row of any length: :func:`shard` pads it at its end, the padding is
masked out, and :func:`unshard` drops it.

Strategies:

- ``"ring"``: K/V blocks travel around the ring (``batch_isend_irecv``) while the current block
  computes; partial outputs merge by their lse. A (query chunk, key chunk) pair that the mask leaves
  empty is skipped (its K/V still travel). The backward recomputes each block from the saved output
  and the global lse and sends dK/dV around the ring back to their owners.
- ``"all_to_all"`` (Ulysses): ``all_to_all_single`` turns sequence shards into head shards (every
  rank gets the whole sequence for H / W heads), any local backend runs, and a second all-to-all
  turns the result back; the backward does the same swaps the other way. Needs H % W == 0 and
  Hkv % W == 0.

Failure is loud: every collective waits at most ``timeout`` seconds; before any work the ranks
exchange their call's signature (shapes, dtype, options and fingerprints of the mask and the score
modifier, see ``agree``), so a rank that is missing is named on every other rank and a rank that
disagrees makes every rank raise the same ValueError naming the field and the ranks.

The package: ``group`` (the process group, waits that name the rank, :func:`record`), ``layout``
(:func:`shard`, :func:`unshard`), ``spec`` (the validated call, with the checkers
``selfattn.attention`` uses), ``agree`` (the ranks' agreement), ``ring`` and ``all_to_all`` (the
strategies), ``varlen`` (:func:`varlen_attention`: a packed row in the varlen layout, by ``cu_seqlens``),
``verify`` (a checker of a user's own context-parallel function, imported when used).
Blocks of the ring are computed by the chunked backend's block kernel; no attention arithmetic
lives here.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), G = H // Hkv, L the
global length, W the world size, n = L / W tokens per rank, c tokens per chunk (n contiguous,
n / 2 zigzag), D head dim of q and k, Dv head dim of v, R query rows of one sub-block.

Example:
    >>> from selfattn import distributed as sad, masks
    >>> q_local = sad.shard(q, layout="zigzag")                      # (B, H, L, D) -> (B, H, L / W, D)
    >>> out_local = sad.attention(q_local, k_local, v_local, layout="zigzag",
    ...                           mask=masks.document(ids) & masks.causal())
    >>> out = sad.unshard(out_local, layout="zigzag")                # (B, H, L, Dv) on every rank
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..backends.chunked.dropout import draw_seed
from ..masks import Mask
from ..scores import ScoreMod
from .agree import agree
from .all_to_all import all_to_all_attention
from .group import DEFAULT_TIMEOUT_S, Stats, group_of, record
from .layout import Layout, Sharding, balanced, pair_work, shard, unshard
from .ring import ring_attention
from .spec import Memory, Strategy, check_local_length, validate
from .varlen import varlen_attention

__all__ = ["DEFAULT_TIMEOUT_S", "Sharding", "Stats", "attention", "balanced", "pair_work", "record", "shard", "unshard",
           "varlen_attention"]

ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | DeviceMesh | None = None,
              layout: Layout | Sharding = "contiguous", mask: Mask | Tensor | None = None, causal: bool | str = False,
              scale: float | None = None, dropout_p: float = 0.0, score_mod: ScoreMod | ScoreFn | None = None,
              return_lse: bool = False, strategy: Strategy = "ring", backend: str = "auto",
              timeout: float | None = None, sinks: Tensor | None = None,
              memory: Memory = "overlap") -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a sequence split across the ranks of ``group``; each rank passes its shard.

    The result on each rank equals this rank's tokens of ``selfattn.attention`` on the gathered
    tensors (output, lse and the gradients of q, k, v), with the mask and score modifier read on
    global positions. Invalid arguments raise the errors ``selfattn.attention`` raises for them.

    Args:
        q: (B, H, L / W, D), this rank's queries in the layout's order (see :func:`shard`).
        k: (B, Hkv, L / W, D), this rank's keys; H % Hkv == 0 (GQA).
        v: (B, Hkv, L / W, Dv), this rank's values.
        group: the process group, or a one-dimensional DeviceMesh (``mesh["cp"]``); None for the default group.
        layout: "contiguous" or "zigzag" (L divisible by 2W; balances causal work), or a :class:`Sharding`
            (:func:`balanced` for packed documents, :meth:`Sharding.of` for any length: the padding is masked).
        mask: a :mod:`selfattn.masks` mask on global positions (a bool tensor is taken as a global
            (B, H, L, L) mask), or None. The same on every rank (compared by fingerprint).
        causal: True (or "top_left" / "bottom_right", the same for self-attention) adds a causal mask.
        scale: multiplier of the scores; None for 1 / sqrt(D).
        dropout_p: dropout on the attention weights. The ring draws the same pattern as the
            single-process chunked backend with the same seed (rank 0's draw from torch's generator);
            all_to_all draws an independent pattern per head group.
        score_mod: a :mod:`selfattn.scores` modifier or ``fn(score, b, h, i, j)`` on global positions.
        return_lse: also return this rank's lse, (B, H, L / W) float32 (-inf on rows that see no key).
        strategy: "ring" (K/V around the ring) or "all_to_all" (Ulysses; H and Hkv divisible by W).
        backend: the local backend of "all_to_all" (any of selfattn.attention's); "auto" for "ring".
        timeout: seconds any transfer may wait for another rank (default :data:`DEFAULT_TIMEOUT_S`;
            ``float("inf")``: no limit of its own, the process group's timeout applies); past it,
            RuntimeError naming the rank that did not answer.
        sinks: (H,) attention sinks, one logit per query head (as ``selfattn.attention``'s), the same on
            every rank; its gradient on each rank is that rank's rows' share (sum it over the group, as
            any parameter every rank holds).
        memory: how the ring's backward moves dK/dV (all_to_all: no effect). "overlap" (default): a block's
            accumulated dK/dV travel to the next rank while this rank computes its share into a buffer of its
            own. "low": the accumulator is waited for and added to in place, which holds two K/V-sized buffers
            fewer per rank and leaves each dK/dV hop's transfer time unhidden (on the distributed suite's Llama
            point, L = 16384: 0.67x one process's attention memory per rank at W = 2 and 0.38x at W = 4, against
            0.80x and 0.47x with "overlap").

    Returns:
        out (B, H, L / W, Dv) in q's dtype, or (out, lse).

    Example:
        >>> out_local = sad.attention(q_local, k_local, v_local, layout="zigzag", causal=True)
    """
    if torch.compiler.is_compiling():  # one custom op: the communication stays out of the graph
        from .compiled import compiled_attention

        return compiled_attention(q, k, v, group=group, layout=layout, mask=mask, causal=causal, scale=scale,
                                  dropout_p=dropout_p, score_mod=score_mod, return_lse=return_lse,
                                  strategy=strategy, backend=backend, timeout=timeout, sinks=sinks, memory=memory)
    g = group_of(group, timeout)
    spec = validate(q, k, v, g, layout, strategy, mask, causal, scale, dropout_p, score_mod, return_lse, backend,
                    sinks, memory)
    if spec.dropout_p > 0:  # drawn where the single-process chunked call draws it; every rank takes rank 0's
        spec = replace(spec, seed=draw_seed())
    spec = agree(g, spec, q, k, v)
    check_local_length(spec.layout, q.shape[2], g.world)  # after the agreement: every rank raises alike
    if spec.strategy == "all_to_all":
        out, lse = all_to_all_attention(g, spec, q, k, v)
    else:
        out, lse = ring_attention(g, spec, q, k, v)
    return (out, lse.float()) if return_lse else out  # type: ignore[union-attr]

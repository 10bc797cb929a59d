"""Context parallelism: one attention over a sequence split across the ranks of a torch.distributed group.

Each rank holds L / W tokens of every sequence (its *shard*); :func:`attention` gives each rank the
output (and lse, and through autograd the gradients of q, k, v) for the tokens it holds, equal to
the single-process :func:`selfattn.attention` on the whole sequence. Transport is torch.distributed
(gloo on the CPU, NCCL on GPUs); masks and score modifiers are given on global positions.

Layouts (which tokens a rank holds), drawn for W = 2, L = 8 (``r`` = the rank holding a token)::

    contiguous   0 0 0 0 1 1 1 1      rank r holds tokens [r L/W, (r + 1) L/W)
    zigzag       0 0 1 1 1 1 0 0      2W chunks; rank r holds chunks r and 2W - 1 - r

Zigzag gives every rank the same causal work.

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
exchange their call's shapes and options, so a rank that is missing is named on every other rank
and a rank with other shapes or options makes every rank raise the same ValueError.

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

import contextlib
import contextvars
import datetime
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from . import masks as _masks
from . import scores as _scores
from .backends import chunked as _chunked
from .functional import attention as _local_attention
from .masks import EMPTY, FULL, Mask

__all__ = ["DEFAULT_TIMEOUT_S", "Stats", "attention", "record", "shard", "unshard"]

Layout = Literal["contiguous", "zigzag"]
Strategy = Literal["ring", "all_to_all"]
ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

DEFAULT_TIMEOUT_S = 300.0
"""How long a collective waits for the other ranks when ``timeout`` is not given."""

_LAYOUTS = ("contiguous", "zigzag")
_STRATEGIES = ("ring", "all_to_all")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ROWS = 256  # query rows of one sub-block
_SCORE_BYTES = 1 << 28  # one sub-block's (B, H, R, c) scores stay under 256 MiB in compute dtype


@dataclass
class Stats:
    """What the calls inside :func:`record` did on this rank.

    Attributes:
        compute_s: seconds spent computing blocks (forward and backward).
        wait_s: seconds spent waiting for transfers after the computation they overlap.
        blocks: (query chunk, key chunk) pairs computed.
        skipped: pairs the mask leaves empty, not computed.
        work: query-key pairs computed (rows x keys summed over blocks), the unit of causal balance.
        sent_bytes: bytes this rank sent.
    """

    compute_s: float = 0.0
    wait_s: float = 0.0
    blocks: int = 0
    skipped: int = 0
    work: int = 0
    sent_bytes: int = 0


_STATS: contextvars.ContextVar[Stats | None] = contextvars.ContextVar("selfattn_distributed_stats", default=None)


@contextlib.contextmanager
def record() -> Iterator[Stats]:
    """Count work, waiting and traffic of the distributed calls (and backwards) inside the block.

    Example:
        >>> with sad.record() as stats:
        ...     sad.attention(q_local, k_local, v_local, causal=True).sum().backward()
        >>> stats.wait_s, stats.blocks, stats.skipped
    """
    stats = Stats()
    token = _STATS.set(stats)
    try:
        yield stats
    finally:
        _STATS.reset(token)


# ----------------------------------------------------------------------------- group and layout


@dataclass(frozen=True)
class _Group:
    """A process group as this module uses it: ranks in the group, global ranks for P2P, timeout."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    timeout: datetime.timedelta

    def peer(self, group_rank: int) -> int:
        """The global rank of a group rank (P2P ops take global ranks)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def wait(self, works: Sequence[dist.Work], what: str, peers: Sequence[int]) -> float:
        """Wait for every transfer within the timeout; a miss names the peer rank. Returns seconds waited."""
        t0 = time.perf_counter()
        for i, work in enumerate(works):
            peer = peers[i] if len(works) == len(peers) else None
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as e:
                who = f"rank {peer}" if peer is not None else f"one of ranks {sorted(set(peers))}"
                raise RuntimeError(
                    f"selfattn.distributed: rank {self.rank} waited {self.timeout.total_seconds():g} s for "
                    f"{what} with {who} of the group, which did not take part: it raised, exited, or is not "
                    f"calling the same selfattn.distributed function ({type(e).__name__}: {e})") from e
        return time.perf_counter() - t0


def _group(group: dist.ProcessGroup | None, timeout: float | None) -> _Group:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("selfattn.distributed needs torch.distributed initialised: call "
                           "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun does "
                           "the rendezvous), or use selfattn.attention on one process")
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return _Group(group, dist.get_rank(group), dist.get_world_size(group), datetime.timedelta(seconds=timeout))


def _check_layout(layout: object) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")


def _chunks_of(layout: str, rank: int, world: int) -> list[int]:
    """The global chunk ids rank ``rank`` holds, in its local order."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def _num_chunks(layout: str, world: int) -> int:
    return world if layout == "contiguous" else 2 * world


def shard(x: Tensor, *, group: dist.ProcessGroup | None = None, layout: Layout = "contiguous",
          dim: int = 2) -> Tensor:
    """This rank's tokens of a global tensor (every rank passes the same ``x``).

    Args:
        x: a global tensor, (B, H, L, D) by default; any tensor with the sequence along ``dim``.
        group: the process group; None for the default group.
        layout: "contiguous" (rank r holds tokens [r L/W, (r+1) L/W)) or "zigzag" (2W chunks,
            rank r holds chunks r and 2W-1-r).
        dim: the sequence dimension.

    Returns:
        (B, H, L / W, D): this rank's tokens in its local order (a copy; differentiable).

    Example:
        >>> q_local = sad.shard(q, layout="zigzag")
    """
    _check_layout(layout)
    if not isinstance(x, Tensor):
        raise TypeError(f"shard takes a tensor, got {type(x).__name__}")
    g = _group(group, None)
    length, parts = x.shape[dim], _num_chunks(layout, g.world)
    if length % parts:
        raise ValueError(f"shard: the sequence length {length} (dim {dim}) must be divisible by "
                         f"{'W' if layout == 'contiguous' else '2W'} = {parts} for layout {layout!r} on "
                         f"{g.world} ranks; pad the sequence (and mask the padding with masks.padding)")
    c = length // parts
    return torch.cat([x.narrow(dim, cid * c, c) for cid in _chunks_of(layout, g.rank, g.world)], dim=dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, g: _Group, layout: str) -> Tensor:  # type: ignore[override]
        parts = [torch.empty_like(x) for _ in range(g.world)]
        xs = x.contiguous()
        if g.world > 1:
            work = dist.all_gather(parts, xs, group=g.group, async_op=True)
            g.wait([work], "unshard's all_gather", list(range(g.world)))
        else:
            parts = [xs]
        nc = _num_chunks(layout, g.world)
        c = x.shape[2] // (nc // g.world)
        chunks: list[Tensor | None] = [None] * nc
        for r, part in enumerate(parts):
            for i, cid in enumerate(_chunks_of(layout, r, g.world)):
                chunks[cid] = part[:, :, i * c:(i + 1) * c]
        ctx.g, ctx.layout = g, layout
        return torch.cat(chunks, dim=2)  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        g: _Group = ctx.g
        c = grad.shape[2] // _num_chunks(ctx.layout, g.world)
        own = [grad[:, :, cid * c:(cid + 1) * c] for cid in _chunks_of(ctx.layout, g.rank, g.world)]
        return torch.cat(own, dim=2), None, None


def unshard(x_local: Tensor, *, group: dist.ProcessGroup | None = None, layout: Layout = "contiguous",
            timeout: float | None = None) -> Tensor:
    """Gather every rank's tokens back into the global tensor, on every rank.

    Args:
        x_local: (B, H, L / W, D), this rank's tokens in the order :func:`shard` gives them.
        group: the process group; None for the default group.
        layout: the layout the tokens were sharded with.
        timeout: seconds to wait for the other ranks (default :data:`DEFAULT_TIMEOUT_S`).

    Returns:
        (B, H, L, D), the same on every rank. Its backward hands each rank its own tokens'
        gradient, which is right when every rank computes the same loss from the gathered tensor.

    Example:
        >>> out = sad.unshard(out_local, layout="zigzag")
    """
    _check_layout(layout)
    if not isinstance(x_local, Tensor) or x_local.dim() != 4:
        raise ValueError(f"unshard takes a 4-D (B, H, L / W, D) tensor, got {getattr(x_local, 'shape', x_local)!r}")
    g = _group(group, timeout)
    if layout == "zigzag" and x_local.shape[2] % 2:
        raise ValueError(f"unshard: a zigzag shard holds two equal chunks, but it has {x_local.shape[2]} tokens")
    return _Unshard.apply(x_local, g, layout)


# ----------------------------------------------------------------------------- validation and agreement


@dataclass
class _Spec:
    """A validated call: everything the ranks must agree on, and what each rank computes with."""

    layout: str
    strategy: str
    mask: Mask | None
    score_mod: _scores.ScoreMod | None
    causal: bool
    scale: float
    dropout_p: float
    return_lse: bool
    backend: str
    seed: int = 0

    def signature(self, q: Tensor, k: Tensor, v: Tensor) -> list[tuple[str, int]]:
        """(name, value) pairs every rank must share (the seed is rank 0's, not compared)."""
        return [("q shape B", q.shape[0]), ("q heads", q.shape[1]), ("local length", q.shape[2]),
                ("q head dim", q.shape[3]), ("k/v heads", k.shape[1]), ("v head dim", v.shape[3]),
                ("dtype", _DTYPES.index(q.dtype)), ("layout", _LAYOUTS.index(self.layout)),
                ("strategy", _STRATEGIES.index(self.strategy)), ("causal", int(self.causal)),
                ("mask given", int(self.mask is not None)), ("score_mod given", int(self.score_mod is not None)),
                ("scale (x1e9)", round(self.scale * 1e9)), ("dropout_p (x1e9)", round(self.dropout_p * 1e9)),
                ("return_lse", int(self.return_lse)), ("seed", self.seed)]


def _tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be this rank's 4-D (B, H, L / W, D) shard, got shape {tuple(t.shape)}; "
                         "make it with selfattn.distributed.shard")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    return t


def _validate(q: object, k: object, v: object, g: _Group, layout: object, strategy: object, mask: object,
              causal: object, scale: object, dropout_p: object, score_mod: object, return_lse: object,
              backend: object) -> _Spec:
    q, k, v = _tensor("q", q), _tensor("k", k), _tensor("v", v)
    _check_layout(layout)
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy must be 'ring' or 'all_to_all', got {strategy!r}")
    b, h, n, d = q.shape
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast with .to(q.dtype)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"context-parallel self-attention needs q (B, H, n, D), k (B, Hkv, n, D) and "
                         f"v (B, Hkv, n, Dv) with one local length n; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if h % k.shape[1]:
        raise ValueError(f"q has {h} heads and k/v have {k.shape[1]}; H must be a multiple of Hkv (GQA)")
    parts = _num_chunks(layout, g.world) // g.world  # chunks per rank
    if n % parts:
        raise ValueError(f"layout 'zigzag' needs L divisible by 2W = {2 * g.world}: this rank holds {n} tokens, "
                         "an odd number, so the global length is not; pad the sequence to a multiple of 2W")
    if strategy == "all_to_all" and (h % g.world or k.shape[1] % g.world):
        raise ValueError(f"strategy 'all_to_all' splits heads across the {g.world} ranks: q heads ({h}) and "
                         f"k/v heads ({k.shape[1]}) must be divisible by W = {g.world}; use strategy='ring'")
    if causal not in (False, True, "top_left", "bottom_right"):
        raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")
    m: Mask | None
    if mask is None or isinstance(mask, Mask):
        m = mask
    elif isinstance(mask, Tensor):
        m = _masks.from_tensor(mask)
    else:
        raise TypeError(f"mask must be None, a selfattn.masks.Mask or a global bool tensor (B, H, L, L), "
                        f"got {type(mask).__name__}")
    length = n * g.world
    if m is not None:
        try:
            m.check(b, h, length, length)
        except ValueError as e:
            raise ValueError(f"mask (on global positions, L = {length}): {e}") from None
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    for name, value, ok, want in (("scale", scale, lambda x: math.isfinite(x) and x > 0, "a finite number > 0"),
                                  ("dropout_p", dropout_p, lambda x: 0.0 <= x < 1.0, "a number in [0, 1)")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ValueError(f"{name} must be {want}, got {value!r}")
    # a callable becomes a custom modifier (scores.custom raises TypeError for anything else)
    mod = score_mod if score_mod is None or isinstance(score_mod, _scores.ScoreMod) else _scores.custom(score_mod)
    if mod is not None and mod.num_heads() not in (None, h):
        raise ValueError(f"score_mod {mod!r} is built for {mod.num_heads()} heads, but q has {h}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if strategy == "ring" and backend != "auto":
        raise ValueError(f"backend={backend!r} applies to strategy='all_to_all', whose local attention runs "
                         "any backend; the ring computes its blocks itself: leave backend='auto'")
    return _Spec(layout=layout, strategy=strategy, mask=m, score_mod=mod, causal=bool(causal),  # type: ignore[arg-type]
                 scale=float(scale), dropout_p=float(dropout_p), return_lse=return_lse, backend=backend)


def _agree(g: _Group, spec: _Spec, q: Tensor, k: Tensor, v: Tensor) -> None:
    """Exchange the call's signature with every other rank; name missing ranks and mismatches.

    Sets ``spec.seed`` to rank 0's seed. Every rank sees every signature, so a mismatch raises the
    same ValueError on every rank.
    """
    mine = spec.signature(q, k, v)
    if g.world == 1:
        return
    names = [name for name, _ in mine]
    send = torch.tensor([value for _, value in mine], dtype=torch.int64, device=q.device)
    others = {r: torch.empty_like(send) for r in range(g.world) if r != g.rank}
    ops = [dist.P2POp(dist.isend, send, g.peer(r), g.group) for r in others]
    ops += [dist.P2POp(dist.irecv, buf, g.peer(r), g.group) for r, buf in others.items()]
    works = dist.batch_isend_irecv(ops)
    g.wait(works, "the call's shapes and options", list(others) * 2)
    table = {r: buf.tolist() for r, buf in others.items()}
    table[g.rank] = send.tolist()
    spec.seed = table[0][-1]
    for r in range(1, g.world):
        diff = [f"{name}: rank 0 has {a}, rank {r} has {b}" for name, a, b in zip(names[:-1], table[0], table[r],
                                                                                     strict=False) if a != b]
        if diff:
            raise ValueError(f"selfattn.distributed.attention was called with different arguments on different "
                             f"ranks ({'; '.join(diff)}); every rank must pass its shard of the same global "
                             "tensors with the same layout, strategy and options")


# ----------------------------------------------------------------------------- ring: blocks


@dataclass
class _Ring:
    """What every block of one ring call needs."""

    g: _Group
    spec: _Spec
    length: int
    chunk: int
    classes: list[list[int]]  # EMPTY / PARTIAL / FULL per (query chunk, key chunk), over batch and heads
    batch: int
    heads: int
    stats: Stats | None
    sub: int = 1  # query rows of a sub-block (and keys of a fine tile)
    fine: Tensor | None = None  # classes of (sub x sub) tiles of the whole call, (L / sub, L / sub), or None
    fused: bool = False  # blocks run in the chunked backend's fused kernel (else plain math here)

    def chunks(self, rank: int) -> list[int]:
        return _chunks_of(self.spec.layout, rank, self.g.world)

    def plan_tiles(self, device: torch.device) -> None:
        """Choose the sub-block size R and, when R divides the chunk, the fine tile map that trims
        each sub-block's keys to the tiles the mask leaves non-empty.

        R is at most ``_ROWS``, so that (B, H, R, c) scores shrink with the chunk (1 / W), and less
        where they would pass ``_SCORE_BYTES``.
        """
        c = self.chunk
        most = max(1, min(c, _ROWS, _SCORE_BYTES // max(1, self.batch * self.heads * c * 8)))
        divisor = max(d for d in range(1, most + 1) if c % d == 0)
        self.sub = divisor if divisor >= min(32, most) else most
        if self.spec.mask is not None and c % self.sub == 0 and self.sub < c:
            self.fine = _pair_classes_tensor(self.spec.mask, self.length, self.sub, device)


def _pair_classes_tensor(mask: Mask, length: int, tile: int, device: torch.device) -> Tensor:
    """EMPTY / PARTIAL / FULL of every (tile x tile) square of the call, over batch and heads: (L / tile,) * 2."""
    t = mask.tiles(length, length, tile, tile, device).cpu()  # (B', H', n, n)
    empty, full = (t == EMPTY).flatten(0, 1).all(0), (t == FULL).flatten(0, 1).all(0)
    return torch.where(empty, EMPTY, torch.where(full, FULL, _masks.PARTIAL))


def _pair_classes(mask: Mask | None, length: int, chunk: int, device: torch.device) -> list[list[int]]:
    nc = length // chunk
    if mask is None:
        return [[FULL] * nc for _ in range(nc)]
    return _pair_classes_tensor(mask, length, chunk, device).tolist()


def _keep(ring: _Ring, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> Tensor:
    """The dropout keep-mask of global rows q0:q1 and keys k0:k1, (B, H, q1 - q0, k1 - k0): the
    chunked backend's tiles of the whole call with the same seed, so the pattern is the single-process one."""
    opts = _chunked.current_options()
    bq, bk, length = opts.block_q or opts.math_block_q, opts.block_k, ring.length
    rows = []
    for t0 in range(q0 - q0 % bq, q1, bq):
        cols = []
        for u0 in range(k0 - k0 % bk, k1, bk):
            shape = (ring.batch, ring.heads, min(t0 + bq, length) - t0, min(u0 + bk, length) - u0)
            tile = _chunked.keep_mask(ring.spec.seed, shape, ring.spec.dropout_p, t0 // bq, u0 // bk, device)
            cols.append(tile[:, :, :, max(k0, u0) - u0:min(k1, u0 + bk) - u0])
        rows.append(torch.cat(cols, dim=-1)[:, :, max(q0, t0) - t0:min(q1, t0 + bq) - t0])
    return torch.cat(rows, dim=-2)


def _block_scores(ring: _Ring, q: Tensor, k: Tensor, q0: int, k0: int, partial: bool,
                  grad_mod: bool = False) -> tuple[Tensor, Tensor]:
    """(raw, scores) of global query rows q0: and keys k0: in compute dtype, (B, Hkv, G, R, c).

    ``raw`` is q k^T * scale; ``scores`` adds the score modifier (with autograd from ``raw`` when
    ``grad_mod``) and the mask (-inf where hidden).
    """
    spec = ring.spec
    b, h, r, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    raw = torch.matmul(q.reshape(b, hkv, h // hkv, r, -1), k.unsqueeze(2).transpose(-1, -2)) * spec.scale
    raw = raw.detach().requires_grad_(grad_mod)
    with torch.enable_grad() if grad_mod else contextlib.nullcontext():
        s = raw
        if spec.score_mod is not None:
            idx = _masks.positions(torch.arange(b), h, q0, q0 + r, k0, k0 + nk, ring.length, ring.length, q.device)
            s = _scores.apply_score_mod(spec.score_mod, raw.reshape(b, h, r, nk), idx).view(raw.shape)
        if partial and spec.mask is not None:
            visible = spec.mask.block(q0, q0 + r, k0, k0 + nk, ring.length, ring.length, q.device)  # (B'|1, H'|1, R, c)
            if visible.shape[1] == 1:
                visible = visible.unsqueeze(2)  # broadcast over (Hkv, G)
            else:
                visible = visible.reshape(visible.shape[0], hkv, h // hkv, r, nk)
            s = s.masked_fill(~visible, float("-inf"))
    return raw, s


def _fused_terms(ring: _Ring, q: Tensor, k: Tensor, q0: int, k0: int,
                 partial: bool) -> tuple[Tensor | None, Tensor | None]:
    """(visible, bias) of a block for the fused kernel: the mask on partial blocks, an additive
    modifier as a bias in the compute dtype, both on global positions."""
    spec, b, h, r, nk = ring.spec, q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    visible = None
    if partial and spec.mask is not None:
        visible = spec.mask.block(q0, q0 + r, k0, k0 + nk, ring.length, ring.length, q.device)
    bias = None
    if spec.score_mod is not None:  # additive (ring.fused checked it)
        idx = _masks.positions(torch.arange(b), h, q0, q0 + r, k0, k0 + nk, ring.length, ring.length, q.device)
        bias = _scores.score_mod_bias(spec.score_mod, idx, q.dtype)
    return visible, bias


def _block_forward(ring: _Ring, q: Tensor, k: Tensor, v: Tensor, q0: int, k0: int,
                   partial: bool) -> tuple[Tensor, Tensor]:
    """Output and lse of query rows q0: (global) against one key chunk: (B, H, R, Dv), (B, H, R)."""
    if ring.fused:
        visible, bias = _fused_terms(ring, q, k, q0, k0, partial)
        out, lse = _chunked.fused_block(q, k, v, scale=ring.spec.scale, visible=visible, bias=bias)
        return out, lse.to(q.dtype)
    b, h, r, _ = q.shape
    _, s = _block_scores(ring, q, k, q0, k0, partial)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf on rows that see no key here
    weights = torch.exp(s - lse.nan_to_num(neginf=0.0))
    if ring.spec.dropout_p > 0:
        keep = _keep(ring, q0, q0 + r, k0, k0 + k.shape[2], q.device).view(weights.shape)
        weights = weights * keep / (1.0 - ring.spec.dropout_p)
    out = torch.matmul(weights, v.unsqueeze(2))  # (B, Hkv, G, R, Dv)
    return out.reshape(b, h, r, -1), lse.reshape(b, h, r)


def _block_backward(ring: _Ring, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, lse: Tensor,
                    delta: Tensor, q0: int, k0: int, partial: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq (B, H, R, D), dk (B, Hkv, c, D), dv (B, Hkv, c, Dv) of one block, from the global out and lse.

    ``lse`` is +inf on rows that see no key, so their probabilities are 0; ``delta`` = rowsum(dO * O).
    """
    if ring.fused:
        visible, bias = _fused_terms(ring, q, k, q0, k0, partial)
        return _chunked.fused_block_backward(dout, q, k, v, out, lse, scale=ring.spec.scale, visible=visible,
                                             bias=bias)
    spec = ring.spec
    b, h, r, _ = q.shape
    hkv = k.shape[1]
    grad_mod = spec.score_mod is not None and not spec.score_mod.additive
    raw, s = _block_scores(ring, q, k, q0, k0, partial, grad_mod)
    split = (b, hkv, h // hkv, r)
    probs = torch.exp(s.detach() - lse.reshape(*split, 1))
    do = dout.reshape(*split, -1)
    dprobs = torch.matmul(do, v.unsqueeze(2).transpose(-1, -2))
    used = probs
    if spec.dropout_p > 0:
        kept = _keep(ring, q0, q0 + r, k0, k0 + k.shape[2], q.device).view(probs.shape).to(probs.dtype)
        kept = kept / (1.0 - spec.dropout_p)
        used, dprobs = probs * kept, dprobs * kept
    dscores = probs * (dprobs - delta.reshape(*split, 1))
    if grad_mod:
        (dscores,) = torch.autograd.grad(s, raw, dscores)
    dq = torch.matmul(dscores, k.unsqueeze(2)) * spec.scale
    dk = torch.matmul(dscores.transpose(-1, -2), q.reshape(*split, -1)).sum(2) * spec.scale
    dv = torch.matmul(used.transpose(-1, -2), do).sum(2)
    return dq.reshape(b, h, r, -1), dk, dv


# ----------------------------------------------------------------------------- ring: passing blocks around


class _Pass:
    """One ring hop in flight: send ``buf`` to the next rank, receive its twin from the previous one."""

    def __init__(self, ring: _Ring, buf: Tensor, what: str) -> None:
        g = ring.g
        self.ring, self.what = ring, what
        self.nxt, self.prv = (g.rank + 1) % g.world, (g.rank - 1) % g.world
        self.incoming = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, g.peer(self.nxt), g.group),
               dist.P2POp(dist.irecv, self.incoming, g.peer(self.prv), g.group)]
        self.works = dist.batch_isend_irecv(ops)
        if ring.stats is not None:
            ring.stats.sent_bytes += buf.numel() * buf.element_size()

    def result(self) -> Tensor:
        waited = self.ring.g.wait(self.works, self.what, [self.nxt, self.prv])
        if self.ring.stats is not None:
            self.ring.stats.wait_s += waited
        return self.incoming


def _pack(*ts: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    out, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(buf[at:at + size].view(shape))
        at += size
    return out


def _visit(ring: _Ring, owner: int) -> Iterator[tuple[int, int, int, int, int, int, bool]]:
    """Every sub-block to compute against ``owner``'s keys: (local query row, global query row, rows,
    local key, global key, keys, partial). Pairs of chunks the mask leaves empty are skipped, and
    within a partial pair each sub-block's keys are trimmed to its non-empty tiles."""
    c, sub = ring.chunk, ring.sub
    for ai, a in enumerate(ring.chunks(ring.g.rank)):
        for bi, kb in enumerate(ring.chunks(owner)):
            cls = ring.classes[a][kb]
            if cls == EMPTY:
                if ring.stats is not None:
                    ring.stats.skipped += 1
                continue
            if ring.stats is not None:
                ring.stats.blocks += 1
            for r0 in range(0, c, sub):
                rows, k0, k1, partial = min(sub, c - r0), 0, c, cls != FULL
                if partial and ring.fine is not None:
                    tiles = ring.fine[(a * c + r0) // sub, kb * c // sub:(kb + 1) * c // sub]
                    live = (tiles != EMPTY).nonzero().flatten().tolist()
                    if not live:
                        continue
                    k0, k1 = live[0] * sub, (live[-1] + 1) * sub
                    partial = bool((tiles[live[0]:live[-1] + 1] != FULL).any())
                if ring.stats is not None:
                    ring.stats.work += rows * (k1 - k0)
                yield ai * c + r0, a * c + r0, rows, bi * c + k0, kb * c + k0, k1 - k0, partial


def _ring_forward(ring: _Ring, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, h, n, _ = q.shape
    step = None
    out = torch.zeros(b, h, n, v.shape[3], dtype=ct, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=ct, device=q.device)
    shapes = (k.shape, v.shape)
    kv = _pack(k, v)
    world, rank = ring.g.world, ring.g.rank
    for s in range(world):
        step = _Pass(ring, kv, "a K/V block") if s < world - 1 else None
        kb, vb = _unpack(kv, shapes)
        t0 = time.perf_counter()
        for lq, gq, nq, lk, gk, nk, partial in _visit(ring, (rank - s) % world):
            rows = slice(lq, lq + nq)
            o_new, l_new = _block_forward(ring, q[:, :, rows].to(ct), kb[:, :, lk:lk + nk].to(ct),
                                          vb[:, :, lk:lk + nk].to(ct), gq, gk, partial)
            l_old = lse[:, :, rows]
            l_sum = torch.logaddexp(l_old, l_new)
            base = l_sum.nan_to_num(neginf=0.0)  # rows still without a key keep weight 0 on both sides
            out[:, :, rows] = (out[:, :, rows] * torch.exp(l_old - base).unsqueeze(-1)
                               + o_new * torch.exp(l_new - base).unsqueeze(-1))
            lse[:, :, rows] = l_sum
        if ring.stats is not None:
            ring.stats.compute_s += time.perf_counter() - t0
        if step is not None:
            kv = step.result()
    return out.to(q.dtype), lse


def _ring_backward(ring: _Ring, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ct = lse.dtype
    world, rank = ring.g.world, ring.g.rank
    delta = (dout.to(ct) * out.to(ct)).sum(-1)  # (B, H, n)
    lse_b = lse.masked_fill(torch.isneginf(lse), float("inf"))
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    kv_shapes, grad_shapes = (k.shape, v.shape), (k.shape, v.shape)
    kv = _pack(k, v)
    kv_step = grad_step = None
    grads = torch.zeros(kv.numel(), dtype=ct, device=q.device)
    for s in range(world):
        kv_step = _Pass(ring, kv, "a K/V block (backward)") if s < world - 1 else None
        kb, vb = _unpack(kv, kv_shapes)
        mine = torch.zeros(kv.numel(), dtype=ct, device=q.device)  # this rank's share of the block's dK/dV
        dk, dv = _unpack(mine, grad_shapes)
        t0 = time.perf_counter()
        for lq, gq, nq, lk, gk, nk, partial in _visit(ring, (rank - s) % world):
            rows, keys = slice(lq, lq + nq), slice(lk, lk + nk)
            gq_, gk_, gv_ = _block_backward(ring, q[:, :, rows].to(ct), kb[:, :, keys].to(ct),
                                            vb[:, :, keys].to(ct), dout[:, :, rows].to(ct), out[:, :, rows].to(ct),
                                            lse_b[:, :, rows], delta[:, :, rows], gq, gk, partial)
            dq[:, :, rows] += gq_
            dk[:, :, keys] += gk_
            dv[:, :, keys] += gv_
        if ring.stats is not None:
            ring.stats.compute_s += time.perf_counter() - t0
        grads = mine if grad_step is None else grad_step.result() + mine
        if kv_step is not None:
            kv = kv_step.result()
        if world > 1:  # the accumulated dK/dV go on to the rank that computes with this block next
            grad_step = _Pass(ring, grads, "a dK/dV block")
    if grad_step is not None:
        grads = grad_step.result()  # after the last hop each rank holds its own block's dK/dV
    dk, dv = _unpack(grads, grad_shapes)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: _Ring) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        out, lse = _ring_forward(ring, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        with torch.no_grad():
            dq, dk, dv = _ring_backward(ring, q, k, v, out, lse, dout)
        return dq, dk, dv, None


# ----------------------------------------------------------------------------- all-to-all (Ulysses)


class _HeadSlice(Mask):
    """Heads h0:h0+count of a mask that carries H heads, for a call that holds only those heads."""

    def __init__(self, inner: Mask, h0: int, count: int, heads: int) -> None:
        self.inner, self.h0, self.count, self.heads = inner, h0, count, heads

    def predicate(self, lq, lk, device=None):
        inner, h0 = self.inner.predicate(lq, lk, device), self.h0
        return lambda b, h, i, j: inner(b, h + h0, i, j)

    def _cut(self, t: Tensor) -> Tensor:
        return t if t.shape[1] == 1 else t[:, self.h0:self.h0 + self.count]

    def block(self, q0, q1, k0, k1, lq, lk, device=None):
        return self._cut(self.inner.block(q0, q1, k0, k1, lq, lk, device))

    def _tile_bounds(self, lq, lk, bq, bk, device):
        t = self._cut(self.inner.tiles(lq, lk, bq, bk, device))
        return t == FULL, t == EMPTY

    def batch_heads(self):
        return self.inner.batch_heads()[0], self.count

    def tensors(self):
        return self.inner.tensors()

    def version(self):
        return self.inner.version()

    def check(self, batch, heads, lq, lk):
        self.inner.check(batch, self.heads, lq, lk)

    def __repr__(self) -> str:
        return f"{self.inner!r}[heads {self.h0}:{self.h0 + self.count}]"


class _HeadShift(_scores.ScoreMod):
    """A score modifier built for H heads, applied to heads h0:h0+count as local heads 0:count."""

    def __init__(self, inner: _scores.ScoreMod, h0: int, count: int) -> None:
        self.inner, self.h0, self.count, self.additive = inner, h0, count, inner.additive

    def __call__(self, score, b, h, i, j):
        return self.inner(score, b, h + self.h0, i, j)

    def bias(self, b, h, i, j, *args, **kwargs):
        return self.inner.bias(b, h + self.h0, i, j, *args, **kwargs)

    def num_heads(self) -> int | None:
        return None if self.inner.num_heads() is None else self.count

    def __repr__(self) -> str:
        return f"{self.inner!r}[heads {self.h0}:{self.h0 + self.count}]"


def _rank_order(layout: str, world: int) -> list[int]:
    """Global chunk ids in the order the ranks' shards concatenate."""
    return [cid for r in range(world) for cid in _chunks_of(layout, r, world)]


def _seq_to_heads(g: _Group, layout: str, x: Tensor) -> Tensor:
    """(B, Hx, n, Dx) sequence shard -> (B, Hx / W, L, Dx) head shard in global order."""
    b, hx, n, dx = x.shape
    w = g.world
    send = x.reshape(b, w, hx // w, n, dx).transpose(0, 1).contiguous()  # (W, B, Hx/W, n, Dx)
    recv = torch.empty_like(send)  # recv[src]: src's tokens of this rank's heads
    work = dist.all_to_all_single(recv, send, group=g.group, async_op=True)
    g.wait([work], "all_to_all (sequence to heads)", list(range(w)))
    nc = _num_chunks(layout, w)
    c = w * n // nc
    by_rank = recv.permute(1, 2, 0, 3, 4).reshape(b, hx // w, nc, c, dx)  # chunks in rank order
    order = _rank_order(layout, w)
    where = [order.index(cid) for cid in range(nc)]
    return by_rank[:, :, where].reshape(b, hx // w, nc * c, dx)


def _heads_to_seq(g: _Group, layout: str, x: Tensor) -> Tensor:
    """(B, Hx / W, L, Dx) head shard in global order -> (B, Hx, n, Dx) sequence shard."""
    b, hl, length, dx = x.shape
    w = g.world
    nc = _num_chunks(layout, w)
    c = length // nc
    by_rank = x.reshape(b, hl, nc, c, dx)[:, :, _rank_order(layout, w)]  # (B, Hx/W, nC, c, Dx)
    send = by_rank.reshape(b, hl, w, length // w, dx).permute(2, 0, 1, 3, 4).contiguous()  # (W, B, Hx/W, n, Dx)
    recv = torch.empty_like(send)  # recv[src]: this rank's tokens of src's heads
    work = dist.all_to_all_single(recv, send, group=g.group, async_op=True)
    g.wait([work], "all_to_all (heads to sequence)", list(range(w)))
    return recv.transpose(0, 1).reshape(b, w * hl, length // w, dx)


class _Swap(torch.autograd.Function):
    """Sequence shards to head shards (``to_heads``) or back; the backward swaps the other way."""

    @staticmethod
    def forward(ctx, x: Tensor, g: _Group, layout: str, to_heads: bool) -> Tensor:  # type: ignore[override]
        ctx.g, ctx.layout, ctx.to_heads = g, layout, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(g, layout, x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(ctx.g, ctx.layout, grad), None, None, None


def _all_to_all(g: _Group, spec: _Spec, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None]:
    h, w = q.shape[1], g.world
    count = h // w
    h0 = g.rank * count
    qh, kh, vh = (_Swap.apply(t, g, spec.layout, True) for t in (q, k, v))
    mask = spec.mask
    if mask is not None and mask.batch_heads()[1] > 1:
        mask = _HeadSlice(mask, h0, count, h)
    mod = None if spec.score_mod is None else _HeadShift(spec.score_mod, h0, count)
    cpu = q.device.type == "cpu"
    rng = contextlib.nullcontext() if spec.dropout_p == 0 else torch.random.fork_rng(
        devices=[] if cpu else [q.device.index], device_type="cuda" if cpu else q.device.type)
    with rng:
        if spec.dropout_p > 0:  # each head group draws its own pattern from the shared seed
            torch.manual_seed((spec.seed + 7919 * g.rank) % (1 << 62))
        res = _local_attention(qh, kh, vh, mask=mask, causal=spec.causal, scale=spec.scale, dropout_p=spec.dropout_p,
                               backend=spec.backend, return_lse=spec.return_lse, score_mod=mod)
    if not spec.return_lse:
        return _Swap.apply(res, g, spec.layout, False), None
    out_h, lse_h = res
    lse = _heads_to_seq(g, spec.layout, lse_h.detach().unsqueeze(-1)).squeeze(-1)
    return _Swap.apply(out_h, g, spec.layout, False), lse


# ----------------------------------------------------------------------------- the entry point


def attention(q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup | None = None,
              layout: Layout = "contiguous", mask: Mask | Tensor | None = None, causal: bool | str = False,
              scale: float | None = None, dropout_p: float = 0.0, score_mod: _scores.ScoreMod | ScoreFn | None = None,
              return_lse: bool = False, strategy: Strategy = "ring", backend: str = "auto",
              timeout: float | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a sequence split across the ranks of ``group``; each rank passes its shard.

    The result on each rank equals this rank's tokens of ``selfattn.attention`` on the gathered
    tensors (output, lse and the gradients of q, k, v), with the mask and score modifier read on
    global positions.

    Args:
        q: (B, H, L / W, D), this rank's queries in the layout's order (see :func:`shard`).
        k: (B, Hkv, L / W, D), this rank's keys; H % Hkv == 0 (GQA).
        v: (B, Hkv, L / W, Dv), this rank's values.
        group: the process group; None for the default group.
        layout: "contiguous" or "zigzag" (L divisible by 2W; balances causal work).
        mask: a :mod:`selfattn.masks` mask on global positions (a bool tensor is taken as a global
            (B, H, L, L) mask), or None.
        causal: True (or "top_left" / "bottom_right", the same for self-attention) adds a causal mask.
        scale: multiplier of the scores; None for 1 / sqrt(D).
        dropout_p: dropout on the attention weights. The ring draws the same pattern as the
            single-process chunked backend with the same seed (rank 0's draw from torch's generator);
            all_to_all draws an independent pattern per head group.
        score_mod: a :mod:`selfattn.scores` modifier or ``fn(score, b, h, i, j)`` on global positions.
        return_lse: also return this rank's lse, (B, H, L / W) float32 (-inf on rows that see no key).
        strategy: "ring" (K/V around the ring) or "all_to_all" (Ulysses; H and Hkv divisible by W).
        backend: the local backend of "all_to_all" (any of selfattn.attention's); "auto" for "ring".
        timeout: seconds any transfer may wait for another rank (default :data:`DEFAULT_TIMEOUT_S`);
            past it, RuntimeError naming the rank that did not take part.

    Returns:
        out (B, H, L / W, Dv) in q's dtype, or (out, lse).

    Example:
        >>> out_local = sad.attention(q_local, k_local, v_local, layout="zigzag", causal=True)
    """
    g = _group(group, timeout)
    spec = _validate(q, k, v, g, layout, strategy, mask, causal, scale, dropout_p, score_mod, return_lse, backend)
    if spec.dropout_p > 0:
        spec.seed = _chunked.draw_seed()  # drawn where the single-process chunked call draws it
    _agree(g, spec, q, k, v)
    if spec.strategy == "all_to_all":
        out, lse = _all_to_all(g, spec, q, k, v)
        return (out, lse.float()) if return_lse else out  # type: ignore[union-attr]
    length = q.shape[2] * g.world
    chunk = length // _num_chunks(spec.layout, g.world)
    mask_all = spec.mask
    if spec.causal:
        mask_all = _masks.causal() if mask_all is None else _masks.causal() & mask_all
    spec.mask = mask_all
    ring = _Ring(g=g, spec=spec, length=length, chunk=chunk, batch=q.shape[0], heads=q.shape[1],
                 classes=_pair_classes(mask_all, length, chunk, q.device), stats=_STATS.get())
    ring.plan_tiles(q.device)
    ring.fused = (spec.dropout_p == 0 and (spec.score_mod is None or spec.score_mod.additive)
                  and _chunked.fused_block_available(q.device, q.shape[3], v.shape[3]))
    out, lse = _RingAttention.apply(q, k, v, ring)
    return (out, lse.float()) if return_lse else out

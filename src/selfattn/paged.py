"""``paged_attention()``: attention of packed queries over keys and values stored in pages.

A pool holds keys (P, S, Hkv, D) and values (P, S, Hkv, Dv): P pages of S tokens each, the paged
layout of flash-attn (``flash_attn_with_kvcache(..., block_table=)``) and vLLM. A page is one
contiguous (S, Hkv, D) block, so a sequence's pages taken in order are its packed keys. Sequence s
owns the pages ``block_table[s, :ceil(seqused_k[s] / S)]``: its token t lies in page
``block_table[s, t // S]`` at slot ``t % S``. Pages may be shared between sequences (a forked
prefix); entries past a sequence's last page are never read (any value, -1 by convention).

The call gathers each sequence's keys and values into packed (Tk, Hkv, D) tensors and makes one
:func:`selfattn.varlen_attention` call with ``cu_seqlens_k`` from ``seqused_k``. So every backend runs
it, with varlen's causal masks and windows (aligned bottom-right per sequence), softcap and sinks,
and autograd reaches q and the pools through the gather. The gather copies the keys and values
that the call reads, once per call.

One case takes another layout: when every sequence has the same small number of queries (at most
``PADDED_MAX_QUERIES``: a decode step, a few speculative tokens), one :func:`selfattn.attention` call
runs over the batch of N, keys (N, Hkv, L, D), with a (N, 1, nq, L) visibility mask (None when every
query sees every key). Varlen's batch of one would score every query against all N sequences' keys and
mask most of them (N^2 x L work for a decode step in SDPA's dense-mask kernel); the batch scores each
against its own (N x L). Sequences of one length are read in place where their pages allow: the keys
are cut into runs where some sequence's next page does not follow its last (:func:`_runs`), and a run
whose first pages are evenly spaced is one strided view of the pool (:func:`_view`). One run is one
call (one sequence; a batch prefilled together); several are one call each, merged through their lse
(a batch decoded after its prefill: each step's new pages interleave). At most ``RUNS_MAX`` calls: the
keys of the shorter runs, and of runs not evenly spaced, are gathered into one more part. Sequences of
different lengths are gathered padded to the longest. Every layout means the same mask, and
tests/test_paged.py holds each to the oracle.

A pool stored heads first, (Hkv, P, S, D) with ``k_pages`` its (P, S, Hkv, D) view (as
:class:`selfattn.PagedKVCache` keeps it), gives SDPA each head's keys of a run as contiguous rows;
flash-attn's contiguous (P, S, Hkv, D) pool works too, and SDPA reads its keys strided by Hkv x D.

Shape legend: N sequences, P pages, S page size (tokens per page), W block-table width (the most
pages one sequence may hold), Tq packed query tokens, Tk = sum(seqused_k) gathered keys, Hq/Hkv
heads, D/Dv head dims.
"""

from __future__ import annotations

import itertools
from typing import Literal, overload

import torch
from torch import Tensor

from . import functional as _functional
from ._call import FLOAT_DTYPES
from ._checks import check_sinks
from .masks.packed import check_cu_seqlens
from .varlen import (
    Causal,
    Window,
    _check_causal,
    _check_lengths,
    _check_window,
    check_qkv,
    softcap_mod,
    varlen_attention,
)

__all__ = ["PADDED_MAX_QUERIES", "RUNS_MAX", "attend", "check_block_table", "gather", "paged_attention"]

PADDED_MAX_QUERIES = 16  # up to this many queries per sequence, all sequences alike: the padded batch

_INT_DTYPES = (torch.int32, torch.int64)


def _check_pool(name: str, pool: object, layout: str) -> Tensor:
    if not isinstance(pool, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(pool).__name__}")
    if pool.dim() != 4 or 0 in pool.shape:
        raise ValueError(f"{name} must be 4-D {layout} (pages, tokens per page, heads, head dim), none of them 0, "
                         f"got shape {tuple(pool.shape)}; a (Tk, Hkv, D) tensor of packed keys goes to "
                         "selfattn.varlen_attention instead")
    if pool.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {pool.dtype}")
    return pool


def _check_pools(q: object, k_pages: object, v_pages: object) -> tuple[Tensor, Tensor]:
    if not isinstance(q, Tensor):
        raise TypeError(f"q must be a torch.Tensor (Tq, Hq, D), got {type(q).__name__}")
    kp = _check_pool("k_pages", k_pages, "(P, S, Hkv, D)")
    vp = _check_pool("v_pages", v_pages, "(P, S, Hkv, Dv)")
    if kp.shape[:3] != vp.shape[:3]:
        raise ValueError(f"k_pages and v_pages must have the same pages, page size and heads (P, S, Hkv), got "
                         f"{tuple(kp.shape[:3])} and {tuple(vp.shape[:3])}")
    if kp.dtype != q.dtype or vp.dtype != q.dtype:
        raise TypeError(f"q, k_pages and v_pages must share a dtype, got q {q.dtype}, k_pages {kp.dtype}, v_pages "
                        f"{vp.dtype}; cast q with .to(k_pages.dtype) (the pools are large: cast them once, if at all)")
    if kp.device != q.device or vp.device != q.device:
        raise ValueError(f"q, k_pages and v_pages must be on one device, got q {q.device}, k_pages {kp.device}, "
                         f"v_pages {vp.device}")
    return kp, vp


def _int_tensor(name: str, t: object, dims: str) -> Tensor:
    if not isinstance(t, Tensor) or t.dtype not in _INT_DTYPES:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"{name} must be an int32 or int64 tensor {dims}, got {got}; build it with "
                        "torch.tensor(..., dtype=torch.int32)")
    return t


def check_block_table(block_table: object, seqused_k: object, *, num_pages: int,
                      page_size: int) -> tuple[Tensor, Tensor]:
    """Check a block table (N, W) and the sequences' lengths (N,) against a pool of ``num_pages`` pages of
    ``page_size`` tokens; return both as int64 tensors. Every page a sequence uses, the first
    ``ceil(seqused_k[s] / page_size)`` entries of its row, must be a page of the pool; the entries
    after them are not read. The checks of the values are skipped while compiling (they read data)."""
    block_table = _int_tensor("block_table", block_table, "2-D (N, W)")
    seqused_k = _int_tensor("seqused_k", seqused_k, "1-D (N,)")
    if block_table.dim() != 2 or block_table.shape[0] == 0:
        raise ValueError(f"block_table must be 2-D (N, W) with N >= 1: row s lists the pages of sequence s in "
                         f"order, got shape {tuple(block_table.shape)}")
    if seqused_k.shape != (block_table.shape[0],):
        raise ValueError(f"seqused_k must be (N,) = ({block_table.shape[0]},), one length per row of block_table, "
                         f"got shape {tuple(seqused_k.shape)}")
    table = block_table.long()
    lengths = seqused_k.to(device=table.device, dtype=torch.int64)
    if torch.compiler.is_compiling():
        return table, lengths
    width = table.shape[1]
    used = (lengths + page_size - 1) // page_size  # pages each sequence reads
    in_use = torch.arange(width, device=table.device) < used[:, None]
    outside = in_use & ((table < 0) | (table >= num_pages))
    negative, too_long, bad_page = torch.stack([(lengths < 0).any(), (used > width).any(), outside.any()]).tolist()
    if negative:
        s = int((lengths < 0).nonzero()[0, 0])
        raise ValueError(f"seqused_k[{s}] is {int(lengths[s])}: a sequence's length is >= 0")
    if too_long:
        s = int((used > width).nonzero()[0, 0])
        raise ValueError(f"sequence {s} uses seqused_k[{s}] = {int(lengths[s])} tokens, which need {int(used[s])} "
                         f"pages of {page_size}, but block_table has only W = {width} columns; widen block_table "
                         f"to at least {int(used.max())} columns or shorten seqused_k")
    if bad_page:
        s, c = (int(i) for i in outside.nonzero()[0])
        raise ValueError(f"block_table[{s}, {c}] = {int(table[s, c])} is not a page of the pool: page indices run "
                         f"from 0 to {num_pages - 1} (k_pages.shape[0] = {num_pages}); sequence {s} reads its first "
                         f"{int(used[s])} entries")
    return table, lengths


def gather(k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seqused_k: Tensor,
           total: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The keys and values of N sequences packed from their pages: (k (Tk, Hkv, D), v (Tk, Hkv, Dv),
    cu_seqlens_k (N + 1,) int32). It trusts its input (:func:`check_block_table` checks it);
    ``total`` is Tk when the caller knows it (no device sync)."""
    device, s = k_pages.device, k_pages.shape[1]
    lengths = seqused_k.to(device=device, dtype=torch.int64)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    tk = int(cu[-1]) if total is None else total
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths, output_size=tk)  # (Tk,)
    t = torch.arange(tk, device=device) - cu[seq]  # each key's position in its sequence
    page, slot = block_table.to(device=device, dtype=torch.int64)[seq, t // s], t % s
    return _rows(k_pages, page, slot), _rows(v_pages, page, slot), cu.to(torch.int32)


def _rows(pages: Tensor, page: Tensor, slot: Tensor) -> Tensor:
    """``pages[page, slot]`` (Tk, H, D). A pool stored contiguously, tokens first (P, S, H, D) or heads first
    (H, P, S, D), is read as rows with one index_select (several times faster on the CPU than indexing two
    dims, or than index_select of 3-D rows); the heads-first result keeps each head's rows contiguous. Any
    other layout goes through that indexing."""
    p, s, h, d = pages.shape
    if pages.is_contiguous():
        return pages.view(p * s, h * d).index_select(0, page * s + slot).view(-1, h, d)
    heads = pages.permute(2, 0, 1, 3)
    if heads.is_contiguous():
        return heads.view(h, p * s, d).index_select(1, page * s + slot).permute(1, 0, 2)
    return pages[page, slot]


@overload
def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seqused_k: Tensor,
                    cu_seqlens_q: Tensor | None = ..., *, max_seqlen_q: int | None = ..., causal: Causal = ...,
                    window: Window = ..., scale: float | None = ..., dropout_p: float = ...,
                    softcap: float | None = ..., sinks: Tensor | None = ..., return_lse: Literal[False] = ...,
                    backend: str = ...) -> Tensor: ...
@overload
def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seqused_k: Tensor,
                    cu_seqlens_q: Tensor | None = ..., *, max_seqlen_q: int | None = ..., causal: Causal = ...,
                    window: Window = ..., scale: float | None = ..., dropout_p: float = ...,
                    softcap: float | None = ..., sinks: Tensor | None = ..., return_lse: Literal[True],
                    backend: str = ...) -> tuple[Tensor, Tensor]: ...
@overload
def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seqused_k: Tensor,
                    cu_seqlens_q: Tensor | None = ..., *, max_seqlen_q: int | None = ..., causal: Causal = ...,
                    window: Window = ..., scale: float | None = ..., dropout_p: float = ...,
                    softcap: float | None = ..., sinks: Tensor | None = ..., return_lse: bool,
                    backend: str = ...) -> Tensor | tuple[Tensor, Tensor]: ...
def paged_attention(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seqused_k: Tensor,
                    cu_seqlens_q: Tensor | None = None, *, max_seqlen_q: int | None = None, causal: Causal = False,
                    window: Window = None, scale: float | None = None, dropout_p: float = 0.0,
                    softcap: float | None = None, sinks: Tensor | None = None, return_lse: bool = False,
                    backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Attention of N sequences' packed queries over their keys and values in a paged pool.

    Sequence s has the queries ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of q and the ``seqused_k[s]``
    keys stored in its pages. Its queries are its last tokens: causal masks and windows are aligned
    to its bottom-right corner, as in :func:`selfattn.varlen_attention`, so a chunk of a prefill sees
    the keys before it. Drawn for 2 queries over 5 keys in pages of 2 (``block_table[s] = [4, 0, 7]``)::

        page:    4   4   0   0   7
        causal:  1   1   1   1   0
                 1   1   1   1   1

    Args:
        q: (Tq, Hq, D), Hq a multiple of Hkv.
        k_pages: (P, S, Hkv, D). v_pages: (P, S, Hkv, Dv). The dtype and device of q.
        block_table: int32/int64 (N, W): row s lists the pages of sequence s in order; only its first
            ``ceil(seqused_k[s] / S)`` entries are read.
        seqused_k: int32/int64 (N,): how many tokens of its pages each sequence uses.
        cu_seqlens_q: int32/int64 (N + 1,): 0, then the running total of the sequences' query counts,
            ending at Tq; None: one query per sequence (a decode step, Tq = N).
        max_seqlen_q, causal, window, scale, dropout_p, softcap, sinks, return_lse, backend: as in
            :func:`selfattn.varlen_attention` (``causal=True``: bottom-right within each sequence).

    Returns:
        out (Tq, Hq, Dv) in q's dtype, or (out, lse (Hq, Tq) float32). A query that sees no key gives 0.

    Example:
        >>> k_pages = v_pages = torch.randn(64, 16, 2, 64)             # 64 pages of 16 tokens
        >>> table = torch.tensor([[3, 9, -1], [5, -1, -1]], dtype=torch.int32)
        >>> used = torch.tensor([20, 7], dtype=torch.int32)             # 20 tokens in pages 3, 9; 7 in page 5
        >>> out = selfattn.paged_attention(torch.randn(2, 8, 64), k_pages, v_pages, table, used)   # (2, 8, 64)
    """
    kp, vp = _check_pools(q, k_pages, v_pages)
    table, lengths = check_block_table(block_table, seqused_k, num_pages=kp.shape[0], page_size=kp.shape[1])
    n = table.shape[0]
    if cu_seqlens_q is None:
        counts = [1] * n
        if q.dim() >= 1 and q.shape[0] != n:
            raise ValueError(f"without cu_seqlens_q each of the N = {n} sequences has one query, but q holds "
                             f"{q.shape[0]} (dim 0); pass cu_seqlens_q for several queries per sequence")
    else:
        cu = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q").tolist()
        if len(cu) != n + 1:
            raise ValueError(f"cu_seqlens_q describes {len(cu) - 1} sequences but block_table has N = {n} rows; "
                             "give one entry per sequence plus the leading 0")
        counts = [b - a for a, b in itertools.pairwise(cu)]
    return attend(q, kp, vp, table, lengths.tolist(), counts, max_seqlen_q=max_seqlen_q, causal=causal,
                  window=window, scale=scale, dropout_p=dropout_p, softcap=softcap, sinks=sinks,
                  return_lse=return_lse, backend=backend)


def attend(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, lengths: list[int], counts: list[int],
           *, max_seqlen_q: int | None = None, causal: Causal = False, window: Window = None,
           scale: float | None = None, dropout_p: float = 0.0, softcap: float | None = None,
           sinks: Tensor | None = None, return_lse: bool = False, backend: str = "auto",
           rows: list[list[int]] | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`paged_attention` once its block table is checked: sequence s has ``lengths[s]`` keys and
    ``counts[s]`` queries. The padded batch when every count is the same and at most
    ``PADDED_MAX_QUERIES``, else the packed gather and varlen. The gathered keys and values are cast to
    q's dtype (the caller allows another dtype only under autocast). ``rows``: the sequences' pages on
    the host, when the caller keeps them (the padded batch reads runs of consecutive pages in place, see
    :func:`_runs`); None: read from ``block_table`` when needed."""
    nq = counts[0]
    if len(set(counts)) == 1 and 0 < nq <= PADDED_MAX_QUERIES and max(lengths) > 0:
        return _padded(q, k_pages, v_pages, block_table, lengths, nq, rows, max_seqlen_q=max_seqlen_q,
                       causal=causal, window=window, scale=scale, dropout_p=dropout_p, softcap=softcap,
                       sinks=sinks, return_lse=return_lse, backend=backend)
    cu_q = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=k_pages.device)
    k, v, cu_k = gather(k_pages, v_pages, block_table, torch.tensor(lengths), total=sum(lengths))
    if isinstance(q, Tensor) and k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=max_seqlen_q, causal=causal, window=window,
                            scale=scale, dropout_p=dropout_p, softcap=softcap, sinks=sinks,
                            return_lse=return_lse, backend=backend)


RUNS_MAX = 4  # a decode step reads at most this many runs of pages in place; the rest is gathered


class _Part:
    """Keys and values (N, H, L, D) of one part of every sequence, and those keys' positions: (L,), or
    (lo, hi) for the range lo..hi - 1."""

    __slots__ = ("k", "positions", "v")

    def __init__(self, k: Tensor, v: Tensor, positions: Tensor | tuple[int, int]) -> None:
        self.k, self.v, self.positions = k, v, positions

    def position_tensor(self, device: torch.device) -> Tensor:
        if isinstance(self.positions, tuple):
            return torch.arange(*self.positions, device=device)
        return self.positions


def _runs(rows: list[list[int]], length: int, size: int) -> list[tuple[int, int, list[int]]]:
    """The keys [0, length) of N sequences of one length, cut where some sequence's next page does not
    follow its last one in the pool: (first key, end key, each sequence's page at the first key), so that
    every sequence holds each run in consecutive pages. Drawn for pages of 2, after a prefill of 4 tokens
    each and one decode step (the new pages interleave)::

        sequence 0:  pages 0 1 | 4        runs: keys 0-3 (first pages 0, 2), key 4 (first pages 4, 5)
        sequence 1:  pages 2 3 | 5
    """
    width = -(-length // size)
    cuts = {0, width}
    for r in rows:
        cuts.update(w for w in range(1, width) if r[w] != r[w - 1] + 1)
    edges = sorted(cuts)
    return [(a * size, min(b * size, length), [r[a] for r in rows]) for a, b in itertools.pairwise(edges)]


def _view(pages: Tensor, first: list[int], lo: int, hi: int) -> Tensor | None:
    """Keys lo..hi of N sequences as a (N, H, hi - lo, D) view of the pool, with no copy, when each holds them
    in consecutive pages from page ``first[n]`` (key lo at its slot ``lo % S``), the first pages are evenly
    spaced and the pool's pages lie end to end in memory. Else None."""
    _, s, h, d = pages.shape
    sp, ss, sh, sd = pages.stride()
    steps = {b - a for a, b in itertools.pairwise(first)}
    step = steps.pop() if len(steps) == 1 else 0
    if steps or step < 0 or sp != s * ss:
        return None
    offset = pages.storage_offset() + first[0] * sp + (lo % s) * ss
    return pages.as_strided((len(first), h, hi - lo, d), (step * sp, sh, ss, sd), offset)


def _parts(k_pages: Tensor, v_pages: Tensor, block_table: Tensor, rows: list[list[int]] | None, length: int,
           one_call: bool) -> list[_Part] | None:
    """N sequences of one length as parts to attend to separately: the runs of :func:`_runs` that
    :func:`_view` reads in place (the longest ``RUNS_MAX``, or ``RUNS_MAX - 1`` and one part gathered from
    the rest). None when nothing is read in place, or when ``one_call`` asks for a single call and the
    sequences are not one run."""
    device, s = k_pages.device, k_pages.shape[1]
    if rows is None:
        rows = block_table[:, : -(-length // s)].tolist()
    runs = [(lo, hi, vk, vv) for lo, hi, first in _runs(rows, length, s)
            if (vk := _view(k_pages, first, lo, hi)) is not None and (vv := _view(v_pages, first, lo, hi)) is not None]
    if not runs or (one_call and (len(runs) > 1 or runs[0][1] - runs[0][0] < length)):
        return None
    runs.sort(key=lambda r: r[0] - r[1])  # the longest first
    kept = runs[:RUNS_MAX] if len(runs) <= RUNS_MAX else runs[: RUNS_MAX - 1]
    parts = [_Part(vk, vv, (lo, hi)) for lo, hi, vk, vv in kept]
    if sum(hi - lo for lo, hi, *_ in kept) < length:  # the runs are disjoint: some keys are in none
        held = torch.ones(length, dtype=torch.bool)
        for lo, hi, *_ in kept:
            held[lo:hi] = False
        rest = held.nonzero()[:, 0].to(device)  # (R,) the keys no kept run holds, gathered
        n, r = len(rows), rest.numel()
        page = block_table.to(device=device, dtype=torch.int64)[:, rest // s].flatten()
        slot = (rest % s).repeat(n)
        k = _rows(k_pages, page, slot).view(n, r, *k_pages.shape[2:]).transpose(1, 2)
        v = _rows(v_pages, page, slot).view(n, r, *v_pages.shape[2:]).transpose(1, 2)
        parts.append(_Part(k, v, rest))
    return parts


def _merge(outs: list[Tensor], lses: list[Tensor], sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """One attention from attentions over disjoint parts of the keys: out (N, Hq, nq, Dv) and lse
    (N, Hq, nq) from each part's, the sinks (Hq,) joining the softmax's denominator once. A query that sees
    no key in any part gives 0 (and lse -inf, or the sink's logit)."""
    lse = torch.stack(lses)  # (parts, N, Hq, nq) float32
    terms = lse if sinks is None else torch.cat([lse, sinks.float()[None, None, :, None].expand_as(lse[:1])])
    total = torch.logsumexp(terms, dim=0)  # (N, Hq, nq)
    weights = torch.exp(lse - total).nan_to_num(0.0)  # a part's share; 0 where the query sees nothing at all
    out = (torch.stack(outs).float() * weights[..., None]).sum(0)
    return out.to(outs[0].dtype), total


def _padded(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, lengths: list[int], nq: int,
            rows: list[list[int]] | None, *, max_seqlen_q: int | None, causal: Causal, window: Window,
            scale: float | None, dropout_p: float, softcap: float | None, sinks: Tensor | None, return_lse: bool,
            backend: str) -> Tensor | tuple[Tensor, Tensor]:
    """N sequences of ``nq`` queries each as attention() over (N, Hkv, L, D) keys, with the packed mask's
    visibility as a (N, 1, nq, L) bool tensor (None when every query sees every key).

    Sequences of one length are read in place where their pages allow (:func:`_parts`): one call when
    each is one run of consecutive pages at evenly spaced first pages (one sequence; a batch prefilled
    together), else one call per part merged through their lse (a batch prefilled together, then decoded:
    the new pages interleave). A part's lse is float32 and differentiable in no backend here, and a forced
    backend may not return one, so under autograd, with dropout, in float64 or with a backend other than
    "auto" (unless the caller asks for the lse), only the single call reads in place. Otherwise the keys are
    gathered, padded to the longest sequence."""
    n, (_, s, hkv, d), dv = len(lengths), k_pages.shape, v_pages.shape[3]
    probes = [pool[0, :0].to(q.dtype) if isinstance(q, Tensor) else pool[0, :0] for pool in (k_pages, v_pages)]
    q = check_qkv(q, *probes)[0]  # varlen's errors for q against the pools' heads, head dims, dtype, device
    if max_seqlen_q is not None or q.shape[0] != n * nq:
        _check_lengths("cu_seqlens_q", torch.tensor([0, n * nq]), q.shape[0], "q", max_seqlen_q)
    left, right = _check_window(window)
    if _check_causal(causal):
        right = 0
    sinks = check_sinks(sinks, q.shape[1], q.device)  # the merge below adds them itself: checked here
    device, lmax, alike = k_pages.device, max(lengths), len(set(lengths)) == 1
    # one query a sequence, each sequence as long as the others, no left bound: it sees every key (a decode step)
    all_visible = alike and nq == 1 and left is None
    parts = None
    if alike:
        grads = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k_pages, v_pages, sinks))
        # an lse is float32 (it would round float64); a forced backend may not return one
        one_call = grads or dropout_p > 0 or q.dtype == torch.float64 or (backend != "auto" and not return_lse)
        parts = _parts(k_pages, v_pages, block_table, rows, lmax, one_call=one_call)
    if parts is None or not all_visible:
        used = torch.tensor(lengths, device=device)[:, None]  # (N, 1)
    if parts is None:
        j = torch.arange(lmax, device=device)  # (Lmax,)
        held = torch.minimum(j, (used - 1).clamp(min=0))  # (N, Lmax): past its end a sequence reads its last key
        # a sequence with no key reads any page (masked): its row may hold anything
        page = block_table.to(device=device, dtype=torch.int64).gather(1, held // s).clamp(0, k_pages.shape[0] - 1)
        k = _rows(k_pages, page.flatten(), (held % s).flatten()).view(n, lmax, hkv, d).transpose(1, 2)
        v = _rows(v_pages, page.flatten(), (held % s).flatten()).view(n, lmax, hkv, dv).transpose(1, 2)
        parts = [_Part(k, v, j)]
    if not all_visible:
        diag = torch.arange(nq, device=device) + used - nq  # (N, nq): the key on each query's diagonal
        hi = used if right is None else torch.minimum(diag + right + 1, used)
    qb = q.view(n, nq, *q.shape[1:]).transpose(1, 2)  # (N, Hq, nq, D)
    mod, one = softcap_mod(softcap), len(parts) == 1
    outs, lses = [], []
    for part in parts:
        k, v = part.k, part.v
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        mask = None
        if not all_visible:
            j = part.position_tensor(device)
            visible = j < hi[..., None]  # (N, nq | 1, L)
            if left is not None:
                visible = visible & (j >= (diag - left)[..., None])  # (N, nq, L)
            mask = None if bool(visible.all()) else visible.unsqueeze(1)  # (N, 1, nq, L)
        # an lse is asked for only when wanted: it narrows the backends that can run the call
        if one and not return_lse:
            outs.append(_functional.attention(qb, k, v, mask=mask, scale=scale, dropout_p=dropout_p, score_mod=mod,
                                              sinks=sinks, backend=backend))
            continue
        o, lse = _functional.attention(qb, k, v, mask=mask, scale=scale, dropout_p=dropout_p, score_mod=mod,
                                       sinks=sinks if one else None, return_lse=True, backend=backend)
        outs.append(o)
        lses.append(lse)
    if one:
        out4, lse3 = outs[0], lses[0] if lses else None
    else:
        out4, lse3 = _merge(outs, lses, sinks)
    out = out4.transpose(1, 2).reshape(n * nq, out4.shape[1], out4.shape[3])  # (Tq, Hq, Dv)
    if not return_lse:
        return out
    assert lse3 is not None
    return out, lse3.permute(1, 0, 2).reshape(lse3.shape[1], n * nq)  # (Hq, Tq)

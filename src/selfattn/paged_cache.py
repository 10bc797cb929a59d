"""A paged key/value cache: a pool of fixed-size pages shared by many sequences of any length.

Keys are read as a pool ``cache.k`` (P, S, G, D) and values as ``cache.v`` (P, S, G, Dv): P pages of S
tokens, the block-table layout of flash-attn's and vLLM's paged caches (:mod:`selfattn.paged`). They
are stored heads first, (G, P, S, D), and ``k``/``v`` are views of that storage: a run of consecutive
pages is then, for each head, one block of contiguous rows, which SDPA reads as fast as a
:class:`~selfattn.KVCache` (about 1.6x faster than keys strided by G x D). Each sequence has an id, a
length and a list of pages (its row of the block table); a sequence grows page by page as tokens are
appended, so memory follows the tokens actually held, not B x the longest sequence. A forked sequence
shares its parent's pages (reference counts); a shared page that is only partly filled is copied before
either side appends to it (copy-on-write), so neither sees the other's new tokens. Freed pages go back
to the pool.

The bookkeeping (ids, lengths, page lists, reference counts, the free list) is plain Python on the host;
the pool is on the cache's device. Reading goes through :func:`selfattn.paged.attend`: a decode step
reads runs of consecutive pages in place, other calls gather the sequences' pages into packed tensors
for :func:`selfattn.varlen_attention`. The cache is for inference: its writes are in place and
gradients through it are not supported (:func:`selfattn.paged_attention` itself is differentiable).

Shape legend: P pages, S page size (tokens per page), G kv heads, D/Dv head dims, N sequences in a
call, T new (packed) tokens, Tq packed queries, Hq query heads.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, overload

import torch
from torch import Tensor, nn

from .cache import check_fits
from .masks.packed import check_cu_seqlens
from .paged import attend, gather
from .varlen import Causal, Window

__all__ = ["PagedKVCache"]

_HOW = "PagedKVCache.for_module(module, num_pages=..., page_size=...) builds the cache a module needs"

SeqIds = Sequence[int] | Tensor


class _Book:
    """The host-side state: plain Python, so that a step updates it without ``nn.Module.__setattr__``."""

    __slots__ = ("free", "lengths", "next_id", "pages", "refs")

    def __init__(self, num_pages: int) -> None:
        self.pages: dict[int, list[int]] = {}  # live sequence id -> its pages, in order
        self.lengths: dict[int, int] = {}  # live sequence id -> tokens held
        self.refs = [0] * num_pages  # how many live sequences hold each page
        self.free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is taken first, freed pages next
        self.next_id = 0


class PagedKVCache(nn.Module):
    """Keys and values of many sequences in a pool of pages (non-persistent buffers: not saved in state dicts).

    Args:
        num_pages: P, the pages of the pool. page_size: S, tokens per page.
        num_kv_heads: G. head_dim: D. value_dim: Dv (default D).
        max_seq_len: the most tokens one sequence may hold (default P x S, the whole pool).
        dtype, device: of the pool.

    Example:
        >>> cache = PagedKVCache.for_module(mha, num_pages=256, page_size=16)     # mha's heads, dtype, device
        >>> a, b = cache.allocate(), cache.allocate()
        >>> cu = torch.tensor([0, 7, 10], dtype=torch.int32)                       # 7 tokens of a, 3 of b
        >>> y = mha(x_packed, cache=cache, seq_ids=[a, b], cu_seqlens=cu)          # x_packed (1, 10, E)
        >>> y = mha(next_tokens, cache=cache, seq_ids=[a, b])                      # (2, 1, E): one token each
        >>> c = cache.fork(a)                                                      # shares a's pages
    """

    @classmethod
    def for_module(cls, module: nn.Module, *, num_pages: int, page_size: int,
                   max_seq_len: int | None = None) -> PagedKVCache:
        """The cache of a :class:`~selfattn.MultiHeadAttention` (or any module with ``num_kv_heads`` and
        ``head_dim``): its kv heads and head dim, in the dtype and on the device of its weights.

        Example:
            >>> cache = PagedKVCache.for_module(mha, num_pages=1024, page_size=16)
        """
        try:
            heads, dim = int(module.num_kv_heads), int(module.head_dim)  # type: ignore[arg-type]
            weight = next(module.parameters())
        except (AttributeError, StopIteration):
            raise TypeError(f"PagedKVCache.for_module needs a module with num_kv_heads, head_dim and weights (a "
                            f"selfattn.MultiHeadAttention), got {type(module).__name__}") from None
        return cls(num_pages, page_size, heads, dim, max_seq_len=max_seq_len, dtype=weight.dtype,
                   device=weight.device)

    _k_heads: Tensor  # (G, P, S, D), a buffer
    _v_heads: Tensor  # (G, P, S, Dv), a buffer

    @property
    def k(self) -> Tensor:
        """The key pool (P, S, G, D), a view of storage laid out heads first (G, P, S, D)."""
        return self._k_heads.permute(1, 2, 0, 3)

    @property
    def v(self) -> Tensor:
        """The value pool (P, S, G, Dv), a view of storage laid out heads first (G, P, S, Dv)."""
        return self._v_heads.permute(1, 2, 0, 3)

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 value_dim: int | None = None, max_seq_len: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        value_dim = head_dim if value_dim is None else value_dim
        max_seq_len = num_pages * page_size if max_seq_len is None else max_seq_len
        sizes = dict(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     value_dim=value_dim, max_seq_len=max_seq_len)
        bad = {n: s for n, s in sizes.items() if isinstance(s, bool) or not isinstance(s, int) or s < 1}
        if bad:
            raise ValueError(f"PagedKVCache needs {', '.join(sizes)} to be ints >= 1, got "
                             + ", ".join(f"{n}={s!r}" for n, s in bad.items()))
        # stored heads first, (G, P, S, D): a run of consecutive pages is then, for each head, one block of
        # contiguous rows, the layout SDPA reads fastest (about 1.6x faster than (P, S, G, D) rows strided by
        # G x D); ``k`` and ``v`` are the (P, S, G, D) views of it
        self.register_buffer("_k_heads", torch.zeros(num_kv_heads, num_pages, page_size, head_dim, dtype=dtype,
                                                     device=device), persistent=False)
        self.register_buffer("_v_heads", torch.zeros(num_kv_heads, num_pages, page_size, value_dim, dtype=dtype,
                                                     device=device), persistent=False)
        self._max_seq_len = max_seq_len
        self._book = _Book(num_pages)

    # ---------------------------------------------------------------- what it holds

    @property
    def num_pages(self) -> int:
        return self._k_heads.shape[1]

    @property
    def page_size(self) -> int:
        return self._k_heads.shape[2]

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def num_free_pages(self) -> int:
        """Pages no sequence holds."""
        return len(self._book.free)

    @property
    def sequences(self) -> tuple[int, ...]:
        """The live sequence ids, in the order they were allocated."""
        return tuple(self._book.lengths)

    def length(self, seq_id: int) -> int:
        """How many tokens sequence ``seq_id`` holds."""
        return self._book.lengths[self._live(seq_id, "seq_id")]

    def pages(self, seq_id: int) -> tuple[int, ...]:
        """The pages of sequence ``seq_id``, in order (its block-table row)."""
        return tuple(self._book.pages[self._live(seq_id, "seq_id")])

    def refcount(self, page: int) -> int:
        """How many live sequences hold ``page`` (0: free)."""
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an int in 0..{self.num_pages - 1} (this pool has {self.num_pages} "
                             f"pages), got {page!r}")
        return self._book.refs[page]

    def block_table(self, seq_ids: SeqIds) -> Tensor:
        """int32 (N, W) on the cache's device, W = ceil(max_seq_len / S): row s lists the pages of
        ``seq_ids[s]``, then -1 (flash-attn's ``block_table``)."""
        ids = self.check_ids(seq_ids)
        width = -(-self._max_seq_len // self.page_size)
        return self._table(ids, width).to(torch.int32)

    def seqused_k(self, seq_ids: SeqIds) -> Tensor:
        """int32 (N,) on the cache's device: each sequence's length (flash-attn's ``seqused_k``)."""
        ids = self.check_ids(seq_ids)
        return torch.tensor([self._book.lengths[i] for i in ids], dtype=torch.int32, device=self.k.device)

    # ---------------------------------------------------------------- checks

    def check_fits(self, dtype: torch.dtype, device: torch.device, what: str) -> None:
        """Raise unless keys and values of ``dtype`` on ``device`` (from ``what``) can be stored here as they
        are: another device is a ValueError, another dtype a TypeError unless autocast is on for that device."""
        check_fits(self._k_heads, dtype, device, what, cache="PagedKVCache", how=_HOW)

    def _live(self, seq_id: object, name: str) -> int:
        if isinstance(seq_id, Tensor) and seq_id.dim() == 0 and not seq_id.dtype.is_floating_point \
                and seq_id.dtype != torch.bool:
            seq_id = int(seq_id)
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise TypeError(f"{name} must be a sequence id (an int that allocate() or fork() returned), got "
                            f"{type(seq_id).__name__} {seq_id!r}")
        if seq_id not in self._book.lengths:
            if 0 <= seq_id < self._book.next_id:
                raise ValueError(f"{name}: sequence {seq_id} was freed (its pages went back to the pool); allocate() "
                                 "a new one, or fork() a sequence before freeing it")
            live = list(self._book.lengths)
            shown = str(live) if len(live) <= 12 else f"{live[:12]} ... ({len(live)} in all)"
            raise ValueError(f"{name}: {seq_id} is not a sequence of this PagedKVCache (live ids: {shown}); use "
                             "the ids that allocate() and fork() return")
        return seq_id

    def check_ids(self, seq_ids: SeqIds) -> list[int]:
        """``seq_ids`` (a list or 1-D int tensor of live, distinct sequence ids) as a list; raises as
        :meth:`append` would."""
        if isinstance(seq_ids, Tensor):
            if seq_ids.dim() != 1 or seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool:
                raise TypeError(f"seq_ids must be a list of ints or a 1-D int tensor, got a {seq_ids.dtype} tensor of "
                                f"shape {tuple(seq_ids.shape)}")
            seq_ids = seq_ids.tolist()
        if isinstance(seq_ids, (int, str, bytes)) or not isinstance(seq_ids, Sequence):
            raise TypeError(f"seq_ids must be a list of sequence ids (one per sequence in the call), got "
                            f"{type(seq_ids).__name__} {seq_ids!r}; for one sequence pass [seq_id]")
        ids = [self._live(s, f"seq_ids[{i}]") for i, s in enumerate(seq_ids)]
        if not ids:
            raise ValueError("seq_ids is empty: name at least one sequence")
        if len(set(ids)) != len(ids):
            twice = next(s for s in ids if ids.count(s) > 1)
            raise ValueError(f"seq_ids names sequence {twice} more than once; give each sequence once, with all "
                             "its new tokens in its range of cu_seqlens")
        return ids

    def _counts(self, ids: list[int], cu_seqlens: Tensor | None, name: str) -> list[int]:
        """Tokens per sequence: from ``cu_seqlens`` (checked against ``ids``), or one each."""
        if cu_seqlens is None:
            return [1] * len(ids)
        if not isinstance(cu_seqlens, Tensor):
            raise TypeError(f"{name} must be None or an int32 tensor (N + 1,), got {type(cu_seqlens).__name__}")
        cu = check_cu_seqlens(cu_seqlens, name).tolist()
        if len(cu) != len(ids) + 1:
            raise ValueError(f"{name} describes {len(cu) - 1} sequences but seq_ids names {len(ids)}; give one entry "
                             "per sequence plus the leading 0")
        return [b - a for a, b in itertools.pairwise(cu)]

    def positions(self, seq_ids: SeqIds, cu_seqlens: Tensor | None = None) -> Tensor:
        """int64 (T,) on the cache's device: the positions that :meth:`append` with these arguments writes,
        each sequence's new tokens after its cached ones (for rotary embeddings)."""
        ids = self.check_ids(seq_ids)
        counts = self._counts(ids, cu_seqlens, "cu_seqlens")
        lengths = self._book.lengths
        return torch.tensor([p for s, n in zip(ids, counts, strict=True) for p in range(lengths[s], lengths[s] + n)],
                            dtype=torch.int64, device=self._k_heads.device)

    def _check_new(self, name: str, t: object, dim: int) -> Tensor:
        layout = f"(T, G, {'Dv' if name == 'v' else 'D'})"
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
        g = self._k_heads.shape[0]
        if t.dim() != 3 or t.shape[1:] != (g, dim):
            raise ValueError(f"{name} must be {layout} = (T, {g}, {dim}), the new tokens of every sequence packed "
                             f"along dim 0, got shape {tuple(t.shape)}")
        self.check_fits(t.dtype, t.device, name)
        return t

    # ---------------------------------------------------------------- sequences

    def allocate(self) -> int:
        """A new, empty sequence; returns its id (ids are never reused). It takes no page until tokens are
        appended."""
        book = self._book
        seq_id, book.next_id = book.next_id, book.next_id + 1
        book.pages[seq_id], book.lengths[seq_id] = [], 0
        return seq_id

    def fork(self, seq_id: int) -> int:
        """A new sequence holding the tokens of ``seq_id``: it shares all of its pages (no copy). A shared page
        that is partly filled is copied when either sequence appends to it, so each sees only its own new
        tokens."""
        parent = self._live(seq_id, "seq_id")
        book = self._book
        child = self.allocate()
        book.pages[child], book.lengths[child] = list(book.pages[parent]), book.lengths[parent]
        for p in book.pages[child]:
            book.refs[p] += 1
        return child

    def free(self, seq_id: int) -> None:
        """Forget sequence ``seq_id``: each of its pages that no other sequence holds goes back to the pool."""
        sid = self._live(seq_id, "seq_id")
        book = self._book
        self._release(book.pages.pop(sid))
        del book.lengths[sid]

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep only the first ``length`` tokens of sequence ``seq_id`` (rejected draft tokens, a retried
        step); the pages past them are released."""
        sid = self._live(seq_id, "seq_id")
        held = self._book.lengths[sid]
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= held:
            raise ValueError(f"length must be an int in 0..{held} (sequence {sid} holds {held} tokens), got "
                             f"{length!r}; truncate only shortens a sequence")
        pages = self._book.pages[sid]
        keep = -(-length // self.page_size)
        self._release(pages[keep:])
        del pages[keep:]
        self._book.lengths[sid] = length

    def reset(self) -> None:
        """Free every sequence (the pool is kept)."""
        next_id = self._book.next_id  # ids are never reused: the old ones now read as freed
        self._book = _Book(self.num_pages)
        self._book.next_id = next_id

    def _release(self, pages: list[int]) -> None:
        book = self._book
        for p in reversed(pages):  # the last page goes on top of the free stack last: reused first
            book.refs[p] -= 1
            if book.refs[p] == 0:
                book.free.append(p)

    # ---------------------------------------------------------------- write and read

    def append(self, seq_ids: SeqIds, k: Tensor, v: Tensor, cu_seqlens: Tensor | None = None) -> None:
        """Write new tokens after the cached ones of each sequence, for a mixed batch in one call: some
        sequences may get many tokens (a prefill or one chunk of it), others one (a decode step).

        Every argument and the room needed are checked before anything is written: a refused call leaves
        the pool, the lengths and the pages as they were.

        Args:
            seq_ids: N distinct live sequence ids (a list or a 1-D int tensor).
            k: (T, G, D), v: (T, G, Dv): the new tokens of every sequence, packed along dim 0, in the pool's
                dtype (another only under autocast) and on its device.
            cu_seqlens: int32/int64 (N + 1,): sequence ``seq_ids[s]`` gets tokens
                ``cu_seqlens[s]:cu_seqlens[s + 1]``; None: one token per sequence (T = N).

        Raises:
            ValueError: unknown or freed ids, shapes that do not fit the pool, a sequence that would pass
                ``max_seq_len``, or a pool without the free pages needed (the message says how many).
            TypeError: ids or tensors of the wrong type, k/v of another dtype than the pool.
        """
        ids = self.check_ids(seq_ids)
        k, v = self._check_new("k", k, self._k_heads.shape[3]), self._check_new("v", v, self._v_heads.shape[3])
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must hold the same tokens: k has T={k.shape[0]}, v has {v.shape[0]}")
        counts = self._counts(ids, cu_seqlens, "cu_seqlens")
        if (total := sum(counts)) != k.shape[0]:
            raise ValueError(f"cu_seqlens ends at {total} tokens but k holds {k.shape[0]} (dim 0); its last entry "
                             "must be the number of packed tokens" if cu_seqlens is not None else
                             f"without cu_seqlens each of the {len(ids)} sequences gets one token, but k holds "
                             f"{k.shape[0]}; pass cu_seqlens for several tokens per sequence")
        book, size = self._book, self.page_size
        grow, copies = 0, 0
        for s, n in zip(ids, counts, strict=True):
            held = book.lengths[s]
            if held + n > self._max_seq_len:
                raise ValueError(f"sequence {s} holds {held} tokens and would hold {held + n}, more than max_seq_len="
                                 f"{self._max_seq_len}; build the cache with a larger max_seq_len, or truncate or "
                                 "free the sequence")
            grow += -(-(held + n) // size) - len(book.pages[s])
            copies += int(n > 0 and self._shared_tail(s))
        if grow + copies > len(book.free):
            raise ValueError(f"PagedKVCache pool exhausted: this append needs {grow + copies} free pages ({grow} for "
                             f"new tokens, {copies} to copy shared pages before writing) but {len(book.free)} of "
                             f"{self.num_pages} are free; free() finished sequences, or build the cache with more "
                             "num_pages")
        kbuf, vbuf = self.k, self.v  # (P, S, G, D) views, for the copies of shared pages
        slots: list[int] = []
        for s, n in zip(ids, counts, strict=True):
            if n == 0:
                continue
            pages, held = book.pages[s], book.lengths[s]
            if self._shared_tail(s):  # copy-on-write: the other holders keep the old page as it is
                old, new = pages[-1], book.free.pop()
                kbuf[new, : held % size].copy_(kbuf[old, : held % size])
                vbuf[new, : held % size].copy_(vbuf[old, : held % size])
                book.refs[old] -= 1
                book.refs[new] = 1
                pages[-1] = new
            while len(pages) * size < held + n:
                page = book.free.pop()
                book.refs[page] = 1
                pages.append(page)
            slots += [pages[p // size] * size + p % size for p in range(held, held + n)]
            book.lengths[s] = held + n
        if slots:
            index = torch.tensor(slots, dtype=torch.int64, device=kbuf.device)
            for store, new_rows in ((self._k_heads, k), (self._v_heads, v)):  # (G, P * S, D) rows, (T, G, D) tokens
                store.view(store.shape[0], -1, store.shape[3]).index_copy_(1, index,
                                                                           new_rows.to(store.dtype).transpose(0, 1))

    def _shared_tail(self, seq_id: int) -> bool:
        """Whether the sequence's last page is partly filled and held by another sequence too."""
        pages, held = self._book.pages[seq_id], self._book.lengths[seq_id]
        return held % self.page_size != 0 and self._book.refs[pages[-1]] > 1

    def _table(self, ids: list[int], width: int | None = None) -> Tensor:
        """int64 (N, W): the pages of each sequence, then -1; W = the most pages among them by default."""
        rows = [self._book.pages[s] for s in ids]
        w = max(map(len, rows)) if width is None else width
        return torch.tensor([r + [-1] * (w - len(r)) for r in rows], dtype=torch.int64,
                            device=self._k_heads.device).view(len(rows), w)

    def gather(self, seq_ids: SeqIds) -> tuple[Tensor, Tensor, Tensor]:
        """The cached keys and values of the sequences, packed: (k (Tk, G, D), v (Tk, G, Dv), cu_seqlens_k
        (N + 1,) int32), Tk their total length; new tensors, in the order of ``seq_ids``."""
        ids = self.check_ids(seq_ids)
        lengths = [self._book.lengths[s] for s in ids]
        return gather(self.k, self.v, self._table(ids), torch.tensor(lengths), total=sum(lengths))

    @overload
    def attention(self, q: Tensor, seq_ids: SeqIds, cu_seqlens_q: Tensor | None = ..., *, causal: Causal = ...,
                  window: Window = ..., scale: float | None = ..., dropout_p: float = ...,
                  softcap: float | None = ..., sinks: Tensor | None = ..., return_lse: Literal[False] = ...,
                  backend: str = ...) -> Tensor: ...
    @overload
    def attention(self, q: Tensor, seq_ids: SeqIds, cu_seqlens_q: Tensor | None = ..., *, causal: Causal = ...,
                  window: Window = ..., scale: float | None = ..., dropout_p: float = ...,
                  softcap: float | None = ..., sinks: Tensor | None = ..., return_lse: Literal[True],
                  backend: str = ...) -> tuple[Tensor, Tensor]: ...
    @overload
    def attention(self, q: Tensor, seq_ids: SeqIds, cu_seqlens_q: Tensor | None = ..., *, causal: Causal = ...,
                  window: Window = ..., scale: float | None = ..., dropout_p: float = ...,
                  softcap: float | None = ..., sinks: Tensor | None = ..., return_lse: bool,
                  backend: str = ...) -> Tensor | tuple[Tensor, Tensor]: ...
    def attention(self, q: Tensor, seq_ids: SeqIds, cu_seqlens_q: Tensor | None = None, *, causal: Causal = True,
                  window: Window = None, scale: float | None = None, dropout_p: float = 0.0,
                  softcap: float | None = None, sinks: Tensor | None = None, return_lse: bool = False,
                  backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
        """Attention of packed queries over the cached tokens of their sequences.

        The queries of a sequence are its newest tokens (append them first): with ``causal`` (the default)
        each sees the sequence's tokens up to its own, bottom-right aligned, so a chunk of a prefill sees
        the chunks before it. When every sequence has the same few queries (a decode step), one
        :func:`selfattn.attention` call runs over them, reading runs of consecutive pages in place; else it
        gathers the sequences' pages and calls :func:`selfattn.varlen_attention` (:mod:`selfattn.paged`).

        Args:
            q: (Tq, Hq, D), Hq a multiple of G; the pool's dtype (another only under autocast).
            seq_ids: N distinct live sequence ids.
            cu_seqlens_q: int32/int64 (N + 1,): the queries of ``seq_ids[s]`` are
                ``q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]]``; None: one query per sequence (Tq = N).
            causal, window, scale, dropout_p, softcap, sinks, return_lse, backend: as in
                :func:`selfattn.varlen_attention`.

        Returns:
            out (Tq, Hq, Dv), or (out, lse (Hq, Tq) float32) with ``return_lse``.
        """
        ids = self.check_ids(seq_ids)
        if not isinstance(q, Tensor):
            raise TypeError(f"q must be a torch.Tensor (Tq, Hq, D), got {type(q).__name__}")
        if cu_seqlens_q is None and q.dim() >= 1 and q.shape[0] != len(ids):
            raise ValueError(f"without cu_seqlens_q each of the {len(ids)} sequences has one query, but q holds "
                             f"{q.shape[0]} (dim 0); pass cu_seqlens_q for several queries per sequence")
        counts = self._counts(ids, cu_seqlens_q, "cu_seqlens_q")
        kp, vp = self.k, self.v
        if q.dtype != kp.dtype or q.device != kp.device:
            self.check_fits(q.dtype, q.device, "q")
        lengths = [self._book.lengths[s] for s in ids]
        return attend(q, kp, vp, self._table(ids), lengths, counts, causal=causal, window=window, scale=scale,
                      dropout_p=dropout_p, softcap=softcap, sinks=sinks, return_lse=return_lse, backend=backend,
                      rows=[self._book.pages[s] for s in ids])

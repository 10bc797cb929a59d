"""PagedKVCache and paged_attention: paged decoding against the contiguous KVCache and the float64 oracle.

Shape legend: N sequences, P pages, S page size, G kv heads, D/Dv head dims, T packed tokens, E embed dim.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_qkv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import selfattn
from selfattn import KVCache, PagedKVCache, masks, testing
from selfattn.paged import gather


def _pair(e: int, h: int, g: int, rope: bool) -> tuple[selfattn.MultiHeadAttention, selfattn.MultiHeadAttention]:
    """A float32 module and its float64 twin with the same weights."""
    mha = selfattn.MultiHeadAttention(e, h, num_kv_heads=g, rope=rope).eval()
    mha64 = selfattn.MultiHeadAttention(e, h, num_kv_heads=g, rope=rope).double().eval()
    mha64.load_state_dict(mha.state_dict())
    return mha, mha64


def _state(cache: PagedKVCache) -> tuple:
    """Everything a refused call must leave as it was: the pool, the lengths, the pages, the counts, the free list."""
    book = cache._book
    return (cache.k.clone(), cache.v.clone(), {s: (book.lengths[s], list(book.pages[s])) for s in book.lengths},
            list(book.refs), list(book.free), book.next_id)


def _same_state(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:] == b[2:]


# steps of a mixed batch: sequence -> new tokens; sequences join late, prefill in chunks, skip steps
_SCHEDULE = [{0: 7}, {0: 5, 1: 9}, {0: 1, 1: 1, 2: 10}, {0: 1, 1: 1, 2: 1, 3: 5}, {0: 1, 2: 3, 3: 1},
             {1: 4, 3: 1}, {0: 1, 1: 1, 2: 1, 3: 1}]


@pytest.mark.parametrize("page_size,num_kv_heads,rope", [(1, 2, True), (3, 2, True), (16, 2, True), (3, 1, False)])
def test_paged_decoding_of_a_mixed_batch_equals_contiguous_cache_and_full_forward(page_size, num_kv_heads, rope):
    """catches: a chunked prefill that does not see its earlier chunks, tokens written to the wrong page or slot
    at a page boundary (page size 1, 3, 16), sequences of a mixed prefill + decode step seeing each other, RoPE
    positions not continuing from the cache, GQA/MQA heads mixed up; B = 1..4 sequences of different lengths."""
    torch.manual_seed(0)
    e, h = 32, 4
    mha, mha64 = _pair(e, h, num_kv_heads, rope)
    totals = [sum(step.get(s, 0) for step in _SCHEDULE) for s in range(4)]
    seqs = [torch.randn(n, e) for n in totals]
    paged = PagedKVCache.for_module(mha, num_pages=sum(-(-n // page_size) for n in totals) + 1, page_size=page_size)
    contiguous = KVCache.for_module(mha, batch_size=4, max_len=max(totals))
    ids: dict[int, int] = {}
    done = [0] * 4
    got_paged: list[list[Tensor]] = [[] for _ in range(4)]
    got_contiguous: list[list[Tensor]] = [[] for _ in range(4)]
    with torch.no_grad():
        for step in _SCHEDULE:
            for s in step:
                ids.setdefault(s, paged.allocate())
            order = list(step)
            x = torch.cat([seqs[s][done[s]:done[s] + step[s]] for s in order])[None]  # (1, T, E)
            cu = torch.tensor([0, *torch.tensor([step[s] for s in order]).cumsum(0).tolist()], dtype=torch.int32)
            y = mha(x, cache=paged, seq_ids=[ids[s] for s in order], cu_seqlens=cu)
            width = max(step.values())  # the same step for the contiguous cache: padded rows, -1 = padding
            xp, pos = torch.zeros(4, width, e), torch.full((4, width), -1)
            for s, n in step.items():
                xp[s, :n], pos[s, :n] = seqs[s][done[s]:done[s] + n], torch.arange(done[s], done[s] + n)
            yc = mha(xp, cache=contiguous, positions=pos)
            for i, s in enumerate(order):
                got_paged[s].append(y[0, int(cu[i]):int(cu[i + 1])])
                got_contiguous[s].append(yc[s, :step[s]])
                done[s] += step[s]
        assert paged.num_free_pages == 1
        for s in range(4):
            ref = mha64(seqs[s][None].double(), causal=True)[0]
            naive = mha(seqs[s][None], causal=True)[0]
            testing.assert_close_to_reference(torch.cat(got_paged[s]), ref, naive, name=f"sequence {s}, paged")
            testing.assert_close_to_reference(torch.cat(got_contiguous[s]), ref, naive, name=f"sequence {s}, KVCache")
            assert paged.length(ids[s]) == totals[s]


class _TinyLM(nn.Module):
    """Embedding, two MultiHeadAttention layers (rotary, GQA) with residuals, a head."""

    def __init__(self, vocab: int = 37, e: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, e), nn.Linear(e, vocab)
        self.layers = nn.ModuleList(selfattn.MultiHeadAttention(e, 4, num_kv_heads=2, rope=True) for _ in range(2))

    def forward(self, idx: Tensor, caches: list | None = None, **step: object) -> Tensor:
        x = self.embed(idx)
        for i, layer in enumerate(self.layers):
            x = x + (layer(x, causal=True) if caches is None else layer(x, cache=caches[i], **step))
        return self.head(x)


def test_greedy_decoding_with_a_paged_cache_equals_kv_cache_and_full_recompute():
    """catches: paged decoding of a model drifting from the contiguous cache or from recomputing every step (one
    cache per layer, sequences prefilled together, one joining while the others decode), float64."""
    torch.manual_seed(0)
    model = _TinyLM().double().eval()
    prompts = [torch.randint(0, 37, (n,)) for n in (5, 11, 2)]
    steps = 10
    with torch.no_grad():
        full, full_logits = [], []
        for p in prompts:  # the oracle: the whole sequence recomputed at every step
            idx = p[None]
            for _ in range(steps):
                logits = model(idx)[0, -1]
                idx = torch.cat([idx, logits.argmax()[None, None]], 1)
                full_logits.append(logits)
            full.append(idx[0, len(p):].tolist())
        contiguous = []
        for p in prompts:
            caches = [KVCache.for_module(layer, batch_size=1, max_len=len(p) + steps) for layer in model.layers]
            logits = model(p[None], caches, positions=torch.arange(len(p)))[0, -1]
            out = []
            for i in range(steps):
                out.append(int(logits.argmax()))
                logits = model(torch.tensor([[out[-1]]]), caches, positions=torch.tensor([len(p) + i]))[0, -1]
            contiguous.append(out)
        caches = [PagedKVCache.for_module(layer, num_pages=16, page_size=4) for layer in model.layers]
        ids = [caches[0].allocate() for _ in prompts]
        for c in caches[1:]:
            assert [c.allocate() for _ in prompts] == ids
        paged: list[list[int]] = [[], [], []]
        paged_logits: list[list[Tensor]] = [[], [], []]
        cu = torch.tensor([0, 5, 16], dtype=torch.int32)  # sequences 0 and 1 prefill together
        logits = model(torch.cat(prompts[:2])[None], caches, seq_ids=ids[:2], cu_seqlens=cu)[0]
        last = {0: logits[4], 1: logits[15]}
        for i in range(steps + 1):
            for s, lg in last.items():
                if len(paged[s]) < steps:
                    paged_logits[s].append(lg)
                    paged[s].append(int(lg.argmax()))
            active = [s for s in range(3) if len(paged[s]) < steps]
            if not active:
                break
            if i == 0:  # sequence 2's prefill in the same call as the others' first decode step
                x = torch.cat([torch.tensor([paged[0][-1], paged[1][-1]]), prompts[2]])[None]
                cu = torch.tensor([0, 1, 2, 4], dtype=torch.int32)
                logits = model(x, caches, seq_ids=ids, cu_seqlens=cu)[0]
                last = {0: logits[0], 1: logits[1], 2: logits[3]}
            else:
                x = torch.tensor([[paged[s][-1]] for s in active])  # (N, 1): one token per sequence
                logits = model(x, caches, seq_ids=[ids[s] for s in active])[:, 0]
                last = dict(zip(active, logits, strict=True))
    assert paged == contiguous == full
    ref = torch.stack(full_logits)
    got = torch.stack([lg for s in range(3) for lg in paged_logits[s]])
    testing.assert_close_to_reference(got, ref, ref, name="paged logits vs full recompute (float64)")


def _kv(n: int, g: int = 2, d: int = 5, seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, g, d, generator=gen, dtype=torch.float64), torch.randn(n, g, d, generator=gen,
                                                                                 dtype=torch.float64)


def _oracle(cache: PagedKVCache, seq: int, q: Tensor, k: Tensor, v: Tensor) -> None:
    """cache.attention of the last len(q) tokens of ``seq`` equals the float64 oracle over ``k``/``v``."""
    got = cache.attention(q, [seq], torch.tensor([0, q.shape[0]], dtype=torch.int32))
    ref = testing.reference_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                      causal="bottom_right")
    testing.assert_close_to_reference(got.transpose(0, 1)[None], ref, ref)


def test_fork_shares_pages_and_copies_the_shared_partial_page_on_write():
    """catches: a child's append written into a page its parent still reads (the parent's tokens changed), full
    shared pages copied for nothing, reference counts that free a page another sequence still holds."""
    cache = PagedKVCache(8, 4, 2, 5, dtype=torch.float64)
    parent = cache.allocate()
    k, v = _kv(6)
    cache.append([parent], k, v, torch.tensor([0, 6]))
    p0, p1 = cache.pages(parent)
    child = cache.fork(parent)
    assert cache.pages(child) == (p0, p1) and cache.refcount(p0) == cache.refcount(p1) == 2
    assert cache.num_free_pages == 6  # forking copies nothing
    kc, vc = _kv(3, seed=1)
    cache.append([child], kc, vc, torch.tensor([0, 3]))
    assert cache.pages(parent) == (p0, p1) and cache.pages(child)[0] == p0 and cache.pages(child)[1] != p1
    assert (cache.refcount(p0), cache.refcount(p1)) == (2, 1)
    kp, vp, _ = cache.gather([parent])
    assert torch.equal(kp, k) and torch.equal(vp, v)  # the parent's tokens are unchanged
    kch, vch, cu = cache.gather([child, parent])
    assert torch.equal(kch[:9], torch.cat([k, kc])) and torch.equal(vch[:9], torch.cat([v, vc]))
    assert cu.tolist() == [0, 9, 15]
    k1, v1 = _kv(1, seed=2)
    cache.append([parent], k1, v1)  # its last page is its own now: written in place
    assert cache.pages(parent) == (p0, p1) and cache.num_free_pages == 4
    assert torch.equal(cache.gather([child])[0], torch.cat([k, kc]))  # the child does not see it
    q = torch.randn(2, 4, 5, dtype=torch.float64)
    _oracle(cache, parent, q, torch.cat([k, k1]), torch.cat([v, v1]))
    _oracle(cache, child, q, torch.cat([k, kc]), torch.cat([v, vc]))
    full = cache.fork(child)  # the child's last page is full... after one more token
    cache.append([child], *_kv(1, seed=3))
    assert cache.length(child) == 10 and cache.length(full) == 9
    cache.free(child)
    cache.free(full)
    assert cache.refcount(p0) == 1 and cache.num_free_pages == 6
    cache.free(parent)
    assert cache.num_free_pages == 8 and all(cache.refcount(p) == 0 for p in range(8))


def test_fork_at_a_page_boundary_copies_nothing():
    """catches: copy-on-write of a full shared page (appends go to a new page: nothing to copy)."""
    cache = PagedKVCache(6, 3, 2, 5, dtype=torch.float64)
    a = cache.allocate()
    cache.append([a], *_kv(6), torch.tensor([0, 6]))
    b = cache.fork(a)
    cache.append([a, b], *_kv(2, seed=1))
    assert cache.pages(a)[:2] == cache.pages(b)[:2] and cache.pages(a)[2] != cache.pages(b)[2]
    assert cache.num_free_pages == 2


def test_freed_pages_are_reused_and_their_old_tokens_stay_invisible():
    """catches: pages not returned to the pool on free, a new sequence reading the stale tokens of the freed
    one left in its reused pages, a freed id accepted again."""
    cache = PagedKVCache(6, 3, 2, 5, dtype=torch.float64)
    a, b = cache.allocate(), cache.allocate()
    cache.append([a, b], *_kv(15), torch.tensor([0, 10, 15]))
    assert cache.num_free_pages == 0
    freed = set(cache.pages(a))
    cache.free(a)
    assert cache.num_free_pages == 4 and a not in cache.sequences
    c = cache.allocate()
    kc, vc = _kv(7, seed=5)
    cache.append([c], kc, vc, torch.tensor([0, 7]))
    assert set(cache.pages(c)) < freed
    _oracle(cache, c, torch.randn(3, 4, 5, dtype=torch.float64), kc, vc)
    with pytest.raises(ValueError, match=f"sequence {a} was freed"):
        cache.append([a], *_kv(1))
    cache.truncate(c, 2)  # rollback: the pages past 2 tokens go back
    assert cache.length(c) == 2 and len(cache.pages(c)) == 1 and cache.num_free_pages == 3
    cache.reset()
    assert cache.sequences == () and cache.num_free_pages == 6
    with pytest.raises(ValueError, match="was freed"):
        cache.length(b)


def _refusals(cache: PagedKVCache, a: int, b: int) -> list:
    """(call, exception, message) for every way an append or a cache operation is refused."""
    k, v = _kv(3)
    cu = torch.tensor([0, 2, 3])
    return [
        (lambda: cache.append([a, b], *_kv(17), torch.tensor([0, 8, 17])), ValueError,
         r"pool exhausted: this append needs 6 free pages \(5 for new tokens, 1 to copy shared pages before "
         r"writing\) but 5 of 8 are free"),
        (lambda: cache.append([a, b], *_kv(12), torch.tensor([0, 11, 12])), ValueError, "more than max_seq_len=12"),
        (lambda: cache.append([a, 99], k, v, cu), ValueError, r"seq_ids\[1\]: 99 is not a sequence"),
        (lambda: cache.append([a, a], k, v, cu), ValueError, "more than once"),
        (lambda: cache.append([], k, v, cu), ValueError, "empty"),
        (lambda: cache.append(a, k, v, cu), TypeError, r"pass \[seq_id\]"),
        (lambda: cache.append([True, b], k, v, cu), TypeError, "sequence id"),
        (lambda: cache.append([a, b], k.float(), v.float(), cu), TypeError, "holds torch.float64 .* k is "
         "torch.float32"),
        (lambda: cache.append([a, b], k.to("meta"), v.to("meta"), cu), ValueError, "on cpu but k is on meta"),
        (lambda: cache.append([a, b], k[:, :1], v[:, :1], cu), ValueError, r"\(T, G, D\) = \(T, 2, 5\)"),
        (lambda: cache.append([a, b], k, v[:, :, :4], cu), ValueError, r"v must be \(T, G, Dv\)"),
        (lambda: cache.append([a, b], k[0], v[0], cu), ValueError, "got shape"),
        (lambda: cache.append([a, b], k, v[:2], cu), ValueError, "same tokens"),
        (lambda: cache.append([a, b], k, v, torch.tensor([0, 2, 4])), ValueError, "ends at 4 tokens but k holds 3"),
        (lambda: cache.append([a, b], k, v, torch.tensor([0, 3])), ValueError, "describes 1 sequences"),
        (lambda: cache.append([a, b], k, v, torch.tensor([0.0, 2, 3])), TypeError, "int32 or int64"),
        (lambda: cache.append([a, b], k, v), ValueError, "one token, but k holds 3"),
        (lambda: cache.truncate(a, 9), ValueError, r"0\.\.4"),
        (lambda: cache.fork(7), ValueError, "not a sequence"),
        (lambda: cache.free("a"), TypeError, "sequence id"),
        (lambda: cache.attention(torch.randn(3, 4, 5, dtype=torch.float64), [a, b]), ValueError, "one query"),
        (lambda: cache.attention(torch.randn(2, 4, 5), [a, b]), TypeError, "q is torch.float32"),
    ]


def test_every_refused_call_names_the_problem_and_writes_nothing():
    """catches: a refused append that wrote some tokens or took pages before failing (pool exhausted half-way,
    one bad id among good ones), errors that do not say how many pages are needed and free, bad ids, shapes,
    dtypes and devices found only deep inside."""
    cache = PagedKVCache(8, 3, 2, 5, max_seq_len=12, dtype=torch.float64)
    a, b = cache.allocate(), cache.allocate()
    cache.append([a, b], *_kv(7), torch.tensor([0, 4, 7]))
    cache.fork(a)  # a's last page is shared: an append to a would copy it first
    for call, exc, match in _refusals(cache, a, b):
        before = _state(cache)
        with pytest.raises(exc, match=match):
            call()
        assert _same_state(before, _state(cache)), match


def test_constructor_and_lookups_refuse_bad_sizes():
    with pytest.raises(ValueError, match="page_size=0"):
        PagedKVCache(4, 0, 2, 8)
    with pytest.raises(ValueError, match="max_seq_len=-1"):
        PagedKVCache(4, 2, 2, 8, max_seq_len=-1)
    with pytest.raises(TypeError, match="num_kv_heads, head_dim"):
        PagedKVCache.for_module(nn.Linear(2, 2), num_pages=4, page_size=2)
    cache = PagedKVCache(4, 2, 2, 8)
    with pytest.raises(ValueError, match=r"0\.\.3"):
        cache.refcount(4)
    assert cache.state_dict() == {}


def _paged_call(cu_q: Tensor, cu_k: Tensor, page_size: int, backend: str, causal: bool,
                window: tuple[int, int] | None):
    """fn(q, k, v) -> paged_attention over k/v scattered into shuffled pages (plus unused ones), as
    check_against_reference calls it: (1, H, T, D) in and out."""
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    need = [-(-n // page_size) for n in lengths]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1)).tolist()
    rows, at = [], 0
    for n in need:
        rows.append(order[at:at + n] + [-1] * (max(need) + 1 - n))
        at += n
    table = torch.tensor(rows, dtype=torch.int32)
    slots = torch.tensor([rows[s][t // page_size] * page_size + t % page_size
                          for s, n in enumerate(lengths) for t in range(n)])

    def fn(q: Tensor, k: Tensor, v: Tensor, **_: object) -> Tensor:
        pools = [torch.zeros(num_pages * page_size, x.shape[1], x.shape[3], dtype=x.dtype).index_copy(
            0, slots, x[0].transpose(0, 1)).view(num_pages, page_size, x.shape[1], x.shape[3]) for x in (k, v)]
        out = selfattn.paged_attention(q[0].transpose(0, 1), *pools, table, torch.tensor(lengths), cu_q,
                                       causal=causal, window=window, backend=backend)
        return out.transpose(0, 1)[None]

    return fn


# queries per sequence: mixed (the packed gather and varlen), and alike (the padded batch): one each as
# when decoding, three each (more than the 2 keys of sequence 1; sequence 4 has no key)
_QUERIES = {"mixed": [3, 0, 20, 1, 3], "decode": [1] * 5, "three": [3] * 5}
_KEYS = {"mixed": [10, 2, 20, 37, 2], "decode": [10, 2, 20, 37, 0], "three": [10, 2, 20, 37, 0]}


@pytest.mark.parametrize("queries", list(_QUERIES))
@pytest.mark.parametrize("backend", ["reference", "sdpa", "chunked"])
@pytest.mark.parametrize("page_size,causal,window", [(1, True, None), (3, True, (4, -1)), (16, False, (2, 3))])
def test_paged_attention_matches_the_oracle_forward_and_backward(queries, backend, page_size, causal, window,
                                                                 small_tiles):
    """catches: keys read from the wrong page or slot (shuffled block tables, unused pages around), sequences
    seeing each other, causal or windows not bottom-right aligned per sequence (a chunk's queries over a longer
    prefix, a sequence with more queries than keys, an empty one), padded keys of the decode layout visible,
    gradients that do not reach q or the pools; GQA, D != Dv, in every backend."""
    counts, lengths = _QUERIES[queries], _KEYS[queries]
    cu_q = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = make_qkv(1, 4, 2, sum(counts), sum(lengths), 19, 11, seed=3)
    left = None if window is None or window[0] == -1 else window[0]
    right = 0 if causal else (None if window is None else window[1])
    fn = _paged_call(cu_q, cu_k, page_size, backend, causal, window)
    testing.check_against_reference(fn, q, k, v, mask=masks.packed(cu_q, cu_k, left=left, right=right),
                                    name=f"paged {backend}")


def test_padded_and_packed_layouts_give_the_same_attention_lse_sinks_and_softcap():
    """catches: the padded decode layout differing from the packed one it stands for: lse laid out (N, Hq, nq)
    instead of (Hq, Tq), sinks or softcap lost, a window's left bound counted from the padded end."""
    gen = torch.Generator().manual_seed(0)
    kp, vp = (torch.randn(12, 3, 2, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    table = torch.tensor([[7, 2, 9, -1], [0, -1, -1, -1], [4, 5, 6, 11]])
    used = torch.tensor([8, 2, 12])
    q = torch.randn(6, 4, 6, generator=gen, dtype=torch.float64)
    cu_q = torch.tensor([0, 2, 4, 6])
    kw = dict(causal=True, window=(3, 0), softcap=2.0, sinks=torch.randn(4, generator=gen, dtype=torch.float64),
              return_lse=True)
    out, lse = selfattn.paged_attention(q, kp, vp, table, used, cu_q, **kw)
    k, v, cu_k = gather(kp, vp, table, used)
    ref_out, ref_lse = selfattn.varlen_attention(q, k, v, cu_q, cu_k, **kw)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "chunked"])
def test_runs_read_in_place_and_merged_equal_the_packed_call(nq, backend, monkeypatch):
    """catches: the merge of runs read in place getting a mask, window, softcap, sink or lse wrong: a sink
    counted once per run, a window's left bound taken from the run instead of the sequence, the lse of
    one run returned, a part gathered from the wrong pages. Three sequences of 22 keys: a run of three
    pages each (evenly spaced), one page each (evenly spaced), two pages anywhere (gathered)."""
    from selfattn import paged as paged_module
    merged = []
    merge = paged_module._merge
    monkeypatch.setattr(paged_module, "_merge", lambda *a: merged.append(1) or merge(*a))
    gen = torch.Generator().manual_seed(0)
    kp, vp = (torch.randn(40, 4, 2, 8, generator=gen) for _ in range(2))
    table = torch.tensor([[3 * s, 3 * s + 1, 3 * s + 2, 20 + s, p, r] for s, (p, r) in
                          enumerate([(31, 12), (25, 38), (10, 33)])])
    used = torch.tensor([22, 22, 22])
    q = torch.randn(3 * nq, 4, 8, generator=gen)
    cu_q = torch.arange(4) * nq
    for kw in (dict(causal=True), dict(causal=True, window=(5, 0), softcap=2.0, return_lse=True,
                                       sinks=torch.randn(4, generator=gen)), dict(window=(3, 1), return_lse=True)):
        if backend == "sdpa":
            kw.pop("softcap", None)  # not additive: sdpa declines it
        out = selfattn.paged_attention(q, kp, vp, table, used, cu_q, backend=backend, **kw)
        k, v, cu_k = gather(kp, vp, table, used)
        kw64 = {n: (a.double() if isinstance(a, Tensor) else a) for n, a in kw.items()}
        want = selfattn.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, backend="reference", **kw64)
        for got, ref in zip(out if kw.get("return_lse") else [out], want if kw.get("return_lse") else [want],
                            strict=True):
            torch.testing.assert_close(got.double(), ref.double(), rtol=1e-5, atol=1e-5)
    assert len(merged) == (3 if backend == "auto" else 2)  # a forced backend merges only when lse is asked for


def test_paged_attention_refuses_bad_block_tables_and_pools():
    """catches: a page index past the pool or negative read as some other page (or an index error deep inside),
    lengths over the block table's capacity, pools of another dtype, device or shape than q."""
    kp = vp = torch.zeros(5, 4, 2, 8)
    q = torch.randn(2, 4, 8)
    table = torch.tensor([[0, 1, -1], [4, -1, -1]], dtype=torch.int32)
    used = torch.tensor([6, 3], dtype=torch.int32)
    selfattn.paged_attention(q, kp, vp, table, used)  # -1 past each sequence's pages is never read
    for args, exc, match in [
        ((q, kp, vp, torch.tensor([[0, 5, -1], [4, -1, -1]]), used), ValueError, r"block_table\[0, 1\] = 5 is not"),
        ((q, kp, vp, torch.tensor([[0, 1, -1], [-1, -1, -1]]), used), ValueError, r"block_table\[1, 0\] = -1"),
        ((q, kp, vp, table, torch.tensor([13, 3])), ValueError, "need 4 pages of 4, but block_table has only W = 3"),
        ((q, kp, vp, table, torch.tensor([6, -1])), ValueError, r"seqused_k\[1\] is -1"),
        ((q, kp, vp, table.float(), used), TypeError, "block_table must be an int32"),
        ((q, kp, vp, table[0], used), ValueError, "2-D"),
        ((q, kp, vp, table, used[:1]), ValueError, r"seqused_k must be \(N,\) = \(2,\)"),
        ((q, kp.double(), vp, table, used), TypeError, "share a dtype"),
        ((q, kp, vp[:, :2], table, used), ValueError, "same pages, page size and heads"),
        ((q, kp[0], vp, table, used), ValueError, "4-D"),
        ((q[:1], kp, vp, table, used), ValueError, "one query"),
    ]:
        with pytest.raises(exc, match=match):
            selfattn.paged_attention(*args)
    with pytest.raises(ValueError, match="describes 1 sequences"):
        selfattn.paged_attention(q, kp, vp, table, used, torch.tensor([0, 2]))


def test_module_refuses_paged_calls_it_cannot_run_and_writes_nothing():
    """catches: a paged call with positions, a mask or causal silently ignoring them, a bfloat16 module writing
    into a float32 pool before failing, seq_ids given without a PagedKVCache, rows and ids that do not match."""
    mha = selfattn.MultiHeadAttention(16, 2).eval()
    cache = PagedKVCache.for_module(mha, num_pages=4, page_size=2)
    a = cache.allocate()
    x = torch.randn(1, 3, 16)
    for kwargs, exc, match in [
        (dict(seq_ids=[a], x=torch.randn(1, 9, 16)), ValueError, "more than max_seq_len=8"),
        (dict(seq_ids=[a], positions=torch.arange(3)), ValueError, "don't pass positions"),
        (dict(seq_ids=[a], causal=True), ValueError, "don't pass"),
        (dict(seq_ids=[a], need_weights=True), ValueError, "no weights"),
        (dict(), ValueError, "needs seq_ids"),
        (dict(seq_ids=[a, cache.allocate()]), ValueError, "B = 1 rows"),
        (dict(seq_ids=[a], cu_seqlens=torch.tensor([0, 2])), ValueError, "ends at 2 tokens but x holds T = 3"),
    ]:
        before = _state(cache)
        with pytest.raises(exc, match=match), torch.no_grad():
            mha(kwargs.pop("x", x), cache=cache, **kwargs)
        assert _same_state(before, _state(cache))
    with pytest.raises(ValueError, match="with cu_seqlens, x must be"):
        mha(torch.randn(2, 3, 16), cache=cache, seq_ids=[a], cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="address the sequences of a PagedKVCache"):
        mha(x, cache=KVCache.for_module(mha, batch_size=1, max_len=4), positions=torch.arange(3), seq_ids=[a])
    bf16 = selfattn.MultiHeadAttention(16, 2).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"PagedKVCache\.for_module\(module, num_pages=\.\.\., page_size=\.\.\.\)"):
        bf16(x.bfloat16(), cache=cache, seq_ids=[a])
    assert cache.length(a) == 0 and not bool(cache.k.any())


def test_float32_paged_cache_under_autocast_is_accepted():
    """catches: the dtype checks refusing a float32 pool of a float32 module under autocast, where attention
    computes in the autocast dtype anyway."""
    mha = selfattn.MultiHeadAttention(16, 2).eval()
    cache = PagedKVCache.for_module(mha, num_pages=4, page_size=2)
    seq = cache.allocate()
    x = torch.randn(1, 3, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = mha(x, cache=cache, seq_ids=[seq])
    assert y.dtype == torch.bfloat16 and cache.length(seq) == 3 and cache.k.dtype == torch.float32


def test_block_table_and_seqused_k_are_flash_attn_shaped():
    """catches: a block table whose rows are not the sequences' pages in order, or lengths that do not match
    (both must drive paged_attention to the same result as the cache's own attention); a pool whose page and
    slot dims do not merge into one read through the wrong strides."""
    cache = PagedKVCache(10, 3, 2, 5, max_seq_len=12, dtype=torch.float64)
    a, b = cache.allocate(), cache.allocate()
    cache.append([b, a], *_kv(11), torch.tensor([0, 4, 11]))
    table, used = cache.block_table([a, b]), cache.seqused_k([a, b])
    assert table.dtype == used.dtype == torch.int32 and table.shape == (2, 4)
    assert table[0, :3].tolist() == list(cache.pages(a)) and table[0, 3] == -1 and used.tolist() == [7, 4]
    k, _, cu = gather(cache.k, cache.v, table, used)
    assert cu.tolist() == [0, 7, 11] and torch.equal(k, cache.gather([a, b])[0])
    q = torch.randn(2, 4, 5, dtype=torch.float64)
    torch.testing.assert_close(selfattn.paged_attention(q, cache.k, cache.v, table, used, causal=True),
                               cache.attention(q, [a, b]), rtol=0, atol=0)
    kt, vt = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (cache.k, cache.v))  # pages, slots not mergeable
    assert torch.equal(gather(kt, vt, table, used)[0], k)


def _reads(monkeypatch) -> dict[str, int]:
    """How many times the padded batch gathered keys or values (instead of reading them in place), and how
    many times it merged attentions over parts of the keys."""
    from selfattn import paged as paged_module
    seen = {"gathered": 0, "merged": 0}
    rows, merge = paged_module._rows, paged_module._merge

    def count(what: str, fn):
        def counted(*a):
            seen[what] += 1
            return fn(*a)
        return counted

    monkeypatch.setattr(paged_module, "_rows", count("gathered", rows))
    monkeypatch.setattr(paged_module, "_merge", count("merged", merge))
    return seen


# layout -> (gathers, merges): one strided view; runs of pages read in place and merged; pages out of order
_LAYOUTS = {"one sequence": (False, False), "prefilled together": (False, False), "forked": (False, False),
            "decoded after a prefill": (False, True), "interleaved": (False, True), "reused pages": (True, False),
            "long interleaved": (True, True), "different lengths": (True, False)}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_runs_of_consecutive_pages_are_read_in_place_and_the_rest_gathered(layout, monkeypatch):
    """catches: a decode step that copies out of its pages what it can read in place (the copy costs as
    much as the attention), that reads in place a layout it cannot (pages reused out of order, sequences
    of different lengths), or that merges the runs of pages wrongly (interleaved decode steps, more runs
    than RUNS_MAX): every layout must give each sequence's own attention."""
    torch.manual_seed(0)
    size, g, d, hq = 4, 2, 8, 4
    cache = PagedKVCache(48, size, g, d)
    n = 1 if layout == "one sequence" else 3
    ids = [cache.allocate() for _ in range(n)]
    if layout in ("interleaved", "long interleaved"):  # one token at a time, every sequence in turn: pages alternate
        for _ in range(10 if layout == "interleaved" else size * selfattn.paged.RUNS_MAX + 1):
            cache.append(ids, torch.randn(n, g, d), torch.randn(n, g, d))
    else:
        if layout == "reused pages":  # two finished sequences, freed in turn: their pages come back out of order
            gone = [cache.allocate(), cache.allocate()]
            cu = torch.tensor([0, 2 * size, 4 * size], dtype=torch.int32)
            cache.append(gone, torch.randn(4 * size, g, d), torch.randn(4 * size, g, d), cu)
            for s in gone:
                cache.free(s)
        held = [10, 7, 9] if layout == "different lengths" else [2 * size] * n
        cu = torch.tensor([0, *torch.tensor(held).cumsum(0).tolist()], dtype=torch.int32)
        cache.append(ids, torch.randn(sum(held), g, d), torch.randn(sum(held), g, d), cu)
        if layout == "decoded after a prefill":  # each new token starts a page: the pages interleave
            cache.append(ids, torch.randn(n, g, d), torch.randn(n, g, d))
    if layout == "forked":  # the copy shares the parent's pages: two sequences, the same first page
        ids = [ids[0], cache.fork(ids[0])]
    seen = _reads(monkeypatch)
    q = torch.randn(len(ids), hq, d)
    out = cache.attention(q, ids)
    assert (seen["gathered"] > 0, seen["merged"] > 0) == _LAYOUTS[layout]
    for row, s in enumerate(ids):
        k, v, _ = cache.gather([s])
        want = testing.reference_attention(q[row][None, :, None].double(), k.transpose(0, 1)[None].double(),
                                           v.transpose(0, 1)[None].double())
        torch.testing.assert_close(out[row].double(), want[0, :, 0], rtol=1e-5, atol=1e-6)


# ---- properties ----

@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_cache_histories_match_each_sequence_alone(data):
    """catches: any history of appends (prefills, decode steps in lockstep or not), forks and frees after
    which a step's attention differs from each sequence's own against the float64 oracle: pages read in
    place from the wrong offset, runs cut or merged wrongly, a sink or window counted per run, a freed
    page's old tokens read, a forked sequence seeing its sibling's new tokens."""
    size, g, d = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 2)), data.draw(st.sampled_from([4, 8]))
    hq = g * data.draw(st.integers(1, 2))
    cache = PagedKVCache(64, size, g, d)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    live: list[int] = []
    for _ in range(data.draw(st.integers(1, 8))):
        action = data.draw(st.sampled_from(["new", "new", "step", "together", "together", "fork", "free"]))
        if action == "new" or not live:
            live.append(cache.allocate())
        elif action == "fork":
            live.append(cache.fork(data.draw(st.sampled_from(live))))
        elif action == "free" and len(live) > 1:
            gone = data.draw(st.sampled_from(live))
            cache.free(gone)
            live.remove(gone)
        if action == "together":  # every sequence the same tokens: a batch prefilled or decoded in lockstep
            ids, counts = list(live), [data.draw(st.integers(1, 2 * size + 1))] * len(live)
        else:
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
            counts = data.draw(st.lists(st.integers(0, 2 * size + 1), min_size=len(ids), max_size=len(ids)))
        if sum(counts) + sum(cache.length(s) for s in live) > 64 * size // 2 or sum(counts) == 0:
            continue
        cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        cache.append(ids, torch.randn(sum(counts), g, d, generator=gen), torch.randn(sum(counts), g, d, generator=gen),
                     cu)
    ids = [s for s in live if cache.length(s) > 0]
    if not ids:
        return
    if data.draw(st.booleans()):  # the largest group of one length: the decode layout, read in place where it can
        groups: dict[int, list[int]] = {}
        for s in ids:
            groups.setdefault(cache.length(s), []).append(s)
        ids = max(groups.values(), key=len)
    nq = data.draw(st.integers(1, min(3, *(cache.length(s) for s in ids))))
    window = data.draw(st.sampled_from([None, (2, 0), (4, -1)]))
    softcap = data.draw(st.sampled_from([None, 3.0]))
    sinks = torch.randn(hq, generator=gen) if data.draw(st.booleans()) else None
    q = torch.randn(len(ids) * nq, hq, d, generator=gen)
    out, lse = cache.attention(q, ids, torch.arange(len(ids) + 1) * nq, window=window, softcap=softcap, sinks=sinks,
                               return_lse=True)
    for row, s in enumerate(ids):
        k, v, cu_k = cache.gather([s])
        rows = slice(row * nq, (row + 1) * nq)
        want, want_lse = selfattn.varlen_attention(
            q[rows].double(), k.double(), v.double(), torch.tensor([0, nq]), cu_k, causal=True, window=window,
            softcap=softcap, sinks=None if sinks is None else sinks.double(), return_lse=True, backend="reference")
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, rows].double(), want_lse.double(), rtol=1e-5, atol=1e-5)


def test_decode_reads_check_sinks_and_take_any_layout_or_backend_alike():
    """catches: the merged read accepting sinks of the wrong shape or dtype (or crashing on a list), a
    forced backend that cannot return lse failing on some page layouts only, a window without a right
    bound crashing with several queries, and a sequence with no key reading a page outside the pool."""
    gen = torch.Generator().manual_seed(0)
    kp, vp = torch.randn(6, 2, 2, 8, generator=gen), torch.randn(6, 2, 2, 8, generator=gen)
    used = torch.tensor([3, 3], dtype=torch.int32)
    q = torch.randn(2, 4, 8, generator=gen)
    for table in ([[0, 1], [2, 3]], [[0, 4], [2, 5]]):  # one run, two runs
        t = torch.tensor(table, dtype=torch.int32)
        with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\) = \(4,\)"):
            selfattn.paged_attention(q, kp, vp, t, used, sinks=torch.randn(2))
        with pytest.raises(TypeError, match="sinks must be a float tensor"):
            selfattn.paged_attention(q, kp, vp, t, used, sinks=torch.zeros(4, dtype=torch.int64))
        with pytest.raises(TypeError, match="sinks must be None or a float tensor"):
            selfattn.paged_attention(q, kp, vp, t, used, sinks=[0.0] * 4)
    # D != Dv: sdpa returns no lse, so a forced sdpa must run every layout as one call
    vp4 = torch.randn(6, 2, 2, 4, generator=gen)
    outs = [selfattn.paged_attention(q, kp, vp4, torch.tensor(t, dtype=torch.int32), used, backend="sdpa")
            for t in ([[0, 1], [2, 3]], [[0, 4], [2, 5]])]
    assert outs[0].shape == outs[1].shape == (2, 4, 4)
    # two queries a sequence, a window with no right bound, not causal
    t = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    q2 = torch.randn(4, 4, 8, generator=gen)
    got = selfattn.paged_attention(q2, kp, vp, t, torch.tensor([4, 4], dtype=torch.int32), cu, window=(1, -1))
    k, v, cu_k = gather(kp, vp, t, torch.tensor([4, 4]))
    torch.testing.assert_close(got, selfattn.varlen_attention(q2, k, v, cu, cu_k, window=(1, -1)))
    # a sequence with no key: whatever its row holds is never read
    out = selfattn.paged_attention(q, kp, vp, torch.tensor([[0, 1], [99, 99]], dtype=torch.int32),
                                   torch.tensor([3, 0], dtype=torch.int32))
    assert bool((out[1] == 0).all())

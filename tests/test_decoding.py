"""RoPE and cached decoding with a position per token."""

from __future__ import annotations

import math

import pytest
import torch

import selfattn
from selfattn import KVCache, rope, testing


def _complex_rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """The direct formulation: pair (x_i, x_{i+D/2}) is the complex number x_i + i x_{i+D/2},
    multiplied by e^{i pos theta_i}."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = z * torch.polar(torch.ones_like(theta), pos.double()[..., None] * theta)
    return torch.cat([z.real, z.imag], dim=-1)


def test_rope_matches_complex_formulation():
    """catches: interleaved vs half layout mixed up, or frequencies off by a factor of 2."""
    x = torch.randn(2, 3, 11, 16, dtype=torch.float64)
    pos = torch.tensor([[5, 0, 1, 2, 3, 4, 9, 7, 8, 100, 2000]] * 2)
    torch.testing.assert_close(rope(x, pos), _complex_rope(x, pos[:, None]))
    torch.testing.assert_close(rope(x, pos[0]), _complex_rope(x, pos[0]))


def test_rope_scores_depend_only_on_relative_position():
    """catches: a rotation that is not a rotation (scores changing under a common shift)."""
    q, k = torch.randn(1, 2, 8, 32, dtype=torch.float64), torch.randn(1, 2, 8, 32, dtype=torch.float64)
    pos = torch.arange(8)
    s0 = rope(q, pos) @ rope(k, pos).transpose(-1, -2)
    s1 = rope(q, pos + 37) @ rope(k, pos + 37).transpose(-1, -2)
    torch.testing.assert_close(s0, s1)


def test_rope_errors():
    with pytest.raises(ValueError, match="D even"):
        rope(torch.randn(1, 1, 4, 5), torch.arange(4))
    with pytest.raises(TypeError, match="integer"):
        rope(torch.randn(1, 1, 4, 4), torch.arange(4.0))
    with pytest.raises(ValueError, match="positions"):
        rope(torch.randn(1, 1, 4, 4), torch.arange(5))


def _full(mha, x):
    """Each sequence alone, full causal forward (the oracle's shape of the computation)."""
    return mha(x, causal=True, positions=torch.arange(x.shape[1]))


@pytest.mark.parametrize("num_kv_heads,use_rope", [(4, False), (2, True), (1, True)])
def test_cached_decoding_equals_full_forward(num_kv_heads, use_rope):
    """catches: a batch assumed to share one position, wrong cache slots, RoPE offsets lost after
    prefill, or GQA heads mismatched in the cache; prefill, 20 single steps and a 4-token step."""
    torch.manual_seed(0)
    e, h, steps = 64, 4, 20
    mha = selfattn.MultiHeadAttention(e, h, num_kv_heads=num_kv_heads, rope=use_rope).eval()
    mha64 = selfattn.MultiHeadAttention(e, h, num_kv_heads=num_kv_heads, rope=use_rope).double().eval()
    mha64.load_state_dict(mha.state_dict())
    prompt_lens = [9, 4, 6]
    total = max(prompt_lens) + steps + 4
    seqs = [torch.randn(1, n + steps + 4, e) for n in prompt_lens]
    b = len(seqs)
    cache = KVCache(b, total + 2, num_kv_heads, e // h)
    got = [[] for _ in range(b)]
    # prefill: right-padded to the longest prompt; pads get position -1
    width = max(prompt_lens)
    x = torch.zeros(b, width, e)
    pos = torch.full((b, width), -1)
    for i, n in enumerate(prompt_lens):
        x[i, :n] = seqs[i][0, :n]
        pos[i, :n] = torch.arange(n)
    with torch.no_grad():
        y = mha(x, cache=cache, positions=pos)
    pad_out = y[1, prompt_lens[1]:]  # padding sees nothing: attention output 0, so only the projection bias
    torch.testing.assert_close(pad_out, mha.proj.bias.expand_as(pad_out))
    for i, n in enumerate(prompt_lens):
        got[i].append(y[i, :n])
    # single-token steps: every sequence at its own position
    lengths = list(prompt_lens)
    for _ in range(steps):
        x = torch.stack([seqs[i][0, lengths[i]] for i in range(b)])[:, None]
        with torch.no_grad():
            y = mha(x, cache=cache, positions=torch.tensor(lengths)[:, None])
        for i in range(b):
            got[i].append(y[i])
            lengths[i] += 1
    # a 4-token (speculative) step
    x = torch.stack([seqs[i][0, lengths[i]:lengths[i] + 4] for i in range(b)])
    pos = torch.stack([torch.arange(n, n + 4) for n in lengths])
    with torch.no_grad():
        y = mha(x, cache=cache, positions=pos)
    for i in range(b):
        got[i].append(y[i])
    for i in range(b):
        cached = torch.cat(got[i])
        with torch.no_grad():
            full = _full(mha, seqs[i])[0]
            ref = _full(mha64, seqs[i].double())[0]
        testing.assert_close_to_reference(cached, ref, full, name=f"sequence {i}: cached vs full forward")


def test_cache_errors():
    mha = selfattn.MultiHeadAttention(32, 4)
    cache = KVCache(2, 8, 4, 8)
    x = torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match="positions"):
        mha(x, cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        mha(x, cache=cache, positions=torch.tensor([[6, 7, 8], [0, 1, 2]]))
    with pytest.raises(ValueError, match="causal"):
        mha(x, cache=cache, positions=torch.arange(3).expand(2, 3), causal=True)
    with pytest.raises(ValueError, match="do not fit"):
        KVCache(2, 8, 2, 8).update(torch.zeros(2, 1, dtype=torch.long), torch.randn(2, 4, 1, 8),
                                   torch.randn(2, 4, 1, 8))


def test_cache_buffers_are_not_persistent():
    cache = KVCache(1, 4, 1, 2)
    assert cache.state_dict() == {}
    assert math.prod(cache.k.shape) == 8


def test_tiny_gpt_quick_trains_and_cached_generation_matches():
    """catches: a model built from selfattn modules that does not learn, or KV-cache generation
    that drifts from recomputing the whole sequence."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "tiny_gpt.py"
    spec = importlib.util.spec_from_file_location("tiny_gpt", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    summary = mod.main(["--quick", "--steps", "60"])
    assert summary["loss_last10"] < 0.8 * summary["loss_first10"]
    assert summary["cached_equals_uncached"]


def test_serve_example_batches_requests_and_each_equals_generating_it_alone():
    """catches: continuous batching over a PagedKVCache (prefill chunks and decode tokens of requests
    arriving at different steps, packed in one call; pages freed and reused) giving a request other
    tokens than generating it alone."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "serve.py"
    spec = importlib.util.spec_from_file_location("serve_example", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        # a pool of 24 pages holds at most 2-3 requests: admission waits for pages to be freed
        summary = mod.main(["--requests", "10", "--step-tokens", "48", "--pages", "24", "--page-size", "8"])
    finally:
        sys.modules.pop(spec.name)
        sys.path.remove(str(path.parent))
    assert summary["equal_to_alone"]
    assert summary["peak_running"] > 1 and summary["peak_pages"] <= 24
    assert summary["packed_tokens"] > summary["steps"]  # steps packed more than one token

def test_batch_decoding_in_step_with_rollback_and_divergence_equals_full_forward():
    """catches: the fast path of a batch that writes one run of slots (no per-slot marks while it
    extends the prefix every sequence fills) losing track of what is written once the batch
    stops moving in step: a rollback to an earlier position, then sequences at different
    positions, must still see exactly their own tokens at positions <= their own."""
    torch.manual_seed(0)
    e, h, b = 32, 4, 2
    mha = selfattn.MultiHeadAttention(e, h, num_kv_heads=2).eval()
    seqs = torch.randn(b, 16, e)
    cache = KVCache(b, 16, 2, e // h)
    with torch.no_grad():
        mha(seqs[:, :6], cache=cache, positions=torch.arange(6).expand(b, 6))   # prefill, in step
        for p in range(6, 9):                                                    # steps, in step
            mha(seqs[:, p:p + 1], cache=cache, positions=torch.full((b, 1), p))
        assert cache.written.all(-1).tolist() == [False, False] and cache.written[:, :9].all()
        y = mha(seqs[:, 7:8], cache=cache, positions=torch.full((b, 1), 7))     # rollback: slot 8 is stale
        full = mha(seqs[:, :8], causal=True)
        torch.testing.assert_close(y, full[:, 7:8])
        # diverge: sequence 0 moves on from 8, sequence 1 rewrites 8 with another token
        other = torch.randn(b, 1, e)
        y = mha(torch.cat([seqs[:1, 8:9], other[1:]]), cache=cache, positions=torch.tensor([[8], [8]]))
        torch.testing.assert_close(y[:1], mha(seqs[:1, :9], causal=True)[:, 8:9])
        torch.testing.assert_close(y[1:], mha(torch.cat([seqs[1:, :8], other[1:]], 1), causal=True)[:, 8:9])
        y = mha(seqs[:, 9:10], cache=cache, positions=torch.tensor([[9], [-1]]))  # sequence 1 pads this step
        torch.testing.assert_close(y[:1], mha(seqs[:1, :10], causal=True)[:, 9:10])
        torch.testing.assert_close(y[1:], mha.proj.bias.expand(1, 1, e))           # padding sees nothing
        assert cache.written[:, :10].tolist() == [[True] * 10, [True] * 9 + [False]]
    cache.reset()
    assert not cache.written.any()


def test_cache_of_another_dtype_is_refused_before_anything_is_written():
    """catches: a bfloat16 module given a default float32 cache writing the new keys into the cache
    and then failing in attention with "cast them with .to(q.dtype)", which a user cannot act on."""
    mha = selfattn.MultiHeadAttention(32, 4).to(torch.bfloat16)
    cache = KVCache(2, 8, 4, 8)  # float32, the default
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"KVCache\.for_module\(module, batch_size=\.\.\., max_len=\.\.\.\).*dtype"):
        mha(x, cache=cache, positions=torch.arange(3))
    assert not bool(cache.written.any()) and not bool(cache.k.any()) and not bool(cache.v.any())
    with pytest.raises(TypeError, match=r"KVCache\.for_module"):  # the cache itself refuses, before writing
        cache.update(torch.arange(3).expand(2, 3), torch.randn(2, 4, 3, 8, dtype=torch.bfloat16),
                     torch.randn(2, 4, 3, 8, dtype=torch.bfloat16))
    assert not bool(cache.written.any()) and not bool(cache.k.any())
    right = KVCache.for_module(mha, batch_size=2, max_len=8)
    assert (right.k.dtype, right.k.shape) == (torch.bfloat16, (2, 4, 8, 8))
    torch.testing.assert_close(mha(x, cache=right, positions=torch.arange(3)), mha(x, causal=True))


def test_float32_cache_under_autocast_is_still_accepted():
    """catches: the dtype check refusing a float32 cache of a float32 module run under autocast,
    where attention casts the cached keys to the autocast dtype anyway."""
    mha = selfattn.MultiHeadAttention(32, 4)
    cache = KVCache.for_module(mha, batch_size=2, max_len=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mha(torch.randn(2, 3, 32), cache=cache, positions=torch.arange(3))
    assert y.dtype == torch.bfloat16 and bool(cache.written[:, :3].all())


def test_positions_other_than_slots_and_padding_are_refused_before_anything_is_written():
    """catches: any negative position taken as padding (only -1 is), a row writing one slot twice in an
    update (which write wins is undefined), both accepted silently, and bool positions failing deep inside."""
    cache = KVCache(2, 8, 2, 4)
    k = torch.randn(2, 2, 3, 4)
    for positions, match in (([[0, 1, 2], [-2, 0, 1]], "-2"), ([[0, 1, 1], [0, 1, 2]], "slot 1 more than once")):
        with pytest.raises(ValueError, match=match):
            cache.update(torch.tensor(positions), k, k)
        assert not bool(cache.written.any()) and not bool(cache.k.any())
    mha = selfattn.MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match="more than once"):
        mha(torch.randn(1, 2, 16), cache=KVCache.for_module(mha, batch_size=1, max_len=4),
            positions=torch.tensor([[3, 3]]))
    with pytest.raises(ValueError, match="int tensor"):
        cache.update(torch.ones(2, 3, dtype=torch.bool), k, k)
    cache.update(torch.tensor([[-1, 0, 1], [0, 1, 2]]), k, k)  # -1 is padding, still accepted
    assert cache.written[0, :2].all() and not cache.written[0, 2]

"""``deterministic=``: the same bits on every run and thread count, and dispatch honouring the flag.

On the CPU every backend is deterministic, so the bit-for-bit tests run each call at several thread
counts (1, 2, 3: the work is split differently each time) and compare the output and every gradient
with ``torch.equal``. Off the CPU the kernels that cannot promise it are only reachable here through
their declared reasons (no GPU in the default suite): those tests build calls on the meta device or
patch a backend's reason.

Shape legend: B batch, H heads, Hkv kv heads, L length, D head dim.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import selfattn
from selfattn import masks, scores
from selfattn._call import AttentionCall
from selfattn.backends import REGISTRY, dispatch
from selfattn.backends import sdpa as sdpa_module
from selfattn.backends.chunked import options
from selfattn.backends.chunked.loops import deterministic_algorithms

THREADS = (1, 2, 3)
B, H, HKV, L, D = 2, 4, 2, 96, 16


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _torch_mode():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _t5_table() -> tuple[torch.Tensor, scores.ScoreMod]:
    """A learned (buckets, H) table read through a bucket of i - j, as T5 does."""
    table = torch.randn(16, H, generator=torch.Generator().manual_seed(5), requires_grad=True)

    def t5(score, b, h, i, j):
        bucket = (i - j).clamp(-8, 7) + 8
        return score + table[bucket, h]
    return table, scores.custom(t5, additive=True)


def _run(case: str, backend: str, deterministic: bool = True) -> list[torch.Tensor]:
    """One call of ``case`` (fresh inputs from a fixed seed): [out, every gradient]."""
    g = torch.Generator().manual_seed(0)
    gqa = case == "gqa"
    q = torch.randn(B, H, L, D, generator=g, requires_grad=True)
    k = torch.randn(B, HKV if gqa else H, L, D, generator=g, requires_grad=True)
    v = torch.randn(B, HKV if gqa else H, L, D, generator=g, requires_grad=True)
    dout = torch.randn(B, H, L, D, generator=g)
    kw: dict = {}
    extra: list[torch.Tensor] = []
    if case == "causal":
        kw["causal"] = True
    elif case == "padding":
        kw["mask"] = masks.padding(torch.tensor([L, L // 3]))
    elif case == "bias":
        kw["bias"] = torch.randn(1, H, L, L, generator=g, requires_grad=True)
        extra.append(kw["bias"])
    elif case == "t5":
        table, kw["score_mod"] = _t5_table()
        extra.append(table)
    elif case == "sinks":
        kw["sinks"] = torch.randn(H, generator=g, requires_grad=True)
        kw["causal"] = True
        extra.append(kw["sinks"])
    elif case == "dropout":
        torch.manual_seed(11)
        kw["dropout_p"] = 0.3
    out = selfattn.attention(q, k, v, backend=backend, deterministic=deterministic, **kw)
    grads = torch.autograd.grad(out, [q, k, v, *extra], dout)
    return [out.detach(), *grads]


CASES = ("plain", "causal", "gqa", "padding", "bias", "t5", "sinks", "dropout")
RUNS = [(c, b) for c in CASES for b in ("reference", "sdpa", "chunked", "chunked-fused")
        if not (b == "sdpa" and c == "sinks") and not (b == "chunked-fused" and c in ("bias", "t5", "dropout"))]


@pytest.mark.parametrize(("case", "backend"), RUNS, ids=[f"{c}-{b}" for c, b in RUNS])
def test_same_bits_at_every_thread_count(case, backend):
    """catches: a backend whose forward or backward reduces in an order that depends on the thread count
    or on the run (a parallel sum over key blocks, a Python set of blocks, an unseeded draw)."""
    name, kernel = ("chunked", "fused") if backend == "chunked-fused" else (backend, "math")
    # a learned table's gradient by autograd (reference, sdpa) is deterministic only in torch's mode
    mode = _torch_mode() if case == "t5" and name != "chunked" else contextlib.nullcontext()
    with options(kernel=kernel) if name == "chunked" else contextlib.nullcontext(), mode:
        runs = []
        for n in THREADS:
            with _threads(n):
                runs.append(_run(case, name))
    first = runs[0]
    for n, other in zip(THREADS[1:], runs[1:], strict=True):
        for i, (a, b) in enumerate(zip(first, other, strict=True)):
            assert torch.equal(a, b), f"{case} on {backend}: tensor {i} differs between 1 and {n} threads"


def test_a_learned_table_by_autograd_needs_torch_mode():
    """catches: reference or sdpa claiming the same bits for a T5 table's gradient, which autograd computes
    with indexing's backward (accumulated in any order across threads unless torch's mode is on); auto
    must then take chunked, whose backward runs that part in torch's mode itself."""
    _, t5 = _t5_table()
    q = k = v = torch.randn(1, H, 16, D, requires_grad=True)
    for name in ("reference", "sdpa"):
        with pytest.raises(ValueError, match=r"deterministic=True, but .*use_deterministic_algorithms\(True\)"):
            selfattn.attention(q, k, v, score_mod=t5, backend=name, deterministic=True)
    assert selfattn.explain(q, k, v, score_mod=t5, deterministic=True).backend == "chunked"
    assert selfattn.explain(q, k, v, score_mod=t5).determinism.startswith("not deterministic")
    with _torch_mode():
        assert selfattn.explain(q, k, v, score_mod=t5, backend="reference").determinism.startswith("deterministic")
    with torch.no_grad():
        assert selfattn.explain(q, k, v, score_mod=t5, backend="reference", deterministic=True).backend == "reference"


def test_varlen_same_bits_at_every_thread_count():
    """catches: the packed path (one fused call per sequence, or chunked's tiles) differing across threads."""
    cu = torch.tensor([0, 40, 41, 130, 200], dtype=torch.int32)
    got = []
    for n in THREADS:
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(200, H, D, generator=g, requires_grad=True) for _ in range(3))
        with _threads(n):
            out = selfattn.varlen_attention(q, k, v, cu, causal=True, deterministic=True)
            got.append([out.detach(), *torch.autograd.grad(out.sum(), (q, k, v))])
    for other in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[0], other, strict=True))


def test_flag_is_checked_and_defaults_to_torch_mode():
    """catches: a flag that accepts anything, or a default that ignores torch.use_deterministic_algorithms."""
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="deterministic must be True, False or None"):
        selfattn.attention(q, k, v, deterministic="yes")  # type: ignore[arg-type]
    seen = []
    real = dispatch.choose

    def spy(call, *args, **kwargs):
        seen.append(call.deterministic)
        return real(call, *args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "choose", spy)
        selfattn.attention(q, k, v, causal=True)
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            selfattn.attention(q, k, v, causal=True)
            selfattn.attention(q, k, v, causal=True, deterministic=False)
        finally:
            torch.use_deterministic_algorithms(before)
    assert seen == [False, True, False]


def _meta_call(**kw) -> AttentionCall:
    q = torch.empty(1, 2, 8, 4, device="meta", requires_grad=True)
    return AttentionCall(q=q, k=q, v=q, mask=None, bias=None, scale=0.5, dropout_p=0.0, return_lse=False, **kw)


def test_flex_off_the_cpu_declines_a_deterministic_backward():
    """catches: dispatch running FlexAttention's atomic-add backward when the same bits were asked for."""
    flex = REGISTRY["flex"]
    if flex.unavailable() is not None:
        pytest.skip(flex.unavailable())
    assert "atomic adds" in flex.nondeterministic(_meta_call())
    reasons = flex.not_supported_reasons(_meta_call(deterministic=True))
    assert any(r.startswith("deterministic=True, but") for r in reasons)
    assert not any("deterministic" in r for r in flex.not_supported_reasons(_meta_call()))
    with torch.no_grad():  # forwards are deterministic
        assert flex.nondeterministic(_meta_call()) is None


def test_dispatch_skips_and_forced_raises_on_a_nondeterministic_backend(monkeypatch):
    """catches: auto picking, or a forced backend silently running, a backend that declared it cannot
    promise the same bits, and explain() not saying why."""
    monkeypatch.setattr(type(REGISTRY["sdpa"]), "nondeterministic", lambda self, call: "it sums in any order")
    q = k = v = torch.randn(1, 2, 8, 4, requires_grad=True)
    assert selfattn.explain(q, k, v, causal=True).backend == "sdpa"  # not asked for: the flag is off
    e = selfattn.explain(q, k, v, causal=True, deterministic=True)
    assert e.backend != "sdpa" and "deterministic=True, but it sums in any order" in e.not_chosen["sdpa"]
    assert e.determinism.startswith("deterministic:")
    assert selfattn.explain(q, k, v, causal=True).determinism.startswith("not deterministic: it sums in any order")
    with pytest.raises(ValueError, match="deterministic=True, but it sums in any order"):
        selfattn.attention(q, k, v, causal=True, backend="sdpa", deterministic=True)
    out = selfattn.attention(q, k, v, causal=True, deterministic=True)  # auto: another backend, the same values
    torch.testing.assert_close(out, selfattn.attention(q, k, v, causal=True, backend="reference"))


def test_sdpa_runs_the_math_kernel_for_a_deterministic_backward(monkeypatch):
    """catches: sdpa off the CPU leaving torch free to pick a fused kernel whose backward accumulates in any
    order, when deterministic=True asked for the same bits (torch's own deterministic mode off)."""
    assert sdpa_module.math_for_determinism(_meta_call())
    with torch.no_grad():
        assert not sdpa_module.math_for_determinism(_meta_call())
    monkeypatch.setattr(sdpa_module, "math_for_determinism", lambda call: True)  # as off the CPU
    flash_on = []
    real = sdpa_module.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        flash_on.append(torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled())
        return real(*args, **kwargs)
    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", spy)
    q = k = v = torch.randn(1, 2, 8, 4, requires_grad=True)
    selfattn.attention(q, k, v, causal=True, backend="sdpa", deterministic=True)
    selfattn.attention(q, k, v, causal=True, backend="sdpa", deterministic=False)
    assert flash_on == [False, True]
    assert REGISTRY["sdpa"].nondeterministic(_meta_call(deterministic=True)) is None
    assert "fused SDPA backward" in REGISTRY["sdpa"].nondeterministic(_meta_call())


def test_sdpa_varlen_kernel_is_not_used_for_a_deterministic_backward():
    """catches: torch's varlen flash kernel (no promised order in its backward) taking a deterministic call."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    mask = masks.packed(cu, cu, left=None, right=0)
    q = torch.empty(1, 2, 8, 8, device="meta", dtype=torch.float16, requires_grad=True)
    call = AttentionCall(q=q, k=q, v=q, mask=mask, bias=None, scale=0.5, dropout_p=0.0, return_lse=False,
                         deterministic=True)
    assert any("deterministic=True" in r for r in sdpa_module.varlen_kernel_obstacles(call))


def test_deterministic_algorithms_turns_torch_mode_on_and_restores_it():
    """catches: chunked's backward leaving torch's deterministic mode on (or off) after a learned term's
    gradient ran under it."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    with deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled()
    after = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    assert after == before
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with deterministic_algorithms():
            assert torch.is_deterministic_algorithms_warn_only_enabled()  # the user's own setting, untouched
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(*before[:1], warn_only=before[1])


def test_chunked_names_a_learned_term_off_the_cpu():
    """catches: explain() calling chunked deterministic off the CPU when a learned score term's gradient goes
    through torch's indexing backward there (atomic adds) and deterministic was not asked for."""
    table = torch.zeros(4, 2, device="meta", requires_grad=True)
    mod = scores.custom(lambda s, b, h, i, j: s + table[(i - j).clamp(0, 3), h])
    call = _meta_call(score_mod=mod)
    chunked = REGISTRY["chunked"]
    try:
        why = chunked.nondeterministic(call)
    except (NotImplementedError, RuntimeError) as err:  # the probe of the modifier cannot run on meta
        pytest.skip(f"the learned-tensor probe does not run on the meta device: {err}")
    assert why is not None and "accumulates in any order" in why
    assert chunked.nondeterministic(_meta_call(score_mod=mod, deterministic=True)) is None

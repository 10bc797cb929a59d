"""selfattn under ``torch.compile``: no graph breaks, the same results as eager, recompiles only where
documented (docs/design.md, "torch.compile").

Most tests compile with ``backend="aot_eager"``: dynamo and AOTAutograd are what selfattn's code
meets (graph breaks, guards, the chunked custom ops and their autograd), and the kernels are then
eager's own, so the compiled results equal eager's exactly. Inductor is checked end to end once
by default and further under ``-m slow``.

Shape legend: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from helpers import make_qkv

import selfattn
from selfattn import masks, scores, testing
from selfattn.backends import chunked
from selfattn.backends.chunked import compiled as chunked_compiled

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

BACKENDS = ["sdpa", "chunked", "auto"]
L = 72  # with small_tiles (32 x 48): several query blocks and key tiles, none dividing L


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _lengths(b: int = 2) -> torch.Tensor:
    return torch.tensor([L, 41, 7, 60, 33][:b])


def _ids(b: int = 2) -> torch.Tensor:
    starts = [[0, 20, 50], [0, 33, 34]][:b]
    return torch.stack([torch.bucketize(torch.arange(L), torch.tensor(s), right=True) for s in starts])


# name -> (function of (q, k, v, lengths, ids, backend) that builds its mask inside, the oracle's kwargs)
CASES = {
    "causal": (lambda q, k, v, n, ids, be: selfattn.attention(q, k, v, causal=True, backend=be),
               lambda n, ids: dict(causal=True)),
    "sliding_window": (lambda q, k, v, n, ids, be: selfattn.attention(q, k, v, mask=masks.sliding_window(20),
                                                                      backend=be),
                       lambda n, ids: dict(mask=masks.sliding_window(20))),
    "padding&causal": (lambda q, k, v, n, ids, be: selfattn.attention(q, k, v, mask=masks.padding(n), causal=True,
                                                                      backend=be),
                       lambda n, ids: dict(mask=masks.padding(n), causal=True)),
    "document&window": (lambda q, k, v, n, ids, be: selfattn.attention(
                            q, k, v, mask=masks.document(ids) & masks.sliding_window(24), backend=be),
                        lambda n, ids: dict(mask=masks.document(ids) & masks.sliding_window(24))),
    # built outside: dynamo 2.13 cannot trace the unary ~ on a user object
    "padding(queries)|~window": (lambda q, k, v, n, ids, be: selfattn.attention(
                                     q, k, v, mask=masks.padding(n, queries=True) | _NOT_WINDOW, backend=be),
                                 lambda n, ids: dict(mask=masks.padding(n, queries=True) | _NOT_WINDOW)),
}
_NOT_WINDOW = ~masks.sliding_window(30)


def _compiled_out_and_grads(fn, q, k, v, *args, dynamo_backend="aot_eager"):
    cf = torch.compile(fn, backend=dynamo_backend, fullgraph=True)
    out = cf(q, k, v, *args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return out, torch.autograd.grad(out, (q, k, v), dout), dout


@pytest.mark.parametrize(("case", "backend"), [(c, b) for c in CASES for b in ("sdpa", "chunked")]
                         + [("causal", "auto"), ("padding&causal", "auto")])
def test_no_graph_break_and_same_as_eager_and_oracle(backend, case, small_tiles):
    """catches: data-dependent Python (.tolist(), .item(), a branch on a mask tensor, ContextVar.get) on
    the path of a compiled call, and a compiled call that computes something else than eager."""
    fn, oracle = CASES[case]
    q, k, v = make_qkv(2, 4, 2, L, L, 16)
    n, ids = _lengths(), _ids()
    explained = torch._dynamo.explain(fn)(q, k, v, n, ids, backend)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, n, ids, backend)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    want = fn(q, k, v, n, ids, backend)
    for got, exp in zip((out, *torch.autograd.grad(out, (q, k, v), dout)),
                        (want, *torch.autograd.grad(want, (q, k, v), dout)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)

    # and held to the float32 rule against the float64 oracle, output and gradients (the same graph)
    testing.check_against_reference(lambda q, k, v, **_: compiled(q, k, v, n, ids, backend), q, k, v,
                                     **oracle(n, ids), name=f"compiled {backend}")


@pytest.mark.parametrize("backend", ["chunked", "auto"])
def test_sinks_under_compile(backend, small_tiles):
    """catches: sinks dropped, or their gradient lost, on the custom-op path (auto runs chunked: sdpa has no sinks)."""
    q, k, v = make_qkv(2, 4, 2, L, L, 16)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    compiled = torch.compile(selfattn.attention, backend="aot_eager", fullgraph=True)
    testing.check_against_reference(compiled, q, k, v, mask=masks.padding(_lengths()), causal=True, sinks=sinks,
                                    backend=backend)
    explained = torch._dynamo.explain(selfattn.attention)(q, k, v, causal=True, sinks=sinks, backend=backend)
    assert explained.graph_break_count == 0


@pytest.mark.parametrize("backend", ["chunked", "sdpa"])
def test_dropout_draws_the_eager_seed(backend, small_tiles):
    """catches: a compiled dropout that ignores torch.manual_seed, or a backward that draws another
    pattern than its forward: with aot_eager the seed is drawn in the graph exactly as eager draws
    it, so output and gradients equal eager's under the same manual_seed."""
    q, k, v = make_qkv(2, 4, 2, L, L, 16, dtype=torch.float64)

    def fn(q, k, v, n):
        return selfattn.attention(q, k, v, mask=masks.padding(n) & masks.sliding_window(40), dropout_p=0.3,
                                  backend=backend)

    n = _lengths()
    torch.manual_seed(11)
    out, grads, dout = _compiled_out_and_grads(fn, q, k, v, n)
    torch.manual_seed(11)
    want = fn(q, k, v, n)
    assert torch.equal(out, want)
    for got, exp in zip(grads, torch.autograd.grad(want, (q, k, v), dout), strict=True):
        assert torch.equal(got, exp)
    torch.manual_seed(12)
    assert not torch.equal(torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, n), out)


def test_chunked_options_and_use_backend_are_guarded(small_tiles):
    """catches: a compiled function that keeps the chunked options or the forced backend it was traced
    with after they change (dropout patterns depend on the tile sizes, so the output shows it)."""
    q, k, v = make_qkv(1, 2, 2, L, L, 8, dtype=torch.float64, requires_grad=False)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v: selfattn.attention(q, k, v, causal=True, dropout_p=0.5),
                             backend=counter, fullgraph=True)
    eager = selfattn.attention
    with selfattn.use_backend("chunked"):
        for tiles in [(32, 48), (16, 16), (32, 48)]:
            with chunked.options(block_q=tiles[0], block_k=tiles[1]):
                torch.manual_seed(3)
                got = compiled(q, k, v)
                torch.manual_seed(3)
                assert torch.equal(got, eager(q, k, v, causal=True, dropout_p=0.5)), tiles
    assert counter.frame_count == 2  # the third call reuses the first graph
    with selfattn.use_backend("reference"):
        torch.manual_seed(3)
        got = compiled(q, k, v)
        torch.manual_seed(3)
        assert torch.equal(got, eager(q, k, v, causal=True, dropout_p=0.5))
    assert counter.frame_count == 3


@pytest.mark.parametrize(("backend", "mark_dynamic"), [(b, False) for b in BACKENDS] + [("chunked", True)])
def test_batch_size_changes_recompile_once_at_most(backend, mark_dynamic):
    """catches: a compiled call specialised on the batch size (a Python int from a mask tensor, a
    batch-sized Python loop): with automatic dynamic shapes the second batch size recompiles once
    and later ones reuse that graph; with the batch dim marked dynamic nothing recompiles."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def fn(q, k, v, n):
        return selfattn.attention(q, k, v, mask=masks.padding(n) & masks.sliding_window(30), causal=True,
                                  backend=backend)

    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    frames = []
    for b in (2, 3, 5):
        q, k, v = make_qkv(b, 4, 2, L, L, 16, seed=b)
        n = _lengths(b)
        if mark_dynamic:
            for t in (q, k, v, n):
                torch._dynamo.mark_dynamic(t, 0)
        out = compiled(q, k, v, n)
        out.sum().backward()
        ref = testing.reference_attention(q.detach().double(), k.detach().double(), v.detach().double(),
                                          mask=masks.padding(n) & masks.sliding_window(30), causal=True)
        assert testing.max_error(out, ref) < 1e-5
        frames.append(counter.frame_count)
    assert frames == ([1, 1, 1] if mark_dynamic else [1, 2, 2])


def test_masks_of_one_structure_share_a_graph(small_tiles):
    """catches: a compiled graph tied to one mask object (a registry keyed on identity: a recompile per
    training step) or to its tensors' values (a stale schedule when another mask of the same structure
    is passed)."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v, m: selfattn.attention(q, k, v, mask=m, backend="chunked"),
                             backend=counter, fullgraph=True)
    q, k, v = make_qkv(2, 4, 2, L, L, 16, requires_grad=False)
    keys = set(chunked_compiled._REGISTRY)
    for lengths, ids in [([L, 40], _ids()), ([9, L], _ids().flip(-1)), ([0, 30], _ids())]:
        mask = masks.padding(torch.tensor(lengths)) & masks.document(ids)
        out = compiled(q, k, v, mask)
        assert testing.max_error(out, testing.reference_attention(q.double(), k.double(), v.double(), mask=mask)) < 1e-5
    assert counter.frame_count == 1
    assert len(set(chunked_compiled._REGISTRY) - keys) == 1


def test_mask_changed_between_compiled_forward_and_backward_raises(small_tiles):
    """catches: a compiled backward that re-reads a mask tensor changed in place since its forward."""
    q, k, v = make_qkv(1, 2, 2, L, L, 8)
    buf = torch.ones(L, L, dtype=torch.bool).tril()
    compiled = torch.compile(lambda q, k, v, t: selfattn.attention(q, k, v, mask=masks.from_tensor(t),
                                                                   backend="chunked"),
                             backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, buf)
    buf.fill_(True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def _bump(s, b, h, i, j):
    return s + 0.1 * (j % 3).to(s.dtype)


@pytest.mark.parametrize("mod", [scores.alibi(scores.alibi_slopes(4)), scores.softcap(5.0),
                                 scores.custom(_bump), scores.chain(scores.alibi(scores.alibi_slopes(4)),
                                                                    scores.softcap(5.0))],
                         ids=["alibi", "softcap", "custom", "chain"])
def test_score_modifiers_run_in_the_chunked_op(mod, small_tiles):
    """catches: a score modifier (its tensors, or a user function) lost on the way through the op registry."""
    q, k, v = make_qkv(2, 4, 2, L, L, 16)
    explained = torch._dynamo.explain(selfattn.attention)(q, k, v, causal=True, score_mod=mod, backend="chunked")
    assert explained.graph_break_count == 0
    compiled = torch.compile(selfattn.attention, backend="aot_eager", fullgraph=True)
    testing.check_against_reference(compiled, q, k, v, causal=True, score_mod=mod, backend="chunked")


def test_dispatch_under_compile_reads_no_data():
    """catches: the cost model reading mask tensors while tracing. Under compile the empty tiles are
    counted from the mask's structure only: padding & causal at 512^2 runs chunked (causal alone
    empties 37% of the tiles), a document mask alone runs sdpa (its tiles cannot be known)."""
    q, k, v = make_qkv(2, 2, 2, 512, 512, 8, requires_grad=False)
    n, ids = torch.tensor([512, 300]), torch.arange(512).div(64, rounding_mode="floor").expand(2, 512)
    for mask, want in [(masks.padding(n) & masks.causal(), "chunked"), (masks.document(ids), "sdpa")]:
        torch._dynamo.reset()
        graphs = torch._dynamo.testing.EagerAndRecordGraphs()
        out = torch.compile(lambda q, k, v, m: selfattn.attention(q, k, v, mask=m), backend=graphs,
                            fullgraph=True)(q, k, v, mask)
        ran = "chunked" if "selfattn.chunked_fwd" in graphs.graphs[0].code else "sdpa"
        assert ran == want, mask
        assert testing.max_error(out, testing.reference_attention(q.double(), k.double(), v.double(), mask=mask)) < 1e-5
    assert chunked_compiled.static_empty_fraction(masks.causal() & masks.padding(n), 512, 512, 128) == 6 / 16
    assert chunked_compiled.static_empty_fraction(masks.document(ids), 512, 512, 128) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_head_attention_module(backend):
    """catches: the module path (fused projections, GQA, a mask object, dropout while training) breaking
    the graph or differing from eager, in the output or the parameters' gradients."""
    torch.manual_seed(0)
    mha = selfattn.MultiHeadAttention(32, 4, num_kv_heads=2, dropout=0.2).double()
    x = torch.randn(2, 40, 32, dtype=torch.float64, requires_grad=True)
    n = torch.tensor([40, 23])

    def step(x, n):  # the README's compiled step
        return mha(x, mask=masks.padding(n), causal=True)

    with selfattn.use_backend(backend) if backend != "auto" else torch.enable_grad():
        assert torch._dynamo.explain(step)(x, n).graph_break_count == 0
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        results = []
        for fn in (compiled, step):
            torch.manual_seed(5)
            out = fn(x, n)
            results.append((out, *torch.autograd.grad(out.square().sum(), (x, *mha.parameters()))))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_plain_calls_and_an_unmasked_module_compile_without_a_break():
    """catches: the plain call's short path reaching what dynamo cannot trace (a ContextVar read)
    before it steps aside for the full path while compiling."""
    q, k, v = make_qkv(2, 4, 2, 24, 24, 8, dtype=torch.float64)
    mha = selfattn.MultiHeadAttention(32, 4, num_kv_heads=2).double()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    calls = [lambda q, k, v: selfattn.attention(q, k, v),
             lambda q, k, v: selfattn.attention(q, k, v, scale=0.3, dropout_p=0.0)]
    for fn in calls:
        assert torch._dynamo.explain(fn)(q, k, v).graph_break_count == 0
        torch.testing.assert_close(torch.compile(fn, backend="eager", fullgraph=True)(q, k, v), fn(q, k, v),
                                   rtol=0, atol=0)
    assert torch._dynamo.explain(mha)(x).graph_break_count == 0
    torch.testing.assert_close(torch.compile(mha, backend="eager", fullgraph=True)(x), mha(x), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["chunked", pytest.param("sdpa", marks=pytest.mark.slow)])
def test_inductor_end_to_end(backend, small_tiles):
    """catches: a fake (meta) implementation whose shapes, dtypes or strides differ from the op's, which
    inductor trusts when it plans buffers; and anything else inductor does differently."""
    q, k, v = make_qkv(2, 4, 2, L, L, 16)

    def fn(q, k, v, n):
        return selfattn.attention(q, k, v, mask=masks.padding(n), causal=True, backend=backend)

    n = _lengths()
    out, grads, dout = _compiled_out_and_grads(fn, q, k, v, n, dynamo_backend="inductor")
    want = fn(q, k, v, n)
    for got, exp in zip((out, *grads), (want, *torch.autograd.grad(want, (q, k, v), dout)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_inductor_dropout_is_deterministic_and_its_gradient_matches_its_forward(small_tiles):
    """catches: inductor's own random numbers giving the backward another dropout pattern than the
    forward: central differences of the compiled function (same seed each call) match its gradient."""
    q, k, v = make_qkv(1, 2, 2, 40, 40, 8, dtype=torch.float64)
    compiled = torch.compile(lambda q, k, v: selfattn.attention(q, k, v, causal=True, dropout_p=0.4,
                                                                backend="chunked"), fullgraph=True)

    def run(q):
        torch.manual_seed(21)
        return compiled(q, k, v)

    out = run(q)
    assert torch.equal(out, run(q))
    direction = torch.randn_like(q)
    (grad,) = torch.autograd.grad(out, q, torch.ones_like(out))
    eps = 1e-6
    numeric = (run(q + eps * direction).sum() - run(q - eps * direction).sum()) / (2 * eps)
    assert abs(numeric.item() - (grad * direction).sum().item()) < 1e-6


@pytest.mark.slow
def test_readme_compile_block_runs_with_inductor():
    """The README's torch.compile block (a python3 block: test_readme does not run it), as written."""
    from test_readme import README, fenced_blocks

    (block,) = [b for b in fenced_blocks(README.read_text(encoding="utf-8"))
                if b.lang == "python3" and "torch.compile" in b.source]
    namespace = {"torch": torch, "masks": masks, "mha": selfattn.MultiHeadAttention(512, 8, num_kv_heads=2)}
    exec(compile(block.source, f"README.md:{block.line}", "exec"), namespace)
    assert namespace["y"].shape == (2, 100, 512)


class _Stripes(masks.Mask):
    """A user's mask that keeps its state in slots, one of them a tuple of tensors and another a dtype:
    nothing vars() could take apart, everything its constructor's arguments say."""

    __slots__ = ("every", "kind", "lengths")

    def __init__(self, every: int, lengths: tuple[torch.Tensor, ...], kind: torch.dtype = torch.int64) -> None:
        self.every, self.lengths, self.kind = every, lengths, kind

    def predicate(self, lq, lk, device=None):
        n = self.lengths[0].to(device=device, dtype=self.kind)
        return lambda b, h, i, j: ((i - j) % self.every != 1) & (j < n[b])

    def _tile_bounds(self, lq, lk, bq, bk, device):
        unknown = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device)
        return unknown, unknown

    def batch_heads(self):
        return self.lengths[0].numel(), 1

    def tensors(self):
        return self.lengths


class _Tilt(scores.ScoreMod):
    """A user's modifier with slots."""

    __slots__ = ("slope",)

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def __call__(self, score, b, h, i, j):
        return score + self.slope * torch.tanh((i - j).to(score.dtype))


def test_a_user_mask_with_slots_compiles(small_tiles):
    """catches: the compiled chunked path taking masks and modifiers apart with vars() and rebuilding
    them with object.__new__, which fails only under torch.compile for any state that is not plain
    instance attributes (slots, here)."""
    q, k, v = make_qkv(2, 4, 2, L, L, 16)
    mask, mod = _Stripes(3, (torch.tensor([L, 50]),)), _Tilt(0.3)

    def fn(q, k, v):
        return selfattn.attention(q, k, v, mask=mask, score_mod=mod, backend="chunked")

    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    out, grads, dout = _compiled_out_and_grads(fn, q, k, v)
    want = fn(q, k, v)
    for got, exp in zip((out, *grads), (want, *torch.autograd.grad(want, (q, k, v), dout)), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=1e-6)

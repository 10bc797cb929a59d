"""selfattn inside real transformers models (tiny random configs, no network).

The oracle is the model in float64 with textbook attention on transformers' own dense mask
(``hf_oracle.oracle_attention``, independent of selfattn; unlike ``eager`` in float64, it does not
turn a fully masked row into NaN). selfattn in float32 must be within the float32 rule of it: at
most 2x (outputs) or 3x (gradients) the error of the model's ``eager`` attention in float32, plus
16 ulps of the largest value. Batches: right-padded, left-padded, and packed (several sequences
in one row, found from ``position_ids``).
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_oracle import NAME, ORACLE, VOCAB, L  # noqa: E402
from hf_oracle import build as _build  # noqa: E402

import selfattn  # noqa: E402
from selfattn import masks  # noqa: E402
from selfattn.integrations import transformers as sa_hf  # noqa: E402
from selfattn.testing import GRADIENT_FACTOR, OUTPUT_FACTOR, compare_to_reference  # noqa: E402

LOOKUP = torch.rand(40, 40, generator=torch.Generator().manual_seed(3)) > 0.5
CAUSAL = ["llama", "mistral", "gemma2", "qwen2", "gpt2", "gpt_oss"]
MODELS = [*CAUSAL, "bert"]


@pytest.fixture(scope="module")
def models():
    """For each model: the float64 oracle, eager float32 (naive), selfattn float32; same weights."""
    out = {}
    for name in MODELS:
        ref = _build(name, ORACLE, torch.float64)
        naive = _build(name, "eager")
        ours = _build(name, NAME)
        naive.load_state_dict(ref.state_dict())
        ours.load_state_dict(ref.state_dict())
        out[name] = (ref, naive, ours)
    return out


def _batch(kind: str, model: str) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, L), generator=g)
    if kind == "packed":  # three documents in one row, positions restarting at each
        pos = torch.cat([torch.arange(9), torch.arange(5), torch.arange(L - 14)]).unsqueeze(0)
        return dict(input_ids=ids[:1], position_ids=pos)
    am = torch.ones(2, L, dtype=torch.long)
    if kind == "right":
        am[1, L - 9:] = 0
    else:
        am[1, :9] = 0
    batch = dict(input_ids=ids, attention_mask=am)
    if kind == "left" and model in CAUSAL:  # positions count real tokens, as generate() does
        batch["position_ids"] = (am.cumsum(-1) - 1).clamp(min=0)
    return batch


def _output(model, batch):
    out = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _real(batch: dict) -> torch.Tensor:
    am = batch.get("attention_mask")
    return torch.ones(batch["input_ids"].shape, dtype=torch.bool) if am is None else am.bool()


def _check(actual, ref, naive, factor, name):
    result = compare_to_reference(actual, ref, naive, factor=factor, name=name)
    assert result.ok, str(result)


@pytest.mark.parametrize("kind", ["right", "left", "packed"])
@pytest.mark.parametrize("model", MODELS)
def test_outputs_match_eager(models, model, kind):
    """catches: a mask mapped wrongly (padding side, window width, documents, offsets), soft-capping
    or sinks dropped, GQA heads paired wrongly, a wrong scale."""
    if kind == "packed" and model == "bert":
        pytest.skip("bidirectional models take no packed position_ids")
    ref, naive, ours = models[model]
    batch = _batch(kind, model)
    real = _real(batch)
    with torch.no_grad():
        r, n, o = _output(ref, batch)[real], _output(naive, batch)[real], _output(ours, batch)[real]
    _check(o, r, n, OUTPUT_FACTOR, f"{model} {kind}")


@pytest.mark.parametrize("model", MODELS)
def test_training_gradients_match_eager(models, model):
    """One training step's parameter gradients on a padded batch (and a packed one for causal LMs)."""
    ref, naive, ours = models[model]
    for kind in ["right"] + (["packed"] if model in CAUSAL else []):
        batch = _batch(kind, model)
        real = _real(batch)
        grads = []
        for m in (ref, naive, ours):
            m.zero_grad()
            out = _output(m, batch)[real]
            w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
            (out * w).sum().backward()
            grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None})
        assert grads[2].keys() == grads[0].keys()
        for key in grads[0]:
            _check(grads[2][key], grads[0][key], grads[1][key], GRADIENT_FACTOR, f"{model} {kind} d{key}")


@pytest.mark.parametrize("model", CAUSAL)
def test_greedy_generation_matches_eager(models, model):
    """The KV cache path (q_offset/kv_offset, sliding-window caches, left padding) gives the same tokens."""
    _, naive, ours = models[model]
    batch = _batch("left", model)
    prompt = dict(input_ids=batch["input_ids"][:, :10], attention_mask=batch["attention_mask"][:, :10])
    prompt["attention_mask"][1, :4] = 0
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = naive.generate(**prompt, **kwargs)
    got = ours.generate(**prompt, **kwargs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("model", ["llama", "mistral", "gpt_oss"])
def test_static_cache_generation_matches_eager(models, model):
    """generate() with a static cache builds the masks ahead and feeds them back to forward as
    4-D "tensors": the selfattn mask rides along as a MaskTensor and gives eager's tokens."""
    _, naive, ours = models[model]
    batch = _batch("left", model)
    prompt = dict(input_ids=batch["input_ids"][:, :10], attention_mask=batch["attention_mask"][:, :10].clone())
    prompt["attention_mask"][1, :4] = 0
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(ours.generate(**prompt, **kwargs), naive.generate(**prompt, **kwargs))


def test_mask_tensor_has_no_values():
    carried = sa_hf.mask_function(2, 5, 5, mask_function=transformers.masking_utils.causal_mask_function)
    assert carried.contiguous() is carried and carried.detach() is carried and carried.to("cpu") is carried
    assert carried.shape == (2, 1, 5, 5) and carried.dtype == torch.bool and carried.dim() == 4
    assert "causal" in repr(carried)


def _value_ops(carried):
    scores = torch.zeros(2, 4, 5, 5)
    return {
        "carried + 1.0": lambda: carried + 1.0,
        "1.0 + carried": lambda: 1.0 + carried,
        "scores + carried": lambda: scores + carried,  # Bloom, MPT: scores plus the mask
        "carried + scores": lambda: carried + scores,
        "carried & carried": lambda: carried & carried,
        "masked_fill(scores, carried)": lambda: scores.masked_fill(carried, 0.0),
        "where(carried, ...)": lambda: torch.where(carried, scores, 0.0),
        "carried.float()": lambda: carried.float(),
        "carried.to(float32)": lambda: carried.to(torch.float32),
        "carried[..., :3]": lambda: carried[..., :3],
        "carried.sum()": lambda: carried.sum(),
        "bool(carried)": lambda: bool(carried),
        "cat": lambda: torch.cat([scores.bool(), carried]),
    }


@pytest.mark.parametrize("op", list(_value_ops(None)))
def test_mask_tensor_values_raise_type_error_whichever_operand(op):
    """catches: AttributeError ('Tensor' object has no attribute 'mask') from the carrier when it
    was the second operand, and any operation that silently read its (absent) values."""
    carried = sa_hf.mask_function(2, 5, 5, mask_function=transformers.masking_utils.causal_mask_function)
    with pytest.raises(TypeError, match=r"selfattn mask .* has no values"):
        _value_ops(carried)[op]()


def test_mask_tensor_is_built_inside_a_compiled_function():
    """catches: dynamo refusing the carrier's construction (Tensor._make_wrapper_subclass), which
    broke the graph of every model forward that builds its mask inside torch.compile."""
    def f(q, lengths):
        carried = sa_hf.MaskTensor(masks.padding(lengths), (2, 1, 5, 5), q.device)
        assert carried.shape == (2, 1, 5, 5) and carried.ndim == 4
        return selfattn.attention(q, q, q, mask=carried.mask)
    q, lengths = torch.randn(2, 2, 5, 4), torch.tensor([3, 5])
    torch.compiler.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(q, lengths), f(q, lengths))


def test_attention_weights_come_back_with_output_attentions(models):
    _, naive, ours = models["llama"]
    batch = _batch("right", "llama")
    with torch.no_grad():
        want = naive(**batch, output_attentions=True).attentions
        got = ours(**batch, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    for a, b in zip(got, want, strict=True):
        real = batch["attention_mask"].bool()[:, None, :, None]
        torch.testing.assert_close(a * real, b * real, rtol=1e-5, atol=1e-6)


def test_set_attn_implementation_switches_to_selfattn(monkeypatch):
    model = _build("llama", "eager")
    model.set_attn_implementation(NAME)
    seen = []
    real = selfattn.functional.attention
    monkeypatch.setattr(selfattn.functional, "attention", lambda *a, **k: seen.append(k["mask"]) or real(*a, **k))
    model(torch.randint(0, VOCAB, (1, 8)))
    assert len(seen) == 2  # both layers; the 8 x 8 causal mask made dense once (small) and shared
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    for m in seen:
        assert torch.equal((m.dense(8, 8) if isinstance(m, masks.Mask) else m).expand(1, 1, 8, 8)[0, 0], causal)
    assert seen[0] is seen[1]


# --- the mask function: what each transformers predicate becomes ------------------------------

def _hf_mask(mask_function, *, batch=2, lq=40, lk=40, q_offset=0, kv_offset=0, attention_mask=None):
    from transformers.masking_utils import sdpa_mask
    want = sdpa_mask(batch_size=batch, q_length=lq, kv_length=lk, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
                     use_vmap=True)
    carried = sa_hf.mask_function(batch, lq, lk, q_offset, kv_offset, mask_function, attention_mask)
    if carried is None:  # every key visible
        return masks.from_tensor(torch.ones(1, 1, 1, 1, dtype=torch.bool)), want.expand(batch, 1, lq, lk)
    assert isinstance(carried, sa_hf.MaskTensor) and carried.shape == (batch, 1, lq, lk)
    return carried.mask, want.expand(batch, 1, lq, lk)


def _predicates():
    mu = transformers.masking_utils
    pos = torch.stack([torch.cat([torch.arange(12), torch.arange(20), torch.arange(8)]),
                       torch.cat([torch.arange(30), torch.arange(3, 13)])])
    ids = mu.find_packed_sequence_indices(pos)  # as transformers derives them

    def packed(fn, ids=ids):
        return mu.and_masks(mu.remap_positions_for_packed_sequence(fn, pos), mu.packed_sequence_mask_function(ids))
    # ids that do not follow the positions (a document whose positions jump): evaluated, still exact
    odd_ids = torch.tensor([[0] * 12 + [1] * 28, [0] * 20 + [1] * 20])
    return {
        "causal": (mu.causal_mask_function, masks.Causal),
        "sliding": (mu.sliding_window_causal_mask_function(5), masks.SlidingWindow),
        "bidirectional_sliding": (mu.sliding_window_bidirectional_mask_function(3), masks.SlidingWindow),
        "packed_causal": (packed(mu.causal_mask_function), masks.Mask),
        "packed_sliding": (packed(mu.sliding_window_causal_mask_function(4)), masks.Mask),
        "packed_odd_ids": (packed(mu.causal_mask_function, odd_ids), masks.Mask),
        "packed_absolute": (packed(lambda b, h, q, kv: q >= 3), masks.Mask),  # not relative: not read on indices
        "chunked": (mu.chunked_causal_mask_function(8, torch.tensor([0, 3])), masks.Mask),
        "custom": (lambda b, h, q, kv: (q - kv) % 3 == 0, masks.FromMaskMod),
        "or_custom": (mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv < 4), masks.Mask),
        "scalar_only": (lambda b, h, q, kv: LOOKUP[q][kv], masks.FromMaskMod),  # needs vmap, as in transformers
    }


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("name", list(_predicates()))
def test_mask_function_equals_transformers_dense_mask(name, padding):
    """Every predicate, named or not, gives exactly transformers' own dense mask, and the named ones
    become named selfattn masks (so tiles are skipped), never an (Lq, Lk) tensor."""
    fn, kind = _predicates()[name]
    am = None
    if padding != "none":
        am = torch.ones(2, 40, dtype=torch.bool)
        am[1, 30:] = False if padding == "right" else True
        if padding == "left":
            am[1, :7] = False
    got, want = _hf_mask(fn, attention_mask=am)
    assert isinstance(got, masks.Mask)
    assert not any(t.numel() >= 40 * 40 for t in got.tensors())
    if kind is not masks.Mask and padding == "none":
        assert isinstance(got, kind), repr(got)
    assert torch.equal(got.dense(40, 40).expand(2, 1, 40, 40), want)


@pytest.mark.parametrize("tensor_offset", [False, True])
@pytest.mark.parametrize(("lq", "lk", "q_offset", "kv_offset"), [(1, 30, 29, 0), (4, 30, 26, 0), (1, 6, 33, 28),
                                                                 (3, 12, 20, 0), (1, 12, 4, 0), (5, 40, 0, 0)])
def test_mask_function_with_cache_offsets(lq, lk, q_offset, kv_offset, tensor_offset):
    """Decoding: queries after a cache (aligned bottom-right), a sliding cache that starts past 0,
    and a static cache whose keys run past the queries (a band with the shift as a tensor when
    the cache gives q_offset as one), for every rule transformers builds; always exact."""
    mu = transformers.masking_utils
    am = torch.ones(2, kv_offset + lk, dtype=torch.bool)
    am[0, :3] = False
    rules = (mu.causal_mask_function, mu.sliding_window_causal_mask_function(5),
             mu.sliding_window_bidirectional_mask_function(2), mu.bidirectional_mask_function,
             mu.chunked_causal_mask_function(4, torch.tensor([0, 2])))
    offset = torch.tensor(q_offset) if tensor_offset else q_offset
    for fn in rules:
        got, want = _hf_mask(fn, lq=lq, lk=lk, q_offset=offset, kv_offset=kv_offset, attention_mask=am)
        assert torch.equal(got.dense(lq, lk).expand(2, 1, lq, lk), want), repr(got)


def _renamed(fn, name="renamed"):
    """``fn``'s code and closure under another name and module: what an upstream rename looks like."""
    g = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    g.__qualname__, g.__module__ = name, "elsewhere"
    return g


def _wrapped(fn):
    return lambda b, h, q, kv: fn(b, h, q, kv)


def _disguised():
    mu = transformers.masking_utils
    pos = torch.cat([torch.arange(12), torch.arange(20), torch.arange(8)]).unsqueeze(0).expand(2, -1)
    ids = mu.find_packed_sequence_indices(pos)
    return {
        "renamed_causal": (_renamed(mu.causal_mask_function), "causal('bottom_right')"),
        "wrapped_causal": (_wrapped(mu.causal_mask_function), "causal('bottom_right')"),
        "own_causal": (lambda b, h, q, kv: q >= kv, "causal('bottom_right')"),
        "wrapped_sliding": (_wrapped(mu.sliding_window_causal_mask_function(5)), "sliding_window(4, 0)"),
        "renamed_and": (_renamed(mu.and_masks(_renamed(mu.sliding_window_overlay(5)),
                                              _wrapped(mu.causal_mask_function))), "sliding_window(4, 0)"),
        "own_window": (lambda b, h, q, kv: (kv <= q) & (q - kv < 5), "sliding_window(4, 0)"),
        "renamed_bidirectional_window": (_renamed(mu.sliding_window_bidirectional_mask_function(3)),
                                         "sliding_window(3, 3)"),
        "wrapped_bidirectional": (_wrapped(mu.bidirectional_mask_function), "None"),
        "wrapped_packed": (_wrapped(mu.and_masks(_renamed(mu.remap_positions_for_packed_sequence(
            _wrapped(mu.causal_mask_function), pos)), _renamed(mu.packed_sequence_mask_function(ids)))),
            "(causal('bottom_right') & document(ids of shape (2, 40)))"),
    }


@pytest.mark.parametrize("name", list(_disguised()))
def test_masks_are_recognised_by_what_they_compute_not_their_names(name):
    """catches: recognition by function name and closure variables, which sent a renamed or
    wrapped transformers predicate to the slow evaluated path (no tiles skipped)."""
    fn, want_repr = _disguised()[name]
    got = sa_hf.selfattn_mask(2, 40, 40, 0, 0, fn, None)
    assert repr(got) == want_repr
    from transformers.masking_utils import sdpa_mask
    want = sdpa_mask(batch_size=2, q_length=40, kv_length=40, mask_function=fn, allow_is_causal_skip=False,
                     use_vmap=True)
    dense = torch.ones(2, 1, 40, 40, dtype=torch.bool) if got is None else got.dense(40, 40).expand(2, 1, 40, 40)
    assert torch.equal(dense, want.expand(2, 1, 40, 40))


def _structure(obj):
    """A mask's types and Python values, with each tensor replaced by its shape and dtype."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype)
    if isinstance(obj, masks.Mask):
        return (type(obj), tuple((k, _structure(v)) for k, v in sorted(vars(obj).items())))
    return obj


@pytest.mark.parametrize("fn", ["causal", "sliding"])
def test_static_cache_steps_share_one_mask_structure(fn):
    """catches: a static cache's tensor q_offset read as a Python int, giving each decoding step
    another mask structure (a compiled forward recompiled at every token)."""
    mu = transformers.masking_utils
    rule = mu.causal_mask_function if fn == "causal" else mu.sliding_window_causal_mask_function(4)
    structures = set()
    for step in (10, 11, 15):  # queries at `step` against a 16-key static cache, left padding in item 1
        am = torch.ones(2, step + 1, dtype=torch.bool)
        am[1, :3] = False
        got = sa_hf.selfattn_mask(2, 1, 16, torch.tensor(step), 0, rule, am)
        structures.add(_structure(got))
        from transformers.masking_utils import sdpa_mask
        want = sdpa_mask(batch_size=2, q_length=1, kv_length=16, q_offset=step, mask_function=rule,
                         attention_mask=am, allow_is_causal_skip=False)
        assert torch.equal(got.dense(1, 16).expand(2, 1, 1, 16), want)
    assert len(structures) == 1, structures


@pytest.mark.parametrize(("lo", "hi", "shift"), [(None, 0, -7), (-3, 0, -5), (-2, 2, 3), (None, None, 0), (1, 4, 0),
                                                 (None, 0, torch.tensor([-3, -9]))])
def test_band_mask_tiles_and_attention(lo, hi, shift):
    """The band mask (a relative rule with a tensor shift): its FULL/EMPTY tiles are exact, and
    every backend that takes it meets the rule against the float64 oracle."""
    from selfattn.integrations.transformers._lower import Band
    m = Band(lo, hi, torch.as_tensor(shift))
    lq, lk = 13, 29
    dense = m.dense(lq, lk).expand(2, 1, lq, lk)
    tiles = m.tiles(lq, lk, 4, 8).expand(2, 1, -1, -1)
    for qi in range(tiles.shape[2]):
        for kj in range(tiles.shape[3]):
            block = dense[:, :, qi * 4:(qi + 1) * 4, kj * 8:(kj + 1) * 8].flatten(2)
            assert block.all(-1)[tiles[:, :, qi, kj] == masks.FULL].all()
            assert (~block.any(-1))[tiles[:, :, qi, kj] == masks.EMPTY].all()
    q, k, v = torch.randn(2, 4, lq, 16), torch.randn(2, 2, lk, 16), torch.randn(2, 2, lk, 16)
    for backend in ("reference", "sdpa", "chunked"):
        selfattn.testing.check_against_reference(
            lambda *a, backend=backend, **kw: selfattn.attention(*a, backend=backend, **kw), q, k, v, mask=m)


def test_upstream_seams_are_where_they_were():
    """Fails loudly when torch or transformers move what the adapter leans on beyond their public
    API (selfattn.integrations.transformers._upstream) or what these tests use."""
    from selfattn.integrations.transformers import _upstream
    with _upstream.getitem_as_index():  # torch's TransformGetItemToIndex
        pass
    assert callable(getattr(transformers.PreTrainedModel, "_can_set_attn_implementation", None))
    assert _upstream.can_set_attn_implementation(transformers.LlamaForCausalLM)
    assert not _upstream.can_set_attn_implementation(transformers.BloomForCausalLM)  # attention of its own
    assert getattr(transformers.PreTrainedModel.get_correct_attn_implementation, "_selfattn_guard", None) is not None
    assert "_compile_all_devices" in vars(transformers.CompileConfig)  # generate() compiling on a CPU (tests)
    # context_parallel's gradient sum: a callback queued from a hook runs once, after the whole backward
    w = torch.ones(3, requires_grad=True)
    seen: list[str] = []
    w.register_post_accumulate_grad_hook(lambda p: _upstream.at_end_of_backward(lambda: seen.append("end")))
    (w * 2).sum().backward()
    assert seen == ["end"] and w.grad is not None
    # context_parallel's document decision: transformers' packed-sequence detection, by name, None for one sequence
    mu = transformers.masking_utils
    one = torch.arange(6).expand(2, 6)
    assert mu.find_packed_sequence_indices(one) is None
    with _upstream.packed_sequences_always_found():
        assert torch.equal(mu.find_packed_sequence_indices(one), torch.zeros(2, 6, dtype=torch.long))
        packed = mu.find_packed_sequence_indices(torch.tensor([[0, 1, 0, 1, 2, 3]]))
        assert packed.tolist() == [[0, 0, 1, 1, 1, 1]]
    assert mu.find_packed_sequence_indices(one) is None
    assert "find_packed_sequence_indices(position_ids)" in inspect.getsource(mu._preprocess_mask_arguments)


def test_packed_mask_skips_tiles_like_a_document_mask():
    """The packed-document mask of a long row is a document mask: its tile map needs no evaluation."""
    mu = transformers.masking_utils
    lengths = [1000, 700, 300, 48]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    fn = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos),
                      mu.packed_sequence_mask_function(ids))
    got = sa_hf.selfattn_mask(1, 2048, 2048, 0, 0, fn, None)
    assert "document" in repr(got) and "causal" in repr(got) and "mask_mod" not in repr(got)
    why = selfattn.explain(torch.randn(1, 2, 2048, 16), torch.randn(1, 2, 2048, 16), torch.randn(1, 2, 2048, 16),
                           mask=got)
    assert why.backend == "chunked", str(why)


def test_importing_selfattn_does_not_import_transformers():
    import subprocess
    import sys
    code = "import sys, selfattn, selfattn.nn, selfattn.masks; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_from_pretrained_takes_the_name(tmp_path):
    saved = _build("qwen2", "eager")
    saved.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME)
    assert loaded.config._attn_implementation == NAME
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, saved(ids).logits, rtol=1e-5, atol=1e-5)


def test_models_bench_measures_each_part_in_its_own_process():
    """The models suite's points run (one attention part, one whole step) and report what they name."""
    from selfattn.bench import models as bench_models
    pts = bench_models.points([256], ["selfattn", "none"])
    assert [(p["part"], p["impl"]) for p in pts] == [("attention", "selfattn"), ("model", "selfattn"),
                                                      ("model", "none")]
    row = bench_models.measure(pts[0], repeats=1)
    assert row["status"] == "ok" and row["time_s"] > 0 and len(row["times"]) == 1
    assert bench_models.measure(dict(part="model", L=1 << 20, impl="eager"), repeats=1)["status"] == "skipped"


def test_models_bench_generation_point_times_both_in_turns(monkeypatch):
    """The generation points: selfattn and sdpa in one process, per-token times of the same repeats
    (ratios pair repeat by repeat), the same tokens; the README block is written from the rows."""
    from selfattn.bench import generation, markdown
    from selfattn.bench.ratios import attach_ratios
    monkeypatch.setattr(generation, "PROMPT", 16)
    monkeypatch.setattr(generation, "NEW_TOKENS", 3)
    rows = [{**r, "suite": "models-generate", "status": "ok"}
            for r in generation.run_generate_point("static", "eager", 2, repeats=2)]
    assert [r["impl"] for r in rows] == ["selfattn", "sdpa"]
    assert all(len(r["times"]) == 2 and r["time_s"] > 0 and r["same_tokens"] for r in rows)
    attach_ratios(rows, "models-generate", ("case", "mode", "B"), ("sdpa",))
    assert rows[0]["ratios"]["sdpa"]["n"] == 2
    block = markdown.blocks(rows)["models-generate"]
    assert "| static cache | eager | 2 |" in block and "| yes |" in block


@pytest.mark.parametrize("rule", ["causal", "chunked", "opaque"])
def test_tensor_offsets_are_read_when_the_mask_is_made(rule):
    """catches: a static cache's q_offset (its cumulative_length, which every layer's cache update
    increments in place before attention runs) read lazily by an evaluated part of the mask, which
    then saw the queries Lq positions further on in each layer."""
    mu = transformers.masking_utils
    fn = {"causal": mu.causal_mask_function, "chunked": mu.chunked_causal_mask_function(4, torch.tensor([0, 1])),
          "opaque": lambda b, h, q, kv: LOOKUP[q][kv] & (kv <= q)}[rule]
    offset = torch.tensor(10)
    got = sa_hf.selfattn_mask(2, 2, 16, offset, 0, fn, None)
    offset.add_(2)  # the cache's update, before attention reads the mask
    from transformers.masking_utils import sdpa_mask
    want = sdpa_mask(batch_size=2, q_length=2, kv_length=16, q_offset=10, mask_function=fn, allow_is_causal_skip=False,
                     use_vmap=True)
    assert torch.equal(got.dense(2, 16).expand(2, 1, 2, 16), want.expand(2, 1, 2, 16))


def test_small_carried_mask_is_made_dense_once_and_follows_its_tensors():
    """A decode step's mask is made dense once for all layers of a forward (dropped when it hides
    nothing), and made again when a tensor it reads changed in place (catches: a stale shared dense
    mask)."""
    from selfattn.integrations.transformers._attention import attention_forward
    keys = torch.ones(2, 12, dtype=torch.bool)
    carried = sa_hf.mask_function(2, 1, 12, torch.tensor(9), 0, transformers.masking_utils.causal_mask_function,
                                  keys)
    module = torch.nn.Module()
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    first, _ = attention_forward(module, q, k, v, carried)
    made = carried._dense
    again, _ = attention_forward(module, q, k, v, carried)
    assert carried._dense is made and torch.equal(first, again)
    keys[1, :5] = False  # the padding tensor the mask reads, changed in place
    after, _ = attention_forward(module, q, k, v, carried)
    assert carried._dense is not made and torch.equal(carried._dense[1], carried.mask.dense(1, 12))
    assert not carried._dense[1][1, ..., :5].any() and torch.equal(after[0], first[0])
    assert not torch.equal(after[1], first[1])
    # the last query of the cache sees every key: nothing hidden, so the layers make the plain call
    last = sa_hf.mask_function(2, 1, 12, torch.tensor(11), 0, transformers.masking_utils.causal_mask_function,
                               torch.ones(2, 12, dtype=torch.bool))
    out, _ = attention_forward(module, q, k, v, last)
    assert last._dense[1] is None
    torch.testing.assert_close(out, selfattn.attention(q, k, v).transpose(1, 2))

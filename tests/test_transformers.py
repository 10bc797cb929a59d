"""selfattn inside real transformers models (tiny random configs, no network).

The oracle is the model in float64 with textbook attention on transformers' own dense mask
(``oracle_attention`` below, independent of selfattn; unlike ``eager`` in float64, it does not
turn a fully masked row into NaN). selfattn in float32 must be within the float32 rule of it: at
most 2x (outputs) or 3x (gradients) the error of the model's ``eager`` attention in float32, plus
16 ulps of the largest value. Batches: right-padded, left-padded, and packed (several sequences
in one row, found from ``position_ids``).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import selfattn  # noqa: E402
from selfattn import masks  # noqa: E402
from selfattn.integrations import transformers as sa_hf  # noqa: E402
from selfattn.testing import GRADIENT_FACTOR, OUTPUT_FACTOR, compare_to_reference  # noqa: E402

NAME = sa_hf.register()
ORACLE = "selfattn_test_oracle"


def oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     softcap=None, s_aux=None, **kwargs):
    """Textbook attention on transformers' dense mask: repeat K/V, scale, soft-cap, mask, sink
    column, softmax (a row that sees nothing gives 0), drop the sink, weights @ V."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    s = query @ k.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    lq, lk = s.shape[-2:]
    if attention_mask is None and (getattr(module, "is_causal", True) if is_causal is None else is_causal) and lq > 1:
        attention_mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    if attention_mask is not None:
        s = s.masked_fill(~attention_mask.bool(), float("-inf"))
    if s_aux is not None:
        s = torch.cat([s, s_aux.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    alive = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(torch.where(alive, s, 0.0), dim=-1) * alive
    p = p[..., :lk]
    return (p @ v).transpose(1, 2).contiguous(), p


def _oracle_mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


transformers.AttentionInterface.register(ORACLE, oracle_attention)
transformers.masking_utils.AttentionMaskInterface.register(ORACLE, _oracle_mask)
L, VOCAB = 24, 101

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
              max_position_embeddings=128)


def _configs() -> dict:
    t = transformers
    return {
        "llama": (t.LlamaConfig, dict(COMMON, intermediate_size=128, num_key_value_heads=2)),
        "mistral": (t.MistralConfig, dict(COMMON, intermediate_size=128, num_key_value_heads=2, sliding_window=7)),
        "gemma2": (t.Gemma2Config, dict(COMMON, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                        sliding_window=6, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=None,
                                        layer_types=["sliding_attention", "full_attention"])),
        "qwen2": (t.Qwen2Config, dict(COMMON, intermediate_size=128, num_key_value_heads=1)),
        "gpt2": (t.GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128)),
        "bert": (t.BertConfig, dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                    vocab_size=VOCAB, max_position_embeddings=128)),
        "gpt_oss": (t.GptOssConfig, dict(COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=16,
                                         num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                         layer_types=["sliding_attention", "full_attention"])),
    }


LOOKUP = torch.rand(40, 40, generator=torch.Generator().manual_seed(3)) > 0.5
CAUSAL = ["llama", "mistral", "gemma2", "qwen2", "gpt2", "gpt_oss"]
MODELS = [*CAUSAL, "bert"]


def _build(model: str, impl: str, dtype: torch.dtype = torch.float32):
    cls, kwargs = _configs()[model]
    cfg = cls(**copy.deepcopy(kwargs))
    auto = transformers.AutoModel if model == "bert" else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if model == "gpt_oss" else {}  # grouped_mm has no float64
    m = auto.from_config(cfg, attn_implementation=impl, **extra)
    return m.to(dtype).eval()


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
    assert carried.contiguous() is carried and carried.detach() is carried
    assert "causal" in repr(carried)
    with pytest.raises(TypeError, match="has no values"):
        carried.float()
    with pytest.raises(TypeError):
        carried & carried
    with pytest.raises(TypeError, match="has no values"):
        carried.sum()


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
    assert len(seen) == 2 and all(isinstance(m, masks.Mask) for m in seen)


# --- the mask function: what each transformers predicate becomes ------------------------------

def _hf_mask(mask_function, *, batch=2, lq=40, lk=40, q_offset=0, kv_offset=0, attention_mask=None):
    from transformers.masking_utils import sdpa_mask
    want = sdpa_mask(batch_size=batch, q_length=lq, kv_length=lk, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, allow_is_causal_skip=False,
                     use_vmap=True)
    carried = sa_hf.mask_function(batch, lq, lk, q_offset, kv_offset, mask_function, attention_mask)
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


@pytest.mark.parametrize(("lq", "lk", "q_offset", "kv_offset"), [(1, 30, 29, 0), (4, 30, 26, 0), (1, 6, 33, 28),
                                                                 (3, 12, 20, 0)])
def test_mask_function_with_cache_offsets(lq, lk, q_offset, kv_offset):
    """Decoding: queries after a cache (aligned bottom-right), a sliding cache that starts past 0,
    and a static cache whose keys run past the queries (not aligned: evaluated, still exact)."""
    mu = transformers.masking_utils
    am = torch.ones(2, kv_offset + lk, dtype=torch.bool)
    am[0, :3] = False
    for fn in (mu.causal_mask_function, mu.sliding_window_causal_mask_function(5)):
        got, want = _hf_mask(fn, lq=lq, lk=lk, q_offset=q_offset, kv_offset=kv_offset, attention_mask=am)
        assert torch.equal(got.dense(lq, lk).expand(2, 1, lq, lk), want)


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

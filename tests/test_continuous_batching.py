"""transformers' continuous batching with ``attn_implementation="selfattn"``.

Continuous batching packs every request of a step into one row and gives each attention call
``cu_seq_lens_q`` / ``cu_seq_lens_k`` with no mask (selfattn registers as a mask-free implementation,
as flash ones are): the adapter runs :func:`selfattn.varlen_attention` on them. The tests compare greedy
tokens with the same batch run by transformers' own implementation (sdpa; eager for Gemma 2, which has
no sdpa path) and with each request generated alone, and the packed call itself with the oracle per
sequence.

Shape legend: T packed tokens, H heads, D head dim.
"""

from __future__ import annotations

import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402

import selfattn.integrations.transformers as sa_hf  # noqa: E402
from selfattn.integrations.transformers._attention import attention_forward  # noqa: E402
from selfattn.testing import reference_attention  # noqa: E402

sa_hf.register()

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=128)

# family -> (config class, model class, config overrides, transformers' own implementation to compare with)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "sdpa"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, "sdpa"),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5), "sdpa"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=5, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                    query_pre_attn_scalar=8), "eager"),
}

GREEDY = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)


def _batching() -> ContinuousBatchingConfig:
    # small pages and steps: a step mixes prefill chunks and decodes, a prompt spans pages
    return ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=24, page_size=4)


def _model(family: str) -> torch.nn.Module:
    config_name, model_name, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**_COMMON, **extra)
    return getattr(transformers, model_name)(config).eval()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 96, (n,), generator=g).tolist() for n in (3, 11, 1, 7, 16)]


def _batch(model: torch.nn.Module, implementation: str, prompts: list[list[int]]) -> list[list[int]]:
    model.set_attn_implementation(implementation)
    out = model.generate_batch(inputs=prompts, generation_config=GREEDY, continuous_batching_config=_batching())
    return [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_batch_gives_the_tokens_of_transformers_own_implementation(family):
    """Requests of different lengths, more tokens than one step holds, windows shorter than the prompts:
    the same greedy tokens as transformers' implementation in the same batch, and as each request alone."""
    model, prompts = _model(family), _prompts()
    reference = FAMILIES[family][3]
    ours = _batch(model, "selfattn", prompts)
    theirs = _batch(model, reference, prompts)
    assert ours == theirs
    model.set_attn_implementation(reference)
    alone = [model.generate(torch.tensor([p]), generation_config=GREEDY)[0, len(p):].tolist() for p in prompts]
    assert ours == alone


def test_the_manager_serves_requests_arriving_later():
    """The manager's background loop: requests added while others decode get their own tokens."""
    model, prompts = _model("llama"), _prompts()
    model.set_attn_implementation("sdpa")
    alone = [model.generate(torch.tensor([p]), generation_config=GREEDY)[0, len(p):].tolist() for p in prompts]
    model.set_attn_implementation("selfattn")
    manager = model.init_continuous_batching(generation_config=GREEDY, continuous_batching_config=_batching())
    manager.start()
    got: dict[str, list[int]] = {}
    try:
        ids = []
        for p in prompts:
            ids.append(manager.add_request(p, max_new_tokens=GREEDY.max_new_tokens))
            time.sleep(0.01)
        deadline = time.monotonic() + 120
        while len(got) < len(ids) and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                got[result.request_id] = list(result.generated_tokens)
    finally:
        manager.stop(block=True, timeout=30)
    assert [got.get(i) for i in ids] == alone
    assert model.config._attn_implementation == "selfattn"  # nothing switched it to another implementation


def _per_sequence(q, k, v, cu_q, cu_k, window):
    """The oracle: each sequence alone, causal aligned bottom-right, the window counted from its diagonal."""
    out = torch.zeros_like(q, dtype=torch.float64)
    for s in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]
        nq, nk = qs.shape[0], ks.shape[0]
        if nq == 0:
            continue
        i = torch.arange(nq)[:, None] + nk - nq
        j = torch.arange(nk)[None, :]
        keep = (j <= i) & ((j >= i - window) if window is not None else True)
        rep = q.shape[1] // k.shape[1]
        o = reference_attention(qs.transpose(0, 1)[None].double(),
                                         ks.repeat_interleave(rep, 1).transpose(0, 1)[None].double(),
                                         vs.repeat_interleave(rep, 1).transpose(0, 1)[None].double(), mask=keep)
        out[cu_q[s]:cu_q[s + 1]] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_packed_call_is_each_sequence_alone(window):
    """The adapter's packed call: prefill chunks (queries after cached keys), decodes (one query), an
    empty request, GQA, a window, and padding past the last entry (continuous batching pads a step)."""
    torch.manual_seed(0)
    cu_q, cu_k = [0, 5, 6, 6, 9], [0, 8, 15, 17, 20]
    tq, tk, h, hkv, d = 11, 22, 4, 2, 8  # 2 padding queries, 2 padding keys
    q, k, v = torch.randn(tq, h, d), torch.randn(tk, hkv, d), torch.randn(tk, hkv, d)
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], None, scaling=d ** -0.5, is_causal=True,
                                     sliding_window=None if window is None else window + 1,
                                     cu_seq_lens_q=torch.tensor(cu_q, dtype=torch.int32),
                                     cu_seq_lens_k=torch.tensor(cu_k, dtype=torch.int32))
    assert weights is None and out.shape == (1, tq, h, d)
    want = _per_sequence(q, k, v, cu_q, cu_k, window)
    torch.testing.assert_close(out[0, :cu_q[-1]].double(), want[:cu_q[-1]], rtol=1e-5, atol=1e-5)


def test_packed_call_refuses_what_it_cannot_give():
    q = torch.randn(1, 2, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="output_attentions"):
        attention_forward(module, q, q, q, None, output_attentions=True, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(ValueError, match="batch of one"):
        attention_forward(module, q.expand(2, -1, -1, -1), q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(TypeError, match="layer type"):
        attention_forward(module, q, q, q, None, cu_seq_lens_q=cu, cu_seq_lens_k={"full_attention": cu})


def test_continuous_batching_seam_is_where_it_was():
    """Fails when transformers moves what the continuous batching seam leans on."""
    import inspect

    from transformers.generation.continuous_batching import continuous_api, utils
    from transformers.masking_utils import _preprocess_mask_arguments

    manager = continuous_api.ContinuousBatchingManager
    assert getattr(manager.switch_to_cb_friendly_attn, "_selfattn_names", None) is not None
    original = inspect.getsource(inspect.unwrap(manager.switch_to_cb_friendly_attn))
    assert "is not supported for continuous batching" in original
    # selfattn gets no mask: only these implementations are given one
    assert inspect.getsource(utils.attn_mask_is_needed).count('["paged|eager", "sdpa"]') == 1
    assert "PagedAttentionCache" in inspect.getsource(_preprocess_mask_arguments)

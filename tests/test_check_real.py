"""The doctor on real attention modules: transformers' GPT-2, Llama and BERT attention (tiny random configs,
eager attention, no download) and torch's nn.MultiheadAttention are certified with their mask verified;
hand-made variants of each with one bug get that bug's id.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from selfattn.check import check

pytest.importorskip("transformers")

import doctor_real_fixtures as rf
from transformers import BertConfig
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def _bert() -> BertSelfAttention:
    config = BertConfig(hidden_size=16, num_attention_heads=4, intermediate_size=32, attention_probs_dropout_prob=0.0)
    config._attn_implementation = "eager"
    return BertSelfAttention(config)


ROPE = None


def _llama_call():
    global ROPE
    ROPE = ROPE or LlamaRotaryEmbedding(rf.llama_config())
    return rf.llama_call(ROPE)


REAL = {
    "GPT2Attention": (rf.gpt2, {}, "additive"),
    "LlamaAttention": (rf.llama, {"call": "llama"}, "additive"),
    "BertSelfAttention": (_bert, {}, "additive"),
    "nn.MultiheadAttention": (lambda: nn.MultiheadAttention(16, 4, batch_first=True), {}, "ignore"),
}


def _options(kwargs: dict) -> dict:
    return {k: (_llama_call() if v == "llama" else v) for k, v in kwargs.items()}


@pytest.mark.parametrize("name", list(REAL))
def test_real_modules_certified_with_mask_verified(name):
    """catches: a false mask-ignored on HF's additive (B, 1, 1, L) masks (BERT), a (B, L) key padding mask never
    applied (nn.MultiheadAttention), rotary positions read as a bug (Llama), GPT-2's Conv1D projections or
    small initialisation hiding the white box."""
    make, kwargs, kind = REAL[name]
    torch.manual_seed(0)
    report = check(make(), **_options(kwargs))
    assert report.passed, [(f.id, f.message) for f in report.findings]
    assert all(f.severity == "warning" for f in report.findings)
    for prop in ("mask", "padding", "white_box", "half_precision", "gradients"):
        assert report.coverage[prop] == "verified", (prop, report.coverage[prop])
    assert report.inferred["mask"]["kind"] == kind
    assert all(r.startswith("matches the definition") for k, r in report.inferred["white box"].items()
               if k != "input scale"), report.inferred["white box"]
    if name == "LlamaAttention":
        assert "rotary" in report.coverage["equivariance"]


def test_config_constructor_is_built():
    """catches: a cls(config, layer_idx) constructor the doctor cannot build without a factory."""
    report = check(GPT2Attention, init={"n_embd": 16, "n_head": 4, "attn_pdrop": 0.0, "resid_pdrop": 0.0})
    assert report.passed and report.inferred["built as"].startswith("GPT2Attention(GPT2Config(")


BUGGY = {"GPT2": (rf.BuggyGPT2, {}), "Llama": (rf.BuggyLlama, {"call": "llama"}),
         "MHA": (rf.BuggyMHA, {"mask_convention": "ignore"})}  # MHA documents key_padding_mask True = padding


@pytest.mark.parametrize("bug", rf.BUGS)
@pytest.mark.parametrize("family", list(BUGGY))
def test_buggy_variants_of_real_modules_get_their_id(family, bug):
    """catches: mask added after softmax, an inverted padding mask, a key mask broadcast over queries, a missing
    scale or heads merged before the transpose passing on a real module, or reported under another id."""
    cls, kwargs = BUGGY[family]
    torch.manual_seed(0)
    report = check(cls(bug), **_options(kwargs))
    assert report.ids == {rf.EXPECTED[bug]}, [(f.id, f.message) for f in report.findings]


@pytest.mark.parametrize("family", list(BUGGY))
def test_hand_written_real_modules_without_bug_pass(family):
    """catches: a variant failing for its hand-written base, not for its bug (the bug tests would prove nothing)."""
    cls, kwargs = BUGGY[family]
    torch.manual_seed(0)
    assert check(cls(None), **_options(kwargs)).passed


def test_readme_llama_example_runs():
    """catches: the README's adapter example for Llama attention drifting from the doctor's API."""
    from test_readme import fenced_blocks

    readme = Path(__file__).resolve().parent.parent / "README.md"
    (block,) = [b for b in fenced_blocks(readme.read_text(encoding="utf-8"))
                if b.lang == "python3" and "LlamaAttention" in b.source]
    exec(compile(block.source, f"README.md:{block.line}", "exec"), {"__name__": "__readme__"})

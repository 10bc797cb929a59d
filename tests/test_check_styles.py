"""The doctor on attention written the way public code bases write it: it runs (never a traceback), raises no
false alarm on correct designs (q/k norms, post-norm blocks, windows, zeroed padded rows, sequence-first
layout, config objects, fixed sizes, required masks, other dtypes), and names the bugs that only show in
half precision, in a hand-written backward, in the scale of modules without usable projections, or for one
of two accepted mask shapes.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import doctor_styles as ds
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfattn.check import check

STYLES = str(Path(ds.__file__))
GPT = str(Path(ds.__file__).with_name("corpus_gpt.py"))

CORRECT = [ds.CausalSelfAttention, ds.Float64Attention, ds.BFloat16Attention, ds.RequiredMask, ds.WindowAttention,
           ds.CachedAttention, ds.QKNormAttention, ds.PostNormBlock, ds.ZeroPaddedQueries, ds.SlidingWindowCausal,
           ds.CausalSwitch, ds.PreNormAttention, ds.NoProjection]
# torch's own behaviour for a sequence that is all padding (NaN) is a warning, not an error
WARNINGS = {ds.Float64Attention: {"nan-on-empty-sequence"}, ds.PostNormBlock: {"nan-on-empty-sequence"}}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selfattn.cli", "check", *args, "--json"], capture_output=True,
                          text=True, timeout=600)


def _errors(report) -> list:
    return [(f.id, f.message) for f in report.findings if f.severity == "error"]


@pytest.mark.parametrize("cls", CORRECT, ids=lambda c: c.__name__)
def test_correct_styles_are_certified(cls):
    """catches: false alarms on q/k norms (definition-mismatch), post-norm blocks, zeroed padded query rows, a
    built-in sliding window (causal-leak), a causal switch (no mask), and crashes on config objects, fixed
    window lengths, maximum batches, required masks and float64 / bfloat16 parameters."""
    report = check(cls)
    assert report.passed and not _errors(report), _errors(report)
    assert report.ids <= WARNINGS.get(cls, set()), report.ids
    assert report.coverage["white_box"] == "verified", report.inferred.get("white box")


def test_config_class_in_the_checked_file_builds_with_and_without_init():
    """catches: ``TypeError: vars() argument must have __dict__ attribute`` (a traceback, exit 1) for any
    Cls(config) class loaded from a file, with no options and with --init."""
    plain = _cli(f"{GPT}:CausalSelfAttention")
    assert plain.returncode == 0 and "Traceback" not in plain.stderr, plain.stdout + plain.stderr
    built = json.loads(plain.stdout)["inferred"]["built as"]
    assert built.startswith("CausalSelfAttention(GPTConfig(") and "'n_embd': 64" in built and "'dropout'" not in built
    init = _cli(f"{GPT}:CausalSelfAttention", "--init", '{"n_embd": 48, "n_head": 4, "dropout": 0.0}')
    styles = _cli(f"{STYLES}:CausalSelfAttention")  # the config class imported next to a subclass
    assert styles.returncode == 0, styles.stdout + styles.stderr
    assert init.returncode == 0, init.stdout + init.stderr
    assert json.loads(init.stdout)["inferred"]["embed_dim"] == 48


def test_never_a_traceback(tmp_path):
    """catches: exit 1 with a traceback (the code of "found a bug") when a module cannot be built or called,
    and an error that names the last signature tried instead of the argument the doctor could not guess."""
    user = tmp_path / "odd.py"
    user.write_text("import torch\nfrom torch import nn\n\n"
                    "class NeedsVocab(nn.Module):\n"
                    "    def __init__(self, dim, vocab_size):\n        super().__init__()\n"
                    "        self.p = nn.Linear(dim, dim)\n\n"
                    "    def forward(self, x):\n        return self.p(x)\n\n"
                    "class ReturnsText(nn.Module):\n"
                    "    def __init__(self, dim):\n        super().__init__()\n\n"
                    "    def forward(self, x):\n        return 'attention'\n")
    vocab = _cli(f"{user}:NeedsVocab")
    assert vocab.returncode == 2 and "Traceback" not in vocab.stderr
    error = json.loads(vocab.stdout)["error"]
    assert "'vocab_size'" in error and "--init" in error and "--factory" in error, error
    text = _cli(f"{user}:ReturnsText")
    assert text.returncode == 2 and "Traceback" not in text.stderr
    assert "not a tensor" in json.loads(text.stdout)["error"]


def test_probes_run_in_the_modules_dtype():
    """catches: float32 probe input sent to float64 and bfloat16 modules (a dtype error, exit 2)."""
    for cls, dtype in ((ds.Float64Attention, "float64"), (ds.BFloat16Attention, "bfloat16")):
        report = check(cls)
        assert report.inferred["dtype"] == dtype and report.passed, _errors(report)
        assert report.coverage["mask"] == "verified"


def test_required_mask_is_sent():
    """catches: a forward(x, mask) with no default failing on forward(x) before any probe ran."""
    report = check(ds.RequiredMask)
    assert "requires" in report.inferred["call"] and report.inferred["mask"]["kind"] == "keep"
    assert report.coverage["mask"] == report.coverage["padding"] == "verified"


def test_fixed_length_and_batch_limit_are_facts():
    """catches: a 49-token window module refused (exit 2), and a cache allocated for 32 rows reported as
    shape-dependent with advice to look for .T; also that --length states the length."""
    window = check(ds.WindowAttention)
    assert "49" in window.inferred["length"] and window.inferred["probe shape"][1] == 49 and window.passed
    stated = check(ds.WindowAttention, length=49, batch=2)
    assert stated.inferred["probe shape"] == (2, 49, 64) and stated.passed
    cache = check(ds.CachedAttention)
    assert "batch <= 32" in cache.inferred["batch limit"] and "shape-dependent" not in cache.ids
    assert cache.passed


def test_default_width_is_like_a_real_model():
    """catches: classes built at E = 16 by default (toy sizes that hide head-dim bugs)."""
    assert check(ds.QKNormAttention).inferred["built as"] == "QKNormAttention(dim=64)"


def test_sequence_first_module_is_recognised():
    """catches: nn.MultiheadAttention(E, H) in its default (L, B, E) layout reported as batch-mixing."""
    torch.manual_seed(0)
    report = check(nn.MultiheadAttention(64, 4))
    assert report.passed and "sequence-first" in report.inferred["layout"], _errors(report)
    assert report.inferred["mask"]["argument"] == "key_padding_mask" and report.coverage["white_box"] == "verified"


def test_design_facts_are_reported():
    """catches: a sliding window, a residual + norm after the attention and zeroed padded rows raising
    causal-leak / definition-mismatch instead of being reported as what they are."""
    window = check(ds.SlidingWindowCausal)
    assert window.inferred["window"] == "sliding window: each query sees itself and the 3 previous tokens"
    assert window.inferred["causal"] is True and not window.findings
    post = check(ds.PostNormBlock)
    assert "adds more after it" in post.inferred["design"]["after the attention"]
    zeroed = check(ds.ZeroPaddedQueries)
    assert zeroed.inferred["design"]["padded queries"] == "the outputs of padded positions are zeroed"
    normed = check(ds.QKNormAttention)
    assert normed.inferred["design"]["q/k normalisation"] == "q and k are normalised (rms_norm) before the scores"


def test_arguments_that_change_nothing_are_not_the_mask():
    """catches: an unused ``layer_past=None`` taken as the mask (mask-ignored), and an adapter that does not pass
    the mask on reported as mask-ignored with no way to say "no mask"."""
    report = check(ds.CausalSelfAttention)
    assert report.coverage["mask"].startswith("not applicable") and "layer_past" in report.coverage["mask"]
    adapter = check(ds.CausalSelfAttention, call=lambda m, x, mask: m(x))
    assert adapter.passed and "does not pass the mask" in adapter.coverage["mask"]
    two = check(ds.CausalSelfAttention, call=lambda m, x: m(x))
    assert two.passed and "passes no mask" in two.coverage["mask"]
    said = check(ds.QKNormAttention, no_mask=True)
    assert said.passed and "--no-mask" in said.coverage["mask"]


def test_call_on_part_of_a_module_needs_no_gradient_elsewhere():
    """catches: no-grad on the MLP's parameters when --call runs only the attention of a residual block."""
    report = check(ds.Block, call=lambda m, x: m.attn(x))
    assert report.passed and "no-grad" not in report.ids, _errors(report)


def test_seed_seeds_the_construction():
    """catches: --seed seeding only the probe inputs, so a report on a random draw of weights cannot be repeated."""
    a, b, c = (check(ds.QKNormAttention, seed=s) for s in (3, 3, 4))
    assert a.inferred["gradients"] == b.inferred["gradients"] != c.inferred["gradients"]


def test_mask_dropped_in_half_precision_is_found():
    """catches: a module that skips its mask in float16/bfloat16 certified because the half-precision probe only
    checked that the output is finite."""
    report = check(ds.MaskDroppedInHalf)
    assert "half-precision-mismatch" in report.ids and not report.passed
    finding = next(f for f in report.findings if f.id == "half-precision-mismatch")
    assert "mask is lost" in finding.message and all("with mask" in k for k in finding.evidence)


def test_wrong_backward_is_found():
    """catches: a custom autograd.Function whose backward is 15% off certified because gradients only had to exist."""
    report = check(ds.WrongBackward)
    assert report.ids == {"wrong-gradient"}, _errors(report)
    assert report.inferred["gradients"]["dtype"] == "float64"


@pytest.mark.parametrize(("cls", "fit"), [(ds.PreNormModelDimScale, "sqrt(E) (embed dim, not head dim)"),
                                          (ds.NoProjectionScaleByCh, "1/D instead of 1/sqrt(D), D = 16")])
def test_scale_bugs_without_usable_projections_are_found(cls, fit):
    """catches: a LayerNorm before the projections or no projections at all leaving the white box "not verified",
    so that dim ** -0.5 instead of dim_head ** -0.5, or 1/ch instead of 1/sqrt(ch), passed."""
    report = check(cls)
    assert report.ids == {"wrong-scale"}, _errors(report)
    assert fit in report.findings[0].message


def test_every_accepted_mask_shape_is_probed():
    """catches: a module that takes (B, 1, L, L) and (B, 1, 1, L) additive masks but puts the second on the query
    axis, certified because only the first accepted shape was probed."""
    report = check(ds.TwoMaskShapes)
    assert report.ids == {"mask-broadcast"}, _errors(report)


class _IgnoredSwitch(ds.Heads):
    def forward(self, x, is_causal: bool = False):
        q, k, v = self.split(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v))


def test_causal_switch_is_a_mask():
    """catches: a module whose mask is SDPA's is_causal switch reported as taking no mask, and a switch that
    does nothing certified."""
    report = check(ds.CausalSwitch)
    assert report.inferred["mask"]["argument"] == "is_causal" and report.coverage["mask"] == "verified"
    assert report.coverage["padding"].startswith("not applicable")
    assert check(_IgnoredSwitch).ids == {"causal-leak"}


def test_half_precision_fix_follows_the_exception():
    """catches: a half-precision crash inside a LayerNorm given the -1e9 fill advice."""
    (finding,) = check(ds.LayerNormHalfCrash).findings
    assert finding.id == "half-precision-overflow" and "-1e9" not in finding.fix and "mixes" in finding.fix


def test_attention_mask_read_as_true_masked_is_a_warning():
    """catches: an ``attention_mask`` argument read as True = masked (the opposite of the HF convention) passing
    without a word."""
    report = check(ds.IgnoreNamedAttentionMask)
    (finding,) = report.findings
    assert report.passed and finding.id == "mask-convention" and finding.severity == "warning"
    assert "1 = attend" in finding.message and "True = masked" in finding.message


class _MaskIgnored(ds.Heads):
    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        return self.merge(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.dim_head), -1) @ v)


def test_report_never_contradicts_itself():
    """catches: coverage.mask "verified" beside inferred.mask "not understood" for a module that ignores its mask."""
    report = check(_MaskIgnored)
    assert report.ids == {"mask-ignored"}
    assert report.coverage["mask"].startswith("verified: the module ignores its mask")
    assert "accepted but ignored" in report.inferred["mask"] and "not understood" not in report.inferred["mask"]
    for state in report.coverage.values():
        assert state == "verified" or state.startswith(("verified:", "not applicable", "not verified"))


def test_qk_norm_in_transformers_families():
    """catches: definition-mismatch on transformers' Qwen3 and OLMo2 attention (q/k normalised before the scores)."""
    pytest.importorskip("transformers")
    from transformers import Olmo2Config, Qwen3Config
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention, Olmo2RotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    for config_cls, attn_cls, rope_cls in ((Qwen3Config, Qwen3Attention, Qwen3RotaryEmbedding),
                                           (Olmo2Config, Olmo2Attention, Olmo2RotaryEmbedding)):
        config = config_cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                            num_hidden_layers=1, head_dim=16)
        config._attn_implementation = "eager"
        rope = rope_cls(config)

        def call(m, x, mask, rope=rope):
            pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
            return m(x, position_embeddings=rope(x, pos), attention_mask=mask)[0]

        torch.manual_seed(0)
        report = check(attn_cls(config, layer_idx=0), call=call)
        assert report.passed and not report.findings, (attn_cls.__name__, _errors(report))
        assert report.coverage["white_box"] == report.coverage["mask"] == "verified"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(200))
def test_no_false_alarm_over_200_seeds(seed):
    """catches: a false alarm that only some weight draws give (1 in 1000 draws of a q/k-norm module gave
    causal-leak: a tiny attention weight read as a hidden key)."""
    for cls in CORRECT:
        report = check(cls, seed=seed)
        assert not _errors(report), (cls.__name__, seed, _errors(report))

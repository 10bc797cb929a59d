"""The doctor on transformers' own attention classes, one tiny random model per family (tests/hf_corpus.py).

A representative handful runs in the default suite; the sweep over every family
(scripts/doctor_sweep.py, in worker processes) is the slow test. Families the doctor does not
handle yet are xfail(strict=True) with the reason, so each flips when the doctor does.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from selfattn.check import check

pytest.importorskip("transformers")

import hf_corpus as hc

ROOT = Path(__file__).resolve().parent.parent

# family -> why the doctor does not certify it yet (measured)
NOT_YET: dict[str, str] = {}
FAST = ["llama", "gpt2", "bert", "qwen3", "olmo2", "mistral", "gemma2", "t5", "vit"]


@pytest.mark.parametrize("family", [pytest.param(f, marks=[pytest.mark.xfail(strict=True, reason=NOT_YET[f])]
                                                 if f in NOT_YET else []) for f in FAST])
def test_family_self_attention_is_certified(family):
    """catches: a false alarm on a transformers family's own attention (GQA, rotary, q/k norm, sliding window,
    soft-capping, relative-position bias, Conv1D projections, encoder and vision attention) called as its layers
    call it."""
    built = hc.build(family)
    report = check(built.module, call=built.call, **built.options)
    assert report.passed, [(f.id, f.message) for f in report.findings]
    assert report.coverage["white_box"] == "verified", report.coverage


def test_adapter_finds_rotary_and_mask_argument():
    """catches: the generic adapter calling Llama without its rotary positions or its mask argument (the doctor
    would then check something other than what the decoder layer runs)."""
    built = hc.build("llama")
    assert built.class_name == "LlamaAttention" and built.path == "layers.0.self_attn"
    report = check(built.module, call=built.call)
    assert report.coverage["mask"] == "verified" and report.inferred["mask"]["kind"] == "additive"
    assert "rotary" in report.coverage["equivariance"]


def test_family_list_and_reasons():
    """catches: the sweep silently skipping families (every package with a modeling file is listed) or a family
    that cannot be built without a reason."""
    names = hc.families()
    assert {"llama", "bert", "t5", "gpt2"} <= set(names) and "auto" in names
    with pytest.raises(hc.CannotBuild, match="no config class"):
        hc.build("auto")


@pytest.mark.slow
def test_full_sweep(tmp_path):
    """catches: a family whose self-attention the doctor crashes on (a traceback from selfattn.check), or a hang:
    every family gets a verdict, none 'doctor raised' or 'timed out'."""
    out = tmp_path / "sweep.json"
    docs = tmp_path / "doctor.md"
    done = subprocess.run([sys.executable, "scripts/doctor_sweep.py", "--json", str(out), "--docs", str(docs)],
                          cwd=ROOT, capture_output=True, text=True, timeout=4 * 3600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(hc.families())
    bad = [(r["family"], r["verdict"], r.get("reason")) for r in rows if r["verdict"] in ("doctor raised",
                                                                                         "timed out", "worker died")]
    assert not bad, bad
    assert "<!-- sweep:transformers -->" in docs.read_text()


@pytest.mark.parametrize("family", ["persimmon", "nanochat", "timesfm2_5"])
def test_q_k_normalised_projections_get_no_false_gradient_alarm(family):
    """catches: the gradient check's finite differences moving every parameter by one absolute step, which takes
    q/k-normalised projections initialised small out of their linear range (wrong-gradient on correct modules)."""
    built = hc.build(family)
    report = check(built.module, call=built.call, **built.options)
    assert "wrong-gradient" not in report.ids, [(f.id, f.evidence) for f in report.findings]
    assert report.coverage["gradients"] == "verified", report.coverage


@pytest.mark.parametrize("family", ["gpt_oss", "muse_glimmer", "wav2vec2_bert"])
def test_scales_and_positions_read_through_rotations_are_designs(family):
    """catches: the walk back through rotary positions counting YaRN's attention factor on cos and sin as a
    scale (gpt-oss: wrong-scale), a scale the config states after a q/k norm (MuseGlimmer's qk_scale_factor)
    read as wrong-scale, and Shaw-style relative-position logits (Wav2Vec2-BERT) read as definition-mismatch."""
    built = hc.build(family)
    report = check(built.module, call=built.call, **built.options)
    assert report.passed, [(f.id, f.message) for f in report.findings] + [report.not_verified]

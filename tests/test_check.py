"""The attention doctor: passing modules pass, each known bug gets exactly its finding id."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import doctor_fixtures as fx
import pytest
import seed_models as sm
import torch
from rich.console import Console
from torch import nn

import selfattn
from selfattn.check import CannotRun, check, render


class TorchMHAWrapper(nn.Module):
    """nn.MultiheadAttention behind forward(x)."""

    def __init__(self, embed_dim: int, num_heads: int = 4) -> None:
        super().__init__()
        self.m = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)

    def forward(self, x):
        return self.m(x, x, x, need_weights=False)[0]


PASSING = [selfattn.SelfAttention, selfattn.MultiHeadAttention, TorchMHAWrapper, fx.CausalCorrect, fx.RelativeBias,
           fx.Alibi, fx.KeyPaddingMask, fx.HFStyleAdditive]
# Correct in float32; their masked_fill(mask == 0, -1e9) raises in float16 (-1e9 does not fit).
HALF_OVERFLOW = [sm.TutorialSelfAttention, sm.TutorialOptimizedSelfAttention, sm.TutorialMultiHeadAttention,
                 sm.CorrectedSelfAttention]


def _no_false_alarm(cls, seed):
    report = check(cls, seed=seed)
    assert report.passed and not report.findings, [(f.id, f.message, f.evidence) for f in report.findings]


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("cls", PASSING, ids=lambda c: c.__name__)
def test_correct_modules_pass_without_false_alarms(cls, seed):
    """catches: probes so strict that a correct module (ours, torch's, with positions or any mask style) gets a
    finding."""
    _no_false_alarm(cls, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 20))
@pytest.mark.parametrize("cls", PASSING, ids=lambda c: c.__name__)
def test_correct_modules_pass_without_false_alarms_20_seeds(cls, seed):
    """catches: a false alarm that only some probe inputs trigger."""
    _no_false_alarm(cls, seed)


@pytest.mark.parametrize("cls", HALF_OVERFLOW, ids=lambda c: c.__name__)
def test_tutorial_classes_get_exactly_half_precision_overflow(cls):
    """catches: the tutorial's float16 crash (masked_fill(mask == 0, -1e9)) kept as a note, or buried among
    false alarms."""
    report = check(cls)
    assert not report.passed and report.ids == {"half-precision-overflow"}
    (finding,) = report.findings
    assert finding.severity == "error"
    assert any("value cannot be converted" in why for why in finding.evidence.values()), finding.evidence
    assert "finfo" in finding.fix and "scaled_dot_product_attention" in finding.fix
    assert report.coverage["mask"] == "verified" and report.coverage["half_precision"] == "verified"


@pytest.mark.parametrize("cls", list(fx.BUGGY), ids=lambda c: c.__name__)
def test_each_bug_gets_exactly_its_id(cls):
    """catches: a bug missed, or reported under the wrong id, or buried among side effects."""
    want, kwargs = fx.BUGGY[cls]
    report = check(cls, **kwargs)
    assert report.ids == {want}, [(f.id, f.message) for f in report.findings]
    (finding,) = report.findings
    assert finding.message and finding.fix and finding.evidence
    assert report.passed == (finding.severity == "warning")  # a warning is named and does not fail the module


def test_causal_flag_requires_causality():
    """catches: --causal not enforced on a bidirectional module."""
    assert check(fx.CausalCorrect, causal=True).passed
    assert check(selfattn.SelfAttention, causal=True).ids == {"causal-leak"}


def test_inferred_call_and_mask_convention():
    report = check(sm.TutorialMultiHeadAttention(32, 4))
    assert report.inferred["call"] == "forward(x)"
    assert report.inferred["mask"]["kind"] == "keep"
    assert report.inferred["mask"]["shape"] == "(B, 1, L, L)"  # (B, L, L) does not broadcast against heads
    report = check(fx.MaskInverted)  # no declared convention: an ignore-convention module is fine
    assert report.passed and report.inferred["mask"]["kind"] == "ignore"


def test_module_state_is_restored():
    """catches: the doctor leaving a user's module in eval mode or wiping its gradients."""
    m = selfattn.MultiHeadAttention(16, 4).train()
    m.qkv.weight.grad = m.qkv.weight.detach().clone()
    check(m)
    assert m.training and m.qkv.weight.grad is not None


def test_cannot_run_is_reported():
    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("nope")

    with pytest.raises(CannotRun, match="every input shape"):
        check(Broken())


class _SelfAttention(nn.Module):
    """Correct single-head attention behind forward(x[, mask]) (mask: (B, L, L), True = may attend)."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)

    def forward(self, x, mask=None):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1) @ v


class _RaisesUnderAutograd(_SelfAttention):
    """Correct, but refuses an input that requires grad: only the gradients probe cannot run."""

    def forward(self, x, mask=None):
        if x.requires_grad:
            raise RuntimeError("no autograd here")
        return super().forward(x, mask)


class _RefusesEmptyRows(_SelfAttention):
    """Correct, but raises on a mask that leaves a query row without any visible key."""

    def forward(self, x, mask=None):
        if mask is not None and not mask.any(-1).all():
            raise ValueError("a row has no visible key")
        return super().forward(x, mask)


def test_probe_that_raises_is_not_verified_and_the_verdict_inconclusive():
    """catches: a probe that crashes on an unexpected exception being dropped silently (the property
    looks checked), taking the whole check down with it, or the module certified (PASSED) although a
    property was never looked at."""
    report = check(_RaisesUnderAutograd)
    assert report.not_verified == {"gradients": "not verified: RuntimeError: no autograd here"}
    assert not report.passed and report.verdict == "inconclusive" and report.findings == []
    assert report.doctor_errors == []  # the module raised, not the doctor
    assert json.loads(report.to_json())["verdict"] == "inconclusive"
    with pytest.raises(AssertionError, match=r"(?s)inconclusive.*gradients"):
        selfattn.testing.assert_attention_correct(_RaisesUnderAutograd)
    assert report.inferred["white box"]["without mask"].startswith("matches the definition")
    assert report.inferred["white box"]["with a causal mask"].startswith("matches the definition")
    assert report.coverage["gradients"] == "not verified: RuntimeError: no autograd here"
    assert json.loads(report.to_json())["not_verified"] == report.not_verified
    console = Console(file=io.StringIO(), width=200)
    render(report, console)
    assert "not verified: RuntimeError: no autograd here" in console.file.getvalue()
    assert "INCONCLUSIVE" in console.file.getvalue()


def test_a_probe_failing_inside_the_doctor_is_a_doctor_error_never_a_pass(monkeypatch):
    """catches: the white box raising inside the doctor's own code (a doctor bug) and the report still saying
    PASSED with the white box "not verified": no certificate without a look."""
    from selfattn.check import doctor

    table = tuple(dataclasses.replace(p, run=None) if p.name == "white box" else p for p in doctor.PROBES)
    monkeypatch.setattr(doctor, "PROBES", table)  # the call itself fails in the doctor's code
    report = check(selfattn.SelfAttention(16))
    assert report.verdict == "inconclusive" and not report.passed
    assert report.doctor_errors == ["white box"]
    assert report.not_verified["white box"].startswith("not verified (doctor error): TypeError")
    assert report.coverage["white_box"].startswith("not verified (doctor error)")
    data = json.loads(report.to_json())
    assert data["inconclusive"] is True and data["doctor_errors"] == ["white box"]


def test_a_probe_emitting_a_kind_it_does_not_declare_is_a_doctor_error(monkeypatch):
    """catches: a probe reporting a finding kind its entry in the probe table does not declare (the table is how
    a reader knows what each probe can say) and the report taking it as a verdict."""
    from selfattn.check import doctor
    from selfattn.check.findings import MISSING_SCALE, Finding
    from selfattn.check.subject.context import Outcome

    def says_missing_scale(ctx):
        return Outcome([Finding.of(MISSING_SCALE, "made up", {})])

    table = tuple(dataclasses.replace(p, run=says_missing_scale) if p.name == "eval determinism" else p
                  for p in doctor.PROBES)
    monkeypatch.setattr(doctor, "PROBES", table)
    report = check(selfattn.SelfAttention(16))
    assert report.verdict == "inconclusive" and "missing-scale" not in report.ids
    assert report.doctor_errors == ["eval determinism"]
    assert "does not declare" in report.not_verified["eval determinism"]


def test_probes_do_not_depend_on_state_left_by_another():
    """catches: half precision reading the fully-masked-row mask that an earlier probe stored on the
    doctor (it failed with AttributeError whenever that probe had raised first), and a module that refuses
    a row with no visible key (an explicit error, not NaN) left unverified instead of reported as a fact."""
    report = check(_RefusesEmptyRows)
    assert report.not_verified == {}, report.not_verified
    assert report.inferred["fully masked rows"].startswith("refused by the module (no NaN): ValueError")
    assert report.passed and report.inferred["mask"]["kind"] == "keep"


def test_assert_attention_correct():
    selfattn.testing.assert_attention_correct(selfattn.SelfAttention(16))
    with pytest.raises(AssertionError, match="missing-scale"):
        selfattn.testing.assert_attention_correct(fx.MissingScale(16))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selfattn.cli", "check", *args], capture_output=True, text=True,
                          timeout=300)


def _cli_here(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """``selfattn check`` run in this process: its exit status and what it printed."""
    from selfattn.cli import main

    capsys.readouterr()
    try:
        code = main(["check", *args])
    except SystemExit as stop:  # argparse's --help
        code = stop.code if isinstance(stop.code, int) else 0
    return code, capsys.readouterr().out


def test_cli_json_exit_codes_and_files_untouched(tmp_path, capsys):
    """catches: wrong exit statuses, a JSON shape other than documented, or the user's folder modified."""
    src = Path(fx.__file__).read_text()
    user = tmp_path / "user_attention.py"
    user.write_text(src)
    before = sorted(p.name for p in tmp_path.iterdir())
    ok = _cli(f"{user}:CausalCorrect", "--causal", "--json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert data["passed"] is True and data["findings"] == [] and "inferred" in data
    assert set(data["coverage"]) >= {"mask", "padding", "causal", "batch_independence", "equivariance",
                                     "half_precision", "gradients", "white_box"}
    # the rest in this process: the exit statuses and JSON are the same, without a start of Python each
    code, out = _cli_here(capsys, f"{user}:MaskInverted", "--mask-convention", "keep", "--json")
    assert code == 1
    (finding,) = json.loads(out)["findings"]
    assert set(finding) == {"id", "severity", "message", "evidence", "fix"} and finding["id"] == "mask-inverted"
    assert finding["severity"] == "error"
    code, out = _cli_here(capsys, f"{user}:NoSuchClass")
    assert code == 2 and "NoSuchClass" in out
    code, out = _cli_here(capsys, f"{user}:NoSuchClass", "--json")
    missing = json.loads(out)
    assert missing["verdict"] == "could not run" and missing["passed"] is False and "NoSuchClass" in missing["error"]
    code, out = _cli_here(capsys, f"{user}:MHAViewMerge", "--init", '{"embed_dim": 32, "num_heads": 8}', "--json")
    assert code == 1 and json.loads(out)["findings"][0]["id"] == "head-merge"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert user.read_text() == src
    assert "imports and runs" in _cli_here(capsys, "--help")[1].replace("\n", " ")


class _ValuesFromKeys(_SelfAttention):
    """Broken: the weights multiply the keys; the values are computed (one fused projection) and dropped."""

    def forward(self, x, mask=None):
        q, k, _ = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ k


class _TrainReturnsNone(_SelfAttention):
    """Correct; its train() returns None, as some public modules' overrides do (timm's LeViT)."""

    def train(self, mode=True):
        super().train(mode)


class _ZeroInitOutput(_SelfAttention):
    """Correct; its output projection starts at zero, as some models initialise it (the output is 0 at first)."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__(embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x, mask=None):
        return self.out(super().forward(x, mask))


def test_values_replaced_by_the_keys_are_not_certified():
    """catches: attention that multiplies the weights by the keys, certified because the fused projection that
    also makes the (unused) values still gets a gradient."""
    report = check(_ValuesFromKeys(32))
    assert not report.passed and "no-grad" in report.ids, [(f.id, f.evidence) for f in report.findings]


def test_modules_whose_train_returns_none_and_zero_initialised_outputs_are_checked():
    """catches: a crash on ``module.eval()`` returning None, and a zero-initialised output projection (constant
    output) read as causal-leak, mask-inverted and no-grad instead of probed with those weights drawn."""
    assert check(_TrainReturnsNone(32)).passed
    report = check(_ZeroInitOutput(32))
    assert report.passed, [(f.id, f.message) for f in report.findings]
    assert "out.weight" in report.inferred["drawn"] and report.coverage["gradients"] == "verified"


class _TalkingHeads(nn.Module):
    """Correct talking-heads attention (CaiT): the weights are mixed across heads after the softmax."""

    def __init__(self, embed_dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.mix = nn.Parameter(torch.eye(heads) + 0.1 * torch.randn(heads, heads))

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attn = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        attn = torch.einsum("bhij,hg->bgij", attn, self.mix)
        return (attn @ v).transpose(1, 2).reshape(b, n, e)


def test_talking_heads_are_a_design_not_a_matmul_order_bug():
    """catches: the head-mixing product after the softmax read as the product with the values (matmul-order on
    correct code), or as a departure from the definition: talking heads (Shazeer et al. 2020) is a design."""
    report = check(_TalkingHeads(32))
    assert report.passed, [(f.id, f.message) for f in report.findings]
    assert "talking heads" in report.inferred["design"]


_INCONCLUSIVE_FILE = '''
import torch
from torch import nn


class RefusesGrad(nn.Module):
    """Correct attention that refuses an input requiring grad: the gradients cannot be probed."""

    def __init__(self, embed_dim):
        super().__init__()
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)

    def forward(self, x):
        if x.requires_grad:
            raise RuntimeError("no autograd here")
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v
'''


def test_cli_exit_status_3_when_inconclusive(tmp_path, capsys):
    """catches: an inconclusive verdict (a probe could not run) exiting 0 as a certificate, or 1 as a bug."""
    user = tmp_path / "refuses.py"
    user.write_text(_INCONCLUSIVE_FILE)
    out = _cli(f"{user}:RefusesGrad", "--json")
    assert out.returncode == 3, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["verdict"] == "inconclusive" and data["passed"] is False and "gradients" in data["not_verified"]
    code, text = _cli_here(capsys, f"{user}:RefusesGrad")
    assert code == 3 and "INCONCLUSIVE" in text


class _KeyFromTheQueryProjection(nn.Module):
    """Broken: the key projection is defined but the keys come from the query projection (k = self.query(x))."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(embed_dim, embed_dim) for _ in range(3))

    def forward(self, x):
        q, k, v = self.query(x), self.query(x), self.value(x)
        return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1) @ v


def test_a_projection_the_forward_never_uses_is_no_grad():
    """catches: a key projection left out of the computation (the keys taken from the query projection)
    certified because only the parameters the call touches were required to get a gradient."""
    report = check(_KeyFromTheQueryProjection(32))
    assert "no-grad" in report.ids and not report.passed, [(f.id, f.evidence) for f in report.findings]
    (finding,) = [f for f in report.findings if f.id == "no-grad"]
    assert finding.evidence["projections never used"] == ["key"]

"""The doctor on modules written the way code bases write them: every mask convention, any signature,
white-box verdicts that count, position terms, coverage and severities, and the mutation tool.

Shape legend: B batch, H heads, L length, E embed dim, D head dim.
"""

from __future__ import annotations

import ast
import io
import json
import math
from pathlib import Path

import doctor_fixtures as fx
import pytest
import torch
from rich.console import Console
from torch import nn

from selfattn.check import COVERED, MaskSpec, check, parse_mask, render
from selfattn.cli import main
from selfattn.mutation import mutants

FILLS = {"finfo.min": None, "-10000": -1e4}


class Convention(nn.Module):
    """Correct two-head attention whose mask has the given kind and shape (see selfattn.check.MASK_KINDS)."""

    def __init__(self, embed_dim: int = 16, kind: str = "keep", shape: str = "BLL", fill: float | None = None) -> None:
        super().__init__()
        self.kind, self.shape, self.fill = kind, shape, fill
        self.heads, self.head_dim = 2, embed_dim // 2
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, mask=None):
        b, length, e = x.shape
        q, k, v = (t.view(b, length, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            m = {"LL": lambda: mask[None, None], "BLL": lambda: mask[:, None], "BL": lambda: mask[:, None, None, :],
                 "B1LL": lambda: mask, "B11L": lambda: mask}[self.shape]()
            fill = torch.finfo(scores.dtype).min if self.fill is None else self.fill
            if self.kind == "keep":
                scores = scores.masked_fill(~m, fill)
            elif self.kind == "ignore":
                scores = scores.masked_fill(m, fill)
            elif self.kind in ("keep-int", "keep-float"):
                scores = scores + (1 - m).to(scores.dtype) * fill  # bool masks raise here: 1 - bool
            else:
                scores = scores + m
        w = torch.softmax(scores, -1)
        return self.proj((w @ v).transpose(1, 2).reshape(b, length, e))


KINDS = ("keep", "ignore", "keep-int", "keep-float", "additive")
SHAPES = ("LL", "BLL", "B1LL", "B11L", "BL")


FAST = sorted({(k, "BL") for k in KINDS} | {("additive", s) for s in SHAPES} | {("keep", "LL")})
SLOW = [(k, s) for k in KINDS for s in SHAPES if (k, s) not in FAST]


@pytest.mark.parametrize("kind,shape", [*FAST, *(pytest.param(*c, marks=pytest.mark.slow) for c in SLOW)])
def test_every_mask_convention_is_inferred_and_verified(kind, shape):
    """catches: a correct module whose mask the doctor does not speak (additive float, (B, L) key padding,
    integer 1/0) reported as mask-ignored, or passed with its mask never applied."""
    report = check(Convention(16, kind, shape))
    assert report.passed and not report.findings, [(f.id, f.message) for f in report.findings]
    assert report.coverage["mask"] == "verified" and report.coverage["padding"] == "verified"
    note = report.inferred["mask"]
    found = {"keep-float": "keep-int"}.get(kind, kind)  # a 1.0/0.0 float mask module takes 1/0 integers too
    assert note["kind"] == found, note
    if shape == "BL":  # (B, 1, 1, L) modules also take (B, 1, L, L) masks: the broader shape is found first
        assert note["shape"] == "(B, L)"


@pytest.mark.parametrize("fill", FILLS.values(), ids=FILLS)
def test_module_fill_values_pass(fill):
    """catches: -10000 or finfo.min fills (the usual additive values) read as a leaky mask."""
    assert check(Convention(16, "keep-int", "B11L", fill)).passed


def test_stated_mask_is_used_and_checked():
    """catches: --mask ignored, or a stated convention the module does not follow certified."""
    report = check(Convention(16, "additive", "B11L"), mask="additive (B,1,1,L)")
    assert report.passed and report.inferred["mask"]["shape"] == "(B, 1, 1, L)"
    wrong = check(Convention(16, "additive", "B11L"), mask="keep (B, 1, 1, L)")
    assert not wrong.passed, wrong.inferred
    assert parse_mask("keep (B,L)") == MaskSpec("keep", "BL")
    with pytest.raises(ValueError, match="KIND"):
        parse_mask("additive (L, B)")


class _OddSignature(nn.Module):
    """Correct attention behind forward(tokens, *, pad) -> {"out": ...}; pad (B, L): True = padding."""

    def __init__(self, embed_dim: int = 16) -> None:
        super().__init__()
        self.inner = Convention(embed_dim, "ignore", "BL")

    def forward(self, tokens, *, pad=None):
        return {"out": self.inner(tokens, pad), "aux": None}


def test_adapter_and_make_mask():
    """catches: a module whose signature the doctor cannot guess left unchecked, or make_mask not used."""
    report = check(_OddSignature(), call=lambda m, x, mask: m(x, pad=mask)["out"], make_mask=lambda keep: ~keep,
                   mask="keep (B,L)")
    assert report.passed and report.coverage["mask"] == "verified", report.findings
    assert report.inferred["call"] == "your call(module, x, mask)"
    inverted = check(_OddSignature(), call=lambda m, x, mask: m(x, pad=mask)["out"], make_mask=lambda keep: keep,
                     mask="keep (B,L)")
    assert inverted.ids == {"mask-inverted"}


def test_dict_output_and_keyword_mask():
    """catches: dict outputs and keyword-only mask names (attention_mask) not understood."""
    report = check(fx.HFStyleAdditive)
    assert report.passed and report.inferred["mask"]["argument"] == "attention_mask"
    assert report.inferred["mask"]["kind"] == "additive"


@pytest.mark.parametrize("cls", list(fx.WHITE_BOX_BUGS), ids=lambda c: c.__name__)
def test_output_matching_no_formula_is_an_error(cls):
    """catches: a per-row sqrt(visible keys) scale or a position term added after the softmax certified because
    no black-box probe sees them."""
    report = check(cls)
    assert not report.passed and "definition-mismatch" in report.ids, report.inferred["white box"]
    finding = next(f for f in report.findings if f.id == "definition-mismatch")
    assert finding.severity == "error" and "closest" in finding.evidence
    if cls is not fx.BiasAfterSoftmax:
        assert report.ids == {"definition-mismatch"}
        allowed = check(cls, allow_nonstandard=True)
        assert allowed.passed and allowed.coverage["white_box"].startswith("not verified")


def test_a_scale_no_formula_names_is_measured():
    """catches: a scale written ``hd ** -1 / 2`` (operator precedence: 1 / (2 hd)) reported only as "no formula":
    the scale read from the score product's operands is named, with the head dim it should follow."""
    report = check(fx.PrecedenceScale)
    assert report.ids == {"wrong-scale"}, [(f.id, f.message) for f in report.findings]
    assert "0.03125" in report.findings[0].message and "1/sqrt(16)" in report.findings[0].message


class _NamedSwappedKV(nn.Module):
    """Keys and values swapped between named projections: softmax(Q V^T) K."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(3))
        self.o_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        b, length, e = x.shape
        q, k, v = (p(x).view(b, length, 4, e // 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        w = torch.softmax(q @ v.transpose(-2, -1) / math.sqrt(e // 4), -1)
        return self.o_proj((w @ k).transpose(1, 2).reshape(b, length, e))


def test_roles_are_judged_by_names_not_by_a_fused_order():
    """catches: named k_proj / v_proj used the other way round certified; and a fused projection read in another
    order than q|k|v (CodeGen's q|v|k) called a bug."""
    swapped = check(_NamedSwappedKV)
    assert swapped.ids == {"definition-mismatch"} and "wrong roles" in swapped.findings[0].message
    assert check(fx.EinsumSwappedKV).passed


@pytest.mark.parametrize("cls", [fx.RelativeBias, fx.Alibi], ids=lambda c: c.__name__)
def test_position_terms_are_recognised(cls):
    """catches: a correct module with a relative-position bias or ALiBi failing as not-equivariant."""
    report = check(cls)
    assert report.passed and not report.findings, [(f.id, f.message) for f in report.findings]
    assert report.coverage["equivariance"].startswith("not applicable") and "bias" in report.coverage["equivariance"]


def test_coverage_severity_and_rendering():
    """catches: coverage missing a property, a warning failing the check, or unverified properties hidden."""
    mha = check(nn.MultiheadAttention(16, 4, batch_first=True))
    assert set(mha.coverage) == set(COVERED)
    assert mha.passed and mha.ids == {"nan-on-empty-sequence"}  # torch's own behaviour: a warning
    assert mha.findings[0].severity == "warning"
    data = json.loads(mha.to_json())
    assert data["findings"][0]["severity"] == "warning" and data["coverage"] == mha.coverage

    class NoLinear(nn.Module):
        def forward(self, x):
            return torch.softmax(x @ x.transpose(-2, -1) / x.shape[-1] ** 0.5, -1) @ x

    report = check(NoLinear())  # no projections: the formula is read from the products' operands
    assert report.coverage["mask"].startswith("not applicable")
    assert report.passed and report.coverage["white_box"] == "verified", report.inferred["white box"]

    class Opaque(nn.Module):  # no softmax, no product the doctor can follow
        def forward(self, x):
            return torch.tanh(x)

    report = check(Opaque(), allow_nonstandard=True)
    assert report.coverage["white_box"].startswith("not verified")
    console = Console(file=io.StringIO(), width=200)
    render(report, console)
    out = console.file.getvalue()
    assert "NOT VERIFIED" in out and "white_box" in out


def test_mutant_operators():
    """catches: a mutation operator the documentation lists that generates nothing."""
    source = Path(fx.__file__).read_text()
    ops = {m.operator for m in mutants(source, "KeyPaddingMask")} | {m.operator for m in mutants(source,
                                                                                                 "CausalCorrect")}
    ops |= {m.operator for m in mutants(source, "HFStyleAdditive")}
    assert ops >= {"drop the scale", "scale 1/d instead of 1/sqrt(d)", "swap matmul operands", "drop a transpose",
                   "transpose the batch dimension", "softmax over dim -2", "flip a mask comparison",
                   "drop a mask inversion (~)", "subtract the mask instead of adding it", "causal offset +1",
                   "move the mask after the softmax"}, ops
    for m in mutants(source, "HFStyleAdditive"):
        ast.parse(m.source)


def test_cli_mask_call_factory_and_files_untouched(tmp_path, capsys):
    """catches: --mask, --call and --factory not reaching the doctor, or the user's folder written to."""
    user = tmp_path / "odd.py"
    user.write_text(Path(fx.__file__).read_text())
    before = sorted(p.name for p in tmp_path.iterdir())

    def cli(*args: str) -> tuple[int, str]:
        code = main(["check", *args, "--json"])
        return code, capsys.readouterr().out

    code, out = cli(f"{user}:KeyPaddingMask", "--call", "lambda m, x, mask: m(x, None if mask is None else ~mask)",
                    "--mask", "ignore (B,L)")
    assert code == 0 and json.loads(out)["coverage"]["mask"] == "verified", out
    code, out = cli(f"{user}:HFStyleAdditive", "--factory", "lambda: HFStyleAdditive(16, num_heads=2)")
    report = json.loads(out)
    assert code == 0 and report["inferred"]["built as"] == "your factory", out
    assert report["inferred"]["mask"]["kind"] == "additive"
    assert cli(f"{user}:HFStyleAdditive", "--mask", "sideways (B,L)")[0] == 2
    code, out = cli(f"{user}:VisibleKeysScale")
    assert code == 1 and json.loads(out)["findings"][0]["id"] == "definition-mismatch"
    assert cli(f"{user}:VisibleKeysScale", "--allow-nonstandard")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.slow
def test_mutation_score_on_the_tutorial(tmp_path, capsys):
    """catches: mutants of the seed tutorial's class (wrong scale, transposes, softmax dim, mask polarity, mask
    after softmax, swapped matmuls) that the doctor certifies, or --mutate writing into the user's folder."""
    import seed_models

    user = tmp_path / "tutorial.py"
    user.write_text(Path(seed_models.__file__).read_text())
    assert main(["check", f"{user}:TutorialSelfAttention", "--mutate", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kill_rate"] >= 0.95 and data["non_equivalent"] >= 10, data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tutorial.py"]


def test_mutate_takes_a_factory_that_is_a_module_expression(tmp_path, capsys):
    """catches: --mutate with --factory "Attention(...)" (an expression giving the module, which the plain check
    takes) calling the module it built with no input, exit 2."""
    user = tmp_path / "kernel_attention.py"
    user.write_text(
        "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n\n\n"
        "class KernelAttention(nn.Module):\n"
        "    def __init__(self, dim, heads=2):\n"
        "        super().__init__()\n"
        "        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)\n\n"
        "    def forward(self, x):\n"
        "        b, n, c = x.shape\n"
        "        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)\n"
        "        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))\n")
    assert main(["check", f"{user}:KernelAttention", "--factory", "KernelAttention(16)", "--mutate", "--json"]) != 2
    assert "kill_rate" in json.loads(capsys.readouterr().out)

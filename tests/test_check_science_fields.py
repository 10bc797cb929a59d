"""The doctor on attention from weather, game-playing and PDE code, and on timm's position tables as they ship.

Each module is written in the style of the code base it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from selfattn.check import check


# -- Pangu-Weather: 3-D Earth-specific windows, heads on an axis beside the window types, a periodic longitude ------
def _earth_index(wp: int, wl: int, wn: int) -> torch.Tensor:
    """Pangu's Earth-specific index: absolute pressure levels and latitudes of query and key, longitude offsets."""
    zi, hi, li = torch.meshgrid(torch.arange(wp), torch.arange(wl), torch.arange(wn), indexing="ij")
    zi, hi, li = zi.flatten(), hi.flatten(), li.flatten()
    z = zi[:, None] + zi[None, :] * wp
    h = hi[:, None] + hi[None, :] * wl
    lon = li[:, None] - li[None, :] + wn - 1
    return (z * wl * wl + h) * (2 * wn - 1) + lon


class EarthWindowAttention(nn.Module):
    """Pangu-Weather's block on (B, Pl * Lat * Lon, C) tokens: windows laid out (B * lon windows, window types, N, C),
    q, k and v (B_, H, types, N, D), a bias table per window type (pressure level x latitude band); with ``shift``,
    a cyclic shift whose mask cuts the pressure levels and latitudes only (the longitude is periodic). ``bug``:
    "merge" (heads merged with a reshape, no permute) or "no mask" (the shift mask dropped)."""

    def __init__(self, dim: int = 32, heads: int = 4, grid: tuple[int, int, int] = (2, 4, 8),
                 window: tuple[int, int, int] = (2, 2, 4), shift: bool = False, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.grid, self.win, self.shift, self.bug = heads, grid, window, shift, bug
        self.types = (grid[0] // window[0]) * (grid[1] // window[1])
        n = math.prod(window)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.randn(window[0] ** 2 * window[1] ** 2 * (2 * window[2] - 1), self.types,
                                              heads) * 0.5)
        self.register_buffer("index", _earth_index(*window).reshape(-1), persistent=False)
        self.register_buffer("shift_mask", self._mask() if shift else torch.zeros(1, self.types, n, n),
                             persistent=False)

    def _partition(self, x: torch.Tensor) -> torch.Tensor:
        b, (p, la, lo), (wp, wl, wn) = x.shape[0], self.grid, self.win
        x = x.view(b, p // wp, wp, la // wl, wl, lo // wn, wn, -1).permute(0, 5, 1, 3, 2, 4, 6, 7)
        return x.reshape(b * (lo // wn), self.types, wp * wl * wn, -1)

    def _reverse(self, w: torch.Tensor, b: int) -> torch.Tensor:
        (p, la, lo), (wp, wl, wn) = self.grid, self.win
        w = w.view(b, lo // wn, p // wp, la // wl, wp, wl, wn, -1).permute(0, 2, 4, 3, 5, 1, 6, 7)
        return w.reshape(b, p, la, lo, -1)

    def _mask(self) -> torch.Tensor:
        (p, la, lo), (wp, wl, _) = self.grid, self.win
        region = torch.zeros(1, p, la, lo, 1)
        cut = 0
        for ps in (slice(0, -wp), slice(-wp, -(wp // 2)), slice(-(wp // 2), None)):
            for ls in (slice(0, -wl), slice(-wl, -(wl // 2)), slice(-(wl // 2), None)):
                region[:, ps, ls] = cut
                cut += 1
        windows = self._partition(region).squeeze(-1)  # (lon windows, types, N)
        apart = windows[:, :, None, :] != windows[:, :, :, None]
        return torch.zeros(apart.shape).masked_fill(apart, -100.0)

    def forward(self, x):
        b, n_tok, c = x.shape
        x = x.view(b, *self.grid, c)
        steps = tuple(w // 2 for w in self.win)
        if self.shift:
            x = torch.roll(x, shifts=tuple(-s for s in steps), dims=(1, 2, 3))
        w = self._partition(x)
        bw, types, n, _ = w.shape
        q, k, v = self.qkv(w).reshape(bw, types, n, 3, self.h, c // self.h).permute(3, 0, 4, 1, 2, 5)
        scores = (q * (c // self.h) ** -0.5) @ k.transpose(-2, -1)  # (B_, H, types, N, N)
        bias = self.table[self.index].view(n, n, self.types, self.h).permute(3, 2, 0, 1)
        scores = scores + bias.unsqueeze(0)
        if self.shift and self.bug != "no mask":
            lon = self.shift_mask.shape[0]
            scores = (scores.view(bw // lon, lon, self.h, types, n, n) + self.shift_mask[None, :, None])
            scores = scores.view(bw, self.h, types, n, n)
        out = scores.softmax(-1) @ v
        out = out.reshape(bw, types, n, c) if self.bug == "merge" else out.permute(0, 2, 3, 1, 4).reshape(bw, types,
                                                                                                           n, c)
        out = self._reverse(self.proj(out), b)
        if self.shift:
            out = torch.roll(out, shifts=steps, dims=(1, 2, 3))
        return out.reshape(b, n_tok, c)


@pytest.mark.parametrize(("shift", "bug", "expected"), [
    (False, None, set()), (False, "merge", {"head-merge"}),
    (True, None, set()), (True, "no mask", {"definition-mismatch"}),
])
def test_earth_specific_windows_with_heads_beside_the_window_types(shift, bug, expected):
    """catches: the heads of (B_, H, types, N, D) merged back with permute(0, 2, 3, 1, 4) were read as a merge that
    mixes tokens (`head-merge` on correct code); shifted windows that wrap around the periodic longitude alone were a
    cyclic shift without its mask (`definition-mismatch`), while the mask dropped (every axis wrapping, seen only on
    the 2 x 4 x 8 grid) passed."""
    torch.manual_seed(0)
    report = check(EarthWindowAttention(shift=shift, bug=bug), embed_dim=32, length=64)
    assert {f.id for f in report.findings if f.severity == "error"} == expected, report.findings
    if shift and bug is None:
        assert "periodic axis" in str(report.inferred.get("window", "")), report.inferred


# -- Leela Chess Zero: smolgen, a score bias per head generated from the whole board -------------------------------
class SmolgenAttention(nn.Module):
    """Lc0's attention body: scores / sqrt(depth) plus smolgen's (B, H, 64, 64) bias, which a small network makes
    from the whole board (compressed squares, a dense layer, one shared projection to 64 x 64 per head). ``bug``:
    "width" (scaled by the model width, not the head's)."""

    def __init__(self, dim: int = 32, heads: int = 4, squares: int = 64, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.n, self.bug = heads, squares, bug
        self.wq, self.wk, self.wv = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.compress = nn.Linear(dim, 4, bias=False)
        self.dense = nn.Linear(4 * squares, 16)
        self.per_head = nn.Linear(16, 16 * heads)
        self.to_board = nn.Linear(16, squares * squares, bias=False)

    def forward(self, x):
        b, n, e = x.shape
        d = e // self.h
        q, k, v = (f(x).view(b, n, self.h, d).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        board = torch.relu(self.dense(self.compress(x).reshape(b, -1)))
        smol = self.to_board(self.per_head(board).view(b, self.h, 16)).view(b, self.h, n, n)
        logits = q @ k.transpose(-2, -1) / math.sqrt(e if self.bug == "width" else d) + smol
        out = torch.softmax(logits, -1) @ v
        return self.out(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize(("bug", "expected"), [(None, set()), ("width", {"wrong-scale"})])
def test_a_score_bias_generated_from_the_tokens_is_a_term_of_its_own(bug, expected):
    """catches: a term on the scores that a network computes from the whole board (smolgen) differs from item to item
    and from run to run on other tokens, so the scores were "not one multiple of the product plus a term" and correct
    code was `definition-mismatch`, and a wrong scale was named so too. The term is in the record: it is taken off."""
    torch.manual_seed(0)
    report = check(SmolgenAttention(bug=bug), embed_dim=32, length=64)
    assert {f.id for f in report.findings if f.severity == "error"} == expected, report.findings
    assert "score term" in report.inferred.get("design", {}), report.inferred


class ScoresCountedTwice(SmolgenAttention):
    """The same scores added to themselves by a second product of q and k: no term of its own, a scale of 2."""

    def forward(self, x):
        b, n, e = x.shape
        d = e // self.h
        q, k, v = (f(x).view(b, n, self.h, d).transpose(1, 2) for f in (self.wq, self.wk, self.wv))
        logits = q @ k.transpose(-2, -1) / math.sqrt(d)
        logits = logits + torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d)
        out = torch.softmax(logits, -1) @ v
        return self.out(out.transpose(1, 2).reshape(b, n, e))


def test_a_term_made_from_q_and_k_is_not_taken_off():
    torch.manual_seed(0)
    report = check(ScoresCountedTwice(), embed_dim=32, length=16)
    assert report.verdict == "failed", report.findings


# -- the Galerkin transformer: masks refused by a RuntimeError the module raises -----------------------------------
class GalerkinAttention(nn.Module):
    """"Choose a Transformer": softmax-free attention Q (LN(K)^T LN(V)) / n, raising on any mask."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_k, self.norm_v = nn.LayerNorm(dim // heads), nn.LayerNorm(dim // heads)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        if mask is not None:
            raise RuntimeError("linear attention does not support casual mask.")
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        k, v = self.norm_k(k), self.norm_v(v)
        out = q @ (k.transpose(-2, -1) @ v) / n
        return self.out(out.transpose(1, 2).reshape(b, n, e))


class KernelRefusal(GalerkinAttention):
    """A mask the module takes in a form of its own ((B, L, L) scores added): the doctor's forms fail in a kernel."""

    def forward(self, x, mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-2, -1) / math.sqrt(e // self.h)
        if mask is not None:
            s = s + mask.view(b, 1, n, n).float().log()
        out = s.softmax(-1) @ v
        return self.out(out.transpose(1, 2).reshape(b, n, e))


def test_a_mask_refused_by_a_runtime_error_of_the_module_is_not_applicable():
    """catches: the Galerkin transformer raises RuntimeError("... does not support casual mask.") on any mask; only
    ValueError, NotImplementedError and assert counted as a refusal, so the check was inconclusive. A RuntimeError
    from an operation (a shape a kernel cannot take) is still no refusal."""
    torch.manual_seed(0)
    report = check(GalerkinAttention(), embed_dim=32, allow_nonstandard=True)
    assert report.verdict == "passed", report.findings
    assert report.coverage["mask"].startswith("not applicable"), report.coverage
    other = check(KernelRefusal(), embed_dim=32)
    assert not other.coverage["mask"].startswith("not applicable"), other.coverage


# -- timm's position tables as they ship, and read at absolute positions -------------------------------------------
def _beit(absolute: bool) -> nn.Module:
    from timm.models.beit import Attention

    torch.manual_seed(0)
    module = Attention(32, num_heads=2, qkv_bias=True, window_size=(4, 4))
    with torch.no_grad():
        module.relative_position_bias_table.normal_(0, 0.5)
        if absolute:  # the table read at (i + j), not at the offset between query and key
            n = module.relative_position_index.shape[0]
            i = torch.arange(n)
            module.relative_position_index.copy_((i[:, None] + i[None, :]) % module.relative_position_bias_table
                                                 .shape[0])
    return module


@pytest.mark.parametrize(("absolute", "expected"), [(False, set()), (True, {"definition-mismatch"})])
def test_a_position_table_read_by_no_offset_is_not_relative(absolute, expected):
    """catches: BEiT's table (a (2W - 1)^2 grid plus three class-token entries) read at i + j was certified as a
    relative-position bias: only tables sized for distances were run on one token everywhere. The index buffer
    itself tells: it ties pairs of tokens at different offsets on every grid."""
    pytest.importorskip("timm")
    report = check(_beit(absolute), embed_dim=32, length=17)
    assert {f.id for f in report.findings if f.severity == "error"} == expected, report.findings


def _mvit(scaled: bool, cls: bool) -> nn.Module:
    from timm.models.mvitv2 import MultiScaleAttention

    torch.manual_seed(0)
    module = MultiScaleAttention(32, 32, feat_size=(4, 4), num_heads=2, kernel_q=(1, 1), kernel_kv=(3, 3),
                                 stride_kv=(2, 2), has_cls_token=cls, rel_pos_type="spatial", residual_pooling=True)
    with torch.no_grad():
        module.rel_pos_h.normal_(0, 0.5)
        module.rel_pos_w.normal_(0, 0.5)
    if not scaled:
        module.scale = 1.0
    return module


@pytest.mark.parametrize("cls", [False, True])
@pytest.mark.parametrize(("scaled", "expected"), [(True, set()), (False, {"missing-scale"})])
def test_position_terms_written_into_the_scores_by_a_slice(scaled, expected, cls):
    """catches: timm's MViT v2 adds its decomposed position terms with attn[:, :, sp:, sp:] = (...): the white box
    stopped at the setitem, so correct code was `definition-mismatch` and a missing scale was named so too. With a
    class token the terms cover all but its row and column."""
    pytest.importorskip("timm")
    report = check(_mvit(scaled, cls), embed_dim=32, length=17 if cls else 16, call=lambda m, x: m(x, [4, 4])[0])
    assert {f.id for f in report.findings if f.severity == "error"} == expected, report.findings


def _levit(viewed: bool) -> nn.Module:
    from timm.models.levit import Attention

    class KeysViewed(Attention):
        """timm's LeViT attention with its keys laid out by reshape(B, H, D, L), not permute(0, 2, 3, 1)."""

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, self.num_heads, -1).split([self.key_dim, self.key_dim, self.val_dim],
                                                                         dim=3)
            k = k.reshape(b, self.num_heads, self.key_dim, n)
            attn = (q.permute(0, 2, 1, 3) @ k * self.scale + self.get_attention_biases(x.device)).softmax(-1)
            return self.proj((attn @ v.permute(0, 2, 1, 3)).transpose(1, 2).reshape(b, n, self.val_attn_dim))

    torch.manual_seed(0)
    module = (KeysViewed if viewed else Attention)(32, key_dim=8, num_heads=2, attn_ratio=2, resolution=4)
    with torch.no_grad():
        module.attention_biases.normal_(0, 0.5)
    return module


@pytest.mark.parametrize(("viewed", "expected"), [(False, set()), (True, {"head-split"})])
def test_keys_viewed_pre_transposed_when_heads_times_head_dim_is_the_length(viewed, expected):
    """catches: LeViT's keys reshaped to (B, H, D, L) from (B, L, H, D) with H * D = L (2 x 8 = 16 tokens) were read
    on the (H, D) axes as the tokens, where they land by chance, and certified. The operand is read on the axis the
    product takes its keys from."""
    pytest.importorskip("timm")
    report = check(_levit(viewed), embed_dim=32, length=16)
    assert {f.id for f in report.findings if f.severity == "error"} == expected, report.findings


# -- modules as people run them: quantized, with LoRA adapters -----------------------------------------------------
class CausalSelfAttention(nn.Module):
    """nanoGPT's attention with a fused c_attn and a tril mask; ``leak``: tril(diagonal=1), one future token seen."""

    def __init__(self, dim: int = 32, heads: int = 4, leak: bool = False) -> None:
        super().__init__()
        self.h, self.leak = heads, leak
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.h, e // self.h).transpose(1, 2) for t in self.c_attn(x).split(e, dim=2))
        att = q @ k.transpose(-2, -1) / math.sqrt(e // self.h)
        seen = torch.ones(n, n, dtype=torch.bool).tril(diagonal=1 if self.leak else 0)
        att = att.masked_fill(~seen, float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize(("leak", "expected"), [(False, set()), (True, {"causal-leak"})])
def test_a_dynamically_quantized_module_is_checked_through_its_dequantized_weights(leak, expected):
    """catches: after torch.ao.quantization.quantize_dynamic, activations are quantized per tensor on the fly, so
    each item's output moved with the others' (batch-mixing), the output was a step function of the input (a causal
    mask off by one went unseen, the gradients "verified" within a finite difference too uncertain to tell), and the
    int8 kernels have no half precision. The Linear layers are read with their weights dequantized."""
    from torch.ao.quantization import quantize_dynamic

    torch.manual_seed(0)
    module = quantize_dynamic(CausalSelfAttention(leak=leak).eval(), {nn.Linear}, dtype=torch.qint8)
    report = check(module, embed_dim=32)
    assert {f.id for f in report.findings if f.severity == "error"} == expected, report.findings
    assert "quantized" in report.inferred, report.inferred


@pytest.mark.parametrize(("merged", "conv1d", "dora"), [(False, False, False), (True, False, False),
                                                          (False, True, False), (False, False, True)])
def test_lora_on_the_value_projection_is_one_projection(merged, conv1d, dora):
    """catches: peft's LoRA adds lora_B(lora_A(dropout(x))) * scaling to the frozen projection's output (GPT-2's
    Conv1D too; DoRA scales both by a magnitude per feature); on v it was read as the values changed after their
    projection (`values-changed`) unless merged. A sum of linear maps of one input is one linear map."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    module = CausalSelfAttention()
    if conv1d:
        from transformers.pytorch_utils import Conv1D

        module.c_attn = Conv1D(96, 32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1, use_dora=dora,
                             init_lora_weights=False, fan_in_fan_out=conv1d)
    wrapped = peft.get_peft_model(module, config)
    module = wrapped.merge_and_unload() if merged else wrapped.base_model.model
    report = check(module, embed_dim=32, causal=True)
    assert report.verdict == "passed", report.findings


class FakeQuantAttention(nn.Module):
    """Quantization-aware training written by hand: q, k and v rounded to a grid of 1/8 in the forward, with a
    straight-through estimator (t + (round(t) - t).detach()) for the backward."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        t = self.qkv(x)
        t = t + (torch.round(t * 8) / 8 - t).detach()
        q, k, v = t.view(b, n, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-2, -1) / math.sqrt(e // self.h)).softmax(-1)
        return self.out((a @ v).transpose(1, 2).reshape(b, n, e))


def test_gradients_a_finite_difference_cannot_resolve_are_not_verified():
    """catches: on a step function of its input (fake quantization with a straight-through estimator) the finite
    difference is as uncertain as it is large, and autograd's derivative agreed with it "within that uncertainty":
    the gradients were verified though nothing was compared. The detached term on V is the estimator, not a change
    of the values."""
    torch.manual_seed(0)
    report = check(FakeQuantAttention, embed_dim=32)
    assert report.coverage["gradients"].startswith("not verified"), report.coverage
    assert report.verdict == "inconclusive" and not report.findings, report.findings


class ShiftedWindows1D(nn.Module):
    """Swin's shifted windows on a sequence: windows of 4 tokens after a roll by 2, the tokens the roll brought
    together kept apart by -100 added to their scores. ``sign``: the mask's fill (+100 is the bug)."""

    def __init__(self, dim: int = 32, heads: int = 4, window: int = 4, sign: float = -100.0) -> None:
        super().__init__()
        self.h, self.w, self.sign = heads, window, sign
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        w, s = self.w, self.w // 2
        region = torch.zeros(n)
        region[n - w:n - s], region[n - s:] = 1, 2
        apart = region.view(-1, w)
        mask = x.new_zeros(n // w, w, w).masked_fill(apart[:, :, None] != apart[:, None, :], self.sign)
        t = torch.roll(x, -s, 1).reshape(b * n // w, w, e)
        q, k, v = self.qkv(t).view(-1, w, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        a = q @ k.transpose(-2, -1) / math.sqrt(e // self.h)
        a = (a.view(b, n // w, self.h, w, w) + mask[None, :, None]).view(-1, self.h, w, w)
        o = (a.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)
        return self.proj(torch.roll(o, s, 1))


@pytest.mark.parametrize(("sign", "expected"), [(-100.0, set()), (100.0, {"mask-inverted"})])
def test_a_shift_mask_added_with_the_wrong_sign_is_inverted(sign, expected):
    """catches: +100 where -100 keeps the rolled tokens apart makes each query in a cut window weigh only the tokens
    of the other side: a symmetric pattern (read as windows) and a term of (head, query, key) (read as a bias), so
    the module was certified. No bias lifts other keys e^50 above a query's own."""
    torch.manual_seed(0)
    report = check(ShiftedWindows1D(sign=sign), embed_dim=32, length=16)
    assert {f.id for f in report.findings if f.severity == "error"} == expected, report.findings


def test_a_module_whose_projections_are_conv1d_is_probed_at_their_width():
    """catches: a GPT-2-style module built by a factory at width 32, whose only projections are transformers'
    Conv1D, was probed at width 64 (exit 2: "mat1 and mat2 shapes cannot be multiplied"): the width was read from
    nn.Linear layers only."""
    from transformers.pytorch_utils import Conv1D

    class Conv1DAttention(CausalSelfAttention):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = Conv1D(96, 32), Conv1D(32, 32)

    torch.manual_seed(0)
    report = check(Conv1DAttention, causal=True)
    assert report.verdict == "passed", report.findings

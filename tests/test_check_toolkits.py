"""The doctor on code in the style of speech toolkits, structure-biology code, vision backbones and hand-written LLM
inference modules. Each test is a wrong verdict the doctor used to give.

Shape legend: B batch, L length, E embed dim, H heads, D head dim, W window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from selfattn.check import check


def _ids(report) -> list[tuple[str, str]]:
    return [(f.id, f.message) for f in report.findings]


# -- shifted windows: the region mask written with masked_fill, and the mask left out ----------------------------
class ShiftedWindows1d(nn.Module):
    """Shifted-window attention along a (B, L, E) sequence (the 1-D Swin of audio and time-series backbones): the
    tokens rolled by ``shift``, attention within windows of ``window`` tokens, the window that the roll filled with
    tokens of both ends split by a region mask written over the scores with ``masked_fill(..., -100.0)``, as Swin's
    reference code fills its mask; ``use_mask=False`` leaves that mask out."""

    def __init__(self, dim: int = 64, heads: int = 4, window: int = 8, shift: int = 4, use_mask: bool = True) -> None:
        super().__init__()
        self.heads, self.window, self.shift, self.use_mask = heads, window, shift, use_mask
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, length, e = x.shape
        w, s, h = self.window, self.shift, self.heads
        n = length // w
        x = torch.roll(x, -s, dims=1)
        q, k, v = self.qkv(x).view(b * n, w, 3, h, e // h).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (e // h) ** -0.5                 # (B n, H, W, W)
        if self.use_mask:
            region = torch.zeros(length, dtype=torch.long, device=x.device)
            region[length - w:length - s], region[length - s:] = 1, 2
            region = region.view(n, w)
            apart = region[:, None, :] != region[:, :, None]                    # (n, W, W)
            scores = scores.view(b, n, h, w, w).masked_fill(apart[None, :, None], -100.0).view(b * n, h, w, w)
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, e)
        return torch.roll(self.proj(out), s, dims=1)


class ShiftedWindowsNoMask(ShiftedWindows1d):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__(dim, heads, use_mask=False)


class ShiftedWindows2d(nn.Module):
    """The same on a (B, H, W, E) map (Swin): rolled by ``shift`` on both axes, windows of ``window`` x ``window``,
    the region mask over the three bands of each axis, written with ``masked_fill(..., -100.0)``."""

    def __init__(self, dim: int = 64, heads: int = 4, window: int = 4, shift: int = 2, use_mask: bool = True) -> None:
        super().__init__()
        self.heads, self.window, self.shift, self.use_mask = heads, window, shift, use_mask
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, hh, ww, e = x.shape
        w, s, h = self.window, self.shift, self.heads
        x = torch.roll(x, (-s, -s), (1, 2))
        windows = x.view(b, hh // w, w, ww // w, w, e).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, e)
        q, k, v = self.qkv(windows).view(windows.shape[0], w * w, 3, h, e // h).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (e // h) ** -0.5                 # (B nW, H, W W, W W)
        if self.use_mask:
            band_h = torch.zeros(hh, dtype=torch.long, device=x.device)
            band_w = torch.zeros(ww, dtype=torch.long, device=x.device)
            band_h[hh - w:hh - s], band_h[hh - s:], band_w[ww - w:ww - s], band_w[ww - s:] = 1, 2, 1, 2
            region = (3 * band_h[:, None] + band_w[None, :]).view(hh // w, w, ww // w, w)
            region = region.permute(0, 2, 1, 3).reshape(-1, w * w)
            apart = region[:, None, :] != region[:, :, None]                    # (nW, W W, W W)
            n = apart.shape[0]
            scores = scores.view(b, n, h, w * w, w * w).masked_fill(apart[None, :, None], -100.0)
            scores = scores.view(b * n, h, w * w, w * w)
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(-1, w * w, e)
        out = self.proj(out).view(b, hh // w, ww // w, w, w, e).permute(0, 1, 3, 2, 4, 5).reshape(b, hh, ww, e)
        return torch.roll(out, (s, s), (1, 2))


class ShiftedWindows2dNoMask(ShiftedWindows2d):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__(dim, heads, use_mask=False)


def test_a_region_mask_filled_with_minus_100_is_a_mask_and_its_absence_is_named():
    """catches: shifted windows whose region mask is written with masked_fill(-100) read as a formula no attention
    follows (-100 taken as a score), and the same module without the mask certified, its first and last tokens
    attending to each other across the roll."""
    torch.manual_seed(0)
    good = check(ShiftedWindows1d(), length=[32])
    assert good.passed, _ids(good)
    bad = check(ShiftedWindowsNoMask(), length=[32])
    assert bad.ids == {"definition-mismatch"}, _ids(bad)
    assert "opposite borders" in bad.findings[0].message
    good = check(ShiftedWindows2d())
    assert good.passed, _ids(good)
    bad = check(ShiftedWindows2dNoMask())
    assert bad.ids == {"definition-mismatch"}, _ids(bad)
    assert "8 x 8 grid" in bad.findings[0].message


# -- a map flattened into tokens behind a convolution -------------------------------------------------------------
class ConvThenAttention(nn.Module):
    """A hybrid block on a (B, C, H, W) map (a convolutional stem, then pre-norm attention over the H W tokens and
    back to a map), with torch's nn.MultiheadAttention (``torch_mha``) or attention written out. ``flat=True`` is the
    bug: the map flattened with ``reshape(B, H * W, C)``, without moving the channels last first."""

    def __init__(self, channels: int = 32, heads: int = 4, torch_mha: bool = True, flat: bool = False) -> None:
        super().__init__()
        self.heads, self.torch_mha, self.flat = heads, torch_mha, flat
        self.stem = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.GELU())
        self.norm = nn.LayerNorm(channels)
        self.mha = nn.MultiheadAttention(channels, heads, batch_first=True)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.out = nn.Linear(channels, channels)

    def forward(self, x):
        b, c, h, w = x.shape
        x = self.stem(x)
        t = x.reshape(b, h * w, c) if self.flat else x.flatten(2).transpose(1, 2)    # (B, L, C)
        n = self.norm(t)
        if self.torch_mha:
            a = self.mha(n, n, n, need_weights=False)[0]
        else:
            q, k, v = self.qkv(n).view(b, h * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            a = torch.softmax(q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5, dim=-1) @ v
            a = self.out(a.transpose(1, 2).reshape(b, h * w, c))
        return (t + a).transpose(1, 2).reshape(b, c, h, w)


@pytest.mark.parametrize("torch_mha", [True, False], ids=["nn.MultiheadAttention", "by hand"])
def test_a_map_flattened_without_its_permute_behind_a_convolution_is_a_head_split(torch_mha):
    """catches: the flatten before the attention named head-merge, the error put on the correct reshape back into a
    map: a convolution spreads the swapped tokens to their neighbours, and the layout operation after it was only
    judged on tensors changed on two rows."""
    torch.manual_seed(0)
    good = check(ConvThenAttention(torch_mha=torch_mha))
    assert good.passed, _ids(good)
    bad = check(ConvThenAttention(torch_mha=torch_mha, flat=True))
    assert "head-split" in bad.ids and "head-merge" not in bad.ids, _ids(bad)


# -- lengths in steps: frames x patches + a class token ------------------------------------------------------------
class DividedTimeAttention(nn.Module):
    """TimeSformer's divided attention over time on (B, 1 + F N, E): the class token attends over every token; each
    patch token attends over the same patch in the F frames and the class token, whose keys and values are
    repeated for each patch with ``repeat_interleave``. It runs only at lengths F N + 1. ``tiled=True`` is the bug:
    ``repeat`` instead, so the (batch, head) rows take another item's or head's class token."""

    def __init__(self, dim: int = 64, heads: int = 4, frames: int = 4, tiled: bool = False) -> None:
        super().__init__()
        self.heads, self.frames, self.tiled = heads, frames, tiled
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, length, e = x.shape
        h, f = self.heads, self.frames
        n, d = (length - 1) // f, e // h
        q, k, v = (t.reshape(b, length, h, d).transpose(1, 2).reshape(b * h, length, d)
                   for t in self.to_qkv(x).chunk(3, dim=-1))
        q = q * d ** -0.5
        cls_out = torch.softmax(q[:, :1] @ k.transpose(1, 2), -1) @ v                      # (B H, 1, D)

        def by_patch(t):  # (B H, F N, D) -> (B H N, F, D)
            return t.reshape(b * h, f, n, d).transpose(1, 2).reshape(b * h * n, f, d)

        repeat = (lambda t: t.repeat(n, 1, 1)) if self.tiled else (lambda t: t.repeat_interleave(n, dim=0))
        qp = by_patch(q[:, 1:])
        kp = torch.cat([repeat(k[:, :1]), by_patch(k[:, 1:])], 1)
        vp = torch.cat([repeat(v[:, :1]), by_patch(v[:, 1:])], 1)
        out = torch.softmax(qp @ kp.transpose(1, 2), -1) @ vp                              # (B H N, F, D)
        out = out.reshape(b * h, n, f, d).transpose(1, 2).reshape(b * h, f * n, d)
        out = torch.cat([cls_out, out], 1).reshape(b, h, length, d).transpose(1, 2).reshape(b, length, e)
        return self.to_out(out)


def test_a_module_that_runs_at_lengths_in_steps_is_probed_past_the_shortest():
    """catches: a module that runs at lengths 5, 9, 13 (four frames of N patches and a class token) read as one
    with a length limit of 5 and probed there, at one patch per frame, where repeat and repeat_interleave agree:
    the class token's keys taken from other items was certified."""
    torch.manual_seed(0)
    good = check(DividedTimeAttention())
    assert good.passed, _ids(good)
    assert good.inferred["probe shape"][1] >= 9 and "lengths" in good.inferred
    bad = check(DividedTimeAttention(tiled=True))
    assert "batch-mixing" in bad.ids, _ids(bad)


# -- Conformer relative positions (Transformer-XL's u and v biases, a shift of 2T - 1 positions) -------------------
def _sinusoids(length: int, dim: int) -> torch.Tensor:
    """The 2T - 1 relative positions T - 1, ..., 0, ..., -(T - 1) as sinusoids, (1, 2T - 1, dim)."""
    rel = torch.arange(length - 1, -length, -1, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(2 * length - 1, dim)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(rel * freq), torch.cos(rel * freq)
    return pe[None]


class ConformerRelAttention(nn.Module):
    """A Conformer encoder's self-attention with relative positions (the new ESPnet / WeNet form): scores
    ((q + u) k^T + shift((q + v) p^T)) / sqrt(d_k), p the 2T - 1 position embeddings through ``linear_pos``, the
    shift turning column T - 1 + j - i into column j. ``scale_first``: q scaled before the biases are added, as
    icefall's Conformer does ((q / sqrt(d_k) + u) k^T + ...). ``bug`` injects one mistake: "u-for-both" (u used
    for the position term too, v never read), "u-on-keys" (u added to the keys: the softmax cancels q . u),
    "mask-on-queries" (a (B, 1, T) key mask transposed onto the query axis, the (B, T, T) form read right),
    "key-mask-only" (not a bug: only (B, 1, T) masks are accepted), "wrong-half" (the shift keeps the last T
    columns of the 2T - 1: relative at one length, but which distances a column holds depends on the length),
    "as-strided" (not a bug: the shift written with as_strided, as icefall writes it)."""

    def __init__(self, dim: int = 64, heads: int = 4, bug: str | None = None, scale_first: bool = False) -> None:
        super().__init__()
        self.h, self.d_k, self.bug, self.scale_first = heads, dim // heads, bug, scale_first
        self.linear_q, self.linear_k, self.linear_v = (nn.Linear(dim, dim) for _ in range(3))
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(nn.init.xavier_uniform_(torch.empty(heads, self.d_k)))
        self.pos_bias_v = nn.Parameter(nn.init.xavier_uniform_(torch.empty(heads, self.d_k)))

    def rel_shift(self, x):
        b, h, t, n = x.shape                                                    # n = 2t - 1
        if self.bug == "as-strided":
            x = x.contiguous()
            s = x.stride()
            return x.as_strided((b, h, t, t), (s[0], s[1], s[2] - s[3], s[3]), storage_offset=s[3] * (t - 1))
        padded = torch.cat([x.new_zeros(b, h, t, 1), x], dim=-1).view(b, h, n + 1, t)
        shifted = padded[:, :, 1:].reshape(b, h, t, n)
        return shifted[..., n // 2:] if self.bug == "wrong-half" else shifted[..., : n // 2 + 1]

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.h, self.d_k) for lin in (self.linear_q, self.linear_k, self.linear_v))
        p = self.linear_pos(_sinusoids(t, x.shape[-1]).to(x)).view(1, -1, self.h, self.d_k).transpose(1, 2)
        u = self.pos_bias_u
        v_bias = u if self.bug == "u-for-both" else self.pos_bias_v
        if self.bug == "u-on-keys":
            k = k + u
            u = torch.zeros_like(u)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.scale_first:
            q = q * self.d_k ** -0.5
        content = (q + u).transpose(1, 2) @ k.transpose(-2, -1)
        position = self.rel_shift((q + v_bias).transpose(1, 2) @ p.transpose(-2, -1))
        scores = content + position if self.scale_first else (content + position) / math.sqrt(self.d_k)
        if mask is not None:                                                    # (B, 1, T) or (B, T, T), True = keep
            if self.bug == "key-mask-only" and mask.shape[1] != 1:
                raise ValueError(f"mask must be (B, 1, T), got {tuple(mask.shape)}")
            if self.bug == "mask-on-queries" and mask.shape[1] == 1:
                mask = mask.transpose(1, 2)
            hidden = ~mask.unsqueeze(1)
            scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
            weights = scores.softmax(-1).masked_fill(hidden, 0.0)
        else:
            weights = scores.softmax(-1)
        return self.linear_out((weights @ v).transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("bug", ["u-for-both", "u-on-keys"])
def test_a_position_bias_that_does_nothing_is_no_grad(bug):
    """catches: pos_bias_v never read (pos_bias_u used for both terms) and pos_bias_u added to the keys (q . u is
    the same for every key of a row, and the softmax cancels it) were certified: an unread parameter beside its
    twin was not required to get a gradient, and a learned term named a bias was taken for a projection's."""
    torch.manual_seed(0)
    good = check(ConformerRelAttention())
    assert good.passed, _ids(good)
    bad = check(ConformerRelAttention(bug=bug))
    assert bad.ids == {"no-grad"}, _ids(bad)


def test_q_scaled_before_the_position_biases_are_added_keeps_its_scale():
    """catches: icefall's order, q / sqrt(d_k) and then u and v added, read as a missing scale: the scale was looked
    for on the operand after the bias was added, not on the tokens' part of it."""
    torch.manual_seed(0)
    good = check(ConformerRelAttention(scale_first=True))
    assert good.passed, _ids(good)


@pytest.mark.parametrize("bug", [None, "key-mask-only"])
def test_the_encoder_key_mask_of_speech_toolkits_is_probed(bug):
    """catches: ESPnet's and WeNet's (B, 1, T) encoder mask was never sent: a module reading only that shape could
    not run."""
    torch.manual_seed(0)
    report = check(ConformerRelAttention(bug=bug))
    assert report.passed and report.inferred["mask"]["kind"] == "keep", _ids(report)


def test_a_bad_option_with_json_is_answered_in_json(tmp_path, capsys):
    """catches: a --mask the doctor cannot parse printed plain text where --json promises JSON."""
    import json

    from selfattn.cli import main

    path = tmp_path / "m.py"
    path.write_text("import torch\n")
    assert main(["check", f"{path}:M", "--mask", "keep (X)", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "could not run" and out["error"].startswith("bad option: mask must read")


# -- AlphaFold's triangle attention: a pattern of its own, accepted with allow_nonstandard --------------------------
class TriangleAttentionStartingNode(nn.Module):
    """AlphaFold 2's triangle self-attention around the starting node (Algorithm 13) on a pair map (B, N, N, C): row
    i's entries (i, j) attend over (i, k) with a bias b_jk projected from the pair (j, k) itself, and a sigmoid
    gate. Each entry then depends on entries outside its row through the bias."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h, self.d = heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.bias = nn.Linear(dim, heads, bias=False)
        self.gate = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, z):
        b, n, _, c = z.shape
        z = self.norm(z)
        q, k, v = self.qkv(z).view(b, n, n, 3, self.h, self.d).unbind(3)          # (B, i, j, H, D)
        scores = torch.einsum("bijhd,bikhd->bhijk", q, k) / math.sqrt(self.d)
        scores = scores + self.bias(z).permute(0, 3, 1, 2)[:, :, None]            # b_jk, the same for every row i
        o = torch.einsum("bhijk,bikhd->bijhd", scores.softmax(-1), v).reshape(b, n, n, c)
        return self.out(torch.sigmoid(self.gate(z)) * o)


def test_allow_nonstandard_accepts_a_dependency_pattern_no_design_follows():
    """catches: with allow_nonstandard (no definition-mismatch, as documented), triangle attention still got one,
    from the pattern of which tokens each output depends on."""
    torch.manual_seed(0)

    def call(m, x):
        b, length, c = x.shape
        side = math.isqrt(length)
        return m(x.view(b, side, side, c)).view(b, length, c)

    report = check(TriangleAttentionStartingNode(), call=call, length=[16], allow_nonstandard=True)
    assert "definition-mismatch" not in report.ids, _ids(report)
    assert report.passed, _ids(report)


# -- a generation loop: a prefill, then one token at a time through a KV cache --------------------------------------
class PrefillThenDecode(nn.Module):
    """Causal attention computed as generation computes it (gpt-fast's, Meta's llama reference): the first
    ``prefill`` tokens in one causal call, every later token alone, over the keys and values cached so far."""

    def __init__(self, dim: int = 64, heads: int = 4, prefill: int = 3) -> None:
        super().__init__()
        self.h, self.d, self.prefill = heads, dim // heads, prefill
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def _attend(self, x, cache):
        b, t, e = x.shape
        q, k, v = (z.view(b, t, self.h, self.d).transpose(1, 2) for z in self.wqkv(x).chunk(3, -1))
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        return self.wo(out.transpose(1, 2).reshape(b, t, e)), (k, v)

    def forward(self, x):
        out, cache = self._attend(x[:, : self.prefill], None)
        outs = [out]
        for t in range(self.prefill, x.shape[1]):
            out, cache = self._attend(x[:, t : t + 1], cache)
            outs.append(out)
        return torch.cat(outs, 1)


def test_a_generation_loop_is_not_read_as_a_head_split():
    """catches: a prefill and decode steps through a cache, each an attention over part of the queries, named
    definition-mismatch ("runs over an axis of size 3, not the 7 tokens"): the white box now says it does not read
    the steps, and the black box's causal checks still run."""
    torch.manual_seed(0)
    report = check(PrefillThenDecode(), causal=True)
    assert "definition-mismatch" not in report.ids, _ids(report)
    assert report.verdict == "inconclusive" and "steps" in str(report.inferred["white box"]), _ids(report)


# -- an own window that a given mask replaces (litgpt's sliding window: built only when no mask is passed) -----------
class WindowUnlessMasked(nn.Module):
    """Causal attention within a sliding window of 3 tokens, built as an additive mask when the caller passes none;
    a mask the caller passes (B, 1, L, L), True = may attend, replaces it, as in litgpt and transformers' layers."""

    def __init__(self, dim: int = 64, heads: int = 4, window: int = 3) -> None:
        super().__init__()
        self.h, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        if mask is None:
            i = torch.arange(t, device=x.device)
            inside = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)
            mask = torch.zeros(t, t, dtype=x.dtype, device=x.device).masked_fill(~inside, float("-inf"))
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, t, e))


def test_a_mask_that_replaces_a_window_as_wide_as_the_probe_band_is_read():
    """catches: a causal window of 3 that a given mask replaces, named causal-leak ("drops its causal mask"): the
    doctor's (B, L, L) probe band is 3 wide too, so the mask it sent hid nothing the window did not, read as a mask
    that changes nothing; a narrower band now shows the mask at work."""
    torch.manual_seed(0)
    report = check(WindowUnlessMasked(), causal=True)
    assert report.passed, _ids(report)
    assert "own pattern" in report.inferred["mask"], report.inferred["mask"]


# -- rotary positions beside a learned null key put first -----------------------------------------------------------
def _rotate(x, interleaved: bool = False):
    """Rotary positions on (B, H, L, D): rotate-half pairing (feature i with i + D/2), or interleaved (2i with
    2i + 1)."""
    d = x.shape[-1]
    pos = torch.arange(x.shape[-2], dtype=x.dtype, device=x.device)[:, None]
    angles = pos / 10000 ** (torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    if interleaved:
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
        pairs = torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)
        return x * cos + pairs * sin
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RotaryWithNullKey(nn.Module):
    """q and k rotated, then a learned null key and value put before the tokens' (as lucidrains' and colt5's
    attention classes do). ``k_pairs_interleaved`` is the bug: k rotated with the other pairing."""

    def __init__(self, dim: int = 64, heads: int = 4, k_pairs_interleaved: bool = False) -> None:
        super().__init__()
        self.h, self.k_interleaved = heads, k_pairs_interleaved
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.null_kv = nn.Parameter(torch.randn(2, heads, 1, dim // heads))
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.h, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, -1))
        q, k = _rotate(q), _rotate(k, self.k_interleaved)
        null_k, null_v = (t.expand(b, -1, -1, -1) for t in self.null_kv)
        k, v = torch.cat([null_k, k], -2), torch.cat([null_v, v], -2)
        weights = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)
        return self.to_out((weights @ v).transpose(1, 2).reshape(b, n, e))


def test_rotary_beside_a_null_key_put_first_is_read_on_the_tokens_keys():
    """catches: a null key before the tokens' keys read as rotary-mismatch: the check of q_i . k_i took the first L
    keys, the null one among them, so each query met its neighbour's key."""
    torch.manual_seed(0)
    good = check(RotaryWithNullKey())
    assert good.passed, _ids(good)
    bad = check(RotaryWithNullKey(k_pairs_interleaved=True))
    assert "rotary-mismatch" in bad.ids, _ids(bad)


# -- a scale stated by the config under litgpt's name ---------------------------------------------------------------
class _LitConfig:
    def __init__(self, n_embd: int = 64, n_head: int = 4, attention_scores_scalar: int | None = None) -> None:
        self.n_embd, self.n_head, self.attention_scores_scalar = n_embd, n_head, attention_scores_scalar


class LitStyleAttention(nn.Module):
    """litgpt's CausalSelfAttention in short: the scale 1/sqrt(config.attention_scores_scalar or head_size).
    ``ignore_scalar`` is the bug: 1/sqrt(head_size) always."""

    def __init__(self, config: _LitConfig, ignore_scalar: bool = False) -> None:
        super().__init__()
        self.config, self.ignore_scalar = config, ignore_scalar
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x):
        b, t, e = x.shape
        h = self.config.n_head
        q, k, v = self.qkv(x).view(b, t, 3, h, e // h).permute(2, 0, 3, 1, 4)
        stated = None if self.ignore_scalar else self.config.attention_scores_scalar
        scale = 1.0 / math.sqrt(stated or e // h)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.proj(out.transpose(1, 2).reshape(b, t, e))


def test_litgpts_attention_scores_scalar_is_the_stated_scale():
    """catches: litgpt's config.attention_scores_scalar (its name for Gemma's query_pre_attn_scalar) not read, so
    the module that follows it got wrong-scale and the one that ignores it was certified."""
    torch.manual_seed(0)
    good = check(LitStyleAttention(_LitConfig(attention_scores_scalar=32)), causal=True)
    assert good.passed, _ids(good)
    bad = check(LitStyleAttention(_LitConfig(attention_scores_scalar=32), ignore_scalar=True), causal=True)
    assert bad.ids == {"wrong-scale"}, _ids(bad)


@pytest.mark.parametrize("bug", ["as-strided", "wrong-half"])
def test_a_relative_shift_is_read_whatever_its_spelling_and_named_when_it_depends_on_the_length(bug):
    """catches: the shift written with as_strided (icefall) read as a formula no attention follows, and a shift
    keeping the wrong half of the 2T - 1 columns certified: relative at any one length, it weighs other distances
    at another, so a padded item's real tokens differ from the same tokens alone."""
    torch.manual_seed(0)
    report = check(ConformerRelAttention(bug=bug))
    if bug == "as-strided":
        assert report.passed, _ids(report)
    else:
        assert report.ids == {"definition-mismatch"} and "length" in report.findings[0].message, _ids(report)


# -- a model that makes its layers causal through the mask it passes ------------------------------------------------
class MaskedLayer(nn.Module):
    """Meta's llama reference in short: forward(x, mask), scores + mask, the mask an additive (L, L) causal one the
    model builds (the layer itself hides nothing)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, mask):
        b, t, e = x.shape
        q, k, v = (w(x).view(b, t, self.h, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-2, -1) / math.sqrt(e // self.h) + mask
        return self.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, e))


class CausalThroughTheMask(nn.Module):
    """Two layers made causal by the additive mask the model builds: (L, L) causal, or with ``window`` and a padding
    mask a (B, 1, L, L) one that also hides keys past the window and the padded tokens (GPT with attention_mask)."""

    def __init__(self, dim: int = 64, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.layers = nn.ModuleList([MaskedLayer(dim), MaskedLayer(dim)])

    def forward(self, x, attention_mask=None):
        t = x.shape[1]
        i = torch.arange(t, device=x.device)
        keep = i[None, :] <= i[:, None]
        if self.window is not None:
            keep = keep & (i[None, :] > i[:, None] - self.window)
        if attention_mask is not None:
            keep = keep[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(keep.shape, device=x.device).masked_fill(~keep, torch.finfo(x.dtype).min)
        for layer in self.layers:
            x = x + layer(x, mask)
        return x


@pytest.mark.parametrize("window", [None, 3])
def test_a_model_that_is_causal_through_the_mask_it_passes_is_causal(window):
    """catches: check_model(..., causal=True) on a model whose layers are causal only through the mask it passes
    named causal-leak on every layer: the replay without the doctor's mask dropped the model's causal mask (also
    when that mask carries a window and the padding besides)."""
    from selfattn.check import check_model

    torch.manual_seed(0)
    x = torch.randn(2, 8, 64)
    inputs = (x,) if window is None else {"x": x, "attention_mask": torch.tensor([[1] * 8, [1] * 6 + [0] * 2])}
    report = check_model(CausalThroughTheMask(window=window), inputs, causal=True)
    assert report.passed, [(name, r.ids) for name, r in report.layers.items()]
    assert len(report.layers) == 2


# -- windows over a grid padded to a multiple of the window (SAM's and ViTDet's image encoder) ----------------------
class PaddedWindows(nn.Module):
    """ViTDet / SAM window attention on a (B, H, W, C) map: the map padded with zeros on the bottom and right to a
    multiple of the window, attention within each window (the zero tokens attended to, as SAM does, no mask), the
    padding cut off again."""

    def __init__(self, dim: int = 64, heads: int = 4, window: int = 4) -> None:
        super().__init__()
        self.h, self.window = heads, window
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, hh, ww, c = x.shape
        w = self.window
        ph, pw = (w - hh % w) % w, (w - ww % w) % w
        x = nn.functional.pad(x, (0, 0, 0, pw, 0, ph))
        hp, wp = hh + ph, ww + pw
        win = x.view(b, hp // w, w, wp // w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, c)
        q, k, v = self.qkv(win).view(win.shape[0], w * w, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, w * w, c)
        out = self.proj(out).view(b, hp // w, wp // w, w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        return out[:, :hh, :ww]


def test_windows_of_a_grid_padded_to_their_multiple_are_windows():
    """catches: SAM's windows of 4 on a 6 x 6 map, padded to 8 x 8, read as a head split (the window's 16 tokens
    do not divide the 36): four padded windows of 16 now tile the grid."""
    torch.manual_seed(0)
    report = check(PaddedWindows(), length=[36])
    assert report.passed, _ids(report)


# -- gated row attention over MSA rows, as many heads as tokens in a row ---------------------------------------------
class GatedRowAttention(nn.Module):
    """OpenFold's Attention on (B, S, N, C) MSA rows: attention along N within each of the S rows, the output
    gated by a sigmoid of the input before its projection. ``merge_by_view`` is the bug: the heads put back with a
    reshape of (..., H, N, D), no transpose."""

    def __init__(self, dim: int = 64, heads: int = 4, merge_by_view: bool = False) -> None:
        super().__init__()
        self.h, self.merge_by_view = heads, merge_by_view
        self.q, self.k, self.v, self.g = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.o = nn.Linear(dim, dim)

    def forward(self, x):                                                       # (B, S, N, C)
        *lead, n, c = x.shape
        d = c // self.h
        q, k, v = (lin(x).view(*lead, n, self.h, d).transpose(-2, -3) for lin in (self.q, self.k, self.v))
        q = q / math.sqrt(d)
        o = torch.softmax(q @ k.transpose(-1, -2), -1) @ v                    # (B, S, H, N, D)
        o = o.reshape(*lead, n, self.h, d) if self.merge_by_view else o.transpose(-2, -3)
        o = o * torch.sigmoid(self.g(x)).view(*lead, n, self.h, d)
        return self.o(o.reshape(*lead, n, c))


def test_a_merge_is_read_where_a_row_holds_as_many_tokens_as_heads():
    """catches: four tokens per MSA row and four heads: the transpose back kept the product's shape, and the
    doctor, following what keeps the shape, read the gated tensor as the product's layout: head-merge on correct
    code."""
    torch.manual_seed(0)

    def rows(m, x):
        return m(x.reshape(x.shape[0], 2, x.shape[1] // 2, x.shape[2])).reshape(x.shape)

    good = check(GatedRowAttention(), call=rows, length=[8])
    assert good.passed, _ids(good)
    bad = check(GatedRowAttention(merge_by_view=True), call=rows, length=[8])
    assert "head-merge" in bad.ids, _ids(bad)


# -- streaming segments with a look-ahead (Emformer) -----------------------------------------------------------------
class SegmentsWithLookAhead(nn.Module):
    """Emformer-like streaming attention: segments of 3 tokens, each query sees every key up to the end of its own
    segment and ``ahead`` tokens past it (the right context). ``ahead=4`` is the bug: counted from the end of the
    next segment, a whole segment and one more token leak."""

    def __init__(self, dim: int = 64, heads: int = 4, ahead: int = 1) -> None:
        super().__init__()
        self.h, self.ahead = heads, ahead
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, e = x.shape
        i = torch.arange(t, device=x.device)
        visible = i[None, :] < (i[:, None] // 3 + 1) * 3 + self.ahead
        q, k, v = self.qkv(x).view(b, t, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.proj(out.transpose(1, 2).reshape(b, t, e))


def test_streaming_segments_with_a_right_context_are_a_design():
    """catches: Emformer's segments with one look-ahead token named causal-leak ("queries see some future keys and
    not others") without any option; a look-ahead of more than a segment is still a leak."""
    torch.manual_seed(0)
    good = check(SegmentsWithLookAhead(), length=[12])
    assert good.passed and "right context" in good.inferred["window"], _ids(good)
    bad = check(SegmentsWithLookAhead(ahead=4), length=[12])
    assert "causal-leak" in bad.ids, _ids(bad)


class TemperatureOrScale(nn.Module):
    """Cosine attention holding two alternatives of one shape, an option choosing which it learns: a logit scale
    (Swin v2's) or a temperature; the other is never read. Not a bug: the two are not a pair."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(heads, 1, 1)))
        self.tau = nn.Parameter(torch.full((heads, 1, 1), 0.1))

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        scores = nn.functional.normalize(q, dim=-1) @ nn.functional.normalize(k, dim=-1).transpose(-2, -1)
        weights = (scores * self.logit_scale.clamp(max=math.log(100.0)).exp()).softmax(-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, e))


def test_alternatives_of_one_shape_are_not_a_pair():
    """guards: a parameter the module's option leaves unread beside another of its shape, named apart, is not
    no-grad (pos_bias_u and pos_bias_v are a pair by their names; logit_scale and tau are not)."""
    torch.manual_seed(0)
    report = check(TemperatureOrScale())
    assert report.passed, _ids(report)


# -- torchtune's forward(x, y=None, *, mask=None): self-attention is forward(x, x) ---------------------------------
class XAndY(nn.Module):
    """torchtune's MultiHeadAttention in short: keys and values from y; without a KV cache, y must be given, also
    for self-attention (forward(x, x))."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (nn.Linear(dim, dim, bias=False)
                                                                   for _ in range(4))

    def forward(self, x, y=None, *, mask=None):
        if y is None:
            raise ValueError("Must provide y input or use kv_cache to enable streaming decoding")
        b, t, e = x.shape
        q = self.q_proj(x).view(b, t, self.h, -1).transpose(1, 2)
        k, v = (p(y).view(b, y.shape[1], self.h, -1).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.output_proj(out.transpose(1, 2).reshape(b, t, e))


def test_a_forward_whose_keys_argument_has_a_default_is_called_with_x_twice():
    """catches: torchtune's forward(x, y=None) could not run (exit 2): forward(x, x) was tried only when the keys'
    argument had no default."""
    torch.manual_seed(0)
    report = check(XAndY())
    assert report.passed and report.inferred["call"].startswith("forward(q, kv)"), _ids(report)


class FixedBatchCache(nn.Module):
    """A prefill through a KV cache allocated for exactly two rows (gpt-fast's and torchtune's caches are made
    for one batch size), with a (B, L) padding mask, True = real token."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("k_cache", torch.zeros(2, heads, 32, dim // heads), persistent=False)

    def forward(self, x, mask=None):
        b, t, e = x.shape
        if b != self.k_cache.shape[0]:
            raise ValueError(f"the cache holds {self.k_cache.shape[0]} rows, not {b}")
        q, k, v = self.qkv(x).view(b, t, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        self.k_cache = self.k_cache.to(k.dtype)
        self.k_cache[:, :, :t] = k.detach()
        keep = None if mask is None else mask[:, None, None, :]
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.proj(out.transpose(1, 2).reshape(b, t, e))


def test_the_padding_probe_skips_one_item_alone_where_the_batch_is_fixed():
    """catches: a module that runs only at its cache's batch size was inconclusive with a doctor error: the
    padding probe ran one item alone, which the module refuses (the sizes probe had said so)."""
    torch.manual_seed(0)
    report = check(FixedBatchCache(), batch=2)
    assert report.verdict == "passed" and not report.doctor_errors, (report.verdict, report.not_verified)


# -- q/k norms of the module's own class, and v through one of them --------------------------------------------------
class HeadRMSNorm(nn.Module):
    """An RMS norm over a head's features, written as a class of its own (Qwen 3's and OLMo 2's q/k norms)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class QKNormAttention(nn.Module):
    """Causal attention with q and k normalised per head by norms of the module's own class. ``v_through_k_norm`` is
    the bug: the values passed through k_norm too."""

    def __init__(self, dim: int = 64, heads: int = 4, v_through_k_norm: bool = False) -> None:
        super().__init__()
        self.h, self.d, self.v_norm_bug = heads, dim // heads, v_through_k_norm
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = HeadRMSNorm(self.d), HeadRMSNorm(self.d)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (p(x).view(b, t, self.h, self.d) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        if self.v_norm_bug:
            v = self.k_norm(v)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, e))


def test_values_through_the_keys_norm_are_changed():
    """catches: v passed through k_norm (a norm of the module's own class) certified: a norm on v is a design
    (Gemma 3n's v_norm), but one named for the keys or queries is the values changed."""
    torch.manual_seed(0)
    good = check(QKNormAttention(), causal=True)
    assert good.passed, _ids(good)
    bad = check(QKNormAttention(v_through_k_norm=True), causal=True)
    assert bad.ids == {"values-changed"}, _ids(bad)


class WindowOfTwoUnlessMasked(nn.Module):
    """A causal window of 2 built as an additive mask when none is given, the scores and the mask added before the
    softmax; a given additive mask replaces it."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(e // self.h)
        if mask is None:
            full = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype)
            mask = torch.triu(full, diagonal=1) + torch.tril(full, diagonal=-2)
        return self.proj(((scores + mask).softmax(-1) @ v).transpose(1, 2).reshape(b, t, e))


def test_half_precision_is_not_compared_on_the_padded_tokens_rows():
    """catches: half-precision-mismatch on a correct window of 2: under the padding mask, a padded token's row
    whose window holds only padded keys has no value to agree on, and it was compared."""
    torch.manual_seed(0)
    report = check(WindowOfTwoUnlessMasked(), causal=True)
    assert report.passed, _ids(report)


# -- building from an annotated args object, or a config that defaults to None ---------------------------------------
@dataclass
class ModelArgs:
    dim: int = 64
    n_heads: int = 4


class ArgsAttention(nn.Module):
    """Meta's llama reference builds its attention from ``args: ModelArgs``; this one also accepts ``config=None``
    (the module's own defaults) when ``by_config`` is used."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.h = args.n_heads
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, e))


class DefaultConfigAttention(ArgsAttention):
    def __init__(self, config=None) -> None:  # gpt-fast's: no annotation, the module's own defaults
        super().__init__(config or ModelArgs())


@pytest.mark.parametrize("cls", [ArgsAttention, DefaultConfigAttention], ids=["args: ModelArgs", "config=None"])
def test_a_module_built_from_an_annotated_args_object_or_its_own_defaults_runs(cls):
    """catches: exit 2, "needs 'args', which the doctor cannot guess", though the annotation names the class; and
    "needs a config object" for a config that defaults to None."""
    torch.manual_seed(0)
    report = check(cls, causal=True)
    assert report.passed, _ids(report)

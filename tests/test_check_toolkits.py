"""The doctor on code in the style of speech toolkits, structure-biology code, vision backbones and hand-written LLM
inference modules. Each test is a wrong verdict the doctor used to give.

Shape legend: B batch, L length, E embed dim, H heads, D head dim, W window.
"""

from __future__ import annotations

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

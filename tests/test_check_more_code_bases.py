"""The doctor on attention from more code bases: padding beside causal masks, and the modules named in each test.

Each module is written in the style of the code base it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import torch
from torch import nn

from selfattn.check import check


# -- a causal layer with a key padding mask, True = padding, filled with -inf (ALiBi / GPT style) -----------------
class CausalWithPadding(nn.Module):
    """A fused-QKV causal layer taking ``key_padding_mask`` (True = padding) and filling hidden scores with -inf, with
    an optional ALiBi bias. A query whose earlier keys are all padding gets a NaN row, as in the published code."""

    def __init__(self, dim: int = 32, heads: int = 4, alibi: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads) if alibi else None,
                             persistent=False)

    def forward(self, x, key_padding_mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / (e // self.heads) ** 0.5
        i = torch.arange(n, device=x.device)
        if self.slopes is not None:
            s = s + self.slopes.to(s.dtype)[:, None, None] * (i[None, :] - i[:, None]).to(s.dtype)
        s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
        if key_padding_mask is not None:
            s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        return self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_a_causal_layer_with_a_padding_mask_is_read_true_means_padding():
    """catches: the doctor's own keep-mask, read True = padding by a causal layer, leaves some queries no key (NaN
    rows, as the module's reading gives there); the NaN made the reading look unsound, so no convention matched
    and the white box compared the scores with the mask read the wrong way round (mask-ignored)."""
    for alibi in (False, True):
        report = check(CausalWithPadding(alibi=alibi))
        assert report.passed, [(f.id, f.message) for f in report.findings]
        assert report.inferred["mask"]["kind"] == "ignore"

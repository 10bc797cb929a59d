"""The doctor on attention from graph, audio and time-series packages, and on attention bugs reported in issue
trackers.

Each module is written in the style of the code base it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

from torch import nn

from selfattn.check import check


# -- torchaudio: a required key_padding_mask, True = padding, on (T, B, D) frames ---------------------------------
class RequiredPaddingMask(nn.Module):
    """torchaudio's ConformerLayer style: (T, B, D) input, a ``key_padding_mask`` forward requires (True = padding,
    passed on to ``nn.MultiheadAttention``), and a depthwise convolution after the attention that mixes neighbouring
    frames (so padded frames reach real ones: a true mask-ignored, and no equivariance)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, 4)
        self.conv = nn.Conv1d(dim, dim, 3, padding=1, groups=dim)

    def forward(self, input, key_padding_mask):
        x = self.self_attn(input, input, input, key_padding_mask=key_padding_mask, need_weights=False)[0] + input
        return x + self.conv(x.permute(1, 2, 0)).permute(2, 0, 1)


def test_a_required_mask_is_sent_in_the_declared_convention():
    """catches: with ``mask_convention="ignore"`` stated, the mask a required argument gets on plain calls made in
    the "keep" convention (all True: every frame padding), so the attention's projections got no gradient
    (no-grad) and the output followed no formula (definition-mismatch)."""
    report = check(RequiredPaddingMask(), mask_convention="ignore")
    assert report.ids == {"mask-ignored", "not-equivariant"}, [(f.id, f.message) for f in report.findings]
    assert report.inferred["mask"]["kind"] == "ignore"

"""The doctor on attention from graph, audio and time-series packages, and on attention bugs reported in issue
trackers.

Each module is written in the style of the code base it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import torch
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


# -- PyTorch-NLP's Luong attention: the softmax on a (B * Lq, Lk) view of the scores -------------------------------
class LuongFlatSoftmax(nn.Module):
    """PyTorch-NLP's ``Attention`` ("general"): scores ``bmm(query W_a, context^T)`` with no scale, viewed as
    (B * Lq, Lk) for ``nn.Softmax``, viewed back for the product with the context, then ``tanh(W_out [mix; q])``.
    ``softmax_dim`` 0 is the reported bug (normalised over queries and batch items)."""

    def __init__(self, dimensions: int = 64, softmax_dim: int = -1) -> None:
        super().__init__()
        self.linear_in = nn.Linear(dimensions, dimensions, bias=False)
        self.linear_out = nn.Linear(dimensions * 2, dimensions, bias=False)
        self.softmax = nn.Softmax(dim=softmax_dim)

    def forward(self, query, context):
        b, n, d = query.shape
        query = self.linear_in(query.reshape(b * n, d)).reshape(b, n, d)
        scores = torch.bmm(query, context.transpose(1, 2).contiguous()).view(b * n, context.shape[1])
        weights = self.softmax(scores).view(b, n, context.shape[1])
        mix = torch.bmm(weights, context)
        return torch.tanh(self.linear_out(torch.cat((mix, query), dim=2).view(b * n, 2 * d)).view(b, n, d)), weights


def test_a_softmax_on_a_flattened_view_of_the_scores_is_read_on_their_axes():
    """catches: the softmax taken on the scores viewed as (B * Lq, Lk) read as weights over axes that are not the
    tokens (definition-mismatch on correct code), and the same over dim 0 named only by its batch-mixing."""
    report = check(LuongFlatSoftmax(), scale=1.0)
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "softmax-dim" in check(LuongFlatSoftmax(softmax_dim=0), scale=1.0).ids

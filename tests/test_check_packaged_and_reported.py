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


# -- GraphGPS on to_dense_batch: the node mask (True = node) and nn.MultiheadAttention's key_padding_mask -----------
class DenseGraphAttention(nn.Module):
    """GraphGPS's global attention on a dense batch: ``mask`` from ``to_dense_batch`` (True = a real node, all True
    when not given), passed to ``key_padding_mask`` (True = padding) as ``~mask``; ``inverted`` drops the ``~`` (the
    slip the model reports only by its NaN); ``weights`` asks for the attention weights (MHA's other path)."""

    def __init__(self, dim: int = 64, inverted: bool = False, weights: bool = False) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.inverted, self.weights = inverted, weights

    def forward(self, h_dense, mask=None):
        if mask is None:
            mask = torch.ones(h_dense.shape[:2], dtype=torch.bool, device=h_dense.device)
        padding = mask if self.inverted else ~mask
        h = self.self_attn(h_dense, h_dense, h_dense, key_padding_mask=padding, need_weights=self.weights)[0]
        return h * mask[..., None]


def test_a_default_node_mask_handed_to_key_padding_mask_uninverted_is_named():
    """catches: nn.MultiheadAttention handed the module's own all-True node mask as key_padding_mask, which hides
    every key when the module is given no mask, named only by its symptoms (non-finite, causal-leak, no-grad)."""
    assert check(DenseGraphAttention(), mask_convention="keep").verdict == "passed"
    for weights in (False, True):
        report = check(DenseGraphAttention(inverted=True, weights=weights))
        assert "mask-inverted" in report.ids, (weights, [(f.id, f.message) for f in report.findings])


# -- open_lm: xformers' rotary, built for (B, H, L, D), applied to (B, L, H, D) --------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryOnTheHeads(nn.Module):
    """open_lm's first attention: q, k, v viewed (B, L, H, D), then xformers' ``RotaryEmbedding`` whose cos and sin
    run along dim -2 (the heads there: every head turned by its index, the same at every position, so the rotation
    cancels in q . k); ``fixed`` permutes q and k to (B, H, L, D) around it, as the reported fix does."""

    def __init__(self, dim: int = 64, heads: int = 4, fixed: bool = False) -> None:
        super().__init__()
        self.heads, self.d, self.fixed = heads, dim // heads, fixed
        self.in_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, self.d, 2).float() / self.d)))

    def rotate(self, q, k):
        t = torch.arange(k.shape[-2], dtype=self.inv_freq.dtype)
        emb = torch.cat((torch.outer(t, self.inv_freq),) * 2, dim=-1).to(q.dtype)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.d) for t in self.in_proj(x).chunk(3, dim=-1))
        if self.fixed:
            q, k = (t.permute(0, 2, 1, 3) for t in self.rotate(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3)))
        else:
            q, k = self.rotate(q, k)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


def test_rotary_tables_along_the_heads_are_named():
    """catches: rotary cos/sin built along the token axis of (B, H, L, D) and applied to (B, L, H, D) q and k, which
    turns each head by its index and leaves the scores with no position, certified as attention with none."""
    report = check(RotaryOnTheHeads(fixed=True), causal=True)
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "rotary-mismatch" in check(RotaryOnTheHeads(), causal=True).ids


# -- an FFT on the way: torch.fft has no float16 or bfloat16 kernel on the CPU --------------------------------------
class SpectralGate(nn.Module):
    """FEDformer / FNet style: a learned gate applied in the frequency domain of each token's features
    (``rfft``/``irfft`` over the channels), then plain attention."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.ones(dim // 2 + 1))
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)

    def forward(self, x):
        x = torch.fft.irfft(torch.fft.rfft(x, dim=-1) * self.gate, n=x.shape[-1], dim=-1)
        return self.attn(x, x, x, need_weights=False)[0]


def test_an_operation_the_device_lacks_in_half_precision_is_not_held_against_the_module():
    """catches: torch.fft's "Unsupported dtype Half" on the CPU reported as half-precision-overflow (the message
    was matched case-sensitively)."""
    report = check(SpectralGate())
    assert "half-precision-overflow" not in report.ids, [(f.id, f.message) for f in report.findings]
    assert any("lacks" in str(v) for v in report.inferred["half precision"].values()), report.inferred


# -- the Temporal Fusion Transformer's interpretable attention: per-head q/k lists, one shared v, the heads' mean ----
class InterpretableAttention(nn.Module):
    """pytorch-forecasting's ``InterpretableMultiHeadAttention`` style: ``q_layers`` and ``k_layers`` one Linear per
    head, one ``v_layer`` shared by every head, the heads averaged, then ``w_h``; ``project`` False never applies
    ``w_h`` (the output is the heads' mean)."""

    def __init__(self, d_model: int = 32, n_head: int = 4, project: bool = True) -> None:
        super().__init__()
        self.d_k = d_model // n_head
        self.v_layer = nn.Linear(d_model, d_model)
        self.q_layers = nn.ModuleList([nn.Linear(d_model, self.d_k) for _ in range(n_head)])
        self.k_layers = nn.ModuleList([nn.Linear(d_model, self.d_k) for _ in range(n_head)])
        self.w_h = nn.Linear(d_model, d_model, bias=False)
        self.project = project

    def forward(self, q, k, v, mask=None):
        vs = self.v_layer(v)
        heads = []
        for q_layer, k_layer in zip(self.q_layers, self.k_layers, strict=True):
            scores = torch.bmm(q_layer(q), k_layer(k).permute(0, 2, 1)) / self.d_k ** 0.5
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            heads.append(torch.bmm(scores.softmax(dim=2), vs))
        out = torch.stack(heads, dim=2).mean(dim=2)
        return (self.w_h(out) if self.project else out), scores


def test_an_output_projection_beside_per_head_projection_lists_is_checked():
    """catches: the output Linear never applied certified when q and k are per-head ``ModuleList``s (their roles
    were read from the list's members, named by their index only)."""
    assert "no-grad" not in check(InterpretableAttention(), no_mask=True).ids
    assert "no-grad" in check(InterpretableAttention(project=False), no_mask=True).ids


# -- locality self-attention (tsai's TSiTPlus with lsa=True, vit-pytorch's LSA): the own key hidden ----------------
class LocalitySelfAttention(nn.Module):
    """tsai's ``MultiheadAttention(lsa=True)`` as TSiTPlus calls it: a learned temperature for the scale, every
    token's own key hidden (``attn_mask`` the identity) and padded keys hidden, both filled with -inf. ``causal``
    hides the diagonal with a causal mask built ``triu(0)`` (the off-by-one that hides each token from itself)."""

    def __init__(self, dim: int = 32, heads: int = 4, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.W_Q, self.W_K, self.W_V = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.tensor((dim // heads) ** -0.5))

    def forward(self, x, key_padding_mask=None):
        b, n, e = x.shape
        q, k, v = (w(x).view(b, n, self.heads, -1).transpose(1, 2) for w in (self.W_Q, self.W_K, self.W_V))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        own = torch.ones(n, n, dtype=torch.bool).triu() if self.causal else torch.eye(n, dtype=torch.bool)
        scores = scores.masked_fill(own, float("-inf"))
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        out = torch.matmul(scores.softmax(-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, e))


def test_the_own_key_hidden_beside_a_padding_mask_is_a_design():
    """catches: locality self-attention's hidden diagonal, beside a padding mask, read as a causal mask that hides
    more than the future (causal-leak) in the padding run (tsai's TSiTPlus with ``lsa=True``, layer and model)."""
    report = check(LocalitySelfAttention(), mask_convention="ignore")
    assert "causal-leak" not in report.ids, [(f.id, f.message) for f in report.findings]
    assert "self mask" in report.inferred["design"], report.inferred["design"]
    assert "causal-leak" in check(LocalitySelfAttention(causal=True), causal=True).ids


# -- labml's DDPM attention block: einsum weights 'bijh', the keys on dim 2 ----------------------------------------
class EinsumImageBlock(nn.Module):
    """labml's DDPM U-Net ``AttentionBlock``: a (B, C, H, W) map flattened to tokens, one head, weights
    ``einsum('bihd,bjhd->bijh')`` normalised over dim 2 (the keys; the reported "fix", dim 1, is the bug), a
    residual."""

    def __init__(self, n_channels: int = 64, n_heads: int = 1, softmax_dim: int = 2) -> None:
        super().__init__()
        self.projection = nn.Linear(n_channels, n_heads * n_channels * 3)
        self.output = nn.Linear(n_heads * n_channels, n_channels)
        self.n_heads, self.d_k, self.softmax_dim = n_heads, n_channels, softmax_dim

    def forward(self, x):
        b, c, h, w = x.shape
        x = x.view(b, c, -1).permute(0, 2, 1)
        q, k, v = torch.chunk(self.projection(x).view(b, -1, self.n_heads, 3 * self.d_k), 3, dim=-1)
        attn = (torch.einsum("bihd,bjhd->bijh", q, k) * self.d_k ** -0.5).softmax(dim=self.softmax_dim)
        res = self.output(torch.einsum("bijh,bjhd->bihd", attn, v).reshape(b, -1, self.n_heads * self.d_k)) + x
        return res.permute(0, 2, 1).view(b, c, h, w)


def test_weights_with_the_heads_last_are_not_read_as_one_key():
    """catches: softmax weights (B, Lq, Lk, H) with one head read as attention over one key (their last axis), so the
    image was grown to 32 x 32 tokens looking for more keys and the check took a minute."""
    report = check(EinsumImageBlock())
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert report.inferred["probe shape"][1] < 100, report.inferred["probe shape"]
    assert "softmax-dim" in check(EinsumImageBlock(softmax_dim=1)).ids

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


class SDPANodeMask(nn.Module):
    """The same node mask (True = a real node, all True when not given) handed to SDPA, whose bool mask reads True as
    may attend: right as it is."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, e = x.shape
        if mask is None:
            mask = torch.ones(b, n, dtype=torch.bool, device=x.device)
        q, k, v = self.qkv(x).view(b, n, 3, 4, -1).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return self.out(o.transpose(1, 2).reshape(b, n, e))


def test_a_default_node_mask_handed_to_key_padding_mask_uninverted_is_named():
    """catches: nn.MultiheadAttention handed the module's own all-True node mask as key_padding_mask, which hides
    every key when the module is given no mask, named only by its symptoms (non-finite, causal-leak, no-grad); and
    SDPA's all-True bool mask (every key visible) read as hiding every key."""
    assert check(DenseGraphAttention(), mask_convention="keep").verdict == "passed"
    assert check(SDPANodeMask()).verdict == "passed"
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

    def __init__(self, dim: int = 64, heads: int = 4, fixed: bool = False, cached: bool = False) -> None:
        super().__init__()
        self.heads, self.d, self.fixed, self.cached = heads, dim // heads, fixed, cached
        self.in_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, self.d, 2).float() / self.d)))
        emb = torch.cat((torch.outer(torch.arange(256).float(), self.inv_freq),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None])  # (the tables cached ahead: no cos or sin runs)
        self.register_buffer("sin_cached", emb.sin()[None, None])

    def rotate(self, q, k):
        if self.cached:
            cos, sin = self.cos_cached[:, :, :k.shape[-2]].to(q.dtype), self.sin_cached[:, :, :k.shape[-2]].to(q.dtype)
        else:
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
    for cached in (False, True):  # the tables computed in forward, or cached ahead as buffers
        report = check(RotaryOnTheHeads(fixed=True, cached=cached), causal=True)
        assert report.verdict == "passed", (cached, [(f.id, f.message) for f in report.findings])
        assert "rotary-mismatch" in check(RotaryOnTheHeads(cached=cached), causal=True).ids, cached


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


# -- ALiBi as a score_mod (attention-gym): the sign of the distance ----------------------------------------------
class AlibiScoreMod(nn.Module):
    """attention-gym's ALiBi ``score_mod`` evaluated eagerly: ``score + slope[h] * (kv_idx - q_idx)`` under a causal
    mask, slopes 2^(-8(h+1)/H); ``flipped`` is the reported ``(q_idx - kv_idx)``; ``causal`` False uses the symmetric
    ``-slope * |q_idx - kv_idx|``."""

    def __init__(self, dim: int = 64, heads: int = 4, flipped: bool = False, causal: bool = True) -> None:
        super().__init__()
        self.heads, self.flipped, self.causal = heads, flipped, causal
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.register_buffer("slopes", torch.exp2(-((torch.arange(heads) + 1) * 8.0 / heads)), persistent=False)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q_idx, kv_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
        distance = (q_idx - kv_idx) if self.flipped else (kv_idx - q_idx)
        if not self.causal:
            distance = -(q_idx - kv_idx).abs()
        scores = q @ k.transpose(-2, -1) * (e // self.heads) ** -0.5 + self.slopes[:, None, None] * distance
        if self.causal:
            scores = torch.where(q_idx >= kv_idx, scores, -float("inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_alibi_with_its_sign_flipped_is_named():
    """catches: ALiBi's distance term added with the wrong sign (distant keys rewarded) certified as a
    relative-position bias."""
    for causal in (True, False):
        report = check(AlibiScoreMod(causal=causal), causal=causal)
        assert report.verdict == "passed", (causal, [(f.id, f.message) for f in report.findings])
    report = check(AlibiScoreMod(flipped=True), causal=True)
    assert "definition-mismatch" in report.ids and "distant keys" in str([f.message for f in report.findings])


# -- PyG's MultiheadAttentionBlock: a mask for the queries' input and one for the keys' -----------------------------
class TwoMaskBlock(nn.Module):
    """PyG's ``MultiheadAttentionBlock.forward(x, y, x_mask, y_mask)``: ``y_mask`` (True = a real element) hides the
    keys through ``key_padding_mask=~y_mask``; ``x_mask`` zeroes the padded queries' attention output, then the
    residual and a feed-forward; ``inverted`` passes ``y_mask`` without its ``~``."""

    def __init__(self, channels: int = 64, heads: int = 4, inverted: bool = False) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(channels, heads, batch_first=True)
        self.lin = nn.Linear(channels, channels)
        self.inverted = inverted

    def forward(self, x, y, x_mask=None, y_mask=None):
        if y_mask is not None and not self.inverted:
            y_mask = ~y_mask
        out = self.attn(x, y, y, y_mask, need_weights=False)[0]
        if x_mask is not None:
            out[~x_mask] = 0.0
        out = out + x
        return out + self.lin(out).relu()


def test_a_query_mask_beside_a_key_mask_is_not_a_broadcast_key_mask():
    """catches: the queries' own mask (``x_mask``, beside the keys' ``y_mask``) read as a key mask broadcast over the
    query axis, on a module whose key mask works."""
    report = check(TwoMaskBlock())
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert report.inferred["mask"]["argument"] == "y_mask", report.inferred["mask"]
    assert check(TwoMaskBlock(), mask_convention="keep").verdict == "passed"
    assert "mask-inverted" in check(TwoMaskBlock(inverted=True), mask_convention="keep").ids


# -- Graphormer's spatial encoding: a learned bias per head looked up by shortest-path distances ------------------
def _tree_distances(n: int) -> torch.Tensor:
    """Shortest-path distances (clipped at 5) on one fixed tree of n nodes, the same for every item."""
    parent = [-1] + [(7 * i + 3) % i for i in range(1, n)]
    dist = torch.zeros(n, n, dtype=torch.long)
    for a in range(n):
        for b in range(n):
            up_a, up_b, seen = a, b, {}
            depth = 0
            while up_a != -1:
                seen[up_a] = depth
                up_a, depth = parent[up_a], depth + 1
            depth = 0
            while up_b not in seen:
                up_b, depth = parent[up_b], depth + 1
            dist[a, b] = min(depth + seen[up_b], 5)
    return dist


class SpatialBiasAttention(nn.Module):
    """Graphormer on a dense batch: ``scores = q k^T * scale + spatial_pos_encoder(spatial_pos)`` with an
    ``nn.Embedding(8, heads)`` looked up by the graph's shortest-path distances (a call input); ``scaled`` False
    forgets the scale."""

    def __init__(self, dim: int = 64, heads: int = 4, scaled: bool = True) -> None:
        super().__init__()
        self.heads, self.scaled = heads, scaled
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.spatial_pos_encoder = nn.Embedding(8, heads)

    def forward(self, x, spatial_pos):
        b, n, e = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * ((e // self.heads) ** -0.5 if self.scaled else 1.0)
        scores = scores + self.spatial_pos_encoder(spatial_pos).permute(0, 3, 1, 2)
        return self.to_out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_a_missing_scale_beside_a_bias_looked_up_by_graph_distances_is_named():
    """catches: a missing scale beside Graphormer's spatial bias (an embedding looked up by shortest-path distances,
    a symmetric index, 0 on the diagonal) named definition-mismatch ("T5's bias is relative")."""
    def call(m, x):
        return m(x, _tree_distances(x.shape[1]).expand(x.shape[0], -1, -1))

    assert check(SpatialBiasAttention(), call=call).verdict == "passed"
    report = check(SpatialBiasAttention(scaled=False), call=call)
    assert "missing-scale" in report.ids and "definition-mismatch" not in report.ids, report.ids


# -- Informer's ProbSparse attention: the top queries gathered in the order of a top-k, put back by their index ----
class ProbSparse(nn.Module):
    """neuralforecast's ``ProbAttention`` inside its ``AttentionLayer``: q, k, v (B, L, H, D); the queries ranked by
    the sparsity measure max - mean of their scores, the top u gathered in ``topk(sorted=False)`` order, attended,
    and written back by their index (the others get the mean of V; at this length every query is a top one).
    ``merged_wrong`` returns (B, H, L, D) to the layer's ``view(B, L, -1)``, the shipped slip."""

    def __init__(self, dim: int = 32, heads: int = 4, merged_wrong: bool = False) -> None:
        super().__init__()
        self.heads, self.merged_wrong = heads, merged_wrong
        self.query_projection, self.key_projection, self.value_projection, self.out_projection = (
            nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(2, 1)
                   for p in (self.query_projection, self.key_projection, self.value_projection))
        scores = q @ k.transpose(-2, -1)
        measure = scores.max(-1)[0] - scores.sum(-1) / n
        top = measure.topk(n, sorted=False)[1]
        rows = (torch.arange(b)[:, None, None], torch.arange(self.heads)[None, :, None], top)
        attn = torch.softmax(q[rows] @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        context = v.mean(dim=-2, keepdim=True).expand_as(v).clone()
        context[rows] = attn @ v
        out = context if self.merged_wrong else context.transpose(2, 1)
        return self.out_projection(out.contiguous().view(b, n, -1))


def test_queries_gathered_in_the_order_of_a_top_k_are_not_a_head_split():
    """catches: the ProbSparse queries, gathered in the order their top-k gives and written back by the same index,
    read as a layout that spreads tokens over other rows (head-split on correct code; on the shipped merge slip,
    head-split where it is head-merge)."""
    report = check(ProbSparse(), length=7)
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "head-merge" in check(ProbSparse(merged_wrong=True), length=7).ids


# -- an image block in channels-first layout: the input in the memory format users pass ----------------------------
class NormedImageBlock(nn.Module):
    """A diffusion-style image attention block on (B, C, H, W): GroupNorm, one head with its weights kept
    'bijh' (heads last), a residual; ``softmax_over_heads`` normalises over the heads axis of one (the bug)."""

    def __init__(self, channels: int = 64, softmax_over_heads: bool = False) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(1, channels)
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(channels, channels) for _ in range(4))
        self.dim = -1 if softmax_over_heads else 2

    def forward(self, x):
        b, c, h, w = x.shape
        t = self.norm(x).flatten(2).transpose(1, 2)
        q, k, v = (f(t).view(b, -1, 1, c) for f in (self.to_q, self.to_k, self.to_v))
        attn = (torch.einsum("bihd,bjhd->bijh", q, k) * c ** -0.5).softmax(dim=self.dim)
        out = self.to_out(torch.einsum("bijh,bjhd->bihd", attn, v).reshape(b, -1, c))
        return x + out.transpose(1, 2).reshape(b, c, h, w)


def test_an_image_block_gets_a_contiguous_input_and_a_softmax_over_one_head_is_named():
    """catches: the doctor handing a channels-first module a channels-last-strided (B, C, H, W) input, on which
    torch's CPU backward crashed the process (a segfault in the gradient probe); and a softmax over a heads axis of
    one read as attention over one key (the image grown to 32 x 32 tokens)."""
    assert check(NormedImageBlock()).verdict == "passed"
    report = check(NormedImageBlock(softmax_over_heads=True))
    assert "softmax-dim" in report.ids and report.inferred["probe shape"][1] < 100, report.ids


# -- a rotary cache that grows, on a module with NaN rows: NaN in the same places is no state -------------------------
class CachedRotaryNaNRow(nn.Module):
    """ESM's rotary style: cos/sin tables cached in attributes, rebuilt when a longer sequence comes; and a causal
    mask built ``triu(0)`` (the diagonal hidden: query 0 sees no key and gives NaN with -inf), a real bug."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self._cos = self._sin = None

    def tables(self, n: int, d: int, dtype: torch.dtype):
        if self._cos is None or self._cos.shape[0] < n:
            ang = torch.arange(n, dtype=dtype)[:, None] / 10000 ** (torch.arange(0, d, 2, dtype=dtype) / d)
            self._cos, self._sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        return self._cos[:n].to(dtype), self._sin[:n].to(dtype)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        cos, sin = self.tables(n, q.shape[-1], q.dtype)
        q, k = (t * cos + torch.cat((-t[..., t.shape[-1] // 2:], t[..., :t.shape[-1] // 2]), -1) * sin for t in (q, k))
        s = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(torch.ones(n, n).triu().bool(), float("-inf"))
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_nan_in_the_same_places_on_two_calls_is_no_state():
    """catches: a module that gives NaN on the same rows on every call, with a cache that grows, named
    state-dependent (NaN compared with NaN: "largest difference nan") beside its real findings."""
    report = check(CachedRotaryNaNRow(), causal=True)
    assert "causal-leak" in report.ids and "state-dependent" not in report.ids, report.ids


# -- TabPFN's attention between items: a second kernel call over no queries -----------------------------------------
class TrainTestItems(nn.Module):
    """TabPFN's ``AlongColumnAttention`` with no test rows: the training rows attend to each other, then the
    (empty) test rows attend to the training rows in a second SDPA call over zero queries, joined back."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        train = nn.functional.scaled_dot_product_attention(q, k, v)
        test = nn.functional.scaled_dot_product_attention(q[:, :, n:], k, v)
        return self.out(torch.cat((train, test), dim=2).transpose(1, 2).reshape(b, n, e))


def test_a_kernel_call_over_no_queries_is_no_doctor_error():
    """catches: the white box raising on an empty tensor (max() of no numbers) when the module calls a kernel on
    zero queries, which left correct code inconclusive with a doctor error."""
    report = check(TrainTestItems())
    assert report.verdict == "passed" and report.doctor_errors == [], (report.ids, report.not_verified)


# -- Moirai's grouped-query attention: heads on two axes, (B, groups, heads per group, L, D), a 5-D mask -----------
class GroupsOnTwoAxes(nn.Module):
    """uni2ts's ``GroupedQueryAttention``: q (B, G, H/G, L, D), k and v (B, G, 1, L, D) broadcast over the heads of
    a group, q and k normalised per head, and the padding mask as a 5-D (B, G, 1, L, L) bool for SDPA (one per
    group, as its variate bias is)."""

    def __init__(self, dim: int = 64, heads: int = 4, groups: int = 2) -> None:
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj, self.v_proj = nn.Linear(dim, groups * self.d), nn.Linear(dim, groups * self.d)
        self.out_proj = nn.Linear(dim, dim)
        self.q_norm, self.k_norm = nn.LayerNorm(self.d), nn.LayerNorm(self.d)

    def forward(self, x, attn_mask=None):
        b, n, e = x.shape
        q = self.q_proj(x).view(b, n, self.groups, self.heads // self.groups, self.d).permute(0, 2, 3, 1, 4)
        k, v = (p(x).view(b, n, self.groups, 1, self.d).permute(0, 2, 3, 1, 4) for p in (self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        k, v = k.expand_as(q), v.expand_as(q)
        mask = None if attn_mask is None else attn_mask[:, None, None, None, :].expand(b, self.groups, 1, n, n)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.permute(0, 3, 1, 2, 4).reshape(b, n, e))


def test_heads_on_two_axes_with_a_five_dimensional_mask_are_read():
    """catches: the white box raising (a doctor error, correct code inconclusive) when SDPA gets q (B, G, H/G, L, D)
    and a 5-D mask, which it laid out over (B, H, L, L)."""
    report = check(GroupsOnTwoAxes(), mask_convention="keep")
    assert report.verdict == "passed" and report.doctor_errors == [], (report.ids, report.not_verified)


# -- TimesFM's attention: q/k RMS norms, then a per-dimension scale 1/sqrt(D) * softplus(p) ln-normalised ----------
class PerDimScaled(nn.Module):
    """TimesFM 2.5's ``MultiHeadAttention`` (no rotary): q and k RMS-normalised per head with gains, q multiplied by
    ``1.442695041 / sqrt(D) * softplus(per_dim_scale)`` (1/sqrt(D) in every entry at its initial 0), then SDPA with
    ``scale=1.0``. ``zero_gains``: the norms' gains at 0, as the package initialises them (q = k = 0); ``trained``:
    ``per_dim_scale`` drawn, as a trained checkpoint has it (a learned scale per dimension)."""

    def __init__(self, dim: int = 32, heads: int = 4, zero_gains: bool = False, trained: bool = False) -> None:
        super().__init__()
        self.heads, self.d = heads, dim // heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        gains = torch.zeros(self.d) if zero_gains else 1 + 0.3 * torch.randn(self.d)
        self.query_ln, self.key_ln = nn.Parameter(gains.clone()), nn.Parameter(gains.clone() + 0.1 * (not zero_gains))
        self.per_dim_scale = nn.Parameter(0.5 * torch.randn(self.d) if trained else torch.zeros(self.d))

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.d).unbind(2)
        q, k = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * g
                for t, g in ((q, self.query_ln), (k, self.key_ln)))
        q = q * (1.442695041 / self.d ** 0.5 * nn.functional.softplus(self.per_dim_scale))
        o = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       scale=1.0)
        return self.out(o.transpose(1, 2).reshape(b, n, e))


def test_a_per_dimension_scale_of_one_number_is_the_scale():
    """catches: TimesFM's per-dimension scale (a vector with 1/sqrt(D) in every entry at its initial value) not read
    as a scale on the way to SDPA's scale=1.0 (missing-scale on the module as it ships); and with q = k = 0 (the
    norms' gains at 0), a scale asserted where none can be read; and the trained vector (other numbers per dimension)
    read as missing-scale through SDPA, where the einsum path reads it as a learned scale."""
    report = check(PerDimScaled())
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    report = check(PerDimScaled(zero_gains=True))
    assert not report.ids & {"missing-scale", "wrong-scale", "rotary-mismatch"}, report.ids
    report = check(PerDimScaled(trained=True))  # SDPA's kernel read as the einsum path reads it: a learned scale
    assert report.verdict == "passed" and "learned" in report.inferred["design"]["scale"], report.ids


# -- Gemma 2's soft-capping, as litgpt and torchtune write it: the cap the config states ----------------------------
class SoftCapped(nn.Module):
    """Gemma 2 style: ``cap * tanh(scores * scale / cap)`` with the cap from ``config.attn_logit_softcapping``;
    ``cap_first`` caps the unscaled scores and scales after (``tanh(qk / cap) * cap * scale``), the slip that reads
    as a cap of cap * scale."""

    def __init__(self, dim: int = 64, heads: int = 4, cap_first: bool = False) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(attn_logit_softcapping=5.0)
        self.heads, self.cap_first = heads, cap_first
        self.qkv, self.o_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        cap, scale = self.config.attn_logit_softcapping, q.shape[-1] ** -0.5
        s = q @ k.transpose(-1, -2)
        s = torch.tanh(s / cap) * cap * scale if self.cap_first else cap * torch.tanh(s * scale / cap)
        return self.o_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_a_soft_cap_other_than_the_stated_one_is_named():
    """catches: soft-capping applied before the scale, read as a cap of cap * scale and certified though the config
    states the cap (litgpt's and torchtune's Gemma 2 with the two steps swapped)."""
    report = check(SoftCapped())
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "definition-mismatch" in check(SoftCapped(cap_first=True)).ids


# -- OLMo's q/k norm over the whole width: before the rotation, or (the slip) after it ------------------------------
class WidthNormedRotary(nn.Module):
    """olmo-core style: q and k RMS-normalised over the whole width with learned gains (drawn as after training),
    rotary tables cached ahead as buffers; ``norm_after`` applies the norm after the rotation, which makes each
    token's score with itself depend on its absolute position."""

    def __init__(self, dim: int = 64, heads: int = 4, norm_after: bool = False) -> None:
        super().__init__()
        self.heads, self.d, self.norm_after = heads, dim // heads, norm_after
        self.w_q, self.w_k, self.w_v, self.w_out = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_gain, self.k_gain = nn.Parameter(1 + 0.5 * torch.randn(dim)), nn.Parameter(1 + 0.5 * torch.randn(dim))
        inv = 1.0 / 10000 ** (torch.arange(0, self.d, 2).float() / self.d)
        emb = torch.cat((torch.outer(torch.arange(128).float(), inv),) * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos())
        self.register_buffer("sin_cached", emb.sin())

    @staticmethod
    def rms(t, gain):
        og = t.dtype  # computed in float32 and cast back, as olmo-core's RMSNorm does
        t = t.float()
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (gain.float() * t).type_as(gain).to(og)

    def rotate(self, t):
        n = t.shape[1]
        cos, sin = self.cos_cached[:n, None].to(t.dtype), self.sin_cached[:n, None].to(t.dtype)
        return t * cos + _rotate_half(t) * sin

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.w_q(x), self.w_k(x), self.w_v(x)
        if not self.norm_after:
            q, k = self.rms(q, self.q_gain), self.rms(k, self.k_gain)
        q, k = (self.rotate(t.view(b, n, self.heads, self.d)).reshape(b, n, e) for t in (q, k))
        if self.norm_after:
            q, k = self.rms(q, self.q_gain), self.rms(k, self.k_gain)
        q, k, v = (t.view(b, n, self.heads, self.d).transpose(1, 2).contiguous() for t in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.w_out(out.transpose(1, 2).reshape(b, n, e))


def test_a_norm_after_the_rotation_is_named_with_tables_cached_ahead():
    """catches: a q/k norm over the whole width applied after the rotation (OLMo's slip) certified when the rotary
    tables are cached ahead: the rotation, several operations before the kernel, was not looked for."""
    torch.manual_seed(0)
    report = check(WidthNormedRotary(), causal=True)
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "rotary-mismatch" in check(WidthNormedRotary(norm_after=True), causal=True).ids

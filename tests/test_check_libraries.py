"""The doctor on library classes and on code written in the style of the code bases that ship them: torchvision's
shifted-window and MaxViT attention, fair-esm's row attention, diffusers' rotary helper, open_clip's eager mask
handling, Longformer's global tokens. Each test is a wrong verdict the doctor used to give.

The library classes are the installed ones (requirements-corpus.txt); a buggy variant subclasses the class, or
calls the library's own helpers with the bug around them.

Shape legend: B batch, L length, E embed dim, H heads, D head dim, G groups of tokens.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfattn.check import check, check_model

needs = {name: pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} is not installed")
         for name in ("torchvision", "esm", "diffusers")}


# -- windows: a grid the size of one window cuts nothing and shifts nothing --------------------------------------
@needs["torchvision"]
def test_a_shifted_window_module_is_probed_on_more_than_one_window():
    """catches: Swin's window bugs certified because the probe grid (4 x 4) was exactly one window, where
    torchvision turns the shift off: the doctor now doubles the grid's sides until the windows show."""
    from torchvision.models.swin_transformer import ShiftedWindowAttention

    class NoReverseShift(ShiftedWindowAttention):
        """The output not rolled back after the windows: each token's output lands 2 rows and 2 columns off."""

        def forward(self, x):
            return torch.roll(super().forward(x), shifts=(-2, -2), dims=(1, 2))

    torch.manual_seed(0)
    good = check(ShiftedWindowAttention(64, [4, 4], [2, 2], 4))
    assert good.passed, [(f.id, f.message) for f in good.findings]
    assert good.inferred["probe shape"][1] > 16 and "windows" in good.inferred["keys"]
    bad = check(NoReverseShift(64, [4, 4], [2, 2], 4))
    assert not bad.passed and bad.ids == {"definition-mismatch"}, [(f.id, f.message) for f in bad.findings]


class WindowCosine(nn.Module):
    """Swin v2 style cosine attention within 4 x 4 windows of a (B, H, W, E) map, with a learned temperature per
    head; heads of 16 (E 64, 4 heads), as many as a window's tokens. ``over`` is the axis q and k are normalised
    over: -1 (the features, correct) or -2 (the window's tokens, a bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, window: int = 4, over: int = -1) -> None:
        super().__init__()
        self.heads, self.window, self.over = heads, window, over
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(heads, 1, 1)))

    def forward(self, x):
        b, h, w, e = x.shape
        s = self.window
        win = x.reshape(b, h // s, s, w // s, s, e).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, e)
        q, k, v = self.qkv(win).reshape(win.shape[0], s * s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = F.normalize(q, dim=self.over) @ F.normalize(k, dim=self.over).transpose(-2, -1)
        scores = scores * self.logit_scale.clamp(max=math.log(100.0)).exp()
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(-1, s * s, e)
        out = self.proj(out).reshape(b, h // s, w // s, s, s, e).permute(0, 1, 3, 2, 4, 5)
        return out.reshape(b, h, w, e)


def test_cosine_attention_normalised_over_the_tokens_is_named_when_heads_are_as_wide_as_a_window():
    """catches: q and k normalised over a window's 16 tokens instead of the 16 features certified: the doctor
    told the two axes apart by their sizes only."""
    torch.manual_seed(0)
    good = check(WindowCosine())
    assert good.passed, [(f.id, f.message) for f in good.findings]
    bad = check(WindowCosine(over=-2))
    assert bad.ids == {"definition-mismatch"} and "tokens" in bad.findings[0].message, bad.findings


@needs["torchvision"]
def test_torchvision_swin_v2_attention_is_certified():
    from torchvision.models.swin_transformer import ShiftedWindowAttentionV2

    torch.manual_seed(0)
    report = check(ShiftedWindowAttentionV2(64, [4, 4], [2, 2], 4))
    assert report.passed, [(f.id, f.message) for f in report.findings]


# -- whole models: tokens grouped on a third axis -----------------------------------------------------------------
@needs["torchvision"]
def test_check_model_finds_maxvit_attention_on_grouped_tokens():
    """catches: check_model skipping MaxViT's attention layers as not self-attention: they take (B, G, P, E), the
    tokens on dim 2, and only dims 0 and 1 were tried. torchvision scales them by 1/sqrt(E): wrong-scale."""
    from torchvision.models.maxvit import MaxVit

    torch.manual_seed(0)
    model = MaxVit(input_size=(32, 32), stem_channels=16, partition_size=2, block_channels=[32], block_layers=[1],
                   head_dim=16, stochastic_depth_prob=0.0)
    report = check_model(model, torch.randn(2, 3, 32, 32))
    assert len(report.layers) == 2, report.could_not_run
    assert all(r.ids == {"wrong-scale"} for r in report.layers.values()), \
        {n: [(f.id, f.message) for f in r.findings] for n, r in report.layers.items()}


# -- a multiplication by zeros and ones on the way to the scores is no scale ---------------------------------------
class _EsmRows(nn.Module):
    """fair-esm's RowSelfAttention over an MSA of one row: the L tokens are its columns, (B, L) padding mask
    True = padded, which the class also multiplies into q in place (``q *= 1 - padding_mask``)."""

    scaling = None  # None: the class's own (1/sqrt(D) over one row)

    def __init__(self, embed_dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        from esm.axial_attention import RowSelfAttention

        self.attn = RowSelfAttention(embed_dim, heads)

    def forward(self, x, padding_mask=None):
        msa = x.transpose(0, 1).unsqueeze(0)  # (1, L, B, E): rows, columns, batch, features
        pad = None if padding_mask is None else padding_mask.unsqueeze(1)
        if self.scaling is None:
            out, _ = self.attn(msa, self_attn_padding_mask=pad)
        else:
            weights = self.attn.compute_attention_weights(msa, self.scaling(self.attn), None, pad)
            out = self.attn.compute_attention_update(msa, weights.softmax(-1))
        return out.squeeze(0).transpose(0, 1)


class _EsmRowsOverD(_EsmRows):
    """Scaled by 1/D instead of 1/sqrt(D)."""

    scaling = staticmethod(lambda attn: 1.0 / attn.head_dim)


@needs["esm"]
def test_esm_row_attention_zeroing_padded_queries_is_not_a_missing_scale():
    """catches: the in-place ``q *= 1 - padding_mask`` after ``q *= scaling`` hid the scale from the white box: a
    wrong scale was also reported as missing-scale under a mask, and the class itself must stay certified."""
    torch.manual_seed(0)
    good = check(_EsmRows())
    assert good.passed, [(f.id, f.message) for f in good.findings]
    bad = check(_EsmRowsOverD())
    assert bad.ids == {"wrong-scale"}, [(f.id, f.message) for f in bad.findings]


# -- rotary tables for one pairing, applied with another ------------------------------------------------------------
class _FluxStyleRotary(nn.Module):
    """Flux-style attention: q/k RMS-normed per head, 1-D rotary positions as cos/sin tables laid out for
    interleaved pairs (``repeat_interleave``), applied with diffusers' ``apply_rotary_emb``. ``k_pairing`` -1
    applies the tables to k as to q; -2 reads k's pairs as halves (``use_real_unbind_dim=-2``), a layout the
    tables were not made for."""

    def __init__(self, dim: int = 64, heads: int = 4, k_pairing: int = -1) -> None:
        super().__init__()
        self.heads, self.k_pairing = heads, k_pairing
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = nn.RMSNorm(dim // heads), nn.RMSNorm(dim // heads)
        self.to_out = nn.Linear(dim, dim)

    def tables(self, n: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angle = torch.arange(n, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
        return angle.cos().repeat_interleave(2, -1).to(dtype), angle.sin().repeat_interleave(2, -1).to(dtype)

    def forward(self, x):
        from diffusers.models.embeddings import apply_rotary_emb

        _, n, e = x.shape
        q, k, v = (f(x).unflatten(-1, (self.heads, -1)) for f in (self.to_q, self.to_k, self.to_v))
        q, k = self.norm_q(q), self.norm_k(k)
        rope = self.tables(n, e // self.heads, x.dtype)
        q = apply_rotary_emb(q, rope, sequence_dim=1)
        k = apply_rotary_emb(k, rope, use_real_unbind_dim=self.k_pairing, sequence_dim=1)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return self.to_out(out.transpose(1, 2).flatten(2))


@needs["diffusers"]
def test_rotary_tables_of_another_pairing_on_k_are_a_mismatch_not_one_side():
    """catches: k rotated with cos/sin laid out for another pairing named rotary-one-side (no rotary on k),
    sending the user to add a rotation that is there."""
    torch.manual_seed(0)
    good = check(_FluxStyleRotary())
    assert good.passed, [(f.id, f.message) for f in good.findings]
    bad = check(_FluxStyleRotary(k_pairing=-2))
    assert bad.ids == {"rotary-mismatch"}, [(f.id, f.message) for f in bad.findings]


# -- an additive mask subtracted ---------------------------------------------------------------------------------
class EagerMaskSubtracted(nn.Module):
    """open_clip's eager path style: a bool attn_mask (True = may attend) turned into 0 / -inf, then (the bug)
    subtracted from the scores instead of added: the masked keys get +inf."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        b, n, e = x.shape
        q, k, v = self.in_proj(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * (e // self.heads) ** -0.5
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
            scores = scores - attn_mask
        return self.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_an_additive_mask_subtracted_is_inverted_not_ignored():
    """catches: the mask's sign flipped named mask-ignored, because the module also takes bool masks, which it
    turns into -inf and then gives NaN: a bool reading that blows up does not make the additive reading doubtful."""
    torch.manual_seed(0)
    report = check(EagerMaskSubtracted())
    assert "mask-inverted" in report.ids and "mask-ignored" not in report.ids, \
        [(f.id, f.message) for f in report.findings]


# -- global tokens computed by an attention of their own -----------------------------------------------------------
class GlobalAndLocal(nn.Module):
    """Longformer style: every token attends within a band of +-2 and to the first ``globals_`` tokens, with one set
    of projections; the global tokens' own rows are computed over every key with a second set (query_global,
    key_global, value_global) and replace the band's rows. attention_mask (B, L): 1 = token, 0 = padding."""

    def __init__(self, dim: int = 64, heads: int = 4, globals_: int = 1) -> None:
        super().__init__()
        self.heads, self.globals_ = heads, globals_
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.query_global, self.key_global, self.value_global = (nn.Linear(dim, dim) for _ in range(3))
        self.output = nn.Linear(dim, dim)

    def split(self, t):
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, hidden_states, attention_mask=None):
        b, n, e = hidden_states.shape
        pad = torch.zeros(b, n, dtype=torch.bool) if attention_mask is None else attention_mask == 0
        d = e // self.heads
        i = torch.arange(n)
        seen = ((i[:, None] - i[None, :]).abs() <= 2) | (i[None, :] < self.globals_)
        low = torch.finfo(hidden_states.dtype).min
        q, k, v = (self.split(f(hidden_states)) for f in (self.query, self.key, self.value))
        s = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~seen, low).masked_fill(pad[:, None, None], low)
        out = s.softmax(-1) @ v
        qg, kg, vg = (self.split(f(hidden_states)) for f in (self.query_global, self.key_global, self.value_global))
        sg = (qg[:, :, : self.globals_] @ kg.transpose(-1, -2) / math.sqrt(d)).masked_fill(pad[:, None, None], low)
        out = torch.cat([sg.softmax(-1) @ vg, out[:, :, self.globals_:]], dim=2)
        return self.output(out.transpose(1, 2).reshape(b, n, e))


def test_global_tokens_computed_by_a_second_attention_are_a_design():
    """catches: the band attention's rows of the global tokens, which the module replaces by a second attention's
    over every key, read as causal-leak; and an attention over no queries (no global tokens) read as a head split."""
    torch.manual_seed(0)
    report = check(GlobalAndLocal())
    assert report.passed, [(f.id, f.message) for f in report.findings]
    assert "queries apart" in report.inferred["design"]
    none = check(GlobalAndLocal(globals_=0))  # the global projections are then unused: no-grad, and only that
    assert none.ids == {"no-grad"}, [(f.id, f.message) for f in none.findings]
    two = check(GlobalAndLocal(globals_=2))  # their rows joined before the heads are merged: no head-merge
    assert two.passed, [(f.id, f.message) for f in two.findings]


# -- fairseq: keys joined with a learned or zero key ---------------------------------------------------------------
class SeqFirstExtraKey(nn.Module):
    """fairseq MultiheadAttention style, (L, B, E) in and out: q scaled in place, keys and values joined with a
    learned bias_k / bias_v (or a zero key and value, ``add_zero_attn``) along the sequence, heads folded into the
    batch for ``bmm``, a (B, L) key_padding_mask True = padding and an (L, L) additive attn_mask, each widened by
    one column for the extra key.
    ``scale_k`` also scales the tokens' keys (a second scale: 1/D in all); ``widen`` False forgets to widen the
    padding mask, so that every call with one raises."""

    def __init__(self, embed_dim: int = 64, heads: int = 4, zero_attn: bool = False, scale_k: bool = False,
                 widen: bool = True) -> None:
        super().__init__()
        self.heads, self.zero_attn, self.scale_k, self.widen = heads, zero_attn, scale_k, widen
        self.scaling = (embed_dim // heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        self.bias_k = None if zero_attn else nn.Parameter(0.1 * torch.randn(1, 1, embed_dim))
        self.bias_v = None if zero_attn else nn.Parameter(0.1 * torch.randn(1, 1, embed_dim))

    def forward(self, query, key_padding_mask=None, attn_mask=None):
        n, b, e = query.shape
        q, k, v = self.q_proj(query), self.k_proj(query), self.v_proj(query)
        q *= self.scaling
        if self.scale_k:
            k = k * self.scaling
        if self.bias_k is not None:
            k, v = torch.cat([k, self.bias_k.repeat(1, b, 1)]), torch.cat([v, self.bias_v.repeat(1, b, 1)])
        q, k, v = (t.contiguous().view(t.shape[0], b * self.heads, -1).transpose(0, 1) for t in (q, k, v))
        if self.zero_attn:
            k, v = torch.cat([k, k.new_zeros(k.shape[0], 1, k.shape[2])], 1), \
                torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[2])], 1)
        if key_padding_mask is not None and self.widen:
            key_padding_mask = torch.cat([key_padding_mask, key_padding_mask.new_zeros(b, 1)], 1)
        weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:  # (L, L) additive, and 0 for the extra key
            weights = weights + torch.cat([attn_mask, attn_mask.new_zeros(n, 1)], 1)[None]
        if key_padding_mask is not None:
            weights = weights.view(b, self.heads, n, -1).masked_fill(key_padding_mask[:, None, None].bool(),
                                                                     float("-inf")).view(b * self.heads, n, -1)
        out = torch.bmm(F.softmax(weights, dim=-1, dtype=torch.float32).type_as(weights), v)
        return self.out_proj(out.transpose(0, 1).contiguous().view(n, b, e))


@pytest.mark.parametrize("zero_attn", [False, True], ids=["bias_kv", "zero_attn"])
def test_a_second_scale_on_keys_joined_with_an_extra_key_is_named(zero_attn):
    """catches: k scaled as well as q (1/D in all) certified when the keys were then joined with bias_k or a zero
    key: the walk back from the joined keys stopped at the cat and found no scale on them."""
    torch.manual_seed(0)
    good = check(SeqFirstExtraKey(zero_attn=zero_attn))
    assert good.passed, [(f.id, f.message) for f in good.findings]
    bad = check(SeqFirstExtraKey(zero_attn=zero_attn, scale_k=True))
    assert bad.ids == {"wrong-scale"}, [(f.id, f.message) for f in bad.findings]


def test_a_padding_mask_that_always_raises_is_not_certified_through_another_argument():
    """catches: a key_padding_mask that raises on every call (not widened for the zero key) certified, the doctor
    having read no padding at all: the padding is now not verified, and the report says which argument raised."""
    torch.manual_seed(0)
    report = check(SeqFirstExtraKey(zero_attn=True, widen=False))
    assert report.verdict == "inconclusive" and "key_padding_mask raised" in report.coverage["padding"], \
        (report.verdict, report.coverage, [(f.id, f.message) for f in report.findings])


# -- a module's own default mask read the other way round ----------------------------------------------------------
class DefaultMaskInverted(nn.Module):
    """BLOOM style, causal: attention_mask (B, L), 1 = token, all ones when not given; the padding is read as
    ``attention_mask.bool()`` instead of ``~attention_mask.bool()`` and joined to the causal mask (True = hidden)."""

    def __init__(self, dim: int = 64, heads: int = 4, fill: float | None = None) -> None:
        super().__init__()
        self.heads, self.fill = heads, fill  # None: finfo.min
        self.query_key_value = nn.Linear(dim, 3 * dim)
        self.dense = nn.Linear(dim, dim)

    def forward(self, hidden_states, attention_mask=None):
        b, n, e = hidden_states.shape
        if attention_mask is None:
            attention_mask = torch.ones(b, n, dtype=torch.long)
        hidden = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None] | attention_mask[:, None, None].bool()
        q, k, v = self.query_key_value(hidden_states).view(b, n, self.heads, 3, -1).unbind(3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        fill = torch.finfo(q.dtype).min if self.fill is None else self.fill
        scores = (q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)).masked_fill(hidden, fill)
        return self.dense((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("fill", [None, float("-inf")], ids=["finfo-min", "-inf"])
def test_a_default_mask_read_the_other_way_round_is_named(fill):
    """catches: a padding mask read inverted, which hides every key when no mask is given, reported only by its
    symptoms (causal-leak, no-grad, and with -inf non-finite) and never as mask-inverted."""
    torch.manual_seed(0)
    report = check(DefaultMaskInverted(fill=fill), causal=True)
    assert "mask-inverted" in report.ids, [(f.id, f.message) for f in report.findings]


# -- T5's bias table looked up by absolute positions ---------------------------------------------------------------
class BucketBias(nn.Module):
    """T5 style: no 1/sqrt(D) (folded into T5's initialisation), a learned bias per head from
    ``nn.Embedding(32, heads)`` looked up by bidirectional log buckets of j - i. ``relative`` False drops the
    query's position (``memory_position`` alone): every row reads the buckets of the key's absolute position."""

    def __init__(self, dim: int = 64, heads: int = 4, relative: bool = True) -> None:
        super().__init__()
        self.heads, self.relative = heads, relative
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.relative_attention_bias = nn.Embedding(32, heads)

    @staticmethod
    def bucket(distance: torch.Tensor, buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
        half = buckets // 2
        out = (distance > 0).long() * half
        n = distance.abs()
        exact = half // 2
        far = exact + (torch.log(n.float().clamp_min(1) / exact) / math.log(max_distance / exact) *
                       (half - exact)).long().clamp(max=half - 1)
        return out + torch.where(n < exact, n, far)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        memory, context = torch.arange(n)[None, :], torch.arange(n)[:, None]
        distance = memory - context if self.relative else memory.expand(n, n)
        bias = self.relative_attention_bias(self.bucket(distance)).permute(2, 0, 1)[None]
        weights = (q @ k.transpose(-1, -2) + bias).softmax(-1)
        return self.o((weights @ v).transpose(1, 2).reshape(b, n, e))


def test_t5_buckets_of_absolute_positions_are_not_read_as_t5s_unscaled_design():
    """catches: a T5 bias looked up by the key's absolute position named missing-scale (the module was then
    compared with T5's unscaled design, which needs buckets of j - i): the position term is what is wrong; and
    certified when the user states T5's scale of 1 (the lookup was only read on the way to a missing scale)."""
    torch.manual_seed(0)
    good = check(BucketBias())
    assert good.passed, [(f.id, f.message) for f in good.findings]
    assert check(BucketBias(), scale=1.0).passed
    for scale in (None, 1.0):
        bad = check(BucketBias(relative=False), scale=scale)
        assert bad.ids == {"definition-mismatch"} and "distance" in bad.findings[0].message, \
            (scale, [(f.id, f.message) for f in bad.findings])


# -- projections held as clones in a ModuleList ------------------------------------------------------------------------
class ClonedProjections(nn.Module):
    """The Annotated Transformer's MultiHeadedAttention: four copies of one Linear in an nn.ModuleList (q, k, v, out),
    named by their place only; ``value_from`` picks the copy the values are computed with (2; 1 is the bug: the
    key projection reused for the values, ``linears[2]`` never used)."""

    def __init__(self, d_model: int = 64, h: int = 4, value_from: int = 2) -> None:
        super().__init__()
        self.h, self.d_k, self.value_from = h, d_model // h, value_from
        self.linears = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(4)])

    def forward(self, query, key, value, mask=None):
        n = query.size(0)
        q, k = (self.linears[i](x).view(n, -1, self.h, self.d_k).transpose(1, 2) for i, x in enumerate((query, key)))
        v = self.linears[self.value_from](value).view(n, -1, self.h, self.d_k).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1) == 0, torch.finfo(scores.dtype).min)
        x = (scores.softmax(-1) @ v).transpose(1, 2).contiguous().view(n, -1, self.h * self.d_k)
        return self.linears[-1](x)


def test_a_cloned_projection_never_used_is_no_grad():
    """catches: the value projection of clones(nn.Linear, 4) never used (the key copy computes the values)
    certified: only projections named for their role (k_proj, to_v) were held to being used."""
    torch.manual_seed(0)
    good = check(ClonedProjections())
    assert good.passed, [(f.id, f.message) for f in good.findings]
    bad = check(ClonedProjections(value_from=1))
    assert "no-grad" in bad.ids and "linears.2" in str(bad.findings), [(f.id, f.message) for f in bad.findings]


# -- a convolution before patch attention ----------------------------------------------------------------------------
class ConvPatchAttention(nn.Module):
    """MobileViT style block on a (B, C, H, W) map: a 3 x 3 conv, then the map unfolded into 2 x 2 patches, each of
    the 4 in-patch positions attending over the patches (tokens at the same place of every patch), folded back, a
    1 x 1 conv and the input joined by a last conv. ``scale_width`` scales by 1/sqrt(C) (a bug)."""

    def __init__(self, channels: int = 64, heads: int = 4, scale_width: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (channels if scale_width else channels // heads) ** -0.5
        self.local = nn.Conv2d(channels, channels, 3, padding=1)
        self.qkv = nn.Linear(channels, 3 * channels, bias=False)
        self.out = nn.Linear(channels, channels)
        self.proj = nn.Conv2d(channels, channels, 1)
        self.fuse = nn.Conv2d(2 * channels, channels, 3, padding=1)

    def forward(self, x):
        b, c, h, w = x.shape
        y = self.local(x)
        patches = y.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 2, 4, 1).reshape(b, 4, -1, c)
        q, k, v = self.qkv(patches).unflatten(-1, (3, self.heads, -1)).permute(3, 0, 1, 4, 2, 5)
        o = ((q @ k.transpose(-1, -2) * self.scale).softmax(-1) @ v).transpose(-3, -2).flatten(-2)
        o = self.out(o).reshape(b, 2, 2, h // 2, w // 2, c).permute(0, 5, 3, 1, 4, 2).reshape(b, c, h, w)
        return self.fuse(torch.cat([self.proj(o), x], 1))


def test_patch_attention_behind_a_convolution_is_read_as_windows():
    """catches: MobileViT's attention over the patches read as a head split (weights over 4 patches, not the 16
    tokens) because the convolution before it makes every output depend on its neighbours, so the run's pattern
    showed no windows; a wrong scale inside is still named."""
    torch.manual_seed(0)
    good = check(ConvPatchAttention())
    assert "definition-mismatch" not in good.ids and not any(f.severity == "error" for f in good.findings), \
        [(f.id, f.message) for f in good.findings]
    bad = check(ConvPatchAttention(scale_width=True))
    assert "wrong-scale" in bad.ids, [(f.id, f.message) for f in bad.findings]


# -- a required padding argument: the module's own error is what the report shows --------------------------------------
class RequiredValidLens(nn.Module):
    """d2l style: forward(queries, keys, values, valid_lens) with valid_lens required, heads folded into the batch
    (transpose_qkv); the keys transposed whole (``keys.T`` on a 3-D tensor: every dim reversed), so that it runs
    only where batch x heads, the head dim and the length coincide, at no size the doctor tries."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def fold(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3).reshape(b * self.heads, n, -1)

    def forward(self, queries, keys, values, valid_lens):
        q, k, v = self.fold(self.W_q(queries)), self.fold(self.W_k(keys)), self.fold(self.W_v(values))
        scores = torch.bmm(q, k.permute(2, 1, 0)) / math.sqrt(q.shape[-1])
        lens = valid_lens.repeat_interleave(self.heads)
        hidden = torch.arange(scores.shape[-1])[None, None, :] >= lens.reshape(-1, 1, 1)
        out = torch.bmm(scores.masked_fill(hidden, -1e6).softmax(-1), v)
        b = queries.shape[0]
        return self.W_o(out.reshape(b, self.heads, -1, out.shape[-1]).permute(0, 2, 1, 3).flatten(2))


def test_the_module_s_own_error_is_shown_when_a_required_mask_is_given():
    """catches: a module that fails inside with its required valid_lens reported as "missing 1 required positional
    argument: 'valid_lens'", the error of a call without it, which blames the user's call."""
    from selfattn.check import CannotRun

    with pytest.raises(CannotRun, match=r"valid_lens=\.\.\.\): RuntimeError"):
        check(RequiredValidLens())


# -- windows of 7 on a grid they do not divide; neighbourhoods; grids the module lays out itself --------------------
@needs["torchvision"]
def test_windows_of_seven_are_probed_on_a_grid_they_tile():
    """catches: a 4 x 4 grid grown to 8 x 8 for windows of 7 holds padded windows the run's pattern does not show,
    read as a head split: the grid is grown to twice the window's side instead (14 x 14)."""
    import timm.models.swin_transformer as swin

    torch.manual_seed(0)
    block = swin.SwinTransformerBlock(64, input_resolution=(8, 8), num_heads=4, window_size=7, shift_size=3,
                                      dynamic_mask=True, always_partition=True)
    report = check(block)
    assert report.passed, [(f.id, f.message) for f in report.findings]
    assert report.inferred["probe shape"][1] == 196


class Neighbourhood(nn.Module):
    """NAT style on a (B, H, W, E) map: each query attends to the k x k neighbourhood around it, moved inwards at
    the borders so that it always holds k x k keys (a border query then sees keys that do not see it)."""

    def __init__(self, dim: int = 64, heads: int = 4, k: int = 3) -> None:
        super().__init__()
        self.heads, self.k = heads, k
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, h, w, e = x.shape
        q, k, v = self.qkv(x).view(b, h * w, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        rows, cols = torch.arange(h), torch.arange(w)
        top, left = (rows - self.k // 2).clamp(0, h - self.k), (cols - self.k // 2).clamp(0, w - self.k)
        in_rows = (rows[None] >= top[:, None]) & (rows[None] < top[:, None] + self.k)
        in_cols = (cols[None] >= left[:, None]) & (cols[None] < left[:, None] + self.k)
        seen = (in_rows[:, None, :, None] & in_cols[None, :, None, :]).reshape(h * w, h * w)
        scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~seen, float("-inf"))
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, h, w, e))


def test_neighbourhood_attention_is_a_design():
    """catches: NAT's neighbourhoods, asymmetric at the borders, read as a mask built wrong (definition-mismatch)."""
    torch.manual_seed(0)
    report = check(Neighbourhood())
    assert report.passed and "neighbourhood" in report.inferred["window"], [(f.id, f.message) for f in report.findings]


class SquareWindows(nn.Module):
    """(B, L, E) in and out; the module lays the tokens out on a sqrt(L) x sqrt(L) grid itself and attends within
    4 x 4 windows. ``permute`` False cuts the windows with a reshape alone (the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, permute: bool = True) -> None:
        super().__init__()
        self.heads, self.permute = heads, permute
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        side = math.isqrt(n)
        assert side * side == n and side % 4 == 0, "a square grid of 4 x 4 windows"
        grid = x.view(b, side // 4, 4, side // 4, 4, e)
        cut = (grid.permute(0, 1, 3, 2, 4, 5) if self.permute else grid).reshape(-1, 16, e)
        q, k, v = self.qkv(cut).view(-1, 16, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        o = self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, 16, e))
        return o.view(b, side // 4, side // 4, 4, 4, e).permute(0, 1, 3, 2, 4, 5).reshape(b, n, e)


def test_a_module_that_lays_out_its_own_grid_is_probed_past_one_window():
    """catches: a (B, L, E) module that runs only on a square grid was probed at 16 tokens, one window, where a
    partition without its permute cannot show."""
    torch.manual_seed(0)
    assert check(SquareWindows()).passed
    bad = check(SquareWindows(permute=False))
    assert not bad.passed and bad.inferred["probe shape"][1] == 64, [(f.id, f.message) for f in bad.findings]


# -- q and k normalised by hand --------------------------------------------------------------------------------------
class HandCosine(nn.Module):
    """Cosine attention with a learned temperature per head, q and k normalised by hand: ``t / t.norm(dim=axis)``
    or ``t * rsqrt(t.pow(2).sum(axis))``. axis -1 (the features) is right; -2 (the tokens) is the bug."""

    def __init__(self, dim: int = 64, heads: int = 4, axis: int = -1, rsqrt: bool = False) -> None:
        super().__init__()
        self.heads, self.axis, self.rsqrt = heads, axis, rsqrt
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.full((heads, 1, 1), 2.0))

    def unit(self, t, axis):
        return t * torch.rsqrt(t.pow(2).sum(axis, keepdim=True)) if self.rsqrt else t / t.norm(dim=axis, keepdim=True)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, -1))
        sim = self.unit(q, self.axis) @ self.unit(k, -1).transpose(-1, -2) * self.logit_scale.exp()
        return self.to_out((sim.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("rsqrt", [False, True], ids=["norm", "rsqrt"])
def test_q_normalised_by_hand_over_the_tokens_is_named(rsqrt):
    """catches: q / q.norm(dim=-2) (or an rsqrt of the squares summed over the tokens) certified as cosine attention:
    only F.normalize and the norm layers were followed."""
    torch.manual_seed(0)
    assert check(HandCosine(rsqrt=rsqrt)).passed
    bad = check(HandCosine(axis=-2, rsqrt=rsqrt))
    assert bad.ids == {"definition-mismatch"} and "tokens" in bad.findings[0].message, bad.findings


# -- a padding mask read True = padding, padded rows zeroed ------------------------------------------------------
class PaddedRowsZeroed(nn.Module):
    """key_padding_mask (B, L) True = padding, padded keys hidden with -inf, and the padded positions' own outputs
    set to 0 after the output projection (x-transformers zeroes them)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, key_padding_mask=None):
        b, n, e = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if key_padding_mask is not None:
            s = s.masked_fill(key_padding_mask[:, None, None], float("-inf"))
        out = self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))
        return out if key_padding_mask is None else out * (~key_padding_mask)[..., None].to(out.dtype)


def test_a_padding_mask_that_zeroes_padded_rows_is_read_true_as_padding():
    """catches: mask-ignored on a module that reads True = padding and zeroes the padded rows: the rows a reading
    leaves out were those of the keep reading only."""
    torch.manual_seed(0)
    report = check(PaddedRowsZeroed())
    assert "mask-ignored" not in report.ids and report.inferred["mask"]["kind"] == "ignore", \
        [(f.id, f.message) for f in report.findings]


# -- a class token with an attention of its own ---------------------------------------------------------------------
class OwnClassQuery(nn.Module):
    """The class token (first) queries every token with a projection of its own; the other tokens attend among
    themselves with SDPA. ``width_scale`` scales the class query's scores by 1/sqrt(E) (a bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, width_scale: bool = False) -> None:
        super().__init__()
        self.heads, self.width_scale = heads, width_scale
        self.qkv, self.cls_q, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        patches = F.scaled_dot_product_attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:])
        qc = self.cls_q(x[:, :1]).view(b, 1, self.heads, -1).transpose(1, 2)
        sc = qc @ k.transpose(-1, -2) * (e if self.width_scale else e // self.heads) ** -0.5
        out = torch.cat([sc.softmax(-1) @ v, patches], 2)
        return self.proj(out.transpose(1, 2).reshape(b, n, e))


def test_a_class_token_with_its_own_attention_is_a_design():
    """catches: definition-mismatch on a class token that reads every token while the others attend among
    themselves (SDPA over L - 1 tokens read as a head split); a wrong scale in its attention is still named."""
    torch.manual_seed(0)
    good = check(OwnClassQuery())
    assert good.passed, [(f.id, f.message) for f in good.findings]
    assert "read-out" in good.inferred["window"]
    assert check(OwnClassQuery(width_scale=True)).ids == {"wrong-scale"}


# -- a second padding argument ----------------------------------------------------------------------------------------
class MaskThenPadding(nn.Module):
    """forward(x, mask=None, padding_mask=None): mask (B, L, L) bool True = may attend, applied; padding_mask (B, L)
    True = padding, applied when ``apply_padding``, or accepted and dropped (the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, apply_padding: bool = True) -> None:
        super().__init__()
        self.heads, self.apply_padding = heads, apply_padding
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask=None, padding_mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if mask is not None:
            s = s.masked_fill(~mask[:, None], torch.finfo(s.dtype).min)
        if padding_mask is not None and self.apply_padding:
            s = s.masked_fill(padding_mask[:, None, None], torch.finfo(s.dtype).min)
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_a_padding_argument_after_a_working_mask_is_probed_too():
    """catches: a padding_mask after a working mask argument never tried, so that one the module accepts and never
    applies was certified, as was one that only zeroes the padded rows' outputs (its keys still seen)."""
    torch.manual_seed(0)
    good = check(MaskThenPadding())
    assert good.passed, [(f.id, f.message) for f in good.findings]
    bad = check(MaskThenPadding(apply_padding=False))
    assert bad.ids == {"mask-ignored"} and "padding_mask" in bad.findings[0].message, bad.findings

    class RowsZeroedOnly(MaskThenPadding):
        def forward(self, x, mask=None, padding_mask=None):
            out = super().forward(x, mask)
            return out if padding_mask is None else out.masked_fill(padding_mask[..., None], 0.0)

    zeroed = check(RowsZeroedOnly())
    assert zeroed.ids == {"mask-ignored"} and "padding_mask" in zeroed.findings[0].message, zeroed.findings


# -- MaxViT's (B, G, P, E) partitions --------------------------------------------------------------------------------
@needs["torchvision"]
def test_attention_over_groups_of_tokens_is_called_with_one_group():
    """catches: torchvision's MaxViT attention, which takes (B, G, P, E) with P fixed by its relative table (49 in
    maxvit_t), could not run: no layout sent 49 tokens on dim 2 (as an image, 7 x 7 went to G and P)."""
    from torchvision.models.maxvit import RelativePositionalMultiHeadAttention

    torch.manual_seed(0)
    report = check(RelativePositionalMultiHeadAttention(64, 16, 49))
    assert report.inferred["layout"].startswith("grouped") and report.ids == {"wrong-scale"}, \
        [(f.id, f.message) for f in report.findings]


# -- a square-only module whose first length that runs is a head count -------------------------------------------------
@needs["torchvision"]
def test_a_module_on_a_square_grid_is_not_a_coincidence_of_sizes():
    """catches: timm's Twins global sub-sampled attention, given (B, L, E) and laying the tokens on a square grid
    itself, read as shape-dependent: at width 32 no default length is a square, the first length it ran at was 4,
    the head count, and squares were not tried."""
    from timm.models.twins import GlobalSubSampleAttn

    class OnASquare(nn.Module):
        def __init__(self, dim: int = 32) -> None:
            super().__init__()
            self.attn = GlobalSubSampleAttn(dim, num_heads=4, sr_ratio=2)

        def forward(self, x):
            side = math.isqrt(x.shape[1])
            assert side * side == x.shape[1], "a square grid of tokens"
            return self.attn(x, (side, side))

    torch.manual_seed(0)
    report = check(OnASquare())
    assert report.passed, [(f.id, f.message) for f in report.findings]


# -- cosine attention normalised over the tokens in a (B, L, H, D) einsum layout -------------------------------------
class EinsumCosine(nn.Module):
    """q and k as (B, L, H, D), normalised by hand over ``axis`` (3: the features; 1: the tokens, the bug), scores by
    einsum "bihd,bjhd->bhij" times a learned temperature per head."""

    def __init__(self, dim: int = 64, heads: int = 4, axis: int = 3) -> None:
        super().__init__()
        self.heads, self.axis = heads, axis
        self.to_q, self.to_kv, self.to_out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.log_t = nn.Parameter(torch.full((heads, 1, 1), math.log(10.0)))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1)
        k, v = self.to_kv(x).view(b, n, 2, self.heads, -1).unbind(2)
        q, k = (t / t.norm(dim=self.axis, keepdim=True) for t in (q, k))
        sim = torch.einsum("bihd,bjhd->bhij", q, k) * self.log_t.exp()
        return self.to_out(torch.einsum("bhij,bjhd->bihd", sim.softmax(-1), v).reshape(b, n, -1))


def test_cosine_attention_over_the_tokens_of_an_einsum_layout_is_named():
    """catches: q / q.norm(dim=1) on (B, L, H, D) certified: the tokens were taken to be the operand's second to
    last axis (the heads there)."""
    torch.manual_seed(0)
    assert check(EinsumCosine()).passed
    assert check(EinsumCosine(axis=1)).ids == {"definition-mismatch"}


# -- CaiT's class attention written as two softmax attentions ----------------------------------------------------------
class ClassAttentionApart(nn.Module):
    """The patches (all tokens but the first) attend among themselves; the class token queries every token with
    projections of its own; both softmax(q k^T / sqrt(D)) v by hand. ``class_dim`` is the class scores' softmax
    dim (-1; -2, over its single query, is the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, class_dim: int = -1) -> None:
        super().__init__()
        self.heads, self.class_dim = heads, class_dim
        self.qkv, self.cls_q, self.cls_kv = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def split(self, t):
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (self.split(t) for t in self.qkv(x[:, 1:]).chunk(3, -1))
        patches = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v
        qc = self.split(self.cls_q(x[:, :1]))
        kc, vc = (self.split(t) for t in self.cls_kv(x).chunk(2, -1))
        cls = (qc @ kc.transpose(-1, -2) * qc.shape[-1] ** -0.5).softmax(self.class_dim) @ vc
        return self.proj(torch.cat([cls, patches], 2).transpose(1, 2).reshape(b, n, e))


def test_class_attention_written_apart_is_a_design():
    """catches: the patches' attention over L - 1 tokens read as a head split when written as a softmax by hand
    (only SDPA's was read as the tokens apart from a read-out one); the class softmax over its query is named."""
    torch.manual_seed(0)
    good = check(ClassAttentionApart())
    assert good.passed, [(f.id, f.message) for f in good.findings]
    assert "softmax-dim" in check(ClassAttentionApart(class_dim=-2)).ids


# -- attn_mask that replaces the causal pattern, beside key_padding_mask ---------------------------------------------
class CausalWithPadding(nn.Module):
    """torch's conventions: causal unless attn_mask (bool, True = masked) replaces the pattern; key_padding_mask
    (B, L) True = padding, hidden on top of either. ``apply_padding`` False only zeroes the padded rows (the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, apply_padding: bool = True) -> None:
        super().__init__()
        self.heads, self.apply_padding = heads, apply_padding
        self.in_proj, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None, key_padding_mask=None):
        b, n, e = x.shape
        q, k, v = self.in_proj(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        hidden = torch.ones(n, n, dtype=torch.bool).triu(1) if attn_mask is None else attn_mask
        if key_padding_mask is not None and self.apply_padding:
            hidden = hidden | key_padding_mask[:, None, None, :]
        s = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(hidden, torch.finfo(q.dtype).min)
        out = self.out_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))
        return out if key_padding_mask is None else out.masked_fill(key_padding_mask[..., None], 0.0)


def test_the_padding_argument_is_preferred_to_a_mask_that_replaces_the_causal_pattern():
    """catches: causal-leak on a causal module whose attn_mask replaces its causal pattern (as torch's layers do)
    when the padding went through attn_mask instead of key_padding_mask; a key_padding_mask that only zeroes the
    padded rows, its keys still seen, is named (it hides query rows instead of keys)."""
    torch.manual_seed(0)
    good = check(CausalWithPadding(), causal=True)
    assert good.passed and good.inferred["mask"]["argument"] == "key_padding_mask", \
        [(f.id, f.message) for f in good.findings]
    bad = check(CausalWithPadding(apply_padding=False), causal=True)
    assert bad.ids & {"mask-ignored", "mask-broadcast"}, [(f.id, f.message) for f in bad.findings]

"""The doctor on attention as recent research code and inference repositories write it.

Each module is written in the style of the code it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from selfattn.check import check_model


# -- a model whose layers take an additive bias and a mask, the model passing only the bias -----------------------
class BiasOrMaskAttention(nn.Module):
    """Llama-style attention taking ``attn_bias`` and ``mask`` (each added to the scores when given)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, attn_bias=None, mask=None):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if attn_bias is not None:
            scores = scores + attn_bias
        if mask is not None:
            scores = scores + mask
        out = scores.float().softmax(-1).type_as(q) @ v
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class BiasedLM(nn.Module):
    """Token ids and an attention_mask; causal and padding joined into one bias in the model's dtype."""

    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(BiasOrMaskAttention(dim) for _ in range(2))

    def forward(self, tokens, attention_mask):
        h = self.embed(tokens)
        t = tokens.shape[1]
        keep = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        bias = torch.zeros(keep.shape, dtype=h.dtype).masked_fill(~keep, torch.finfo(h.dtype).min)
        for layer in self.layers:
            h = h + layer(h, attn_bias=bias)
        return h


def test_the_doctors_mask_beside_a_models_bias_does_not_overflow_half_precision():
    # the doctor's mask goes to `mask` while the model's bias stays in `attn_bias`: in float16 the two fills add up
    # to -inf on left-padded rows the model never reads (half-precision-overflow on a correct model)
    tokens = torch.randint(1, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(tokens)
    attention_mask[1, :3] = 0
    attention_mask[2, :5] = 0
    report = check_model(BiasedLM(), {"tokens": tokens, "attention_mask": attention_mask}, causal=True)
    assert report.verdict == "passed", report.summary()


# -- a KV cache kept as a list of (keys, values) pairs appended to (minGPT generation forks) ----------------------
class PairListCachedAttention(nn.Module):
    """Causal attention whose cache is ``self.past``, a list of each call's (keys, values) so far."""

    def __init__(self, dim: int = 32, heads: int = 4, slip: str | None = None) -> None:
        super().__init__()
        self.heads, self.slip = heads, slip
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.past: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.past:
            pk, pv = self.past[-1]
            axis = 1 if self.slip == "grown on the heads" else 2
            k, v = torch.cat([pk, k], axis), torch.cat([pv, v], axis)
        self.past.append((k, v))
        if self.slip == "never read":
            k, v = k[:, :, -t:], v[:, :, -t:]
        seen = torch.arange(k.shape[2])[None, :] <= torch.arange(t)[:, None] + k.shape[2] - t
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        return self.wo(out.transpose(1, 2).reshape(b, t, e))


def test_a_cache_kept_as_a_list_of_key_value_pairs_is_continued():
    # the pairs were no state the doctor put back or followed: keys never read, or grown on the heads' axis, passed
    from selfattn.check import check
    assert check(PairListCachedAttention(), causal=True).verdict == "passed"
    for slip in ("never read", "grown on the heads"):
        report = check(PairListCachedAttention(slip=slip), causal=True)
        assert "state-dependent" in report.ids, (slip, report.ids)


# -- a model handing its layers the padding as a column (B, 1, L, 1), which each layer turns into a row ------------
class ColumnMaskedAttention(nn.Module):
    """Takes ``mask`` (B, 1, L, 1), 1.0 = token, and lays it on the keys with a transpose (``turned``) or not."""

    def __init__(self, dim: int = 32, heads: int = 4, turned: bool = True) -> None:
        super().__init__()
        self.heads, self.turned = heads, turned
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)
        if mask is not None:
            keys = mask.transpose(-1, -2) if self.turned else mask
            scores = scores.masked_fill(keys == 0, torch.finfo(scores.dtype).min)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, e))


class ColumnMaskedEncoder(nn.Module):
    def __init__(self, turned: bool = True, vocab: int = 40, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.layers = nn.ModuleList(ColumnMaskedAttention(dim, turned=turned) for _ in range(2))

    def forward(self, ids):
        h = self.embed(ids)
        column = ids.ne(0)[:, None, :, None].to(h.dtype)
        for layer in self.layers:
            h = h + layer(h, mask=column)
        return h


def test_a_models_padding_column_that_its_layers_turn_into_a_row_is_their_mask():
    # the layer alone reads a (B, 1, 1, L) mask transposed, onto its queries: mask-broadcast on a correct model
    ids = torch.randint(1, 40, (3, 10), generator=torch.Generator().manual_seed(7))
    ids[1, 7:] = 0
    ids[2, 5:] = 0
    report = check_model(ColumnMaskedEncoder(), (ids,))
    assert report.verdict == "passed", report.summary()
    report = check_model(ColumnMaskedEncoder(turned=False), (ids,))
    assert all("mask-broadcast" in r.ids for r in report.layers.values()), report.summary()


# -- projections wrapped by a LoRA adapter, in peft's layout (the frozen layer kept as ``base_layer``) -------------
class LoraLinear(nn.Module):
    """A low-rank adapter around a frozen Linear: base_layer(x) + B(A(x)) * scaling, as peft's ``lora.Linear``."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features, bias=False)})
        nn.init.normal_(self.lora_B["default"].weight, std=0.2)
        self.scaling = 2.0

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x)) * self.scaling


class LoraAttention(nn.Module):
    """Attention whose q and v projections carry LoRA adapters; ``k_from_q``: keys from the query projection."""

    def __init__(self, dim: int = 32, heads: int = 4, k_from_q: bool = False) -> None:
        super().__init__()
        self.heads, self.k_from_q = heads, k_from_q
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.q_proj, self.v_proj = LoraLinear(self.q_proj), LoraLinear(self.v_proj)
        self.k_proj.requires_grad_(False)
        self.o_proj.requires_grad_(False)

    def forward(self, x):
        b, t, e = x.shape
        k = self.q_proj(x) if self.k_from_q else self.k_proj(x)
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (self.q_proj(x), k, self.v_proj(x)))
        out = (q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)).softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, e))


def test_an_unused_projection_beside_lora_wrapped_ones_is_named():
    # the frozen base layers and the wrapper's own path hid the group: k = q_proj(x) passed under LoRA
    from selfattn.check import check
    assert check(LoraAttention()).verdict == "passed"
    report = check(LoraAttention(k_from_q=True))
    assert "no-grad" in report.ids, report.ids


# -- SDPA's is_causal and a padding mask, which it takes one or the other of --------------------------------------
class PaddedCausalSDPA(nn.Module):
    """Causal self-attention through SDPA with a (B, L) key mask, True = attend; ``folded``: the causal pattern joined
    into the mask when one is given, else dropped (``is_causal=mask is None``)."""

    def __init__(self, dim: int = 32, heads: int = 4, folded: bool = True) -> None:
        super().__init__()
        self.heads, self.folded = heads, folded
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = None if attn_mask is None else attn_mask[:, None, None, :]
        if mask is not None and self.folded:
            mask = mask & torch.ones(t, t, dtype=torch.bool).tril()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(out.transpose(1, 2).reshape(b, t, e))


def test_causality_dropped_whenever_a_mask_is_given_is_a_causal_leak():
    # with the mask's convention stated, the white box read the later keys left visible as padding ignored
    from selfattn.check import check
    assert check(PaddedCausalSDPA(), causal=True, mask_convention="keep").verdict == "passed"
    report = check(PaddedCausalSDPA(folded=False), causal=True, mask_convention="keep")
    assert report.ids == {"causal-leak"}, report.ids


# -- a model's additive bias subtracted by its layers --------------------------------------------------------------
class SubtractedBiasAttention(BiasOrMaskAttention):
    """As :class:`BiasOrMaskAttention`, with ``attn_bias`` subtracted from the scores."""

    def forward(self, x, attn_bias=None, mask=None):
        return super().forward(x, None if attn_bias is None else -attn_bias, mask)


class SubtractedBiasLM(BiasedLM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SubtractedBiasAttention(32) for _ in range(2))


def test_a_models_bias_subtracted_by_its_layers_is_an_inverted_mask():
    # the padding carried in attn_bias left each real token only the padded keys: mask-ignored, and a wrong-gradient
    # of the real keys' scores rounded away under the fill
    tokens = torch.randint(1, 50, (3, 9), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(tokens)
    attention_mask[1, 6:] = 0
    attention_mask[2, 4:] = 0
    report = check_model(SubtractedBiasLM(), {"tokens": tokens, "attention_mask": attention_mask})
    for layer in report.layers.values():
        assert "mask-inverted" in layer.ids and not {"mask-ignored", "wrong-gradient"} & layer.ids, report.summary()


# -- criss-cross attention (CCNet): one softmax over a pixel's column and row, each part with its own values -------
class CrissCrossAttention(nn.Module):
    """Each pixel of a (B, C, H, W) map attends to the pixels of its column and its row (itself counted once), with
    the values products computed channels first, as bmm(V (N, C, H), A^T)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.q, self.k = nn.Conv2d(dim, dim // 8, 1), nn.Conv2d(dim, dim // 8, 1)
        self.v = nn.Conv2d(dim, dim, 1)
        self.gamma = nn.Parameter(torch.ones(1))

    def forward(self, x):
        b, _, h, w = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        q_col = q.permute(0, 3, 2, 1).reshape(b * w, h, -1)  # (B * W, H, C'): the pixels of each column
        k_col = k.permute(0, 3, 1, 2).reshape(b * w, -1, h)
        v_col = v.permute(0, 3, 1, 2).reshape(b * w, -1, h)
        q_row = q.permute(0, 2, 3, 1).reshape(b * h, w, -1)  # (B * H, W, C'): the pixels of each row
        k_row = k.permute(0, 2, 1, 3).reshape(b * h, -1, w)
        v_row = v.permute(0, 2, 1, 3).reshape(b * h, -1, w)
        self_once = torch.diag(torch.full((h,), float("-inf"))).to(x)  # the pixel itself is in its row already
        e_col = (torch.bmm(q_col, k_col) + self_once).view(b, w, h, h).permute(0, 2, 1, 3)  # (B, H, W, H)
        e_row = torch.bmm(q_row, k_row).view(b, h, w, w)  # (B, H, W, W)
        a = torch.cat([e_col, e_row], -1).softmax(-1)
        a_col = a[..., :h].permute(0, 2, 1, 3).reshape(b * w, h, h)
        a_row = a[..., h:].reshape(b * h, w, w)
        out_col = torch.bmm(v_col, a_col.transpose(1, 2)).view(b, w, -1, h).permute(0, 2, 3, 1)
        out_row = torch.bmm(v_row, a_row.transpose(1, 2)).view(b, h, -1, w).permute(0, 2, 1, 3)
        return self.gamma * (out_col + out_row) + x


def test_criss_cross_attention_is_not_read_as_values_times_weights():
    # its values products take a part of the softmax's output each: read as V @ weights (matmul-order)
    from selfattn.check import check
    report = check(CrissCrossAttention(), scale=1.0)
    assert "matmul-order" not in report.ids, report.ids


# -- a fused projection unpacked key first (ALiBi and nanoGPT re-implementations) ---------------------------------
class KeyFirstFusedAttention(nn.Module):
    """``key, query, value = self.kqv(x).chunk(3, dim=-1)``, then softmax(q k^T / sqrt(d)) v."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.kqv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, e = x.shape
        key, query, value = self.kqv(x).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (query, key, value))
        out = (q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, e))


def test_a_fused_projection_unpacked_key_first_is_read_in_its_order():
    # the first of three parts was taken for the queries whatever the source called it: softmax-dim on correct code
    from selfattn.check import check
    assert check(KeyFirstFusedAttention()).verdict == "passed"


# -- the queries' rows of a fused projection initialised at 0 (modded-nanogpt) ------------------------------------
class ZeroQueryAttention(nn.Module):
    """A fused c_attn whose query rows start at 0: every score is 0 until training moves them."""

    def __init__(self, dim: int = 32, heads: int = 4, scale: float | None = None) -> None:
        super().__init__()
        self.heads, self.scale = heads, scale
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        with torch.no_grad():
            self.c_attn.weight[:dim].zero_()

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.c_attn(x).split(e, dim=2))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, e))


def test_scores_zero_at_every_scale_leave_the_white_box_unverified():
    # q = 0 makes every scale alike: scale=1.0 passed as 1/sqrt(d) after the input was scaled 2.7e4 times
    from selfattn.check import check
    report = check(ZeroQueryAttention(scale=1.0), causal=True)
    assert report.verdict == "inconclusive" and report.coverage["white_box"].startswith("not verified"), report.ids


# -- a hook on the attention map, as relevance-propagation code registers it --------------------------------------
class HookedMapAttention(nn.Module):
    """ViT attention that saves its attention map's gradient with ``attn.register_hook`` (explainability code)."""

    def __init__(self, dim: int = 32, heads: int = 4, scaled: bool = True) -> None:
        super().__init__()
        self.heads, self.scaled = heads, scaled
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_gradients: torch.Tensor | None = None

    def save_attn_gradients(self, grad: torch.Tensor) -> None:
        self.attn_gradients = grad

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scale = (c // self.heads) ** -0.5 if self.scaled else 1.0
        attn = (q @ k.transpose(-2, -1) * scale).softmax(dim=-1)
        attn.register_hook(self.save_attn_gradients)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


def test_a_module_that_needs_autograd_on_is_checked():
    # the hook raises without gradients, and the doctor's calls run without them: exit 2 on a module a plain call runs
    from selfattn.check import check
    assert check(HookedMapAttention()).verdict == "passed"
    assert "missing-scale" in check(HookedMapAttention(scaled=False)).ids


# -- attention on a map with its values product written channels first (EDM's U-Net blocks) ----------------------
class ChannelsFirstProductAttention(nn.Module):
    """q, k, v (B * H, C / H, L) from a 1 x 1 convolution; weights "ncq,nck->nqk" and values "nqk,nck->ncq", put back
    with a reshape to the map's shape; ``tokens_first``: the values product written "nqk,nck->nqc" and put back the
    same way (the tokens spread over the channels)."""

    def __init__(self, dim: int = 64, heads: int = 4, tokens_first: bool = False) -> None:
        super().__init__()
        self.heads, self.tokens_first = heads, tokens_first
        self.qkv, self.proj = nn.Conv2d(dim, 3 * dim, 1), nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).reshape(x.shape[0] * self.heads, x.shape[1] // self.heads, 3, -1).unbind(2)
        w = torch.einsum("ncq,nck->nqk", q, k / math.sqrt(k.shape[1])).softmax(dim=2)
        a = torch.einsum("nqk,nck->nqc" if self.tokens_first else "nqk,nck->ncq", w, v)
        return self.proj(a.reshape(*x.shape)) + x


def test_a_values_product_written_channels_first_is_merged_as_such():
    # its (B * H, D, L) output was read as (B * H, L, D): head-merge on the correct module
    from selfattn.check import check
    assert check(ChannelsFirstProductAttention()).verdict == "passed"
    assert "head-merge" in check(ChannelsFirstProductAttention(tokens_first=True)).ids


# -- a sequence-first module with a bug that mixes its items (fairseq's MultiheadAttention style) ------------------
class TimeFirstAttention(nn.Module):
    """Takes (T, B, C), unpacks ``tgt_len, bsz, embed_dim = query.size()``, attends over (B * H, T, D) with bmm;
    ``slip``: "merge" (the heads put back with a view, no transpose), "softmax" (over the B * H axis)."""

    def __init__(self, dim: int = 32, heads: int = 4, slip: str | None = None) -> None:
        super().__init__()
        self.heads, self.head_dim, self.slip = heads, dim // heads, slip
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, query):
        tgt_len, bsz, embed_dim = query.size()
        q, k, v = (p(query).contiguous().view(tgt_len, bsz * self.heads, self.head_dim).transpose(0, 1)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        weights = torch.bmm(q * self.head_dim ** -0.5, k.transpose(1, 2))
        weights = weights.softmax(dim=0 if self.slip == "softmax" else -1)
        attn = torch.bmm(weights, v)
        if self.slip == "merge":
            attn = attn.contiguous().view(tgt_len, bsz, embed_dim)
        else:
            attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


def test_a_sequence_first_module_mixing_its_items_is_read_in_its_own_layout():
    # mixing along both axes, it was probed batch first: batch-mixing where its own bug has an id
    from selfattn.check import check
    assert check(TimeFirstAttention()).verdict == "passed"
    assert "head-merge" in check(TimeFirstAttention(slip="merge")).ids
    assert "softmax-dim" in check(TimeFirstAttention(slip="softmax")).ids


# -- an output projection skipped beside LoRA-wrapped projections, or kept in an output block of its own ------------
class LoraSkippedOutput(LoraAttention):
    """As :class:`LoraAttention`, returning the heads without ``o_proj``."""

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (self.q_proj(x), self.k_proj(x),
                                                                          self.v_proj(x)))
        out = (q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)).softmax(-1) @ v
        return out.transpose(1, 2).reshape(b, t, e)


class SelfPart(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        out = (q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)).softmax(-1) @ v
        return out.transpose(1, 2).reshape(b, t, e)


class OutputPart(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(dim, dim), nn.LayerNorm(dim)

    def forward(self, hidden, residual):
        return self.LayerNorm(self.dense(hidden) + residual)


class SplitBlockAttention(nn.Module):
    """BERT's layout: ``self`` (query, key, value) and ``output`` (dense, LayerNorm); ``skip``: dense not applied."""

    def __init__(self, dim: int = 32, heads: int = 4, skip: bool = False) -> None:
        super().__init__()
        self.self, self.output, self.skip = SelfPart(dim, heads), OutputPart(dim), skip

    def forward(self, x):
        h = self.self(x)
        return self.output.LayerNorm(h + x) if self.skip else self.output(h, x)


def test_an_output_projection_skipped_beside_lora_or_in_an_output_block_is_named():
    # LoRA's wrappers and frozen layers, or an output block of its own, hid the skipped projection: certified
    from selfattn.check import check
    assert "no-grad" in check(LoraSkippedOutput()).ids
    assert check(SplitBlockAttention()).verdict == "passed"
    assert "no-grad" in check(SplitBlockAttention(skip=True)).ids


# -- a square map's side taken as sqrt(L) in floating point (SAM 2's axial rotary) --------------------------------
class FloatSideMapAttention(nn.Module):
    """Attention over the tokens of a square map whose side is ``math.sqrt(L)``: the positions ``arange(side * side)``
    must be L of them, which they are at squares and, by rounding, at a few other lengths (6, 12)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        side = math.sqrt(n)
        assert torch.arange(side * side).numel() == n
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = (q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def test_a_square_maps_module_running_at_a_few_other_lengths_by_rounding_is_probed_at_a_square():
    # it runs at 6 and 12 tokens and fails at 5 and 7: probed at 6 tokens, a map's positions that are no grid (SAM 2's
    # rotary then made a correct module shape-dependent)
    from selfattn.check import check
    report = check(FloatSideMapAttention())
    n = report.inferred["probe shape"][1]
    assert report.verdict == "passed" and math.isqrt(n) ** 2 == n, (report.ids, report.inferred["lengths"])


# -- a softmax written through its log: exp(s - logsumexp(s)) -------------------------------------------------------
class LogNormalisedAttention(nn.Module):
    """Causal attention whose weights are ``exp(s - torch.logsumexp(s, dim, keepdim=True))``; ``dim`` -2 normalises
    over the queries."""

    def __init__(self, dim: int = 32, heads: int = 4, over: int = -1) -> None:
        super().__init__()
        self.heads, self.over = heads, over
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.to_qkv(x).reshape(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        s = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        i = torch.arange(t)
        s = s.masked_fill(i[None, :] > i[:, None], torch.finfo(s.dtype).min)
        p = torch.exp(s - torch.logsumexp(s, dim=self.over, keepdim=True))
        return self.to_out(torch.einsum("bhij,bhjd->bhid", p, v).transpose(1, 2).reshape(b, t, e))


def test_a_softmax_written_through_its_log_is_read_as_one():
    # over the queries in a causal module it was causal-leak, its white box seeing no softmax
    from selfattn.check import check
    assert check(LogNormalisedAttention(), causal=True).verdict == "passed"
    assert check(LogNormalisedAttention(over=-2), causal=True).ids == {"softmax-dim"}


# -- per-head maps of one head's width, the model's width kept as self.d (ViT-from-scratch tutorials) --------------
class PerHeadMapsAttention(nn.Module):
    """Each head's slice of the tokens gets its own q, k and v maps of d_head -> d_head."""

    def __init__(self, d: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.d, self.n_heads, self.d_head = d, n_heads, d // n_heads
        self.q_mappings, self.k_mappings, self.v_mappings = (
            nn.ModuleList(nn.Linear(self.d_head, self.d_head) for _ in range(n_heads)) for _ in range(3))

    def forward(self, sequences):
        out = []
        for h in range(self.n_heads):
            seq = sequences[:, :, h * self.d_head:(h + 1) * self.d_head]
            q, k, v = self.q_mappings[h](seq), self.k_mappings[h](seq), self.v_mappings[h](seq)
            out.append((q @ k.transpose(-1, -2) / self.d_head ** 0.5).softmax(-1) @ v)
        return torch.cat(out, -1)


def test_a_width_kept_as_d_beside_per_head_maps_is_tried():
    # the first Linear's input is one head's width: probed at it only, exit 2 on a module a plain call runs
    from selfattn.check import check
    assert check(PerHeadMapsAttention()).verdict == "passed"


class KeyFirstCore(nn.Module):
    """guided-diffusion's QKVAttention with its packed projection unpacked key first, channels first."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, qkv):
        bs, width, length = qkv.shape
        ch = width // (3 * self.heads)
        k, q, v = qkv.reshape(bs * self.heads, ch * 3, length).split(ch, dim=1)
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale).softmax(dim=-1)
        return torch.einsum("bts,bcs->bct", weight, v).reshape(bs, -1, length)


class KeyFirstBlock(nn.Module):
    """The block around it: a group norm, a 1-d convolution makes the packed projection, another maps the heads
    back."""

    def __init__(self, channels: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, channels)
        self.qkv, self.attention = nn.Conv1d(channels, 3 * channels, 1), KeyFirstCore(heads)
        self.proj_out = nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        b, c, *spatial = x.shape
        h = self.attention(self.qkv(self.norm(x.reshape(b, c, -1))))
        return (x.reshape(b, c, -1) + self.proj_out(h)).reshape(b, c, *spatial)


def test_a_packed_projection_unpacked_key_first_by_a_core_is_read_in_its_order():
    # the unpacking is in the core's forward, not the block's: softmax-dim on correct code
    from selfattn.check import check
    assert check(KeyFirstBlock()).verdict == "passed"


class PaddedTimeFirstAttention(TimeFirstAttention):
    """:class:`TimeFirstAttention` with fairseq's ``key_padding_mask`` (B, T), True = padding."""

    def forward(self, query, key_padding_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q, k, v = (p(query).contiguous().view(tgt_len, bsz * self.heads, self.head_dim).transpose(0, 1)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        weights = torch.bmm(q * self.head_dim ** -0.5, k.transpose(1, 2))
        if key_padding_mask is not None:
            weights = weights.view(bsz, self.heads, tgt_len, -1).masked_fill(
                key_padding_mask[:, None, None, :], float("-inf")).view(bsz * self.heads, tgt_len, -1)
        attn = torch.bmm(weights.softmax(dim=-1), v)
        if self.slip == "merge":
            attn = attn.contiguous().view(tgt_len, bsz, embed_dim)
        else:
            attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class PaddedTimeFirstEncoder(nn.Module):
    def __init__(self, slip: str | None = None, vocab: int = 40, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=1)
        self.layers = nn.ModuleList(PaddedTimeFirstAttention(dim, slip=slip) for _ in range(2))

    def forward(self, src_tokens):
        pad = src_tokens.eq(1)
        x = self.embed(src_tokens).transpose(0, 1)
        for layer in self.layers:
            x = x + layer(x, key_padding_mask=pad)
        return x.transpose(0, 1)


def test_a_layer_mixing_tokens_on_its_own_is_not_also_reading_its_mask_inverted():
    # the merge without the transpose lets the padding reach real tokens: mask-inverted beside the head-merge
    tokens = torch.randint(2, 40, (3, 9), generator=torch.Generator().manual_seed(3))
    tokens[1, 6:] = 1
    tokens[2, 4:] = 1
    assert check_model(PaddedTimeFirstEncoder(), (tokens,)).verdict == "passed"
    report = check_model(PaddedTimeFirstEncoder(slip="merge"), (tokens,))
    for layer in report.layers.values():
        assert "head-merge" in layer.ids and "mask-inverted" not in layer.ids, report.summary()


# -- a packed projection unpacked key first by indexing (Swin's qkv[0], qkv[1], qkv[2]) ------------------------------
class IndexedKeyFirstAttention(KeyFirstFusedAttention):
    def forward(self, x):
        b, n, c = x.shape
        kqv = self.kqv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        k, q, v = kqv[0], kqv[1], kqv[2]
        out = (q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def test_a_packed_projection_unpacked_key_first_by_indexing_is_read_in_its_order():
    # only chunk, split and unbind were read as an unpacking: softmax-dim on correct code
    from selfattn.check import check
    assert check(IndexedKeyFirstAttention()).verdict == "passed"


# -- a causal switch beside a padding column, both passed by the model --------------------------------------------
class SwitchedColumnAttention(ColumnMaskedAttention):
    """:class:`ColumnMaskedAttention` with a ``causal`` switch the model turns on."""

    def forward(self, x, mask=None, causal=False):
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)
        if mask is not None:
            scores = scores.masked_fill(mask.transpose(-1, -2) == 0, torch.finfo(scores.dtype).min)
        if causal:
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), torch.finfo(scores.dtype).min)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, e))


class SwitchedColumnLM(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.layers = nn.ModuleList(SwitchedColumnAttention(dim) for _ in range(2))

    def forward(self, ids):
        h = self.embed(ids)
        column = ids.ne(0)[:, None, :, None].to(h.dtype)
        for layer in self.layers:
            h = h + layer(h, mask=column, causal=True)
        return h


def test_a_causal_switch_beside_a_padding_column_stays_on():
    # the column was taken for a mask that carries the whole pattern, and the model's switch was turned off:
    # causal-leak on a correct model
    ids = torch.randint(1, 40, (3, 10), generator=torch.Generator().manual_seed(7))
    ids[1, 7:] = 0
    ids[2, 5:] = 0
    report = check_model(SwitchedColumnLM(), (ids,), causal=True)
    assert report.verdict == "passed", report.summary()


# -- a window whose token count equals the head dim (Swin's 4 x 4 window at head dim 16) ---------------------------
class SmallWindowAttention(nn.Module):
    """Attention within one window of window_size[0] x window_size[1] tokens, with a relative position bias table."""

    def __init__(self, dim: int = 64, window_size: tuple[int, int] = (4, 4), num_heads: int = 4) -> None:
        super().__init__()
        self.window_size, self.num_heads = window_size, num_heads
        wh, ww = window_size
        self.relative_position_bias_table = nn.Parameter(0.02 * torch.randn((2 * wh - 1) * (2 * ww - 1), num_heads))
        coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + torch.tensor([wh - 1, ww - 1])
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * ww - 1) + rel[..., 1], persistent=False)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = q * (c // self.num_heads) ** -0.5 @ k.transpose(-2, -1) + bias.permute(2, 0, 1)
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def test_a_windows_token_count_equal_to_the_head_dim_is_its_length():
    # it runs only at 16 tokens, also the head dim: read as sizes matching by accident (shape-dependent)
    from selfattn.check import check
    assert check(SmallWindowAttention()).verdict == "passed"


class PairBiasAtHeadDim(nn.Module):
    """A learned (H, L, L) score bias over a fixed 16 tokens, added without slicing; the head dim is 16 too."""

    def __init__(self, dim=32, heads=2, length=16):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.pair_bias = nn.Parameter(torch.randn(heads, length, length) * 0.1)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads) + self.pair_bias
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


class QueriesTransposedAtHeadDim(nn.Module):
    """q^T k: (d, d) scores that multiply V only when the length equals the head dim."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = q.transpose(-2, -1) @ k / math.sqrt(c // self.heads)
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def test_a_table_over_token_pairs_at_the_head_dim_fixes_the_length():
    # it ran only at 16 tokens, also the head dim, and was read as sizes matching by accident (shape-dependent)
    # although its (H, 16, 16) bias says the length; a product that needs L = d is still that
    from selfattn.check import check
    report = check(PairBiasAtHeadDim())
    assert report.verdict == "passed", report.ids
    assert "pair_bias" in report.inferred["length"]
    assert "shape-dependent" in check(QueriesTransposedAtHeadDim()).ids


class IndexedKeyFirstOverQueries(KeyFirstFusedAttention):
    """Unpacked key first by indexing, with the softmax over the queries."""

    def forward(self, x):
        b, n, c = x.shape
        kqv = self.kqv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        k, q, v = kqv[0], kqv[1], kqv[2]
        out = (q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5).softmax(-2) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def test_a_softmax_over_the_queries_beside_key_first_unpacking_is_softmax_dim():
    # the projections were read q first whatever the source said, and with q and k swapped a softmax over the queries
    # is the weights transposed: matmul-order, whose fix sends the user to the wrong line
    from selfattn.check import check
    assert check(IndexedKeyFirstOverQueries()).ids == {"softmax-dim"}


# -- Transformer-XL memory in a model's own object, attention sequence first over [memory; tokens] ------------------
class SegmentMemory:
    """Each layer's hidden states of the last segment (M, B, E), kept in a plain object the model replaces."""

    def __init__(self, layers: int, length: int, batch: int, dim: int) -> None:
        self.states = torch.zeros(layers, length, batch, dim)

    def update(self, hidden: list[torch.Tensor]) -> None:
        with torch.no_grad():
            joined = torch.cat([self.states, torch.stack(hidden)], dim=1)
            self.states = joined[:, -self.states.shape[1]:].detach()


def _rel_shift(x: torch.Tensor) -> torch.Tensor:
    """Transformer-XL's shift of a (query, key, ...) position term: row i moved right by its distance to the last."""
    zero = x.new_zeros((x.size(0), 1, *x.shape[2:]))
    padded = torch.cat([zero, x], dim=1).view(x.size(1) + 1, x.size(0), *x.shape[2:])
    return padded[1:].view_as(x)


class XLSegmentAttention(nn.Module):
    """(L, B, E) queries over [memory; tokens], content and position terms with u and v, scores as "ijbh"."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.kv, self.r, self.out = (nn.Linear(dim, dim), nn.Linear(dim, 2 * dim),
                                             nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, memory, pos_emb, u, v, mask):
        cur, b = x.shape[:2]
        full = self.norm(torch.cat([memory, x], dim=0))
        n = full.shape[0]
        q = self.q(x).view(cur, b, self.heads, self.head_dim)
        key, value = (t.view(n, b, self.heads, self.head_dim) for t in self.kv(full).chunk(2, dim=-1))
        r = self.r(pos_emb).view(n, self.heads, self.head_dim)
        scores = torch.einsum("ibhd,jbhd->ijbh", q + u, key) + \
            _rel_shift(torch.einsum("ibhd,jhd->ijbh", q + v, r))
        scores = (scores / math.sqrt(self.head_dim)).masked_fill(mask[..., None], float("-inf"))
        out = torch.einsum("ijbh,jbhd->ibhd", scores.softmax(dim=1), value)
        return self.out(out.reshape(cur, b, -1))


class XLSegmentModel(nn.Module):
    """Features (L, B, F) in; the memory object made on the first call and replaced on every call."""

    def __init__(self, features: int = 6, dim: int = 32, layers: int = 2, memory: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.layers = nn.ModuleList(XLSegmentAttention(dim) for _ in range(layers))
        self.u, self.v = nn.Parameter(0.1 * torch.randn(4, dim // 4)), nn.Parameter(0.1 * torch.randn(4, dim // 4))
        self.dim, self.memory_length, self.memory = dim, memory, None
        self.register_buffer("inv_freq", 1 / 10000 ** (torch.arange(0.0, dim, 2.0) / dim))

    def forward(self, x):
        cur, b = x.shape[:2]
        if self.memory is None:
            self.memory = SegmentMemory(len(self.layers), self.memory_length, b, self.dim)
        n = cur + self.memory_length
        mask = torch.ones(cur, n).triu(1 + self.memory_length).bool()[..., None]  # (L, M + L, 1)
        angles = torch.outer(torch.arange(n - 1, -1, -1.0), self.inv_freq)
        pos_emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
        h, hidden = self.embed(x), []
        for layer, memory in zip(self.layers, self.memory.states, strict=True):
            hidden.append(h)
            h = h + layer(h, memory, pos_emb, self.u, self.v, mask)
        self.memory.update(hidden)
        return h


def test_a_model_replacing_its_memory_on_every_call_meets_each_run_as_given():
    # the memory the first run left made the second run differ on every item: the model read as batch first, and
    # the "ijbh" scores over [memory; tokens] as a softmax over the wrong dim (softmax-dim on correct layers)
    torch.manual_seed(0)
    model = XLSegmentModel().eval()
    report = check_model(model, torch.randn(5, 2, 6))
    assert model.memory is None  # handed back as it was given
    assert report.verdict != "failed", report.summary()
    for name, layer in report.layers.items():
        assert not layer.findings, (name, layer.ids)
        assert "matches the definition" in str(layer.inferred["white box"]), layer.inferred["white box"]


# -- a packed projection unpacked key first by a helper, a function of the file, or in one branch of several -------
def split_key_first(kqv: torch.Tensor, heads: int) -> list[torch.Tensor]:
    key, query, value = kqv.chunk(3, dim=-1)
    return [t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (query, key, value)]


class KeyFirstByFunction(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.kqv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = split_key_first(self.kqv(x), self.heads)
        weights = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).flatten(2))


class PackedParts(nn.Module):
    """A helper that unpacks the packed projection in the order its flag says and hands back (q, k, v)."""

    def __init__(self, dim: int, heads: int, key_first: bool) -> None:
        super().__init__()
        self.heads, self.key_first, self.proj = heads, key_first, nn.Linear(dim, 3 * dim)

    def forward(self, x):
        parts = self.proj(x).chunk(3, dim=-1)
        if self.key_first:
            k, q, v = parts
        else:
            q, k, v = parts
        return tuple(t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))


class KeyFirstByHelper(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, key_first: bool = True, over_queries: bool = False) -> None:
        super().__init__()
        self.qkv, self.o, self.over_queries = PackedParts(dim, heads, key_first), nn.Linear(dim, dim), over_queries

    def forward(self, x):
        q, k, v = self.qkv(x)
        weights = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-2 if self.over_queries else -1)
        return self.o((weights @ v).transpose(1, 2).flatten(2))


def test_an_unpacking_in_a_helper_a_function_or_one_branch_is_read_where_it_runs():
    # the forward's own `q, k, v = self.qkv(x)` (a call's result, unpacked elsewhere), or the first of two branches,
    # was taken for the packed projection's order: softmax-dim on correct modules
    from selfattn.check import check
    assert check(KeyFirstByFunction()).verdict == "passed"
    for key_first in (True, False):
        assert check(KeyFirstByHelper(key_first=key_first)).verdict == "passed", key_first
        assert check(KeyFirstByHelper(key_first=key_first, over_queries=True)).ids == {"softmax-dim"}


# -- the Annotated Transformer's four clones, the last (the output projection) never applied ----------------------
class ClonedProjections(nn.Module):
    def __init__(self, h: int = 4, d_model: int = 32, apply_output: bool = True) -> None:
        super().__init__()
        self.h, self.d_k, self.apply_output = h, d_model // h, apply_output
        self.linears = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, query, key, value, mask=None):
        n = query.size(0)
        query, key, value = (lin(x).view(n, -1, self.h, self.d_k).transpose(1, 2)
                             for lin, x in zip(self.linears, (query, key, value), strict=False))
        scores = query @ key.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1) == 0, float("-inf"))
        x = (scores.softmax(dim=-1) @ value).transpose(1, 2).contiguous().view(n, -1, self.h * self.d_k)
        return self.linears[-1](x) if self.apply_output else x


def test_the_last_of_four_cloned_projections_never_applied_is_named():
    from selfattn.check import check
    assert check(ClonedProjections()).verdict == "passed"
    report = check(ClonedProjections(apply_output=False))
    assert {f.id for f in report.findings if f.severity == "error"} == {"no-grad"}, report.ids


# -- SAINT's attention between samples: the model's items folded into one sequence (1, B, n * d) --------------------
class RowAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.to_qkv, self.to_out = heads, nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        weights = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(dim=-1)
        return self.to_out((weights @ v).transpose(1, 2).flatten(2))


class BetweenSamples(nn.Module):
    def __init__(self, features: int = 5, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(1, dim)
        self.rows = RowAttention(features * dim)

    def forward(self, x):  # (B, features) numbers
        h = self.embed(x[..., None])  # (B, n, d)
        b, n, d = h.shape
        folded = h.reshape(1, b, n * d)  # every sample a token of one sequence
        return (folded + self.rows(folded)).reshape(b, n, d)


def test_a_model_folding_its_items_into_one_sequence_has_that_attention_checked():
    # the (1, B, n * d) states were read as one token of B items, sequence first: the attention between samples was
    # left unchecked ("called with one token"), and a model of that layer alone was inconclusive
    torch.manual_seed(0)
    report = check_model(BetweenSamples().eval(), torch.randn(6, 5))
    assert list(report.layers) == ["rows"] and report.verdict == "passed", report.summary()


# -- what users do to a module before they check it: compiled, scripted ---------------------------------------------
class NamedMaskAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attention_mask=None):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        return self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                         .transpose(1, 2).flatten(2))


def test_a_compiled_module_keeps_its_arguments_names():
    # torch.compile's wrapper takes *args, **kwargs: the mask argument, unnamed, read as no mask
    from selfattn.check.subject.caller import forward_signature
    compiled = torch.compile(NamedMaskAttention())
    assert list(forward_signature(compiled).parameters) == ["x", "attention_mask"]


class Scriptable(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(b, t, self.heads, e // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, e // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, e // self.heads).transpose(1, 2)
        weights = (q @ k.transpose(-2, -1) / math.sqrt(e // self.heads)).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, e))


def test_a_scripted_module_raises_nothing_inside_the_doctor():
    # the gradients probe asked a ScriptModule for get_submodule, which TorchScript does not have: a doctor error
    from selfattn.check import check
    report = check(torch.jit.script(Scriptable()))
    assert not report.doctor_errors, report.doctor_errors


# -- a Swin window whose relative index is sliced to the tokens it gets (monai's WindowAttention) ------------------
class SlicedWindowAttention(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, window_size: tuple[int, int] = (4, 4)) -> None:
        super().__init__()
        self.heads, self.window_size, self.scale = heads, window_size, (dim // heads) ** -0.5
        wh, ww = window_size
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * wh - 1) * (2 * ww - 1), heads))
        coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + torch.tensor([wh - 1, ww - 1])
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * ww - 1) + rel[..., 1])
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        index = self.relative_position_index[:n, :n].reshape(-1)  # runs at any n up to the window's tokens
        bias = self.relative_position_bias_table[index].reshape(n, n, -1).permute(2, 0, 1)
        attn = (attn + bias[None]).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


def test_a_window_that_runs_at_fewer_tokens_by_slicing_is_probed_at_its_window():
    # at 7 tokens of a 4 x 4 window a one-token shift crosses a row: a 2-D relative bias is not relative along one
    # axis, and the correct module was definition-mismatch until --length 16 (with no way out through check_model)
    from selfattn.check import check
    report = check(SlicedWindowAttention())
    assert report.verdict == "passed", report.ids
    assert report.inferred["probe shape"][1] == 16


# -- torch's MultiheadAttention held in half precision ---------------------------------------------------------------
class MHAWrapper(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x, key_padding_mask=None):
        return self.self_attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)[0]


class CausalMHAWrapper(MHAWrapper):
    def forward(self, x, key_padding_mask=None):
        future = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        return self.self_attn(x, x, x, attn_mask=future, key_padding_mask=key_padding_mask, need_weights=False)[0]


def test_a_causal_half_precision_mha_is_analysed_in_its_float64_copy():
    # its fast path took a (B, L, L) key_padding_mask the float64 copy's path refuses: "its float64 copy reads masks
    # differently", the white box ran in bfloat16, and its rounding missed the formula (definition-mismatch)
    from selfattn.check import check
    report = check(CausalMHAWrapper().to(torch.bfloat16))
    assert report.verdict == "passed", report.ids
    assert report.inferred["analysed in"] == "a float64 copy"


def test_a_half_precision_module_is_not_blamed_for_its_float32_nan_on_an_empty_sequence():
    # its fast path gives NaN on an item that is all padding in every dtype; the float64 reference, run another way,
    # did not: half-precision-overflow on a correct module held in float16
    from selfattn.check import check
    for dtype in (torch.float16, torch.bfloat16):
        report = check(MHAWrapper().to(dtype))
        assert report.verdict == "passed", (dtype, report.ids)


# -- LoFTR's full attention: "nlsh" scores, a query mask and a key mask, padded queries' rows NaN by design ---------
class QueryKeyMaskedAttention(nn.Module):
    """(N, L, H, D) queries, keys and values; both masks hide with -inf, so a padded query's row is NaN."""

    def forward(self, queries, keys, values, q_mask=None, kv_mask=None):
        scores = torch.einsum("nlhd,nshd->nlsh", queries, keys)
        if q_mask is not None and kv_mask is not None:
            scores = scores.masked_fill(~(q_mask[:, :, None, None] & kv_mask[:, None, :, None]), float("-inf"))
        weights = torch.softmax(scores / queries.size(3) ** 0.5, dim=2)
        return torch.einsum("nlsh,nshd->nlhd", weights, values)


class MatchingLayer(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.attention = heads, QueryKeyMaskedAttention()
        self.q, self.k, self.v, self.merge = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, source, x_mask=None, source_mask=None):
        n = x.shape[0]
        q, k, v = (p(t).view(n, -1, self.heads, x.shape[-1] // self.heads)
                   for p, t in ((self.q, x), (self.k, source), (self.v, source)))
        return x + self.merge(self.attention(q, k, v, x_mask, source_mask).reshape(n, -1, x.shape[-1]))


class Matcher(nn.Module):
    def __init__(self, both: bool = False) -> None:
        super().__init__()
        self.self_layer, self.cross_layer, self.both = MatchingLayer(), MatchingLayer(), both

    def forward(self, feat0, feat1, mask0, mask1):
        feat0 = self.self_layer(feat0, feat0, mask0, mask0)
        if self.both:  # LoFTR's order: each side through the self layer first, so the source's padded rows are NaN
            feat1 = self.self_layer(feat1, feat1, mask1, mask1)
        return self.cross_layer(feat0, feat1, mask0, mask1)


def test_nan_rows_of_queries_a_mask_hides_are_not_misread():
    # NaN rows made the einsum's weights unequal to the softmax's (softmax-dim on the correct module) and made the
    # cross layer's rows look dependent on the other tokens (read as self-attention: causal-leak, non-finite)
    from selfattn.check import check

    def both_masks(m, x, mask=None):
        heads = x.view(*x.shape[:2], 4, -1)
        keep = None if mask is None else mask.bool()
        return m(heads, heads, heads, q_mask=keep, kv_mask=keep).reshape(x.shape)

    report = check(QueryKeyMaskedAttention(), call=both_masks, mask="keep (B,L)")
    assert not [f for f in report.findings if f.severity == "error"], report.ids
    torch.manual_seed(0)
    mask0, mask1 = torch.ones(2, 12, dtype=torch.bool), torch.ones(2, 10, dtype=torch.bool)
    mask0[1, -3:], mask1[0, -2:] = False, False
    model = check_model(Matcher().eval(), (torch.randn(2, 12, 32), torch.randn(2, 10, 32), mask0, mask1))
    assert "cross_layer" in model.not_self_attention, (list(model.layers), model.not_self_attention)
    assert not any(f.severity == "error" for layer in model.layers.values() for f in layer.findings)
    # the source's NaN padded rows reach every row of one item (weights 0 times NaN values): that item's output all
    # NaN, the other's not, and the layer is still told for a cross-attention
    both = check_model(Matcher(both=True).eval(), (torch.randn(2, 12, 32), torch.randn(2, 10, 32), mask0, mask1))
    assert "cross_layer" in both.not_self_attention, (list(both.layers), both.not_self_attention)


# -- a model's padding given as `mask` (True = padding), its layers' wrapper dropping it ----------------------------
class PaddingWrapper(nn.Module):
    def __init__(self, drops: bool) -> None:
        super().__init__()
        self.self_attn, self.drops = nn.MultiheadAttention(32, 4, batch_first=True), drops

    def forward(self, x, key_padding_mask=None):
        given = None if self.drops else key_padding_mask
        return self.self_attn(x, x, x, key_padding_mask=given, need_weights=False)[0]


class PreNormStack(nn.Module):
    def __init__(self, drops: bool = False) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(32) for _ in range(2))
        self.layers = nn.ModuleList(PaddingWrapper(drops) for _ in range(2))

    def forward(self, x, mask=None):
        for norm, layer in zip(self.norms, self.layers, strict=True):
            x = x + layer(norm(x), key_padding_mask=mask)
        return x


def test_a_models_padding_under_a_name_with_no_polarity_is_read_and_judged():
    # `mask` True = padding was read 1 = token, which left no item a token: no padding known, and a wrapper that
    # drops the mask before its attention was certified
    torch.manual_seed(0)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    x = torch.randn(2, 7, 32)
    assert check_model(PreNormStack().eval(), (x, pad)).verdict == "passed"
    report = check_model(PreNormStack(drops=True).eval(), (x, pad))
    assert all("mask-ignored" in layer.ids for layer in report.layers.values()), report.summary()


# -- a layer that transposes its model's additive causal mask (it sees the future only) ------------------------------
class TransposedMaskAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attention_mask):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + attention_mask.transpose(-1, -2)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).flatten(2))


class TransposedMaskLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 32)
        self.layers = nn.ModuleList(TransposedMaskAttention() for _ in range(2))

    def forward(self, tokens):
        h, t = self.embed(tokens), tokens.shape[1]
        bias = torch.full((t, t), torch.finfo(h.dtype).min).triu(1)[None, None]
        for layer in self.layers:
            h = h + layer(h, bias)
        return h


def test_a_model_whose_attention_sees_the_future_only_is_not_read_sequence_first():
    # a change at token 0 reached row 0 alone, as an item's would in a sequence-first model: the model was read
    # (L, B), and its layers' causal leak was batch-mixing
    torch.manual_seed(0)
    report = check_model(TransposedMaskLM().eval(), torch.randint(0, 40, (2, 7)))
    for name, layer in report.layers.items():
        assert "causal-leak" in layer.ids and "batch-mixing" not in layer.ids, (name, layer.ids)


# -- BERT-pytorch's layout: q, k and v as three clones in a list, the output projection apart -----------------------
class ThreeClones(nn.Module):
    def __init__(self, h: int = 4, d_model: int = 32, apply_output: bool = True) -> None:
        super().__init__()
        self.h, self.d_k, self.apply_output = h, d_model // h, apply_output
        self.linear_layers = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(3))
        self.output_linear = nn.Linear(d_model, d_model)

    def forward(self, x):
        n = x.size(0)
        q, k, v = (lin(x).view(n, -1, self.h, self.d_k).transpose(1, 2) for lin in self.linear_layers)
        out = ((q @ k.transpose(-2, -1) / math.sqrt(self.d_k)).softmax(-1) @ v).transpose(1, 2).reshape(n, -1,
                                                                                                      self.h * self.d_k)
        return self.output_linear(out) if self.apply_output else out


def test_an_output_projection_apart_from_three_cloned_ones_never_applied_is_named():
    from selfattn.check import check
    assert check(ThreeClones()).verdict == "passed"
    assert check(ThreeClones(apply_output=False)).ids == {"no-grad"}


# -- a model taking its padding through **kwargs -------------------------------------------------------------------
class KeywordPaddingStack(PreNormStack):
    def forward(self, x, **inputs):
        return super().forward(x, inputs.get("mask"))


def test_a_models_padding_given_through_its_keyword_arguments_is_read():
    # forward(x, **inputs) bound the padding under "inputs": no padding known, a dropped mask certified
    torch.manual_seed(0)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    x = torch.randn(2, 7, 32)
    model = KeywordPaddingStack(drops=True).eval()
    report = check_model(model, {"x": x, "mask": pad})
    assert all("mask-ignored" in layer.ids for layer in report.layers.values()), report.summary()


# -- in-place layout and rotary, with q/k norms (the operands are read, not the projections' fit) -------------------
def _rotate_in_place(t, cos, sin, copy_halves=True):
    half = t.shape[-1] // 2
    a, b = (t[..., :half].clone(), t[..., half:].clone()) if copy_halves else (t[..., :half], t[..., half:])
    t[..., :half] = a * cos - b * sin
    t[..., half:] = b * cos + a * sin


class InPlaceNormedRotary(nn.Module):
    """Per-head q/k LayerNorm, rotary written into q and k in place, heads put back with ``y.transpose_(1, 2)``."""

    def __init__(self, dim=32, heads=2, copy_halves=True, transpose_back=True):
        super().__init__()
        self.heads, self.copy_halves, self.transpose_back = heads, copy_halves, transpose_back
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.q_norm, self.k_norm = nn.LayerNorm(dim // heads), nn.LayerNorm(dim // heads)

    def forward(self, x):
        b, t, c = x.shape
        d = c // self.heads
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        angles = torch.outer(torch.arange(t, dtype=x.dtype), 1e4 ** -(torch.arange(0, d, 2, dtype=x.dtype) / d))
        for z in (q, k):
            _rotate_in_place(z, angles.cos(), angles.sin(), self.copy_halves)
        q *= d ** -0.5
        scores = q @ k.transpose(-2, -1)
        scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu_(1), float("-inf"))
        y = scores.softmax(-1) @ v
        if self.transpose_back:
            y.transpose_(1, 2)
        return self.c_proj(y.reshape(b, t, c))


def test_heads_put_back_by_an_in_place_transpose_are_merged_right():
    # the merge read the tensor transpose_ was given, before it changed, as the one the reshape read: head-merge on a
    # correct module, and in place of the right id on a rotation that is none
    from selfattn.check import check
    assert check(InPlaceNormedRotary(), causal=True).verdict == "passed"
    assert check(InPlaceNormedRotary(copy_halves=False), causal=True).ids == {"rotary-mismatch"}
    assert check(InPlaceNormedRotary(transpose_back=False), causal=True).ids == {"head-merge"}


# -- a pattern of each head's own ------------------------------------------------------------------------------------
class HeadsOfTwoRanges(nn.Module):
    """Causal; the first half of the heads over every earlier token, the second over a window of the last two (or,
    ``dilated``, bidirectional heads each with a dilation of its own, as Longformer's multi-head dilation)."""

    def __init__(self, dim=32, heads=4, dilated=False, leak=False):
        super().__init__()
        self.heads, self.dilated, self.leak = heads, dilated, leak
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        if self.dilated:
            step = torch.tensor([1, 1, 2, 2])[:, None, None]
            visible = ((i - j).abs() % step == 0) & ((i - j).abs() <= 2 * step)
        else:
            earlier = j <= i + (1 if self.leak == "next" else 0)
            near = earlier & (i - j <= 1) & ((j != i) if self.leak == "own" else True)
            visible = torch.stack([earlier, earlier, near, near])
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=visible).transpose(1, 2).reshape(b, n, c))


def test_heads_that_each_see_part_of_the_keys_are_a_design():
    # the white box compared each head's pattern with what the heads see together: causal-leak on both
    from selfattn.check import check
    assert check(HeadsOfTwoRanges(), causal=True).verdict == "passed"
    assert check(HeadsOfTwoRanges(dilated=True)).verdict == "passed"
    assert "causal-leak" in check(HeadsOfTwoRanges(leak="next"), causal=True).ids
    # heads that see every key together, one of them not its own: a broken mask, not a pattern
    assert "causal-leak" in check(HeadsOfTwoRanges(leak="own"), causal=True).ids


# -- LightSANs style: keys pooled into a few interests, positions attended apart -------------------------------------
class InterestPooledAttention(nn.Module):
    """Keys and values pooled from the tokens into 3 interests by a softmax over the tokens (learned queries), and a
    second attention of positions to positions scaled 1/sqrt(2 D) * 1/sqrt(D) (decoupled positions)."""

    def __init__(self, dim=32, heads=4, length=8, interests=3, bug=None):
        super().__init__()
        self.heads, self.bug = heads, bug
        self.query, self.key, self.value, self.dense = (nn.Linear(dim, dim) for _ in range(4))
        self.theta_k = nn.Parameter(torch.randn(dim, interests))
        self.theta_v = nn.Parameter(torch.randn(dim, interests))
        self.pos = nn.Parameter(torch.randn(length, dim))
        self.pos_q, self.pos_k = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def _heads(self, t):
        return t.view(*t.shape[:-1], self.heads, -1).transpose(-3, -2)

    @staticmethod
    def _pooled(x, theta):
        weights = (x @ theta).softmax(dim=-2)  # (B, L, interests): over the tokens
        return torch.einsum("nij,nik->nkj", x, weights)  # (B, interests, E)

    def forward(self, x):
        b, n, c = x.shape
        d = c // self.heads
        q = self._heads(self.query(x))
        k, v = self._heads(self._pooled(self.key(x), self.theta_k)), self._heads(self._pooled(self.value(x),
                                                                                                self.theta_v))
        scale = 1.0 if self.bug == "missing-scale" else d ** -0.5
        content = (q @ k.transpose(-1, -2) * scale).softmax(-2 if self.bug == "softmax-dim" else -1) @ v
        pe = self.pos[:n]
        places = (self._heads(self.pos_q(pe)) * (2 * d) ** -0.5 @ self._heads(self.pos_k(pe)).transpose(-1, -2)
                  / math.sqrt(d)).softmax(-1)
        out = content + places @ self._heads(self.value(x))
        return self.dense(out.transpose(1, 2).reshape(b, n, c))


def test_tokens_pooled_into_interests_and_positional_attention_are_designs():
    # the pooling's softmax over the tokens was read as an attention with its softmax over the queries, and the
    # attention of positions to positions, scaled 1/sqrt(2 D) on purpose, as a wrong scale
    from selfattn.check import check
    assert check(InterestPooledAttention(), length=8).verdict == "passed"
    for bug in ("softmax-dim", "missing-scale"):
        assert check(InterestPooledAttention(bug=bug), length=8).ids == {bug}


class AdditiveGlobalAttention(nn.Module):
    """Fastformer (Wu et al. 2021): a global query pooled by a softmax over the tokens, multiplied into the keys,
    a global key pooled alike, multiplied into the values; no L x L weights."""

    def __init__(self, dim=32, heads=4, over_heads=False):
        super().__init__()
        self.heads, self.over = heads, -1 if over_heads else 1
        self.to_q, self.to_k, self.to_v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.score_q, self.score_k = nn.Linear(dim, heads), nn.Linear(dim, heads)

    def _pool(self, t, score):
        d = t.shape[-1] // self.heads
        alpha = (score(t) / math.sqrt(d)).softmax(dim=self.over)  # (B, L, H)
        pooled = torch.einsum("bsh,bshd->bhd", alpha, t.view(*t.shape[:2], self.heads, d))
        return pooled.reshape(t.shape[0], 1, -1)

    def forward(self, x):
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        p = k * self._pool(q, self.score_q)
        return q + self.out(v * self._pool(p, self.score_k))


def test_tokens_pooled_by_a_softmax_over_the_slots_is_softmax_dim():
    # pooling weights over (B, L, H) were read as attention over H reduced keys; a softmax over the tokens was
    # softmax-dim, and one over the heads matmul-order
    from selfattn.check import check
    assert check(AdditiveGlobalAttention(), allow_nonstandard=True).verdict == "passed"
    assert check(AdditiveGlobalAttention(over_heads=True), allow_nonstandard=True).ids == {"softmax-dim"}


class QueryAndPackedKeyValue(nn.Module):
    """A query projection beside keys and values packed in one (``kv_proj``), as tabular transformers write it."""

    def __init__(self, dim=32, heads=4, apply_output=True):
        super().__init__()
        self.heads, self.apply_output = heads, apply_output
        self.q_proj, self.kv_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (self.q_proj(x), k, v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        return self.out_proj(out) if self.apply_output else out


def test_an_output_projection_never_applied_beside_packed_keys_and_values_is_named():
    # the rule wants the q and k projections used; a packed kv_proj was read as no role, so the module passed
    from selfattn.check import check
    assert check(QueryAndPackedKeyValue()).verdict == "passed"
    assert check(QueryAndPackedKeyValue(apply_output=False)).ids == {"no-grad"}


class EncoderLayerTwoMasks(nn.Module):
    """DETR-style encoder layer around nn.MultiheadAttention, taking src_mask and src_key_padding_mask."""

    def __init__(self, dim=32, heads=4, invert_padding=False):
        super().__init__()
        self.invert_padding = invert_padding
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        if self.invert_padding and src_key_padding_mask is not None:
            src_key_padding_mask = ~src_key_padding_mask
        out = self.attn(src, src, src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                        need_weights=False)[0]
        return self.norm(src + out)


def test_a_padding_argument_beside_the_mask_read_the_other_way_round_is_said():
    # only the first mask argument's polarity was read; a key padding mask inverted inside passed with no word
    from selfattn.check import check
    assert "mask-convention" not in check(EncoderLayerTwoMasks()).ids
    assert "mask-convention" in check(EncoderLayerTwoMasks(invert_padding=True)).ids


class FieldInteraction(nn.Module):
    """AutoInt's interacting layer (Song et al. 2019) as CTR libraries write it: raw (E, E) matrices applied with
    tensordot over (B, fields, E), heads split along the features, a residual map, ReLU."""

    def __init__(self, embedding_size=16, head_num=2):
        super().__init__()
        self.head_num = head_num
        self.W_Query, self.W_key, self.W_Value, self.W_Res = (
            nn.Parameter(torch.randn(embedding_size, embedding_size) * embedding_size ** -0.5) for _ in range(4))

    def forward(self, inputs):
        q, k, v = (torch.tensordot(inputs, w, dims=([-1], [0])) for w in (self.W_Query, self.W_key, self.W_Value))
        q, k, v = (torch.stack(torch.split(t, t.shape[-1] // self.head_num, dim=2)) for t in (q, k, v))
        weights = (torch.einsum("bnik,bnjk->bnij", q, k) / q.shape[-1] ** 0.5).softmax(dim=-1)
        out = torch.cat(torch.split(weights @ v, 1), dim=-1).squeeze(0)
        return torch.relu(out + torch.tensordot(inputs, self.W_Res, dims=([-1], [0])))


def test_a_width_read_from_raw_matrices_comes_before_the_default():
    # at width 16 the default width 64 ran channels first ((B, 64, 16): 64 fields of 16), and the module was read
    # as attention over its features (definition-mismatch)
    from selfattn.check import check
    report = check(FieldInteraction())
    assert report.verdict == "passed", report.ids
    assert report.inferred["embed_dim"] == 16


class LearnedScaleCosine(nn.Module):
    """Swin v2's scaled cosine attention: per-head unit q and k, a learned logit scale clamped at log(100)."""

    def __init__(self, dim=32, heads=4, normalise="head"):
        super().__init__()
        self.heads, self.normalise = heads, normalise
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(heads, 1, 1)))

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x)
        if self.normalise == "width":  # the bug: over the whole width, before the heads are split
            q, k, v = qkv.chunk(3, -1)
            qkv = torch.cat([F.normalize(q, dim=-1), F.normalize(k, dim=-1), v], -1)
        q, k, v = qkv.reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.normalise == "head":
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        elif self.normalise == "across heads":  # the bug: over the heads' axis
            q, k = F.normalize(q, dim=1), F.normalize(k, dim=1)
        elif self.normalise == "q only":
            q = F.normalize(q, dim=-1)
        scale = torch.clamp(self.logit_scale, max=math.log(100.0)).exp()
        attn = (q @ k.transpose(-2, -1) * scale).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("normalise", ["width", "across heads", "q only"])
def test_a_cosine_of_other_vectors_than_each_heads_q_and_k_is_named(normalise):
    # the learned temperature made any scale the design's, whatever was normalised: passed
    from selfattn.check import check
    assert check(LearnedScaleCosine()).verdict == "passed"
    assert check(LearnedScaleCosine(normalise=normalise)).ids == {"definition-mismatch"}


def _txl(u_on_keys=False):
    """Transformer-XL's relative attention with its scores masked in float32 (``score.float().masked_fill(...)``,
    as the original code does), u added to the queries, or (the bug) to the keys, where the softmax cancels it."""
    from doctor_corpus_wild import RelPartialLearnableMultiHeadAttn

    class Float32Scores(RelPartialLearnableMultiHeadAttn):
        def softmax(self, score):
            return F.softmax(score.float(), dim=1).type_as(score)

        def forward(self, w):
            if not u_on_keys:
                return super().forward(w)
            qlen, bsz = w.shape[:2]
            pos_seq = torch.arange(qlen - 1, -1, -1.0, dtype=w.dtype)
            sinusoid = torch.outer(pos_seq, self.inv_freq.to(w.dtype))
            r = torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)
            q, k, v = (t.view(qlen, bsz, self.n_head, self.d_head) for t in self.qkv_net(w).chunk(3, dim=-1))
            ac = torch.einsum("ibnd,jbnd->ijbn", q, k + self.r_w_bias)
            bd = self._rel_shift(torch.einsum("ibnd,jnd->ijbn", q + self.r_r_bias,
                                              self.r_net(r).view(qlen, self.n_head, self.d_head)))
            mask = torch.ones(qlen, qlen, dtype=torch.bool).triu(1)
            prob = self.softmax(((ac + bd) * self.scale).masked_fill(mask[:, :, None, None], float("-inf")))
            vec = torch.einsum("ijbn,jbnd->ibnd", prob, v).reshape(qlen, bsz, self.n_head * self.d_head)
            return self.layer_norm(w + self.o_net(vec))

    return Float32Scores(4, 32, 8)


def test_a_bias_the_softmax_cancels_is_no_grad_also_beside_float32_scores():
    # u added to the keys is q . u on every key of a row, which the softmax cancels: its float64 gradient is 0 up to
    # rounding, but float32 scores leave 1e-9 of rounding, above the 1e-10 the rule allowed
    from selfattn.check import check
    assert check(_txl(), causal=True).verdict == "passed"
    assert check(_txl(u_on_keys=True), causal=True).ids == {"no-grad"}


class ConvQKVMap(nn.Module):
    """Attention over an image's positions with q, k and v from one 1 x 1 convolution (and batch norm), heads laid
    out channel blocks first, as YOLO's position-sensitive attention writes it; (B, C, H, W) in and out."""

    def __init__(self, dim=32, heads=2, keys_from_queries=False):
        super().__init__()
        self.heads, self.key_dim, self.keys_from_queries = heads, dim // heads // 2, keys_from_queries
        self.qkv = nn.Sequential(nn.Conv2d(dim, dim + 2 * heads * self.key_dim, 1, bias=False),
                                 nn.BatchNorm2d(dim + 2 * heads * self.key_dim))
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).view(b, self.heads, -1, h * w).split([self.key_dim, self.key_dim, c // self.heads],
                                                                     dim=2)
        if self.keys_from_queries:  # the bug: the keys' channels computed and never read
            k = q
        attn = (q.transpose(-2, -1) @ k * self.key_dim ** -0.5).softmax(dim=-1)
        return self.proj((v @ attn.transpose(-2, -1)).view(b, c, h, w))


def test_channels_of_a_one_by_one_convolution_never_read_are_no_grad():
    # dead rows were looked for in Linear weights only: keys from the queries' channels of a fused 1 x 1 convolution
    # passed
    from selfattn.check import check
    assert check(ConvQKVMap().eval()).verdict == "passed"
    assert "no-grad" in check(ConvQKVMap(keys_from_queries=True).eval()).ids


def _shaw(values_transposed=False):
    """OpenNMT's Shaw relative attention, with (the bug) the weights transposed before the value positions' term."""
    from doctor_corpus_wild2 import ShawMultiHeadedAttention, _relative_matmul

    class ValueTermTransposed(ShawMultiHeadedAttention):
        def forward(self, x, mask=None):
            key, value, query = (self.shape(lin(x)) for lin in (self.linear_keys, self.linear_values,
                                                                  self.linear_query))
            positions = torch.arange(x.size(1))
            table = self.relative_positions_embeddings((positions[None, :] - positions[:, None]).clamp(
                -self.max_relative_positions, self.max_relative_positions) + self.max_relative_positions)
            query = query / math.sqrt(self.dim_per_head)
            attn = (query @ key.transpose(2, 3) + _relative_matmul(query, table, True)).softmax(-1)
            context = attn @ value + _relative_matmul(attn.transpose(2, 3), table, False)
            return self.final_linear(self.unshape(context))

    return (ValueTermTransposed if values_transposed else ShawMultiHeadedAttention)(4, 32)


def test_weights_transposed_before_the_value_positions_term_are_matmul_order():
    # the position term on the values was a fact whatever way round it took the weights: passed
    from selfattn.check import check
    assert check(_shaw(), no_mask=True).verdict == "passed"
    assert check(_shaw(values_transposed=True), no_mask=True).ids == {"matmul-order"}


class OffByOneSoftmax(nn.Module):
    """softmax_1 ("Attention Is Off By One"): exp(s) / (1 + sum exp(s)), written out and shifted by the row's max."""

    def __init__(self, dim=32, heads=4, scaled=True):
        super().__init__()
        self.heads, self.scaled = heads, scaled
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, -1))
        s = q @ k.transpose(-1, -2) * ((c // self.heads) ** -0.5 if self.scaled else 1.0)
        m = s.amax(-1, keepdim=True).clamp(min=0)
        e = torch.exp(s - m)
        w = e / (torch.exp(-m) + e.sum(-1, keepdim=True))
        return self.to_out((w @ v).transpose(1, 2).reshape(b, n, c))


def test_a_softmax_with_one_more_term_in_its_sum_is_read_as_a_sink():
    # the written-out softmax was read only as e / e.sum(-1): definition-mismatch on softmax_1
    from selfattn.check import check
    report = check(OffByOneSoftmax())
    assert report.verdict == "passed", report.ids
    assert "sink" in report.inferred["design"]["sinks"]
    assert check(OffByOneSoftmax(scaled=False)).ids == {"missing-scale"}


class NeighbourVectorAttention(nn.Module):
    """Point Transformer's vector attention (Zhao et al. 2021) over each token's k nearest tokens by index: a softmax
    per feature over the neighbours of MLP(q_i - k_j), summed with the values; the feature width equals the probe's
    length."""

    def __init__(self, dim=16, neighbours=4):
        super().__init__()
        self.neighbours = neighbours
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        n = x.shape[1]
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        index = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().topk(self.neighbours, largest=False)[1]
        k, v = k[:, index], v[:, index]  # (B, N, K, D)
        attn = self.attn_mlp(q[:, :, None, :] - k).softmax(dim=-2)
        return torch.einsum("bijd,bijd->bid", attn, v)


def test_a_softmax_over_neighbours_the_product_sums_is_no_wrong_axis():
    # its (B, N, K, D) weights at a width equal to the length were read as a few queries over every key, and the
    # softmax over the neighbours as over the queries: softmax-dim, even with --allow-nonstandard
    from selfattn.check import check
    assert check(NeighbourVectorAttention(), length=16).ids == {"definition-mismatch"}
    assert check(NeighbourVectorAttention(), length=16, allow_nonstandard=True).verdict == "passed"


class WindowsThroughTorchMHA(nn.Module):
    """nn.MultiheadAttention within windows of 4 tokens, the tokens regrouped sequence first as (4, B * L / 4, E), as
    factorised video blocks call it one axis at a time."""

    def __init__(self, dim=32, heads=4, back_without_transpose=False):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads)
        self.back_without_transpose = back_without_transpose

    def forward(self, x):
        b, n, e = x.shape
        windows = x.reshape(b * n // 4, 4, e).transpose(0, 1)  # (4, B * L / 4, E)
        out = self.attn(windows, windows, windows, need_weights=False)[0]
        if self.back_without_transpose:  # the bug: sequence-first output read back as batch first
            return out.reshape(b, n, e)
        return out.transpose(0, 1).reshape(b, n, e)


def test_torch_multihead_attention_on_regrouped_tokens_is_read():
    # the projections' reading needs the query to be the module's input: no formula was followed (inconclusive)
    from selfattn.check import check
    assert check(WindowsThroughTorchMHA(), length=16).verdict == "passed"
    assert check(WindowsThroughTorchMHA(back_without_transpose=True), length=16).verdict == "failed"


class AxisKeywordSoftmax(nn.Module):
    """Flax-style raw kernels applied with einsum, the softmax called with NumPy's ``axis=-1``."""

    def __init__(self, dim=32, heads=4, key_unused=False):
        super().__init__()
        self.heads, self.key_unused = heads, key_unused
        self.query, self.key, self.value = (nn.Parameter(torch.randn(dim, heads, dim // heads) * dim ** -0.5)
                                            for _ in range(3))
        self.out = nn.Parameter(torch.randn(heads, dim // heads, dim) * dim ** -0.5)

    def forward(self, x):
        q = torch.einsum("bld,dhk->bhlk", x, self.query)
        k = torch.einsum("bld,dhk->bhlk", x, self.query if self.key_unused else self.key)
        v = torch.einsum("bld,dhk->bhlk", x, self.value)
        weights = torch.softmax(torch.einsum("bhqk,bhsk->bhqs", q, k) / math.sqrt(q.shape[-1]), axis=-1)
        return torch.einsum("bhqk,hkd->bqd", weights @ v, self.out)


def test_a_softmax_given_its_axis_by_numpys_keyword_is_read_over_that_axis():
    # axis=-1 was not read as dim: torch's implicit dim (1 of 4) was taken, and a correct module was softmax-dim
    from selfattn.check import check
    assert check(AxisKeywordSoftmax(), embed_dim=32).verdict == "passed"
    assert check(AxisKeywordSoftmax(key_unused=True), embed_dim=32).ids == {"no-grad"}


class PointwiseConvProjections(nn.Module):
    """q, k and v from three 1 x 1 Conv2d over a (B, C, H, W) map, as convolutional attention blocks write them."""

    def __init__(self, dim=32, heads=2, values_from_queries=False):
        super().__init__()
        self.heads, self.values_from_queries = heads, values_from_queries
        self.q, self.k, self.v, self.proj = (nn.Conv2d(dim, dim, 1) for _ in range(4))

    def forward(self, x):
        b, c, h, w = x.shape
        q, k = self.q(x), self.k(x)
        v = self.q(x) if self.values_from_queries else self.v(x)
        q, k, v = (t.reshape(b, self.heads, c // self.heads, h * w).transpose(-1, -2) for t in (q, k, v))
        out = ((q @ k.transpose(-1, -2)) * (c // self.heads) ** -0.5).softmax(-1) @ v
        return self.proj(out.transpose(-1, -2).reshape(b, c, h, w))


def test_a_pointwise_conv2d_projection_never_used_is_no_grad():
    # the rule on a projection left out by its siblings knew Linear and 1 x 1 Conv1d layers, not Conv2d
    from selfattn.check import check
    assert check(PointwiseConvProjections()).verdict == "passed"
    assert check(PointwiseConvProjections(values_from_queries=True)).ids == {"no-grad"}


class UntiedPositions(nn.Module):
    """TUPE (Ke et al. 2021): content and absolute position correlations computed apart, added, scaled 1/sqrt(2 D)."""

    def __init__(self, dim=32, heads=4, length=16, over_queries=False):
        super().__init__()
        self.heads, self.over = heads, -2 if over_queries else -1
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.5)
        self.pos_q, self.pos_k = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        d = c // self.heads
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        pq, pk = (lin(self.pos[:n]).view(n, self.heads, d).transpose(0, 1) for lin in (self.pos_q, self.pos_k))
        scores = (q @ k.transpose(-1, -2) + pq @ pk.transpose(-1, -2)) / math.sqrt(2 * d)
        return self.out((scores.softmax(self.over) @ v).transpose(1, 2).reshape(b, n, c))


def test_tupes_shared_scale_beside_its_position_correlations_is_its_design():
    # 1/sqrt(2 D) beside a term of positions alone was wrong-scale
    from selfattn.check import check
    assert check(UntiedPositions()).verdict == "passed"
    assert check(UntiedPositions(over_queries=True)).ids == {"softmax-dim"}


class AdditiveMaskAfterSoftmax(nn.Module):
    """A (B, L) keep mask turned into an additive -10000 fill, added to the weights after the softmax (the bug)."""

    def __init__(self, dim=32, heads=4, after=True):
        super().__init__()
        self.heads, self.after = heads, after
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        fill = 0.0 if mask is None else (1.0 - mask[:, None, None, :].to(x.dtype)) * -10000.0
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        weights = scores.softmax(-1) + fill if self.after else (scores + fill).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, c))


def test_a_mask_added_to_the_weights_after_the_softmax_is_mask_after_softmax():
    # an addition between the softmax and the values was definition-mismatch (beside mask-ignored)
    from selfattn.check import check
    assert check(AdditiveMaskAfterSoftmax(after=False), mask="keep (B,L)").verdict == "passed"
    assert check(AdditiveMaskAfterSoftmax(), mask="keep (B,L)").ids == {"mask-after-softmax"}


class SharedKeyHead(nn.Module):
    """Multi-query attention as lucidrains' packages write it: q with heads, one key and value head shared,
    ``einsum("b h i d, b j d -> b h i j")``; ``viewed``: q split with reshape(b, h, n, d) (the bug)."""

    def __init__(self, dim=32, heads=4, viewed=False):
        super().__init__()
        self.heads, self.viewed = heads, viewed
        self.to_q, self.to_kv, self.to_out = nn.Linear(dim, dim, bias=False), nn.Linear(dim, 16, bias=False), \
            nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q = self.to_q(x)
        q = q.reshape(b, self.heads, n, -1) if self.viewed else q.view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        scores = torch.einsum("bhid,bjd->bhij", q, k) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("bhij,bjd->bhid", scores.softmax(-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, c))


def test_a_query_split_without_its_transpose_beside_one_shared_key_head_is_head_split():
    # q's token axis against a key of no head axis was two letters ("h" and "i"): q was not read, and the symptom
    # (causal-leak, mask-ignored) was named instead of the split
    from selfattn.check import check
    assert check(SharedKeyHead(), causal=True).verdict == "passed"
    assert check(SharedKeyHead(viewed=True), causal=True).ids == {"head-split"}


class PointCloudSelfAttention(nn.Module):
    """PCT's plain self-attention over (B, C, N) point features: 1-D convolutions for q, k and v, softmax over the
    keys, scaled by sqrt(d_a), a residual."""

    def __init__(self, channels=32, over_queries=False):
        super().__init__()
        self.over = 1 if over_queries else -1
        self.q_conv, self.k_conv = nn.Conv1d(channels, channels // 4, 1, bias=False), \
            nn.Conv1d(channels, channels // 4, 1, bias=False)
        self.v_conv = nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        q, k, v = self.q_conv(x).permute(0, 2, 1), self.k_conv(x), self.v_conv(x)
        weights = torch.softmax(torch.bmm(q, k) * (k.shape[1] ** -0.5), dim=self.over)  # (B, N queries, N keys)
        return x + torch.bmm(v, weights.permute(0, 2, 1))


class PointCloudEncoder(nn.Module):
    def __init__(self, over_queries=False):
        super().__init__()
        self.embed = nn.Conv1d(3, 32, 1)
        self.sa1, self.sa2 = PointCloudSelfAttention(over_queries=over_queries), PointCloudSelfAttention()

    def forward(self, points):
        return self.sa2(self.sa1(self.embed(points))).amax(-1)


def test_a_models_layers_called_channels_first_are_laid_out_so():
    # (B, C, N) states were read as (B, L, E): the channels as tokens, and the layers definition-mismatch
    torch.manual_seed(0)
    points = torch.randn(2, 3, 20)
    report = check_model(PointCloudEncoder().eval(), points)
    assert report.layers and all(layer.verdict == "passed" for layer in report.layers.values()), report.summary()
    report = check_model(PointCloudEncoder(over_queries=True).eval(), points)
    assert report.layers["sa1"].ids == {"softmax-dim"} and report.layers["sa2"].verdict == "passed", report.summary()


class PreNormedMapAttention(nn.Module):
    """A diffusion U-Net's attention block: an RMSNorm over the channels written with F.normalize, q, k and v from
    one 1 x 1 Conv2d, learned memory keys and values, einsum scores scaled 1/sqrt(d)."""

    def __init__(self, dim=32, heads=4, dim_head=8, memory=4, normalise_q=False, back_transposed=False):
        super().__init__()
        self.heads, self.normalise_q, self.back_transposed = heads, normalise_q, back_transposed
        self.g = nn.Parameter(torch.ones(1, dim, 1, 1))
        self.mem_kv = nn.Parameter(torch.randn(2, heads, memory, dim_head))
        self.to_qkv = nn.Conv2d(dim, 3 * heads * dim_head, 1, bias=False)
        self.to_out = nn.Conv2d(heads * dim_head, dim, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        x = F.normalize(x, dim=1) * self.g * c ** 0.5
        q, k, v = (t.reshape(b, self.heads, -1, h * w).transpose(-1, -2) for t in self.to_qkv(x).chunk(3, dim=1))
        if self.normalise_q:  # q made of unit norm over the whole width, across the heads (the bug)
            q = F.normalize(q.transpose(1, 2).reshape(b, h * w, -1), dim=-1).view(b, h * w, self.heads, -1)
            q = q.transpose(1, 2) * q.shape[-1] ** 0.5
        mk, mv = (t.expand(b, -1, -1, -1) for t in self.mem_kv)
        k, v = torch.cat((mk, k), dim=-2), torch.cat((mv, v), dim=-2)
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        out = (sim.softmax(-1) @ v).transpose(-1, -2)
        if self.back_transposed:  # the tokens, laid out (h w), put back as (w h): the map comes back transposed
            return self.to_out(out.reshape(b, -1, w, h).transpose(-1, -2))
        return self.to_out(out.reshape(b, -1, h, w))


def test_a_pre_norm_before_a_convolution_projection_is_no_q_k_normalisation():
    # the walk back from q to a normalisation passed through the 1 x 1 Conv2d into the input's pre-norm, and the
    # correct block was definition-mismatch (q normalised over the whole width)
    from selfattn.check import check
    assert check(PreNormedMapAttention()).verdict == "passed"
    assert check(PreNormedMapAttention(normalise_q=True)).ids == {"definition-mismatch"}


def test_a_map_put_back_transposed_is_head_merge():
    # swapping two tokens changed two rows of the output, but not theirs: each token's row put back at another's
    # place passed with only the not-equivariant warning
    from selfattn.check import check
    assert check(PreNormedMapAttention(back_transposed=True)).ids == {"head-merge"}


class ScalarGainQKNorm(nn.Module):
    """q and k RMS-normalised per head by hand, each times one learned number (trained away from 1), then scaled
    1/sqrt(d); ``fixed`` holds the same numbers as buffers, a scale no training moves."""

    def __init__(self, dim=32, heads=2, fixed=False):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        gains = (torch.tensor(1.3), torch.tensor(0.8))
        if fixed:
            self.register_buffer("q_gain", gains[0])
            self.register_buffer("k_gain", gains[1])
        else:
            self.q_gain, self.k_gain = nn.Parameter(gains[0]), nn.Parameter(gains[1])

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        rms = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
        q, k = rms(q) * self.q_gain, rms(k) * self.k_gain
        weights = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, c))


def test_a_learned_number_on_normalised_q_and_k_is_a_temperature():
    # the gains were read as a fixed factor on the scores: 1.04 / sqrt(d) was wrong-scale on a correct module
    from selfattn.check import check
    assert check(ScalarGainQKNorm()).verdict == "passed"
    assert check(ScalarGainQKNorm(fixed=True)).ids == {"wrong-scale"}


class UntiedPositionsOneMap(nn.Module):
    """TUPE with positions from an embedding, its position keys taken from the position queries' projection: ``pos_k``
    never used (``one_map``), or used as it should be."""

    def __init__(self, dim=32, heads=4, length=16, one_map=True):
        super().__init__()
        self.heads, self.one_map = heads, one_map
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.pos = nn.Embedding(length, dim)
        self.pos_q, self.pos_k = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        d = c // self.heads
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        p = self.pos(torch.arange(n))
        pq = self.pos_q(p).view(n, self.heads, d).transpose(0, 1)
        pk = pq if self.one_map else self.pos_k(p).view(n, self.heads, d).transpose(0, 1)
        scores = (q @ k.transpose(-1, -2) + pq @ pk.transpose(-1, -2)) / math.sqrt(2 * d)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def test_a_position_projection_left_out_by_its_sibling_is_no_grad():
    # pos_k names no q, k or v role once "pos" is read as one: the sibling rule never looked at it
    from selfattn.check import check
    assert check(UntiedPositionsOneMap(one_map=False)).verdict == "passed"
    assert check(UntiedPositionsOneMap()).ids == {"no-grad"}


class EmptyMemoryAttention(nn.Module):
    """Learned memory keys and values joined before the tokens' own, their count an option (0 by default)."""

    def __init__(self, dim=32, heads=4, memory=0):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.memory = nn.Parameter(torch.randn(2, heads, memory, dim // heads))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mk, mv = (t.expand(b, -1, -1, -1) for t in self.memory)
        k, v = torch.cat((mk, k), dim=2), torch.cat((mv, v), dim=2)
        weights = (q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, c))


def test_an_empty_parameter_leaves_the_gradient_probe_running():
    # the probe moved every used parameter by noise relative to its largest entry: an empty one made it raise, and
    # the correct module was inconclusive
    from selfattn.check import check
    report = check(EmptyMemoryAttention())
    assert report.verdict == "passed" and not report.doctor_errors
    assert check(EmptyMemoryAttention(memory=2)).verdict == "passed"


class BlockedHaloAttention(nn.Module):
    """HaloNet's blocked local attention on a sequence: queries in blocks of ``block``, each block attending to its own
    tokens and ``halo`` tokens on each side (keys padded at the ends and masked there)."""

    def __init__(self, dim=32, heads=4, block=4, halo=2, scaled=True):
        super().__init__()
        self.heads, self.block, self.halo, self.scaled = heads, block, halo, scaled
        self.to_q, self.to_kv, self.to_out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        h, blk, halo, d = self.heads, self.block, self.halo, c // self.heads
        q = self.to_q(x).view(b, n // blk, blk, h, d).permute(0, 3, 1, 2, 4)  # (b, h, blocks, blk, d)
        kv = F.pad(self.to_kv(x), (0, 0, halo, halo)).unfold(1, blk + 2 * halo, blk)  # (b, blocks, 2c, window)
        k, v = kv.view(b, n // blk, 2, h, d, -1).permute(2, 0, 3, 1, 5, 4)  # each (b, h, blocks, window, d)
        valid = F.pad(x.new_ones(n), (halo, halo)).unfold(0, blk + 2 * halo, blk).bool()  # (blocks, window)
        scores = q @ k.transpose(-1, -2) * (d ** -0.5 if self.scaled else 1.0)
        weights = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
        return self.to_out((weights @ v).permute(0, 2, 3, 1, 4).reshape(b, n, c))


def test_blocks_that_see_a_halo_around_them_are_a_design():
    # a query block sees its own tokens and a halo that overlaps its neighbours': no symmetric pattern, and the
    # correct module was definition-mismatch (queries see some future keys and miss some past ones)
    from selfattn.check import check
    assert check(BlockedHaloAttention(), length=16).verdict == "passed"
    assert check(BlockedHaloAttention(scaled=False), length=16).ids == {"missing-scale"}


class BlockOrPaddingMaskAttention(nn.Module):
    """A layer that takes FlexAttention's block mask first and a (B, L) padding mask (True = valid) after it, its
    output projection initialised at 0 (``zero_out``) as diffusion and audio transformers do."""

    def __init__(self, dim=32, heads=4, zero_out=False):
        super().__init__()
        self.heads = heads
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        if zero_out:
            nn.init.zeros_(self.to_out.weight)

    def forward(self, x, block_mask=None, padding_mask=None):
        b, n, c = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if block_mask is not None:
            raise NotImplementedError(f"a BlockMask of block size {block_mask.BLOCK_SIZE} needs flex_attention")
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        if padding_mask is not None:
            scores = scores.masked_fill(~padding_mask[:, None, None, :], float("-inf"))
        return self.to_out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


class PaddedStack(nn.Module):
    def __init__(self, zero_out=False):
        super().__init__()
        self.layers = nn.ModuleList(BlockOrPaddingMaskAttention(zero_out=zero_out) for _ in range(2))

    def forward(self, x, padding_mask=None):
        for layer in self.layers:
            x = x + layer(x, padding_mask=padding_mask)
        return x


@pytest.mark.parametrize("zero_out", [False, True])
def test_a_layer_is_replayed_with_its_mask_argument_not_a_block_mask(zero_out):
    # the doctor's mask went to block_mask, the first parameter named like a mask, which the model leaves None (and
    # no tensor can be); and an output projection at 0, one output for every token, was read as the model's padding
    # mask hiding every key (mask-inverted)
    padding = torch.ones(2, 10, dtype=torch.bool)
    padding[1, 7:] = False
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(0))
    report = check_model(PaddedStack(zero_out), {"x": x, "padding_mask": padding})
    assert report.verdict == "passed", report.summary()


class FloatOrBoolMaskAttention(nn.Module):
    """A CLIP-style layer: a bool mask (True = masked) turned additive, a float one added as given, or (``flipped``,
    the bug) subtracted."""

    def __init__(self, dim=32, heads=4, flipped=False):
        super().__init__()
        self.heads, self.flipped = heads, flipped
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros(attn_mask.shape, dtype=x.dtype).masked_fill(attn_mask, float("-inf"))
            elif self.flipped:
                attn_mask = -attn_mask
            scores = scores + attn_mask
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


class CausalTextTower(nn.Module):
    def __init__(self, flipped=False, vocab=50, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(FloatOrBoolMaskAttention(dim, flipped=flipped) for _ in range(2))

    def forward(self, tokens):
        n = tokens.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h, attn_mask=mask)
        return h


def test_nan_in_a_layers_own_run_is_non_finite_without_padding():
    # the doctor's masks replace the model's float causal mask, which the layer subtracts: its own run gives NaN,
    # and the model was certified
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    assert check_model(CausalTextTower(), (tokens,)).verdict == "passed"
    report = check_model(CausalTextTower(flipped=True), (tokens,))
    assert report.layers and all("non-finite" in layer.ids for layer in report.layers.values()), report.summary()


class ZeroInitAttentionBlock(nn.Module):
    """A block as video diffusion code ships it: x + attn(x) with the attention's output projection initialised at 0,
    then a feed-forward on each token with its own residual."""

    def __init__(self, dim=32, heads=4, over_queries=False):
        super().__init__()
        self.heads, self.over = heads, -2 if over_queries else -1
        self.qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        nn.init.zeros_(self.to_out.weight)
        nn.init.zeros_(self.to_out.bias)
        self.ff = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)).softmax(self.over)
        x = x + self.to_out((weights @ v).transpose(1, 2).reshape(b, n, c))
        return x + self.ff(x)


def test_a_silent_attention_branch_before_a_feed_forward_is_probed_with_its_zeros_drawn():
    # the output was no constant (the feed-forward changes each token) and no zeros were drawn: each output row
    # depended on its own token only, and the correct block was definition-mismatch and mask-ignored
    from selfattn.check import check
    report = check(ZeroInitAttentionBlock())
    assert report.verdict == "passed" and "drawn" in report.inferred
    assert check(ZeroInitAttentionBlock(over_queries=True)).ids == {"softmax-dim"}


class ParallelFusedBlock(nn.Module):
    """PaLM's parallel block: one projection gives q (all heads), one shared key and value head, and the feed-forward's
    hidden units; the attention and the feed-forward are summed. ``values_from_keys``: v taken from k's slice."""

    def __init__(self, dim=32, heads=4, head_dim=8, values_from_keys=False):
        super().__init__()
        self.heads, self.head_dim, self.values_from_keys = heads, head_dim, values_from_keys
        self.sizes = (heads * head_dim, head_dim, head_dim, 4 * dim)
        self.fused = nn.Linear(dim, sum(self.sizes), bias=False)
        self.attn_out, self.ff_out = nn.Linear(heads * head_dim, dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v, hidden = self.fused(x).split(self.sizes, dim=-1)
        v = k if self.values_from_keys else v
        q = q.view(b, n, self.heads, self.head_dim).transpose(1, 2)
        weights = (torch.einsum("bhid,bjd->bhij", q, k) / math.sqrt(self.head_dim)).softmax(-1)
        out = torch.einsum("bhij,bjd->bhid", weights, v).transpose(1, 2).reshape(b, n, -1)
        return self.attn_out(out) + self.ff_out(F.silu(hidden))


def test_values_left_out_of_a_fused_projection_with_a_feed_forward_part_are_no_grad():
    # the value head's 8 rows of 176 were too few for the dead-rows rule (an eighth of the rows at least)
    from selfattn.check import check
    assert check(ParallelFusedBlock()).verdict == "passed"
    assert check(ParallelFusedBlock(values_from_keys=True)).ids == {"no-grad"}


class FocusPresentAttention(nn.Module):
    """Video-diffusion style attention over frames with a per-item flag named like a mask: ``focus_present_mask``
    (B,), True for the items whose frames attend only to themselves."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, focus_present_mask=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if focus_present_mask is not None and focus_present_mask.all():
            return self.out(v.transpose(1, 2).reshape(b, n, c))  # every frame sees only itself
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        if focus_present_mask is not None and not (~focus_present_mask).all():
            keep = torch.where(focus_present_mask.view(b, 1, 1, 1), torch.eye(n, dtype=torch.bool),
                               torch.ones(n, n, dtype=torch.bool))
            scores = scores.masked_fill(~keep, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def test_an_argument_named_like_a_mask_that_takes_one_flag_per_item_is_not_judged_as_a_mask():
    # every bool mask raised on its shape and an integer one ran, changing nothing: mask-ignored on a correct module
    from selfattn.check import check
    report = check(FocusPresentAttention())
    assert not report.ids and "not verified" in report.coverage["mask"]
    assert check(FocusPresentAttention(), no_mask=True).verdict == "passed"


class SegmentMemoryAttention(nn.Module):
    """titans-style segmented attention: the tokens padded to whole segments folded into the batch, causal within
    each, with learned memory keys and values joined before every segment's own."""

    def __init__(self, dim=32, heads=4, segment=4, memory=2, scaled=True):
        super().__init__()
        self.heads, self.segment, self.scale = heads, segment, (dim // heads) ** -0.5 if scaled else 1.0
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.memory = nn.Parameter(torch.randn(2, heads, memory, dim // heads))

    def forward(self, x):
        b, n, c = x.shape
        seg, h, m = self.segment, self.heads, self.memory.shape[2]
        x = F.pad(x, (0, 0, 0, -n % seg))
        w = x.shape[1] // seg
        q, k, v = self.qkv(x).view(b * w, seg, 3, h, c // h).permute(2, 0, 3, 1, 4)  # each (b w, h, seg, d)
        mk, mv = (t.expand(b * w, -1, -1, -1) for t in self.memory)
        k, v = torch.cat((mk, k), dim=2), torch.cat((mv, v), dim=2)
        future = torch.ones(seg, seg, dtype=torch.bool).triu(1)
        hidden = torch.cat((torch.zeros(seg, m, dtype=torch.bool), future), dim=1)
        scores = (q @ k.transpose(-1, -2) * self.scale).masked_fill(hidden, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, w * seg, c)[:, :n]
        return self.out(out)


def test_learned_memory_beside_each_segment_is_a_design():
    # the weights (segment, memory + segment) were read as over axes that are not the tokens, and segments folded
    # into the batch did not tile a length they pad: definition-mismatch on a correct module
    from selfattn.check import check
    assert check(SegmentMemoryAttention(), causal=True).verdict == "passed"
    assert check(SegmentMemoryAttention(scaled=False), causal=True).ids == {"missing-scale"}


class LocalAndGlobalProjections(nn.Module):
    """Longformer-style: blocks of 4 tokens attend within their block through query / key / value; token 0 is
    global, its row attending to every token through query_global / key_global / value_global. ``local_keys``: the
    global row takes its keys from the local ``key`` (key_global never used)."""

    def __init__(self, dim=32, heads=4, local_keys=False):
        super().__init__()
        self.heads, self.local_keys = heads, local_keys
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.query_global, self.key_global, self.value_global = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def _heads(self, t):
        return t.view(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (self._heads(lin(x)) for lin in (self.query, self.key, self.value))
        block = torch.arange(n) // 4
        local = ((q @ k.transpose(-1, -2)) / math.sqrt(c // self.heads)).masked_fill(
            block[:, None] != block[None, :], float("-inf"))
        out = local.softmax(-1) @ v
        gk = self._heads((self.key if self.local_keys else self.key_global)(x))
        gq, gv = self._heads(self.query_global(x[:, :1])), self._heads(self.value_global(x))
        out = torch.cat((((gq @ gk.transpose(-1, -2)) / math.sqrt(c // self.heads)).softmax(-1) @ gv, out[:, :, 1:]), 2)
        return self.out(out.transpose(1, 2).reshape(b, n, c))


def test_a_qualified_projection_left_out_by_its_siblings_is_no_grad():
    # key_global names no role the sibling rule reads (a qualifier beside the role word): left out while
    # query_global and value_global were used, it passed
    from selfattn.check import check
    assert check(LocalAndGlobalProjections(), length=8).verdict == "passed"
    assert check(LocalAndGlobalProjections(local_keys=True), length=8).ids == {"no-grad"}


class RegistersSlicedAway(nn.Module):
    """Register tokens appended after the tokens and cut off with ``out[:, :-registers]``: at 0 registers (the bug)
    that slice keeps no row at all."""

    def __init__(self, dim=32, heads=4, registers=0):
        super().__init__()
        self.registers = nn.Parameter(torch.randn(registers, dim))
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x):
        joined = torch.cat((x, self.registers.expand(x.shape[0], -1, -1)), dim=1)
        return self.attn(joined, joined, joined, need_weights=False)[0][:, :-self.registers.shape[0]]


def test_a_module_that_runs_but_returns_no_row_is_wrong_output_shape():
    # it was "could not run" (exit 2): no (B, L, E) output on any shape tried, though the module runs
    from selfattn.check import check
    assert check(RegistersSlicedAway()).ids == {"wrong-output-shape"}


class QueryAxisMaskAttention(nn.Module):
    """A (B, L) keep mask laid on the query axis (mask[:, None, :, None]) instead of the keys' (the bug)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attention_mask=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask.bool()[:, None, :, None], -1e4)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


class QueryAxisMaskModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(QueryAxisMaskAttention() for _ in range(2))

    def forward(self, ids, attention_mask):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h, attention_mask=attention_mask)
        return h


def test_a_models_padding_check_adds_no_symptom_the_layers_diagnosis_explains():
    # the model-level padding check added mask-ignored beside the layer's own mask-broadcast, which explains it
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    keep = torch.ones(2, 12, dtype=torch.long)
    keep[1, -4:] = 0
    report = check_model(QueryAxisMaskModel(), {"ids": ids, "attention_mask": keep})
    assert report.layers and all(r.ids == {"mask-broadcast"} for r in report.layers.values()), report.summary()


class MemoryPairAttention(nn.Module):
    """Learned memory keys and values held as a pair, ``mem_k`` and ``mem_v``, their count an option;
    ``values_from_keys``: the memory values taken from ``mem_k`` (``mem_v`` never used)."""

    def __init__(self, dim=32, heads=4, memory=0, values_from_keys=True):
        super().__init__()
        self.heads, self.values_from_keys = heads, values_from_keys
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mem_k = nn.Parameter(torch.randn(heads, memory, dim // heads))
        self.mem_v = nn.Parameter(torch.randn(heads, memory, dim // heads))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mv = self.mem_k if self.values_from_keys else self.mem_v
        k = torch.cat((self.mem_k.expand(b, -1, -1, -1), k), dim=2)
        v = torch.cat((mv.expand(b, -1, -1, -1), v), dim=2)
        weights = (q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, c))


def test_an_empty_twin_left_unused_is_no_finding_at_a_count_of_0():
    # at 0 memory slots the module computes the textbook attention, but the twin rule saw mem_v unused beside mem_k
    from selfattn.check import check
    assert check(MemoryPairAttention()).verdict == "passed"
    assert check(MemoryPairAttention(memory=2)).ids == {"no-grad"}
    assert check(MemoryPairAttention(memory=2, values_from_keys=False)).verdict == "passed"


class FeaturesToBlocks(nn.Module):
    """Features per token embedded by a Linear, then zero-initialised attention blocks (a diffusion transformer's
    trunk at initialisation)."""

    def __init__(self, features=6, dim=32, over_queries=False):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(ZeroInitAttentionBlock(dim, over_queries=over_queries) for _ in range(2))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def test_a_model_whose_first_attention_mixes_nothing_yet_is_read_batch_first():
    # a change of the input at one token reached that token's rows alone, as an item's change does in a model that
    # takes its inputs sequence first: the layers were probed over the batch (batch-mixing on a correct model, and on
    # one whose softmax runs over the queries)
    x = torch.randn(2, 10, 6, generator=torch.Generator().manual_seed(0))
    report = check_model(FeaturesToBlocks(), (x,))
    assert report.verdict == "passed", report.ids
    assert all(r.ids == {"softmax-dim"} for r in check_model(FeaturesToBlocks(over_queries=True), (x,)).layers.values())


# -- FlexAttention: score and mask mods as attn-gym writes them -----------------------------------------------------
def _alibi_slopes(heads):
    return torch.exp2(-8.0 * torch.arange(1, heads + 1) / heads)


class FlexModAttention(nn.Module):
    """Attention through ``flex_attention``: an ALiBi ``score_mod`` and a causal sliding-window ``mask_mod`` in a
    block mask built for each call's length. ``scale``: the scale passed (None: flex's own 1/sqrt(d));
    ``keys_from_queries``: the keys' part of the fused projection left out; ``cached``: the block mask built on the
    first call and kept."""

    def __init__(self, dim=32, heads=4, window=3, scale=None, keys_from_queries=False, cached=False):
        super().__init__()
        self.heads, self.window, self.scale = heads, window, scale
        self.keys_from_queries, self.cached = keys_from_queries, cached
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.block_mask = None

    def forward(self, x):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        slopes = _alibi_slopes(self.heads).to(x)

        def alibi(score, batch, head, q_idx, kv_idx):
            return score + slopes[head] * (kv_idx - q_idx)

        def sliding_causal(batch, head, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= self.window)

        block_mask = self.block_mask
        if block_mask is None:
            block_mask = create_block_mask(sliding_causal, None, None, n, n, device=x.device)
            if self.cached:
                self.block_mask = block_mask
        out = flex_attention(q, q if self.keys_from_queries else k, v, score_mod=alibi, block_mask=block_mask,
                             scale=self.scale)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


def test_flex_attention_with_its_mods_is_read_by_the_white_box():
    # flex_attention compiles its kernel even in eager mode, which failed under the white box's recording, and it
    # has no backward on CPU: every module calling it was inconclusive, and its bugs had no id
    from selfattn.check import check
    report = check(FlexModAttention())
    assert report.verdict == "passed", (report.ids, report.coverage)
    assert report.coverage["white_box"] == "verified" and "gradients through" in report.inferred
    assert check(FlexModAttention(scale=1.0)).ids == {"missing-scale"}
    assert check(FlexModAttention(keys_from_queries=True)).ids == {"no-grad"}


def test_a_block_mask_kept_from_the_first_call_is_state_dependent():
    # the attribute went from None to an object holding tensors (a BlockMask, a namespace), which was not counted as
    # state a call replaces: the calls in a row never ran, and the module was certified
    from selfattn.check import check
    assert check(FlexModAttention(cached=True)).ids == {"state-dependent"}


class LogSumExpSinkAttention(nn.Module):
    """gpt-oss-style attention sinks written through the log of the softmax's sum: a learned logit per head joins
    the scores in ``logsumexp`` and has no value."""

    def __init__(self, dim=32, heads=4, scaled=True):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5 if scaled else 1.0
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.sinks = nn.Parameter(torch.randn(heads))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * self.scale
        sink = self.sinks.view(1, -1, 1, 1).expand(b, -1, n, 1)
        weights = torch.exp(scores - torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1, keepdim=True))
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, c))


def test_sinks_in_the_log_of_the_softmaxs_sum_are_a_softmax_with_sinks():
    # exp(s - logsumexp([s, sink])) was no softmax the white box knew: definition-mismatch on a correct module
    from selfattn.check import check
    report = check(LogSumExpSinkAttention())
    assert report.verdict == "passed", report.ids
    assert check(LogSumExpSinkAttention(scaled=False)).ids == {"missing-scale"}


class PackagedRotaryAttention(nn.Module):
    """Attention with rotary-embedding-torch's ``RotaryEmbedding`` (as spear-tts and soundstorm use it);
    ``key_offset``: the keys rotated that many positions late (``offset=`` given to one side)."""

    def __init__(self, dim=32, heads=4, key_offset=0):
        super().__init__()
        from rotary_embedding_torch import RotaryEmbedding
        self.heads, self.key_offset = heads, key_offset
        self.rotary = RotaryEmbedding(dim // heads)
        self.to_q, self.to_kv = nn.Linear(dim, dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.to_kv(x).view(b, n, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        q = self.rotary.rotate_queries_or_keys(q)
        k = self.rotary.rotate_queries_or_keys(k, offset=self.key_offset)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


def test_keys_rotated_late_by_a_packaged_rotary_are_rotary_mismatch():
    # the package multiplies each rotated term by its (xPos) scale, 1 when off: the tables were not found behind that
    # number, the offset was never compared, and the module was certified
    pytest.importorskip("rotary_embedding_torch")
    from selfattn.check import check
    assert check(PackagedRotaryAttention()).verdict == "passed"
    assert check(PackagedRotaryAttention(key_offset=1)).ids == {"rotary-mismatch"}


def _closure_module(modules, forward_fn):
    """a_unet's way of making a module: a class made on the spot whose forward is a closure given to it."""

    class Module(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(modules)

        def forward(self, *args, **kwargs):
            return forward_fn(*args, **kwargs)

    return Module()


def _attention_core(features, head_features, heads):
    to_out = nn.Linear(head_features * heads, features, bias=False)

    def forward(q, k, v):
        q, k, v = (t.unflatten(-1, (heads, head_features)).transpose(1, 2) for t in (q, k, v))
        weights = (q @ k.transpose(-1, -2) * head_features ** -0.5).softmax(dim=-1)
        return to_out((weights @ v).transpose(1, 2).flatten(2))

    return _closure_module([to_out], forward)


class ClosureAttention(nn.Module):
    """Projections in the class, the core a closure over its output projection (a_unet's ``AttentionBase``)."""

    def __init__(self, features=32, head_features=8, heads=4):
        super().__init__()
        self.to_q = nn.Linear(features, head_features * heads, bias=False)
        self.to_kv = nn.Linear(features, 2 * head_features * heads, bias=False)
        self.attention = _attention_core(features, head_features, heads)

    def forward(self, x):
        return self.attention(self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))


def test_a_copy_of_a_module_built_on_closures_runs_its_own_layers():
    # a deep copy keeps the closure, so the float16 copy called the float32 original's output projection
    # (half-precision-overflow on a correct module, and no float64 analysis)
    from selfattn.check import check
    report = check(ClosureAttention())
    assert report.verdict == "passed", report.ids
    assert "float64" in str(report.inferred["analysed in"])


class SecondStreamAttention(nn.Module):
    """A layer that hands on a second stream beside its output (agent attention's agent tokens, a memory): its own
    projection makes the second output. ``cache``: the keys and values returned too; ``values_from_keys``: the
    weights multiplied by the keys."""

    def __init__(self, dim=32, heads=4, agents=4, cache=False, values_from_keys=False):
        super().__init__()
        self.heads, self.cache, self.values_from_keys = heads, cache, values_from_keys
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out, self.to_agent_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.agents = nn.Parameter(torch.randn(agents, dim) * 0.02)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        weights = (q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)).softmax(-1)
        out = self.to_out((weights @ (k if self.values_from_keys else v)).transpose(1, 2).reshape(b, n, c))
        agents = self.to_agent_out(self.agents.expand(b, -1, -1) + x.mean(1, keepdim=True))
        return (out, agents, (k, v)) if self.cache else (out, agents)


def test_a_projection_of_a_second_stream_the_layer_returns_is_no_unused_projection():
    # the gradient probe took the output alone: the agents' projection got no gradient from it (no-grad on a correct
    # layer); a value projection reaching only the returned cache still gets no-grad
    from selfattn.check import check
    assert check(SecondStreamAttention()).verdict == "passed"
    assert check(SecondStreamAttention(cache=True)).verdict == "passed"
    buggy = check(SecondStreamAttention(values_from_keys=True)).ids
    assert "no-grad" in buggy and check(SecondStreamAttention(cache=True, values_from_keys=True)).ids == buggy


class MapAttention(nn.Module):
    """Bottleneck-transformer attention on a ResNet's feature map (B, C, H, W): q, k and v from a 1 x 1 convolution,
    and a learned absolute position embedding for a map of ``fmap`` (so that it runs at that size only)."""

    def __init__(self, dim=32, heads=4, dim_head=8, fmap=(6, 6)):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_qkv = nn.Conv2d(dim, 3 * heads * dim_head, 1, bias=False)
        self.pos = nn.Parameter(torch.randn(fmap[0] * fmap[1], dim_head) * 0.02)

    def forward(self, fmap):
        b, _, h, w = fmap.shape
        q, k, v = (t.reshape(b, self.heads, -1, h * w).transpose(-1, -2) for t in self.to_qkv(fmap).chunk(3, dim=1))
        scores = (q @ k.transpose(-1, -2) + q @ self.pos.t()) * self.scale
        out = scores.softmax(-1) @ v
        return out.transpose(-1, -2).reshape(b, -1, h, w)


def test_a_models_layer_on_a_feature_map_is_replayed_at_its_map():
    # the (B, C, H, W) map was read as channels last ((B, 32, 6) tokens of width 6): every replay failed and the
    # layer could not run, so the model was inconclusive
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), MapAttention())
    report = check_model(model, (torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0)),))
    assert report.verdict == "passed", (report.could_not_run, {n: r.ids for n, r in report.layers.items()})


class EfficientAttention(nn.Module):
    """Efficient attention (Shen et al.), as a_unet ships it: q normalised by a softmax over its features, k by one
    over the tokens, keys and values summed into a context first; no (query, key) weights at all."""

    def __init__(self, dim=32, heads=4, dim_head=8):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q, self.to_kv = nn.Linear(dim, heads * dim_head, bias=False), nn.Linear(dim, 2 * heads * dim_head)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def split(self, x):
        b, n, _ = x.shape
        return (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (self.to_q(x), *self.to_kv(x).chunk(2, -1)))

    def attend(self, q, k, v):
        q, k = q.softmax(dim=-1) * self.scale, k.softmax(dim=-2)
        context = torch.einsum("bhnd,bhne->bhde", k, v)
        out = torch.einsum("bhnd,bhde->bhne", q, context)
        return self.to_out(out.transpose(1, 2).flatten(2))

    def forward(self, x):
        return self.attend(*self.split(x))


def test_a_softmax_of_the_projections_themselves_is_no_attention_weights():
    # q's softmax over its features, times the scale, was read as attention weights scaled after the softmax
    # (missing-scale), and k's over the tokens as a softmax over the wrong axis: efficient attention is a design of
    # its own, definition-mismatch until --allow-nonstandard
    from selfattn.check import check
    assert check(EfficientAttention()).ids == {"definition-mismatch"}
    assert check(EfficientAttention(), allow_nonstandard=True).verdict == "passed"


class TokenShiftRotaryAttention(nn.Module):
    """MEGABYTE / RWKV-style token shift (half the features from the token before, zeros before the first) then
    causal attention with rotary positions; ``keys_rotated``: False leaves k unrotated."""

    def __init__(self, dim=32, heads=4, keys_rotated=True):
        super().__init__()
        self.heads, self.keys_rotated = heads, keys_rotated
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        head_dim = dim // heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, x):
        b, n, c = x.shape
        kept, shifted = x.chunk(2, dim=-1)
        x = torch.cat((kept, F.pad(shifted, (0, 0, 1, -1))), dim=-1)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        angles = torch.outer(torch.arange(n, dtype=x.dtype), self.inv_freq.to(x.dtype)).repeat(1, 2)

        def rotate(t):
            one, two = t.chunk(2, dim=-1)
            return t * angles.cos() + torch.cat((-two, one), dim=-1) * angles.sin()

        q, k = rotate(q), rotate(k) if self.keys_rotated else k
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(out.transpose(1, 2).reshape(b, n, c))


def test_a_token_shift_before_rotary_keeps_the_rotation_readable():
    # with one token everywhere, the shift gives position 0 zeros where the others have the token: its q and k are
    # no copy of theirs, and its score with itself differing was read as q and k rotated apart (rotary-mismatch)
    from selfattn.check import check
    assert check(TokenShiftRotaryAttention(), causal=True).verdict == "passed"
    assert check(TokenShiftRotaryAttention(keys_rotated=False), causal=True).ids == {"rotary-one-side"}


class WindowMemoryBiasAttention(nn.Module):
    """A MaxViT / RT-1 window (B, H, W, E) with a learned 2-D relative-position bias per head and learned memory
    keys and values put before the window's own (the bias padded with zeros over them). ``by_key``: the table
    indexed by the key's own cell instead of its offset from the query."""

    def __init__(self, dim=32, heads=4, window=4, memory=3, by_key=False):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.memory = nn.Parameter(torch.randn(2, heads, memory, dim // heads))
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads))
        rows, cols = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
        cells = torch.stack((rows.flatten(), cols.flatten()), dim=-1)
        rel = cells[None, :].expand(len(cells), -1, -1) if by_key else cells[:, None] - cells[None, :] + window - 1
        self.register_buffer("index", (rel * torch.tensor([2 * window - 1, 1])).sum(-1), persistent=False)

    def forward(self, x):
        b, h, w, c = x.shape
        q, k, v = self.qkv(x.reshape(b, h * w, c)).view(b, h * w, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        k = torch.cat((self.memory[0].expand(b, -1, -1, -1), k), dim=2)
        v = torch.cat((self.memory[1].expand(b, -1, -1, -1), v), dim=2)
        bias = F.pad(self.table[self.index].permute(2, 0, 1), (self.memory.shape[2], 0))
        weights = (q @ k.transpose(-1, -2) * self.scale + bias).softmax(-1)
        return self.out((weights @ v).transpose(1, 2).reshape(b, h, w, c))


def test_a_2d_relative_bias_beside_memory_keys_is_read_on_the_tokens_keys():
    # the scores' first L keys were taken as the tokens', which with memory put first are the memory's and the first
    # tokens': the bias read shifted, not relative (definition-mismatch on a correct window)
    from selfattn.check import check
    assert check(WindowMemoryBiasAttention(), length=16).verdict == "passed"
    assert check(WindowMemoryBiasAttention(by_key=True), length=16).ids == {"definition-mismatch"}


class TrianglePairAttention(nn.Module):
    """AlphaFold's triangle attention around the starting node on a pair map (B, N, N, D): each row of pairs attends
    along itself, with a per-head bias made from the pair map (pair (j, k) biasing query j and key k of every
    row); ``ending``: around the ending node (the map transposed in and out)."""

    def __init__(self, dim=16, heads=2, ending=False):
        super().__init__()
        self.heads, self.ending = heads, ending
        self.to_qkv, self.to_bias = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, heads, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def attend(self, pair, hidden=None):
        """``hidden``: ((b i), 1, 1, j) bool, the keys of each row hidden."""
        if self.ending:
            pair = pair.transpose(1, 2)
        b, n, _, d = pair.shape
        rows = pair.reshape(b * n, n, d)  # the rows folded into the batch, item-major: (b i) j d
        q, k, v = self.to_qkv(rows).view(b * n, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        bias = self.to_bias(pair).permute(0, 3, 1, 2).repeat_interleave(n, dim=0)  # (b i) h j k: every row alike
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads) + bias
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        out = self.to_out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, n, d))
        return out.transpose(1, 2) if self.ending else out

    def forward(self, pair):
        return self.attend(pair)


@pytest.mark.parametrize("ending", [False, True])
def test_triangle_attention_over_a_pair_map_is_a_design(ending):
    # each pair depends on its own row (the attention) and on the row of its column's index (the bias): a pattern
    # that was read as queries seeing some future keys and missing past ones (definition-mismatch)
    from selfattn.check import check
    report = check(TrianglePairAttention(ending=ending), length=25)
    assert report.verdict == "passed", report.ids
    assert "triangle attention" in str(report.inferred.get("window"))


class ZeroedPaddingAttention(nn.Module):
    """x-transformers' habit: the outputs of padded queries zeroed after the attention. ``keys``: how the key mask is
    laid on the scores: "keys" (right), None (forgotten) or "queries" (on the query axis)."""

    def __init__(self, dim=32, heads=4, keys="keys"):
        super().__init__()
        self.heads, self.keys = heads, keys
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x, mask=None):  # mask (B, L), True = a real token
        b, n, c = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)
        if mask is not None and self.keys is not None:
            laid = mask[:, None, None, :] if self.keys == "keys" else mask[:, None, :, None]
            scores = scores.masked_fill(~laid, -torch.finfo(scores.dtype).max)
        out = scores.softmax(-1) @ v
        if mask is not None:
            out = out.masked_fill(~mask[:, None, :, None], 0.0)
        return self.to_out(out.transpose(1, 2).reshape(b, n, c))


def test_a_key_mask_forgotten_beside_padded_rows_zeroed_is_said_with_its_other_cause():
    # the only rows the mask changed were the padded queries' own, zeroed: named as a key mask laid on the queries
    # alone, whose fix points the wrong way when the keys were simply never masked. A mask on the query axis whose
    # rows a kernel gives 0 has the same output: the finding names both causes
    from selfattn.check import check
    assert check(ZeroedPaddingAttention()).verdict == "passed"
    for keys in (None, "queries"):
        report = check(ZeroedPaddingAttention(keys=keys))
        assert report.ids == {"mask-broadcast"}, report.ids
        assert "never masked" in report.findings[0].message


class CachedSlopesAttention(nn.Module):
    """Tranception's learned ALiBi: the bias made from learned slopes is cached in a buffer on the first call and
    reused while long enough; ``detached``: cached without its autograd history, and made again in training."""

    def __init__(self, dim=32, heads=4, detached=False):
        super().__init__()
        self.heads, self.detached = heads, detached
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.slopes = nn.Parameter(torch.tensor([2.0 ** -(i + 1) for i in range(heads)]).view(heads, 1, 1))
        self.register_buffer("bias", None, persistent=False)

    def alibi(self, n):
        if self.bias is not None and self.bias.shape[-1] >= n and not (self.detached and torch.is_grad_enabled()):
            return self.bias[..., :n, :n]
        r = torch.arange(n)
        bias = -(r[None, :] - r[:, None]).abs() * self.slopes
        self.register_buffer("bias", bias.detach() if self.detached else bias, persistent=False)
        return bias

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c // self.heads) + self.alibi(n)
        return self.to_out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def test_a_bias_cached_with_its_autograd_history_is_state_dependent():
    # every probe's call put the buffer back, so no second backward ever met the first call's graph: certified,
    # though a second training step fails
    from selfattn.check import check
    assert check(CachedSlopesAttention()).ids == {"state-dependent"}
    assert check(CachedSlopesAttention(detached=True)).verdict == "passed"


class CausalBlock(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, c))


class HourglassLM(nn.Module):
    """An hourglass language model: tokens averaged in pairs for a shorter middle stack, then repeated back. The
    causal version shifts the tokens by one before pooling, so that no pooled token holds a later one."""

    def __init__(self, vocab=50, dim=32, shift=True):
        super().__init__()
        self.shift, self.embed = shift, nn.Embedding(vocab, dim)
        self.pre, self.middle, self.post = CausalBlock(dim), CausalBlock(dim), CausalBlock(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.pre(self.embed(ids))
        pooled = F.pad(h, (0, 0, 1, -1)) if self.shift else h
        b, n, c = pooled.shape
        middle = self.middle(F.pad(pooled, (0, 0, 0, n % 2)).view(b, -1, 2, c).mean(2))  # an odd token pooled alone
        return self.head(self.post(h + middle.repeat_interleave(2, dim=1)[:, :n]))


def test_a_causal_model_whose_pooling_sees_ahead_is_causal_leak():
    # each attention layer hid the future and was certified, and so was the model, whose pooling averaged each token
    # with the next: with --causal, the model's own outputs are checked too
    for length in (12, 9):  # at an odd length, the last token is pooled alone: the one before it must be changed
        ids = torch.randint(0, 50, (2, length), generator=torch.Generator().manual_seed(0))
        assert check_model(HourglassLM(), (ids,), causal=True).verdict == "passed"
        leaky = check_model(HourglassLM(shift=False), (ids,), causal=True)
        assert leaky.verdict == "failed" and [f.id for f in leaky.findings] == ["causal-leak"]
        assert all(r.verdict == "passed" for r in leaky.layers.values())


class _JoinedProjection(nn.Module):
    """q, k and v of the tokens joined with their positions: its own width (``dim``) is twice the tokens'."""

    def __init__(self, dim, heads):
        super().__init__()
        self.dim, self.heads = dim, heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, joined):
        b, n, _ = joined.shape
        return self.qkv(joined).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)


class ConcatPositionAttention(nn.Module):
    """Learned positions concatenated to the tokens (not added) before the projections: the projection block holds
    twice the input's width as its ``dim``, and every layer of the module takes that width."""

    def __init__(self, dim, heads=4, max_len=64):
        super().__init__()
        self.positions = nn.Embedding(max_len, dim)
        self.project, self.out = _JoinedProjection(2 * dim, heads), nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        joined = torch.cat((x, self.positions.weight[:n].expand(b, -1, -1)), dim=-1)
        q, k, v = self.project(joined)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 2 * c))


def test_the_width_a_module_is_built_with_is_tried_first():
    # the width its projection block holds (2 x dim) was the only one tried: no input the module takes, exit 2
    from selfattn.check import check
    report = check(ConcatPositionAttention, init={"dim": 32})
    assert report.inferred["embed_dim"] == 32 and report.verdict == "passed", report.ids


class BlockMaskArgumentAttention(nn.Module):
    """Attention that takes FlexAttention's BlockMask from its caller (native sparse attention's sliding-window
    mask), built once for a length and passed down."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x, sliding_window_flex_mask=None):
        from torch.nn.attention.flex_attention import flex_attention
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = flex_attention(q, k, v, block_mask=sliding_window_flex_mask)
        return self.out(out.transpose(1, 2).reshape(b, n, c))


def test_an_argument_that_takes_a_block_mask_is_no_tensor_mask():
    # every tensor mask raised on the BlockMask's attributes: the mask was "not verified" and the module inconclusive
    from selfattn.check import check
    report = check(BlockMaskArgumentAttention())
    assert report.verdict == "passed" and "BlockMask" in report.coverage["mask"], report.coverage


def test_a_model_calling_flex_attention_is_recorded():
    # the model's recording run has autograd on, where flex_attention on CPU refuses inputs that require grad: the
    # model could not run (exit 2), though each layer checks alone
    blocks = nn.Sequential(nn.Linear(8, 32), FlexModAttention(), FlexModAttention())
    x = torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(0))
    report = check_model(blocks, (x,))
    assert report.verdict == "passed" and len(report.layers) == 2, (report.could_not_run, report.summary())


class LazyMaskCacheAttention(nn.Module):
    """A causal mask made on the first call (no slot for it in __init__), then cut to each call's length and stored
    back, so that a longer call after a shorter one fails; ``in_dict``: kept in a dict made on the first call."""

    def __init__(self, dim=32, heads=4, in_dict=False):
        super().__init__()
        self.heads, self.in_dict = heads, in_dict
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        if self.in_dict:
            if not hasattr(self, "store"):
                self.store = {"mask": torch.ones(64, 64, dtype=torch.bool).tril()}
            self.store["mask"] = mask = self.store["mask"][:n, :n]
        else:
            if not hasattr(self, "mask"):
                self.mask = torch.ones(64, 64, dtype=torch.bool).tril()
            self.mask = mask = self.mask[:n, :n]
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("in_dict", [False, True])
def test_a_mask_made_on_the_first_call_and_cut_to_it_is_state_dependent(in_dict):
    # state absent before the first call counted as a cache that grew, and a dict of tensors made then as no state
    # at all: the next, longer call failed, and the module was certified
    from selfattn.check import check
    assert check(LazyMaskCacheAttention(in_dict=in_dict)).ids == {"state-dependent"}


class MaskedEfficientAttention(EfficientAttention):
    """Efficient attention with a key padding mask filled into k before its softmax over the tokens, and into v."""

    def forward(self, x, input_mask=None):
        q, k, v = self.split(x)
        if input_mask is not None:
            keep = input_mask[:, None, :, None]
            k, v = k.masked_fill(~keep, torch.finfo(k.dtype).min), v.masked_fill(~keep, 0.0)
        return self.attend(q, k, v)


def test_efficient_attention_with_its_keys_padded_is_still_its_own_design():
    # k filled with the padding before its softmax hid that softmax's projection: it was read as softmax-dim
    from selfattn.check import check
    assert check(MaskedEfficientAttention()).ids == {"definition-mismatch"}
    assert check(MaskedEfficientAttention(), allow_nonstandard=True).verdict == "passed"


class BlockedLocalAttention(nn.Module):
    """local-attention's causal windows: the tokens cut into windows, each query sees its window up to itself and
    ``back`` windows before it whole; ``own``: False hides the query's own token (a bug)."""

    def __init__(self, dim=32, heads=4, window=4, back=1, own=True):
        super().__init__()
        self.heads, self.window, self.back, self.own = heads, window, back, own
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(n)
        blocks = i // self.window
        visible = (i[None, :] <= i[:, None] if self.own else i[None, :] < i[:, None]) & \
            (blocks[None, :] >= blocks[:, None] - self.back)
        visible[0, 0] = True  # the first query keeps one key
        scores = (q @ k.transpose(-1, -2) / math.sqrt(c // self.heads)).masked_fill(~visible, float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def test_causal_windows_that_look_back_a_block_are_a_design():
    # a query sees its block up to itself and the block before whole: "hides past keys, in no window" (causal-leak)
    from selfattn.check import check
    report = check(BlockedLocalAttention(), causal=True, length=16)
    assert report.verdict == "passed", report.ids
    assert "blocked local attention" in str(report.inferred["window"])
    assert "causal-leak" in check(BlockedLocalAttention(own=False), causal=True, length=16).ids


class FourierMixedAttention(nn.Module):
    """Attention beside a token mixing through the FFT (Mega's EMA computed as a long convolution), which the CPU
    does not run in float16 or bfloat16."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.decay = nn.Parameter(torch.rand(dim))

    def forward(self, x):
        b, n, c = x.shape
        spectrum = torch.fft.rfft(x, n=2 * n, dim=1) * torch.fft.rfft(self.decay ** torch.arange(n)[:, None], n=2 * n,
                                                                      dim=0)
        x = x + torch.fft.irfft(spectrum, n=2 * n, dim=1)[:, :n]
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, c))


def test_half_precision_every_run_of_which_the_device_refused_is_not_said_verified():
    # both half-precision runs were "not run" (an operation the CPU lacks in them), and the coverage said verified;
    # what the device lacks is reported, not held against the module
    from selfattn.check import check
    report = check(FourierMixedAttention(), causal=True)
    if all(str(v).startswith("not run") for v in report.inferred.get("half precision", {}).values()):
        assert report.coverage["half_precision"].startswith("not applicable") and report.verdict == "passed"
    else:  # a torch whose CPU runs the FFT in half precision: verified as any other
        assert report.coverage["half_precision"] == "verified"


class MaskedTrianglePairAttention(TrianglePairAttention):
    """The same with AlphaFold's optional pair mask (B, N, N): the keys of each row that it hides."""

    def forward(self, pair, mask=None):
        if mask is None:
            return self.attend(pair)
        batch, rows, keys = mask.shape  # (b i j) -> ((b i), 1, 1, j), as einops spells it
        return self.attend(pair, ~mask.reshape(batch * rows, 1, 1, keys))


class PairStack(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.blocks = nn.ModuleList(MaskedTrianglePairAttention(dim) for _ in range(2))

    def forward(self, pair):
        for block in self.blocks:
            pair = pair + block(pair)
        return pair


def test_a_layers_mask_the_model_never_passes_is_not_judged_in_the_model():
    # the pair mask takes no (B, L) or (B, L, L) mask of the map's tokens, so it was "not verified" and each layer
    # inconclusive, though the model passes none and pads nothing
    report = check_model(PairStack(), (torch.randn(2, 5, 5, 16, generator=torch.Generator().manual_seed(0)),))
    assert report.verdict == "passed", report.summary()
    assert all(r.coverage["mask"].startswith("not applicable") for r in report.layers.values())

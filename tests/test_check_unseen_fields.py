"""The doctor on attention from fields its other tests do not cover: memory and register tokens, recommender and
tabular code, graph and set models.

Each module is written in the style of the code base it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from selfattn.check import CannotRun, check


# -- memory / register tokens joined to the tokens inside the module (x-transformers, ViT registers) ----------------
def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, -1)
    return torch.cat((-b, a), -1)


def _rotate_pairs(t: torch.Tensor) -> torch.Tensor:
    return torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)


class MemoryTokenAttention(nn.Module):
    """x-transformers' ``num_memory_tokens``: learned tokens put before the tokens (``first``) or after them (ViT
    registers), attended with them, their outputs dropped; rotary over every position when ``rotary``. ``bug``:
    "unscaled", "merge" (heads merged without their transpose) or "k-pairs" (k rotated by interleaved pairs)."""

    def __init__(self, dim: int = 64, heads: int = 4, memory: int = 2, first: bool = True, rotary: bool = False,
                 bug: str | None = None) -> None:
        super().__init__()
        self.h, self.m, self.first, self.rotary, self.bug = heads, memory, first, rotary, bug
        self.memory_tokens = nn.Parameter(torch.randn(memory, dim))
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        mem = self.memory_tokens.expand(b, -1, -1)
        x = torch.cat((mem, x) if self.first else (x, mem), dim=1)
        total, d = n + self.m, e // self.h
        q, k, v = self.to_qkv(x).view(b, total, 3, self.h, d).permute(2, 0, 3, 1, 4)
        if self.rotary:
            f = torch.outer(torch.arange(total, dtype=x.dtype), 1.0 / 10000 ** (torch.arange(0, d, 2).to(x) / d))
            half = torch.cat((f, f), -1)
            q = q * half.cos() + _rotate_half(q) * half.sin()
            if self.bug == "k-pairs":
                pairs = f.repeat_interleave(2, -1)
                k = k * pairs.cos() + _rotate_pairs(k) * pairs.sin()
            else:
                k = k * half.cos() + _rotate_half(k) * half.sin()
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 if self.bug == "unscaled" else None)
        out = out.reshape(b, total, e) if self.bug == "merge" else out.transpose(1, 2).reshape(b, total, e)
        return self.to_out(out[:, self.m:] if self.first else out[:, :n])


@pytest.mark.parametrize("first", [True, False], ids=["memory-first", "registers-last"])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_memory_tokens_joined_inside_the_module_are_a_design(first, rotary):
    """catches: learned tokens joined to the tokens inside the module were definition-mismatch ("the attention runs
    over an axis of size L + M, not the L tokens"); the attention is read over both, and said."""
    torch.manual_seed(0)
    report = check(MemoryTokenAttention(first=first, rotary=rotary))
    assert report.passed, report.findings
    assert "memory tokens" in report.inferred["design"], report.inferred


@pytest.mark.parametrize(("bug", "expected"), [("unscaled", "missing-scale"), ("merge", "head-merge"),
                                               ("k-pairs", "rotary-mismatch")])
def test_a_bug_beside_memory_tokens_is_named(bug, expected):
    """catches: with the attention read over the memory and the tokens, the heads' merge, the scale and the rotary
    are read on them too (the token swap and the repeated token land M rows further)."""
    torch.manual_seed(0)
    report = check(MemoryTokenAttention(rotary=bug == "k-pairs", bug=bug))
    assert expected in report.ids, report.findings


# -- attention with no projections (d2l's DotProductAttention called with x thrice, a wide model) ------------------
class NoProjectionAttention(nn.Module):
    """softmax(x x^T / sqrt(E)) x: the teaching code's first attention, no weights; ``scaled`` False drops the
    scale (the bug)."""

    def __init__(self, scaled: bool = True) -> None:
        super().__init__()
        self.scaled = scaled

    def forward(self, queries, keys, values):
        scores = torch.bmm(queries, keys.transpose(1, 2))
        if self.scaled:
            scores = scores / queries.shape[-1] ** 0.5
        return torch.bmm(scores.softmax(-1), values)


@pytest.mark.parametrize("scaled", [True, False], ids=["correct", "unscaled"])
def test_a_module_whose_weights_are_one_hot_on_the_probe_input_is_probed_on_a_smaller_one(scaled):
    """catches: with no projection and 512 features, x x^T is dominated by its diagonal, each token's weight on its
    own key is 1 and the output is the input: the doctor read it as a residual around a zero branch and could not
    run it (exit 2, "the output does not depend on its input"). The probe input is scaled down until tokens mix."""
    torch.manual_seed(0)
    report = check(NoProjectionAttention(scaled), embed_dim=512)
    assert "input scale" in report.inferred, report.inferred
    if scaled:
        assert report.passed, report.findings
    else:
        assert "missing-scale" in report.ids, report.findings


# -- Peter Bloem's "transformers from scratch": SelfAttention(emb, heads), tokeys called before toqueries ---------
class BloemSelfAttention(nn.Module):
    """The blog's wide self-attention: heads folded into the batch, keys computed first. ``bug``: "softmax-dim1"
    (softmax over the queries) or "weights-transposed" (the weights transposed before the values)."""

    bug: str | None = None

    def __init__(self, emb: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.tokeys = nn.Linear(emb, emb, bias=False)
        self.toqueries = nn.Linear(emb, emb, bias=False)
        self.tovalues = nn.Linear(emb, emb, bias=False)
        self.unifyheads = nn.Linear(emb, emb)

    def forward(self, x):
        b, t, e = x.size()
        h, s = self.heads, e // self.heads
        keys, queries, values = self.tokeys(x), self.toqueries(x), self.tovalues(x)
        keys = keys.view(b, t, h, s).transpose(1, 2).contiguous().view(b * h, t, s)
        queries = queries.view(b, t, h, s).transpose(1, 2).contiguous().view(b * h, t, s)
        values = values.view(b, t, h, s).transpose(1, 2).contiguous().view(b * h, t, s)
        dot = torch.bmm(queries, keys.transpose(1, 2)) / s ** 0.5
        dot = F.softmax(dot, dim=1 if self.bug == "softmax-dim1" else 2)
        if self.bug == "weights-transposed":
            dot = dot.transpose(1, 2)
        out = torch.bmm(dot, values).view(b, h, t, s).transpose(1, 2).contiguous().view(b, t, h * s)
        return self.unifyheads(out)


@pytest.mark.parametrize(("bug", "expected"), [(None, None), ("softmax-dim1", "softmax-dim"),
                                               ("weights-transposed", "matmul-order")])
def test_projections_named_tokeys_and_toqueries_take_their_roles_by_name(bug, expected):
    """catches: a constructor width named ``emb`` could not be built, and projections named ``tokeys`` and
    ``toqueries`` took their roles in call order (keys first), which swapped softmax-dim and matmul-order."""
    torch.manual_seed(0)
    report = check(type("Former", (BloemSelfAttention,), {"bug": bug}))
    if expected is None:
        assert report.passed, report.findings
    else:
        assert report.ids & {"softmax-dim", "matmul-order"} == {expected}, report.findings


# -- kang205's SASRec fill, -2**32 + 1, which float16 cannot hold -------------------------------------------------
class HugeFillAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, mask):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2) / (e // self.h) ** 0.5).masked_fill(~mask[:, None, None, :], -2 ** 32 + 1)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)


def test_half_precision_evidence_is_the_modules_own_error():
    """catches: a bool mask whose half-precision run raised for the module's own reason (a fill float16 cannot
    hold) was retried as 0/1 values, and the evidence quoted that retry's error (masked_fill wants a bool mask),
    a cast the doctor made."""
    torch.manual_seed(0)
    report = check(HugeFillAttention(), mask="keep (B,L)")
    (found,) = [f for f in report.findings if f.id == "half-precision-overflow"]
    said = str(found.evidence)
    assert "boolean" not in said.lower() and "invert" not in said and "overflow" in said, said


# -- kang205's SASRec (TensorFlow) ported: masks read off the data, torch.where with a constant fill -------------
class TFSASRecAttention(nn.Module):
    """Heads split by torch.split / cat on the batch, keys' padding read as sign(|sum(keys)|), masks applied with
    where(mask == 0, ones_like(scores) * (-2**32 + 1), scores), no output projection, the input added back."""

    def __init__(self, num_units: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.Q, self.K, self.V = (nn.Linear(num_units, num_units) for _ in range(3))
        self.num_heads = num_heads

    def forward(self, queries):
        h, keys = self.num_heads, queries
        q, k, v = self.Q(queries), self.K(keys), self.V(keys)
        q_, k_, v_ = (torch.cat(torch.split(t, t.shape[-1] // h, dim=2), dim=0) for t in (q, k, v))
        outputs = q_ @ k_.transpose(1, 2) / k_.shape[-1] ** 0.5
        key_masks = torch.sign(torch.abs(keys.sum(-1))).repeat(h, 1).unsqueeze(1).repeat(1, queries.shape[1], 1)
        paddings = torch.ones_like(outputs) * (-2 ** 32 + 1)
        outputs = torch.where(key_masks == 0, paddings, outputs)
        tril = torch.tril(torch.ones_like(outputs[0, :, :]))
        outputs = torch.where(tril.unsqueeze(0).repeat(outputs.shape[0], 1, 1) == 0, paddings, outputs)
        outputs = torch.softmax(outputs, dim=-1) @ v_
        return torch.cat(torch.split(outputs, q.shape[0], dim=0), dim=2) + queries


def test_masks_applied_with_where_and_a_constant_fill_are_read_as_masks():
    """catches: kang205's SASRec, whose masks are applied with torch.where(mask == 0, ones_like(scores) * fill,
    scores), was definition-mismatch ("the scores pass through eq() between the product and the softmax"): the walk
    back from the softmax followed the condition. It follows the one input that is not a constant fill."""
    torch.manual_seed(0)
    report = check(TFSASRecAttention(), causal=True)
    assert report.passed, report.findings


# -- a graph attention whose forward requires the adjacency: forward(h, adj) -------------------------------------
class DenseGraphAttention(nn.Module):
    def __init__(self, in_dim: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.h = num_heads
        self.Q, self.K, self.V = (nn.Linear(in_dim, in_dim) for _ in range(3))

    def forward(self, h, adj):
        b, n, e = h.shape
        q, k, v = (f(h).view(b, n, self.h, -1).transpose(1, 2) for f in (self.Q, self.K, self.V))
        score = (q @ k.transpose(-1, -2) / (e // self.h) ** 0.5).masked_fill(adj.unsqueeze(1) == 0, -1e4)
        return (score.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)


def test_a_stated_mask_goes_to_the_one_argument_forward_requires():
    """catches: with --mask stated, a module whose forward requires one more argument not named like a mask
    (a graph's adj) could not run: the doctor called forward(x) alone. The stated mask goes there."""
    torch.manual_seed(0)
    report = check(DenseGraphAttention(), mask="keep-int (B,L,L)")
    assert report.passed, report.findings


# -- LDM's SpatialSelfAttention: channels first, the values product written as an einsum of v and w^T --------------
class SpatialSelfAttention(nn.Module):
    """ldm/modules/attention.py: 1 x 1 convolutions on a (B, C, H, W) map, w_ = softmax(q k / sqrt(C)) over the keys,
    then einsum('bij,bjk->bik', v, w_^T), channels first. ``untransposed``: the bug, w_ not transposed (the
    product contracts the queries)."""

    def __init__(self, in_channels: int = 32, untransposed: bool = False) -> None:
        super().__init__()
        self.untransposed = untransposed
        self.norm = nn.GroupNorm(8, in_channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(in_channels, in_channels, 1) for _ in range(4))

    def forward(self, x):
        h_ = self.norm(x)
        q, k, v = self.q(h_), self.k(h_), self.v(h_)
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w).permute(0, 2, 1)
        k = k.reshape(b, c, h * w)
        w_ = torch.einsum("bij,bjk->bik", q, k) * (int(c) ** (-0.5))
        w_ = F.softmax(w_, dim=2)
        v = v.reshape(b, c, h * w)
        if not self.untransposed:
            w_ = w_.permute(0, 2, 1)
        h_ = torch.einsum("bij,bjk->bik", v, w_).reshape(b, c, h, w)
        return x + self.proj_out(h_)


@pytest.mark.parametrize("untransposed", [False, True], ids=["correct", "weights-not-transposed"])
def test_a_channels_first_einsum_of_v_and_the_transposed_weights_is_the_definition(untransposed):
    """catches: LDM's einsum('bij,bjk->bik', v, w_^T), which contracts the keys and gives the output channels first,
    was matmul-order ("weights transposed before V"); only a matmul was read that way."""
    torch.manual_seed(0)
    report = check(SpatialSelfAttention(untransposed=untransposed))
    if untransposed:
        assert "matmul-order" in report.ids, report.findings
    else:
        assert report.passed, report.findings


# -- a heads-first tensor re-viewed as (B, L, H, D) (Flux-style fused qkv), at a length no multiple of the heads ----
class ReviewedHeads(nn.Module):
    """qkv laid out (3, B, H, L, D) by a permute; ``role`` ("q", "k" or "v") is then re-viewed with
    reshape(B, L, H, D).transpose(1, 2) as if it were still tokens-first: the bug."""

    def __init__(self, dim: int = 64, heads: int = 4, role: str | None = None) -> None:
        super().__init__()
        self.h, self.role = heads, role
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        if self.role == "q":
            q = q.reshape(b, n, self.h, -1).transpose(1, 2)
        elif self.role == "k":
            k = k.reshape(b, n, self.h, -1).transpose(1, 2)
        elif self.role == "v":
            v = v.reshape(b, n, self.h, -1).transpose(1, 2)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("role", [None, "q", "k", "v"])
def test_a_heads_first_tensor_re_viewed_as_tokens_first_is_a_head_split_at_any_length(role):
    """catches: at 7 tokens and 4 heads, re-viewing a (B, H, L, D) tensor as (B, L, H, D) leaves each head with two
    changed rows when two tokens are swapped (but other rows than theirs), and was certified; only lengths that are
    a multiple of the heads were caught. The rows of all heads together hold the swap on five positions."""
    torch.manual_seed(0)
    report = check(ReviewedHeads(role=role), length=7)
    if role is None:
        assert report.passed, report.findings
    else:
        assert "head-split" in report.ids, report.findings


# -- Flux's rope: 2 x 2 rotation matrices applied by apply_rope, through SDPA ---------------------------------------
def _apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    pairs = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    out = freqs[..., 0] * pairs[..., 0] + freqs[..., 1] * pairs[..., 1]
    return out.reshape(*x.shape).type_as(x)


class FluxStyleAttention(nn.Module):
    """Flux's SelfAttention in short: fused qkv, rope as (L, D/2, 2, 2) rotation matrices, SDPA. ``rope_on_v``: the
    bug, v rotated too."""

    def __init__(self, dim: int = 64, heads: int = 4, rope_on_v: bool = False) -> None:
        super().__init__()
        self.h, self.rope_on_v = heads, rope_on_v
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        d = e // self.h
        q, k, v = self.qkv(x).reshape(b, n, 3, self.h, d).permute(2, 0, 3, 1, 4)
        angle = torch.outer(torch.arange(n, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
        freqs = torch.stack([angle.cos(), -angle.sin(), angle.sin(), angle.cos()], -1).reshape(n, d // 2, 2, 2)
        q, k = _apply_rope(q, freqs), _apply_rope(k, freqs)
        if self.rope_on_v:
            v = _apply_rope(v, freqs)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("rope_on_v", [False, True], ids=["correct", "rope-on-v"])
def test_values_changed_by_a_term_of_the_input_are_read_through_sdpa_too(rope_on_v):
    """catches: Flux's rope applied to v as well, as a sum of products with a table (no rotate_half to recognise),
    was certified through SDPA: the values' term from the input was read only for a softmax written out."""
    torch.manual_seed(0)
    report = check(FluxStyleAttention(rope_on_v=rope_on_v))
    if rope_on_v:
        assert "values-changed" in report.ids, report.findings
    else:
        assert report.passed, report.findings


# -- x-transformers' per-head RMS norms: F.normalize(t, dim=-1) * sqrt(dim_head) * (gamma + 1) --------------------
class HeadRMSNormAttention(nn.Module):
    """x-transformers' ``k_rmsnorm`` / ``qk_rmsnorm``: the keys (``both``: the queries too) RMS-normed per head as a
    unit norm times sqrt(dim_head) and a learned gain, then the usual 1/sqrt(dim_head) (``unscaled``: left out)."""

    def __init__(self, dim: int = 64, heads: int = 4, both: bool = False, unscaled: bool = False) -> None:
        super().__init__()
        self.h, self.both, self.unscaled = heads, both, unscaled
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim, bias=False)
        self.k_gamma = nn.Parameter(torch.zeros(heads, 1, dim // heads))
        self.q_gamma = nn.Parameter(torch.zeros(heads, 1, dim // heads))

    def forward(self, x):
        b, n, e = x.shape
        d = e // self.h
        q, k, v = (f(x).view(b, n, self.h, d).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        k = F.normalize(k, dim=-1) * d ** 0.5 * (self.k_gamma + 1.0)
        if self.both:
            q = F.normalize(q, dim=-1) * d ** 0.5 * (self.q_gamma + 1.0)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * (1.0 if self.unscaled else d ** -0.5)
        out = torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize(("both", "unscaled", "expected"), [(False, False, None), (True, False, None),
                                                            (False, True, "missing-scale")])
def test_keys_rms_normed_as_a_unit_norm_times_sqrt_d_keep_their_scale(both, unscaled, expected):
    """catches: keys RMS-normed as F.normalize(k) * sqrt(dim_head) were read as scaled by sqrt(dim_head), so the
    correct 1/sqrt(dim_head) after them came out as no scale at all (missing-scale on correct code); that sqrt(d)
    is the norm's own."""
    torch.manual_seed(0)
    report = check(HeadRMSNormAttention(both=both, unscaled=unscaled))
    if expected is None:
        assert report.passed, report.findings
    else:
        assert expected in report.ids, report.findings


class XPosMemoryKVAttention(nn.Module):
    """x-transformers' ``rotary_xpos`` with ``attn_num_mem_kv``: rotary positions that also scale q by s^(i/512) and
    k by s^(-i/512) per frequency (xPos), then learned memory keys and values put before the keys. ``bug``:
    "k-pairs" rotates k by interleaved pairs where q is rotated by halves."""

    def __init__(self, dim: int = 64, heads: int = 4, memory: int = 2, bug: str | None = None,
                 scale_first: bool = False) -> None:
        super().__init__()
        self.h, self.bug, self.scale_first = heads, bug, scale_first
        d = dim // heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim, bias=False)
        self.mem_k = nn.Parameter(torch.randn(heads, memory, d))
        self.mem_v = nn.Parameter(torch.randn(heads, memory, d))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("xpos", (torch.arange(0, d, 2).float() + 0.4 * d) / (1.4 * d))

    def forward(self, x):
        b, n, e = x.shape
        d = e // self.h
        q, k, v = (f(x).view(b, n, self.h, d).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        t = torch.arange(n, dtype=x.dtype)
        freqs = torch.cat([torch.outer(t, self.inv_freq)] * 2, -1)
        power = (t - n // 2)[:, None] / 512
        scale = torch.cat([self.xpos] * 2)[None, :] ** power
        if self.scale_first:  # local-attention's order: q scaled, then rotated
            q = q * d ** -0.5
        q = q * freqs.cos() * scale + _rotate_half(q) * freqs.sin() * scale
        turn = _rotate_pairs if self.bug == "k-pairs" else _rotate_half
        k = k * freqs.cos() / scale + turn(k) * freqs.sin() / scale
        k = torch.cat((self.mem_k.expand(b, -1, -1, -1), k), dim=-2)
        v = torch.cat((self.mem_v.expand(b, -1, -1, -1), v), dim=-2)
        w = (q @ k.transpose(-1, -2) * (1.0 if self.scale_first else d ** -0.5)).softmax(-1)
        return self.to_out((w @ v).transpose(1, 2).reshape(b, n, e))


def test_a_scale_applied_before_xpos_rotary_counts():
    """catches: q scaled by 1/sqrt(d) before an xPos rotation (local-attention's LocalMHA(use_xpos=True)) was
    missing-scale: the walk back from the scores stopped at the rotation, which is no pure one (it scales each row);
    it goes on to the tensor the rotation was made from. (Here q's size alone also tells a scale folded into it.)"""
    torch.manual_seed(0)
    report = check(XPosMemoryKVAttention(scale_first=True))
    assert report.passed, report.findings
    assert "scaled by 0.25 = 1/sqrt(16)" in report.inferred["white box"]["without mask"], report.inferred


@pytest.mark.parametrize(("bug", "expected"), [(None, None), ("k-pairs", "rotary-mismatch")])
def test_memory_keys_joined_after_xpos_rotary_are_not_read_as_part_of_the_rotation(bug, expected):
    """catches: xPos keys with memory keys put before them were read as one rotated operand: the memory part is no
    rotation, so the xPos decay was named rotary-mismatch (x-transformers' Decoder(rotary_xpos=True,
    attn_num_mem_kv=2)); the tokens' part of the keys is read."""
    torch.manual_seed(0)
    report = check(XPosMemoryKVAttention(bug=bug), causal=False)
    if expected is None:
        assert report.passed, report.findings
    else:
        assert expected in report.ids, report.findings


# -- torchscale's MultiheadAttention: q scaled in place, NaN scores zeroed before the additive mask ----------------
class TorchscaleStyleAttention(nn.Module):
    """torchscale's layer called by its Decoder: ``q *= self.scaling``, heads folded into the batch, ``nan_to_num``
    on the scores, then the -inf causal mask added in place, and its sub-LayerNorm (``subln``) before the output
    projection. ``unscaled``: the in-place scaling left out."""

    def __init__(self, dim: int = 64, heads: int = 4, unscaled: bool = False) -> None:
        super().__init__()
        self.h, self.unscaled = heads, unscaled
        self.scaling = (dim // heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.inner_attn_ln = nn.LayerNorm(dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if not self.unscaled:
            q *= self.scaling
        q, k, v = (t.view(b, n, self.h, -1).transpose(1, 2).reshape(b * self.h, n, -1) for t in (q, k, v))
        attn_mask = torch.triu(torch.zeros(n, n).fill_(float("-inf")), 1)
        w = torch.bmm(q, k.transpose(1, 2))
        w = torch.nan_to_num(w)
        w += attn_mask.unsqueeze(0)
        out = torch.bmm(F.softmax(w, dim=-1), v)
        return self.out_proj(self.inner_attn_ln(out.view(b, self.h, n, -1).transpose(1, 2).reshape(b, n, e)))


@pytest.mark.parametrize(("unscaled", "expected"), [(False, None), (True, "missing-scale")])
def test_scores_through_nan_to_num_are_read(unscaled, expected):
    """catches: torchscale's nan_to_num between the score product and the softmax stopped the reading of the
    scores (definition-mismatch, "the scores pass through nan_to_num()"); on finite scores it changes nothing."""
    torch.manual_seed(0)
    report = check(TorchscaleStyleAttention(unscaled=unscaled))
    if expected is None:
        assert report.passed, report.findings
    else:
        assert expected in report.ids, report.findings


# -- x-transformers' pre_scale_post_talking_heads: the weights scaled after the softmax by a mix of the heads' scores --
class PreScalePostTalkingHeads(nn.Module):
    """x-transformers' Attend with ``pre_scale_post_talking_heads``: a 1x1 convolution over the heads of the scaled
    scores, which then multiplies the softmax's weights (its "improvisation"). ``masked``: a 0/1 causal mask
    multiplied into the weights after the softmax instead (a bug). ``gate``: one learned number per head multiplies
    the weights instead (the same as scaling each head's output), after ``masked``'s mask if both."""

    def __init__(self, dim: int = 64, heads: int = 4, masked: bool = False, gate: bool = False) -> None:
        super().__init__()
        self.h, self.masked, self.gate = heads, masked, gate
        self.head_gate = nn.Parameter(torch.rand(1, heads, 1, 1) + 0.5)
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.pre_scale_post_talking_heads = nn.Conv2d(heads, heads, 1, bias=False)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.h, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, -1))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * (e // self.h) ** -0.5
        attn = sim.softmax(-1)
        if self.masked:
            attn = attn * torch.ones(n, n).tril()
        if self.gate:
            attn = attn * self.head_gate
        elif not self.masked:
            attn = attn * self.pre_scale_post_talking_heads(sim)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize(("masked", "gate", "allow", "expected"), [
    (False, False, False, "definition-mismatch"), (False, False, True, None),
    (True, False, False, "mask-after-softmax"), (False, True, False, None), (True, True, False, "mask-after-softmax")])
def test_weights_rescaled_after_the_softmax_by_a_dense_term_are_no_mask(masked, gate, allow, expected):
    """catches: weights multiplied after the softmax by a term of the scores (a mix of the heads) were named
    mask-after-softmax, even with --allow-nonstandard; a mask multiplies by 0 or 1, this by many values: it follows
    no formula of attention (definition-mismatch, which the user may allow). A 0/1 mask there stays
    mask-after-softmax, with a gate per head or not; a gate per head alone scales each head's output (it was
    definition-mismatch)."""
    torch.manual_seed(0)
    report = check(PreScalePostTalkingHeads(masked=masked, gate=gate), allow_nonstandard=allow)
    if expected is None:
        assert report.passed, report.findings
    else:
        assert expected in report.ids, report.findings


# -- older transformers decoders (LLaMA in transformers 4.28, Baichuan, InternLM): the scores floored at finfo.min --
class FlooredScoresAttention(nn.Module):
    """Baichuan2-13B's order: the scores plus an ALiBi bias with the future hidden, the additive mask added, then
    ``torch.max(scores, torch.tensor(finfo.min))`` (``clamp``: ``scores.clamp(min=finfo.min)``) so that -inf plus a
    mask stays finite. ``scale``: the scale on the scores."""

    def __init__(self, dim: int = 64, heads: int = 4, clamp: bool = False, scale: float | None = None) -> None:
        super().__init__()
        self.h, self.clamp = heads, clamp
        self.scale = scale if scale is not None else (dim // heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, hidden_states, attention_mask=None):
        b, n, e = hidden_states.shape
        q, k, v = (f(hidden_states).view(b, n, self.h, -1).transpose(1, 2) for f in (self.q_proj, self.k_proj,
                                                                                     self.v_proj))
        i = torch.arange(n)
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.h + 1) / self.h)
        future = torch.full((n, n), float("-inf")).triu(1)  # Baichuan's future_mask: ALiBi over the keys, causal
        w = q @ k.transpose(2, 3) * self.scale + slopes[:, None, None] * i[None, None, :] + future
        if attention_mask is not None:
            w = w + attention_mask
            low = torch.finfo(w.dtype).min
            w = w.clamp(min=low) if self.clamp else torch.max(w, torch.tensor(low))
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((w @ v).transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("clamp", [False, True], ids=["max", "clamp"])
@pytest.mark.parametrize(("scale", "expected"), [(None, None), (1 / 8, "wrong-scale")])
def test_scores_floored_at_finfo_min_are_read(clamp, scale, expected):
    """catches: torch.max(scores, finfo.min) after the mask (the older transformers decoders', Baichuan's) stopped
    the reading of the scores under a mask (definition-mismatch, "the scores pass through max()"); it only lifts
    -inf to the lowest finite number."""
    torch.manual_seed(0)
    report = check(FlooredScoresAttention(clamp=clamp, scale=scale))
    if expected is None:
        assert report.passed, report.findings
    else:
        assert expected in report.ids, report.findings


# -- remote-code LLMs: Phi-1.5's packed rotary rejoined to v, Qwen-1's log-n scaling of q ---------------------------
def _rope_tables(n: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


class PhiStyleMHA(nn.Module):
    """Phi-1.5's remote code: Wqkv viewed (B, L, 3, H, D), rotary on the first ``rotary_dim`` dims of q and k (halves),
    then ``torch.cat([q, k, qkv[:, :, 2:3]], 2)`` and ``unbind``: v passes the rejoin unrotated. ``bug``: "k-sign"
    rotates k the other way."""

    def __init__(self, dim: int = 64, heads: int = 4, rotary_dim: int = 8, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.rd, self.bug = heads, rotary_dim, bug
        self.Wqkv, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        qkv = self.Wqkv(x).view(b, n, 3, self.h, e // self.h)
        cos, sin = (t[:, None, :] for t in _rope_tables(n, self.rd, x.dtype))

        def turn(t, sign=1.0):
            t1, t2 = t[..., :self.rd].chunk(2, -1)
            return torch.cat([t1 * cos - sign * t2 * sin, sign * t1 * sin + t2 * cos, t[..., self.rd:]], -1)

        q = turn(qkv[:, :, 0]).unsqueeze(2)
        k = turn(qkv[:, :, 1], -1.0 if self.bug == "k-sign" else 1.0).unsqueeze(2)
        q, k, v = torch.cat([q, k, qkv[:, :, 2:3]], dim=2).unbind(dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(q.shape[-1]))
        scores = scores + torch.triu(torch.full((n, n), -10000.0, dtype=scores.dtype), 1)
        out = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)
        return self.out_proj(out.reshape(b, n, e))


class QwenStyleAttention(nn.Module):
    """Qwen-1: rotary by halves, then q at position i past the training length (``seq_length``) multiplied by
    log_{seq_length}(i) (``use_logn_attn``), causal SDPA. ``bug``: "logn-key" scales k instead."""

    def __init__(self, dim: int = 64, heads: int = 4, seq_length: int = 3, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.bug = heads, bug
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim, bias=False)
        logn = [math.log(i, seq_length) if i > seq_length else 1.0 for i in range(1, 64)]
        self.register_buffer("logn_tensor", torch.tensor(logn)[None, :, None, None], persistent=False)

    def forward(self, hidden_states):
        b, n, e = hidden_states.shape
        d = e // self.h
        q, k, v = (t.view(b, n, self.h, d) for t in self.c_attn(hidden_states).split(e, dim=2))
        cos, sin = (torch.cat([t, t], -1)[None, :, None, :] for t in _rope_tables(n, d, hidden_states.dtype))
        q, k = (t * cos + _rotate_half(t) * sin for t in (q, k))
        if self.bug == "logn-key":
            k = k * self.logn_tensor[:, :n].type_as(k)
        else:
            q = q * self.logn_tensor[:, :n].type_as(q)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize(("module", "expected"), [
    (lambda: PhiStyleMHA(), None), (lambda: PhiStyleMHA(bug="k-sign"), "rotary-mismatch"),
    (lambda: QwenStyleAttention(), None), (lambda: QwenStyleAttention(bug="logn-key"), "rotary-mismatch")],
    ids=["phi", "phi-k-sign", "qwen-logn", "qwen-logn-on-k"])
def test_remote_code_llm_attention_as_it_ships(module, expected):
    """catches: Phi's v, rejoined to the rotated q and k and unbound again, was read through every part of the join
    (values-changed on correct code), and no rotation was read at all, so k rotated the other way was certified
    (the run on one token everywhere now runs whenever the module computes cos and sin itself); Qwen's log-n
    scaling of q, one factor per query position, was rotary-mismatch (the scores are relative once each row is
    divided by it), while the same factor on k is a mismatch."""
    torch.manual_seed(0)
    report = check(module())
    if expected is None:
        assert report.passed, report.findings
    else:
        assert expected in report.ids, report.findings


class FalconRWStyleAttention(nn.Module):
    """Falcon's remote code (RW): causal SDPA when given no mask; given the model's (B, 1, L, L) bool mask (True =
    masked, the causal pattern and the padding together), that mask alone, as -1e9 where True."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.query_key_value, self.dense = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, hidden_states, alibi=None, attention_mask=None):
        b, n, e = hidden_states.shape
        q, k, v = (t.view(b, n, self.h, -1).transpose(1, 2) for t in self.query_key_value(hidden_states).chunk(3, -1))
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            additive = (attention_mask * 1.0).masked_fill(attention_mask, -1e9).to(q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, additive)
        return self.dense(out.transpose(1, 2).reshape(b, n, e)), None


def test_a_mask_with_true_masked_that_replaces_the_causal_pattern_is_read_so():
    """catches: a layer causal only when given no mask, whose mask is the model's (B, 1, L, L) with True = masked,
    was read as taking a (B, 1, 1, L) key mask and named causal-leak ("drops its causal mask"): that a mask
    replaces the layer's own pattern was tried in the keep polarity only."""
    torch.manual_seed(0)
    report = check(FalconRWStyleAttention())
    assert report.passed, report.findings
    assert report.inferred["mask"]["shape"] == "(B, 1, L, L)", report.inferred["mask"]


class ChatGLMStyleAttention(nn.Module):
    """ChatGLM2's SelfAttention: states (L, B, E), causal SDPA when given no mask, else the model's bool mask with
    True = masked, inverted for SDPA."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.query_key_value, self.dense = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        n, b, e = hidden_states.shape
        q, k, v = (t.view(n, b, self.h, -1).permute(1, 2, 0, 3)
                   for t in self.query_key_value(hidden_states).chunk(3, -1))
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, ~attention_mask)
        return self.dense(out.permute(2, 0, 1, 3).reshape(n, b, e))


def test_a_sequence_first_layer_whose_mask_replaces_its_causal_pattern_is_certified():
    """catches: ChatGLM's layer, causal without a mask and given the model's bool mask with True = masked, was
    inconclusive (no mask the doctor sends read as one): the mask replacing the causal pattern was tried in the
    keep polarity only."""
    torch.manual_seed(0)
    report = check(ChatGLMStyleAttention())
    assert report.passed, (report.findings, report.inferred.get("mask"))


class Falcon40BStyleAttention(nn.Module):
    """Falcon-40B's new decoder architecture: qkv viewed (B, L, G, r + 2, D), each group's key and value broadcast
    to its r query heads and flattened, rotary on q and k after that, causal SDPA. ``bug``: "tiled" lays the values
    out group after group ([0, 1, 0, 1]) where the keys go [0, 0, 1, 1]."""

    def __init__(self, dim: int = 64, heads: int = 4, groups: int = 2, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.g, self.bug = heads, groups, bug
        self.d = dim // heads
        self.query_key_value = nn.Linear(dim, (heads + 2 * groups) * self.d, bias=False)
        self.dense = nn.Linear(dim, dim, bias=False)

    def forward(self, hidden_states):
        b, n, e = hidden_states.shape
        r = self.h // self.g
        qkv = self.query_key_value(hidden_states).view(b, n, self.g, r + 2, self.d)
        q = qkv[:, :, :, :-2]
        k, v = (torch.broadcast_to(t, q.shape) for t in (qkv[:, :, :, [-2]], qkv[:, :, :, [-1]]))
        q, k, v = (t.flatten(2, 3) for t in (q, k, v))
        if self.bug == "tiled":
            v = v.view(b, n, self.g, r, self.d).transpose(2, 3).reshape(b, n, self.h, self.d)
        cos, sin = (torch.cat([t, t], -1)[None, :, None, :] for t in _rope_tables(n, self.d, hidden_states.dtype))
        q, k = (t * cos + _rotate_half(t) * sin for t in (q, k))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize(("bug", "expected"), [(None, None), ("tiled", "group-mismatch")])
def test_kv_groups_broadcast_and_rotated_after_their_repeat_are_read(bug, expected):
    """catches: Falcon-40B's kv heads are broadcast over an axis of one and flattened, and the keys rotated after
    that: neither repeat was read (the one-sized axis, and no head of the rotated keys equals one before), so values
    laid out in another group order than the keys were certified. The broadcast is read with its axis dropped, and
    a side rotated after its repeat is read by which of its heads are copies of each other."""
    torch.manual_seed(0)
    report = check(Falcon40BStyleAttention(bug=bug))
    if expected is None:
        assert report.passed, report.findings
    else:
        assert expected in report.ids, report.findings


def test_values_grouped_otherwise_than_the_keys_by_design_are_not_a_group_mismatch():
    """catches: transformers' DiffLlama splits its kv heads in two halves for the values of its two attentions
    (every value head of one a copy of one kv head) while the keys are grouped as usual: reading the heads that are
    copies of each other on one side named that group-mismatch; only a layout with as many groups as the other
    side is compared."""
    transformers = pytest.importorskip("transformers")
    from selfattn.check import check_model

    torch.manual_seed(0)
    config = transformers.DiffLlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=64, num_hidden_layers=1, vocab_size=64)
    config._attn_implementation = "eager"
    report = check_model(transformers.DiffLlamaModel(config).eval(), {"input_ids": torch.randint(0, 64, (2, 7))})
    assert report.passed, report.summary()


# -- per-head projection lists and heads averaged over one shared value projection (Temporal Fusion Transformer) --
class InterpretableHeads(nn.Module):
    """pytorch-forecasting's ``InterpretableMultiHeadAttention``: a q and a k projection per head in ``ModuleList``s,
    one value projection all heads share, the heads averaged, then ``w_h`` from one head's width back to the model's.
    ``k_from_q``: each head's keys taken from its query layer (``ks = self.q_layers[i](k)``)."""

    def __init__(self, n_head: int = 4, d_model: int = 32, k_from_q: bool = False) -> None:
        super().__init__()
        self.n_head, self.d, self.k_from_q = n_head, d_model // n_head, k_from_q
        self.v_layer = nn.Linear(d_model, self.d)
        self.q_layers = nn.ModuleList([nn.Linear(d_model, self.d) for _ in range(n_head)])
        self.k_layers = nn.ModuleList([nn.Linear(d_model, self.d) for _ in range(n_head)])
        self.w_h = nn.Linear(self.d, d_model, bias=False)

    def forward(self, q, k, v, mask=None):
        vs, heads = self.v_layer(v), []
        for i in range(self.n_head):
            qs = self.q_layers[i](q)
            ks = (self.q_layers if self.k_from_q else self.k_layers)[i](k)
            attn = torch.bmm(qs, ks.permute(0, 2, 1)) / math.sqrt(self.d)
            if mask is not None:
                attn = attn.masked_fill(mask, -1e4)
            heads.append(torch.bmm(torch.softmax(attn, dim=2), vs))
        return self.w_h(torch.stack(heads, dim=2).mean(dim=2)), None


@pytest.mark.parametrize("k_from_q", [False, True])
def test_a_per_head_projection_list_the_call_never_uses_is_no_grad(k_from_q):
    """catches: keys taken from the per-head query layers of a TFT-style module were certified (a head's projection
    in a ``ModuleList`` was grouped with its list only, and the output map from one head's width, wider out than in,
    was read as a fused qkv projection)"""
    torch.manual_seed(0)
    report = check(InterpretableHeads(k_from_q=k_from_q))
    assert {f.id for f in report.findings if f.severity == "error"} == ({"no-grad"} if k_from_q else set()), \
        report.findings


# -- cross-attention whose forward takes the queries' and the keys' sequences by other names (BLIP-2, Flamingo) ----
class QFormerCrossAttention(nn.Module):
    """BLIP-2's Q-Former cross-attention: learned query tokens attend to image features,
    ``forward(hidden_states, encoder_hidden_states, encoder_attention_mask=None)`` with a (B, L) keep-mask made
    additive. ``bug``: "mask ignored" (the extended mask built and never added), "unscaled"."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        b, n, e = hidden_states.shape
        d = e // self.heads

        def split(t):
            return t.view(b, t.shape[1], self.heads, d).transpose(1, 2)

        q = split(self.query(hidden_states))
        k, v = split(self.key(encoder_hidden_states)), split(self.value(encoder_hidden_states))
        scores = q @ k.transpose(-1, -2) / (1.0 if self.bug == "unscaled" else math.sqrt(d))
        if encoder_attention_mask is not None:
            extended = (1.0 - encoder_attention_mask[:, None, None, :].to(scores.dtype)) * -10000.0
            if self.bug != "mask ignored":
                scores = scores + extended
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)


class PerceiverAttention(nn.Module):
    """Flamingo's perceiver resampler: ``forward(latents, x)``, the latents attending to the media tokens joined
    with the latents themselves (``kv_input = cat((x, latents), dim=-2)``)."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.to_q, self.to_kv, self.to_out = nn.Linear(dim, dim, bias=False), nn.Linear(dim, 2 * dim, bias=False), \
            nn.Linear(dim, dim, bias=False)

    def forward(self, latents, x):
        b, n, e = latents.shape
        d = e // self.heads
        q = self.to_q(latents).view(b, n, self.heads, d).transpose(1, 2)
        if self.bug != "unscaled":
            q = q * d ** -0.5
        k, v = (t.view(b, -1, self.heads, d).transpose(1, 2)
                for t in self.to_kv(torch.cat((x, latents), dim=-2)).chunk(2, dim=-1))
        sim = q @ k.transpose(-1, -2)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        return self.to_out((sim.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize(("module", "expected"), [
    (QFormerCrossAttention, None), (partial(QFormerCrossAttention, bug="mask ignored"), "mask-ignored"),
    (partial(QFormerCrossAttention, bug="unscaled"), "missing-scale"),
    (PerceiverAttention, None), (partial(PerceiverAttention, bug="unscaled"), "missing-scale")])
def test_cross_attention_over_two_required_sequences_is_called_with_both(module, expected):
    """catches: forward(queries, keys) with both required and the second not named like keys or a context
    (``encoder_hidden_states``, Flamingo's ``x``) could not be called (exit 2), and a cross-attention's key mask named
    ``encoder_attention_mask`` was read as no mask, so one the module never adds was certified"""
    torch.manual_seed(0)
    report = check(module())
    if expected is None:
        assert report.passed, report.findings
    else:
        assert expected in report.ids, report.findings


# -- positions added to q and k after their projections (Conditional DETR's decoder self-attention) ----------------
def _sine_positions(x: torch.Tensor) -> torch.Tensor:
    """DETR's sine embedding of each token's index, the width of x."""
    n, e = x.shape[1], x.shape[2]
    angle = torch.arange(n, dtype=x.dtype)[:, None] / 10000 ** (torch.arange(0, e, 2, dtype=x.dtype) / e)
    return torch.stack((angle.sin(), angle.cos()), -1).flatten(1)[None].expand(x.shape[0], -1, -1)


class ConditionalSelfAttention(nn.Module):
    """``q = q_content_proj(x) + q_pos_proj(pos)``, ``k = k_content_proj(x) + k_pos_proj(pos)``, ``v = v_proj(x)``.
    ``bug``: "k rotated" turns k by its position (a rotation on one side, no added term)."""

    def __init__(self, dim: int = 32, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_content_proj, self.q_pos_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k_content_proj, self.k_pos_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, position_embeddings):
        b, n, e = hidden_states.shape
        d = e // self.heads
        q = self.q_content_proj(hidden_states) + self.q_pos_proj(position_embeddings)
        if self.bug == "k rotated":
            k = self.k_content_proj(hidden_states)
            angle = torch.arange(n, dtype=k.dtype)[:, None] / 100 ** (torch.arange(0, e // 2, dtype=k.dtype) / e)
            k = torch.cat((k[..., ::2] * angle.cos() - k[..., 1::2] * angle.sin(),
                           k[..., ::2] * angle.sin() + k[..., 1::2] * angle.cos()), -1)
        else:
            k = self.k_content_proj(hidden_states) + self.k_pos_proj(position_embeddings)
        q, k, v = (t.view(b, n, self.heads, d).transpose(1, 2) for t in (q, k, self.v_proj(hidden_states)))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize(("bug", "expected"), [(None, None), ("k rotated", "rotary-one-side")])
def test_positions_added_after_the_projections_are_no_rotation(bug, expected):
    """catches: q and k each plus a projection of the position (Conditional DETR) read as rotated unalike
    (rotary-mismatch) on correct code: with one token at every position the scores change with the position, as
    they do for absolute positions. An added term is the same vector at every position between runs on two tokens;
    a rotation turns it."""
    torch.manual_seed(0)
    report = check(ConditionalSelfAttention(bug=bug), call=lambda m, x: m(x, _sine_positions(x)))
    errors = {f.id for f in report.findings if f.severity == "error"}
    if expected is None:
        assert not errors, report.findings
    else:
        # k's position projection is never used beside q's (no-grad, named for it)
        assert errors & {"rotary-one-side", "rotary-mismatch"}, report.findings
        assert errors <= {"rotary-one-side", "rotary-mismatch", "no-grad"}, report.findings


def _memory_cross(name: str, dropped: bool) -> nn.Module:
    """A decoder's cross-attention over a memory, ``forward(tgt, memory, <name>=None)`` with a (B, S) bool mask,
    True = padding, named as code bases name it; ``dropped``: the mask accepted and never used."""
    source = (f"class MemoryCrossAttention(nn.Module):\n"
              f"    def __init__(self):\n"
              f"        super().__init__()\n"
              f"        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)\n"
              f"    def forward(self, tgt, memory, {name}=None):\n"
              f"        mask = None if {dropped} else {name}\n"
              f"        return self.attn(tgt, memory, memory, key_padding_mask=mask, need_weights=False)[0]\n")
    namespace: dict = {"nn": nn}
    exec(source, namespace)
    return namespace["MemoryCrossAttention"]()


@pytest.mark.parametrize("name", ["memory_mask", "enc_mask", "cross_attn_mask", "encoder_padding_mask", "text_mask"])
@pytest.mark.parametrize("dropped", [False, True])
def test_a_mask_is_any_argument_named_with_the_word_mask(name, dropped):
    """catches: an argument was read as a mask only when its name was on a list, so a cross-attention's
    ``memory_mask`` (nn.Transformer's), ``enc_mask``, ``cross_attn_mask`` (mllama's) or fairseq's
    ``encoder_padding_mask`` that the module accepts and never uses was certified ("not named like a mask")"""
    torch.manual_seed(0)
    report = check(_memory_cross(name, dropped))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == ({"mask-ignored"} if dropped else set()), report.findings


@pytest.mark.parametrize("bug", [None, "k", "v"])
def test_a_per_head_list_with_one_member_used_for_every_head_is_no_grad(bug):
    """catches: every head taking the first member of its per-head projection list (``self.k_layers[0]``) was
    certified: the list's other members got no gradient while one of them did"""

    class PerHeadLists(InterpretableHeads):
        def __init__(self) -> None:
            super().__init__()
            self.v_layers = nn.ModuleList([nn.Linear(32, self.d) for _ in range(self.n_head)])

        def forward(self, q, k, v):
            heads = []
            for i in range(self.n_head):
                qs = self.q_layers[i](q)
                ks = self.k_layers[0 if bug == "k" else i](k)
                vs = self.v_layers[0 if bug == "v" else i](v)
                heads.append(torch.softmax(qs @ ks.transpose(1, 2) / math.sqrt(self.d), -1) @ vs)
            return self.w_h(torch.stack(heads, dim=2).mean(dim=2))

    torch.manual_seed(0)
    report = check(PerHeadLists())
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == (set() if bug is None else {"no-grad"}), report.findings


@pytest.mark.parametrize(("name", "reads"), [("memory_key_padding_mask", "keep"), ("tgt_key_padding_mask", "keep"),
                                             ("encoder_attention_mask", "ignore")])
def test_a_cross_attention_mask_read_against_its_names_convention_is_warned(name, reads):
    """catches: nn.Transformer's memory_key_padding_mask (True = padding) read as True = attend, or Hugging Face's
    encoder_attention_mask (1 = attend) read as True = masked, got no mask-convention warning, while the same slip
    on key_padding_mask or attention_mask did"""
    source = ("class Cross(nn.Module):\n"
              "    def __init__(self):\n"
              "        super().__init__()\n"
              "        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)\n"
              f"    def forward(self, tgt, memory, {name}=None):\n"
              f"        mask = None if {name} is None else {'~' if reads == 'keep' else ''}{name}.bool()\n"
              "        return self.attn(tgt, memory, memory, key_padding_mask=mask, need_weights=False)[0]\n")
    namespace: dict = {"nn": nn}
    exec(source, namespace)
    torch.manual_seed(0)
    report = check(namespace["Cross"]())
    assert "mask-convention" in report.ids, report.findings


class ContextAttention(nn.Module):
    """A perceiver-style cross-attention, ``forward(x, context, context_mask)`` with the keys' mask required
    (True = keep), as lucidrains' modules write it; ``ignored``: the mask taken and never used."""

    def __init__(self, ignored: bool = False, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.ignored = heads, ignored
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, context, context_mask):
        b, n, e = x.shape
        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, -1, self.heads, e // self.heads).transpose(1, 2) for t in (q, k, v))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * (e // self.heads) ** -0.5
        if not self.ignored:
            sim = sim.masked_fill(~context_mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        out = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("ignored", [False, True])
def test_a_required_mask_after_two_sequences_is_given(ignored):
    """catches: ``forward(x, context, context_mask)`` with the mask required exited 2 (two sequences were tried
    only when nothing else was required); with the mask unused, forward(x, x, x) ran with x taken as the mask"""
    torch.manual_seed(0)
    report = check(ContextAttention(ignored))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert report.inferred["call"].startswith("forward(q, kv)"), report.inferred["call"]
    assert errors == ({"mask-ignored"} if ignored else set()), report.findings
    assert report.coverage["mask"].startswith("verified"), report.coverage


class GraphBiasAttention(nn.Module):
    """Graphormer-style: a virtual node first, the scores biased per head by the nodes' shortest-path distance
    through an embedding whose row 0 ("no path", padding_idx) autograd leaves at 0; a path graph over the nodes.
    ``detached``: the bias table cut from autograd by a hand-written ``.data`` read."""

    def __init__(self, detached: bool = False, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.detached = heads, detached
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.spatial = nn.Embedding(8, heads, padding_idx=0)
        with torch.no_grad():
            self.spatial.weight.normal_(std=0.5)
            self.spatial.weight[0] = 0

    def forward(self, x, key_padding_mask=None):
        b, t, e = x.shape
        d = e // self.heads
        q = self.q_proj(x) * d ** -0.5
        q, k, v = (y.view(b, t, self.heads, d).transpose(1, 2) for y in (q, self.k_proj(x), self.v_proj(x)))
        node = torch.arange(t - 1, device=x.device)
        hops = torch.zeros(t, t, dtype=torch.long, device=x.device)  # 0 on the virtual node's row and column
        hops[1:, 1:] = (node[:, None] - node[None, :]).abs().clamp(max=6) + 1
        bias = F.embedding(hops, self.spatial.weight.data) if self.detached else self.spatial(hops)
        attn = q @ k.transpose(-1, -2) + bias.permute(2, 0, 1).to(q.dtype)
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        out = attn.softmax(-1) @ v
        return self.out_proj(out.transpose(1, 2).reshape(b, t, e))


@pytest.mark.parametrize("detached", [False, True])
def test_an_embeddings_padding_row_is_no_wrong_gradient(detached):
    """catches: a bias read through an embedding with a padding_idx (Graphormer's spatial and edge encodings) was
    wrong-gradient on correct code: autograd leaves the padding row at 0 by design, the finite difference moved it"""
    torch.manual_seed(0)
    report = check(GraphBiasAttention(detached))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == ({"no-grad"} if detached else set()), report.findings


class VolumeWindowAttention(nn.Module):
    """Video Swin-style attention within one (D, H, W) window of a clip or a volume: a learned table of
    (2D - 1)(2H - 1)(2W - 1) biases per head, read through an index of the 3-D offsets between the tokens.
    ``unpermuted``: the offsets (3, N, N) reshaped to (N, N, 3) without the permute, so that the index mixes the
    coordinates of other pairs (no function of the offset any more)."""

    def __init__(self, unpermuted: bool = False, dim: int = 32, heads: int = 4, window=(2, 2, 3)) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        d, h, w = window
        self.table = nn.Parameter(0.5 * torch.randn((2 * d - 1) * (2 * h - 1) * (2 * w - 1), heads))
        coords = torch.stack(torch.meshgrid(torch.arange(d), torch.arange(h), torch.arange(w), indexing="ij"))
        flat = coords.flatten(1)
        offsets = flat[:, :, None] - flat[:, None, :]
        offsets = offsets.reshape(d * h * w, d * h * w, 3) if unpermuted else offsets.permute(1, 2, 0)
        offsets = offsets.contiguous() + torch.tensor([d - 1, h - 1, w - 1])
        index = offsets[..., 0] * (2 * h - 1) * (2 * w - 1) + offsets[..., 1] * (2 * w - 1) + offsets[..., 2]
        self.register_buffer("index", index.clamp(0, self.table.shape[0] - 1))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = attn + self.table[self.index[:n, :n].reshape(-1)].reshape(n, n, -1).permute(2, 0, 1)
        if mask is not None:
            attn = attn + mask[:, None]
        out = (attn.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(out)


@pytest.mark.parametrize("unpermuted", [False, True])
def test_a_3d_window_bias_is_read_on_its_volume(unpermuted):
    """catches: a (2D - 1)(2H - 1)(2W - 1) table of a 3-D window (Video Swin's, Swin UNETR's) was read as distances
    on a line, so that the correct module at its window's length was definition-mismatch"""
    torch.manual_seed(0)
    report = check(VolumeWindowAttention(unpermuted), call=lambda m, x: m(x, None), length=12)
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == ({"definition-mismatch"} if unpermuted else set()), report.findings


class ProcessorStyleAttention(nn.Module):
    """diffusers-style: to_q, to_k, to_v and ``to_out = ModuleList([Linear, Dropout])``, heads folded into the batch
    for SDPA; ``applied``: whether forward ends with to_out (a processor that forgets it returns the heads' merge)."""

    def __init__(self, applied: bool = True, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.applied = heads, applied
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])

    def forward(self, hidden_states, attention_mask=None):
        b, n, e = hidden_states.shape
        q, k, v = (p(hidden_states).view(b, n, self.heads, -1).transpose(1, 2)
                   for p in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        out = out.transpose(1, 2).reshape(b, n, e)
        if self.applied:
            out = self.to_out[1](self.to_out[0](out))
        return out


@pytest.mark.parametrize("applied", [True, False])
def test_an_output_projection_never_applied_is_no_grad(applied):
    """catches: an attention that holds an output projection (diffusers' to_out[0], a plain out_proj) and returns
    without it was certified: only q, k and v projections were held to being used beside their siblings"""
    torch.manual_seed(0)
    report = check(ProcessorStyleAttention(applied))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == (set() if applied else {"no-grad"}), report.findings


class FoldedHeadsAttention(nn.Module):
    """Stable Diffusion's memory-efficient attention: q, k, v as (B * H, N, D) for an xformers-style kernel (SDPA
    on 3-D tensors here), the (B, N) keep-mask repeated item-major over the heads, the heads merged back as (d h);
    ``mask_fold="(h b)"``: the mask repeated heads-first, so that item b's rows get another item's mask."""

    def __init__(self, mask_fold: str = "(b h)", dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.mask_fold = heads, mask_fold
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.0))

    def forward(self, x, mask=None):
        q, k, v = (rearrange(f(x), "b n (h d) -> (b h) n d", h=self.heads) for f in (self.to_q, self.to_k, self.to_v))
        if mask is not None:
            mask = repeat(mask, f"b j -> {self.mask_fold} () j", h=self.heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out(rearrange(out, "(b h) n d -> b n (d h)", h=self.heads))


@pytest.mark.parametrize("mask_fold", ["(b h)", "(h b)"])
def test_a_mask_folded_with_the_heads_into_the_batch_is_read_by_items(mask_fold):
    """catches: an SDPA call on (B * H, N, D) with its (B * H, 1, N) mask was compared item by item against every
    item's rows at once, so a correct module whose (d h) merge keeps the projections from being read was
    mask-ignored"""
    torch.manual_seed(0)
    report = check(FoldedHeadsAttention(mask_fold))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == (set() if mask_fold == "(b h)" else {"mask-ignored"}), report.findings


class CausalRefusesMasks(nn.Module):
    """monai's SABlock with ``causal=True``: a causal buffer of its own, and any mask refused in so many words (a
    ValueError, or a bare ``assert``); ``leak``: the buffer read transposed (each query sees the future)."""

    def __init__(self, how: str = "raise", leak: bool = False, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.how, self.leak = heads, how, leak
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)
        self.register_buffer("causal_mask", torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64))

    def forward(self, x, attn_mask=None):
        if self.how == "raise" and attn_mask is not None:
            raise ValueError("Causal attention does not support attention masks.")
        if self.how == "assert":
            assert attn_mask is None
        b, n, e = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = q @ k.transpose(-2, -1) * (e // self.heads) ** -0.5
        allowed = self.causal_mask[:, :, :n, :n]
        att = att.masked_fill((allowed.transpose(-1, -2) if self.leak else allowed) == 0, float("-inf"))
        return self.out_proj((att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("how", ["raise", "assert"])
@pytest.mark.parametrize("leak", [False, True])
def test_a_module_that_refuses_every_mask_in_its_own_words_takes_none(how, leak):
    """catches: a causal block that refuses any mask by design (monai's SABlock(causal=True): "Causal attention does
    not support attention masks.") was inconclusive until --no-mask, although nothing else could be sent"""
    torch.manual_seed(0)
    report = check(CausalRefusesMasks(how, leak))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert report.verdict == ("failed" if leak else "passed"), (report.verdict, report.findings, report.coverage)
    assert errors == ({"causal-leak"} if leak else set()), report.findings
    assert report.coverage["mask"].startswith("not applicable: the module refuses every mask"), report.coverage


class StreamingAttention(nn.Module):
    """AudioCraft's streaming attention: causality set in the constructor, forward in nn.MultiheadAttention's
    signature with every mask and ``is_causal`` asserted away; ``causal=False`` while the stack around it is causal
    is no error of the layer's own."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(dim, 3 * dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
                is_causal=False):
        assert not is_causal, "not supported: use the causal argument of the constructor"
        assert attn_mask is None
        assert key_padding_mask is None
        b, n, e = query.shape
        q, k, v = self.in_proj(query).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, e)), None


def test_a_causal_switch_refused_with_the_masks_leaves_no_mask():
    """catches: a forward that asserts its masks and its is_causal away (AudioCraft's) was inconclusive until
    --no-mask: the switch the doctor then tried raised"""
    torch.manual_seed(0)
    report = check(StreamingAttention())
    assert report.verdict == "passed", (report.verdict, report.findings, report.coverage)
    assert report.coverage["mask"].startswith("not applicable: the module refuses every mask"), report.coverage
    assert report.coverage["causal"] == "verified" and report.inferred["causal"], report.inferred


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    one, two = t.chunk(2, dim=-1)
    return torch.cat((-two, one), dim=-1)


class YarnAttention(nn.Module):
    """YaRN-scaled rotary written from the paper: frequencies interpolated by a ramp between the original and the
    stretched ones (factor 4 over 16 original positions), and the attention factor 0.1 ln(4) + 1 multiplied into q
    and k after their rotation. ``bug``: "k plain" rotates k with the unscaled frequencies; "q only" multiplies the
    factor into q alone; "twice" folds it into cos and sin too."""

    def __init__(self, bug: str | None = None, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.d, self.bug = heads, dim // heads, bug
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))
        half = torch.arange(0, self.d, 2, dtype=torch.float64) / self.d
        plain = 10000.0 ** -half
        wavelengths = 2 * math.pi / plain
        ramp = ((16 / wavelengths - 1) / (32 - 1)).clamp(0, 1)  # 1: keep (high frequencies), 0: interpolate
        self.register_buffer("plain", plain.float(), persistent=False)
        self.register_buffer("inv_freq", (plain / 4 * (1 - ramp) + plain * ramp).float(), persistent=False)
        self.mscale = 0.1 * math.log(4) + 1

    def _rotate(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(t.shape[-2], device=t.device, dtype=t.dtype)[:, None] * freqs.to(t.dtype)
        emb = torch.cat((angles, angles), dim=-1)
        folded = self.mscale if self.bug == "twice" else 1.0  # the factor folded into cos and sin as well
        return t * emb.cos() * folded + _rotate_half(t) * emb.sin() * folded

    def forward(self, x, attention_mask=None):
        b, n, e = x.shape
        q, k, v = (p(x).view(b, n, self.heads, self.d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q = self._rotate(q, self.inv_freq) * self.mscale
        k = self._rotate(k, self.plain if self.bug == "k plain" else self.inv_freq)
        if self.bug != "q only":
            k = k * self.mscale
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize(("bug", "expected"), [(None, set()), ("k plain", {"rotary-mismatch"}),
                                               ("q only", {"wrong-scale"}), ("twice", {"wrong-scale"})])
def test_yarns_attention_factor_after_the_rotation_is_no_scale(bug, expected):
    """catches: YaRN's attention factor multiplied into q and k after their rotation (not folded into cos and sin)
    was wrong-scale on correct code, and k rotated with other frequencies than q was named wrong-scale too"""
    torch.manual_seed(0)
    report = check(YarnAttention(bug))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == expected, report.findings


class GroupedEinsumAttention(nn.Module):
    """gpt-oss's reference attention: q as (B, T, G, r, D), each kv head broadcast to its r query heads on an axis of
    its own, scores and product as 5-D einsums, learned sinks beside the scores. ``tiled``: the values tiled with
    ``repeat`` and viewed back, so that query head (g, m) takes its values from kv head (g * r + m) % G."""

    def __init__(self, tiled: bool = False, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.g, self.r, self.d, self.tiled = kv_heads, heads // kv_heads, dim // heads, tiled
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.d)
        self.sinks = nn.Parameter(torch.randn(heads))
        self.out = nn.Linear(heads * self.d, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([self.g * self.r * self.d, self.g * self.d, self.g * self.d], dim=-1)
        q = q.view(b, t, self.g, self.r, self.d)
        k = k.view(b, t, self.g, self.d)[:, :, :, None, :].expand(-1, -1, -1, self.r, -1)
        v = v.view(b, t, self.g, self.d)
        v = v.repeat(1, 1, self.r, 1).view(b, t, self.g, self.r, self.d) if self.tiled else \
            v[:, :, :, None, :].expand(-1, -1, -1, self.r, -1)
        causal = torch.triu(x.new_full((t, t), float("-inf")), diagonal=1)
        scores = torch.einsum("bqhmd,bkhmd->bhmqk", q, k) * self.d ** -0.5 + causal
        sinks = self.sinks.reshape(self.g, self.r, 1, 1).expand(b, -1, -1, t, -1)
        weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        return self.out(torch.einsum("bhmqk,bkhmd->bqhmd", weights, v).reshape(b, t, -1))


@pytest.mark.parametrize("tiled", [False, True])
def test_kv_heads_on_an_axis_of_their_own_are_grouped_alike(tiled):
    """catches: with the query heads on two axes (kv head, member of its group) in 5-D einsums, as gpt-oss writes
    them, values tiled with repeat while the keys are broadcast (another kv head's values) were certified"""
    torch.manual_seed(0)
    report = check(GroupedEinsumAttention(tiled))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == ({"group-mismatch"} if tiled else set()), report.findings


class BlockAroundACore(nn.Module):
    """A block holding an attention core (q, k, v projections only) and its own output projection, as Llama-style
    ports split them; ``applied``: whether forward ends with ``o_proj``."""

    def __init__(self, applied: bool = True, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.applied = applied
        self.core = ProcessorStyleAttention(applied=False, dim=dim, heads=heads)
        del self.core.to_out  # the core holds no output projection of its own
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        out = self.core(hidden_states, attention_mask)
        return self.o_proj(out) if self.applied else out


@pytest.mark.parametrize("applied", [True, False])
def test_a_blocks_output_projection_never_applied_is_no_grad(applied):
    """catches: a block's own o_proj left out while the q, k and v projections of its core were used was certified:
    only a module's own Linears were held to its output projection"""
    torch.manual_seed(0)
    report = check(BlockAroundACore(applied))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == (set() if applied else {"no-grad"}), report.findings


class ClassAttentionBlock(nn.Module):
    """CaiT's and XCiT's class-attention block: the class token (token 0) queries every token through SDPA; the
    other tokens pass through the norm untouched; ``scale``: the scale given to SDPA (None: its own)."""

    def __init__(self, scale: float | None = None, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.scale = heads, scale
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def attend(self, x):
        b, n, c = x.shape
        q = self.q(x[:, :1]).reshape(b, 1, self.heads, -1).transpose(1, 2)
        k, v = (p(x).reshape(b, n, self.heads, -1).transpose(1, 2) for p in (self.k, self.v))
        cls = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.proj(cls.transpose(1, 2).reshape(b, 1, c))

    def forward(self, x):
        y = self.norm(x)
        return x + torch.cat([self.attend(y), y[:, 1:]], dim=1)


class AttentionPool(ClassAttentionBlock):
    """The class attention alone: one row out, for the class token (timm's ClassAttn, AttentionPoolLatent)."""

    def forward(self, x):
        return self.attend(x)


@pytest.mark.parametrize("scale", [None, 1 / 32])
def test_a_class_attention_block_is_read_with_its_one_query(scale):
    """catches: the class token alone querying every token through SDPA (XCiT's, CaiT's class-attention blocks) was
    definition-mismatch, as a head split, on correct code, and a wrong scale given to SDPA went unnamed"""
    torch.manual_seed(0)
    report = check(ClassAttentionBlock(scale))
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == (set() if scale is None else {"wrong-scale"}), report.findings


def test_attention_pooling_says_why_it_cannot_be_checked():
    """catches: a module returning one row for the class token or a learned query could not run (exit 2) with no
    word of why: "never returned a (B, L, E) output", or a width searched among its MLP's sizes"""
    with pytest.raises(CannotRun, match="attention pooling or class attention"):
        check(AttentionPool())


class FoldedMaskOnly(nn.Module):
    """fairseq-style: an ``attn_mask`` taken only as (B * H, L, L), any other form refused by a shape check."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2) * (e // self.heads) ** -0.5).reshape(b * self.heads, n, n)
        if attn_mask is not None:
            if attn_mask.dim() != 3 or attn_mask.shape[0] != b * self.heads:
                raise ValueError(f"attn_mask must be of shape (bsz * num_heads, L, L), got {tuple(attn_mask.shape)}")
            scores = scores + attn_mask
        out = scores.softmax(-1).reshape(b, self.heads, n, n) @ v
        return self.out_proj(out.transpose(1, 2).reshape(b, n, e))


def test_a_mask_taken_in_a_form_the_doctor_does_not_send_is_no_refusal():
    """catches: a mask every form of which fails a shape check of the module's (a ValueError that names the mask)
    read as a mask the module refuses, so that a mask never looked at was certified as not applicable"""
    torch.manual_seed(0)
    report = check(FoldedMaskOnly())
    assert report.verdict == "inconclusive" and report.coverage["mask"].startswith("not verified"), report.coverage


_SCRIPTED_HELPERS = '''
import torch
from torch import nn


@torch.jit.script
def scores_of(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.bmm(q * scale, k.transpose(1, 2))


@torch.jit.script
def attend(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.bmm(weights, v)


class ScriptedSelfAttention(nn.Module):
    """Sockeye-style: keys and values interleaved per head in one projection, heads folded into the batch, the two
    products in TorchScript helpers."""

    SCALE_BY_WIDTH = False

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ff_in = nn.Linear(dim, 3 * dim, bias=False)
        self.ff_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, n, e = x.shape
        d = e // self.heads
        q, kv = self.ff_in(x).split([e, 2 * e], dim=-1)  # keys and values interleaved per head, as Sockeye's
        kv = kv.reshape(b, n, self.heads, 2, d)
        q, k, v = (t.reshape(b, n, self.heads, d).transpose(1, 2).reshape(b * self.heads, n, d)
                   for t in (q, kv[..., 0, :], kv[..., 1, :]))
        scale = (e if self.SCALE_BY_WIDTH else d) ** -0.5
        out = attend(scores_of(q, k, scale).softmax(dim=-1), v)
        return self.ff_out(out.reshape(b, self.heads, n, d).transpose(1, 2).reshape(b, n, e))


class ScaledByWidth(ScriptedSelfAttention):
    SCALE_BY_WIDTH = True
'''


@pytest.mark.parametrize(("name", "expected"), [("ScriptedSelfAttention", set()), ("ScaledByWidth", {"wrong-scale"})])
def test_torchscript_helpers_in_a_checked_file_are_read_as_python(tmp_path, name, expected):
    """catches: products inside @torch.jit.script helpers (Sockeye's interleaved matmuls) ran as calls the trace
    could not look into, so that a correct module loaded from its file was definition-mismatch"""
    from selfattn.check.subject.building import load_class

    path = tmp_path / "scripted.py"
    path.write_text(_SCRIPTED_HELPERS)
    torch.manual_seed(0)
    report = check(load_class(f"{path}:{name}")())
    errors = {f.id for f in report.findings if f.severity == "error"}
    assert errors == expected, report.findings

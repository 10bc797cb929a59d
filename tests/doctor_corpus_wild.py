"""The doctor in the wild: attention modules from code bases its corpus (tests/doctor_corpus.py) has not seen.

Two kinds of entries in :data:`WILD`, each checked by tests/test_check_wild.py:

- real packages, imported (never copied), installed test-only with ``--no-deps``: fair-esm's
  ``MultiheadAttention`` (fairseq's, sequence-first, through torch's fused function, and with rotary
  positions), its MSA ``RowSelfAttention`` and ``ColumnSelfAttention`` (4-D (R, C, B, E) input, called
  on one row or one column), litgpt's ``CausalSelfAttention`` (fused qkv, rotary on a quarter of the
  head dim, MHA and GQA). An entry whose package is missing is skipped.
- modules written here in the style of a code base that is not packaged (one-line comment on each
  class names the style; none is a copy): ESPnet/WeNet relative-position attention (legacy: positions
  given; new: rel_shift over 2L-1 positions made by the module), Transformer-XL's
  RelPartialLearnable attention (sequence-first einsum, rel_shift, built-in causal mask, post-norm),
  AlphaFold/OpenFold gated attention with pair bias, Swin window attention on a (B, H, W, C) map
  (window partition, relative-position table, shifted windows), gpt-fast's inference attention
  with an ``index_copy_`` KV cache of a fixed batch, litgpt-style partial rotary, a conformer
  self-attention module with ``key_padding_mask`` (True = padding), Swin v2 cosine attention with a
  learned logit scale, and a sequence-first (L, B, E) einsum attention. Each has the bugs that ship in
  that style as one-line variants (subclasses that change the line the bug is on).

Every entry names what the doctor must say: ``expected`` None (certified: no error finding; warnings
are allowed) or the finding id it must name. ``options`` are the :func:`selfattn.check` arguments a
user would give: a factory, ``call`` only where forward needs what the doctor cannot guess
(positions, a pair representation, a 4-D layout), the mask convention the module documents.

Shape legend: B batch, L length, E embed dim, H heads, D head dim, N tokens per window, S cache length.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from selfattn.check import Report, check

E, H = 64, 4  # embed dim and heads of every module here (head dim 16, as the doctor's own corpus)
D = E // H


def _sinusoid(positions: Tensor, dim: int) -> Tensor:
    """(P,) positions -> (P, dim) sin/cos embedding (Vaswani et al.), in the positions' dtype."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=positions.device, dtype=positions.dtype) / dim))
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


# ---------------------------------------------------------------------------------------------------------------
# ESPnet / WeNet relative-position attention


class RelPositionMultiHeadedAttention(nn.Module):
    # style: WeNet/ESPnet "legacy" RelPositionMultiHeadedAttention (pos_bias_u/v, linear_pos, no rel_shift)
    """forward(query, key, value, mask, pos_emb): mask (B, 1, T) or (B, T, T) bool, True = may attend (ESPnet's
    non-padding mask); pos_emb (1, T, E), the encoder's sinusoidal embedding of the positions."""

    def __init__(self, n_head: int, n_feat: int, dropout_rate: float = 0.0) -> None:
        super().__init__()
        self.d_k, self.h = n_feat // n_head, n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        self.dropout = nn.Dropout(dropout_rate)

    def forward_qkv(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b = query.size(0)
        q = self.linear_q(query).view(b, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(b, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(b, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v  # (B, H, T, D)

    def forward_attention(self, value: Tensor, scores: Tensor, mask: Tensor | None) -> Tensor:
        b = value.size(0)
        if mask is not None:
            hidden = mask.unsqueeze(1).eq(0)  # (B, 1, *, T)
            scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
            attn = torch.softmax(scores, dim=-1).masked_fill(hidden, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = (self.dropout(attn) @ value).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.linear_out(x)

    def matrix_ac(self, q: Tensor, k: Tensor) -> Tensor:
        """Content term: (q + u) k^T; q (B, T, H, D), k (B, H, T, D)."""
        return (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(-2, -1)

    def matrix_bd(self, q: Tensor, p: Tensor) -> Tensor:
        """Position term: (q + v) p^T; p (1, H, T, D)."""
        return (q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1)

    def scores(self, ac: Tensor, bd: Tensor) -> Tensor:
        return (ac + bd) / math.sqrt(self.d_k)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, pos_emb: Tensor) -> Tensor:
        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)  # (B, T, H, D)
        p = self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)
        return self.forward_attention(v, self.scores(self.matrix_ac(q, k), self.matrix_bd(q, p)), mask)


class RelPosNoScale(RelPositionMultiHeadedAttention):
    """Bug: the 1/sqrt(d_k) of (ac + bd) left out."""

    def scores(self, ac: Tensor, bd: Tensor) -> Tensor:
        return ac + bd


class RelPosNoBiasU(RelPositionMultiHeadedAttention):
    """pos_bias_u declared and forgotten: the content term is q k^T (Transformer-XL's u left out)."""

    def matrix_ac(self, q: Tensor, k: Tensor) -> Tensor:
        return q.transpose(1, 2) @ k.transpose(-2, -1)


class RelPosMaskAfterSoftmax(RelPositionMultiHeadedAttention):
    """Bug: the masked scores are only zeroed after the softmax (the fill before it dropped)."""

    def forward_attention(self, value: Tensor, scores: Tensor, mask: Tensor | None) -> Tensor:
        b = value.size(0)
        attn = torch.softmax(scores, dim=-1)
        if mask is not None:
            attn = attn.masked_fill(mask.unsqueeze(1).eq(0), 0.0)
        x = (self.dropout(attn) @ value).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.linear_out(x)


class RelPosMaskInverted(RelPositionMultiHeadedAttention):
    """Bug: the non-padding mask used as the masked positions (``.eq(0)`` forgotten)."""

    def forward_attention(self, value: Tensor, scores: Tensor, mask: Tensor | None) -> Tensor:
        b = value.size(0)
        if mask is not None:
            hidden = mask.unsqueeze(1).bool()
            scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
            attn = torch.softmax(scores, dim=-1).masked_fill(hidden, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = (self.dropout(attn) @ value).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.linear_out(x)


def _legacy_pos_emb(x: Tensor) -> Tensor:
    """WeNet's legacy RelPositionalEncoding output for x (B, T, E): (1, T, E), positions 0..T-1."""
    return _sinusoid(torch.arange(x.size(1), device=x.device, dtype=x.dtype), x.size(-1))[None]


def _espnet_call(m: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """Self-attention as WeNet's encoder layer calls it: query = key = value = x, with the positions."""
    return m(x, x, x, mask, _legacy_pos_emb(x))


class RelPositionSelfAttention(RelPositionMultiHeadedAttention):
    # style: ESPnet (latest) RelPositionMultiHeadedAttention + RelPositionalEncoding: 2T-1 relative positions,
    # rel_shift; the module makes its own positional embedding
    """forward(x, mask=None): x (B, T, E); mask (B, 1, T) or (B, T, T) bool, True = may attend."""

    def relative_positions(self, x: Tensor) -> Tensor:
        """(1, 2T-1, E): embeddings of the relative positions T-1, ..., 0, ..., -(T-1)."""
        t = x.size(1)
        return _sinusoid(torch.arange(t - 1, -t, -1, device=x.device, dtype=x.dtype), x.size(-1))[None]

    @staticmethod
    def rel_shift(x: Tensor) -> Tensor:
        """(B, H, T, 2T-1) scores over relative positions -> (B, H, T, T) over keys (position i - j at [i, j])."""
        b, h, t, _ = x.shape
        padded = torch.cat([x.new_zeros(b, h, t, 1), x], dim=-1).view(b, h, -1, t)
        return padded[:, :, 1:].reshape(b, h, t, -1)[:, :, :, : x.size(-1) // 2 + 1]

    def matrix_bd(self, q: Tensor, p: Tensor) -> Tensor:
        return self.rel_shift(super().matrix_bd(q, p))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:  # type: ignore[override]
        return super().forward(x, x, x, mask, self.relative_positions(x))


class RelShiftSoftmaxQueries(RelPositionSelfAttention):
    """Bug: softmax over the query axis."""

    def forward_attention(self, value: Tensor, scores: Tensor, mask: Tensor | None) -> Tensor:
        b = value.size(0)
        if mask is not None:
            hidden = mask.unsqueeze(1).eq(0)
            scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
            attn = torch.softmax(scores, dim=-2).masked_fill(hidden, 0.0)
        else:
            attn = torch.softmax(scores, dim=-2)
        x = (self.dropout(attn) @ value).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.linear_out(x)


class RelShiftScaleByWidth(RelPositionSelfAttention):
    """Bug: scores divided by sqrt(n_feat), the model width, instead of sqrt(d_k)."""

    def scores(self, ac: Tensor, bd: Tensor) -> Tensor:
        return (ac + bd) / math.sqrt(self.h * self.d_k)


class IcefallRelPositionAttention(RelPositionSelfAttention):
    # style: k2/icefall conformer RelPositionMultiheadAttention: the same rel_shift attention with a
    # key_padding_mask (True = padding) filled with -inf before the softmax, nothing after it
    """forward(x, key_padding_mask=None): x (B, T, E); key_padding_mask (B, T) bool, True = padding."""

    def forward_attention(self, value: Tensor, scores: Tensor, mask: Tensor | None) -> Tensor:
        b = value.size(0)
        if mask is not None:
            scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
        x = (self.dropout(torch.softmax(scores, dim=-1)) @ value).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:  # type: ignore[override]
        return super().forward(x, key_padding_mask)


class IcefallNoScale(IcefallRelPositionAttention):
    """Bug: the 1/sqrt(d_k) left out."""

    def scores(self, ac: Tensor, bd: Tensor) -> Tensor:
        return ac + bd


class IcefallNoBiasU(IcefallRelPositionAttention):
    """pos_bias_u declared and forgotten (as :class:`RelPosNoBiasU`), without ESPnet's post-softmax fill."""

    def matrix_ac(self, q: Tensor, k: Tensor) -> Tensor:
        return q.transpose(1, 2) @ k.transpose(-2, -1)


class IcefallSoftmaxQueries(IcefallRelPositionAttention):
    """Bug: softmax over the query axis."""

    def forward_attention(self, value: Tensor, scores: Tensor, mask: Tensor | None) -> Tensor:
        b = value.size(0)
        if mask is not None:
            scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
        x = (torch.softmax(scores, dim=-2) @ value).transpose(1, 2).reshape(b, -1, self.h * self.d_k)
        return self.linear_out(x)


# ---------------------------------------------------------------------------------------------------------------
# Transformer-XL


class RelPartialLearnableMultiHeadAttn(nn.Module):
    # style: Transformer-XL RelPartialLearnableMultiHeadAttn (qkv_net, r_net, r_w_bias/r_r_bias, _rel_shift,
    # "ibnd,jbnd->ijbn" scores, softmax over dim 1, post-norm), decoder without memory
    """forward(w): w (qlen, B, d_model), sequence-first; causal (the decoder's mask is built in); returns
    layer_norm(w + attention(w))."""

    causal_offset = 1  # triu(ones(q, k), diagonal=1 + mlen) with mlen = 0

    def __init__(self, n_head: int, d_model: int, d_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_head, self.d_head, self.scale = n_head, d_head, 1 / d_head ** 0.5
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.r_w_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.1)
        self.r_r_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.1)
        self.register_buffer("inv_freq", 1 / (10000 ** (torch.arange(0.0, d_model, 2.0) / d_model)))

    @staticmethod
    def _rel_shift(x: Tensor) -> Tensor:
        """(qlen, klen, B, H) scores over relative positions klen-1..0 -> scores over keys."""
        zero_pad = x.new_zeros((x.size(0), 1, *x.size()[2:]))
        padded = torch.cat([zero_pad, x], dim=1).view(x.size(1) + 1, x.size(0), *x.size()[2:])
        return padded[1:].view_as(x)

    def softmax(self, score: Tensor) -> Tensor:
        return F.softmax(score, dim=1)

    def forward(self, w: Tensor) -> Tensor:
        qlen, bsz = w.shape[:2]
        pos_seq = torch.arange(qlen - 1, -1, -1.0, device=w.device, dtype=w.dtype)
        sinusoid = torch.outer(pos_seq, self.inv_freq.to(w.dtype))
        r = torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)  # (klen, d_model)
        w_head_q, w_head_k, w_head_v = self.qkv_net(w).chunk(3, dim=-1)
        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(qlen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(qlen, bsz, self.n_head, self.d_head)
        r_head_k = self.r_net(r).view(qlen, self.n_head, self.d_head)
        ac = torch.einsum("ibnd,jbnd->ijbn", w_head_q + self.r_w_bias, w_head_k)
        bd = self._rel_shift(torch.einsum("ibnd,jnd->ijbn", w_head_q + self.r_r_bias, r_head_k))
        score = (ac + bd) * self.scale
        mask = torch.triu(torch.ones(qlen, qlen, dtype=torch.bool, device=w.device), diagonal=self.causal_offset)
        score = score.masked_fill(mask[:, :, None, None], float("-inf"))
        prob = self.drop(self.softmax(score))
        vec = torch.einsum("ijbn,jbnd->ibnd", prob, w_head_v).reshape(qlen, bsz, self.n_head * self.d_head)
        return self.layer_norm(w + self.o_net(vec))


class TXLCausalOffByOne(RelPartialLearnableMultiHeadAttn):
    """Bug: the decoder mask hides from diagonal 2 on (a memory length counted once too often): the next
    token is visible."""

    causal_offset = 2


class TXLSoftmaxQueries(RelPartialLearnableMultiHeadAttn):
    """Bug: softmax over dim 0 of the (i, j, b, n) scores: the queries."""

    def softmax(self, score: Tensor) -> Tensor:
        return F.softmax(score, dim=0)


class TXLNoScale(RelPartialLearnableMultiHeadAttn):
    """Bug: scale = 1 (the 1/sqrt(d_head) dropped)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = 1.0


# ---------------------------------------------------------------------------------------------------------------
# AlphaFold / OpenFold


class MSARowAttentionWithPairBias(nn.Module):
    # style: AlphaFold2 / OpenFold MSARowAttentionWithPairBias: gated attention (sigmoid gate on the output),
    # pair bias from a LayerNorm-ed pair representation, q scaled in place, mask bias inf * (mask - 1)
    """forward(m, z, mask=None): m (S, R, c_m), one MSA row per sequence (S acts as the batch); z (R, R, c_z),
    the pair representation shared by the rows; mask (S, R) float, 1 = residue present."""

    inf = 1e4  # OpenFold's fp16 setting of "inf" (its fp32/bf16 setting, 1e9, does not fit float16)
    pair_first = True  # OpenFold's order: layer_norm_m, layer_norm_z, linear_z, then the attention's layers

    def __init__(self, c_m: int, c_z: int, c_hidden: int, no_heads: int) -> None:
        super().__init__()
        self.c_hidden, self.no_heads = c_hidden, no_heads
        if self.pair_first:
            self._pair_layers(c_m, c_z, no_heads)
        self.linear_q = nn.Linear(c_m, c_hidden * no_heads, bias=False)
        self.linear_k = nn.Linear(c_m, c_hidden * no_heads, bias=False)
        self.linear_v = nn.Linear(c_m, c_hidden * no_heads, bias=False)
        self.linear_g = nn.Linear(c_m, c_hidden * no_heads)
        self.linear_o = nn.Linear(c_hidden * no_heads, c_m)
        if not self.pair_first:
            self._pair_layers(c_m, c_z, no_heads)

    def _pair_layers(self, c_m: int, c_z: int, no_heads: int) -> None:
        self.layer_norm_m = nn.LayerNorm(c_m)
        self.layer_norm_z = nn.LayerNorm(c_z)
        self.linear_z = nn.Linear(c_z, no_heads, bias=False)

    def scale_q(self, q: Tensor) -> None:
        q *= self.c_hidden ** -0.5

    def mask_bias(self, mask: Tensor) -> Tensor:
        return (self.inf * (mask - 1))[:, None, None, :]  # (S, 1, 1, R)

    def forward(self, m: Tensor, z: Tensor, mask: Tensor | None = None) -> Tensor:
        s, r, _ = m.shape
        m = self.layer_norm_m(m)
        pair_bias = self.linear_z(self.layer_norm_z(z)).permute(2, 0, 1)[None]  # (1, H, R, R)
        q, k, v = (lin(m).view(s, r, self.no_heads, self.c_hidden).transpose(1, 2)
                   for lin in (self.linear_q, self.linear_k, self.linear_v))
        self.scale_q(q)
        a = q @ k.transpose(-1, -2) + pair_bias
        if mask is not None:
            a = a + self.mask_bias(mask)
        o = (torch.softmax(a, dim=-1) @ v).transpose(1, 2).reshape(s, r, -1)
        return self.linear_o(o * torch.sigmoid(self.linear_g(m)))


class PairBiasQFirst(MSARowAttentionWithPairBias):
    """The same module with the attention's layers declared before the pair-bias ones (the order in which the
    doctor, which takes E from the first nn.Linear, can run it); the bug variants below derive from it."""

    pair_first = False


class PairBiasInf1e9(PairBiasQFirst):
    """Bug (float16): OpenFold's fp32 "inf" of 1e9 kept: 1e9 is inf in float16, and 0 * inf is NaN."""

    inf = 1e9


class PairBiasScaleByCm(PairBiasQFirst):
    """Bug: q scaled by c_m ** -0.5 (the MSA channel width) instead of c_hidden ** -0.5."""

    def scale_q(self, q: Tensor) -> None:
        q *= (self.c_hidden * self.no_heads) ** -0.5


class PairBiasMaskInverted(PairBiasQFirst):
    """Bug: the mask read as 1 = padding (the bias -inf * mask)."""

    def mask_bias(self, mask: Tensor) -> Tensor:
        return (-self.inf * mask)[:, None, None, :]


C_Z = 8


def _pair(r: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A fixed pair representation (R, R, c_z) for R residues (the same for every call at that R)."""
    g = torch.Generator().manual_seed(r)
    return torch.randn(r, r, C_Z, generator=g).to(device=device, dtype=dtype)


def _pair_call(mod: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """MSA rows x (S, R, c_m) with the pair representation the trunk would give."""
    return mod(x, _pair(x.size(1), x.dtype, x.device), mask)


# ---------------------------------------------------------------------------------------------------------------
# Swin (v1): window attention on a (B, H, W, C) feature map


def _window_partition(x: Tensor, ws: int) -> Tensor:
    """(B, H, W, C) -> (B * nW, ws * ws, C)."""
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, ws * ws, c)


def _window_reverse(windows: Tensor, ws: int, h: int, w: int) -> Tensor:
    """(B * nW, ws * ws, C) -> (B, H, W, C)."""
    c = windows.size(-1)
    x = windows.view(-1, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, h, w, c)


class SwinWindowAttention(nn.Module):
    # style: Swin Transformer v1 WindowAttention (relative_position_bias_table / relative_position_index,
    # fused qkv, additive shifted-window mask), driven by the block's window_partition / cyclic shift
    """forward(x): x (B, H, W, C) feature map; attention within ws x ws windows, shifted by ``shift_size``
    (SW-MSA, with Swin's mask between the regions a shift brings together); returns (B, H, W, C)."""

    def __init__(self, dim: int, num_heads: int, window_size: int = 2, shift_size: int = 0) -> None:
        super().__init__()
        self.dim, self.num_heads, self.ws, self.shift = dim, num_heads, window_size, shift_size
        self.scale = (dim // num_heads) ** -0.5
        ws = window_size
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, num_heads) * 0.5)
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (ws - 1)  # (N, N, 2)
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * ws - 1) + rel[..., 1], persistent=False)
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def shift_mask(self, h: int, w: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """(nW, N, N) additive: 0 within a region, -100 between regions a cyclic shift put in one window."""
        img = torch.zeros(1, h, w, 1, device=device)
        cuts = (slice(0, -self.ws), slice(-self.ws, -self.shift), slice(-self.shift, None))
        for n, (hs, wsl) in enumerate((a, b) for a in cuts for b in cuts):
            img[:, hs, wsl, :] = n
        regions = _window_partition(img, self.ws).squeeze(-1)  # (nW, N)
        return ((regions[:, None, :] != regions[:, :, None]) * -100.0).to(dtype)

    def merge(self, out: Tensor) -> Tensor:
        b_, _, n, _ = out.shape
        return out.transpose(1, 2).reshape(b_, n, -1)

    def attention(self, windows: Tensor, mask: Tensor | None) -> Tensor:
        b_, n, c = windows.shape
        qkv = self.qkv(windows).reshape(b_, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = attn + bias.permute(2, 0, 1)[None]
        if mask is not None:
            nw = mask.size(0)
            attn = (attn.view(b_ // nw, nw, self.num_heads, n, n) + mask[None, :, None]).view(-1, self.num_heads, n, n)
        return self.proj(self.merge(attn.softmax(dim=-1) @ v))

    def forward(self, x: Tensor) -> Tensor:
        h, w = x.shape[1:3]
        mask = None
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
            mask = self.shift_mask(h, w, x.device, x.dtype)
        out = _window_reverse(self.attention(_window_partition(x, self.ws), mask), self.ws, h, w)
        if self.shift:
            out = torch.roll(out, shifts=(self.shift, self.shift), dims=(1, 2))
        return out


class SwinHeadMergeNoTranspose(SwinWindowAttention):
    """Bug: (attn @ v).reshape(B_, N, C) without the transpose(1, 2)."""

    def merge(self, out: Tensor) -> Tensor:
        b_, _, n, _ = out.shape
        return out.reshape(b_, n, -1)


class SwinScaleByDim(SwinWindowAttention):
    """Bug: qk_scale = dim ** -0.5 (the channel width) instead of head_dim ** -0.5."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = self.dim ** -0.5


def _square_map(mod: nn.Module, x: Tensor) -> Tensor:
    """Tokens x (B, L, C) as the (B, sqrt(L), sqrt(L), C) feature map Swin's stages carry."""
    b, n, c = x.shape
    side = math.isqrt(n)
    return mod(x.view(b, side, side, c)).reshape(b, n, c)


# ---------------------------------------------------------------------------------------------------------------
# gpt-fast


class KVCache(nn.Module):
    # style: gpt-fast KVCache: buffers for max_batch_size rows, updated with index_copy_ at input_pos
    def __init__(self, max_batch_size: int, max_seq_length: int, n_heads: int, head_dim: int) -> None:
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def update(self, input_pos: Tensor, k_val: Tensor, v_val: Tensor) -> tuple[Tensor, Tensor]:
        k_out, v_out = self.k_cache, self.v_cache
        k_out.index_copy_(2, input_pos, k_val)
        v_out.index_copy_(2, input_pos, v_val)
        return k_out, v_out


def _precompute_freqs_cis(seq_len: int, n_elem: int, base: float = 10000.0) -> Tensor:
    """gpt-fast's rotary cache: (seq_len, n_elem // 2, 2) cos/sin of interleaved pairs."""
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """x (B, T, H, D): rotate the pairs (x[2i], x[2i+1]) by the angles of their position (computed in float32)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = freqs_cis.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
                       xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)


class GptFastAttention(nn.Module):
    # style: gpt-fast model.py Attention: fused wqkv (GQA), interleaved rotary from freqs_cis, KVCache with
    # index_copy_, SDPA with the model's causal mask over the whole cache
    """forward(x, freqs_cis, mask, input_pos): x (B, T, E) with B = max_batch_size; mask (1, 1, T, S) bool
    (the model's causal_mask[None, None, input_pos]); the cache holds S = max_seq_length positions."""

    def __init__(self, dim: int, n_head: int, n_local_heads: int | None = None, max_batch_size: int = 4,
                 max_seq_length: int = 32) -> None:
        super().__init__()
        self.n_head, self.n_local_heads = n_head, n_local_heads or n_head
        self.head_dim, self.dim = dim // n_head, dim
        self.wqkv = nn.Linear(dim, (n_head + 2 * self.n_local_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache = KVCache(max_batch_size, max_seq_length, self.n_local_heads, self.head_dim)

    def rotate(self, q: Tensor, k: Tensor, v: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return _apply_rotary_emb(q, freqs_cis), _apply_rotary_emb(k, freqs_cis), v

    def cache(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.kv_cache.update(input_pos, k, v)

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q, k, v = self.rotate(q, k, v, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = self.cache(input_pos, k, v)
        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))


class GptFastRotaryOnV(GptFastAttention):
    """Bug: the rotary embedding applied to v as well."""

    def rotate(self, q: Tensor, k: Tensor, v: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(_apply_rotary_emb(t, freqs_cis) for t in (q, k, v))  # type: ignore[return-value]


class GptFastCacheOffByOne(GptFastAttention):
    """Bug: the new keys/values written at input_pos + 1: each query sees its predecessor's key in its own
    place, and position 0 holds nothing."""

    def cache(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.kv_cache.update(input_pos + 1, k, v)


def _gpt_fast_call(m: nn.Module, x: Tensor) -> Tensor:
    """A prefill as gpt-fast's Transformer runs it: positions 0..T-1, its causal mask over the whole cache."""
    seqlen, max_len = x.size(1), m.kv_cache.k_cache.size(2)
    input_pos = torch.arange(seqlen, device=x.device)
    causal = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=x.device))
    freqs_cis = _precompute_freqs_cis(max_len, m.head_dim).to(x.device)
    return m(x, freqs_cis[input_pos], causal[None, None, input_pos], input_pos)


# ---------------------------------------------------------------------------------------------------------------
# litgpt style, hand-written (the real class is entered below when litgpt is installed)


def _rope_cache(seq_len: int, n_elem: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """litgpt's build_rope_cache: cos, sin (T, n_elem), rotate-half layout."""
    theta = 1.0 / (10000 ** (torch.arange(0, n_elem, 2, device=device).float() / n_elem))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), theta).repeat(1, 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class PartialRotaryCausalSelfAttention(nn.Module):
    # style: litgpt CausalSelfAttention: fused qkv, rotary on the first rope_n_elem of each head
    # (rotary_percentage 0.25, Pythia/GPT-NeoX), SDPA is_causal when no mask is given
    """forward(x, cos, sin, mask=None): x (B, T, E); cos, sin (T, rope_n_elem); mask None (causal) or
    (B, 1, T, T) bool, True = may attend."""

    def __init__(self, n_embd: int, n_head: int, rotary_percentage: float = 0.25) -> None:
        super().__init__()
        self.n_head, self.head_size = n_head, n_embd // n_head
        self.rope_n_elem = int(rotary_percentage * self.head_size)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def rope(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n = self.rope_n_elem
        q = torch.cat((_rotate_half_rope(q[..., :n], cos, sin), q[..., n:]), dim=-1)
        k = torch.cat((_rotate_half_rope(k[..., :n], cos, sin), k[..., n:]), dim=-1)
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return y.transpose(1, 2)  # (B, T, H, D)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (u.view(b, t, self.n_head, self.head_size).transpose(1, 2) for u in (q, k, v))
        q, k, v = self.rope(q, k, v, cos, sin)
        return self.proj(self.attend(q, k, v, mask).reshape(b, t, c))


class PartialRotaryOnV(PartialRotaryCausalSelfAttention):
    """Bug: the rotary part applied to v too."""

    def rope(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, _ = super().rope(q, k, v, cos, sin)
        n = self.rope_n_elem
        return q, k, torch.cat((_rotate_half_rope(v[..., :n], cos, sin), v[..., n:]), dim=-1)


class PartialRotaryMergeNoTranspose(PartialRotaryCausalSelfAttention):
    """Bug: the (B, H, T, D) output reshaped to (B, T, E) without the transpose."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


class PartialRotaryCausalOffByOne(PartialRotaryCausalSelfAttention):
    """Bug: its own causal mask, ones(T, T).triu(diagonal=2) as the hidden part: the next token is visible."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        t = q.size(2)
        causal = ~torch.ones(t, t, dtype=torch.bool, device=q.device).triu(diagonal=2)
        mask = causal if mask is None else mask & causal
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def _litgpt_style_call(m: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    cos, sin = _rope_cache(x.size(1), m.rope_n_elem, x.dtype, x.device)
    return m(x, cos, sin, mask)


# ---------------------------------------------------------------------------------------------------------------
# Conformer


class ConformerMHSAModule(nn.Module):
    # style: Conformer multi-headed self-attention module (torchaudio/NeMo layout): LayerNorm, self-attention
    # with key_padding_mask (True = padding), dropout, residual
    """forward(x, key_padding_mask=None): x (B, T, E); key_padding_mask (B, T) bool, True = padding."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm = nn.LayerNorm(d_model)
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.query(h), self.key(h), self.value(h)

    def weights(self, scores: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        return scores.softmax(dim=-1)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        b, t, c = x.shape
        h = self.norm(x)
        q, k, v = (u.view(b, t, self.n_heads, -1).transpose(1, 2) for u in self.qkv(h))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        out = (self.weights(scores, key_padding_mask) @ v).transpose(1, 2).reshape(b, t, c)
        return x + self.dropout(self.out(out))


class ConformerMaskInverted(ConformerMHSAModule):
    """Bug: the padding mask used as a keep-mask (masked_fill(~key_padding_mask, ...))."""

    def weights(self, scores: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        if key_padding_mask is not None:
            scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
        return scores.softmax(dim=-1)


class ConformerMaskAfterSoftmax(ConformerMHSAModule):
    """Bug: the padded keys' weights zeroed after the softmax, not renormalised."""

    def weights(self, scores: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        attn = scores.softmax(dim=-1)
        if key_padding_mask is not None:
            attn = attn.masked_fill(key_padding_mask[:, None, None, :], 0.0)
        return attn


class ConformerKeyIsQuery(ConformerMHSAModule):
    """Bug: k = self.query(h): the key projection is never used."""

    def qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.query(h), self.query(h), self.value(h)


# ---------------------------------------------------------------------------------------------------------------
# Swin v2 cosine attention


class CosineAttention(nn.Module):
    # style: Swin Transformer v2 WindowAttention's scaled cosine attention: F.normalize q and k, a learned
    # per-head logit_scale clamped at log(100) and exponentiated (here over a sequence, with a key mask)
    """forward(x, mask=None): x (B, L, E); mask (B, L) bool, True = may attend."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.logit_scale = nn.Parameter(torch.log(10 * torch.ones(num_heads, 1, 1)))
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def cosine(self, q: Tensor, k: Tensor) -> Tensor:
        return F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)

    def softmax(self, attn: Tensor) -> Tensor:
        return attn.softmax(dim=-1)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        attn = self.cosine(q, k) * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        if mask is not None:
            attn = attn.masked_fill(~mask[:, None, None, :], float("-inf"))
        return self.proj((self.softmax(attn) @ v).transpose(1, 2).reshape(b, n, c))


class CosineNormalizeTokens(CosineAttention):
    """Bug: F.normalize over dim -2 (the tokens) instead of -1 (the channels of one head)."""

    def cosine(self, q: Tensor, k: Tensor) -> Tensor:
        return F.normalize(q, dim=-2) @ F.normalize(k, dim=-2).transpose(-2, -1)


class CosineSoftmaxQueries(CosineAttention):
    """Bug: softmax over the query axis."""

    def softmax(self, attn: Tensor) -> Tensor:
        return attn.softmax(dim=-2)


# ---------------------------------------------------------------------------------------------------------------
# sequence-first einsum attention


class SeqFirstEinsumAttention(nn.Module):
    # style: sequence-first (L, B, E) einsum attention as Transformer-XL / Megatron-era code writes it:
    # "ibnd,jbnd->ijbn" scores, softmax over dim 1 (the keys), "ijbn,jbnd->ibnd"
    """forward(x, key_padding_mask=None): x (L, B, E); key_padding_mask (B, L) bool, True = padding."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.d_head = n_head, d_model // n_head
        self.q_net = nn.Linear(d_model, d_model)
        self.kv_net = nn.Linear(d_model, 2 * d_model)
        self.o_net = nn.Linear(d_model, d_model)
        self.scale = self.d_head ** -0.5

    def probs(self, score: Tensor) -> Tensor:
        return score.softmax(dim=1)

    def combine(self, prob: Tensor, v: Tensor) -> Tensor:
        return torch.einsum("ijbn,jbnd->ibnd", prob, v)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        length, bsz, _ = x.shape
        q = self.q_net(x).view(length, bsz, self.n_head, self.d_head)
        k, v = (t.reshape(length, bsz, self.n_head, self.d_head) for t in self.kv_net(x).chunk(2, dim=-1))
        score = torch.einsum("ibnd,jbnd->ijbn", q, k) * self.scale
        if key_padding_mask is not None:
            score = score.masked_fill(key_padding_mask.t()[None, :, :, None], float("-inf"))
        vec = self.combine(self.probs(score), v)
        return self.o_net(vec.reshape(length, bsz, -1))


class SeqFirstSoftmaxQueries(SeqFirstEinsumAttention):
    """Bug: softmax over dim 0 (the queries), as if the layout were (keys, queries) ..."""

    def probs(self, score: Tensor) -> Tensor:
        return score.softmax(dim=0)


class SeqFirstWeightsTransposed(SeqFirstEinsumAttention):
    """Bug: "ijbn,ibnd->jbnd": the weights summed over the queries (weights^T @ V)."""

    def combine(self, prob: Tensor, v: Tensor) -> Tensor:
        return torch.einsum("ijbn,ibnd->jbnd", prob, v)


class SeqFirstNoScale(SeqFirstEinsumAttention):
    """Bug: the scale never applied."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scale = 1.0


class SeqFirstNamedWeightsTransposed(SeqFirstEinsumAttention):
    """Bug: "ijbn,ibnd->jbnd" (weights^T @ V), with the projections named for their roles (q_proj, k_proj, v_proj)."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__(d_model, n_head)
        del self.q_net, self.kv_net
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, d_model) for _ in range(3))

    def combine(self, prob: Tensor, v: Tensor) -> Tensor:
        return torch.einsum("ijbn,ibnd->jbnd", prob, v)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        length, bsz, _ = x.shape
        q, k, v = (p(x).view(length, bsz, self.n_head, self.d_head) for p in (self.q_proj, self.k_proj, self.v_proj))
        score = torch.einsum("ibnd,jbnd->ijbn", q, k) * self.scale
        if key_padding_mask is not None:
            score = score.masked_fill(key_padding_mask.t()[None, :, :, None], float("-inf"))
        return self.o_net(self.combine(self.probs(score), v).reshape(length, bsz, -1))


# ---------------------------------------------------------------------------------------------------------------
# real packages: fair-esm, litgpt


def _esm_mha(rotary: bool, scaling: str = "head") -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from esm.multihead_attention import MultiheadAttention

        m = MultiheadAttention(E, H, self_attention=True, use_rotary_embeddings=rotary)
        if scaling == "none":  # a user who set scaling = 1 (the scale folded elsewhere, and forgotten there)
            m.scaling = 1.0
        elif scaling == "width":
            m.scaling = E ** -0.5
        return m
    return make


def _esm_call(m: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """fairseq's self-attention call (T, B, E); key_padding_mask (B, T) True = padding."""
    return m(x, x, x, key_padding_mask=mask, need_weights=False)[0]


def _esm_row() -> nn.Module:
    from esm.axial_attention import RowSelfAttention

    return RowSelfAttention(E, H)


def _esm_column() -> nn.Module:
    from esm.axial_attention import ColumnSelfAttention

    return ColumnSelfAttention(E, H)


def _row_call(m: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """One MSA row: x (B, L, E) -> (R=1, C=L, B, E); padding mask (B, R, C), True = padding."""
    pad = None if mask is None else mask[:, None, :]
    return m(x.permute(1, 0, 2)[None], self_attn_padding_mask=pad)[0][0].permute(1, 0, 2)


def _column_call(m: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """One MSA column: x (B, L, E) -> (R=L, C=1, B, E); padding mask (B, R, C), True = padding."""
    pad = None if mask is None else mask[:, :, None]
    return m(x.permute(1, 0, 2)[:, None], self_attn_padding_mask=pad)[0][:, 0].permute(1, 0, 2)


def _litgpt(n_query_groups: int = H) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from litgpt.config import Config
        from litgpt.model import CausalSelfAttention

        config = Config(n_embd=E, n_head=H, n_query_groups=n_query_groups, rotary_percentage=0.25, bias=True,
                        block_size=128, n_layer=1, padded_vocab_size=128)
        return CausalSelfAttention(config, block_idx=0)
    return make


def _litgpt_call(m: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """GPT.forward's call: cos/sin of the positions (model.rope_cache), mask None (causal) or (B, 1, T, T)."""
    from litgpt.model import build_rope_cache

    cos, sin = build_rope_cache(x.size(1), m.config.rope_n_elem, device=x.device)
    return m(x, cos.to(x.dtype)[None], sin.to(x.dtype)[None], mask)


# ---------------------------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True)
class Wild:
    """One module (or buggy variant) and what the doctor must say about it."""

    module: str  # the style or package class
    variant: str  # "correct", or the bug
    make: Callable[[], nn.Module]  # the factory a user would give
    options: dict = field(default_factory=dict)  # further selfattn.check arguments
    expected: str | None = None  # None: certified (no error finding); else the error id that must be named
    needs: str | None = None  # the package an entry imports (skipped without it)
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}/{self.variant}"

    @property
    def available(self) -> bool:
        return self.needs is None or importlib.util.find_spec(self.needs) is not None


def _f(cls: type, *args, **kwargs) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        return cls(*args, **kwargs)
    make.__qualname__ = f"{cls.__name__}{args}"
    return make


def _causal_keep(keep: Tensor) -> Tensor:
    """litgpt's mask: the model's causal mask_cache and the padding together, (B, 1, T, T) bool."""
    t = keep.size(-1)
    return (keep & torch.ones(t, t, dtype=torch.bool, device=keep.device).tril())[:, None]


_ESM = {"call": _esm_call, "mask": "ignore (B,L)"}
_ESP = {"call": _espnet_call, "mask": "keep (B,L,L)"}
_ESP_NEW = {"mask": "keep (B,L,L)"}
_ESP_B1T = {"mask": "keep (B,L)", "make_mask": lambda keep: keep[:, None, :]}  # ESPnet's encoder mask (B, 1, T)
_TXL = (H, E, D)
_AF = {"call": _pair_call, "mask": "keep-float (B,L)"}
_AF_ARGS = (E, C_Z, D, H)
_SWIN = {"call": _square_map, "length": [16, 36]}
_GPT_FAST = {"call": _gpt_fast_call, "batch": 4}
_LIT = {"call": _litgpt_style_call}
_CONF = {"mask_convention": "ignore"}
_KEEP = {"mask_convention": "keep"}

WILD_ENTRIES: list[Wild] = [
    # -- fair-esm (fairseq's MultiheadAttention, ESM-1b/ESM-2; MSA Transformer's axial attention)
    Wild("esm-mha", "correct", _esm_mha(False), _ESM, needs="esm",
         note="no rotary: fairseq hands the work to torch's F.multi_head_attention_forward"),
    Wild("esm-mha-rotary", "correct", _esm_mha(True), _ESM, needs="esm",
         note="ESM-2: rotary, q *= scaling in place, bmm"),
    Wild("esm-mha-rotary", "scaling = 1", _esm_mha(True, "none"), _ESM, "missing-scale", needs="esm"),
    Wild("esm-mha-rotary", "scaling = embed_dim ** -0.5", _esm_mha(True, "width"), _ESM, "wrong-scale", needs="esm"),
    Wild("esm-row", "correct", _esm_row, {"call": _row_call, "mask": "ignore (B,L)"}, needs="esm",
         note="RowSelfAttention on one row (R = 1)"),
    Wild("esm-column", "correct", _esm_column, {"call": _column_call, "mask": "ignore (B,L)"}, needs="esm",
         note="ColumnSelfAttention on one column (C = 1)"),
    # -- litgpt
    Wild("litgpt", "correct", _litgpt(), {"call": _litgpt_call}, needs="litgpt",
         note="rotary_percentage 0.25; mask None = causal (SDPA is_causal), as GPT.forward calls it"),
    Wild("litgpt-gqa", "correct", _litgpt(2), {"call": _litgpt_call}, needs="litgpt"),
    Wild("litgpt", "correct, mask stated", _litgpt(), {"call": _litgpt_call, "mask": "keep (B,1,L,L)"},
         needs="litgpt", note="a given mask replaces the causal default (GPT passes its causal mask_cache)"),
    Wild("litgpt", "correct, causal & padding mask", _litgpt(), {"call": _litgpt_call, "make_mask": _causal_keep},
         needs="litgpt", note="the mask GPT would pass: causal mask_cache & padding, (B, 1, T, T)"),
    # -- ESPnet / WeNet
    Wild("espnet-relpos-legacy", "correct", _f(RelPositionMultiHeadedAttention, H, E), _ESP,
         note="masked_fill(mask, 0.0) after the softmax, as ESPnet/WeNet write it"),
    Wild("espnet-relpos-legacy", "no 1/sqrt(d_k)", _f(RelPosNoScale, H, E), _ESP, "missing-scale"),
    Wild("espnet-relpos-legacy", "pos_bias_u forgotten", _f(RelPosNoBiasU, H, E), _ESP, "no-grad",
         note="still attention, but the declared pos_bias_u is never read beside its twin pos_bias_v"),
    Wild("espnet-relpos-legacy", "mask only after softmax", _f(RelPosMaskAfterSoftmax, H, E), _ESP,
         "mask-after-softmax"),
    Wild("espnet-relpos-legacy", "mask inverted", _f(RelPosMaskInverted, H, E), _ESP, "mask-inverted"),
    Wild("espnet-relpos-relshift", "correct", _f(RelPositionSelfAttention, H, E), _ESP_NEW),
    Wild("espnet-relpos-relshift", "correct, (B, 1, T) mask", _f(RelPositionSelfAttention, H, E), _ESP_B1T,
         note="make_mask gives ESPnet's encoder mask shape"),
    Wild("espnet-relpos-relshift", "softmax over queries", _f(RelShiftSoftmaxQueries, H, E), _ESP_NEW,
         "softmax-dim"),
    Wild("espnet-relpos-relshift", "scale by n_feat", _f(RelShiftScaleByWidth, H, E), _ESP_NEW, "wrong-scale"),
    Wild("icefall-relpos", "correct", _f(IcefallRelPositionAttention, H, E), _CONF),
    Wild("icefall-relpos", "no 1/sqrt(d_k)", _f(IcefallNoScale, H, E), _CONF, "missing-scale"),
    Wild("icefall-relpos", "pos_bias_u forgotten", _f(IcefallNoBiasU, H, E), _CONF, "no-grad",
         note="still attention, but the declared pos_bias_u is never read beside its twin pos_bias_v"),
    Wild("icefall-relpos", "softmax over queries", _f(IcefallSoftmaxQueries, H, E), _CONF, "softmax-dim"),
    # -- Transformer-XL
    Wild("txl-rel-partial", "correct", _f(RelPartialLearnableMultiHeadAttn, *_TXL)),
    Wild("txl-rel-partial", "causal mask off by one", _f(TXLCausalOffByOne, *_TXL), expected="causal-leak"),
    Wild("txl-rel-partial", "softmax over queries (dim 0)", _f(TXLSoftmaxQueries, *_TXL), expected="softmax-dim"),
    Wild("txl-rel-partial", "no scale", _f(TXLNoScale, *_TXL), expected="missing-scale"),
    # -- AlphaFold / OpenFold
    Wild("af2-pair-bias-gated", "correct (OpenFold layer order)", _f(MSARowAttentionWithPairBias, *_AF_ARGS), _AF,
         note="linear_z (c_z -> H) is the first nn.Linear"),
    Wild("af2-pair-bias-gated", "correct", _f(PairBiasQFirst, *_AF_ARGS), _AF),
    Wild("af2-pair-bias-gated", "inf = 1e9 in float16", _f(PairBiasInf1e9, *_AF_ARGS), _AF,
         "half-precision-overflow"),
    Wild("af2-pair-bias-gated", "q scaled by c_m", _f(PairBiasScaleByCm, *_AF_ARGS), _AF, "wrong-scale"),
    Wild("af2-pair-bias-gated", "mask inverted", _f(PairBiasMaskInverted, *_AF_ARGS), _AF, "mask-inverted"),
    # -- Swin v1 windows on a map
    Wild("swin-map-windows", "correct, one window", _f(SwinWindowAttention, E, H, 2, 0), {**_SWIN, "length": 4}),
    Wild("swin-map-windows", "correct", _f(SwinWindowAttention, E, H, 2, 0), _SWIN),
    Wild("swin-map-windows-shifted", "correct", _f(SwinWindowAttention, E, H, 2, 1), _SWIN),
    Wild("swin-map-windows", "head merge without transpose", _f(SwinHeadMergeNoTranspose, E, H, 2, 0), _SWIN,
         "head-merge"),
    Wild("swin-map-windows", "scale by dim", _f(SwinScaleByDim, E, H, 2, 0), _SWIN, "wrong-scale"),
    # -- gpt-fast
    Wild("gpt-fast", "correct", _f(GptFastAttention, E, H, 2), _GPT_FAST,
         note="GQA 4/2; cache for exactly 4 rows and 32 positions; inference code (no detach); batch=4 stated"),
    Wild("gpt-fast", "correct, batch not stated", _f(GptFastAttention, E, H, 2), {"call": _gpt_fast_call}),
    Wild("gpt-fast", "correct, 1 row x 32 positions", _f(GptFastAttention, E, H, 2, max_batch_size=1),
         {"call": _gpt_fast_call}),
    Wild("gpt-fast", "rotary on v", _f(GptFastRotaryOnV, E, H, 2), _GPT_FAST, "values-changed"),
    Wild("gpt-fast", "cache written at input_pos + 1", _f(GptFastCacheOffByOne, E, H, 2), _GPT_FAST,
         "causal-leak"),
    # -- litgpt style
    Wild("litgpt-style-partial-rope", "correct", _f(PartialRotaryCausalSelfAttention, E, H), _LIT),
    Wild("litgpt-style-partial-rope", "rotary on v", _f(PartialRotaryOnV, E, H), _LIT, "values-changed"),
    Wild("litgpt-style-partial-rope", "head merge without transpose", _f(PartialRotaryMergeNoTranspose, E, H),
         _LIT, "head-merge"),
    Wild("litgpt-style-partial-rope", "causal mask off by one", _f(PartialRotaryCausalOffByOne, E, H), _LIT,
         "causal-leak"),
    # -- Conformer
    Wild("conformer-mhsa", "correct", _f(ConformerMHSAModule, E, H), _CONF),
    Wild("conformer-mhsa", "correct, convention not stated", _f(ConformerMHSAModule, E, H)),
    Wild("conformer-mhsa", "mask inverted", _f(ConformerMaskInverted, E, H), _CONF, "mask-inverted"),
    Wild("conformer-mhsa", "mask after softmax", _f(ConformerMaskAfterSoftmax, E, H), _CONF, "mask-after-softmax"),
    Wild("conformer-mhsa", "k = self.query(h)", _f(ConformerKeyIsQuery, E, H), _CONF, "no-grad"),
    # -- Swin v2 cosine
    Wild("swinv2-cosine", "correct", _f(CosineAttention, E, H), _KEEP),
    Wild("swinv2-cosine", "normalize over tokens", _f(CosineNormalizeTokens, E, H), _KEEP, "mask-ignored",
         note="q/k normalised across the sequence: padded tokens reach the real ones"),
    Wild("swinv2-cosine", "softmax over queries", _f(CosineSoftmaxQueries, E, H), _KEEP, "softmax-dim"),
    # -- sequence-first einsum
    Wild("seq-first-einsum", "correct", _f(SeqFirstEinsumAttention, E, H), _CONF),
    Wild("seq-first-einsum", "softmax over queries (dim 0)", _f(SeqFirstSoftmaxQueries, E, H), _CONF,
         "softmax-dim"),
    Wild("seq-first-einsum", "weights transposed", _f(SeqFirstWeightsTransposed, E, H), _CONF, "matmul-order"),
    Wild("seq-first-einsum", "weights transposed, named projections", _f(SeqFirstNamedWeightsTransposed, E, H),
         _CONF, "matmul-order"),
    Wild("seq-first-einsum", "no scale", _f(SeqFirstNoScale, E, H), _CONF, "missing-scale"),
]

WILD: dict[str, Wild] = {w.name: w for w in WILD_ENTRIES}
assert len(WILD) == len(WILD_ENTRIES), "duplicate wild entry names"


def check_wild(entry: Wild, seed: int = 0) -> Report:
    """The doctor on one entry, as a user would run it."""
    return check(entry.make, seed=seed, **entry.options)


def errors(report: Report) -> set[str]:
    return {f.id for f in report.findings if f.severity == "error"}


def right(entry: Wild, report: Report) -> bool:
    """The verdict the entry must get: certified, or failed naming the expected id."""
    if entry.expected is None:
        return report.verdict == "passed"
    return report.verdict == "failed" and entry.expected in report.ids


if __name__ == "__main__":  # python tests/doctor_corpus_wild.py [substring ...]: the table, with seconds
    picks = [w for w in WILD_ENTRIES if not sys.argv[1:] or any(s in w.name for s in sys.argv[1:])]
    for w in picks:
        if not w.available:
            print(f"{w.name}: skipped ({w.needs} not installed)")
            continue
        start = time.perf_counter()
        try:
            r = check_wild(w)
        except Exception as err:  # a look at every entry, whatever fails
            print(f"{w.name}: RAISED {type(err).__name__}: {str(err)[:300]}")
            continue
        took = time.perf_counter() - start
        mark = "ok   " if right(w, r) else "WRONG"
        print(f"{mark} {w.name}: expected {w.expected or 'passed'}; got {r.verdict} {sorted(r.ids)} "
              f"{took:.2f}s" + (f" not_verified={r.not_verified}" if r.not_verified else "")
              + (f" doctor_errors={r.doctor_errors}" if r.doctor_errors else ""))

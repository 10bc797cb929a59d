"""The doctor in the wild, second round: more attention modules from code bases it had not seen.

Same form as tests/doctor_corpus_wild.py (its :class:`Wild` entries, checked by tests/test_check_wild2.py).
Two kinds of entries:

- real packages, imported (never copied): timm's SAM/ViTDet ``Attention`` with decomposed relative
  positions on a (B, H, W, C) map, timm's Swin v2 ``WindowAttention`` (cosine scores, a learned logit
  scale, the continuous position bias MLP), vit-pytorch's NaViT ``Attention`` (RMS-normalised q/k with
  learned gains, SDPA with scale 1), transformers' ``XLNetRelativeAttention`` (sequence-first, content
  and position terms with their biases, rel_shift, post-norm), x-transformers' ``Attention`` with
  talking heads and with gated values;
- modules written here in the style of a code base (one-line comment on each class names it; none is
  a copy): OpenNMT's MultiHeadedAttention with ``max_relative_positions`` (Shaw: a term on the scores
  and one on the values), nanoGPT with in-place operations (``q.mul_``, ``masked_fill_``), a
  lucidrains-style einops module, MPT/BLOOM-style ALiBi through ``baddbmm``, Meta's llama reference
  inference attention (a preallocated cache written by slice assignment at ``start_pos``, complex
  rotary, ``repeat_kv``), a diffusers-style attention processor (heads folded into the batch,
  ``baddbmm(beta=0)``), an ESPnet-style module that rewrites the caller's mask in place, and a T5-style
  encoder attention with bucketed relative positions and no scale (``scale=1`` stated, as T5 folds it
  into its initialisation).

Each buggy variant is one line changed, a bug that ships in that style.

Shape legend: B batch, L length, E embed dim, H heads, D head dim, S cache length.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from doctor_corpus_wild import Wild, check_wild, right
from torch import Tensor, nn

E, H = 64, 4
D = E // H


def _f(cls: type, *args, **kwargs) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        return cls(*args, **kwargs)
    make.__qualname__ = f"{cls.__name__}{args}"
    return make


# ---------------------------------------------------------------------------------------------------------------
# OpenNMT-py MultiHeadedAttention with max_relative_positions (Shaw et al. 2018)


def _relative_positions_matrix(length: int, max_relative_positions: int, device: torch.device) -> Tensor:
    r = torch.arange(length, device=device)
    distance = r[None, :] - r[:, None]  # (L, L): key - query
    return torch.clamp(distance, -max_relative_positions, max_relative_positions) + max_relative_positions


def _relative_matmul(x: Tensor, z: Tensor, transpose: bool) -> Tensor:
    """x (B, H, L, *), z (L, L, *): the Shaw term, one relation per (query, key) pair."""
    b, h, length, _ = x.shape
    x_t = x.permute(2, 0, 1, 3).reshape(length, b * h, -1)  # (L, B*H, *)
    out = torch.matmul(x_t, z.transpose(1, 2) if transpose else z)  # (L, B*H, *)
    return out.reshape(length, b, h, -1).permute(1, 2, 0, 3)


class ShawMultiHeadedAttention(nn.Module):
    # style: OpenNMT-py onmt/modules/multi_headed_attn.py with max_relative_positions > 0
    """forward(x, mask): mask (B, 1, L) bool, True = padding (OpenNMT's convention)."""

    def __init__(self, head_count: int, model_dim: int, max_relative_positions: int = 4) -> None:
        super().__init__()
        self.dim_per_head = model_dim // head_count
        self.model_dim, self.head_count = model_dim, head_count
        self.linear_keys = nn.Linear(model_dim, model_dim)
        self.linear_values = nn.Linear(model_dim, model_dim)
        self.linear_query = nn.Linear(model_dim, model_dim)
        self.final_linear = nn.Linear(model_dim, model_dim)
        self.max_relative_positions = max_relative_positions
        vocab = 2 * max_relative_positions + 1
        self.relative_positions_embeddings = nn.Embedding(vocab, self.dim_per_head)

    def shape(self, x: Tensor) -> Tensor:
        return x.view(x.size(0), -1, self.head_count, self.dim_per_head).transpose(1, 2)

    def unshape(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2).contiguous().view(x.size(0), -1, self.head_count * self.dim_per_head)

    def keys(self, x: Tensor) -> Tensor:
        return self.linear_keys(x)

    def scale(self, query: Tensor) -> Tensor:
        query /= math.sqrt(self.dim_per_head)  # in place, on the head view of the projection
        return query

    def normalise(self, scores: Tensor) -> Tensor:
        return torch.softmax(scores, dim=-1)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        key, value = self.shape(self.keys(x)), self.shape(self.linear_values(x))
        query = self.shape(self.linear_query(x))
        positions = _relative_positions_matrix(x.size(1), self.max_relative_positions, x.device)
        relations_keys = self.relative_positions_embeddings(positions)  # (L, L, D)
        relations_values = self.relative_positions_embeddings(positions)
        query = self.scale(query)
        scores = torch.matmul(query, key.transpose(2, 3)) + _relative_matmul(query, relations_keys, True)
        scores = scores.float()  # OpenNMT masks in float32: -1e18 does not fit in half precision
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1), -1e18)  # (B, 1, 1, L)
        attn = self.normalise(scores).to(query.dtype)
        context = torch.matmul(attn, value) + _relative_matmul(attn, relations_values, False)
        return self.final_linear(self.unshape(context))


class ShawScaleByModelDim(ShawMultiHeadedAttention):
    """Bug: query / sqrt(model_dim)."""

    def scale(self, query: Tensor) -> Tensor:
        return query / math.sqrt(self.model_dim)


class ShawSoftmaxQueries(ShawMultiHeadedAttention):
    """Bug: softmax over the query axis."""

    def normalise(self, scores: Tensor) -> Tensor:
        return torch.softmax(scores, dim=-2)


class ShawKeyIsQuery(ShawMultiHeadedAttention):
    """Bug: the keys made by the query projection."""

    def keys(self, x: Tensor) -> Tensor:
        return self.linear_query(x)


_ONMT = {"mask": "ignore (B,L)", "make_mask": lambda keep: ~keep[:, None, :]}  # OpenNMT's (B, 1, L) pad mask


# ---------------------------------------------------------------------------------------------------------------
# nanoGPT with in-place operations


class InPlaceCausalSelfAttention(nn.Module):
    # style: nanoGPT model.py CausalSelfAttention, slow path, with the in-place edits people make to it
    def __init__(self, n_embd: int, n_head: int, block_size: int = 64) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", self.causal(block_size).view(1, 1, block_size, block_size))

    def causal(self, n: int) -> Tensor:
        return torch.tril(torch.ones(n, n))

    def head_scale(self, head_size: int) -> float:
        return 1.0 / math.sqrt(head_size)

    def merge(self, y: Tensor, b: int, t: int, c: int) -> Tensor:
        return y.transpose(1, 2).contiguous().view(b, t, c)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q.mul_(self.head_scale(k.size(-1)))  # in place on a view of the fused projection
        att = q @ k.transpose(-2, -1)
        att.masked_fill_(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        return self.c_proj(self.merge(att @ v, b, t, c))


class InPlaceScaleByWidth(InPlaceCausalSelfAttention):
    """Bug: 1/sqrt(n_embd) instead of 1/sqrt(head_size)."""

    def head_scale(self, head_size: int) -> float:
        return 1.0 / math.sqrt(self.n_embd)


class InPlaceCausalShowsNext(InPlaceCausalSelfAttention):
    """Bug: tril(diagonal=1), each query sees the next token."""

    def causal(self, n: int) -> Tensor:
        return torch.tril(torch.ones(n, n), diagonal=1)


class InPlaceMergeNoTranspose(InPlaceCausalSelfAttention):
    """Bug: heads merged with a view, without the transpose back."""

    def merge(self, y: Tensor, b: int, t: int, c: int) -> Tensor:
        return y.contiguous().view(b, t, c)


# ---------------------------------------------------------------------------------------------------------------
# lucidrains-style einops attention


class EinopsAttention(nn.Module):
    # style: lucidrains (vit-pytorch / x-transformers era) Attention with einops and a (b, j) key mask
    """forward(x, mask): mask (B, L) bool, True = may attend."""

    def __init__(self, dim: int, heads: int = 8, dim_head: int = 64) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, self.scale_for(dim, dim_head)
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_out = nn.Linear(inner, dim)

    def scale_for(self, dim: int, dim_head: int) -> float:
        return dim_head ** -0.5

    def weigh(self, attn: Tensor, v: Tensor) -> Tensor:
        from einops import einsum
        return einsum(attn, v, "b h i j, b h j d -> b h i d")

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        from einops import einsum, rearrange
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in self.to_qkv(x).chunk(3, dim=-1))
        q = q * self.scale
        sim = einsum(q, k, "b h i d, b h j d -> b h i j")
        if mask is not None:
            sim = sim.masked_fill(~rearrange(mask, "b j -> b 1 1 j"), -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        return self.to_out(rearrange(self.weigh(attn, v), "b h n d -> b n (h d)"))


class EinopsScaleByDim(EinopsAttention):
    """Bug: dim ** -0.5 (the model width) instead of dim_head ** -0.5."""

    def scale_for(self, dim: int, dim_head: int) -> float:
        return dim ** -0.5


class EinopsWeightsTransposed(EinopsAttention):
    """Bug: the weights read as (b h j i)."""

    def weigh(self, attn: Tensor, v: Tensor) -> Tensor:
        from einops import einsum
        return einsum(attn, v, "b h j i, b h j d -> b h i d")


_KEEP_BL = {"mask": "keep (B,L)"}


# ---------------------------------------------------------------------------------------------------------------
# ALiBi through baddbmm (MPT / BLOOM style)


def _alibi_slopes(n_heads: int) -> Tensor:
    start = 2 ** (-8 / n_heads)
    return torch.tensor([start ** (i + 1) for i in range(n_heads)])


class AlibiBaddbmmAttention(nn.Module):
    # style: BLOOM/MPT causal attention: alibi bias over key positions, baddbmm(alibi, q, k^T, alpha=1/sqrt(d))
    """forward(x, attention_mask): attention_mask (B, L), 1 = attend (Hugging Face)."""

    def __init__(self, hidden_size: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, hidden_size // n_head
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.register_buffer("slopes", _alibi_slopes(n_head), persistent=False)

    def alpha(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def hidden(self, t: int, device: torch.device) -> Tensor:
        return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        fused = self.query_key_value(x).view(b, t, self.n_head, 3, self.head_dim)
        q, k, v = (fused[..., i, :].transpose(1, 2).reshape(b * self.n_head, t, self.head_dim) for i in range(3))
        alibi = (self.slopes[:, None] * torch.arange(t, device=x.device, dtype=x.dtype)[None, :])  # (H, L)
        alibi = alibi[None, :, None, :].expand(b, -1, 1, -1).reshape(b * self.n_head, 1, t)
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), beta=1.0, alpha=self.alpha()).view(b, self.n_head, t, t)
        hidden = self.hidden(t, x.device)[None, None]
        if attention_mask is not None:
            hidden = hidden | ~attention_mask.bool()[:, None, None, :]
        scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        ctx = (probs.view(b * self.n_head, t, t) @ v).view(b, self.n_head, t, self.head_dim)
        return self.dense(ctx.permute(0, 2, 1, 3).reshape(b, t, -1))


class AlibiNoAlpha(AlibiBaddbmmAttention):
    """Bug: baddbmm with alpha=1 (the 1/sqrt(d) forgotten)."""

    def alpha(self) -> float:
        return 1.0


class AlibiCausalOffByOne(AlibiBaddbmmAttention):
    """Bug: triu(2): the next token is visible."""

    def hidden(self, t: int, device: torch.device) -> Tensor:
        return torch.ones(t, t, dtype=torch.bool, device=device).triu(2)


_HF_MASK = {"mask": "keep-int (B,L)"}


# ---------------------------------------------------------------------------------------------------------------
# Meta llama reference inference attention


def _freqs_cis(dim: int, end: int, theta: float = 10000.0) -> Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end).float()
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def _apply_rotary(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk))


def _repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(bs, slen, n_kv_heads * n_rep,
                                                                                      head_dim)


class LlamaReferenceAttention(nn.Module):
    # style: meta-llama/llama model.py Attention (inference: cache_k/cache_v written at start_pos, no grad reset)
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, max_batch_size: int = 8, max_seq_len: int = 32):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        cache = (max_batch_size, max_seq_len, n_kv_heads, self.head_dim)
        self.register_buffer("cache_k", torch.zeros(cache), persistent=False)
        self.register_buffer("cache_v", torch.zeros(cache), persistent=False)

    def denominator(self) -> float:
        return math.sqrt(self.head_dim)

    def rotate(self, xq: Tensor, xk: Tensor, xv: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        xq, xk = _apply_rotary(xq, xk, freqs_cis)
        return xq, xk, xv

    def forward(self, x: Tensor, start_pos: int, freqs_cis: Tensor, mask: Tensor | None) -> Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk, xv = self.rotate(xq, xk, xv, freqs_cis)
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:bsz, start_pos: start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos: start_pos + seqlen] = xv
        keys = _repeat_kv(self.cache_k[:bsz, : start_pos + seqlen], self.n_rep).transpose(1, 2)
        values = _repeat_kv(self.cache_v[:bsz, : start_pos + seqlen], self.n_rep).transpose(1, 2)
        xq = xq.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / self.denominator()
        if mask is not None:
            scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        out = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)


class LlamaRefScaleByDim(LlamaReferenceAttention):
    """Bug: / sqrt(dim) instead of / sqrt(head_dim)."""

    def denominator(self) -> float:
        return math.sqrt(self.n_heads * self.head_dim)


class LlamaRefRotaryOnV(LlamaReferenceAttention):
    """Bug: the rotation applied to the values too (xv passed where xk is rotated)."""

    def rotate(self, xq: Tensor, xk: Tensor, xv: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        xq, xk = _apply_rotary(xq, xk, freqs_cis)
        _, xv = _apply_rotary(xv, xv, freqs_cis)
        return xq, xk, xv


def _llama_causal(seqlen: int, dtype: torch.dtype, device: torch.device, diagonal: int = 1) -> Tensor:
    return torch.triu(torch.full((seqlen, seqlen), float("-inf"), device=device, dtype=dtype), diagonal=diagonal)


def _llama_call(m: nn.Module, x: Tensor) -> Tensor:
    """Transformer.forward at start_pos 0: freqs_cis[:seqlen] and the triu(-inf, 1) causal mask."""
    t = x.size(1)
    return m(x, 0, _freqs_cis(m.head_dim, 64)[:t].to(x.device), _llama_causal(t, x.dtype, x.device))


def _llama_call_off_by_one(m: nn.Module, x: Tensor) -> Tensor:
    """Bug in the caller's mask: triu(diagonal=2), each query sees the next token."""
    t = x.size(1)
    return m(x, 0, _freqs_cis(m.head_dim, 64)[:t].to(x.device), _llama_causal(t, x.dtype, x.device, 2))


# ---------------------------------------------------------------------------------------------------------------
# diffusers-style attention processor (heads folded into the batch)


class FoldedHeadsProcessor:
    # style: diffusers AttnProcessor (head_to_batch_dim, get_attention_scores with baddbmm(beta=0), batch_to_head_dim)
    def __call__(self, attn: ProcessorAttention, hidden_states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        b = hidden_states.shape[0]
        mask = attn.prepare_attention_mask(attention_mask, b)
        query = attn.head_to_batch_dim(attn.to_q(hidden_states))
        key = attn.head_to_batch_dim(attn.to_k(hidden_states))
        value = attn.head_to_batch_dim(attn.to_v(hidden_states))
        probs = attn.get_attention_scores(query, key, mask)
        out = attn.batch_to_head_dim(torch.bmm(probs, value))
        return attn.to_out[1](attn.to_out[0](out))


class ProcessorAttention(nn.Module):
    """forward(hidden_states, attention_mask): attention_mask (B, L) additive (0 / large negative)."""

    def __init__(self, query_dim: int, heads: int = 8, dim_head: int = 64) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, self.scale_for(query_dim, dim_head)
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(query_dim, inner, bias=False)
        self.to_v = nn.Linear(query_dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])
        self.processor = FoldedHeadsProcessor()

    def scale_for(self, query_dim: int, dim_head: int) -> float:
        return dim_head ** -0.5

    def head_to_batch_dim(self, t: Tensor) -> Tensor:
        b, n, c = t.shape
        return t.reshape(b, n, self.heads, c // self.heads).permute(0, 2, 1, 3).reshape(b * self.heads, n, -1)

    def batch_to_head_dim(self, t: Tensor) -> Tensor:
        bh, n, d = t.shape
        return t.reshape(bh // self.heads, self.heads, n, d).permute(0, 2, 1, 3).reshape(bh // self.heads, n, -1)

    def prepare_attention_mask(self, mask: Tensor | None, b: int) -> Tensor | None:
        if mask is None:
            return None
        return mask[:, None, :].repeat_interleave(self.heads, dim=0)  # (B*H, 1, L)

    def get_attention_scores(self, query: Tensor, key: Tensor, mask: Tensor | None) -> Tensor:
        base = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype, device=query.device)
        beta = 0.0
        if mask is not None:
            base, beta = mask, 1.0
        scores = torch.baddbmm(base, query, key.transpose(-1, -2), beta=beta, alpha=self.scale)
        return scores.softmax(dim=-1)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.processor(self, hidden_states, attention_mask)


class ProcessorScaleByQueryDim(ProcessorAttention):
    """Bug: query_dim ** -0.5 (the model width)."""

    def scale_for(self, query_dim: int, dim_head: int) -> float:
        return query_dim ** -0.5


class ProcessorMergeNoPermute(ProcessorAttention):
    """Bug: batch_to_head_dim by a reshape, without the permute back."""

    def batch_to_head_dim(self, t: Tensor) -> Tensor:
        bh, n, d = t.shape
        return t.reshape(bh // self.heads, n, self.heads * d)


_ADD = {"mask": "additive (B,L)"}


# ---------------------------------------------------------------------------------------------------------------
# ESPnet-style module that rewrites the caller's mask in place


class MaskRewritingAttention(nn.Module):
    # style: ESPnet MultiHeadedAttention.forward_attention with the in-place mask edits seen in forks
    """forward(x, mask): mask (B, L) bool, True = may attend; changed in place to (B, 1, 1, L) True = hidden."""

    def __init__(self, n_feat: int, n_head: int) -> None:
        super().__init__()
        self.h, self.d_k = n_head, n_feat // n_head
        self.qkv = nn.Linear(n_feat, 3 * n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)

    def hidden(self, mask: Tensor) -> Tensor:
        return mask.unsqueeze_(1).unsqueeze_(1).eq_(0)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, self.d_k).permute(2, 0, 3, 1, 4)
        q /= math.sqrt(self.d_k)  # in place, on a view shared with k and v
        scores = q @ k.transpose(-2, -1)
        if mask is not None:
            hidden = self.hidden(mask)
            scores.masked_fill_(hidden, float("-inf"))
            attn = torch.softmax(scores, dim=-1).masked_fill(hidden, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        return self.linear_out((attn @ v).transpose(1, 2).reshape(b, t, -1))


class MaskRewritingInverted(MaskRewritingAttention):
    """Bug: the eq_(0) left out: the keep-mask used as the hidden mask."""

    def hidden(self, mask: Tensor) -> Tensor:
        return mask.unsqueeze_(1).unsqueeze_(1)


# ---------------------------------------------------------------------------------------------------------------
# T5-style encoder attention with bucketed relative positions


def _relative_bucket(relative_position: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    num_buckets //= 2  # bidirectional
    ret = (relative_position > 0).long() * num_buckets
    n = relative_position.abs()
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return ret + torch.where(is_small, n, large)


class BucketedRelativeAttention(nn.Module):
    # style: T5/mT5 encoder self-attention (no 1/sqrt(d): T5 folds it into the init; bucketed bias per head)
    """forward(x, mask): mask (B, L) 1 = attend."""

    def __init__(self, d_model: int, n_heads: int, num_buckets: int = 32) -> None:
        super().__init__()
        self.n_heads, self.d_kv = n_heads, d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)

    def position_bias(self, t: int, device: torch.device) -> Tensor:
        pos = torch.arange(t, device=device)
        buckets = _relative_bucket(pos[None, :] - pos[:, None])
        return self.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # (1, H, L, L)

    def normalise(self, scores: Tensor) -> Tensor:
        return F.softmax(scores.float(), dim=-1).type_as(scores)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.n_heads, self.d_kv).transpose(1, 2) for lin in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(3, 2))
        bias = self.position_bias(t, x.device)
        if mask is not None:
            bias = bias + (1.0 - mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        scores += bias  # in place, as T5 writes it
        return self.o(torch.matmul(self.normalise(scores), v).transpose(1, 2).contiguous().view(b, t, -1))


class BucketedSoftmaxQueries(BucketedRelativeAttention):
    """Bug: softmax over the query axis."""

    def normalise(self, scores: Tensor) -> Tensor:
        return F.softmax(scores.float(), dim=-2).type_as(scores)


_T5 = {"mask": "keep-int (B,L)", "scale": 1.0}


# ---------------------------------------------------------------------------------------------------------------
# GPT-J-style attention: partial interleaved rotary written into q and k in place


def _rotate_every_two(x: Tensor) -> Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _sin_cos(length: int, rotary_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float64) / rotary_dim))
    ang = torch.arange(length, device=device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return (ang.sin().repeat_interleave(2, -1).to(dtype)[None, :, None, :],
            ang.cos().repeat_interleave(2, -1).to(dtype)[None, :, None, :])


class GPTJStyleAttention(nn.Module):
    # style: GPT-J / CodeGen attention: q_proj/k_proj/v_proj, rotary on the first rotary_dim dims, written in place
    def __init__(self, embed_dim: int, num_heads: int, rotary_dim: int = 8, max_positions: int = 64) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.rotary_dim = num_heads, embed_dim // num_heads, rotary_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.register_buffer("bias", torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool)))
        self.scale_attn = self.scale_for(embed_dim)

    def scale_for(self, embed_dim: int) -> float:
        return math.sqrt(self.head_dim)

    def rotate(self, q: Tensor, k: Tensor, v: Tensor, sin: Tensor, cos: Tensor) -> None:
        r = self.rotary_dim
        for t in (q, k):
            part = t[..., :r].clone()
            t[..., :r] = part * cos + _rotate_every_two(part) * sin  # in place, on (B, L, H, D)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.num_heads, self.head_dim) for lin in (self.q_proj, self.k_proj, self.v_proj))
        sin, cos = _sin_cos(t, self.rotary_dim, x.dtype, x.device)
        self.rotate(q, k, v, sin, cos)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        w = torch.matmul(q.float(), k.float().transpose(-1, -2))
        w = torch.where(self.bias[:t, :t], w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device))
        w = (w / self.scale_attn).softmax(dim=-1).to(v.dtype)
        return self.out_proj(torch.matmul(w, v).permute(0, 2, 1, 3).contiguous().view(b, t, -1))


class GPTJRotaryOnV(GPTJStyleAttention):
    """Bug: the loop rotates v too."""

    def rotate(self, q: Tensor, k: Tensor, v: Tensor, sin: Tensor, cos: Tensor) -> None:
        r = self.rotary_dim
        for t in (q, k, v):
            part = t[..., :r].clone()
            t[..., :r] = part * cos + _rotate_every_two(part) * sin


class GPTJScaleByEmbed(GPTJStyleAttention):
    """Bug: scale_attn = sqrt(embed_dim)."""

    def scale_for(self, embed_dim: int) -> float:
        return math.sqrt(embed_dim)


# ---------------------------------------------------------------------------------------------------------------
# fairseq-style sequence-first attention with heads folded into the batch (bmm)


class SeqFirstBmmAttention(nn.Module):
    # style: fairseq MultiheadAttention's own path: (T, B, E), q *= scaling, (B*H, T, D) bmm, key_padding_mask
    """forward(query, key_padding_mask): query (T, B, E); key_padding_mask (B, T) bool, True = padding."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.scaling = self.scaling_for(embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def scaling_for(self, embed_dim: int) -> float:
        return self.head_dim ** -0.5

    def merge(self, attn: Tensor, tgt_len: int, bsz: int) -> Tensor:
        return attn.transpose(0, 1).contiguous().view(tgt_len, bsz, self.embed_dim)

    def forward(self, query: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        tgt_len, bsz, _ = query.size()
        q = self.q_proj(query)
        k = self.k_proj(query)
        v = self.v_proj(query)
        q *= self.scaling
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, -1)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool),
                                                    float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, -1)
        attn_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).type_as(attn_weights)
        attn = torch.bmm(attn_probs, v)
        return self.out_proj(self.merge(attn, tgt_len, bsz))


class SeqFirstBmmScaleByEmbed(SeqFirstBmmAttention):
    """Bug: scaling = embed_dim ** -0.5."""

    def scaling_for(self, embed_dim: int) -> float:
        return embed_dim ** -0.5


class SeqFirstBmmMergeNoTranspose(SeqFirstBmmAttention):
    """Bug: (B*H, T, D) viewed as (T, B, E) without the transpose back."""

    def merge(self, attn: Tensor, tgt_len: int, bsz: int) -> Tensor:
        return attn.contiguous().view(tgt_len, bsz, self.embed_dim)


_FAIRSEQ = {"mask": "ignore (B,L)"}


# ---------------------------------------------------------------------------------------------------------------
# Falcon-style multi-query attention (one key/value head, broadcast in the products)


class MultiQueryAttention(nn.Module):
    # style: Falcon-7B / SantaCoder multi-query attention: fused query_key_value (H + 2 heads), k/v broadcast
    """forward(x, attention_mask): attention_mask (B, 1, L, L) additive (0 / finfo.min), causal and padding."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.query_key_value = nn.Linear(hidden_size, hidden_size + 2 * self.head_dim, bias=False)
        self.dense = nn.Linear(hidden_size, hidden_size, bias=False)

    def weigh(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        if mask is not None:
            scores = scores + mask
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        fused = self.query_key_value(x).view(b, t, self.num_heads + 2, self.head_dim)
        q = fused[:, :, :-2].transpose(1, 2)  # (B, H, L, D)
        k, v = fused[:, :, [-2]].transpose(1, 2), fused[:, :, [-1]].transpose(1, 2)  # (B, 1, L, D)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # broadcast over the heads
        out = self.weigh(scores, attention_mask) @ v
        return self.dense(out.transpose(1, 2).reshape(b, t, -1))


class MultiQueryMaskAfterSoftmax(MultiQueryAttention):
    """Bug: the additive mask added to the weights."""

    def weigh(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        w = F.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        return w if mask is None else w + mask


def _falcon_mask(keep: Tensor) -> Tensor:
    """Falcon's (B, 1, L, L) additive mask from keep (B, L, L): hidden -> finfo.min."""
    return torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill(
        ~keep, torch.finfo(torch.float32).min)[:, None]


_MQA = {"mask": "additive (B,1,L,L)"}


# ---------------------------------------------------------------------------------------------------------------
# Qwen3 / OLMo-2-style q/k RMSNorm per head, then the usual 1/sqrt(d)


class HeadRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: Tensor) -> Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


class QKRMSNormAttention(nn.Module):
    # style: Qwen3 attention: q_norm/k_norm RMSNorm over each head's dims, SDPA with its default 1/sqrt(d), causal
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.q_norm, self.k_norm = HeadRMSNorm(self.head_dim), HeadRMSNorm(self.head_dim)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def sdpa_scale(self) -> float | None:
        return None

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.sdpa_scale())
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class QKRMSNormNoScale(QKRMSNormAttention):
    """Bug: scale=1.0 passed (as if the RMSNorm were a unit normalisation)."""

    def sdpa_scale(self) -> float | None:
        return 1.0


# ---------------------------------------------------------------------------------------------------------------
# Music Transformer relative attention (the "skewing" of Huang et al. 2018)


class SkewedRelativeAttention(nn.Module):
    # style: Music Transformer relative global attention: Srel = skew(Q E_r^T), causal, E_r (max_len, D) per layer
    def __init__(self, d_model: int, num_heads: int, max_len: int = 64) -> None:
        super().__init__()
        self.h, self.dh, self.max_len = num_heads, d_model // num_heads, max_len
        self.Wq, self.Wk, self.Wv = (nn.Linear(d_model, d_model) for _ in range(3))
        self.fc = nn.Linear(d_model, d_model)
        self.E = nn.Parameter(torch.randn(max_len, self.dh) * 0.5)

    @staticmethod
    def skew(qe: Tensor) -> Tensor:
        """(B, H, L, L) logits against relative positions -(L-1)..0 -> (B, H, L, L) with [i, j] = position j - i."""
        b, h, length, _ = qe.shape
        padded = F.pad(qe, (1, 0))  # (B, H, L, L + 1)
        return padded.reshape(b, h, length + 1, length)[:, :, 1:]

    def hidden(self, t: int, device: torch.device) -> Tensor:
        return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, self.h, self.dh).transpose(1, 2) for lin in (self.Wq, self.Wk, self.Wv))
        e = self.E[self.max_len - t:]  # relative positions -(t-1) .. 0
        srel = self.skew(q @ e.transpose(0, 1))
        logits = (q @ k.transpose(-1, -2) + srel) / math.sqrt(self.dh)
        logits = logits.masked_fill(self.hidden(t, x.device), float("-inf"))
        out = logits.softmax(-1) @ v
        return self.fc(out.transpose(1, 2).reshape(b, t, -1))


class SkewedCausalHidesDiagonal(SkewedRelativeAttention):
    """Bug: triu(0): each query hides itself (the first row has no visible key)."""

    def hidden(self, t: int, device: torch.device) -> Tensor:
        return torch.ones(t, t, dtype=torch.bool, device=device).triu(1) | torch.eye(t, dtype=torch.bool,
                                                                                        device=device)


# ---------------------------------------------------------------------------------------------------------------
# lucidrains-style talking heads


class TalkingHeadsAttention(nn.Module):
    # style: lucidrains talking-heads (Shazeer et al. 2020): heads mixed by einsum before and after the softmax
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, self.scale_for(dim, dim_head)
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.pre_softmax_proj = nn.Parameter(torch.eye(heads) + 0.3 * torch.randn(heads, heads))
        self.post_softmax_proj = nn.Parameter(torch.eye(heads) + 0.3 * torch.randn(heads, heads))
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        dots = torch.einsum("bhij,hk->bkij", dots, self.pre_softmax_proj)
        attn = self.normalise(dots)
        attn = torch.einsum("bhij,hk->bkij", attn, self.post_softmax_proj)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))

    def scale_for(self, dim: int, dim_head: int) -> float:
        return dim_head ** -0.5

    def normalise(self, dots: Tensor) -> Tensor:
        return dots.softmax(dim=-1)


class TalkingHeadsScaleByDim(TalkingHeadsAttention):
    """Bug: dim ** -0.5."""

    def scale_for(self, dim: int, dim_head: int) -> float:
        return dim ** -0.5


class TalkingHeadsSoftmaxQueries(TalkingHeadsAttention):
    """Bug: softmax over the query axis."""

    def normalise(self, dots: Tensor) -> Tensor:
        return dots.softmax(dim=-2)


# ---------------------------------------------------------------------------------------------------------------
# hand-written softmax, pre-transposed keys, chunked (memory-efficient) attention


class ManualSoftmaxAttention(nn.Module):
    # style: research code that writes the softmax out (exp of the scores minus their row max, over the row sum)
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dh = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def normalise(self, s: Tensor) -> Tensor:
        e = torch.exp(s - s.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        w = self.normalise(q @ k.transpose(-1, -2) / math.sqrt(self.dh))
        return self.out((w @ v).transpose(1, 2).reshape(b, n, -1))


class ManualSoftmaxOverQueries(ManualSoftmaxAttention):
    """Bug: the row max and the sum over the query axis."""

    def normalise(self, s: Tensor) -> Tensor:
        e = torch.exp(s - s.amax(dim=-2, keepdim=True))
        return e / e.sum(dim=-2, keepdim=True)


class PreTransposedKeyAttention(nn.Module):
    # style: MPT's scaled_multihead_dot_product_attention: k rearranged to (b, h, d, s) once, q @ k, softmax_scale
    """forward(x, attention_mask): attention_mask (B, L) bool, True = attend; causal."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.softmax_scale = n_heads, (d_model // n_heads) ** -0.5
        self.Wqkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        from einops import rearrange
        q, k, v = self.Wqkv(x).chunk(3, dim=2)
        q = rearrange(q, "b s (h d) -> b h s d", h=self.n_heads)
        k = rearrange(k, "b s (h d) -> b h d s", h=self.n_heads)
        v = rearrange(v, "b s (h d) -> b h s d", h=self.n_heads)
        attn_weight = q.matmul(k) * self.softmax_scale
        s = attn_weight.size(-1)
        min_val = torch.finfo(q.dtype).min
        if attention_mask is not None:
            attn_weight = attn_weight.masked_fill(~attention_mask.view(-1, 1, 1, s), min_val)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attn_weight = attn_weight.masked_fill(~causal.view(1, 1, s, s), min_val)
        attn_weight = torch.softmax(attn_weight, dim=-1)
        return self.out_proj(rearrange(attn_weight.matmul(v), "b h s d -> b s (h d)"))


class ChunkedAttention(nn.Module):
    # style: memory-efficient attention in PyTorch (Rabe & Staats): key chunks, running max and sum (online softmax)
    def __init__(self, dim: int, heads: int, chunk: int = 3) -> None:
        super().__init__()
        self.heads, self.dh, self.chunk = heads, dim // heads, chunk
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def scale(self) -> float:
        return self.dh ** -0.5

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, self.dh).transpose(1, 2) * self.scale()
        k, v = (t.view(b, n, self.heads, self.dh).transpose(1, 2) for t in self.to_kv(x).chunk(2, dim=-1))
        acc = torch.zeros_like(q)
        total = q.new_zeros(b, self.heads, n, 1)
        best = q.new_full((b, self.heads, n, 1), float("-inf"))
        for start in range(0, n, self.chunk):
            kc, vc = k[:, :, start:start + self.chunk], v[:, :, start:start + self.chunk]
            s = q @ kc.transpose(-1, -2)
            new_best = torch.maximum(best, s.amax(-1, keepdim=True))
            correction = torch.exp(best - new_best)
            e = torch.exp(s - new_best)
            acc = acc * correction + e @ vc
            total = total * correction + e.sum(-1, keepdim=True)
            best = new_best
        return self.to_out((acc / total).transpose(1, 2).reshape(b, n, -1))


class ChunkedScaleByDim(ChunkedAttention):
    """Bug: dim ** -0.5 (the model width)."""

    def scale(self) -> float:
        return (self.heads * self.dh) ** -0.5


# ---------------------------------------------------------------------------------------------------------------
# lucidrains-style learned null key/value


class NullKVAttention(nn.Module):
    # style: lucidrains (imagen / DALLE2 / muse) Attention with a learned null_kv put before the tokens' keys/values
    """forward(x, mask): mask (B, L) bool, True = attend; the null key is always visible."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, self.scale_for(dim, dim_head)
        self.null_kv = nn.Parameter(torch.randn(2, heads, 1, dim_head))
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, 2 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def scale_for(self, dim: int, dim_head: int) -> float:
        return dim_head ** -0.5

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2) * self.scale
        k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_kv(x).chunk(2, dim=-1))
        nk, nv = (t.expand(b, -1, -1, -1) for t in self.null_kv.unbind(0))
        k, v = torch.cat((nk, k), dim=-2), torch.cat((nv, v), dim=-2)
        sim = q @ k.transpose(-1, -2)
        if mask is not None:
            mask = F.pad(mask, (1, 0), value=True)
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        out = sim.softmax(dim=-1) @ v
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class NullKVScaleByDim(NullKVAttention):
    """Bug: dim ** -0.5."""

    def scale_for(self, dim: int, dim_head: int) -> float:
        return dim ** -0.5


class NullKVMaskNotPadded(NullKVAttention):
    """Bug: the mask is padded on the wrong side: the null key takes the first token's mask, the last token's
    key the null key's True."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return super().forward(x, None if mask is None else torch.cat((mask[:, 1:], mask[:, :1]), -1))


# ---------------------------------------------------------------------------------------------------------------
# real packages


def _sam(scale_by_width: bool = False) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from timm.models.vision_transformer_sam import Attention
        m = Attention(E, num_heads=H, use_rel_pos=True, input_size=(4, 4))
        with torch.no_grad():  # the tables start at zero in timm; a trained model's are not
            m.rel_pos_h.normal_(0, 0.5)
            m.rel_pos_w.normal_(0, 0.5)
        if scale_by_width:
            m.fused_attn = False  # the eager path reads self.scale
            m.scale = E ** -0.5
        return m
    make.__qualname__ = f"timm_sam_attention(scale_by_width={scale_by_width})"
    return make


def _cait() -> nn.Module:
    from timm.models.cait import TalkingHeadAttn
    return TalkingHeadAttn(E, num_heads=H, qkv_bias=True)


def _beit() -> nn.Module:
    from timm.models.beit import Attention
    m = Attention(E, num_heads=H, qkv_bias=True, window_size=(4, 4))
    with torch.no_grad():  # timm starts the table at zero
        m.relative_position_bias_table.normal_(0, 0.5)
    return m


def _deberta() -> nn.Module:
    from transformers import DebertaV2Config
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention
    cfg = DebertaV2Config(hidden_size=E, num_attention_heads=H, intermediate_size=2 * E, relative_attention=True,
                          pos_att_type=["c2p", "p2c"], position_buckets=8, max_relative_positions=16,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    m = DisentangledSelfAttention(cfg)
    g = torch.Generator().manual_seed(1)
    # the encoder's rel_embeddings (2 * position_buckets, E), LayerNorm'd, handed to every layer
    m.register_buffer("encoder_rel_embeddings", F.layer_norm(torch.randn(16, E, generator=g), (E,)))
    return m


def _deberta_call(m: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """DebertaV2Encoder's call of a layer's attention: a (B, 1, L, L) 0/1 mask (all ones without padding) and the
    shared rel_embeddings."""
    if mask is None:
        mask = torch.ones(x.shape[0], 1, x.shape[1], x.shape[1], dtype=torch.int64, device=x.device)
    return m(x, mask, rel_embeddings=m.encoder_rel_embeddings.to(x.dtype))[0]


def _map_call(m: nn.Module, x: Tensor) -> Tensor:
    """timm's SAM blocks call the attention on the (B, H, W, C) map."""
    b, n, c = x.shape
    side = math.isqrt(n)
    return m(x.view(b, side, side, c)).reshape(b, n, c)


def _swinv2() -> nn.Module:
    from timm.models.swin_transformer_v2 import WindowAttention
    return WindowAttention(E, window_size=(4, 4), num_heads=H)


def _navit() -> nn.Module:
    from vit_pytorch.na_vit import Attention
    m = Attention(E, heads=H, dim_head=D)
    with torch.no_grad():  # learned gains, not all ones as at init
        m.q_norm.gamma.uniform_(0.5, 1.5)
        m.k_norm.gamma.uniform_(0.5, 1.5)
    return m


def _xlnet() -> nn.Module:
    from transformers import XLNetConfig
    from transformers.models.xlnet.modeling_xlnet import XLNetRelativeAttention
    cfg = XLNetConfig(d_model=E, n_head=H, d_head=D, d_inner=2 * E, dropout=0.0)
    m = XLNetRelativeAttention(cfg)
    with torch.no_grad():  # its parameters are torch.FloatTensor(...), left to XLNetPreTrainedModel._init_weights
        for name, p in m.named_parameters():
            if name.startswith("layer_norm"):
                continue
            p.normal_(0, 0.1 if "bias" in name else E ** -0.5)
    return m


def _xlnet_width() -> nn.Module:
    m = _xlnet()
    m.scale = E ** -0.5  # the shipped typo: the model width for d_head
    return m


def _xlnet_pos(length: int, batch: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """XLNetModel.relative_positional_encoding for attn_type 'bi': positions klen .. -qlen + 1."""
    pos_seq = torch.arange(length, -length, -1.0, device=device, dtype=torch.float32)
    inv_freq = 1 / torch.pow(10000, torch.arange(0, E, 2.0, device=device) / E)
    sinusoid = torch.einsum("i,d->id", pos_seq, inv_freq)
    return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1)[:, None, :].expand(-1, batch, -1).to(dtype)


def _xlnet_call(m: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """XLNetModel's h stream without memory: (L, B, E); attn_mask_h (L, L, B, 1), 1 = hidden."""
    h = x.transpose(0, 1)
    t, b = h.shape[:2]
    mask_h = None
    if mask is not None:
        mask_h = (~mask).to(x.dtype).T[None, :, :, None].expand(t, t, b, 1)
    out = m(h, None, mask_h, None, _xlnet_pos(t, b, x.dtype, x.device), None)[0]
    return out.transpose(0, 1)


def _x_transformers(**kwargs) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from x_transformers.x_transformers import Attention
        m = Attention(E, dim_head=D, heads=H, **kwargs)
        with torch.no_grad():  # away from an identity/zero init, as after training
            for name, p in m.named_parameters():
                if "talking_heads" in name or "to_v_gate" in name:
                    p.add_(torch.randn_like(p) * 0.3)
        return m
    make.__qualname__ = f"x_transformers_attention{tuple(kwargs)}"
    return make


def _x_transformers_plain(**kwargs) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        from x_transformers.x_transformers import Attention
        return Attention(E, dim_head=D, heads=H, **kwargs)
    make.__qualname__ = f"x_transformers_attention{tuple(kwargs)}"
    return make


def _deepvit() -> nn.Module:
    from vit_pytorch.deepvit import Attention
    return Attention(E, heads=H, dim_head=D)


WILD2_ENTRIES: list[Wild] = [
    # -- real packages
    Wild("timm-sam-relpos", "correct", _sam(), {"call": _map_call, "length": 16}, needs="timm",
         note="ViTDet/SAM decomposed relative positions (get_rel_pos + add_decomposed_rel_pos) on a 4 x 4 map"),
    Wild("timm-sam-relpos", "scale = dim ** -0.5", _sam(True), {"call": _map_call, "length": 16}, "wrong-scale",
         needs="timm"),
    Wild("timm-swinv2-window", "correct", _swinv2, {"length": 16, "mask": "additive (B,L,L)"}, needs="timm",
         note="cosine scores, logit_scale clamped and exp'd, 16 * sigmoid(cpb_mlp) bias"),
    Wild("navit", "correct", _navit, _KEEP_BL, needs="vit_pytorch",
         note="RMSNorm q/k with learned gains; SDPA scale=1 (the norm carries sqrt(dim_head))"),
    Wild("xlnet-rel-attn", "correct", _xlnet, {"call": _xlnet_call, "mask": "keep (B,L)"}, needs="transformers",
         note="'ibnd,jbnd->bnij' content and position terms, r_w_bias/r_r_bias, rel_shift_bnij, post-norm"),
    Wild("xlnet-rel-attn", "scale = d_model ** -0.5", _xlnet_width, {"call": _xlnet_call, "mask": "keep (B,L)"},
         "wrong-scale", needs="transformers"),
    Wild("x-transformers-talking-heads", "correct", _x_transformers(pre_talking_heads=True, post_talking_heads=True),
         needs="x_transformers", note="heads mixed before and after the softmax (Shazeer et al. 2020)"),
    Wild("x-transformers-gated-values", "correct", _x_transformers(gate_values=True), needs="x_transformers",
         note="sigmoid gate on each head's output (AlphaFold style)"),
    # -- OpenNMT Shaw
    Wild("onmt-shaw", "correct", _f(ShawMultiHeadedAttention, H, E), _ONMT,
         note="query /= sqrt(d) in place; relation terms on the scores and on the values"),
    Wild("onmt-shaw", "query / sqrt(model_dim)", _f(ShawScaleByModelDim, H, E), _ONMT, "wrong-scale"),
    Wild("onmt-shaw", "softmax over queries", _f(ShawSoftmaxQueries, H, E), _ONMT, "softmax-dim"),
    Wild("onmt-shaw", "key = linear_query(x)", _f(ShawKeyIsQuery, H, E), _ONMT, "no-grad"),
    # -- nanoGPT in place
    Wild("nanogpt-in-place", "correct", _f(InPlaceCausalSelfAttention, E, H), note="q.mul_ on a view of c_attn"),
    Wild("nanogpt-in-place", "1/sqrt(n_embd)", _f(InPlaceScaleByWidth, E, H), expected="wrong-scale"),
    Wild("nanogpt-in-place", "tril(diagonal=1)", _f(InPlaceCausalShowsNext, E, H), expected="causal-leak"),
    Wild("nanogpt-in-place", "merge without transpose", _f(InPlaceMergeNoTranspose, E, H), expected="head-merge"),
    # -- lucidrains einops
    Wild("einops-attention", "correct", _f(EinopsAttention, E, H, D), _KEEP_BL, needs="einops"),
    Wild("einops-attention", "dim ** -0.5", _f(EinopsScaleByDim, E, H, D), _KEEP_BL, "wrong-scale", needs="einops"),
    Wild("einops-attention", "weights read as (b h j i)", _f(EinopsWeightsTransposed, E, H, D), _KEEP_BL,
         "matmul-order", needs="einops"),
    # -- ALiBi
    Wild("alibi-baddbmm", "correct", _f(AlibiBaddbmmAttention, E, H), _HF_MASK),
    Wild("alibi-baddbmm", "alpha = 1", _f(AlibiNoAlpha, E, H), _HF_MASK, "missing-scale"),
    Wild("alibi-baddbmm", "triu(2)", _f(AlibiCausalOffByOne, E, H), _HF_MASK, "causal-leak"),
    # -- llama reference
    Wild("llama-ref-cache", "correct", _f(LlamaReferenceAttention, E, H, 2), {"call": _llama_call},
         note="GQA 4/2; cache for 8 rows and 32 positions written by slice assignment; complex rotary"),
    Wild("llama-ref-cache", "/ sqrt(dim)", _f(LlamaRefScaleByDim, E, H, 2), {"call": _llama_call}, "wrong-scale"),
    Wild("llama-ref-cache", "rotary on v", _f(LlamaRefRotaryOnV, E, H, 2), {"call": _llama_call}, "values-changed"),
    Wild("llama-ref-cache", "mask triu(diagonal=2)", _f(LlamaReferenceAttention, E, H, 2),
         {"call": _llama_call_off_by_one}, "causal-leak"),
    # -- diffusers-style processor
    Wild("folded-heads-processor", "correct", _f(ProcessorAttention, E, H, D), _ADD),
    Wild("folded-heads-processor", "query_dim ** -0.5", _f(ProcessorScaleByQueryDim, E, H, D), _ADD, "wrong-scale"),
    Wild("folded-heads-processor", "merge without permute", _f(ProcessorMergeNoPermute, E, H, D), _ADD, "head-merge"),
    # -- in-place mask
    Wild("mask-rewriting", "correct", _f(MaskRewritingAttention, E, H), _KEEP_BL,
         note="mask.unsqueeze_(1).unsqueeze_(1).eq_(0); q /= sqrt(d) on a shared view; scores.masked_fill_"),
    Wild("mask-rewriting", "eq_(0) left out", _f(MaskRewritingInverted, E, H), _KEEP_BL, "mask-inverted"),
    # -- T5 buckets
    Wild("t5-buckets", "correct", _f(BucketedRelativeAttention, E, H), _T5, note="scale=1 stated, as T5 has"),
    Wild("t5-buckets", "softmax over queries", _f(BucketedSoftmaxQueries, E, H), _T5, "softmax-dim"),
    Wild("timm-cait-talking-heads", "correct", _cait, needs="timm",
         note="proj_l before and proj_w after the softmax mix the heads (nn.Linear over the head axis)"),
    Wild("timm-beit-relpos", "correct", _beit, {"length": 17}, needs="timm",
         note="relative position bias table over a 4 x 4 window and a class token: 17 tokens"),
    Wild("deberta-v2-disentangled", "correct", _deberta, {"call": _deberta_call, "mask": "keep-int (B,1,L,L)"},
         needs="transformers", note="c2p + p2c terms; all three scaled by 1/sqrt(3 d) (scale_factor 3) by design"),
    # -- GPT-J style
    Wild("gptj-in-place-rotary", "correct", _f(GPTJStyleAttention, E, H), note="t[..., :r] = rotated, in place"),
    Wild("gptj-in-place-rotary", "rotary on v", _f(GPTJRotaryOnV, E, H), expected="values-changed"),
    Wild("gptj-in-place-rotary", "scale_attn = sqrt(embed_dim)", _f(GPTJScaleByEmbed, E, H), expected="wrong-scale"),
    # -- fairseq-style sequence-first bmm
    Wild("seq-first-bmm", "correct", _f(SeqFirstBmmAttention, E, H), _FAIRSEQ),
    Wild("seq-first-bmm", "scaling = embed_dim ** -0.5", _f(SeqFirstBmmScaleByEmbed, E, H), _FAIRSEQ, "wrong-scale"),
    Wild("seq-first-bmm", "merge without transpose", _f(SeqFirstBmmMergeNoTranspose, E, H), _FAIRSEQ, "head-merge"),
    # -- Falcon-style MQA
    Wild("falcon-mqa", "correct", _f(MultiQueryAttention, E, H), _MQA),
    Wild("falcon-mqa", "mask added after softmax", _f(MultiQueryMaskAfterSoftmax, E, H), _MQA, "mask-after-softmax"),
    # -- Qwen3-style q/k RMSNorm
    Wild("qk-rmsnorm", "correct", _f(QKRMSNormAttention, E, H)),
    Wild("qk-rmsnorm", "sdpa scale=1", _f(QKRMSNormNoScale, E, H), expected="missing-scale",
         note="an RMS norm is not a unit normalisation: its rows have norm sqrt(d)"),
    # -- Music Transformer
    Wild("music-transformer-skew", "correct", _f(SkewedRelativeAttention, E, H)),
    Wild("music-transformer-skew", "triu(0) hides the diagonal", _f(SkewedCausalHidesDiagonal, E, H),
         expected="causal-leak"),
    # -- talking heads
    Wild("talking-heads-einsum", "correct", _f(TalkingHeadsAttention, E, H, D)),
    Wild("talking-heads-einsum", "dim ** -0.5", _f(TalkingHeadsScaleByDim, E, H, D), expected="wrong-scale"),
    Wild("talking-heads-einsum", "softmax over queries", _f(TalkingHeadsSoftmaxQueries, E, H, D),
         expected="softmax-dim"),
    # -- hand-written softmax, pre-transposed keys, chunked
    Wild("manual-softmax", "correct", _f(ManualSoftmaxAttention, E, H), note="exp(s - max) / sum, no softmax op"),
    Wild("manual-softmax", "normalised over queries", _f(ManualSoftmaxOverQueries, E, H), expected="softmax-dim"),
    Wild("mpt-pre-transposed-k", "correct", _f(PreTransposedKeyAttention, E, H), _KEEP_BL, needs="einops"),
    Wild("chunked-online-softmax", "correct", _f(ChunkedAttention, E, H), note="key chunks of 3, running max/sum"),
    Wild("chunked-online-softmax", "dim ** -0.5", _f(ChunkedScaleByDim, E, H), expected="wrong-scale"),
    # -- learned memory / null key-values
    Wild("x-transformers-mem-kv", "correct", _x_transformers_plain(num_mem_kv=2), _KEEP_BL, needs="x_transformers",
         note="2 learned memory key/value pairs concatenated before the tokens'"),
    Wild("x-transformers-zero-kv", "correct", _x_transformers_plain(add_zero_kv=True), _KEEP_BL,
         needs="x_transformers", note="a zero key/value padded before the tokens'"),
    Wild("null-kv", "correct", _f(NullKVAttention, E, H, D), _KEEP_BL),
    Wild("null-kv", "dim ** -0.5", _f(NullKVScaleByDim, E, H, D), _KEEP_BL, "wrong-scale"),
    Wild("null-kv", "mask shifted by one", _f(NullKVMaskNotPadded, E, H, D), _KEEP_BL, "mask-ignored"),
    Wild("deepvit-re-attention", "correct", _deepvit, needs="vit_pytorch",
         note="re-attention (Zhou et al. 2021): weights mixed across heads, then a LayerNorm over the heads"),
]

WILD2: dict[str, Wild] = {w.name: w for w in WILD2_ENTRIES}
assert len(WILD2) == len(WILD2_ENTRIES), "duplicate wild2 entry names"


if __name__ == "__main__":  # python tests/doctor_corpus_wild2.py [substring ...]: the table, with seconds
    picks = [w for w in WILD2_ENTRIES if not sys.argv[1:] or any(s in w.name for s in sys.argv[1:])]
    for w in picks:
        if not w.available:
            print(f"{w.name}: skipped ({w.needs} not installed)")
            continue
        start = time.perf_counter()
        try:
            r = check_wild(w)
        except Exception as err:  # a look at every entry, whatever fails
            print(f"RAISED {w.name}: {type(err).__name__}: {str(err)[:300]}")
            continue
        took = time.perf_counter() - start
        mark = "ok   " if right(w, r) else "WRONG"
        errs = [(f.id, f.message[:200]) for f in r.findings if f.severity == "error"]
        print(f"{mark} {w.name}: expected {w.expected or 'passed'}; got {r.verdict} {sorted(r.ids)} {took:.2f}s"
              + (f" not_verified={r.not_verified}" if r.not_verified else "")
              + (f" doctor_errors={r.doctor_errors}" if r.doctor_errors else "")
              + (f"\n      errors={errs}" if errs and not right(w, r) else ""))

"""The doctor on designs and habits it used to misread: in-place operations on the way to the scores, modules
that rewrite their arguments, values changed before the product, head dims that hide a scale, cosine attention,
sequence-first einsum layouts, Transformer-XL and Shaw relative positions, and caches that fix the batch size.

Shape legend: B batch, L length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import inspect
import math

import doctor_corpus_wild as dw
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from selfattn.check import _seams, check


def _rope(t: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary positions 0..L-1 (base 10000) on (..., L, D)."""
    n, d = t.shape[-2], t.shape[-1] // 2
    angle = torch.arange(n, dtype=t.dtype)[:, None] / 10000 ** (torch.arange(d, dtype=t.dtype) / d)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    return t * cos + torch.cat([-t[..., d:], t[..., :d]], -1) * sin


class _Fused(nn.Module):
    """A fused qkv projection split into heads; the modules below differ in what they do with q, k, v."""

    def __init__(self, dim: int, heads: int = 4, norm: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(dim // heads) if norm else nn.Identity()
        self.k_norm = nn.LayerNorm(dim // heads) if norm else nn.Identity()

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, e = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        return self.q_norm(q), self.k_norm(k), v

    @staticmethod
    def merge(o: torch.Tensor) -> torch.Tensor:
        b, h, n, d = o.shape
        return o.transpose(1, 2).reshape(b, n, h * d)


class LearnedScalarTemperature(_Fused):
    """Correct, a published design (locality self-attention for small-dataset ViTs, Lee et al. 2021): one
    learned scalar temperature, ``exp(t)``, in place of 1/sqrt(D), trained away from its initial value, and
    each token kept from attending to itself (the diagonal masked)."""

    def __init__(self, dim: int, heads: int = 4, fixed: bool = False) -> None:
        super().__init__(dim, heads)
        start = torch.tensor(math.log((dim // heads) ** -0.5) + 0.4)  # trained away from log(1/sqrt(D))
        if fixed:
            self.register_buffer("log_temperature", start)
        else:
            self.log_temperature = nn.Parameter(start)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        s = torch.matmul(q, k.transpose(-1, -2)) * self.log_temperature.exp()
        own = torch.eye(s.shape[-1], dtype=torch.bool, device=s.device)
        return self.out(self.merge(s.masked_fill(own, float("-inf")).softmax(-1) @ v))


class NormedScaledInPlace(_Fused):
    """Correct: q/k LayerNorm per head, then ``q.mul_(scale)`` in place (no formula over the projections fits)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, norm=True)

    def forward(self, x):
        q, k, v = self.split(x)
        q.mul_(q.shape[-1] ** -0.5)
        return self.merge(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class NormedScaledBeforeRotary(_Fused):
    """Correct: q/k LayerNorm, q divided by sqrt(D), then rotary positions on q and k."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, norm=True)

    def forward(self, x):
        q, k, v = self.split(x)
        q = q / math.sqrt(q.shape[-1])
        return self.merge(torch.softmax(_rope(q) @ _rope(k).transpose(-1, -2), -1) @ v)


class _RMSNorm(nn.Module):
    """Llama's RMSNorm written out: x * rsqrt(mean(x^2) + eps), times a learned weight per dimension."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class RMSNormedRotaryUnscaled(_Fused):
    """Bug (Qwen 3 style, q/k RMSNorm then rotary): the 1/sqrt(D) is missing."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.q_norm, self.k_norm = _RMSNorm(dim // self.heads), _RMSNorm(dim // self.heads)

    def forward(self, x):
        q, k, v = self.split(x)
        return self.merge(torch.softmax(_rope(q) @ _rope(k).transpose(-1, -2), -1) @ v)


class RotaryOnValues(_Fused):
    """Bug: the rotary positions are applied to v too."""

    def forward(self, x):
        q, k, v = self.split(x)
        q, k, v = _rope(q), _rope(k), _rope(v)
        return self.merge(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v)


class PrefixKeptRotary(_Fused):
    """Correct (EVA-02 style): a class token first, kept out of the rotary positions, which rotate q and k of
    the other tokens; ``on_values`` is the bug of rotating v's too."""

    def __init__(self, dim: int, on_values: bool = False) -> None:
        super().__init__(dim)
        self.on_values = on_values

    def forward(self, x):
        q, k, v = self.split(x)
        q, k = (torch.cat([t[:, :, :1], _rope(t[:, :, 1:])], dim=2) for t in (q, k))
        if self.on_values:
            v = torch.cat([v[:, :, :1], _rope(v[:, :, 1:])], dim=2)
        return self.merge(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v)


class WindowedSdpa(_Fused):
    """Correct (Twins' locally grouped attention): tokens of a 4 x 4 map attend within 2 x 2 windows, one
    SDPA call over every window; ``scale`` set is the bug of a scale other than 1/sqrt(D)."""

    def __init__(self, dim: int, scale: float | None = None) -> None:
        super().__init__(dim)
        self.scale = scale

    def forward(self, x):
        b, n, e = x.shape
        side = math.isqrt(n)
        w = x.reshape(b, side // 2, 2, side // 2, 2, e).transpose(2, 3).reshape(-1, 4, e)  # (B * windows, 4, E)
        q, k, v = self.split(w)
        o = self.merge(F.scaled_dot_product_attention(q, k, v, scale=self.scale))
        return o.reshape(b, side // 2, side // 2, 2, 2, e).transpose(2, 3).reshape(b, n, e)


class _ValuesMadeOver(_Fused):
    """Correct fused-qkv attention whose values go through ``values(v, x)`` before the product."""

    def values(self, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return v

    def forward(self, x):
        q, k, v = self.split(x)
        v = self.values(v, x)
        return self.merge(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v)


class ValuesThroughGelu(_ValuesMadeOver):
    """Bug: an activation left on the values (copied from the MLP)."""

    def values(self, v, x):
        return F.gelu(v)


class ValuesPlusTheInput(_ValuesMadeOver):
    """Bug: the input added to the values (a residual put inside the attention)."""

    def values(self, v, x):
        b, n, e = x.shape
        return v + x.reshape(b, n, self.heads, e // self.heads).transpose(1, 2)


class ValuesNormalised(_ValuesMadeOver):
    """Design (Gemma 3n's v_norm): an RMS norm without a weight on the values."""

    def values(self, v, x):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)


class ValueEmbeddings(_ValuesMadeOver):
    """Design (value embeddings, as in speed-run GPT trainers): a learned table mixed into the values."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.ve = nn.Parameter(0.1 * torch.randn(self.heads, 1, dim // self.heads))
        self.lambdas = nn.Parameter(torch.tensor([0.7, 0.3]))

    def values(self, v, x):
        return self.lambdas[0] * v + self.lambdas[1] * self.ve


class ConvImageAttention(nn.Module):
    """An image block's attention, channels first (as latent-diffusion and VQGAN autoencoders write it): a group
    norm, 1x1 convolutions for q, k, v and the output, the values product written V^T W^T, a residual."""

    def __init__(self, channels: int, scale: float | None = None, softmax_dim: int = 2, permute: bool = True) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, channels)
        self.q, self.k, self.v, self.proj = (nn.Conv2d(channels, channels, 1) for _ in range(4))
        self.scale, self.softmax_dim, self.permute = scale, softmax_dim, permute

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, height, width = q.shape
        q = q.reshape(b, c, height * width).permute(0, 2, 1)
        w = torch.bmm(q, k.reshape(b, c, height * width)) * (self.scale if self.scale is not None else c ** -0.5)
        w = torch.softmax(w, dim=self.softmax_dim)
        w = w.permute(0, 2, 1) if self.permute else w
        return x + self.proj(torch.bmm(v.reshape(b, c, height * width), w).reshape(b, c, height, width))


class ChannelsLastImageAttention(nn.Module):
    """Attention over an image given channels last, (B, H, W, C) (as segment-anything's image encoder)."""

    def __init__(self, dim: int, heads: int = 4, scale: float | None = None) -> None:
        super().__init__()
        self.heads, self.scale = heads, scale if scale is not None else (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, height, width, _ = x.shape
        qkv = self.qkv(x).reshape(b, height * width, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * self.heads, height * width, -1).unbind(0)
        w = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        o = (w @ v).view(b, self.heads, height, width, -1).permute(0, 2, 3, 1, 4).reshape(b, height, width, -1)
        return self.proj(o)


class T5Style(nn.Module):
    """T5's attention: no scale on the scores, 1/sqrt(D) folded into the query projection's initialisation."""

    def __init__(self, dim: int, heads: int = 4, folded: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        d = dim // heads
        with torch.no_grad():
            for layer in (self.k, self.v, self.o):
                layer.weight.normal_(0.0, dim ** -0.5)
            self.q.weight.normal_(0.0, (dim * d) ** -0.5 if folded else dim ** -0.5)

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        return self.o((torch.softmax(q @ k.transpose(-1, -2), -1) @ v).transpose(1, 2).reshape(b, n, e))


class CausalUnlessMasked(_Fused):
    """nanoGPT / litgpt style: no mask means causal (``is_causal=mask is None``), a mask given replaces it."""

    invert = False

    def forward(self, x, mask=None):
        q, k, v = self.split(x)
        mask = ~mask if self.invert and mask is not None else mask
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None))


class CausalUnlessMaskedInverted(CausalUnlessMasked):
    """Bug: the mask given is read True = hidden."""

    invert = True


class RewritesItsMask(_Fused):
    """Correct, but turns the caller's (B, L) keep-mask into a (B, 1, 1, L) hide-mask in place."""

    def forward(self, x, key_padding_mask=None):
        q, k, v = self.split(x)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if key_padding_mask is not None:
            hide = key_padding_mask.unsqueeze_(1).unsqueeze_(1).logical_not_()
            s = s.masked_fill(hide, torch.finfo(s.dtype).min)
        return self.merge(torch.softmax(s, -1) @ v)


class HalvesItsInput(_Fused):
    """Correct attention on half its input, halved in place (``x.mul_(0.5)``)."""

    def forward(self, x):
        x.mul_(0.5)
        q, k, v = self.split(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v))


class ViTStyle(nn.Module):
    """vit-pytorch's layout: heads and dim_head with defaults, inner = heads * dim_head, scale ``dim_head ** -0.5``."""

    def __init__(self, dim: int, heads: int = 8, dim_head: int = 64) -> None:
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        o = torch.softmax(q @ k.transpose(-1, -2) * self.scale, -1) @ v
        return self.to_out(o.transpose(1, 2).reshape(b, n, -1))


class ViTScaledByWidth(ViTStyle):
    """Bug (as shipped in a vision package): the scale is ``dim ** -0.5``, the model width, not the head dim."""

    def __init__(self, dim: int, heads: int = 8, dim_head: int = 64) -> None:
        super().__init__(dim, heads, dim_head)
        self.scale = dim ** -0.5


class CosineTemperature(_Fused):
    """Correct design (Swin v2 style): L2-normalised q and k, a learned log-temperature per head, no 1/sqrt(D)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.log_tau = nn.Parameter(torch.full((self.heads, 1, 1), math.log(12.0)))

    def forward(self, x):
        q, k, v = self.split(x)
        s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)
        return self.merge(torch.softmax(s * self.log_tau.clamp(max=math.log(100.0)).exp(), -1) @ v)


class SequenceFirstEinsum(nn.Module):
    """Correct, sequence-first (L, B, E) as Transformer-XL code writes it: scores "ibnd,jbnd->ijbn", the softmax
    over dim 1 (the keys), values "ijbn,jbnd->ibnd"."""

    def __init__(self, dim: int, heads: int = 4, softmax_dim: int = 1) -> None:
        super().__init__()
        self.heads, self.softmax_dim = heads, softmax_dim
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        n, b, e = x.shape
        q, k, v = self.qkv(x).reshape(n, b, 3, self.heads, e // self.heads).unbind(2)
        p = torch.einsum("ibnd,jbnd->ijbn", q, k).mul(q.shape[-1] ** -0.5).softmax(dim=self.softmax_dim)
        return self.out(torch.einsum("ijbn,jbnd->ibnd", p, v).reshape(n, b, e))


class SequenceFirstMasked(nn.Module):
    """Correct, sequence-first with its mask in the same layout, as Transformer-XL code takes it: bool, True =
    masked, (Lq, Lk, B) or (Lq, Lk, 1), broadcast over the heads with ``[:, :, :, None]`` (an (Lq, Lk) one with
    ``[None, :, :, None]``). ``ignore_mask`` drops it; ``fill`` is the masked score."""

    def __init__(self, dim: int, heads: int = 4, ignore_mask: bool = False, fill: float = float("-inf")) -> None:
        super().__init__()
        self.heads, self.ignore_mask, self.fill = heads, ignore_mask, fill
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        n, b, e = x.shape
        q, k, v = (t.reshape(n, b, self.heads, -1) for t in self.qkv(x).chunk(3, dim=-1))
        s = torch.einsum("ibnd,jbnd->ijbn", q, k) / math.sqrt(q.shape[-1])
        if attn_mask is not None and not self.ignore_mask:
            if attn_mask.dim() == 2:
                s = s.masked_fill(attn_mask[None, :, :, None], self.fill)
            elif attn_mask.dim() == 3:
                s = s.masked_fill(attn_mask[:, :, :, None], self.fill)
        p = F.softmax(s, dim=1)
        return self.out(torch.einsum("ijbn,jbnd->ibnd", p, v).reshape(n, b, e))


class PositionsRequired(nn.Module):
    """Correct, an inference module that must be told where its tokens are, as gpt-fast writes it: ``input_pos``
    (L,) indexes a key/value cache written in place and the rows of a causal buffer; or an offset ``start_pos``
    with an additive mask, as Meta's reference Llama. ``scale`` replaces SDPA's 1/sqrt(D) (1.0: missing-scale)."""

    def __init__(self, dim: int, heads: int = 4, length: int = 16, offset: bool = False,
                 scale: float | None = None) -> None:
        super().__init__()
        self.heads, self.offset, self.scale = heads, offset, scale
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, heads, length, dim // heads))
        self.register_buffer("v_cache", torch.zeros(1, heads, length, dim // heads))
        self.register_buffer("causal", torch.tril(torch.ones(length, length, dtype=torch.bool)))

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.wqkv(x).split(e, dim=-1))
        if b != self.k_cache.shape[0]:
            self.k_cache = self.k_cache.new_zeros(b, *self.k_cache.shape[1:])
            self.v_cache = self.v_cache.new_zeros(b, *self.v_cache.shape[1:])
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        mask = self.causal[None, None, input_pos]
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, scale=self.scale)
        return self.wo(y.transpose(1, 2).reshape(b, n, e))


class OffsetRequired(PositionsRequired):
    def forward(self, x: torch.Tensor, start_pos: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.wqkv(x).split(e, dim=-1))
        keys = torch.arange(start_pos, start_pos + n)
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~self.causal[keys][:, keys], float("-inf"))
        if mask is not None:
            s = s + mask
        return self.wo((torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, n, e))


class BucketedBias(nn.Module):
    """Correct, T5's attention as its descendants copy it, built with torch's default initialisation: no scale on the
    scores, a bias per head from ``nn.Embedding(buckets, heads)`` looked up by the bucketed relative positions.
    ``table=True`` looks the same bias up in a plain parameter (Swin's relative-position table) instead, ``index``
    "absolute" by the key's position, "clipped" by Shaw's clipped offset j - i + K: with no scale, each of those is
    missing-scale."""

    def __init__(self, dim: int, heads: int = 4, buckets: int = 32, table: bool = False, index: str = "t5") -> None:
        super().__init__()
        self.heads, self.buckets, self.table, self.index = heads, buckets, table, index
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.relative_attention_bias = nn.Embedding(buckets, heads)
        self.bias_table = nn.Parameter(torch.randn(buckets, heads))

    def _bucket(self, rel: torch.Tensor) -> torch.Tensor:
        half = self.buckets // 2
        exact = half // 2
        far = exact + (torch.log(rel.abs().clamp(min=1).float() / exact) / math.log(128 / exact)
                       * (half - exact)).long().clamp(max=half - 1)
        return (rel > 0).long() * half + torch.where(rel.abs() < exact, rel.abs(), far)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        pos = torch.arange(n)
        rel = pos[None, :] - pos[:, None]
        buckets = {"t5": lambda: self._bucket(rel), "absolute": lambda: pos[None, :].expand(n, n),
                   "clipped": lambda: rel.clamp(-4, 4) + 4}[self.index]()
        bias = self.bias_table[buckets] if self.table else self.relative_attention_bias(buckets)
        s = q @ k.transpose(-1, -2) + bias.permute(2, 0, 1)[None]
        if mask is not None:
            s = s + mask
        return self.o((torch.softmax(s.float(), dim=-1).type_as(s) @ v).transpose(1, 2).reshape(b, n, e))


class SequenceFirstOverQueries(SequenceFirstEinsum):
    """Bug: the same layout with the softmax over dim 0, the queries."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, softmax_dim=0)


class RelativeXL(nn.Module):
    """Transformer-XL relative attention without memory, sequence-first (L, B, E): content term (q + u) . k and
    position term (q + v) . R_(i-j) from sinusoids through r_net, aligned by the relative shift; causal."""

    scaled = True

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.d_head = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.r_net = nn.Linear(dim, dim, bias=False)
        self.r_w_bias = nn.Parameter(0.1 * torch.randn(heads, dim // heads))
        self.r_r_bias = nn.Parameter(0.1 * torch.randn(heads, dim // heads))
        self.o_net = nn.Linear(dim, dim, bias=False)

    @staticmethod
    def _rel_shift(x: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros((x.size(0), 1, *x.size()[2:]), dtype=x.dtype)
        return torch.cat([pad, x], dim=1).view(x.size(1) + 1, x.size(0), *x.size()[2:])[1:].view_as(x)

    def forward(self, w):
        n, b, e = w.shape
        freq = 1 / 10000 ** (torch.arange(0.0, e, 2.0, dtype=w.dtype) / e)
        angle = torch.outer(torch.arange(n - 1, -1, -1.0, dtype=w.dtype), freq)
        r_k = self.r_net(torch.cat([angle.sin(), angle.cos()], -1)).view(n, self.heads, self.d_head)
        q, k, v = self.qkv(w).view(n, b, 3, self.heads, self.d_head).unbind(2)
        ac = torch.einsum("ibnd,jbnd->ijbn", q + self.r_w_bias, k)
        bd = self._rel_shift(torch.einsum("ibnd,jnd->ijbn", q + self.r_r_bias, r_k))
        score = ac + bd
        if self.scaled:
            score = score * self.d_head ** -0.5
        future = torch.ones(n, n, dtype=torch.bool).triu(1)[:, :, None, None]
        prob = score.masked_fill(future, float("-inf")).softmax(dim=1)
        return self.o_net(torch.einsum("ijbn,jbnd->ibnd", prob, v).reshape(n, b, e))


class RelativeXLUnscaled(RelativeXL):
    """Bug: the same without the 1/sqrt(d_head)."""

    scaled = False


class ShawRelative(_Fused):
    """Shaw et al.: learned embeddings of clip(j - i, +-3) added to the keys (a score term) and to the values."""

    over = -1

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.rel_k = nn.Embedding(7, dim // self.heads)
        self.rel_v = nn.Embedding(7, dim // self.heads)

    def forward(self, x):
        q, k, v = self.split(x)
        n = x.shape[1]
        rel = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-3, 3) + 3
        a_k, a_v = self.rel_k(rel), self.rel_v(rel)  # (L, L, D)
        s = (q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, a_k)) / math.sqrt(q.shape[-1])
        p = s.softmax(self.over)
        return self.merge(p @ v + torch.einsum("bhij,ijd->bhid", p, a_v))


class ShawOverQueries(ShawRelative):
    """Bug: the same with the softmax over the queries."""

    over = -2


def _rope_in_place(t: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary positions written into ``t`` in place, half by half (returns ``t``)."""
    n, d = t.shape[-2], t.shape[-1] // 2
    angle = torch.arange(n, dtype=t.dtype)[:, None] / 10000 ** (torch.arange(d, dtype=t.dtype) / d)
    cos, sin = angle.cos(), angle.sin()
    first, second = t[..., :d].clone(), t[..., d:].clone()
    t[..., :d] = first * cos - second * sin
    t[..., d:] = first * sin + second * cos
    return t


def _rope_complex(t: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary positions through complex numbers (Meta's Llama code): (..., L, D) -> the same."""
    n, d = t.shape[-2], t.shape[-1]
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), 1 / 10000 ** (torch.arange(0, d, 2) / d))
    turned = torch.view_as_complex(t.double().reshape(*t.shape[:-1], d // 2, 2)) * torch.polar(
        torch.ones_like(freqs), freqs)
    return torch.view_as_real(turned).flatten(-2).to(t.dtype)


class RotaryWritten(_Fused):
    """Correct (in place, or complex) rotary on q and k; ``on_values`` (a bug) on v too."""

    rope = staticmethod(_rope_in_place)
    on_values = False

    def forward(self, x):
        q, k, v = (t.contiguous() for t in self.split(x))
        q, k = self.rope(q), self.rope(k)
        if self.on_values:
            v = self.rope(v)
        return self.merge(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v)


class RotaryWrittenOnValues(RotaryWritten):
    on_values = True


class RotaryComplex(RotaryWritten):
    rope = staticmethod(_rope_complex)


class RotaryComplexOnValues(RotaryComplex):
    on_values = True


class ScaledOnASplitView(nn.Module):
    """Scales q in place on a view that ``split`` returned (nanoGPT's split, then ``q.mul_``): torch refuses the
    backward of such an in-place change, so its gradients cannot be probed."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = (t.view(*x.shape[:2], 4, -1).transpose(1, 2) for t in self.c_attn(x).split(x.shape[-1], 2))
        q.mul_(q.shape[-1] ** -0.5)
        return _Fused.merge(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class WrittenIntoBuffers(nn.Module):
    """Inference code ported from a C kernel: the scores and the output written into buffers it allocates
    (``torch.baddbmm(..., out=s)``, ``torch.bmm(w, v, out=o)``), which autograd refuses to differentiate."""

    def __init__(self, dim: int, scaled: bool = True) -> None:
        super().__init__()
        self.c_attn, self.scaled = nn.Linear(dim, 3 * dim), scaled

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (t.view(b, n, 4, -1).transpose(1, 2).reshape(b * 4, n, -1) for t in self.c_attn(x).split(e, 2))
        s = torch.empty(b * 4, n, n, dtype=x.dtype, device=x.device)
        torch.baddbmm(s, q, k.transpose(1, 2), beta=0.0, alpha=q.shape[-1] ** -0.5 if self.scaled else 1.0, out=s)
        o = torch.empty_like(q)
        torch.bmm(s.softmax(-1), v, out=o)
        return _Fused.merge(o.view(b, 4, n, -1))


class SharedQueryKey(nn.Module):
    """Reformer style: one projection called twice for the queries and the keys."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.to_qk, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        def heads(t):
            return t.view(*x.shape[:2], 4, -1).transpose(1, 2)
        q, k, v = heads(self.to_qk(x)), heads(self.to_qk(x)), heads(self.to_v(x))
        return _Fused.merge(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v)


class ValuesEinsumTokensFirst(_Fused):
    """Correct: sequence-first input, weights "bhqk", values product "bhqk,kbhd->qbhd", merged by a reshape."""

    def forward(self, x):
        n, b, e = x.shape
        q, k, v = self.qkv(x).view(n, b, 3, self.heads, e // self.heads).unbind(2)
        p = torch.einsum("qbhd,kbhd->bhqk", q, k).div(math.sqrt(e // self.heads)).softmax(-1)
        return torch.einsum("bhqk,kbhd->qbhd", p, v).reshape(n, b, e)


class OptionalProjections(nn.Module):
    """Correct: projections for a cross-attention context and a gate, used only when asked."""

    def __init__(self, dim: int, use_gate: bool = False) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_k_context, self.to_v_context = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.gate_proj, self.use_gate = nn.Linear(dim, dim), use_gate

    def forward(self, x, context=None):
        def heads(t):
            return t.view(t.shape[0], t.shape[1], 4, -1).transpose(1, 2)
        k_in = x if context is None else context
        to_k, to_v = (self.to_k, self.to_v) if context is None else (self.to_k_context, self.to_v_context)
        q, k, v = heads(self.to_q(x)), heads(to_k(k_in)), heads(to_v(k_in))
        out = _Fused.merge(F.scaled_dot_product_attention(q, k, v))
        return out * torch.sigmoid(self.gate_proj(x)) if self.use_gate else out


class BatchFixedByCache(_Fused):
    """gpt-fast style: keys and values written into a cache allocated for batch 3 (``index_copy_``), causal."""

    future = 0

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.register_buffer("k_cache", torch.zeros(3, self.heads, 32, dim // self.heads), persistent=False)
        self.register_buffer("v_cache", torch.zeros(3, self.heads, 32, dim // self.heads), persistent=False)

    def forward(self, x):
        q, k, v = self.split(x)
        n = x.shape[1]
        at = torch.arange(n)
        self.k_cache.index_copy_(2, at, k)
        self.v_cache.index_copy_(2, at, v)
        k, v = self.k_cache[:, :, :n], self.v_cache[:, :, :n]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(self.future), float("-inf"))
        return self.merge(torch.softmax(s, -1) @ v)


class BatchFixedByCacheLeaking(BatchFixedByCache):
    """Bug: the same with the causal mask shifted by one (each query sees the next key)."""

    future = 1


def test_in_place_scaling_and_scaling_before_rotary_are_read_as_scaled():
    """catches: the trace keeping the first maker of a tensor, so ``q.mul_(scale)`` after a q/k norm was invisible
    (false missing-scale), and a scale applied before rotary positions lost at the rotation (false missing-scale)."""
    for cls in (NormedScaledInPlace, NormedScaledBeforeRotary):
        report = check(cls(32))
        assert report.verdict == "passed", (cls.__name__, [(f.id, f.message) for f in report.findings])
        assert "1/sqrt(8)" in report.inferred["white box"]["without mask"], report.inferred["white box"]


def test_a_norms_weight_behind_a_rotation_is_not_a_learned_scale():
    """catches: the walk back through rotary positions reaching the q/k norm's weight (a vector per head dim)
    and taking it for a learned per-dimension scale, so a missing 1/sqrt(D) behind q/k RMSNorm and rotary
    (Qwen 3's layout) was certified."""
    assert "missing-scale" in check(RMSNormedRotaryUnscaled(32)).ids


def test_values_changed_before_the_product_are_named():
    """catches: rotary positions applied to v certified, as only the scale, the softmax axis and the orientation
    of the weights were checked, not that V reaches the product as its projection made it."""
    report = check(RotaryOnValues(32))
    assert report.verdict == "failed" and "values-changed" in report.ids, [(f.id, f.message) for f in report.findings]


def test_values_rotated_after_a_kept_prefix_are_named():
    """catches: v joined from an untouched class token and rotated image tokens (a cat along the tokens)
    certified, because only the join, not its parts, was read as V."""
    assert check(PrefixKeptRotary(32)).verdict == "passed"
    bad = check(PrefixKeptRotary(32, on_values=True))
    assert bad.verdict == "failed" and "values-changed" in bad.ids, [(f.id, f.message) for f in bad.findings]


def test_sdpa_within_windows_is_read_window_by_window():
    """catches: one SDPA call over windows of an image (each of 4 tokens of 16) read as a head split that mixes
    tokens and heads (definition-mismatch), while the same windows through softmax were read; a wrong scale
    inside the windows must still be named."""
    report = check(WindowedSdpa(32), length=16)
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    bad = check(WindowedSdpa(32, scale=1.0), length=16)
    assert "missing-scale" in bad.ids or "wrong-scale" in bad.ids, [(f.id, f.message) for f in bad.findings]


def test_any_change_of_the_values_is_named_and_the_designs_are_facts():
    """catches: values changed after their projection certified because only a rotation was looked for (an
    activation, the input added), and the published designs on the values (a norm, learned value embeddings)
    read as that bug."""
    for bug in (ValuesThroughGelu, ValuesPlusTheInput):
        report = check(bug(32))
        assert report.verdict == "failed" and report.ids == {"values-changed"}, \
            (bug.__name__, [(f.id, f.message) for f in report.findings])
    for design in (ValuesNormalised, ValueEmbeddings, _ValuesMadeOver):
        report = check(design(32))
        assert report.verdict == "passed", (design.__name__, [(f.id, f.message) for f in report.findings],
                                            report.not_verified)


def test_image_attention_is_called_as_an_image_and_read_on_its_tokens():
    """catches: a module that takes (B, C, H, W) or (B, H, W, C) refused (it runs on no (B, L, E) input), the white
    box failing inside the doctor on a 4-D projection output, and V^T W^T (channels first) read as matmul-order;
    their bugs still named."""
    for module in (ConvImageAttention(32), ChannelsLastImageAttention(32)):
        report = check(module)
        assert report.verdict == "passed", (type(module).__name__, [(f.id, f.message) for f in report.findings],
                                            report.not_verified)
        assert report.inferred["layout"].startswith(("channels-first", "channels-last"))
    assert check(ConvImageAttention(32, scale=1.0)).ids == {"missing-scale"}
    assert check(ChannelsLastImageAttention(32, scale=1.0)).ids == {"missing-scale"}
    assert check(ConvImageAttention(32, permute=False)).ids == {"matmul-order"}
    assert "softmax-dim" in check(ConvImageAttention(32, softmax_dim=1)).ids


def test_a_scale_folded_into_the_query_projection_is_the_definition():
    """catches: T5's attention (no scale on the scores, q's weights initialised 1/sqrt(D) smaller) named
    missing-scale, and the same code with ordinary initialisation not named."""
    torch.manual_seed(0)
    report = check(T5Style(64))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "folded into the query projection" in report.inferred["design"]["scale"]
    assert check(T5Style(64, folded=False)).ids == {"missing-scale"}


def test_a_mask_that_replaces_the_modules_own_causal_pattern_is_understood():
    """catches: a module whose mask=None means causal (SDPA's is_causal=mask is None, transformers' sdpa path)
    refused every mask ("a mask that hides nothing does not give the unmasked output"), so its mask and padding
    went unverified or were named mask-error; and its inverted mask certified."""
    for kw in ({}, {"mask": "keep (B,1,L,L)"}):
        report = check(CausalUnlessMasked(32), **kw)
        assert report.verdict == "passed", (kw, [(f.id, f.message) for f in report.findings], report.coverage)
        assert report.coverage["mask"] == "verified" and report.coverage["padding"] == "verified"
        assert "replaces it" in report.inferred["mask"]["own pattern"]
    assert check(CausalUnlessMaskedInverted(32), mask="keep (B,1,L,L)").verdict == "failed"


def test_a_module_that_rewrites_its_arguments_is_a_fact_not_a_crash():
    """catches: a module that rewrites the caller's mask in place (``mask.unsqueeze_(1)...``) corrupting the doctor's
    own tensors (IndexError from the doctor, or a wrong mask convention and a false matmul-order), and one that
    scales its input in place changing the probe input of every later probe."""
    report = check(RewritesItsMask(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings] + [report.not_verified]
    assert "mutates-input" in report.ids and report.inferred["mask"]["kind"] == "keep"
    (mutated,) = [f for f in report.findings if f.id == "mutates-input"]
    assert mutated.severity == "warning" and mutated.evidence["changed"] == ["its mask argument"]
    assert report.coverage["mask"] == "verified"
    report = check(HalvesItsInput(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings] + [report.not_verified]
    assert [f.evidence["changed"] for f in report.findings if f.id == "mutates-input"] == [["its input"]]


def test_a_head_dim_that_defaults_to_the_width_does_not_hide_a_scale_by_the_width():
    """catches: ``dim ** -0.5`` instead of ``dim_head ** -0.5`` certified, because the doctor built the class with
    its default dim_head, equal to the width it chose (64), so the two scales were the same number."""
    bad = check(ViTScaledByWidth, embed_dim=64)
    assert "wrong-scale" in bad.ids, [(f.id, f.message) for f in bad.findings]
    assert "model width" in next(f.message for f in bad.findings if f.id == "wrong-scale")
    assert check(ViTStyle, embed_dim=64).verdict == "passed"


def test_cosine_attention_with_a_learned_temperature_is_a_design():
    """catches: L2-normalised q and k times a learned temperature per head (no 1/sqrt(D)) read as
    definition-mismatch (the temperature stopped the walk from the softmax to the product)."""
    report = check(CosineTemperature(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "cosine" in report.inferred["white box"]["without mask"]


def test_a_learned_scalar_temperature_is_a_design_and_a_fixed_one_is_not():
    """catches: one learned temperature on the scores (exp of a scalar parameter, not per head) read as
    wrong-scale, because a one-element tensor was taken for a constant; the same factor from a buffer (not
    trained) must stay wrong-scale."""
    report = check(LearnedScalarTemperature(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "learned temperature" in report.inferred["white box"]["without mask"]
    fixed = check(LearnedScalarTemperature(32, fixed=True))
    assert "wrong-scale" in fixed.ids, [(f.id, f.message) for f in fixed.findings]


def test_sequence_first_einsum_layouts_are_read_on_their_own_axes():
    """catches: weights laid out (Lq, Lk, B, H) by an einsum, the softmax over dim 1, read as weights over axes
    that are not the tokens (definition-mismatch) and their merge as head-merge; the softmax over the queries in
    the same layout must still be softmax-dim."""
    report = check(SequenceFirstEinsum(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert report.inferred["layout"].startswith("sequence-first")
    bad = check(SequenceFirstOverQueries(32))
    assert "softmax-dim" in bad.ids, [(f.id, f.message) for f in bad.findings]


def test_a_sequence_first_mask_is_found_in_its_own_layout_and_its_bugs_named():
    """catches: a sequence-first module whose mask is (Lq, Lk, B) or (Lq, Lk, 1), as Transformer-XL takes it, left
    inconclusive (no batch-first mask shape is accepted), or failed because a batch-first (B, 1, L, L) mask it
    never reads is "accepted but ignored"; the same module that drops its mask must still be mask-ignored."""
    report = check(SequenceFirstMasked(32, fill=-1e4))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert report.inferred["mask"]["shape"] == "(L, L, B)", report.inferred["mask"]
    assert report.coverage["mask"] == report.coverage["padding"] == "verified"
    bad = check(SequenceFirstMasked(32, ignore_mask=True))
    assert bad.ids == {"mask-ignored"}, [(f.id, f.message) for f in bad.findings]


def test_nan_on_a_fully_masked_row_is_a_warning_as_torchs_own_attention_gives_it():
    """catches: a -inf fill (torch's MultiheadAttention, Transformer-XL, fairseq) failing a correct module: a row
    with no visible key is NaN there, which the doctor names as a warning and does not hold against the verdict."""
    report = check(SequenceFirstMasked(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert report.ids == {"nan-on-masked-row"}
    assert {f.severity for f in report.findings} == {"warning"}

    class TorchMHA(nn.Module):
        def __init__(self, embed_dim: int = 32, num_heads: int = 4) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)

        def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
            return self.attn(x, x, x, attn_mask=attn_mask, need_weights=False)[0]

    report = check(TorchMHA())
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert report.ids == {"nan-on-masked-row"}
    assert report.coverage["mask"] == "verified"


def test_a_forward_that_requires_the_positions_of_its_tokens_is_called_with_them():
    """catches: an inference module whose forward requires ``input_pos`` or ``start_pos`` (gpt-fast, Meta's
    reference Llama) left unchecked ("could not run"): the doctor gives the positions of a plain call, says so, and
    still names the module's bugs."""
    report = check(PositionsRequired(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "input_pos given the positions" in report.inferred["call"]
    assert report.inferred["causal"] is True
    assert check(PositionsRequired(32, scale=1.0)).ids == {"missing-scale"}
    report = check(OffsetRequired(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "start_pos" in report.inferred["call"] and report.coverage["mask"] == "verified"


def test_t5s_unscaled_scores_with_bucketed_bias_are_its_design():
    """catches: T5's attention (no 1/sqrt(D), a per-head bias from an embedding of relative-position buckets) built
    without T5's own initialisation read as missing-scale; the same bias from a plain table, or a per-head embedding
    looked up by clipped offsets, with no scale is still missing-scale. Looked up by absolute positions, the bias
    is not relative: that, not T5's missing scale, is what is wrong (definition-mismatch)."""
    report = check(BucketedBias(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "T5" in report.inferred["design"]["scale"]
    assert check(BucketedBias(32, table=True)).ids == {"missing-scale"}
    assert check(BucketedBias(32, index="clipped")).ids == {"missing-scale"}  # Shaw's j - i + K, not T5's buckets
    assert check(BucketedBias(32, index="absolute")).ids == {"definition-mismatch"}


def test_a_cache_that_fixes_the_batch_size_is_a_limit_and_hides_no_other_finding():
    """catches: a module that runs only at its cache's batch size read as batch-mixing (it fails on one item
    alone) or shape-dependent, and that verdict swallowing the causal-leak of a shifted causal mask."""
    report = check(BatchFixedByCache(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "batch size 3" in report.inferred["batch size"]
    bad = check(BatchFixedByCacheLeaking(32))
    assert "causal-leak" in bad.ids and "batch-mixing" not in bad.ids, [(f.id, f.message) for f in bad.findings]


def test_doctor_seams_are_where_they_were():
    """Fails loudly when the private torch behaviour the doctor's trace leans on moves (selfattn.check._seams)."""
    t = torch.zeros(3)
    before = _seams.version(t)
    t.add_(1)
    t[0] = 2.0
    assert _seams.version(t) == before + 2
    assert _seams.base_of(t[1:]) is t and _seams.base_of(t) is None

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        with _seams.untraced():
            torch.ones(2).sum()
        assert Counting.calls == 0
        torch.ones(2).sum()
    assert Counting.calls > 0


def test_relative_position_designs_are_facts_and_their_bugs_still_named():
    """catches: Transformer-XL's content and position terms (u/v biases, relative shift, sequence-first einsums)
    and Shaw's relative positions (a score term and a value term) read as definition-mismatch, because a term that
    depends on the queries was taken for a bias that may not vary between batch items; and the same designs with
    a missing scale or a softmax over the queries certified."""
    for cls in (RelativeXL, ShawRelative):
        report = check(cls(32))
        assert report.verdict == "passed", (cls.__name__, [(f.id, f.message) for f in report.findings])
        assert report.inferred["design"]["positions"].startswith("relative positions"), report.inferred["design"]
        assert report.coverage["equivariance"].startswith("not applicable")
    assert "value positions" in check(ShawRelative(32)).inferred["design"]
    assert "missing-scale" in check(RelativeXLUnscaled(32)).ids
    assert "softmax-dim" in check(ShawOverQueries(32)).ids


def test_rotary_written_in_place_or_in_complex_numbers_is_read_on_q_k_and_v():
    """catches: rotary positions applied to v missed when the rotation is written in place (``t[..., :d] = ...``)
    or through complex numbers (``view_as_complex``), while the same on q and k only must pass."""
    for cls in (RotaryWritten, RotaryComplex):
        report = check(cls(32))
        assert report.verdict == "passed", (cls.__name__, [(f.id, f.message) for f in report.findings])
    for cls in (RotaryWrittenOnValues, RotaryComplexOnValues):
        assert "values-changed" in check(cls(32)).ids, cls.__name__


def test_a_module_error_under_the_doctors_modes_is_the_modules_not_a_doctor_error():
    """catches: torch refusing the module's own in-place change of a split view under autograd, blamed on the
    doctor (its function mode was the deepest frame) or left an unverified property (the module is inference
    code: its gradients are not applicable, a fact), the same for results written into the module's own buffers
    (``out=``), and a projection called twice making the white box raise (recorded operations compared with == on
    their tensors)."""
    report = check(ScaledOnASplitView(32))
    assert report.verdict == "passed" and report.doctor_errors == [], report.not_verified
    assert report.coverage["gradients"].startswith("not applicable: the module runs only without autograd")
    assert "modified inplace" in report.inferred["inference only"]
    report = check(SharedQueryKey(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings] + [report.not_verified]
    report = check(WrittenIntoBuffers(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings] + [report.not_verified]
    assert "out=" in report.inferred["inference only"]
    assert check(WrittenIntoBuffers(32, scaled=False)).ids == {"missing-scale"}


def test_a_values_product_that_writes_tokens_first_merges_correctly():
    """catches: "bhqk,kbhd->qbhd" then a reshape (a correct merge) read as head-merge, which also hid a real
    causal leak inside its evidence."""
    report = check(ValuesEinsumTokensFirst(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]


def test_projections_used_only_on_request_are_not_no_grad():
    """catches: a cross-attention context's projections and a gate left unused by a self-attention call reported
    as no-grad (only a projection named for the role whose keys or values came from elsewhere is)."""
    report = check(OptionalProjections(32))
    assert report.verdict == "passed", [(f.id, f.message, f.evidence) for f in report.findings]


class ShrinksItsMask(_Fused):
    """Wrong: the causal buffer is replaced by its slice for this call (``self.mask = self.mask[:L, :L]``), so a
    call with a longer input than the last one fails."""

    def __init__(self, dim: int, heads: int = 4, longest: int = 64) -> None:
        super().__init__(dim, heads)
        self.register_buffer("mask", torch.ones(longest, longest, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        self.mask = self.mask[:n, :n]
        q, k, v = self.split(x)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return self.merge(s.masked_fill(~self.mask, float("-inf")).softmax(-1) @ v)


class GrowsItsRotaryCache(_Fused):
    """Correct: rotary tables cached for the longest input so far and rebuilt (a tensor and its length replaced)
    when a longer one comes, as GPT-NeoX's and older Llama code do; a call also keeps its weights for a viewer."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__(dim, heads)
        self.cached = 0
        self.cos = self.sin = torch.zeros(0)
        self.last_weights: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        n, d = x.shape[1], q.shape[-1] // 2
        if n > self.cached:
            angle = torch.arange(n, dtype=x.dtype)[:, None] / 10000 ** (torch.arange(d, dtype=x.dtype) / d)
            self.cached, self.cos, self.sin = n, torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        cos, sin = self.cos[:n].to(x.dtype), self.sin[:n].to(x.dtype)
        q, k = (t * cos + torch.cat([-t[..., d:], t[..., :d]], -1) * sin for t in (q, k))
        w = ((q @ k.transpose(-2, -1)) / math.sqrt(2 * d)).softmax(-1)
        self.last_weights = w.detach()
        return self.merge(w @ v)


class ConcatenatingCache(_Fused):
    """Correct decoding code: each call's keys and values appended to the cache (``torch.cat``), every query
    seeing the cached tokens and its own causal past; a second call continues the sequence."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__(dim, heads)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        if self.k_cache is not None:
            k, v = torch.cat([self.k_cache, k], 2), torch.cat([self.v_cache, v], 2)
        self.k_cache, self.v_cache = k, v
        n, s = q.shape[2], k.shape[2]
        visible = torch.ones(n, s, dtype=torch.bool).tril(s - n)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return self.merge(scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v)


def test_a_module_that_replaces_its_own_state_is_probed_as_given_and_a_state_that_breaks_calls_is_named():
    """catches: a module that overwrites its causal buffer with this call's slice crashing the doctor (a raw
    RuntimeError from its own layout check) or certified; and, the other way, rotary tables grown on demand, a
    kept weights tensor or a concatenating KV cache (each call continues the sequence) read as that bug, or their
    attention misread because one probe's call left the module in another state."""
    report = check(ShrinksItsMask(32))
    assert "state-dependent" in report.ids, [(f.id, f.message) for f in report.findings] + [report.not_verified]
    assert report.findings[0].evidence["replaced"]["mask"] == ("a tensor (64, 64)", "a tensor (7, 7)")
    for cls in (GrowsItsRotaryCache, ConcatenatingCache):
        report = check(cls(32))
        assert report.verdict == "passed", (cls.__name__, [(f.id, f.message) for f in report.findings],
                                            report.not_verified)
        assert "a call replaces the module's own" in report.inferred["state"], report.inferred
    assert "give the module's outputs as given" in check(GrowsItsRotaryCache(32)).inferred["state"]
    assert "state carried from call to call" in check(ConcatenatingCache(32)).inferred["state"]
    module = GrowsItsRotaryCache(32)
    check(module)
    assert module.cached == 0 and module.last_weights is None  # the module is left as it was given


def _grid(n: int) -> tuple[int, int]:
    """(H, W) with H * W = n, H the largest divisor of n up to its square root."""
    h = math.isqrt(n)
    while n % h:
        h -= 1
    return h, n // h


class SequenceReduction(nn.Module):
    """Correct, a published design (PVT's spatial reduction, CvT's strided key/value convolution): the keys and
    values come from the tokens laid out as an image and reduced by a strided convolution, so each of the L
    queries attends over L / r^2 keys. ``bug``: "dim scale" (1/sqrt(E), the bug that shipped in a ViT package),
    "over queries" (softmax over the queries)."""

    def __init__(self, dim: int, heads: int = 4, ratio: int = 2, bug: str = "") -> None:
        super().__init__()
        self.heads, self.ratio, self.bug = heads, ratio, bug
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.reduce = nn.Conv2d(dim, dim, ratio, stride=ratio)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        h, w = _grid(n)
        d = e // self.heads
        q = self.q(x).view(b, n, self.heads, d).transpose(1, 2)
        image = x.transpose(1, 2).reshape(b, e, h, w)
        pooled = self.norm(self.reduce(image).flatten(2).transpose(1, 2))  # (B, L / r^2, E)
        k, v = self.kv(pooled).view(b, -1, 2, self.heads, d).permute(2, 0, 3, 1, 4)
        scale = e ** -0.5 if self.bug == "dim scale" else d ** -0.5
        weights = (q @ k.transpose(-2, -1) * scale).softmax(-2 if self.bug == "over queries" else -1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, n, e))


def test_keys_and_values_reduced_from_the_tokens_are_a_design_and_their_bugs_still_named():
    """catches: spatial-reduction attention (PVT v2's and Twins' global sub-sampled attention in timm, CvT-style
    strided key/value convolutions), whose L queries attend over fewer keys, read as definition-mismatch ("a
    head split that mixes tokens and heads") or not-equivariant; and the same design with 1/sqrt(E) or a softmax
    over the queries certified or misnamed."""
    def on_a_grid(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x, _grid(x.shape[1]))

    pytest = __import__("pytest")
    pytest.importorskip("timm")
    from timm.models.pvt_v2 import Attention as PvtAttention
    from timm.models.twins import GlobalSubSampleAttn

    for name, module, how in [("ours", SequenceReduction(32), {}),
                              ("pvt v2", PvtAttention(32, num_heads=2, sr_ratio=2), {"call": on_a_grid}),
                              ("twins gsa", GlobalSubSampleAttn(32, num_heads=2, sr_ratio=2), {"call": on_a_grid})]:
        report = check(module.eval(), length=16, **how)
        assert report.verdict == "passed", (name, [(f.id, f.message) for f in report.findings], report.not_verified)
        assert "4 positions for the 16 queries" in report.inferred["design"]["reduced keys"], report.inferred
    assert "wrong-scale" in check(SequenceReduction(32, bug="dim scale"), length=16).ids
    assert "softmax-dim" in check(SequenceReduction(32, bug="over queries"), length=16).ids


class GatedAttentionUnit(nn.Module):
    """A published design (the gated attention unit of FLASH, Hua et al. 2022): one shared low-dimensional
    projection scaled into q and k per role, ReLU^2 weights over L in place of the softmax, and a gate. Its zeros
    follow the values, not positions. ``causal``: the future hidden; ``off_by_one``: tril(1), the next token seen."""

    def __init__(self, dim: int, qk_dim: int = 16, causal: bool = False, off_by_one: bool = False) -> None:
        super().__init__()
        self.causal, self.off_by_one = causal, off_by_one
        self.to_hidden = nn.Linear(dim, 4 * dim)
        self.to_qk = nn.Linear(dim, qk_dim)
        self.gamma = nn.Parameter(0.02 * torch.randn(2, qk_dim))
        self.beta = nn.Parameter(torch.zeros(2, qk_dim))
        self.to_out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        v, gate = F.silu(self.to_hidden(x)).chunk(2, dim=-1)
        q, k = (F.silu(self.to_qk(x))[..., None, :] * self.gamma + self.beta).unbind(dim=-2)
        weights = F.relu(torch.einsum("bid,bjd->bij", q, k) / n) ** 2
        if self.causal or self.off_by_one:
            weights = weights.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(int(self.off_by_one)), 0.0)
        return self.to_out(torch.einsum("bij,bjd->bid", weights, v) * gate)


def test_relu_squared_weights_whose_zeros_follow_the_values_are_no_mask():
    """catches: a gated attention unit (ReLU^2 weights, exact zeros wherever a score is negative) read as
    causal-leak ("queries see some future keys and not others", "hides past keys") because the zeros of its
    weights were taken for a mask, even with --allow-nonstandard; and its off-by-one causal mask or a missing
    causal mask the user asked for then certified."""
    for seed in range(3):
        for causal in (False, True):
            torch.manual_seed(seed)
            report = check(GatedAttentionUnit(32, causal=causal), allow_nonstandard=True, causal=causal)
            assert report.verdict == "passed", (seed, causal, [(f.id, f.message) for f in report.findings],
                                                report.coverage)
            assert report.inferred["causal"] is causal
        torch.manual_seed(seed)
        assert "causal-leak" in check(GatedAttentionUnit(32, off_by_one=True), allow_nonstandard=True).ids, seed
        torch.manual_seed(seed)
        assert "causal-leak" in check(GatedAttentionUnit(32), allow_nonstandard=True, causal=True).ids, seed


def test_local_attention_in_blocks_with_look_around_is_read_as_windows():
    """catches: lucidrains' local-attention (LocalMHA: blocks of queries, each over its own and its neighbours'
    keys, padded with a constant, causal or not, optionally with l2-normalised q/k and a fixed temperature of 8)
    read as definition-mismatch ("weights over axes that are not the tokens") or wrong-scale, and a 1/sqrt(E)
    scale in it certified."""
    pytest = __import__("pytest")
    pytest.importorskip("local_attention")
    from local_attention import LocalMHA

    for causal in (False, True):
        for qk_rmsnorm in (False, True):
            torch.manual_seed(0)
            module = LocalMHA(dim=32, window_size=4, dim_head=8, heads=4, causal=causal, qk_rmsnorm=qk_rmsnorm,
                              use_rotary_pos_emb=False).eval()
            report = check(module, length=16)
            assert report.verdict == "passed", (causal, qk_rmsnorm, [(f.id, f.message) for f in report.findings])
            assert "window" in report.inferred["window"], report.inferred
            # with its rotary positions it raises in half precision (float32 tables), and nothing else
            rotary = check(LocalMHA(dim=32, window_size=4, dim_head=8, heads=4, causal=causal,
                                    qk_rmsnorm=qk_rmsnorm).eval())
            assert set(rotary.ids) == {"half-precision-overflow"}, [(f.id, f.message) for f in rotary.findings]
    torch.manual_seed(0)
    wrong = LocalMHA(dim=32, window_size=4, dim_head=8, heads=4, causal=True, use_rotary_pos_emb=False).eval()
    wrong.attn_fn.scale = 32 ** -0.5
    assert "wrong-scale" in check(wrong, length=16).ids


def test_flash_gated_attention_units_are_a_design_with_allow_nonstandard():
    """catches: flash-pytorch's GAU (ReLU^2 weights with a learned relative bias, so whole diagonals of keys get
    exact zeros) read as causal-leak even with --allow-nonstandard."""
    pytest = __import__("pytest")
    pytest.importorskip("flash_pytorch")
    from flash_pytorch import GAU

    for causal in (False, True):
        for laplace in (False, True):
            torch.manual_seed(0)
            report = check(GAU(dim=32, query_key_dim=16, causal=causal, laplace_attn_fn=laplace).eval(),
                           allow_nonstandard=True)
            assert report.verdict == "passed", (causal, laplace, [(f.id, f.message) for f in report.findings])
            assert report.inferred["causal"] is causal


def test_image_attention_with_windows_or_a_reduction_by_seven_is_probed_on_a_grid_it_can_read():
    """catches: vit-pytorch's Twins blocks, which take (B, C, H, W) and whose norm broadcasts a (B, L, E) input
    into another shape, reported as "never returned a (B, L, E) output" (the image layout was never tried); and
    the global sub-sampled attention with its default reduction by 7 probed on a 7 x 7 grid, where one key is
    left (weight 1 whatever the score): a false wrong-scale and no-grad. Its scale bug is still named."""
    pytest = __import__("pytest")
    pytest.importorskip("vit_pytorch")
    from vit_pytorch.twins_svt import GlobalAttention, LocalAttention

    for module in (LocalAttention(32, heads=4, dim_head=8, patch_size=2), LocalAttention(32, heads=4, dim_head=8),
                   GlobalAttention(32, heads=4, dim_head=8, k=2), GlobalAttention(32, heads=4, dim_head=8)):
        report = check(module.eval())
        assert report.verdict == "passed", (module, [(f.id, f.message) for f in report.findings], report.not_verified)
        assert report.inferred["layout"].startswith("channels-first")
    wrong = GlobalAttention(32, heads=4, dim_head=8).eval()
    wrong.scale = 32 ** -0.5
    report = check(wrong)
    assert "wrong-scale" in report.ids and report.inferred["probe shape"] == (2, 196, 32), report.inferred


class ClipTextLayer(nn.Module):
    """Correct, as open_clip's text tower runs its blocks: a pre-norm residual block (open_clip's own
    ResidualAttentionBlock: nn.MultiheadAttention, then an MLP) given the causal mask the tower holds for its fixed
    context length, batch first or sequence first. ``leak``: that mask shows the next token."""

    def __init__(self, dim: int = 64, heads: int = 4, context: int = 8, batch_first: bool = True,
                 leak: bool = False) -> None:
        super().__init__()
        from open_clip.transformer import ResidualAttentionBlock

        self.block = ResidualAttentionBlock(dim, heads, batch_first=batch_first)
        self.register_buffer("attn_mask", torch.full((context, context), float("-inf")).triu(1 + int(leak)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, attn_mask=self.attn_mask)


def test_a_pre_norm_block_with_a_fixed_context_length_is_read_batch_or_sequence_first():
    """catches: nn.MultiheadAttention behind a norm read as definition-mismatch (its query, a norm of the input,
    was taken as sequence-first), a residual block compared as if its output were the attention's, a fixed context
    length equal to the head count of a wrapped attention read as a shape coincidence, and a sequence-first module
    with a fixed length left at "runs only at batch size 8" and then failing on the probe input."""
    pytest = __import__("pytest")
    pytest.importorskip("open_clip")
    from open_clip.transformer import ResidualAttentionBlock

    report = check(ResidualAttentionBlock(64, 4).eval())
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    for batch_first in (True, False):
        report = check(ClipTextLayer(batch_first=batch_first).eval())
        assert report.verdict == "passed", (batch_first, [(f.id, f.message) for f in report.findings])
        assert "runs only at length 8" in report.inferred["length"], report.inferred
        assert report.inferred.get("layout", "batch-first").startswith("batch" if batch_first else "sequence")
        assert "causal-leak" in check(ClipTextLayer(batch_first=batch_first, leak=True).eval()).ids


class CausalDroppedWithPadding(_Fused):
    """SDPA takes attn_mask or is_causal: a causal module written ``is_causal=mask is None`` that, given a key
    padding mask, drops its causal mask (``keep_causal`` keeps it, correct). ``padding_true``: the mask reads
    True = padding, as flash-attn's wrappers take it; ``additive``: a float (B, 1, 1, L) mask of 0 and -inf."""

    def __init__(self, dim: int, keep_causal: bool = False, padding_true: bool = False) -> None:
        super().__init__(dim)
        self.keep_causal, self.padding_true = keep_causal, padding_true

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        if key_padding_mask is None:
            return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        keep = (~key_padding_mask if self.padding_true else key_padding_mask)[:, None, None, :]
        if self.keep_causal:
            n = x.shape[1]
            keep = keep & torch.ones(n, n, dtype=torch.bool).tril()
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_a_causal_mask_dropped_when_a_padding_mask_comes_is_a_leak():
    """catches: a causal module that loses its causal mask whenever it is given a key padding mask (the classic
    ``is_causal=mask is None`` with SDPA) reported inconclusive ("no mask understood": the all-visible mask changes
    the output) instead of causal-leak, in either bool polarity; the module that keeps both must pass."""
    for padding_true in (False, True):
        report = check(CausalDroppedWithPadding(32, padding_true=padding_true))
        assert "causal-leak" in report.ids, (padding_true, [(f.id, f.message) for f in report.findings],
                                             report.coverage)
        assert report.inferred["mask"]["kind"] == ("ignore" if padding_true else "keep"), report.inferred["mask"]
        report = check(CausalDroppedWithPadding(32, keep_causal=True, padding_true=padding_true))
        assert report.verdict == "passed", (padding_true, [(f.id, f.message) for f in report.findings])


class SeparateProjectionsThroughTorch(nn.Module):
    """Correct, as fairseq (and fair-esm) call torch's functional core: three projection weights passed with
    ``use_separate_proj_weight=True`` and the biases packed. ``k_is_q``: the keys made by the query's weights."""

    def __init__(self, dim: int, heads: int = 4, k_is_q: bool = False, gated_bias: bool = False) -> None:
        super().__init__()
        self.heads, self.k_is_q, self.gated_bias = heads, k_is_q, gated_bias
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.gate = nn.Linear(dim, heads)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        t = x.transpose(0, 1)
        bias = None
        if self.gated_bias:  # WavLM-style: a relative-position bias gated by the query, passed as a float attn_mask
            n = x.shape[1]
            rel = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().float()
            gate = torch.sigmoid(self.gate(x)).transpose(1, 2)  # (B, H, L)
            bias = (gate[..., None] * -0.1 * rel).reshape(-1, n, n)
        out, _ = F.multi_head_attention_forward(
            t, t, t, t.shape[-1], self.heads, None,
            torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]), None, None, False, 0.0,
            self.out_proj.weight, self.out_proj.bias, training=False, key_padding_mask=key_padding_mask, attn_mask=bias,
            need_weights=False, use_separate_proj_weight=True, q_proj_weight=self.q_proj.weight,
            k_proj_weight=self.q_proj.weight if self.k_is_q else self.k_proj.weight, v_proj_weight=self.v_proj.weight)
        return out.transpose(0, 1)


def test_torch_functional_attention_with_separate_weights_is_read():
    """catches: torch's multi_head_attention_forward called with three projection weights (fairseq's, fair-esm's)
    left unread by the white box (inconclusive), and keys made by the query's weights certified."""
    report = check(SeparateProjectionsThroughTorch(32))
    assert report.verdict == "passed", ([(f.id, f.message) for f in report.findings], report.coverage)
    assert report.coverage["white_box"] == "verified"
    assert "no-grad" in check(SeparateProjectionsThroughTorch(32, k_is_q=True)).ids
    # a float attn_mask that is a bias (WavLM's gated relative positions) is not read as the definition
    gated = check(SeparateProjectionsThroughTorch(32, gated_bias=True))
    assert "definition-mismatch" not in gated.ids, [(f.id, f.message) for f in gated.findings]


def test_re_attention_normalised_over_the_heads_is_a_design():
    """catches: DeepViT's re-attention (the weights mixed across heads by a learned matrix, then a LayerNorm over
    the heads) read as definition-mismatch because no affine map of the heads reproduces the normalised mixture;
    and a 1/sqrt(E) scale in it certified."""
    pytest = __import__("pytest")
    pytest.importorskip("vit_pytorch")
    from vit_pytorch.deepvit import Attention

    report = check(Attention(32, heads=4, dim_head=8).eval())
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "re-attention" in report.inferred["design"], report.inferred
    wrong = Attention(32, heads=4, dim_head=8).eval()
    wrong.scale = 32 ** -0.5
    assert "wrong-scale" in check(wrong).ids


class DiffusionAttentionBlock(nn.Module):
    """Correct, a diffusion U-Net's attention block (as in guided-diffusion): (B, C, ...) channels first, a
    GroupNorm, a 1x1 conv1d qkv laid out per head, 1/sqrt(sqrt(ch)) on q and on k, and a residual around an output
    projection initialised at zero. ``scale_twice``: 1/sqrt(ch) on q and on k (1/ch in all)."""

    def __init__(self, channels: int = 64, heads: int = 4, scale_twice: bool = False) -> None:
        super().__init__()
        self.heads, self.scale_twice = heads, scale_twice
        self.norm = nn.GroupNorm(8, channels)
        self.qkv = nn.Conv1d(channels, 3 * channels, 1)
        self.proj_out = nn.Conv1d(channels, channels, 1)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, *spatial = x.shape
        x = x.reshape(b, c, -1)
        qkv = self.qkv(self.norm(x))
        ch = c // self.heads
        q, k, v = qkv.reshape(b * self.heads, 3 * ch, -1).split(ch, dim=1)
        scale = ch ** -0.5 if self.scale_twice else ch ** -0.25
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale).softmax(-1)
        h = torch.einsum("bts,bcs->bct", weight, v).reshape(b, c, -1)
        return (x + self.proj_out(h)).reshape(b, c, *spatial)


class ZeroInitResidualAttention(nn.Module):
    """Correct, as DiT's adaLN-Zero and ControlNet initialise it: x + attention(norm(x)), the attention's output
    projection at zero, so that at initialisation the block is the identity."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        nn.init.zeros_(self.attn.out_proj.weight)
        nn.init.zeros_(self.attn.out_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.attn(y, y, y, need_weights=False)[0]


def test_a_residual_around_a_zero_initialised_branch_is_probed_with_that_branch_drawn():
    """catches: a block that is the identity at initialisation (a residual around an output projection at zero,
    as diffusion models and DiT start) read as causal-leak ("each query sees only its own token"), and a
    channels-first (B, C, T) block run only where L = E and read as batch-mixing; its scale bug still named."""
    for module in (ZeroInitResidualAttention(), DiffusionAttentionBlock()):
        report = check(module.eval())
        assert report.verdict == "passed", (type(module).__name__, [(f.id, f.message) for f in report.findings])
        assert "zero-initialised" in report.inferred["drawn"], report.inferred
    report = check(DiffusionAttentionBlock().eval())
    assert report.inferred["layout"].startswith("channels-first-1d"), report.inferred
    assert "wrong-scale" in check(DiffusionAttentionBlock(scale_twice=True).eval()).ids


def test_relu_kinks_in_a_finite_difference_are_no_wrong_gradient():
    """catches: torch's own TransformerEncoderLayer (a ReLU feed-forward) named wrong-gradient for some weight
    draws, because a central difference whose step crosses a ReLU's kink bends away from autograd's derivative."""
    for seed in range(6):
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
        report = check(layer, no_mask=True, seed=seed)
        assert "wrong-gradient" not in report.ids, (seed, report.inferred["gradients"])


class FusedRawParameter(nn.Module):
    """A fused qkv projection held as raw parameters (``F.linear(x, self.in_proj_weight, self.in_proj_bias)``, as
    open_clip and nn.MultiheadAttention hold it). ``k_is_q``: the keys are the queries (the values' third of the
    weight still computed, the keys' never read)."""

    def __init__(self, dim: int = 32, heads: int = 4, k_is_q: bool = False) -> None:
        super().__init__()
        self.heads, self.k_is_q = heads, k_is_q
        self.in_proj_weight = nn.Parameter(torch.randn(3 * dim, dim) * dim ** -0.5)
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).view(b, n, 3, self.heads, -1) \
            .permute(2, 0, 3, 1, 4)
        if self.k_is_q:
            k = q
        o = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1) @ v
        return self.out(o.transpose(1, 2).reshape(b, n, e))


def test_library_options_and_raw_fused_weights_are_read():
    """catches: a raw-parameter fused projection whose keys' rows never get a gradient certified (only nn.Linear
    weights were read row by row); diffusers' scale_qk=False (the module's scale, 1) read as missing-scale;
    GPT-2's reorder_and_upcast_attn (it asserts float32 weights, so its float64 copy refuses an additive mask)
    read as mask-ignored; ConViT's gated positional attention (runs only at square lengths, and L = E = 64 is one)
    read as batch-mixing; x-transformers' sparse top-k (each row keeps its k highest scores) read as causal-leak."""
    pytest = __import__("pytest")
    assert check(FusedRawParameter()).verdict == "passed"
    assert "no-grad" in check(FusedRawParameter(k_is_q=True)).ids
    diffusers = pytest.importorskip("diffusers.models.attention_processor")
    module = diffusers.Attention(64, heads=4, dim_head=16, scale_qk=False).eval()
    report = check(module)
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    transformers = pytest.importorskip("transformers")
    from selfattn import check_model

    cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=1, vocab_size=100, reorder_and_upcast_attn=True,
                                  bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg).eval()
    layer = check_model(model, {"input_ids": torch.randint(0, 100, (2, 12))}).layers["h.0.attn"]
    assert layer.verdict == "passed", [(f.id, f.message) for f in layer.findings]
    convit = pytest.importorskip("timm.models.convit")
    report = check(convit.GPSA(64, num_heads=4).eval(), allow_nonstandard=True)
    assert "batch-mixing" not in report.ids and "perfect squares" in report.inferred["lengths"], report.inferred
    xt = pytest.importorskip("x_transformers.x_transformers")
    report = check(xt.Attention(64, dim_head=16, heads=4, sparse_topk=4).eval(), allow_nonstandard=True)
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "4 highest scores" in report.inferred["design"]["top-k"], report.inferred


@torch.jit.script
def _scripted_softcap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(scores / cap)


class ScriptedSoftcap(_Fused):
    """Correct, Gemma 2's soft-capping, with the cap in a torch.jit.script function (as x-transformers writes its
    softclamp): code the doctor's record cannot see into."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        scores = _scripted_softcap((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]), 5.0)
        return self.merge(scores.softmax(-1) @ v)


def test_scores_made_by_code_the_record_cannot_see_are_not_a_verdict():
    """catches: scores passed through a TorchScript function (invisible to the record) named definition-mismatch
    ("the softmax input was not made by a product"): nothing was seen, so nothing is certified or named."""
    report = check(ScriptedSoftcap(32))
    assert report.verdict == "inconclusive" and "definition-mismatch" not in report.ids, \
        [(f.id, f.message) for f in report.findings]
    assert "cannot see into" in report.coverage["white_box"], report.coverage


class HeadsFirstScores(_Fused):
    """Correct, scores laid out heads first ("bhid,bhjd->hbij", as fair-esm's MSA row attention writes them) with
    a (B, L) key padding mask, True = padding. ``on_queries``: the mask put on the query axis."""

    def __init__(self, dim: int, on_queries: bool = False) -> None:
        super().__init__(dim)
        self.on_queries = on_queries

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        scores = torch.einsum("bhid,bhjd->hbij", q, k) / math.sqrt(q.shape[-1])
        if key_padding_mask is not None:
            pad = key_padding_mask[None, :, :, None] if self.on_queries else key_padding_mask[None, :, None, :]
            scores = scores.masked_fill(pad, float("-inf"))
        return self.merge(torch.einsum("hbij,bhjd->bhid", scores.softmax(-1), v))


def test_masked_scores_laid_out_heads_first_are_read_per_batch_item():
    """catches: scores laid out heads first ("hbij") misread under a (B, L) key padding mask, and the mask put on
    their query axis certified. (fair-esm's row and column attention, whose (R, C, B, E) projections made the white
    box reshape such scores as if the batch came first, are entries of the wild corpus.)"""
    report = check(HeadsFirstScores(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert {"mask-ignored", "mask-broadcast"} & set(check(HeadsFirstScores(32, on_queries=True)).ids)


class KeyMaskOnSomeCalls(_Fused):
    """A (B, L) key padding mask, True = may attend, applied on some calls only. ``bug``: "item 0" (item 0's mask
    applied to every item), "with grad" (dropped when autograd is on: the training path), "long" (dropped from 16
    tokens on: a fast path for long sequences), "alone" (dropped for a batch of one); "" is correct."""

    def __init__(self, dim: int, bug: str = "") -> None:
        super().__init__(dim)
        self.bug = bug

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        drop = mask is None or (self.bug == "with grad" and torch.is_grad_enabled()) or \
            (self.bug == "long" and x.shape[1] >= 16) or (self.bug == "alone" and x.shape[0] == 1)
        if drop:
            return self.merge(F.scaled_dot_product_attention(q, k, v))
        keep = (mask[:1] if self.bug == "item 0" else mask)[:, None, None, :].expand(q.shape[0], 1, 1, -1)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_a_key_mask_is_checked_on_every_item_with_autograd_and_at_a_longer_length():
    """catches: a key mask taken from item 0 for every item, dropped on the autograd path, on a long-sequence path or
    for a batch of one certified: the padding probe changed item 0's padding only, under no_grad, at the probe
    length and batch."""
    assert check(KeyMaskOnSomeCalls(32)).verdict == "passed"
    for bug in ("item 0", "with grad", "long", "alone"):
        report = check(KeyMaskOnSomeCalls(32, bug=bug))
        assert "mask-ignored" in report.ids, (bug, [(f.id, f.message) for f in report.findings])


class DictWeightsFirst(_Fused):
    """Correct, returning {"attn_weights": w, "hidden_states": out}: the weights come first in the dict."""

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        q, k, v = self.split(x)
        w = ((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])).softmax(-1)
        return {"attn_weights": w, "hidden_states": self.merge(w @ v)}


def test_a_dict_output_is_read_at_the_tensor_of_the_inputs_shape():
    """catches: a dict output whose first tensor is the weights taken for the output (CannotRun: never returned
    a (B, L, E) output)."""
    report = check(DictWeightsFirst(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]


class RotaryOn(_Fused):
    """Rotary positions on the sides named in ``sides`` ("qk" is correct; "q" or "k" alone is the bug), through
    ``rope`` (rotate-half, in place, or complex numbers), scores by matmul or by torch's SDPA."""

    def __init__(self, dim: int, sides: str = "qk", rope=_rope, sdpa: bool = False) -> None:
        super().__init__(dim)
        self.sides, self.rope, self.sdpa = sides, rope, sdpa

    def forward(self, x):
        q, k, v = (t.contiguous() for t in self.split(x))
        q = self.rope(q) if "q" in self.sides else q
        k = self.rope(k) if "k" in self.sides else k
        if self.sdpa:
            return self.merge(F.scaled_dot_product_attention(q, k, v))
        return self.merge(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v)


def test_rotary_positions_on_one_side_only_are_named():
    """catches: rotary positions on q but not on k (or on k only) passed: the scores then depend on where each
    token is, and a permutation probe cannot tell, since the module is not meant to be equivariant anyway."""
    for rope in (_rope, _rope_in_place, _rope_complex):
        for sdpa in (False, True):
            report = check(RotaryOn(32, "qk", rope, sdpa))
            assert report.verdict == "passed", (rope.__name__, sdpa, [(f.id, f.message) for f in report.findings])
            for sides in ("q", "k"):
                report = check(RotaryOn(32, sides, rope, sdpa))
                assert "rotary-one-side" in report.ids, (sides, rope.__name__, sdpa, report.ids)
                found = next(f for f in report.findings if f.id == "rotary-one-side")
                assert f"on {sides} but not" in found.evidence["matches"]


class CosineOver(_Fused):
    """Cosine attention whose q and k are L2-normalised along ``axis`` of (B, H, L, D): -1 (the head dim) is the
    design; -2 (the tokens) is the bug. Scores by matmul with a learned temperature, or by SDPA with scale 10."""

    def __init__(self, dim: int, axis: int = -1, sdpa: bool = False) -> None:
        super().__init__(dim)
        self.axis, self.sdpa = axis, sdpa
        self.log_tau = nn.Parameter(torch.full((self.heads, 1, 1), math.log(10.0)))

    def forward(self, x):
        q, k, v = self.split(x)
        q, k = F.normalize(q, dim=self.axis), F.normalize(k, dim=self.axis)
        if self.sdpa:
            return self.merge(F.scaled_dot_product_attention(q, k, v, scale=10.0))
        return self.merge(torch.softmax(q @ k.transpose(-1, -2) * self.log_tau.exp(), -1) @ v)


def test_cosine_attention_normalised_over_the_tokens_is_named():
    """catches: q and k normalised along the tokens instead of the head dim passed, the learned temperature
    taken for the scale: every query then depends on the whole sequence, and no probe of a bidirectional
    module sees it from the outside."""
    for sdpa in (False, True):
        assert check(CosineOver(32, -1, sdpa)).verdict == "passed"
        report = check(CosineOver(32, 2, sdpa))
        assert "definition-mismatch" in report.ids, (sdpa, report.ids)
        found = next(f for f in report.findings if f.id == "definition-mismatch")
        assert "along the" in found.message and "tokens" in found.message


class ComplexBuffer(_Fused):
    """Correct: rotary positions from a complex ``freqs_cis`` buffer made once at construction, as Meta's Llama and
    gpt-fast keep them, sliced to the input's length."""

    def __init__(self, dim: int, max_len: int = 64) -> None:
        super().__init__(dim)
        d = dim // self.heads
        angles = torch.outer(torch.arange(max_len).float(), 1 / 10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def _turn(self, t):
        pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * self.freqs_cis[: t.shape[-2]]).flatten(-2).type_as(t)

    def forward(self, x):
        q, k, v = self.split(x)
        return self.merge(F.scaled_dot_product_attention(self._turn(q), self._turn(k), v, is_causal=True))


def test_a_complex_rotary_buffer_survives_the_half_precision_copy():
    """catches: the half-precision copy made with .to(float16), which also casts a complex buffer to a real one
    (dropping its imaginary part): a correct module was accused of half-precision-mismatch."""
    report = check(ComplexBuffer(32))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert set(report.inferred["half precision"]) == {"float16", "bfloat16"}


class KeyMaskInChunks(_Fused):
    """A (B, L) key padding mask, True = may attend, with the keys taken in chunks of 16 whose partial results merge
    by their logsumexp (a memory-saving loop). ``bug``: "first chunk's mask" (every chunk reads the mask of keys
    0..15: right up to 16 tokens), "long path" (a path for 32 tokens and more that drops the mask); "" is correct."""

    def __init__(self, dim: int, bug: str = "") -> None:
        super().__init__(dim)
        self.bug = bug

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        if mask is None or (self.bug == "long path" and x.shape[1] >= 32):
            return self.merge(F.scaled_dot_product_attention(q, k, v))
        outs, lses = [], []
        for start in range(0, k.shape[2], 16):
            stop = min(start + 16, k.shape[2])
            keep = mask[:, :stop - start] if self.bug == "first chunk's mask" else mask[:, start:stop]
            s = (q @ k[:, :, start:stop].transpose(-2, -1)) / math.sqrt(q.shape[-1])
            s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
            lse = torch.logsumexp(s, -1, keepdim=True)
            outs.append(torch.nan_to_num((s - lse).exp()) @ v[:, :, start:stop])
            lses.append(lse)
        total = torch.logsumexp(torch.stack(lses), 0)
        return self.merge(sum(o * (lse - total).exp() for o, lse in zip(outs, lses, strict=True)))


def test_a_key_mask_is_checked_past_the_lengths_where_code_takes_another_path():
    """catches: a mask dropped on a path for 32 tokens and more, and key chunks that all read the first chunk's
    mask, certified: the padding probe ran at the probe length and at 16 tokens only."""
    assert check(KeyMaskInChunks(32)).verdict == "passed"
    for bug in ("first chunk's mask", "long path"):
        report = check(KeyMaskInChunks(32, bug=bug))
        assert "mask-ignored" in report.ids, (bug, [(f.id, f.message) for f in report.findings])


class NormalisedKeys(nn.Module):
    """Correct, q and k each through a learned RMSNorm of their own before the scores (Qwen 3, OLMo 2, ViT-22B).
    ``bug``: the keys go through the queries' norm, and k_norm is never used."""

    def __init__(self, dim: int, heads: int = 4, bug: bool = False) -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.q_norm, self.k_norm = nn.RMSNorm(dim // heads), nn.RMSNorm(dim // heads)
        with torch.no_grad():  # trained norms, not ones
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), (self.q_norm if self.bug else self.k_norm)(k)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, e)


def test_keys_normalised_by_the_queries_norm_are_named():
    """catches: k = self.q_norm(k) certified: a parameter the call never touches was taken for an adapter's unused
    part, and only Linear siblings named for a role were compared."""
    assert check(NormalisedKeys(32)).verdict == "passed"
    report = check(NormalisedKeys(32, bug=True))
    assert "no-grad" in report.ids and "k_norm" in str(report.findings), [(f.id, f.message) for f in report.findings]


class BiasFromAnMLP(_Fused):
    """Correct, Swin v2's continuous position bias: a small ReLU MLP maps a fixed table of relative offsets to one
    bias per head. Some of its hidden units are dead on that table (ReLU below zero for every offset)."""

    def __init__(self, dim: int, length: int = 7) -> None:
        super().__init__(dim)
        offsets = torch.arange(length)[None, :] - torch.arange(length)[:, None]
        self.register_buffer("offsets", torch.stack([offsets, offsets.abs()], -1).float() / length)
        self.mlp = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, self.heads))
        with torch.no_grad():
            self.mlp[0].bias[::5] = -10.0  # every fifth unit never fires on the table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        n = x.shape[1]
        bias = self.mlp(self.offsets[:n, :n]).permute(2, 0, 1)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


def test_dead_units_of_a_bias_mlp_are_not_an_unused_projection():
    """catches: ReLU units of a position-bias MLP that are dead on its fixed table named no-grad ("part of a
    projection never reaches the output"): unused outputs of a projection come in blocks, dead units one by one."""
    report = check(BiasFromAnMLP(32), length=7)
    assert "no-grad" not in report.ids, [(f.id, f.message) for f in report.findings]


class BiasAccumulatedInPlace(_Fused):
    """A learned-looking relative bias kept in a buffer, with the scores added into a view of it in place: the buffer
    carries the call's autograd history (and drifts) from one call to the next."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.register_buffer("rel", torch.zeros(self.heads, 64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        n = x.shape[1]
        s = self.rel[:, :n, :n]
        s += ((q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])).mean(0)
        return self.merge(s.softmax(-1) @ v)


def test_a_module_that_keeps_autograd_history_in_its_state_is_named_not_a_doctor_error():
    """catches: "backward through the graph a second time" from a module's own buffer filed as the doctor's error
    (doctor_errors == ["gradients"]) instead of as the module's state-dependent failure."""
    report = check(BiasAccumulatedInPlace(32))
    assert not report.doctor_errors, report.not_verified
    assert "state-dependent" in report.ids or "dropout-in-eval" in report.ids, [f.id for f in report.findings]


class LearnedMemoryTokens(nn.Module):
    """Correct, a published design (Perceiver's latents, memory tokens): learned vectors put before the tokens and
    projected with them into keys and values, so each query sees L + M keys. ``scale``: the scores' scale."""

    def __init__(self, dim: int, heads: int = 4, memory: int = 3, scale: float | None = None) -> None:
        super().__init__()
        self.heads, self.scale = heads, scale if scale is not None else (dim // heads) ** -0.5
        self.memory = nn.Parameter(torch.randn(memory, dim))
        self.to_q, self.to_kv, self.out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        context = torch.cat([self.memory.expand(b, -1, -1), x], 1)  # (B, M + L, E)
        q = self.to_q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, -1, self.heads, e // self.heads).transpose(1, 2) for t in self.to_kv(context).chunk(2, -1))
        w = (q @ k.transpose(-2, -1) * self.scale).softmax(-1)
        return self.out((w @ v).transpose(1, 2).reshape(b, n, e))


class QueriesAsKeys(nn.Module):
    """Correct, a published design (Reformer's shared-QK attention): one projection gives the queries and the keys;
    there is no key projection, and the one there is is named for the queries. ``scaled``: False drops 1/sqrt(D)."""

    def __init__(self, dim: int, heads: int = 4, scaled: bool = True) -> None:
        super().__init__()
        self.heads, self.scaled = heads, scaled
        self.to_q, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.to_q, self.to_v))
        s = q @ q.transpose(-2, -1)
        w = (s / math.sqrt(q.shape[-1]) if self.scaled else s).softmax(-1)
        return (w @ v).transpose(1, 2).reshape(b, n, e)


def test_memory_tokens_and_shared_query_keys_are_designs():
    """catches: learned memory tokens projected with the input into keys and values named definition-mismatch
    ("weights over axes that are not the tokens"), and Reformer's shared-QK ("projections used in the wrong roles"):
    published designs read as bugs, while a wrong scale in either is still named."""
    for module in (LearnedMemoryTokens(32), QueriesAsKeys(32)):
        report = check(module)
        assert report.verdict == "passed", (type(module).__name__, [(f.id, f.message) for f in report.findings])
    assert "wrong-scale" in check(LearnedMemoryTokens(32, scale=32 ** -0.5)).ids
    assert {"missing-scale", "wrong-scale", "definition-mismatch"} & set(check(QueriesAsKeys(32, scaled=False)).ids)


class DilatedWindows(_Fused):
    """Correct, attention within 4 dilated windows (token t in window t % 4, as LongNet's dilated or MaxViT's grid
    attention): the tokens are regrouped, attended per window and put back. ``bug``: put back without the
    transpose, so that outputs land at other tokens' positions."""

    def __init__(self, dim: int, bug: bool = False) -> None:
        super().__init__(dim)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        groups = 4
        windows = x.view(b, n // groups, groups, e).transpose(1, 2).reshape(b * groups, n // groups, e)
        q, k, v = self.split(windows)
        o = self.merge(F.scaled_dot_product_attention(q, k, v)).view(b, groups, n // groups, e)
        return o.reshape(b, n, e) if self.bug else o.transpose(1, 2).reshape(b, n, e)


def test_outputs_put_back_at_other_positions_are_not_a_causal_leak():
    """catches: windows put back without their permute named causal-leak on a module that is not causal ("queries
    see some future keys and not others"): outputs that do not depend on their own token are misplaced outputs."""
    assert check(DilatedWindows(32), length=8).verdict == "passed"
    report = check(DilatedWindows(32, bug=True), length=8)
    assert "definition-mismatch" in report.ids and "causal-leak" not in report.ids, \
        [(f.id, f.message) for f in report.findings]


class SequenceFirstCausal(SequenceFirstEinsum):
    """Sequence-first causal attention with its own mask, as Transformer-XL builds it: ``triu(ones, diagonal)``,
    True = masked, filled with -inf. ``diagonal=1`` is right; ``diagonal=0`` also hides each query's own token, so
    the first query sees no key and its row is NaN."""

    def __init__(self, dim: int, diagonal: int = 1) -> None:
        super().__init__(dim)
        self.diagonal = diagonal

    def forward(self, x):
        n, b, e = x.shape
        q, k, v = self.qkv(x).reshape(n, b, 3, self.heads, e // self.heads).unbind(2)
        s = torch.einsum("ibnd,jbnd->ijbn", q, k).mul(q.shape[-1] ** -0.5)
        hidden = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=self.diagonal)[:, :, None, None]
        p = s.masked_fill(hidden, float("-inf")).softmax(dim=1)
        return self.out(torch.einsum("ijbn,jbnd->ibnd", p, v).reshape(n, b, e))


def test_a_causal_mask_that_hides_the_diagonal_is_named_in_a_sequence_first_module():
    """catches: a sequence-first causal module whose mask hides the diagonal named softmax-dim (and batch-mixing):
    the NaN of its first row made the layout test see a change where nothing changed, so the module was probed as
    batch-first and its causal-leak was absorbed."""
    assert check(SequenceFirstCausal(32), causal=True).verdict == "passed"
    report = check(SequenceFirstCausal(32, diagonal=0), causal=True)
    assert "causal-leak" in report.ids and not {"softmax-dim", "batch-mixing"} & set(report.ids), \
        [(f.id, f.message) for f in report.findings]


class PaddingByLengths(_Fused):
    """Padding given as each item's length (B,), as speech toolkits take it (ESPnet's ilens, WeNet's lengths); the
    key mask is built inside. ``off_by_one``: ``arange > lengths`` leaves the first padded key visible."""

    def __init__(self, dim: int, off_by_one: bool = False) -> None:
        super().__init__(dim)
        self.off_by_one = off_by_one

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        if lengths is None:
            return self.merge(F.scaled_dot_product_attention(q, k, v))
        at = torch.arange(x.shape[1])[None, :]
        pad = at > lengths[:, None] if self.off_by_one else at >= lengths[:, None]
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :]))


def _lengths_call(m: nn.Module, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    return m(x) if keep is None else m(x, lengths=keep.sum(-1))


def test_padding_given_as_lengths_is_not_certified_unseen():
    """catches: a module that takes its padding as lengths (B,) certified with its mask "not applicable" although
    an off-by-one there hides nothing it should: the doctor sends lengths to an argument named like them."""
    assert check(PaddingByLengths(32)).verdict == "passed"  # lengths are sent as lengths
    assert "mask-ignored" in check(PaddingByLengths(32, off_by_one=True)).ids
    assert check(PaddingByLengths(32), call=_lengths_call, mask="keep (B,L)").verdict == "passed"
    assert "mask-ignored" in check(PaddingByLengths(32, off_by_one=True), call=_lengths_call, mask="keep (B,L)").ids


class AddmmProjection(nn.Module):
    """GPT-2's Conv1D as its code base writes it: the weight kept (in, out) and applied with addmm."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.nf)


AddmmProjection.__name__ = AddmmProjection.__qualname__ = "Conv1D"  # the name GPT-2 code gives it


class FusedConv1DAttention(nn.Module):
    """Causal attention with a fused c_attn Conv1D, as GPT-2 writes it. ``values_as_keys``: the key slice of c_attn
    is dropped and the values are used as keys (its key columns never reach the output)."""

    def __init__(self, dim: int, heads: int = 4, values_as_keys: bool = False) -> None:
        super().__init__()
        self.heads, self.values_as_keys = heads, values_as_keys
        self.c_attn, self.c_proj = AddmmProjection(3 * dim, dim), AddmmProjection(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.c_attn(x).split(e, dim=2))
        k = v if self.values_as_keys else k
        return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, e))


def test_unused_columns_of_a_gpt2_conv1d_are_named():
    """catches: values used as keys in a fused GPT-2 Conv1D certified: its weight is (in, out), so the unused key
    features are columns, and only nn.Linear rows were read."""
    assert check(FusedConv1DAttention(32), causal=True, embed_dim=32).verdict == "passed"
    assert "no-grad" in check(FusedConv1DAttention(32, values_as_keys=True), causal=True, embed_dim=32).ids


class HeadsAsTokens(_Fused):
    """SDPA given (B, L, H, D) instead of (B, H, L, D): each token attends over its own heads. ``right``: the
    transpose that makes it attention over the tokens."""

    def __init__(self, dim: int, right: bool = False) -> None:
        super().__init__(dim)
        self.right = right

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1) for t in self.qkv(x).chunk(3, -1))
        if self.right:
            return self.merge(F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
        return F.scaled_dot_product_attention(q, k, v).reshape(b, n, e)


class GlobalKeys(_Fused):
    """Correct, a published design (BigBird's ITC, Longformer): blocks of 2 tokens that see their own and the
    neighbouring blocks, and the first block's keys seen by every query."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        block = torch.arange(x.shape[1]) // 2
        keep = ((block[:, None] - block[None, :]).abs() <= 1) | (block[None, :] == 0)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_attention_over_the_heads_and_global_keys_get_their_own_names():
    """catches: SDPA over the heads (each token sees only itself) named causal-leak on a module no one called causal,
    and a local pattern with global keys (BigBird) read as a causal leak."""
    assert check(HeadsAsTokens(32, right=True)).verdict == "passed"
    report = check(HeadsAsTokens(32))
    assert "definition-mismatch" in report.ids and "causal-leak" not in report.ids, report.ids
    report = check(GlobalKeys(32))
    assert report.verdict == "passed" and "global tokens" in str(report.inferred), \
        [(f.id, f.message) for f in report.findings]


class AxialGrid(nn.Module):
    """Correct, one axial layer on a 4 x 4 grid of tokens (Ho et al. 2019, lucidrains' axial-attention): attention
    along each column, added to the input. ``bug``: the columns' output put back without its permute."""

    def __init__(self, dim: int, bug: bool = False) -> None:
        super().__init__()
        self.cols, self.bug = _Fused(dim), bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        side = math.isqrt(n)
        columns = x.view(b, side, side, e).transpose(1, 2).reshape(b * side, side, e)  # (B * col, row, E)
        q, k, v = self.cols.split(columns)
        out = self.cols.merge(F.scaled_dot_product_attention(q, k, v)).view(b, side, side, e)
        return x + (out.reshape(b, n, e) if self.bug else out.transpose(1, 2).reshape(b, n, e))


def test_axial_outputs_put_back_without_their_permute_are_not_a_causal_leak():
    """catches: an axial layer whose output is put back without its permute named causal-leak ("queries see some
    future keys and not others"): each output still sees its own token (the residual), but some past keys are
    hidden too, which no causal mask does."""
    assert check(AxialGrid(32), length=16).verdict == "passed"
    report = check(AxialGrid(32, bug=True), length=16)
    assert "definition-mismatch" in report.ids and "causal-leak" not in report.ids, \
        [(f.id, f.message) for f in report.findings]


class DocumentIds(_Fused):
    """Correct, packed documents given as ids (B, L), as xformers' block-diagonal masks and flash-attn's varlen
    calls are built from: a token sees the tokens of its own document. Padding is document -1."""

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        if doc_ids is None:
            return self.merge(F.scaled_dot_product_attention(q, k, v))
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=same[:, None]))


def _documents_call(m: nn.Module, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    return m(x) if keep is None else m(x, torch.where(keep, 0, -1))


def test_document_ids_are_not_read_as_a_mask_that_leaks():
    """catches: document ids (an argument not named like a mask) sent the doctor's bool masks, which a document
    mask reads as two documents, and then named mask-ignored on a correct module: an input that reads no mask as a
    mask does is not verified, and with a call that gives it ids it is checked."""
    report = check(DocumentIds(32))
    assert report.verdict == "inconclusive" and "doc_ids" in report.coverage["mask"], report.coverage
    assert check(DocumentIds(32), call=_documents_call, mask="keep (B,L)").verdict == "passed"


class KeyMaskReadAcrossItems(_Fused):
    """A (B, L) key padding mask read through a transpose and a reshape (as code ported from a sequence-first
    (L, B) layout does): each item gets a mix of the items' padding, a superset of its own here (the probe's
    padding grows with the item), so no padded key is left visible while real keys are hidden."""

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if key_padding_mask is not None:
            b, n = key_padding_mask.shape
            pad = key_padding_mask.t().reshape(b, n)
            s = s.masked_fill(pad[:, None, None, :], float("-inf"))
        return self.merge(s.softmax(-1) @ v)


def test_a_key_mask_read_across_items_is_not_a_causal_leak():
    """catches: keys hidden beyond a padding mask, differently in each item, named causal-leak on a module that has
    no causal mask: the surplus follows the mask, so the mask is misread (mask-ignored)."""
    report = check(KeyMaskReadAcrossItems(32))
    assert "mask-ignored" in report.ids and "causal-leak" not in report.ids, report.ids


class PartialRotary(_Fused):
    """Rotary positions on the first quarter of each head's dims, the rest passed through (GPT-NeoX's rotary_pct,
    Phi's partial_rotary_factor). ``bug``: "order" puts k's rotated part after its pass-through part (q's first),
    "base" rotates k with another base than q; both leave each side a proper rotation, so only the scores show it."""

    def __init__(self, dim: int, bug: str = "") -> None:
        super().__init__(dim)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        r = q.shape[-1] // 4
        n = x.shape[1]
        angle = torch.arange(n, dtype=x.dtype)[:, None] * 10000.0 ** (-torch.arange(0, r, 2, dtype=x.dtype) / r)
        k_angle = angle * 0.5 if self.bug == "base" else angle
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        k_cos, k_sin = torch.cat([k_angle.cos()] * 2, -1), torch.cat([k_angle.sin()] * 2, -1)

        def turn(t: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return t * c + torch.cat([-t[..., r // 2:], t[..., :r // 2]], -1) * s

        q = torch.cat([turn(q[..., :r], cos, sin), q[..., r:]], -1)
        k_rot, k_pass = turn(k[..., :r], k_cos, k_sin), k[..., r:]
        k = torch.cat([k_pass, k_rot] if self.bug == "order" else [k_rot, k_pass], -1)
        return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_q_and_k_rotated_differently_are_named():
    """catches: rotary positions whose rotated and pass-through parts are concatenated in other orders for q and
    k (or k rotated with other frequencies) certified, because each side on its own is a rotation: with one token
    at every position the scores must depend on the distance between tokens only."""
    assert check(PartialRotary(64), causal=True).verdict == "passed"
    for bug in ("order", "base"):
        report = check(PartialRotary(64, bug), causal=True)
        assert "rotary-mismatch" in report.ids, (bug, report.ids)


class SelfMaskedSharedQK(nn.Module):
    """Correct, shared-QK attention (Reformer's full attention): the keys are the L2-normalised queries, and since a
    query is nearest to itself, its own score is overwritten in place by -5e4 (finite, apart from the mask's fill),
    so a token attends to itself only when nothing else is visible. ``like_the_mask``: the diagonal hidden by the
    padding mask's own fill instead, as locality self-attention hides it. ``causal``: a causal mask too (the
    decoder's form).
    ``below``: the self score written on the diagonal below it, (i, i - 1), a bug."""

    def __init__(self, dim: int, heads: int = 4, like_the_mask: bool = False, causal: bool = False,
                 below: bool = False) -> None:
        super().__init__()
        self.heads, self.like_the_mask, self.causal, self.below = heads, like_the_mask, causal, below
        self.to_qk = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, input_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(b, n, self.heads, -1).transpose(1, 2).reshape(b * self.heads, n, -1)

        qk, v = heads(self.to_qk(x)), heads(self.to_v(x))
        dots = torch.einsum("bie,bje->bij", qk, F.normalize(qk, dim=-1)) * qk.shape[-1] ** -0.5
        at = torch.arange(n)
        fill = -torch.finfo(dots.dtype).max
        if self.below:
            dots[:, at[1:], at[:-1]] = -5e4
        else:
            dots[:, at, at] = fill if self.like_the_mask else -5e4
        if input_mask is not None:
            dots.masked_fill_(~input_mask.repeat_interleave(self.heads, 0)[:, None, :], fill)
        if self.causal:
            dots.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), fill)
        out = torch.einsum("bij,bje->bie", dots.softmax(-1), v)
        return out.reshape(b, self.heads, n, -1).transpose(1, 2).reshape(b, n, e)


def test_a_self_mask_written_in_place_is_a_design():
    """catches: the scores' diagonal set in place (dots[:, i, i] = -5e4) stopped the white box ("the scores pass
    through setitem()", definition-mismatch), and once read, the hidden diagonal was a causal-leak: a finite value of
    its own is Reformer's self mask, a design; the diagonal hidden like the mask is locality self-attention's (LSA:
    tsai's and vit-pytorch's hide it with the mask's fill), a design too."""
    report = check(SelfMaskedSharedQK(32))
    assert report.verdict == "passed" and "self mask" in report.inferred["design"], report.ids
    report = check(SelfMaskedSharedQK(32, like_the_mask=True))
    assert report.verdict == "passed" and "self mask" in report.inferred["design"], report.ids


def test_a_causal_self_mask_is_a_design_and_one_below_the_diagonal_is_not():
    """catches: with a causal mask, query 1 puts weight 1 on key 0 whatever its own token (its own key is hidden by
    the self mask), which the causal probe read as a mask hiding past keys (causal-leak on Reformer's causal form);
    and a self score written one below the diagonal (every later key seen, one earlier one missed) was certified."""
    report = check(SelfMaskedSharedQK(32, causal=True), causal=True)
    assert report.verdict == "passed" and "self mask" in report.inferred["design"], report.ids
    assert "causal-leak" in check(SelfMaskedSharedQK(32, causal=True, like_the_mask=True), causal=True).ids
    assert "causal-leak" in check(SelfMaskedSharedQK(32, causal=True, below=True), causal=True).ids
    assert "definition-mismatch" in check(SelfMaskedSharedQK(32, below=True)).ids


class DecomposedGridPositions(nn.Module):
    """Correct, decomposed relative positions on a grid (ViTDet's and SAM's image encoders): the scores of the
    (B * heads, L, L) product get q . R_h[row_q - row_k] broadcast over the key columns and q . R_w[col_q - col_k]
    broadcast over the key rows. Input (B, side, side, E). ``merge_early``: heads merged with a reshape before
    moving them back, the bug."""

    def __init__(self, dim: int, heads: int = 4, side: int = 4, merge_early: bool = False) -> None:
        super().__init__()
        self.heads, self.merge_early = heads, merge_early
        self.qkv = nn.Linear(dim, 3 * dim)
        self.table_h = nn.Parameter(torch.randn(2 * side - 1, dim // heads) * 0.5)
        self.table_w = nn.Parameter(torch.randn(2 * side - 1, dim // heads) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, hs, ws, e = x.shape
        q, k, v = self.qkv(x).reshape(b, hs * ws, 3, self.heads, -1).permute(2, 0, 3, 1, 4) \
            .reshape(3, b * self.heads, hs * ws, -1).unbind(0)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        rows, cols = torch.arange(hs), torch.arange(ws)
        near_h = self.table_h[rows[:, None] - rows[None, :] + hs - 1]  # (hs, hs, D)
        near_w = self.table_w[cols[:, None] - cols[None, :] + ws - 1]
        grid_q = q.reshape(-1, hs, ws, q.shape[-1])
        term_h = torch.einsum("nyxd,ykd->nyxk", grid_q, near_h)
        term_w = torch.einsum("nyxd,xkd->nyxk", grid_q, near_w)
        scores = (scores.view(-1, hs, ws, hs, ws) + term_h[..., None] + term_w[..., None, :]).view(-1, hs * ws,
                                                                                                 hs * ws)
        o = scores.softmax(-1) @ v
        if self.merge_early:
            return o.reshape(b, hs, ws, e)
        return o.view(b, self.heads, hs, ws, -1).permute(0, 2, 3, 1, 4).reshape(b, hs, ws, e)


def test_decomposed_grid_positions_broadcast_onto_the_scores_are_a_design():
    """catches: position terms added to the scores broadcast over one key axis of a grid view (ViTDet, SAM) read as
    no formula (definition-mismatch) on a correct module, which also hid its head-merge bug behind that name."""
    assert check(DecomposedGridPositions(32)).verdict == "passed"
    assert "head-merge" in check(DecomposedGridPositions(32, merge_early=True)).ids


class SplitWithoutTranspose(nn.Module):
    """Three projections split into heads; ``bug``: "q" views q as (B, H, L, D) straight from (B, L, E) (the classic
    split without its transpose), "v" does that to v only; "merge" puts the heads back with transpose(2, 3)."""

    def __init__(self, dim: int, heads: int = 4, bug: str = "") -> None:
        super().__init__()
        self.heads, self.bug = heads, bug
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape

        def split(t: torch.Tensor, wrong: bool) -> torch.Tensor:
            return t.view(b, self.heads, n, -1) if wrong else t.view(b, n, self.heads, -1).transpose(1, 2)

        q = split(self.q(x), self.bug == "q")
        k = split(self.k(x), False)
        v = split(self.v(x), self.bug == "v")
        o = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v
        o = o.transpose(2, 3) if self.bug == "merge" else o.transpose(1, 2)
        return self.out(o.reshape(b, n, e))


class FlattenedMap(nn.Module):
    """Single-head attention over a (B, C, H, W) map with 1x1 convolutions after a GroupNorm (the diffusion
    autoencoders' attention block); ``bug``: "in" flattens q with reshape(B, H*W, C) instead of reshape(B, C, H*W)
    and a permute, "out" puts the (B, H*W, C) result back with a view to (B, C, H, W), no permute."""

    def __init__(self, channels: int, bug: str = "") -> None:
        super().__init__()
        self.bug = bug
        self.norm = nn.GroupNorm(8, channels)
        self.q, self.k, self.v = (nn.Conv2d(channels, channels, 1) for _ in range(3))
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, hs, ws = x.shape
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        q = q.reshape(b, hs * ws, c) if self.bug == "in" else q.reshape(b, c, hs * ws).permute(0, 2, 1)
        k, v = k.reshape(b, c, hs * ws), v.reshape(b, c, hs * ws).permute(0, 2, 1)
        o = torch.softmax(torch.bmm(q, k) / math.sqrt(c), dim=-1) @ v  # (B, H*W, C)
        o = o.view(b, c, hs, ws) if self.bug == "out" else o.permute(0, 2, 1).reshape(b, c, hs, ws)
        return x + self.proj(o)


def test_rows_that_mix_tokens_on_the_way_in_or_out_are_named():
    """catches: heads split with view(B, H, L, D), a (B, C, H, W) map flattened without its permute, and heads or
    a map put back across tokens, certified with only not-equivariant because the products themselves have the
    right scale, softmax axis and order: swapping two tokens must move two rows of q, k and v, and each row read
    after the values product must hold one token's features."""
    assert check(SplitWithoutTranspose(32)).verdict == "passed"
    assert check(FlattenedMap(32)).verdict == "passed"
    for module, kind in ((SplitWithoutTranspose(32, bug="q"), "head-split"),
                         (SplitWithoutTranspose(32, bug="v"), "head-split"), (FlattenedMap(32, "in"), "head-split"),
                         (SplitWithoutTranspose(32, bug="merge"), "head-merge"),
                         (FlattenedMap(32, "out"), "head-merge")):
        report = check(module)
        assert kind in report.ids and report.verdict == "failed", (type(module).__name__, module.bug, report.ids)


class QueryAxisPaddingMask(_Fused):
    """A torch-style ``key_padding_mask`` (True = padding) given to SDPA as ``~mask[:, None, :, None]``: on the query
    axis, so padded keys stay visible (the bug; ``[:, None, None, :]`` is right)."""

    def __init__(self, dim: int, on_queries: bool = True) -> None:
        super().__init__(dim)
        self.on_queries = on_queries

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        if key_padding_mask is None:
            return self.merge(F.scaled_dot_product_attention(q, k, v))
        keep = ~key_padding_mask[:, None, :, None] if self.on_queries else ~key_padding_mask[:, None, None, :]
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_a_padding_mask_on_the_query_axis_is_a_broadcast_in_either_polarity():
    """catches: a True = padding key mask put on the query axis named mask-ignored (its polarity guessed as keep,
    which matched nothing): the rows it changes are the kept ones, read as True = padding they are the queries."""
    assert check(QueryAxisPaddingMask(32, on_queries=False)).verdict == "passed"
    report = check(QueryAxisPaddingMask(32))
    assert "mask-broadcast" in report.ids and "mask-ignored" not in report.ids, report.ids


class ConfigDropoutAlwaysOn(nn.Module):
    """nanoGPT's flash path with ``dropout_p=self.dropout`` passed in eval mode too (the bug), built from a config
    dataclass whose dropout defaults to 0.1."""

    def __init__(self, config: DropoutConfig) -> None:
        super().__init__()
        self.heads, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.c_attn(x).split(e, dim=2))
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return o.transpose(1, 2).reshape(b, n, e)


class DropoutConfig:
    def __init__(self, n_embd: int = 64, n_head: int = 4, dropout: float = 0.1) -> None:
        self.n_embd, self.n_head, self.dropout = n_embd, n_head, dropout


def test_a_config_dropout_is_kept_so_a_dropout_left_on_in_eval_is_seen():
    """catches: the doctor zeroing a config's dropout (its default 0.1) when it built the module, which made the
    classic dropout_p=self.dropout in eval mode unreachable: a dropout field with a default keeps it."""
    report = check(ConfigDropoutAlwaysOn, causal=True)
    assert "dropout-in-eval" in report.ids, report.ids


def _masked_softmax(scores: torch.Tensor, valid_lens: torch.Tensor, fill: float = -1e6) -> torch.Tensor:
    """Softmax over the keys, each row's keys from its valid length on set to ``fill`` (d2l.ai's masked_softmax:
    lengths (B,) for every query of an item or (B, L) per query; the assignment turns -1e6 into -inf in float16,
    where masked_fill would raise)."""
    shape = scores.shape
    lens = valid_lens.repeat_interleave(shape[1]) if valid_lens.dim() == 1 else valid_lens.reshape(-1)
    rows = scores.reshape(-1, shape[-1]).clone()
    rows[torch.arange(shape[-1], device=scores.device)[None, :] >= lens[:, None]] = fill
    scores = rows.reshape(shape)
    return torch.softmax(scores, dim=-1)


class ValidLengths(nn.Module):
    """Correct, padding given as each item's valid length, required (d2l.ai's MultiHeadAttention): heads folded
    into the batch, the lengths repeated per head with repeat_interleave. ``tiled``: with repeat, so head rows of
    item b read item (b mod B)'s length (the bug); ``fill``: what the hidden scores are set to (0, the bug: they
    stay in the softmax)."""

    def __init__(self, num_hiddens: int, num_heads: int, tiled: bool = False, lazy: bool = False,
                 fill: float = -1e6) -> None:
        super().__init__()
        self.num_heads, self.tiled, self.fill = num_heads, tiled, fill
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.LazyLinear(num_hiddens, bias=False) if lazy else  # as d2l.ai
                                                  nn.Linear(num_hiddens, num_hiddens, bias=False) for _ in range(4))

    def fold(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, -1).permute(0, 2, 1, 3).reshape(b * self.num_heads, n, -1)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                valid_lens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.fold(self.W_q(queries)), self.fold(self.W_k(keys)), self.fold(self.W_v(values))
        lens = valid_lens.repeat(self.num_heads) if self.tiled else valid_lens.repeat_interleave(self.num_heads, 0)
        o = torch.bmm(_masked_softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1]), lens, self.fill), v)
        b = queries.shape[0]
        return self.W_o(o.reshape(b, self.num_heads, o.shape[1], -1).permute(0, 2, 1, 3).reshape(b, o.shape[1], -1))


def test_padding_given_as_required_lengths_is_sent_as_lengths():
    """catches: a forward that requires valid lengths (B,) (d2l.ai's MultiHeadAttention, the most read teaching
    code) could not run at all (its width named num_hiddens, its lengths not a mask the doctor sends, its
    nn.LazyLinear read as a width of 0). Its one finding is its -1e6 fill, which float16 turns into -inf: an empty
    row is finite in float32, NaN in float16."""
    report = check(ValidLengths)
    assert report.ids == {"half-precision-overflow"}, [(f.id, f.message) for f in report.findings]
    assert report.inferred["mask"]["kind"] == "lengths" and report.coverage["padding"] == "verified"
    assert "mask-ignored" in check(ValidLengths, init={"num_hiddens": 64, "num_heads": 4, "tiled": True}).ids
    lazy = check(ValidLengths, init={"num_hiddens": 64, "num_heads": 4, "lazy": True})  # E from no Linear's size
    assert lazy.ids == {"half-precision-overflow"} and lazy.inferred["embed_dim"] == 64, lazy.ids


def test_hidden_scores_set_to_zero_under_required_lengths_are_mask_ignored():
    """catches: with the hidden scores set to 0 (still in the softmax), no lengths hid a key, so the doctor went on
    to a sequence-first layout whose mask "matched" on no row at all (each query saw only its own key there): the
    module was batch-mixing. A match needs a row that sees a kept and a hidden key; the lengths stay, and the
    padded keys that still reach the outputs are named."""
    report = check(ValidLengths, init={"num_hiddens": 64, "num_heads": 4, "fill": 0.0})
    assert "mask-ignored" in report.ids and "batch-mixing" not in report.ids, report.ids
    assert report.inferred["mask"]["kind"] == "lengths"


class ColumnsThenRows(nn.Module):
    """Correct, two-step axial attention on a 4 x 4 grid of tokens: each column, then each row (CCNet's and axial
    transformers' factorised attention); together the steps reach every token, each alone a few."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.cols, self.rows = _Fused(dim, heads), _Fused(dim, heads)

    @staticmethod
    def _attend(block: _Fused, t: torch.Tensor) -> torch.Tensor:
        q, k, v = block.split(t)
        return block.merge(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        side = math.isqrt(n)
        grid = x.view(b, side, side, e)
        cols = self._attend(self.cols, grid.transpose(1, 2).reshape(b * side, side, e))
        grid = cols.view(b, side, side, e).transpose(1, 2)
        rows = self._attend(self.rows, grid.reshape(b * side, side, e))
        return rows.view(b, n, e)


def test_two_axial_steps_are_read_as_windows():
    """catches: a correct two-step axial block named definition-mismatch ("the attention runs over an axis of 4,
    not the 16 tokens"): after both steps every token depends on every other, so the steps were not read as local;
    several cores over parts of the tokens are windows, and a split that mixes tokens is head-split's to name."""
    report = check(ColumnsThenRows(32), length=16)
    assert report.verdict == "passed" and report.coverage["white_box"] == "verified", report.ids


class PairedRotaryTables(_Fused):
    """Rotary positions on interleaved pairs (x0, x1), (x2, x3), ... ``tables``: "interleaved" lays each
    frequency's cos/sin out for its pair (repeat_interleave), correct; "halves" lays them out as two halves
    (repeat), as rotate-half code does, so the two entries of a pair turn by different angles: no rotation (the bug
    V-JEPA 2's video rotary shipped with)."""

    def __init__(self, dim: int, tables: str = "interleaved") -> None:
        super().__init__(dim)
        self.tables = tables

    def turn(self, t: torch.Tensor) -> torch.Tensor:
        n, d = t.shape[-2], t.shape[-1]
        angle = torch.arange(n, dtype=t.dtype)[:, None] / 10000.0 ** (torch.arange(d // 2, dtype=t.dtype) / (d // 2))
        spread = (lambda a: a.repeat_interleave(2, -1)) if self.tables == "interleaved" else (lambda a: a.repeat(1, 2))
        pairs = t.unflatten(-1, (-1, 2))
        swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
        return t * spread(angle.cos()) + swapped * spread(angle.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        return self.merge(F.scaled_dot_product_attention(self.turn(q), self.turn(k), v))


def test_a_rotary_whose_tables_do_not_pair_with_its_rotation_is_named():
    """catches: cos/sin tables laid out for rotate-half on an interleaved-pairs rotation certified as rotary
    positions: the map is no rotation, so each token's score with itself changes with its position."""
    assert check(PairedRotaryTables(32)).verdict == "passed"
    assert "rotary-mismatch" in check(PairedRotaryTables(32, "halves")).ids


class PerHeadOutput(nn.Module):
    """Correct, Mesh-TensorFlow / T5X style: projections are (E, H, D) einsums and the output projection contracts
    the heads and their dims directly ("bhnd,hde->bne"), so the heads are never merged into one tensor."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        d = dim // heads
        self.w_q, self.w_k, self.w_v = (nn.Parameter(torch.randn(dim, heads, d) / math.sqrt(dim)) for _ in range(3))
        self.w_o = nn.Parameter(torch.randn(heads, d, dim) / math.sqrt(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (torch.einsum("bne,ehd->bhnd", x, w) for w in (self.w_q, self.w_k, self.w_v))
        weights = torch.einsum("bhid,bhjd->bhij", q, k).div(math.sqrt(q.shape[-1])).softmax(-1)
        return torch.einsum("bhnd,hde->bne", torch.einsum("bhij,bhjd->bhid", weights, v), self.w_o)


def test_heads_contracted_by_the_output_projection_are_not_a_merge():
    """catches: an output projection that contracts the heads and their dims of the (B, H, L, D) result as it is
    named head-merge: its input was compared flat with a reshape that has the same memory."""
    assert check(PerHeadOutput(64)).verdict == "passed"


class CausalChunks(_Fused):
    """Correct, chunked attention (Llama 4's local layers): tokens attend causally within chunks of 4, the last
    chunk padded; ``open_chunks``: each chunk sees its own future too (the bug, for a decoder)."""

    def __init__(self, dim: int, open_chunks: bool = False) -> None:
        super().__init__(dim)
        self.open_chunks = open_chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        pad = -n % 4
        q, k, v = self.split(F.pad(x, (0, 0, 0, pad)))  # (B, H, L + pad, D)

        def chunks(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(2, (-1, 4))  # (B, H, chunks, 4, D)

        o = F.scaled_dot_product_attention(chunks(q), chunks(k), chunks(v), is_causal=not self.open_chunks)
        return self.merge(o.flatten(2, 3))[:, :n]


def test_causal_chunks_are_a_design():
    """catches: chunked causal attention (past chunks hidden on purpose) named causal-leak ("hides past keys in no
    window"), and its padded last chunk read as a head split that mixes tokens."""
    for length in (7, 8):
        report = check(CausalChunks(32), causal=True, length=length)
        assert report.verdict == "passed" and "chunks" in report.inferred["window"], (length, report.ids)
    assert "causal-leak" in check(CausalChunks(32, open_chunks=True), causal=True, length=8).ids


class TokensBeforeHeadsRotary(nn.Module):
    """Rotary positions applied in the (B, L, H, D) layout before the heads move forward (GPT-J's and Mesh
    Transformer JAX's order), interleaved pairs on the first half of each head; ``k_base``: k rotated with another
    base than q (the bug)."""

    def __init__(self, dim: int, heads: int = 4, k_base: float = 10000.0) -> None:
        super().__init__()
        self.heads, self.k_base = heads, k_base
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))

    @staticmethod
    def turn(t: torch.Tensor, base: float) -> torch.Tensor:  # t: (B, L, H, D)
        r = t.shape[-1] // 2
        angle = torch.arange(t.shape[1], dtype=t.dtype)[:, None] / base ** (torch.arange(0, r, 2, dtype=t.dtype) / r)
        cos, sin = (f(angle).repeat_interleave(2, -1)[None, :, None, :] for f in (torch.cos, torch.sin))
        part = t[..., :r]
        swapped = torch.stack((-part[..., 1::2], part[..., ::2]), -1).flatten(-2)
        return torch.cat((part * cos + swapped * sin, t[..., r:]), -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.turn(q, 10000.0), self.turn(k, self.k_base)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2).reshape(b, n, e)


def test_rotary_applied_with_tokens_before_heads_is_found_and_checked():
    """catches: rotary positions applied on (B, L, H, D) not found (the positions were looked for on the axis
    before the head dim only), so q and k rotated with different bases were certified."""
    report = check(TokensBeforeHeadsRotary(32), causal=True)
    assert report.verdict == "passed" and "rotary" in report.inferred["design"]["positions"], report.inferred
    assert "rotary-mismatch" in check(TokensBeforeHeadsRotary(32, k_base=1000.0), causal=True).ids


class CrossStripes(nn.Module):
    """Correct, CSWin-style cross-shaped windows on a 4 x 4 grid: half the channels attend within stripes of width
    one along the rows, half along the columns (each stripe's layout has an axis of one position)."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads // 2
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def stripes(self, t: torch.Tensor, tall: bool) -> torch.Tensor:  # (B, L, C) -> (B * stripes, H, side, D)
        b, n, c = t.shape
        side = math.isqrt(n)
        grid = t.transpose(-2, -1).contiguous().view(b, c, side, side)
        sh, sw = (side, 1) if tall else (1, side)
        w = grid.view(b, c, side // sh, sh, side // sw, sw).permute(0, 2, 4, 3, 5, 1).contiguous()
        w = w.reshape(-1, sh * sw, c)
        return w.reshape(-1, sh * sw, self.heads, c // self.heads).permute(0, 2, 1, 3).contiguous()

    def back(self, o: torch.Tensor, tall: bool, b: int, n: int) -> torch.Tensor:
        side = math.isqrt(n)
        sh, sw = (side, 1) if tall else (1, side)
        o = o.transpose(1, 2).reshape(b, side // sh, side // sw, sh, sw, -1)
        return o.permute(0, 1, 3, 2, 4, 5).reshape(b, n, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, c).permute(2, 0, 1, 3)
        outs = []
        for tall, part in ((True, slice(0, c // 2)), (False, slice(c // 2, c))):
            q, k, v = (self.stripes(t[..., part], tall) for t in qkv)
            w = ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
            outs.append(self.back(w @ v, tall, b, n))
        return self.proj(torch.cat(outs, -1))


def test_an_axis_of_one_position_is_not_rotary():
    """catches: a copy along an axis of one position read as rotary positions (a rotation at position 0 is the
    identity), which reported positions the module does not have and would run the rotary checks on it."""
    report = check(CrossStripes(64), length=16)
    assert report.verdict == "passed" and "positions" not in report.inferred.get("design", {}), report.inferred


class GatedHeads(_Fused):
    """Correct, a sigmoid gate per head on the attention's output, shaped with ``view_as`` on the (B, L, H, D) result
    (as gated-attention models write it): the walk from the values product reaches the gate through view_as."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.gate = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous()  # (B, L, H, D)
        g = self.gate(x).view_as(o)
        return (o * torch.sigmoid(g)).reshape(x.shape)


def test_a_gate_shaped_like_the_result_is_not_a_merge():
    """catches: the rows of a gate (read after the values product through its view_as) compared with the query
    tokens' features and named head-merge: only a tensor that holds the product's values is a merge."""
    assert check(GatedHeads(32)).verdict == "passed"


class PooledKeysPerHead(_Fused):
    """Correct, keys and values pooled per head on the token grid by a strided depthwise convolution (MViT's
    pooling attention), on 16 tokens with a head dim of 16: a (B * H, D, h, w) map whose channel axis has the
    sequence's length."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__(dim)
        d = dim // self.heads
        self.pool_k, self.pool_v = (nn.Conv2d(d, d, 3, stride=2, padding=1, groups=d, bias=False) for _ in range(2))

    def pooled(self, t: torch.Tensor, pool: nn.Conv2d) -> torch.Tensor:
        b, h, n, d = t.shape
        side = math.isqrt(n)
        grid = pool(t.reshape(b * h, side, side, d).permute(0, 3, 1, 2))  # (B * H, D, side / 2, side / 2)
        return grid.reshape(b, h, d, -1).transpose(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        k, v = self.pooled(k, self.pool_k), self.pooled(v, self.pool_v)
        return self.merge(F.scaled_dot_product_attention(q, k, v))


def test_keys_pooled_on_a_map_whose_channels_have_the_sequences_length_are_not_a_split():
    """catches: head-split on MViT-style pooled keys because the (B * H, D, h, w) map's channel axis has the
    sequence's length and was read as its token axis: a tensor is by token when any reading of its axes says so."""
    assert check(PooledKeysPerHead(64), length=16).verdict == "passed"


class SdpaAdditive(_Fused):
    """Correct, an additive (L, L) mask handed to SDPA as it is (SDPA wants a float mask in the query's dtype)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_a_float_mask_from_make_mask_is_made_in_the_probes_dtype():
    """catches: half-precision-overflow on a correct module whose float mask came from the user's make_mask, which
    builds it in float32 whatever the probe's dtype: a float mask it returns is cast as the doctor's own are."""
    def additive(keep: torch.Tensor) -> torch.Tensor:
        return torch.zeros(keep.shape[-2:]).masked_fill(~keep[0], -100.0)

    assert check(SdpaAdditive(32), mask="additive (L,L)", make_mask=additive).verdict == "passed"


class RequiredMaskRewritten(_Fused):
    """Correct, ESPnet-style: a required (B, L, L) keep-mask rewritten in place into the hidden positions
    (``mask.unsqueeze_(1).eq_(0)``); ``grad_scale``: a custom backward whose gradient is 15% off (the bug)."""

    def __init__(self, dim: int, grad_scale: float = 1.0) -> None:
        super().__init__(dim)
        self.grad_scale = grad_scale

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        hidden = mask.unsqueeze_(1).eq_(0)
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(hidden, float("-inf"))
        return self.merge(_ScaledBackward.apply(s.softmax(-1) @ v, self.grad_scale))


class _ScaledBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def test_a_required_mask_rewritten_in_place_still_gets_its_gradients_checked():
    """catches: the gradient probe switched off ("autograd refuses an in-place operation") on a module whose
    required mask it rewrites in place: the doctor put the mask back in place after the call, which bumped the
    version of a tensor autograd had saved; a mask made for one call is no longer put back."""
    report = check(RequiredMaskRewritten(32))
    assert report.coverage["gradients"] == "verified" and "mutates-input" in report.ids, report.coverage
    assert "wrong-gradient" in check(RequiredMaskRewritten(32, grad_scale=1.15)).ids


class SpeechToolkitAttention(nn.Module):
    """ESPnet / WeNet style: ``MultiHeadedAttention(n_head, n_feat, dropout_rate)``, ``forward(query, key, value,
    mask)`` with a required (B, 1, T) or (B, T, T) keep-mask read as ``mask.unsqueeze(1).eq(0)``. ``after``: the mask
    applied only to the weights after the softmax (the bug)."""

    def __init__(self, n_head: int, n_feat: int, dropout_rate: float, after: bool = False) -> None:
        super().__init__()
        self.h, self.d_k, self.after = n_head, n_feat // n_head, after
        self.linear_q, self.linear_k, self.linear_v, self.linear_out = (nn.Linear(n_feat, n_feat) for _ in range(4))
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b = query.size(0)
        q, k, v = (lin(t).view(b, -1, self.h, self.d_k).transpose(1, 2)
                   for lin, t in ((self.linear_q, query), (self.linear_k, key), (self.linear_v, value)))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        hidden = mask.unsqueeze(1).eq(0)
        if self.after:
            attn = torch.softmax(scores, dim=-1).masked_fill(hidden, 0.0)
        else:
            attn = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).masked_fill(hidden, 0.0)
        x = (self.dropout(attn) @ v).transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.linear_out(x)


def test_a_speech_toolkits_required_mask_module_is_built_and_called():
    """catches: ESPnet's constructor (n_feat) not built without --init, and a required mask found in a convention
    whose "hide nothing" hides everything (an additive 0 read as mask.eq(0)), so the module with its mask applied
    after the softmax ran constant and the doctor exited 2, with or without the convention stated."""
    assert check(SpeechToolkitAttention).verdict == "passed"
    for stated in (None, "keep (B,L,L)"):
        report = check(SpeechToolkitAttention, init={"n_head": 4, "n_feat": 64, "dropout_rate": 0.1, "after": True},
                       mask=stated)
        assert "mask-after-softmax" in report.ids, (stated, report.ids)


class QueryAndKeySequences(nn.Module):
    """Correct, OpenFold's ``Attention``: ``forward(q_x, kv_x, biases=None)`` takes the queries' and the keys'
    sequences (the same one for self-attention) and a list of additive biases, with a sigmoid gate on the output.
    ``double_scale``: q scaled twice (the bug)."""

    def __init__(self, c_q: int, c_hidden: int = 16, no_heads: int = 4, double_scale: bool = False) -> None:
        super().__init__()
        self.c_hidden, self.no_heads, self.double_scale = c_hidden, no_heads, double_scale
        self.linear_q, self.linear_k, self.linear_v = (nn.Linear(c_q, c_hidden * no_heads, bias=False)
                                                       for _ in range(3))
        self.linear_g, self.linear_o = nn.Linear(c_q, c_hidden * no_heads), nn.Linear(c_hidden * no_heads, c_q)

    def forward(self, q_x: torch.Tensor, kv_x: torch.Tensor, biases: list[torch.Tensor] | None = None) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(*t.shape[:-1], self.no_heads, self.c_hidden).transpose(-2, -3)

        q, k, v = heads(self.linear_q(q_x)), heads(self.linear_k(kv_x)), heads(self.linear_v(kv_x))
        q = q / math.sqrt(self.c_hidden) ** (2 if self.double_scale else 1)
        a = q @ k.transpose(-1, -2)
        for b in biases or []:
            a = a + b
        o = (a.softmax(-1) @ v).transpose(-2, -3).reshape(*q_x.shape[:-1], -1)
        return self.linear_o(o * torch.sigmoid(self.linear_g(q_x)))


def test_a_forward_of_query_and_key_sequences_is_called_with_both():
    """catches: OpenFold's forward(q_x, kv_x, biases=None) called as forward(q, k, v), the input going to the
    biases too, so a correct module was batch-mixing and a buggy one exited 2: two sequence arguments get x
    twice."""
    report = check(QueryAndKeySequences(64))
    assert report.verdict == "passed" and report.inferred["call"].startswith("forward(q, kv)"), report.ids
    assert "wrong-scale" in check(QueryAndKeySequences(64, double_scale=True)).ids


class KeysAssembledInPlace(nn.Module):
    """Correct, in the style of latent-attention inference code: rotary on a part of q and of a single shared key
    head, the keys assembled by copying their parts into an empty tensor (``k[..., :n].copy_(k_pass)``).
    ``k_unrotated``: the shared key part copied in before its rotation (the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, nope: int = 8, rope: int = 8, k_unrotated: bool = False) -> None:
        super().__init__()
        self.heads, self.nope, self.rope, self.k_unrotated = heads, nope, rope, k_unrotated
        self.q = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.kv = nn.Linear(dim, heads * (nope + nope) + rope, bias=False)  # per-head k_pass and v, one k_rot
        self.o = nn.Linear(heads * nope, dim, bias=False)
        inv = 1.0 / 10000 ** (torch.arange(0, rope, 2).double() / rope)
        self.register_buffer("inv", inv.float(), persistent=False)

    def rotate(self, t: torch.Tensor) -> torch.Tensor:  # (B, h, L, rope), interleaved pairs
        angles = torch.arange(t.shape[-2], dtype=t.dtype)[:, None] * self.inv.to(t.dtype)
        cos, sin = angles.cos(), angles.sin()
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        q_pass, q_rot = q.split((self.nope, self.rope), -1)
        q = torch.cat((q_pass, self.rotate(q_rot)), -1)
        kv, k_rot = self.kv(x).split((self.heads * 2 * self.nope, self.rope), -1)
        k_pass, v = kv.view(b, n, self.heads, -1).transpose(1, 2).split((self.nope, self.nope), -1)
        k_rot = k_rot.view(b, 1, n, self.rope)
        k_rot = (k_rot if self.k_unrotated else self.rotate(k_rot)).expand(b, self.heads, n, self.rope)
        k = k_pass.new_empty(b, self.heads, n, self.nope + self.rope)
        k[..., : self.nope].copy_(k_pass)
        k[..., self.nope:].copy_(k_rot)
        w = (q @ k.transpose(-1, -2) / math.sqrt(self.nope + self.rope)).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, -1))


def test_keys_assembled_by_writes_into_views_are_read_through_them():
    """catches: keys made by ``new_empty`` and ``copy_`` into slices of it were read as the empty tensor, so the
    rotation written into them was not seen and a correct module was rotary-one-side (DeepSeek V3 in the
    whole-model sweep); a rotation whose halves are stacked and flattened into pairs was not read as one."""
    assert check(KeysAssembledInPlace()).verdict == "passed", check(KeysAssembledInPlace()).ids
    assert "rotary-one-side" in check(KeysAssembledInPlace(k_unrotated=True)).ids


class TinyCausal(nn.Module):
    """Correct causal attention whose weights are drawn at a tiny scale (std 1e-10, as some configs initialise a
    tower before its weights are loaded): every output and every change of one is tiny."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        for p in self.parameters():
            nn.init.normal_(p, std=1e-10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, n, e))


def test_which_keys_a_row_sees_is_read_relative_to_tiny_outputs():
    """catches: a change of an output row counted only above 1e-10 absolute, so with weights at 1e-10 the past
    keys seemed hidden and a correct causal module was causal-leak."""
    report = check(TinyCausal())
    assert report.verdict == "passed" and report.inferred["causal"], report.ids


class DecodeStep(nn.Module):
    """Correct, a decode step of inference code with a cache of ``max_batch`` slots filled before the call (a prompt
    of ``start`` tokens per slot): ``forward(x, start_pos)`` attends to the slot's prompt and, causally, to the
    new tokens, then writes them after the prompt. ``first_slot``: every row reads slot 0's prompt (the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, max_batch: int = 8, max_seq: int = 48, start: int = 5,
                 first_slot: bool = False) -> None:
        super().__init__()
        self.heads, self.first_slot = heads, first_slot
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        g = torch.Generator().manual_seed(3)
        self.register_buffer("cache_k", torch.randn(max_batch, max_seq, heads, dim // heads, generator=g))
        self.register_buffer("cache_v", torch.randn(max_batch, max_seq, heads, dim // heads, generator=g))
        self.cache_k[:, start:].zero_()
        self.cache_v[:, start:].zero_()

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        bsz, n, _ = x.shape
        xq, xk, xv = (w(x).view(bsz, n, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        self.cache_k[:bsz, start_pos:start_pos + n] = xk
        self.cache_v[:bsz, start_pos:start_pos + n] = xv
        rows = slice(0, 1) if self.first_slot else slice(0, bsz)
        keys = self.cache_k[rows, : start_pos + n].expand(bsz, -1, -1, -1).transpose(1, 2)
        values = self.cache_v[rows, : start_pos + n].expand(bsz, -1, -1, -1).transpose(1, 2)
        scores = xq.transpose(1, 2) @ keys.transpose(2, 3) / math.sqrt(xq.shape[-1])
        future = torch.full((n, n), float("-inf")).triu(1)
        scores = scores + torch.cat([torch.zeros(n, start_pos), future], dim=1).type_as(scores)
        out = (scores.softmax(-1) @ values).transpose(1, 2).reshape(bsz, n, -1)
        return self.wo(out)


class BatchFirstTable(nn.Module):
    """A sinusoid table laid out sequence-first, (max_len, 1, E) as in the PyTorch tutorial, added to batch-first
    input by ``x.size(0)``: the batch row's entry, not the token's (the bug), before correct attention."""

    def __init__(self, dim: int = 64, heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        position = torch.arange(max_len)[:, None]
        div = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
        pe = torch.zeros(max_len, 1, dim)
        pe[:, 0, 0::2], pe[:, 0, 1::2] = torch.sin(position * div), torch.cos(position * div)
        self.register_buffer("pe", pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pe[: x.size(0)]
        return self.attn(x, x, x, need_weights=False)[0]


def test_a_decode_step_reads_its_rows_cache_and_a_term_by_batch_row_is_still_mixing():
    """catches: at a decode step (a per-slot cache filled before the call) an item alone reads slot 0's prompt, so a
    correct module was batch-mixing; an output that follows the batch row is a fact only when the call writes a
    per-row state, so a position table read by batch row stays batch-mixing."""
    call = "lambda m, x: m(x, 5)"
    report = check(DecodeStep(), call=call, causal=True)
    assert report.verdict == "passed" and "state per batch row" in report.inferred, report.ids
    assert "batch-mixing" in check(DecodeStep(first_slot=True), call=call, causal=True).ids
    assert "batch-mixing" in check(BatchFirstTable()).ids


class FlaxStyle(nn.Module):
    """Correct, a port of Flax's attention: kernels (E, H, D) applied by einsum, scores "...qhd,...khd->...hqk" with
    an ellipsis, a bool mask (True = attend) combined with the module's causal one by ``&`` and applied by
    ``torch.where`` with finfo.min. ``causal``: the module's own causal mask; ``transposed``: that mask built as
    key >= query (the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, causal: bool = False, transposed: bool = False) -> None:
        super().__init__()
        self.causal, self.transposed = causal, transposed
        self.query, self.key, self.value = (nn.Parameter(torch.randn(dim, heads, dim // heads) * dim ** -0.5)
                                            for _ in range(3))
        self.out = nn.Parameter(torch.randn(heads, dim // heads, dim) * dim ** -0.5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (torch.einsum("...e,ehd->...hd", x, w) for w in (self.query, self.key, self.value))
        q = q / math.sqrt(q.shape[-1])
        w = torch.einsum("...qhd,...khd->...hqk", q, k)
        if self.causal:
            i = torch.arange(x.shape[-2])
            own = (i[None, :] >= i[:, None]) if self.transposed else (i[:, None] >= i[None, :])
            mask = own[None, None] if mask is None else own[None, None] & mask
        if mask is not None:
            w = torch.where(mask, w, torch.finfo(w.dtype).min)
        o = torch.einsum("...hqk,...khd->...qhd", w.softmax(-1), v)
        return torch.einsum("...hd,hde->...e", o, self.out)


def test_einsums_with_an_ellipsis_are_read_and_a_transposed_causal_mask_is_named():
    """catches: an einsum spelled with "..." read as a matmul of its operands, so the white box raised inside the
    doctor (inconclusive); with the module's causal mask and the doctor's, the scores whose every row saw one key
    were read as scaled by 0 (wrong-scale); a causal mask built key >= query read as a local window."""
    assert check(FlaxStyle).verdict == "passed", check(FlaxStyle).ids
    report = check(FlaxStyle(causal=True))
    assert report.verdict == "passed" and report.inferred["causal"], report.ids
    assert check(FlaxStyle(causal=True, transposed=True)).ids == {"causal-leak"}


class StreamingChunks(nn.Module):
    """Correct, a streaming speech encoder's self-attention: ``forward(x, mask)`` with a chunk mask made inside
    (each frame sees its whole chunk of ``chunk`` frames and ``left`` chunks before it), combined with the caller's
    (B, 1, L) padding mask (True = frame). ``transposed``: the chunk mask built the other way round (the bug)."""

    def __init__(self, n_feat: int = 64, n_head: int = 4, chunk: int = 3, left: int = 1,
                 transposed: bool = False) -> None:
        super().__init__()
        self.h, self.chunk, self.left, self.transposed = n_head, chunk, left, transposed
        self.linear_q, self.linear_k, self.linear_v, self.linear_out = (nn.Linear(n_feat, n_feat) for _ in range(4))

    def chunk_mask(self, size: int) -> torch.Tensor:
        ret = torch.zeros(size, size, dtype=torch.bool)
        for i in range(size):
            start = max((i // self.chunk - self.left) * self.chunk, 0)
            ret[i, start:min((i // self.chunk + 1) * self.chunk, size)] = True
        return ret.T if self.transposed else ret

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (lin(x).view(b, n, self.h, -1).transpose(1, 2) for lin in (self.linear_q, self.linear_k,
                                                                           self.linear_v))
        keep = self.chunk_mask(n)[None]
        if mask is not None:
            keep = keep & mask
        scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~keep[:, None], float("-inf"))
        return self.linear_out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


def test_streaming_chunk_masks_are_a_design_and_their_transpose_a_leak():
    """catches: a streaming encoder's chunk mask (its own chunk whole, some chunks before) was causal-leak, and the
    same mask transposed (later chunks seen, earlier ones not) was certified."""
    report = check(StreamingChunks)
    assert report.verdict == "passed" and "streaming chunks" in report.inferred.get("window", ""), report.ids
    assert "causal-leak" in check(StreamingChunks(transposed=True)).ids


def _rotate_seq_first(t: torch.Tensor, rot: int, interleaved: bool) -> torch.Tensor:
    """Rotary positions on the first ``rot`` dims of t (S, B, H, D), the positions on dim 0."""
    part, rest = t[..., :rot], t[..., rot:]
    inv = 1.0 / 10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    ang = (torch.arange(t.shape[0], dtype=torch.float32)[:, None] * inv)[:, None, None].to(t.dtype)  # (S, 1, 1, r/2)
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        part = torch.stack((a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()), -1).flatten(-2)
    else:
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        half = torch.cat((-part[..., rot // 2:], part[..., : rot // 2]), -1)
        part = part * cos + half * sin
    return torch.cat((part, rest), -1)


class SequenceFirstCore(nn.Module):
    """Correct, Megatron-style: hidden states [s, b, h], a fused QKV split per head, rotary on a quarter of the head
    dim (sequence first), scores by ``baddbmm(beta=0, alpha=1/sqrt(hn))``, and a *required* attention mask
    [b, 1, s, s] where True = masked (filled with -10000). ``key_pass_first``: k's rotated part concatenated after
    its pass-through part while q's comes first (the bug); ``interleaved_q``: q rotated by interleaved pairs, k by
    halves (the bug)."""

    def __init__(self, hidden_size: int = 64, num_attention_heads: int = 4, key_pass_first: bool = False,
                 interleaved_q: bool = False) -> None:
        super().__init__()
        self.np, self.hn = num_attention_heads, hidden_size // num_attention_heads
        self.key_pass_first, self.interleaved_q = key_pass_first, interleaved_q
        self.query_key_value, self.dense = nn.Linear(hidden_size, 3 * hidden_size), nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, None]:
        sq, b, _ = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(sq, b, self.np, 3 * self.hn)
        q, k, v = torch.split(mixed, self.hn, dim=3)
        rot = self.hn // 4
        q = _rotate_seq_first(q, rot, self.interleaved_q)
        k = _rotate_seq_first(k, rot, False)
        if self.key_pass_first:
            k = torch.cat((k[..., rot:], k[..., :rot]), -1)
        q, k, v = (t.reshape(sq, b * self.np, self.hn) for t in (q, k, v))
        scores = torch.empty(b * self.np, sq, sq, dtype=q.dtype)
        scores = torch.baddbmm(scores, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0,
                               alpha=1.0 / math.sqrt(self.hn)).view(b, self.np, sq, sq)
        probs = scores.masked_fill(attention_mask, -10000.0).softmax(-1).view(b * self.np, sq, sq)
        context = torch.bmm(probs, v.transpose(0, 1)).view(b, self.np, sq, self.hn)
        context = context.permute(2, 0, 1, 3).reshape(sq, b, self.np * self.hn)
        return self.dense(context), None


def test_sequence_first_modules_with_a_required_mask_and_rotary_are_read():
    """catches: a sequence-first forward whose [b, 1, s, s] mask is required was tried batch first only, so it ran
    only where batch, length and width line up and was batch-mixing (30 s); rotary positions on the first axis were
    not found, so q and k rotated differently were certified."""
    report = check(SequenceFirstCore)
    assert report.verdict == "passed" and report.inferred["layout"].startswith("sequence-first"), report.ids
    assert "rotary" in str(report.inferred.get("design", {}).get("positions")), report.inferred.get("design")
    assert "rotary-mismatch" in check(SequenceFirstCore(key_pass_first=True)).ids
    assert "rotary-mismatch" in check(SequenceFirstCore(interleaved_q=True)).ids


class TopKSparse(nn.Module):
    """Correct, explicit sparse attention: each query keeps its ``topk`` largest scores (the others filled with the
    most negative number), with the caller's (B, L) key mask (True = attend) applied the same way."""

    def __init__(self, dim: int = 64, heads: int = 4, topk: int = 3) -> None:
        super().__init__()
        self.heads, self.topk = heads, topk
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        sim = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        floor = -torch.finfo(sim.dtype).max
        if mask is not None:
            sim = sim.masked_fill(~mask[:, None, None, :], floor)
        if self.topk < n:
            kth = sim.topk(self.topk, dim=-1).values[..., -1:]
            sim = sim.masked_fill(sim < kth, floor)
        return self.to_out((sim.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_a_top_k_that_keeps_other_keys_in_each_item_is_read_with_a_mask():
    """catches: with a padding mask, the scores were fitted only where every batch item sees the key, and a top-k
    keeps other keys in each item, so no row had two such entries: definition-mismatch (wrong-scale before)."""
    for seed in range(4):
        report = check(TopKSparse, seed=seed)
        assert report.verdict == "passed", (seed, report.ids)


class XPos(nn.Module):
    """Correct, xPos: rotate-half rotary positions with q scaled per frequency by zeta^(n / 512) and k by
    zeta^(-n / 512) (the scores stay relative, and decay with distance). ``same_sign``: k scaled by zeta^(n / 512)
    like q (the bug: the scores then depend on the positions themselves)."""

    def __init__(self, dim: int = 64, heads: int = 4, same_sign: bool = False) -> None:
        super().__init__()
        self.heads, self.same_sign = heads, same_sign
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        d = dim // heads
        self.register_buffer("zeta", (torch.arange(0, d, 2) + 0.4 * d) / (1.4 * d), persistent=False)
        self.register_buffer("inv", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def rotate(self, t: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
        n = t.shape[-2]
        ang = torch.arange(n, dtype=t.dtype)[:, None] * self.inv.to(t.dtype)
        scale = (self.zeta.to(t.dtype)[None] ** power[:, None]).repeat(1, 2)  # (L, D)
        cos, sin = torch.cat((ang, ang), -1).cos() * scale, torch.cat((ang, ang), -1).sin() * scale
        a, b = t.chunk(2, -1)
        return t * cos + torch.cat((-b, a), -1) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        power = torch.arange(n, dtype=x.dtype) / 512
        q, k = self.rotate(q, power), self.rotate(k, power if self.same_sign else -power)
        w = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return self.out((w @ v).transpose(1, 2).reshape(b, n, e))


def test_xpos_scaling_is_a_design_and_the_same_scale_on_both_a_mismatch():
    """catches: xPos (q scaled by zeta^n, k by zeta^-n, each beside its rotation) read as rotary that is no rotation
    (rotary-mismatch, x-transformers' rotary_xpos); with both changed in norm, the run on one token everywhere
    decides, and names k scaled like q."""
    report = check(XPos)
    assert report.verdict == "passed" and "xPos" in str(report.inferred.get("design")), report.ids
    assert "rotary-mismatch" in check(XPos(same_sign=True)).ids


class PooledKeys(nn.Module):
    """Correct, Next-ViT's efficient attention: keys and values from the tokens average-pooled by 4 (a sequence
    reduction), queries from every token."""

    def __init__(self, dim: int = 64, head_dim: int = 16, sr_ratio: int = 2) -> None:
        super().__init__()
        self.heads = dim // head_dim
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))
        self.sr, self.norm = nn.AvgPool1d(sr_ratio ** 2, sr_ratio ** 2), nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q = self.q(x).reshape(b, n, self.heads, -1).transpose(1, 2)
        pooled = self.norm(self.sr(x.transpose(1, 2))).transpose(1, 2)
        k, v = (f(pooled).reshape(b, -1, self.heads, c // self.heads).transpose(1, 2) for f in (self.k, self.v))
        w = (q @ k.transpose(-1, -2) * (c // self.heads) ** -0.5).softmax(-1)
        return self.proj((w @ v).transpose(1, 2).reshape(b, n, c))


def test_keys_pooled_from_the_tokens_are_probed_at_a_length_that_keeps_several():
    """catches: probed at 7 tokens, keys pooled by 4 left one key: every weight was 1, q and k got no gradient and
    the scale could not be read (no-grad, wrong-scale); a module that pools its tokens is probed at 16."""
    report = check(PooledKeys().eval())
    assert report.verdict == "passed" and report.inferred["probe shape"][1] == 16, report.ids


class ExclusiveAttention(nn.Module):
    """Correct, exclusive self-attention with a gate per head: each head's output loses its projection on the token's
    own normalised value, ``out - (out . v_hat) v_hat``, is gated, and the heads are merged by permute and reshape.
    ``merged_early``: merged with reshape before the permute (the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, merged_early: bool = False) -> None:
        super().__init__()
        self.heads, self.merged_early = heads, merged_early
        self.to_qkv, self.to_gate = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, heads, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in self.to_qkv(x).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v)
        v_hat = F.normalize(v, dim=-1)
        out = out - (out * v_hat).sum(dim=-1, keepdim=True) * v_hat
        out = out * self.to_gate(x).sigmoid().permute(0, 2, 1)[..., None]
        merged = out.reshape(b, n, e) if self.merged_early else out.permute(0, 2, 1, 3).reshape(b, n, e)
        return self.to_out(merged)


def test_a_side_branch_on_the_heads_output_is_not_read_as_its_merge():
    """catches: the first read of the values product was followed, into a sum over the head dim (exclusive
    self-attention's projection on v), and that read, in the heads' layout, was taken for a merge by reshape:
    head-merge on a correct module."""
    assert check(ExclusiveAttention).verdict == "passed", check(ExclusiveAttention).ids
    assert "head-merge" in check(ExclusiveAttention(merged_early=True)).ids


class ContinuousBias(nn.Module):
    """Correct, Swin v2's continuous position bias: a small MLP (its first bias initialised at 0, then a ReLU) of
    the log-spaced relative coordinates of a window's tokens; at coordinate (0, 0) every pre-activation is exactly
    0, a kink of the ReLU at the point itself."""

    def __init__(self, dim: int = 64, heads: int = 4, side: int = 3) -> None:
        super().__init__()
        self.heads, self.side = heads, side
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.cpb = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, heads, bias=False))
        nn.init.zeros_(self.cpb[0].bias)
        yx = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")).flatten(1)
        rel = (yx[:, :, None] - yx[:, None, :]).permute(1, 2, 0).float()  # (L, L, 2)
        self.register_buffer("coords", torch.sign(rel) * torch.log2(rel.abs() + 1.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        bias = 16 * torch.sigmoid(self.cpb(self.coords.to(x.dtype)).permute(2, 0, 1))
        w = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias).softmax(-1)
        return self.proj((w @ v).transpose(1, 2).reshape(b, n, e))


def test_a_relu_kink_at_the_point_itself_is_no_wrong_gradient():
    """catches: ReLUs of pre-activations that are exactly 0 (a zero bias on the (0, 0) coordinate) sit on their
    kink at the point itself, where no finite difference, however small its step, sees the one-sided derivative
    autograd takes: a correct module was wrong-gradient; the gradient is compared off the point too."""
    for seed in (1, 2):  # draws where the kink's share of the derivative is above the finite difference's noise
        torch.manual_seed(seed)
        report = check(ContinuousBias(), length=9)
        assert report.verdict == "passed", (seed, report.ids)


class ZeroesEmptyRows(nn.Module):
    """Correct, as x-transformers' core: a (B, L) key mask (True = attend) hides keys, and a query whose row the mask
    empties gets an output of 0. ``inverted``: the scores filled where the mask is True (the bug), while the rows
    are still judged by ``mask.any``."""

    def __init__(self, dim: int = 64, heads: int = 4, inverted: bool = False) -> None:
        super().__init__()
        self.heads, self.inverted = heads, inverted
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        sim = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if mask is not None:
            keep = mask[:, None, None, :]
            sim = sim.masked_fill(keep if self.inverted else ~keep, -torch.finfo(sim.dtype).max)
        out = sim.softmax(-1) @ v
        if mask is not None:
            out = out.masked_fill(~mask.any(-1)[:, None, None, None], 0.0)
        return self.to_out(out.transpose(1, 2).reshape(b, n, e))


def test_a_stated_convention_read_inverted_is_named_when_empty_rows_are_zeroed():
    """catches: with the convention stated, a module reading its mask inverted but zeroing the rows ``mask.any``
    finds empty gave the unmasked output neither with a mask hiding nothing nor with one hiding everything, so no
    mask was understood: inconclusive (or mask-error with the shape stated) instead of mask-inverted."""
    for stated in ({"mask_convention": "keep"}, {"mask": "keep (B,L)"}):
        assert check(ZeroesEmptyRows, **stated).verdict == "passed", stated
        assert "mask-inverted" in check(ZeroesEmptyRows(inverted=True), **stated).ids, stated


class GroupedScratch(nn.Module):
    """Correct, grouped-query attention written from scratch: 4 query heads, 2 kv heads repeated with
    ``repeat_interleave``. ``values_tiled``: the values repeated with ``repeat`` (heads 0, 1, 0, 1) while the keys
    are interleaved (0, 0, 1, 1): a query head's keys and values come from different kv heads (the bug)."""

    def __init__(self, d: int = 64, heads: int = 4, groups: int = 2, values_tiled: bool = False) -> None:
        super().__init__()
        self.heads, self.groups, self.hd, self.values_tiled = heads, groups, d // heads, values_tiled
        self.W_query = nn.Linear(d, d, bias=False)
        self.W_key, self.W_value = (nn.Linear(d, groups * (d // heads), bias=False) for _ in range(2))
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.W_query(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = (w(x).view(b, n, self.groups, self.hd).transpose(1, 2) for w in (self.W_key, self.W_value))
        r = self.heads // self.groups
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat(1, r, 1, 1) if self.values_tiled else v.repeat_interleave(r, dim=1)
        w = torch.softmax(q @ k.transpose(2, 3) / self.hd ** 0.5, dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, -1))


def test_keys_and_values_repeated_from_different_kv_heads_are_named():
    """catches: grouped keys repeated by repeat_interleave and values by repeat, so query heads 1 and 2 took keys and
    values from different kv heads: certified (a from-scratch Llama 3 with real weights then goes wrong)."""
    assert check(GroupedScratch).verdict == "passed", check(GroupedScratch).ids
    assert "group-mismatch" in check(GroupedScratch(values_tiled=True)).ids
    sdpa = check(GroupedSdpa(values_tiled=True))
    assert "group-mismatch" in sdpa.ids and check(GroupedSdpa()).verdict == "passed", sdpa.ids


class GroupedSdpa(GroupedScratch):
    """The same through scaled_dot_product_attention."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.W_query(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = (w(x).view(b, n, self.groups, self.hd).transpose(1, 2) for w in (self.W_key, self.W_value))
        r = self.heads // self.groups
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat(1, r, 1, 1) if self.values_tiled else v.repeat_interleave(r, dim=1)
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))


class SwitchedCausal(nn.Module):
    """Correct, Stable Diffusion's ``SelfAttention``: ``forward(x, causal_mask=False)``, the causal mask built with
    ``triu(1)`` when the switch is on. ``tril``: built with ``tril(-1)`` (the bug: it hides the past and the
    diagonal and shows the future)."""

    def __init__(self, d_embed: int = 64, n_heads: int = 4, tril: bool = False) -> None:
        super().__init__()
        self.n_heads, self.tril = n_heads, tril
        self.in_proj, self.out_proj = nn.Linear(d_embed, 3 * d_embed), nn.Linear(d_embed, d_embed)

    def forward(self, x: torch.Tensor, causal_mask: bool = False) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.n_heads, -1).transpose(1, 2) for t in self.in_proj(x).chunk(3, dim=-1))
        weight = q @ k.transpose(-1, -2)
        if causal_mask:
            ones = torch.ones_like(weight, dtype=torch.bool)
            weight = weight.masked_fill(ones.tril(-1) if self.tril else ones.triu(1), -torch.inf)
        weight = F.softmax(weight / math.sqrt(e // self.n_heads), dim=-1)
        return self.out_proj((weight @ v).transpose(1, 2).reshape(b, n, e))


def test_a_causal_switch_named_otherwise_is_still_tried():
    """catches: a bool switch named ``causal_mask`` was not read as a causal switch, so the path behind it never
    ran and a causal mask built with tril(-1) was certified."""
    report = check(SwitchedCausal)
    assert report.verdict == "passed" and report.inferred["mask"]["argument"] == "causal_mask", report.ids
    assert "causal-leak" in check(SwitchedCausal(tril=True)).ids


class KeepsItsWeights(nn.Module):
    """Correct, in d2l.ai's style: the module keeps its last attention weights as an attribute (with their autograd
    history after a forward) and a staticmethod object as a class-level helper held by the instance; neither can
    be deep-copied."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attention_weights: torch.Tensor | None = None
        self.helper = staticmethod(math.sqrt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        self.attention_weights = (q @ k.transpose(-1, -2) / self.helper.__func__(q.shape[-1])).softmax(-1)
        return self.out((self.attention_weights @ v).transpose(1, 2).reshape(b, n, e))


def test_a_module_that_cannot_be_deep_copied_is_still_copied_for_the_probes():
    """catches: a module holding a tensor with autograd history (its last weights, after one forward) or a
    staticmethod object could not be deep-copied, so its half-precision and float64 copies were never made: the
    half-precision probe was not verified and the module inconclusive."""
    module = KeepsItsWeights()
    module(torch.randn(2, 5, 64))  # the weights it keeps now carry autograd history
    report = check(module)
    assert report.verdict == "passed" and report.inferred["analysed in"] == "a float64 copy", report.ids


class SinksAndWindow(nn.Module):
    """Correct, StreamingLLM's pattern: each query sees the first ``sinks`` tokens and a causal window of ``window``
    tokens ending at itself."""

    def __init__(self, dim: int = 64, heads: int = 4, sinks: int = 2, window: int = 3) -> None:
        super().__init__()
        self.heads, self.sinks, self.window = heads, sinks, window
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        i = torch.arange(n)
        keep = (i[None, :] <= i[:, None]) & ((i[None, :] < self.sinks) | (i[:, None] - i[None, :] < self.window))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(o.transpose(1, 2).reshape(b, n, e))


def test_attention_sinks_beside_a_causal_window_are_a_design():
    """catches: the first tokens kept visible beside a causal sliding window (StreamingLLM) read as a causal mask
    hiding past keys in no window: causal-leak on a correct module."""
    for causal in (False, True):
        report = check(SinksAndWindow, causal=causal)
        assert report.verdict == "passed" and "sinks" in report.inferred.get("window", ""), (causal, report.ids)


class PackedVarlen(nn.Module):
    """Correct, in flash-attn's ``MHA`` style: a packed qkv (B, S, 3, H, D), rotary on q and k of the pack (the pack
    rebuilt with ``torch.stack([q, k, v], 2)``, read back with ``unbind``), and under a (B, S) key padding mask
    (True = token) the real tokens gathered, attention run sequence by sequence from ``cu_seqlens``, and scattered
    back. ``offset``: each sequence after the first read one token early (the bug: it takes the previous one's last
    token and loses its own last)."""

    def __init__(self, dim: int = 64, heads: int = 4, offset: bool = False) -> None:
        super().__init__()
        self.heads, self.offset = heads, offset
        self.Wqkv, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("inv", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)

    def rotary(self, t: torch.Tensor) -> torch.Tensor:  # (B, S, H, D), the first 8 dims
        ang = torch.arange(t.shape[1], dtype=t.dtype)[:, None] * self.inv.to(t.dtype)
        cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
        part = t[..., :8]
        turned = part * cos + torch.cat((-part[..., 4:], part[..., :4]), -1) * sin
        return torch.cat((turned, t[..., 8:]), -1)

    @staticmethod
    def attend(qkv: torch.Tensor) -> torch.Tensor:  # (b, s, 3, H, D) -> (b, s, H, D)
        q, k, v = qkv.unbind(dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(q.shape[-1]))
        return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, e = x.shape
        qkv = self.Wqkv(x).view(b, s, 3, self.heads, -1)
        qkv = torch.stack([self.rotary(qkv[:, :, 0]), self.rotary(qkv[:, :, 1]), qkv[:, :, 2]], dim=2)
        if key_padding_mask is None:
            return self.out_proj(self.attend(qkv).reshape(b, s, e))
        indices = torch.nonzero(key_padding_mask.flatten()).flatten()
        lengths = key_padding_mask.sum(-1)
        cu = F.pad(torch.cumsum(lengths, 0), (1, 0))
        packed = qkv.reshape(b * s, *qkv.shape[2:])[indices]
        starts = [int(cu[i]) - (int(self.offset) if i else 0) for i in range(b)]
        outs = [self.attend(packed[start:start + int(n)][None])[0] for start, n in zip(starts, lengths, strict=True)]
        out = torch.zeros(b * s, self.heads, e // self.heads, dtype=x.dtype)
        out[indices] = torch.cat(outs)
        return self.out_proj(out.view(b, s, e))


def test_a_packed_qkv_and_a_varlen_path_under_a_padding_mask_are_read():
    """catches: v read back from the pack the rotated q and k were stacked into was values-changed; the padded run,
    attention over each sequence's real tokens, was definition-mismatch (and an einsum over one sequence a doctor
    error); with the mask on, a cu_seqlens that lets one sequence reach the next was certified."""
    report = check(PackedVarlen, mask="keep (B,L)")
    assert report.verdict == "passed", report.ids
    assert "batch-mixing" in check(PackedVarlen(offset=True), mask="keep (B,L)").ids


class PrefixKeptInPlace(nn.Module):
    """Correct, as CogVideoX keeps its text tokens unrotated: the first ``prefix`` tokens pass, the others' q and k
    are rotated (frequencies of its own, base 100) and written back in place, ``q[:, :, p:] = rope(q[:, :, p:])``.
    ``shifted``: k's rotated part taken from the wrong tokens, ``rope(k[:, :, :-p])`` (the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, prefix: int = 2, shifted: bool = False) -> None:
        super().__init__()
        self.heads, self.prefix, self.shifted = heads, prefix, shifted
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    @staticmethod
    def rope(t: torch.Tensor) -> torch.Tensor:
        d = t.shape[-1]
        ang = torch.arange(t.shape[-2], dtype=t.dtype)[:, None] / 100 ** (torch.arange(0, d, 2, dtype=t.dtype) / d)
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        return t * cos + torch.cat((-t[..., d // 2:], t[..., : d // 2]), -1) * sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = (t.clone() for t in self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4))
        p = self.prefix
        q[:, :, p:] = self.rope(q[:, :, p:])
        k[:, :, p:] = self.rope(k[:, :, :-p] if self.shifted else k[:, :, p:])
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, e))


def test_rotary_written_in_place_on_part_of_the_tokens_is_checked():
    """catches: rotary positions written into the tokens after a kept prefix, in place, were not read as rotary at
    all, so the run on one token everywhere never ran and k rotated from the wrong tokens was certified."""
    assert check(PrefixKeptInPlace).verdict == "passed", check(PrefixKeptInPlace).ids
    assert "rotary-mismatch" in check(PrefixKeptInPlace(shifted=True)).ids


class YarnScaled(nn.Module):
    """Correct, latent-attention style with YaRN: the softmax scale is 1/sqrt(D) times mscale^2, mscale from the
    config's ``rope_parameters`` (``mscale_all_dim``, ``factor``), as transformers' ``yarn_apply_mscale`` folds it
    into latent attention (a ``kv_lora_rank``). ``stated``: whether the module carries that config."""

    def __init__(self, dim: int = 64, heads: int = 4, stated: bool = True) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.heads = heads
        rope = {"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}
        if stated:
            self.config = SimpleNamespace(rope_parameters=rope, kv_lora_rank=32)
        m = 0.1 * math.log(rope["factor"]) + 1.0
        self.scaling = (dim // heads) ** -0.5 * m * m
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        w = (q @ k.transpose(-1, -2) * self.scaling).softmax(-1)
        return self.out((w @ v).transpose(1, 2).reshape(b, n, e))


def test_yarn_mscale_in_the_config_is_a_stated_scale():
    """catches: the softmax scale with YaRN's mscale_all_dim folded in (Mistral 4, DeepSeek) was wrong-scale; the
    same scale without a config stating it still is."""
    report = check(YarnScaled())
    assert report.verdict == "passed" and "mscale" in str(report.inferred.get("design", {}).get("scale")), report.ids
    assert "wrong-scale" in check(YarnScaled(stated=False)).ids


class NormedQK(nn.Module):
    """Correct, q/k LayerNorm over the head dim (Hunyuan, CogVideoX). ``over_tokens``: the norm applied after the
    tokens were moved onto the last axis, (B, H, D, L), so that it normalises over the tokens (the bug: each row's
    q and k then depend on every token; a swap of two tokens leaves those statistics as they were)."""

    def __init__(self, dim: int = 64, heads: int = 4, length: int = 7, over_tokens: bool = False) -> None:
        super().__init__()
        self.heads, self.over_tokens = heads, over_tokens
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        width = length if over_tokens else dim // heads
        self.q_norm, self.k_norm = nn.LayerNorm(width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.over_tokens:
            q = self.q_norm(q.transpose(-1, -2)).transpose(-1, -2)
            k = self.k_norm(k.transpose(-1, -2)).transpose(-1, -2)
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, n, e))


def test_a_qk_norm_over_the_tokens_is_named():
    """catches: a q/k LayerNorm applied with the tokens on its last axis normalises over them; a swap of two tokens
    keeps the statistics, so it was certified: one token changed must change one row of q and k."""
    assert check(NormedQK, length=7).verdict == "passed"
    report = check(NormedQK(over_tokens=True), length=7)
    assert "definition-mismatch" in report.ids and "normalises over the tokens" in str(report.findings), report.ids


class GroupNormedAttention(nn.Module):
    """Correct, a U-Net's attention as diffusers writes it (``Attention(norm_num_groups=...)``): a GroupNorm over
    the tokens' channels before q, k and v, and a key padding mask (B, L), True = attend, made an additive mask in
    the default dtype. ``ignore_mask``: the mask never reaches the scores; ``norm``: False, no GroupNorm."""

    def __init__(self, dim: int = 64, heads: int = 4, ignore_mask: bool = False, norm: bool = True) -> None:
        super().__init__()
        self.heads, self.ignore_mask = heads, ignore_mask
        self.group_norm = nn.GroupNorm(8, dim) if norm else nn.Identity()
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = hidden_states.shape
        h = self.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        q, k, v = (f(h).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        bias = None
        if attention_mask is not None and not self.ignore_mask:
            bias = torch.zeros(b, 1, 1, n).masked_fill(~attention_mask.bool()[:, None, None, :], float("-inf"))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out(o.transpose(1, 2).reshape(b, n, e))


def test_a_group_norm_over_the_tokens_before_a_padding_mask_is_a_design():
    """catches: the padded tokens move a GroupNorm's statistics over the tokens, and through them every output, so
    a U-Net's attention under a padding mask was mask-ignored; with those statistics held the mask is read, and a
    mask that never reaches the scores is still named."""
    report = check(GroupNormedAttention())
    assert report.verdict == "passed" and "statistics over the tokens" in report.inferred, report.ids
    assert "mask-ignored" in check(GroupNormedAttention(ignore_mask=True)).ids


def test_a_float32_mask_beside_the_float64_copy_is_read_as_the_module_computes_it():
    """catches: a module that builds its additive mask in the default float32 is right in its own dtype, but torch's
    CPU attention kernel misreads a float32 mask beside float64 queries from 16 tokens on: the doctor's float64
    copy of it saw the padded keys and the module was mask-ignored."""
    report = check(GroupNormedAttention(norm=False))
    assert report.verdict == "passed", report.ids


class LatentSpatialBlock(nn.Module):
    """Correct, a latent-diffusion spatial transformer's self-attention (as ldm's SpatialTransformer): a (B, C, H, W)
    map normed, projected by a 1x1 convolution, flattened to tokens, attention with a residual, the tokens put back
    into the map and projected out, a residual around it all. ``reshape_back``: the tokens put back with
    ``reshape(B, C, H, W)`` and no permute (the bug: each position then holds features of other tokens)."""

    def __init__(self, channels: int = 64, heads: int = 4, reshape_back: bool = False) -> None:
        super().__init__()
        self.heads, self.reshape_back = heads, reshape_back
        self.norm = nn.GroupNorm(8, channels, eps=1e-6)
        self.proj_in, self.proj_out = nn.Conv2d(channels, channels, 1), nn.Conv2d(channels, channels, 1)
        self.to_qkv, self.to_out = nn.Linear(channels, 3 * channels, bias=False), nn.Linear(channels, channels)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        w = torch.einsum("bhid,bhjd->bhij", q, k).mul(q.shape[-1] ** -0.5).softmax(-1)
        return self.to_out(torch.einsum("bhij,bhjd->bhid", w, v).transpose(1, 2).reshape(b, n, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)
        t = self.attend(t) + t
        t = t.reshape(b, c, h, w) if self.reshape_back else t.transpose(1, 2).reshape(b, c, h, w)
        return self.proj_out(t) + x


def test_tokens_put_back_into_a_map_without_their_permute_are_named():
    """catches: an image block that puts its tokens back into the (B, C, H, W) map with a reshape and no permute was
    certified (its not-equivariant is a warning, which positions would explain): with two tokens swapped, the
    attention's output changes on their two rows and the map after that reshape on the rows of others."""
    assert check(LatentSpatialBlock()).verdict == "passed"
    report = check(LatentSpatialBlock(reshape_back=True))
    assert "head-merge" in report.ids and "put tokens back" in report.findings[0].fix, report.ids


class FloatMaskedInItsDtype(nn.Module):
    """Correct, a mask of 1.0 = masked in the module's own dtype subtracted times a large number, as XLNet writes it
    (65500 in float16, where 1e30 overflows). A bool mask there becomes a float32 term that promotes the float16
    scores; the module takes float masks."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if attn_mask is not None:
            scores = scores - (65500 if attn_mask.dtype == torch.float16 else 1e30) * attn_mask[:, None]
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_a_bool_mask_that_half_precision_cannot_take_is_sent_as_the_dtypes_floats():
    """catches: a module taking float masks of 1.0 = masked, found with a bool mask (it reads one alike in float32),
    raised in float16 on that bool mask (its float32 term promoted the scores), and was half-precision-overflow."""
    report = check(FloatMaskedInItsDtype())
    assert report.verdict == "passed" and report.inferred["mask"]["kind"] == "ignore", report.ids


class BatchFixedByItsArguments(_Fused):
    """Correct, a bias (B, 1, L, L) given by the call for the probe's batch: an item alone still gets the whole
    batch's bias, and the output the whole batch's shape."""

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        return self.merge((q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias).softmax(-1) @ v)


def test_an_item_alone_given_the_whole_batchs_arguments_is_a_limit_not_batch_mixing():
    """catches: an item alone run through a call whose other arguments carry the batch gives an output of the
    whole batch; compared with one item of the batch, it was batch-mixing."""
    bias = torch.zeros(3, 1, 7, 7)
    report = check(BatchFixedByItsArguments(32), call=lambda m, x: m(x, bias.to(x.dtype)), batch=3, length=7)
    assert report.verdict == "passed" and "fix the batch" in str(report.inferred), report.ids


class FoldedHeads(nn.Module):
    """Correct, heads folded into the batch for bmm with a key padding mask (B, L), True = padding (fairseq's and
    Uni-Core's layout). ``keys``: "transpose" (right), "view" (k laid out (B*H, D, L) by a view: each key column
    holds features of several tokens); ``merge``: "transpose" (right) or "view" (heads merged without the transpose
    back); ``scale``: "scores" (right) or "weights" (the scale multiplied into the weights after the softmax)."""

    def __init__(self, dim: int = 64, heads: int = 4, keys: str = "transpose", merge: str = "transpose",
                 scale: str = "scores") -> None:
        super().__init__()
        self.heads, self.keys, self.merge, self.scale = heads, keys, merge, scale
        self.in_proj, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape
        d = e // self.heads
        q, k, v = (t.view(b, n, self.heads, d).transpose(1, 2).reshape(b * self.heads, n, d)
                   for t in self.in_proj(x).chunk(3, dim=-1))
        kt = k.transpose(1, 2) if self.keys == "transpose" else k.reshape(b * self.heads, d, n)
        w = torch.bmm(q * d ** -0.5 if self.scale == "scores" else q, kt)
        if key_padding_mask is not None:
            w = w.view(b, self.heads, n, n).masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
            w = w.view(b * self.heads, n, n)
        w = w.softmax(-1) if self.scale == "scores" else w.softmax(-1) * d ** -0.5
        o = torch.bmm(w, v)
        o = o.view(b, self.heads, n, d).transpose(1, 2).reshape(b, n, e) if self.merge == "transpose" else \
            o.view(b, n, e)
        return self.out_proj(o)


def test_keys_laid_out_by_a_view_a_scale_on_the_weights_and_a_bad_merge_get_their_own_ids():
    """catches: keys laid out (B*H, D, L) by a view instead of a transpose (each key column then holds features of
    several tokens) was certified without a mask and mask-inverted with one; a scale multiplied into the weights
    after the softmax was mask-after-softmax on a module with no mask; heads merged without the transpose back were
    also mask-inverted beside head-merge."""
    assert check(FoldedHeads()).verdict == "passed"
    def errors(report: object) -> set[str]:
        return {f.id for f in report.findings if f.severity == "error"}  # type: ignore[attr-defined]

    for report in (check(FoldedHeads(keys="view")), check(FoldedHeads(keys="view"), no_mask=True)):
        assert errors(report) == {"head-split"}, [(f.id, f.message) for f in report.findings]
    scaled = check(FoldedHeads(scale="weights"), no_mask=True)
    assert errors(scaled) == {"missing-scale"} and "after the softmax" in str(scaled.findings), scaled.ids
    merged = check(FoldedHeads(merge="view"))
    assert "head-merge" in merged.ids and "mask-inverted" not in merged.ids, merged.ids


class TinyInitialised(nn.Module):
    """Correct, an additive (B, 1, 1, L) mask, every weight drawn at 1e-10 (Pix2Struct's config initialises so): the
    outputs are about 1e-19 in size."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        for w in (self.qkv.weight, self.out.weight):
            nn.init.normal_(w, std=1e-10)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if attention_mask is not None:
            scores = scores + attention_mask
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_a_mask_that_changes_outputs_of_1e_19_changes_them():
    """catches: a module whose weights are drawn at 1e-10 gives outputs of about 1e-19, which every mask changed by
    less than 1e-4 of 1: each was "accepted, but changed nothing" and the module was mask-ignored."""
    report = check(TinyInitialised())
    assert "mask-ignored" not in report.ids and report.inferred["mask"]["kind"] == "additive", report.ids


class BiasedScores(_Fused):
    """Correct, a bias on the scores: a learned table per head and token pair (``table``, as Swin's or T5's), plus
    what the call passes per item (``bias`` (B, H, L, L): a pair representation's bias, as protein and molecule
    models add). ``alone``: the module runs at batch 1 only (a cache allocated for one sequence); ``scale``: the
    scale on the scores (1/sqrt(E) is the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, alone: bool = False, scale: float | None = None) -> None:
        super().__init__(dim, heads)
        self.alone, self.scale = alone, scale if scale is not None else (dim // heads) ** -0.5
        self.table = nn.Parameter(torch.randn(heads, 16, 16))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.alone and x.shape[0] != 1:
            raise ValueError("the cache holds one sequence")
        q, k, v = self.split(x)
        n = x.shape[1]
        s = q @ k.transpose(-1, -2) * self.scale + self.table[:, :n, :n]
        return self.merge((s if bias is None else s + bias).softmax(-1) @ v)


def test_a_bias_per_item_or_on_an_item_alone_is_told_from_the_scale():
    """catches: with a bias that differs between items (what the call passes per item), the scores were no multiple
    of the product plus one term (definition-mismatch); on an item alone, the bias and the scale blended and the
    scale read was a little off (wrong-scale). The scale is read on a second run on other tokens, where the bias
    stays what it was; a wrong scale is still named."""
    assert check(BiasedScores(alone=True), batch=1).verdict == "passed"
    assert "wrong-scale" in check(BiasedScores(alone=True, scale=64 ** -0.5), batch=1).ids
    torch.manual_seed(0)
    bias = torch.randn(3, 4, 7, 7)
    per_item = check(BiasedScores(), call=lambda m, x: m(x, bias.to(x.dtype)), batch=3, length=7)
    assert per_item.verdict == "passed", [(f.id, f.message) for f in per_item.findings]
    wrong = check(BiasedScores(scale=64 ** -0.5), call=lambda m, x: m(x, bias.to(x.dtype)), batch=3, length=7)
    assert "wrong-scale" in wrong.ids, wrong.ids


class FixedResolution(_Fused):
    """Correct, attention over a fixed 8 x 8 grid of tokens with E = 64 (a Swin block built for one input
    resolution asserts its length), at any batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 64:
            raise ValueError("input feature has wrong size")
        q, k, v = self.split(x)
        return self.merge(F.scaled_dot_product_attention(q, k, v))


def test_a_fixed_length_that_equals_the_width_is_a_length_not_batch_mixing():
    """catches: a module that runs at any batch but at its one length, 64 tokens, as wide as its embed dim, ran only
    at shapes where two of B, L and E coincide, and was batch-mixing ("sizes line up")."""
    report = check(FixedResolution(64))
    assert report.verdict == "passed" and "own length" in report.inferred["lengths"], report.ids


class KeyPaddingToSDPA(_Fused):
    """A key padding mask (B, L) handed to SDPA: correct with its ``~`` (torch's convention: True = padding), the
    bug without it (``invert=False``: SDPA's attn_mask keeps where True)."""

    def __init__(self, dim: int, invert: bool = True) -> None:
        super().__init__(dim)
        self.invert = invert

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        keep = None if key_padding_mask is None else \
            (~key_padding_mask if self.invert else key_padding_mask)[:, None, None, :]
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_a_key_padding_mask_read_true_keep_is_a_convention_warning():
    """catches: a key_padding_mask given to SDPA without its ~ (a common port) reads True = may attend, against its
    name: certified without a word, as attention_mask read the other way already was not."""
    assert "mask-convention" not in check(KeyPaddingToSDPA(32)).ids
    report = check(KeyPaddingToSDPA(32, invert=False))
    assert "mask-convention" in report.ids and "True = padding" in str(report.findings), report.ids


class LongPathDropsMask(_Fused):
    """Correct below 128 tokens; ``drops``: from 128 tokens on, a fused path that forgets the padding mask (the bug
    a threshold for long sequences hides from short probes)."""

    def __init__(self, dim: int, drops: bool = False) -> None:
        super().__init__(dim)
        self.drops = drops

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        if self.drops and x.shape[1] >= 128:
            keep = None
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_a_mask_dropped_past_128_tokens_is_found():
    """catches: a long-sequence path that drops the padding mask from 128 tokens on was certified: the padding probe
    stopped at 64 tokens; it also runs at 300."""
    assert check(LongPathDropsMask(32)).verdict == "passed"
    report = check(LongPathDropsMask(32, drops=True))
    assert "mask-ignored" in report.ids and "300 tokens" in str(report.findings), report.ids


class MaskCachedByShape(_Fused):
    """A key mask (B, L), True = attend, expanded once per shape and kept on the module (the bug: a later call with
    another mask of the same shape gets the first call's); ``keyed``: the cache also keyed by the mask itself."""

    def __init__(self, dim: int, keyed: bool = False) -> None:
        super().__init__(dim)
        self.keyed = keyed
        self._seen: torch.Tensor | None = None
        self._expanded: torch.Tensor | None = None

    def expanded(self, mask: torch.Tensor) -> torch.Tensor:
        if self._seen is None or self._expanded is None or self._seen.shape != mask.shape or \
                (self.keyed and not torch.equal(self._seen, mask)):
            self._seen, self._expanded = mask.clone(), mask[:, None, None, :].bool()
        return self._expanded

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.split(x)
        keep = None if mask is None else self.expanded(mask)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


def test_a_mask_cached_by_its_shape_is_found_on_calls_in_a_row():
    """catches: a mask expanded once and kept by its shape gives a later call the first call's mask; every probe's
    call meets the module as given (its state put back), so it was certified. Two calls in a row, with a padding
    mask then one that hides nothing, must give the second alone's output."""
    assert check(MaskCachedByShape(32, keyed=True)).verdict == "passed"
    report = check(MaskCachedByShape(32))
    assert "mask-ignored" in report.ids and "in a row" in str(report.findings), report.ids


class HeadMajorFold(nn.Module):
    """Heads folded into the batch for bmm with a key padding mask (B, L), True = padding, viewed (B, H, L, L) to be
    applied. ``head_major``: the fold is (H * B) (the bug: the view then gives items each other's masks); else
    (B * H), correct."""

    def __init__(self, dim: int = 64, heads: int = 4, head_major: bool = False) -> None:
        super().__init__()
        self.heads, self.head_major = heads, head_major
        self.in_proj, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape
        d = e // self.heads
        order = (2, 1, 0, 3) if self.head_major else (1, 2, 0, 3)  # (H, B, L, D) or (B, H, L, D)
        q, k, v = (t.reshape(n, b, self.heads, d).permute(*order).reshape(-1, n, d)
                   for t in self.in_proj(x.transpose(0, 1)).chunk(3, -1))
        w = torch.bmm(q * d ** -0.5, k.transpose(1, 2))
        if key_padding_mask is not None:
            w = w.view(b, self.heads, n, n).masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
            w = w.view(-1, n, n)
        o = torch.bmm(w.softmax(-1), v)
        o = o.view(self.heads, b, n, d).permute(1, 2, 0, 3) if self.head_major else \
            o.view(b, self.heads, n, d).permute(0, 2, 1, 3)
        return self.out_proj(o.reshape(b, n, e))


def test_items_given_each_others_masks_are_mask_ignored_not_inverted():
    """catches: heads folded head-major, (H * B), with the key padding mask viewed batch-major gives items each
    other's masks: the convention matched none, and the white box read the polarity it was sent as inverted
    (mask-inverted, whose fix flips a mask the module reads right)."""
    assert check(HeadMajorFold()).verdict == "passed"
    report = check(HeadMajorFold(head_major=True))
    assert "mask-ignored" in report.ids and "mask-inverted" not in report.ids, report.ids


class UnshiftedRelPositions(dw.RelPositionSelfAttention):
    """ESPnet's relative attention with its rel_shift dropped: the (q, position) product read at the key's own
    column, so the position term depends on where the key is, not on its distance to the query."""

    def matrix_bd(self, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        scores = dw.RelPositionMultiHeadedAttention.matrix_bd(self, q, p)
        return scores[..., : scores.size(-1) // 2 + 1]


def test_relative_positions_read_at_the_keys_own_column_are_named():
    """catches: a relative-position term without its rel_shift (it depends on the key's column, not on i - j) was
    certified and reported as relative positions: with one token everywhere, two pairs the same distance apart must
    score alike."""
    torch.manual_seed(0)
    assert check(dw.RelPositionSelfAttention(4, 64, 0.0)).verdict == "passed"
    report = check(UnshiftedRelPositions(4, 64, 0.0))
    assert "definition-mismatch" in report.ids and "not relative" in str(report.findings), report.ids


class VmappedHeads(_Fused):
    """Correct, one head's attention written for one item and mapped over the batch and the heads with torch.vmap
    (as JAX ports write it)."""

    @staticmethod
    def one_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (q @ k.T / math.sqrt(q.shape[-1])).softmax(-1) @ v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split(x)
        return self.merge(torch.vmap(torch.vmap(self.one_head))(q, k, v))


def test_heads_mapped_with_vmap_are_not_a_doctor_error():
    """catches: the record kept tensors made inside torch.vmap, which do not outlive it: the white box raised inside
    the doctor (inconclusive, a doctor error) on a correct module."""
    report = check(VmappedHeads(32))
    assert report.verdict == "passed" and not report.not_verified, report.not_verified



def test_tokens_kept_last_after_the_attention_are_read_as_tokens():
    """catches: a channels-first attention keeps its tokens on the last axis of the values product (timm's
    Attention2d: (B, heads, D, N), then a view back to the map); the swap of two tokens was counted on the other
    axes only, so that view looked like spreading them over others (head-merge on a correct module)."""
    maxxvit = pytest.importorskip("timm.models.maxxvit")
    report = check(maxxvit.Attention2d(64, 64, dim_head=16))
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]


class HeadsFirstSetBlock(nn.Module):
    """Correct, a set-attention block in the style of Set Transformer's MAB: heads folded into the batch heads
    first by concatenating the feature splits (row h * B + b), a presence mask (B, N), True = element, repeated once
    per head to follow that fold, and the queries added back. ``interleaved``: the mask repeated item by item
    instead (row b * H + h), which hands each row another item's mask."""

    def __init__(self, dim: int = 64, heads: int = 4, interleaved: bool = False) -> None:
        super().__init__()
        self.heads, self.interleaved = heads, interleaved
        self.fc_q, self.fc_k, self.fc_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.fc_o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        d = x.shape[-1] // self.heads
        q, k, v = (torch.cat(t.split(d, 2), 0) for t in (self.fc_q(x), self.fc_k(x), self.fc_v(x)))
        scores = q.bmm(k.transpose(1, 2)) / math.sqrt(d)
        if mask is not None:
            rows = mask.repeat_interleave(self.heads, 0) if self.interleaved else mask.repeat(self.heads, 1)
            scores = scores.masked_fill(~rows[:, None, :], float("-inf"))
        o = torch.cat((q + scores.softmax(2).bmm(v)).split(x.shape[0], 0), 2)
        return o + F.relu(self.fc_o(o))


def test_a_mask_repeated_for_heads_folded_heads_first_is_read_per_item():
    """catches: scores with heads folded in front of the batch (H * B rows) were read as if folded batch first, so a
    presence mask repeated to follow that fold hid "other keys than the mask" (mask-ignored on a correct module)."""
    report = check(HeadsFirstSetBlock())
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "mask-ignored" in check(HeadsFirstSetBlock(interleaved=True)).ids


class LearnedDistanceBias(nn.Module):
    """Correct, a learned relative-position bias: one table of 2 * max_len - 1 distances per head, read at
    j - i + max_len - 1 (as in many text and speech encoders). ``summed``: read at i + j instead, so the bias
    depends on where the pair is, not on its distance (2L - 1 entries are read all the same). ``absolute``: a
    learned absolute embedding added to the tokens too (BEiT with both), which makes scores depend on where a pair
    is by design."""

    def __init__(self, dim: int = 64, heads: int = 4, max_len: int = 32, summed: bool = False,
                 absolute: bool = False) -> None:
        super().__init__()
        self.heads, self.max_len, self.summed = heads, max_len, summed
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.randn(2 * max_len - 1, heads))
        self.absolute = nn.Parameter(torch.randn(max_len, dim)) if absolute else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        if self.absolute is not None:
            x = x + self.absolute[:n]
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        at = torch.arange(n)
        where = at[:, None] + at[None, :] if self.summed else at[None, :] - at[:, None] + self.max_len - 1
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + self.table[where].permute(2, 0, 1)
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class GridDistanceBias(nn.Module):
    """Correct, attention over a (B, C, H, W) map with a table of (2H - 1)(2W - 1) 2-D distances per head (Swin's
    and MaxViT's form, for the whole map). ``summed``: each axis's offset read as the sum of the two positions."""

    def __init__(self, dim: int = 32, heads: int = 4, side: int = 4, summed: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Conv2d(dim, 3 * dim, 1), nn.Conv2d(dim, dim, 1)
        self.table = nn.Parameter(torch.randn((2 * side - 1) ** 2, heads))
        r, c = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        r, c = r.flatten(), c.flatten()
        dr = r[:, None] + r[None, :] if summed else r[:, None] - r[None, :] + side - 1
        dc = c[:, None] + c[None, :] if summed else c[:, None] - c[None, :] + side - 1
        self.register_buffer("index", dr * (2 * side - 1) + dc, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, e, h, w = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, self.heads, e // self.heads, h * w).unbind(1)
        scores = q.transpose(-2, -1) @ k * (e // self.heads) ** -0.5 + self.table[self.index].permute(2, 0, 1)
        out = v @ scores.softmax(-1).transpose(-2, -1)
        return self.proj(out.reshape(b, e, h, w))


def test_a_distance_table_read_at_absolute_positions_is_named():
    """catches: a table of relative distances (2M - 1 entries, or (2H - 1)(2W - 1) on a map) read at i + j: every
    entry of the table is read, so the record held no sign that the bias should be relative, and the bias of
    (head, query, key) was certified as a relative-position bias."""
    torch.manual_seed(0)
    assert check(LearnedDistanceBias()).verdict == "passed"
    assert check(LearnedDistanceBias(absolute=True)).verdict == "passed"  # what the table adds is judged
    report = check(LearnedDistanceBias(summed=True))
    assert "definition-mismatch" in report.ids and "not relative" in str(report.findings), report.ids
    assert check(GridDistanceBias(), length=16).verdict == "passed"
    assert "definition-mismatch" in check(GridDistanceBias(summed=True), length=16).ids


class FoldedBaddbmm(nn.Module):
    """Correct, Megatron's and BLOOM's core: heads folded into the batch and the scores made by baddbmm into an
    empty buffer (beta=0, alpha = 1/sqrt(D)). ``keys_reshaped``: k laid out (B * H, D, L) by a reshape instead of a
    transpose, which puts one token's features on the rows of others."""

    def __init__(self, hidden_size: int = 64, heads: int = 4, keys_reshaped: bool = False) -> None:
        super().__init__()
        self.heads, self.keys_reshaped = heads, keys_reshaped
        self.query_key_value, self.dense = nn.Linear(hidden_size, 3 * hidden_size), nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, n, e = hidden_states.shape
        d = e // self.heads
        q, k, v = (t.permute(0, 2, 1, 3).reshape(b * self.heads, n, d)
                   for t in self.query_key_value(hidden_states).view(b, n, self.heads, 3 * d).split(d, -1))
        kt = k.reshape(b * self.heads, d, n) if self.keys_reshaped else k.transpose(1, 2)
        scores = torch.baddbmm(q.new_empty(b * self.heads, n, n), q, kt, beta=0.0, alpha=d ** -0.5)
        out = torch.bmm(scores.softmax(-1), v).view(b, self.heads, n, d).permute(0, 2, 1, 3).reshape(b, n, e)
        return self.dense(out)


def test_keys_reshaped_for_baddbmm_are_a_head_split():
    """catches: the operands of baddbmm were not read for which token each row holds, so keys laid out (B * H, D, L)
    by a reshape were certified (only not-equivariant, a warning)."""
    assert check(FoldedBaddbmm()).verdict == "passed"
    assert "head-split" in check(FoldedBaddbmm(keys_reshaped=True)).ids


class LearnedSinkLogit(nn.Module):
    """Correct, gpt-oss's attention sinks: a learned logit per head joins each row of the scores as a column of its
    own, takes part in the softmax and is dropped after it, so the weights of a row sum to less than 1.
    ``on_every_score``: the logit added to every score of the row instead, which the softmax cancels."""

    def __init__(self, dim: int = 64, heads: int = 4, on_every_score: bool = False) -> None:
        super().__init__()
        self.heads, self.on_every_score = heads, on_every_score
        self.qkv, self.o_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.sinks = nn.Parameter(torch.randn(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        sink = self.sinks.view(1, -1, 1, 1)
        if self.on_every_score:
            weights = (scores + sink).softmax(-1)
        else:
            weights = torch.cat([scores, sink.expand(b, -1, n, 1)], -1).softmax(-1)[..., :-1]
        return self.o_proj((weights @ v).transpose(1, 2).reshape(b, n, e))


class KernelsByRole(FlaxStyle):
    """Flax-style kernels with the keys projected by the query kernel: the key kernel is never used."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = (torch.einsum("...e,ehd->...hd", x, w) for w in (self.query, self.query, self.value))
        w = torch.einsum("...qhd,...khd->...hqk", q / math.sqrt(q.shape[-1]), k).softmax(-1)
        return torch.einsum("...hd,hde->...e", torch.einsum("...hqk,...khd->...qhd", w, v), self.out)


class SeparateProjWeights(nn.Module):
    """Correct, torch's functional multi-head attention with its projections held as separate raw weights
    (``use_separate_proj_weight``). ``keys_by_query``: the key weight passed is the query's."""

    def __init__(self, dim: int = 64, heads: int = 4, keys_by_query: bool = False) -> None:
        super().__init__()
        self.heads, self.keys_by_query = heads, keys_by_query
        self.q_proj_weight, self.k_proj_weight, self.v_proj_weight = (
            nn.Parameter(torch.randn(dim, dim) * dim ** -0.5) for _ in range(3))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.transpose(0, 1)
        out, _ = F.multi_head_attention_forward(
            t, t, t, t.shape[-1], self.heads, None, self.in_proj_bias, None, None, False, 0.0, self.out_proj.weight,
            self.out_proj.bias, training=False, need_weights=False, use_separate_proj_weight=True,
            q_proj_weight=self.q_proj_weight, v_proj_weight=self.v_proj_weight,
            k_proj_weight=self.q_proj_weight if self.keys_by_query else self.k_proj_weight)
        return out.transpose(0, 1)


class RawProjections(nn.Module):
    """Correct, projections held as raw parameters with short names (wq, bq, ...). The key's bias gets a gradient
    of 0, as nn.Linear's does (q . b_k is the same for every key), and is a projection's part, not a tensor of the
    module's own that changes nothing."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        for role in "qkvo":
            setattr(self, f"w{role}", nn.Parameter(torch.randn(dim, dim) * dim ** -0.5))
            setattr(self, f"b{role}", nn.Parameter(torch.randn(dim) * 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = ((x @ getattr(self, f"w{r}") + getattr(self, f"b{r}")).view(b, n, self.heads, -1).transpose(1, 2)
                   for r in "qkv")
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, e)
        return out @ self.wo + self.bo


def test_parameters_that_change_nothing_are_no_grad():
    """catches: a learned sink logit added to every score (the softmax cancels it: its float64 gradient is rounding
    of 0), and a key weight held as a raw parameter that the call never uses (the keys projected by the query's
    weight or kernel), were certified: only nn.Linear projections were compared with their siblings."""
    torch.manual_seed(0)
    assert check(LearnedSinkLogit(), causal=True).verdict == "passed"
    assert "no-grad" in check(LearnedSinkLogit(on_every_score=True), causal=True).ids
    assert check(SeparateProjWeights()).verdict == "passed"
    assert "no-grad" in check(SeparateProjWeights(keys_by_query=True)).ids
    assert "no-grad" in check(KernelsByRole()).ids
    assert check(RawProjections()).verdict == "passed"


class MaskedWhereTrue(nn.Module):
    """Correct, ChatGLM's convention: a full (B, 1, L, L) mask, True = masked, with its own causal pattern, flipped
    for SDPA's True = attend. ``as_given``: the mask handed to SDPA without its ~, read the other way round."""

    def __init__(self, dim: int = 64, heads: int = 4, as_given: bool = False) -> None:
        super().__init__()
        self.heads, self.as_given = heads, as_given
        self.qkv, self.dense = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keep = attention_mask if self.as_given else ~attention_mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.dense(out.transpose(1, 2).reshape(b, n, e))


def test_a_mask_read_the_other_way_round_from_a_stated_convention_is_inverted():
    """catches: a mask whose effect matched no convention had its white-box reading "hides the keys the mask keeps"
    turned into mask-ignored, even when the user stated the convention (--mask): then the polarity is known, and the
    reading is mask-inverted."""
    report = check(MaskedWhereTrue(), causal=True, mask="ignore (B,1,L,L)")
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert "mask-inverted" in check(MaskedWhereTrue(as_given=True), causal=True, mask="ignore (B,1,L,L)").ids


def test_a_scripted_module_is_inconclusive_without_a_doctor_error():
    """catches: the white box hooked a torch.jit.script module's layers, which TorchScript refuses: a doctor error
    (inconclusive for the wrong reason). The record cannot follow TorchScript's operations, so the white box says
    so and names the Python class to check instead."""
    report = check(torch.jit.script(FoldedBaddbmm()))
    said = report.coverage["white_box"]
    assert report.verdict == "inconclusive" and "TorchScript" in said and "doctor error" not in said, said
    masked = check(torch.jit.script(HeadsFirstSetBlock()), mask="keep (B,L)")  # the mask probe hooks no layer of it
    assert masked.verdict == "inconclusive" and masked.coverage["mask"] == "verified", masked.ids


class SkewedRelative(nn.Module):
    """Correct, Music Transformer's causal relative attention: one embedding per distance (the last row for distance
    0), q times those embeddings "skewed" into place by a left pad and a reshape. ``first_rows``: the embeddings
    taken from the table's first L rows instead of its last, so which distance a column means depends on L."""

    def __init__(self, dim: int = 64, heads: int = 4, max_len: int = 32, first_rows: bool = False) -> None:
        super().__init__()
        self.heads, self.max_len, self.first_rows = heads, max_len, first_rows
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.distances = nn.Parameter(torch.randn(max_len, dim // heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        table = self.distances[:n] if self.first_rows else self.distances[self.max_len - n:]
        rel = F.pad(q @ table.T, (1, 0)).reshape(b, self.heads, n + 1, n)[:, :, 1:]
        scores = (q @ k.transpose(-2, -1) + rel) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_a_causal_output_that_depends_on_the_length_is_a_leak():
    """catches: relative embeddings cut from the table's first rows depend on how many tokens there are, so an
    earlier output changes when a token is appended; no probe compared a causal module's outputs at two lengths,
    and the module was certified."""
    torch.manual_seed(0)
    assert check(SkewedRelative(), causal=True).verdict == "passed"
    report = check(SkewedRelative(first_rows=True), causal=True)
    assert "causal-leak" in report.ids and "tokens are dropped" in str(report.findings), report.ids


class CachedKeys(nn.Module):
    """Keys and values kept between calls. ``grow``: appended to (a decoding cache, a design: every call stores its
    own); else reused whenever the next call has the same shape (the bug: a new input of that shape attends to the
    old input's keys)."""

    def __init__(self, dim: int = 64, heads: int = 4, grow: bool = False) -> None:
        super().__init__()
        self.heads, self.grow = heads, grow
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.grow:
            if self.keys is not None and self.keys.shape[0] == b:
                k, v = torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2)
            self.keys, self.values = k.detach(), v.detach()
        elif self.keys is not None and self.keys.shape == k.shape:
            k, v = self.keys, self.values
        else:
            self.keys, self.values = k.detach(), v.detach()
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out(out.transpose(1, 2).reshape(b, n, e))


def test_a_cache_reused_for_other_tokens_of_the_same_shape_is_state_dependent():
    """catches: calls in a row were made at four shapes, never the same one twice with other tokens, so keys cached
    by their shape and reused for a new input were certified; a cache that grows stays a design."""
    assert "state-dependent" in check(CachedKeys()).ids
    assert "state-dependent" not in check(CachedKeys(grow=True)).ids


class SparseCausal(nn.Module):
    """Correct, the Sparse Transformer's causal patterns (block size 3) as one mask: ``strided``, each query sees the
    2 keys before it and every third key further back; ``fixed``, its own block up to itself and the last column
    of every earlier block; ``dilated``, the keys 0, 2 and 4 positions back."""

    def __init__(self, dim: int = 64, heads: int = 4, pattern: str = "strided") -> None:
        super().__init__()
        self.heads, self.pattern = heads, pattern
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, e = x.shape
        i = torch.arange(n)
        back = i[:, None] - i[None, :]
        keep = {"strided": (back < 3) | (back % 3 == 0), "dilated": (back % 2 == 0) & (back <= 4),
                "fixed": (i[:, None] // 3 == i[None, :] // 3) | (i[None, :] % 3 == 2)}[self.pattern] & (back >= 0)
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.proj(out.transpose(1, 2).reshape(b, n, e))


@pytest.mark.parametrize("pattern", ["strided", "fixed", "dilated"])
def test_the_sparse_transformers_causal_patterns_are_designs(pattern: str):
    """catches: a causal pattern that hides some past keys outside any window was causal-leak, although the Sparse
    Transformer's strided and fixed patterns (and a dilated causal window) hide exactly such keys by design."""
    report = check(SparseCausal(pattern=pattern), causal=True)
    assert report.verdict == "passed" and "Sparse Transformer" in report.inferred["window"], report.ids


def test_a_mask_behind_layer_scale_is_read():
    """catches: a pre-norm block whose attention branch is scaled by LayerScale at its usual start (1e-5, timm's
    init_values for DeiT III and CaiT) changes its output by 1e-6 of its size under a mask, below the 1e-4 that
    counted as "changed nothing": a correct block was mask-ignored. In float64 such a change counts."""
    vision_transformer = pytest.importorskip("timm.models.vision_transformer")
    block = vision_transformer.Block(64, 4, qkv_bias=True, init_values=1e-5)
    if "attn_mask" not in inspect.signature(block.forward).parameters:
        pytest.skip("this timm's Block takes no mask")
    report = check(block)
    assert report.verdict == "passed", [(f.id, f.message) for f in report.findings]
    assert report.inferred["mask"]["argument"] == "attn_mask"

"""Attention modules: they own projections and call ``functional.attention``; they never pick a backend.

Shape legend: B batch, L (Lq) query length, S (Lk) context length, E embed dim, H query heads,
G kv heads, D = E // H head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .cache import KVCache
from .functional import Causal, attention, attention_with_weights
from .masks import Mask
from .paged_cache import PagedKVCache, SeqIds
from .rope import rope as apply_rope

__all__ = ["MultiHeadAttention", "SelfAttention"]


def _check_input(name: str, x: object, embed_dim: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (B, L, E), got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != embed_dim:
        raise ValueError(f"{name} must be (B, L, E) with E = {embed_dim}, got shape {tuple(x.shape)}")
    return x


def _module_mask(mask: Mask | Tensor | None) -> Mask | Tensor | None:
    """A 3-D bool mask (B, Lq, Lk), the single-head habit, gains a head dim: (B, 1, Lq, Lk)."""
    if isinstance(mask, Tensor) and mask.dim() == 3:
        return mask.unsqueeze(1)
    return mask


class SelfAttention(nn.Module):
    """Single-head self-attention, the tutorial's module: ``softmax(Q K^T / sqrt(E)) V``.

    Parameters are named ``query``, ``key`` and ``value`` as in the tutorial, so its state
    dicts load directly.

    Args:
        embed_dim: E, the size of each token's vector (also the head dim).
        dropout: dropout on the attention weights while training.
        bias: whether the Q/K/V projections have a bias.

    Example:
        >>> attn = SelfAttention(512)
        >>> out = attn(torch.randn(32, 10, 512))                      # (32, 10, 512)
        >>> out, w = attn(x, mask=torch.ones(10, 10, dtype=torch.bool).tril(), need_weights=True)
    """

    def __init__(self, embed_dim: int, *, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        if embed_dim < 1:
            raise ValueError(f"embed_dim must be >= 1, got {embed_dim}")
        self.embed_dim = embed_dim
        self.dropout = dropout
        self.query = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.key = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.value = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, x: Tensor, mask: Mask | Tensor | None = None, need_weights: bool = False,
                *, causal: Causal = False) -> Tensor | tuple[Tensor, Tensor]:
        """x: (B, L, E); mask: bool (L, L), (B, L, L) or a Mask, True = may attend.

        Returns the output (B, L, E), and with ``need_weights`` also the weights (B, L, L).
        """
        x = _check_input("x", x, self.embed_dim)
        q = self.query(x).unsqueeze(1)  # (B, 1, L, E): one head
        k = self.key(x).unsqueeze(1)
        v = self.value(x).unsqueeze(1)
        m, dropout_p = _module_mask(mask), self.dropout if self.training else 0.0
        if need_weights:
            out, w = attention_with_weights(q, k, v, mask=m, causal=causal, dropout_p=dropout_p)
            return out.squeeze(1), w.squeeze(1)
        return attention(q, k, v, mask=m, causal=causal, dropout_p=dropout_p).squeeze(1)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with a fused QKV projection, GQA/MQA, RoPE, a KV cache and cross-attention.

    Parameters: ``qkv`` (E -> E + 2 * G * D, rows ordered [q | k | v]) and ``proj`` (E -> E),
    named as in the tutorial so its state dicts load when G == H.

    Args:
        embed_dim: E. num_heads: H, must divide E. num_kv_heads: G (default H); H % G == 0.
            G == 1 is multi-query attention.
        dropout: dropout on the attention weights while training.
        bias: whether the projections have biases.
        rope: rotary position embeddings on q and k: False, True (base 10000) or the base.

    Example:
        >>> mha = MultiHeadAttention(512, 8, num_kv_heads=2)
        >>> y = mha(torch.randn(2, 100, 512), causal=True)            # (2, 100, 512)
        >>> y = mha(x, context=memory)                                # cross-attention
        >>> y = mha(x, cache=paged, seq_ids=[a, b])                   # decoding with a PagedKVCache
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 dropout: float = 0.0, bias: bool = True, rope: bool | float = False) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        if rope is not False and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dim, got {self.head_dim}")
        self.dropout = dropout
        self.rope_base = None if rope is False else (10000.0 if rope is True else float(rope))
        kv_dim = num_kv_heads * self.head_dim
        self.qkv = nn.Linear(embed_dim, embed_dim + 2 * kv_dim, bias=bias)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _project_cross(self, x: Tensor, context: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, L, D) from x, k and v (B, G, S, D) from context: views of the projections."""
        b, lq, _ = x.shape
        h, g, d = self.num_heads, self.num_kv_heads, self.head_dim
        e, kv_dim, lk = self.embed_dim, g * d, context.shape[1]
        w, bias = self.qkv.weight, self.qkv.bias
        q = nn.functional.linear(x, w[:e], None if bias is None else bias[:e])
        kv = nn.functional.linear(context, w[e:], None if bias is None else bias[e:])
        k, v = kv.split([kv_dim, kv_dim], dim=-1)
        return (q.view(b, lq, h, d).transpose(1, 2), k.view(b, lk, g, d).transpose(1, 2),
                v.view(b, lk, g, d).transpose(1, 2))

    def forward(self, x: Tensor, mask: Mask | Tensor | None = None, *, context: Tensor | None = None,
                causal: Causal = False, need_weights: bool = False, cache: KVCache | PagedKVCache | None = None,
                positions: Tensor | None = None, seq_ids: SeqIds | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x: (B, L, E); context: (B, S, E) for cross-attention (default: x itself).

        mask: bool (L, S), (B, L, S), (B, H, L, S) or a Mask; True = may attend.
        cache: a KVCache; the new tokens' keys and values are written at ``positions`` and each
            query sees the cached tokens of its own sequence at positions <= its own.
            Or a PagedKVCache: the new tokens are appended to the sequences ``seq_ids`` and each
            query sees its sequence's tokens up to its own; positions come from the cache.
        positions: int (B, L) or (L,), each token's position in its sequence (RoPE and the
            cache; -1 marks padding: not cached, attention output 0). Default: 0..L-1.
        seq_ids: with a PagedKVCache, the sequence of each row of x (x (B, L, E): L new tokens each),
            or of each packed range of ``cu_seqlens``.
        cu_seqlens: with a PagedKVCache, int32 (N + 1,): x is (1, T, E), the new tokens of the N
            sequences packed (a mixed step: prefill chunks and single decode tokens in one call).
        Returns (B, L, E), and with ``need_weights`` also per-head weights (B, H, L, S).
        """
        x = _check_input("x", x, self.embed_dim)
        if isinstance(cache, PagedKVCache):
            if mask is not None or causal is not False or context is not None or need_weights:
                raise ValueError("with a PagedKVCache each query sees its sequence's tokens up to its own; don't pass "
                                 "mask, causal, context or need_weights (it returns no weights)")
            return self._forward_paged(x, cache, positions, seq_ids, cu_seqlens)
        if seq_ids is not None or cu_seqlens is not None:
            raise ValueError("seq_ids and cu_seqlens address the sequences of a PagedKVCache; pass cache=PagedKVCache"
                             "(...), or use positions with a KVCache")
        if context is not None:
            context = _check_input("context", context, self.embed_dim)
        if cache is not None:  # checked before any work, so a wrong call leaves the cache as it was
            if positions is None:
                raise ValueError("a cache needs positions: int (B, L), each new token's position in its sequence")
            if mask is not None or causal is not False or context is not None:
                raise ValueError("with a cache, visibility comes from positions (each query sees its sequence's "
                                 "tokens at positions <= its own); don't pass mask, causal or context")
            weight = self.qkv.weight
            cache.check_fits(weight.dtype, weight.device, f"this {type(self).__name__}'s projection")
        b, lq, _ = x.shape
        if context is None:
            # one view of the fused projection as (B, H + 2G, L, D) heads, split into three views
            # (q (B, H, L, D), k and v (B, G, L, D)): the strides of splitting the projection first,
            # in fewer ops, since this runs every decode step
            h, g = self.num_heads, self.num_kv_heads
            q, k, v = self.qkv(x).view(b, lq, h + 2 * g, self.head_dim).transpose(1, 2).split((h, g, g), dim=1)
        else:
            q, k, v = self._project_cross(x, context)  # (B, H, L, D), (B, G, S, D), (B, G, S, D)
        if positions is not None and positions.dim() == 1:
            positions = positions.expand(b, -1)
        if self.rope_base is not None:
            if context is not None:
                raise ValueError("rope is for self-attention; cross-attention (context=) has no shared positions")
            pos = torch.arange(lq, device=x.device) if positions is None else positions.clamp(min=0)
            q, k = apply_rope(q, pos, base=self.rope_base), apply_rope(k, pos, base=self.rope_base)
        if cache is not None:
            assert positions is not None  # checked above
            k, v, mask = cache.update(positions, k, v)  # (B, G, S', D), (B, 1, L, S') or None
        dropout_p = self.dropout if self.training else 0.0
        if mask is not None:
            mask = _module_mask(mask)
        if need_weights:
            out, w = attention_with_weights(q, k, v, mask=mask, causal=causal, dropout_p=dropout_p)
        else:
            out = attention(q, k, v, mask=mask, causal=causal, dropout_p=dropout_p)
        out = self.proj(out.transpose(1, 2).reshape(b, lq, self.embed_dim))  # (B, L, E)
        return (out, w) if need_weights else out

    def _forward_paged(self, x: Tensor, cache: PagedKVCache, positions: Tensor | None, seq_ids: SeqIds | None,
                       cu_seqlens: Tensor | None) -> Tensor:
        """A step with a PagedKVCache: project the new tokens packed as (T, E), rotate them at the positions
        the cache gives, append their keys and values, attend over each sequence's pages."""
        if positions is not None:
            raise ValueError("a PagedKVCache appends each sequence's new tokens after its cached ones, so their "
                             "positions come from the cache (cache.positions(seq_ids, cu_seqlens)); don't pass "
                             "positions")
        if seq_ids is None:
            raise ValueError("a PagedKVCache needs seq_ids: the cache's sequence id of each row of x (from "
                             "cache.allocate()), or of each packed range of cu_seqlens")
        weight = self.qkv.weight
        cache.check_fits(weight.dtype, weight.device, f"this {type(self).__name__}'s projection")
        ids = cache.check_ids(seq_ids)
        b, lq, e = x.shape
        if cu_seqlens is None:
            if len(ids) != b:
                raise ValueError(f"seq_ids names {len(ids)} sequences but x has B = {b} rows; give one id per row "
                                 "of x (its L tokens go to that sequence), or pack x as (1, T, E) with cu_seqlens")
            # a decode step (one token a row) needs no cu_seqlens: the cache's calls then take one token each
            cu = None if lq == 1 else torch.arange(b + 1, dtype=torch.int32, device=x.device) * lq
        elif b != 1:
            raise ValueError(f"with cu_seqlens, x must be (1, T, E), the new tokens of every sequence packed along "
                             f"dim 1, got shape {tuple(x.shape)}")
        else:
            cu = cu_seqlens
        t = b * lq
        pos = cache.positions(ids, cu) if self.rope_base is not None or cu is not None else None  # checks cu
        if pos is not None and pos.numel() != t:
            raise ValueError(f"cu_seqlens ends at {pos.numel()} tokens but x holds T = {t} (dim 1); its last entry "
                             "must be the number of packed tokens")
        h, g, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x.reshape(t, e)).view(t, h + 2 * g, d).split((h, g, g), dim=1)  # (T, H|G, D)
        if self.rope_base is not None:
            assert pos is not None
            q = apply_rope(q.transpose(0, 1)[None], pos, base=self.rope_base)[0].transpose(0, 1)
            k = apply_rope(k.transpose(0, 1)[None], pos, base=self.rope_base)[0].transpose(0, 1)
        cache.append(ids, k, v, cu)
        dropout_p = self.dropout if self.training else 0.0
        out = cache.attention(q, ids, cu, causal=True, dropout_p=dropout_p)  # (T, H, D)
        return self.proj(out.reshape(t, e)).view(b, lq, e)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """Build a module with the weights of ``m`` (same output for batch-first input).

        ``m``'s ``key_padding_mask`` and bool ``attn_mask`` use True = ignore; convert them with
        :func:`selfattn.masks.from_torch_key_padding_mask` and
        :func:`selfattn.masks.from_torch_attn_mask`.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch needs an nn.MultiheadAttention, got {type(m).__name__}")
        if not m._qkv_same_embed_dim:
            raise ValueError("from_torch needs kdim == vdim == embed_dim (one in_proj_weight)")
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch does not support add_bias_kv or add_zero_attn")
        has_bias = m.in_proj_bias is not None
        out = cls(m.embed_dim, m.num_heads, dropout=m.dropout, bias=has_bias)
        out = out.to(device=m.in_proj_weight.device, dtype=m.in_proj_weight.dtype)
        with torch.no_grad():
            out.qkv.weight.copy_(m.in_proj_weight)
            out.proj.weight.copy_(m.out_proj.weight)
            if has_bias:
                out.qkv.bias.copy_(m.in_proj_bias)
                out.proj.bias.copy_(m.out_proj.bias)
        return out

"""Two bugs of different kinds in one module: each is named, and the one bug alone is named alone.

The white box reads a core's scale, which keys its scores hide, the operands' roles, the merge and the rotation
apart, and a mask that changes nothing at all is the bug itself, not a symptom of another one.
"""

from __future__ import annotations

import pytest
import torch
from einops import rearrange
from torch import nn
from torch.nn import functional as F

from selfattn.check import check


# -- a timm-style SDPA wrapper, causal, with a (B, L) keep-mask ------------------------------------------------------
class CausalSDPA(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, bugs: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.heads, self.bugs = heads, bugs
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = None if attn_mask is None else attn_mask[:, None, None, :]
        if mask is not None and "causal-leak" not in self.bugs:  # the bug: causal only when no mask is given
            mask = mask & torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scale = 1.0 if "missing-scale" in self.bugs else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
        return self.proj(out.transpose(1, 2).reshape(b, t, e))


# -- an einops module with a (B, L) keep-mask --------------------------------------------------------------------
class EinopsMasked(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, bugs: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.heads, self.bugs = heads, bugs
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * (1.0 if "missing-scale" in self.bugs else q.shape[-1] ** -0.5)
        if mask is not None and "mask-ignored" not in self.bugs:  # the bug: the mask is taken and never applied
            dots = dots.masked_fill(~mask[:, None, None, :], -torch.finfo(dots.dtype).max)
        attn = dots.softmax(dim=-2 if "softmax-dim" in self.bugs else -1)
        spelled = "bhji,bhjd->bhid" if "matmul-order" in self.bugs else "bhij,bhjd->bhid"
        out = torch.einsum(spelled, attn, v)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


# -- Hugging Face eager style: grouped keys and values, rotary from a (cos, sin) table ------------------------------
def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _interleaved(x, cos, sin):  # GPT-J's pairing: (x0, x1), (x2, x3), ...
    pairs = x.unflatten(-1, (-1, 2))
    c, s = cos[..., : x.shape[-1] // 2, None], sin[..., : x.shape[-1] // 2, None]
    turned = torch.stack((pairs[..., 0] * c[..., 0] - pairs[..., 1] * s[..., 0],
                          pairs[..., 0] * s[..., 0] + pairs[..., 1] * c[..., 0]), dim=-1)
    return turned.flatten(-2)


class GroupedRotary(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2,
                 bugs: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.bugs = heads, kv_heads, dim // heads, bugs
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.is_causal = True

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
        inv = 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2, device=q.device).to(q.dtype) / self.head_dim)
        freqs = torch.arange(t, device=q.device).to(q.dtype)[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + _rotate_half(q) * sin
        if "rotary-mismatch" in self.bugs:  # the bug: k rotated with the other pairing
            k = _interleaved(k, freqs.cos(), freqs.sin())
        elif "rotary-one-side" not in self.bugs:  # the bug: k is never rotated
            k = k * cos + _rotate_half(k) * sin
        n = self.heads // self.kv_heads
        k = k.repeat_interleave(n, dim=1)
        v = v.repeat(1, n, 1, 1) if "group-mismatch" in self.bugs else v.repeat_interleave(n, dim=1)
        scale = 1.0 if "missing-scale" in self.bugs else self.head_dim ** -0.5
        scores = q @ k.transpose(2, 3) * scale
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


# -- nanoGPT style: a causal (L, L) buffer, the softmax written out --------------------------------------------------
class CausalBuffer(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, block: int = 16, bugs: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.heads, self.bugs = heads, bugs
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("bias", torch.ones(block, block, dtype=torch.bool).tril())

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = self.c_attn(x).split(e, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = q @ k.transpose(-2, -1) * (1.0 if "missing-scale" in self.bugs else k.size(-1) ** -0.5)
        future = ~self.bias[:t, :t]
        if "causal-leak" in self.bugs:  # the bug: the mask one token late (each query sees the next)
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(2)
        if "mask-after-softmax" not in self.bugs:
            att = att.masked_fill(future, float("-inf"))
        att = att.softmax(dim=-2 if "softmax-dim" in self.bugs else -1)
        if "mask-after-softmax" in self.bugs:  # the bug: the future zeroed after the softmax, rows not renormalised
            att = att.masked_fill(future, 0.0)
        out = att @ v
        if "head-merge" in self.bugs:  # the bug: heads merged without the transpose back
            return self.c_proj(out.reshape(b, t, e))
        return self.c_proj(out.transpose(1, 2).reshape(b, t, e))


CASES = [
    (CausalBuffer, {"causal": True}, ("softmax-dim", "mask-after-softmax")),
    (CausalBuffer, {"causal": True}, ("mask-after-softmax", "missing-scale")),
    (CausalBuffer, {"causal": True}, ("head-merge", "causal-leak")),
    (CausalSDPA, {"causal": True, "mask_convention": "keep"}, ("causal-leak", "missing-scale")),
    (EinopsMasked, {"mask_convention": "keep"}, ("mask-ignored", "matmul-order")),
    (EinopsMasked, {"mask_convention": "keep"}, ("matmul-order", "missing-scale")),
    (EinopsMasked, {"mask_convention": "keep"}, ("softmax-dim", "missing-scale")),
    (GroupedRotary, {"causal": True}, ("rotary-one-side", "group-mismatch")),
    (GroupedRotary, {"causal": True}, ("rotary-mismatch", "missing-scale")),
]


@pytest.mark.parametrize(("module", "options", "bugs"), CASES, ids=["+".join(c[2]) for c in CASES])
def test_each_of_two_bugs_is_named(module, options, bugs):
    torch.manual_seed(0)
    assert check(module(), **options).verdict == "passed"
    for bug in bugs:  # alone, each is named alone: reading on past it adds no second finding
        torch.manual_seed(0)
        alone = check(module(bugs=frozenset({bug})), **options)
        assert {f.id for f in alone.findings if f.severity == "error"} == {bug}, (bug, alone.ids)
    torch.manual_seed(0)
    both = check(module(bugs=frozenset(bugs)), **options)
    assert set(bugs) <= both.ids, both.ids



class UnscaledWithValueNorm(nn.Module):
    """Gemma's attention: no scale on the scores by design, q, k and v each RMS-normalised (v with no gain)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)

    def forward(self, x):
        q, k, v = (self._norm(t.unflatten(-1, (self.heads, -1))).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        return self.o((q @ k.transpose(-1, -2)).softmax(-1).matmul(v).transpose(1, 2).flatten(2))


def test_a_norm_on_the_values_is_no_second_bug_beside_a_first():
    # read beside the missing scale, the values' own per-token factor was values-changed
    torch.manual_seed(0)
    assert check(UnscaledWithValueNorm()).ids == {"missing-scale"}
    assert check(UnscaledWithValueNorm(), scale=1.0).verdict == "passed"


class CausalBufferOwnKeyHidden(CausalBuffer):
    """The causal mask one token too wide (triu(0)): every query hides its own key; with ``merged`` the heads are put
    back without the transpose too."""

    def __init__(self, merged: bool = False) -> None:
        super().__init__(bugs=frozenset({"head-merge"} if merged else ()))
        self.bias = self.bias.tril(-1)
        self.bias[0, 0] = True  # the first query keeps one key (a row with none is NaN)


def test_a_hidden_own_key_beside_heads_merged_without_the_transpose_is_named_too():
    # head-merge explains a causal leak its scrambled rows show; the scores hiding the diagonal are a leak of their own
    assert check(CausalBufferOwnKeyHidden(), causal=True).ids == {"causal-leak"}
    assert {"causal-leak", "head-merge"} <= check(CausalBufferOwnKeyHidden(merged=True), causal=True).ids

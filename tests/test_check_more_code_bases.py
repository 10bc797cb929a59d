"""The doctor on attention from more code bases: padding beside causal masks, and the modules named in each test.

Each module is written in the style of the code base it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import torch
from torch import nn

from selfattn.check import check


# -- a causal layer with a key padding mask, True = padding, filled with -inf (ALiBi / GPT style) -----------------
class CausalWithPadding(nn.Module):
    """A fused-QKV causal layer taking ``key_padding_mask`` (True = padding) and filling hidden scores with -inf, with
    an optional ALiBi bias. A query whose earlier keys are all padding gets a NaN row, as in the published code."""

    def __init__(self, dim: int = 32, heads: int = 4, alibi: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads) if alibi else None,
                             persistent=False)

    def forward(self, x, key_padding_mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / (e // self.heads) ** 0.5
        i = torch.arange(n, device=x.device)
        if self.slopes is not None:
            s = s + self.slopes.to(s.dtype)[:, None, None] * (i[None, :] - i[:, None]).to(s.dtype)
        s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
        if key_padding_mask is not None:
            s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        return self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


def test_a_causal_layer_with_a_padding_mask_is_read_true_means_padding():
    """catches: the doctor's own keep-mask, read True = padding by a causal layer, leaves some queries no key (NaN
    rows, as the module's reading gives there); the NaN made the reading look unsound, so no convention matched
    and the white box compared the scores with the mask read the wrong way round (mask-ignored)."""
    for alibi in (False, True):
        report = check(CausalWithPadding(alibi=alibi))
        assert report.passed, [(f.id, f.message) for f in report.findings]
        assert report.inferred["mask"]["kind"] == "ignore"


# -- a (B, 1, 1, L) mask read as its row 0 by an SDPA layer -------------------------------------------------------
class RowOfTheMask(nn.Module):
    """A layer documenting a (B, 1, 1, L) key mask (True = padding) that it reads as ``mask[:, 0, 0]`` before SDPA, as
    code that builds the kernel's mask from a broadcastable one does."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        allowed = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        if mask is not None:
            allowed = allowed & ~mask[:, 0, 0][:, None, None, :]
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(o.transpose(1, 2).reshape(b, n, e))


def test_a_key_mask_is_tried_where_a_full_mask_matched_no_convention():
    """catches: the doctor's (B, 1, L, L) mask, of which the layer reads row 0, matched no convention, and the key
    masks (B, 1, 1, L) were never tried: the white box read the wrong mask (causal-leak)."""
    report = check(RowOfTheMask())
    assert report.passed, [(f.id, f.message) for f in report.findings]
    assert report.inferred["mask"]["shape"] == "(B, 1, 1, L)"


# -- SpeechBrain: a wrapper of nn.MultiheadAttention whose first mask is attn_mask, the padding beside it ----------
class WrappedMHA(nn.Module):
    """SpeechBrain's ``MultiheadAttention`` style: (B, L, E) in, torch's layer (L, B, E) inside, ``attn_mask`` first
    and ``key_padding_mask`` (True = padding) beside it."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(dim, heads)

    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None):
        out, _ = self.att(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), attn_mask=attn_mask,
                          key_padding_mask=key_padding_mask)
        return out.transpose(0, 1)


class LengthsEncoder(nn.Module):
    """An encoder given frames and each item's relative length (SpeechBrain's ``wav_len``), which builds the padding
    mask and hands it to each layer as ``key_padding_mask``."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList([WrappedMHA(dim) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, wav_len):
        lengths = torch.round(wav_len * x.shape[1])
        padding = torch.arange(x.shape[1])[None, :] >= lengths[:, None]
        for layer in self.layers:
            x = self.norm(x + layer(x, x, x, key_padding_mask=padding))
        return x


def test_a_model_padding_handed_beside_the_mask_argument_is_read():
    """catches: a model that pads through key_padding_mask while the layer's first mask argument is attn_mask: the
    padded item's hidden keys were not part of the formulas (definition-mismatch), and the tokens permuted under the
    fixed padding read as not-equivariant."""
    from selfattn.check import check_model

    torch.manual_seed(0)
    report = check_model(LengthsEncoder().eval(), (torch.randn(2, 9, 32), torch.tensor([1.0, 6 / 9])))
    assert report.layers, report
    for name, layer in report.layers.items():
        assert layer.passed, (name, [(f.id, f.message) for f in layer.findings])
        assert "not-equivariant" not in layer.ids, name


# -- rotary positions: keys rotated at other positions than the queries --------------------------------------------
def _rotate_half(t):
    a, b = t.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryOffset(nn.Module):
    """Llama style (B, H, L, D) with rotate-half rotary; ``offset`` rotates the keys at ``position_ids + offset`` (a
    cache offset given to one side only). ``complex_tables``: Llama 4's ``view_as_complex(q) * freqs_cis`` instead."""

    def __init__(self, dim: int = 64, heads: int = 4, offset: int = 0, complex_tables: bool = False) -> None:
        super().__init__()
        self.heads, self.offset, self.complex_tables = heads, offset, complex_tables
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def _angles(self, positions, d):
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        return positions[:, None].float() * inv  # (L, D / 2)

    def _rotate(self, t, positions):
        ang = self._angles(positions, t.shape[-1])
        if self.complex_tables:
            freqs = torch.polar(torch.ones_like(ang), ang)
            pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * freqs).flatten(-2).type_as(t)
        cos, sin = torch.cat((ang, ang), -1).cos().to(t.dtype), torch.cat((ang, ang), -1).sin().to(t.dtype)
        return t * cos + _rotate_half(t) * sin

    def forward(self, x):
        b, n, e = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        positions = torch.arange(n, device=x.device)
        q, k = self._rotate(q, positions), self._rotate(k, positions + self.offset)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, e))


def test_keys_rotated_at_other_positions_than_the_queries_are_named():
    """catches: k rotated at position_ids + 1 certified: with one token everywhere q_i . k_i is q . R(1) k at every
    position, the same everywhere, so only the tables that rotate q and k tell it (rotate-half and complex ones)."""
    for complex_tables in (False, True):
        assert check(RotaryOffset(complex_tables=complex_tables)).passed, complex_tables
        for offset in (1, -2):
            report = check(RotaryOffset(offset=offset, complex_tables=complex_tables))
            assert report.ids == {"rotary-mismatch"}, (complex_tables, offset, [(f.id, f.message)
                                                                                 for f in report.findings])


# -- torch's other names for an operation (torch.multiply, torch.divide) -----------------------------------------
class AliasedOps(nn.Module):
    """Keras's ``MultiHeadAttention`` written with torch's aliases (as Keras's ops call them on its torch backend):
    q scaled by ``torch.multiply`` with a 0-d tensor, scores from ``einsum("aecd,abcd->acbe", key, query)`` with the
    key first; ``on_scores``: the scale applied to the scores by ``torch.divide`` instead."""

    def __init__(self, dim: int = 64, heads: int = 4, on_scores: bool = False) -> None:
        super().__init__()
        self.heads, self.on_scores = heads, on_scores
        # EinsumDense's kernels "abc,cde->abde": (E, H, D) for q, k, v and (H, D, E) for the output
        self.query, self.key, self.value = (nn.Parameter(torch.randn(dim, heads, dim // heads) / dim ** 0.5)
                                            for _ in range(3))
        self.out = nn.Parameter(torch.randn(heads, dim // heads, dim) / dim ** 0.5)

    def forward(self, x):
        q, k, v = (torch.einsum("abc,cde->abde", x, w) for w in (self.query, self.key, self.value))
        d = q.shape[-1]
        if not self.on_scores:
            q = torch.multiply(q, torch.tensor(1 / d ** 0.5, dtype=q.dtype))
        scores = torch.einsum("aecd,abcd->acbe", k, q)
        if self.on_scores:
            scores = torch.divide(scores, torch.tensor(d ** 0.5, dtype=q.dtype))
        weights = torch.softmax(scores, dim=-1)
        return torch.einsum("abcd,cde->abe", torch.einsum("acbe,aecd->abcd", weights, v), self.out)


def test_torch_aliases_of_an_operation_are_read_as_it():
    """catches: a scale applied by torch.multiply or torch.divide (Keras's ops on torch) unread: missing-scale, or the
    scores passing through an unknown multiply() (definition-mismatch)."""
    for on_scores in (False, True):
        report = check(AliasedOps(on_scores=on_scores))
        assert report.passed, (on_scores, [(f.id, f.message) for f in report.findings])


# -- MLA: the values' up-projection never used -------------------------------------------------------------------
class LatentAttention(nn.Module):
    """Multi-head latent attention in DeepSeek's notation: x -> latent (W_DKV), keys and values up-projected from it
    (W_UK, W_UV), queries by W_UQ. ``values_from_keys``: values taken through W_UK, W_UV never used."""

    def __init__(self, dim: int = 64, heads: int = 4, latent: int = 16, values_from_keys: bool = False) -> None:
        super().__init__()
        self.heads, self.values_from_keys = heads, values_from_keys
        self.W_DKV = nn.Linear(dim, latent, bias=False)
        self.W_UQ = nn.Linear(dim, dim, bias=False)
        self.W_UK = nn.Linear(latent, dim, bias=False)
        self.W_UV = nn.Linear(latent, dim, bias=False)
        self.W_O = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, n, e = x.shape
        c = self.W_DKV(x)
        q = self.W_UQ(x).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.W_UK(c).view(b, n, self.heads, -1).transpose(1, 2)
        v = (self.W_UK if self.values_from_keys else self.W_UV)(c).view(b, n, self.heads, -1).transpose(1, 2)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.W_O(o.transpose(1, 2).reshape(b, n, e))


def test_an_unused_up_projection_of_latent_attention_is_named():
    """catches: W_UV left unused (values through W_UK) certified: MLA's names for its up-projections said no role."""
    assert check(LatentAttention()).passed
    report = check(LatentAttention(values_from_keys=True))
    assert "no-grad" in report.ids, [(f.id, f.message) for f in report.findings]


# -- Keras 3 layers on the torch backend -------------------------------------------------------------------------
def _keras():
    import os

    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = __import__("pytest").importorskip("keras")
    if keras.backend.backend() != "torch":
        __import__("pytest").skip("Keras runs on another backend here")
    return keras


def test_keras_multi_head_attention_is_checked_in_its_own_precision():
    """catches: every Keras layer failed half precision (half-precision-overflow): .half() cast its weights while
    its dtype policy still cast the inputs to float32; and its float64 copy computed in float32."""
    keras = _keras()
    keras.utils.set_random_seed(0)
    layer = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)
    x = torch.zeros(2, 7, 64)
    layer(x, x)
    report = check(layer, call=lambda m, x, mask: m(x, x, attention_mask=mask))
    assert report.passed, [(f.id, f.message) for f in report.findings]
    assert report.coverage["half_precision"] == "verified"
    assert report.inferred["analysed in"] == "a float64 copy"


def test_an_unused_keras_value_projection_is_named_and_its_key_bias_is_not():
    """catches: a Keras layer whose value_dense is built but never used certified (Dense is no nn.Linear), the key
    projection's bias, which the softmax cancels, named no-grad under Keras's variable names ("key/bias"), and a
    layer not built yet refused (exit 2: the doctor put back its state after the call that built it)."""
    keras = _keras()
    layers, ops = keras.layers, keras.ops

    class SelfAttention(layers.Layer):
        def __init__(self, dim=64, heads=4, values_from_keys=False, **kwargs):
            super().__init__(**kwargs)
            self.heads, self.head_dim, self.values_from_keys = heads, dim // heads, values_from_keys
            self.query_dense, self.key_dense, self.value_dense = (layers.Dense(dim, name=n)
                                                                  for n in ("query", "key", "value"))
            self.output_dense = layers.Dense(dim, name="attention_output")

        def build(self, input_shape):
            for d in (self.query_dense, self.key_dense, self.value_dense, self.output_dense):
                d.build(input_shape)

        def call(self, x):
            b, n = ops.shape(x)[0], ops.shape(x)[1]

            def heads(t):
                return ops.transpose(ops.reshape(t, (b, n, self.heads, self.head_dim)), (0, 2, 1, 3))

            q, k = heads(self.query_dense(x)), heads(self.key_dense(x))
            v = heads((self.key_dense if self.values_from_keys else self.value_dense)(x))
            w = ops.softmax(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / self.head_dim ** 0.5, axis=-1)
            return self.output_dense(ops.reshape(ops.transpose(ops.matmul(w, v), (0, 2, 1, 3)), (b, n, -1)))

    for values_from_keys in (False, True):
        keras.utils.set_random_seed(0)
        layer = SelfAttention(values_from_keys=values_from_keys)
        layer(torch.zeros(2, 7, 64))
        report = check(layer)
        if values_from_keys:
            assert "no-grad" in report.ids, [(f.id, f.message) for f in report.findings]
        else:
            assert report.passed, [(f.id, f.message) for f in report.findings]
    # not built yet (its weights made on its first call), as `selfattn check file.py:Class` constructs it
    report = check(SelfAttention())
    assert report.passed, [(f.id, f.message) for f in report.findings]


# -- a KV cache kept in the module (LLMs-from-scratch's chapter 4 style) -----------------------------------------
class CachedCausal(nn.Module):
    """Keys and values appended to a cache the module keeps, and the causal mask's rows read from a buffer at the
    cache's position ``ptr``; ``advance=False`` never moves ``ptr`` (a later chunk reads rows 0.., hiding cached keys
    it should see)."""

    def __init__(self, dim: int = 32, heads: int = 4, context: int = 64, advance: bool = True) -> None:
        super().__init__()
        self.heads, self.advance = heads, advance
        self.W_query, self.W_key, self.W_value, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.register_buffer("mask", torch.ones(context, context).triu(1), persistent=False)
        self.cache_k = self.cache_v = None
        self.ptr = 0

    def forward(self, x, use_cache=False):
        b, n, e = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.W_query, self.W_key, self.W_value))
        start = 0
        if use_cache:
            if self.cache_k is not None:
                k, v = torch.cat([self.cache_k, k], dim=2), torch.cat([self.cache_v, v], dim=2)
            self.cache_k, self.cache_v = k, v
            start = self.ptr
            if self.advance:
                self.ptr += n
        s = (q @ k.transpose(-1, -2)).masked_fill(self.mask.bool()[start:start + n, :k.shape[2]], float("-inf"))
        o = torch.softmax(s / k.shape[-1] ** 0.5, dim=-1) @ v
        return self.out_proj(o.transpose(1, 2).reshape(b, n, e))


def test_a_cache_that_continues_another_sequence_is_named():
    """catches: a cache whose position is never advanced certified: the calls in a row only noted that outputs change
    from call to call (a cache's state); a causal module called on the first tokens and then on the rest must give
    the rows of one call on all of them."""
    use_cache = dict(call=lambda m, x: m(x, use_cache=True), causal=True)
    assert check(CachedCausal(), **use_cache).passed
    report = check(CachedCausal(advance=False), **use_cache)
    assert report.ids == {"state-dependent"}, [(f.id, f.message) for f in report.findings]


# -- ESPnet / SpeechBrain relative attention: the position projection and the (B, 1, T) mask ----------------------
class RelPositionAttention(nn.Module):
    """Transformer-XL relative attention as the speech toolkits write it: content term (q + u) k^T, position term
    (q + v) p^T over sinusoids of the relative distances projected by ``linear_pos``, a (B, 1, T) mask (1 = keep).
    ``bug``: "no_linear_pos" uses the sinusoids as they come; "mask_on_queries" puts the mask on the query axis."""

    def __init__(self, dim: int = 64, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.h, self.d, self.bug = heads, dim // heads, bug
        self.linear_q, self.linear_k, self.linear_v, self.linear_out = (nn.Linear(dim, dim) for _ in range(4))
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.randn(heads, dim // heads) * 0.1)
        self.pos_bias_v = nn.Parameter(torch.randn(heads, dim // heads) * 0.1)

    def _sinusoids(self, n: int, dim: int, like: torch.Tensor) -> torch.Tensor:
        rel = torch.arange(n - 1, -n, -1, dtype=like.dtype, device=like.device)[:, None]  # distances i - j
        freq = torch.exp(torch.arange(0, dim, 2, dtype=like.dtype, device=like.device) * (-4.0 / dim))
        return torch.cat(((rel * freq).sin(), (rel * freq).cos()), dim=-1)  # (2n - 1, dim)

    def forward(self, x, mask=None):
        b, n, e = x.shape
        q = self.linear_q(x).view(b, n, self.h, self.d)
        k, v = (p(x).view(b, n, self.h, self.d).transpose(1, 2) for p in (self.linear_k, self.linear_v))
        pe = self._sinusoids(n, e, x)
        p = (pe if self.bug == "no_linear_pos" else self.linear_pos(pe)).view(-1, self.h, self.d).transpose(0, 1)
        ac = (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(-1, -2)
        bd_full = (q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-1, -2)  # (B, H, n, 2n - 1)
        i = torch.arange(n, device=x.device)
        bd = bd_full.gather(-1, (n - 1 - i[:, None] + i[None, :]).expand(b, self.h, n, n))  # distance i - j
        scores = (ac + bd) / self.d ** 0.5
        if mask is not None:
            hidden = (mask.transpose(1, 2) if self.bug == "mask_on_queries" else mask).unsqueeze(1).eq(0)
            scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        w = torch.softmax(scores, dim=-1)
        if mask is not None:
            w = w.masked_fill(hidden, 0.0)
        return self.linear_out((w @ v).transpose(1, 2).reshape(b, n, e))


def test_relative_attention_of_the_speech_toolkits():
    """catches: the sinusoids taken without linear_pos certified (the projection has no q/k/v role, and its
    siblings named none either), and a stated (B, 1, T) key mask put on the query axis named mask-error ("raises
    with the mask you stated") instead of mask-broadcast."""
    stated = dict(mask="keep (B,1,L)")
    assert check(RelPositionAttention(), **stated).passed
    report = check(RelPositionAttention(bug="no_linear_pos"), **stated)
    assert "no-grad" in report.ids, [(f.id, f.message) for f in report.findings]
    report = check(RelPositionAttention(bug="mask_on_queries"), **stated)
    assert "mask-broadcast" in report.ids, [(f.id, f.message) for f in report.findings]


# -- DeepSeek-V3: decoupled rotary on part of the head dim, interleaved pairs laid out as halves ------------------
class DecoupledRotary(nn.Module):
    """MLA's attention with its decoupled rotary part: q = [q_nope | rope(q_rot)], k = [k_nope | rope(k_rot)], the
    rotation on interleaved pairs written out as halves (``cat([x1 cos - x2 sin, x2 cos + x1 sin])``)."""

    def __init__(self, dim: int = 64, heads: int = 4, nope: int = 8, rot: int = 4) -> None:
        super().__init__()
        self.h, self.nope, self.rot = heads, nope, rot
        self.q_proj = nn.Linear(dim, heads * (nope + rot), bias=False)
        self.k_proj = nn.Linear(dim, heads * nope + rot, bias=False)  # one rotary key shared by the heads
        self.v_proj = nn.Linear(dim, heads * nope, bias=False)
        self.o_proj = nn.Linear(heads * nope, dim, bias=False)

    def _rotate(self, t):
        n = t.shape[-2]
        inv = 1.0 / 10000 ** (torch.arange(0, self.rot, 2, dtype=torch.float32) / self.rot)
        ang = torch.arange(n, dtype=torch.float32)[:, None] * inv
        cos, sin = ang.cos().to(t.dtype), ang.sin().to(t.dtype)
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, x):
        bsz, n, _ = x.shape
        q = self.q_proj(x).view(bsz, n, self.h, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rot], dim=-1)
        k_all = self.k_proj(x)
        k_nope = k_all[..., :self.h * self.nope].view(bsz, n, self.h, -1).transpose(1, 2)
        k_rot = k_all[..., self.h * self.nope:].view(bsz, 1, n, self.rot)
        q = torch.cat((q_nope, self._rotate(q_rot)), dim=-1)
        k = torch.cat((k_nope, self._rotate(k_rot).expand(-1, self.h, -1, -1)), dim=-1)
        v = self.v_proj(x).view(bsz, n, self.h, -1).transpose(1, 2)
        o = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o_proj(o.transpose(1, 2).reshape(bsz, n, -1))


def test_interleaved_rotary_laid_out_as_halves_is_read_as_positions():
    """catches: DeepSeek-V3's rotation of interleaved pairs written out as halves not read as rotary positions, so
    a correct module got a not-equivariant warning (no position term explained it)."""
    report = check(DecoupledRotary())
    assert report.passed and not report.findings, [(f.id, f.message) for f in report.findings]
    assert "rotary" in str(report.inferred.get("design")), report.inferred.get("design")


# -- a causal mask of 1 and 0 handed down by the model (keras-hub's decoder blocks) --------------------------------
class OnesAndZerosLayer(nn.Module):
    """A layer taking the model's (B, L, L) mask of integers, 1 = may attend (padding merged into the causal mask
    by a minimum, as keras-hub's decoders build it)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, attention_mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if attention_mask is not None:
            s = s.masked_fill(attention_mask[:, None] == 0, torch.finfo(s.dtype).min)
        return self.out((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class OnesAndZerosDecoder(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.attention = OnesAndZerosLayer(dim)

    def forward(self, x, padding_mask):
        n = x.shape[1]
        causal = (torch.arange(n)[:, None] >= torch.arange(n)[None, :]).int()
        return x + self.attention(x, attention_mask=torch.minimum(padding_mask[:, None, :], causal[None]))


def test_a_models_causal_mask_of_ones_and_zeros_stands_for_the_layers_pattern():
    """catches: with --causal, the model's integer 1/0 causal mask was not read as the layer's own pattern, so the
    layer was probed without it and named causal-leak."""
    from selfattn.check import check_model

    torch.manual_seed(0)
    padding = torch.ones(2, 7, dtype=torch.int32)
    padding[1, 5:] = 0
    report = check_model(OnesAndZerosDecoder().eval(), (torch.randn(2, 7, 32), padding), causal=True)
    assert report.layers and all(r.passed for r in report.layers.values()), \
        {n: [(f.id, f.message) for f in r.findings] for n, r in report.layers.items()}


# -- short sequences: ACT's encoder of 3 tokens --------------------------------------------------------------------
def test_a_padding_probe_at_three_tokens_is_no_doctor_error():
    """catches: at 3 tokens the padding probe padded an item whole and compared its (no) real tokens: a doctor error
    (max() of an empty tensor) made torch's own layer inconclusive (ACT's encoder: latent, state, environment)."""
    torch.manual_seed(0)
    layer = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    for batch in (2, 3):
        report = check(layer, call=lambda m, x, mask: m(x, x, x, key_padding_mask=mask)[0], length=[3], batch=batch)
        assert report.passed and report.coverage["padding"] == "verified", (batch, report.not_verified)


# -- causal layers whose padding only the left side shows ----------------------------------------------------------
class FirstItemsMask(nn.Module):
    """A causal layer with a key padding mask (True = padding) that applies item 0's mask to every item
    (``mask[:1]``): with padding at the end a causal layer hides it anyway; padding on the left shows it.
    ``column=True``: a (B, 1, L, L) keep mask read as ``mask[:, 0, :, 0]``, one column, for the key padding."""

    def __init__(self, dim: int = 32, heads: int = 4, column: bool = False) -> None:
        super().__init__()
        self.column = column
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x, mask=None):
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        kpm = None
        if mask is not None:
            kpm = (mask[:, 0, :, 0] == 0) if self.column else mask[:1].expand(x.shape[0], -1)
        return self.attn(x, x, x, attn_mask=causal, key_padding_mask=kpm, need_weights=False)[0]


def test_padding_on_the_left_shows_what_a_causal_layer_hides():
    """catches: item 0's mask applied to every item, and a full mask read as one column for the key padding,
    certified on causal layers: the doctor padded only the end of each item, which causality hides anyway."""
    report = check(FirstItemsMask(), mask="ignore (B,L)", causal=True)
    assert "mask-ignored" in report.ids, [(f.id, f.message) for f in report.findings]
    report = check(FirstItemsMask(column=True), causal=True)
    assert not report.passed, [(f.id, f.message) for f in report.findings]


# -- learned memory keys before the tokens, rotated at positions after them ----------------------------------------
class MemoryKeys(RotaryOffset):
    """Two learned memory tokens joined before the tokens' keys (positions 0, 1; the tokens at 2..L+1 for q and k);
    ``restart``: the tokens' keys rotated from 0 again (memory at 0, 1, the tokens' keys at 0..L-1)."""

    def __init__(self, restart: bool = False) -> None:
        super().__init__()
        self.restart = restart
        self.mem = nn.Parameter(torch.randn(2, 64) * 0.5)

    def forward(self, x):
        b, n, e = x.shape
        xm = torch.cat((self.mem[None].expand(b, -1, -1), x), dim=1)
        q = self.q_proj(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (p(xm).view(b, n + 2, self.heads, -1).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        positions = torch.arange(n, device=x.device)
        keys_at = torch.cat((torch.arange(2, device=x.device), positions if self.restart else positions + 2))
        q, k = self._rotate(q, positions + 2), self._rotate(k, keys_at)
        visible = torch.ones(n, n + 2, dtype=torch.bool, device=x.device).tril(2)
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, e))


def test_memory_keys_before_the_tokens_are_no_rotary_mismatch():
    """catches: learned memory keys first, read through SDPA, paired query i with key i (a memory key): a false
    rotary-mismatch on a correct module; the tokens' keys rotated from 0 again are still named."""
    report = check(MemoryKeys(), causal=True)
    assert report.passed, [(f.id, f.message) for f in report.findings]
    report = check(MemoryKeys(restart=True), causal=True)
    assert report.ids == {"rotary-mismatch"}, [(f.id, f.message) for f in report.findings]


# -- a decode step that takes its own path ------------------------------------------------------------------------
class DecodeStepOffByOne(CachedCausal):
    """:class:`CachedCausal` whose one-token decode step reads the mask row one position on (its own path)."""

    def forward(self, x, use_cache=False):
        if use_cache and x.shape[1] == 1 and self.cache_k is not None:
            self.ptr += 1
        return super().forward(x, use_cache)


def test_a_decode_step_of_one_token_continues_the_sequence():
    """catches: a cache right for chunks and wrong for a one-token decode step certified: the calls continued the
    sequence in chunks only."""
    report = check(DecodeStepOffByOne(), call=lambda m, x: m(x, use_cache=True), causal=True)
    assert report.ids == {"state-dependent"}, [(f.id, f.message) for f in report.findings]


# -- a keep mask handed to torch's src_key_padding_mask ------------------------------------------------------------
class EncoderLM(nn.Module):
    """A causal language model on nn.TransformerEncoder, padding read from the token ids (0 = padding);
    ``keep_as_padding``: the keep mask (~pad) handed to ``src_key_padding_mask`` (True = padding), which hides every
    key of an item the model does not pad (torch's kernels give that item's tokens 0, or NaN)."""

    def __init__(self, keep_as_padding: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.keep_as_padding = keep_as_padding

    def forward(self, input_ids):
        pad = input_ids == 0
        causal = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1])
        return self.enc(self.emb(input_ids), mask=causal, is_causal=True,
                        src_key_padding_mask=~pad if self.keep_as_padding else pad)


def test_a_keep_mask_handed_as_the_padding_mask_of_an_item_without_padding_is_named():
    """catches: the model's keep mask given as src_key_padding_mask certified: the padded items' real tokens still
    saw the padding (finite), and the item without padding, whose every key was hidden, got one output for all its
    tokens from torch's kernel rather than NaN."""
    from selfattn.check import check_model

    torch.manual_seed(0)
    ids = torch.randint(1, 50, (3, 8))
    ids[1, 6:] = 0
    ids[2, 5:] = 0
    report = check_model(EncoderLM().eval(), (ids,))
    assert all(r.passed for r in report.layers.values()), report
    report = check_model(EncoderLM(keep_as_padding=True).eval(), (ids,))
    assert report.layers and all("mask-inverted" in r.ids for r in report.layers.values()), \
        {n: r.ids for n, r in report.layers.items()}


# -- scGPT's flash layer: padded rows zeroed inside, a post-norm residual around them -----------------------------
class FlashStyleBlock(nn.Module):
    """scGPT's ``FlashTransformerEncoderLayer`` style: ``src_key_padding_mask`` True = padding, None when nothing is
    padded, inverted for a flash-attn style core that reads True = keep and gives padded rows 0; then a post-norm
    residual block (a padded row keeps its own token only)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.Wqkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, src, src_key_padding_mask=None):
        keep = None if src_key_padding_mask is None or not src_key_padding_mask.any() else ~src_key_padding_mask
        b, n, e = src.shape
        q, k, v = self.Wqkv(src).view(b, n, 3, self.heads, -1).unbind(2)
        s = torch.einsum("bthd,bshd->bhts", q, k) / q.shape[-1] ** 0.5
        if keep is not None:
            s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        out = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v)
        if keep is not None:
            out = out * keep[:, :, None, None]
        return self.norm(src + self.out_proj(out.reshape(b, n, e)))


def test_padded_rows_left_to_their_own_token_do_not_hide_the_convention():
    """catches: under the other reading a flash-style core zeroes the rows of the tokens the doctor keeps, and the
    residual leaves each of them its own token: those rows were compared, no convention matched, and the white box
    named a correct layer mask-ignored."""
    report = check(FlashStyleBlock())
    assert report.passed, [(f.id, f.message) for f in report.findings]
    assert report.inferred["mask"]["kind"] == "ignore"


# -- a from-scratch module whose q, k, v are raw matrices (LLMs-from-scratch's SelfAttention_v1) --------------------
class RawMatrices(nn.Module):
    """Chapter 3's ``SelfAttention_v1``: ``W_query``, ``W_key``, ``W_value`` as (d_in, d_out) parameters, one
    sequence (L, d_in) at a time."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.W_query, self.W_key, self.W_value = (nn.Parameter(torch.rand(d_in, d_out)) for _ in range(3))

    def forward(self, x):
        q, k, v = x @ self.W_query, x @ self.W_key, x @ self.W_value
        return torch.softmax(q @ k.T / k.shape[-1] ** 0.5, dim=-1) @ v


def test_the_width_of_raw_projection_matrices_is_tried():
    """catches: built with d_in = 32 and no Linear to read its width from, the module was probed at 64 only and
    the doctor gave up (exit 2) on a module a plain call runs."""
    report = check(RawMatrices, init={"d_in": 32, "d_out": 32}, call=lambda m, x: torch.stack([m(t) for t in x]))
    assert report.passed, [(f.id, f.message) for f in report.findings]


# -- state that is no cache ----------------------------------------------------------------------------------------
class SegmentMemoryAttention(nn.Module):
    """Transformer-XL's segment memory: the last ``memory`` inputs of the previous call are keys and values beside
    the new tokens (a bounded memory, not a cache that continues one sequence)."""

    def __init__(self, dim: int = 32, heads: int = 4, memory: int = 2) -> None:
        super().__init__()
        self.heads, self.memory = heads, memory
        self.q, self.kv, self.out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.mem = None

    def forward(self, x):
        b, n, e = x.shape
        ctx = x if self.mem is None or self.mem.shape[0] != b else torch.cat([self.mem, x], dim=1)
        m = ctx.shape[1] - n
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, ctx.shape[1], self.heads, -1).transpose(1, 2) for t in self.kv(ctx).chunk(2, dim=-1))
        visible = torch.ones(n, ctx.shape[1], dtype=torch.bool, device=x.device).tril(m)
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        self.mem = ctx[:, -self.memory:].detach()
        return self.out(o.transpose(1, 2).reshape(b, n, e))


def test_a_memory_of_the_last_tokens_is_no_cache_to_continue():
    """catches: a bounded segment memory judged as a KV cache that continues another sequence (state-dependent on
    a correct Transformer-XL memory): only state that grows by the tokens of each call is a cache."""
    report = check(SegmentMemoryAttention(), causal=True)
    assert report.passed, [(f.id, f.message) for f in report.findings]


# -- Keras: the mask's polarity, and a Dense never called --------------------------------------------------------
def test_a_keras_mask_read_true_means_masked_is_a_warning_and_an_unbuilt_dense_is_named():
    """catches: a Keras layer reading its mask as True = masked certified silently (Keras masks are True = keep),
    and a key Dense never called, so never built and without weights, invisible to the unused-projection rule."""
    keras = _keras()
    layers, ops = keras.layers, keras.ops

    class Attention(layers.Layer):
        def __init__(self, dim=32, inverted=False, keys_from_queries=False, **kwargs):
            super().__init__(**kwargs)
            self.inverted, self.keys_from_queries = inverted, keys_from_queries
            self.query, self.key, self.value = (layers.Dense(dim, name=n) for n in ("query", "key", "value"))

        def call(self, x, mask=None):
            q = self.query(x)
            k = self.query(x) if self.keys_from_queries else self.key(x)
            s = ops.matmul(q, ops.transpose(k, (0, 2, 1))) / q.shape[-1] ** 0.5
            if mask is not None:
                keep = ops.cast(mask, "bool")[:, None, :]
                s = ops.where(ops.logical_not(keep) if self.inverted else keep, s, -1e4)
            return ops.matmul(ops.softmax(s, axis=-1), self.value(x))

    assert "mask-convention" in check(Attention(inverted=True), embed_dim=32).ids
    assert "no-grad" in check(Attention(keys_from_queries=True), embed_dim=32).ids
    assert check(Attention(), embed_dim=32).passed


class FirstKeyAndItself(RowOfTheMask):
    """Each query sees the first key and itself only: what a decode loop gives whose cached keys are stored at
    step 0 and never replaced (fairseq's ``incremental_state`` slip)."""

    def forward(self, x, mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        i = torch.arange(n, device=x.device)
        visible = (i[None, :] == 0) | (i[None, :] == i[:, None])
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.proj(o.transpose(1, 2).reshape(b, n, e))


def test_the_first_key_and_itself_is_no_sink_design():
    """catches: a query that sees the first key and itself read as StreamingLLM's sinks beside a window of no
    previous token, a design: with --causal it hides past keys, causal-leak."""
    assert "causal-leak" in check(FirstKeyAndItself(), causal=True).ids


# -- a causal sliding window joined to a full mask of 1 and 0 -------------------------------------------------------
class WindowJoinedToMask(nn.Module):
    """A causal sliding window of 3 keys, joined to the caller's (B, 1, L, L) mask (``keep``: 1 = may attend; else
    bool True = padding), as code that builds one boolean mask for SDPA does."""

    def __init__(self, dim: int = 32, heads: int = 4, keep: bool = True) -> None:
        super().__init__()
        self.heads, self.keep = heads, keep
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        i = torch.arange(n, device=x.device)
        allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)
        if attn_mask is not None:
            allowed = allowed & (attn_mask.bool() if self.keep else ~attn_mask)
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(o.transpose(1, 2).reshape(b, n, e))


def test_a_full_mask_joined_to_a_window_as_wide_as_the_probe_band_is_read():
    """catches: the doctor's full mask is a causal band of 3, which a window of 3 hides anyway: the mask showed no
    effect, and a correct layer was named mask-inverted. A mask the module joins to its own pattern must hide more
    than that pattern, as one that replaces it must."""
    for keep in (True, False):
        report = check(WindowJoinedToMask(keep=keep), causal=True)
        assert report.passed, (keep, [(f.id, f.message) for f in report.findings])


# -- a preallocated cache that keeps each slot's padding -----------------------------------------------------------
class PaddedSlotsCache(nn.Module):
    """gpt-fast style: keys, values and each slot's padding written into preallocated buffers at a position counter;
    every call sees the slots written so far, with their padding (a later call continues the earlier one's sequence)."""

    def __init__(self, dim: int = 32, heads: int = 4, slots: int = 256) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.k_cache = torch.zeros(4, heads, slots, dim // heads)
        self.v_cache = torch.zeros(4, heads, slots, dim // heads)
        self.pad_cache = torch.zeros(4, slots, dtype=torch.bool)
        self.pos = 0

    def forward(self, x, key_padding_mask=None, use_cache=False):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        pad = torch.zeros(b, n, dtype=torch.bool) if key_padding_mask is None else key_padding_mask
        start = self.pos if use_cache else 0
        if use_cache:
            self.k_cache, self.v_cache, self.pad_cache = (c.clone() for c in (self.k_cache, self.v_cache,
                                                                              self.pad_cache))
            self.k_cache[:b, :, start:start + n] = k.to(self.k_cache.dtype)
            self.v_cache[:b, :, start:start + n] = v.to(self.v_cache.dtype)
            self.pad_cache[:b, start:start + n] = pad
            self.pos = start + n
            k, v = self.k_cache[:b, :, :start + n].to(q.dtype), self.v_cache[:b, :, :start + n].to(q.dtype)
            pad = self.pad_cache[:b, :start + n]
        i = torch.arange(n)[:, None] + start
        allowed = (torch.arange(k.shape[2])[None, :] <= i)[None, None] & ~pad[:, None, None, :]
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.proj(o.transpose(1, 2).reshape(b, n, e))


def test_a_cache_that_keeps_each_slots_padding_reads_its_own_mask():
    """catches: after a call with padding, a call with a mask that hides nothing gives other outputs than alone,
    since the cache continues the first call's sequence with its padding: read as a mask cached by its shape
    (mask-ignored). The second call given the padding mask again gives other outputs: it reads its own mask."""
    report = check(PaddedSlotsCache(), causal=True,
                   call=lambda m, x, mask: m(x, key_padding_mask=mask, use_cache=True), mask="ignore (B,L)")
    assert report.passed, [(f.id, f.message) for f in report.findings]

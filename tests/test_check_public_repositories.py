"""The doctor on attention as research repositories, tutorials and reference packages write it.

Each module is written in the style of the code it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from selfattn.check import check


# -- attention over the channels of a map (Restormer's transposed attention) --------------------------------------
class ChannelMapAttention(nn.Module):
    """Restormer-style transposed attention on a (B, C, H, W) map: 1 x 1 and depthwise convolutions make q, k and v,
    q and k are L2-normalised over the pixels, and the weights are (C/h, C/h) per head, over the channels."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.temperature = nn.Parameter(torch.ones(heads, 1, 1))
        self.qkv = nn.Conv2d(dim, 3 * dim, 1, bias=False)
        self.qkv_dw = nn.Conv2d(3 * dim, 3 * dim, 3, padding=1, groups=3 * dim, bias=False)
        self.project_out = nn.Conv2d(dim, dim, 1, bias=False)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv_dw(self.qkv(x)).chunk(3, dim=1)
        q, k, v = (t.reshape(b, self.heads, c // self.heads, h * w) for t in (q, k, v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        attn = (q @ k.transpose(-2, -1) * self.temperature).softmax(dim=-1)
        return self.project_out((attn @ v).reshape(b, c, h, w))


def test_attention_over_a_maps_channels_is_no_window_of_tokens():
    # its (C/h, C/h) weights keep their size when the grid grows, as windows' do; with 4 heads they were read as
    # windows merged the wrong way (head-merge), with 1 head as windows of 64 tokens (certified)
    for heads in (4, 1):
        report = check(ChannelMapAttention(heads=heads))
        assert report.ids == {"definition-mismatch"}, (heads, report.ids)
        assert "not over the tokens" in report.inferred["keys"]
    assert check(ChannelMapAttention(heads=4), allow_nonstandard=True).passed


# -- a (B, 1, L) pad mask turned into the heads' mask on the wrong axis (attention-is-all-you-need ports) ----------
class PadMaskedMHA(nn.Module):
    """Post-norm attention taking q, k, v and a (B, 1, L) pad mask (1 = keep), which it gives a heads axis with
    ``unsqueeze(1)`` (right: (B, 1, 1, L)) or ``unsqueeze(-1)`` (the bug: (B, 1, L, 1), on the queries)."""

    def __init__(self, d_model: int = 64, n_head: int = 4, wrong_axis: bool = False) -> None:
        super().__init__()
        self.n_head, self.wrong_axis = n_head, wrong_axis
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)
        self.w_v = nn.Linear(d_model, d_model, bias=False)
        self.fc = nn.Linear(d_model, d_model, bias=False)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, q, k, v, mask=None):
        b, n, e = q.shape
        residual = q
        q, k, v = (lin(t).view(b, -1, self.n_head, e // self.n_head).transpose(1, 2)
                   for lin, t in ((self.w_q, q), (self.w_k, k), (self.w_v, v)))
        scores = q @ k.transpose(2, 3) / (e // self.n_head) ** 0.5
        if mask is not None:
            mask = mask.unsqueeze(-1) if self.wrong_axis else mask.unsqueeze(1)
            scores = scores.masked_fill(mask == 0, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)
        return self.norm(self.fc(out) + residual)


def test_a_pad_mask_on_the_query_axis_of_a_module_taking_no_full_mask_is_a_broadcast():
    # its (B, 1, L) form is the only one it takes, so it is its key mask, not a (B, Lq, Lk) one: the bug was
    # mask-ignored (its effect matched no convention)
    assert check(PadMaskedMHA()).passed
    assert check(PadMaskedMHA(wrong_axis=True)).ids == {"mask-broadcast"}


# -- ProbSparse attention (Informer): random key samples choose the queries, every query at short lengths ----------
class ProbSparseAttention(nn.Module):
    """Informer-style ProbSparse self-attention: a random sample of keys scores each query's sparsity, the top u
    queries attend, the rest take the mean of the values. At u = L (factor * ceil(ln L) >= L) every query attends
    and the module is softmax attention; the sample then changes only the order of the rows. ``merge_by_view``
    puts the (B, H, L, D) context back with ``view(B, L, -1)``, a head-merge that shipped in a port."""

    def __init__(self, dim: int = 64, heads: int = 4, factor: int = 5, merge_by_view: bool = False) -> None:
        super().__init__()
        self.heads, self.factor, self.merge_by_view = heads, factor, merge_by_view
        self.query_projection = nn.Linear(dim, dim)
        self.key_projection = nn.Linear(dim, dim)
        self.value_projection = nn.Linear(dim, dim)
        self.out_projection = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        h, d = self.heads, e // self.heads
        q, k, v = (p(x).view(b, n, h, d).transpose(1, 2) for p in
                   (self.query_projection, self.key_projection, self.value_projection))
        u = min(self.factor * math.ceil(math.log(n)), n)
        sample = torch.randint(n, (n, u))
        qk_sample = (q.unsqueeze(-2) @ k[:, :, sample].transpose(-2, -1)).squeeze(-2)
        sparsity = qk_sample.max(-1)[0] - qk_sample.sum(-1) / n
        top = sparsity.topk(u, sorted=False)[1]
        q_top = torch.gather(q, 2, top[..., None].expand(-1, -1, -1, d))
        attn = torch.softmax(q_top @ k.transpose(-2, -1) / math.sqrt(d), dim=-1)
        context = v.mean(-2, keepdim=True).expand(b, h, n, d).clone()
        context.scatter_(2, top[..., None].expand(-1, -1, -1, d), attn @ v)
        out = context.view(b, n, -1) if self.merge_by_view else context.transpose(1, 2).reshape(b, n, e)
        return self.out_projection(out)


def test_a_random_sample_that_only_reorders_a_sum_is_no_dropout():
    # two calls differ by a rounding (6e-8): it was dropout-in-eval, which also hid the port's head-merge
    torch.manual_seed(0)
    assert check(ProbSparseAttention()).passed
    assert check(ProbSparseAttention(merge_by_view=True)).ids == {"head-merge"}


# -- pair-biased attention that requires its mask, with a zero-initialised output (protein structure models) --------
class PairBiasedAttention(nn.Module):
    """Gated attention over single representations ``s`` with a bias from the pair representation ``z``, a required
    float mask (1 = real token) turned into ``(1 - mask) * -1e4``, and an output projection initialised to
    zero (as structure models initialise their last layers). ``flipped`` reads the mask the other way round."""

    def __init__(self, c_s: int = 64, c_z: int = 16, heads: int = 4, flipped: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.flipped = heads, c_s // heads, flipped
        self.norm_s = nn.LayerNorm(c_s)
        self.proj_q = nn.Linear(c_s, c_s)
        self.proj_k = nn.Linear(c_s, c_s, bias=False)
        self.proj_v = nn.Linear(c_s, c_s, bias=False)
        self.proj_g = nn.Linear(c_s, c_s, bias=False)
        self.proj_z = nn.Sequential(nn.LayerNorm(c_z), nn.Linear(c_z, heads, bias=False))
        self.proj_o = nn.Linear(c_s, c_s, bias=False)
        nn.init.zeros_(self.proj_o.weight)

    def forward(self, s, z, mask, multiplicity: int = 1):
        b, n, _ = s.shape
        s = self.norm_s(s)
        q, k, v = (p(s).view(b, n, self.heads, self.head_dim) for p in (self.proj_q, self.proj_k, self.proj_v))
        bias = self.proj_z(z).permute(0, 3, 1, 2)
        keep = 1 - mask if self.flipped else mask
        attn = torch.einsum("bihd,bjhd->bhij", q, k) / self.head_dim ** 0.5 + bias
        attn = (attn + (1 - keep[:, None, None].to(attn.dtype)) * -1e4).softmax(dim=-1)
        o = torch.einsum("bhij,bjhd->bihd", attn, v).reshape(b, n, -1)
        return self.proj_o(torch.sigmoid(self.proj_g(s)) * o)


def _with_pair(module, x, mask):
    """The user's call: a pair representation that is the same for every item, and the mask as given."""
    z = torch.randn(1, x.shape[1], x.shape[1], 16, generator=torch.Generator().manual_seed(3)).to(x)
    return module(x, z.expand(x.shape[0], -1, -1, -1), mask)


def test_a_module_requiring_its_mask_runs_with_a_zero_initialised_output():
    # the search for a mask that hides nothing saw no token change the output and gave up: exit 2
    assert check(PairBiasedAttention(), call=_with_pair, mask="keep-float (B,L)").passed
    assert "mask-inverted" in check(PairBiasedAttention(flipped=True), call=_with_pair, mask="keep-float (B,L)").ids


# -- a softmax written out by hand, on raw weight matrices (exercises and course notebooks) ------------------------
class WrittenOutSoftmaxMHSA(nn.Module):
    """Causal multi-head self-attention on raw ``X @ W`` matrices with the softmax written out: the row maximum
    subtracted, ``exp``, and a division by the row sum (kept, or given its dim back with ``unsqueeze``).
    ``variant``: "scale dropped", "sum over queries", or "no shift" (exp of the scores as they are, summed without
    keepdim: the formula is right, but large scores overflow)."""

    def __init__(self, d_model: int = 64, heads: int = 4, variant: str = "") -> None:
        super().__init__()
        self.heads, self.variant = heads, variant
        self.W_Q, self.W_K, self.W_V, self.W_O = (nn.Parameter(torch.randn(d_model, d_model) / d_model ** 0.5)
                                                  for _ in range(4))

    def forward(self, X):
        b, s, d = X.shape
        dk = d // self.heads
        Q, K, V = ((X @ W).reshape(b, s, self.heads, dk).transpose(1, 2) for W in (self.W_Q, self.W_K, self.W_V))
        scores = Q @ K.transpose(-1, -2)
        if self.variant != "scale dropped":
            scores = scores / math.sqrt(dk)
        causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        if self.variant == "no shift":
            e = torch.exp(scores)
            weights = e / torch.sum(e, dim=-1).unsqueeze(-1)
        else:
            e = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
            weights = e / e.sum(dim=-2 if self.variant == "sum over queries" else -1, keepdim=True)
        return (weights @ V).transpose(1, 2).reshape(b, s, d) @ self.W_O


def test_a_softmax_written_out_by_hand_is_read_as_one():
    # the white box saw no softmax: the right module was inconclusive and a dropped scale went unnamed
    assert check(WrittenOutSoftmaxMHSA(), causal=True).passed
    assert check(WrittenOutSoftmaxMHSA(variant="no shift"), causal=True).ids == {"non-finite"}
    assert check(WrittenOutSoftmaxMHSA(variant="scale dropped"), causal=True).ids == {"missing-scale"}
    assert "softmax-dim" in check(WrittenOutSoftmaxMHSA(variant="sum over queries"), causal=True).ids


# -- a KV cache kept in a plain object the module holds (KV-cache tutorials) ----------------------------------------
class KeyValueStore:
    """Keys and values of earlier calls, grown with ``torch.cat`` on the token axis (dim 2)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class StoreCachedAttention(nn.Module):
    """Causal attention that appends every call's keys and values to a :class:`KeyValueStore` and attends over all
    of them, its causal mask offset by the past. ``slip``: "own keys only" (appended, then only the call's own kept)
    or "no offset" (the mask as if there were no past)."""

    def __init__(self, dim: int = 64, heads: int = 4, slip: str = "") -> None:
        super().__init__()
        self.heads, self.slip = heads, slip
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.store = KeyValueStore()

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (z.view(b, t, self.heads, e // self.heads).transpose(1, 2) for z in self.qkv(x).split(e, dim=2))
        k, v = self.store.extend(k, v)
        if self.slip == "own keys only":
            k, v = k[:, :, -t:], v[:, :, -t:]
        past = 0 if self.slip == "no offset" else k.shape[2] - t
        visible = torch.ones(t, k.shape[2], dtype=torch.bool).tril(diagonal=past)
        att = (q @ k.transpose(-2, -1) / (e // self.heads) ** 0.5).masked_fill(~visible, float("-inf"))
        return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, e))


def test_a_cache_kept_in_a_plain_object_is_put_back_between_calls():
    # the store was not put back: each probe met the last one's keys (dropout-in-eval, half-precision-overflow on
    # the right module); keys appended but never read were certified
    assert check(StoreCachedAttention(), causal=True).passed
    assert check(StoreCachedAttention(slip="own keys only"), causal=True).ids == {"state-dependent"}
    assert check(StoreCachedAttention(slip="no offset"), causal=True).ids == {"state-dependent"}


# -- Meta's reference attention on model-parallel linear layers (fairscale's ColumnParallelLinear) ----------------
class ColumnParallelLinear(nn.Module):
    """A one-process stand-in for a model-parallel Linear: its own class, a (out, in) weight, F.linear."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / in_features ** 0.5)

    def forward(self, x):
        return F.linear(x, self.weight)


class ReferenceStyleAttention(nn.Module):
    """Llama-reference attention on parallel linear layers ``wq``, ``wk``, ``wv``, ``wo``, through SDPA with a causal
    mask. ``slip``: "v from wk" (the value projection never used) or "no wo" (the output projection skipped)."""

    def __init__(self, dim: int = 64, heads: int = 4, slip: str = "") -> None:
        super().__init__()
        self.heads, self.slip = heads, slip
        self.wq, self.wk, self.wv, self.wo = (ColumnParallelLinear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, e = x.shape
        v_proj = self.wk if self.slip == "v from wk" else self.wv
        q, k, v = (p(x).view(b, n, self.heads, e // self.heads).transpose(1, 2) for p in (self.wq, self.wk, v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, e)
        return out if self.slip == "no wo" else self.wo(out)


def test_an_unused_projection_on_another_librarys_linear_layer_is_named():
    # only nn.Linear was taken for a projection: both slips were certified on Meta's reference code
    assert check(ReferenceStyleAttention(), causal=True).passed
    assert "no-grad" in check(ReferenceStyleAttention(slip="v from wk"), causal=True).ids
    assert check(ReferenceStyleAttention(slip="no wo"), causal=True).ids == {"no-grad"}


def _rotate(xq, xk, freqs_cis):
    """Meta's complex rotary: pairs of features as complex numbers, multiplied by e^(i m theta)."""
    def one(t):
        z = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(z * freqs_cis[None, :, None, :]).flatten(3).type_as(t)
    return one(xq), one(xk)


class ReferenceCachedRotaryAttention(nn.Module):
    """Llama-reference attention with complex rotary and a preallocated cache moved to q's dtype with
    ``cache.to(xq)``, on parallel linear layers. ``q_only``: k's rotation computed and dropped
    (``xq, _ = apply_rotary_emb(xq, xk, ...)``)."""

    def __init__(self, dim: int = 64, heads: int = 4, q_only: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.q_only = heads, dim // heads, q_only
        self.wq, self.wk, self.wv, self.wo = (ColumnParallelLinear(dim, dim) for _ in range(4))
        d = self.head_dim
        angles = torch.outer(torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.cache_k = torch.zeros(4, 64, heads, d)
        self.cache_v = torch.zeros(4, 64, heads, d)

    def forward(self, x):
        b, n, _ = x.shape
        xq, xk, xv = (w(x).view(b, n, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.q_only:
            xq, _ = _rotate(xq, xk, self.freqs_cis[:n])
        else:
            xq, xk = _rotate(xq, xk, self.freqs_cis[:n])
        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)
        self.cache_k[:b, :n] = xk
        self.cache_v[:b, :n] = xv
        keys, values = self.cache_k[:b, :n], self.cache_v[:b, :n]
        q, k, v = (t.transpose(1, 2) for t in (xq, keys, values))
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + torch.full((n, n), float("-inf")).triu(1)
        out = F.softmax(scores.float(), dim=-1).type_as(q) @ v
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


def test_rotary_on_q_only_through_a_cache_moved_to_qs_dtype_is_one_sided():
    # cache.to(xq) took q's rotation for k's, and the parallel layers ended no walk: rotary-mismatch
    assert check(ReferenceCachedRotaryAttention(), causal=True).passed
    assert check(ReferenceCachedRotaryAttention(q_only=True), causal=True).ids == {"rotary-one-side"}


# -- caches kept in a dict or a list the module holds (Whisper's kv_cache dict, lists appended to) ------------------
class ContainerCachedAttention(nn.Module):
    """Causal attention keeping earlier keys and values in a dict (``self.kv_cache["k"]``) or in lists appended to
    (``self.past_k``), its causal mask offset by the past. ``offset_kept_at_zero``: the mask as if there were no past
    (the bug)."""

    def __init__(self, dim: int = 64, heads: int = 4, store: str = "dict", offset_kept_at_zero: bool = False) -> None:
        super().__init__()
        self.heads, self.store, self.zero = heads, store, offset_kept_at_zero
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.kv_cache: dict[str, torch.Tensor] = {}
        self.past_k: list[torch.Tensor] = []
        self.past_v: list[torch.Tensor] = []

    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (z.view(b, t, self.heads, e // self.heads).transpose(1, 2) for z in self.qkv(x).split(e, dim=2))
        if self.store == "dict":
            if "k" in self.kv_cache:
                k, v = torch.cat([self.kv_cache["k"], k], dim=2), torch.cat([self.kv_cache["v"], v], dim=2)
            self.kv_cache["k"], self.kv_cache["v"] = k, v
        else:
            self.past_k.append(k)
            self.past_v.append(v)
            k, v = torch.cat(self.past_k, dim=2), torch.cat(self.past_v, dim=2)
        past = 0 if self.zero else k.shape[2] - t
        visible = torch.ones(t, k.shape[2], dtype=torch.bool).tril(diagonal=past)
        att = (q @ k.transpose(-2, -1) / (e // self.heads) ** 0.5).masked_fill(~visible, float("-inf"))
        return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, e))


def test_a_cache_kept_in_a_dict_or_a_list_is_put_back_between_calls():
    # items set or appended in place were not put back: dropout-in-eval on the right dict cache, exit 2 on the list
    for store in ("dict", "list"):
        assert check(ContainerCachedAttention(store=store), causal=True).passed, store
        assert check(ContainerCachedAttention(store=store, offset_kept_at_zero=True), causal=True).ids == \
            {"state-dependent"}, store


# -- projections that are convolutions over one position (GPT-2's Conv1D, nn.Conv1d of kernel 1) -------------------
class Conv1D(nn.Module):
    """GPT-2's Conv1D: a Linear whose weight is (in, out), applied with addmm."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.nf)


class PointwiseProjectedAttention(nn.Module):
    """Attention whose projections are GPT-2 ``Conv1D`` layers (``kind="gpt2"``: ``q_attn``, ``k_attn``, ``v_attn``,
    ``c_proj``) or ``nn.Conv1d`` of kernel 1 over (B, E, L) (``kind="conv"``: ``to_q``, ``to_k``, ``to_v``,
    ``to_out``). ``slip``: "v from k" (the value projection never used) or "no out" (the output projection
    skipped)."""

    def __init__(self, dim: int = 64, heads: int = 4, kind: str = "gpt2", slip: str = "") -> None:
        super().__init__()
        self.heads, self.kind, self.slip = heads, kind, slip
        if kind == "gpt2":
            self.q_attn, self.k_attn, self.v_attn, self.c_proj = (Conv1D(dim, dim) for _ in range(4))
        else:
            self.to_q, self.to_k, self.to_v, self.to_out = (nn.Conv1d(dim, dim, 1) for _ in range(4))

    def forward(self, x):
        b, n, e = x.shape
        if self.kind == "gpt2":
            proj = [self.q_attn, self.k_attn, self.k_attn if self.slip == "v from k" else self.v_attn]
            q, k, v = (p(x) for p in proj)
        else:
            c = x.transpose(1, 2)
            proj = [self.to_q, self.to_k, self.to_k if self.slip == "v from k" else self.to_v]
            q, k, v = (p(c).transpose(1, 2) for p in proj)
        q, k, v = (t.view(b, n, self.heads, e // self.heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, e)
        if self.slip == "no out":
            return out
        return self.c_proj(out) if self.kind == "gpt2" else self.to_out(out.transpose(1, 2)).transpose(1, 2)


def test_an_unused_pointwise_convolution_projection_is_named():
    # only Linear layers were taken for projections: a value or output projection never used was certified
    for kind in ("gpt2", "conv"):
        assert check(PointwiseProjectedAttention(kind=kind)).passed, kind
        for slip in ("v from k", "no out"):
            assert "no-grad" in check(PointwiseProjectedAttention(kind=kind, slip=slip)).ids, (kind, slip)


# -- a whole model run under inference_mode, its layers on parallel linear layers (Meta's reference Transformer) ---
class ReferenceStyleModel(nn.Module):
    """Token embeddings, two causal :class:`ReferenceStyleAttention` blocks with residuals, at width 32; its forward
    runs under ``torch.inference_mode()``, as the reference code's does."""

    def __init__(self, dim: int = 32, slip: str = "") -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(100, dim)
        self.layers = nn.ModuleList(ReferenceStyleAttention(dim, heads=4, slip=slip) for _ in range(2))

    @torch.inference_mode()
    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return h


def test_a_model_run_under_inference_mode_is_replayed_at_its_width():
    # its recorded calls were inference tensors (autograd refused them: inconclusive), and its layers were
    # probed at the default width 64 (could not run)
    from selfattn.check import check_model
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    report = check_model(ReferenceStyleModel(), {"tokens": tokens}, causal=True)
    assert report.verdict == "passed", report.summary()
    report = check_model(ReferenceStyleModel(slip="no wo"), {"tokens": tokens}, causal=True)
    assert all(layer.ids == {"no-grad"} for layer in report.layers.values()), report.summary()


# -- models that build their padding mask from token ids (classifiers with a padding index, fairseq encoders) ------
class PaddedTokensLayer(nn.Module):
    """Post-norm attention taking ``key_padding_mask`` (True = padding), filled with -inf."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, key_padding_mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (e // self.heads) ** 0.5
        if key_padding_mask is not None:
            hidden = key_padding_mask if key_padding_mask.dim() == 4 else key_padding_mask[:, None, None, :]
            scores = scores.masked_fill(hidden, float("-inf"))
        return self.norm(x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e)))


class PaddedTokensEncoder(nn.Module):
    """Token ids with padding index 0, three :class:`PaddedTokensLayer` blocks given ``tokens.eq(0)``. ``slip``:
    "dropped on one layer" (the middle block gets None), "query axis" (the padding laid out (B, 1, L, 1)) or "query
    rows" (laid out (B, 1, L, L) with the padded queries' rows hidden)."""

    def __init__(self, dim: int = 32, slip: str = "") -> None:
        super().__init__()
        self.slip = slip
        self.embed = nn.Embedding(50, dim, padding_idx=0)
        self.layers = nn.ModuleList(PaddedTokensLayer(dim) for _ in range(3))

    def forward(self, tokens):
        pad = tokens.eq(0)
        if self.slip == "query axis":
            pad = pad[:, None, :, None]
        elif self.slip == "query rows":  # BERT4Rec's repeat: (B, 1, L, L), each padded query's row hidden
            pad = pad[:, None, :, None].expand(-1, 1, -1, pad.shape[1])
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            h = layer(h, key_padding_mask=None if self.slip == "dropped on one layer" and i == 1 else pad)
        return h


def test_a_models_padding_from_token_ids_is_judged_on_every_layer():
    # the padding was read from the mask each layer got: a layer given none, and a mask laid out on the query axis
    # (no padding read from a column), were certified
    from selfattn.check import check_model
    tokens = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    tokens[1, -3:] = 0
    assert check_model(PaddedTokensEncoder(), (tokens,)).verdict == "passed"
    report = check_model(PaddedTokensEncoder(slip="dropped on one layer"), (tokens,))
    errors = [sorted(f.id for f in r.findings if f.severity == "error") for r in report.layers.values()]
    assert errors == [[], ["mask-ignored"], []], report.summary()
    for slip in ("query axis", "query rows"):  # the second tells no padding: the embedding's padding index does
        report = check_model(PaddedTokensEncoder(slip=slip), (tokens,))
        assert all("mask-broadcast" in r.ids for r in report.layers.values()), (slip, report.summary())


# -- a model handing its layers the causal pattern and the padding as an additive bias under another name ----------
class BiasedBlock(nn.Module):
    """Attention taking ``attn_bias`` (B, 1, T, T), 0 = may attend, finfo.min = hidden, added to the scores."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, attn_bias):
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(e // self.heads) + attn_bias
        return x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, e))


class BiasedEncoder(nn.Module):
    """Per-step features and a (B, T) keep mask of the real steps; the blocks get the causal pattern and the padding
    joined into one additive bias."""

    def __init__(self, features: int = 10, dim: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(BiasedBlock(dim) for _ in range(2))

    def forward(self, steps, seqmask):
        x = self.inp(steps)
        t = x.shape[1]
        blocked = torch.ones(t, t, dtype=torch.bool).triu(1)[None, None] | ~seqmask[:, None, None, :]
        bias = torch.zeros(blocked.shape, dtype=x.dtype).masked_fill(blocked, torch.finfo(x.dtype).min)
        for block in self.blocks:
            x = block(x, bias)
        return x


def test_a_models_additive_bias_that_is_its_mask_is_replayed_as_one():
    # attn_bias is named like no mask: replayed as recorded, the items' padding read as keys hidden by no mask
    # (mask-ignored on a correct model)
    from selfattn.check import check_model
    seqmask = torch.ones(3, 8, dtype=torch.bool)
    seqmask[1, 6:] = False
    seqmask[2, 4:] = False
    steps = torch.randn(3, 8, 10, generator=torch.Generator().manual_seed(2))
    report = check_model(BiasedEncoder(), (steps, seqmask), causal=True)
    assert report.verdict == "passed", report.summary()


# -- a sequence-first model: token ids (L, B), blocks computing over (B * H, L, D) with bmm -------------------------
class SequenceFirstBlock(nn.Module):
    """A post-norm block on (L, B, E) states with an (L, L) additive causal mask, its heads folded into the batch
    for ``torch.bmm``, as torch's functional attention lays them out."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, z, mask):
        n, b, e = z.shape
        d = e // self.heads
        q, k, v = (t.reshape(n, b * self.heads, d).transpose(0, 1) for t in self.in_proj(z).chunk(3, dim=-1))
        weights = torch.softmax(torch.bmm(q, k.transpose(1, 2)) / math.sqrt(d) + mask, dim=-1)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(n, b, e)
        return self.norm(z + self.out_proj(out))


class SequenceFirstLM(nn.Module):
    """Token ids (L, B), learned positions, two :class:`SequenceFirstBlock` layers given the causal mask."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, dim)
        self.pos = nn.Parameter(torch.randn(20, 1, dim) * 0.1)
        self.blocks = nn.ModuleList(SequenceFirstBlock(dim) for _ in range(2))

    def forward(self, ids):
        n = ids.shape[0]
        z = self.embed(ids) + self.pos[:n]
        mask = torch.full((n, n), float("-inf")).triu(1)
        for block in self.blocks:
            z = block(z, mask)
        return z


def test_a_model_taking_its_token_ids_sequence_first_is_replayed_so():
    # dim 0 of the ids was taken for the batch: the right model was batch-mixing, its items read as tokens
    from selfattn.check import check_model
    ids = torch.randint(0, 50, (9, 3), generator=torch.Generator().manual_seed(4))
    report = check_model(SequenceFirstLM(), (ids,))
    assert report.verdict == "passed", report.summary()


# -- a causal model whose left-padded queries are left with no key (minGPT with an attention_mask) ------------------
class LeftPaddedCausalBlock(nn.Module):
    """Causal attention taking ``attention_mask`` (B, L), 1 = token; hidden scores filled with -inf (``fill="-inf"``)
    or finfo.min. With left padding, -inf leaves the padded queries with no key: their rows are NaN."""

    def __init__(self, dim: int = 32, heads: int = 4, fill: str = "-inf") -> None:
        super().__init__()
        self.heads, self.fill = heads, fill
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x, attention_mask):
        b, n, e = x.shape
        q, k, v = self.c_attn(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        hidden = torch.ones(n, n, dtype=torch.bool).triu(1) | (attention_mask[:, None, None, :] == 0)
        fill = float("-inf") if self.fill == "-inf" else torch.finfo(x.dtype).min
        scores = (q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)).masked_fill(hidden, fill)
        return x + self.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class LeftPaddedLM(nn.Module):
    def __init__(self, dim: int = 32, fill: str = "-inf") -> None:
        super().__init__()
        self.wte = nn.Embedding(50, dim)
        self.h = nn.ModuleList(LeftPaddedCausalBlock(dim, fill=fill) for _ in range(3))

    def forward(self, input_ids, attention_mask):
        x = self.wte(input_ids)
        for block in self.h:
            x = block(x, attention_mask)
        return x


def test_nan_that_reaches_a_models_real_tokens_is_named():
    # each layer was probed on the doctor's own inputs: a model whose real tokens come out NaN was certified
    from selfattn.check import check_model
    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(6))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0
    inputs = {"input_ids": ids, "attention_mask": attention_mask}
    assert check_model(LeftPaddedLM(fill="finfo.min"), inputs, causal=True).verdict == "passed"
    report = check_model(LeftPaddedLM(), inputs, causal=True)
    assert report.verdict == "failed" and "non-finite" in report.layers["h.1"].ids, report.summary()


# -- a causal layer reading the key padding out of a full (B, 1, L, L) mask ----------------------------------------
class PaddingFromFullMask(nn.Module):
    """Causal attention through SDPA, given the caller's (B, 1, L, L) keep-mask (causal and padding joined), from
    which it takes the key padding: its last row (right), or its first column (``column=True``: the bug, which
    hides every key of an item whose first token is padding)."""

    def __init__(self, dim: int = 32, heads: int = 4, column: bool = False) -> None:
        super().__init__()
        self.heads, self.column = heads, column
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, attention_mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, e // self.heads).permute(2, 0, 3, 1, 4)
        visible = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        if attention_mask is not None:
            pad = attention_mask[:, 0, :, 0] if self.column else attention_mask[:, 0, -1, :]
            visible = visible & pad.bool()[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.out(out.transpose(1, 2).reshape(b, n, e))


def test_key_padding_read_from_a_full_masks_column_is_named():
    # the padding run the white box adds for a mask that matched no convention padded the end, which a causal
    # layer hides anyway: the column read was certified
    assert check(PaddingFromFullMask(), causal=True, mask="keep (B,1,L,L)").passed
    assert not check(PaddingFromFullMask(column=True), causal=True, mask="keep (B,1,L,L)").passed


# -- a layer that reads its mask only as given or not (Whisper's SDPA path: is_causal=mask is not None) -------------
class SwitchMaskAttention(nn.Module):
    """Self-attention through SDPA that takes the model's causal mask buffer but reads it only as a switch."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, mask=None):
        b, n, e = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=mask is not None and n > 1)
        return self.out(out.transpose(1, 2).reshape(b, n, e))


class SwitchMaskDecoder(nn.Module):
    """Token ids, a (n_ctx, n_ctx) -inf causal buffer handed to every layer, as Whisper's text decoder does."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(60, dim)
        self.blocks = nn.ModuleList(SwitchMaskAttention(dim) for _ in range(2))
        self.register_buffer("mask", torch.full((16, 16), float("-inf")).triu(1), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x, mask=self.mask)
        return x


def test_a_mask_read_only_as_a_causal_switch_in_a_causal_model_is_no_ignored_mask():
    # every mask the doctor sent made it causal, as the model's does: mask-ignored on Whisper's decoder as shipped
    from selfattn.check import check_model
    tokens = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(7))
    assert check_model(SwitchMaskDecoder(), (tokens,), causal=True).verdict == "passed"
    # without causal=True nothing tells what the switch stands for: inconclusive, and the report says what to say
    report = check_model(SwitchMaskDecoder(), (tokens,))
    assert report.verdict == "inconclusive", report.summary()
    assert all("--causal" in r.coverage["mask"] for r in report.layers.values()), report.summary()
    # the layer alone runs without a mask unless a call gives it one: --causal alone would judge the bidirectional
    # plain call, so the advice asks for such a call too
    assert "--call" in check(SwitchMaskAttention()).coverage["mask"]


# -- a model handed over in train mode, its sublayers called through lambdas (the Annotated Transformer) ------------
class AnnotatedAttention(nn.Module):
    """Multi-head attention on (query, key, value) with dropout on the weights, as the Annotated Transformer's."""

    def __init__(self, dim: int = 32, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.linears = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, mask=None):
        b = query.shape[0]
        q, k, v = (lin(t).view(b, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2)
                   for lin, t in zip(self.linears, (query, key, value), strict=False))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(1) == 0, -1e4)
        out = (self.dropout(scores.softmax(-1)) @ v).transpose(1, 2).reshape(b, -1, query.shape[-1])
        return self.linears[-1](out)


class SublayerConnection(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class AnnotatedDecoderLayer(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.self_attn, self.src_attn = AnnotatedAttention(dim), AnnotatedAttention(dim)
        self.sublayer = nn.ModuleList(SublayerConnection(dim) for _ in range(2))

    def forward(self, x, memory, src_mask, tgt_mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, tgt_mask))
        return self.sublayer[1](x, lambda x: self.src_attn(x, memory, memory, src_mask))


class AnnotatedDecoder(nn.Module):
    """Target ids and an encoded source; its layers' cross-attention reached through a lambda."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, dim)
        self.layers = nn.ModuleList(AnnotatedDecoderLayer(dim) for _ in range(2))

    def forward(self, tgt, memory):
        n = tgt.shape[1]
        tgt_mask = torch.ones(1, n, n, dtype=torch.bool).tril()
        src_mask = torch.ones(memory.shape[0], 1, memory.shape[1], dtype=torch.bool)
        x = self.embed(tgt)
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return x


def test_a_model_handed_over_in_train_mode_is_checked_in_eval_mode_throughout():
    # the model was put back in train mode after its recorded run, so the cross-attention its lambda closes over ran
    # with dropout on in every replay: it was checked as a self-attention (dropout-in-eval, state-dependent)
    from selfattn.check import check_model
    tgt = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(8))
    memory = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(9))
    model = AnnotatedDecoder().train()
    report = check_model(model, (tgt, memory))
    assert report.verdict == "passed", report.summary()
    assert model.training and model.layers[0].src_attn.dropout.training  # its modes given back

"""The doctor on layers replayed as their model calls them, where the call carries more than the hidden states.

Each module is written in the style of the code base it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfattn.check import check_model


# -- a model that pads its input to a multiple of a window and tells the layer which rows are padding (Longformer) --
class IndexMaskedAttention(nn.Module):
    """Self-attention called with the model's additive key mask (B, L) and ``is_index_masked`` (B, L): the padded
    queries' weights are zeroed, so their rows are 0 whatever the tokens (as Longformer's layer does)."""

    def __init__(self, dim: int = 32, heads: int = 4, scaled: bool = True) -> None:
        super().__init__()
        self.heads, self.scaled = heads, scaled
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, attention_mask=None, is_index_masked=None):
        b, n, e = hidden_states.shape
        d = e // self.heads

        def split(t):
            return t.view(b, n, self.heads, d).transpose(1, 2)

        q, k, v = split(self.query(hidden_states)), split(self.key(hidden_states)), split(self.value(hidden_states))
        if self.scaled:
            q = q / math.sqrt(d)
        scores = q @ k.transpose(-1, -2)
        if attention_mask is not None:
            scores = scores + attention_mask[:, None, None, :]
        probs = scores.softmax(-1)
        if is_index_masked is not None:
            probs = probs.masked_fill(is_index_masked[:, None, :, None], 0.0)
        return ((probs @ v).transpose(1, 2).reshape(b, n, e),)


class PaddedToTheWindow(nn.Module):
    """Token ids padded to a multiple of ``window`` inside the model; the layers get the additive mask and the
    padded rows' index."""

    def __init__(self, vocab: int = 50, dim: int = 32, window: int = 16, scaled: bool = True) -> None:
        super().__init__()
        self.window = window
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([IndexMaskedAttention(dim, scaled=scaled) for _ in range(2)])

    def forward(self, input_ids):
        n = input_ids.shape[1]
        input_ids = F.pad(input_ids, (0, (-n) % self.window))
        keep = torch.zeros_like(input_ids, dtype=torch.bool)
        keep[:, :n] = True
        additive = (~keep).float() * -10000.0
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h, attention_mask=additive, is_index_masked=~keep)[0]
        return h[:, :n]


@pytest.mark.parametrize("scaled", [True, False], ids=["correct", "unscaled"])
def test_rows_the_model_pads_in_its_call_are_not_read_as_a_pattern(scaled):
    """catches: a layer whose model pads its input to the window and zeroes the padded rows through the call
    (Longformer, LED) was definition-mismatch ("some outputs do not depend on their own token"); the real
    tokens are judged alone, and a bug among them is still named."""
    torch.manual_seed(0)
    report = check_model(PaddedToTheWindow(scaled=scaled), (torch.randint(1, 50, (2, 7)),), layers=1)
    (layer,) = report.layers.values()
    assert "recorded padding" in layer.inferred, layer.inferred
    if scaled:
        assert layer.passed, layer.findings
    else:
        assert "missing-scale" in {f.id for f in layer.findings}
        assert "definition-mismatch" not in {f.id for f in layer.findings}


# -- a speech encoder given lengths: the model's padding is only in the (B, 1, T) mask it builds (ESPnet, WeNet) ----
class EspnetStyleAttention(nn.Module):
    """ESPnet's MultiHeadedAttention(query, key, value, mask): mask (B, 1, T), True = keep, turned into
    ``mask.unsqueeze(1).eq(0)`` (True = masked) and filled with the dtype's min; ``inverted`` reads it with
    ``eq(1)``."""

    def __init__(self, dim: int = 32, heads: int = 4, inverted: bool = False) -> None:
        super().__init__()
        self.h, self.d_k, self.inverted = heads, dim // heads, inverted
        self.linear_q, self.linear_k = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.linear_v, self.linear_out = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, query, key, value, mask):
        b = query.size(0)
        q = self.linear_q(query).view(b, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(b, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(b, -1, self.h, self.d_k).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        masked = mask.unsqueeze(1).eq(1 if self.inverted else 0)
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        attn = scores.softmax(-1).masked_fill(masked, 0.0)
        return self.linear_out((attn @ v).transpose(1, 2).reshape(b, -1, self.h * self.d_k))


class LengthsEncoder(nn.Module):
    """A speech encoder: features (B, T, F) and their lengths (B,) in, the (B, 1, T) keep mask built from them and
    passed to every layer as (query, key, value, mask)."""

    def __init__(self, feats: int = 8, dim: int = 32, last_inverted: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(feats, dim)
        self.layers = nn.ModuleList([EspnetStyleAttention(dim) for _ in range(2)] +
                                    [EspnetStyleAttention(dim, inverted=last_inverted)])

    def forward(self, xs, ilens):
        mask = (torch.arange(xs.shape[1])[None, :] < ilens[:, None])[:, None, :]
        x = self.embed(xs)
        for layer in self.layers:
            x = x + layer(x, x, x, mask)
        return x, mask


@pytest.mark.parametrize("bug", [False, True], ids=["correct", "last-layer-inverted"])
def test_padding_in_the_mask_a_model_builds_from_lengths_is_checked(bug):
    """catches: a speech encoder whose last layer reads the (B, 1, T) mask the model builds from the lengths the
    other way round was certified: the model's inputs name no padding mask, so the replay with the padded frames
    changed never ran. The padding is now read from the mask the model passes (the keep value is the one that
    fills a whole item)."""
    torch.manual_seed(0)
    report = check_model(LengthsEncoder(last_inverted=bug), (torch.randn(2, 9, 8), torch.tensor([9, 6])))
    verdicts = [(row["verdict"], row["findings"]) for row in report.summary()]
    if bug:
        assert verdicts[:2] == [("passed", [])] * 2 and "mask-inverted" in verdicts[2][1], verdicts
    else:
        assert verdicts == [("passed", [])] * 3, verdicts


# -- a decoder whose layers are causal only without a mask, and a model that passes them its key padding mask ------
class CausalUnlessMasked(nn.Module):
    """Attention that is causal through SDPA's ``is_causal`` when it gets no mask; a given mask replaces the pattern
    (litgpt's and several Hugging Face ports' design: the caller's mask must carry causality)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, e // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.proj(y.transpose(1, 2).reshape(b, n, e))


class PaddedDecoder(nn.Module):
    """``causal_in_mask``: the model combines the causal pattern with the padding (right); else it passes only the
    (B, 1, 1, L) key padding mask, and its layers drop their causality."""

    def __init__(self, causal_in_mask: bool = True) -> None:
        super().__init__()
        self.causal_in_mask = causal_in_mask
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(CausalUnlessMasked() for _ in range(2))

    def forward(self, input_ids, attention_mask):
        n = input_ids.shape[1]
        mask = attention_mask.bool()[:, None, None, :]
        if self.causal_in_mask:
            mask = mask & torch.ones(n, n, dtype=torch.bool).tril()
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h, mask)
        return h


@pytest.mark.parametrize("causal_in_mask", [True, False], ids=["correct", "padding-only"])
def test_a_causal_model_that_passes_only_its_padding_to_layers_that_drop_causality_leaks(causal_in_mask):
    """catches: check_model(..., causal=True) certified a decoder that hands its layers only the key padding mask
    while they are causal only when they get no mask: every token saw the future. The replay with the model's own
    mask is read for future keys when the user says the model is causal."""
    torch.manual_seed(0)
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[1, 6:] = 0
    report = check_model(PaddedDecoder(causal_in_mask), {"input_ids": torch.randint(0, 50, (2, 8)),
                                                         "attention_mask": padding}, causal=True)
    rows = report.summary()
    if causal_in_mask:
        assert all(row["verdict"] == "passed" for row in rows), rows
    else:
        assert all("causal-leak" in row["findings"] for row in rows), rows


# -- SASRec: torch's MultiheadAttention, sequence first, called with a normed query and the raw states as keys ------
class SASRecLike(nn.Module):
    """pmixer's SASRec.pytorch in short: item embeddings, left-padded sequences (item 0 = padding), each block
    ``mha(LayerNorm(seqs), seqs, seqs, attn_mask=~tril, key_padding_mask=padding)`` on (L, B, E) states. ``bug``:
    "kpm-inverted" (the padding mask negated), "mask-anticausal" (tril(-1) hidden: each item sees the future)."""

    def __init__(self, items: int = 50, dim: int = 32, bug: str | None = None) -> None:
        super().__init__()
        self.bug = bug
        self.item_emb = nn.Embedding(items + 1, dim, padding_idx=0)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.attention_layers = nn.ModuleList(nn.MultiheadAttention(dim, 2) for _ in range(2))

    def forward(self, log_seqs):
        timeline_mask = log_seqs == 0
        seqs = self.item_emb(log_seqs) * ~timeline_mask.unsqueeze(-1)
        n = seqs.shape[1]
        causal = ~torch.tril(torch.ones(n, n, dtype=torch.bool))
        if self.bug == "mask-anticausal":
            causal = torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-1)
        padding = ~timeline_mask if self.bug == "kpm-inverted" else timeline_mask
        for norm, attention in zip(self.norms, self.attention_layers, strict=True):
            seqs = seqs.transpose(0, 1)
            q = norm(seqs)
            if self.bug == "keys-normed":  # the other way round: the keys and values normed, the query raw
                out, _ = attention(seqs, q, q, attn_mask=causal, key_padding_mask=padding)
            else:
                out, _ = attention(q, seqs, seqs, attn_mask=causal, key_padding_mask=padding)
            seqs = (q + out).transpose(0, 1) * ~timeline_mask.unsqueeze(-1)
        return seqs


def _item_sequences() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(1, 50, (3, 10), generator=g)
    seqs[1, 6:] = 0
    seqs[2, 3:] = 0
    return seqs


@pytest.mark.parametrize(("bug", "expected"), [(None, None), ("keys-normed", None), ("kpm-inverted", "mask-inverted"),
                                               ("mask-anticausal", "causal-leak")])
def test_a_query_normed_apart_from_its_keys_is_self_attention(bug, expected):
    """catches: SASRec's mha(LayerNorm(x), x, x) replayed with the doctor's input as the query only, the keys left
    as recorded: definition-mismatch ("each query sees only its own token") and mask-ignored on correct code, an
    inverted padding mask certified, a mask that shows only the future read as a cross-attention (changing the
    first token reached no other row). The keys and values go with the query when they are one tensor of its
    shape, the padding is read from the mask the model passes, and the last token is changed too. Keys and
    values normed where the query is not (a correct variant) were read as a cross-attention and not checked."""
    torch.manual_seed(0)
    report = check_model(SASRecLike(bug=bug), (_item_sequences(),), layers=1)
    assert not report.not_self_attention, report.not_self_attention
    (layer,) = report.layers.values()
    if expected is None:
        assert layer.passed, layer.findings
    else:
        assert expected in layer.ids, layer.findings


# -- a model whose layers get no mask and read none (TSLib's FullAttention(mask_flag=False), iTransformer) ----------
class FullAttention(nn.Module):
    """TSLib's FullAttention wrapped in its AttentionLayer: ``attn_mask`` taken, read only when ``mask_flag``."""

    def __init__(self, dim: int = 32, heads: int = 4, mask_flag: bool = False) -> None:
        super().__init__()
        self.h, self.mask_flag = heads, mask_flag
        self.query_projection, self.key_projection = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.value_projection, self.out_projection = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, queries, keys, values, attn_mask):
        b, n, e = queries.shape
        q = self.query_projection(queries).view(b, n, self.h, -1)
        k = self.key_projection(keys).view(b, n, self.h, -1)
        v = self.value_projection(values).view(b, n, self.h, -1)
        scores = torch.einsum("blhe,bshe->bhls", q, k) / math.sqrt(q.shape[-1])
        if self.mask_flag and attn_mask is not None:
            scores = scores.masked_fill(attn_mask, float("-inf"))
        out = torch.einsum("bhls,bshd->blhd", scores.softmax(-1), v).reshape(b, n, e)
        return self.out_projection(out), None


class VariateTokens(nn.Module):
    """iTransformer: each variate's series embedded as one token, attention over the variates, no mask."""

    def __init__(self, steps: int = 24, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(steps, dim)
        self.layers = nn.ModuleList(FullAttention(dim) for _ in range(2))

    def forward(self, x_enc):
        h = self.embed(x_enc.transpose(1, 2))
        for layer in self.layers:
            h = h + layer(h, h, h, attn_mask=None)[0]
        return h


def test_a_mask_the_model_never_passes_and_the_layer_never_reads_is_not_judged():
    """catches: iTransformer's layers, to which the model passes attn_mask=None and which read no mask by design,
    were mask-ignored; the mask probe is not applicable as the model calls them, and said so."""
    torch.manual_seed(0)
    report = check_model(VariateTokens(), (torch.randn(2, 24, 7),))
    assert report.passed, report.summary()
    assert all("model's mask" in r.inferred for r in report.layers.values())


# -- a bias added to the weights after the softmax (a Graphormer port's bug): the layer is still found --------------
class BiasAfterSoftmax(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attn_bias):
        b, n, e = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        probs = (q @ k.transpose(-1, -2) / math.sqrt(e // self.h)).softmax(-1) + attn_bias
        return self.out((probs @ v).transpose(1, 2).reshape(b, n, e))


class GraphWithBias(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, dim)
        self.spatial = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(BiasAfterSoftmax(dim) for _ in range(2))

    def forward(self, nodes, distances):
        bias = self.spatial(distances).permute(0, 3, 1, 2)
        h = self.embed(nodes)
        for layer in self.layers:
            h = h + layer(h, bias)
        return h


def test_a_model_whose_bias_is_added_after_the_softmax_has_its_attention_found():
    """catches: check_model said "no attention layer found" on a model whose layers add a bias to the weights
    after the softmax; the weights are followed through the addition, and the bug is named."""
    torch.manual_seed(0)
    nodes, distances = torch.randint(0, 20, (2, 6)), torch.randint(0, 8, (2, 6, 6))
    report = check_model(GraphWithBias(), (nodes, distances))
    assert len(report.layers) == 2 and report.verdict == "failed", report.summary()


# -- PyTorch's translation tutorial: nn.Transformer, sequence first, a decoder's cross-attention over the source ----
class Seq2SeqTransformer(nn.Module):
    """The tutorial's model in short: token embeddings, nn.Transformer (L, B, E), a causal target mask and both
    padding masks; the decoder's cross-attention takes the source's memory as keys and values."""

    def __init__(self, vocab: int = 40, dim: int = 32) -> None:
        super().__init__()
        self.src_emb, self.tgt_emb = nn.Embedding(vocab, dim), nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, 4, 1, 1, 64, dropout=0.0)

    def forward(self, src, tgt):
        src_pad, tgt_pad = (src == 0).T, (tgt == 0).T
        tgt_mask = self.transformer.generate_square_subsequent_mask(tgt.shape[0])
        return self.transformer(self.src_emb(src), self.tgt_emb(tgt), tgt_mask=tgt_mask,
                                src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                                memory_key_padding_mask=src_pad)


def test_a_sequence_first_cross_attention_is_not_checked_as_self_attention():
    """catches: the decoder's cross-attention of a sequence-first nn.Transformer was checked as self-attention
    (definition-mismatch: "each query sees only its own token"): the test that its rows depend on its own input's
    other tokens handed the layer the recorded (L, B, E) states where the replay takes (B, L, E), and failed."""
    torch.manual_seed(0)
    src, tgt = torch.randint(1, 40, (9, 3)), torch.randint(1, 40, (7, 3))
    src[7:, 1], tgt[5:, 2] = 0, 0
    report = check_model(Seq2SeqTransformer().eval(), (src, tgt))
    assert list(report.not_self_attention) == ["transformer.decoder.layers.0.multihead_attn"], report.summary()
    assert report.passed, report.summary()


# -- decoders whose causality comes from the model: a switch, a buffer cut by the layer, one layer left out ----------
class SwitchedAttention(nn.Module):
    """MPT's layer in short: forward(x, attn_bias, attention_mask, is_causal=True); the causal pattern is built
    from the switch and combined with the (B, L) padding mask. ``ignores_switch``: the bug."""

    def __init__(self, dim: int = 32, heads: int = 4, ignores_switch: bool = False) -> None:
        super().__init__()
        self.h, self.ignores_switch = heads, ignores_switch
        self.Wqkv, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attn_bias=None, attention_mask=None, is_causal=True):
        b, n, e = x.shape
        q, k, v = self.Wqkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(e // self.h)
        if attn_bias is not None:
            scores = scores + attn_bias[..., -n:, -n:]
        if is_causal and not self.ignores_switch:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask[:, None, None, :].bool(), float("-inf"))
        return self.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class BufferedAttention(nn.Module):
    """Whisper's MultiHeadAttention in short: forward(x, xa=None, mask=None), the model's (n_ctx, n_ctx) -inf
    buffer cut to the tokens by the layer."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, xa=None, mask=None):
        b, n, e = x.shape
        q, k, v = (f(x).view(b, n, self.h, -1).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(e // self.h)
        if mask is not None:
            scores = scores + mask[:n, :n]
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class SwitchedDecoder(nn.Module):
    """``style``: "switch" (is_causal=True and the padding mask to every layer), "buffer" (Whisper's layers and
    (16, 16) causal buffer, no padding), "skip-one" (the model passes layer 1 no causal switch); ``bad_layer``: that
    layer ignores the switch."""

    def __init__(self, style: str = "switch", bad_layer: int | None = None) -> None:
        super().__init__()
        self.style = style
        self.embed = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList(BufferedAttention() if style == "buffer" else
                                    SwitchedAttention(ignores_switch=i == bad_layer) for i in range(3))
        self.register_buffer("mask", torch.full((16, 16), float("-inf")).triu(1))

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        for i, block in enumerate(self.blocks):
            if self.style == "buffer":
                h = h + block(h, mask=self.mask)
            else:
                h = h + block(h, attention_mask=attention_mask, is_causal=not (self.style == "skip-one" and i == 1))
        return h


def _padded_ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 8, dtype=torch.long)
    keep[1, 6:] = 0
    return ids, keep


@pytest.mark.parametrize("style", ["switch", "buffer"])
def test_a_decoder_causal_through_a_switch_or_a_buffer_is_causal(style):
    """catches: check_model(..., causal=True) named causal-leak on a correct decoder whose layers get an is_causal
    switch beside a key padding mask (the replay turned the switch off whenever the layer takes a mask), or an
    (n_ctx, n_ctx) causal buffer that the layer cuts to the tokens (not read as the model's causal mask)."""
    torch.manual_seed(0)
    ids, keep = _padded_ids()
    report = check_model(SwitchedDecoder(style), {"input_ids": ids, "attention_mask": keep}, causal=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize(("style", "bad_layer"), [("skip-one", None), ("switch", 2)])
def test_the_one_layer_of_a_stack_that_sees_the_future_is_named(style, bad_layer):
    """catches: without --causal, a decoder whose model passes one layer no causal switch, or one of whose layers
    ignores the switch, was certified: each layer alone is a correct attention. As the model calls them, the other
    layers of the stack are causal and this one sees the future: causal-leak on that layer only."""
    torch.manual_seed(0)
    ids, keep = _padded_ids()
    report = check_model(SwitchedDecoder(style, bad_layer), {"input_ids": ids, "attention_mask": keep})
    odd = "blocks.1" if bad_layer is None else f"blocks.{bad_layer}"
    assert {row["layer"]: "causal-leak" in row["findings"] for row in report.summary()} == {
        f"blocks.{i}": f"blocks.{i}" == odd for i in range(3)}, report.summary()


# -- a padding mask the model builds wrong: one item's padding for every item -------------------------------------
class ExtendedMaskEncoder(nn.Module):
    """BERT's extended mask, (1 - mask) * min, here (B, L) for the layers' additive key mask. ``bug``: "first-item"
    builds every item's from the first item's padding."""

    def __init__(self, bug: str | None = None) -> None:
        super().__init__()
        self.bug = bug
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(IndexMaskedAttention(32) for _ in range(2))

    def forward(self, input_ids, attention_mask):
        keep = attention_mask.float()
        if self.bug == "first-item":
            keep = keep[:1].expand_as(keep)
        extended = (1.0 - keep) * torch.finfo(torch.float32).min
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h, attention_mask=extended)[0]
        return h


@pytest.mark.parametrize(("bug", "expected"), [(None, None), ("first-item", "mask-ignored")])
def test_a_padding_mask_the_model_builds_wrong_is_named_for_what_it_does(bug, expected):
    """catches: a model that gives every item the first item's padding was named mask-inverted: the real tokens
    of a padded item still see each other, so the mask is not read the other way round, it leaves the padding
    visible (mask-ignored)."""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 8), generator=torch.Generator().manual_seed(2))
    keep = torch.ones(2, 8, dtype=torch.long)
    keep[1, 5:] = 0
    report = check_model(ExtendedMaskEncoder(bug), {"input_ids": ids, "attention_mask": keep})
    if expected is None:
        assert report.passed, report.summary()
    else:
        assert all(expected in row["findings"] and "mask-inverted" not in row["findings"]
                   for row in report.summary()), report.summary()


# -- T5's decoder: the causal mask added into the position bias the first layer returns ---------------------------
class T5StyleAttention(nn.Module):
    """transformers 4's T5Attention in short: no scale; the first layer owns the bucketed bias table, adds the mask
    into the bias and returns it; later layers take ``position_bias`` and leave ``mask`` unread."""

    def __init__(self, dim: int = 32, heads: int = 4, owns_bias: bool = False) -> None:
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.relative_attention_bias = nn.Embedding(16, heads) if owns_bias else None

    def forward(self, hidden_states, mask=None, position_bias=None):
        b, n, e = hidden_states.shape
        q, k, v = (f(hidden_states).view(b, n, self.h, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        if position_bias is None:
            assert self.relative_attention_bias is not None
            rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
            buckets = (-rel).clamp(min=0, max=15)  # a decoder's buckets: the past only
            position_bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None]
            if mask is not None:
                position_bias = position_bias + mask
        w = (q @ k.transpose(-1, -2) + position_bias).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(b, n, e)), position_bias


class T5StyleDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(T5StyleAttention(owns_bias=i == 0) for i in range(2))

    def forward(self, input_ids, attention_mask=None):
        n = input_ids.shape[1]
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        if attention_mask is not None:  # the padding added in too: (B, 1, L, L)
            mask = mask.masked_fill(~attention_mask.bool()[:, None, None, :], torch.finfo(torch.float32).min)
        h, bias = self.embed(input_ids), None
        for layer in self.layers:
            out, bias = layer(h, mask=mask, position_bias=bias)
            h = h + out
        return h


def test_a_mask_carried_by_the_position_bias_the_first_layer_returns_is_read_there():
    """catches: T5's later decoder layers, which take the causal mask through the position bias the first layer
    returns and leave their mask argument unread, were mask-ignored (and missing-scale, T5's design, with it) when
    the model's inputs carry no padding; a recorded argument that hides exactly the keys the mask hides carries
    it."""
    torch.manual_seed(0)
    report = check_model(T5StyleDecoder(), (torch.randint(0, 50, (2, 7)),))
    assert report.passed, report.summary()
    assert "position_bias" in report.layers["layers.1"].inferred["model's mask"]


def test_left_padding_carried_by_the_position_bias_leaves_the_padded_rows_to_the_model():
    """catches: with left padding added into T5's position bias, the later layers' padded queries have every key
    hidden by finfo.min; their rows changed with the length (causal-leak), their gradients were rounded away
    (wrong-gradient), and the bias cast to float16 became -inf there (half-precision-overflow, where the model built
    in float16 fills with float16's finfo.min and stays finite)."""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, 0
    report = check_model(T5StyleDecoder(), {"input_ids": ids, "attention_mask": mask})
    assert report.passed, report.to_json()


# -- d2l's encoder: MultiHeadAttention(queries, keys, values, valid_lens) around a DotProductAttention core -------
class DotProductAttention(nn.Module):
    """d2l's core: no weights, heads folded into the batch, masked_softmax over valid_lens (a finite fill)."""

    def forward(self, queries, keys, values, valid_lens=None):
        scores = queries @ keys.transpose(1, 2) / math.sqrt(queries.shape[-1])
        if valid_lens is not None:  # (B*H,) lengths, or (B*H, L) ones per query (a decoder's causal pattern)
            lens = valid_lens[:, None, None] if valid_lens.dim() == 1 else valid_lens[:, :, None]
            hidden = torch.arange(scores.shape[-1])[None, None, :] >= lens
            scores = scores.masked_fill(hidden, -1e4)
        return scores.softmax(-1) @ values


class D2LMultiHeadAttention(nn.Module):
    """``repeat_order``: valid_lens repeated item after item (torch.repeat) where the heads are folded item-major
    (repeat_interleave): items get each other's lengths."""

    def __init__(self, dim: int = 32, heads: int = 4, repeat_order: bool = False) -> None:
        super().__init__()
        self.num_heads, self.repeat_order = heads, repeat_order
        self.attention = DotProductAttention()
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def transpose_qkv(self, x):
        x = x.reshape(x.shape[0], x.shape[1], self.num_heads, -1).permute(0, 2, 1, 3)
        return x.reshape(-1, x.shape[2], x.shape[3])

    def forward(self, queries, keys, values, valid_lens):
        q, k, v = self.transpose_qkv(self.W_q(queries)), self.transpose_qkv(self.W_k(keys)), \
            self.transpose_qkv(self.W_v(values))
        if valid_lens is not None:
            valid_lens = valid_lens.repeat(self.num_heads) if self.repeat_order else \
                torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        out = self.attention(q, k, v, valid_lens)
        out = out.reshape(-1, self.num_heads, out.shape[1], out.shape[2]).permute(0, 2, 1, 3)
        return self.W_o(out.reshape(out.shape[0], out.shape[1], -1))


class D2LEncoder(nn.Module):
    def __init__(self, repeat_order: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 32)
        self.blks = nn.ModuleList(D2LMultiHeadAttention(repeat_order=repeat_order) for _ in range(2))

    def forward(self, X, valid_lens):
        h = self.embedding(X)
        for blk in self.blks:
            h = h + blk(h, h, h, valid_lens)
        return h


@pytest.mark.parametrize("repeat_order", [False, True], ids=["correct", "lengths-repeated-in-the-wrong-order"])
def test_a_layer_around_a_weightless_core_given_lengths_is_checked(repeat_order):
    """catches: in d2l's encoder the doctor chose the weightless DotProductAttention, given q, k and v apart, as
    the layer and skipped it as a cross-attention (no layer checked); the valid_lens the model passes were replayed
    as recorded, so lengths repeated in the wrong order across the heads were certified. The core is checked
    through its parent, the lengths go where the model's went, and the model's padding is read from them."""
    torch.manual_seed(0)
    X = torch.randint(0, 40, (3, 9), generator=torch.Generator().manual_seed(0))
    report = check_model(D2LEncoder(repeat_order), (X, torch.tensor([9, 5, 3])))
    assert list(report.layers) == ["blks.0", "blks.1"], report.summary()
    if repeat_order:
        assert all("mask-ignored" in row["findings"] for row in report.summary()), report.summary()
    else:
        assert report.passed, report.summary()


# -- Reformer's local attention: the softmax written out as exp(scores - logsumexp(scores)) -------------------------
class LogsumexpAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.query_key, self.value, self.dense = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden_states):
        b, n, e = hidden_states.shape
        qk = self.query_key(hidden_states).view(b, n, self.h, -1).transpose(1, 2)
        v = self.value(hidden_states).view(b, n, self.h, -1).transpose(1, 2)
        dots = qk @ qk.transpose(-1, -2) / math.sqrt(e // self.h)
        probs = torch.exp(dots - torch.logsumexp(dots, dim=-1, keepdim=True))
        return self.dense((probs @ v).transpose(1, 2).reshape(b, n, e))


class LogsumexpModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(LogsumexpAttention() for _ in range(2))

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return h


def test_attention_normalised_with_logsumexp_is_found_in_a_model():
    """catches: check_model said "no attention layer found" on Reformer, whose layers normalise the scores with
    exp(dots - logsumexp(dots)) instead of calling softmax."""
    torch.manual_seed(0)
    report = check_model(LogsumexpModel(), (torch.randint(0, 50, (2, 7)),))
    assert list(report.layers) == ["layers.0", "layers.1"], report.summary()


# -- a dense graph transformer: each graph's adjacency passed to every layer --------------------------------------
class AdjacencyAttention(nn.Module):
    """Graph-transformer attention restricted to each node's neighbours: forward(h, adj), adj (B, N, N) 0/1."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.Q, self.K, self.V, self.O = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, h, adj):
        b, n, e = h.shape
        q, k, v = (f(h).view(b, n, self.h, -1).transpose(1, 2) for f in (self.Q, self.K, self.V))
        score = (q @ k.transpose(-1, -2) / math.sqrt(e // self.h)).masked_fill(adj.unsqueeze(1) == 0, float("-inf"))
        return self.O((score.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class GraphTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.layers = nn.ModuleList(AdjacencyAttention() for _ in range(2))

    def forward(self, feats, adj):
        h = self.embed(feats)
        for layer in self.layers:
            h = h + layer(h, adj)
        return h


def test_each_items_own_pattern_from_the_call_is_what_the_white_box_compares_with():
    """catches: a graph transformer given a different adjacency per graph was mask-ignored ("the scores hide other
    keys than the mask"): the white box compared every item's scores with the first item's pattern."""
    g = torch.Generator().manual_seed(0)
    adj = (torch.rand(3, 7, 7, generator=g) < 0.4).float()
    adj = ((adj + adj.transpose(1, 2) + torch.eye(7)) > 0).float()
    torch.manual_seed(0)
    report = check_model(GraphTransformer(), (torch.randn(3, 7, 8, generator=g), adj))
    assert report.passed, report.summary()


class GraphMHA(nn.Module):
    """Each graph's adjacency as nn.MultiheadAttention's attn_mask, (B * H, N, N) item-major as torch documents it
    (``repeat_interleave``); ``head_major`` repeats it graph after graph (``repeat``), giving heads other graphs'."""

    def __init__(self, head_major: bool = False) -> None:
        super().__init__()
        self.head_major = head_major
        self.embed = nn.Linear(8, 32)
        self.layers = nn.ModuleList(nn.MultiheadAttention(32, 4, batch_first=True) for _ in range(2))

    def forward(self, feats, adj, node_mask=None):
        allowed = adj.bool() | torch.eye(adj.shape[-1], dtype=torch.bool)
        if node_mask is not None:  # padded nodes see only themselves and are seen by none
            allowed = (allowed & node_mask[:, None, :] & node_mask[:, :, None]) | torch.eye(adj.shape[-1],
                                                                                           dtype=torch.bool)
        blocked = ~allowed
        mask = blocked.repeat(4, 1, 1) if self.head_major else blocked.repeat_interleave(4, dim=0)
        h = self.embed(feats)
        for layer in self.layers:
            h = h + layer(h, h, h, attn_mask=mask, need_weights=False)[0]
        return h


@pytest.mark.parametrize("padded", [False, True], ids=["", "padded-nodes"])
@pytest.mark.parametrize("head_major", [False, True], ids=["correct", "repeated-graph-after-graph"])
def test_a_per_graph_mask_with_the_heads_folded_into_the_batch_is_each_items_own(head_major, padded):
    """catches: a (B * H, N, N) attn_mask, one per graph, was not cut item by item for an item alone (only
    tensors whose first size is B were), so the second graph alone got the first one's adjacency (batch-mixing
    on a correct model). With padded nodes, a (B, 1, 1, L) key_padding_mask beside that attn_mask gives NaN (torch
    broadcasts it into another shape) and a row the doctor's mask empties is NaN in every shape: neither was read
    as a mask shape hiding other keys (mask-ignored)."""
    g = torch.Generator().manual_seed(1)
    adj = (torch.rand(3, 7, 7, generator=g) < 0.3).float()
    adj = adj + adj.transpose(1, 2)
    nodes = torch.ones(3, 7, dtype=torch.bool)
    nodes[1, 5:], nodes[2, 4:] = False, False
    torch.manual_seed(0)
    inputs = (torch.randn(3, 7, 8, generator=g), adj, *([nodes] if padded else []))
    report = check_model(GraphMHA(head_major).eval(), inputs)
    if head_major:
        assert not report.passed, report.summary()
    else:
        assert report.passed, report.summary()


# -- Set Transformer: a first block that changes the width (dim_in -> dim_out) ------------------------------------
class WideningSAB(nn.Module):
    """juho-lee's MAB(X, X) from dim_in to dim_out: Q + softmax(Q K^T / sqrt(dim_out)) V, then a row-wise layer."""

    def __init__(self, dim_in: int, dim_out: int, heads: int = 4) -> None:
        super().__init__()
        self.h, self.dim_V = heads, dim_out
        self.fc_q, self.fc_k, self.fc_v = (nn.Linear(dim_in, dim_out) for _ in range(3))
        self.fc_o = nn.Linear(dim_out, dim_out)

    def forward(self, x):
        q, k, v = self.fc_q(x), self.fc_k(x), self.fc_v(x)
        s = self.dim_V // self.h
        q_, k_, v_ = (torch.cat(t.split(s, 2), 0) for t in (q, k, v))
        a = torch.softmax(q_ @ k_.transpose(1, 2) / math.sqrt(s), 2)
        o = torch.cat((q_ + a @ v_).split(q.size(0), 0), 2)
        return o + F.relu(self.fc_o(o))


class SetEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(WideningSAB(8, 32), WideningSAB(32, 32))

    def forward(self, x):
        return self.enc(x)


def test_an_attention_that_changes_the_width_is_listed_not_dropped():
    """catches: a model whose first attention block maps 8 features to 32 was reported without that block (no
    module maps (B, L, E) to itself there), and the model could pass on the other layers alone. It is listed as a
    layer the doctor could not run, and the model is inconclusive unless another layer fails."""
    torch.manual_seed(0)
    report = check_model(SetEncoder(), (torch.randn(2, 7, 8),))
    assert "enc.0" in report.could_not_run and "enc.1" in report.layers, report.summary()
    assert report.verdict != "passed"


# -- a block that drops its attention's output ------------------------------------------------------------------
class DroppingGPT(nn.Module):
    """nanoGPT's blocks in short; ``drop``: the block at that index adds its input where the attention's output
    belongs (x = x + ln(x) instead of x = x + attn(ln(x)))."""

    def __init__(self, drop: int | None = None) -> None:
        super().__init__()
        self.drop = drop
        self.embed = nn.Embedding(50, 32)
        self.ln = nn.ModuleList(nn.LayerNorm(32) for _ in range(3))
        self.attn = nn.ModuleList(CausalUnlessMasked() for _ in range(3))

    def forward(self, idx):
        x = self.embed(idx)
        for i, (ln, attn) in enumerate(zip(self.ln, self.attn, strict=True)):
            out = attn(ln(x))
            x = x + (ln(x) if i == self.drop else out)
        return x


@pytest.mark.parametrize("drop", [None, 1])
def test_a_layer_whose_output_the_model_never_uses_is_no_grad(drop):
    """catches: a block that computes its attention and then adds something else was certified: each layer alone is
    correct. Changing the layer's output must change the model's output."""
    torch.manual_seed(0)
    rows = {row["layer"]: row["findings"] for row in check_model(DroppingGPT(drop),
                                                                 (torch.randint(0, 50, (2, 7)),)).summary()}
    assert {name: "no-grad" in found for name, found in rows.items()} == {
        f"attn.{i}": i == drop for i in range(3)}, rows


class D2LDecoder(nn.Module):
    """d2l's decoder self-attention in training: dec_valid_lens = arange(1, L + 1) for every item, (B, L), one length
    per query: the causal pattern itself."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 32)
        self.attention1 = nn.ModuleList(D2LMultiHeadAttention() for _ in range(2))

    def forward(self, X):
        b, n = X.shape
        dec_valid_lens = torch.arange(1, n + 1).repeat(b, 1)
        h = self.embedding(X)
        for attention in self.attention1:
            h = h + attention(h, h, h, dec_valid_lens)
        return h


def test_lengths_given_per_query_stay_as_the_model_gave_them():
    """catches: d2l's decoder passes (B, L) lengths, one per query, which carry its causal pattern; taken as the
    layer's mask argument, they were replaced by the doctor's (B,) lengths, and --causal named causal-leak."""
    torch.manual_seed(0)
    X = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    report = check_model(D2LDecoder(), (X,), causal=True)
    assert report.passed, report.summary()


class LeftPaddedEncoder(nn.Module):
    """fairseq's TransformerEncoder in short: src_tokens left-padded with the pad index 1, src_lengths beside them,
    the key padding mask read off the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.padding_idx = 1
        self.embed_tokens = nn.Embedding(40, 32, padding_idx=1)
        self.layers = nn.ModuleList(IndexMaskedAttention(32) for _ in range(2))

    def forward(self, src_tokens, src_lengths):
        additive = src_tokens.eq(self.padding_idx).float() * -10000.0
        h = self.embed_tokens(src_tokens)
        for layer in self.layers:
            h = h + layer(h, attention_mask=additive)[0]
        return h


def test_lengths_beside_left_padded_tokens_are_left_padding():
    """catches: the model's padding read from src_lengths was taken as right padding; fairseq pads on the left, and
    correct layers were mask-inverted. The side whose padded positions all hold one token id is the padding."""
    torch.manual_seed(0)
    tokens = torch.randint(4, 40, (3, 8), generator=torch.Generator().manual_seed(2))
    tokens[1, :3], tokens[2, :5] = 1, 1
    report = check_model(LeftPaddedEncoder(), {"src_tokens": tokens, "src_lengths": torch.tensor([8, 5, 3])})
    assert report.passed, report.summary()


# -- a bool causal mask with True = masked (MPT's, older Hugging Face layers) under --causal ------------------------
class IgnoreMaskAttention(nn.Module):
    """scores.masked_fill(attention_mask, min): the model's bool mask, True = masked."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.Wqkv, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attention_mask=None):
        b, n, e = x.shape
        q, k, v = self.Wqkv(x).view(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(e // self.h)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, torch.finfo(scores.dtype).min)
        return self.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class IgnoreMaskDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList(IgnoreMaskAttention() for _ in range(2))

    def forward(self, input_ids):
        n = input_ids.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None].expand(input_ids.shape[0], 1, n, n)
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h, attention_mask=mask)
        return h


def test_a_bool_causal_mask_with_true_masked_is_the_models_causal_mask():
    """catches: under --causal, a model passing a bool causal mask with True = masked was either causal-leak (not
    read as its causal mask) or inconclusive (the doctor's masks, which must carry causality, were tried with
    True = keep only)."""
    torch.manual_seed(0)
    report = check_model(IgnoreMaskDecoder(), (torch.randint(0, 50, (2, 7)),), causal=True)
    assert report.passed, report.summary()


class ListOutputAttention(CausalUnlessMasked):
    """An attention returning [output, present] as a list (OpenAI GPT's Attention in transformers)."""

    def forward(self, x, mask=None):
        return [super().forward(x, mask), None]


class ListOutputGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.attn = nn.ModuleList(ListOutputAttention() for _ in range(2))

    def forward(self, idx):
        x = self.embed(idx)
        for attn in self.attn:
            x = x + attn(x)[0]
        return x


def test_a_layer_whose_output_the_hook_cannot_change_is_not_called_unused():
    """catches: a layer returning a list was no-grad in the whole-model sweep (OpenAI GPT): the hook that changes
    the layer's output changed nothing, and the model's output stayed the same. Only a change the hook made is
    read, and on the model's own weights and on its copy with all-zero parameters drawn alike."""
    torch.manual_seed(0)
    report = check_model(ListOutputGPT(), (torch.randint(0, 50, (2, 7)),))
    assert report.passed, report.summary()


@pytest.mark.parametrize("side", ["left", "right"])
def test_alibi_built_per_item_from_the_padding_is_read_under_a_causal_mask(side):
    """catches: transformers' BLOOM builds its ALiBi from each item's padding (positions counted over the real
    tokens), so the doctor's causal run sees keys the model's mask hid with a bias of each item's own. The scale
    is read from the differences of two runs that share that bias; a key masked in both runs left a difference
    of 0 there (two equal fills), which the fit read as a score and the layer got definition-mismatch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4, pad_token_id=0)
    model = transformers.BloomModel(config).eval()
    ids = torch.randint(3, 64, (2, 8))
    pad = slice(0, 3) if side == "left" else slice(5, 8)
    mask = torch.ones_like(ids)
    mask[1, pad], ids[1, pad] = 0, 0
    report = check_model(model, {"input_ids": ids, "attention_mask": mask}, causal=True)
    assert report.verdict == "passed", report.to_json()


# -- a model that adds its padding into the bias it passes every layer (llm-foundry's MPT: ALiBi, causal, padding) --
class BiasedAttention(nn.Module):
    """Fused q, k, v; the scores plus the bias the model passes, nothing else (MPT's torch attention)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.Wqkv, self.out_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attn_bias=None):
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.Wqkv(x).chunk(3, -1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)
        if attn_bias is not None:
            scores = scores + attn_bias
        return self.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class BiasedModel(nn.Module):
    """ALiBi counted from the last key, the causal mask and the padding, added into one (B, H, L, L) float bias with
    finfo.min: a padded query on the left has every key hidden. ``bug``: "self hidden" builds the causal mask with
    tril(-1), "queries" lays the padding on the query axis, "dropped" passes the layers no bias at all."""

    def __init__(self, bug: str | None = None, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.bug, self.heads = bug, heads
        self.wte = nn.Embedding(50, dim)
        self.blocks = nn.ModuleList([BiasedAttention(dim, heads) for _ in range(2)])

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        slopes = 2.0 ** (-8.0 * torch.arange(1, self.heads + 1) / self.heads)
        bias = (slopes[:, None, None] * torch.arange(1 - n, 1)[None, None, :]).expand(b, -1, n, n)
        keep = torch.ones(n, n, dtype=torch.bool).tril(-1 if self.bug == "self hidden" else 0)
        real = attention_mask.bool()
        keep = keep & (real[:, None, :, None] if self.bug == "queries" else real[:, None, None, :])
        bias = bias.masked_fill(~keep[:, None] if keep.dim() == 3 else ~keep, torch.finfo(bias.dtype).min)
        h = self.wte(input_ids)
        for block in self.blocks:
            h = h + block(h, attn_bias=None if self.bug == "dropped" else bias)
        return h


@pytest.mark.parametrize("side", ["left", "right", "every-item-left"])
@pytest.mark.parametrize(("bug", "expected"), [(None, None), ("self hidden", "causal-leak"),
                                               ("queries", "mask-broadcast"), ("dropped", "mask-ignored")])
def test_padding_added_into_the_bias_the_model_passes_is_the_models(side, bug, expected):
    """catches: MPT-style padding added into the bias: a padded query with every key hidden weighs them all alike
    (finfo.min), so its row changed with the length (causal-leak) and its gradient was rounded away
    (wrong-gradient), and the white box read its row as one the mask should hide (mask-ignored), on correct models.
    Those rows are the model's padding. A causal mask that hides the diagonal, padding laid on the query axis, and a
    layer that gets none of the padding the inputs mark are named. With every item padded, the first item's padded
    rows are the model's too (the dependencies are read on the first item)."""
    if bug is not None and side == "every-item-left":
        pytest.skip("the bugs are read on the models padded one item at a time")
    if bug in ("dropped", "queries") and side == "right":
        pytest.skip("a causal layer hides right padding from the real tokens without any key mask")
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 8))
    mask = torch.ones_like(ids)
    pad = slice(5, 8) if side == "right" else slice(0, 3)
    mask[1, pad], ids[1, pad] = 0, 0
    if side == "every-item-left":
        mask[0, :2], ids[0, :2] = 0, 0
    report = check_model(BiasedModel(bug).eval(), {"input_ids": ids, "attention_mask": mask})
    if expected is None:
        assert report.verdict == "passed", report.to_json()
    else:
        assert all(expected in layer.ids for layer in report.layers.values()), report.to_json()


# -- the Annotated Transformer's decoder: a mask it requires, built by the model as padding & subsequent ----------
class AnnotatedAttention(nn.Module):
    """MultiHeadedAttention(query, key, value, mask): the mask is required, (B, L, L) with 0 = masked (filled with
    -1e4 here, where the original's -1e9 overflows float16)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.linears = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))

    def forward(self, query, key, value, mask):
        b, n, e = query.shape
        q, k, v = (lin(t).view(b, -1, self.h, e // self.h).transpose(1, 2)
                   for lin, t in zip(self.linears, (query, key, value), strict=False))
        scores = (q @ k.transpose(-2, -1) / math.sqrt(e // self.h)).masked_fill(mask.unsqueeze(1) == 0, -1e4)
        return self.linears[-1]((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class AnnotatedDecoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(AnnotatedAttention() for _ in range(2))

    def forward(self, tgt):
        n = tgt.shape[1]
        mask = (tgt != 0).unsqueeze(-2) & (torch.triu(torch.ones(1, n, n), diagonal=1) == 0)
        h = self.embed(tgt)
        for layer in self.layers:
            h = h + layer(h, h, h, mask)
        return h


def test_the_models_causal_mask_stands_for_the_layers_pattern_at_any_length():
    """catches: under --causal, a decoder whose layers require the mask the model builds was replayed without the
    model's causal mask when the doctor's probe was longer than the recorded call (a target of 5 tokens): that
    mask was cut to the probe's length, which it cannot be, so an all-visible one went in (causal-leak on a correct
    decoder)."""
    torch.manual_seed(0)
    tgt = torch.randint(1, 50, (2, 5))
    tgt[0, -2:] = 0
    report = check_model(AnnotatedDecoderLM().eval(), (tgt,), causal=True)
    assert report.passed, report.summary()


class CausalKeyPaddingAttention(nn.Module):
    """Causal on its own; ``attention_mask`` (B, 1, L, L), True = masked, replaces that pattern, and
    ``key_padding_mask`` (B, L), True = padding, is hidden on top of either."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.query_key_value, self.dense = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, attention_mask=None, key_padding_mask=None):
        b, n, e = hidden_states.shape
        q, k, v = (t.view(b, n, self.h, -1).transpose(1, 2) for t in self.query_key_value(hidden_states).chunk(3, -1))
        if attention_mask is None:
            attention_mask = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
        if key_padding_mask is not None:
            attention_mask = attention_mask | key_padding_mask[:, None, None, :]
        s = (q @ k.transpose(-1, -2) / math.sqrt(e // self.h)).masked_fill(attention_mask, torch.finfo(q.dtype).min)
        return self.dense((s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class KeyPaddingOnly(nn.Module):
    """Passes its layers only the key padding mask, from transformers' attention_mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(CausalKeyPaddingAttention() for _ in range(2))

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = h + layer(h, key_padding_mask=~attention_mask.bool())
        return h


def test_the_padding_probe_leaves_the_models_padded_query_rows_out():
    """catches: a causal layer given only the model's left padding as key_padding_mask: the model's padded queries
    see no key and weigh every key alike, so the doctor's padding probe, which changes its own padded keys, saw
    those rows move and named mask-ignored on a correct model."""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :3], mask[2, :5] = 0, 0
    report = check_model(KeyPaddingOnly().eval(), {"input_ids": ids, "attention_mask": mask}, causal=True)
    assert report.passed, report.summary()


class ExpandedPaddingMHA(nn.Module):
    """The key padding expanded into nn.MultiheadAttention's attn_mask, (B * H, L, L) item-major (``repeat``, graph
    after graph, in the bug)."""

    def __init__(self, head_major: bool = False) -> None:
        super().__init__()
        self.head_major = head_major
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(nn.MultiheadAttention(32, 4, batch_first=True) for _ in range(2))

    def forward(self, input_ids, attention_mask):
        n = input_ids.shape[1]
        hidden = ~attention_mask.bool()[:, None, :].expand(-1, n, n)
        mask = hidden.repeat(4, 1, 1) if self.head_major else hidden.repeat_interleave(4, dim=0)
        h = self.emb(input_ids)
        for layer in self.layers:
            h = h + layer(h, h, h, attn_mask=mask, need_weights=False)[0]
        return h


@pytest.mark.parametrize("head_major", [False, True], ids=["correct", "repeated-item-after-item"])
def test_padding_expanded_into_a_per_item_attn_mask_is_read_item_by_item(head_major):
    """catches: the model's padding expanded into a (B * H, L, L) attn_mask was not seen as the model's padding (only
    (B, ..., L) tensors were), so the white box compared every item with the first, unpadded one
    (definition-mismatch on a correct model)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:], mask[2, 4:] = 0, 0
    report = check_model(ExpandedPaddingMHA(head_major).eval(), {"input_ids": ids, "attention_mask": mask})
    if head_major:
        assert not report.passed, report.summary()
    else:
        assert report.passed, report.summary()


class GLMStyleSelfAttention(nn.Module):
    """ChatGLM's layer: states (L, B, E); causal SDPA when given no mask, else the model's bool mask (B, 1, L, L) with
    True = masked, inverted for SDPA."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.query_key_value, self.dense = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, attention_mask=None):
        n, b, e = hidden_states.shape
        q, k, v = (t.view(n, b, self.h, -1).permute(1, 2, 0, 3)
                   for t in self.query_key_value(hidden_states).chunk(3, -1))
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, ~attention_mask)
        return self.dense(out.permute(2, 0, 1, 3).reshape(n, b, e))


class GLMStyleModel(nn.Module):
    """ChatGLM's get_masks: ones(B, L, L).tril_() (``leak``: tril_(1), each query also sees the next token), the
    padding folded in, True = masked; the states go through the layers sequence first."""

    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        self.leak = leak
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(GLMStyleSelfAttention() for _ in range(2))

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        full = torch.ones(b, n, n).tril_(1 if self.leak else 0)
        full = full * attention_mask[:, None, :]
        mask = (full < 0.5).unsqueeze(1)
        h = self.emb(input_ids).transpose(0, 1)
        for layer in self.layers:
            h = h + layer(h, attention_mask=mask)
        return h.transpose(0, 1)


@pytest.mark.parametrize(("leak", "expected"), [(False, None), (True, "causal-leak")])
def test_a_causal_mask_built_off_by_one_is_read_in_a_sequence_first_model(leak, expected):
    """catches: the read of a layer as the model calls it, with the model's own mask, skipped layers called sequence
    first, so ChatGLM's get_masks built with tril_(1) (each query also seeing the next token) was certified while
    the same slip in a batch-first model was named."""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, :2], ids[1, :2] = 0, 0
    report = check_model(GLMStyleModel(leak).eval(), {"input_ids": ids, "attention_mask": mask}, causal=True)
    if expected is None:
        assert report.passed, report.summary()
    else:
        assert all(expected in layer.ids for layer in report.layers.values()), report.summary()


# -- offset attention: softmax over the keys, then renormalised over the queries (Point Cloud Transformer) ----------
class OffsetAttention(nn.Module):
    """PCT's ``SA_Layer`` on channels-first points (B, C, N): the weights renormalised over the other axis
    (``attention / (1e-9 + attention.sum(dim=1, keepdim=True))``) before the product, and the offset x - x_r."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.q_conv = nn.Conv1d(channels, channels // 4, 1, bias=False)
        self.k_conv = nn.Conv1d(channels, channels // 4, 1, bias=False)
        self.k_conv.weight = self.q_conv.weight
        self.v_conv = nn.Conv1d(channels, channels, 1)
        self.trans_conv = nn.Conv1d(channels, channels, 1)

    def forward(self, x):
        energy = torch.bmm(self.q_conv(x).permute(0, 2, 1), self.k_conv(x))
        attention = torch.softmax(energy, dim=-1)
        attention = attention / (1e-9 + attention.sum(dim=1, keepdim=True))
        return x + torch.relu(self.trans_conv(x - torch.bmm(self.v_conv(x), attention)))


class PointCloudEncoder(nn.Module):
    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.embed = nn.Conv1d(3, channels, 1)
        self.sa1, self.sa2 = OffsetAttention(channels), OffsetAttention(channels)

    def forward(self, points):
        return self.sa2(self.sa1(self.embed(points))).max(dim=-1).values


def test_weights_renormalised_over_the_other_axis_still_make_an_attention_layer():
    """catches: check_model exited 2 ("no attention layer found") on a point-cloud model whose layers renormalise
    the softmax weights by their sum over the queries before the product: a division did not pass the weights on"""
    torch.manual_seed(0)
    report = check_model(PointCloudEncoder().eval(), (torch.randn(2, 3, 16),), allow_nonstandard=True)
    assert list(report.layers) == ["sa1", "sa2"], report.summary()


# -- a causal bias with the padding added in, made finite again, passed to SDPA (OLMo's ``attention_bias``) --------
class FusedBiasAttention(nn.Module):
    """OLMo's attention: one ``att_proj`` for q, k and v, SDPA with the model's float bias as ``attn_mask``."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.att_proj, self.attn_out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x, attention_bias=None):
        b, n, e = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.att_proj(x).split(e, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias)
        return self.attn_out(out.transpose(1, 2).reshape(b, n, e))


class CausalBiasModel(nn.Module):
    """The causal bias is ``triu(1)`` at finfo.min; the padding, (1 - mask) * finfo.min, is added to it and the
    -inf where both meet is put back to finfo.min (OLMo's ``ensure_finite_``): a query padded on the left sees no
    key, a row with no value to agree on in any dtype."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(50, dim)
        self.blocks = nn.ModuleList([FusedBiasAttention(dim, heads) for _ in range(2)])

    def forward(self, input_ids, attention_mask):
        n, low = input_ids.shape[1], torch.finfo(torch.float).min
        bias = torch.triu(torch.full((n, n), low), diagonal=1)[None, None]
        bias = bias + (1.0 - attention_mask.float())[:, None, None, :] * low
        bias = bias.masked_fill(bias == float("-inf"), low)
        h = self.wte(input_ids)
        for block in self.blocks:
            h = h + block(h, attention_bias=bias)
        return h


def test_half_precision_leaves_out_the_rows_a_model_pads_through_its_bias():
    """catches: a model that adds its left padding into the causal bias leaves each padded query every key at the
    fill; float16 and float32 weigh those keys differently (which of them rounds to the fill), so correct layers were
    named half-precision-mismatch. Those rows are the model's padding and are not compared."""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, 0
    report = check_model(CausalBiasModel().eval(), {"input_ids": ids, "attention_mask": mask})
    assert report.verdict == "passed", report.to_json()


# -- padding made a (B, 1, L, L) bool mask from the outer product of the key and query masks (Megatron's BERT) -----
class MaskedFillAttention(nn.Module):
    """Fused q, k, v; the scores filled at -10000 where the model's bool mask is True (Megatron's
    ``attention_mask_func``)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.query_key_value, self.dense = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, attention_mask):
        b, n, e = hidden_states.shape
        fused = self.query_key_value(hidden_states)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in fused.chunk(3, -1))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(e // self.heads)).masked_fill(attention_mask, -10000.0)
        return self.dense((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, e))


class OuterProductMaskEncoder(nn.Module):
    """``bss = b1s * bs1``, then ``< 0.5``: True where the query or the key is padding. ``bug``: "queries" builds it
    from the query mask alone (``bs1.expand``); "flipped" keeps ``> 0.5``."""

    def __init__(self, bug: str | None = None, dim: int = 32) -> None:
        super().__init__()
        self.bug = bug
        self.embed = nn.Embedding(50, dim)
        self.layers = nn.ModuleList([MaskedFillAttention(dim) for _ in range(2)])

    def forward(self, input_ids, attention_mask):
        b1s, bs1 = attention_mask.unsqueeze(1), attention_mask.unsqueeze(2)
        bss = bs1.expand(-1, -1, attention_mask.shape[1]) if self.bug == "queries" else b1s * bs1
        mask = (bss.unsqueeze(1) > 0.5) if self.bug == "flipped" else (bss.unsqueeze(1) < 0.5)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h, mask)
        return h


@pytest.mark.parametrize(("bug", "expected"), [(None, None), ("queries", "mask-broadcast"),
                                               ("flipped", "mask-inverted")])
def test_padding_laid_on_the_query_axis_of_the_mask_the_layer_takes_is_mask_broadcast(bug, expected):
    """catches: a (B, 1, L, L) mask that hides the padded queries' rows and no key, passed as the layer's own mask,
    was named mask-inverted, whose fix (the other polarity) does not fix it"""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:], ids[1, 6:] = 0, 0
    report = check_model(OuterProductMaskEncoder(bug).eval(), {"input_ids": ids, "attention_mask": mask})
    if expected is None:
        assert report.verdict == "passed", report.to_json()
    else:
        assert {f.id for r in report.layers.values() for f in r.findings if f.severity == "error"} == {expected}, \
            report.to_json()


class LeftToRightModel(nn.Module):
    """Megatron's GPT: ``get_ltor_masks`` makes the (1, 1, L, L) bool mask, True = masked, as ``tril < 0.5``.
    ``flipped``: ``tril > 0.5``, which hides the past and each query's own key and shows the future."""

    def __init__(self, flipped: bool = False, dim: int = 32) -> None:
        super().__init__()
        self.flipped = flipped
        self.embed = nn.Embedding(50, dim)
        self.layers = nn.ModuleList([MaskedFillAttention(dim) for _ in range(2)])

    def forward(self, input_ids):
        n = input_ids.shape[1]
        tril = torch.tril(torch.ones(1, n, n)).view(1, 1, n, n)
        mask = tril > 0.5 if self.flipped else tril < 0.5
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h, mask)
        return h


@pytest.mark.parametrize("flipped", [False, True])
def test_a_causal_mask_built_the_other_way_round_is_a_causal_leak(flipped):
    """catches: a decoder whose bool causal mask is the causal pattern's complement (each query sees only later
    keys, the last one none) was certified without --causal: no layer of its stack is causal to compare with, and the
    pattern is neither a band nor the causal one transposed (a query that sees one key alone does not depend on its
    own token)"""
    torch.manual_seed(0)
    report = check_model(LeftToRightModel(flipped).eval(), (torch.randint(1, 50, (2, 9)),))
    if flipped:
        assert {f.id for r in report.layers.values() for f in r.findings if f.severity == "error"} == \
            {"causal-leak"}, report.to_json()
    else:
        assert report.verdict == "passed", report.to_json()


class WindowedBiasModel(CausalBiasModel):
    """A causal window of 3 at finfo.min with the padding added and clamped (a sliding-window decoder's bias): the
    last query's window no longer reaches the padded keys on the left."""

    def forward(self, input_ids, attention_mask):
        n, low = input_ids.shape[1], torch.finfo(torch.float).min
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        bias = torch.zeros(n, n).masked_fill(~((j <= i) & (j > i - 3)), low)[None, None]
        bias = (bias + (1.0 - attention_mask.float())[:, None, None, :] * low).clamp(min=low)
        h = self.wte(input_ids)
        for block in self.blocks:
            h = h + block(h, attention_bias=bias)
        return h


def test_padding_added_into_a_windowed_causal_bias_is_the_models():
    """catches: with a causal window, the last query does not reach the padded keys on the left, so the padding
    added into the bias was not seen as the model's; its padded rows (every key at the fill) gave causal-leak and
    wrong-gradient on a correct model. A bias that hides the padded keys from every query and shows each real key
    to some query carries the padding."""
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, 0
    report = check_model(WindowedBiasModel().eval(), {"input_ids": ids, "attention_mask": mask})
    assert report.verdict == "passed", report.to_json()


class PackedKeysCell(nn.Module):
    """Sockeye's ``DotAttentionCell``: no weights, given the queries (B, L, E) and the keys and values packed apart
    (B, L, 2E), heads split inside; ``scale``: its factor on the queries; ``softmax_dim``: the axis its softmax runs
    over."""

    def __init__(self, heads: int, scale: float, softmax_dim: int = -1) -> None:
        super().__init__()
        self.heads, self.scale, self.softmax_dim = heads, scale, softmax_dim

    def forward(self, queries, key_values):
        b, n, e = queries.shape
        d = e // self.heads
        k, v = key_values.reshape(b, n, 2, self.heads, d).permute(2, 0, 3, 1, 4)
        q = queries.reshape(b, n, self.heads, d).transpose(1, 2) * self.scale
        out = torch.softmax(q @ k.transpose(-1, -2), dim=self.softmax_dim) @ v
        return out.transpose(1, 2).reshape(b, n, e)


class PackedSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, scale: float, softmax_dim: int = -1) -> None:
        super().__init__()
        self.q_in, self.kv_in, self.out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.cell = PackedKeysCell(heads, scale, softmax_dim)

    def forward(self, x):
        return self.out(self.cell(self.q_in(x), self.kv_in(x)))


class PackedEncoder(nn.Module):
    def __init__(self, bug: str | None = None, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, dim)
        self.norm = nn.LayerNorm(dim)
        self.self_attention = PackedSelfAttention(dim, heads, (dim if bug == "wrong-scale" else dim // heads) ** -0.5,
                                                  -2 if bug == "softmax-dim" else -1)

    def forward(self, tokens):
        h = self.embed(tokens)
        return h + self.self_attention(self.norm(h))


@pytest.mark.parametrize("bug", [None, "wrong-scale", "softmax-dim"])
def test_a_cell_given_its_keys_apart_is_checked_through_its_parent(bug):
    """catches: a model whose attention cell takes the queries and the keys and values packed apart (Sockeye's
    DotAttentionCell) had that cell taken as its layer, judged no self-attention, and nothing checked (inconclusive);
    with its softmax over the queries the cell looked like self-attention, stayed the layer and could not be called"""
    torch.manual_seed(0)
    report = check_model(PackedEncoder(bug), (torch.randint(1, 50, (2, 7)),))
    assert list(report.layers) == ["self_attention"], (report.layers, report.not_self_attention)
    errors = {f.id for r in report.layers.values() for f in r.findings if f.severity == "error"}
    assert errors == ({bug} if bug else set()), report.summary()


# -- Particle Transformer: a pair bias made per jet and folded with the heads into the batch ----------------------
class PairBiasJets(nn.Module):
    """weaver's ParT: an interaction bias U (B, H, P, P) embedded from pairwise features of each jet's particles and
    given to nn.MultiheadAttention as a (B * H, P, P) float attn_mask, item-major. ``swapped``: U laid out (H, B, P, P)
    and reshaped to (B * H, P, P) without its permute, so that each jet gets other jets' heads."""

    def __init__(self, swapped: bool = False, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.swapped, self.h = swapped, heads
        self.embed = nn.Linear(3, dim)
        self.pair = nn.Sequential(nn.Linear(2, 8), nn.GELU(), nn.Linear(8, heads))
        self.blocks = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(2))

    def forward(self, particles):
        b, p, _ = particles.shape
        eta, phi = particles[..., 1], particles[..., 2]
        delta = torch.stack(((eta[:, :, None] - eta[:, None, :]).abs(), (phi[:, :, None] - phi[:, None, :]).abs()), -1)
        u = self.pair(delta)  # (B, P, P, H)
        u = u.permute(3, 0, 1, 2) if self.swapped else u.permute(0, 3, 1, 2)
        u = u.reshape(b * self.h, p, p)
        x = self.embed(particles)
        for block in self.blocks:
            x = x + block(x, x, x, attn_mask=u, need_weights=False)[0]
        return x


@pytest.mark.parametrize("swapped", [False, True], ids=["item-major", "heads-first-reshaped"])
def test_a_bias_the_model_lays_out_across_jets_wrongly_is_batch_mixing(swapped):
    """catches: each layer is replayed with the bias the model passed it, cut to one item, so a bias that carries
    other jets' values for this one (a (H, B, P, P) tensor reshaped to (B * H, P, P)) left every layer correct as
    called and the model passed. The model's first jet alone is handed another bias than in the batch."""
    torch.manual_seed(0)
    report = check_model(PairBiasJets(swapped).eval(), torch.randn(3, 6, 3))
    first = report.layers["blocks.0"]
    assert ("batch-mixing" in {f.id for f in first.findings}) == swapped, report.summary()
    if not swapped:
        assert report.passed, report.summary()


def test_a_dynamically_quantized_model_is_read_with_its_weights_dequantized():
    """catches: the model-level reads (the padding changed as the model calls each layer) ran on the quantized
    model, whose activations are quantized per tensor: padded tokens moved the real tokens' outputs through the
    scale, and a correct BERT was `mask-ignored` in every layer."""
    from torch.ao.quantization import quantize_dynamic
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=32)
    model = quantize_dynamic(BertModel(config).eval(), {nn.Linear}, dtype=torch.qint8)
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    report = check_model(model, {"input_ids": ids, "attention_mask": mask})
    assert report.passed, report.summary()
    assert all("quantized" in layer.inferred for layer in report.layers.values())

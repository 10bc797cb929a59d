"""The doctor on layers replayed as their model calls them, where the call carries more than the hidden states.

Each module is written in the style of the code base it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import math

import pytest
import torch
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
        input_ids = nn.functional.pad(input_ids, (0, (-n) % self.window))
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
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
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

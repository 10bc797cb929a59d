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

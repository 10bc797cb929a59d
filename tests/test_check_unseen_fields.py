"""The doctor on attention from fields its other tests do not cover: memory and register tokens, recommender and
tabular code, graph and set models.

Each module is written in the style of the code base it names; the tests say which wrong verdict they catch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfattn.check import check


# -- memory / register tokens joined to the tokens inside the module (x-transformers, ViT registers) ----------------
def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, -1)
    return torch.cat((-b, a), -1)


def _rotate_pairs(t: torch.Tensor) -> torch.Tensor:
    return torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)


class MemoryTokenAttention(nn.Module):
    """x-transformers' ``num_memory_tokens``: learned tokens put before the tokens (``first``) or after them (ViT
    registers), attended with them, their outputs dropped; rotary over every position when ``rotary``. ``bug``:
    "unscaled", "merge" (heads merged without their transpose) or "k-pairs" (k rotated by interleaved pairs)."""

    def __init__(self, dim: int = 64, heads: int = 4, memory: int = 2, first: bool = True, rotary: bool = False,
                 bug: str | None = None) -> None:
        super().__init__()
        self.h, self.m, self.first, self.rotary, self.bug = heads, memory, first, rotary, bug
        self.memory_tokens = nn.Parameter(torch.randn(memory, dim))
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, e = x.shape
        mem = self.memory_tokens.expand(b, -1, -1)
        x = torch.cat((mem, x) if self.first else (x, mem), dim=1)
        total, d = n + self.m, e // self.h
        q, k, v = self.to_qkv(x).view(b, total, 3, self.h, d).permute(2, 0, 3, 1, 4)
        if self.rotary:
            f = torch.outer(torch.arange(total, dtype=x.dtype), 1.0 / 10000 ** (torch.arange(0, d, 2).to(x) / d))
            half = torch.cat((f, f), -1)
            q = q * half.cos() + _rotate_half(q) * half.sin()
            if self.bug == "k-pairs":
                pairs = f.repeat_interleave(2, -1)
                k = k * pairs.cos() + _rotate_pairs(k) * pairs.sin()
            else:
                k = k * half.cos() + _rotate_half(k) * half.sin()
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0 if self.bug == "unscaled" else None)
        out = out.reshape(b, total, e) if self.bug == "merge" else out.transpose(1, 2).reshape(b, total, e)
        return self.to_out(out[:, self.m:] if self.first else out[:, :n])


@pytest.mark.parametrize("first", [True, False], ids=["memory-first", "registers-last"])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_memory_tokens_joined_inside_the_module_are_a_design(first, rotary):
    """catches: learned tokens joined to the tokens inside the module were definition-mismatch ("the attention runs
    over an axis of size L + M, not the L tokens"); the attention is read over both, and said."""
    torch.manual_seed(0)
    report = check(MemoryTokenAttention(first=first, rotary=rotary))
    assert report.passed, report.findings
    assert "memory tokens" in report.inferred["design"], report.inferred


@pytest.mark.parametrize(("bug", "expected"), [("unscaled", "missing-scale"), ("merge", "head-merge"),
                                               ("k-pairs", "rotary-mismatch")])
def test_a_bug_beside_memory_tokens_is_named(bug, expected):
    """catches: with the attention read over the memory and the tokens, the heads' merge, the scale and the rotary
    are read on them too (the token swap and the repeated token land M rows further)."""
    torch.manual_seed(0)
    report = check(MemoryTokenAttention(rotary=bug == "k-pairs", bug=bug))
    assert expected in report.ids, report.findings

"""A T5 encoder layer with its learned relative-position table, trained at 16k tokens on the CPU.

T5 adds to every score a learned per-head bias looked up by the bucket of the offset j - i (exact
for small offsets, logarithmic up to ``max_distance``). Written as a dense bias it is an
(H, L, L) tensor: 4 GiB per layer at 16k tokens and 4 heads, with its gradient as much again. Here
the lookup is a score modifier: the chunked backend evaluates it tile by tile in the forward and
sums the table's gradient tile by tile in the backward, so no (L, L) tensor is built.

The layer follows transformers' ``T5Block`` (RMS layer norms, unscaled scores, a ReLU feed-forward)
and loads its weights (``T5Layer.from_hf``); the tests check the two agree, output and gradients.
The task is synthetic: each output must reproduce the input three positions back, which the layer
can only learn through the table. It prints the loss per step, the time per step and the peak
extra resident memory of the first step.

    python examples/t5_encoder.py                   # 16384 tokens, a few minutes
    python examples/t5_encoder.py --quick           # 512 tokens, seconds

Shape legend: B batch, L tokens, E model dim, H heads, D head dim, NB buckets.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import Tensor, nn

import selfattn
from selfattn import scores


def relative_bucket(rel: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """T5's bidirectional bucket of the offset ``rel = j - i``: half the buckets for j > i; within a
    half, offsets below a quarter of ``num_buckets`` are exact, longer ones share logarithmic buckets
    up to ``max_distance``, beyond which they share the last."""
    half = num_buckets // 2
    bucket = (rel > 0).long() * half
    dist = rel.abs()
    exact = half // 2
    far = exact + (torch.log(dist.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (half - exact)).long()
    return bucket + torch.where(dist < exact, dist, far.clamp(max=half - 1))


class RMSNorm(nn.Module):
    """T5's layer norm: scale only, no mean, no bias."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype)


class T5Layer(nn.Module):
    """One T5 encoder layer: x + attention(norm(x)) with the learned bucket bias, then x + FFN(norm(x))."""

    def __init__(self, dim: int, heads: int, head_dim: int, ffn: int, num_buckets: int = 32,
                 max_distance: int = 128) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.num_buckets, self.max_distance = num_buckets, max_distance
        inner = heads * head_dim
        self.q, self.k, self.v = (nn.Linear(dim, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, dim, bias=False)
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)
        self.wi, self.wo = nn.Linear(dim, ffn, bias=False), nn.Linear(ffn, dim, bias=False)
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)

    def position_bias(self, score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        """The score modifier: the score plus the table's entry for (bucket(j - i), head h)."""
        table = self.relative_attention_bias.weight  # (NB, H)
        return score + table[relative_bucket(j - i, self.num_buckets, self.max_distance), h]

    def forward(self, x: Tensor, backend: str = "auto") -> Tensor:
        b, length, _ = x.shape
        y = self.norm1(x)
        q, k, v = (p(y).view(b, length, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        # T5 folds 1/sqrt(D) into its initialisation: the scores are q . k, unscaled
        out = selfattn.attention(q, k, v, scale=1.0, backend=backend,
                                 score_mod=scores.custom(self.position_bias, additive=True))  # (B, H, L, D)
        x = x + self.o(out.transpose(1, 2).reshape(b, length, -1))
        return x + self.wo(torch.relu(self.wi(self.norm2(x))))

    @classmethod
    def from_hf(cls, block: nn.Module) -> T5Layer:
        """This layer with the weights of a transformers ``T5Block`` whose attention has the table."""
        attn, ff = block.layer[0].SelfAttention, block.layer[1].DenseReluDense
        layer = cls(attn.q.in_features, attn.n_heads, attn.key_value_proj_dim, ff.wi.out_features,
                    attn.relative_attention_num_buckets, attn.relative_attention_max_distance)
        ours = {"q": attn.q, "k": attn.k, "v": attn.v, "o": attn.o, "wi": ff.wi, "wo": ff.wo,
                "relative_attention_bias": attn.relative_attention_bias,
                "norm1": block.layer[0].layer_norm, "norm2": block.layer[1].layer_norm}
        with torch.no_grad():
            for name, theirs in ours.items():
                getattr(layer, name).weight.copy_(theirs.weight)
        return layer


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="512 tokens, 60 steps")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.steps = 512, 60
    torch.manual_seed(0)
    layer = T5Layer(args.dim, args.heads, args.dim // args.heads, 4 * args.dim)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    shift = 3
    x = torch.randn(1, args.length, args.dim)
    target = torch.roll(x, shift, dims=1)  # output i must reproduce input i - 3
    losses, times, peak = [], [], None
    print(f"T5 layer: E={args.dim}, H={args.heads}, L={args.length}, backend chunked")
    for step in range(args.steps):
        base = _reset_peak() if step == 0 else 0
        start = time.perf_counter()
        loss = (layer(x, backend="chunked") - x - target)[:, shift:].pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        if step == 0:
            peak = _peak_rss() - base
        losses.append(loss.item())
        print(f"step {step + 1}/{args.steps}: loss {losses[-1]:.4f}  {times[-1]:.1f} s")
    summary = {"length": args.length, "steps": args.steps, "loss_first": losses[0], "loss_last": losses[-1],
               "seconds_per_step": sum(times[1:] or times) / len(times[1:] or times),
               "first_step_peak_mib": round((peak or 0) / 2**20),
               "dense_bias_mib": round(args.heads * args.length**2 * 4 / 2**20)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

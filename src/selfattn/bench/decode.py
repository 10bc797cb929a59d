"""``selfattn bench --suite decode``: one KV-cache decode step of a 12-layer, 768-wide model from a
2k-token cache, B = 1 and B = 8, vs projecting the new token and calling SDPA on the cached tensors.

Shape legend: B batch, E embed dim.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from rich.progress import Progress, TaskID
from rich.table import Table

from .ratios import attach_ratios
from .report import measured, ratio_tables
from .timing import time_interleaved

__all__ = ["IN_ALL", "NAME", "decode_steps", "grid", "run", "tables"]

NAME = "decode"
IN_ALL = True
DECODE_BATCHES = [1, 8]


def grid(args: argparse.Namespace) -> list[dict]:
    return [dict(B=b) for b in DECODE_BATCHES]


def run(todo: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """One decode step of a 12-layer, 768-wide model (12 heads) from a 2k-token cache, for B = 1 and
    B = 8: selfattn's KVCache path vs projecting the new token and calling SDPA on the cached
    tensors directly (the least a decode step can do), interleaved."""
    import selfattn

    device, dtype = args.device, getattr(torch, args.dtype)
    layers, e, h, cached = (2, 128, 4, 256) if args.quick else (12, 768, 12, 2048)
    out = []
    for p in todo:
        b = p["B"]
        progress.update(task, description=f"decode: {layers} layers, E={e}, cache {cached}, B={b}")
        torch.manual_seed(0)
        mods = [selfattn.MultiHeadAttention(e, h).to(device=device, dtype=dtype).eval() for _ in range(layers)]
        caches = [selfattn.KVCache(b, cached + 64, h, e // h, dtype=dtype, device=device) for _ in range(layers)]
        with torch.no_grad():
            prompt = torch.randn(b, cached, e, device=device, dtype=dtype)
            for m, c in zip(mods, caches, strict=True):
                m(prompt, cache=c, positions=torch.arange(cached, device=device).expand(b, -1))
        steps = decode_steps(mods, caches, torch.randn(b, 1, e, device=device, dtype=dtype), cached)
        with torch.no_grad():
            timings = time_interleaved(steps, args.repeats or (20 if args.quick else 50), device, warmup=3)
        out += [dict(suite="decode", case=f"{layers}x{e}, cache {cached}", B=b, impl=name, mode="decode step",
                     L=cached, status="ok", **measured(t)) for name, t in timings.items()]
        progress.advance(task)
    attach_ratios(out, "decode", ("case", "B"), ["sdpa"])
    return out


def decode_steps(mods: list, caches: list, x: torch.Tensor, cached: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The two decode steps at position ``cached`` (both write that slot, so both see cached + 1
    keys); each returns the last layer's output, which must agree (tests/test_bench.py)."""
    import torch.nn.functional as F

    b, _, e = x.shape
    pos = torch.full((b, 1), cached, device=x.device)

    def ours() -> torch.Tensor:
        y = x
        for m, c in zip(mods, caches, strict=True):
            y = m(y, cache=c, positions=pos)
        return y

    def raw() -> torch.Tensor:  # the same projections, then SDPA straight on the cached K/V (all visible)
        y = x
        for m, c in zip(mods, caches, strict=True):
            h = m.num_heads
            q, k, v = m.qkv(y).split(e, dim=-1)
            q = q.view(b, 1, h, e // h).transpose(1, 2)
            c.k[:, :, cached] = k.view(b, h, e // h)
            c.v[:, :, cached] = v.view(b, h, e // h)
            o = F.scaled_dot_product_attention(q, c.k[:, :, :cached + 1], c.v[:, :, :cached + 1])
            y = m.proj(o.transpose(1, 2).reshape(b, 1, e))
        return y

    return {"selfattn": ours, "sdpa": raw}


def tables(results: list[dict]) -> list[Table]:
    return ratio_tables(results, "decode", ("case", "B", "mode"), "sdpa",
                        "KV-cache decode step vs SDPA on the cached tensors (x = ratio to SDPA)")

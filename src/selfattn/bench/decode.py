"""``selfattn bench --suite decode``: one KV-cache decode step of a 12-layer, 768-wide model from a
2k-token cache, B = 1 and B = 8, vs projecting the new token and calling SDPA on the cached tensors,
and the same step with a PagedKVCache (pages of 16 and 128 tokens) vs the contiguous KVCache.

Shape legend: B batch, E embed dim.
"""

from __future__ import annotations

import argparse
import os
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
PAGE_SIZES = [16, 128]


def grid(args: argparse.Namespace) -> list[dict]:
    """(B, cached tokens) points: ``--batches`` and ``--lengths`` (default B = 1, 8 from 2048 tokens, 256
    with ``--quick``)."""
    contexts = getattr(args, "lengths", None) or [None]
    return [dict(B=b, L=length) for b in (getattr(args, "batches", None) or DECODE_BATCHES) for length in contexts]


def _cache_bytes(layers: int, b: int, cached: int, e: int, itemsize: int, copies: int) -> int:
    """K and V of every layer for ``copies`` caches (the KVCache and each paged copy)."""
    return copies * layers * 2 * b * (cached + 64) * e * itemsize


def run(todo: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """One decode step of a 12-layer, 768-wide model (12 heads) from a 2k-token cache, for B = 1 and
    B = 8: selfattn's KVCache path vs projecting the new token and calling SDPA on the cached
    tensors directly (the least a decode step can do), and with a PagedKVCache per page size holding
    the same tokens, interleaved."""
    import selfattn


    device, dtype = args.device, getattr(torch, args.dtype)
    layers, e, h, default_cached = (2, 128, 4, 256) if args.quick else (12, 768, 12, 2048)
    page_sizes = getattr(args, "page_sizes", None) or PAGE_SIZES
    limit = 0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out = []
    for p in todo:
        b, cached = p["B"], p["L"] or default_cached
        need = _cache_bytes(layers, b, cached, e, torch.empty(0, dtype=dtype).element_size(), 1 + len(page_sizes))
        if device == "cpu" and need > limit:
            out += [dict(suite="decode", case=f"{layers}x{e}, cache {cached}", B=b, impl=name, mode="decode step",
                         L=cached, status="skipped", note=f"needs ~{need / 2**30:.0f} GiB of caches")
                    for name in ("selfattn", "sdpa", *(f"paged-{size}" for size in page_sizes))]
            progress.advance(task)
            continue
        progress.update(task, description=f"decode: {layers} layers, E={e}, cache {cached}, B={b}")
        torch.manual_seed(0)
        mods = [selfattn.MultiHeadAttention(e, h).to(device=device, dtype=dtype).eval() for _ in range(layers)]
        caches = [selfattn.KVCache(b, cached + 64, h, e // h, dtype=dtype, device=device) for _ in range(layers)]
        with torch.no_grad():
            prompt = torch.randn(b, cached, e, device=device, dtype=dtype)
            for m, c in zip(mods, caches, strict=True):
                m(prompt, cache=c, positions=torch.arange(cached, device=device).expand(b, -1))
        paged = {f"paged-{size}": paged_copies(caches, cached, size) for size in page_sizes}
        steps = decode_steps(mods, caches, torch.randn(b, 1, e, device=device, dtype=dtype), cached, paged)
        with torch.no_grad():
            timings = time_interleaved(steps, args.repeats or (20 if args.quick else 50), device, warmup=3)
        out += [dict(suite="decode", case=f"{layers}x{e}, cache {cached}", B=b, impl=name, mode="decode step",
                     L=cached, status="ok", **measured(t)) for name, t in timings.items()]
        progress.advance(task)
    attach_ratios([r for r in out if r["status"] == "ok"], "decode", ("case", "B"), ["sdpa", "selfattn"])
    return out


def paged_copies(caches: list, cached: int, page_size: int) -> list:
    """A PagedKVCache per KVCache holding its first ``cached`` tokens of each sequence (sequence ids 0..B-1),
    with room for the step's new token."""
    import selfattn

    out = []
    for c in caches:
        b, g, _, d = c.k.shape
        pages = b * (-(-(cached + 1) // page_size))
        paged = selfattn.PagedKVCache(pages, page_size, g, d, dtype=c.k.dtype, device=c.k.device)
        ids = [paged.allocate() for _ in range(b)]
        cu = torch.arange(b + 1, device=c.k.device) * cached
        paged.append(ids, c.k[:, :, :cached].transpose(1, 2).reshape(b * cached, g, d),
                     c.v[:, :, :cached].transpose(1, 2).reshape(b * cached, g, d), cu)
        out.append(paged)
    return out


def decode_steps(mods: list, caches: list, x: torch.Tensor, cached: int,
                 paged: dict[str, list] | None = None) -> dict[str, Callable[[], torch.Tensor]]:
    """The decode steps at position ``cached`` (each writes that slot, so each sees cached + 1 keys); each
    returns the last layer's output, which must agree (tests/test_bench.py). A paged step appends the
    token to every sequence of its caches (one per layer, from :func:`paged_copies`) and truncates them
    back, so each repeat does the same work."""
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

    def paged_step(pcs: list) -> Callable[[], torch.Tensor]:
        ids = list(pcs[0].sequences)

        def step() -> torch.Tensor:
            y = x
            for m, c in zip(mods, pcs, strict=True):
                y = m(y, cache=c, seq_ids=ids)
            for c in pcs:
                for s in ids:
                    c.truncate(s, cached)
            return y

        return step

    return {"selfattn": ours, "sdpa": raw, **{name: paged_step(pcs) for name, pcs in (paged or {}).items()}}


def tables(results: list[dict]) -> list[Table]:
    return [*ratio_tables(results, "decode", ("case", "B", "mode"), "sdpa",
                          "KV-cache decode step vs SDPA on the cached tensors (x = ratio to SDPA)"),
            *ratio_tables(results, "decode", ("case", "B", "mode"), "selfattn",
                          "PagedKVCache (paged-<page size>) vs the contiguous KVCache (x = ratio to selfattn)")]

"""``selfattn bench --suite overhead``: ``attention(backend="auto")`` vs calling
``scaled_dot_product_attention`` directly at (1, 8, 4096, 64), no mask and causal, interleaved.

Shape legend: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import argparse

import torch
from rich.progress import Progress, TaskID
from rich.table import Table

from .ratios import attach_ratios
from .report import measured, ratio_tables
from .timing import time_interleaved

__all__ = ["IN_ALL", "NAME", "grid", "run", "tables"]

NAME = "overhead"
IN_ALL = True


def grid(args: argparse.Namespace) -> list[dict]:
    return [dict(causal=False), dict(causal=True)]


def run(todo: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """attention(auto) vs raw SDPA at (1, 8, 4096, 64), interleaved in one process."""
    import torch.nn.functional as F

    import selfattn

    device, dtype = args.device, getattr(torch, args.dtype)
    q, k, v = (torch.randn(1, 8, 4096, 64, device=device, dtype=dtype) for _ in range(3))
    n = args.repeats or (10 if args.quick else 30)
    out = []
    for p in todo:
        causal = p["causal"]
        progress.update(task, description=f"overhead causal={causal}")
        fns = {"selfattn": lambda c=causal: selfattn.attention(q, k, v, causal=c),
               "sdpa": lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c)}
        with torch.no_grad():
            timings = time_interleaved(fns, n, device)
        for name, t in timings.items():
            out.append(dict(suite="overhead", case="causal" if causal else "none", impl=name, mode="fwd",
                            L=4096, B=1, H=8, D=64, status="ok", **measured(t)))
        progress.advance(task)
    attach_ratios(out, "overhead", ("case",), ["sdpa"])
    return out


def tables(results: list[dict]) -> list[Table]:
    return ratio_tables(results, "overhead", ("case", "L", "mode"), "sdpa",
                        "attention(auto) vs raw scaled_dot_product_attention, (1, 8, 4096, 64)")

"""``selfattn bench --suite modules``: ``MultiHeadAttention`` vs ``nn.MultiheadAttention``
(need_weights=False) and the tutorial's MultiHeadAttention, forward and forward+backward, timed in
turns in one process.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import argparse

import torch
from rich.progress import Progress, TaskID
from rich.table import Table
from torch import nn

from .ratios import attach_ratios
from .report import measured, ratio_tables
from .timing import time_call, time_interleaved
from .worker import make_step

__all__ = ["IN_ALL", "NAME", "grid", "run", "tables"]

NAME = "modules"
IN_ALL = True
MODULE_SHAPES = [(32, 10, 512, 8), (8, 512, 512, 8), (2, 2048, 512, 8)]  # (B, L, E, heads)


def grid(args: argparse.Namespace) -> list[dict]:
    """(B, L, E, H) and mode of every point."""
    return [dict(B=b, L=length, E=e, H=h, mode=mode) for b, length, e, h in MODULE_SHAPES
            for mode in args.modes or ["fwd", "fwd+bwd"]]


def run(todo: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """MultiHeadAttention vs nn.MultiheadAttention and the tutorial's, interleaved in one process."""
    import selfattn

    from .anchors import TextbookMultiHeadAttention

    device, dtype = args.device, getattr(torch, args.dtype)
    out = []
    for p in todo:
        b, length, e, h, mode = p["B"], p["L"], p["E"], p["H"], p["mode"]
        progress.update(task, description=f"modules {mode} B={b} L={length}")
        torch.manual_seed(0)
        x = torch.randn(b, length, e, device=device, dtype=dtype, requires_grad=mode == "fwd+bwd")
        mods = {"selfattn": selfattn.MultiHeadAttention(e, h),
                "torch": nn.MultiheadAttention(e, h, batch_first=True),
                "tutorial": TextbookMultiHeadAttention(e, h)}
        calls = {"selfattn": lambda m=mods["selfattn"], x=x: m(x),
                 "torch": lambda m=mods["torch"], x=x: m(x, x, x, need_weights=False)[0],
                 "tutorial": lambda m=mods["tutorial"], x=x: m(x)[0]}
        for m in mods.values():
            m.to(device=device, dtype=dtype).eval()
        steps = {name: make_step(calls[name], [x, *mods[name].parameters()], mode == "fwd+bwd") for name in mods}
        once = time_call(steps["tutorial"], device)
        repeats = args.repeats or max(3, min(30 if not args.quick else 10, int(20 / max(once, 1e-4))))
        for name, t in time_interleaved(steps, repeats, device).items():
            out.append(dict(suite="modules", B=b, L=length, E=e, H=h, impl=name, mode=mode, status="ok",
                            **measured(t)))
        progress.advance(task)
    attach_ratios(out, "modules", ("B", "L", "E", "H", "mode"), ["torch", "tutorial"])
    return out


def tables(results: list[dict]) -> list[Table]:
    return ratio_tables(results, "modules", ("B", "L", "E", "H", "mode"), "torch",
                        "MultiHeadAttention vs nn.MultiheadAttention and the tutorial's (x = ratio to torch, "
                        "per repeat: median (min-max))")

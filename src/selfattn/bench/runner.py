"""The one runner of ``selfattn bench``: the suites asked for, one progress bar, their tables, the JSON
and the plots.

A suite is a module with ``NAME``, ``IN_ALL`` (part of ``--suite all``), ``grid(args)`` (its points),
``run(points, args, progress, task)`` (its result rows, one progress step per point) and
``tables(results)`` (its rich tables, none when it has no rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from types import ModuleType

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import decode, distributed, learned, masks, models, modules, overhead

__all__ = ["SUITES", "main"]

SUITES: dict[str, ModuleType] = {s.NAME: s for s in (modules, overhead, decode, masks, distributed, models,
                                                        learned)}
"""Every suite, in the order they run and print."""


def main(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: wide rows, not wrapped cells
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        console.print("[red]--device cuda given, but torch sees no CUDA device[/red]")
        return 2
    chosen = [s for s in SUITES.values() if (s.IN_ALL if args.suite == "all" else s.NAME == args.suite)]
    meta = dict(torch=torch.__version__, device=args.device, dtype=args.dtype, threads=torch.get_num_threads(),
                machine=platform.machine(), cpus=os.cpu_count(), quick=args.quick,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    console.print(f"selfattn bench: {meta}")
    grids = [(suite, suite.grid(args)) for suite in chosen]
    results: list[dict] = []
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("bench", total=sum(len(points) for _, points in grids))
        for suite, points in grids:
            results += suite.run(points, args, progress, task)
    for suite in chosen:
        for table in suite.tables(results):
            console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        console.print(f"results written to {args.json}")
    if args.plot:
        paths = masks.plots(results, args.plot)
        console.print(f"plots: {', '.join(map(str, paths))}" if paths else "no plots (matplotlib missing or no data)")
    return 1 if any(r["status"] == "error" for r in results) else 0

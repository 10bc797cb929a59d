"""``selfattn bench``: selfattn side by side with its anchors, in one run.

Suites:
- modules: ``MultiHeadAttention`` vs ``nn.MultiheadAttention`` (need_weights=False) and the
  tutorial's MultiHeadAttention, forward and forward+backward.
- overhead: ``attention(backend="auto")`` vs calling ``scaled_dot_product_attention`` directly.
- masks: masked attention from 1k to 64k tokens: selfattn (auto, chunked) vs raw SDPA (with the
  dense mask where a mask is needed), SDPA is_causal, the tutorial's textbook math and compiled
  FlexAttention (CPU: forward only, as it has no CPU backward).
- distributed: ``selfattn.distributed.attention`` on W = 1, 2, 4 processes at a fixed total length
  (time, per-rank peak memory, communication hidden behind compute); see ``bench.distributed``.
  Not part of ``all``.

The modules and overhead suites time their implementations in turns in one process, so all see
the same machine noise. Every point of the masks suite runs in its own process (see ``worker``),
so its peak memory is its own. Results are medians (with every repeat and their relative
spread); ratios are against an anchor of the same run. Timing is :mod:`selfattn.bench.timing`.

Shape legend: B batch, L length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn

from . import distributed as _distributed
from .timing import Timing, time_call, time_interleaved
from .worker import MASK_CASES, make_step

__all__ = ["main"]

MODULE_SHAPES = [(32, 10, 512, 8), (8, 512, 512, 8), (2, 2048, 512, 8)]  # (B, L, E, heads)
MASK_IMPLS = ["selfattn", "chunked", "sdpa", "sdpa-causal", "sdpa-causal-valid", "textbook", "flex"]
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK_LENGTHS = [2048]
QUICK_IMPLS = ["selfattn", "sdpa", "sdpa-causal-valid", "textbook"]
H, D = 8, 64


def _estimate_bytes(impl: str, case: str, length: int, mode: str, itemsize: int) -> int:
    """Rough peak memory of the O(L^2) implementations, to skip points that cannot fit."""
    batch = 2 if case.startswith("padding") else 1
    l2 = batch * length * length
    if impl == "textbook":
        return l2 * H * itemsize * (5 if mode == "fwd+bwd" else 3)
    if impl == "sdpa" and case not in ("causal", "dense"):
        return l2 * (1 + 4)  # the bool mask and its additive float form
    if impl == "flex":
        return batch * H * length * D * itemsize * 16
    return 0


def _mask_points(args: argparse.Namespace, device: str) -> list[dict]:
    cases = args.cases or MASK_CASES
    unknown = set(cases) - set(MASK_CASES)
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; choose from {MASK_CASES}")
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    modes = args.modes or (["fwd+bwd"] if args.quick else ["fwd", "fwd+bwd"])
    impls = args.impls or (QUICK_IMPLS if args.quick else MASK_IMPLS)
    points = []
    for case in cases:
        for mode in modes:
            for length in lengths:
                for impl in impls:
                    if impl in ("sdpa-causal", "sdpa-causal-valid") and not case.startswith("padding"):
                        continue  # anchors for the padded cases; for causal, "sdpa" is is_causal itself
                    p = dict(suite="masks", case=case, mode=mode, L=length, impl=impl, H=H, D=D)
                    if impl == "flex" and mode == "fwd+bwd" and not device.startswith("cuda"):
                        p["skip"] = "FlexAttention has no CPU backward"
                    points.append(p)
    return points


def _run_points(points: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    limit = (args.memory_limit_gb * 2**30 if args.memory_limit_gb
             else 0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    repeats = args.repeats or 50  # at most; each point stops after its time budget
    results = []
    for p in points:
        p = dict(p, device=args.device, dtype=args.dtype, repeats=repeats, seconds=2.0 if args.quick else 10.0)
        progress.update(task, description=f"masks {p['case']} {p['impl']} {p['mode']} L={p['L']}")
        need = _estimate_bytes(p["impl"], p["case"], p["L"], p["mode"], itemsize)
        if "skip" in p:
            res = {"status": "skipped", "note": p.pop("skip")}
        elif need > limit:
            res = {"status": "skipped", "note": f"needs ~{need / 2**30:.0f} GiB (> {limit / 2**30:.0f})"}
        else:
            res = _spawn(p)
        results.append({**p, **res})
        progress.advance(task)
    return results


def _spawn(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "selfattn.bench.worker", json.dumps(spec)],
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        return {"status": "error", "note": f"worker exited {proc.returncode}: {tail[0][:200]}"}
    res = json.loads(lines[-1])
    if "error" in res:
        return {"status": "error", "note": res["error"]}
    return {"status": "ok", **res}


def _measured(t: Timing) -> dict:
    """The result fields of one timed implementation: median, every repeat, relative spread."""
    return {"time_s": t.median, "times": t.times, "spread": t.spread}


def _modules(args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """MultiHeadAttention vs nn.MultiheadAttention and the tutorial's, interleaved in one process."""
    import selfattn

    from .anchors import TextbookMultiHeadAttention

    device, dtype = args.device, getattr(torch, args.dtype)
    modes = args.modes or ["fwd", "fwd+bwd"]
    out = []
    for b, length, e, h in MODULE_SHAPES:
        for mode in modes:
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
            steps = {name: make_step(calls[name], [x, *mods[name].parameters()], mode == "fwd+bwd")
                     for name in mods}
            once = time_call(steps["tutorial"], device)
            repeats = args.repeats or max(3, min(30 if not args.quick else 10, int(20 / max(once, 1e-4))))
            for name, t in time_interleaved(steps, repeats, device).items():
                out.append(dict(suite="modules", B=b, L=length, E=e, H=h, impl=name, mode=mode, status="ok",
                                **_measured(t)))
            progress.advance(task)
    return out


def _overhead(args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """attention(auto) vs raw SDPA at (1, 8, 4096, 64), interleaved in one process."""
    import torch.nn.functional as F

    import selfattn

    device, dtype = args.device, getattr(torch, args.dtype)
    q, k, v = (torch.randn(1, 8, 4096, 64, device=device, dtype=dtype) for _ in range(3))
    n = args.repeats or (10 if args.quick else 30)
    out = []
    for causal in (False, True):
        progress.update(task, description=f"overhead causal={causal}")
        fns = {"selfattn": lambda c=causal: selfattn.attention(q, k, v, causal=c),
               "sdpa": lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c)}
        with torch.no_grad():
            timings = time_interleaved(fns, n, device)
        for name, t in timings.items():
            out.append(dict(suite="overhead", case="causal" if causal else "none", impl=name, mode="fwd",
                            L=4096, B=1, H=8, D=64, status="ok", **_measured(t)))
        progress.advance(task)
    return out


def _cell(r: dict | None, base: float | None, memory: bool) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return f"[dim]{r['status']}: {r.get('note', '')}[/dim]"
    text = f"{r['time_s'] * 1e3:.1f} ms" + (f" x{r['time_s'] / base:.2f}" if base else "")
    return text + (f"\n{r['peak_bytes'] / 2**20:.0f} MiB" if memory else "")


def _decode(args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """One decode step of a 12-layer, 768-wide model (12 heads) from a 2k-token cache: selfattn's
    KVCache path vs projecting the new token and calling SDPA on the cached tensors directly."""
    import torch.nn.functional as F

    import selfattn

    device, dtype = args.device, getattr(torch, args.dtype)
    layers, e, h, cached = (2, 128, 4, 256) if args.quick else (12, 768, 12, 2048)
    progress.update(task, description=f"decode: {layers} layers, E={e}, cache {cached}")
    torch.manual_seed(0)
    mods = [selfattn.MultiHeadAttention(e, h).to(device=device, dtype=dtype).eval() for _ in range(layers)]
    caches = [selfattn.KVCache(1, cached + 64, h, e // h, dtype=dtype, device=device) for _ in range(layers)]
    with torch.no_grad():
        prompt = torch.randn(1, cached, e, device=device, dtype=dtype)
        for m, c in zip(mods, caches, strict=True):
            m(prompt, cache=c, positions=torch.arange(cached, device=device)[None])
    x = torch.randn(1, 1, e, device=device, dtype=dtype)
    pos = torch.tensor([[cached]], device=device)

    def ours() -> None:
        y = x
        for m, c in zip(mods, caches, strict=True):
            y = m(y, cache=c, positions=pos)

    def raw() -> None:  # the same projections, then SDPA straight on the cached K/V (all visible)
        y = x
        for m, c in zip(mods, caches, strict=True):
            q, k, v = m.qkv(y).split(e, dim=-1)
            q = q.view(1, 1, h, e // h).transpose(1, 2)
            c.k[:, :, cached] = k.view(1, h, e // h)
            c.v[:, :, cached] = v.view(1, h, e // h)
            o = F.scaled_dot_product_attention(q, c.k[:, :, :cached + 1], c.v[:, :, :cached + 1])
            y = m.proj(o.transpose(1, 2).reshape(1, 1, e))

    with torch.no_grad():
        timings = time_interleaved({"selfattn": ours, "sdpa": raw}, args.repeats or (20 if args.quick else 50),
                                   device)
    progress.advance(task)
    return [dict(suite="decode", case=f"{layers}x{e}, cache {cached}", impl=name, mode="decode step", L=cached,
                 status="ok", **_measured(t)) for name, t in timings.items()]


def _ratio_tables(results: list[dict], suite: str, split: str | None, key_fields: tuple[str, ...],
                  anchor: str, title: str) -> list[Table]:
    """One table per value of ``split`` (or one table): rows keyed by ``key_fields``, a column per
    implementation with its median time, its ratio to ``anchor`` and (masks) its peak memory."""
    rows = [r for r in results if r["suite"] == suite]
    tables: list[Table] = []
    parts = list(dict.fromkeys(r.get(split) for r in rows)) if split else ([None] if rows else [])
    for part in parts:
        sel = [r for r in rows if split is None or r.get(split) == part]
        impls = list(dict.fromkeys(r["impl"] for r in sel))
        table = Table(title=title + (f": {part}" if part else ""))
        for f in key_fields:
            table.add_column(f)
        for impl in impls:
            table.add_column(impl, justify="right")
        groups: dict[tuple, dict[str, dict]] = {}
        for r in sel:
            groups.setdefault(tuple(r.get(f) for f in key_fields), {})[r["impl"]] = r
        for key, by_impl in groups.items():
            base_row = by_impl.get(anchor, {})
            base = base_row.get("time_s") if base_row.get("status") == "ok" else None
            table.add_row(*(str(x) for x in key), *(_cell(by_impl.get(i), base, suite == "masks") for i in impls))
        tables.append(table)
    return tables


def _plots(results: list[dict], folder: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = [r for r in results if r["suite"] == "masks" and r["status"] == "ok"]
    if not rows:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    paths = []
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {impl: f"C{n % 10}" for n, impl in enumerate(impls)}  # one colour per implementation everywhere
    for metric, label, scale in (("time_s", "median time (s)", 1.0), ("peak_bytes", "peak extra memory (MiB)", 2**-20)):
        fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.2), squeeze=False)
        for ax, case in zip(axes[0], cases, strict=True):
            for (impl, mode) in dict.fromkeys((r["impl"], r["mode"]) for r in rows if r["case"] == case):
                pts = sorted((r["L"], r[metric] * scale) for r in rows
                             if r["case"] == case and r["impl"] == impl and r["mode"] == mode)
                ax.plot(*zip(*pts, strict=True), marker="o", color=colors[impl],
                        linestyle="-" if mode == "fwd" else "--", label=f"{impl} {mode}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(case)
            ax.set_xlabel("sequence length")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
        handles = {}
        for ax in axes[0]:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        fig.legend(handles.values(), handles.keys(), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
        path = folder / ("time.png" if metric == "time_s" else "memory.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _distributed_table(results: list[dict]) -> Table:
    """One row per point: time and peak memory per rank, each also as a ratio to W = 1."""
    table = Table(title="context parallelism (zigzag, fwd+bwd, per rank; x = ratio to W=1; hidden = share of "
                        "communication overlapped by compute)")
    for col in ("case", "L", "strategy", "W", "time s", "x", "peak MiB", "x", "comm alone s", "hidden"):
        table.add_column(col)
    rows = [r for r in results if r["suite"] == "distributed"]
    base = {(r["case"], r["L"], r["strategy"]): r for r in rows if r["W"] == 1 and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["case"], str(r["L"]), r["strategy"], str(r["W"]), r["status"], "", r.get("note", ""),
                          "", "", "")
            continue
        b = base.get((r["case"], r["L"], r["strategy"]))
        mib = max(0, r["peak_bytes"]) / 2**20  # resident growth; the allocator's reuse can make it ~0
        hidden = "-" if r["hidden"] is None else f"{100 * r['hidden']:.0f}%"
        peak_ratio = f"{r['peak_bytes'] / b['peak_bytes']:.2f}" if b and b["peak_bytes"] >= 2**20 else "-"
        table.add_row(r["case"], str(r["L"]), r["strategy"], str(r["W"]), f"{r['time_s']:.2f}",
                      f"{r['time_s'] / b['time_s']:.2f}" if b else "", f"{mib:.0f}", peak_ratio,
                      f"{r['comm_alone_s']:.3f}", hidden)
    return table


def main(args: argparse.Namespace) -> int:
    console = Console()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        console.print("[red]--device cuda given, but torch sees no CUDA device[/red]")
        return 2
    suites = ["modules", "overhead", "decode", "masks"] if args.suite == "all" else [args.suite]
    meta = dict(torch=torch.__version__, device=args.device, dtype=args.dtype, threads=torch.get_num_threads(),
                machine=platform.machine(), cpus=os.cpu_count(), quick=args.quick,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    console.print(f"selfattn bench: {meta}")
    modes = args.modes or ["fwd", "fwd+bwd"]
    points = _mask_points(args, args.device) if "masks" in suites else []
    dpoints = _distributed.points(args.lengths, args.quick, args.repeats) if "distributed" in suites else []
    total = (len(points) + len(dpoints) + (2 if "overhead" in suites else 0) + (1 if "decode" in suites else 0)
             + (len(MODULE_SHAPES) * len(modes) if "modules" in suites else 0))
    results: list[dict] = []
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("bench", total=total)
        if "modules" in suites:
            results += _modules(args, progress, task)
        if "overhead" in suites:
            results += _overhead(args, progress, task)
        if "decode" in suites:
            results += _decode(args, progress, task)
        results += _run_points(points, args, progress, task)
        for p in dpoints:
            progress.update(task, description=f"distributed {p['case']} {p['strategy']} W={p['W']} L={p['L']}")
            results.append({**p, **_distributed.run_point(p)})
            progress.advance(task)

    tables = [
        *_ratio_tables(results, "modules", None, ("B", "L", "E", "H", "mode"), "torch",
                       "MultiHeadAttention vs nn.MultiheadAttention and the tutorial's (x = ratio to torch)"),
        *_ratio_tables(results, "overhead", None, ("case", "L", "mode"), "sdpa",
                       "attention(auto) vs raw scaled_dot_product_attention, (1, 8, 4096, 64)"),
        *_ratio_tables(results, "decode", None, ("case", "mode"), "sdpa",
                       "KV-cache decode step vs SDPA on the cached tensors (x = ratio to SDPA)"),
        *_ratio_tables(results, "masks", "case", ("mode", "L"), "sdpa",
                       f"H={H}, D={D}, x = ratio to raw SDPA, MiB = peak extra memory"),
    ]
    if dpoints:
        tables.append(_distributed_table(results))
    for table in tables:
        console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        console.print(f"results written to {args.json}")
    if args.plot:
        paths = _plots(results, args.plot)
        console.print(f"plots: {', '.join(map(str, paths))}" if paths else "no plots (matplotlib missing or no data)")
    return 1 if any(r["status"] == "error" for r in results) else 0

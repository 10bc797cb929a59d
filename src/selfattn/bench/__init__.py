"""``selfattn bench``: selfattn side by side with its anchors, in one run.

Suites:
- modules: ``MultiHeadAttention`` vs ``nn.MultiheadAttention`` (need_weights=False) and the
  tutorial's MultiHeadAttention, forward and forward+backward.
- overhead: ``attention(backend="auto")`` vs calling ``scaled_dot_product_attention`` directly.
- decode: one KV-cache decode step of a 12-layer, 768-wide model from a 2k-token cache, B = 1
  and B = 8, vs projecting the new token and calling SDPA on the cached tensors.
- masks: masked attention from 1k to 64k tokens: selfattn (auto, chunked) vs raw SDPA (with the
  dense mask where a mask is needed), SDPA is_causal (over the whole batch, and for padded
  batches over each item's real tokens only), the tutorial's textbook math and compiled
  FlexAttention (CPU: forward only, as it has no CPU backward).
- models: a Llama-shaped transformers model trained on one packed row, selfattn vs transformers'
  sdpa and eager, time and peak memory of the attention part and of the whole step; and the same
  model generating greedily (dynamic and static caches, eager and compiled), selfattn vs sdpa,
  time per token; see ``bench.models``. ``--cases train`` or ``--cases generate`` runs one half.
  Not part of ``all`` (minutes per point at 16k tokens).
- distributed: ``selfattn.distributed.attention`` on W = 1, 2, 4 processes at a fixed total length
  (time, per-rank peak memory, communication hidden behind compute); see ``bench.distributed``.
  Not part of ``all``.

Every suite times the implementations of one point in turns in one process
(:func:`~selfattn.bench.timing.time_interleaved`), so all see the same machine noise; a ratio is
taken repeat by repeat and reported as its median with the min-max over the repeats
(:mod:`selfattn.bench.ratios`; in the JSON, each row's ``ratios``). For the masks suite that
process is a worker of its own per point, and each implementation's peak memory is then measured
alone in a further worker, so it is its own (see ``worker``). Results are medians (with every
repeat and their relative spread). Timing is :mod:`selfattn.bench.timing`. The README's tables
are written from the JSON by ``scripts/readme_tables.py`` (:mod:`selfattn.bench.markdown`).

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
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn

from . import distributed as _distributed
from . import models as _models
from .ratios import MASK_ANCHORS, attach_ratios, format_ratio
from .timing import Timing, time_call, time_interleaved
from .worker import MASK_CASES, case_batch, make_step

__all__ = ["main"]

MODULE_SHAPES = [(32, 10, 512, 8), (8, 512, 512, 8), (2, 2048, 512, 8)]  # (B, L, E, heads)
MASK_IMPLS = ["selfattn", "chunked", "sdpa", "sdpa-causal", "sdpa-causal-valid", "textbook", "flex"]
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK_LENGTHS = [2048]
QUICK_CASES = ["causal", "padding(3L/4,L)+causal", "sliding_window(256)", "document(8 docs)"]
QUICK_IMPLS = ["selfattn", "chunked", "sdpa", "sdpa-causal", "sdpa-causal-valid"]
DECODE_BATCHES = [1, 8]
H, D = 8, 64


def _estimate_bytes(impl: str, case: str, length: int, mode: str, itemsize: int) -> int:
    """Rough peak memory of the O(L^2) implementations, to skip points that cannot fit."""
    batch = case_batch(case)
    l2 = batch * length * length
    if impl == "textbook":
        return l2 * H * itemsize * (5 if mode == "fwd+bwd" else 3)
    if impl == "sdpa" and case not in ("causal", "dense"):
        return l2 * (1 + 4)  # the bool mask and its additive float form
    if impl == "flex":
        return batch * H * length * D * itemsize * 16
    return 0


def _mask_points(args: argparse.Namespace, device: str) -> list[dict]:
    cases = args.cases or (QUICK_CASES if args.quick else MASK_CASES)
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
                    if impl == "sdpa-causal" and case in ("causal", "dense"):
                        continue  # for causal, "sdpa" is is_causal itself; dense has no causal anchor
                    if impl == "sdpa-causal-valid" and not case.startswith("padding"):
                        continue  # the padded cases' anchor: is_causal on each item's real tokens
                    p = dict(suite="masks", case=case, mode=mode, L=length, impl=impl, H=H, D=D)
                    if impl == "flex" and mode == "fwd+bwd" and not device.startswith("cuda"):
                        p["skip"] = "FlexAttention has no CPU backward"
                    points.append(p)
    return points


def _run_points(points: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """Measure the masks suite's points: per (case, mode, L), one worker times every implementation
    interleaved, then one worker per implementation measures its peak memory alone."""
    limit = (args.memory_limit_gb * 2**30 if args.memory_limit_gb
             else 0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    repeats = args.repeats or 50  # at most; each point stops after its time budget
    seconds = 2.0 if args.quick else 10.0  # per implementation and point
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        p = dict(p, device=args.device, dtype=args.dtype, repeats=repeats, seconds=seconds)
        groups.setdefault((p["case"], p["mode"], p["L"]), []).append(p)
    results = []
    for (case, mode, length), group in groups.items():
        skipped: dict[str, str] = {}
        for p in group:
            need = _estimate_bytes(p["impl"], case, length, mode, itemsize)
            if "skip" in p:
                skipped[p["impl"]] = p.pop("skip")
            elif need > limit:
                skipped[p["impl"]] = f"needs ~{need / 2**30:.0f} GiB (> {limit / 2**30:.0f})"
        impls = [p["impl"] for p in group if p["impl"] not in skipped]
        progress.update(task, description=f"masks {case} {mode} L={length}: timing {len(impls)} interleaved")
        timed = _worker({**group[0], "impls": impls}) if impls else {}
        for p in group:
            impl = p["impl"]
            got = timed if "error" in timed else timed.get(impl, {"error": "no result"})  # the worker's, or its own
            if impl in skipped:
                res = {"status": "skipped", "note": skipped[impl]}
            elif "error" in got:
                res = {"status": "error", "note": got["error"]}
            else:
                progress.update(task, description=f"masks {case} {impl} {mode} L={length}: peak memory")
                mem = _worker(p)
                res = ({"status": "error", "note": f"memory: {mem['error']}"} if "error" in mem
                       else {"status": "ok", **timed[impl], "peak_bytes": mem["peak_bytes"]})
            results.append({**p, **res})
            progress.advance(task)
    attach_ratios(results, "masks", ("case", "mode", "L"), MASK_ANCHORS)
    return results


def _worker(spec: dict) -> dict:
    """Run ``selfattn.bench.worker`` on ``spec`` in a fresh process; its JSON, or {"error": why}."""
    proc = subprocess.run([sys.executable, "-m", "selfattn.bench.worker", json.dumps(spec)],
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        return {"error": f"worker exited {proc.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


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
    attach_ratios(out, "modules", ("B", "L", "E", "H", "mode"), ["torch", "tutorial"])
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
    attach_ratios(out, "overhead", ("case",), ["sdpa"])
    return out


def _cell(r: dict | None, anchor: str) -> str:
    """Median time and the ratio to ``anchor`` (measured in the same interleaved run) with its spread."""
    if r is None:
        return ""
    if r["status"] != "ok":
        return f"[dim]{r['status']}: {r.get('note', '')}[/dim]"
    ratio = format_ratio(r.get("ratios", {}).get(anchor))
    return f"{r['time_s'] * 1e3:.1f} ms" + (f" {ratio}" if ratio else "")


def _decode(args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """One decode step of a 12-layer, 768-wide model (12 heads) from a 2k-token cache, for B = 1 and
    B = 8: selfattn's KVCache path vs projecting the new token and calling SDPA on the cached
    tensors directly (the least a decode step can do), interleaved."""
    import selfattn

    device, dtype = args.device, getattr(torch, args.dtype)
    layers, e, h, cached = (2, 128, 4, 256) if args.quick else (12, 768, 12, 2048)
    out = []
    for b in DECODE_BATCHES:
        progress.update(task, description=f"decode: {layers} layers, E={e}, cache {cached}, B={b}")
        torch.manual_seed(0)
        mods = [selfattn.MultiHeadAttention(e, h).to(device=device, dtype=dtype).eval() for _ in range(layers)]
        caches = [selfattn.KVCache(b, cached + 64, h, e // h, dtype=dtype, device=device) for _ in range(layers)]
        with torch.no_grad():
            prompt = torch.randn(b, cached, e, device=device, dtype=dtype)
            for m, c in zip(mods, caches, strict=True):
                m(prompt, cache=c, positions=torch.arange(cached, device=device).expand(b, -1))
        steps = _decode_steps(mods, caches, torch.randn(b, 1, e, device=device, dtype=dtype), cached)
        with torch.no_grad():
            timings = time_interleaved(steps, args.repeats or (20 if args.quick else 50), device, warmup=3)
        out += [dict(suite="decode", case=f"{layers}x{e}, cache {cached}", B=b, impl=name, mode="decode step",
                     L=cached, status="ok", **_measured(t)) for name, t in timings.items()]
        progress.advance(task)
    attach_ratios(out, "decode", ("case", "B"), ["sdpa"])
    return out


def _decode_steps(mods: list, caches: list, x: torch.Tensor, cached: int) -> dict[str, Callable[[], torch.Tensor]]:
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


def _ratio_tables(results: list[dict], suite: str, key_fields: tuple[str, ...], anchor: str,
                  title: str) -> list[Table]:
    """Rows keyed by ``key_fields``, a column per implementation with its median time and its ratio
    to ``anchor`` (repeat by repeat, in the same interleaved run: median and min-max)."""
    rows = [r for r in results if r["suite"] == suite]
    if not rows:
        return []
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    table = Table(title=title)
    for f in key_fields:
        table.add_column(f)
    for impl in impls:
        table.add_column(impl, justify="right")
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(f) for f in key_fields), {})[r["impl"]] = r
    for key, by_impl in groups.items():
        table.add_row(*(str(x) for x in key), *(_cell(by_impl.get(i), anchor) for i in impls))
    return [table]


def _anchor_label(impl: str, case: str) -> str:
    """What an anchor implementation is, in a given masks case."""
    if impl == "sdpa":
        return {"causal": "is_causal", "dense": "SDPA"}.get(case, "SDPA dense")
    return {"sdpa-causal": "is_causal", "sdpa-causal-valid": "is_causal real", "flex": "flex"}.get(impl, impl)


def _mask_tables(results: list[dict]) -> list[Table]:
    """One table per masks case: a row per (mode, L, implementation) with its median time, its
    ratio to every anchor timed in the same interleaved run (median and min-max over the repeats)
    and its own peak memory (measured alone)."""
    rows = [r for r in results if r["suite"] == "masks"]
    tables = []
    for case in dict.fromkeys(r["case"] for r in rows):
        sel = [r for r in rows if r["case"] == case]
        anchors = [a for a in MASK_ANCHORS if any(r["impl"] == a for r in sel)]
        table = Table(title=f"masks: {case} (H={H}, D={D}, B={case_batch(case)}; x = time / anchor's time, "
                            "per repeat of one interleaved run: median (min-max); is_causal real = on each "
                            "item's real tokens; MiB = peak extra memory, measured alone)")
        for col in ("mode", "L", "impl", "time"):
            table.add_column(col, no_wrap=True)
        for a in anchors:
            table.add_column(f"x {_anchor_label(a, case)}", justify="right", no_wrap=True)
        table.add_column("MiB", justify="right")
        for r in sel:
            if r["status"] != "ok":
                table.add_row(r["mode"], str(r["L"]), r["impl"], f"[dim]{r['status']}: {r.get('note', '')}[/dim]",
                              *[""] * len(anchors), "")
                continue
            ratios = r.get("ratios", {})
            table.add_row(r["mode"], str(r["L"]), r["impl"], f"{r['time_s'] * 1e3:.1f} ms",
                          *(format_ratio(ratios.get(a)) or ("-" if a == r["impl"] else "") for a in anchors),
                          f"{r['peak_bytes'] / 2**20:.0f}")
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


def _models_table(results: list[dict]) -> Table:
    """One row per point: time and peak memory, each also as a ratio to transformers' sdpa."""
    table = Table(title=f"Llama-shaped model on one packed row of {_models.DOCS} documents, fwd+bwd "
                        "(attention = one layer's mask + attention alone; model = the whole training step; "
                        "x = ratio to sdpa)")
    for col in ("part", "L", "impl", "time s", "x sdpa", "peak MiB", "x sdpa"):
        table.add_column(col)
    rows = [r for r in results if r["suite"] == "models"]
    sdpa = {(r["part"], r["L"]): r for r in rows if r["impl"] == "sdpa" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["part"], str(r["L"]), r["impl"], r["status"], r.get("note", ""), "", "")
            continue
        b = sdpa.get((r["part"], r["L"]))
        table.add_row(r["part"], str(r["L"]), r["impl"], f"{r['time_s']:.2f}",
                      f"{r['time_s'] / b['time_s']:.2f}x" if b else "-", f"{r['peak_bytes'] / 2**20:.0f}",
                      f"{r['peak_bytes'] / b['peak_bytes']:.2f}x" if b and b["peak_bytes"] > 0 else "-")
    return table


def main(args: argparse.Namespace) -> int:
    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: wide rows, not wrapped cells
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
    mimpls = [i for i in _models.IMPLS if not args.impls or i in args.impls]
    mlengths = args.lengths or ([1024] if args.quick else [8192, 16384])
    mcases = args.cases or ["train", "generate"]  # the models suite's halves
    mpoints = _models.points(mlengths, mimpls) if "models" in suites and "train" in mcases else []
    gpoints = ((_models.GENERATE_POINTS[:1] if args.quick else _models.GENERATE_POINTS)
               if "models" in suites and "generate" in mcases else [])
    total = (len(points) + len(dpoints) + len(mpoints) + len(gpoints) + (2 if "overhead" in suites else 0)
             + (len(DECODE_BATCHES) if "decode" in suites else 0)
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
        for p in mpoints:
            progress.update(task, description=f"models ({p['part']}) {p['impl']} L={p['L']}")
            results.append({**p, **_models.measure(p, args.repeats or 1)})
            progress.advance(task)
        for cache, mode, b in gpoints:
            progress.update(task, description=f"models (generate) {mode}, {cache} cache, B={b}")
            results += _models.measure_generate((cache, mode, b), args.repeats or 5)
            progress.advance(task)

    tables = [
        *_ratio_tables(results, "modules", ("B", "L", "E", "H", "mode"), "torch",
                       "MultiHeadAttention vs nn.MultiheadAttention and the tutorial's (x = ratio to torch, "
                       "per repeat: median (min-max))"),
        *_ratio_tables(results, "overhead", ("case", "L", "mode"), "sdpa",
                       "attention(auto) vs raw scaled_dot_product_attention, (1, 8, 4096, 64)"),
        *_ratio_tables(results, "decode", ("case", "B", "mode"), "sdpa",
                       "KV-cache decode step vs SDPA on the cached tensors (x = ratio to SDPA)"),
        *_mask_tables(results),
        *_ratio_tables(results, "models-generate", ("case", "mode", "B"), "sdpa",
                       f"Greedy generation, {_models.PROMPT}-token prompt, {_models.NEW_TOKENS} new tokens: time per "
                       "token (x = ratio to sdpa, per repeat: median (min-max))"),
    ]
    if dpoints:
        tables.append(_distributed_table(results))
    if mpoints:
        tables.append(_models_table(results))
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

"""``selfattn bench --suite masks``: masked attention from 1k to 64k tokens: selfattn (auto, chunked)
vs raw SDPA (with the dense mask where a mask is needed), SDPA is_causal (over the whole batch, and
for padded batches over each item's real tokens only), the tutorial's textbook math and compiled
FlexAttention (CPU: forward only, as it has no CPU backward). The varlen case packs documents of
mixed lengths in one row: selfattn.varlen_attention beside attention with the document mask it
equals and SDPA is_causal on the documents padded to the longest.

Each (case, mode, L) point runs in a worker process of its own that times every implementation in
turns (:func:`~selfattn.bench.worker.time_group`); each implementation's peak memory is then
measured alone in a further worker, so it is its own.

Shape legend: B batch, L length, H heads, D head dim.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress, TaskID
from rich.table import Table

from .ratios import MASK_ANCHORS, attach_ratios, format_ratio
from .spawn import json_worker
from .worker import MASK_CASES, VARLEN, VARLEN_IMPLS, case_batch

__all__ = ["IN_ALL", "NAME", "grid", "plots", "run", "tables"]

NAME = "masks"
IN_ALL = True
MASK_IMPLS = ["selfattn", "chunked", "sdpa", "sdpa-causal", "sdpa-causal-valid", *VARLEN_IMPLS, "textbook", "flex"]
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK_LENGTHS = [2048]
QUICK_CASES = ["causal", "padding(3L/4,L)+causal", "sliding_window(256)", "document(8 docs)"]
QUICK_IMPLS = ["selfattn", "chunked", "sdpa", "sdpa-causal", "sdpa-causal-valid"]
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


def grid(args: argparse.Namespace) -> list[dict]:
    device = args.device
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
                    if impl in VARLEN_IMPLS and case != VARLEN:
                        continue  # the varlen case's own anchors: the document mask, SDPA on padded documents
                    p = dict(suite="masks", case=case, mode=mode, L=length, impl=impl, H=H, D=D)
                    if impl == "flex" and mode == "fwd+bwd" and not device.startswith("cuda"):
                        p["skip"] = "FlexAttention has no CPU backward"
                    points.append(p)
    return points


def run(todo: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """Measure the masks suite's points: per (case, mode, L), one worker times every implementation
    interleaved, then one worker per implementation measures its peak memory alone."""
    limit = (args.memory_limit_gb * 2**30 if args.memory_limit_gb
             else 0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    repeats = args.repeats or 50  # at most; each point stops after its time budget
    seconds = 2.0 if args.quick else 10.0  # per implementation and point
    groups: dict[tuple, list[dict]] = {}
    for p in todo:
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
        timed = run_worker({**group[0], "impls": impls}) if impls else {}
        for p in group:
            impl = p["impl"]
            got = timed if "error" in timed else timed.get(impl, {"error": "no result"})  # the worker's, or its own
            if impl in skipped:
                res = {"status": "skipped", "note": skipped[impl]}
            elif "error" in got:
                res = {"status": "error", "note": got["error"]}
            else:
                progress.update(task, description=f"masks {case} {impl} {mode} L={length}: peak memory")
                mem = run_worker(p)
                res = ({"status": "error", "note": f"memory: {mem['error']}"} if "error" in mem
                       else {"status": "ok", **timed[impl], "peak_bytes": mem["peak_bytes"]})
            results.append({**p, **res})
            progress.advance(task)
    attach_ratios(results, "masks", ("case", "mode", "L"), MASK_ANCHORS)
    return results


def run_worker(spec: dict) -> dict:
    """Run ``selfattn.bench.worker`` on ``spec`` in a fresh process; its JSON, or {"error": why}."""
    return json_worker("selfattn.bench.worker", spec)


def _anchor_label(impl: str, case: str) -> str:
    """What an anchor implementation is, in a given masks case."""
    if impl == "sdpa":
        return {"causal": "is_causal", "dense": "SDPA"}.get(case, "SDPA dense")
    return {"sdpa-causal": "is_causal", "sdpa-causal-valid": "is_causal real", "flex": "flex",
            "document": "document mask", "sdpa-padded": "SDPA padded"}.get(impl, impl)


def tables(results: list[dict]) -> list[Table]:
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


def plots(results: list[dict], folder: Path) -> list[Path]:
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
        handles: dict[str, Any] = {}
        for ax in axes[0]:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        fig.legend(list(handles.values()), list(handles.keys()), fontsize=8, loc="center left",
                   bbox_to_anchor=(1.0, 0.5))
        path = folder / ("time.png" if metric == "time_s" else "memory.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths

"""``selfattn bench --suite distributed``: context-parallel attention at a fixed total length.

For W = 1, 2, 4 processes (gloo on 127.0.0.1, one CPU thread each) every rank runs
``selfattn.distributed.attention`` forward and backward on its L / W tokens, and reports its
time, its peak extra memory during the step, and how much of its communication was hidden
behind compute: ``hidden = 1 - exposed / alone``, where ``exposed`` is the time the step spent
waiting for transfers and ``alone`` the time the same transfers take with no compute (all_to_all
does not overlap, so its share is 0 by construction and ``alone`` is what it costs). The ranks run with
glibc's mmap threshold fixed (:data:`~selfattn.bench.memory.MALLOC_ENV`): the peak is the tensors'.

With ``--cases model`` (and ``model-budget``) the suite also trains a transformers Llama
context-parallel: :mod:`selfattn.bench.context_models`.

Shape legend: B batch, H heads, L total length, W world size, D head dim.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from rich.progress import Progress, TaskID
from rich.table import Table

from . import context_models
from .memory import MALLOC_ENV, Memory
from .spawn import run_ranks

__all__ = ["CASES", "IN_ALL", "NAME", "grid", "points", "run", "run_point", "tables"]

NAME = "distributed"
IN_ALL = False

CASES = ["causal", "documents(8)+causal"]
WORLDS = [1, 2, 4]
H, D = 8, 64


def _case(name: str, length: int) -> dict:
    from .. import masks

    if name == "causal":
        return dict(causal=True)
    ids = torch.arange(length).div(length // 8, rounding_mode="floor")
    return dict(mask=masks.document(ids) & masks.causal())


def _alone(strategy: str, q: torch.Tensor, world: int, timeout: datetime.timedelta) -> float:
    """Seconds the step's transfers take with nothing to overlap them."""
    rank = dist.get_rank()
    if world == 1:
        return 0.0
    t0 = time.perf_counter()
    if strategy == "all_to_all":
        for _ in range(6):  # q, k, v and out in the forward; dout and dq, dk, dv swaps back in the backward
            buf = q.reshape(world, -1).contiguous()
            dist.all_to_all_single(torch.empty_like(buf), buf, async_op=True).wait(timeout)
        return time.perf_counter() - t0
    kv = torch.cat([q.reshape(-1), q.reshape(-1)])
    for size, hops in ((kv, 2 * (world - 1)), (kv, world)):  # K/V forward and backward; dK/dV back to owners
        for _ in range(hops):
            ops = [dist.P2POp(dist.isend, size, (rank + 1) % world),
                   dist.P2POp(dist.irecv, torch.empty_like(size), (rank - 1) % world)]
            for w in dist.batch_isend_irecv(ops):
                w.wait(timeout)
    return time.perf_counter() - t0


def _measure(rank: int, world: int, spec: dict) -> dict:
    """One rank's median step time, its time waiting for transfers, the transfers' time alone, its peak."""
    from .. import distributed as sad

    timeout = datetime.timedelta(seconds=600)
    length, layout, strategy = spec["L"], spec["layout"], spec["strategy"]
    torch.manual_seed(0)
    n = length // world
    q, k, v = (torch.randn(1, H, n, D, requires_grad=True) for _ in range(3))
    kw = _case(spec["case"], length)

    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        out = sad.attention(q, k, v, layout=layout, strategy=strategy, timeout=600, **kw)
        assert isinstance(out, torch.Tensor)
        out.sum().backward()

    step()  # warm-up
    mem = Memory("cpu")
    dist.barrier()
    mem.start()
    times, waits = [], []
    for _ in range(spec["repeats"]):
        dist.barrier()
        with sad.record() as stats:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        waits.append(stats.wait_s)
    peak = mem.stop()
    dist.barrier()
    alone = _alone(strategy, q.detach(), world, timeout)
    return dict(time_s=sorted(times)[len(times) // 2], wait_s=min(waits), alone_s=alone, peak_bytes=peak)


def run_point(spec: dict) -> dict:
    """Run one point (case, L, W, layout, strategy, repeats) on W spawned processes; the slowest rank's
    time, the largest peak memory and the hidden share of communication."""
    ranks = run_ranks(_measure, spec, spec["W"], spec.get("limit_s", 1800), env=MALLOC_ENV)
    if isinstance(ranks, str):
        return {"status": "error", "note": ranks}
    alone = max(r["alone_s"] for r in ranks)
    wait = max(r["wait_s"] for r in ranks)
    hidden = None if alone == 0 or spec["strategy"] == "all_to_all" else max(0.0, min(1.0, 1 - wait / alone))
    return {"status": "ok", "time_s": max(r["time_s"] for r in ranks), "wait_s": wait, "comm_alone_s": alone,
            "peak_bytes": max(r["peak_bytes"] for r in ranks), "hidden": hidden}


def points(lengths: list[int] | None, quick: bool, repeats: int | None) -> list[dict]:
    """The grid: every case at each total length, W = 1, 2, 4, zigzag, ring and all_to_all."""
    out = []
    for length in lengths or ([4096] if quick else [8192]):
        for case in CASES:
            for strategy in ("ring", "all_to_all"):
                for world in WORLDS:
                    out.append(dict(suite="distributed", case=case, L=length, W=world, layout="zigzag",
                                    strategy=strategy, H=H, D=D, mode="fwd+bwd", repeats=repeats or 2))
    return out


MODEL_CASES = ["model", "model-budget"]


def grid(args: argparse.Namespace) -> list[dict]:
    """The kernel points of the mask cases asked for (default: all); with ``--cases model`` or
    ``model-budget``, the transformers model's points (:mod:`selfattn.bench.context_models`)."""
    cases = args.cases or CASES
    unknown = set(cases) - set(CASES) - set(MODEL_CASES)
    if unknown:
        raise SystemExit(f"distributed: unknown cases {sorted(unknown)}; known: {CASES + MODEL_CASES}")
    todo = [p for p in points(args.lengths, args.quick, args.repeats) if p["case"] in cases]
    if set(cases) & set(MODEL_CASES):
        context_models.check_lengths(args.lengths)
    if "model" in cases:
        todo += context_models.points(args.lengths, args.quick, args.repeats)
    if "model-budget" in cases:
        todo += context_models.budget_points(args.lengths, args.quick, args.repeats)
    return todo


def run(todo: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """:func:`run_point` on every point, each on its own spawned processes."""
    out = []
    for p in todo:
        if p["suite"] == context_models.NAME:
            progress.update(task, description=f"distributed Llama {p['part']} W={p['W']} L={p['L']}")
            out.append({**p, **context_models.run_point(p)})
        else:
            progress.update(task, description=f"distributed {p['case']} {p['strategy']} W={p['W']} L={p['L']}")
            out.append({**p, **run_point(p)})
        progress.advance(task)
    return out


def tables(results: list[dict]) -> list[Table]:
    """One row per point: time and peak memory per rank, each also as a ratio to W = 1."""
    table = Table(title="context parallelism (zigzag, fwd+bwd, per rank; x = ratio to W=1; hidden = share of "
                        "communication overlapped by compute)")
    for col in ("case", "L", "strategy", "W", "time s", "x", "peak MiB", "x", "comm alone s", "hidden"):
        table.add_column(col)
    rows = [r for r in results if r["suite"] == "distributed"]
    if not rows:
        return context_models.tables(results)
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
    return [table, *context_models.tables(results)]


if __name__ == "__main__":
    print(json.dumps(run_point(json.loads(sys.argv[1]))))

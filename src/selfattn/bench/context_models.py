"""The model points of ``selfattn bench --suite distributed`` (``--cases model model-budget``): a
transformers Llama trained with its packed row split over W = 1, 2, 4 processes by
:func:`selfattn.integrations.transformers.context_parallel`.

The model is the ``models`` suite's (hidden 512, 8 query heads, 2 key/value heads, 4 layers, vocabulary
1024, float32, random weights); one row of L tokens packs 8 uneven documents (``position_ids`` restart at
each). Every rank runs on gloo over 127.0.0.1 with one CPU thread. Two parts, each measured per rank:

- ``model``: the whole training step (``cp.shard`` of the global row, forward, the global loss, backward,
  the gradients summed over the ranks);
- ``attention``: one layer's attention alone, as the model runs it under the context: forward + backward of
  ``selfattn.distributed.attention`` on this rank's (1, 8, L / W, 64) queries and (1, 2, L / W, 64)
  keys/values with the row's document & causal mask (zigzag layout, ring), with each ``memory`` option
  (``"overlap"``, the default, and ``"low"``).

W = 1 is the model in one process without the context (the anchor): the ratios are against it (for the
attention part, against W = 1 with the default memory option). Each row reports the slowest rank's median
time and the largest rank's peak extra memory (resident growth during the step, the warm-up step included;
the ranks run with glibc's mmap threshold fixed, :data:`~selfattn.bench.memory.MALLOC_ENV`, so that it is
the tensors' peak). ``model-budget`` keeps the tokens per rank fixed (L = W x the given length) to show
how the longest row that fits a per-rank memory budget grows with W. On a machine with
fewer cores than W the ranks share cores, so times at W = 4 measure that sharing as well; the memory per
rank does not depend on it.

Shape legend: L tokens in the row, W processes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from rich.table import Table

from .llama import HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB
from .memory import MALLOC_ENV, Memory
from .models import DOCS, _document_lengths, model_step
from .spawn import run_ranks

__all__ = ["NAME", "PARTS", "WORLDS", "budget_points", "points", "run_point", "tables"]

NAME = "distributed-model"  # the rows' suite field

PARTS = ["attention", "model"]
WORLDS = [1, 2, 4]
MEMORY = ["overlap", "low"]  # the attention part's memory options
_PRIMER = 256  # tokens per rank of the step each rank runs before its measured one


def _row(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (1, L), position_ids (1, L)) of the packed row, as the models suite draws it."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (1, length), generator=g)
    pos = torch.cat([torch.arange(n) for n in _document_lengths(length, DOCS, seed)]).unsqueeze(0)
    return ids, pos


def _model_step(length: int, world: int):
    """One training step of this rank's part of the row (W = 1: the plain model, no context)."""
    from ..integrations.transformers import context_parallel

    step, model = model_step("selfattn", length)  # the same weights on every rank (seeded)
    if world == 1:
        return step
    ids, pos = _row(length)

    def cp_step() -> None:
        model.zero_grad(set_to_none=True)
        with context_parallel(model, layout="zigzag", strategy="ring", timeout=600) as cp:
            model(**cp.shard(input_ids=ids, position_ids=pos, labels=ids)).loss.backward()
    return cp_step


def _attention_step(length: int, world: int, memory: str = "overlap"):
    """Forward + backward of one layer's attention on this rank's shard, with the row's global mask."""
    from .. import distributed as sad
    from .. import masks

    _, pos = _row(length)
    documents = (pos == 0).cumsum(-1) - 1  # (1, L) document ids from the restarting positions
    mask = masks.document(documents) & masks.causal()
    n, d = length // world, HIDDEN // HEADS
    g = torch.Generator().manual_seed(2 + dist.get_rank())
    q = torch.randn(1, HEADS, n, d, generator=g, requires_grad=True)
    k = torch.randn(1, KV_HEADS, n, d, generator=g, requires_grad=True)
    v = torch.randn(1, KV_HEADS, n, d, generator=g, requires_grad=True)

    def step() -> None:
        out = sad.attention(q, k, v, layout="zigzag", strategy="ring", mask=mask, timeout=600,
                            memory=memory)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor)
        out.sum().backward()
        q.grad = k.grad = v.grad = None
    return step


def _measure(rank: int, world: int, spec: dict) -> dict:
    """One rank's median step time and peak extra memory (the warm-up step included in the peak). The same
    step on a row of ``_PRIMER`` tokens runs first, outside the peak: what a process allocates once, whatever
    the length (libraries' and kernels' lazy set-up, the process group's first transfers), is not the step's."""
    length, memory = spec["L"], spec.get("memory", "overlap")
    for size in (_PRIMER * world, length):
        step = _model_step(size, world) if spec["part"] == "model" else _attention_step(size, world, memory)
        if size != length:
            step()
    mem = Memory("cpu")
    dist.barrier()
    mem.start()
    t0 = time.perf_counter()
    step()  # warm-up, inside the peak: the first step allocates what the later ones reuse
    first = time.perf_counter() - t0
    times = []
    for _ in range(spec["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = mem.stop()
    median = sorted(times)[len(times) // 2] if times else first
    return dict(time_s=median, first_s=first, peak_bytes=peak)


def run_point(spec: dict) -> dict:
    """One (part, L, W) point on W spawned processes: the slowest rank's time, the largest peak."""
    ranks = run_ranks(_measure, spec, spec["W"], spec.get("limit_s", 3600), timeout_s=1800, env=MALLOC_ENV)
    if isinstance(ranks, str):
        return {"status": "error", "note": ranks}
    return {"status": "ok", "time_s": max(r["time_s"] for r in ranks), "first_s": max(r["first_s"] for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks)}


def points(lengths: list[int] | None, quick: bool, repeats: int | None) -> list[dict]:
    """Both parts at each length, W = 1, 2, 4 (L divisible by 2W: the zigzag layout); the attention part with
    each memory option."""
    return [dict(suite=NAME, part=part, L=length, W=world, repeats=repeats if repeats is not None else 1,
                 **({"memory": memory} if part == "attention" else {}))
            for length in lengths or ([2048] if quick else [16384]) for part in PARTS
            for memory in (MEMORY if part == "attention" else [None]) for world in WORLDS]


def budget_points(lengths: list[int] | None, quick: bool, repeats: int | None) -> list[dict]:
    """The whole step with a fixed number of tokens per rank: L = W x each length, W = 1, 2, 4."""
    return [dict(suite=NAME, part="model", L=length * world, W=world, per_rank=length,
                 repeats=repeats if repeats is not None else 0)
            for length in lengths or ([1024] if quick else [16384]) for world in WORLDS]


def check_lengths(lengths: list[int] | None) -> None:
    for length in lengths or []:
        if length % (2 * max(WORLDS)):
            raise SystemExit(f"distributed model points: L={length} must be divisible by {2 * max(WORLDS)} "
                             "(the zigzag layout on W = 4)")


def tables(results: list[dict]) -> list[Table]:
    """Per rank, as ratios to W = 1: one row per (part, L, W); with the budget points, a second table of the
    peak at a fixed number of tokens per rank."""
    rows = [r for r in results if r["suite"] == NAME]
    out = []
    fixed = [r for r in rows if "per_rank" not in r]
    if fixed:
        table = Table(title=f"Llama {LAYERS} layers, hidden {HIDDEN}, packed row, context parallel (zigzag ring), "
                            "per rank; x = ratio to W=1 (one process, no context)")
        for col in ("part", "L", "W", "time s", "x", "peak MiB", "x", "<= 1.2/W"):
            table.add_column(col)
        base = {(r["part"], r["L"]): r for r in fixed if r["W"] == 1 and r["status"] == "ok"
                and r.get("memory", "overlap") == "overlap"}  # one anchor: W = 1 moves no dK/dV either way
        for r in fixed:
            part = r["part"] + (f" (memory={r['memory']})" if "memory" in r else "")
            if r["status"] != "ok":
                table.add_row(part, str(r["L"]), str(r["W"]), r["status"], "", r.get("note", ""), "", "")
                continue
            b = base.get((r["part"], r["L"]))
            ratio = r["peak_bytes"] / b["peak_bytes"] if b and b["peak_bytes"] >= 2**20 else None
            table.add_row(part, str(r["L"]), str(r["W"]), f"{r['time_s']:.2f}",
                          f"{r['time_s'] / b['time_s']:.2f}" if b else "", f"{max(0, r['peak_bytes']) / 2**20:.0f}",
                          "-" if ratio is None else f"{ratio:.2f}",
                          "-" if ratio is None else ("yes" if ratio <= 1.2 / r["W"] else "no"))
        out.append(table)
    budget = [r for r in rows if "per_rank" in r]
    if budget:
        table = Table(title="the whole step with L / W tokens per rank fixed: peak per rank; x = ratio to W=1")
        for col in ("tokens per rank", "W", "L", "time s", "peak MiB", "x"):
            table.add_column(col)
        base = {r["per_rank"]: r for r in budget if r["W"] == 1 and r["status"] == "ok"}
        for r in budget:
            if r["status"] != "ok":
                table.add_row(str(r["per_rank"]), str(r["W"]), str(r["L"]), r["status"], r.get("note", ""), "")
                continue
            b = base.get(r["per_rank"])
            table.add_row(str(r["per_rank"]), str(r["W"]), str(r["L"]), f"{r['time_s']:.2f}",
                          f"{max(0, r['peak_bytes']) / 2**20:.0f}",
                          f"{r['peak_bytes'] / b['peak_bytes']:.2f}" if b and b["peak_bytes"] > 0 else "-")
        out.append(table)
    return out

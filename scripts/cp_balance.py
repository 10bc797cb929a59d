"""How evenly each layout shares a packed row's attention work across the ranks of context parallelism.

Counted pairs (simulated, no processes): rows of documents with lengths drawn log-uniform in [32, 8192],
packed to L tokens; the query-key pairs the causal document mask leaves (and a 1024-token sliding window), per
rank, for the contiguous, zigzag and balanced layouts at W = 2, 4, 8; max / mean over the ranks, the worst of the
seeds. Measured (``--time``): the ring's forward and backward on W = 2 gloo processes, one thread each, for each
layout on one such row: the slowest rank's compute seconds (``sad.record``) and the step's wall time.

    python scripts/cp_balance.py [--length 65536] [--seeds 5] [--time --time-length 16384]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from selfattn import distributed as sad
from selfattn import masks
from selfattn.bench.spawn import run_ranks
from selfattn.distributed.layout import _loads

LAYOUTS = ("contiguous", "zigzag", "balanced")


def packed_row(length: int, seed: int, lo: int = 32, hi: int = 8192) -> torch.Tensor:
    """(L,) document ids: lengths log-uniform in [lo, hi], the last one cut to fit."""
    g, lens = torch.Generator().manual_seed(seed), []
    while sum(lens) < length:
        lens.append(int(math.exp(math.log(lo) + torch.rand(1, generator=g).item() * math.log(hi / lo))))
    lens[-1] -= sum(lens) - length
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def layout_of(name: str, ids: torch.Tensor, world: int, window: int | None) -> sad.Sharding:
    if name == "balanced":
        return sad.balanced(world, document_ids=ids, window=window)
    return sad.Sharding.of(name, ids.numel(), world)


def simulate(length: int, seeds: int) -> list[dict]:
    rows = []
    for window in (None, 1024):
        for world in (2, 4, 8):
            worst = {name: 0.0 for name in LAYOUTS}
            for seed in range(seeds):
                ids = packed_row(length, seed)
                work = sad.pair_work(ids, True, window).double()
                for name in LAYOUTS:
                    loads = _loads(work, layout_of(name, ids, world, window))
                    worst[name] = max(worst[name], float(loads.max() / loads.mean()))
            rows.append({"window": window, "world": world, **worst})
    return rows


def _timed(rank: int, world: int, spec: dict) -> dict:
    """One rank: the ring's forward and backward on one packed row, for each layout."""
    ids = packed_row(spec["length"], spec["seed"])
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, ids.numel(), 64) for _ in range(3))
    out = {}
    for name in LAYOUTS:
        lay = layout_of(name, ids, world, None)
        ql, kl, vl = (sad.shard(t, layout=lay).requires_grad_() for t in (q, k, v))
        best = None
        for _ in range(spec["repeats"]):
            with sad.record() as stats:
                t0 = time.perf_counter()
                sad.attention(ql, kl, vl, layout=lay, mask=masks.document(ids[None]) & masks.causal()).sum().backward()
                wall = time.perf_counter() - t0
            if best is None or wall < best["wall_s"]:
                best = {"wall_s": wall, "compute_s": stats.compute_s}
        out[name] = best
    return out


def timed(length: int, repeats: int, seed: int) -> dict:
    ran = run_ranks(_timed, {"length": length, "repeats": repeats, "seed": seed}, 2, 3600)
    if isinstance(ran, str):
        raise RuntimeError(ran)
    return {name: {"compute_s": [r[name]["compute_s"] for r in ran], "wall_s": max(r[name]["wall_s"] for r in ran)}
            for name in LAYOUTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--time", action="store_true", help="also time the ring on 2 processes")
    ap.add_argument("--time-length", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--time-seed", type=int, default=2, help="the row timed (seed 2: zigzag's worst at 32k)")
    args = ap.parse_args()
    rows = simulate(args.length, args.seeds)
    print(f"counted pairs, L = {args.length}, {args.seeds} rows of log-uniform 32-8k documents; max / mean per rank "
          "(the worst row)")
    print("| window | W | contiguous | zigzag | balanced |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['window'] or 'none'} | {r['world']} | {r['contiguous']:.3f} | {r['zigzag']:.3f} | "
              f"{r['balanced']:.3f} |")
    if args.time:
        res = timed(args.time_length, args.repeats, args.time_seed)
        ids = packed_row(args.time_length, args.time_seed)
        work = sad.pair_work(ids).double()
        print(f"\nring forward + backward, W = 2, L = {args.time_length} (row {args.time_seed}), B = 1, H = 4, D = 64, "
              "float32, one thread per rank (best of the repeats)")
        print("| layout | counted pairs max / mean | compute s, rank 0 / rank 1 | max / mean | step s |")
        print("|---|---|---|---|---|")
        for name, r in res.items():
            c, loads = r["compute_s"], _loads(work, layout_of(name, ids, 2, None))
            print(f"| {name} | {float(loads.max() / loads.mean()):.3f} | {c[0]:.2f} / {c[1]:.2f} | "
                  f"{max(c) / (sum(c) / len(c)):.3f} | {r['wall_s']:.2f} |")
        print(json.dumps(res))


if __name__ == "__main__":
    main()

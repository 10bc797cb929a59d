"""``selfattn bench --suite learned``: attention with a learned term, forward and backward, the term's
gradient included: a T5-style bucket table closed over by a score modifier, and a dense pair bias
(1, H, L, L) that requires grad (as AlphaFold's), from 4k to 16k tokens.

Implementations, on the same inputs: selfattn's chunked backend (the term applied tile by tile, its
gradient summed tile by tile); SDPA with the term as a dense float bias (the table gathered into a
(1, H, L, L) bias, differentiable back to the table); and selfattn's reference backend (the textbook
math). Each point's implementations are timed in turns in one fresh process; each one's peak memory
is then measured alone in another, over its first step, gradients included
(``python -m selfattn.bench.learned '<json spec>'``). The inputs and the term (the pair bias itself)
are made before the measurement, so they are not counted; the bias's gradient is.

Shape legend: B batch (1), H heads, L length, D head dim, NB buckets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.progress import Progress, TaskID
from rich.table import Table

from .memory import Memory
from .ratios import attach_ratios, format_ratio
from .report import measured
from .spawn import json_worker
from .timing import time_interleaved

__all__ = ["IN_ALL", "NAME", "grid", "run", "tables"]

NAME = "learned"
IN_ALL = False  # minutes per point at 16k tokens
H, D, NB = 4, 32, 32
CASES = ["t5 buckets", "pair bias"]
IMPLS = ["chunked", "sdpa", "reference"]
LENGTHS = [4096, 16384]


def grid(args: argparse.Namespace) -> list[dict]:
    """(case, L) points: ``--cases`` (default both) and ``--lengths`` (default 4k and 16k; 1k with ``--quick``)."""
    lengths = getattr(args, "lengths", None) or ([1024] if args.quick else LENGTHS)
    cases = [c for c in (getattr(args, "cases", None) or CASES) if c in CASES] or CASES
    return [dict(case=c, L=length) for c in cases for length in lengths]


def _bucket(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return (j - i).clamp(-(NB // 2 - 1), NB // 2 - 1) + NB // 2


def _estimate_bytes(impl: str, case: str, length: int) -> int:
    """A rough peak: the (H, L, L) float32 tensors an implementation holds at once."""
    square = H * length * length * 4
    copies = {"chunked": 2 if case == "pair bias" else 0, "sdpa": 4, "reference": 6}[impl]
    return copies * square + 64 * length * H * D * 4


def _steps(case: str, length: int, impls: list[str]) -> dict[str, Callable[[], tuple[torch.Tensor, ...]]]:
    """One fwd+bwd per implementation, on the same q, k, v and term, each reaching the term's gradient:
    each returns (out, dq, dk, dv, the term's gradient)."""
    import selfattn
    from selfattn import scores

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, length, D, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(1, H, length, D, generator=gen)
    table = (torch.randn(NB, H, generator=gen) * 0.1).requires_grad_()
    pair = (torch.randn(1, H, length, length, generator=gen) * 0.1).requires_grad_() if case == "pair bias" else None
    i = torch.arange(length)

    def term() -> dict:
        """selfattn's arguments for the term."""
        if pair is not None:
            return dict(bias=pair)
        return dict(score_mod=scores.custom(lambda s, b, h, qi, kj: s + table[_bucket(qi, kj), h], additive=True))

    def dense() -> torch.Tensor:
        """The (1, H, L, L) bias the term stands for, differentiable back to it (SDPA's only form of it)."""
        if pair is not None:
            return pair
        return table[_bucket(i[:, None], i[None, :])].permute(2, 0, 1)[None]

    def step(impl: str) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            for t in (q, k, v, table, pair):
                if t is not None:
                    t.grad = None
            if impl == "sdpa":  # the dense bias is built in the step: it is part of what SDPA costs
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense())
            else:
                out = selfattn.attention(q, k, v, backend=impl, **term())
            out.backward(dout)
            grads = (out, q.grad, k.grad, v.grad, (pair if pair is not None else table).grad)
            assert all(g is not None for g in grads), f"{impl}: a gradient is missing"
            return grads  # type: ignore[return-value]
        return run

    return {impl: step(impl) for impl in impls}


def worker(spec: dict) -> dict:
    """In a fresh process: time ``spec["impls"]`` interleaved, or measure ``spec["impl"]``'s peak alone."""
    if "impls" in spec:
        steps = _steps(spec["case"], spec["L"], spec["impls"])
        timings = time_interleaved(steps, spec["repeats"], "cpu", warmup=1)
        return {name: measured(t) for name, t in timings.items()}
    step = _steps(spec["case"], spec["L"], [spec["impl"]])[spec["impl"]]
    mem = Memory("cpu")  # the first step: a warm-up would leave its freed gradients for the next to reuse
    mem.start()
    step()
    return {"peak_bytes": mem.stop()}


def _spawn(spec: dict) -> dict:
    return json_worker("selfattn.bench.learned", spec)


def run(todo: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    if args.device != "cpu":
        raise SystemExit("the learned suite runs on the CPU only")
    limit = 0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out = []
    for p in todo:
        case, length = p["case"], p["L"]
        base = dict(suite=NAME, case=case, L=length, mode="fwd+bwd")
        fits = [i for i in IMPLS if _estimate_bytes(i, case, length) <= limit]
        progress.update(task, description=f"learned {case} L={length}: timing {', '.join(fits)}")
        timed = _spawn(dict(case=case, L=length, impls=fits, repeats=args.repeats or (3 if length > 4096 else 5)))
        for impl in IMPLS:
            if impl not in fits:
                need = _estimate_bytes(impl, case, length)
                out.append({**base, "impl": impl, "status": "skipped", "note": f"needs ~{need / 2**30:.0f} GiB"})
                continue
            got = timed if "error" in timed else timed.get(impl, {"error": "no result"})
            if "error" in got:
                out.append({**base, "impl": impl, "status": "error", "note": got["error"]})
                continue
            progress.update(task, description=f"learned {case} {impl} L={length}: peak memory")
            mem = _spawn(dict(case=case, L=length, impl=impl))
            out.append({**base, "impl": impl, "status": "ok", **got, "peak_bytes": mem.get("peak_bytes")})
        progress.advance(task)
    attach_ratios([r for r in out if r["status"] == "ok"], NAME, ("case", "L"), ["sdpa", "reference"])
    return out


def tables(results: list[dict]) -> list[Table]:
    rows = [r for r in results if r["suite"] == NAME]
    if not rows:
        return []
    table = Table(title=f"learned terms, fwd+bwd with the term's gradient (B=1, H={H}, D={D}; x = time / anchor's "
                        "time in one interleaved run, median (min-max); MiB = peak extra memory, measured alone)")
    for col in ("case", "L", "impl", "time", "x sdpa (dense bias)", "x reference", "MiB"):
        table.add_column(col, justify="right" if col not in ("case", "impl") else "left", no_wrap=True)
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["case"], str(r["L"]), r["impl"], f"[dim]{r['status']}: {r.get('note', '')}[/dim]",
                          "", "", "")
            continue
        ratios = r.get("ratios", {})
        peak = r.get("peak_bytes")
        table.add_row(r["case"], str(r["L"]), r["impl"], f"{r['time_s'] * 1e3:.0f} ms",
                      format_ratio(ratios.get("sdpa")) or "-", format_ratio(ratios.get("reference")) or "-",
                      "?" if peak is None else f"{peak / 2**20:.0f}")
    return [table]


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))

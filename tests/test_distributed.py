"""Context-parallel attention (selfattn.distributed) against single-process selfattn.attention.

Each test spawns W processes with torch.multiprocessing (gloo on 127.0.0.1) that run many cases in
one go and write their measurements to JSON; the test then judges them. Every spawn has a hard
timeout, and every collective inside has its own, so nothing can hang.

Shape legend: B batch, H query heads, Hkv key/value heads, L global length, W world size,
D head dim, Dv value head dim.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import selfattn
from selfattn import distributed as sad
from selfattn import masks, scores, testing
from selfattn.backends import chunked
from selfattn.bench.spawn import free_port, spawn_and_join

F64_EXACT = 1e-12  # float64: distributed and single-process agree to this, relative to max(1, |ref|)
LSE_F32 = 4 * torch.finfo(torch.float32).eps  # lse is returned in float32 by both



def _entry(rank: int, fn_name: str, world: int, port: int, outdir: str, backend: str) -> None:
    """Runs in each spawned process: join the group, run ``fn_name``, write its result (or the error)."""
    code = 1
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        result = globals()[fn_name](rank, world)
        Path(outdir, f"{rank}.json").write_text(json.dumps(result))
        code = 0
    except BaseException:
        Path(outdir, f"{rank}.err").write_text(traceback.format_exc())
    finally:
        os._exit(code)  # no teardown: a group left broken by a failure test must not hang the exit


def _spawn(fn_name: str, world: int, tmp_path: Path, limit: float = 120.0, backend: str = "gloo") -> list[dict]:
    """Run ``fn_name(rank, world)`` on ``world`` processes; their results, by rank. Fails past ``limit`` s."""
    outdir = tmp_path / f"{fn_name}-{world}"
    outdir.mkdir()
    done = spawn_and_join(_entry, (fn_name, world, free_port(), str(outdir), backend), world, limit)
    errors = {r: (outdir / f"{r}.err").read_text() for r in range(world) if (outdir / f"{r}.err").exists()}
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    assert done, f"{fn_name} on {world} ranks: a process died without a result, or ran past {limit} s"
    return [json.loads((outdir / f"{r}.json").read_text()) for r in range(world)]


# ----------------------------------------------------------------------------- cases (run in the workers)


def _cases(batch: int, heads: int, length: int) -> dict[str, dict]:
    """Every kind of mask and score modifier, on global positions (the same on every rank)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.sort(torch.randint(0, 4, (batch, length), generator=gen), dim=1).values
    lengths = torch.tensor([length - 5, length // 3][:batch])
    dense = torch.rand(batch, heads, length, length, generator=gen) < 0.6
    return {
        "none": {},
        "causal": dict(causal=True),
        "window": dict(mask=masks.sliding_window(7, 3)),
        "documents": dict(mask=masks.document(ids) & masks.causal()),
        "padding": dict(mask=masks.padding(lengths, queries=True)),
        "composed": dict(mask=(masks.document(ids) & masks.causal()) | ~masks.sliding_window(30, 30)),
        "from_tensor": dict(mask=masks.from_tensor(dense)),
        "alibi": dict(causal=True, score_mod=scores.alibi(scores.alibi_slopes(heads))),
        "softcap": dict(mask=masks.document(ids), score_mod=scores.softcap(2.0), scale=1.0),
        "custom": dict(score_mod=lambda s, b, h, i, j: s + 0.2 * torch.sin(0.3 * i - 0.7 * j + h)),
    }


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item() / max(1.0, ref.double().abs().max().item())


def _lse_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.equal(torch.isneginf(a), torch.isneginf(ref)):
        return math.inf
    fin = torch.isfinite(ref)
    return _rel(a[fin], ref[fin]) if bool(fin.any()) else 0.0


def _single(q, k, v, gout, **kw) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = selfattn.attention(q, k, v, return_lse=True, **kw)
    out.backward(gout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _sharded(q, k, v, gout, layout: str | sad.Sharding, strategy: str, **kw) -> tuple[torch.Tensor, ...]:
    ql, kl, vl = (sad.shard(t, layout=layout).detach().requires_grad_() for t in (q, k, v))
    out, lse = sad.attention(ql, kl, vl, layout=layout, strategy=strategy, return_lse=True, timeout=20, **kw)
    out.backward(sad.shard(gout, layout=layout))
    return out.detach(), lse, ql.grad, kl.grad, vl.grad


def _errors(got: tuple, ref: tuple, layout: str) -> dict[str, float]:
    out, lse, dq, dk, dv = got
    r_out, r_lse, r_dq, r_dk, r_dv = (sad.shard(t, layout=layout) if t.dim() == 4 else
                                      sad.shard(t.unsqueeze(-1), layout=layout).squeeze(-1) for t in ref)
    return {"out": _rel(out, r_out), "lse": _lse_err(lse, r_lse), "dq": _rel(dq, r_dq), "dk": _rel(dk, r_dk),
            "dv": _rel(dv, r_dv)}


def exact_worker(rank: int, world: int) -> dict:
    """Every case x layout x strategy, float64 (plus one float32 case held to the rule, and dropout)."""
    torch.manual_seed(0)
    hkv, chunk, batch = max(1, world), 12, 2
    heads, length = 2 * hkv, 2 * world * chunk  # GQA (2 query heads per kv head); L divisible by 2W
    q = torch.randn(batch, heads, length, 8, dtype=torch.float64)
    k = torch.randn(batch, hkv, length, 8, dtype=torch.float64)
    v = torch.randn(batch, hkv, length, 6, dtype=torch.float64)  # Dv != D
    gout = torch.randn(batch, heads, length, 6, dtype=torch.float64)
    results: dict[str, dict] = {}
    for name, kw in _cases(batch, heads, length).items():
        ref = _single(q, k, v, gout, **kw)
        for layout in ("contiguous", "zigzag"):
            for strategy in ("ring", "all_to_all"):
                results[f"{layout}/{strategy}/{name}"] = _errors(_sharded(q, k, v, gout, layout, strategy, **kw),
                                                                ref, layout)
            results[f"{layout}/ring-low-memory/{name}"] = _errors(
                _sharded(q, k, v, gout, layout, "ring", memory="low", **kw), ref, layout)
    # dropout: the ring draws the single-process chunked pattern for the same seed
    for layout in ("contiguous", "zigzag"):
        kw = dict(mask=masks.sliding_window(9), dropout_p=0.3)
        torch.manual_seed(123)
        ref = _single(q, k, v, gout, backend="chunked", **kw)
        for memory in ("overlap", "low"):
            torch.manual_seed(123)
            results[f"{layout}/ring-{memory}/dropout"] = _errors(
                _sharded(q, k, v, gout, layout, "ring", memory=memory, **kw), ref, layout)
    # all_to_all dropout: a valid pattern per head group, fixed by the seed
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(_sharded(q, k, v, gout, "zigzag", "all_to_all", causal=True, dropout_p=0.5)[0])
    plain = _sharded(q, k, v, gout, "zigzag", "all_to_all", causal=True)[0]
    results["a2a_dropout"] = {"repeatable": bool(torch.equal(*outs)), "changes": not torch.allclose(outs[0], plain),
                              "finite": bool(torch.isfinite(outs[0]).all())}
    # float32, held to the rule against the float64 oracle
    kw32 = dict(mask=masks.document(torch.arange(length).div(7, rounding_mode="floor")), causal=True)
    q32, k32, v32 = q.float(), k.float(), v.float()
    ref64 = sad.shard(testing.reference_attention(q32, k32, v32, **kw32), layout="zigzag")
    naive = sad.shard(testing.reference_attention(q32, k32, v32, dtype=None, safe=False, **kw32), layout="zigzag")
    for strategy in ("ring", "all_to_all"):
        got = _sharded(q32, k32, v32, gout.float(), "zigzag", strategy, **kw32)[0]
        c = testing.compare_to_reference(got, ref64, naive)
        results[f"float32/{strategy}"] = {"ok": c.ok, "error": c.error, "tolerance": c.tolerance}
    # unshard along another dimension, as shard: (B, L / W, E) -> (B, L, E), the backward hands back this rank's part
    x, gx = torch.randn(batch, length, 5, dtype=torch.float64), torch.randn(batch, length, 5, dtype=torch.float64)
    for layout in ("contiguous", "zigzag"):
        local = sad.shard(x, layout=layout, dim=1).requires_grad_()
        whole = sad.unshard(local, layout=layout, dim=-2, timeout=20)
        whole.backward(gx)
        results[f"{layout}/unshard-dim1"] = {"out": _rel(whole.detach(), x),
                                             "grad": _rel(local.grad, sad.shard(gx, layout=layout, dim=1))}
    results["balance"] = _balance(q)
    return results


def sharding_worker(rank: int, world: int) -> dict:
    """Rows of lengths no layout divides, and balanced layouts of packed documents: every mask kind, both strategies,
    against one process on this rank's real positions; shard / unshard round trips and their gradients."""
    torch.manual_seed(0)
    hkv, batch = world, 2
    heads, length = 2 * hkv, 4 * world * 6 + 5  # not a multiple of 2W, nor of any K W
    q = torch.randn(batch, heads, length, 8, dtype=torch.float64)
    k = torch.randn(batch, hkv, length, 8, dtype=torch.float64)
    v = torch.randn(batch, hkv, length, 6, dtype=torch.float64)
    gout = torch.randn(batch, heads, length, 6, dtype=torch.float64)
    docs = torch.repeat_interleave(torch.arange(4), torch.tensor([3, length - 20, 9, 8]))
    layouts = {"contiguous": sad.Sharding.of("contiguous", length, world),
               "zigzag": sad.Sharding.of("zigzag", length, world),
               "balanced": sad.balanced(world, document_ids=docs),
               "balanced-k3": sad.balanced(world, cu_seqlens=[0, 3, length - 17, length - 8, length],
                                           chunks_per_rank=3),
               "balanced-window": sad.balanced(world, document_ids=docs, window=4)}
    results: dict[str, dict] = {}
    for name, kw in _cases(batch, heads, length).items():
        ref = _single(q, k, v, gout, **kw)
        for lname, lay in layouts.items():
            pos = lay.positions(rank)
            real = pos < length
            for strategy in ("ring", "all_to_all"):
                out, lse, dq, dk, dv = _sharded(q, k, v, gout, lay, strategy, **kw)
                r_out, r_lse, r_dq, r_dk, r_dv = (t[:, :, pos[real]] for t in ref)
                results[f"{lname}/{strategy}/{name}"] = {
                    "out": _rel(out[:, :, real], r_out), "lse": _lse_err(lse[:, :, real], r_lse),
                    "dq": _rel(dq[:, :, real], r_dq), "dk": _rel(dk[:, :, real], r_dk),
                    "dv": _rel(dv[:, :, real], r_dv),
                    "padding": float(out[:, :, ~real].abs().max()) if bool((~real).any()) else 0.0}
    # dropout on a padded row: the single-process chunked pattern of the same seed (the padding draws nothing)
    kw = dict(mask=masks.sliding_window(5), dropout_p=0.3)
    torch.manual_seed(123)
    ref = _single(q, k, v, gout, backend="chunked", **kw)
    for lname, lay in layouts.items():
        pos = lay.positions(rank)
        real = pos < length
        torch.manual_seed(123)
        got = _sharded(q, k, v, gout, lay, "ring", **kw)
        results[f"{lname}/ring/dropout"] = {
            part: (_lse_err if part == "lse" else _rel)(a[:, :, real], b[:, :, pos[real]])
            for part, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref, strict=True)}
    x, gx = torch.randn(batch, length, 5, dtype=torch.float64), torch.randn(batch, length, 5, dtype=torch.float64)
    for lname, lay in layouts.items():
        local = sad.shard(x, layout=lay, dim=1).requires_grad_()
        whole = sad.unshard(local, layout=lay, dim=1, timeout=20)
        whole.backward(gx)
        results[f"{lname}/unshard"] = {"out": _rel(whole.detach(), x), "shape": float(whole.shape[1] != length),
                                       "grad": _rel(local.grad, sad.shard(gx, layout=lay, dim=1))}
    return results


def sinks_worker(rank: int, world: int) -> dict:
    """Attention sinks (gpt-oss): out, lse and every gradient, the sinks' summed over the ranks, in both strategies."""
    torch.manual_seed(0)
    batch, hkv, length = 2, world, 4 * world * 3
    heads = 2 * hkv
    q = torch.randn(batch, heads, length, 8, dtype=torch.float64)
    k, v = (torch.randn(batch, hkv, length, 8, dtype=torch.float64) for _ in range(2))
    gout = torch.randn(batch, heads, length, 8, dtype=torch.float64)
    sinks = torch.randn(heads, dtype=torch.float64)
    results = {}
    for name, kw in (("causal", dict(causal=True)), ("window", dict(mask=masks.sliding_window(5)))):
        s1 = sinks.clone().requires_grad_()
        ref = _single(q, k, v, gout, sinks=s1, **kw)
        for layout in ("contiguous", "zigzag"):
            for strategy in ("ring", "all_to_all"):
                s2 = sinks.clone().requires_grad_()
                got = _sharded(q, k, v, gout, layout, strategy, sinks=s2, **kw)
                dsinks = s2.grad.clone()
                dist.all_reduce(dsinks)
                results[f"{layout}/{strategy}/{name}"] = {**_errors(got, ref, layout), "dsinks": _rel(dsinks, s1.grad)}
    return results


def varlen_worker(rank: int, world: int) -> dict:
    """distributed.varlen_attention on a packed row of a length no layout divides, against one process's
    varlen_attention on the whole row: contiguous, zigzag and balanced layouts, both strategies, causal, windows,
    softcap and sinks; float64. Under torch.compile too (fullgraph), and the errors of a row that does not match."""
    torch.manual_seed(0)
    hkv = world
    heads, length = 2 * hkv, 4 * world * 6 + 5
    cu = torch.tensor([0, 3, length - 17, length - 8, length], dtype=torch.int32)
    q = torch.randn(length, heads, 8, dtype=torch.float64)
    k = torch.randn(length, hkv, 8, dtype=torch.float64)
    v = torch.randn(length, hkv, 6, dtype=torch.float64)
    gout = torch.randn(length, heads, 6, dtype=torch.float64)
    cases = {"none": {}, "causal": dict(causal=True), "causal+window": dict(causal=True, window=(4, -1)),
             "window": dict(window=(3, 2)), "softcap+sinks": dict(causal=True, softcap=2.0, sinks="sinks")}
    layouts = {"contiguous": sad.Sharding.of("contiguous", length, world),
               "zigzag": sad.Sharding.of("zigzag", length, world),
               "balanced": sad.balanced(world, cu_seqlens=cu, causal=True)}
    sinks = torch.randn(heads, dtype=torch.float64)

    def leaves(*ts):
        return [t.detach().clone().requires_grad_() for t in ts]

    results: dict[str, dict] = {}
    for name, kw in cases.items():
        s1, s2 = leaves(sinks, sinks)
        kw1 = {n: (s1 if a == "sinks" else a) for n, a in kw.items()}
        q1, k1, v1 = leaves(q, k, v)
        out, lse = selfattn.varlen_attention(q1, k1, v1, cu, return_lse=True, **kw1)
        out.backward(gout)
        ref = (out.detach(), lse.T, q1.grad, k1.grad, v1.grad)
        for lname, lay in layouts.items():
            pos = lay.positions(rank)
            real = pos < length
            for strategy in ("ring", "all_to_all"):
                s2.grad = None
                kw2 = {n: (s2 if a == "sinks" else a) for n, a in kw.items()}
                ql, kl, vl = leaves(*(sad.shard(t, layout=lay, dim=0) for t in (q, k, v)))
                out, lse = sad.varlen_attention(ql, kl, vl, cu, layout=lay, strategy=strategy, return_lse=True,
                                                timeout=20, **kw2)
                out.backward(sad.shard(gout, layout=lay, dim=0))
                got = (out.detach(), lse.T, ql.grad, kl.grad, vl.grad)
                errs = {part: (_lse_err if part == "lse" else _rel)(a[real], b[pos[real]])
                        for part, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref, strict=True)}
                errs["padding"] = float(out[~real].detach().abs().max()) if bool((~real).any()) else 0.0
                if "sinks" in kw:
                    dsinks = s2.grad.clone()
                    dist.all_reduce(dsinks)
                    errs["dsinks"] = _rel(dsinks, s1.grad)
                results[f"{lname}/{strategy}/{name}"] = errs
    lay = layouts["balanced"]
    fn = torch.compile(lambda q, k, v: sad.varlen_attention(q, k, v, cu, layout=lay, causal=True, timeout=20),
                       backend="aot_eager", fullgraph=True)
    ql = sad.shard(q, layout=lay, dim=0)
    kl, vl = (sad.shard(t, layout=lay, dim=0) for t in (k, v))
    eager = sad.varlen_attention(ql, kl, vl, cu, layout=lay, causal=True, timeout=20)
    results["compiled"] = {"out": _rel(fn(ql, kl, vl), eager)}
    errors = {}
    for name, call in (("other-row", lambda: sad.varlen_attention(ql, kl, vl, cu[:-1], layout=lay)),
                       ("plain-layout", lambda: sad.varlen_attention(ql, kl, vl, cu, layout="contiguous")),
                       ("kv-tokens", lambda: sad.varlen_attention(ql, kl[:-1], vl[:-1], cu, layout=lay)),
                       ("cu-float", lambda: sad.varlen_attention(ql, kl, vl, cu.double(), layout=lay))):
        try:
            call()
            errors[name] = "no error"
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    results["errors"] = errors
    empty = torch.zeros(0, heads, 8, dtype=torch.float64)
    out, lse = sad.varlen_attention(empty, empty[:, :hkv], empty[:, :hkv, :6], torch.zeros(3, dtype=torch.int32),
                                    causal=True, return_lse=True, timeout=20)
    results["empty row"] = {"shape": float(out.shape != (0, heads, 6) or lse.shape != (heads, 0))}
    return results


def determinism_worker(rank: int, world: int) -> dict:
    """The ring and all_to_all at a fixed W, float32, run at 1, 2 and 3 threads: out, lse and every gradient
    compared bit for bit with the first run."""
    torch.manual_seed(0)
    batch, hkv, length = 2, world, 4 * world * 8
    heads = 2 * hkv
    q = torch.randn(batch, heads, length, 16)
    k, v = (torch.randn(batch, hkv, length, 16) for _ in range(2))
    gout = torch.randn(batch, heads, length, 16)
    sinks = torch.randn(heads)
    results = {}
    for name, kw in (("causal", dict(causal=True)), ("window", dict(mask=masks.sliding_window(13))),
                     ("sinks", dict(causal=True))):
        for layout, strategy in (("zigzag", "ring"), ("contiguous", "ring"), ("zigzag", "all_to_all")):
            runs = []
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                extra = {"sinks": sinks.clone().requires_grad_()} if name == "sinks" else {}
                got = _sharded(q, k, v, gout, layout, strategy, **kw, **extra)
                runs.append([*got, *((extra["sinks"].grad,) if extra else ())])
            same = all(torch.equal(a, b) for other in runs[1:] for a, b in zip(runs[0], other, strict=True))
            results[f"{layout}/{strategy}/{name}"] = {"ok": same}
    # a second derivative: the ring's backward is not differentiable, so create_graph=True must raise
    ql, kl, vl = (sad.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v))
    out = sad.attention(ql, kl, vl, layout="zigzag", causal=True, timeout=20)
    try:
        torch.autograd.grad(out.sum(), ql, create_graph=True)
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    results["create_graph refused"] = {"ok": "the ring's attention has no second derivative" in refused}
    return results


def _balance(q: torch.Tensor) -> dict:
    """Work per rank for causal attention in each layout, and the pairs skipped."""
    out = {}
    for layout in ("contiguous", "zigzag"):
        ql = sad.shard(q, layout=layout).requires_grad_()
        with sad.record() as stats:
            sad.attention(ql, ql, ql, layout=layout, causal=True, timeout=20).sum().backward()
        out[layout] = {"work": stats.work, "skipped": stats.skipped, "blocks": stats.blocks}
    return out


def failure_worker(rank: int, world: int) -> dict:
    """Bad lengths, mismatched shapes and layouts, and a rank that raises before the call."""
    seen: dict[str, str] = {}

    def catch(name: str, fn) -> None:
        t0 = time.monotonic()
        try:
            fn()
            seen[name] = "no error"
        except (ValueError, RuntimeError) as e:
            seen[name] = f"{type(e).__name__}: {e}"
        seen[name + "_s"] = str(time.monotonic() - t0)

    x = torch.randn(1, 2, 6 * world, 4, dtype=torch.float64)
    catch("shard_indivisible", lambda: sad.shard(torch.randn(1, 3, 6 * world + 1, 4)))
    odd = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    catch("zigzag_odd", lambda: sad.attention(odd, odd, odd, layout="zigzag", timeout=5))
    mine = sad.shard(x) if rank != 1 else torch.randn(1, 2, 8, 4, dtype=torch.float64)
    catch("shape_mismatch", lambda: sad.attention(mine, mine, mine, timeout=5))
    local = sad.shard(x)
    catch("layout_mismatch", lambda: sad.attention(local, local, local, layout="zigzag" if rank == 2 else "contiguous",
                                                   timeout=5))
    catch("heads_indivisible", lambda: sad.attention(local, local, local, strategy="all_to_all", timeout=5))
    lay = sad.Sharding.of("zigzag", length=6 * world, world=world)
    short = sad.shard(x, layout=lay)[:, :, : -2 if rank == 1 else None]  # rank 1's shard misses 2 tokens
    catch("sharding_short", lambda: sad.attention(short, short, short, layout=lay, timeout=5))
    uneven = torch.randn(2, 4 + 2 * (rank == 1), 3)
    catch("unshard_shapes", lambda: sad.unshard(uneven, dim=1, timeout=5))
    if rank == world - 1:
        catch("dead_rank", lambda: (_ for _ in ()).throw(RuntimeError("this rank failed in user code")))
        time.sleep(4.5)  # stay alive (the group open) while the others time out
    else:
        catch("dead_rank", lambda: sad.attention(local, local, local, timeout=2))
    return seen


def nccl_worker(rank: int, world: int) -> dict:
    """The float64 exactness cases on CUDA tensors over NCCL (a subset)."""
    torch.manual_seed(0)
    dev = torch.device("cuda", rank)
    length = 2 * world * 32
    q, k, v = (torch.randn(2, 2 * world, length, 16, dtype=torch.float64, device=dev) for _ in range(3))
    gout = torch.randn(2, 2 * world, length, 16, dtype=torch.float64, device=dev)
    results = {}
    for name, kw in _cases(2, 2 * world, length).items():
        kw = {key: (val if not isinstance(val, torch.Tensor) else val.to(dev)) for key, val in kw.items()}
        ref = _single(q, k, v, gout, **kw)
        for strategy in ("ring", "all_to_all"):
            results[f"zigzag/{strategy}/{name}"] = _errors(_sharded(q, k, v, gout, "zigzag", strategy, **kw), ref,
                                                           "zigzag")
    return results


def precision_worker(rank: int, world: int) -> dict:
    """float32 with q and k of scale 2 and a small head dim, where rounding in the merge shows: the
    ring's out, lse, dq, dk and dv held to the rule (error over tolerance) against the float64 oracle."""
    gen = torch.Generator().manual_seed(3)
    batch, heads, hkv, length, d = 2, 4, 2, 240, 8
    q = (torch.randn(batch, heads, length, d, generator=gen, dtype=torch.float64) * 2).float()
    k = (torch.randn(batch, hkv, length, d, generator=gen, dtype=torch.float64) * 2).float()
    v = torch.randn(batch, hkv, length, d, generator=gen, dtype=torch.float64).float()
    gout = torch.randn(batch, heads, length, d, generator=gen, dtype=torch.float64)
    cases = {"none": {}, "causal": dict(causal=True),
             "custom": dict(score_mod=lambda s, b, h, i, j: s + 0.2 * torch.sin(0.3 * i - 0.7 * j + h))}
    results = {}
    for name, kw in cases.items():
        oracle = dict(causal=kw.get("causal", False), score_mod=kw.get("score_mod"))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref = testing.reference_attention(q64, k64, v64, **oracle)
        naive = testing.reference_attention(qn, kn, vn, **oracle, dtype=None, safe=False)
        refs = [ref, testing.reference_lse(q64, k64, **oracle), *torch.autograd.grad(ref, (q64, k64, v64), gout)]
        naives = [naive, testing.reference_lse(q, k, **oracle, dtype=None),
                  *torch.autograd.grad(naive, (qn, kn, vn), gout.float())]
        for layout in ("contiguous", "zigzag"):
            got = _sharded(q, k, v, gout.float(), layout, "ring", **kw)
            ratios = {}
            for what, a, r, nv in zip(("out", "lse", "dq", "dk", "dv"), got, refs, naives, strict=True):
                r, nv = (sad.shard(t, layout=layout) if t.dim() == 4 else
                         sad.shard(t.unsqueeze(-1), layout=layout).squeeze(-1) for t in (r, nv))
                c = testing.compare_to_reference(a, r, nv, factor=2.0 if what in ("out", "lse") else 3.0)
                ratios[what] = c.error / c.tolerance
            results[f"{layout}/{name}"] = ratios
    return results


def agreement_worker(rank: int, world: int) -> dict:
    """Ranks that disagree about the mask, the modifier or the dtype; an unlimited timeout; ring
    dropout under other chunked tile options than the single-process reference."""
    seen: dict[str, str] = {}
    length, heads = 12 * world, 2
    torch.manual_seed(0)
    x = torch.randn(1, heads, length, 4, dtype=torch.float64)
    local = sad.shard(x)
    ids = torch.arange(length).div(7 if rank == 1 else 6, rounding_mode="floor")
    lengths = torch.tensor([length - (3 if rank == 2 else 1)])
    slopes = scores.alibi_slopes(heads) * (2.0 if rank == 0 else 1.0)
    c = 0.5 if rank == 1 else 0.25
    calls = {
        "documents": dict(mask=masks.document(ids), causal=True),
        "padding": dict(mask=masks.padding(lengths)),
        "alibi": dict(score_mod=scores.alibi(slopes)),
        "custom": dict(score_mod=lambda s, b, h, i, j: s + c * torch.cos(i - j)),
    }
    for name, kw in calls.items():
        try:
            sad.attention(local, local, local, timeout=20, **kw)
            seen[name] = "no error"
        except ValueError as e:
            seen[name] = f"ValueError: {e}"
    mine = local.float() if rank == 1 else local
    try:
        sad.attention(mine, mine, mine, timeout=20)
        seen["dtype"] = "no error"
    except ValueError as e:
        seen["dtype"] = f"ValueError: {e}"
    try:
        out = sad.attention(local, local, local, causal=True, timeout=float("inf"))
        seen["inf_timeout"] = f"error {_rel(out, sad.shard(selfattn.attention(x, x, x, causal=True)))}"
    except Exception as e:  # recorded: the test names it
        seen["inf_timeout"] = f"{type(e).__name__}: {e}"
    big = torch.randn(1, heads, 32 * world, 8, dtype=torch.float64)
    gout = torch.randn_like(big)
    with chunked.options(block_q=32, block_k=48):  # the reference's tiles differ from the dropout grid
        torch.manual_seed(11)
        ref = _single(big, big, big, gout, backend="chunked", causal=True, dropout_p=0.3)
    torch.manual_seed(11)
    seen["dropout_errors"] = json.dumps(_errors(_sharded(big, big, big, gout, "zigzag", "ring", causal=True,
                                                         dropout_p=0.3), ref, "zigzag"))
    return seen


_CALLS = [0]


def _exit_in_the_backward(s, b, h, i, j):
    """A score modifier, the same on every rank, whose process exits on rank 2 at its 4th call: the
    first block of the backward (the forward computes 3 blocks at W = 3 without a mask)."""
    _CALLS[0] += 1
    if dist.get_rank() == 2 and _CALLS[0] == 4:
        os._exit(0)
    return s + 0.0 * i


def dying_entry(rank: int, world: int, port: int, outdir: str) -> None:
    """Rank 2 exits in the middle of the ring's backward; the others record what they were told."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    x = sad.shard(torch.randn(1, 2, 24 * world, 4, dtype=torch.float64)).requires_grad_()
    t0 = time.monotonic()
    try:
        sad.attention(x, x, x, score_mod=_exit_in_the_backward, timeout=30).sum().backward()
        seen = "no error"
    except RuntimeError as e:
        seen = f"RuntimeError: {e}"
    Path(outdir, f"{rank}.json").write_text(json.dumps({"error": seen, "seconds": time.monotonic() - t0}))
    os._exit(0)


# ----------------------------------------------------------------------------- tests


def _judge(results: list[dict], world: int) -> None:
    for rank, res in enumerate(results):
        for key, errs in res.items():
            if key == "balance":
                continue
            if key == "a2a_dropout":
                assert all(errs.values()), f"rank {rank}: all_to_all dropout {errs}"
            elif key.startswith("float32"):
                assert errs["ok"], f"rank {rank} {key}: {errs}"
            else:
                bad = {n: e for n, e in errs.items() if e > (LSE_F32 if n == "lse" else F64_EXACT)}
                assert not bad, f"W={world} rank {rank} {key}: {bad}"


_SLOW = pytest.mark.slow  # a spawn per world size: 1 and 3 in the default run


@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=_SLOW), 3, pytest.param(4, marks=_SLOW)],
                ids=lambda w: f"W{w}")
def exact_run(request, tmp_path_factory):
    """One spawn per world size runs every exactness case and the causal balance count."""
    world = request.param
    return world, _spawn("exact_worker", world, tmp_path_factory.mktemp(f"exact{world}"))


def test_exact_every_mask_layout_strategy(exact_run):
    """catches: a rank evaluating masks or score modifiers on local instead of global positions, a wrong
    merge of partial results (fully masked blocks, -inf lse), dK/dV returned to the wrong owner, zigzag
    chunks out of order, head groups mixed up by all_to_all (GQA, per-head masks, ALiBi slopes), a
    ring dropout pattern that differs from the single-process one, and the ring's memory="low" backward
    adding a block's dK/dV into another block's accumulator or returning it to the wrong owner."""
    world, res = exact_run
    _judge(res, world)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_any_length_and_balanced_layouts_are_exact(world, tmp_path):
    """catches: padding a row to the layout's multiple seen as keys (or its queries given output), a mask read past
    the row's end, a balanced layout's chunks gathered or attended in the wrong order, unshard returning the
    padding or handing its gradient to the wrong rank, and dropout on a padded row drawing another pattern than the
    unpadded call with the same seed (the grid's edge tiles were drawn at the call's clipped size)."""
    for rank, res in enumerate(_spawn("sharding_worker", world, tmp_path, limit=300)):
        for key, errs in res.items():
            bad = {n: e for n, e in errs.items() if e > (LSE_F32 if n == "lse" else F64_EXACT)}
            assert not bad, f"W={world} rank {rank} {key}: {bad}"


def test_varlen_rows_across_ranks_equal_one_process(tmp_path):
    """catches: the varlen (cu_seqlens) form of context parallelism reading cu_seqlens as local offsets, a sequence
    split over ranks seeing only its local part, a balanced layout's padding seen as keys, sinks or softcap lost on
    the way, a graph break under compile, a cu_seqlens that describes another row accepted silently, and a row of
    empty sequences refused with the shape of a tensor the caller never passed."""
    for rank, res in enumerate(_spawn("varlen_worker", 2, tmp_path, limit=300)):
        errors = res.pop("errors")
        assert errors["other-row"].startswith("ValueError: cu_seqlens describes a row of"), errors
        assert errors["plain-layout"].startswith("ValueError: cu_seqlens describes a row of"), errors
        assert "Sharding.of('contiguous'" in errors["plain-layout"], errors
        assert errors["kv-tokens"].startswith("ValueError:"), errors
        assert errors["cu-float"].startswith("TypeError: cu_seqlens must be an int32 or int64"), errors
        for key, errs in res.items():
            bad = {n: e for n, e in errs.items() if e > (LSE_F32 if n == "lse" else F64_EXACT)}
            assert not bad, f"rank {rank} {key}: {bad}"


@pytest.mark.slow  # a spawn per thread count
def test_ring_gives_the_same_bits_at_every_thread_count(tmp_path):
    """catches: context parallelism at a fixed world size whose result depends on the run or the thread
    count (blocks merged in arrival order, gradients summed as they come back), and a second derivative
    through the ring's backward that is silently constant instead of refused."""
    for rank, res in enumerate(_spawn("determinism_worker", 2, tmp_path)):
        assert all(r["ok"] for r in res.values()), f"rank {rank}: {res}"


def test_attention_sinks_across_ranks(tmp_path):
    """catches: sinks missing from distributed attention (gpt-oss under context parallelism), added per block
    instead of once on the merged rows, or their gradient taken from the wrong rows."""
    for res in _spawn("sinks_worker", 2, tmp_path):
        bad = {case: e for case, e in res.items() if max(e.values()) > 1e-10}
        assert not bad, bad


def test_zigzag_balances_causal_work(exact_run):
    """catches: zigzag not giving each rank the same causal work, and empty blocks computed instead of skipped."""
    world, res = exact_run
    bal = [r["balance"] for r in res]
    zig = [b["zigzag"]["work"] for b in bal]
    assert len(set(zig)) == 1, f"zigzag causal work per rank: {zig}"
    if world > 1:
        assert len({b["contiguous"]["work"] for b in bal}) > 1  # the imbalance zigzag removes
        assert all(b["zigzag"]["skipped"] > 0 for b in bal)
        assert sum(b["contiguous"]["skipped"] for b in bal) > 0


def test_failures_are_loud_not_hangs(tmp_path):
    """catches: a missing rank hanging the others forever, mismatched shapes or layouts across ranks
    computing garbage (or deadlocking; unshard aborting one rank and giving another a wrong shape), lengths
    that do not split being silently truncated, and one rank whose shard does not fit a Sharding raising alone
    while the others wait out the timeout."""
    world = 3
    res = _spawn("failure_worker", world, tmp_path, limit=90)
    for rank, seen in enumerate(res):
        assert "divisible" in seen["shard_indivisible"], seen["shard_indivisible"]
        assert "2W" in seen["zigzag_odd"], seen["zigzag_odd"]
        assert seen["shape_mismatch"].startswith("ValueError") and "rank 1" in seen["shape_mismatch"]
        assert seen["layout_mismatch"].startswith("ValueError") and "layout" in seen["layout_mismatch"]
        assert "divisible by W" in seen["heads_indivisible"], seen["heads_indivisible"]
        assert seen["sharding_short"].startswith("ValueError") and "local length" in seen["sharding_short"] and \
            "rank 1" in seen["sharding_short"] and float(seen["sharding_short_s"]) < 2, seen
        assert seen["unshard_shapes"].startswith("ValueError") and "(2, 6, 3)" in seen["unshard_shapes"], seen
        if rank < world - 1:
            assert seen["dead_rank"].startswith("RuntimeError") and f"rank {world - 1}" in seen["dead_rank"]
            assert float(seen["dead_rank_s"]) < 2 + 2, seen["dead_rank_s"]


def test_ring_keeps_the_float32_rule_for_every_gradient(tmp_path):
    """catches: block outputs merged into a float32 output by rescaling it with a rounded running lse:
    its rounding, amplified through rowsum(dO * O) in the backward, put dq and dk at up to 2.6x the
    rule's tolerance at W = 3 (zigzag, q and k of scale 2, D = 8)."""
    world = 3
    res = _spawn("precision_worker", world, tmp_path, limit=300)
    bad = {f"rank {r} {key}": ratios for r, per in enumerate(res) for key, ratios in per.items()
           if max(ratios.values()) > 1}
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_keeps_the_float32_rule_at_every_world_size(world, tmp_path):
    """catches: the same as above at the other world sizes (W = 1 zigzag already merges two chunks)."""
    res = _spawn("precision_worker", world, tmp_path, limit=600)
    bad = {f"rank {r} {key}": ratios for r, per in enumerate(res) for key, ratios in per.items()
           if max(ratios.values()) > 1}
    assert not bad, bad


def test_ranks_agree_on_mask_modifier_and_dtype(tmp_path):
    """catches: ranks that pass different document ids, padding lengths or score modifiers each
    computing with their own (a silent mixture), a dtype mismatch reported as indices ("rank 0 has
    2"), timeout=float('inf') failing in timedelta, and a ring dropout that follows the chunked
    options in force instead of the call's own pattern."""
    world = 3
    res = _spawn("agreement_worker", world, tmp_path)
    for name, field, odd in (("documents", "mask", 1), ("padding", "mask", 2), ("alibi", "score_mod", 0),
                             ("custom", "score_mod", 1)):
        msgs = {r[name] for r in res}
        assert len(msgs) == 1, msgs  # the same error on every rank
        (msg,) = msgs
        others = " and ".join(str(r) for r in range(world) if r != odd)
        assert msg.startswith("ValueError: selfattn.distributed.attention was called with different arguments"), msg
        assert f"{field}: " in msg and f"rank {odd} has fingerprint" in msg and f"ranks {others} have" in msg, msg
    assert {r["dtype"] for r in res} == {res[0]["dtype"]}
    assert "dtype: ranks 0 and 2 have float64, rank 1 has float32" in res[0]["dtype"], res[0]["dtype"]
    for r in res:
        assert r["inf_timeout"].startswith("error ") and float(r["inf_timeout"][6:]) <= F64_EXACT, r["inf_timeout"]
        errors = json.loads(r["dropout_errors"])
        assert all(e <= (LSE_F32 if n == "lse" else F64_EXACT) for n, e in errors.items()), errors


def test_a_rank_that_dies_mid_ring_is_named_by_its_neighbours(tmp_path):
    """catches: a rank that exits in the middle of the ring's backward named vaguely, or reported
    as "waited 30 s" when its connection broke at once."""
    world = 3
    outdir = tmp_path / "dying"
    outdir.mkdir()
    spawn_and_join(dying_entry, (world, free_port(), str(outdir)), world, 120)
    for rank in (0, 1):  # rank 2's neighbours: it receives from 1 and sends to 0
        seen = json.loads((outdir / f"{rank}.json").read_text())
        assert seen["error"].startswith("RuntimeError") and "lost rank 2" in seen["error"], seen
        assert "waited 30 s" not in seen["error"] and seen["seconds"] < 25, seen
    assert not (outdir / "2.json").exists()


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


_Q = torch.randn(1, 2, 8, 4)
BAD_FOR_BOTH = {
    "scale-str": dict(scale="x"), "scale-zero": dict(scale=0.0), "scale-tensor": dict(scale=torch.tensor(0.5)),
    "dropout-1": dict(dropout_p=1.0), "dropout-str": dict(dropout_p="0.1"),
    "float-mask": dict(mask=torch.zeros(8, 8)), "mask-str": dict(mask="causal"),
    "mask-device": dict(mask=torch.ones(8, 8, dtype=torch.bool, device="meta")),
    "mask-batch": dict(mask=masks.padding([1, 2, 3])), "causal-str": dict(causal="upper"),
    "score-mod-int": dict(score_mod=3), "score-mod-heads": dict(score_mod=scores.alibi(scores.alibi_slopes(4))),
    "return-lse-int": dict(return_lse=1), "backend-none": dict(backend=None), "backend-unknown": dict(backend="nope"),
    "q-3d": dict(q=torch.randn(1, 8, 4)), "q-int": dict(q=torch.ones(1, 2, 8, 4, dtype=torch.long)),
    "k-float64": dict(k=_Q.double()), "length-0": dict(q=_Q[:, :, :0], k=_Q[:, :, :0], v=_Q[:, :, :0]),
    "head-dim-0": dict(q=_Q[..., :0], k=_Q[..., :0], v=_Q[..., :0]),
    "batch-0": dict(q=_Q[:0], k=_Q[:0], v=_Q[:0]),
}


def test_bad_arguments_get_the_single_process_errors(one_rank_group):
    """catches: distributed.attention validating on its own and disagreeing with attention() (a bad
    scale a ValueError there, a TypeError here; a mask tensor's device not checked; L = 0 and D = 0
    a ZeroDivisionError; B = 0 accepted silently)."""
    for name, bad in BAD_FOR_BOTH.items():
        call = {"q": _Q, "k": _Q, "v": _Q, **bad}
        errors = []
        for fn in (selfattn.attention, sad.attention):
            try:
                fn(**call)
                errors.append(None)
            except (TypeError, ValueError) as e:
                errors.append((type(e).__name__, str(e)))
        assert errors[0] is not None and errors[0] == errors[1], (name, errors)


def test_unshard_takes_dim_like_shard(one_rank_group):
    """catches: unshard gathering only 4-D tensors along dim 2 while shard takes any dim, and a bad dim (for either)
    reaching an IndexError or the collective instead of a named error."""
    x = torch.randn(2, 6, 3)
    assert torch.equal(sad.unshard(sad.shard(x, dim=1, layout="zigzag"), dim=1, layout="zigzag"), x)
    for bad in (3, -4, 1.0, True, None):
        with pytest.raises(ValueError, match="dim"):
            sad.unshard(x, dim=bad)
        with pytest.raises(ValueError, match="dim"):
            sad.shard(x, dim=bad)
    with pytest.raises(ValueError, match="2 equal chunks"):
        sad.unshard(torch.randn(2, 5, 3), dim=1, layout="zigzag")


def test_memory_option_is_checked_and_agreed(one_rank_group):
    """catches: a misspelt memory option taken as the default silently."""
    with pytest.raises(ValueError, match=r"memory must be 'overlap'.*or 'low'.*got 'lo'"):
        sad.attention(_Q, _Q, _Q, memory="lo")  # type: ignore[arg-type]
    out = sad.attention(_Q, _Q, _Q, memory="low", causal=True)
    assert torch.equal(out, sad.attention(_Q, _Q, _Q, causal=True))


def test_unlimited_timeout_is_accepted(one_rank_group):
    """catches: timeout=float('inf') raising OverflowError from timedelta."""
    out = sad.attention(_Q, _Q, _Q, causal=True, timeout=float("inf"))
    torch.testing.assert_close(out, selfattn.attention(_Q, _Q, _Q, causal=True))


def test_a_device_mesh_names_the_group(one_rank_group):
    """catches: a DeviceMesh passed as group reaching torch.distributed as an unknown object, a mesh of two
    dimensions taken whole, or a mesh_dim that is not one of its dimensions accepted."""
    from torch.distributed.device_mesh import init_device_mesh

    from selfattn.distributed.group import process_group

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))
    out = sad.attention(_Q, _Q, _Q, causal=True, group=mesh["cp"])
    torch.testing.assert_close(out, selfattn.attention(_Q, _Q, _Q, causal=True))
    assert torch.equal(sad.unshard(sad.shard(_Q, group=mesh["cp"]), group=mesh["cp"]), _Q)
    assert process_group(mesh, "cp") is mesh.get_group("cp")
    with pytest.raises(ValueError, match="mesh\\['cp'\\]"):
        sad.attention(_Q, _Q, _Q, group=mesh)
    with pytest.raises(ValueError, match="not a dimension"):
        process_group(mesh, "tp")
    with pytest.raises(TypeError, match="ProcessGroup, a DeviceMesh"):
        sad.attention(_Q, _Q, _Q, group="cp")


def test_pair_work_counts_what_the_mask_leaves():
    """catches: the balanced layout weighing chunks by another work than the mask's visible pairs (document runs,
    a causal or bidirectional window)."""
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3], [0] * 5 + [1] * 6])
    for causal, window in ((True, None), (False, None), (True, 2), (False, (1, 2)), (False, 1)):
        m = masks.document(ids)
        if causal:
            m = m & masks.causal()
        if window is not None:
            left, right = (window, 0 if causal else window) if isinstance(window, int) else window
            m = m & masks.sliding_window(left, right)
        assert torch.equal(sad.pair_work(ids, causal, window), m.dense(11, 11).sum((0, 1, 3))), (causal, window)


def _log_uniform_row(length: int, seed: int) -> torch.Tensor:
    """(L,) document ids of a packed row: lengths drawn log-uniform in [32, 8192], the last one cut to fit."""
    g, lens = torch.Generator().manual_seed(seed), []
    while sum(lens) < length:
        lens.append(int(math.exp(math.log(32) + torch.rand(1, generator=g).item() * math.log(8192 / 32))))
    lens[-1] -= sum(lens) - length
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def test_balanced_layout_shares_the_work_of_packed_documents():
    """catches: a balanced layout that is no better than zigzag on packed documents (the causal work sits in the
    long documents), gives ranks different numbers of tokens, or loses or repeats a chunk."""
    from selfattn.distributed.layout import _loads

    for seed in range(3):
        ids = _log_uniform_row(65536, seed)
        work = sad.pair_work(ids).double()
        for world in (2, 4, 8):
            lay = sad.balanced(world, document_ids=ids)
            loads = _loads(work, lay)
            assert float(loads.max() / loads.mean()) <= 1.05, (seed, world, loads)
            assert sorted(c for o in lay.owners for c in o) == list(range(lay.padded // lay.chunk))
            assert len({len(o) for o in lay.owners}) == 1
    with pytest.raises(ValueError, match="one of the two"):
        sad.balanced(2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sad.balanced(2, cu_seqlens=[1, 4])


def test_a_cropped_mask_hides_the_padding():
    """catches: the padding past a row's end visible as keys or seeing keys, a mask read past the row, and a tile
    that holds padding claimed full."""
    from selfattn.masks.base import Cropped

    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3])
    for inner in (masks.document(ids) & masks.causal(), None, masks.sliding_window(2, 1)):
        m = Cropped(inner, 11)
        want = torch.zeros(16, 16, dtype=torch.bool)
        want[:11, :11] = True if inner is None else inner.dense(11, 11)[0, 0]
        assert torch.equal(m.dense(16, 16)[0, 0], want)
        for tile in (1, 3, 4, 5, 16):
            t = m.tiles(16, 16, tile, tile)[0, 0]
            for a in range(t.shape[0]):
                for b in range(t.shape[1]):
                    block = want[a * tile:(a + 1) * tile, b * tile:(b + 1) * tile]
                    assert not (t[a, b] == masks.FULL and not block.all()), (tile, a, b)
                    assert not (t[a, b] == masks.EMPTY and block.any()), (tile, a, b)


def test_rejects_bad_arguments_without_a_group():
    """catches: calling without torch.distributed initialised giving an obscure error deep inside torch."""
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        sad.attention(x, x, x)


def test_import_does_not_initialise_distributed():
    """catches: importing selfattn (or selfattn.distributed) starting a process group as a side effect."""
    code = ("import selfattn, torch.distributed as d; from selfattn import distributed; "
            "assert not d.is_initialized()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def pieces_worker(rank: int, world: int) -> dict:
    """The ring with sub-blocks of 8 rows whose keys are cut into pieces of 16 (merged by lse), every mask kind."""
    from selfattn.distributed import ring

    ring._ROWS, ring._KEYS = 8, 16
    torch.manual_seed(0)
    batch, heads, length = 2, 2 * world, 2 * world * 24  # zigzag chunks of 24 keys: pieces of 16 and 8
    q = torch.randn(batch, heads, length, 8, dtype=torch.float64)
    k, v = (torch.randn(batch, world, length, 8, dtype=torch.float64) for _ in range(2))
    gout = torch.randn(batch, heads, length, 8, dtype=torch.float64)
    results = {}
    for name, kw in _cases(batch, heads, length).items():
        ref = _single(q, k, v, gout, **kw)
        for layout in ("contiguous", "zigzag"):
            results[f"{layout}/ring/{name}"] = _errors(_sharded(q, k, v, gout, layout, "ring", **kw), ref, layout)
    kw = dict(mask=masks.sliding_window(9), dropout_p=0.3)
    torch.manual_seed(123)
    ref = _single(q, k, v, gout, backend="chunked", **kw)
    torch.manual_seed(123)
    results["zigzag/ring/dropout"] = _errors(_sharded(q, k, v, gout, "zigzag", "ring", **kw), ref, "zigzag")
    return results


def test_ring_cuts_the_keys_of_a_sub_block_into_pieces(tmp_path):
    """catches: the pieces a sub-block's keys are cut into (so that its scores stay a fixed size) skipping or
    repeating keys, a piece's mask taken from the wrong tiles, or its dropout pattern differing."""
    _judge(_spawn("pieces_worker", 2, tmp_path), 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_exact_larger(world, tmp_path):
    """catches: errors that only show when blocks span several sub-blocks and chunked tiles (L in the hundreds)."""
    res = _spawn("large_worker", world, tmp_path, limit=600)
    _judge(res, world)


def large_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    length, heads = 384, 2 * world
    ids = torch.arange(length).div(50, rounding_mode="floor")
    q = torch.randn(1, heads, length, 16, dtype=torch.float64)
    k, v = torch.randn_like(q), torch.randn_like(q)
    gout = torch.randn_like(q)
    results = {}
    for name, kw in {"documents": dict(mask=masks.document(ids), causal=True),
                     "window": dict(mask=masks.sliding_window(40))}.items():
        ref = _single(q, k, v, gout, **kw)
        for layout in ("contiguous", "zigzag"):
            for strategy in ("ring", "all_to_all"):
                results[f"{layout}/{strategy}/{name}"] = _errors(_sharded(q, k, v, gout, layout, strategy, **kw),
                                                                ref, layout)
    with chunked.options(block_q=32, block_k=48):
        kw = dict(causal=True, dropout_p=0.2)
        torch.manual_seed(5)
        ref = _single(q, k, v, gout, backend="chunked", **kw)
        torch.manual_seed(5)
        results["zigzag/ring/dropout-tiles"] = _errors(_sharded(q, k, v, gout, "zigzag", "ring", **kw), ref, "zigzag")
    return results


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL")
def test_nccl_exact(tmp_path):
    """catches: the ring or all_to_all breaking on CUDA tensors over NCCL (device placement, coalesced P2P works)."""
    world = min(2, torch.cuda.device_count())
    _judge(_spawn("nccl_worker", world, tmp_path, limit=300, backend="nccl"), world)


# ----------------------------------------------------------------------------- torch.compile


def compiled_worker(rank: int, world: int, grid: bool = False) -> dict:
    """sad.attention inside torch.compile(fullgraph=True): out, lse and gradients against one process, in both
    strategies, a zigzag row and a padded one; a new mask tensor of the same structure does not recompile;
    dropout and sinks equal eager's bits."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    batch, hkv, length = 2, world, 4 * world * 3
    heads = 2 * hkv
    q = torch.randn(batch, heads, length, 8, dtype=torch.float64)
    k, v = (torch.randn(batch, hkv, length, 8, dtype=torch.float64) for _ in range(2))
    gout = torch.randn(batch, heads, length, 8, dtype=torch.float64)
    cases = _cases(batch, heads, length)
    names = list(cases) if grid else ["causal", "documents", "alibi", "custom"]
    odd = sad.Sharding.of("zigzag", length=length - 3, world=world)
    results: dict = {}

    def run(kw: dict, layout, strategy: str, counter=None):
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: sad.attention(q, k, v, layout=layout, strategy=strategy, return_lse=True,
                                                         timeout=20, **kw),
                           backend=counter or "aot_eager", fullgraph=True)
        return _sharded_with(fn, q if layout is not odd else q[:, :, :length - 3], k if layout is not odd else
                             k[:, :, :length - 3], v if layout is not odd else v[:, :, :length - 3],
                             gout if layout is not odd else gout[:, :, :length - 3], layout)

    for name in names:
        kw = cases[name]
        for layout in ("zigzag", odd):
            if layout is odd and name not in ("causal", "custom"):  # the others hold tensors over the whole row
                continue
            cut = slice(None) if layout == "zigzag" else slice(0, length - 3)
            ref = _single(q[:, :, cut], k[:, :, cut], v[:, :, cut], gout[:, :, cut], **kw)
            for strategy in ("ring", "all_to_all"):
                got = run(kw, layout, strategy)
                if layout is odd:  # compared on the row (unshard drops the padding, whose lse is -inf)
                    got = tuple(sad.unshard(t, layout=odd) if t.dim() == 4 else
                                sad.unshard(t.unsqueeze(-1), layout=odd).squeeze(-1) for t in got)
                    results[f"padded/{strategy}/{name}"] = {
                        part: (_lse_err if part == "lse" else _rel)(a, b)
                        for part, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref, strict=True)}
                    continue
                results[f"zigzag/{strategy}/{name}"] = _errors(got, ref, layout)
    # the same structure with other tensors: no second compile
    counter = CompileCounterWithBackend("aot_eager")
    ids = torch.sort(torch.randint(0, 4, (batch, length), generator=torch.Generator().manual_seed(5)), 1).values
    fn = torch.compile(lambda q, k, v, m: sad.attention(q, k, v, layout="zigzag", mask=m, timeout=20),
                       backend=counter, fullgraph=True)
    torch._dynamo.reset()
    ql, kl, vl = (sad.shard(t, layout="zigzag") for t in (q, k, v))
    fn(ql, kl, vl, masks.document(ids) & masks.causal())
    other = fn(ql, kl, vl, masks.document(torch.flip(ids, (0,))) & masks.causal())
    eager = sad.attention(ql, kl, vl, layout="zigzag", mask=masks.document(torch.flip(ids, (0,))) & masks.causal())
    results["recompiles"] = {"frames": counter.frame_count, "second call": _rel(other, eager)}
    # dropout and sinks: the same bits as the eager distributed call with the same seed
    sinks = torch.randn(heads, dtype=torch.float64)
    for strategy in ("ring", "all_to_all"):
        both = []
        for compiled in (False, True):
            s = sinks.clone().requires_grad_()
            leaves = [sad.shard(t, layout="zigzag").requires_grad_() for t in (q, k, v)]

            def call(q, k, v, s=s, strategy=strategy):
                return sad.attention(q, k, v, layout="zigzag", strategy=strategy, causal=True, dropout_p=0.3,
                                     sinks=s, timeout=20)
            torch._dynamo.reset()
            torch.manual_seed(11)
            out = (torch.compile(call, backend="aot_eager", fullgraph=True) if compiled else call)(*leaves)
            out.backward(sad.shard(gout, layout="zigzag"))
            both.append([out.detach(), *(t.grad for t in leaves), s.grad])
        results[f"dropout+sinks/{strategy}"] = {"equal": all(torch.equal(a, b) for a, b in zip(*both, strict=True))}
    return results


def compiled_grid_worker(rank: int, world: int) -> dict:
    return compiled_worker(rank, world, grid=True)


def _sharded_with(fn, q, k, v, gout, layout) -> tuple[torch.Tensor, ...]:
    ql, kl, vl = (sad.shard(t, layout=layout).detach().requires_grad_() for t in (q, k, v))
    out, lse = fn(ql, kl, vl)
    out.backward(sad.shard(gout, layout=layout))
    return out.detach(), lse, ql.grad, kl.grad, vl.grad


def _judge_compiled(res: list[dict]) -> None:
    for r in res:
        rec = r.pop("recompiles")
        assert rec["frames"] == 1 and rec["second call"] == 0.0, rec
        drop = {case: e for case, e in r.items() if case.startswith("dropout")}
        assert all(e["equal"] for e in drop.values()), drop
        bad = {case: e for case, e in r.items() if case not in drop and max(e.values()) > F64_EXACT}
        assert not bad, bad


@pytest.mark.slow  # two ranks compiling: the single-process compile tests stay in the default run
def test_attention_compiles_fullgraph(tmp_path):
    """catches: a graph break (or an error) in context-parallel attention under torch.compile(fullgraph=True), the
    ring's transfers traced into the graph, a compiled call whose output or gradients differ from one process's, a
    recompile for every batch's mask tensors, and dropout or sinks that differ from the eager call's."""
    _judge_compiled(_spawn("compiled_worker", 2, tmp_path, limit=300))


@pytest.mark.slow
def test_attention_compiles_fullgraph_every_case(tmp_path):
    """catches: a mask or score modifier of _cases that cannot be taken apart into the op under compile."""
    _judge_compiled(_spawn("compiled_grid_worker", 2, tmp_path, limit=600))

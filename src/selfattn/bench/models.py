"""The ``models`` suite: a Llama-shaped transformers model trained on one packed row.

Hidden 512, 8 query heads, 2 key/value heads, 4 layers, random weights, vocabulary 1024 (small,
so the logits do not dwarf attention), float32. One row of ``length`` tokens packs 8 documents
(``position_ids`` restart at each), the layout of packed pre-training. A step is forward +
backward of the language-model loss, with ``attn_implementation`` set to:

- ``selfattn``: :mod:`selfattn.integrations.transformers` (a document & causal mask object);
- ``sdpa`` and ``eager``: transformers' own, which materialise the (L, L) packed mask;
- ``none``: attention replaced by passing the values through (same shapes, no mixing): what
  the rest of the model costs.

Two parts are measured: ``model``, the whole training step; and ``attention``, one layer's
attention alone as the model runs it (transformers builds the packed-row mask through the
implementation's mask function, then its attention function runs forward + backward), whose
time and peak memory are the attention part (a peak measured on the whole step may fall outside
attention, so differences of whole-step peaks would understate it).

Each point runs in its own process, so its peak memory is its own; time is the median of the
repeats, with the first (warm-up) step reported apart.

The suite also times greedy generation with the same model, selfattn vs sdpa (rows of suite
``models-generate``, see :mod:`selfattn.bench.generation`); ``--cases train`` or ``--cases generate``
runs one half.

Shape legend: L tokens in the row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
from rich.progress import Progress, TaskID
from rich.table import Table

from .llama import HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, register
from .memory import Memory

__all__ = ["DOCS", "IMPLS", "IN_ALL", "NAME", "attention_step", "grid", "measure", "model_step", "points", "run",
           "run_point", "run_suite", "tables"]

NAME = "models"
IN_ALL = False

IMPLS = ["selfattn", "sdpa", "eager", "none"]
DOCS = 8


def _document_lengths(length: int, docs: int, seed: int = 0) -> list[int]:
    """``docs`` lengths summing to ``length``, uneven (between 1/2 and 3/2 of the mean)."""
    g = torch.Generator().manual_seed(seed)
    w = 0.5 + torch.rand(docs, generator=g, dtype=torch.float64)
    sizes = (w / w.sum() * length).floor().long()
    sizes[-1] += length - int(sizes.sum())
    return sizes.tolist()


def model_step(impl: str, length: int, seed: int = 0):
    """(step, model): one forward + backward of the packed-row loss with ``impl``."""
    import transformers

    register()
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                   max_position_embeddings=length)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (1, length), generator=g)
    pos = torch.cat([torch.arange(n) for n in _document_lengths(length, DOCS, seed)]).unsqueeze(0)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        # use_cache=False: transformers finds the packed documents in position_ids only without a cache
        loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
        loss.backward()
    return step, model


def attention_step(impl: str, length: int, seed: int = 0):
    """One layer's attention part alone, as the model runs it: transformers builds the mask of the
    packed row through ``impl``'s mask function (from ``position_ids``), then ``impl``'s attention
    function runs forward + backward on (1, 8, L, 64) queries and (1, 2, L, 64) keys/values."""
    import transformers
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama import modeling_llama

    register()
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                   num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=length)
    cfg._attn_implementation = impl
    module: Any = torch.nn.Module()  # what transformers' attention functions read of a layer
    module.num_key_value_groups, module.is_causal, module.training = HEADS // KV_HEADS, True, True
    fn = modeling_llama.eager_attention_forward if impl == "eager" else transformers.AttentionInterface()[impl]
    g = torch.Generator().manual_seed(seed + 1)
    d = HIDDEN // HEADS
    q = torch.randn(1, HEADS, length, d, generator=g, requires_grad=True)
    k = torch.randn(1, KV_HEADS, length, d, generator=g, requires_grad=True)
    v = torch.randn(1, KV_HEADS, length, d, generator=g, requires_grad=True)
    pos = torch.cat([torch.arange(n) for n in _document_lengths(length, DOCS, seed)]).unsqueeze(0)
    embeds = torch.empty(1, length, HIDDEN)

    def step() -> None:
        mask = create_causal_mask(config=cfg, inputs_embeds=embeds, attention_mask=None, cache=None,
                                  position_ids=pos)
        out, _ = fn(module, q, k, v, mask, dropout=0.0, scaling=d ** -0.5)
        out.sum().backward()
        q.grad = k.grad = v.grad = None
    return step


def estimate_bytes(impl: str, length: int, part: str = "model") -> int:
    """Rough peak of the implementations that hold (L, L) tensors, to skip points that cannot fit:
    eager keeps scores and weights of every layer for the backward; sdpa builds the bool mask and
    its float form."""
    if impl == "eager":
        return (LAYERS if part == "model" else 1) * HEADS * length * length * 4 * 3
    if impl == "sdpa":
        return length * length * (1 + 4) * 2
    return 0


def run_point(impl: str, length: int, repeats: int, part: str = "model") -> dict:
    """Time and peak memory of ``repeats`` steps after one warm-up, in this process.

    part: "model" (the whole training step) or "attention" (one layer's mask and attention)."""
    step = model_step(impl, length)[0] if part == "model" else attention_step(impl, length)
    mem = Memory("cpu")
    mem.start()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = mem.stop()
    times.sort()
    median = times[len(times) // 2] if times else first
    return {"impl": impl, "length": length, "part": part, "time_s": median, "times": times, "first_s": first,
            "peak_bytes": peak}


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 0


def points(lengths: list[int], impls: list[str], parts: tuple[str, ...] = ("attention", "model")) -> list[dict]:
    """Every (part, impl, length) to measure; the "attention" part has no ``none`` baseline."""
    return [dict(suite="models", part=part, L=length, impl=impl) for part in parts for length in lengths
            for impl in impls if not (part == "attention" and impl == "none")]


def measure(point: dict, repeats: int) -> dict:
    """One point in its own process (its peak memory is its own); skipped, with why, when it would
    not fit in memory or fails."""
    impl, length, part = point["impl"], point["L"], point["part"]
    need, have = estimate_bytes(impl, length, part), _available_bytes()
    if need > 0.6 * have:
        return {"status": "skipped", "note": f"needs ~{need / 2**30:.0f} GiB of {have / 2**30:.0f} GiB available"}
    cmd = [sys.executable, "-m", "selfattn.bench.models", impl, str(length), str(repeats), part]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": "error", "note": tail[0][:200]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"status": "ok", "time_s": out["time_s"], "times": out["times"], "first_s": out["first_s"],
            "peak_bytes": out["peak_bytes"]}


def run_suite(lengths: list[int], impls: list[str], repeats: int = 1, parts: tuple[str, ...] = ("attention", "model"),
              progress: Any = None) -> list[dict]:
    """:func:`measure` every point of :func:`points`."""
    rows = []
    for point in points(lengths, impls, parts):
        if progress is not None:
            progress(f"models ({point['part']}): {point['impl']} at L={point['L']}")
        rows.append({**point, **measure(point, repeats)})
    return rows


def grid(args: argparse.Namespace) -> list[dict]:
    """The training points (``--cases train``) and the generation points (``--cases generate``); both by default."""
    from .generation import GENERATE_POINTS

    halves = args.cases or ["train", "generate"]
    impls = [i for i in IMPLS if not args.impls or i in args.impls]
    train = points(args.lengths or ([1024] if args.quick else [8192, 16384]), impls) if "train" in halves else []
    generate = [dict(suite="models-generate", cache=c, mode=m, B=b)
                for c, m, b in (GENERATE_POINTS[:1] if args.quick else GENERATE_POINTS)] if "generate" in halves else []
    return train + generate


def run(todo: list[dict], args: argparse.Namespace, progress: Progress, task: TaskID) -> list[dict]:
    """:func:`measure` every training point, :func:`~selfattn.bench.generation.measure_generate` every generation
    point."""
    from .generation import measure_generate

    out = []
    for p in todo:
        if p["suite"] == "models-generate":
            progress.update(task, description=f"models (generate) {p['mode']}, {p['cache']} cache, B={p['B']}")
            out += measure_generate((p["cache"], p["mode"], p["B"]), args.repeats or 5)
        else:
            progress.update(task, description=f"models ({p['part']}) {p['impl']} L={p['L']}")
            out.append({**p, **measure(p, args.repeats or 1)})
        progress.advance(task)
    return out


def tables(results: list[dict]) -> list[Table]:
    """One row per point: time and peak memory, each also as a ratio to transformers' sdpa."""
    table = Table(title=f"Llama-shaped model on one packed row of {DOCS} documents, fwd+bwd "
                        "(attention = one layer's mask + attention alone; model = the whole training step; "
                        "x = ratio to sdpa)")
    for col in ("part", "L", "impl", "time s", "x sdpa", "peak MiB", "x sdpa"):
        table.add_column(col)
    rows = [r for r in results if r["suite"] == "models"]
    generation = _generation_tables(results)
    if not rows:
        return generation
    sdpa = {(r["part"], r["L"]): r for r in rows if r["impl"] == "sdpa" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["part"], str(r["L"]), r["impl"], r["status"], r.get("note", ""), "", "")
            continue
        b = sdpa.get((r["part"], r["L"]))
        table.add_row(r["part"], str(r["L"]), r["impl"], f"{r['time_s']:.2f}",
                      f"{r['time_s'] / b['time_s']:.2f}x" if b else "-", f"{r['peak_bytes'] / 2**20:.0f}",
                      f"{r['peak_bytes'] / b['peak_bytes']:.2f}x" if b and b["peak_bytes"] > 0 else "-")
    return [table, *generation]


def _generation_tables(results: list[dict]) -> list[Table]:
    from .generation import NEW_TOKENS, PROMPT
    from .report import ratio_tables

    return ratio_tables(results, "models-generate", ("case", "mode", "B"), "sdpa",
                        f"Greedy generation, {PROMPT}-token prompt, {NEW_TOKENS} new tokens: time per token "
                        "(x = ratio to sdpa, per repeat: median (min-max))")


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("SELFATTN_BENCH_THREADS", torch.get_num_threads())))
    print(json.dumps(run_point(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))

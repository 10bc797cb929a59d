"""Continuous batching with selfattn's PagedKVCache: requests arrive while others are decoding.

A scheduler runs steps of at most ``--step-tokens`` tokens. Each step packs one decode token of every
running request and the next prefill chunk of the requests still reading their prompt into one call
(idx (1, T) and cu_seqlens); every block's attention appends the new keys and values to its
PagedKVCache and attends over each sequence's pages. A request is admitted once it has arrived and
the pool can hold all its tokens; its pages go back to the pool when it finishes, for the next ones.

At the end every request's tokens are checked against generating it alone (a contiguous KVCache, one
request at a time), and tokens/s are printed for both. The model is tiny_gpt's, with random weights
(seeded): the tokens mean nothing, their equality does. The exit status is 1 if a request differs.

    python examples/serve.py
    python examples/serve.py --requests 64 --step-tokens 256 --page-size 32 --json

Shape legend: T packed tokens of a step, V vocabulary.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import TinyGPT, generate

import selfattn
from selfattn import PagedKVCache


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    arrival: int  # the scheduler step at which it arrives
    seq: int = -1  # its sequence id in every block's cache, once admitted
    read: int = 0  # prompt tokens already in the cache
    out: list[int] = field(default_factory=list)


def make_requests(n: int, vocab: int, seed: int) -> list[Request]:
    """Prompts of 4-96 tokens asking for 4-40 new ones, arriving about every 2 steps (a Poisson process)."""
    g = torch.Generator().manual_seed(seed)
    reqs, step = [], 0.0
    for rid in range(n):
        step += float(torch.empty(1).exponential_(0.5, generator=g))
        length = int(torch.randint(4, 97, (1,), generator=g))
        reqs.append(Request(rid, torch.randint(vocab, (length,), generator=g).tolist(),
                            int(torch.randint(4, 41, (1,), generator=g)), int(step)))
    return reqs


def pages_for(req: Request, page_size: int) -> int:
    return math.ceil((len(req.prompt) + req.max_new) / page_size)


@torch.no_grad()
def serve(model: TinyGPT, reqs: list[Request], caches: list[PagedKVCache], step_tokens: int) -> dict:
    """Run every request to its end; returns the scheduler's counts."""
    page_size, pool = caches[0].page_size, caches[0].num_pages
    waiting = sorted(reqs, key=lambda r: r.arrival)
    running: list[Request] = []
    reserved, steps, packed, peak_pages, peak_running = 0, 0, 0, 0, 0
    while waiting or running:
        # admit what has arrived, while the pool can hold every token of it (so no step runs out of pages)
        while waiting and waiting[0].arrival <= steps and reserved + pages_for(waiting[0], page_size) <= pool:
            req = waiting.pop(0)
            ids = {cache.allocate() for cache in caches}
            assert len(ids) == 1, "every block's cache gives the same ids"
            req.seq, reserved = ids.pop(), reserved + pages_for(req, page_size)
            running.append(req)
        # one decode token per request that has read its prompt, then prefill chunks with the budget left
        batch: list[tuple[Request, list[int]]] = [(r, r.out[-1:]) for r in running if r.read == len(r.prompt)]
        budget = step_tokens - len(batch)
        for r in running:
            if r.read < len(r.prompt) and budget > 0:
                chunk = r.prompt[r.read:r.read + budget]
                batch.append((r, chunk))
                budget -= len(chunk)
        steps += 1
        if not batch:  # nothing has arrived yet
            continue
        idx = torch.tensor([t for _, chunk in batch for t in chunk])[None]  # (1, T)
        cu = torch.tensor([0] + [len(chunk) for _, chunk in batch]).cumsum(0).to(torch.int32)
        logits = model(idx, caches, seq_ids=[r.seq for r, _ in batch], cu_seqlens=cu)[0, cu[1:] - 1]  # (N, V)
        packed += idx.shape[1]
        peak_pages = max(peak_pages, pool - caches[0].num_free_pages)
        peak_running = max(peak_running, len(running))
        for (r, chunk), row in zip(batch, logits, strict=True):
            if r.read < len(r.prompt):
                r.read += len(chunk)
                if r.read < len(r.prompt):
                    continue  # the prompt's last token gives the first new one
            r.out.append(int(row.argmax()))
            if len(r.out) == r.max_new:
                for cache in caches:
                    cache.free(r.seq)
                reserved -= pages_for(r, page_size)
                running.remove(r)
    return {"steps": steps, "packed_tokens": packed, "peak_pages": peak_pages, "pool_pages": pool,
            "peak_running": peak_running}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--step-tokens", type=int, default=128, help="the most tokens one step packs")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pages", type=int, default=96, help="pages in each block's pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    args = p.parse_args(argv)
    for flag in ("requests", "step_tokens", "page_size", "pages"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.pages * args.page_size < 96 + 40:
        p.error(f"--pages x --page-size = {args.pages * args.page_size} tokens: the pool must hold one request "
                "(up to 96 + 40 tokens)")
    torch.manual_seed(args.seed)
    vocab = 64
    model = TinyGPT(vocab).eval()
    reqs = make_requests(args.requests, vocab, args.seed)
    caches = [PagedKVCache.for_module(block.attn, num_pages=args.pages, page_size=args.page_size)
              for block in model.blocks]
    new_tokens = sum(r.max_new for r in reqs)
    print(f"{len(reqs)} requests, prompts {min(len(r.prompt) for r in reqs)}-{max(len(r.prompt) for r in reqs)} "
          f"tokens, {new_tokens} new tokens in all; pools of {args.pages} pages x {args.page_size} tokens per "
          f"block; steps of <= {args.step_tokens} tokens; selfattn {selfattn.__version__}")

    t0 = time.perf_counter()
    counts = serve(model, reqs, caches, args.step_tokens)
    batched_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = [generate(model, torch.tensor([r.prompt]), r.max_new, use_cache=True) for r in reqs]
    alone_s = time.perf_counter() - t0

    differ = [r.rid for r, want in zip(reqs, alone, strict=True) if r.out != want]
    print(f"continuous batching: {new_tokens / batched_s:8.1f} tokens/s ({batched_s:.2f} s, {counts['steps']} "
          f"steps, up to {counts['peak_running']} requests at once, peak {counts['peak_pages']} of "
          f"{counts['pool_pages']} pages)")
    print(f"one at a time:       {new_tokens / alone_s:8.1f} tokens/s ({alone_s:.2f} s, KVCache per request)")
    print(f"every request's tokens equal generating it alone: {not differ}"
          + (f" (requests {differ} differ)" if differ else ""))
    summary = {"requests": len(reqs), "new_tokens": new_tokens, "batched_tokens_per_s": new_tokens / batched_s,
               "alone_tokens_per_s": new_tokens / alone_s, "equal_to_alone": not differ, **counts}
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["equal_to_alone"] else 1)

"""Greedy generation with the ``models`` suite's Llama-shaped model: selfattn vs transformers' sdpa.

The same model (weights shared by selfattn and sdpa, vocabulary 1024) greedily generates
:data:`NEW_TOKENS` tokens after a :data:`PROMPT`-token prompt, B = 1 and 8, with a dynamic and a
static cache in eager mode, and with a static cache and the forward compiled by ``generate``
(``CompileConfig(fullgraph=True)``, inductor). selfattn and sdpa run in one process, timed in turns
(:func:`~selfattn.bench.timing.time_interleaved`), so their ratio is taken repeat by repeat; the time
is per generated token (the whole ``generate`` call, prefill included, over :data:`NEW_TOKENS`); the
first call (compilation, for the compiled points) is reported apart, and whether the two produced
the same tokens. Rows are of suite ``models-generate``.

The ``continuous`` point serves :data:`CB_REQUESTS` requests with prompts of 32 to :data:`PROMPT` tokens
through transformers' continuous batching (``generate_batch``, its paged cache, steps of at most
:data:`CB_STEP_TOKENS` tokens); its time per token is the whole call over :data:`NEW_TOKENS` as for the
others, so its inverse times B is the tokens/s of the batch.

Shape legend: B batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from .llama import HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, register

__all__ = ["GENERATE_IMPLS", "GENERATE_POINTS", "NEW_TOKENS", "PROMPT", "generate_call", "measure_generate",
           "run_generate_point"]

PROMPT, NEW_TOKENS = 256, 48
GENERATE_IMPLS = ("selfattn", "sdpa")
# (cache, mode, B): eager generation with each cache, and generate()'s compiled forward (static cache)
CB_REQUESTS, CB_STEP_TOKENS = 16, 256
GENERATE_POINTS = [(cache, "eager", b) for cache in ("dynamic", "static") for b in (1, 8)] + [
    ("static", "compiled", b) for b in (1, 8)] + [("paged", "continuous", CB_REQUESTS)]


def generate_call(impl: str, batch: int, cache: str, mode: str, seed: int = 0):
    """(call, model): ``call()`` greedily generates :data:`NEW_TOKENS` tokens after a :data:`PROMPT`-token
    prompt for ``batch`` sequences and returns them."""
    import transformers

    register()
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                   max_position_embeddings=PROMPT + NEW_TOKENS)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens
    g = torch.Generator().manual_seed(seed + 1)
    if mode == "continuous":
        return _continuous_call(model, batch, g), model
    ids = torch.randint(0, VOCAB, (batch, PROMPT), generator=g)
    kwargs: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    if mode == "compiled":
        config = transformers.CompileConfig(fullgraph=True)
        # transformers 5.24: generate() compiles on a CPU only with this flag (declared `= None`, so typed None)
        config._compile_all_devices = True  # type: ignore[assignment]
        kwargs["compile_config"] = config
    else:
        kwargs["disable_compile"] = True

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, **kwargs)
    return call, model


def _continuous_call(model: Any, requests: int, g: torch.Generator) -> Any:
    """``call()`` serves ``requests`` prompts of 32 to PROMPT tokens through ``generate_batch`` and returns
    their tokens (requests, NEW_TOKENS)."""
    import transformers

    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(32, PROMPT + 1, (requests,), generator=g)]
    config = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0)
    pages = requests * -(-(PROMPT + NEW_TOKENS) // 32)
    batching = transformers.ContinuousBatchingConfig(num_blocks=pages + 8, page_size=32,
                                                     max_batch_tokens=CB_STEP_TOKENS)

    def call() -> torch.Tensor:
        with torch.inference_mode():
            out = model.generate_batch(inputs=prompts, generation_config=config,
                                       continuous_batching_config=batching)
        return torch.tensor([list(out[f"req_{i}"].generated_tokens) for i in range(requests)])
    return call


def run_generate_point(cache: str, mode: str, batch: int, repeats: int) -> list[dict]:
    """selfattn and sdpa generating, timed in turns in this process: one row per implementation."""
    from .timing import time_interleaved

    calls, first, tokens = {}, {}, {}
    for impl in GENERATE_IMPLS:
        calls[impl] = generate_call(impl, batch, cache, mode)[0]
        t0 = time.perf_counter()
        tokens[impl] = calls[impl]()  # warm-up (compiles, for the compiled points)
        first[impl] = time.perf_counter() - t0
    timings = time_interleaved(calls, repeats, "cpu", warmup=0)
    same = all(torch.equal(tokens[impl], tokens[GENERATE_IMPLS[0]]) for impl in GENERATE_IMPLS)
    return [{"impl": impl, "case": f"{cache} cache", "mode": mode, "B": batch, "L": PROMPT,
             "time_s": timings[impl].median / NEW_TOKENS, "times": [t / NEW_TOKENS for t in timings[impl].times],
             "first_s": first[impl], "same_tokens": same} for impl in GENERATE_IMPLS]


def measure_generate(point: tuple[str, str, int], repeats: int) -> list[dict]:
    """One generation point (both implementations) in its own process; rows of suite ``models-generate``
    with their ratios to sdpa."""
    from .ratios import attach_ratios

    cache, mode, batch = point
    cmd = [sys.executable, "-m", "selfattn.bench.generation", cache, mode, str(batch), str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    base = {"suite": "models-generate", "case": f"{cache} cache", "mode": mode, "B": batch, "L": PROMPT}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return [{**base, "impl": impl, "status": "error", "note": tail[0][:200]} for impl in GENERATE_IMPLS]
    rows = [{**base, **r, "status": "ok"} for r in json.loads(proc.stdout.strip().splitlines()[-1])]
    attach_ratios(rows, "models-generate", ("case", "mode", "B"), ("sdpa",))
    return rows


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("SELFATTN_BENCH_THREADS", torch.get_num_threads())))
    print(json.dumps(run_generate_point(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))

"""One benchmark point, run in a fresh process: ``python -m selfattn.bench.worker '<json spec>'``.

A fresh process per point makes the peak-memory reading its own: on the CPU the kernel's
high-water mark (VmHWM) is reset after the warm-up and read after one step; on CUDA the
allocator's peak is used. Prints one JSON line: time_s (median), times, spread, first_s, peak_bytes.

Shape legend: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import selfattn
from selfattn import masks

from .anchors import compiled_flex, flex_block_mask, textbook_attention
from .timing import Timing, sync, time_call, time_one

WINDOW = 256
DOCS = 8


@dataclass
class MaskCase:
    batch: int
    mask: masks.Mask | None
    mask_mod: Callable | None  # the same predicate for FlexAttention
    lengths: Tensor | None = None  # padding+causal: real length of each batch item


def mask_case(name: str, length: int, device: str) -> MaskCase:
    if name == "causal":
        return MaskCase(1, masks.causal(), lambda b, h, q, kv: q >= kv)
    if name == "padding+causal":
        lengths = torch.tensor([length, length // 2], device=device)
        return MaskCase(2, masks.padding(lengths) & masks.causal(),
                        lambda b, h, q, kv: (kv < lengths[b]) & (q >= kv), lengths)
    if name == "padding(queries)+causal":  # padded query rows skipped too: their outputs are discarded
        lengths = torch.tensor([length, length // 2], device=device)
        return MaskCase(2, masks.padding(lengths, queries=True) & masks.causal(),
                        lambda b, h, q, kv: (kv < lengths[b]) & (q < lengths[b]) & (q >= kv), lengths)
    if name == f"sliding_window({WINDOW})":
        return MaskCase(1, masks.sliding_window(WINDOW), lambda b, h, q, kv: (kv <= q) & (q - kv <= WINDOW))
    if name == f"document({DOCS} docs)":
        ids = torch.arange(length, device=device) * DOCS // length
        return MaskCase(1, masks.document(ids), lambda b, h, q, kv: ids[q] == ids[kv])
    if name == "dense":
        return MaskCase(1, None, None)
    raise ValueError(f"unknown mask case {name!r}")


MASK_CASES = ["causal", "padding+causal", "padding(queries)+causal", f"sliding_window({WINDOW})",
              f"document({DOCS} docs)", "dense"]


class _Memory:
    """Peak extra memory of what runs between start() and stop()."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the high-water mark to the current resident size
            self.base = self._status("VmRSS")

    def stop(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base


def make_step(fn: Callable[[], Tensor], params: list[Tensor], backward: bool) -> Callable[[], None]:
    """One timed step: fn() under no_grad, or fn().sum().backward() with fresh gradients."""
    def step() -> None:
        if backward:
            for p in params:
                p.grad = None
            fn().sum().backward()
        else:
            with torch.no_grad():
                fn()
    return step


def _attention_step(spec: dict, small: bool) -> tuple[Callable[[], Callable[[], None]], list[Tensor]]:
    """(prepare, inputs): prepare() builds what the implementation needs and returns the step."""
    length = 256 if small else spec["L"]
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    h, d, impl, backward = spec["H"], spec["D"], spec["impl"], spec["mode"] == "fwd+bwd"
    case = mask_case(spec["case"], length, device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(case.batch, h, length, d, generator=g, device=device, dtype=dtype)
               .requires_grad_(backward) for _ in range(3))

    def run(fn: Callable[[], Tensor]) -> Callable[[], None]:
        return make_step(fn, [q, k, v], backward)

    def prepare() -> Callable[[], None]:
        if impl in ("selfattn", "chunked"):
            backend = "auto" if impl == "selfattn" else "chunked"
            return run(lambda: selfattn.attention(q, k, v, mask=case.mask, backend=backend))
        if impl == "sdpa":
            if spec["case"] == "causal":
                return run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            dense = None if case.mask is None else case.mask.dense(length, length, device)
            return run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
        if impl == "sdpa-causal":
            return run(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        if impl == "sdpa-causal-valid":
            assert case.lengths is not None
            lens = [int(n) for n in case.lengths]

            def per_item() -> Tensor:
                outs = [F.scaled_dot_product_attention(q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n],
                                                       is_causal=True) for i, n in enumerate(lens)]
                return torch.cat([o.sum().reshape(1) for o in outs])
            return run(per_item)
        if impl == "textbook":
            dense = None if case.mask is None else case.mask.dense(length, length, device)
            return run(lambda: textbook_attention(q, k, v, dense))
        if impl == "flex":
            block_mask = flex_block_mask(case.mask_mod, case.batch, length, device)
            flex = compiled_flex()
            return run(lambda: flex(q, k, v, block_mask=block_mask))
        raise ValueError(f"unknown implementation {impl!r}")

    return prepare, [q, k, v]


def run_point(spec: dict) -> dict:
    build = _attention_step
    device = spec["device"]
    # warm-up: kernels, allocator and (flex) compilation; at full size only where compilation needs it
    warm_prepare, _ = build(spec, small=spec.get("impl") != "flex")
    warm_prepare()()
    sync(device)
    del warm_prepare
    prepare, _inputs = build(spec, small=False)
    mem = _Memory(device)
    mem.start()
    step = prepare()
    first = time_call(step, device)
    peak = mem.stop()
    budget = spec.get("seconds", 10.0)  # repeat until about this much time is spent, or `repeats`
    repeats = min(spec["repeats"], int(budget / max(first, 1e-6)))
    timing = time_one(step, repeats, device, warmup=0)
    if not timing.times:  # one run already took the whole budget: it is the measurement
        timing = Timing([first])
    return {"time_s": timing.median, "times": timing.times, "spread": timing.spread, "first_s": first,
            "peak_bytes": peak}


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        result = run_point(spec)
    except Exception as e:  # report, the parent shows it in the table
        result = {"error": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Masks-suite measurements, run in a fresh process: ``python -m selfattn.bench.worker '<json spec>'``.

Two kinds of spec, because time and memory need different conditions:

- ``"impls": [...]`` (:func:`time_group`): every implementation of one point (case, mode, L) is
  built in this one process and timed in turns (:func:`selfattn.bench.timing.time_interleaved`),
  so a ratio between two of them compares repeats that saw the same machine noise, repeat by
  repeat. Prints ``{impl: {time_s, times, spread, first_s} | {error}}``.
- ``"impl": name`` (:func:`measure_memory`): one implementation alone, so the peak-memory reading
  is its own: on the CPU the kernel's high-water mark (VmHWM) is reset after the warm-up and read
  after one step; on CUDA the allocator's peak is used. Prints ``{peak_bytes, first_s}``.

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
from .memory import Memory
from .timing import Timing, sync, time_call, time_interleaved

WINDOW = 256
DOCS = 8
MIN_ROUNDS = 3  # interleaved rounds of a point, at least (unless one round is longer than LONG_ROUND_S)
LONG_ROUND_S = 60.0


@dataclass
class MaskCase:
    batch: int
    mask: masks.Mask | None
    mask_mod: Callable | None  # the same predicate for FlexAttention
    lengths: Tensor | None = None  # padding+causal: real length of each batch item
    cu_seqlens: Tensor | None = None  # the varlen case: where each packed document starts (N + 1,)


def mask_case(name: str, length: int, device: str) -> MaskCase:
    """The mask of case ``name`` at length L, its FlexAttention ``mask_mod`` and its batch."""
    if name == "causal":
        return MaskCase(1, masks.causal(), lambda b, h, q, kv: q >= kv)
    if name in PADDED_LENGTHS:  # keys-only padding: padded query rows are computed (and discarded)
        lengths = torch.tensor([int(f * length) for f in PADDED_LENGTHS[name]], device=device)
        return MaskCase(len(lengths), masks.padding(lengths) & masks.causal(),
                        lambda b, h, q, kv: (kv < lengths[b]) & (q >= kv), lengths)
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
    if name == VARLEN:
        cu = varlen_cu_seqlens(length, device)
        ids = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), cu[1:] - cu[:-1])
        return MaskCase(1, masks.document(ids) & masks.causal(),
                        lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv), cu_seqlens=cu)
    if name == "dense":
        return MaskCase(1, None, None)
    raise ValueError(f"unknown mask case {name!r}")


# the padded batches the README tracks: each item's real length as a fraction of L
PADDED_LENGTHS = {"padding(L)+causal": (1.0,), "padding(3L/4)+causal": (0.75,),
                  "padding(3L/4,L)+causal": (0.75, 1.0)}
# the varlen case: documents of mixed lengths packed in one row, as shares of L (the last takes the rest)
VARLEN = f"varlen({DOCS} mixed docs)+causal"
VARLEN_SHARES = (0.30, 0.02, 0.15, 0.05, 0.25, 0.08, 0.10)
VARLEN_IMPLS = ("document", "sdpa-padded")  # implementations of the varlen case only
MASK_CASES = ["causal", "padding+causal", "padding(queries)+causal", *PADDED_LENGTHS, f"sliding_window({WINDOW})",
              f"document({DOCS} docs)", VARLEN, "dense"]


def varlen_cu_seqlens(length: int, device: str) -> Tensor:
    """cu_seqlens (DOCS + 1,) int32 of the varlen case at length L."""
    lengths = [int(f * length) for f in VARLEN_SHARES]
    lengths.append(length - sum(lengths))
    return F.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0)).to(torch.int32)


def case_batch(name: str) -> int:
    """B of a mask case (without building its tensors)."""
    if name in PADDED_LENGTHS:
        return len(PADDED_LENGTHS[name])
    return 2 if name.startswith("padding") else 1


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
        if case.cu_seqlens is not None:
            return run(_varlen_impl(impl, q, k, v, case))
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


def _varlen_impl(impl: str, q: Tensor, k: Tensor, v: Tensor, case: MaskCase) -> Callable[[], Tensor]:
    """The varlen case's implementations, each from the packed (1, H, L, D) inputs: selfattn's
    varlen_attention on (L, H, D) views of them (auto, chunked), attention with the document mask it
    equals, SDPA with that mask dense, SDPA is_causal on the documents padded to the longest (padding
    and unpadding included), is_causal over the whole row (the unmasked cost), flex, textbook."""
    assert case.cu_seqlens is not None and case.mask is not None and case.mask_mod is not None
    cu = case.cu_seqlens
    length = q.shape[2]
    pq, pk, pv = (t[0].transpose(0, 1) for t in (q, k, v))  # (L, H, D) views
    if impl in ("selfattn", "chunked"):
        backend = "auto" if impl == "selfattn" else "chunked"
        return lambda: selfattn.varlen_attention(pq, pk, pv, cu, causal=True, backend=backend)
    if impl == "document":
        return lambda: selfattn.attention(q, k, v, mask=case.mask)
    if impl in ("sdpa", "textbook"):
        dense = case.mask.dense(length, length, q.device)
        if impl == "textbook":
            return lambda: textbook_attention(q, k, v, dense)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    if impl == "sdpa-padded":
        spans = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
        longest = max(b - a for a, b in spans)

        def padded() -> Tensor:
            qp, kp, vp = (torch.stack([F.pad(t[0, :, a:b], (0, 0, 0, longest - (b - a))) for a, b in spans])
                          for t in (q, k, v))  # (N, H, longest, D)
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True)
            return torch.cat([out[i, :, :b - a] for i, (a, b) in enumerate(spans)], dim=1)  # (H, L, D)
        return padded
    if impl == "sdpa-causal":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if impl == "flex":
        block_mask = flex_block_mask(case.mask_mod, 1, length, str(q.device))
        flex = compiled_flex()
        return lambda: flex(q, k, v, block_mask=block_mask)
    raise ValueError(f"unknown implementation {impl!r} for {VARLEN}")


def _warm_step(spec: dict, device: str) -> None:
    """Run one step untimed: kernels, allocator and (flex) compilation. Small inputs do, except
    for flex, whose compiled kernel is specialised to the full shape."""
    warm_prepare, _ = _attention_step(spec, small=spec["impl"] != "flex")
    warm_prepare()()
    sync(device)


def measure_memory(spec: dict) -> dict:
    """Peak extra memory of one step of ``spec["impl"]``, alone in this process (and that step's time)."""
    device = spec["device"]
    _warm_step(spec, device)
    prepare, _inputs = _attention_step(spec, small=False)
    mem = Memory(device)
    mem.start()
    step = prepare()
    first = time_call(step, device)
    return {"peak_bytes": mem.stop(), "first_s": first}


def time_group(spec: dict) -> dict[str, dict]:
    """Time every implementation of ``spec["impls"]`` at one point, in turns in this process.

    Each is warmed up and run once (``first_s``); then rounds of one step each are timed until
    about ``spec["seconds"]`` per implementation is spent: at least ``MIN_ROUNDS`` (a spread needs
    several) and at most ``spec["repeats"]``. When a single round takes longer than that budget
    and than ``LONG_ROUND_S`` (the longest lengths), those first runs are the measurement. An
    implementation that raises gets ``{"error": ...}`` and the others are still timed.
    """
    device = spec["device"]
    steps: dict[str, Callable[[], None]] = {}
    first: dict[str, float] = {}
    out: dict[str, dict] = {}
    for impl in spec["impls"]:
        one = dict(spec, impl=impl)
        try:
            _warm_step(one, device)
            prepare, _inputs = _attention_step(one, small=False)
            steps[impl] = prepare()
            first[impl] = time_call(steps[impl], device)
        except Exception as e:  # reported in the table; the other implementations still run
            steps.pop(impl, None)
            out[impl] = {"error": f"{type(e).__name__}: {e}"[:500]}
            gc.collect()
    if steps:
        budget = spec.get("seconds", 10.0) * len(steps)
        one_round = sum(first.values())
        rounds = (0 if one_round > max(budget, LONG_ROUND_S)
                  else min(spec["repeats"], max(MIN_ROUNDS, int(budget / one_round))))
        if rounds > 0:
            timings = time_interleaved(steps, rounds, device, warmup=0)
        else:  # one round took the whole budget: it is the measurement
            timings = {impl: Timing([first[impl]]) for impl in steps}
        for impl, t in timings.items():
            out[impl] = {"time_s": t.median, "times": t.times, "spread": t.spread, "first_s": first[impl]}
    return {impl: out[impl] for impl in spec["impls"]}


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        result: dict = time_group(spec) if "impls" in spec else measure_memory(spec)
    except Exception as e:  # report, the parent shows it in the table
        result = {"error": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

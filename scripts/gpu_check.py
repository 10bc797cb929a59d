"""GPU check: every backend against float64 in bf16 and fp16, then selfattn vs raw SDPA and FlexAttention.

    python scripts/gpu_check.py                 # on a CUDA machine: L 4k..32k, H=16, D=128
    python scripts/gpu_check.py --device cpu --quick   # the same logic on tiny sizes (a smoke test)

Part 1 runs every backend on awkward shapes and masks in bfloat16 and float16 and holds it to the
test suite's rule (selfattn.testing): error <= 2x that of the same plain math in that dtype (vs the
float64 oracle), plus ulps.
Part 2 times forward and forward+backward of selfattn ``auto``, raw SDPA (is_causal, or a dense
mask) and compiled FlexAttention on causal, sliding-window and packed-document (causal) masks,
and prints TFLOP/s (counting only visible (query, key) pairs) and ratios, next to the measured
bf16 matrix-multiply rate of the device.

Shape legend: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

import selfattn
from selfattn import masks, testing
from selfattn.backends import REGISTRY
from selfattn.bench.timing import time_one


def correctness(device: str, quick: bool) -> bool:
    print("== 1. every backend vs float64 (rule: err <= 2 x naive + 16 ulp) ==")
    ok = True
    shapes = [(2, 8, 2, 113, 203, 64)] + ([] if quick else [(1, 8, 8, 1023, 1024, 128)])
    cases = {"causal-br": masks.causal("bottom_right"), "window": masks.sliding_window(50),
             "doc&causal": masks.document(torch.arange(203) // 60) & masks.causal("bottom_right")}
    for dtype in (torch.bfloat16, torch.float16):
        for b, hq, hkv, lq, lk, d in shapes:
            g = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(b, hq, lq, d, device=device, generator=g)
            k = torch.randn(b, hkv, lk, d, device=device, generator=g)
            v = torch.randn(b, hkv, lk, d, device=device, generator=g)
            for name, mask in cases.items():
                if name == "doc&causal" and lk != 203:
                    mask = masks.document(torch.arange(lk) // 300) & masks.causal("bottom_right")
                ref = testing.reference_attention(q, k, v, mask=mask)
                naive = testing.reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask, dtype=None,
                                                    safe=False)
                for backend in REGISTRY:
                    try:
                        with torch.no_grad():
                            out = selfattn.attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask,
                                                     backend=backend)
                    except ValueError as e:
                        print(f"  {str(dtype)[6:]:8s} {(b, hq, hkv, lq, lk, d)!s:28s} {name:10s} "
                              f"{backend:9s} not run: {e}")
                        continue
                    c = testing.compare_to_reference(out, ref, naive, name=backend)
                    ok &= c.ok
                    print(f"  {str(dtype)[6:]:8s} {(b, hq, hkv, lq, lk, d)!s:28s} {name:10s} {backend:9s} "
                          f"err {c.error:.2e}  bar {c.tolerance:.2e}  {'ok' if c.ok else 'FAIL'}")
    return ok


def varlen_correctness(device: str) -> bool:
    """varlen_attention in every backend (on CUDA, auto and sdpa take torch's varlen flash kernel): the forward
    against the float64 oracle of each sequence alone, max abs error under 2e-2 (bf16) / 4e-3 (fp16)."""
    print("== 1b. varlen_attention vs float64 per sequence (forward) ==")
    ok = True
    lq, lk = [300, 0, 17, 129, 64], [300, 5, 40, 129, 0]  # self, cross with more keys, empty sides
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(sum(lq), 8, 64, device=device, generator=g)
    k, v = (torch.randn(sum(lk), 2, 64, device=device, generator=g) for _ in range(2))
    for dtype in (torch.bfloat16, torch.float16):
        for causal, window in ((True, None), (False, (31, 8)), (True, (63, 0))):
            ref_out = []
            a = c = 0
            for nq, nk in zip(lq, lk, strict=True):
                if nq and nk:
                    i = torch.arange(nq, device=device)[:, None] + nk - nq
                    j = torch.arange(nk, device=device)[None, :]
                    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
                    if causal:
                        keep &= j <= i
                    if window is not None:
                        keep &= (j >= i - window[0]) & (j <= i + window[1])
                    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[a:a + nq], k[c:c + nk], v[c:c + nk]))
                    ref_out.append(testing.reference_attention(qs, ks, vs, mask=keep)[0].transpose(0, 1))
                elif nq:
                    ref_out.append(torch.zeros(nq, 8, 64, device=device, dtype=torch.float64))
                a, c = a + nq, c + nk
            ref = torch.cat(ref_out)
            for backend in [*REGISTRY, "auto"]:
                try:
                    explain = selfattn.varlen_explain(q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k,
                                                      causal=causal, window=window, backend=backend)
                    out = selfattn.varlen_attention(q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k, causal=causal,
                                                    window=window, backend=backend)
                except ValueError as e:
                    print(f"  {str(dtype)[6:]:8s} causal={causal!s:5s} window={window!s:8s} {backend:9s} not run: {e}")
                    continue
                err = float((out.double() - ref).abs().max())
                good = err < (2e-2 if dtype == torch.bfloat16 else 4e-3)
                ok &= good
                print(f"  {str(dtype)[6:]:8s} causal={causal!s:5s} window={window!s:8s} {backend:9s} "
                      f"({explain.backend}) max err {err:.2e} {'ok' if good else 'FAIL'}")
    return ok


def matmul_rate(device: str, quick: bool) -> float:
    n = 1024 if quick else 8192
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    t = time_one(lambda: a @ b, 5 if quick else 20, device).median
    return 2 * n**3 / t / 1e12


def _visible_pairs(case: str, length: int, window: int, docs: int) -> float:
    if case == "causal":
        return length * (length + 1) / 2
    if case == "window":
        return sum(min(i + 1, window + 1) for i in range(length))
    m = length // docs
    return docs * m * (m + 1) / 2


def _impls(q, k, v, mask, dense, block_mask, flex, mode: str) -> dict[str, Callable[[], None]]:
    calls = {
        "selfattn": lambda: selfattn.attention(q, k, v, mask=mask),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=dense is None, attn_mask=dense),
        "flex": lambda: flex(q, k, v, block_mask=block_mask),
    }

    def step(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            if mode == "fwd":
                with torch.no_grad():
                    fn()
            else:
                fn().sum().backward()
        return run

    return {name: step(fn) for name, fn in calls.items()}


def speed(device: str, quick: bool) -> None:
    print("\n== 2. speed: selfattn auto vs raw SDPA vs compiled FlexAttention ==")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    rate = matmul_rate(device, quick)
    print(f"measured matmul rate: {rate:.1f} TFLOP/s ({'bf16' if device.startswith('cuda') else 'fp32'})")
    b, h, d = (1, 2, 32) if quick else (1, 16, 128)
    lengths = [256, 512] if quick else [4096, 8192, 16384, 32768]
    window, docs = (64, 4) if quick else (1024, 8)
    dtype = torch.bfloat16
    backward_modes = ["fwd", "fwd+bwd"] if device.startswith("cuda") else ["fwd"]
    header = (f"{'case':8s} {'mode':8s} {'L':>6s} | {'selfattn':>16s} | {'sdpa':>16s} | {'flex':>16s} | "
              f"{'auto/best':>9s} {'%matmul':>8s}")
    print(header)
    for case in ("causal", "window", "document"):
        for length in lengths:
            ids = torch.arange(length, device=device) * docs // length
            mask = {"causal": masks.causal(), "window": masks.sliding_window(window),
                    "document": masks.document(ids) & masks.causal()}[case]
            mod = {"causal": lambda b_, h_, q, kv: q >= kv,
                   "window": lambda b_, h_, q, kv: (q >= kv) & (q - kv <= window),
                   "document": lambda b_, h_, q, kv, ids=ids: (ids[q] == ids[kv]) & (q >= kv)}[case]
            block_mask = create_block_mask(mod, None, None, length, length, device=device)
            dense = None if case == "causal" else mask.dense(length, length, device)
            for mode in backward_modes:
                q, k, v = (torch.randn(b, h, length, d, device=device, dtype=dtype, requires_grad=mode != "fwd")
                           for _ in range(3))
                impls = _impls(q, k, v, mask, dense, block_mask, flex, mode)
                flops = 4 * b * h * d * _visible_pairs(case, length, window, docs) * (1 if mode == "fwd" else 3.5)
                times = {}
                for name, fn in impls.items():
                    try:
                        times[name] = time_one(fn, 3 if quick else 10, device).median
                    except Exception as e:  # report and go on: one anchor failing must not hide the rest
                        print(f"  {name} failed: {type(e).__name__}: {str(e)[:120]}")
                cells = [f"{times[n] * 1e3:7.2f}ms {flops / times[n] / 1e12:6.1f}T" if n in times else f"{'-':>16s}"
                         for n in impls]
                best = min(times.get("sdpa", math.inf), times.get("flex", math.inf))
                ratio = times["selfattn"] / best if "selfattn" in times and best < math.inf else float("nan")
                pct = 100 * flops / times["selfattn"] / 1e12 / rate if "selfattn" in times else float("nan")
                print(f"{case:8s} {mode:8s} {length:6d} | " + " | ".join(cells) + f" | {ratio:9.2f} {pct:7.0f}%")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test of the script)")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (use --device cpu --quick for a smoke test)")
        return 2
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    ok = correctness(args.device, args.quick)
    ok &= varlen_correctness(args.device)
    speed(args.device, args.quick)
    print("\ncorrectness:", "all backends within the rule" if ok else "FAILURES above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

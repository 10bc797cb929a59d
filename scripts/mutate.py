"""The doctor's mutation score and false-alarm count on the seed tutorial's classes and other styles.

    .venv/bin/python scripts/mutate.py            # all modules, 20 seeds of false-alarm checks
    .venv/bin/python scripts/mutate.py --seeds 3  # quicker

For each module: mutants of its source (selfattn.check.mutate), the kill rate over non-equivalent
mutants, the survivors; then the original checked with seeds 0..N-1, counting error findings it
should not get (the tutorial's classes do get half-precision-overflow: their -1e9 fill does not
fit in float16, a true finding, not counted as a false alarm).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from selfattn.check import check  # noqa: E402
from selfattn.check.mutate import score  # noqa: E402
from selfattn.check.target import load_class  # noqa: E402

MODULES = {  # file:Class -> (style, error ids expected on the original)
    "tests/seed_models.py:TutorialSelfAttention": ("seed tutorial, single head, (B, L, L) 1/0 mask",
                                                   {"half-precision-overflow"}),
    "tests/seed_models.py:TutorialOptimizedSelfAttention": ("seed tutorial, fused qkv, bmm",
                                                            {"half-precision-overflow"}),
    "tests/seed_models.py:TutorialMultiHeadAttention": ("seed tutorial, multi-head", {"half-precision-overflow"}),
    "tests/doctor_fixtures.py:HFStyleAdditive": ("Hugging Face style: hidden_states, additive attention_mask, "
                                                 "tuple output", set()),
    "tests/doctor_fixtures.py:KeyPaddingMask": ("x-transformers style: (B, L) bool key mask", set()),
    "tests/doctor_fixtures.py:CausalCorrect": ("causal, triu mask built in", set()),
    "tests/doctor_fixtures.py:RelativeBias": ("learned relative-position bias (T5/Swin)", set()),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20, help="seeds of the false-alarm check on the originals")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    results = []
    for spec, (style, expected) in MODULES.items():
        t = time.perf_counter()
        s = score(str(ROOT / spec))
        alarms = []
        for seed in range(args.seeds):
            extra = {f.id for f in check(load_class(str(ROOT / spec)), seed=seed).findings
                     if f.severity == "error"} - expected
            if extra:
                alarms.append({"seed": seed, "ids": sorted(extra)})
        row = {"module": spec, "style": style, "mutants": s.total, "stillborn": s.stillborn,
               "equivalent": s.equivalent, "non_equivalent": s.non_equivalent, "killed": s.killed,
               "kill_rate": round(s.rate, 4), "killed_by": s.killed_by, "survivors": s.survivors,
               "false_alarms": alarms, "seeds": args.seeds, "seconds": round(time.perf_counter() - t, 1)}
        results.append(row)
        print(f"{spec} ({style}): {s.killed}/{s.non_equivalent} non-equivalent mutants named "
              f"({100 * s.rate:.1f}%), {s.equivalent} equivalent, {s.stillborn} stillborn; "
              f"false alarms over {args.seeds} seeds: {len(alarms)}; {row['seconds']} s", flush=True)
        for sv in s.survivors:
            print(f"    survivor: {sv['operator']} at {sv['where']} -> {sv['findings']}")
    killed = sum(r["killed"] for r in results)
    total = sum(r["non_equivalent"] for r in results)
    print(f"all: {killed}/{total} ({100 * killed / max(total, 1):.1f}%); false alarms: "
          f"{sum(len(r['false_alarms']) for r in results)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if killed >= 0.95 * total and not any(r["false_alarms"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

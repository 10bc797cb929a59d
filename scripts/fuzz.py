"""The long fuzzing profile: run the property-based differential tests until a time budget is spent.

    python scripts/fuzz.py --seconds 3600        # or: make fuzz FUZZ_SECONDS=3600

Examples are random (not the fixed-seed default profile) and every failure hypothesis finds is kept
in its database under .hypothesis/, so the next run replays it first. Prints, per backend, how many
calls ran and how many were declined, and every failure with its minimal example; exits 1 if any.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="time budget (default 600)")
    parser.add_argument("--chunk", type=int, default=200, help="examples per test between progress reports")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the calls are small)")
    args = parser.parse_args()
    os.environ["SELFATTN_FUZZ"] = "1"
    os.environ["SELFATTN_EXAMPLES"] = str(args.chunk)
    os.chdir(ROOT)

    import torch

    torch.set_num_threads(args.threads)
    import conftest  # noqa: F401  (registers and loads the hypothesis profiles)
    import fuzzing
    import test_fuzz

    tests = [(f"oracle[{b}]", lambda b=b: test_fuzz.test_backend_matches_oracle(b)) for b in test_fuzz.BACKENDS]
    tests += [("without_autograd", test_fuzz.test_without_autograd),
              ("backends_agree", test_fuzz.test_backends_agree),
              ("dropout", test_fuzz.test_dropout_is_reproducible_and_exact),
              ("autocast", test_fuzz.test_autocast)]
    failures: list[str] = []
    start, rounds = time.monotonic(), 0
    while time.monotonic() - start < args.seconds:
        rounds += 1
        for name, test in tests:
            if time.monotonic() - start >= args.seconds:
                break
            try:
                test()
            except Exception as e:  # a falsified property: keep its report and go on searching
                notes = "\n".join(getattr(e, "__notes__", []))
                failures.append(f"{name}: {type(e).__name__}: {e}\n{notes}")
                print(failures[-1], flush=True)
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(fuzzing.COUNTS.items()))
        print(f"[{time.monotonic() - start:7.0f} s] round {rounds}: {counts}", flush=True)
    print(f"done: {len(failures)} failure(s) in {time.monotonic() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

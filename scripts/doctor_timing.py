"""Time the doctor over the correct corpus: seconds per module, and per probe, at the default sizes.

    .venv/bin/python scripts/doctor_timing.py                  # every correct corpus module, seed 0
    .venv/bin/python scripts/doctor_timing.py --json out.json  # also the rows

Each module is checked once in this process (after one warm-up check, so that imports and torch's first
calls are not charged to the first module) with torch limited to ``--threads`` threads (2 by default,
as on CI). Prints the median and the maximum per module, the slowest modules, the probes that take
the most time in total, and any module whose verdict is not "passed" (a false alarm, or a corpus
module that needs a fix; the findings a corpus entry knows to be true of it count as passed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="*", help="only these corpus entries")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)

    import doctor_corpus as dc
    import torch

    torch.set_num_threads(args.threads)
    names = args.only or dc.CORRECT
    dc.check_entry(dc.CORPUS[names[0]], seed=args.seed)  # warm-up
    rows = []
    for name in names:
        t = time.perf_counter()
        try:
            report = dc.check_entry(dc.CORPUS[name], seed=args.seed)
            errors = {f.id for f in report.findings if f.severity == "error"}
            # a corpus module's known findings are true of it (timm's eager path gives NaN on empty rows)
            verdict = "passed" if report.verdict == "failed" and errors <= dc.CORPUS[name].known else report.verdict
            probes = report.seconds
        except Exception as e:  # recorded: the timing of the others goes on
            verdict, probes = f"raised {type(e).__name__}: {e}"[:200], {}
        rows.append({"module": name, "seconds": round(time.perf_counter() - t, 3), "verdict": verdict,
                     "probes": {k: round(v, 3) for k, v in probes.items()}})
        print(f"{name}: {rows[-1]['seconds']:.2f} s ({verdict})", flush=True)
    seconds = [r["seconds"] for r in rows]
    per_probe: dict[str, float] = {}
    for r in rows:
        for k, v in r["probes"].items():
            per_probe[k] = per_probe.get(k, 0.0) + v
    print(f"\n{len(rows)} modules: median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s, "
          f"total {sum(seconds):.1f} s ({args.threads} threads)")
    print("slowest:", ", ".join(f"{r['module']} {r['seconds']:.1f} s" for r in
                               sorted(rows, key=lambda r: -r["seconds"])[:5]))
    print("probes, total seconds:", ", ".join(f"{k} {v:.1f}" for k, v in
                                              sorted(per_probe.items(), key=lambda kv: -kv[1])))
    wrong = {r["module"]: r["verdict"] for r in rows if r["verdict"] != "passed"}
    if wrong:
        print("not passed:", json.dumps(wrong, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "seed": args.seed, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

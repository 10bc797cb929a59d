"""The doctor on every self-attention class transformers ships: one tiny random model per family.

    .venv/bin/python scripts/doctor_sweep.py                        # every family; JSON + docs/doctor.md table
    .venv/bin/python scripts/doctor_sweep.py --families llama gpt2  # some families, printed only

Each family is built and checked in a worker process (tests/hf_corpus.py: tiny config, the first
self-attention module, one generic adapter, per-family options); a family that takes longer than
``--timeout`` seconds or kills its worker is recorded as such and the sweep goes on in a new worker.
Verdicts: certified, the error ids found, "inconclusive: <the probes that could not run>", "could not build:
<why>", "not self-attention: <why>", "doctor raised: <exception>" (a traceback from selfattn.check itself),
"timed out", "worker died".
The table goes into docs/doctor.md between the sweep markers.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import queue
import subprocess
import sys
import threading
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
BEGIN, END = "<!-- sweep:transformers -->", "<!-- /sweep:transformers -->"
MODEL_MARKERS = ("<!-- sweep:model -->", "<!-- /sweep:model -->")


def _unseen(report: object) -> dict[str, str]:
    """What kept a report from a pass: the probes that raised and the properties not verified."""
    from selfattn.check.report import unseen

    return {**report.not_verified, **{p: report.coverage[p] for p in unseen(report.coverage)}}  # type: ignore[attr-defined]


def check_family(family: str, seed: int = 0) -> dict:
    """Build and check one family (in this process); the result as a JSON-able dict."""
    import hf_corpus as hc

    from selfattn.check import CannotRun, check

    t = time.perf_counter()
    row: dict = {"family": family, "class": "", "path": "", "options": hc.FAMILY_OPTIONS.get(family, {}).get("why", "")}
    try:
        built = hc.build(family, seed)
    except hc.NotSelfAttention as e:
        return {**row, "verdict": "not self-attention", "reason": str(e), "seconds": round(time.perf_counter() - t, 1)}
    except hc.CannotBuild as e:
        return {**row, "verdict": "could not build", "reason": str(e), "seconds": round(time.perf_counter() - t, 1)}
    row.update({"class": built.class_name, "path": built.path})
    try:
        report = check(built.module, call=built.call, seed=seed, **built.options)
    except CannotRun as e:
        return {**row, "verdict": "doctor could not run", "reason": str(e)[:300],
                "seconds": round(time.perf_counter() - t, 1)}
    except Exception as e:  # a traceback from the doctor itself: recorded, the sweep goes on
        return {**row, "verdict": "doctor raised", "reason": f"{type(e).__name__}: {e}"[:300],
                "seconds": round(time.perf_counter() - t, 1)}
    if report.verdict == "inconclusive":  # no error found, but a probe could not run: not certified
        return {**row, "verdict": "inconclusive", "reason": "; ".join(f"{p}: {why}" for p, why in
                                                                       _unseen(report).items())[:300],
                "seconds": round(time.perf_counter() - t, 1)}
    errors = sorted({f.id for f in report.findings if f.severity == "error"})
    mask = report.inferred.get("mask")
    return {**row, "verdict": "certified" if report.passed else "findings", "ids": errors,
            "warnings": sorted({f.id for f in report.findings if f.severity == "warning"}),
            "mask": mask.get("convention") if isinstance(mask, dict) and "convention" in mask else str(mask)[:80],
            "messages": {f.id: f.message[:300] for f in report.findings if f.severity == "error"},
            "seconds": round(time.perf_counter() - t, 1)}


def check_family_model(family: str, seed: int = 0) -> dict:
    """Build one family's whole tiny model and check it with ``selfattn.check_model`` (its first attention layer,
    called as the model calls it: no per-family adapter or option); the result as a JSON-able dict."""
    import hf_corpus as hc

    from selfattn.check import CannotRun, check_model

    t = time.perf_counter()
    row: dict = {"family": family, "class": "", "path": "", "options": "whole model"}
    try:
        model, inputs = hc.build_model(family, seed)
    except hc.CannotBuild as e:
        return {**row, "verdict": "could not build", "reason": str(e), "seconds": round(time.perf_counter() - t, 1)}
    try:
        found = check_model(model, inputs, layers=1, seed=seed)
    except CannotRun as e:
        verdict = "no attention found" if "no attention layer" in str(e) else "doctor could not run"
        return {**row, "verdict": verdict, "reason": str(e)[:300], "seconds": round(time.perf_counter() - t, 1)}
    except Exception as e:  # a traceback from the doctor itself: recorded, the sweep goes on
        return {**row, "verdict": "doctor raised", "reason": f"{type(e).__name__}: {e}"[:300],
                "seconds": round(time.perf_counter() - t, 1)}
    if found.could_not_run:
        name, why = next(iter(found.could_not_run.items()))
        return {**row, "class": found.classes[name], "path": name, "verdict": "doctor could not run",
                "reason": why[:300], "seconds": round(time.perf_counter() - t, 1)}
    name, report = next(iter(found.layers.items()))
    row.update({"class": found.classes[name], "path": name})
    seconds = round(time.perf_counter() - t, 1)
    if report.verdict == "inconclusive":
        return {**row, "verdict": "inconclusive", "reason": "; ".join(f"{p}: {why}" for p, why in
                                                                       _unseen(report).items())[:300],
                "seconds": seconds}
    mask = report.inferred.get("mask")
    return {**row, "verdict": "certified" if report.passed else "findings",
            "ids": sorted({f.id for f in report.findings if f.severity == "error"}),
            "warnings": sorted({f.id for f in report.findings if f.severity == "warning"}),
            "mask": mask.get("convention") if isinstance(mask, dict) and "convention" in mask else str(mask)[:80],
            "messages": {f.id: f.message[:300] for f in report.findings if f.severity == "error"}, "seconds": seconds}


def _worker(seed: int, memory_gib: float, whole: bool = False) -> None:
    import resource
    import warnings

    warnings.filterwarnings("ignore")
    limit = int(memory_gib * 2**30)  # a family that would take the machine's memory fails alone, with a reason
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for line in sys.stdin:
        family = line.strip()
        if family:
            print(json.dumps((check_family_model if whole else check_family)(family, seed)), flush=True)
            gc.collect()


class _Worker:
    def __init__(self, seed: int, memory_gib: float, whole: bool = False) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", "--seed", str(seed), "--memory-gib",
                                      str(memory_gib), *(["--model"] if whole else [])], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, family: str, timeout: float) -> dict | None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(family + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if line is None:
                return None
            if line.startswith("{"):
                return json.loads(line)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def sweep(names: list[str], seed: int, timeout: float, memory_gib: float = 4.0, recycle: int = 20,
          log: Path | None = None, progress: bool = True, whole: bool = False) -> list[dict]:
    """Check each family in a worker process; a hang or a dead worker costs one family, not the sweep.

    A worker is replaced after ``recycle`` families (each family imports its modeling code and builds
    a model: memory grows). With ``log``, each row is appended to it as a JSON line, and the families
    already there are not checked again (a sweep that was stopped resumes).
    """
    done = {}
    if log is not None and log.exists():
        done = {r["family"]: r for r in map(json.loads, log.read_text().splitlines()) if r.get("family")}
    rows, worker, served = [], None, 0
    for i, family in enumerate(names):
        if family in done:
            rows.append(done[family])
            continue
        if worker is not None and served >= recycle:
            worker.stop()
            worker, served = None, 0
        worker = worker or _Worker(seed, memory_gib, whole)
        served += 1
        t = time.perf_counter()
        row = worker.ask(family, timeout)
        if row is None:
            died = worker.proc.poll() is not None
            worker.stop()
            worker = None
            row = {"family": family, "class": "", "path": "", "options": "",
                   "verdict": "worker died" if died else "timed out",
                   "reason": "the worker process ended" if died else f"no result within {timeout:.0f} s",
                   "seconds": round(time.perf_counter() - t, 1)}
        rows.append(row)
        if log is not None:
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if progress:
            print(f"[{i + 1}/{len(names)}] {family}: {verdict_text(row)} ({row['seconds']} s)", flush=True)
    if worker is not None:
        worker.stop()
    return rows


def verdict_text(row: dict) -> str:
    if row["verdict"] == "certified":
        return "certified"
    if row["verdict"] == "findings":
        return ", ".join(row["ids"])
    return f"{row['verdict']}: {row.get('reason', '')}"


def totals(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["verdict"]] = out.get(r["verdict"], 0) + 1
    return out


def markdown(rows: list[dict], meta: dict, whole: bool = False) -> str:
    """The sweep table, with a header line saying how it was made and the totals."""
    counts = totals(rows)
    how = "`scripts/doctor_sweep.py --model`" if whole else "`scripts/doctor_sweep.py`"
    lines = [f"_Written by {how} (transformers {meta['transformers']}, torch {meta['torch']}, "
             f"{meta['date']}, seed {meta['seed']}): {len(rows)} families; "
             + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1])) + "._", "",
             "| family | class | verdict | options needed |", "| --- | --- | --- | --- |"]
    for r in rows:
        verdict = verdict_text(r).replace("|", "\\|").replace("\n", " ")
        if len(verdict) > 160:
            verdict = verdict[:157] + "..."
        lines.append(f"| {r['family']} | {r['class'] or '-'} | {verdict} | {r.get('options') or 'generic'} |")
    return "\n".join(lines)


def write_docs(path: Path, table: str, begin: str = BEGIN, end: str = END) -> None:
    """Put ``table`` between the markers of ``path`` (appended with the markers if they are missing)."""
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n\n{table}\n\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="*", help="only these families (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per family, build and check")
    p.add_argument("--memory-gib", type=float, default=4.0, help="address-space limit of the worker process")
    p.add_argument("--recycle", type=int, default=20, help="families per worker process")
    p.add_argument("--log", type=Path, help="append each row here as a JSON line; families already there are skipped")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--docs", type=Path, help="write the table into this markdown file (default with a full sweep: "
                                             "docs/doctor.md)")
    p.add_argument("--model", action="store_true",
                   help="check each family's whole model with selfattn.check_model (no adapter, no per-family "
                        "options); its table goes between the whole-model markers")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.seed, args.memory_gib, args.model)
        return 0
    import hf_corpus as hc
    import torch
    import transformers

    names = args.families or hc.families()
    rows = sweep(names, args.seed, args.timeout, args.memory_gib, args.recycle, args.log, whole=args.model)
    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "date": date.today().isoformat(),
            "seed": args.seed, "python": platform.python_version()}
    counts = totals(rows)
    print(f"{len(rows)} families: " + ", ".join(f"{v}: {n}" for v, n in sorted(counts.items())))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    docs = args.docs or (ROOT / "docs" / "doctor.md" if not args.families else None)
    if docs is not None:
        write_docs(docs, markdown(rows, meta, whole=args.model), *(MODEL_MARKERS if args.model else (BEGIN, END)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

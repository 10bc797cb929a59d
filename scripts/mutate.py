"""The doctor's mutation score and false-alarm count on the tutorial's classes and on the corpus of real modules.

    .venv/bin/python scripts/mutate.py                          # everything, 20 seeds of false-alarm checks
    .venv/bin/python scripts/mutate.py --seeds 200              # the long false-alarm run
    .venv/bin/python scripts/mutate.py --only timm llama --seeds 3
    .venv/bin/python scripts/mutate.py --json out.json --docs docs/doctor.md

For each module: mutants of its source (selfattn.mutation; for a library class, the source of
its defining module, mutated in memory, with the module-level functions the class calls), the kill
rate over non-equivalent mutants, the survivors; then the original checked with seeds 0..N-1 (the
module built under each seed too), counting error findings it should not get. The modules: the seed
tutorial's classes and the doctor's fixtures (which do get half-precision-overflow, a true finding:
their -1e9 fill does not fit in float16), every correct module of tests/doctor_corpus.py (timm,
x-transformers, vit-pytorch, diffusers, open_clip, torch, hand-written) and a fast subset of
transformers families (tests/hf_corpus.py). Kill rates are summed per library.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from selfattn.check import check  # noqa: E402
from selfattn.check.subject.building import load_class  # noqa: E402
from selfattn.mutation import score  # noqa: E402

BEGIN, END = "<!-- mutate:corpus -->", "<!-- /mutate:corpus -->"
FIXTURES = {  # file:Class -> (style, error ids expected on the original)
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
HF_FAST = ["llama", "gpt2", "bert", "qwen3", "olmo2", "mistral", "gemma2", "t5"]


@dataclass
class Subject:
    """One module to mutate: how to mutate it (spec, make, options) and how to check its original per seed."""

    name: str
    library: str
    style: str
    spec: object  # what score() takes: "file.py:Class", "package.module:Class" or a class
    options: dict
    make: Callable | None
    original: Callable[[int], object]  # seed -> what check() takes (module, class or "file.py:Class")
    expected: set[str] = field(default_factory=set)  # error ids true of the original


def _accepted(options: dict) -> tuple[dict, list[str]]:
    """The options this doctor's check() takes, and the names of those it does not (yet)."""
    params = inspect.signature(check).parameters
    return {k: v for k, v in options.items() if k in params}, [k for k in options if k not in params]


def subjects(only: list[str] | None) -> list[Subject]:
    out = [Subject(spec.rpartition(":")[2], "seed tutorial and fixtures", style, str(ROOT / spec), {}, None,
                   lambda seed, spec=spec: load_class(str(ROOT / spec)), expected)
           for spec, (style, expected) in FIXTURES.items()]
    import doctor_corpus as dc

    for name in dc.CORRECT:
        e = dc.CORPUS[name]
        spec = e.spec if e.is_file else e.target
        out.append(Subject(name, e.library, e.note or e.target, spec, e.options, e.make,
                           lambda seed, e=e: dc.build(e, seed), set(e.known)))
    import hf_corpus as hc

    for family in HF_FAST:
        out.append(Subject(family, "transformers", "tiny random config, generic adapter", None, {}, None,
                           lambda seed, family=family: hc.build(family, seed)))
    return [s for s in out if not only or s.name in only or s.library in only]


def _hf(subject: Subject, seed: int):
    built = subject.original(seed)
    return built, {"call": built.call, **built.options}


def run(subject: Subject, seeds: int) -> dict:
    t = time.perf_counter()
    options, missing = _accepted(subject.options)
    row: dict = {"module": subject.name, "library": subject.library, "style": subject.style, "seeds": seeds}
    if missing:
        return {**row, "skipped": f"needs option(s) {', '.join(missing)}, which this doctor's check() does not take"}
    try:
        if subject.library == "transformers":
            built, options = _hf(subject, 0)
            s = score(type(built.module), options, make=built.make)
        else:
            s = score(subject.spec, options, make=subject.make)
    except Exception as err:  # the original cannot be loaded, built or checked: said in the row, the run goes on
        return {**row, "skipped": f"{type(err).__name__}: {err}"[:300], "seconds": round(time.perf_counter() - t, 1)}
    alarms = []
    for seed in range(seeds):
        try:
            if subject.library == "transformers":
                built, opts = _hf(subject, seed)
                report = check(built.module, seed=seed, **opts)
            else:
                report = check(subject.original(seed), seed=seed, **options)
            extra = {f.id for f in report.findings if f.severity == "error"} - subject.expected
        except Exception as err:  # a crash on the original is a false alarm too, and the worst kind
            extra = {f"raised {type(err).__name__}: {err}"[:200]}
        if extra:
            alarms.append({"seed": seed, "ids": sorted(extra)})
    return {**row, "mutants": s.total, "stillborn": s.stillborn, "equivalent": s.equivalent,
            "relabelled": s.relabelled, "non_equivalent": s.non_equivalent, "killed": s.killed,
            "kill_rate": round(s.rate, 4),
            "original_errors": s.original_errors, "killed_by": s.killed_by, "survivors": s.survivors,
            "false_alarms": alarms, "seconds": round(time.perf_counter() - t, 1)}


def per_library(rows: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        lib = out.setdefault(r["library"], {"modules": 0, "killed": 0, "non_equivalent": 0, "survivors": 0,
                                            "false_alarm_seeds": 0, "seeds": 0, "skipped": 0})
        if "skipped" in r:
            lib["skipped"] += 1
            continue
        lib["modules"] += 1
        lib["killed"] += r["killed"]
        lib["non_equivalent"] += r["non_equivalent"]
        lib["survivors"] += len(r["survivors"])
        lib["false_alarm_seeds"] += len(r["false_alarms"])
        lib["seeds"] += r["seeds"]
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    libs = per_library(rows)
    lines = [f"_Written by `scripts/mutate.py` (torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{meta['date']}; false alarms over seeds 0-{meta['seeds'] - 1})._", "",
             "| library | modules | killed / non-equivalent mutants | survivors | seeds with a false alarm |",
             "| --- | --- | --- | --- | --- |"]
    for name, v in sorted(libs.items()):
        rate = f"{v['killed']} / {v['non_equivalent']}" + (f" ({100 * v['killed'] / v['non_equivalent']:.1f}%)"
                                                           if v["non_equivalent"] else "")
        skipped = f" (+{v['skipped']} not run)" if v["skipped"] else ""
        lines.append(f"| {name} | {v['modules']}{skipped} | {rate} | {v['survivors']} | "
                     f"{v['false_alarm_seeds']} of {v['seeds']} |")
    lines += ["", "Relabelled: mutants that only permute a projection's columns (a head split's grouped axes "
              "swapped) and survive: the same module with its weights permuted, left out of the rate.", "",
              "| module | library | mutants | stillborn | equivalent | relabelled | killed / non-equivalent | "
              "false alarms (seeds) | survivors (operator, line) |", "|" + " --- |" * 9]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['module']} | {r['library']} | not run: {r['skipped'][:120]} | | | | | | |")
            continue
        survivors = "; ".join(f"{s['operator']} ({s['where'].split(':')[0]})" for s in r["survivors"])[:300]
        alarms = ", ".join(f"{a['seed']}: {'/'.join(a['ids'])}" for a in r["false_alarms"][:3])
        more = f" (+{len(r['false_alarms']) - 3})" if len(r["false_alarms"]) > 3 else ""
        alarm_text = f"{len(r['false_alarms'])}" + (f": {alarms}{more}" if alarms else "")
        lines.append(f"| {r['module']} | {r['library']} | {r['mutants']} | {r['stillborn']} | {r['equivalent']} | "
                     f"{r.get('relabelled', 0)} | {r['killed']} / {r['non_equivalent']} | {alarm_text} | "
                     f"{survivors.replace('|', '/') or '-'} |")
    return "\n".join(lines)


def write_docs(path: Path, table: str) -> None:
    """Put ``table`` between the mutation markers of ``path`` (appended with the markers if missing)."""
    text = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n\n{table}\n\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    path.write_text(text)


def main() -> int:
    import warnings

    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20, help="seeds of the false-alarm check on the originals")
    p.add_argument("--only", nargs="*", help="only these modules or libraries (names as printed)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--docs", type=Path, help="write the markdown tables into this file, between the mutation markers")
    args = p.parse_args()
    import torch
    import transformers

    rows = []
    for subject in subjects(args.only):
        row = run(subject, args.seeds)
        rows.append(row)
        if "skipped" in row:
            print(f"{subject.name} ({subject.library}): not run: {row['skipped']}", flush=True)
            continue
        print(f"{subject.name} ({subject.library}): {row['killed']}/{row['non_equivalent']} non-equivalent mutants "
              f"named ({100 * row['kill_rate']:.1f}%), {row['equivalent']} equivalent, {row['stillborn']} stillborn; "
              f"original's errors {row['original_errors'] or 'none'}; false alarms over {args.seeds} seeds: "
              f"{len(row['false_alarms'])}; {row['seconds']} s", flush=True)
        for sv in row["survivors"]:
            print(f"    survivor: {sv['operator']} at {sv['where']} -> {sv['findings']}")
    libs = per_library(rows)
    for name, v in sorted(libs.items()):
        print(f"{name}: {v['killed']}/{v['non_equivalent']} killed, {v['false_alarm_seeds']} seeds with a false alarm "
              f"of {v['seeds']}, {v['skipped']} not run")
    killed = sum(v["killed"] for v in libs.values())
    total = sum(v["non_equivalent"] for v in libs.values())
    alarms = sum(v["false_alarm_seeds"] for v in libs.values())
    print(f"all: {killed}/{total} ({100 * killed / max(total, 1):.1f}%); seeds with a false alarm: {alarms}")
    from datetime import date

    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "date": date.today().isoformat(),
            "seeds": args.seeds}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "libraries": libs, "rows": rows}, indent=1))
    if args.docs:
        write_docs(args.docs, markdown(rows, meta))
    return 0 if killed >= 0.97 * total and not alarms and not any("skipped" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

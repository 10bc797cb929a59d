"""The README's performance tables, written from what ``selfattn bench --json`` measured.

Numbers typed by hand drift from the code that measured them; these tables are generated instead.
README.md marks each generated block with a pair of comments::

    <!-- bench:masks -->
    ...generated, replaced on every run...
    <!-- /bench:masks -->

:func:`blocks` turns bench results into the markdown of each block it has data for and
:func:`rewrite` puts them between their markers, leaving every other line alone (a block the
results say nothing about keeps its text). ``scripts/readme_tables.py`` is the command line.

Blocks: ``modules`` (``MultiHeadAttention`` vs ``nn.MultiheadAttention`` and the tutorial's),
``overhead`` (``attention(auto)`` vs raw SDPA), ``decode`` (a KV-cache decode step vs SDPA on
the cached tensors), ``masks`` (masked attention at one length against its anchors) and
``masks-targets`` (memory vs SDPA is_causal, padded batches vs their real tokens, the longest
length), ``models`` (a transformers Llama on a packed row; each point ran in its own process,
so its ratios are of medians, not per repeat) and ``models-generate`` (the same model generating,
selfattn and sdpa timed in turns in one process). Ratios are repeat by repeat within one interleaved
run: median (min-max), see :mod:`selfattn.bench.ratios`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from .ratios import format_ratio, ratio_stats

__all__ = ["BLOCKS", "blocks", "load", "rewrite"]

BLOCKS = ("modules", "overhead", "decode", "masks", "masks-targets", "models", "models-generate", "distributed-model")
_MARKED = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)
_README_LENGTH = 16384  # the masks table's length when the results have it (the README's since the start)


def load(paths: Iterable[Path]) -> list[dict]:
    """The result rows of one or more bench JSON files, each row given its file's ``meta``.

    Several files can be combined (e.g. ``--suite masks`` and ``--suite decode`` run apart); a
    point measured in more than one file keeps the last file's rows.
    """
    rows: dict[tuple, dict] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data["results"]:
            key = tuple(sorted((k, str(v)) for k, v in r.items()
                               if k in ("suite", "case", "mode", "L", "B", "E", "H", "impl", "strategy", "W",
                                        "part", "per_rank", "memory")))
            rows[key] = {**r, "meta": data.get("meta", {})}
    return list(rows.values())


def _ok(rows: list[dict], **where: object) -> dict | None:
    """The first ok row matching every field of ``where``."""
    for r in rows:
        if r.get("status") == "ok" and all(r.get(k) == v for k, v in where.items()):
            return r
    return None


def _ms(r: dict | None) -> str:
    if r is None:
        return "-"
    t = r["time_s"] * 1e3
    return f"{t:.0f} ms" if t >= 100 else f"{t:.1f} ms" if t >= 1 else f"{t:.2f} ms"


def _seconds(t: float) -> str:
    return f"{t:.0f} s" if t >= 10 else f"{t:.1f} s"


def _ratio(r: dict | None, anchor: dict | None, *, speedup: bool = False) -> str:
    """``r`` / ``anchor`` (or anchor / r for a speed-up), per repeat of their interleaved run."""
    if r is None or anchor is None:
        return "-"
    stats = ratio_stats(anchor["times"], r["times"]) if speedup else ratio_stats(r["times"], anchor["times"])
    return format_ratio(stats) or "-"


def _source(rows: list[dict]) -> str:
    meta = rows[0].get("meta", {}) if rows else {}
    parts = [f"torch {meta['torch']}" if "torch" in meta else "", meta.get("device", ""), meta.get("dtype", ""),
             f"{meta['cpus']} CPUs" if "cpus" in meta else "", (meta.get("date") or "")[:10]]
    return ("_Written by `scripts/readme_tables.py` from `selfattn bench --json` ("
            + ", ".join(p for p in parts if p) + "); x = time / anchor's time, repeat by repeat in one "
            "interleaved run: median (min-max over the repeats)._")


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _modules(rows: list[dict]) -> str | None:
    rows = [r for r in rows if r.get("suite") == "modules"]
    shapes = list(dict.fromkeys((r["B"], r["L"], r["E"], r["H"]) for r in rows))
    if not shapes:
        return None
    body = []
    for b, length, e, h in shapes:
        cells = []
        for mode in ("fwd", "fwd+bwd"):
            where = dict(B=b, L=length, E=e, H=h, mode=mode)
            cells.append(_ratio(_ok(rows, impl="selfattn", **where), _ok(rows, impl="torch", **where)))
        body.append([f"`MultiHeadAttention` / `nn.MultiheadAttention`, (B, L, E, H) = ({b}, {length}, {e}, {h})",
                     *cells, "<= 1.0x"])
    b, length, e, h = max(shapes, key=lambda s: s[1])
    cells = []
    for mode in ("fwd", "fwd+bwd"):
        where = dict(B=b, L=length, E=e, H=h, mode=mode)
        cells.append(_ratio(_ok(rows, impl="tutorial", **where), _ok(rows, impl="selfattn", **where)))
    body.append([f"the tutorial's MultiHeadAttention / ours, ({b}, {length}, {e}, {h}) (how much faster ours is)",
                 *cells, ">= 1.8x"])
    return _source(rows) + "\n\n" + _table(["what", "fwd", "fwd+bwd", "target"], body)


def _overhead(rows: list[dict]) -> str | None:
    rows = [r for r in rows if r.get("suite") == "overhead"]
    if not rows:
        return None
    r0 = rows[0]
    cells = [_ratio(_ok(rows, impl="selfattn", case=c), _ok(rows, impl="sdpa", case=c)) for c in ("none", "causal")]
    shape = f"({r0['B']}, {r0['H']}, {r0['L']}, {r0['D']})"
    return _source(rows) + "\n\n" + _table(
        ["what", "no mask", "causal", "target"],
        [[f"`attention(auto)` / raw SDPA, (B, H, L, D) = {shape}, fwd", *cells, "<= 1.05x"]])


def _decode(rows: list[dict]) -> str | None:
    rows = [r for r in rows if r.get("suite") == "decode"]
    if not rows:
        return None
    batches = sorted({r.get("B", 1) for r in rows})
    body = []
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = []
        for b in batches:
            ours, anchor = (_ok(rows, case=case, B=b, impl=i) for i in ("selfattn", "sdpa"))
            cells.append(f"{_ratio(ours, anchor)}; {_ms(ours)} vs {_ms(anchor)}" if ours and anchor else "-")
        body.append([f"decode step, {case} (layers x width, cached tokens) / projecting and calling SDPA on the "
                     "cached tensors", *cells, "<= 1.0x"])
    return _source(rows) + "\n\n" + _table(["what", *(f"B = {b}" for b in batches), "target"], body)


def _causal_anchor(case: str) -> str:
    return "sdpa" if case == "causal" else "sdpa-causal"


def _masks_length(rows: list[dict]) -> int | None:
    lengths = sorted({r["L"] for r in rows if r.get("status") == "ok" and r["impl"] in ("selfattn", "chunked")})
    if not lengths:
        return None
    return _README_LENGTH if _README_LENGTH in lengths else lengths[-1]


def _masks(rows: list[dict], length: int) -> str:
    body = []
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for case in cases:
        impls = ["selfattn", "chunked"] if case == "causal" else ["selfattn"]
        for impl in impls:
            def pick(i: str, mode: str, case: str = case) -> dict | None:
                return _ok(rows, case=case, L=length, mode=mode, impl=i)
            if not any(pick(impl, m) for m in ("fwd", "fwd+bwd")):
                continue
            dense = None if case == "causal" else "sdpa"
            label = f"{case}, backend=\"chunked\"" if impl == "chunked" else case
            peaks = [pick(i, "fwd+bwd") if i else None for i in (impl, dense, _causal_anchor(case))]
            body.append([
                label,
                " / ".join(_ms(pick(impl, m)) for m in ("fwd", "fwd+bwd")),
                " / ".join(_ms(pick(dense, m)) for m in ("fwd", "fwd+bwd")) if dense else "-",
                " / ".join(_ratio(pick(impl, m), pick(dense, m), speedup=True) for m in ("fwd", "fwd+bwd"))
                if dense else "-",
                " / ".join(_ratio(pick(impl, m), pick(_causal_anchor(case), m)) for m in ("fwd", "fwd+bwd")),
                _ratio(pick(impl, "fwd"), pick("flex", "fwd")),
                " / ".join(f"{p['peak_bytes'] / 2**20:.0f}" if p else "-" for p in peaks),
            ])
    header = [f"case, L = {length}", "selfattn fwd / fwd+bwd", "raw SDPA dense mask fwd / fwd+bwd",
              "speed-up over SDPA dense (its time / ours)", "x SDPA is_causal fwd / fwd+bwd",
              "x compiled FlexAttention fwd", "peak fwd+bwd MiB: ours / SDPA dense / SDPA is_causal"]
    return _source(rows) + "\n\n" + _table(header, body)


def _masks_targets(rows: list[dict], length: int) -> str:
    cases = list(dict.fromkeys(r["case"] for r in rows))
    body = []
    memory = []
    for case in cases:
        if case in ("causal", "dense"):
            continue
        ours = _ok(rows, case=case, L=length, mode="fwd+bwd", impl="selfattn")
        anchor = _ok(rows, case=case, L=length, mode="fwd+bwd", impl=_causal_anchor(case))
        if ours and anchor and anchor["peak_bytes"] > 0:
            memory.append(f"{case} {ours['peak_bytes'] / anchor['peak_bytes']:.2f}x")
    if memory:
        body.append([f"peak extra memory fwd+bwd at L = {length} vs SDPA's unmasked causal at the same L and batch",
                     ", ".join(memory)])
    valid = []
    for case in cases:
        cells = []
        for mode in ("fwd", "fwd+bwd"):
            ours = _ok(rows, case=case, L=length, mode=mode, impl="selfattn")
            anchor = _ok(rows, case=case, L=length, mode=mode, impl="sdpa-causal-valid")
            if ours and anchor:
                cells.append(f"{_ratio(ours, anchor)} {mode}")
        if cells:
            valid.append(f"{case}: {', '.join(cells)}")
    if valid:
        body.append([f"padded batches vs SDPA is_causal on each item's real tokens only, L = {length} "
                     "(keys-only padding still computes the padded query rows)", "; ".join(valid)])
    longest = max(r["L"] for r in rows)  # its own row: the masks table is at another length
    done = [r for r in rows if r["L"] == longest and r["impl"] == "chunked" and r["mode"] == "fwd+bwd"]
    if done and longest != length:
        ok = [r for r in done if r.get("status") == "ok"]
        text = ", ".join(f"{r['case']} {_seconds(r['time_s'])}" if r.get("status") == "ok"
                         else f"{r['case']} {r.get('status')}" for r in done)
        if ok:
            text += f"; peak at most {max(r['peak_bytes'] for r in ok) / 2**30:.1f} GiB"
        body.append([f"L = {longest}, fwd+bwd, backend=\"chunked\"", text])
    return _source(rows) + "\n\n" + _table([f"other targets, L = {length}", "measured"], body)


def _models(rows: list[dict]) -> str | None:
    rows = [r for r in rows if r.get("suite") == "models"]
    keys = list(dict.fromkeys((r["part"], r["L"]) for r in rows))
    if not any(r.get("status") == "ok" for r in rows):
        return None
    body = []
    for part, length in keys:
        sdpa = _ok(rows, part=part, L=length, impl="sdpa")
        for impl in ("selfattn", "sdpa", "eager", "none"):
            r = next((x for x in rows if x["part"] == part and x["L"] == length and x["impl"] == impl), None)
            if r is None:
                continue
            if r.get("status") != "ok":
                body.append([part, str(length), impl, r.get("status", "-"), r.get("note", ""), "", ""])
                continue
            time_x = f"{r['time_s'] / sdpa['time_s']:.2f}x" if sdpa else "-"
            mem_x = f"{r['peak_bytes'] / sdpa['peak_bytes']:.2f}x" if sdpa and sdpa["peak_bytes"] > 0 else "-"
            body.append([part, str(length), impl, _seconds(r["time_s"]), time_x,
                         f"{r['peak_bytes'] / 2**20:.0f} MiB", mem_x])
    meta = rows[0].get("meta", {})
    source = (f"_Written by `scripts/readme_tables.py` from `selfattn bench --suite models --json` (torch "
              f"{meta.get('torch', '?')}, {meta.get('cpus', '?')} CPUs, {(meta.get('date') or '')[:10]}); each "
              "point in its own process, time = median step, x = ratio to sdpa's. attention = one layer's mask "
              "and attention, fwd+bwd; model = the whole training step (none = attention replaced by a "
              "pass-through)._")
    return source + "\n\n" + _table(["part", "L", "attn_implementation", "time", "x sdpa", "peak", "x sdpa"], body)


def _models_generate(rows: list[dict]) -> str | None:
    rows = [r for r in rows if r.get("suite") == "models-generate"]
    if not any(r.get("status") == "ok" for r in rows):
        return None
    body = []
    for case, mode, b in dict.fromkeys((r["case"], r["mode"], r["B"]) for r in rows):
        where = dict(case=case, mode=mode, B=b)
        ours, sdpa = _ok(rows, impl="selfattn", **where), _ok(rows, impl="sdpa", **where)
        same = "yes" if ours and ours.get("same_tokens") else "no" if ours else "-"
        body.append([case, mode, str(b), _ms(ours), _ms(sdpa), _ratio(ours, sdpa), same])
    r0 = rows[0]
    source = _source(rows).replace("selfattn bench --json", "selfattn bench --suite models --cases generate --json")
    return (source + f" Greedy generation of {r0.get('L', '?')}-token prompts, time per generated token (the "
            "whole `generate` call over the new tokens); compiled = static cache and `CompileConfig(fullgraph=True)`"
            ", first (compiling) call excluded.\n\n"
            + _table(["cache", "forward", "B", "selfattn / token", "sdpa / token", "x sdpa", "same tokens"], body))


def _distributed_model(rows: list[dict]) -> str | None:
    every = [r for r in rows if r.get("suite") == "distributed-model"]
    rows = [r for r in every if "per_rank" not in r]
    if not any(r.get("status") == "ok" for r in every):
        return None
    body = []
    for part, memory, length in dict.fromkeys((r["part"], r.get("memory"), r["L"]) for r in rows):
        # one anchor per part and length: W = 1 with the default memory option (one process moves no dK/dV)
        one = _ok(rows, part=part, L=length, W=1, memory=None if memory is None else "overlap")
        label = part if memory is None else f"{part} (memory={memory})"
        for r in (x for x in rows if x["part"] == part and x.get("memory") == memory and x["L"] == length):
            if r.get("status") != "ok":
                body.append([label, str(length), str(r["W"]), r.get("status", "-"), r.get("note", ""), "", "", ""])
                continue
            time_x = f"{r['time_s'] / one['time_s']:.2f}x" if one else "-"
            mem = r["peak_bytes"] / one["peak_bytes"] if one and one["peak_bytes"] > 0 else None
            body.append([label, str(length), str(r["W"]), _seconds(r["time_s"]), time_x,
                         f"{r['peak_bytes'] / 2**20:.0f} MiB", "-" if mem is None else f"{mem:.2f}x",
                         f"{1.2 / r['W']:.2f}x"])
    meta = every[0].get("meta", {})
    source = (f"_Written by `scripts/readme_tables.py` from `selfattn bench --suite distributed --cases model "
              f"model-budget --json` (torch {meta.get('torch', '?')}, {meta.get('cpus', '?')} CPUs, "
              f"{(meta.get('date') or '')[:10]}); per rank (the slowest rank's median step, the largest rank's peak "
              "extra resident memory with glibc's mmap threshold fixed, after a primer step), one CPU thread per "
              "rank, x = ratio to W = 1 (one process, no context). "
              "attention = one layer's distributed.attention, fwd+bwd; model = the whole training step._")
    text = source
    if body:
        text += "\n\n" + _table(["part", "L", "W", "time", "x W=1", "peak", "x W=1", "1.2 / W"], body)
    budget = [r for r in every if "per_rank" in r]
    if budget:
        lines = []
        for r in budget:
            one = _ok(budget, per_rank=r["per_rank"], W=1)
            if r.get("status") != "ok":
                lines.append([str(r["per_rank"]), str(r["W"]), str(r["L"]), r.get("status", "-"), r.get("note", "")])
                continue
            mem = f"{r['peak_bytes'] / one['peak_bytes']:.2f}x" if one and one["peak_bytes"] > 0 else "-"
            lines.append([str(r["per_rank"]), str(r["W"]), str(r["L"]), f"{r['peak_bytes'] / 2**20:.0f} MiB", mem])
        text += ("\n\nThe whole step with the tokens per rank fixed (L = W x tokens per rank), one step each:\n\n"
                 + _table(["tokens per rank", "W", "L", "peak per rank", "x W=1"], lines))
    return text


def blocks(results: list[dict], *, length: int | None = None) -> dict[str, str]:
    """The markdown of every block the results have data for: name -> text.

    Args:
        results: bench result rows (:func:`load`).
        length: the masks tables' L (default 16384 when measured, else the longest measured).
    """
    out = {}
    for name, make in (("modules", _modules), ("overhead", _overhead), ("decode", _decode), ("models", _models),
                       ("models-generate", _models_generate), ("distributed-model", _distributed_model)):
        text = make(results)
        if text is not None:
            out[name] = text
    masks = [r for r in results if r.get("suite") == "masks"]
    length = length or _masks_length(masks)
    if masks and length is not None:
        out["masks"] = _masks(masks, length)
        out["masks-targets"] = _masks_targets(masks, length)
    return out


def rewrite(text: str, new: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` with each marked block named in ``new`` replaced by its new markdown.

    Returns:
        (the new text, the names of the blocks replaced). Blocks of ``new`` without markers in
        ``text`` are left out (the caller reports them); every other line is kept as it was.
    """
    done: list[str] = []

    def sub(m: re.Match) -> str:
        name = m["name"]
        if name not in new:
            return m[0]
        done.append(name)
        return f"{m[1]}\n{new[name].strip()}\n\n{m[4]}"

    return _MARKED.sub(sub, text), done

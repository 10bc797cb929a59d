"""Ratios between implementations timed in the same interleaved run, with their spread.

Every suite times the implementations of one point in turns in one process
(:func:`selfattn.bench.timing.time_interleaved`), so repeat i of one implementation and repeat i
of another ran next to each other and saw the same machine noise. A ratio is therefore taken
repeat by repeat; its median is the figure and its min-max over the repeats is the spread. Two
medians from different processes (or different moments) would mix two sets of noise, which on a
shared 2-core machine can move a ratio by 30%.

The bench tables, the JSON (``ratios`` of each result row) and the README tables
(:mod:`selfattn.bench.markdown`) all format ratios through this module.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

__all__ = ["MASK_ANCHORS", "attach_ratios", "format_ratio", "ratio_stats"]

# implementations the masks suite measures the others against (a ratio is given to each present)
MASK_ANCHORS = ("sdpa", "sdpa-causal", "sdpa-causal-valid", "document", "sdpa-padded", "flex")


def ratio_stats(times: Sequence[float], anchor_times: Sequence[float]) -> dict[str, float | int] | None:
    """``times / anchor_times`` repeat by repeat: {"median", "min", "max", "n"}.

    The two lists must come from one interleaved run (equal lengths, repeat i of each taken in the
    same round). Lists of different lengths cannot be paired: their ratio of medians is returned
    with no spread (min = max = median, n = 0). None when either list is empty or holds a zero.
    """
    if not times or not anchor_times or min(anchor_times) <= 0:
        return None
    if len(times) != len(anchor_times):
        r = statistics.median(times) / statistics.median(anchor_times)
        return {"median": r, "min": r, "max": r, "n": 0}
    rs = [t / a for t, a in zip(times, anchor_times, strict=True)]
    return {"median": statistics.median(rs), "min": min(rs), "max": max(rs), "n": len(rs)}


def _num(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def format_ratio(stats: dict[str, float | int] | None, *, spread: bool = True) -> str:
    """``"0.96x (0.93-0.99)"``: the median ratio and its min-max over the repeats ("" for None).

    Where there is no spread to show the bracket says why: ``(1 run)`` for a single repeat (a
    point whose one round outlasts the time budget), ``(unpaired)`` for timings that were not
    taken in one interleaved run (a ratio of medians).
    """
    if stats is None:
        return ""
    text = f"{_num(stats['median'])}x"
    if spread:
        n = stats["n"]
        text += (f" ({_num(stats['min'])}-{_num(stats['max'])})" if n > 1 else " (1 run)" if n == 1
                 else " (unpaired)")
    return text


def attach_ratios(results: list[dict], suite: str, key_fields: Iterable[str], anchors: Iterable[str]) -> None:
    """Give each ok row of ``suite`` a ``ratios`` dict: anchor impl -> :func:`ratio_stats`.

    Rows with equal ``key_fields`` are one point, timed in one interleaved run; every row of a
    point gets a ratio to each of ``anchors`` that was measured there (an anchor has none to itself).
    """
    keys = tuple(key_fields)
    anchors = tuple(anchors)
    points: dict[tuple, dict[str, dict]] = {}
    for r in results:
        if r.get("suite") == suite and r.get("status") == "ok":
            points.setdefault(tuple(r.get(f) for f in keys), {})[r["impl"]] = r
    for by_impl in points.values():
        for impl, r in by_impl.items():
            ratios = {}
            for a in anchors:
                if a != impl and a in by_impl:
                    stats = ratio_stats(r["times"], by_impl[a]["times"])
                    if stats is not None:
                        ratios[a] = stats
            r["ratios"] = ratios

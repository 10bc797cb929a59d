"""What every suite reports with: a timed implementation's result fields, and a table of medians with
their ratios to an anchor (repeat by repeat, from one interleaved run).

Shape legend: none (tables of results).
"""

from __future__ import annotations

from rich.table import Table

from .ratios import format_ratio
from .timing import Timing

__all__ = ["cell", "measured", "ratio_tables"]


def measured(t: Timing) -> dict:
    """The result fields of one timed implementation: median, every repeat, relative spread."""
    return {"time_s": t.median, "times": t.times, "spread": t.spread}


def cell(r: dict | None, anchor: str) -> str:
    """Median time and the ratio to ``anchor`` (measured in the same interleaved run) with its spread."""
    if r is None:
        return ""
    if r["status"] != "ok":
        return f"[dim]{r['status']}: {r.get('note', '')}[/dim]"
    ratio = format_ratio(r.get("ratios", {}).get(anchor))
    return f"{r['time_s'] * 1e3:.1f} ms" + (f" {ratio}" if ratio else "")


def ratio_tables(results: list[dict], suite: str, key_fields: tuple[str, ...], anchor: str,
                  title: str) -> list[Table]:
    """Rows keyed by ``key_fields``, a column per implementation with its median time and its ratio
    to ``anchor`` (repeat by repeat, in the same interleaved run: median and min-max)."""
    rows = [r for r in results if r["suite"] == suite]
    if not rows:
        return []
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    table = Table(title=title)
    for f in key_fields:
        table.add_column(f)
    for impl in impls:
        table.add_column(impl, justify="right")
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(f) for f in key_fields), {})[r["impl"]] = r
    for key, by_impl in groups.items():
        table.add_row(*(str(x) for x in key), *(cell(by_impl.get(i), anchor) for i in impls))
    return [table]

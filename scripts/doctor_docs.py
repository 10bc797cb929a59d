"""Write the doctor's findings table (README.md) and its catalogue and probe tables (docs/doctor.md)
from the catalogue (:mod:`selfattn.check.findings`) and the probe table (:data:`selfattn.check.doctor.PROBES`).

Each table sits between ``<!-- doctor:NAME -->`` and ``<!-- /doctor:NAME -->``; what is between them
is replaced, nothing else is touched. ``--check`` changes nothing and exits 1 when a file would change
(the test suite runs it).

Usage:
    python scripts/doctor_docs.py           # rewrite README.md and docs/doctor.md
    python scripts/doctor_docs.py --check
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from selfattn.check.doctor import CALLING_EMITS, DOCTOR_EMITS, PROBES
from selfattn.check.findings import CATALOGUE

ROOT = Path(__file__).resolve().parent.parent


def _ids(kinds: frozenset[str] | set[str]) -> str:
    order = list(CATALOGUE)
    return ", ".join(f"`{k}`" for k in sorted(kinds, key=order.index))


def findings_table() -> str:
    """The README's table: id, severity, what it means."""
    rows = ["| id | severity | what |", "|---|---|---|"]
    rows += [f"| `{k.id}` | {k.severity} | {k.summary} |" for k in CATALOGUE.values()]
    return "\n".join(rows)


def catalogue_table() -> str:
    """docs/doctor.md's catalogue: id, severity, what it means, what it explains, how to fix it."""
    rows = ["| id | severity | what | explains | fix |", "|---|---|---|---|---|"]
    for k in CATALOGUE.values():
        explains = "every other finding but those a second run cannot cause" if len(k.explains) > 10 else \
            _ids(k.explains) or "-"
        rows.append(f"| `{k.id}` | {k.severity} | {k.summary} | {explains} | {k.fix} |")
    return "\n".join(rows)


def probe_table() -> str:
    """docs/doctor.md's probe table: the order probes run in, what each covers, reads and may emit."""
    rows = ["| probe | covers | reads | may emit |", "|---|---|---|---|",
            f"| (calling: call style, sizes, layout) | - | - | {_ids(CALLING_EMITS)} |"]
    for p in PROBES:
        reads = ", ".join(p.needs) or "-"
        rows.append(f"| {p.name} | {f'`{p.covers}`' if p.covers else '-'} | {reads} | {_ids(p.emits)} |")
    rows.append(f"| (every call: its input, mask and own state) | - | - | {_ids(DOCTOR_EMITS)} |")
    return "\n".join(rows)


BLOCKS = {"README.md": {"findings": findings_table},
          "docs/doctor.md": {"catalogue": catalogue_table, "probes": probe_table}}


def rewrite(text: str, blocks: dict) -> str:
    """``text`` with each ``<!-- doctor:NAME -->`` block replaced; ValueError naming a missing marker."""
    for name, make in blocks.items():
        pattern = re.compile(rf"(<!-- doctor:{name} -->\n).*?(<!-- /doctor:{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no <!-- doctor:{name} --> ... <!-- /doctor:{name} --> markers")
        body = make()
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` compare) the tables; 0 when written or up to date, 1 when ``--check`` differs."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would change")
    args = p.parse_args(argv)
    stale = []
    for rel, blocks in BLOCKS.items():
        path = ROOT / rel
        text = path.read_text(encoding="utf-8")
        new = rewrite(text, blocks)
        if new != text:
            stale.append(rel)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    verb = "out of date" if args.check else "rewrote"
    print(f"{verb}: {', '.join(stale)}" if stale else "up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())

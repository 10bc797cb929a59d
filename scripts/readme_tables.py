"""Rewrite README.md's performance tables from the JSON that ``selfattn bench --json`` wrote.

The README's numbers are not typed by hand: each table sits between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` and this script replaces what is between them with what the given runs
measured (see :mod:`selfattn.bench.markdown` for the blocks). Blocks the runs have no data for
keep their text, so suites can be run and written separately.

Usage:
    selfattn bench --suite masks --lengths 16384 65536 --json bench-results/masks.json
    selfattn bench --suite modules --json bench-results/modules.json   # and overhead, decode
    python scripts/readme_tables.py bench-results/*.json [--readme README.md] [--length 16384]
    python scripts/readme_tables.py bench-results/*.json --check       # exit 1 if README.md would change
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from selfattn.bench.markdown import blocks, load, rewrite

README = Path(__file__).resolve().parent.parent / "README.md"


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` compare) the README's bench blocks; 0 when done or unchanged."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", type=Path, help="bench results (selfattn bench --json); later files win")
    p.add_argument("--readme", type=Path, default=README, help="the file to rewrite (default: the repo's README.md)")
    p.add_argument("--length", type=int, default=None,
                   help="L of the masks tables (default: 16384 when measured, else the longest measured)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the file would change")
    args = p.parse_args(argv)

    new = blocks(load(args.json), length=args.length)
    text = args.readme.read_text(encoding="utf-8")
    out, done = rewrite(text, new)
    missing = sorted(set(new) - set(done))
    for name in missing:
        print(f"warning: no <!-- bench:{name} --> ... <!-- /bench:{name} --> markers in {args.readme}; "
              "block not written", file=sys.stderr)
    if args.check:
        changed = out != text
        print(f"{args.readme}: {'would change' if changed else 'up to date'} ({', '.join(done) or 'no block'})")
        return 1 if changed else 0
    args.readme.write_text(out, encoding="utf-8")
    print(f"{args.readme}: wrote {', '.join(done) or 'no block'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

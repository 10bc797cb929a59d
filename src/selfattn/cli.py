"""The ``selfattn`` command: thin argument parsing over the library."""

from __future__ import annotations

import argparse
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="selfattn", description="Self-attention for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the tutorial's walkthrough with real tensors")
    d.add_argument("--out", type=Path, default=Path("selfattn-out"), help="folder for the heatmap PNG")

    b = sub.add_parser("bench", help="time and memory against the anchors, in one run")
    b.add_argument("--suite", choices=["modules", "overhead", "masks", "all"], default="all",
                   help="modules: MultiHeadAttention vs nn.MultiheadAttention and the tutorial's; "
                        "overhead: attention(auto) vs raw SDPA; masks: masked attention 1k-64k")
    b.add_argument("--quick", action="store_true", help="a reduced grid that runs in under two minutes")
    b.add_argument("--cases", nargs="+", help="mask cases to run (default: all)")
    b.add_argument("--lengths", nargs="+", type=int, help="sequence lengths for the masks suite")
    b.add_argument("--modes", nargs="+", choices=["fwd", "fwd+bwd"], help="default: both (--quick: fwd+bwd)")
    b.add_argument("--impls", nargs="+", help="implementations for the masks suite (default: all)")
    b.add_argument("--repeats", type=int, default=None,
                   help="at most this many timed repeats per point (the median is reported; "
                        "default: as many as fit the point's time budget, up to 50)")
    b.add_argument("--device", default="cpu", help="cpu or cuda")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    b.add_argument("--memory-limit-gb", type=float, default=None,
                   help="skip points whose estimated memory exceeds this (default: 60%% of RAM)")
    b.add_argument("--json", type=Path, help="write all results as JSON")
    b.add_argument("--plot", type=Path, help="folder for time and memory PNG plots")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.out)
    from .bench import main as bench_main

    return bench_main(args)


if __name__ == "__main__":
    raise SystemExit(main())

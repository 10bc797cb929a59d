"""The ``selfattn`` command: thin argument parsing over the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="selfattn", description="Self-attention for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the tutorial's walkthrough with real tensors")
    d.add_argument("--out", type=Path, default=Path("selfattn-out"), help="folder for the heatmap PNG")

    c = sub.add_parser(
        "check", help="prove an attention module right, or name its bugs",
        description="Run an attention module through black-box and white-box probes and certify it or "
                    "name each bug with evidence and a fix. NOTE: this imports and runs the given Python "
                    "file (its top-level code too); it never writes to it. Exit status: 0 passed, "
                    "1 findings, 2 could not run the module, 3 inconclusive (no error found, but a probe "
                    "could not run: not certified).")
    c.add_argument("target", help="path/to/file.py:ClassName (with --model: path/to/file.py:factory)")
    c.add_argument("--model", action="store_true",
                   help="the target is a function of no argument returning (model, example_inputs): run the model "
                        "once, find every attention layer by behaviour and check each with the call the model makes "
                        "(example_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments)")
    c.add_argument("--layers", type=int, default=None, metavar="N",
                   help="with --model: check only the first N attention layers")
    c.add_argument("--init", type=json.loads, default=None, metavar="JSON",
                   help='constructor keyword arguments, e.g. \'{"embed_dim": 64}\' (default: try the usual '
                        "signatures: (embed_dim), (embed_dim, num_heads), keyword variants)")
    c.add_argument("--embed-dim", type=int, default=None,
                   help="embed dim E: used when building the class (default 64); for a factory's module, its own")
    c.add_argument("--batch", type=int, default=None, metavar="B",
                   help="the batch size to probe with, for a module that runs only up to some batch (default: several)")
    c.add_argument("--length", type=int, nargs="+", default=None, metavar="L",
                   help="the sequence length(s) to probe with, for a module that runs only at some lengths (e.g. "
                        "window attention over 49 tokens: --length 49; default: several short ones)")
    c.add_argument("--mask-convention", choices=["keep", "ignore"],
                   help="your module's documented mask convention: keep (True/1 = may attend) or "
                        "ignore (True = masked); a module that behaves the other way gets mask-inverted")
    c.add_argument("--mask", metavar="'KIND (SHAPE)'",
                   help="your module's mask, e.g. 'additive (B,1,1,L)', 'keep (B,L)', 'ignore (L,L)'; kinds: keep, "
                        "ignore (bool), keep-int, keep-float (1 = may attend), additive (0 / large negative); "
                        "shapes: (L,L), (B,L,L), (B,1,L,L), (B,1,1,L), (B,L), (B,1,L), (B,1,L,1) (a key column "
                        "the module turns into a row) (default: inferred)")
    c.add_argument("--no-mask", action="store_true", help="the module takes no mask: try no argument as one")
    c.add_argument("--call", metavar="PYTHON",
                   help="how to call the module, a Python function of (module, x, mask) returning the output, "
                        "e.g. \"lambda m, x, mask: m(x, attention_mask=mask)[0]\", or of (module, x) for a module "
                        "without a mask (the file's names, torch, nn and F are in scope; mask is None or what --mask "
                        "describes)")
    c.add_argument("--factory", metavar="PYTHON",
                   help="build the module with this Python function of no argument instead of the class's "
                        "constructor, e.g. \"lambda: Attn(Config(hidden_size=16))\" (the file's names in scope)")
    c.add_argument("--allow-nonstandard", action="store_true",
                   help="the module is not textbook attention on purpose: no definition-mismatch finding")
    c.add_argument("--causal", action="store_true", help="the module must be causal")
    c.add_argument("--bidirectional", action="store_true",
                   help="every query must see every key (an encoder: no causal mask, window or is_causal)")
    c.add_argument("--scale", type=float, default=None,
                   help="the score scale the module uses on purpose instead of 1/sqrt(head dim) (e.g. 1 for T5)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random probe inputs and of building the module")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("--mutate", action="store_true",
                   help="instead of checking the class, check mutants of its source (small AST edits) and print "
                        "the share the doctor names (its kill rate) and the mutants it misses")

    b = sub.add_parser("bench", help="time and memory against the anchors, in one run")
    b.add_argument("--suite", choices=["modules", "overhead", "decode", "masks", "distributed", "models", "learned",
                                       "all"],
                   default="all",
                   help="modules: MultiHeadAttention vs nn.MultiheadAttention and the tutorial's; "
                        "overhead: attention(auto) vs raw SDPA; decode: a KV-cache decode step vs SDPA on "
                        "the cached tensors; masks: masked attention 1k-64k; distributed: context parallelism on "
                        "1, 2, 4 processes (--cases model model-budget: a transformers Llama trained "
                        "context-parallel); models: a Llama-shaped transformers model trained on a packed row and "
                        "generating, selfattn vs sdpa and eager; learned: fwd+bwd with a learned T5 bucket table or "
                        "pair bias, 4k-16k (distributed, models and learned are not part of all)")
    b.add_argument("--quick", action="store_true", help="a reduced grid that runs in under two minutes")
    b.add_argument("--cases", nargs="+",
                   help="mask cases to run (default: all); for the models suite, train and/or generate; for the "
                        "distributed suite, its mask cases and/or model, model-budget; for the learned suite, "
                        "'t5 buckets' and/or 'pair bias'")
    b.add_argument("--lengths", nargs="+", type=int,
                   help="sequence lengths for the masks and learned suites; cached tokens for the decode suite")
    b.add_argument("--batches", nargs="+", type=int, help="batch sizes for the decode suite (default: 1 8)")
    b.add_argument("--page-sizes", nargs="+", type=int, help="PagedKVCache page sizes for the decode suite "
                   "(default: 16 128)")
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
    if args.command == "check":
        return _check(args)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(args.out)
    from .bench import main as bench_main

    return bench_main(args)


def _check(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .check import CannotRun, check, render

    console = Console()
    options = {"init": args.init, "embed_dim": args.embed_dim, "batch": args.batch, "length": args.length,
               "mask_convention": args.mask_convention, "mask": args.mask, "no_mask": args.no_mask, "call": args.call,
               "causal": args.causal, "bidirectional": args.bidirectional, "scale": args.scale,
               "allow_nonstandard": args.allow_nonstandard,
               "seed": args.seed}
    # the target file's folder stays importable while the command runs: its factory, class or model may import a
    # file beside it when called, not only when the file is imported
    sys.path.insert(0, str(Path(args.target.rpartition(":")[0] or ".").resolve().parent))
    if args.model:
        return _check_model(args, options, console)
    if args.mutate:
        from .mutation import main as mutate_main

        return mutate_main(args.target, {**options, "factory": args.factory}, as_json=args.json)
    target = args.target
    try:
        if args.factory:
            from .check.subject.building import load_file, user_callable

            namespace = vars(load_file(args.target.rpartition(":")[0]))
            target = user_callable(args.factory, namespace)
            options["call"] = user_callable(args.call, namespace) if args.call else None
        report = check(target, **options)
    except ValueError as e:
        return _bad_option(console, args.json, str(e))
    except CannotRun as e:
        return _cannot_run(console, args.json, f"could not run the module: {e}")
    except Exception as e:  # never a traceback: exit 1 means "found a bug", so a crash must not look like one
        return _cannot_run(console, args.json, f"the doctor could not check this module: {type(e).__name__}: {e}")
    if args.json:
        print(report.to_json())
    else:
        render(report, console)
    return {"passed": 0, "failed": 1, "inconclusive": 3}[report.verdict]


def _check_model(args: argparse.Namespace, options: dict, console: object) -> int:
    from .check import CannotRun, check_model, render_model
    from .check.subject.building import load_file

    for flag in ("init", "call", "factory", "mutate"):
        if getattr(args, flag):
            return _bad_option(console, args.json, f"--{flag} does not go with --model (the model's own calls are "
                                                   "replayed)")
    path, sep, name = args.target.rpartition(":")
    try:
        if not sep or not path or not name:
            raise CannotRun(f"expected path/to/file.py:factory, got {args.target!r}")
        factory = vars(load_file(path)).get(name)
        if not callable(factory):
            raise CannotRun(f"{path} has no function named {name!r}")
        try:
            made = factory()
        except Exception as e:
            raise CannotRun(f"the factory failed: {type(e).__name__}: {e}") from e
        if not (isinstance(made, tuple) and len(made) == 2):
            raise CannotRun(f"{name}() must return (model, example_inputs), got {type(made).__name__}")
        kept = {k: v for k, v in options.items() if k not in ("init", "embed_dim", "call")}
        report = check_model(made[0], made[1], layers=args.layers, **kept)
    except ValueError as e:
        return _bad_option(console, args.json, str(e))
    except CannotRun as e:
        return _cannot_run(console, args.json, f"could not run the model: {e}")
    except Exception as e:  # never a traceback
        return _cannot_run(console, args.json, f"the doctor could not check this model: {type(e).__name__}: {e}")
    if args.json:
        print(report.to_json())
    else:
        render_model(report, console)  # type: ignore[arg-type]
    return {"passed": 0, "failed": 1, "inconclusive": 3}[report.verdict]


def _bad_option(console: object, as_json: bool, message: str) -> int:
    """Exit 2 for an option the doctor cannot use; with --json the message is the JSON's error."""
    if as_json:
        print(json.dumps({"passed": False, "verdict": "could not run", "error": f"bad option: {message}"}))
    else:
        console.print(f"[red]bad option[/red]: {message}")  # type: ignore[attr-defined]
    return 2


def _cannot_run(console: object, as_json: bool, message: str) -> int:
    if as_json:
        print(json.dumps({"passed": False, "verdict": "could not run", "error": message}))
    else:
        console.print(f"[red]{message}[/red]")  # type: ignore[attr-defined]
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

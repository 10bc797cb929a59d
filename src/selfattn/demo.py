"""``selfattn demo``: the tutorial's walkthrough with real tensors.

1. The shape table for batch 32, length 10, embed 512 (x, Q, K, V, scores, weights, output).
2. The 4-token example ("深度", "学习", "很", "有趣", embed 8): the tutorial's illustrative
   score matrix and its softmax, then a real ``SelfAttention(8)``'s weights; both printed and
   drawn as a heatmap PNG (needs matplotlib: ``pip install selfattn[plot]``).
3. One line per backend: its output against the float64 oracle of ``selfattn.testing``, with
   the error and whether it is within the test suite's rule.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D head dim, E embed dim.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from . import masks, testing
from .backends import REGISTRY
from .functional import attention, explain
from .nn import SelfAttention

TOKENS = ["深度", "学习", "很", "有趣"]
TOKENS_LATIN = ["shendu", "xuexi", "hen", "youqu"]  # labels when no CJK font is installed
# The tutorial's illustrative scores (each token against every token).
TUTORIAL_SCORES = torch.tensor([
    [0.8, 0.6, 0.1, 0.05],
    [0.7, 0.9, 0.2, 0.1],
    [0.1, 0.2, 0.95, 0.8],
    [0.05, 0.1, 0.8, 0.9],
])


def shape_table(console: Console) -> None:
    b, length, e = 32, 10, 512
    torch.manual_seed(0)
    attn = SelfAttention(e).eval()
    x = torch.randn(b, length, e)
    with torch.no_grad():
        q, k, v = attn.query(x), attn.key(x), attn.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(e)
        out, weights = attn(x, need_weights=True)
    table = Table(title=f"Shapes through SelfAttention (batch {b}, length {length}, embed {e})")
    for col in ("tensor", "shape", "what it is"):
        table.add_column(col)
    rows = [
        ("x", x, "input tokens"),
        ("Q = x Wq", q, "queries"),
        ("K = x Wk", k, "keys"),
        ("V = x Wv", v, "values"),
        ("scores = Q K^T / sqrt(E)", scores, "every token against every token"),
        ("weights = softmax(scores)", weights, "rows sum to 1"),
        ("output = weights V", out, "same shape as x"),
    ]
    for name, t, what in rows:
        table.add_row(name, str(tuple(t.shape)), what)
    console.print(table)
    console.print(f"weights rows sum to 1: max |sum - 1| = {(weights.sum(-1) - 1).abs().max().item():.2e}")


def _matrix_table(title: str, m: torch.Tensor, labels: list[str]) -> Table:
    table = Table(title=title)
    table.add_column("")
    for lab in labels:
        table.add_column(lab, justify="right")
    for lab, row in zip(labels, m.tolist(), strict=True):
        table.add_row(lab, *(f"{x:.3f}" for x in row))
    return table


def four_tokens(console: Console, out_dir: Path) -> None:
    tutorial_weights = torch.softmax(TUTORIAL_SCORES, dim=-1)
    console.print(_matrix_table("Tutorial scores (illustrative)", TUTORIAL_SCORES, TOKENS))
    console.print(_matrix_table("softmax(scores): the attention weights", tutorial_weights, TOKENS))

    torch.manual_seed(0)
    attn = SelfAttention(8).eval()
    x = torch.randn(1, 4, 8)  # (batch 1, 4 tokens, embed 8)
    with torch.no_grad():
        _, w = attn(x, need_weights=True)
        _, wc = attn(x, mask=masks.causal(), need_weights=True)
    console.print(_matrix_table("SelfAttention(8) weights on random embeddings", w[0], TOKENS))
    console.print(_matrix_table("... with a causal mask (no token sees the future)", wc[0], TOKENS))
    path = _heatmap(out_dir, [tutorial_weights, w[0], wc[0]],
                    ["tutorial scores -> softmax", "SelfAttention(8)", "SelfAttention(8), causal"])
    if path is None:
        console.print("[yellow]heatmap skipped: matplotlib is not installed "
                      "(pip install 'selfattn[plot]')[/yellow]")
    else:
        console.print(f"heatmap written to [bold]{path}[/bold]")


def _heatmap(out_dir: Path, mats: list[torch.Tensor], titles: list[str]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import font_manager
    except ImportError:
        return None
    cjk = [f.name for f in font_manager.fontManager.ttflist
           if any(key in f.name for key in ("CJK", "Noto Sans SC", "WenQuanYi", "SimHei", "Heiti"))]
    labels = TOKENS if cjk else TOKENS_LATIN
    if cjk:
        plt.rcParams["font.family"] = cjk[0]
    fig, axes = plt.subplots(1, len(mats), figsize=(5.2 * len(mats), 4.2))
    fig.subplots_adjust(wspace=0.45)
    for ax, m, title in zip(axes, mats, titles, strict=True):
        im = ax.imshow(m.numpy(), vmin=0, vmax=1, cmap="viridis")
        ax.set_xticks(range(4), labels)
        ax.set_yticks(range(4), labels)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(title)
        for i in range(4):
            for j in range(4):
                ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center",
                        color="white" if m[i, j] < 0.5 else "black", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.8)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "attention_4_tokens.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def backend_check(console: Console) -> None:
    """Every backend on one awkward call (GQA, Lq != Lk, causal + padding) against the float64 oracle
    of :mod:`selfattn.testing`, held to its rule."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 113, 59, generator=g)  # (B, Hq, Lq, D)
    k = torch.randn(2, 2, 203, 59, generator=g)  # (B, Hkv, Lk, D)
    v = torch.randn(2, 2, 203, 59, generator=g)  # (B, Hkv, Lk, Dv)
    mask = masks.causal("bottom_right") & masks.padding(torch.tensor([203, 150]))
    ref = testing.reference_attention(q, k, v, mask=mask)
    naive = testing.reference_attention(q, k, v, mask=mask, dtype=None, safe=False)
    table = Table(title="Backends vs the float64 oracle (B=2, Hq=6, Hkv=2, Lq=113, Lk=203, D=59, "
                        "causal bottom-right & padding)")
    for col in ("backend", "max |out - ref64|", "tolerance", "verdict"):
        table.add_column(col)
    table.caption = ("the rule (selfattn.testing): error <= 2 x that of the textbook math done in float32, "
                     "+ 16 ulps")
    for name in REGISTRY:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # flex on the CPU warns that it compiles first
                out = attention(q, k, v, mask=mask, backend=name)
        except Exception as e:  # a backend this machine cannot run (e.g. no C++ compiler for flex)
            table.add_row(name, "-", "-", f"[yellow]not run[/yellow]: {type(e).__name__}: {str(e)[:80]}")
            continue
        c = testing.compare_to_reference(out, ref, naive, name=name)
        table.add_row(name, f"{c.error:.2e}", f"{c.tolerance:.2e}",
                      "[green]matches[/green]" if c.ok else "[red]MISMATCH[/red]")
    console.print(table)
    console.print(str(explain(q, k, v, mask=mask)))


def main(out_dir: Path = Path("selfattn-out")) -> int:
    console = Console()
    console.rule("1. Shapes")
    shape_table(console)
    console.rule("2. Four tokens: 深度 学习 很 有趣")
    four_tokens(console, out_dir)
    console.rule("3. Every backend against float64")
    backend_check(console)
    return 0

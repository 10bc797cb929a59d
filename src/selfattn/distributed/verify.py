"""Check a user's own context-parallel attention: run it on gloo ranks against the one-process oracle, and name
what is wrong.

:func:`check_context_parallel` spawns W processes, each with a gloo group; every rank draws the same global
q, k, v (float64) and, for each mask case (none, causal, a causal sliding window, packed documents, padding),
hands the user's function its shard in the stated layout with a :class:`Case` that says everything the mask is
made of. The outputs and the gradients of q, k and v are gathered and compared with the oracle
(``selfattn.testing.reference_attention`` on the whole sequence). A case that differs is explained by the
outputs of the known mistakes, each computed on one process: the window ignored or inverted, the mask built from
local positions, key blocks taken for another rank's (the ring turned the wrong way, or another layout assumed),
the causal, document or padding part dropped, the partial results merged in low precision (the error only on
rows whose keys lie on several ranks), or a wrong gradient behind a right output.

Shape legend: B batch, H heads, L the global length, W the world size, n = L / W tokens per rank, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import distributed as sad
from .. import masks as _masks
from .._oracle import reference_attention
from ..bench.spawn import run_ranks

__all__ = ["CASES", "Case", "ContextParallelFinding", "ContextParallelReport", "check_context_parallel"]

CASES = ("none", "causal", "window", "documents", "padding")
_B, _H, _D = 2, 2, 8
_EXACT = 1e-9  # float64: a right implementation agrees with the oracle far below this
_MATCH = 1e-7  # an output this close to a mistake's is that mistake


@dataclass
class Case:
    """What the user's function is given with this rank's q, k and v: the mask, said every way a ring needs it.

    Attributes:
        name: the case ("none", "causal", "window", "documents", "padding").
        rank, world: this rank and W.
        group: the process group of the W ranks.
        layout: "contiguous" or "zigzag".
        positions: (n,) the global positions of this rank's tokens, in their local order.
        all_positions: (W, n) every rank's (rank o's keys sit at ``all_positions[o]``).
        causal: key j is visible from query i only when j <= i.
        window: (left, right): only keys with i - left <= j <= i + right; None for none.
        document_ids: (B, L) global document ids (a key is visible only within the query's document), or None.
        cu_seqlens: (N + 1,) the same documents as offsets (every row holds the same ones), or None.
        lengths: (B,) real tokens of each row (keys at positions >= lengths[b] are padding), or None.
        mask: the whole mask as a :mod:`selfattn.masks` mask on global positions.
        scale: the softmax scale, 1 / sqrt(D).
    """

    name: str
    rank: int
    world: int
    group: Any
    layout: str
    positions: Tensor
    all_positions: Tensor
    causal: bool = False
    window: tuple[int, int] | None = None
    document_ids: Tensor | None = None
    cu_seqlens: Tensor | None = None
    lengths: Tensor | None = None
    mask: _masks.Mask | None = None
    scale: float = 1.0


@dataclass(frozen=True)
class ContextParallelFinding:
    """One thing wrong: ``id`` (a kind below), the case it showed in, what it means, the evidence and a fix."""

    id: str
    case: str
    message: str
    evidence: str
    fix: str


@dataclass
class ContextParallelReport:
    """Per case, the largest relative errors of the output and of each gradient; and the findings."""

    world: int
    layout: str
    errors: dict[str, dict[str, float]] = field(default_factory=dict)
    findings: list[ContextParallelFinding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def __str__(self) -> str:
        head = f"context-parallel attention on {self.world} ranks, layout {self.layout!r}: "
        if self.ok:
            return head + f"equal to one process in every case ({', '.join(self.errors)})"
        return head + "\n" + "\n".join(f"- {f.id} ({f.case}): {f.message}\n  evidence: {f.evidence}\n  fix: {f.fix}"
                                       for f in self.findings)


_FIXES = {
    "window-ignored": "apply the window on every block of the ring, from global positions",
    "window-inverted": "a key is in the window when i - left <= j <= i + right (global positions): check the sign",
    "local-positions": "build each block's mask from the global positions of its queries and of the keys' owner, "
                       "not from indices within the shard",
    "ring-order": "at step s rank r holds the keys of rank (r - s) mod W (they travel to the next rank): mask "
                  "them with that rank's positions",
    "layout-mismatch": "the function assumes another layout than the one its shards are in",
    "rows-out-of-order": "return this rank's rows in the order its shard holds them",
    "causal-dropped": "keep the causal part of the mask on every block",
    "documents-ignored": "keep the document mask on every block (from global document ids)",
    "padding-ignored": "mask the padded keys on every block",
    "merge-precision": "merge the blocks' partial outputs and lse in float32 or better (lse = logaddexp, "
                       "out = sum of exp(lse_block - lse) * out_block)",
    "wrong-gradient": "the forward is right: check the backward (dK/dV returned to their owners, the global lse "
                      "used to recompute each block)",
    "wrong-output": "no known mistake explains it: compare one block at a time with selfattn.distributed.attention",
    "crashed": "the function raised",
    "wrong-shape": "return (B, H, n, D), this rank's rows",
}


def _case(name: str, rank: int, world: int, layout: str, group: Any, length: int) -> Case:
    lay = sad.Sharding.of(layout, length, world)
    allpos = torch.stack([lay.positions(r) for r in range(world)])
    case = Case(name, rank, world, group, layout, allpos[rank], allpos, scale=_D ** -0.5)
    parts: list[_masks.Mask] = []
    if name in ("causal", "window", "documents"):
        case.causal = True
        parts.append(_masks.causal())
    if name == "window":
        case.window = (length // 4, 0)
        parts.append(_masks.sliding_window(*case.window))
    if name == "documents":
        sizes = [length // 4 - 1, length // 2 + 3, length - (length // 4 - 1) - (length // 2 + 3)]
        case.cu_seqlens = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
        case.document_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes)).expand(_B, length).clone()
        parts.append(_masks.document(case.document_ids))
    if name == "padding":
        case.lengths = torch.tensor([length - 3, length // 2 + 1])
        parts.append(_masks.padding(case.lengths))
    for p in parts:
        case.mask = p if case.mask is None else case.mask & p
    return case


def _rank_body(rank: int, world: int, spec: dict) -> dict:
    """One rank: every case through the user's function; the gathered outputs and gradients, as lists."""
    fn: Callable[..., Tensor] = spec["fn"]
    layout, length = spec["layout"], spec["length"]
    g = torch.Generator().manual_seed(spec["seed"])
    q, k, v, gout = (torch.randn(_B, _H, length, _D, generator=g, dtype=torch.float64) for _ in range(4))
    out: dict = {}
    for name in spec["cases"]:
        case = _case(name, rank, world, layout, dist.group.WORLD, length)
        ql, kl, vl = (sad.shard(t, layout=layout).requires_grad_() for t in (q, k, v))
        try:
            o = fn(ql, kl, vl, case)
        except Exception as e:  # the user's function: its failure is a finding, on every rank alike
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        if not isinstance(o, Tensor) or tuple(o.shape) != tuple(ql.shape):
            out[name] = {"shape": str(tuple(o.shape)) if isinstance(o, Tensor) else type(o).__name__}
            continue
        o.backward(sad.shard(gout, layout=layout))
        got = {n: sad.unshard(t.detach().double(), layout=layout) for n, t in
               (("out", o), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad)) if t is not None}
        out[name] = {n: t.tolist() for n, t in got.items()} if rank == 0 else {}
    return out


def _rel(a: Tensor, b: Tensor, rows: Tensor | None = None) -> float:
    """Largest |a - b| relative to max(1, max |b|), over query rows ``rows`` (bool (L,)) when given."""
    if rows is not None:
        if not bool(rows.any()):
            return 0.0
        a, b = a[:, :, rows], b[:, :, rows]
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def _oracle(q: Tensor, k: Tensor, v: Tensor, gout: Tensor, visible: Tensor, scale: float) -> dict[str, Tensor]:
    """Output and gradients of attention with a dense (B|1, H|1, L, L) visibility (rows that see nothing: 0)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = reference_attention(q, k, v, mask=visible.expand(_B, _H, -1, -1), scale=scale)
    o.backward(gout)
    return {"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}  # type: ignore[dict-item]


def _dense(mask: _masks.Mask | None, length: int) -> Tensor:
    return torch.ones(1, 1, length, length, dtype=torch.bool) if mask is None else mask.dense(length, length)


def _mistakes(case: Case, length: int) -> dict[str, Tensor]:
    """The dense visibility each known mistake gives, (B|1, H|1, L, L) on global positions."""
    full = _dense(case.mask, length)
    out: dict[str, Tensor] = {}
    pos = case.all_positions  # (W, n)
    world, n = pos.shape
    owner = torch.empty(length, dtype=torch.long)
    local = torch.empty(length, dtype=torch.long)
    for r in range(world):
        owner[pos[r]], local[pos[r]] = r, torch.arange(n)
    idx = torch.arange(length)

    def remapped(qi: Tensor, kj: Tensor) -> Tensor:
        """visible'(I, J) = full(qi[I, J], kj[I, J]): the mask read at other positions, (B|1, H|1, L, L)."""
        return full[:, :, qi, kj]

    out["local-positions"] = remapped(local[:, None].expand(length, length), local[None, :].expand(length, length))
    if world > 1:  # keys of owner o masked as if they were rank (2r - o)'s, r the query's rank: the ring reversed
        wrong_owner = (2 * owner[:, None] - owner[None, :]) % world
        out["ring-order"] = remapped(idx[:, None].expand(length, length), pos[wrong_owner, local[None, :]])
        other = "contiguous" if case.layout == "zigzag" else "zigzag"
        believed = torch.empty(length, dtype=torch.long)
        alt = sad.Sharding.of(other, length, world)
        for r in range(world):
            believed[pos[r]] = alt.positions(r)
        out["layout-mismatch"] = remapped(believed[:, None].expand(length, length),
                                          believed[None, :].expand(length, length))
    parts = {"causal-dropped": case.causal, "window-ignored": case.window is not None,
             "documents-ignored": case.document_ids is not None, "padding-ignored": case.lengths is not None}
    for mistake, present in parts.items():
        if not present:
            continue
        kept = []
        if case.causal and mistake != "causal-dropped":
            kept.append(_masks.causal())
        if case.window is not None and mistake != "window-ignored":
            kept.append(_masks.sliding_window(*case.window))
        if case.document_ids is not None and mistake != "documents-ignored":
            kept.append(_masks.document(case.document_ids))
        if case.lengths is not None and mistake != "padding-ignored":
            kept.append(_masks.padding(case.lengths))
        m = None
        for p in kept:
            m = p if m is None else m & p
        out[mistake] = _dense(m, length)
    if case.window is not None:
        left, right = case.window
        i, j = idx[:, None], idx[None, :]
        causal = (j <= i) if case.causal else torch.ones(length, length, dtype=torch.bool)
        inside = (j >= i - left) & (j <= i + right)
        out["window-inverted"] = (causal & ~inside)[None, None]
    return out


def _explain(name: str, case: Case, got: dict[str, Tensor], ref: dict[str, Tensor], inputs: tuple[Tensor, ...],
             length: int) -> ContextParallelFinding:
    """The finding for a case whose result differs from the oracle's."""
    q, k, v, gout = inputs
    err = {n: _rel(got[n], ref[n]) for n in got}
    shown = ", ".join(f"{n} {e:.1e}" for n, e in err.items())
    missing = [n[1] for n in ("dq", "dk", "dv") if n not in got]
    if err["out"] <= _EXACT and missing:
        return ContextParallelFinding("wrong-gradient", name, f"the output is right but no gradient reaches "
                                      f"{', '.join(missing)}", shown, _FIXES["wrong-gradient"])
    if err["out"] <= _EXACT:
        bad = [n for n in ("dq", "dk", "dv") if err.get(n, 0.0) > _EXACT]
        return ContextParallelFinding("wrong-gradient", name, f"the output is right but the gradient of "
                                      f"{', '.join(b[1] for b in bad)} is not", shown, _FIXES["wrong-gradient"])
    for mistake, visible in _mistakes(case, length).items():
        if torch.equal(visible.expand(_B, _H, -1, -1), _dense(case.mask, length).expand(_B, _H, -1, -1)):
            continue  # this mistake changes nothing in this case: it cannot be told apart here
        cand = _oracle(q, k, v, gout, visible, case.scale)
        if _rel(got["out"], cand["out"]) <= _MATCH:
            what = {"local-positions": "the mask is built from each rank's local positions (0 .. n-1 in its shard), "
                                       "not the tokens' global positions",
                    "ring-order": "each block of keys is masked as if it belonged to another rank: the ring turns one "
                                  "way and the code assumes the other",
                    "layout-mismatch": "the mask assumes another layout than the one the shards are in",
                    "window-inverted": "the sliding window is inverted: the keys outside it are seen, those inside "
                                       "are not",
                    "window-ignored": "the sliding window is not applied",
                    "causal-dropped": "the causal part of the mask is dropped",
                    "documents-ignored": "the document mask is dropped: queries see other documents' keys",
                    "padding-ignored": "the padded keys are attended to"}[mistake]
            return ContextParallelFinding(mistake, name, what, f"{shown}; equal to that mistake's output to "
                                          f"{_rel(got['out'], cand['out']):.1e}", _FIXES[mistake])
    chunk = length // (case.world * (2 if case.layout == "zigzag" else 1))
    if case.layout == "zigzag":  # each rank's two chunks returned swapped: chunk c gathered where 2W - 1 - c goes
        perm = torch.arange(length).view(-1, chunk).flip(0).flatten()
        if _rel(got["out"], ref["out"][:, :, perm]) <= _MATCH:
            return ContextParallelFinding("rows-out-of-order", name, "each rank returns its rows in another order than "
                                          "its shard holds them", shown, _FIXES["rows-out-of-order"])
    visible = _dense(case.mask, length).expand(_B, _H, -1, -1)
    owner = torch.empty(length, dtype=torch.long)
    for r in range(case.world):
        owner[case.all_positions[r]] = r
    spans = torch.zeros(length, dtype=torch.bool)  # rows whose visible keys lie on more than one rank
    for i in range(length):
        seen = owner[visible[..., i, :].any(0).any(0)]
        spans[i] = seen.numel() > 0 and bool((seen != seen[0]).any())
    one, many = _rel(got["out"], ref["out"], ~spans), _rel(got["out"], ref["out"], spans)
    if one <= _EXACT < many <= 3e-2:
        return ContextParallelFinding("merge-precision", name, "rows whose keys all lie on one rank are exact, rows "
                                      "that merge several ranks' blocks are off by a low precision's rounding: the "
                                      "partial outputs or lse are merged in low precision",
                                      f"{shown}; rows on one rank {one:.1e}, rows over several {many:.1e}",
                                      _FIXES["merge-precision"])
    return ContextParallelFinding("wrong-output", name, "the output differs from one process's and no known mistake "
                                  "explains it", shown, _FIXES["wrong-output"])


def check_context_parallel(fn: Callable[..., Tensor], *, world_size: int = 2, layout: str = "contiguous",
                           cases: tuple[str, ...] | list[str] = CASES, length: int | None = None, seed: int = 0,
                           timeout: float = 300.0) -> ContextParallelReport:
    """Run a user's context-parallel attention on ``world_size`` gloo ranks and compare it with one process.

    Args:
        fn: ``fn(q, k, v, case) -> out``, a module-level function (it is pickled by name into the ranks): q, k, v
            (B, H, n, D) float64, this rank's shard in ``layout`` (requires grad); ``case`` a :class:`Case` (the
            group, the positions of every rank's tokens, and the mask as flags, document ids, cu_seqlens, lengths
            and a :mod:`selfattn.masks` mask); ``out`` (B, H, n, D), this rank's rows. It may use any transport on
            ``case.group``.
        world_size: W, the ranks to spawn.
        layout: "contiguous" or "zigzag": how the shards are cut (:func:`selfattn.distributed.shard`).
        cases: which of :data:`CASES` to run.
        length: L, the global length (default 8 W, or 16 W for zigzag).
        seed: the seed of q, k, v and the output gradient.
        timeout: seconds the ranks may take in all.

    Returns:
        A :class:`ContextParallelReport`: the errors of every case and a finding for each that differs.

    Example:
        >>> report = check_context_parallel(my_ring, world_size=2, layout="zigzag")
        >>> print(report)
    """
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', got {layout!r}")
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise ValueError(f"cases must be some of {CASES}, got {list(cases)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    parts = world_size * (2 if layout == "zigzag" else 1)
    length = length if length is not None else 8 * parts
    if length % parts or length < 4 * parts:
        raise ValueError(f"length must be a multiple of {parts} and at least {4 * parts}, got {length}")
    ran = run_ranks(_rank_body, {"fn": fn, "layout": layout, "length": length, "seed": seed, "cases": list(cases)},
                    world_size, timeout, timeout_s=timeout)
    report = ContextParallelReport(world_size, layout)
    if isinstance(ran, str):
        report.findings.append(ContextParallelFinding("crashed", "all", "the ranks did not finish", ran,
                                                      _FIXES["crashed"]))
        return report
    g = torch.Generator().manual_seed(seed)
    q, k, v, gout = (torch.randn(_B, _H, length, _D, generator=g, dtype=torch.float64) for _ in range(4))
    inputs = (q, k, v, gout)
    for name in cases:
        res = ran[0][name]
        if "error" in res or "shape" in res:
            kind = "crashed" if "error" in res else "wrong-shape"
            report.findings.append(ContextParallelFinding(kind, name, "the function raised" if kind == "crashed" else
                                                          "the output is not this rank's (B, H, n, D)",
                                                          res.get("error") or f"got {res['shape']}", _FIXES[kind]))
            continue
        case = _case(name, 0, world_size, layout, None, length)
        got = {n: torch.tensor(t, dtype=torch.float64) for n, t in res.items()}
        ref = _oracle(q, k, v, gout, _dense(case.mask, length), case.scale)
        report.errors[name] = {n: _rel(got[n], ref[n]) for n in got}
        if max(report.errors[name].values()) > _EXACT or set(got) != {"out", "dq", "dk", "dv"}:
            report.findings.append(_explain(name, case, got, ref, inputs, length))
    return report

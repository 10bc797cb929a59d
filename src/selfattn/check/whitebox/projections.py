"""The white box's first reading: the attention recomputed from the module's projections.

The linear maps one common input goes through (the module's input, or a norm of it; one fused map,
a query map and a fused key/value map, or three maps) are the projections Q, K, V. The attention is
recomputed from them under the definition and under each known bug, with rotary positions when
plain Q, K do not fit, and compared with the output of every later linear map (the output
projection, before any residual or norm) and with the module's output; the formula that reproduces
one of them names the bug. A module whose scores differ from Q K^T / sqrt(D) by a term that depends
only on (head, query, key) has a relative-position bias.

Shape legend: B batch, H query heads, G kv heads, L length, E embed dim, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..findings import (
    DEFINITION_MISMATCH,
    HEAD_MERGE,
    MASK_AFTER_SOFTMAX,
    MATMUL_ORDER,
    MISSING_SCALE,
    SOFTMAX_DIM,
    WRONG_SCALE,
)
from .positions import ROPE_BASES, rope
from .products import distance_rewarded, name_role
from .trace import Linear, Op, Trace, linears


class NoFormula(LookupError):
    """No formula over the projections reproduces the module's output (a doctor bug, an IndexError or a KeyError,
    is not this: it is reported as the doctor's error, never read as "no formula")."""

__all__ = ["Capture", "NoFormula", "capture", "identify", "qkv_heads"]

Project = Callable[[Tensor], Tensor]  # (..., E_in) float64 -> (..., E_out) float64


@dataclass
class Capture:
    """The module's projections of its input u and what came after, from one run.

    ``splits`` holds every reading of the projections as (q (B, L, H * D), k (B, L, G * D),
    v (B, L, G * D)); ``outs`` the linear maps applied after them (candidates for the output
    projection); ``softmax_in`` the softmax inputs (each (..., L, L), normalised over the last dim).
    """

    splits: list[tuple[Tensor, Tensor, Tensor]]
    outs: list[Linear]
    how: str
    softmax_in: list[Tensor] = field(default_factory=list)
    # a term the module adds to the scores as given to it, (B or 1, H or 1, L, L): a float attn_mask that is a bias
    # (a pair bias per item, relative positions) handed to nn.MultiheadAttention's functional core
    added: Tensor | None = None

    @property
    def q(self) -> Tensor:
        return self.splits[0][0]

    @property
    def k(self) -> Tensor:
        return self.splits[0][1]

    @property
    def v(self) -> Tensor:
        return self.splits[0][2]


def _linear(weight: Tensor, bias: Tensor | None) -> Project:
    w, b = weight.detach().double(), None if bias is None else bias.detach().double()
    return lambda t: nn.functional.linear(t, w, b)


def _fused_splits(o: Tensor, e: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Readings of one fused projection of width W: [q | k | v] in equal thirds, or q of width E and k, v halves."""
    width = o.shape[-1]
    splits: list[tuple[Tensor, Tensor, Tensor]] = []
    if width % 3 == 0:
        splits.append(tuple(o.split(width // 3, dim=-1)))
    rest = width - e
    if rest > 0 and rest % 2 == 0 and rest // 2 != width // 3:
        splits.append(tuple(o.split([e, rest // 2, rest // 2], dim=-1)))
    return splits


def capture(trace: Trace, module: nn.Module, x: Tensor) -> Capture | str:
    """The projections in a recorded run, or why they were not found.

    Args:
        trace: the record of one run of the module on ``x``.
        module: the module (for the maps of hooked leaves such as transformers' Conv1D).
        x: (B, L, E) the module's input in that run.
    """
    softmax_in = [op.args[0] for op in trace.ops if op.name in ("softmax", "_softmax") and
                  (op.args[1] if len(op.args) > 1 and isinstance(op.args[1], int) else op.kwargs.get("dim"))
                  in (-1, op.args[0].dim() - 1)]
    for op in trace.ops:
        if op.name == "multi_head_attention_forward":
            found = _mha(op, x)
            if found is not None:
                q, k, v, out, added = found
                made = op.outputs[0] if op.outputs else None  # (L, B, E): the attention's own output, before what
                if made is not None and made.dim() == 3:    # a block adds after it (a residual, an MLP)
                    made = made.transpose(0, 1) if made.transpose(0, 1).shape[:2] == q.shape[:2] else made
                return Capture([(q, k, v)], [Linear("out_proj", q, 0, made, out)],
                               "nn.MultiheadAttention's packed in-projection", softmax_in,
                               None if added is None or added.shape[0] not in (1, q.shape[0]) else added)
    maps = linears(trace, module)
    if not maps:
        return "no linear map was applied (projections done another way)"
    groups: dict[int, list[Linear]] = {}
    for lin in maps:
        groups.setdefault(lin.input_id, []).append(lin)
    order = sorted(groups.values(), key=lambda g: (not (g[0].input.shape == x.shape and
                                                        torch.equal(g[0].input, x.to(g[0].input.dtype))),
                                                   maps.index(g[0])))
    for group in order:
        splits, how = _readings(group, trace.fused_order)
        if splits:
            used = {id(g) for g in group}
            start = max(maps.index(g) for g in group)
            outs = [m for m in maps[start + 1:] if id(m) not in used]
            return Capture(splits, outs, how, softmax_in)
    sizes = ", ".join(str(len(g)) for g in groups.values())
    return f"no input goes through 1 (fused), 2 (q and kv) or 3 (q, k, v) projections (groups of {sizes})"


def _output(lin: Linear) -> Tensor:
    """The output of a map :func:`linears` recorded (it records each with its output)."""
    assert lin.output is not None
    return lin.output


def _readings(group: list[Linear], fused_order: tuple[str, ...] | None = None
              ) -> tuple[list[tuple[Tensor, Tensor, Tensor]], str]:
    e = group[0].input.shape[-1]
    if len(group) == 1:  # equal thirds in the order the module's source unpacks them (key, query, value = ...)
        roles = fused_order or ("q", "k", "v")
        splits = _fused_splits(_output(group[0]), e)
        thirds = [t for t in splits if len({p.shape[-1] for p in t}) == 1]
        splits = [(t[roles.index("q")], t[roles.index("k")], t[roles.index("v")]) for t in thirds] + \
            [t for t in splits if not any(t is u for u in thirds)]
        return splits, f"fused projection {group[0].name!r} split as [{' | '.join(roles)}]"
    if len(group) == 2:
        a, b = group
        if name_role(b.name) == "q" or "kv" in a.name.split(".")[-1]:
            a, b = b, a
        q, kv = _output(a), _output(b)
        if kv.shape[-1] % 2 == 0 and (kv.shape[-1] == 2 * q.shape[-1] or "kv" in b.name):
            k, v = kv.chunk(2, dim=-1)
            return [(q, k, v)], f"projections {a.name!r} (q) and {b.name!r} split as [k | v]"
        return [], ""
    if len(group) == 3:
        named = {name_role(g.name): _output(g) for g in group}
        if set(named) == {"q", "k", "v"}:
            return [(named["q"], named["k"], named["v"])], "separate projections, recognised by name"
        q, k, v = (_output(g) for g in group)
        return [(q, k, v)], "separate projections, taken in call order as q, k, v"
    return [], ""


def _mha(op: Op, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Project, Tensor | None] | None:
    """q, k, v, the output map of nn.MultiheadAttention's functional core, when its query is ``x``, and the term
    its float attn_mask adds to the scores when that mask is a bias, (B or 1, H or 1, L, L)."""
    a = op.mha_arguments()
    if a.get("bias_k") is not None or a.get("add_zero_attn") or a.get("static_k") is not None:
        return None  # keys the projections do not make
    bias = a.get("attn_mask")
    added = None
    if isinstance(bias, Tensor) and bias.is_floating_point() and bool(((bias != 0) & (bias > -1e4)).any()):
        # a float attn_mask that is a bias: (L, L), or (B * H, L, L) item-major, one per item and head (a pair
        # bias: ParT's); read as a term of the scores where every entry is finite
        heads = int(a.get("num_heads") or 0)
        if not bool(torch.isfinite(bias).all()) or heads < 1 or bias.dim() not in (2, 3):
            return None  # a bias and a mask in one tensor (WavLM's gated relative positions beside padding)
        added = bias.detach().double()[None, None] if bias.dim() == 2 else \
            bias.detach().double().reshape(-1, heads, *bias.shape[-2:])
    separate = bool(a.get("use_separate_proj_weight"))
    missing = [a.get(f"{r}_proj_weight") for r in "qkv"] if separate else [a["in_proj_weight"]]
    if any(w is None for w in missing):
        return None
    query = a["query"]
    batch_first = query.transpose(0, 1)
    if batch_first.shape != x.shape and query.shape != x.shape:
        return None
    # the functional core takes (L, B, E) whatever batch_first says; its query may be a norm of x (pre-norm blocks),
    # so the layout follows the shapes, and x itself only where both readings have its shape (B == L)
    xin = batch_first if batch_first.shape == x.shape and not (
        query.shape == x.shape and torch.equal(query, x.to(query.dtype))) else query
    b, e = a["in_proj_bias"], a["embed_dim_to_check"]
    # fairseq-style modules pass three weights (use_separate_proj_weight) and the packed bias
    ws = [a[f"{r}_proj_weight"].detach() for r in "qkv"] if separate else a["in_proj_weight"].detach().split(e)
    bs = [None] * 3 if b is None else b.detach().split(e)
    tr = (lambda t: t.transpose(0, 1)) if xin is batch_first else (lambda t: t)
    q, k, v = (nn.functional.linear(tr(t), wi, bi)
               for t, wi, bi in zip((a["query"], a["key"], a["value"]), ws, bs, strict=True))
    return q, k, v, _linear(a["out_proj_weight"], a["out_proj_bias"]), added


def _heads(t: Tensor, h: int) -> Tensor:
    """(B, H, L, D) from a projection's output (B, L, E), or (B, H, W, E) for an image (its tokens row by row)."""
    b, e = t.shape[0], t.shape[-1]
    return t.reshape(b, -1, h, e // h).transpose(1, 2)


def _masked(s: Tensor, keep: Tensor | None) -> Tensor:
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _variants(qh: Tensor, kh: Tensor, vh: Tensor, keep: Tensor | None, raw: Tensor | None,
              stated: float | None = None,
              added: Tensor | None = None) -> dict[str, list[tuple[str, Callable[[], Tensor]]]]:
    """Candidate outputs (B, L, E) before the output projection, by finding id; "correct" is the definition.

    qh (B, H, L, D); kh, vh (B, H, L, D) (kv heads already repeated); keep (B, 1, L, L) bool or None;
    raw: the mask the module was given, as float (B, 1, L, L), for masks applied after the softmax;
    stated: the score scale the user or the module's config states, instead of 1/sqrt(D); added: a term the module
    adds to the scaled scores as it was given one (a bias through nn.MultiheadAttention's attn_mask).
    """
    b, h, length, d = qh.shape
    e = h * d
    scores = qh @ kh.transpose(-1, -2)  # (B, H, L, L)
    good = stated if stated is not None else 1 / math.sqrt(d)

    def merge(o: Tensor) -> Tensor:
        return o.transpose(1, 2).reshape(b, length, e)

    seen: dict[tuple[float, int], Tensor] = {}  # several candidates share a softmax: compute each once

    def soft(scale: float, dim: int = -1) -> Tensor:
        if (scale, dim) not in seen:
            terms = scores * scale if added is None else scores * scale + added
            seen[scale, dim] = torch.softmax(_masked(terms, keep), dim=dim).nan_to_num(0)
        return seen[scale, dim]

    def differs(scale: float) -> bool:
        return abs(scale / good - 1) > 1e-6

    definition = "softmax(QK^T / sqrt(D)) V" if stated is None else f"softmax({stated:.6g} QK^T) V (the stated scale)"
    out: dict[str, list[tuple[str, Callable[[], Tensor]]]] = {
        "correct": [(definition, lambda: merge(soft(good) @ vh))],
        MISSING_SCALE: [("softmax(QK^T) V, no 1/sqrt(D)", lambda: merge(soft(1.0) @ vh))] if differs(1.0) else [],
        WRONG_SCALE: [("scaled by 1/D", lambda: merge(soft(1 / d) @ vh))] if differs(1 / d) else [],
        SOFTMAX_DIM: [("softmax over the query dimension", lambda: merge(soft(good, -2) @ vh))],
        MATMUL_ORDER: [("weights transposed before V", lambda: merge(soft(good).transpose(-1, -2) @ vh))],
    }
    if h > 1:
        if differs(1 / math.sqrt(e)):
            out[WRONG_SCALE].append(("scaled by 1/sqrt(E) (embed dim, not head dim)",
                                       lambda: merge(soft(1 / math.sqrt(e)) @ vh)))
        out[HEAD_MERGE] = [("heads merged with view/reshape without transposing back",
                              lambda: (soft(good) @ vh).reshape(b, length, e))]
    if h == 1:
        out[SOFTMAX_DIM].append(("softmax over the batch dimension", lambda: merge(soft(good, 0) @ vh)))
        if length == d:
            out[MATMUL_ORDER].append(("V @ weights instead of weights @ V", lambda: merge(vh @ soft(good))))
    if keep is not None:
        plain = torch.softmax(scores * good, -1)
        out[MASK_AFTER_SOFTMAX] = [("mask multiplied into the weights after softmax (not renormalised)",
                                      lambda: merge(plain * keep @ vh))]
        if raw is not None:
            out[MASK_AFTER_SOFTMAX].append(("mask added to the weights after softmax",
                                              lambda: merge((plain + raw) @ vh)))
    return out


def _score_fit(cap: Capture, qh: Tensor, kh: Tensor) -> float:
    """Best correlation of Q K^T (B, H, L, L) with a captured softmax input, over its finite, unmasked entries."""
    scores = qh @ kh.transpose(-1, -2)
    best = -1.0
    for s in cap.softmax_in:
        if s.numel() != scores.numel():
            continue
        s = s.double().reshape(scores.shape)
        seen = torch.isfinite(s) & (s > -1e3)
        if seen.sum() < 4:
            continue
        a, b = s[seen] - s[seen].mean(), scores[seen] - scores[seen].mean()
        best = max(best, float((a @ b) / (a.norm() * b.norm() + 1e-30)))
    return best


# (map applied to a candidate, what it must reproduce, where the match stands in the module)
Target = tuple[Callable[[Tensor], Tensor], Tensor, str]
AFTER = "the output of {name}; the module adds more after it (a residual, a norm, zeroed padded rows)"


def _targets(cap: Capture, final: Tensor) -> list[Target]:
    """What a candidate (B, L, H * D) may reproduce: the module's output as it is or through one of the linear maps
    after the projections, or that map's own output (before a residual or norm the module adds after it)."""
    found: list[Target] = [(lambda c: c, final.double(), "the module's output")]
    for lin in cap.outs[:3]:
        found.append((lin.apply, final.double(), f"the module's output, through {lin.name}"))
        if lin.output is not None:
            found.append((lin.apply, lin.output.double(), AFTER.format(name=lin.name)))
    return found


def _error(cand: Tensor, targets: list[Target]) -> tuple[float, str]:
    """The smallest relative error of ``cand`` against the targets (inf when no shape fits), and that target."""
    best, where = math.inf, ""
    for apply, target, label in targets:
        try:
            out = apply(cand)
        except RuntimeError:
            continue
        if out.shape == target.shape:
            err = (out - target).abs().max().item() / (1 + target.abs().max().item())
            if err < best:
                best, where = err, label
    return best, where


def qkv_heads(split: tuple[Tensor, Tensor, Tensor], h: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """(q, k, v) as (B, H, L, D) float64 with ``h`` query heads, kv heads repeated (GQA); None if h does not fit."""
    q, k, v = split
    e, kw = q.shape[-1], k.shape[-1]
    if e % h or kw % (e // h) or v.shape[-1] != kw:
        return None
    g = kw // (e // h)
    if h % g:
        return None
    qh, kh, vh = _heads(q.double(), h), _heads(k.double(), g), _heads(v.double(), g)
    return qh, kh.repeat_interleave(h // g, 1), vh.repeat_interleave(h // g, 1)


def _head_splits(cap: Capture, heads: list[int]) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
    """(h, q, k, v) with q, k, v as (B, H, L, D) float64, for every reading of the projections and head count."""
    for split in cap.splits:
        for h in heads:
            found = qkv_heads(split, h)
            if found is not None:
                yield (h, *found)


def _position_forms(qh: Tensor, kh: Tensor) -> list[tuple[str | None, Tensor, Tensor]]:
    forms: list[tuple[str | None, Tensor, Tensor]] = [(None, qh, kh)]
    if qh.shape[-1] % 2:  # rotary positions rotate pairs of features
        return forms
    for base in ROPE_BASES:
        for inter in (False, True):
            how = f"rotary positions ({'interleaved pairs' if inter else 'rotate-half'}, base {base:g})"
            forms.append((how, rope(qh, base, inter), rope(kh, base, inter)))
    return forms


def identify(cap: Capture, module_out: Tensor, heads: list[int], keep: Tensor | None, raw: Tensor | None = None,
             known_bias: Tensor | None = None, rtol: float = 1e-3,
             stated: Callable[[int], float | None] = lambda d: None) -> tuple[str | None, dict]:
    """Which formula the module's output follows.

    Args:
        cap: the captured projections.
        module_out: (B, L, E) the module's output in the captured run.
        heads: head counts to try.
        keep: (B, 1, L, L) bool or None, True = may attend (the mask the module was given, as keep).
        raw: (B, 1, L, L) float or None, the mask's values as the module received them.
        known_bias: (H, L, L) the relative-position bias found in a run without mask; with a mask,
            only that bias is accepted (a mask is itself a term of (query, key)).
        rtol: largest error, relative to 1 + max |output|, that counts as a match.
        stated: the score scale stated for head dim D (by the user or the module's config), or None.

    Returns:
        (finding id, or None when the output follows the definition; evidence with "formula" or
        "matches", "heads", "relative error", and "positions" when rotary positions or a
        relative-position bias were found; "_bias", the (H, L, L) bias, for the caller only).

    Raises:
        NoFormula: no formula reproduces the output; the message names the closest one.
    """
    targets = _targets(cap, module_out)
    best: tuple[float, str, str, int, str | None, str] | None = None
    for positions_needed in (False, True):
        for h, qh, kh, vh in _head_splits(cap, heads):
            forms = _position_forms(qh, kh)
            if positions_needed:  # only the rotary form whose scores best fit the softmax input
                forms = sorted(forms[1:], key=lambda f: -_score_fit(cap, f[1], f[2]))[:1 if cap.softmax_in else None]
            for positions, qp, kp in forms[:1] if not positions_needed else forms:
                added = cap.added if cap.added is not None and cap.added.shape[1] in (1, h) else None
                for fid, candidates in _variants(qp, kp, vh, keep, raw, stated(qp.shape[-1]), added).items():
                    for desc, fn in candidates:
                        try:
                            err, where = _error(fn(), targets)
                        except RuntimeError:
                            continue
                        label = desc if positions is None else f"{desc}, with {positions}"
                        if best is None or err < best[0]:
                            best = (err, fid, label, h, positions, where)
                        if fid == "correct" and err < rtol:
                            return None, {"formula": label, "heads": h, "relative error": err, "compared with": where,
                                          **({"positions": positions} if positions else {})}
        if best is not None and best[0] < rtol:
            return best[1], {"matches": best[2], "heads": best[3], "relative error": best[0],
                             "compared with": best[5], **({"positions": best[4]} if best[4] else {})}
    bias = _relative_bias(cap, targets, heads, keep, known_bias, rtol, stated)
    if bias is not None:
        farther = distance_rewarded(bias["_bias"][None], bias.pop("_seen"))
        if farther is not None:
            return DEFINITION_MISMATCH, {"matches": farther, **bias}
        return None, bias
    raise NoFormula("no known formula reproduces the output" +
                      ("" if best is None or best[0] == math.inf else
                       f" (closest: {best[2]}, relative error {best[0]:.2g})"))


def _relative_bias(cap: Capture, targets: list[Target], heads: list[int], keep: Tensor | None, known: Tensor | None,
                   rtol: float, stated: Callable[[int], float | None]) -> dict | None:
    """Evidence of a relative-position bias: the softmax input minus Q K^T / sqrt(D) depends only on
    (head, query, key) (with a mask: equals ``known``), and softmax(that input) V reproduces the
    output; None otherwise."""
    if keep is not None and known is None:
        return None
    for s in cap.softmax_in:
        for h, qh, kh, vh in _head_splits(cap, heads):
            b, _, length, _ = qh.shape
            if b < 2 or s.shape[-2:] != (length, length) or s.numel() != b * h * length * length:
                continue
            s4 = s.double().reshape(b, h, length, length)
            d = qh.shape[-1]
            plain = qh @ kh.transpose(-1, -2) * (stated(d) or 1 / math.sqrt(d))
            seen = torch.isfinite(s4) & (s4 > -1e4) & (True if keep is None else keep)
            if not seen.any():
                continue
            diff = torch.where(seen, s4 - plain, torch.zeros((), dtype=torch.float64))
            ref = diff[:1] if known is None else known[None]
            size = 1 + diff.abs().max().item()
            if (diff - ref).abs().masked_fill(~seen, 0).max().item() > rtol * size or \
                    diff.abs().max().item() < rtol:
                continue
            cand = (torch.softmax(s4, -1).nan_to_num(0) @ vh).transpose(1, 2).reshape(b, length, -1)
            err, where = _error(cand, targets)
            if err < rtol:
                return {"formula": "softmax(QK^T / sqrt(D) + bias(head, query, key)) V", "heads": h,
                        "relative error": err, "compared with": where, "_bias": diff[0], "_seen": seen[:1],
                        "positions": "a relative-position bias (depends only on query, key)"}
    return None

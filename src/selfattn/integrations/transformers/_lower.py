"""A traced mask expression (:mod:`._symbolic`) as a selfattn mask, exactly.

The expression is taken apart into what selfattn has a mask for, from what each part computes:

- comparisons of the key position minus the query position with constants (``kv <= q``,
  ``kv > q - w``, ``abs(q - kv) <= w``, any affine form of ``kv - q``): a band of diagonals,
  intersected over a conjunction. With the queries at selfattn's alignment (the last Lq of the
  key positions) it is ``causal`` or ``sliding_window``; otherwise (a static cache, whose keys run
  past the queries) it is a :class:`Band` whose shift is a tensor, so that every decoding step
  has the same mask structure and a compiled graph is reused;
- ``t[b, q] == t[b, kv]`` (the same value of one tensor at both positions: packed sequences):
  ``document``; relative rules on positions remapped through another tensor (``pos[b, kv] <=
  pos[b, q]``) inside such a conjunction are read on the indices once the positions are the
  indices plus a constant inside every document;
- a part that reads only the key (or only the query) position, with the batch item: evaluated
  into a (B, 1, 1, Lk) (or (B, 1, Lq, 1)) bool tensor, ``from_tensor`` (padding, for one);
- ``&``, ``|``, ``~`` of those, and constants;
- anything else (chunked attention, a custom rule): the part itself, evaluated
  (``from_mask_mod``), exact, its tile map computed by evaluation.

Shape legend: B batch, Lq/Lk lengths, r a query row, c a key column; positions are transformers'
(``q = q_offset + r``, ``kv = kv_offset + c``); selfattn puts row r at key index ``r + Lk - Lq``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ... import masks as _masks
from ._symbolic import BINARY, Expr, evaluate, flip

__all__ = ["ALL", "Band", "Geometry", "lower"]

ALL: Any = object()  # every key visible (no mask); never handed to a backend
_BIG = 1 << 40  # an unbounded side of a sliding window
_CMP = ("le", "lt", "ge", "gt", "eq", "ne")
_NEGATE = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le", "eq": "ne", "ne": "eq"}


class Band(_masks.Mask):
    """Key j is visible from query i (selfattn positions) when ``lo <= j - i + shift <= hi``.

    ``shift``: an int tensor, 0-dim or (B,), read when the mask is used, so that masks that differ
    only in where the queries sit (the steps of a static-cache decode) share one structure; ``lo``
    and ``hi``: ints, None for an unbounded side. A causal rule whose queries start ``-shift``
    keys before selfattn's bottom-right alignment is ``Band(None, 0, shift)``.
    """

    def __init__(self, lo: int | None, hi: int | None, shift: Tensor) -> None:
        self.lo, self.hi, self.shift = lo, hi, shift

    def _shift(self, device: Any) -> Tensor:
        s = self.shift.to(device)
        return s.view(-1, 1, 1, 1) if s.dim() == 1 else s  # (B, 1, 1, 1) or ()

    def predicate(self, lq, lk, device=None):
        s, lo, hi = self.shift.to(device), self.lo, self.hi
        batched = s.dim() == 1

        def visible(b, h, i, j):
            d = j - i + (s[b] if batched else s)
            out = torch.ones_like(d, dtype=torch.bool)
            if lo is not None:
                out = out & (d >= lo)
            if hi is not None:
                out = out & (d <= hi)
            return out
        return visible

    def _tile_bounds(self, lq, lk, bq, bk, device):
        off = _masks.query_offset(lq, lk)
        q0 = torch.arange(0, lq, bq, device=device)
        k0 = torch.arange(0, lk, bk, device=device)
        qlo, qhi = (q0 + off)[:, None], (torch.clamp(q0 + bq, max=lq) - 1 + off)[:, None]  # (nQ, 1)
        klo, khi = k0[None, :], (torch.clamp(k0 + bk, max=lk) - 1)[None, :]  # (1, nK)
        s = self._shift(device)
        dmin, dmax = (klo - qhi)[None, None] + s, (khi - qlo)[None, None] + s  # (B|1, 1, nQ, nK)
        full = torch.ones_like(dmin, dtype=torch.bool)
        empty = torch.zeros_like(dmin, dtype=torch.bool)
        if self.lo is not None:
            full, empty = full & (dmin >= self.lo), empty | (dmax < self.lo)
        if self.hi is not None:
            full, empty = full & (dmax <= self.hi), empty | (dmin > self.hi)
        return full, empty

    def batch_heads(self):
        return (self.shift.numel(), 1) if self.shift.dim() == 1 else (1, 1)

    def tensors(self):
        return (self.shift,)

    def __repr__(self) -> str:
        return f"band({self.lo}, {self.hi}, shift={'tensor' if self.shift.dim() == 0 else 'per item'})"


@dataclass
class Geometry:
    """One call: batch size, lengths, the positions of the first query and key, the device, and
    whether tensor values may be read (not while torch.compile traces)."""

    batch: int
    lq: int
    lk: int
    q_offset: int | Tensor
    kv_offset: int
    device: torch.device
    eager: bool
    shift: int | Tensor = field(init=False)
    """kv - q minus selfattn's j - i for the same row and column (0 when aligned)."""

    def __post_init__(self) -> None:
        self.shift = (self.kv_offset + self.lk - self.lq) - self.q_offset

    def indices(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(b, h, q, kv) positions of the whole call, broadcastable (B, 1, Lq, Lk)."""
        dev = self.device
        return (torch.arange(self.batch, device=dev).view(-1, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long,
                                                                                    device=dev),
                (torch.arange(self.lq, device=dev) + self.q_offset).view(1, 1, -1, 1),
                (torch.arange(self.lk, device=dev) + self.kv_offset).view(1, 1, 1, -1))


def lower(expr: Expr, g: Geometry) -> _masks.Mask | Any:
    """The selfattn mask equal to ``expr`` on the call ``g``, or :data:`ALL`."""
    return _bool(expr, g)


# --- structure of an expression -----------------------------------------------------------------

def _vars(e: Expr) -> frozenset[str]:
    kind = e[0]
    if kind in ("b", "h", "q", "kv"):
        return frozenset([kind])
    if kind == "const":
        return frozenset()
    if kind == "index":
        return frozenset().union(*(_vars(x) for x in e[2]))
    return frozenset().union(*(_vars(x) for x in e[1:]))


def _flatten(op: str, e: Expr) -> list[Expr]:
    return [y for x in e[1:] for y in (_flatten(op, x) if x[0] == op else [x])]


def _const_bool(e: Expr) -> bool | None:
    if e[0] == "const" and isinstance(e[1], (bool, int)) and not isinstance(e[1], Tensor):
        return bool(e[1])
    return None


def _affine(e: Expr) -> tuple[dict[str, int], int] | None:
    """``e`` as sum(coeff * var) + const with int coefficients, or None."""
    kind = e[0]
    if kind in ("b", "h", "q", "kv"):
        return {kind: 1}, 0
    if kind == "const":
        v = e[1]
        return ({}, int(v)) if isinstance(v, int) and not isinstance(v, bool) else None
    if kind in ("add", "sub"):
        a, b = _affine(e[1]), _affine(e[2])
        if a is None or b is None:
            return None
        sign = 1 if kind == "add" else -1
        coeffs = dict(a[0])
        for k, v in b[0].items():
            coeffs[k] = coeffs.get(k, 0) + sign * v
        return {k: v for k, v in coeffs.items() if v}, a[1] + sign * b[1]
    if kind == "neg":
        a = _affine(e[1])
        return None if a is None else ({k: -v for k, v in a[0].items()}, -a[1])
    if kind == "mul":
        a, b = _affine(e[1]), _affine(e[2])
        if a is None or b is None or (a[0] and b[0]):
            return None
        (coeffs, c), factor = (a, b[1]) if not b[0] else (b, a[1])
        return {n: v * factor for n, v in coeffs.items() if v * factor}, c * factor
    return None


def _band(atom: Expr) -> tuple[int | None, int | None] | None:
    """The diagonals ``lo <= kv - q <= hi`` a comparison keeps, or None if it is not such a rule."""
    op, x, y = atom
    if y[0] == "abs" and x[0] != "abs":
        op, x, y = flip(op), y, x
    if x[0] == "abs":  # abs(a * (kv - q) + e) <= c
        inner, bound = _affine(x[1]), _affine(y)
        if inner is None or bound is None or bound[0] or op not in ("le", "lt"):
            return None
        c = bound[1] - (op == "lt")
        d = _diagonal(inner)
        if d is None:
            return None
        a, e = d
        lo, hi = (-c - e, c - e) if a == 1 else (e - c, e + c)
        return lo, hi
    ax, ay = _affine(x), _affine(y)
    if ax is None or ay is None:
        return None
    coeffs = dict(ax[0])
    for k, v in ay[0].items():
        coeffs[k] = coeffs.get(k, 0) - v
    d = _diagonal(({k: v for k, v in coeffs.items() if v}, ax[1] - ay[1]))
    if d is None or op == "ne":
        return None
    a, c = d  # a * (kv - q) + c OP 0
    if a == 1:
        t = -c
    else:
        op, t = flip(op), c
    return {"le": (None, t), "lt": (None, t - 1), "ge": (t, None), "gt": (t + 1, None), "eq": (t, t)}[op]


def _diagonal(aff: tuple[dict[str, int], int]) -> tuple[int, int] | None:
    """(a, c) when the affine form is ``a * (kv - q) + c`` with a = +-1."""
    coeffs, c = aff
    if set(coeffs) != {"q", "kv"} or coeffs["kv"] != -coeffs["q"] or abs(coeffs["kv"]) != 1:
        return None
    return coeffs["kv"], c


def _document(atom: Expr) -> Tensor | None:
    """``t[..., q] == t[..., kv]`` with the same tensor and leading indices: the tensor, or None."""
    op, x, y = atom
    if op != "eq" or x[0] != "index" or y[0] != "index" or x[1] is not y[1]:
        return None
    (t, ix), iy = x[1:], y[2]
    if len(ix) != t.dim() or len(iy) != len(ix) or ix[:-1] != iy[:-1] or ix[:-1] not in ((), (("b",),)):
        return None
    if {ix[-1], iy[-1]} != {("q",), ("kv",)}:
        return None
    return t


# --- lowering -----------------------------------------------------------------------------------

def _none(g: Geometry) -> _masks.Mask:
    return _masks.from_tensor(torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=g.device))


def _bool(e: Expr, g: Geometry) -> _masks.Mask | Any:
    kind = e[0]
    value = _const_bool(e)
    if value is not None:
        return ALL if value else _none(g)
    if kind == "and":
        return _and(_flatten("and", e), g)
    if kind == "or":
        parts = [_bool(x, g) for x in _flatten("or", e)]
        if any(p is ALL for p in parts):
            return ALL
        out = parts[0]
        for p in parts[1:]:
            out = out | p
        return out
    if kind == "not":
        inner = e[1]
        if inner[0] in _CMP:
            return _bool((_NEGATE[inner[0]], *inner[1:]), g)
        if inner[0] == "not":
            return _bool(inner[1], g)
        if inner[0] in ("and", "or"):
            return _bool(("or" if inner[0] == "and" else "and", *(("not", x) for x in inner[1:])), g)
    return _and([e], g)


def _and(parts: list[Expr], g: Geometry) -> _masks.Mask | Any:
    """A conjunction: one band from every relative comparison, documents, one-sided parts, the rest."""
    parts = [(_NEGATE[p[1][0]], *p[1][1:]) if p[0] == "not" and p[1][0] in _CMP else p for p in parts]
    parts = [p for p in parts if _const_bool(p) is not True]
    if any(_const_bool(p) is False for p in parts):
        return _none(g)
    docs = {id(p): t for p in parts if p[0] in _CMP for t in [_document(p)] if t is not None}
    if docs:
        parts = [p if id(p) in docs else _remap_within_documents(p, next(iter(docs.values())), g) for p in parts]
    lo: int | None = None
    hi: int | None = None
    banded, out = False, []
    for p in parts:
        band = _band(p) if p[0] in _CMP else None
        if band is not None:
            banded = True
            lo = band[0] if lo is None else lo if band[0] is None else max(lo, band[0])
            hi = band[1] if hi is None else hi if band[1] is None else min(hi, band[1])
        elif id(p) in docs and (m := _document_mask(docs[id(p)], g)) is not None:
            out.append(m)
        elif p[0] in ("or", "and") or (p[0] == "not" and p[1][0] in ("not", "and", "or")):
            out.append(_bool(p, g))
        else:
            out.append(_leaf(p, g))
    if banded:
        out.insert(0, _band_mask(lo, hi, g))
    out = [m for m in out if m is not ALL]
    if not out:
        return ALL
    result = out[0]
    for m in out[1:]:
        result = result & m
    return result


def _band_mask(lo: int | None, hi: int | None, g: Geometry) -> _masks.Mask | Any:
    """The diagonals lo <= kv - q <= hi of the call as a selfattn mask."""
    if lo is not None and hi is not None and lo > hi:
        return _none(g)
    s = g.shift
    if not isinstance(s, Tensor):  # an int (or a dynamic size while compiling)
        dmin, dmax = s - (g.lk - 1), s + (g.lq - 1)  # the diagonals kv - q this call has
        if (lo is None or lo <= dmin) and (hi is None or hi >= dmax):
            return ALL  # a decode step's causal rule: every key visible, no mask
        if s == 0 and (lo is None or lo <= 0) and (hi is None or hi >= 0):
            if lo is None and hi == 0:
                return _masks.causal("bottom_right")
            return _masks.sliding_window(_BIG if lo is None else -lo, _BIG if hi is None else hi)
        s = torch.tensor(s, device=g.device)
    return Band(lo, hi, s if s.device == g.device else s.to(g.device))


def _document_mask(ids: Tensor, g: Geometry) -> _masks.Mask | None:
    """``document`` of the keys' ids when the queries are the last Lq key positions (else None)."""
    if isinstance(g.q_offset, Tensor) or g.shift != 0 or ids.shape[-1] < g.kv_offset + g.lk:
        return None
    keys = ids[..., g.kv_offset:g.kv_offset + g.lk]
    if keys.dim() == 2 and keys.shape[0] not in (1, g.batch):
        return None
    return _masks.document(keys)


def _leaf(e: Expr, g: Geometry) -> _masks.Mask | Any:
    """A part with no named mask: a key (or query) mask tensor when it reads one side only, else
    the part itself evaluated."""
    used = _vars(e)
    folded = _fold_one_sided(e, g)
    if folded is not None:
        return ALL if folded else _none(g)
    b, h, q, kv = g.indices()
    if "q" not in used or "kv" not in used:
        if "q" in used:
            t = evaluate(e, b, h, q, kv[..., :1]).bool()
        else:
            t = evaluate(e, b, h, q[..., :1, :], kv).bool()
        if t.dim() == 0:
            t = t.view(1, 1, 1, 1)
        return _masks.from_tensor(t)
    return _masks.from_mask_mod(_evaluator(e, g), batch=g.batch if "b" in used else 1)


def _fold_one_sided(e: Expr, g: Geometry) -> bool | None:
    """The value of a comparison of one position with a constant when it is the same for every
    position of the call (``q >= 0``: the bidirectional rule), else None."""
    if e[0] not in _CMP or e[0] == "ne" or isinstance(g.q_offset, Tensor):
        return None
    x, y = _affine(e[1]), _affine(e[2])
    if x is None or y is None:
        return None
    coeffs = {k: x[0].get(k, 0) - y[0].get(k, 0) for k in {*x[0], *y[0]}}
    coeffs = {k: v for k, v in coeffs.items() if v}
    if len(coeffs) != 1 or next(iter(coeffs)) not in ("q", "kv"):
        return None
    (var, a), c = next(iter(coeffs.items())), x[1] - y[1]
    first = g.q_offset if var == "q" else g.kv_offset
    last = first + (g.lq if var == "q" else g.lk) - 1
    ends = {BINARY[e[0]](a * p + c, 0) for p in (first, last)}  # monotone in p: the ends decide
    return ends.pop() if len(ends) == 1 and e[0] != "eq" else None


def _evaluator(e: Expr, g: Geometry):
    q_off, kv_off = g.q_offset, g.kv_offset

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return evaluate(e, b, torch.zeros_like(h), q + q_off, kv + kv_off).bool()
    mask_mod.__qualname__ = "transformers_predicate"
    return mask_mod


def _remap_within_documents(e: Expr, ids: Tensor, g: Geometry) -> Expr:
    """Inside ``ids[b, q] == ids[b, kv]``, a rule on positions read through another tensor
    (``pos[b, kv] <= pos[b, q]``, transformers' packed sequences) is the same rule on the indices
    when ``pos`` is the index plus a constant inside every document: ``e`` rewritten so, when it is."""
    found: list[Tensor] = []
    if e[0] not in _CMP or not _reads_through(e, found) or len({id(t) for t in found}) != 1 or found[0] is ids:
        return e
    unmapped = _unmap(e)
    if _band(unmapped) is None:  # only a rule on kv - q survives a shift of both positions
        return e
    return unmapped if _shifts_within_documents(found[0], ids, g) else e


def _remapped(e: Expr) -> bool:
    return e[0] == "index" and len(e[2]) == 2 and e[2][0] == ("b",) and e[2][1] in (("q",), ("kv",))


def _reads_through(e: Expr, found: list[Tensor]) -> bool:
    """Whether ``e`` reads the positions only as ``pos[b, q]`` / ``pos[b, kv]`` (collected in ``found``)."""
    kind = e[0]
    if _remapped(e):
        found.append(e[1])
        return True
    if kind in ("q", "kv"):
        return False
    if kind in ("b", "h", "const"):
        return True
    if kind == "index":
        return all(_reads_through(i, found) for i in e[2])
    return all(_reads_through(x, found) for x in e[1:])


def _unmap(e: Expr) -> Expr:
    if _remapped(e):
        return e[2][1]
    if e[0] in ("b", "h", "q", "kv", "const", "index"):
        return e
    return (e[0], *(_unmap(x) for x in e[1:]))


def _shifts_within_documents(pos: Tensor, ids: Tensor, g: Geometry) -> bool:
    """True when, inside every document, positions are the indices plus a constant (what
    transformers' packed-sequence detection guarantees), so a relative rule reads the same on both."""
    if not (pos.dim() == ids.dim() == 2 and pos.shape[-1] == ids.shape[-1] == g.lk and g.lq == g.lk
            and not isinstance(g.q_offset, Tensor) and g.q_offset == g.kv_offset == 0):
        return False
    if not g.eager:
        return True  # cannot read data while tracing; transformers derives both from the same position_ids
    pos, ids = torch.broadcast_tensors(pos, ids.to(pos.device))
    shift = pos - torch.arange(g.lk, device=pos.device)
    same_doc = ids[:, 1:] == ids[:, :-1]
    return bool(((shift[:, 1:] == shift[:, :-1]) | ~same_doc).all())


"""The attention itself, found in a :class:`~selfattn.check.whitebox.trace.Trace`: the score product, the softmax and
the weights-times-values product (or one SDPA call), checked from their own operands.

Whatever came before (q/k normalisation, rotary positions, a LayerNorm, slices of one input with no
projection at all) and whatever comes after (the output projection, a residual, a norm, zeroed
padded rows) is not part of the verdict, except the merge of the heads: the tensor the next
operation reads must be the heads put back side by side. The checks:

- the scores are ``c * (A @ B^T) + T`` with one number ``c`` and a term ``T`` of (head, query, key)
  only (a mask, a relative-position bias), or ``cap * tanh(c * A @ B^T / cap) + T`` (soft-capping);
  the scale ``c``, times any number A and B were multiplied by on their way from where they were
  made, is judged against the head dim D that the product contracts: 1/sqrt(D), or the scale the
  user or the module's config states (q and k of unit norm make it a temperature: any scale);
- the softmax runs over the last dim, the one the weights-times-values product contracts;
- the weights that reach that product are the softmax's output, in its orientation (not V @ W,
  not W^T @ V, not W changed after the softmax);
- when A, B and V can be traced to projections whose names or fused order give their roles, the
  roles are q, k and v.

Shape legend: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import itertools
import math
import string
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..findings import (
    CAUSAL_LEAK,
    DEFINITION_MISMATCH,
    GROUP_MISMATCH,
    HEAD_MERGE,
    MASK_AFTER_SOFTMAX,
    MASK_IGNORED,
    MASK_INVERTED,
    MATMUL_ORDER,
    MISSING_SCALE,
    ROTARY_MISMATCH,
    ROTARY_ONE_SIDE,
    SOFTMAX_DIM,
    VALUES_CHANGED,
    WRONG_SCALE,
)
from ..subject.building import ROLE_PATTERNS, name_role, norm_role
from ..subject.caller import token_grids
from .positions import (
    normalised,
    normalised_off_the_head,
    normalised_over_tokens,
    rotary,
    rotated_from,
    rotation_on_the_way,
    rotation_problem,
    rotation_tables,
    scale_origin,
    unit_before_gains,
    unit_over_tokens,
)
from .trace import LAYOUT, PRODUCTS, SOFTMAX, Op, Origin, Trace

__all__ = ["ROLE_PATTERNS", "Verdict", "bucket_not_relative", "core_operands", "distance_rewarded", "every_key_hidden",
           "examine_cores", "memory_tokens", "name_role", "relative_positions", "rotated_apart",
           "rotated_operands", "rotation_off_the_tokens", "table_not_relative"]

_SCALES = frozenset({"mul", "rmul", "mul_", "imul", "div", "truediv", "div_", "itruediv"})
_TERMS = frozenset({"add", "sub", "radd", "rsub", "add_", "sub_", "iadd", "isub", "masked_fill", "masked_fill_",
                    "where"})
_MASKED = -1e3  # a score below this is a masked one (masks fill -inf, finfo.min, -10000, ...)
# q and k both made like rotary positions and both changed in norm row by row: xPos scales q by s^i and k by s^-i
# (the scores stay relative), a rotation with a sign lost does not; which one, the run on one token everywhere tells
_SCALED_ROTARY = "rotary positions that also scale q and k row by row (xPos's decay: q by s^i, k by s^-i)"


class Unrecognised(LookupError):
    """The record holds an attention the doctor cannot follow; the message says where it stopped."""


class Unseen(Unrecognised):
    """The scores were made by code the record cannot see into (a TorchScript function, a compiled extension):
    nothing can be said of their formula."""


@dataclass
class Verdict:
    """What one attention core follows: ``fid`` None for the definition, else the bug's finding id."""

    fid: str | None
    evidence: dict
    facts: dict = field(default_factory=dict)
    also: list[Verdict] = field(default_factory=list)
    """Bugs of other kinds the same core follows besides ``fid`` (read apart: a scale is read apart from which keys
    are hidden, from how the heads are merged and from how q and k are rotated)."""


def _joined(found: list[Verdict | None]) -> Verdict | None:
    """The first bug of ``found`` with the others of other kinds as its ``also`` (None: no bug)."""
    bugs = [v for v in found if v is not None and v.fid is not None]
    if not bugs:
        return None
    first = bugs[0]
    for other in bugs[1:]:
        if other.fid != first.fid and all(other.fid != v.fid for v in first.also):
            first.also.append(other)
            first.facts = {**other.facts, **first.facts}
    return first


def _dim(op: Op) -> int:
    """The softmax's dim, normalised (torch's implicit dim for a call without one)."""
    s = op.args[0]
    dim = op.args[1] if len(op.args) > 1 and isinstance(op.args[1], int) else op.kwargs.get("dim")
    if dim is None:
        dim = 0 if s.dim() in (0, 1, 3) else 1
    return dim % s.dim()


def _operands(op: Op) -> list[tuple[int, Tensor]]:
    """(identity, value) of a product's matrix operands, in order (einsum's equation and baddbmm's input left out)."""
    pairs = list(zip(op.in_ids, op.inputs, strict=False))
    return pairs[1:3] if op.name == "baddbmm" else pairs


def _equation(op: Op) -> tuple[list[str], str] | None:
    """An einsum's operand subscripts and output subscripts, an ellipsis spelled out in letters of its own
    (Flax-style "...qhd,...khd->...hqk" on (B, L, H, D) operands: "aqhd,akhd->ahqk"); None for another operation
    or an implicit output."""
    if op.name != "einsum" or not isinstance(op.args[0], str):
        return None
    eq = op.args[0].replace(" ", "")
    if "->" not in eq:
        return None
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    if "." not in eq:
        return terms, out
    tensors = op.inputs
    if len(tensors) != len(terms) or any(term.count("...") > 1 for term in terms):
        return None
    spans = [t.dim() - len(term.replace("...", "")) if "..." in term else 0
             for t, term in zip(tensors, terms, strict=True)]
    n = max(spans)
    free = [c for c in string.ascii_letters if c not in eq][:n]
    if min(spans) < 0 or len(free) < n:
        return None
    fill = "".join(free)
    terms = [term.replace("...", fill[n - span:]) for term, span in zip(terms, spans, strict=True)]
    return terms, out.replace("...", fill)


def _contract(op: Op, a: Tensor, b: Tensor) -> Tensor:
    """The product of two operands in float64, as the operation computes it (without baddbmm's input and alpha)."""
    eq = _equation(op)
    if eq is not None:
        return torch.einsum(f"{eq[0][0]},{eq[0][1]}->{eq[1]}", a.double(), b.double())
    return torch.matmul(a.double(), b.double())


def _contracted_size(op: Op, a: Tensor, b: Tensor) -> int:
    eq = _equation(op)
    if eq is None:
        return a.shape[-1]
    (sa, sb), out = eq
    return math.prod(a.shape[sa.index(c)] for c in sa if c in sb and c not in out)


def _contracted_axis(op: Op, position: int, w: Tensor) -> int | None:
    """The axis (from the end) of the operand ``w`` at ``position`` that the product contracts, when it is one
    axis; None otherwise."""
    eq = _equation(op)
    if eq is None:
        return -1 if position == 0 else -2 if w.dim() >= 2 else None
    (sa, sb), out = eq
    subs, other = (sa, sb) if position == 0 else (sb, sa)
    contracted = [i for i, c in enumerate(subs) if c in other and c not in out]
    return contracted[0] - len(subs) if len(contracted) == 1 else None


def _weights_contracted_last(op: Op, position: int, w: Tensor) -> bool:
    """Does the product contract the last dim of its operand ``w`` (at ``position``)?"""
    eq = _equation(op)
    if eq is not None:
        (sa, sb), out = eq
        subs, other = (sa, sb) if position == 0 else (sb, sa)
        contracted = {c for c in subs if c in other and c not in out}
        return contracted == {subs[-1]}
    return position == 0  # matmul(W, V) contracts W's last dim; matmul(V, W) its second to last


def _transposed_keys_contracted(op: Op, position: int) -> bool:
    """For weights read transposed (keys on their second-to-last dim): does the product contract that dim, giving
    the transpose of W @ V (channels first: ``V @ W^T``, LDM's ``einsum('bij,bjk->bik', v, w^T)``)?"""
    eq = _equation(op)
    if eq is not None:
        (sa, sb), out = eq
        subs, other = (sa, sb) if position == 0 else (sb, sa)
        contracted = {c for c in subs if c in other and c not in out}
        return len(subs) >= 2 and contracted == {subs[-2]}
    return position == 1  # matmul(V, W^T) contracts W^T's second-to-last dim


def _einsum_token_axes(op: Op, position: int, w: Tensor, p: Tensor, length: int) -> tuple[int, int] | None:
    """For weights ``p`` that an einsum ``op`` multiplies by the values as they are (``w`` is ``p``), with the
    tokens not on the last two axes ("ijbh,jbhd->ibhd"): (query axis, key axis) of ``p``, the key axis the one the
    product contracts; None for any other product or layout."""
    eq = _equation(op)
    if eq is None or p.dim() < 3 or w.shape != p.shape or (p.shape[-2:] == (length, length) and
                                                           _weights_contracted_last(op, position, w)):
        return None
    if not torch.allclose(w.double(), p.double(), atol=1e-6, equal_nan=True):  # NaN rows: queries the mask hides
        return None
    (sa, sb), out = eq
    subs, other = (sa, sb) if position == 0 else (sb, sa)
    if len(subs) != p.dim():
        return None
    contracted = [c for c in subs if c in other and c not in out]
    kept = [i for i, c in enumerate(subs) if c in out and p.shape[i] == length]
    if len(contracted) != 1 or p.shape[subs.index(contracted[0])] < length or len(kept) != 1:
        return None  # (more keys than tokens: a memory of earlier segments, Transformer-XL's, read as extra keys)
    if (kept[0], subs.index(contracted[0])) == (p.dim() - 2, p.dim() - 1):
        return None  # the tokens last already (keys beside memory ones: read as such below)
    return kept[0], subs.index(contracted[0])


def _canonical_output(op: Op, position: int, query_axis: int, batch: int) -> tuple[int, ...] | None:
    """For an einsum weights-times-values product whose weights have their query axis at ``query_axis``: the
    permutation of its output to (B, H, L, D) ("bhqk,kbhd->qbhd" writes (L, B, H, D)), or of a three-letter one to
    (B * H, L, D) ("nqk,nck->ncq" writes (B * H, D, L)), or None when the letters do not say it (the batch letter
    is the one of the probe's batch size, the first when both are)."""
    eq = _equation(op)
    if eq is None:
        return None
    (sa, sb), out = eq
    subs = sa if position == 0 else sb
    if not -len(subs) <= query_axis < len(subs):
        return None
    query = subs[query_axis]
    values_only = [c for c in out if c not in subs]
    rest = [c for c in out if c != query and c not in values_only]
    if len(out) == 3 and len(values_only) == 1 and len(rest) == 1 and query in out:  # (B * H, L, D) in any order
        return out.index(rest[0]), out.index(query), out.index(values_only[0])  # (EDM's "nqk,nck->ncq")
    if len(out) != 4 or len(values_only) != 1 or len(rest) != 2 or query not in out:
        return None
    sizes = dict(zip(out, op.outputs[0].shape, strict=True)) if op.outputs else {}
    first, second = rest if sizes.get(rest[1]) != batch or sizes.get(rest[0]) == batch else rest[::-1]
    return out.index(first), out.index(second), out.index(query), out.index(values_only[0])


def _orientation(w: Tensor, p: Tensor) -> str | None:
    """"same" when ``w`` holds the softmax output ``p`` as it is, "transposed" when with its last two dims
    swapped, None when neither (weights changed after the softmax)."""
    if w.numel() != p.numel():
        return None
    tol = 1e-3 * (1 + float(p.abs().nan_to_num(0.0).max()))

    def holds(a: Tensor, b: Tensor) -> bool:  # a NaN where the softmax gave one (a row with no visible key) holds
        a, b = a.double().reshape(b.shape), b.double()
        return bool((((a - b).abs() <= tol) | (a.isnan() & b.isnan())).all())
    if w.shape[-2:] == p.shape[-2:] and holds(w, p):
        return "same"
    pt = p.transpose(-1, -2)
    if w.shape[-2:] == pt.shape[-2:] and holds(w, pt):
        return "transposed"
    return None


_ZEROING = frozenset({"masked_fill", "masked_fill_", "where", "mul", "mul_", "nan_to_num"})


def _zeroed_as(w: Tensor, p: Tensor) -> Tensor:
    """The softmax output ``p`` with the rows (or, for weights given transposed, the columns) that ``w`` zeroed set
    to 0, so that weights zeroed on rows with no visible key still read as the softmax's."""
    if w.numel() != p.numel():
        return p
    for pp, dim in ((p, -1), (p.transpose(-1, -2), -1)):
        if w.shape[-2:] == pp.shape[-2:]:
            dead = w.reshape(pp.shape).abs().sum(dim, keepdim=True) == 0
            out = pp.masked_fill(dead, 0)
            return out if pp is p else out.transpose(-1, -2)
    return p


def _one_factor(w: Tensor, p: Tensor) -> float | None:
    """The number c != 1 when the weights ``w`` the product reads are c times the softmax's ``p`` everywhere (of one
    shape), else None."""
    if w.shape != p.shape:
        return None
    w, p = w.double(), p.double()
    seen = p.abs() > 1e-6 * float(p.abs().max())
    if not bool(seen.any()):
        return None
    c = float((w[seen] / p[seen]).mean())
    if abs(c - 1.0) < 1e-6 or float((w - c * p).abs().max()) > 1e-9 * float(w.abs().max()):
        return None
    return c


def _product_after(trace: Trace, tid: int) -> tuple[Op, int, list[str]] | None:
    """The first product that reads ``tid`` (through layout operations and at most two others), the identity it
    reads, and the names of the non-layout operations on the way."""
    frontier = [tid]
    passed: list[str] = []
    for _ in range(3):
        nxt = []
        for t in frontier:
            for op, read in trace.consumers(t):
                if op.name in PRODUCTS:
                    return op, read, passed
                if op.name not in SOFTMAX and op.out_ids:
                    nxt.append(op.out_ids[0])
                    passed.append(op.name)
                break
        frontier = nxt
    return None


def _depends_on(trace: Trace, tid: int, inputs: frozenset[int]) -> bool:
    """Was the tensor ``tid`` computed from one of the run's inputs (``id`` of the tensors given to the module)?"""
    return any(trace.identity(t) in inputs for t in (tid, *trace.ancestors(tid)))


_ADDS = frozenset({"add", "radd", "add_", "iadd", "sub", "rsub", "sub_", "isub"})


def _position_products(trace: Trace, tid: int, inputs: frozenset[int]) -> list[str] | None:
    """When the tensor ``tid`` is (relayouts, as Transformer-XL's relative shift or DeBERTa's gather, and sums, as
    DeBERTa's c2p + p2c written ``score += ...``, of) products one of whose operands does not depend on the run's
    input (a table of relative-position embeddings): what each is; None when some branch is something else."""
    todo, seen, found_names = [tid], set[int](), list[str]()
    while todo and len(seen) < 60:
        cur = todo.pop(0)
        if cur in seen:
            continue
        seen.add(cur)
        found = trace.maker(cur)
        if found is None:
            continue
        op = found[0]
        if op.name in PRODUCTS:
            pairs = _operands(op)
            free = [i for i, _ in pairs if not _depends_on(trace, i, inputs)]
            if len(pairs) < 2 or len(free) != 1:
                return None
            found_names.append(f"a term of the queries with a position table ({op.name}" +
                               (f" {op.args[0]!r}" if op.name == "einsum" else "") + ")")
        elif op.name in LAYOUT or op.name in _ADDS or op.name in ("cat", "pad", "constant_pad_nd", "gather",
                                                                  "index_select", "mul", "as_strided") or \
                op.number() is not None:  # as_strided: icefall's relative shift
            todo.extend(op.in_ids)
    return found_names or None


def _position_product(trace: Trace, tid: int, inputs: frozenset[int]) -> str | None:
    """:func:`_position_products`, said in one line."""
    names = _position_products(trace, tid, inputs)
    return None if names is None else "; ".join(dict.fromkeys(names))


def _value_position_term(trace: Trace, sm: Op, pv: Op, inputs: frozenset[int]) -> str | None:
    """A second product of the weights with a tensor that does not depend on the run's input (Shaw's relative
    positions on the values, sum_j p_ij a_ij): what it is, else None."""
    if not inputs:
        return None
    for op, read in trace.consumers(sm.out_ids[0]):
        if op is pv or op.name not in PRODUCTS or _head_mix(op) is not None:  # a head mix is talking heads
            continue
        others = [i for i, _ in _operands(op) if i != read]
        if others and not any(_depends_on(trace, i, inputs) for i in others):
            return "a position term on the values: the weights also multiply a position table " \
                   f"({op.name}{f' {op.args[0]!r}' if op.name == 'einsum' else ''}; Shaw relative positions)"
    return None


def _position_correlations(trace: Trace, length: int, inputs: frozenset[int]) -> bool:
    """Does the record hold an (..., L, L) product of two operands made from no token (positions times positions,
    TUPE's untied correlations), rather than a bias looked up from a table?"""
    for op in trace.ops:
        if op.name in PRODUCTS and op.outputs and op.outputs[0].dim() >= 2 and \
                tuple(op.outputs[0].shape[-2:]) == (length, length):
            pairs = _operands(op)
            if len(pairs) == 2 and not any(_depends_on(trace, i, inputs) for i, _ in pairs):
                return True
    return False


def _value_term_across_queries(trace: Trace, sm: Op, pv: Op, inputs: frozenset[int]) -> str | None:
    """When the product of the weights with a position table on the values (:func:`_value_position_term`) sums them
    along an axis over which they do not sum to 1 (the queries': the weights transposed before that product, while
    the values' own product takes them the right way): what was seen, else None."""
    for op, read in trace.consumers(sm.out_ids[0]):
        if op is pv or op.name not in PRODUCTS or _head_mix(op) is not None:
            continue
        operands = _operands(op)
        others = [i for i, _ in operands if i != read]
        if not others or any(_depends_on(trace, i, inputs) for i in others):
            continue
        position = next((n for n, (i, _) in enumerate(operands) if i == read), None)
        view = trace.value(read)
        if position is None or view is None or not view.is_floating_point():
            return None
        axis = _contracted_axis(op, position, view)
        if axis is None:
            return None
        sums = view.double().sum(axis)
        sums = sums[torch.isfinite(sums) & (sums.abs() > 1e-9)]  # rows with every key hidden (zeroed) say nothing
        if sums.numel() and float((sums - 1).abs().max()) > 1e-4:
            return (f"the position term on the values ({op.name}) sums the weights along an axis over which they do "
                    "not sum to 1 (the queries'): the weights are transposed before that product")
        return None
    return None


def _relative_terms(trace: Trace, chain: _Chain, inputs: frozenset[int], shape: torch.Size,
                    axes: tuple[int, int] | None) -> list[tuple[str, Tensor, float]]:
    """The position products added to the scores beside the content product (Transformer-XL's BD term, Shaw's
    q . a_ij): each named, with its value in the layout of the content product ``shape`` (moved as the weights
    were, when ``axes``) and the factor the scores get after it is added; [] unless every added term is one."""
    if not inputs:
        return []
    found = []
    for tid, after in chain.added:
        value = trace.value(tid)
        name = _position_product(trace, tid, inputs) if value is not None else None
        laid = None if name is None or value is None else _as_scores(value, axes, shape)
        if name is None or laid is None:
            return []
        found.append((name, laid, after))
    for tid, after, spread in chain.spread:  # a broadcast term: only a position product counts (not a mask, ALiBi)
        value = trace.value(tid)
        name = _position_product(trace, tid, inputs) if value is not None else None
        if name is None or value is None or axes is not None:
            continue
        if math.prod(spread) == math.prod(shape):
            found.append((name, value.double().expand(spread).reshape(shape), after))
        elif chain.region is not None and math.prod(spread) == math.prod(chain.region[1]):
            whole = torch.zeros(shape, dtype=torch.float64, device=value.device)  # the term on its part alone
            whole[chain.region[0]] = value.double().expand(spread).reshape(chain.region[1])  # type: ignore[index]
            found.append((name, whole, after))
    return found


def _computed_terms(trace: Trace, chain: _Chain, inputs: frozenset[int], shape: torch.Size,
                    axes: tuple[int, int] | None, product: Op) -> list[tuple[Tensor, float]]:
    """The terms added to the scores that the module computes from the tokens with weights of their own, not
    through the score product's operands (Leela Chess Zero's smolgen: a bias per head, query and key generated
    from the whole board by a small network): each with the factor the scores get after it is added; [] unless
    every added term is one. A term made from q or k (the scores counted twice), a mask (hidden entries) or a
    tensor the call passes (judged as a bias on two runs) is none."""
    if not inputs or not chain.added:
        return []
    near = {trace.identity(i) for i in (*product.in_ids, *product.out_ids)}
    for i in product.in_ids:  # the q and k projections' outputs: a term made from them is a position or content
        for t in (i, *trace.ancestors(i)):  # term of the attention's own operands (Funnel's, Transformer-XL's)
            made = trace.maker(t)
            if made is not None and made[0].name in ("linear", "addmm", "module"):
                near.add(trace.identity(t))
    found = []
    for tid, after in chain.added:
        value = trace.value(tid)
        if value is None or trace.identity(tid) in inputs or not _depends_on(trace, tid, inputs) or \
                not bool(torch.isfinite(value).all()) or float(value.min()) <= _MASKED or \
                any(trace.identity(t) in near for t in (tid, *trace.ancestors(tid))):
            return []
        laid = _as_scores(value, axes, shape)
        if laid is None:
            return []
        found.append((laid, after))
    return found


def _as_scores(value: Tensor, axes: tuple[int, int] | None, shape: torch.Size) -> Tensor | None:
    """A term added to the scores, in float64 and in the layout of the content product ``shape`` (its query and
    key axes moved last, as the weights' were, when ``axes``); None when it has another shape."""
    value = value.double()
    if axes is not None and value.dim() == len(shape):
        value = value.movedim(axes, (-2, -1))
    return value if value.shape == shape else None


def _temperature(op: Op) -> Tensor | None:
    """For a multiplication (division) of the scores by a tensor constant over queries and keys (a learned
    temperature per head, as cosine attention has): the factor it applies, else None."""
    if op.name not in _SCALES or len(op.inputs) != 2:
        return None
    small = min(op.inputs, key=lambda t: t.numel())
    divides = op.name in ("div", "truediv", "div_", "itruediv")
    if small.numel() <= 1 or small.dim() < 2 or tuple(small.shape[-2:]) != (1, 1) or \
            (divides and small is not op.inputs[1]):
        return None
    return 1.0 / small.double() if divides else small.double()


@dataclass
class _Chain:
    """The way from the score product to the softmax: the steps nearest the softmax first, the temperatures (a
    factor per head) multiplied in, and the tensors added beside the followed branch (keys), each with the product
    of the numbers the scores were multiplied by after it was added."""

    steps: list[tuple[str, float | None]] = field(default_factory=list)
    temperatures: list[Tensor] = field(default_factory=list)
    added: list[tuple[int, float]] = field(default_factory=list)
    mixed: list[str] = field(default_factory=list)  # the operations that mix the heads' scores (talking heads)
    spread: list[tuple[int, float, torch.Size]] = field(default_factory=list)  # added terms broadcast to a shape
    # the part of the scores a setitem rewrote with what it made of them (the index, that part's shape): terms added
    # on the way there cover only it (timm's MViT v2 leaves the class token's row and column as they were)
    region: tuple[object, torch.Size] | None = None
    fills: list[tuple[float, int]] = field(default_factory=list)  # a number written over scores, its step's index


def _negligible_fills(s: Tensor, chain: _Chain) -> Tensor:
    """The scores with those a mask filled with a finite number too low to weigh anything (Swin's -100 written
    with masked_fill: e^-100 next to the scores the doctor's probes give) set to -inf, so that they are read as
    hidden, as -inf or finfo.min are, and not as scores the product and a term should explain."""
    for value, at in chain.fills:
        if not math.isfinite(value) or value <= _MASKED:
            continue
        factors = [x for _, x in chain.steps[:at] if x is not None]  # numbers the scores were multiplied by later
        if any(n in ("tanh", "temperature", "talking heads") for n, _ in chain.steps[:at]):
            continue
        filled = value * math.prod(factors)
        at_fill = torch.isclose(s.double(), torch.tensor(filled, dtype=torch.float64, device=s.device),
                                rtol=1e-9, atol=0.0)
        rest = s.double()[~at_fill & torch.isfinite(s)]
        if not bool(at_fill.any()) or not rest.numel() or filled > float(rest.max()) - 40:
            continue  # a fill that still weighs something is a score the definition must explain
        s = s.masked_fill(at_fill, float("-inf"))
    return s


def _head_mix(op: Op) -> int | None:
    """For an operation that mixes the heads of (..., L, L) scores or weights by a learned square matrix and
    nothing else (talking heads, Shazeer et al. 2020: a 1x1 conv2d over the head channels, an nn.Linear over a
    head axis put last, an einsum "bhij,hk->bkij"): the identity of the scores it mixes, else None."""
    if not op.inputs or not op.outputs or op.outputs[0].dim() < 4:
        return None
    out = op.outputs[0]
    if op.name in ("linear", "conv2d"):
        x, w = op.inputs[0], op.inputs[1] if len(op.inputs) > 1 else None
        if w is None or x.numel() != out.numel():
            return None
        if op.name == "linear" and w.dim() == 2 and w.shape[0] == w.shape[1] == x.shape[-1] and x.dim() >= 4:
            return op.in_ids[0]
        if op.name == "conv2d" and w.dim() == 4 and tuple(w.shape[2:]) == (1, 1) and w.shape[0] == w.shape[1] and \
                x.dim() == 4 and x.shape[1] == w.shape[0]:
            return op.in_ids[0]
        return None
    if op.name in ("einsum", "matmul") and len(op.inputs) == 2:
        small = min(range(2), key=lambda i: op.inputs[i].numel())
        mat, big = op.inputs[small], op.inputs[1 - small]
        if mat.dim() == 2 and mat.shape[0] == mat.shape[1] and mat.shape[0] in big.shape and \
                big.numel() == out.numel() and big.dim() >= 4 and out.shape[-1] == big.shape[-1]:
            return op.in_ids[1 - small]
    return None


def _score_chain(trace: Trace, tid: int) -> tuple[Op, _Chain]:
    """Walk back from the softmax input to the score product: (product, the chain)."""
    chain = _Chain()
    steps, temperatures = chain.steps, chain.temperatures
    for _ in range(60):
        found = trace.maker(tid)
        if found is None:  # no recorded operation made it: code the record does not enter
            raise Unseen("no score product the record saw leads to the softmax: a softmax taken of the "
                         "projections themselves (efficient or linear attention's, over the keys' tokens or the "
                         "queries' features), or code the record cannot see into (a torch.jit.script function, "
                         "a compiled extension)")
        op, _ = found
        mixed = _head_mix(op)
        if mixed is not None:
            steps.append(("talking heads", None))
            chain.mixed.append(op.name)
            tid = mixed
            continue
        if op.name in PRODUCTS:
            return op, chain
        residual = _residual_head_mix(trace, op)
        if residual is not None:  # x-transformers: sim = sim + talking_heads(sim)
            steps.append(("talking heads", None))
            chain.mixed.append(f"{op.name} of the scores and a head mix of them")
            tid = residual
            continue
        number = op.number()
        temperature = _temperature(op) if number is None else None
        if number is not None and trace.learned_number(op):  # a learned scalar (LSA's temperature.exp())
            temperature, number = torch.tensor(number, dtype=torch.float64), None
        nxt: int | None
        if temperature is not None:
            steps.append(("temperature", None))
            temperatures.append(temperature)
            nxt = op.in_ids[max(range(2), key=lambda i: op.inputs[i].numel())]
        elif number is not None or op.name in LAYOUT or op.name in ("tanh",):
            steps.append((op.name, number))
            nxt = op.main_input()
        elif op.name == "nan_to_num" and op.in_ids:  # NaN scores to 0 (torchscale's, before its mask is added):
            nxt = op.in_ids[0]  # the finite scores pass as they are
        elif (floor := _floor_of(op)) is not None:  # torch.max(scores, finfo.min), clamp(min=finfo.min): a -inf
            nxt = floor  # lifted to the lowest finite number; every other score passes as it is
        elif op.name in ("setitem", "index_put", "index_put_") and op.in_ids and len(op.args) >= 3 and \
                (isinstance(op.args[2], (int, float)) or (isinstance(op.args[2], Tensor) and op.args[2].numel() == 1)):
            steps.append(("masked_fill", None))  # scores at some indices set to a number: a mask written in place
            chain.fills.append((float(op.args[2]), len(steps) - 1))
            nxt = op.in_ids[0]
        elif op.name == "setitem" and len(op.in_ids) == 2 and len(op.inputs) == 2 and op.outputs and \
                op.inputs[1].numel() * 2 > op.outputs[0].numel():
            # scores rewritten in place by what is made of them (timm's MViT v2 adds its decomposed position
            # terms with attn[:, :, sp:, sp:] = (attn[:, :, sp:, sp:] + rel_h + rel_w)); the part left as it was
            # (the class token's row and column) is scores as well: the rewritten part is followed
            steps.append(("setitem", None))
            if op.inputs[1].numel() < op.outputs[0].numel() and len(op.args) > 1:
                chain.region = (op.args[1], op.outputs[0][op.args[1]].shape)
            nxt = op.in_ids[1]
        elif op.name in _TERMS or op.name == "cat":  # a term added; or sink logits set beside the scores
            steps.append((op.name, None))
            if op.name in ("masked_fill", "masked_fill_") and len(op.args) >= 3 and \
                    (isinstance(op.args[2], (int, float)) or
                     (isinstance(op.args[2], Tensor) and op.args[2].numel() == 1)):
                chain.fills.append((float(op.args[2]), len(steps) - 1))
            pairs = list(zip(op.in_ids, op.inputs, strict=False))
            if op.name == "where":  # where(cond, fill, scores): the condition is no score, nor a constant fill
                # (kang205's SASRec: where(key_masks == 0, ones_like(scores) * (-2**32 + 1), scores))
                values = [(i, t) for i, t in pairs if t.is_floating_point() and t.numel() > 1]
                varying = [(i, t) for i, t in values if not bool((t == t.flatten()[0]).all())]
                if len(varying) == 1 and len(values) == 2:
                    fill = next(t for i, t in values if i != varying[0][0])
                    chain.fills.append((float(fill.flatten()[0]), len(steps) - 1))
                pairs = varying or values or pairs
            nxt = max(pairs, key=lambda it: it[1].numel())[0] if pairs else None
            if op.name in ("add", "radd", "add_", "iadd") and len(pairs) == 2:
                after = math.prod(x for _, x in steps if x is not None)
                chain.added += [(i, after) for i, t in pairs if i != nxt and t.shape == pairs[0][1].shape]
                if op.outputs:  # terms broadcast over the query or key axis (SAM's decomposed rel_h, rel_w)
                    chain.spread += [(i, after, op.outputs[0].shape) for i, t in pairs if i != nxt and
                                     t.shape != op.outputs[0].shape and t.dim() == op.outputs[0].dim() and
                                     torch.broadcast_shapes(t.shape, op.outputs[0].shape) == op.outputs[0].shape]
        else:
            raise Unrecognised(f"the scores pass through {op.name}() between the product and the softmax")
        if nxt is None:
            raise Unrecognised(f"the scores pass through {op.name}() with no tensor input")
        tid = nxt
    raise Unrecognised("the chain from the product to the softmax is too long to follow")


def _after_head_mix(trace: Trace, sm: Op) -> tuple[Op, int, list[str], list[str]] | None:
    """When the softmax's weights are mixed across heads before the product with the values (talking heads): that
    product, the identity it reads, the non-layout operations passed after the mix, and the mixing operations;
    else None."""
    tid, mixes = sm.out_ids[0], []
    for _ in range(4):
        step = next(iter(trace.consumers(tid)), None)
        if step is None or _head_mix(step[0]) != step[1] or not step[0].out_ids:
            break
        mixes.append(step[0].name)
        tid = step[0].out_ids[0]
    after = _product_after(trace, tid) if mixes else None
    return None if after is None else (*after, mixes)


def _normed_over_heads(trace: Trace, p: Tensor) -> bool:
    """Does the record hold a LayerNorm over an axis of the heads' size on a tensor of the weights' size (DeepViT's
    re-attention normalises the head-mixed weights with its heads put last)?"""
    heads = p.shape[1] if p.dim() == 4 else None
    for op in trace.ops:
        if op.name == "layer_norm" and op.inputs and op.inputs[0].numel() == p.numel() and heads is not None:
            shape = op.args[1] if len(op.args) > 1 else op.kwargs.get("normalized_shape")
            if shape is not None and tuple(shape) == (heads,) and op.inputs[0].shape[-1] == heads:
                return True
    return False


def _mixed_as(w: Tensor, p: Tensor) -> Tensor | None:
    """The softmax output ``p`` (B, H, L, L) mixed across heads as the weights ``w`` are (an affine map of the head
    axis, fitted; also with the last two dims of ``p`` swapped, so that weights transposed after the mix still read
    as transposed), when one reproduces ``w``; else None."""
    if p.dim() != 4 or w.numel() != p.numel():
        return None
    y = w.double().reshape(p.shape).movedim(1, -1).reshape(-1, p.shape[1])
    for cand in (p, p.transpose(-1, -2)):
        x = cand.double().movedim(1, -1).reshape(-1, p.shape[1])
        x = torch.cat([x, torch.ones_like(x[:, :1])], -1)
        if not bool(torch.isfinite(x).all() and torch.isfinite(y).all()):
            return None
        fitted = x @ torch.linalg.lstsq(x, y).solution
        if bool(((fitted - y).abs() <= 1e-6 * (1 + float(y.abs().max()))).all()):
            mixed = fitted.reshape(*cand.movedim(1, -1).shape).movedim(-1, 1)
            return mixed if cand is p else mixed.transpose(-1, -2)
    return None


_JOINS = frozenset({"cat", "concat", "concatenate", "pad", "constant_pad_nd"})


def _memory_side(trace: Trace, vid: int, extra: int, inputs: frozenset[int]) -> str | None:
    """Where the values ``vid`` have ``extra`` entries along their token axis that depend on no input of the run
    (x-transformers' ``num_mem_kv``, a null key/value, ``add_zero_kv``'s zero pad): "first" or "last", else None."""
    if not inputs:
        return None
    tid = vid
    for _ in range(12):
        found = trace.maker(tid)
        if found is None:
            return None
        op = found[0]
        if op.name in _JOINS:
            break
        src = op.main_input()
        if op.name not in LAYOUT or src is None:
            return None
        tid = src
    else:
        return None
    if op.name in ("pad", "constant_pad_nd"):  # zeros padded on the token axis (the second to last of (.., L, D))
        widths = op.args[1] if len(op.args) > 1 else op.kwargs.get("pad")
        if not isinstance(widths, (list, tuple)) or len(widths) < 4 or any(widths[:2]):
            return None
        before, after = widths[2], widths[3]
        return "first" if (before, after) == (extra, 0) else "last" if (before, after) == (0, extra) else None
    parts = list(zip(op.in_ids, op.inputs, strict=False))
    fixed = [not _depends_on(trace, i, inputs) for i, _ in parts]
    if len(parts) < 2 or all(fixed) or not any(fixed):
        return None
    dim = op.args[1] if len(op.args) > 1 and isinstance(op.args[1], int) else op.kwargs.get("dim", 0)
    size = sum(t.shape[dim] for (_, t), f in zip(parts, fixed, strict=True) if f)
    if size != extra:
        return None
    if fixed[0] and not fixed[-1]:
        return "first"
    return "last" if fixed[-1] and not fixed[0] else None


def _residual_head_mix(trace: Trace, op: Op) -> int | None:
    """For ``x + mix(x)`` (a head mix added to the scores it mixes): the identity of x, else None."""
    if op.name not in ("add", "radd", "add_", "iadd") or len(op.in_ids) != 2:
        return None
    for i, j in ((0, 1), (1, 0)):
        found = trace.maker(op.in_ids[j])
        mixed = _head_mix(found[0]) if found is not None else None
        if mixed is not None and trace.origin(mixed).id == trace.origin(op.in_ids[i]).id:
            return op.in_ids[i]
    return None


def _visible(s: Tensor) -> Tensor:
    """The scores no mask hides (finite and above a fill)."""
    return torch.isfinite(s) & (s > _MASKED)


def _fit(s: Tensor, r: Tensor, batch: int, with_terms: bool,
         given: float | None = None) -> tuple[float, Tensor, Tensor]:
    """Fit s = c * r + t + a constant per row (the softmax ignores one) over the visible entries (with terms: those
    no batch item masks): (c, t (batch, X, Lq, Lk), those entries). t is 0 without terms, else a term per (head,
    query, key) position: it may not vary between batch items, which the caller checks. ``given``: c as known."""
    lq, lk = r.shape[-2:]
    if r.numel() % (batch * lq * lk):  # a product over one item's tokens (a loop over the sequences of a batch)
        batch = 1
    r = r.double().reshape(batch, -1, lq, lk)
    s = s.double().reshape(r.shape)
    seen = _visible(s) & torch.isfinite(r)
    # a term shared by the items is fitted where every item sees the key; without one each item's own visible
    # scores will do (a top-k that keeps other keys in each item, beside a padding mask)
    joint = seen.all(0, keepdim=True).expand_as(seen) if with_terms else seen
    if not joint.any():
        raise Unrecognised("every score is masked in some batch item")

    def centred(t: Tensor, axis: int) -> Tensor:
        count = joint.sum(axis, keepdim=True).clamp_min(1)
        return torch.where(joint, t - torch.where(joint, t, 0).sum(axis, keepdim=True) / count, 0)

    sr, rr = centred(s, -1), centred(r, -1)  # a constant per row (a row max subtracted) changes nothing
    ds, dr = (centred(sr, 0), centred(rr, 0)) if with_terms and batch > 1 else (sr, rr)
    denominator = float((dr * dr).sum())
    if not denominator > 0 and with_terms:  # the items see different keys (a top-k per item): no shared term to fit
        return _fit(s, r, batch, False)
    if not denominator > 0:  # every row sees one key (or the product is constant along rows): no multiple to read
        raise Unrecognised("no row of the scores has two visible entries that differ: their scale cannot be read")
    c = float((ds * dr).sum()) / denominator if given is None else given
    return c, torch.where(joint, sr - c * rr, 0), joint


def _role(trace: Trace, tid: int) -> tuple[str | None, str]:
    """The role (q, k, v) of the projection a tensor comes from, and how it is known: "name" (its module's name,
    ``q_proj``, ``to_k``) or "order" (its place in a fused projection split in three or two parts: the role the
    module's source unpacks it as, ``key, query, value = ...chunk(3)``, else "q" for the first of three only, as
    code bases order the rest as they like, q|v|k in CodeGen); (None, "") when it cannot be told."""
    part, parts = None, None

    def by_order(part: int) -> str:  # the order the module's source unpacks the parts in, else q first
        return trace.fused_order[part] if trace.fused_order is not None else "q" if part == 0 else "k or v"
    for _ in range(80):
        if tid in trace.names:
            role = name_role(trace.names[tid])
            if role is not None:
                return role, "name"
            if part is not None and parts == 3:
                return by_order(part), "order"
            return None, ""
        found = trace.maker(tid)
        if found is None:
            return None, ""
        op, index = found
        if op.name == "linear":  # a projection without a module name (F.linear on a packed weight)
            return (by_order(part), "order") if part is not None and parts == 3 else (None, "")
        if op.name in ("split", "chunk", "unbind", "tensor_split", "split_with_sizes"):  # the one nearest the
            part, parts = index, len(op.outputs)  # projection counts
        elif op.name in ("getitem", "select") and len(op.args) > 1 and \
                isinstance(op.args[1], int) and not isinstance(op.args[1], bool) and op.args[0].dim() > 0:
            part, parts = op.args[1] % op.args[0].shape[0], op.args[0].shape[0]
        nxt = op.main_input()
        if nxt is None:
            return None, ""
        tid = nxt
    return None, ""


_MADE = frozenset({"linear", "addmm", "conv1d", "conv2d", "cat", "stack", "repeat", "index_select", "gather",
                   "index_copy", "index_copy_", "copy_", "setitem", "masked_scatter", "where"}) | PRODUCTS
_WRITES = frozenset({"index_copy", "index_copy_", "index_put", "index_put_", "copy_", "setitem", "scatter",
                     "scatter_", "masked_scatter"})
_NONLINEAR = frozenset({"relu", "gelu", "silu", "sigmoid", "tanh", "exp", "elu", "leaky_relu", "softplus", "abs",
                        "square", "pow", "sin", "cos", "softmax", "log_softmax", "mish", "hardtanh", "relu6"})
_TERMS_ON_V = frozenset({"add", "sub", "radd", "rsub", "add_", "sub_", "iadd", "isub", "mul", "rmul", "mul_", "imul",
                         "div", "truediv", "div_", "itruediv"})


def _values_verdict(trace: Trace, vid: int, evidence: dict, facts: dict,
                    inputs: frozenset[int] = frozenset(), depth: int = 3) -> Verdict | None:
    """values-changed when V reaches the product with the weights changed after its projection (up to the head
    split): rotated (rotary positions applied to v too), through a nonlinearity, or by a term computed from the
    module's input; else None. A norm on V, or a term that does not come from the input (a learned vector, a value
    embedding the model passes in), is a design: a fact."""
    origin = trace.origin(vid)
    op = origin.op
    while op is not None and op.name == "setitem" and len(op.args) > 1 and op.args[1] == "view":
        # a write into another view of the tensor V is read from (rotary applied in place to the q and k parts of
        # a packed qkv): V's own part is the tensor before the write
        origin = trace.origin(op.in_ids[0])
        op = origin.op
    if op is None:
        return None
    if op.name == "stack" and origin.part is not None and origin.parts == len(op.in_ids) and depth > 0:
        return _values_verdict(trace, op.in_ids[origin.part], evidence, facts, inputs, depth - 1)  # unbind(stack)
    if op.name == "cat" and origin.part is not None and origin.parts and depth > 0:  # unbind(cat([q, k, v], 2))[2]
        dim = op.kwargs.get("dim", op.kwargs.get("axis", op.args[1] if len(op.args) > 1 and
                                                 isinstance(op.args[1], int) else 0))
        sizes = [t.shape[dim] if -t.dim() <= dim < t.dim() else 0 for t in op.inputs]
        if sum(sizes) == origin.parts and len(sizes) == len(op.in_ids):  # (Phi's rotary rejoins q and k to v)
            at = origin.part
            for pid, size in zip(op.in_ids, sizes, strict=True):
                if at < size:
                    return _values_verdict(trace, pid, evidence, facts, inputs, depth - 1) if size == 1 else None
                at -= size
    if op.name in ("stack", "cat") and origin.part is None and depth > 0 and (now := trace.value(vid)) is not None:
        flat = now.flatten().sort().values  # V taken out of a packed tensor (torch.stack([q, k, v], 2)[:, :, 2]):
        for pid, piece in zip(op.in_ids, op.inputs, strict=False):  # the part it holds is what V is
            if piece.numel() == now.numel() and piece.dtype == now.dtype and \
                    torch.equal(piece.flatten().sort().values, flat):
                return _values_verdict(trace, pid, evidence, facts, inputs, depth - 1)
    if rotated_from(trace, origin.id) is not None:  # also a rotation written as a cat, a stack or in place
        return Verdict(VALUES_CHANGED, {"matches": "the values are rotated like q and k (rotary positions applied to "
                                          "v) before the product with the weights", **evidence}, facts)
    if op.name in _WRITES:  # a cache the values are written into: what was written is what V is
        for written in op.in_ids[1:]:
            if rotated_from(trace, trace.origin(written).id) is not None:
                return Verdict(VALUES_CHANGED, {"matches": "the values are rotated like q and k (rotary positions "
                                                  "applied to v) before they are written to the cache",
                                                  **evidence}, facts)
    if op.name in ("cat", "stack") and depth > 0:  # values joined from parts (a prefix token kept apart from the
        for part in op.in_ids:  # rotated image tokens, as EVA does for q and k): each part is read as V is
            found = _values_verdict(trace, part, evidence, facts, inputs, depth - 1)
            if found is not None:
                return found
        return None
    if op.name in _MADE:
        return None
    norm = normalised(trace, vid)
    if norm is not None and norm_role(norm) is None:  # a norm class of the module's own: its output is named
        for t in (vid, *trace.ancestors(vid, limit=8)):
            name = trace.names.get(t)
            if name is not None:  # the nearest named output: the norm's, or the projection's (no norm named)
                norm = name if norm_role(name) is not None else norm
                break
    if norm is not None and norm_role(norm) is not None:  # the keys' or queries' own norm (v = self.k_norm(v))
        return Verdict(VALUES_CHANGED, {"matches": f"the values pass through {norm}, a norm named for the "
                                          f"{'keys' if norm_role(norm) == 'k' else 'queries'}, after their "
                                          "projection (a norm copied onto v by mistake?)", **evidence}, facts)
    if norm is not None:
        facts["values"] = f"V is normalised ({norm}) after its projection"
        return None
    if op.name in _NONLINEAR:
        return Verdict(VALUES_CHANGED, {"matches": f"the values pass through {op.name} after their projection, "
                                          "before the product with the weights", **evidence}, facts)
    if op.name in _TERMS_ON_V and len(op.in_ids) == 2:
        main = op.main_input()
        other = next((i for i in op.in_ids if i != main), None)
        if op.name in ("add", "radd", "add_", "iadd") and main is not None and other is not None and \
                (root := _linear_root(trace, origin.id, inputs)) is not None and \
                root[1]:
            facts["values"] = ("V's projection is a sum of linear maps of one input (a low-rank adapter beside it, "
                               "as LoRA adds B A x to W x): one linear projection")
            return None
        made = trace.maker(other) if other is not None else None
        if op.name in ("add", "radd", "add_", "iadd") and made is not None and made[0].name == "detach":
            facts["values"] = ("V plus a detached term (x + (q(x) - x).detach(): a straight-through estimator, as "
                               "quantization-aware training writes it): its forward is q(x), its gradient x's")
            return None
        scale = trace.value(other) if other is not None else None
        own = frozenset({trace.identity(main)}) if main is not None else frozenset()
        if op.name in ("mul", "rmul", "mul_", "imul") and own and scale is not None and scale.dim() >= 1 and \
                scale.shape[-1] == 1 and other is not None and _depends_on(trace, other, own):
            # one factor per token computed from V itself (x * (mean(x^2) + eps) ** -0.5: Gemma's v_norm)
            facts["values"] = "V is normalised after its projection (each token scaled by a factor of its own)"
            return None
        if other is not None and main is not None and inputs and _depends_on(trace, other, inputs) and \
                _depends_on(trace, main, inputs):
            return Verdict(VALUES_CHANGED, {"matches": f"the values are changed by a term computed from the input "
                                              f"({op.name}) after their projection, before the product with the "
                                              "weights", **evidence}, facts)
        facts["values"] = (f"V is changed after its projection by a term that does not come from the input "
                           f"({op.name}: a learned vector, a value embedding or residual)")
    return None


def _linear_root(trace: Trace, tid: int, inputs: frozenset[int], depth: int = 16) -> tuple[int, bool] | None:
    """(the tensor a linear map of it made ``tid`` from, whether a projection is on the way) for a tensor made by
    ``linear`` or ``addmm`` ops, or leaves with a 2-D weight (transformers' Conv1D), sums of such maps of one
    tensor, factors that do not depend on the run's inputs multiplied in (LoRA's scaling, DoRA's magnitude per
    feature), and dropout or layout on the way (LoRA's ``lora_B(lora_A(dropout(x))) * scaling``); None when
    something else made it."""
    found = trace.maker(tid)
    if found is None or depth == 0:
        return trace.identity(tid), False
    op = found[0]
    if op.name in ("linear", "addmm", "module"):  # "module": a leaf with a 2-D weight (transformers' Conv1D)
        at = 1 if op.name == "addmm" else 0
        got = _linear_root(trace, op.in_ids[at], inputs, depth - 1) if len(op.in_ids) > at else None
        return None if got is None else (got[0], True)
    if op.name in ("add", "radd", "add_", "iadd", "sub", "rsub", "sub_", "isub") and len(op.in_ids) == 2:
        fixed = [i for i in op.in_ids if not _depends_on(trace, i, inputs)]
        if len(fixed) == 1:  # a bias added or taken off (DoRA's base_result - bias)
            return _linear_root(trace, next(i for i in op.in_ids if i != fixed[0]), inputs, depth - 1)
        sides = [_linear_root(trace, i, inputs, depth - 1) for i in op.in_ids]
        if sides[0] is None or sides[1] is None or sides[0][0] != sides[1][0] or not (sides[0][1] and sides[1][1]):
            return None  # x itself added to a map of it is a residual on v, no projection
        return sides[0][0], True
    if op.name in ("mul", "rmul", "div", "truediv"):
        varying = [i for i in op.in_ids if _depends_on(trace, i, inputs)]
        if len(varying) != 1 or (op.name in ("div", "truediv") and op.in_ids[0] != varying[0]):
            return None  # a product of two things the input makes, or the input in a denominator
        factors = [t for i, t in zip(op.in_ids, op.inputs, strict=False) if i != varying[0]]
        if any(t.dim() > 1 and any(size != 1 for size in t.shape[:-1]) for t in factors):
            return None  # a factor that varies along the tokens (rotary tables): no map of the features alone
        return _linear_root(trace, varying[0], inputs, depth - 1)
    if op.name == "dropout" or op.name in LAYOUT:
        main = op.main_input()
        return None if main is None else _linear_root(trace, main, inputs, depth - 1)
    return trace.identity(tid), False


def _softmax_over_keys(trace: Trace, sm: Op, dim: int) -> bool:
    """Does the softmax's ``dim`` come from the key operand of an einsum score product (the operand a projection's
    name says is k, else the second one, as in q k^T)?"""
    try:
        product, _ = _score_chain(trace, sm.in_ids[0])
    except Unrecognised:
        return False
    eq = _equation(product)
    if eq is None or len(eq[0]) != 2 or len(eq[1]) != sm.args[0].dim():
        return False
    (sa, sb), out = eq
    letter = out[dim]
    side = 0 if letter in sa and letter not in sb else 1 if letter in sb and letter not in sa else None
    if side is None:
        return False
    named = [r if how == "name" else None for r, how in (_role(trace, i) for i in product.in_ids[:2])]
    keys = named.index("k") if "k" in named else 1
    return side == keys


def _kv_heads(trace: Trace, tid: int) -> list[int] | None:
    """For a key or value operand with grouped heads repeated to the query heads: which kv head each of its heads
    is, read off the tensor of fewer heads it was repeated from (a few operations back: one axis H there G, H a
    multiple of G, the other axes alike); None when there is none or a head matches no kv head exactly."""
    chain = [(cur, trace.value(cur)) for cur in (tid, *trace.ancestors(tid, limit=24))]  # k^T, k, k before repeat
    tensors = [t for _, t in chain if t is not None and t.dim() >= 3 and not t.is_complex()]
    # an operand with the heads on two axes, kv head and member of its group (gpt-oss's (B, L, G, r, D) einsums),
    # is read with those axes flattened into one, as the query heads are numbered
    readings = [(i, r, flat) for i, t in enumerate(tensors) for r, flat in
                [(t, False), *((t.flatten(a, a + 1), True) for a in reversed(range(t.dim() - 2)) if t.dim() >= 5)]]
    for i, value, flat in readings:
        # a kv head broadcast to its group before a flatten (Falcon-40B's (B, L, G, 1, D) expanded to r, flattened
        # to G * r heads) is read with its axis of one dropped
        earlier = [t.squeeze(a) if t.dim() == value.dim() + 1 and t.shape[a] == 1 else t
                   for t in tensors[i + 1:] for a in ([*range(t.dim())] if t.dim() == value.dim() + 1 else [0])]
        for before in earlier:
            if before.dim() != value.dim():
                continue
            axes = [a for a in range(value.dim()) if before.shape[a] != value.shape[a]]
            if len(axes) != 1:
                continue
            axis = axes[0]
            heads, groups = value.shape[axis], before.shape[axis]
            if not 1 < groups < heads or heads % groups:
                continue
            found = []
            for h in range(heads):
                match = [g for g in range(groups) if torch.equal(value.select(axis, h), before.select(axis, g))]
                if len(match) != 1:
                    break
                found.append(match[0])
            if len(found) == heads:
                return found
            if not flat:  # a reading of the operand as it is decides; another pair of its axes may still be the heads
                return None
    return None


def _first_seen(labels: list[int]) -> list[int]:
    """``labels`` renumbered by first appearance ([1, 1, 0, 0] -> [0, 0, 1, 1]): which heads share one."""
    order: dict[int, int] = {}
    return [order.setdefault(x, len(order)) for x in labels]


def _equal_heads(t: Tensor, heads: int) -> list[int] | None:
    """For an operand (..., H, L, D) with ``heads`` heads on its third axis from the end: each head labelled by the
    first head equal to it, renumbered by first appearance; None when the axis is not there."""
    if t.dim() < 3 or t.shape[-3] != heads:
        return None
    labels: list[int] = []
    for h in range(heads):
        head = t.select(-3, h)
        labels.append(next((g for g in range(h) if torch.equal(head, t.select(-3, g))), h))
    return _first_seen(labels)


def _groups_verdict(trace: Trace, kid: int, vid: int, evidence: dict, facts: dict) -> Verdict | None:
    """group-mismatch when k and v are both repeated from fewer kv heads (GQA, MQA) but a query head takes its keys
    from one kv head and its values from another (repeat_interleave for one, repeat for the other); else None."""
    k_heads, v_heads = _kv_heads(trace, kid), _kv_heads(trace, vid)
    if (k_heads is None) != (v_heads is None):  # one side rotated after its repeat (Falcon-40B's keys): which of
        known = k_heads if k_heads is not None else v_heads  # its heads are copies of each other still tells
        other = trace.value(vid if k_heads is not None else kid)
        found = None if other is None or known is None else _equal_heads(other, len(known))
        if found is not None and known is not None and len(set(found)) == len(set(known)) < len(found):
            # as many groups as the known side (values grouped otherwise by design, DiffLlama's halves, are not read)
            k_heads, v_heads = (_first_seen(known), found) if v_heads is None else (found, _first_seen(known))
    if k_heads is None or v_heads is None or len(k_heads) != len(v_heads):
        return None
    if k_heads == v_heads:
        facts["grouped heads"] = f"{len(k_heads)} query heads share {len(set(k_heads))} kv heads: {k_heads}"
        return None
    return Verdict(GROUP_MISMATCH, {"matches": f"query heads take their keys from kv heads {k_heads} and their "
                                               f"values from kv heads {v_heads}", **evidence}, facts)


def _roles_verdict(trace: Trace, ids: tuple[int, int, int], evidence: dict, facts: dict) -> Verdict | None:
    """A verdict when the score and value operands come from projections in the wrong roles, else None."""
    roles = [_role(trace, i) for i in ids]
    named = [r if how == "name" else None for r, how in roles]
    if (roles[1] == ("q", "order") and roles[0][0] in ("k or v", "k")) or named[:2] == ["k", "q"]:
        return Verdict(SOFTMAX_DIM, {"matches": "the scores are K Q^T (keys and queries swapped): the softmax runs "
                                      "over the queries", **evidence}, facts)
    if named[:2] == ["q", "q"] and named[2] in ("v", None):  # no key projection ran: the keys are the queries'
        facts["shared qk"] = ("the keys are the queries' projection (shared-QK attention, as in Reformer); a key "
                              "projection the module has and never uses is the gradient probe's no-grad")
        return None
    if any(r not in (want, None) for r, want in zip(named, ("q", "k", "v"), strict=True)):
        return Verdict(DEFINITION_MISMATCH, {"matches": f"softmax({named[0] or '?'} {named[1] or '?'}^T) "
                                               f"{named[2] or '?'}: the projections are used in the wrong roles",
                                               **evidence}, facts)
    return None


def _disentangled_scale(trace: Trace, chain: _Chain, inputs: frozenset[int], scale: float, d: int, width: int,
                        said: str, facts: dict) -> tuple[str | None, str, dict]:
    """DeBERTa's scale: the content product and n relative-position products (c2p, p2c) added to it, each scaled by
    1/sqrt((1 + n) D) so that their sum keeps the variance of one (He et al. 2021, ``scale_factor``). A design when
    the scale is that with n the number of position products found, and it is not 1/sqrt(width) as well."""
    n = sum(len(_position_products(trace, tid, inputs) or ()) for tid, _ in chain.added)
    if n and abs(scale * math.sqrt((1 + n) * d) - 1) < 1e-3 and (1 + n) * d != width:
        facts = {**facts, "scale": f"1/sqrt({1 + n} x {d}): the content product and {n} relative-position "
                                   f"product(s) share it (DeBERTa's scale_factor {1 + n})"}
        return None, f"{said} = 1/sqrt({1 + n} x {d}) (DeBERTa's disentangled attention: {n} position terms)", facts
    return WRONG_SCALE, said, facts


def _scale_verdict(c: float, d: int, width: int, expected: float | None, unit_norm: bool) -> tuple[str | None, str]:
    want = expected if expected is not None else 1 / math.sqrt(d)
    said = f"scores scaled by {c:.6g}"
    if abs(c / want - 1) < 1e-3:
        return None, f"{said} = {'the stated scale' if expected is not None else f'1/sqrt({d})'}"
    if unit_norm and expected is None:
        return None, f"{said} (q and k have unit norm, or had before learned gains: cosine-similarity attention, " \
            "the scale is a temperature)"
    if abs(c - 1) < 1e-3:
        return MISSING_SCALE, f"{said}: no 1/sqrt({d})"
    if abs(c * d - 1) < 1e-3:
        return WRONG_SCALE, f"{said} = 1/{d} (1/D instead of 1/sqrt(D), D = {d})"
    if width and abs(c * math.sqrt(width) - 1) < 1e-3:
        return WRONG_SCALE, f"{said} = 1/sqrt({width}) (the model width, not the head dim {d})"
    return WRONG_SCALE, f"{said}; expected {want:.6g} = " + \
        ("the stated scale" if expected is not None else f"1/sqrt({d}), D = {d} the head dim")


def _past_the_rotation(fid: str | None, said: str, scale: float, a: Origin, b: Origin, d: int, width: int,
                       expected: float | None, unit: bool, facts: dict) -> tuple[str | None, str]:
    """The scale verdict without YaRN's attention factor: the same number above 1 (0.1 ln(s) + 1 for a context s times
    longer) multiplied into q and into k right after their rotation is a temperature of the positions, as when it is
    folded into cos and sin (recorded in ``facts``); the rest of the scale is judged."""
    f, g = a.after_rotation, b.after_rotation
    if fid is None or f <= 1 + 1e-6 or abs(f / g - 1) > 1e-9:
        return fid, said
    facts["attention factor"] = (f"q and k multiplied by {f:.6g} after their rotation: the rotary positions' "
                                 "attention factor (YaRN's mscale), a temperature of the positions")
    again, plain = _scale_verdict(scale / (f * g), d, width, expected, unit)
    return again, f"{plain}, times {f:.6g}^2 (the rotation's attention factor, YaRN's)"


def _other_axes(weights: Tensor, length: int) -> str:
    """What attention weights (..., Lq, Lk) over other axes than the L tokens' may be: a few queries over every token
    (attention pooling, class attention: no self-attention, whose output the doctor would need a row per token of),
    a square over the features (XCiT's cross-covariance attention: a design of its own), or a head split that mixes
    tokens and heads."""
    rows, keys = (weights.shape[-2], weights.shape[-1]) if weights.dim() >= 2 else (1, weights.numel())
    if keys == length and rows < length:
        return (f"{rows} query row(s) over the {length} tokens: attention pooling or class attention, a learned or "
                "class-token query, which is no self-attention; or a head split that mixes tokens and heads")
    if rows == keys:
        return (f"a square of {rows} over another axis: attention over the channels (XCiT's cross-covariance "
                "attention, a design of its own: --allow-nonstandard) or a head split that mixes tokens and heads")
    return "a head split that mixes tokens and heads"


def _head_bias_lookup(trace: Trace, heads: set[int]) -> tuple[str, Tensor] | None:
    """(the table's shape as text, the (Lq, Lk) index of the first item) of a per-head position bias looked up in
    a learned ``nn.Embedding(entries, heads)`` by an index map over (query, key), as T5 looks its bias up; None
    when there is none. ``heads``: the sizes the head axis may have."""
    for op in trace.ops:
        if op.name != "embedding" or len(op.inputs) < 2:
            continue
        tables = [(tid, w) for tid, w in zip(op.in_ids, op.inputs, strict=False)
                  if w.is_floating_point() and w.dim() == 2 and w.shape[1] in heads and trace.learned(tid, depth=0)]
        index = next((t for t in op.inputs if not t.is_floating_point()), None)
        if not tables or index is None or index.dim() < 2:
            continue
        square = index.reshape(-1, *index.shape[-2:])[0]
        if square.shape[0] >= 3 and square.shape[1] == square.shape[0]:
            return f"{tuple(tables[0][1].shape)} (buckets, heads)", square
    return None


def _toeplitz(square: Tensor) -> bool:
    n = square.shape[0]
    return all(bool((square.diagonal(k) == square.diagonal(k)[0]).all()) for k in range(-n + 1, n))


def _head_bias_table(trace: Trace, heads: set[int]) -> str | None:
    """The shape of the embedding table a per-head position bias was looked up in the way T5 looks it up, as text,
    or None. T5's ``relative_attention_bias`` is an ``nn.Embedding(buckets, heads)`` (trained, one column per head)
    indexed by an (Lq, Lk) map of buckets of j - i: the same bucket along each diagonal, bucket 0 for the key at
    the query's own position and bucket 1 for the key just before it (exact buckets for small distances, in both
    T5's bidirectional and causal forms). A table indexed by absolute positions, or by clipped offsets (Shaw's
    index j - i + K), is not T5's. ``heads``: the sizes the head axis may have."""
    found = _head_bias_lookup(trace, heads)
    if found is None:
        return None
    table, square = found
    return table if _toeplitz(square) and int(square[0, 0]) == 0 and int(square[1, 0]) == 1 else None


def bucket_not_relative(trace: Trace, heads: set[int], plain_only: bool = False) -> str | None:
    """Why a T5-style bias table (learned, one column per head) is looked up by an index that is not of j - i: the
    index changes along a diagonal (the query's position dropped from ``memory_position - context_position``, say);
    None when it is of j - i, a symmetric distance of some other structure (the same on the diagonal), or there is
    no such table. ``plain_only``: only an index of one position (the key's
    or the query's) or of i + j counts (a grid's offsets, flattened, are of neither: a 2-D relative index)."""
    found = _head_bias_lookup(trace, heads)
    if found is None or _toeplitz(found[1]):
        return None
    table, square = found
    if torch.equal(square, square.T) and bool((square.diagonal() == square[0, 0]).all()):
        return None  # a distance on another structure than the line (Graphormer's shortest paths, |dy|, |dx| on a grid)
    rows_alike, columns_alike = bool((square == square[:1]).all()), bool((square == square[:, :1]).all())
    summed = _toeplitz(square.flip(-1))  # constant along each anti-diagonal: an index of i + j
    if plain_only and not (rows_alike or columns_alike or summed):
        return None
    how = ": every query row reads the same buckets, by the key's position alone (the query's position dropped " \
          "from memory - context)" if rows_alike else ": every key reads the same buckets, by the query's position " \
          "alone" if columns_alike else ": it is a function of i + j (a sign lost in memory - context)" if summed \
          else ""
    return (f"a learned bias per head from an embedding of {table} is looked up by an index that is not a function "
            f"of the distance j - i{how}; T5's bias is relative")


def _index_follows_offsets(square: Tensor) -> bool:
    """Is the (n, n) index of a position table read by the offsets between query and key on some grid of the n
    tokens: the same entry for every pair at one offset (Swin's and BEiT's tables, T5's buckets, LeViT's |dy|, |dx|),
    or pairs that share an entry at one offset up to sign along each axis (Pangu-Weather's table of absolute levels
    and latitudes with longitude offsets; a full table of (query, key) pairs)?"""
    n = square.shape[0]
    flat = square.reshape(-1).long()
    flat = flat - flat.min()
    for sides in token_grids(n):
        coords, rest = [], torch.arange(n)
        for size in reversed(sides):
            coords.append(rest % size)
            rest = rest // size
        coords.reverse()
        signed, unsigned = torch.zeros(n, n, dtype=torch.long), torch.zeros(n, n, dtype=torch.long)
        for c, size in zip(coords, sides, strict=True):
            off = c[:, None] - c[None, :]
            signed = signed * (2 * size - 1) + off + size - 1
            unsigned = unsigned * size + off.abs()
        for key, value in ((signed.reshape(-1), flat), (flat, unsigned.reshape(-1))):
            groups = int(key.max()) + 1
            low = torch.full((groups,), torch.iinfo(torch.long).max).scatter_reduce(0, key, value, "amin")
            high = torch.full((groups,), torch.iinfo(torch.long).min).scatter_reduce(0, key, value, "amax")
            if torch.equal(low[key], high[key]):
                return True
    return False


def table_not_relative(trace: Trace, inputs: frozenset[int]) -> str | None:
    """Why a learned position table read by an index buffer over (query, key) pairs is read by no offsets: on the
    line and on every grid of the tokens (a few leading tokens, class tokens with entries of their own, set apart)
    the index ties pairs of tokens at different offsets (a table read at i + j, a grid index with a wrong stride);
    None when it follows them or there is no such table."""
    for op in trace.ops:
        if op.name not in ("getitem", "index_select") or len(op.inputs) < 2 or not op.in_ids:
            continue
        table = op.inputs[0]
        if not table.is_floating_point() or table.dim() < 2 or not trace.learned(op.in_ids[0], depth=0):
            continue
        found = next(((i, t) for i, t in zip(op.in_ids[1:], op.inputs[1:], strict=False)
                      if not t.is_floating_point() and t.dtype != torch.bool and t.numel() >= 9), None)
        if found is None or _depends_on(trace, found[0], inputs):
            continue
        n = math.isqrt(found[1].numel())
        if n * n != found[1].numel() or n > 400:
            continue
        square = found[1].reshape(n, n).cpu()
        # a few leading tokens set apart only when they read entries of their own (BEiT's class-token entries)
        apart = [c for c in range(min(4, n - 3)) if c == 0 or not bool(torch.isin(
            torch.cat((square[:c].flatten(), square[:, :c].flatten())), square[c:, c:].reshape(-1)).any())]
        if any(_index_follows_offsets(square[c:, c:]) for c in apart):
            continue
        return (f"a learned table {tuple(table.shape)} is read by an index over the {n} x {n} (query, key) pairs "
                "that ties pairs at different offsets on the line and on every grid of the tokens (read at i + j, or "
                "a grid index with a wrong stride?): a relative-position bias gives pairs one offset apart one entry")
    return None


def folded_scale(q: Tensor, k: Tensor, d: int) -> bool:
    """Is 1/sqrt(d) folded into q's projection (T5's initialisation: q's weights 1/sqrt(d) of k's), so that scores
    with no scale are the definition? Read from the sizes of q and k on the probe input: their ratio within 30%
    of 1/sqrt(d) (ordinary projections give q and k of one size)."""
    if d < 4 or q.numel() == 0 or k.numel() == 0:
        return False
    rms = float(q.double().pow(2).mean().sqrt() / k.double().pow(2).mean().sqrt())  # per entry: GQA's k is smaller
    return rms > 0 and abs(math.log(rms * math.sqrt(d))) < math.log(1.3)


def _per_dim(op: Op | None, d: int) -> bool:
    """Is ``op`` a multiplication by a vector of one value per head dimension (a learned per-dimension scale)?"""
    if op is None or op.name not in ("mul", "rmul") or len(op.inputs) != 2:
        return False
    small = min(op.inputs, key=lambda t: t.numel())
    return small.numel() == d and small.shape[-1] == d and small.dim() <= 4


def _norm_gain(trace: Trace, op: Op | None) -> bool:
    """Is ``op`` (a multiplication by a vector) a norm's own gain, applied to ``x * rsqrt(...)`` (a q/k RMSNorm's
    weight, Qwen3's), rather than a scale of its own applied after the norm (TimesFM's per_dim_scale)?"""
    if op is None:
        return False
    for i in op.in_ids:
        made = trace.origin(i).op  # past casts and layout (``(x.float() * rsqrt(var)).to(x.dtype)``)
        if made is not None and made.name in ("mul", "rmul") and \
                any((m := trace.maker(j)) is not None and m[0].name == "rsqrt" for j in made.in_ids):
            return True
    return False


def _unit_norm(a: Tensor, b: Tensor, fa: float, fb: float) -> bool:
    """Do both score operands (divided by the factors found on their way) have unit norm along an axis of the
    head dim's size (the contracted one: the last of q, the last or, for k transposed, the one before of k)?"""
    def unit(t: Tensor, f: float) -> bool:
        t = t.double() / f if f else t.double()
        axes = [-1, -2] if t.dim() >= 2 else [-1]
        return any(t.shape[ax] == a.shape[-1] and bool(((t.norm(dim=ax) - 1).abs() < 1e-3).all()) for ax in axes)
    return unit(a, fa) and unit(b, fb)


def _one_side_unit(a: Tensor, b: Tensor, axis_a: int | None, axis_b: int | None, d: int) -> str | None:
    """Which score operand alone has unit norm along the head dim the product contracts (q normalised, k not), or
    None (both, or neither)."""
    def unit(t: Tensor, axis: int | None) -> bool:
        return axis is not None and t.dim() >= 1 and t.shape[axis] == d and t.is_floating_point() and \
            bool(((t.double().norm(dim=axis) - 1).abs() < 1e-3).all())
    sides = (unit(a, axis_a), unit(b, axis_b))
    if sides == (True, False):
        return "the first operand of the scores (q) has unit norm along the head dim and the second (k) not"
    if sides == (False, True):
        return "the second operand of the scores (k) has unit norm along the head dim and the first (q) not"
    return None


def _merge(trace: Trace, op: Op, out: Tensor, final: Tensor,
           canon: tuple[int, ...] | None = None) -> tuple[str | None, str]:
    """Check that the tensor read after the weights-times-values product puts the heads side by side (operations
    that keep the heads' layout, such as zeroing padded rows, are followed first). ``canon``: the permutation that
    makes the product's output (B, H, L, D) when its layout is another (an einsum's "ibhd")."""
    m = final
    found = _main_line(trace, op.out_ids[0], out)
    if found is not None:
        out, read = found
        value = trace.value(read[1])
        if value is None:
            return None, "merge of the heads not checked (the product is read directly)"
        nxt = read[0]
        if value.shape == out.shape and nxt.name in PRODUCTS and _contracts_heads(nxt, read[1], out):
            return None, "heads read by the output projection as they are (it contracts the heads and their dims)"
        m = value
    o = out.double() if canon is None or out.dim() != len(canon) else out.double().permute(canon)
    cands: dict[str, Tensor] = {}
    if o.dim() == 4:
        b, h, length, d = o.shape
        cands["correct"] = o.transpose(1, 2).reshape(b, length, h * d)
        cands["sequence-first"] = o.permute(2, 0, 1, 3).reshape(length, b, h * d)
        cands[HEAD_MERGE] = o.reshape(b, length, h * d)
    elif o.dim() == 3 and m.dim() >= 2 and m.shape[-1] % o.shape[-1] == 0:
        h = m.shape[-1] // o.shape[-1]
        if h == 1:
            cands["correct"] = o
        elif o.shape[0] % h == 0:
            bh, length, d = o.shape
            o4 = o.reshape(bh // h, h, length, d)
            cands["correct"] = o4.transpose(1, 2).reshape(bh // h, length, h * d)
            cands["sequence-first"] = o4.permute(2, 0, 1, 3).reshape(length, bh // h, h * d)
            cands[HEAD_MERGE] = o.reshape(bh // h, length, h * d)
    if _tokens_kept(o, m) is False:
        return HEAD_MERGE, ("each row the next operation reads holds features of several query tokens: the heads (or "
                            "the tokens of a map) are put back with a view, reshape or transpose that mixes tokens")
    if not cands or m.numel() != next(iter(cands.values())).numel():
        return None, "merge of the heads not checked (the next operation reads another shape)"
    flat = m.double().reshape(-1)
    tol = 1e-3 * (1 + float(flat.abs().max()))
    for label, cand in cands.items():
        if bool(((cand.reshape(-1) - flat).abs() <= tol).all()):
            if label == HEAD_MERGE:
                return HEAD_MERGE, "heads merged with view/reshape before the transpose back"
            return None, "heads merged side by side"
    return None, "merge of the heads not recognised (the next operation reads something else)"


def _main_line(trace: Trace, tid: int, out: Tensor, depth: int = 4) -> tuple[Tensor, tuple[Op, int]] | None:
    """From the values product's output ``tid`` (value ``out``), the first operation that reads it, or what an
    operation keeping its layout made of it (zeroing padded rows, a gate, ``out - (out . v) v``), in another shape:
    (the value read, (that operation, the key it read)); reads that lead nowhere else in the heads' layout (a sum
    over the head dim, a side branch) are passed over. None when nothing reads it (the module returns it)."""
    for nxt, key in trace.consumers(tid):
        value = trace.value(key)
        # read as it is: a transposed view keeps the shape only when sizes coincide (as many heads as tokens)
        same = value is not None and value.shape == out.shape and (key == tid or torch.equal(value, out))
        if same and nxt.out_ids and nxt.outputs[0].shape == out.shape:
            if depth > 0 and (found := _main_line(trace, nxt.out_ids[0], nxt.outputs[0], depth - 1)) is not None:
                return found  # still in the heads' layout: follow it
            continue
        if same and nxt.name not in PRODUCTS and nxt.outputs and nxt.outputs[0].numel() < out.numel():
            continue  # a reduction over the head dim (a side branch)
        return out, (nxt, key)
    return None


def _contracts_heads(op: Op, read: int, out: Tensor) -> bool:
    """Does the product ``op`` contract two axes of the values product's output ``out``, read as it is, the head
    dim among them (a per-head output projection: Mesh-TF's einsum "bhnd,hde->bne", or "bnhd,hde->bne")?"""
    eq = _equation(op)
    if eq is None or out.dim() != 4 or read not in op.in_ids:
        return False
    (sa, sb), result = eq
    mine = sa if op.in_ids.index(read) == 0 else sb
    if len(mine) != 4:
        return False
    contracted = [c for c in mine if c not in result]
    return len(contracted) == 2 and mine[-1] in contracted and mine[0] in result  # (heads, dims) in any order


def _tokens_kept(o: Tensor, m: Tensor) -> bool | None:
    """Does every row of ``m`` (the tensor read after the values product, along an axis of one token's feature count)
    hold the features of one query token of ``o`` (..., L, D), in any order? None when no axis of ``m`` can be one
    token's features. A merge in any head order keeps each token's values together; a view before the transpose
    back, or a transpose of the wrong axes, spreads them over other rows."""
    if o.dim() < 2 or o.numel() != m.numel() or o.is_complex() or m.is_complex():
        return None
    every_o, every_m = o.double().flatten().sort().values, m.double().flatten().sort().values
    finite = torch.isfinite(every_o) & torch.isfinite(every_m)
    if not torch.allclose(every_o[finite], every_m[finite], rtol=1e-6, atol=1e-9):
        return None  # not the product's values moved about (a gate the walk reached through its view_as)
    length, d = o.shape[-2], o.shape[-1]
    lead = o.numel() // (length * d)
    verdict = None
    for a in range(m.dim()):
        f = m.shape[a]
        if f % d or lead % (f // d) or f == 1:
            continue
        h, b = f // d, lead // (f // d)
        rows_m = m.double().movedim(a, -1).reshape(-1, f).sort(-1).values
        rows_m = rows_m[torch.isfinite(rows_m).all(1)]  # a row with no visible key (NaN) is in no order
        layouts = [o.double().reshape(b, h, length, d), o.double().reshape(h, b, length, d).transpose(0, 1)]
        # heads on a leading axis of their own beside others (windows: Pangu's (B, H, windows, N, D))
        layouts += [o.double().movedim(i, 0).reshape(h, b, length, d).transpose(0, 1)
                    for i in range(1, o.dim() - 2) if o.dim() > 4 and o.shape[i] == h]
        for o4 in layouts:
            rows_o = o4.permute(0, 2, 1, 3).reshape(-1, f).sort(-1).values
            rows_o = rows_o[torch.isfinite(rows_o).all(1)]
            if not len(rows_o) or not len(rows_m):
                return None
            tol = 1e-7 * (1 + float(rows_o.abs().max())) * math.sqrt(f)
            if bool((torch.cdist(rows_m, rows_o).min(1).values <= tol).all()):
                return True
        verdict = False
    return verdict


def _self_mask(s: Tensor, hidden: Tensor) -> str | None:
    """The design fact when every token's score with itself is set to one finite value that no other masked score
    has (Reformer's shared-QK attention: a query is nearest to itself, so its own key is hidden by -1e5 and seen only
    when nothing else is visible); else None. s, hidden: (..., L, L)."""
    if s.dim() < 2 or s.shape[-1] != s.shape[-2] or s.shape[-1] < 2:
        return None
    diag = s.diagonal(dim1=-2, dim2=-1).double()
    if not bool(hidden.diagonal(dim1=-2, dim2=-1).all()) or not bool(torch.isfinite(diag).all()):
        return None
    value = float(diag.max())
    off = hidden & ~torch.eye(s.shape[-1], dtype=torch.bool, device=s.device)
    masked = s.double()[off]
    if bool((masked == value).any()):  # the diagonal hidden as the other masked scores are: a mask's bug
        return None
    own = diag == value  # the rest of the diagonal: the mask's own value (a padded key), written over it
    if 2 * int(own.sum()) < own.numel() or not bool(torch.isin(diag[~own], masked).all()):
        return None
    return (f"each token's score with itself is set to {value:g}, apart from the mask: a token attends to itself only "
            "when no other key is visible (shared-QK attention's self mask, as in Reformer)")


def distance_rewarded(t: Tensor, seen: Tensor) -> str | None:
    """For a term added to square scores (..., L, L), visible where ``seen``: is it, in every head, a number per query
    row plus a slope times the distance |i - j|, with the slopes positive (and some above 0)? ALiBi subtracts
    m |i - j| (or adds m (j - i) for j <= i): a term that grows with the distance rewards far keys, ALiBi's sign
    flipped. What that is, or None (a learned table, any other term)."""
    n = t.shape[-1]
    if t.dim() < 2 or t.shape[-2] != n or n < 3 or seen.shape != t.shape:
        return None
    at = torch.arange(n, device=t.device)
    dist = (at[:, None] - at[None, :]).abs().double()
    rows, masks = t.double().reshape(-1, n, n), seen.reshape(-1, n, n)
    top = 1 + float(rows.masked_fill(~masks, 0).abs().max())
    slopes = []
    for row, mask in zip(rows, masks, strict=True):  # each query row up to a number of its own (the softmax's)
        count = mask.sum(-1, keepdim=True).clamp_min(1)
        xc = torch.where(mask, dist - (dist * mask).sum(-1, keepdim=True) / count, 0.0)
        yc = torch.where(mask, row - row.masked_fill(~mask, 0).sum(-1, keepdim=True) / count, 0.0)
        spread = float((xc * xc).sum())
        if spread == 0:
            continue
        slope = float((xc * yc).sum()) / spread
        if float((yc - slope * xc).abs().max()) > 1e-6 * top:
            return None  # not linear in the distance: another term (a learned table, buckets)
        slopes.append(slope)
    if not slopes or min(slopes) < -1e-9 * top or max(slopes) <= 1e-6 * top:
        return None
    return (f"a position term that grows with the distance |i - j| (slopes {min(slopes):.3g} to {max(slopes):.3g} per "
            "position) raises the scores of distant keys: ALiBi's distance penalty with its sign flipped (ALiBi "
            "adds -m |i - j|)")


def _own_key_hidden(hidden: Tensor, keep: Tensor) -> bool:
    """Is every token's own key hidden, and apart from the diagonal exactly what a key mask (the same for every query:
    padding, no causal pattern) hides? Then the diagonal is a design of its own (locality self-attention, Lee et
    al. 2021: tsai's and vit-pytorch's LSA mask the diagonal with the padding's fill); a causal mask that also hides
    the diagonal is not read so. hidden (..., L, L); keep broadcastable to it."""
    n = hidden.shape[-1]
    if hidden.dim() < 2 or hidden.shape[-2] != n or n < 3 or keep.shape[-2:] != (n, n):
        return False
    if not bool(hidden.diagonal(dim1=-2, dim2=-1).all()) or not bool((keep == keep[..., :1, :]).all()):
        return False
    rows, keys = hidden.reshape(-1, n, n), keep.reshape(-1, n, n)[:, 0, :]  # heads may be folded into the batch
    if rows.shape[0] % keys.shape[0]:
        return False
    keys = keys.repeat_interleave(rows.shape[0] // keys.shape[0], 0).to(rows.device)
    eye = torch.eye(n, dtype=torch.bool, device=rows.device)
    return bool(torch.equal(~rows & ~eye, keys[:, None, :] & ~eye))


def _convolved_before(trace: Trace, op: Op) -> bool:
    """Did a convolution run on the way to ``op`` (the input mixed with its neighbours before the attention)?"""
    for other in trace.ops:
        if other is op:
            return False
        if other.name in ("conv1d", "conv2d", "conv3d"):
            return True
    return False


def _other_queries(trace: Trace, op: Op, length: int) -> int:
    """The most queries another attention of the run weighs all ``length`` keys for, when it has fewer queries
    than tokens (Longformer's global tokens: their rows computed apart, over every key); 0 when there is none."""
    most = 0
    for other in trace.ops:
        if other is op or not other.outputs:
            continue
        if other.name == "scaled_dot_product_attention" and len(other.inputs) > 1:
            rows, keys = other.inputs[0].shape[-2], other.inputs[1].shape[-2]
        elif other.name in SOFTMAX and other.outputs[0].dim() >= 2:
            rows, keys = other.outputs[0].shape[-2], other.outputs[0].shape[-1]
        else:
            continue
        if keys == length and 0 < rows < length:
            most = max(most, rows)
    return most


def _future_seen(hidden: Tensor, length: int) -> str | None:
    """Which future keys the scores of a causal module leave visible (or that they hide every query's own key), read
    from the scores alone ((..., L, L) bool, True where masked); None when they hide the future and no more."""
    if hidden.dim() < 2 or tuple(hidden.shape[-2:]) != (length, length):
        return None
    future = torch.ones(length, length, dtype=torch.bool, device=hidden.device).triu(1)
    flat = hidden.reshape(-1, length, length)
    seen = (future & ~flat).any(0)
    if bool(seen.any()):
        return (f"the scores leave future keys visible ((query, key) pairs {seen.nonzero().tolist()[:10]}), read "
                "from the scores before the softmax, whatever the merge after it does")
    if length > 2 and bool(flat.diagonal(dim1=-2, dim2=-1)[:, 1:].all()):  # every query hides its own key
        return ("the scores hide each query's own key (the causal mask one token too wide: triu(0) for triu(1)), "
                "read from the scores before the softmax, whatever the merge after it does")
    return None


def _mask_verdict(hidden: Tensor, keep: Tensor | None, evidence: dict, apart: int = 0) -> Verdict | None:
    """Do the scores hide exactly the keys the mask the run sent (with the module's own structure) hides?

    hidden: (..., L, L) bool, True where the module's scores are masked; keep: (B, 1, L, L), True = may attend.
    apart: how many query rows another attention of the module computes over every key (:func:`_other_queries`):
    up to that many rows may hide more here, since the module's output takes them from there."""
    if keep is None:
        return None
    want = ~keep
    b = keep.shape[0]
    lead = list(hidden.shape[:-2])
    if len(lead) >= 2 and lead[0] != b and lead.count(b) == 1:  # heads first ("hnij", fair-esm's row attention)
        hidden = hidden.movedim(lead.index(b), 0)
    folded = hidden
    try:
        hidden = hidden.reshape(b, -1, *hidden.shape[-2:])
    except RuntimeError:
        return None
    if hidden.shape[-2:] != want.shape[-2:]:
        return None
    # a key no query may see is padding: its own query's row is not an output anyone reads (packed documents give
    # the padding a document of its own), so it is not compared
    # nor is the row of a query that may see no key (a row the model pads, or one that depends on no token)
    padded_rows = want.all(-2, keepdim=True).transpose(-1, -2) | want.all(-1, keepdim=True)  # (B, 1, L, 1)
    if torch.equal(torch.where(padded_rows, want, hidden), want.expand_as(hidden)):
        return None
    if len(lead) == 1 and lead[0] > b and b > 1:
        # heads folded into the batch heads first (torch.cat(x.split(d, -1), 0), Set Transformer's MAB) with the mask
        # repeated to match (mask.repeat(H, 1)): row h * B + b is item b's. Which fold the scores have is not read
        # here; a mask given to the wrong items changes their outputs, which the padding probe sees
        head_first = folded.reshape(-1, b, *folded.shape[-2:]).transpose(0, 1)
        if torch.equal(torch.where(padded_rows, want, head_first), want.expand_as(head_first)):
            return None
    if want.any() and torch.equal(hidden, keep.expand_as(hidden)):
        return Verdict(MASK_INVERTED, {"matches": "the scores hide the keys the mask keeps", **evidence})
    if want.any() and not hidden.any():
        return Verdict(MASK_IGNORED, {"matches": "no score is masked although the mask hides keys", **evidence})
    extra, missed = (hidden & ~want).sum().item(), (~hidden & want).sum().item()
    if not missed and apart:  # rows whose keys this attention hides beyond the pattern, few enough to be the rows
        rows = (hidden & ~want).reshape(-1, *hidden.shape[-2:]).any(-1).any(0)  # another attention computes
        if int(rows.sum()) <= apart:
            evidence["rows computed apart"] = (f"{int(rows.sum())} query row(s) hide more keys here than the module "
                                               "shows them: another attention of the module computes them over "
                                               "every key (global tokens)")
            return None
    own_key = torch.eye(hidden.shape[-1], dtype=torch.bool, device=hidden.device)
    if not missed and hidden.shape[1] > 1 and torch.equal(hidden.all(1, keepdim=True), want.expand(b, 1, -1, -1)) \
            and not torch.equal(hidden.any(1), hidden.all(1)) and not bool((hidden & own_key & ~want).any()):
        # (each head sees its own token wherever the run lets it: a head that hides it has a broken mask)
        # heads that each see part of what the run leaves visible, and together all of it (Longformer's dilation per
        # head, local heads beside global ones): each head's pattern is its design
        evidence["heads' patterns"] = ("the heads hide different keys (a pattern per head: a dilation or window of "
                                       "their own); together they see every key the run leaves visible")
        return None
    if not missed:  # more hidden than the mask hides: each row's k highest scores kept (sparse top-k attention)?
        seen, allowed = (~hidden).sum(-1), (~want).expand_as(hidden).sum(-1)
        k = int(seen.max())
        if 0 < k < int(allowed.max()) and torch.equal(seen, allowed.clamp(max=k)):
            evidence["top-k"] = f"each query keeps its {k} highest scores among the keys the mask leaves (sparse " \
                                "top-k attention)"
            return None
    matches = (f"the scores hide other keys than the mask: {missed} hidden (query, key) pairs left visible, {extra} "
               "visible ones hidden")
    if not missed:
        # keys hidden beyond the mask: the same ones in every item are the module's own structure (a causal mask that
        # hides the diagonal); ones that change with the item's padding are the mask read for other keys than it marks
        # (a (B, L) mask transposed or reshaped across the batch)
        surplus = hidden & ~want
        if b > 1 and not torch.equal(surplus, surplus.any(0, keepdim=True) & ~want):
            return Verdict(MASK_IGNORED, {"matches": matches + " (which keys are hidden changes with the item: the "
                                                               "mask is read for other keys than it marks)",
                                          **evidence})
    if missed and not extra:
        length = hidden.shape[-1]
        left = torch.where(padded_rows, False, ~hidden & want)
        # the causal part of what was sent: later keys hidden from real queries, among keys some query may see
        later = want & torch.ones(length, length, dtype=torch.bool, device=want.device).triu(1) & \
            ~want.all(-2, keepdim=True) & ~padded_rows
        if bool(later.any()) and torch.equal(left, later.expand_as(left)):
            # the pairs left visible are exactly the causal pattern's: the mask's keys are hidden, the causal pattern
            # is not (dropped whenever a mask is given: is_causal=mask is None around SDPA)
            return Verdict(CAUSAL_LEAK, {"matches": matches + " (exactly the later keys: the causal pattern is "
                                                              "dropped when a mask is given)", **evidence})
    return Verdict(MASK_IGNORED if missed else CAUSAL_LEAK, {"matches": matches, **evidence})


class _ScoresRead(Exception):  # not an error: how the read of a partner run hands back its scores
    """The scores s and the product r of a core as :func:`_softmax_core` reads them before fitting s = c r + t."""

    def __init__(self, s: Tensor, r: Tensor) -> None:
        super().__init__()
        self.s, self.r = s, r


def _floor_of(op: Op) -> int | None:
    """For an operation that only lifts scores below a very negative floor to it (``torch.max(s,
    torch.tensor(finfo.min))``, ``s.clamp(min=finfo.min)``, as older transformers models and Baichuan write it), the
    key of the scores it takes; else None."""
    if op.name in ("max", "maximum") and len(op.in_ids) == 2 and len(op.inputs) == 2:
        small = [i for i, t in enumerate(op.inputs) if t.numel() == 1]
        if len(small) == 1 and float(op.inputs[small[0]]) <= _MASKED:
            return op.in_ids[1 - small[0]]
        return None
    if op.name in ("clamp", "clamp_", "clamp_min", "clamp_min_") and op.in_ids:
        low = op.kwargs.get("min", op.args[1] if len(op.args) > 1 else None)
        high = op.kwargs.get("max", op.args[2] if len(op.args) > 2 and op.name.startswith("clamp") else None)
        if "min" in op.name and low is None:
            low = op.args[1] if len(op.args) > 1 else None
        if isinstance(low, Tensor) and low.numel() == 1:
            low = float(low)
        if isinstance(low, (int, float)) and low <= _MASKED and high is None:
            return op.in_ids[0]
    return None


def _scaled_per_row(w: Tensor, p: Tensor) -> bool:
    """Are the weights ``w`` the softmax's ``p`` times one positive number per row (not the same for all rows)?"""
    if w.shape != p.shape or p.dim() < 2:
        return False
    p64, w64 = p.detach().double(), w.detach().double()
    seen = p64.abs() > 1e-9
    ratio = torch.where(seen, w64 / torch.where(seen, p64, 1.0), torch.nan)
    low = torch.where(seen, ratio, torch.inf).amin(-1)
    high = torch.where(seen, ratio, -torch.inf).amax(-1)
    rows = seen.any(-1)
    if not bool(rows.any()) or bool((low[rows] <= 0).any()):
        return False
    constant = bool(((high - low)[rows] <= 1e-6 * high[rows].abs()).all())
    return constant and float(high[rows].max() - low[rows].min()) > 1e-6 * float(high[rows].max())


def _mask_added(w: Tensor, p: Tensor) -> bool:
    """Are the weights ``w`` the softmax's ``p`` plus a mask: a difference of 0 in most entries and one large
    negative number (an additive mask's fill) in the others?"""
    if w.shape != p.shape or not w.is_floating_point():
        return False
    diff = (w.detach().double() - p.detach().double())
    if not bool(torch.isfinite(diff).all()):
        return False
    off = diff.abs() > 1e-6
    if not bool(off.any()) or int(off.sum()) * 2 > off.numel():
        return False
    fills = diff[off]
    return bool((fills < -1.0).all()) and float(fills.max() - fills.min()) <= 1e-6 * float(fills.abs().max())


def _rescaled_densely(w: Tensor, p: Tensor) -> bool:
    """Are the weights ``w`` the softmax's ``p`` times a tensor of many values within a row (x-transformers' weights
    scaled by a mix of the heads' scores), not of 0 and one number per row (a mask applied after the softmax, with
    a gate per head or not)?"""
    if w.shape != p.shape or p.dim() < 1:
        return False
    p64, w64 = p.detach().double(), w.detach().double()
    seen = p64.abs() > 1e-9
    ratio = (w64 / torch.where(seen, p64, 1.0)).abs()
    kept = seen & (ratio > 1e-6)  # entries a mask did not zero
    if not bool(kept.any()):
        return False
    low = torch.where(kept, ratio, torch.inf).amin(-1)
    high = torch.where(kept, ratio, -torch.inf).amax(-1)
    rows = kept.any(-1)
    return bool(((high - low)[rows] > 1e-3 * high[rows]).any())


def _learned_gain(trace: Trace, tid: int) -> bool:
    """Was the score operand ``tid`` multiplied by a learned number on its way from its last computation (through
    layouts, numbers and rotary positions: a QK-norm's scalar gain, ``rms(q) * self.q_gain``)? Such a gain is a
    temperature on the scores, learned as one on the scores is."""
    for _ in range(4):
        for _ in range(200):
            found = trace.maker(tid)
            if found is None:
                return False
            op = found[0]
            if op.number() is not None and trace.learned_number(op):
                return True
            if op.number() is None and op.name not in LAYOUT:
                break
            src = op.main_input()
            if src is None:
                return False
            tid = src
        rotated = rotated_from(trace, tid)
        if rotated is None:
            return False
        tid = rotated[0]
    return False


def _past_the_norm(origin: Origin, d: int) -> float:
    """The factor an operand got after its origin, less the sqrt(d) of an RMS norm written as a unit norm times
    sqrt(d) (x-transformers' ``F.normalize(k, dim=-1) * dim_head ** 0.5``): that factor is the norm's own, and the
    operand's entries are of size 1 after it, as a plain projection's are."""
    if origin.op is not None and origin.op.name in ("normalize", "l2norm") and \
            abs(origin.factor / math.sqrt(d) - 1) < 1e-3:
        return origin.factor / math.sqrt(d)
    return origin.factor


def _partner_scores(partner: Callable[[], Trace | None] | None, trace: Trace, sm: Op, final: Tensor, width: int,
                    length: int, expected: Callable[[int], float | None], batch: int,
                    local: bool) -> tuple[Tensor, Tensor] | None:
    """The scores and product of the same core in a run of the module on other tokens (the same call otherwise),
    read as this run's are; None when there is no such run or it cannot be read alike."""
    other = None if partner is None else partner()
    at = next((i for i, op in enumerate(trace.ops) if op is sm), None)
    if other is None or at is None or len(other.ops) != len(trace.ops) or other.ops[at].name != sm.name:
        return None
    try:
        _softmax_core(other, other.ops[at], final, width, length, expected, None, batch, frozenset(), local,
                      scores_only=True)
    except _ScoresRead as read:
        return read.s, read.r
    except (Unrecognised, RuntimeError):
        return None
    return None


def _fit_on_two_runs(s: Tensor, r: Tensor, s2: Tensor, r2: Tensor, batch: int) -> tuple[float, Tensor, Tensor] | None:
    """Fit s = c * r + t with a term t the two runs share (it does not come from the tokens: a bias the call passes,
    per item or for an item alone): c from the runs' differences, (c, t, the entries seen); None when no term is
    shared."""
    if s.shape != s2.shape or r.shape != r2.shape:
        return None
    apart = torch.where(_visible(s) & _visible(s2), s.double() - s2.double(), -math.inf)  # a key masked in a run
    c, _, seen = _fit(apart, r - r2, batch, False)  # is no entry of the difference (two fills would leave it 0)
    _, t, seen2 = _fit(s, r, batch, False, c)
    _, t2, _ = _fit(s2, r2, batch, False, c)
    size = 1 + float(s.double().reshape(t.shape)[seen2].abs().max())
    if float((t - t2).abs().masked_fill(~seen2, 0).max()) > 1e-6 * size:
        return None
    return c, t, seen & seen2


def _own_key_sunk(t: Tensor, seen: Tensor) -> float:
    """How far, at most, a term on square (..., N, N) scores lifts some key of a row above that row's own key (the
    diagonal): a mask hides other keys, never a query's own, so a gap of e^50 is a mask added with the wrong sign
    (Reformer's self mask, which hides the own key on purpose, is told apart before)."""
    if t.dim() < 2 or t.shape[-1] != t.shape[-2] or t.shape[-1] < 2 or seen.shape != t.shape:
        return 0.0
    own = t.diagonal(dim1=-2, dim2=-1)
    seen_own = seen.diagonal(dim1=-2, dim2=-1)
    top = t.masked_fill(~seen, float("-inf")).amax(-1)
    gap = (top - own).masked_fill(~seen_own | ~torch.isfinite(top), 0)
    return float(gap.max()) if gap.numel() else 0.0


def _efficient(trace: Trace, length: int) -> bool:
    """Does the record normalise q or k split into heads over their own features (a softmax over the last axis of a
    (B, H, L, D) projection, D not the tokens): efficient attention (Shen et al.), whose softmaxes are of the
    projections themselves, not over (query, key) scores? (A softmax of a scoring projection, one number per head
    and token (Fastformer's pooling), is attention over the tokens, read as such.)"""
    return any(op.name in SOFTMAX and op.inputs and op.inputs[0].dim() >= 4 and _dim(op) % op.inputs[0].dim() ==
               op.inputs[0].dim() - 1 and op.inputs[0].shape[-1] != length and op.inputs[0].shape[-2] == length and
               _of_a_projection(trace, op.in_ids[0]) for op in trace.ops)


def _of_a_projection(trace: Trace, tid: int, reach: int = 12) -> bool:
    """Is ``tid`` a learned projection's output, up to layout operations and numbers (q or k split into heads,
    perhaps scaled): what a softmax over the features of q or over the tokens of k takes in efficient (linear)
    attention, rather than scores?"""
    for _ in range(reach):
        found = trace.maker(tid)
        if found is None:
            return False
        op = found[0]
        if op.name in ("linear", "addmm", "module"):
            weights = op.in_ids[1:2] if op.name == "linear" else op.in_ids[2:3] if op.name == "addmm" else []
            return op.name == "module" or any(trace.identity(w) in trace.parameters for w in weights)
        if not op.in_ids or not (op.name in LAYOUT or op.number() is not None or op.name in _FILLS):
            return False
        tid = op.in_ids[0]  # through a layout, a number, or a padding mask filled in (keys of padded tokens)
    return False


_FILLS = frozenset({"masked_fill", "masked_fill_"})


def _softmax_core(trace: Trace, sm: Op, final: Tensor, width: int, length: int,
                  expected: Callable[[int], float | None], keep: Tensor | None = None,
                  batch: int = 1, inputs: frozenset[int] = frozenset(), local: bool = False,
                  scores_only: bool = False, partner: Callable[[], Trace | None] | None = None,
                  apart: bool = False, masked_after: bool = False, causal: bool = False) -> Verdict | None:
    """The verdict of one softmax and the products around it. ``apart``: the softmax's axis and the values product's
    order are taken as right, so that the rest (the scale, the operands' roles, the merge, the rotation) is read
    beside a bug in them (:func:`_read_apart`); ``masked_after``: so are weights masked after the softmax.
    ``causal``: the user said the module is causal and the run sent no mask, so its scores must hide the future."""
    p = sm.outputs[0]
    after = _product_after(trace, sm.out_ids[0])
    if after is None:
        return None  # a softmax that feeds no product is not an attention's
    if _efficient(trace, length) and not (p.dim() >= 2 and p.shape[-1] == p.shape[-2] == length) and \
            _of_a_projection(trace, sm.in_ids[0]):
        return None  # a softmax of q or k themselves (efficient attention's): no weights over the tokens
    pv, read, passed = after
    operands = _operands(pv)
    position = next((i for i, (tid, _) in enumerate(operands) if tid == read), 0)
    w = operands[position][1]
    vid = operands[1 - position][0] if len(operands) > 1 else operands[0][0]
    dim = _dim(sm)
    evidence: dict = {"operations": f"{len(trace.ops)} recorded"}
    facts: dict = {}
    talking = _after_head_mix(trace, sm)
    if talking is not None:  # the weights mixed across heads by a learned matrix: read them as mixed
        pv, read, passed, mixes = talking
        operands = _operands(pv)
        position = next((i for i, (tid, _) in enumerate(operands) if tid == read), 0)
        w = operands[position][1]
        vid = operands[1 - position][0] if len(operands) > 1 else operands[0][0]
        mixed_p = _mixed_as(w, p)
        if mixed_p is None and _normed_over_heads(trace, p) and w.shape == p.shape:
            # re-attention (DeepViT): the mixture then a LayerNorm over the heads; the weights are what it made
            mixed_p, passed = w, [n for n in passed if n in _ZEROING]
            facts["re-attention"] = (f"the weights are mixed across heads after the softmax ({', '.join(mixes)}) "
                                     "and normalised over the heads by a LayerNorm (re-attention, DeepViT)")
        if mixed_p is None:
            return Verdict(DEFINITION_MISMATCH, {"matches": "the weights are mixed across heads after the softmax "
                                                   f"({', '.join(mixes)}) by no affine map of the heads", **evidence})
        p = mixed_p
        if "re-attention" not in facts:
            facts["talking heads"] = f"the weights are mixed across heads after the softmax ({', '.join(mixes)}; " \
                                     "talking heads)"
    if {"pad", "as_strided", "roll"} & set(passed):  # the weights re-laid out (Longformer's band of diagonals
        raise Unseen(f"the weights are re-laid out between the softmax and the product ({', '.join(passed)}: a "
                     "band of diagonals turned into chunks, as sliding-window attention computes it): their formula "
                     "is not read")
    if passed and set(passed) <= _ADDS and _mask_added(w, p):  # an additive mask (0 / -100) added to the weights
        return Verdict(MASK_AFTER_SOFTMAX, {"matches": f"a mask is added to the weights after the softmax "
                                                      f"({', '.join(passed)}): hidden keys get large negative weights "
                                                      "instead of none", **evidence})
    if passed and not set(passed) <= _ZEROING:
        return Verdict(DEFINITION_MISMATCH, {"matches": f"the weights pass through {', '.join(passed)} between "
                                               "the softmax and the product with the values", **evidence})
    other = operands[1 - position][1] if len(operands) > 1 else None
    made = pv.outputs[0] if pv.outputs else None
    if other is not None and made is not None and made.dim() >= 2 and tuple(made.shape[-2:]) == (length, length) \
            and length not in tuple(other.shape):
        # weights times a matrix with no token axis, still (L, L): the heads are mixed (talking heads, re-attention)
        return Verdict(DEFINITION_MISMATCH, {"matches": "the weights are mixed across heads between the softmax "
                                               "and the product with the values (talking heads)", **evidence})
    s = sm.args[0]
    if p.dim() < w.dim() and p.numel() == w.numel() and p.shape[-1] == w.shape[-1] == length and \
            tuple(w.shape[-2:]) == (length, length) and p.shape[-2] != length:
        # the softmax ran on a view that flattens the leading axes, (B * Lq, Lk) (PyTorch-NLP's Luong attention):
        # read on the weights' own axes; over a flattened axis, it normalises queries and batch items together
        if dim != p.dim() - 1:
            return Verdict(SOFTMAX_DIM, {"matches": f"softmax over dim {dim} of the scores viewed as "
                                           f"{tuple(p.shape)}: over queries (and batch items or heads) flattened "
                                           "together, not over the keys", **evidence})
        p, s, dim = p.reshape(w.shape), s.reshape(w.shape), w.dim() - 1
    axes = _einsum_token_axes(pv, position, w, p, length)
    if axes is not None and apart and dim == axes[0] and _softmax_over_keys(trace, sm, dim):
        axes = None  # the weights read as the softmax made them, the order taken as right
    elif axes is not None and apart:
        dim = axes[1]  # the softmax taken as over the keys
    if axes is not None:  # an einsum layout with the tokens elsewhere ("ijbh": sequence first): move them last
        if dim == axes[0] and _softmax_over_keys(trace, sm, dim):  # the product contracts the queries instead
            transposed = Verdict(MATMUL_ORDER, {"matches": f"the product with the values contracts the queries (dim "
                                                f"{axes[1]} of the weights) while the softmax runs over the keys "
                                                f"(dim {dim}, from the key operand of the scores): weights "
                                                "transposed before V", **evidence})
            return _joined([transposed, _read_apart(trace, sm, final, width, length, expected, batch, inputs,
                                                    local)])
        if dim != axes[1]:
            wrong_dim = Verdict(SOFTMAX_DIM, {"matches": f"softmax over dim {dim} of the {p.dim()}-d weights, not "
                                                f"over the keys (dim {axes[1]}, the axis the product with the "
                                                "values contracts)", **evidence})
            return _joined([wrong_dim, _read_apart(trace, sm, final, width, length, expected, batch, inputs, local,
                                                    _BESIDE_SOFTMAX_DIM)])
        facts["layout"] = f"einsum {pv.args[0]!r}: the weights' query and key axes are dims {axes[0]} and {axes[1]}"
        p, s, w, dim = (p.movedim(axes, (-2, -1)), s.movedim(axes, (-2, -1)), p.movedim(axes, (-2, -1)),
                        p.dim() - 1)
    sinks = p.shape[-1] - length if p.dim() >= 2 and p.shape[-2] == length and p.shape[-1] > length == w.shape[-1] \
        else 0
    if sinks and dim == p.dim() - 1:  # attention sinks: logits in the softmax with no value (gpt-oss)
        first = _orientation(w, p[..., :length]) is None and _orientation(w, p[..., sinks:]) is not None
        cut = slice(sinks, None) if first else slice(None, length)
        p, s = p[..., cut], s[..., cut]
        facts["sinks"] = f"{sinks} sink logit(s) per row in the softmax, with no value (attention sinks)"
    if sm.kwargs.get("sink"):  # written out: exp(s) / (1 + sum exp(s)), shifted by the row's max
        facts["sinks"] = ("one more term per row in the softmax's sum, with no value (softmax_1, exp(s) / (1 + sum "
                          "exp(s)): a sink logit)")
    memory: slice | None = None
    keys_joined = p.shape[-1] if p.dim() >= 2 else 0  # the keys, memory included
    extra = p.shape[-1] - length if p.dim() >= 2 and p.shape[-2] == length and w.shape[-1] == p.shape[-1] else 0
    if extra > 0 and dim == p.dim() - 1:  # keys and values that are no token's: learned memory, a null key
        side = _memory_side(trace, vid, extra, inputs)
        if side is not None:
            memory = slice(extra, None) if side == "first" else slice(None, length)
            p, s, w = p[..., memory], s[..., memory], w[..., memory]
            facts["memory"] = f"{extra} key/value pair(s) that depend on no token, put {side} beside the tokens' " \
                              "(learned memory key/values, a null or zero key/value)"
    # a convolution before the attention (MobileViT's 3 x 3 conv around its patch attention) makes every output
    # depend on its neighbours: the run's pattern cannot show windows, the weights' shape does
    local = local or _convolved_before(trace, sm)
    if memory is None and local and dim == p.dim() - 1 and p.dim() >= 3 and 1 < p.shape[-2] < length and \
            p.shape[-1] > p.shape[-2] and w.shape[-1] == p.shape[-1]:
        # learned memory keys joined to each window's or segment's own (titans' persistent memory beside its
        # segments): the keys past the memory are the window's
        for extra in range(1, p.shape[-1] - p.shape[-2] + 1):
            side = _memory_side(trace, vid, extra, inputs)
            if side is not None:
                memory = slice(extra, None) if side == "first" else slice(None, p.shape[-1] - extra)
                p, s, w = p[..., memory], s[..., memory], w[..., memory]
                facts["memory"] = f"{extra} key/value pair(s) that depend on no token, put {side} beside each " \
                                  "window's keys (learned memory key/values)"
                break
    window = local and p.dim() >= 2 and p.shape[-1] == p.shape[-2] and 1 < p.shape[-1] < length and \
        _tiles(length, p.shape[-1], tuple(p.shape[:-2]), batch) and \
        p.numel() // p.shape[-1] >= batch * length
    blocks = local and not window and p.dim() >= 3 and 1 < p.shape[-2] < length < p.shape[-3] * p.shape[-2] + \
        p.shape[-2] and p.shape[-1] > p.shape[-2] and p.shape[-1] % p.shape[-2] == 0
    if window:  # attention within windows (Swin's on an image): the weights' axes are a window's tokens
        facts["windows"] = f"attention within windows of {p.shape[-1]} tokens (the module sees a local pattern)"
        keep = None  # the run's (L, L) pattern is the windows'; each window's scores are read on their own
    elif blocks:  # blocks of queries, each over its block and its neighbours' keys (local attention, look-around)
        facts["windows"] = (f"attention in {p.shape[-3]} blocks of {p.shape[-2]} queries, each over {p.shape[-1]} "
                            "keys (its block and its neighbours': local attention with look-around)")
        keep = None
    elif p.dim() >= 2 and p.shape[-2] == length and 1 <= p.shape[-1] < length and w.shape[-1] == p.shape[-1]:
        pooled = _contracted_axis(pv, position, w) == -2
        if pooled and dim == p.dim() - 2:
            # a softmax over the tokens whose product sums over them: the tokens pooled into a few slots (learned
            # queries, as LightSANs' item-to-interest aggregation, or Fastformer's global query), which the attention
            # takes as its keys; the attention is the core that reads them
            return None
        if pooled:  # the product sums the weights over the tokens, the softmax runs over the slots
            return Verdict(SOFTMAX_DIM, {"matches": f"the tokens are pooled into {p.shape[-1]} slot(s) by weights "
                                                    f"the product sums over the tokens (dim {p.dim() - 2}), but the "
                                                    f"softmax runs over the slots (dim {dim})", **evidence})
        # keys and values from fewer positions than the queries
        facts["reduced keys"] = _reduced(p.shape[-1], length)
        keep = None  # the run's (L, L) pattern does not apply to them
    elif p.dim() >= 2 and p.shape[-2] == length and p.shape[-1] > length and w.shape[-1] == p.shape[-1]:
        # keys and values from more positions than the tokens: learned memory or latents (Perceiver, num_mem_kv,
        # Memorizing Transformers), or a cache of earlier tokens
        facts["extra keys"] = (f"{p.shape[-1]} keys for {length} tokens: {p.shape[-1] - length} more (learned memory "
                               "or latent tokens, or a cache)")
        keep = None  # the run's (L, L) pattern does not apply to them
    elif local and p.dim() >= 2 and 2 < p.shape[-1] == p.shape[-2] < length and w.shape[-1] == p.shape[-1] and \
            p.shape[-1] + _other_queries(trace, sm, length) == length:
        # the tokens but a few read-out ones, among themselves; those in an attention of their own (CaiT's class
        # attention written apart)
        facts["queries apart"] = (f"{p.shape[-1]} of the {length} tokens attend among themselves; the other "
                                  f"{length - p.shape[-1]} in an attention of their own over every token")
        length, keep = p.shape[-1], None
    elif local and p.dim() >= 2 and p.shape[-1] == length and 1 <= p.shape[-2] < length and \
            w.shape[-1] == length and p.shape[-2] * 2 <= length:
        # a few queries over every key, beside another attention for the rest (Longformer's global tokens)
        facts["queries apart"] = (f"{p.shape[-2]} query row(s) attend over all {length} tokens in an attention of "
                                  "their own (global tokens)")
        keep = None  # the run's (L, L) pattern is the other attention's
    elif p.dim() < 2 or p.shape[-1] != length or p.shape[-2] != length:
        return Verdict(DEFINITION_MISMATCH, {"matches": f"the weights are {tuple(p.shape[-2:])} over axes that are "
                                               f"not the {length} tokens ({_other_axes(p, length)})", **evidence})
    if dim != p.dim() - 1 and apart:
        dim = p.dim() - 1
    elif dim != p.dim() - 1 and p.shape[dim] != length and w.shape == p.shape and \
            _contracted_axis(pv, position, w) == dim - p.dim():
        # the softmax over the axis the product sums, of other than the tokens (Point Transformer's vector attention:
        # a softmax per feature over each point's k neighbours): weights of another design, not a wrong axis
        return Verdict(DEFINITION_MISMATCH, {"matches": f"the weights are a softmax over dim {dim} of {p.shape[dim]} "
                                                        "entries, which the product with the values sums: no (query, "
                                                        "key) weights over the tokens (a softmax per feature over "
                                                        "neighbours, as vector attention's)", **evidence})
    elif dim != p.dim() - 1:
        wrong_dim = Verdict(SOFTMAX_DIM, {"matches": f"softmax over dim {dim} of the {p.dim()}-d scores, not over "
                                            "the keys (the last dim)", **evidence})
        return _joined([wrong_dim, _read_apart(trace, sm, final, width, length, expected, batch, inputs, local,
                                                    _BESIDE_SOFTMAX_DIM)])
    if passed:  # weights zeroed where the mask hides (ESPnet's softmax(...).masked_fill(hidden, 0)): rows with no
        p = _zeroed_as(w, p)  # visible key become 0; elsewhere a no-op when the scores were masked before the softmax
        factor = _one_factor(w, p)
        if factor is not None:  # softmax(QK^T) * c: the scale on the weights (rows sum to c), none on the scores
            return Verdict(MISSING_SCALE, {"matches": f"the weights are multiplied by {factor:.6g} after the softmax "
                                                      f"({', '.join(passed)}), so that each row sums to {factor:.3g}: "
                                                      "a scale belongs on the scores, before the softmax",
                                           **evidence})
        if _orientation(w, p) is None and _scaled_per_row(w, p):  # a gate per head (or per query): the same as
            facts["gated weights"] = (f"each row of weights is multiplied after the softmax by a number of its own "
                                      f"({', '.join(passed)}: a gate per head, the same as scaling each head's "
                                      "output)")
            p = w  # scaling that head's output instead
        if _orientation(w, p) is None and _rescaled_densely(w, p):
            return Verdict(DEFINITION_MISMATCH, {"matches": f"the weights are multiplied after the softmax by a "
                                                   f"tensor that varies entry by entry ({', '.join(passed)}; not a "
                                                   "mask, which multiplies by 0 or 1): the visible keys' weights no "
                                                   "longer sum to 1", **evidence})
        if _orientation(w, p) is None and masked_after:
            p = w  # read on past the mask, as the weights the product takes
        elif _orientation(w, p) is None:
            after_softmax = Verdict(MASK_AFTER_SOFTMAX, {"matches": f"the weights are masked after the softmax "
                                                                    f"({', '.join(passed)}): the visible keys' weights "
                                                                    "no longer sum to 1", **evidence})
            if apart:
                return after_softmax
            return _joined([after_softmax, _read_apart(trace, sm, final, width, length, expected, batch, inputs, local,
                                                       masked_after=True)])
        facts["masked weights"] = f"the weights of hidden keys are zeroed after the softmax ({', '.join(passed)})"
    if axes is None and w.numel() < p.numel() and _orientation(w, p) is None:
        # the values multiplied by a part of the softmax's output (CCNet's criss-cross attention: one softmax over a
        # pixel's column and row keys, then each part with its own values): no product of the whole to orient
        raise Unrecognised(f"the values are multiplied by {tuple(w.shape)} weights, a part of the softmax's "
                           f"{tuple(p.shape)} output (one softmax shared by several products)")
    orientation = _orientation(w, p)
    # V^T @ W^T (channels first, as convolutional blocks compute it) contracts the keys too: the output is the
    # transpose of W @ V, (..., D, L)
    channels_first = axes is None and orientation == "transposed" and _transposed_keys_contracted(pv, position)
    order = None  # the weights' product with the values; which keys the scores hide is read apart from it
    if axes is None and not channels_first and (orientation is None or not _weights_contracted_last(pv, position, w)):
        how = "V @ weights instead of weights @ V" if position == 1 and pv.name != "einsum" else \
            "weights transposed before V" if orientation == "transposed" else \
            "the product with the values does not contract the key axis"
        order = Verdict(MATMUL_ORDER, {"matches": how, **evidence})
    elif orientation == "transposed" and not channels_first:
        order = Verdict(MATMUL_ORDER, {"matches": "weights transposed before V", **evidence})
    if order is not None and apart:
        order = None
    elif order is not None and keep is None:
        return _joined([order, _read_apart(trace, sm, final, width, length, expected, batch, inputs, local)])
    if channels_first:
        facts["layout"] = "the values product is V^T W^T (channels first): the transpose of W V"
    try:
        product, chain = _score_chain(trace, sm.in_ids[0])
    except Unrecognised:
        if order is not None:
            return order
        raise
    steps, temperatures = chain.steps, chain.temperatures
    pairs = _operands(product)
    if len(pairs) < 2:
        if order is not None:
            return order
        raise Unrecognised("the score product has one operand")
    (aid, a), (bid, b) = pairs[0], pairs[1]
    r = _contract(product, a, b)
    if axes is not None and r.dim() == p.dim():
        r = r.movedim(axes, (-2, -1))
    d = _contracted_size(product, a, b)
    if memory is not None and r.dim() >= 2 and r.shape[-1] == keys_joined:  # the keys' product has them too
        r = r[..., memory]
    if s.numel() != r.numel():
        if order is not None:
            return order
        raise Unrecognised("the softmax input does not have the score product's size")
    names = [n for n, _ in steps]
    if "tanh" in names:
        tanh_at = names.index("tanh")
        cap = math.prod(x for _, x in steps[:tanh_at] if x is not None)
        raw = s.double()
        s = torch.where(raw > _MASKED, cap * torch.atanh((raw / cap).clamp(-1 + 1e-12, 1 - 1e-12)), raw)
        facts["soft-capping"] = f"scores capped at {cap:.6g} by cap * tanh(scores / cap)"
        evidence["_softcap"] = cap  # compared with the cap the module states (read by the probe, not reported)
    if temperatures and "tanh" not in names:  # a learned temperature per head: the scale is learned
        temperature = math.prod(temperatures[1:], start=temperatures[0])
        raw = s.double()
        s = torch.where(raw > _MASKED, raw / temperature.to(raw.device), raw)
        facts["temperature"] = (f"the scores are multiplied by a learned temperature (values "
                                f"{float(temperature.min()):.4g} to {float(temperature.max()):.4g})")
    with_terms = any(n in _TERMS for n in names) or product.name == "baddbmm"
    s = _negligible_fills(s, chain)
    hidden = ~(torch.isfinite(s) & (s > _MASKED))
    if not scores_only and s.numel() and bool(hidden.all()):  # no mask the doctor sends hides every key
        inverted = Verdict(MASK_INVERTED, {"matches": "the module masks every score of every query: a mask it builds "
                                                      "for itself (every token visible when it is given none) is read "
                                                      "the other way round, so each query weighs every key alike (or "
                                                      "none, with -inf)", **evidence})
        return _joined([inverted, order]) or inverted
    own = _self_mask(s, hidden)
    if own is not None:
        facts["self mask"] = own
        eye = torch.eye(length, dtype=torch.bool, device=hidden.device)
        hidden = hidden & ~eye
        if keep is not None and keep.shape[-2:] == eye.shape:  # a query's own key counts as visible: the black box
            keep = keep | (eye & keep.any(-2, keepdim=True))  # saw a query with one other key not depend on its
            # own (the weight 1 on that key); a padded key, which no query sees, stays hidden from its own query
    elif keep is not None and _own_key_hidden(hidden, keep):
        facts["self mask"] = ("each token's own key is hidden, beside the mask (locality self-attention, LSA: a "
                              "token attends to the others only)")
        eye = torch.eye(length, dtype=torch.bool, device=hidden.device)
        hidden, keep = hidden & ~eye, keep | eye  # the diagonal is the design's: not compared with the mask
    masked = _mask_verdict(hidden, keep, evidence, _other_queries(trace, sm, length))
    for fact in ("top-k", "heads' patterns"):
        if fact in evidence:
            facts[fact] = evidence.pop(fact)
    if "rows computed apart" in evidence:
        facts["rows computed apart"] = evidence.pop("rows computed apart")
    if masked is not None:
        if not window:  # heads merged wrongly make rows depend on other tokens: the pattern the mask is read
            canon = _canonical_output(pv, position, axes[0] if axes is not None else w.dim() - 2, batch)  # against
            merge_fid, merged = _merge(trace, pv, pv.outputs[0], final, canon)
            if merge_fid is not None:
                masked = Verdict(merge_fid, {"matches": merged, **evidence}, facts)
                leak = _future_seen(hidden, length) if causal else None
                if leak is not None:  # the scores themselves see the future: a leak of its own, beside the merge's
                    masked.also.append(Verdict(CAUSAL_LEAK, {"matches": leak, "_direct": True, **evidence}))
        return _joined([masked, order])
    if order is not None:
        return order
    relative = _relative_terms(trace, chain, inputs, r.shape, axes)
    if relative:  # content and position products (Transformer-XL, Shaw): one scale for both
        facts["positions"] = "relative positions: " + "; ".join(name for name, _, _ in relative)
        total = math.prod(x for _, x in steps if x is not None)
        for _, term, later in relative:  # a term added after a factor the content branch has below the sum
            r = r + term / (total / later if later else 1.0)
    computed = [] if relative else _computed_terms(trace, chain, inputs, r.shape, axes, product)
    if computed:  # a term of each item's own, from the tokens: known exactly from the record, so taken off
        facts["score term"] = ("a term computed from the tokens by weights of its own (not from q and k) added to "
                               "the scores (as Leela Chess Zero's smolgen)")
        total = math.prod(x for _, x in steps if x is not None)
        for term, later in computed:
            r = r + term / (total / later if later else 1.0)
    if chain.mixed:  # talking heads: the scores are a learned mix of the heads' products; the numbers on the way
        c = math.prod(x for _, x in steps if x is not None)  # are the scale (the mix, learned, is not one)
        facts["talking heads (scores)"] = f"the scores are mixed across heads before the softmax " \
                                          f"({', '.join(chain.mixed)}; talking heads)"
    elif scores_only:
        raise _ScoresRead(s, r)
    else:
        c, t, seen = _fit(s, r, batch, with_terms)
        size = 1 + float(s.double().reshape(t.shape)[seen].abs().max())
        varies = (t - t[:1]).abs().masked_fill(~seen, 0).amax()
        alone = with_terms and t.shape[0] == 1 and float(t.abs().max()) > 1e-3 * size  # one item: c and t blend
        if float(varies) > 1e-3 * size or alone:
            # a term of each item's own (a pair bias, ALiBi from each item's padding), or of an item alone: c is read
            # from a second run on other tokens, where the term stays what it was
            scores = _partner_scores(partner, trace, sm, final, width, length, expected, batch, local)
            shared = None if scores is None else _fit_on_two_runs(s, r, scores[0], scores[1], batch)
            if shared is not None:
                c, t, seen = shared
                facts["position term"] = ("an additive term of (item, head, query, key) that does not come from the "
                                          "tokens (a bias the call passes, or a relative-position bias)")
            elif float(varies) > 1e-3 * size:
                raise Unrecognised(f"the scores are not one multiple of the product plus a term of (head, query, "
                                   f"key): best multiple {c:.4g} leaves a difference of {float(varies):.3g} between "
                                   "batch items")
            else:
                raise Unrecognised("one item alone: a term on the scores and their scale cannot be told apart")
        lifted = _own_key_sunk(t, seen) if "self mask" not in facts else 0.0
        if lifted >= 50:  # a term that lifts other keys e^50 over a query's own: a mask with + where - hides
            return Verdict(MASK_INVERTED, {"matches": f"a term lifts other keys {lifted:.3g} above each query's own "
                                                      "key in some rows, so that the query no longer weighs itself: "
                                                      "a mask written with the wrong sign (+100 where -100 hides, "
                                                      "as a shifted-window mask)", **evidence}, facts)
        if float(t.abs().max()) > 1e-3 * size:
            facts.setdefault("position term", "an additive term of (head, query, key) (a relative-position bias)")
            farther = distance_rewarded(t, seen)
            if farther is not None:
                return Verdict(DEFINITION_MISMATCH, {"matches": farther, **evidence}, facts)
    tokens = p.shape[-1] if window else length  # within windows, q and k hold a window's tokens
    axis_a, axis_b = _contracted_axis(product, 0, a), _contracted_axis(product, 1, b)
    over_tokens = normalised_over_tokens(trace, aid, d, tokens, a, axis_a) or \
        normalised_over_tokens(trace, bid, d, tokens, b, axis_b) or unit_over_tokens(a, axis_a, tokens) or \
        unit_over_tokens(b, axis_b, tokens) or normalised_off_the_head(trace, aid, d) or \
        normalised_off_the_head(trace, bid, d)
    if over_tokens:
        return Verdict(DEFINITION_MISMATCH, {"matches": over_tokens, **evidence}, facts)
    origin_a, origin_b = scale_origin(trace, aid), scale_origin(trace, bid)
    scale = c * _past_the_norm(origin_a, d) * _past_the_norm(origin_b, d)
    unit = _unit_norm(a, b, origin_a.factor, origin_b.factor) or \
        (unit_before_gains(trace, aid, d) and unit_before_gains(trace, bid, d))
    fid, said = _scale_verdict(scale, d, width, expected(d), unit)
    fid, said = _past_the_rotation(fid, said, scale, origin_a, origin_b, d, width, expected(d), unit, facts)
    if fid is not None and temperatures and (half := _one_side_unit(a, b, axis_a, axis_b, d)) is not None:
        # a learned temperature on the scores of one unit operand: a cosine attention with the other side left out
        return Verdict(DEFINITION_MISMATCH, {"matches": f"{half}, and the scores are multiplied by a learned "
                                                        "temperature: a cosine attention with one side left "
                                                        "unnormalised (the scores are cos times the other's norm)",
                                             **evidence}, facts)
    if fid == MISSING_SCALE and folded_scale(a, b, d):
        fid, said = None, f"{said}, but q is 1/sqrt({d}) of k in size: the scale is folded into q's projection"
        facts["scale"] = f"folded into the query projection's weights (q is 1/sqrt({d}) of k in size, as T5 " \
                         "initialises it): no scale on the scores"
    if "position term" in facts and (absolute := bucket_not_relative(
            trace, set(p.shape) - {length}, plain_only=not (fid == MISSING_SCALE and expected(d) is None))):
        return Verdict(DEFINITION_MISMATCH, {"matches": absolute, **evidence}, facts)
    if fid == MISSING_SCALE and "position term" in facts and expected(d) is None and \
            (table := _head_bias_table(trace, set(p.shape) - {length})) is not None:
        fid, said = None, f"{said}, with a learned bias per head looked up from a table of {table}: T5's design"
        facts["scale"] = (f"none on the scores, with a relative-position bias per head from an embedding of {table}, "
                          "as T5 and its descendants (mT5, LongT5, UMT5) compute it: T5 folds 1/sqrt(D) into its "
                          "initialisation and learns the rest")
    if fid == WRONG_SCALE and relative and expected(d) is None:
        fid, said, facts = _disentangled_scale(trace, chain, inputs, scale, d, width, said, facts)
    if fid == WRONG_SCALE and "position term" in facts and expected(d) is None and \
            abs(scale * math.sqrt(2 * d) - 1) < 1e-3 and _position_correlations(trace, length, inputs):
        # TUPE (Ke et al. 2021): content and untied position correlations added, both scaled by 1/sqrt(2D)
        fid, said = None, f"{said}: 1/sqrt(2 D) beside a position term, as TUPE scales its two correlations"
        facts["scale"] = "1/sqrt(2 D): the content and the position correlations share it (TUPE's untied positions)"
    if fid is not None and temperatures:
        fid, said = None, f"{said}, times a learned temperature: the scale is learned"
    if fid is not None and (_learned_gain(trace, aid) or _learned_gain(trace, bid)):
        fid, said = None, f"{said}, with q or k times a learned gain (a number per side): the scale is learned"
        facts["scale"] = "learned: q (or k) is multiplied by a learned number, a temperature on the scores"
    if fid is not None and inputs and not _depends_on(trace, aid, inputs) and not _depends_on(trace, bid, inputs):
        # an attention of positions to positions beside the tokens' own (TUPE's untied positions, LightSANs'
        # decoupled position encoding, scaled 1/sqrt(2D)): its scale is its design's
        fid, said = None, f"{said}: the scores come from positions only (no token enters them), a scale of the design"
        facts["positional attention"] = "a softmax over scores of positions alone (untied or decoupled positions)"
    # the learned vector on the operand itself (TimesFM's per_dim_scale), not a norm's weight behind a rotation
    if fid is not None and (_per_dim(trace.origin(aid).op, d) or _per_dim(trace.origin(bid).op, d)):
        fid, said = None, f"{said}, times a learned scale per head dimension (TimesFM's per_dim_scale)"
        facts["scale"] = "q (or k) is multiplied by a learned vector per head dimension: the scale is learned"
    evidence.update({"scale": said, "head dim": d, "product": product.name})
    # the scale, the operands' roles, the merge and the rotation are read apart: a bug in one leaves the others
    # readable, and each is named
    found = [Verdict(fid, {"matches": said, **evidence}, facts) if fid is not None else None]
    found.append(_roles_verdict(trace, (aid, bid, vid), evidence, facts) or
                 _values_verdict(trace, vid, evidence, facts, inputs) or
                 _groups_verdict(trace, bid, vid, evidence, facts))
    canon = _canonical_output(pv, position, axes[0] if axes is not None else w.dim() - 2, batch)
    if channels_first and pv.outputs:
        nd = pv.outputs[0].dim()
        canon = (*range(nd - 2), nd - 1, nd - 2)
    merge_fid, merged = _merge(trace, pv, pv.outputs[0], final, canon)
    if (window or blocks) and merge_fid is None:  # heads side by side cannot be told from windows put back
        merged = "heads merged side by side within the windows (the windows are put back by the module's own layout)"
    if blocks:  # blocks of a sequence are merged with the same reshape a head merge would be: not read
        merge_fid, merged = None, "not checked: the blocks are put back by the module's own layout"
    if "queries apart" in facts:  # its rows join the other attention's before the heads are merged: read there
        merge_fid, merged = None, "read with the attention whose rows these join"
    evidence["merge"] = merged
    if merge_fid is not None:
        found.append(Verdict(merge_fid, {"matches": merged, **evidence}, facts))
    one_side = _one_side(trace, aid, bid, evidence, facts)
    found.append(one_side)
    turned = rotary(trace, aid, a) if one_side is None else None
    if turned is not None:
        facts["positions"] = turned
    elif one_side is None:
        problems = (_rotation_problem(trace, aid, a), _rotation_problem(trace, bid, b))
        problem = problems[0] or problems[1]
        if problems[0] and problems[1]:  # both: xPos's decay, or a rotation that is not one; the run on one token
            facts["positions"] = _SCALED_ROTARY  # everywhere tells
        elif problem:
            found.append(Verdict(ROTARY_MISMATCH, {"matches": problem, **evidence}, facts))
        if "" in problems:
            facts["positions"] = "rotary positions (a rotation with frequencies of its own: scaled, YaRN, ...)"
    value_term = _value_position_term(trace, sm, pv, inputs)
    if value_term is not None:
        facts["value positions"] = value_term
        across = _value_term_across_queries(trace, sm, pv, inputs)
        if across is not None:
            found.append(Verdict(MATMUL_ORDER, {"matches": across, **evidence}, facts))
    norms = (normalised(trace, aid), normalised(trace, bid))
    if all(norms):
        facts["q/k normalisation"] = f"q and k are normalised ({norms[0]}) before the scores"
    joined = _joined(found)
    if joined is not None:
        return joined
    return Verdict(None, {"formula": f"softmax({'capped ' if 'tanh' in names else ''}c Q K^T"
                                     f"{' + T' if 'position term' in facts else ''}) V from the operands of its "
                                     f"products; {said}", **evidence}, facts)


_APART = frozenset({MISSING_SCALE, WRONG_SCALE, ROTARY_ONE_SIDE, ROTARY_MISMATCH, GROUP_MISMATCH, VALUES_CHANGED})
# beside a softmax over the wrong axis, weights masked after it too (the product with the values is the right way
# round: the weights there are the softmax's, masked)
_BESIDE_SOFTMAX_DIM = _APART | {MASK_AFTER_SOFTMAX}


def _read_apart(trace: Trace, sm: Op, final: Tensor, width: int, length: int,
                expected: Callable[[int], float | None], batch: int, inputs: frozenset[int],
                local: bool, kinds: frozenset = _APART, masked_after: bool = False) -> Verdict | None:
    """Beside a softmax over the wrong axis or weights multiplied the wrong way: the bug the rest of the core
    follows (a scale slip, the rotation, the kv groups, the values; ``kinds``), read with that axis and order taken
    as right (and, ``masked_after``, weights masked after the softmax taken as its own); None when there is none or it
    cannot be read."""
    try:
        found = _softmax_core(trace, sm, final, width, length, expected, None, batch, inputs, local, apart=True,
                              masked_after=masked_after)
    except Exception:  # what cannot be read apart leaves the first bug alone
        return None
    if found is None or found.fid is None:
        return None
    # what does not depend on the weights' axis or order: the scale, the rotation, the kv groups, the values (a merge
    # read past weights multiplied the wrong way is not the module's own)
    kept = [v for v in (found, *found.also) if v.fid in kinds]
    for v in kept:
        v.also = []
    return _joined(list(kept))




def _rotation_problem(trace: Trace, tid: int, value: Tensor) -> str | None:
    """:func:`rotation_problem` of a score operand, or of the tensor it is a layout of (k^T: k)."""
    found = rotation_problem(trace, tid, value)
    origin = trace.origin(tid).id
    if found is None and origin != tid and (before := trace.value(origin)) is not None:
        return rotation_problem(trace, origin, before)
    return found


def _one_side(trace: Trace, qid: int, kid: int, evidence: dict, facts: dict) -> Verdict | None:
    """rotary-one-side when exactly one of the score operands was rotated on its way from its projection (the
    other reached its own projection unrotated); None otherwise (both, neither, or a side not traced back)."""
    sides = (rotation_on_the_way(trace, qid), rotation_on_the_way(trace, kid))
    if set(sides) != {True, False}:
        return None
    plain = kid if sides[0] else qid  # made like rotary positions but no rotation (cos/sin for another pairing)?
    value = trace.value(plain)
    problem = _rotation_problem(trace, plain, value) if value is not None else None
    if problem:
        return Verdict(ROTARY_MISMATCH, {"matches": f"{'k' if sides[0] else 'q'} is not rotated as "
                                                    f"{'q' if sides[0] else 'k'} is: {problem}", **evidence}, facts)
    said = "rotary positions on q but not on k" if sides[0] else "rotary positions on k but not on q"
    return Verdict(ROTARY_ONE_SIDE, {"matches": f"{said}: the scores then depend on each token's position, not "
                                                "only on the distance between tokens", **evidence}, facts)


def _reduced(keys: int, length: int) -> str:
    return (f"keys and values from {keys} positions for the {length} queries (a sequence reduction: a strided "
            "convolution or a pooling of the tokens, as PVT's, Twins' or CvT's; masks are not read on them)")


def _sdpa_hidden(op: Op, length: int) -> Tensor:
    """(..., L, L) bool: where an SDPA call masks its scores (its attn_mask and is_causal)."""
    mask = op.kwargs.get("attn_mask", op.args[3] if len(op.args) > 3 else None)
    causal = op.kwargs.get("is_causal", op.args[5] if len(op.args) > 5 else False)
    hidden = torch.zeros(length, length, dtype=torch.bool)
    if causal:
        hidden = hidden | torch.ones(length, length, dtype=torch.bool).triu(1)
    masked = _sdpa_mask_hidden(mask)
    return hidden if masked is None else hidden | masked


def _hidden_by(mask: object) -> Tensor | None:
    """Where a mask given to torch's MultiheadAttention hides (bool True = hidden, as key_padding_mask and its
    attn_mask read it; a float mask, where it is -inf or below a fill)."""
    if not isinstance(mask, Tensor):
        return None
    return mask.cpu() if mask.dtype == torch.bool else mask.detach().cpu() <= _MASKED


def _sdpa_mask_hidden(mask: object) -> Tensor | None:
    """Where an attn_mask given to scaled_dot_product_attention hides (its bool mask reads True as may attend)."""
    return _hidden_by(~mask if isinstance(mask, Tensor) and mask.dtype == torch.bool else mask)


def every_key_hidden(trace: Trace) -> str | None:
    """Does a kernel of the record (scaled_dot_product_attention, nn.MultiheadAttention's functional core) get masks
    that hide every key from every query? Then a mask the module builds for itself when it is given none is read the
    other way round (GraphGPS's to_dense_batch mask, True = node, handed to key_padding_mask, True = padding): what
    it says, or None."""
    for op in trace.ops:
        if op.name == "scaled_dot_product_attention" and op.inputs:
            hidden = _sdpa_mask_hidden(op.kwargs.get("attn_mask", op.args[3] if len(op.args) > 3 else None))
            if hidden is not None and hidden.numel() and bool(hidden.all()):
                return "scaled_dot_product_attention gets an attn_mask that hides every key from every query"
        elif op.name == "multi_head_attention_forward":
            a = op.mha_arguments()
            padding, pairs = _hidden_by(a.get("key_padding_mask")), _hidden_by(a.get("attn_mask"))
            if a.get("bias_k") is not None or a.get("add_zero_attn"):
                continue  # a key no mask covers
            if (padding is not None and padding.numel() and bool(padding.all())) or \
                    (pairs is not None and pairs.numel() and bool(pairs.all())):
                which = "key_padding_mask" if padding is not None and bool(padding.all()) else "attn_mask"
                return f"nn.MultiheadAttention gets a {which} that hides every key from every query"
    return None


def _tiles(length: int, size: int, lead: tuple[int, ...], batch: int = 1) -> bool:
    """Do windows of ``size`` tile the L tokens: L a multiple of it, or an axis of ``lead`` counting the windows of
    the L tokens padded to a multiple (chunked attention pads its last chunk), alone or folded into the ``batch``
    (titans' segments, (B * windows, ...)), or square windows of a square grid padded on both sides to a multiple of
    the window's (SAM's and ViTDet's windows, padded with zeros)?"""
    counts = [*lead, *(m // batch for m in lead if batch > 1 and m % batch == 0)]
    if length % size == 0 or any(n * size >= length > (n - 1) * size for n in counts):
        return True
    side, window = math.isqrt(length), math.isqrt(size)
    if side * side != length or window * window != size or window < 2 or side % window == 0:
        return False
    return math.prod(lead) % (-(-side // window)) ** 2 == 0


def _regrouped(op: Op, batch: int, length: int) -> bool:
    """Does an nn.MultiheadAttention core get its tokens in other rows than the module's (B, L) (windows, one axis of
    a video: (L', B', E) with B' L' = B L)? A core given the module's tokens as they are is read by its projections,
    and what they do not match is no formula."""
    query = op.mha_arguments().get("query")
    return isinstance(query, Tensor) and query.dim() == 3 and query.shape[0] * query.shape[1] == batch * length and \
        {int(query.shape[0]), int(query.shape[1])} != {batch, length}


def _mha_core(trace: Trace, op: Op, final: Tensor, length: int, batch: int) -> Verdict:
    """torch's nn.MultiheadAttention core given tokens the module rearranged first (windows, or one axis of a video
    at a time: (B * 4, L / 4, E)), which the projections' reading cannot line up with the module's input: its formula
    is torch's; how the module puts its output back is read (the merge)."""
    query = op.mha_arguments()["query"]  # (L', B', E), whatever batch_first says
    tokens, items = int(query.shape[0]), int(query.shape[1]) if query.dim() == 3 else 1
    facts = {"core": f"torch's nn.MultiheadAttention over {tokens} tokens in each of {items} rows (the module "
                     f"rearranges its {batch} x {length} tokens before it: windows, or one axis at a time)"}
    merge_fid, merged = _merge(trace, op, op.outputs[0].transpose(0, 1), final)
    if merge_fid is not None:
        return Verdict(merge_fid, {"matches": merged}, facts)
    return Verdict(None, {"formula": "torch's nn.MultiheadAttention core (its own formula) on tokens the module "
                                     f"rearranged; {merged}"}, facts)


def _sdpa_core(trace: Trace, op: Op, final: Tensor, width: int, length: int,
               expected: Callable[[int], float | None], keep: Tensor | None = None, local: bool = False,
               inputs: frozenset[int] = frozenset()) -> Verdict:
    q, k = op.inputs[0], op.inputs[1]
    d = q.shape[-1]
    facts: dict = {}
    # learned memory keys and values joined to each window's own (titans' persistent memory beside its segments)
    extra = k.shape[-2] - q.shape[-2] if q.dim() >= 2 and k.dim() >= 2 and len(op.in_ids) > 2 else 0
    side = _memory_side(trace, op.in_ids[2], extra, inputs) if local and extra > 0 else None
    window = local and q.dim() >= 2 and (q.shape[-2] == k.shape[-2] or side is not None) and \
        1 < q.shape[-2] < length and _tiles(length, q.shape[-2], q.shape[:-2])
    if window:  # attention within windows (Twins' locally grouped attention): each window's call on its own
        facts["windows"] = f"attention within windows of {q.shape[-2]} tokens (the module sees a local pattern)"
        if side is not None:
            facts["memory"] = f"{extra} key/value pair(s) that depend on no token, put {side} beside each window's " \
                              "keys (learned memory key/values)"
        length, keep = q.shape[-2], None
    if q.dim() >= 2 and 2 < q.shape[-2] < length == q.shape[-2] + _other_queries(trace, op, length) and \
            k.shape[-2] == q.shape[-2]:  # the tokens but a few read-out ones, among themselves; those apart
        facts["queries apart"] = (f"{q.shape[-2]} of the {length} tokens attend among themselves; the other "
                                  f"{length - q.shape[-2]} in an attention of their own over every token")
        length, keep = q.shape[-2], None
    # a few queries over every token, the other rows untouched by attention (XCiT's and CaiT's class-attention blocks)
    few = local and q.dim() >= 2 and k.dim() >= 2 and 2 * q.shape[-2] <= length == k.shape[-2]
    if few:
        facts["queries apart"] = (f"{q.shape[-2]} query row(s) attend over all {length} tokens in an attention of "
                                  "their own (class attention, global tokens)")
        keep = None  # the run's (L, L) pattern is the rest of the module's
    elif q.dim() < 2 or q.shape[-2] != length:
        shape = (q.shape[-2] if q.dim() >= 2 else 1, k.shape[-2] if k.dim() >= 2 else 1)
        return Verdict(DEFINITION_MISMATCH, {"matches": f"scaled_dot_product_attention runs over an axis of size "
                                               f"{shape[0]}, not the {length} tokens "
                                               f"({_other_axes(torch.empty(shape), length)})"})
    cached = k.shape[-2] > length  # keys and values from a cache of more positions (gpt-fast's, allocated ahead)
    if k.shape[-2] < length:  # keys and values from fewer positions than the queries: a sequence reduction
        facts["reduced keys"] = _reduced(k.shape[-2], length)
        cached = True  # the run's (L, L) pattern does not apply to them
    given = op.kwargs.get("scale", op.args[6] if len(op.args) > 6 else None)
    base = 1 / math.sqrt(d) if given is None else float(given)
    over_tokens = normalised_over_tokens(trace, op.in_ids[0], d, length, q, -1) or \
        normalised_over_tokens(trace, op.in_ids[1], d, length, k, -1) or unit_over_tokens(q, -1, length) or \
        unit_over_tokens(k, -1, length) or normalised_off_the_head(trace, op.in_ids[0], d) or \
        normalised_off_the_head(trace, op.in_ids[1], d)
    if over_tokens:
        return Verdict(DEFINITION_MISMATCH, {"matches": over_tokens, "head dim": d,
                                             "product": "scaled_dot_product_attention"}, facts)
    if not bool(q.any()) or not bool(k.any()):
        raise Unseen("q or k is all zeros (a gain initialised at 0): every scale gives the same weights, so the scale "
                     "cannot be read")
    origin_q, origin_k = scale_origin(trace, op.in_ids[0]), scale_origin(trace, op.in_ids[1])
    scale = base * origin_q.factor * origin_k.factor
    unit = _unit_norm(q, k, origin_q.factor, origin_k.factor) or \
        (unit_before_gains(trace, op.in_ids[0], d) and unit_before_gains(trace, op.in_ids[1], d))
    fid, said = _scale_verdict(scale, d, width, expected(d), unit)
    fid, said = _past_the_rotation(fid, said, scale, origin_q, origin_k, d, width, expected(d), unit, facts)
    if fid is not None and any(_per_dim(o.op, d) and not _norm_gain(trace, o.op)  # as the einsum path reads it
                               for o in (origin_q, origin_k)):
        fid, said = None, f"{said}, times a learned scale per head dimension (TimesFM's per_dim_scale)"
        facts["scale"] = "q (or k) is multiplied by a learned vector per head dimension: the scale is learned"
    evidence = {"scale": said, "head dim": d, "product": "scaled_dot_product_attention"}
    # the scale, which keys are hidden, the operands' roles, the merge and the rotation are read apart: a bug in one
    # leaves the others readable, and each is named
    found = [Verdict(fid, {"matches": said, **evidence}) if fid is not None else None]
    if keep is not None and not cached:
        hidden = _sdpa_hidden(op, length)
        # (B, H, L, L); or heads folded into the batch (B * H, L, L), the layout xformers' kernels take, read by items
        lead: tuple[int, ...] = (q.shape[0],) if q.dim() == 3 and q.shape[0] != keep.shape[0] else \
            (keep.shape[0], q.shape[-3])
        if q.dim() > 4:  # heads grouped on two axes, (B, groups, heads per group, L, D) (Moirai's): read as (B, H)
            lead = tuple(q.shape[:-2])
        try:
            hidden = hidden.expand(*torch.broadcast_shapes(hidden.shape, (*lead, length, length)))
        except RuntimeError as err:
            raise Unrecognised(f"the kernel's mask {tuple(hidden.shape)} does not lay out over its queries "
                               f"{tuple(q.shape)}") from err
        if hidden.dim() > 4:
            hidden = hidden.reshape(hidden.shape[0], -1, length, length)
        masked = _mask_verdict(hidden, keep, evidence)
        if "heads' patterns" in evidence:
            facts["heads' patterns"] = evidence.pop("heads' patterns")
        if masked is not None:
            merge_fid, merged = _merge(trace, op, op.outputs[0], final)  # a wrong merge distorts the pattern
            return _joined([*found, Verdict(merge_fid, {"matches": merged, **evidence})
                            if merge_fid is not None else masked]) or masked
    found.append(_roles_verdict(trace, (op.in_ids[0], op.in_ids[1], op.in_ids[2]), evidence, {}) or
                 _values_verdict(trace, op.in_ids[2], evidence, {}, inputs) or
                 _groups_verdict(trace, op.in_ids[1], op.in_ids[2], evidence, facts))
    merge_fid, merged = _merge(trace, op, op.outputs[0], final)
    if window and merge_fid is None:  # heads side by side cannot be told from windows put back
        merged = "heads merged side by side within the windows (the windows are put back by the module's own layout)"
    if "queries apart" in facts:  # rows joined with another attention's before the merge: not read
        merge_fid, merged = None, "not checked: the rows are joined with another attention's before the merge"
    evidence["merge"] = merged
    if merge_fid is not None:
        found.append(Verdict(merge_fid, {"matches": merged, **evidence}))
    one_side = _one_side(trace, op.in_ids[0], op.in_ids[1], evidence, facts)
    found.append(one_side)
    turned = rotary(trace, op.in_ids[0], q) if one_side is None else None
    problems = (None, None) if turned or one_side is not None else (_rotation_problem(trace, op.in_ids[0], q),
                                                                    _rotation_problem(trace, op.in_ids[1], k))
    if problems[0] and problems[1]:
        turned, problems = _SCALED_ROTARY, (None, None)
    if problems[0] or problems[1]:
        found.append(Verdict(ROTARY_MISMATCH, {"matches": problems[0] or problems[1], **evidence}))
    if "" in problems:
        turned = "rotary positions (a rotation with frequencies of its own: scaled, YaRN, ...)"
    if turned:
        facts["positions"] = turned
    if cached:
        facts["cache"] = f"keys and values from a cache of {k.shape[-2]} positions for the {length} queries"
    joined = _joined(found)
    if joined is not None:
        return joined
    return Verdict(None, {"formula": f"scaled_dot_product_attention; {said}", **evidence}, facts)


def examine_cores(trace: Trace, final: Tensor, width: int, length: int,
                  expected: Callable[[int], float | None], keep: Tensor | None = None,
                  batch: int = 1, inputs: frozenset[int] = frozenset(), local: bool = False,
                  partner: Callable[[], Trace | None] | None = None, causal: bool = False) -> list[Verdict]:
    """Every attention core in the record, each with its verdict.

    Args:
        trace: the record of one run of the module.
        final: the module's output in that run, as the module returned it.
        width: the model width E (to name a 1/sqrt(E) scale).
        length: the number of tokens L in the run (the weights must be (L, L)).
        keep: (B, 1, L, L) bool, True = may attend: what the run's mask and the module's own structure leave
            visible; the scores must hide exactly the rest (None: not checked).
        batch: the run's batch size B (scores are (B, ..., L, L) or (B * H, L, L)).
        inputs: the identities (``id``) of the tensors the run gave the module: a product one of whose operands
            does not depend on them is a position term.
        expected: the scale the user or the module states for head dim D, or None for 1/sqrt(D).
        local: the module on its own hides some keys (a window): weights over fewer tokens than L, a divisor of
            L, are read as attention within windows.
        partner: the record of the same call on other tokens, made when asked: a term on the scores that varies
            between items (or an item alone) is told from the scale on the two runs, where it stays the same.
        causal: the user said the module is causal and the run sent no mask: scores that see the future are a leak
            of their own, also where the merge after them mixes tokens.

    Returns:
        One :class:`Verdict` per core, in the order they ran.

    Raises:
        Unrecognised: a softmax feeds a product but the doctor cannot follow its scores (the message says
            where it stopped); or no core was found.
    """
    verdicts = []
    cores = sum(op.name == "scaled_dot_product_attention" or op.name in SOFTMAX for op in trace.ops)
    local = local or cores > 1  # steps that each see part of the tokens and together all (axial: rows, then columns)
    steps = _decode_steps(trace, length)
    if steps is not None:
        raise Unseen(f"the call runs the attention in {len(steps)} steps over a growing cache (queries "
                           f"{[q for q, _ in steps]}, keys {[k for _, k in steps]}: a prefill and decode steps); "
                           "each step sees part of the tokens, and the record is not read step by step")
    memory, _ = memory_tokens(trace, length)
    if memory:  # learned tokens joined to the tokens inside the module: the attention runs over both
        length, keep = length + memory, None  # the mask the run sent covers the tokens only: the probes judge it
    for op in trace.ops:
        if op.outputs and op.outputs[0].numel() == 0:  # an attention over no queries (no global tokens) weighs nothing
            continue
        if op.name == "scaled_dot_product_attention":
            verdicts.append(_sdpa_core(trace, op, final, width, length, expected, keep, local, inputs))
        elif op.name == "multi_head_attention_forward" and op.outputs and _regrouped(op, batch, length):
            verdicts.append(_mha_core(trace, op, final, length, batch))
        elif op.name in SOFTMAX:
            found = _softmax_core(trace, op, final, width, length, expected, keep, batch, inputs, local,
                                  partner=partner, causal=causal)
            if found is not None:
                verdicts.append(found)
    if memory:
        for verdict in verdicts:
            verdict.facts["memory tokens"] = (f"{memory} learned token(s) joined to the {length - memory} tokens "
                                              "inside the module, attended with them, their own outputs dropped "
                                              "(memory or register tokens: x-transformers' num_memory_tokens, ViT "
                                              "registers)")
    if not verdicts and trace.transformed:
        raise Unrecognised("no attention was found: the module computes it inside torch.vmap (a torch.func "
                           "transform), whose operations a record cannot keep")
    if not verdicts:
        raise Unrecognised("no attention was found: no softmax feeding a product, no scaled_dot_product_attention")
    return verdicts


def memory_tokens(trace: Trace, length: int) -> tuple[int, int]:
    """(how many, at which position the tokens start) for the learned tokens the module joins to its ``length``
    tokens along the token axis of a (B, L, E) tensor (a ``cat`` of the tokens' states with parameters only, before
    the projections: memory or register tokens) when an attention core then has that many more queries; else (0, 0).
    Keys and values joined alone (a null key) keep the queries at L and are read where the keys are."""
    cores = {op.inputs[0].shape[-2] for op in trace.ops if op.name == "scaled_dot_product_attention" and
             op.inputs and op.inputs[0].dim() >= 2}
    cores |= {op.outputs[0].shape[-2] for op in trace.ops if op.name in SOFTMAX and op.outputs and
              op.outputs[0].dim() >= 2}
    for op in trace.ops:
        if op.name not in ("cat", "concat", "concatenate") or not op.outputs or op.outputs[0].dim() != 3:
            continue
        dim = op.kwargs.get("dim", op.args[1] if len(op.args) > 1 and isinstance(op.args[1], int) else 0)
        if dim % 3 != 1:
            continue
        parts = [(t, trace.learned(i)) for i, t in zip(op.in_ids, op.inputs, strict=False)]
        tokens = [at for at, (t, learned) in enumerate(parts) if t.shape[1] == length and not learned]
        extra = sum(t.shape[1] for t, learned in parts if learned)
        if len(tokens) == 1 and sum(learned for _, learned in parts) == len(parts) - 1 and extra and \
                length + extra in cores:
            return extra, sum(t.shape[1] for t, _ in parts[:tokens[0]])
    return 0, 0


def _decode_steps(trace: Trace, length: int) -> list[tuple[int, int]] | None:
    """(queries, keys) of each attention core when the run is a generation loop over a KV cache: three or more
    cores whose query counts add up to the L tokens, each fewer than L, over as many keys or more at each step (a
    prefill, then decode steps; a cache allocated ahead, or a rolling one, keeps its size); else None."""
    steps = []
    for op in trace.ops:
        if not op.outputs or op.outputs[0].dim() < 2:
            continue
        if op.name == "scaled_dot_product_attention" and len(op.inputs) >= 2 and op.inputs[1].dim() >= 2:
            steps.append((op.inputs[0].shape[-2], op.inputs[1].shape[-2]))
        elif op.name in SOFTMAX:
            steps.append((op.outputs[0].shape[-2], op.outputs[0].shape[-1]))
    if len(steps) == length >= 3:  # one attention per token (a decode step's query may have no axis of its own)
        steps = [(1, k) for _, k in steps]
    if len(steps) < 3 or sum(q for q, _ in steps) != length or any(q >= length for q, _ in steps):
        return None
    keys = [k for _, k in steps]
    return steps if all(a <= b for a, b in itertools.pairwise(keys)) else None


def _query_key_last(r: Tensor, length: int) -> Tensor | None:
    """Scores ``r`` with their two token axes (the only two of size L, the query's first) moved last, cut to the
    first L keys (a cache's later keys hold nothing yet); None when the axes cannot be told."""
    axes = [i for i, size in enumerate(r.shape) if size == length]
    if len(axes) == 1 and r.dim() >= 2 and axes[0] == r.dim() - 2 and r.shape[-1] > length:
        return r[..., :length]  # queries, then a cache's keys
    if len(axes) != 2:
        return None
    return r.movedim(axes, (-2, -1))


def relative_positions(trace: Trace, length: int, rtol: float = 1e-4, memory: tuple[int, int] = (0, 0)) -> str | None:
    """For a run on one token repeated at every position: where q and k of an attention core are not rotated alike
    (the rotated part of k concatenated after its pass-through part while q's comes first, other frequencies, k
    rotated at other positions than q); None when they are, or no core could be read.

    With one token everywhere, q_i = R_i q and k_j = S_j k; rotated alike (S = R, any orthogonal R_i: 1-D or 2-D
    rotary, xPos, a prefix kept unrotated), each token's score with itself is q . k, whatever its position: the
    diagonal of Q K^T is constant (to ``rtol`` of the largest score). ``memory``: the learned tokens the module
    joins to the tokens (:func:`memory_tokens`), which are no copy of the token and are left out."""
    for op in trace.ops:
        r: Tensor | None = None
        read = _core_operands(trace, op)
        if read is not None:
            product, q, k = read
            try:
                if product is None:  # scaled_dot_product_attention
                    if q.dim() == k.dim() >= 3 and q.shape[-3] != k.shape[-3] and q.shape[-3] % k.shape[-3] == 0:
                        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)  # grouped keys
                    r = q @ k.transpose(-1, -2)
                else:
                    r = _contract(product, q, k)
            except RuntimeError:
                continue
        if memory[0] and r is not None and r.dim() >= 2 and r.shape[-2] == r.shape[-1] == length + memory[0]:
            r = r[..., memory[1]:memory[1] + length, memory[1]:memory[1] + length]
        extra = 0 if r is None or r.dim() < 2 else r.shape[-1] - length  # keys beyond the tokens: memory, a cache
        r = None if r is None else _query_key_last(r, length)
        if r is None or length < 3:
            continue
        diag = r.diagonal(dim1=-2, dim2=-1)
        spread = (diag - diag[..., :1]).abs()
        size = 1 + float(r.abs().max())
        alike = _same_before_rotation(q, k, length, rtol) if read is not None else None
        if alike is not None:  # positions whose q and k are no copy of the token's (a token shift's first row)
            diag = diag[..., alike]
            spread = (diag - diag[..., -1:]).abs()
        if float(spread.max()) > rtol * size and extra > 0:
            # learned keys put first (a null key and value, memory tokens): the tokens' keys are the last L
            full = _contract(product, q, k) if product is not None else q @ k.transpose(-1, -2)
            if full.dim() >= 2 and full.shape[-2] == length:
                late = full[..., extra:].diagonal(dim1=-2, dim2=-1)
                if float((late - late[..., :1]).abs().max()) <= rtol * size:
                    continue
        if float(spread.max()) > rtol * size and _scaled_per_query(r, length, rtol * size):
            continue
        if float(spread.max()) > rtol * size:
            at = int(spread.reshape(-1, length).amax(0).argmax())
            return (f"with the same token at every position, its score with itself is {float(diag.flatten()[0]):.4g} "
                    f"at position 0 but differs by {float(spread.max()):.3g} at position {at} (scores up to "
                    f"{size - 1:.3g}): rotated alike, q_i . k_i would be q . k at every position")
    return None


def _same_before_rotation(q: Tensor, k: Tensor, length: int, rtol: float) -> Tensor | None:
    """For a run on one token repeated at every position: the positions whose q and k have the norms of the last
    position's (a rotation keeps them), when some do not and at least 3 do (a token shift gives position 0 half its
    features from before the sequence, zeros); None when every position has them, or q and k are not laid out
    (..., L, D), or too few do (xPos scales every position's norm: its scores are read whole)."""
    if q.dim() < 2 or k.dim() < 2 or q.shape[-2] != length or k.shape[-2] != length:
        return None
    norms = [t.norm(dim=-1).reshape(-1, length) for t in (q, k)]
    ok = torch.ones(length, dtype=torch.bool)
    for n in norms:
        ok &= ((n - n[:, -1:]).abs() <= rtol * (1 + n.abs().amax(-1, keepdim=True))).all(0)
    if bool(ok.all()) or int(ok.sum()) < 3:
        return None
    return ok.nonzero().flatten()


def _core_operands(trace: Trace, op: Op) -> tuple[Op | None, Tensor, Tensor] | None:
    """For an attention core (``scaled_dot_product_attention``, or a softmax walked back to its score product): (the
    score product, None for the kernel; q; k) as they reach it, in float64; None for another operation or a product
    that cannot be read."""
    try:
        if op.name == "scaled_dot_product_attention" and len(op.inputs) >= 2:
            return None, op.inputs[0].double(), op.inputs[1].double()
        if op.name in SOFTMAX:
            product, _ = _score_chain(trace, op.in_ids[0])
            pairs = _operands(product)
            if len(pairs) >= 2:
                return product, pairs[0][1].double(), pairs[1][1].double()
    except (Unseen, Unrecognised, RuntimeError):
        pass
    return None


def score_operands(trace: Trace) -> tuple[Tensor, Tensor] | None:
    """The two operands of the first attention core's score product (q and k as they reach it, in float64), or
    None when none could be read."""
    for op in trace.ops:
        read = _core_operands(trace, op)
        if read is not None:
            return read[1], read[2]
    return None


def _core_pairs(trace: Trace) -> list[tuple[int, Tensor]]:
    """(id, tensor) of q and k as they reach the record's first attention core; empty when none is read."""
    for op in trace.ops:
        if op.name == "scaled_dot_product_attention" and len(op.inputs) >= 2:
            return list(zip(op.in_ids[:2], op.inputs[:2], strict=True))
        if op.name in SOFTMAX:
            try:
                return _operands(_score_chain(trace, op.in_ids[0])[0])[:2]
            except (Unseen, Unrecognised, RuntimeError):
                continue
    return []


def rotated_operands(trace: Trace) -> bool:
    """Is q or k, as it reaches the first attention core, rotated like rotary positions (along any axis), a few more
    operations back than the white box's own reading looks (a q/k norm after the rotation: OLMo's), or by a complex
    table of modulus 1 (Llama 4's freqs_cis)?"""
    pairs = _core_pairs(trace)
    return any(rotary(trace, tid, value, reach=24) is not None for tid, value in pairs) or \
        any(t is not None and t[0].is_complex() for t in (rotation_tables(trace, tid) for tid, _ in pairs))


def rotated_apart(trace: Trace, length: int) -> str | None:
    """Are q and k, as they reach the first attention core, rotated by tables of other positions (k rotated at
    ``position_ids + 1``, a cache offset given to one side only)? Both tables must be read and of one shape, or k's
    over more positions on one axis (learned memory keys or cached ones first: its last L are the tokens'); None
    when they agree or cannot be compared. One token everywhere cannot tell this: q_i . k_i is then q . R(offset) k
    at every position."""
    pairs = _core_pairs(trace)
    if len(pairs) < 2:
        return None
    found = [rotation_tables(trace, tid) for tid, _ in pairs[:2]]
    if found[0] is None or found[1] is None or len(found[0]) != len(found[1]):
        return None
    def last_tokens(a: Tensor, b: Tensor) -> Tensor:  # keys after learned memory or cached ones: the last L are
        differ = [i for i in range(a.dim()) if a.shape[i] != b.shape[i]] if a.dim() == b.dim() else []  # the tokens'
        if len(differ) == 1 and a.shape[differ[0]] == length and b.shape[differ[0]] > length:
            return b.narrow(differ[0], b.shape[differ[0]] - length, length)
        return b

    found = [found[0], [last_tokens(a, b) for a, b in zip(*found, strict=True)]]
    try:  # one table for every item on one side (positions of shape (1, L)), one per item on the other
        squeeze = [list(torch.broadcast_tensors(a, b)) for a, b in zip(*found, strict=True)]
    except RuntimeError:
        return None
    if any(a.shape[i] != b.shape[i] and length in (a.shape[i], b.shape[i])
           for a, b in zip(*found, strict=True) for i in range(-min(a.dim(), b.dim()), 0)):
        return None  # positions broadcast: a table of one position against one of the tokens'
    squeeze = [[pair[j].squeeze() for pair in squeeze] for j in (0, 1)]

    def agree(a: list[Tensor], b: list[Tensor]) -> bool:
        return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))

    q_t, k_t = squeeze
    if agree(q_t, k_t) or agree(q_t, k_t[::-1]):
        return None
    axis = next((a for a in range(q_t[0].dim()) if q_t[0].shape[a] == length), None)
    shift = None
    if axis is not None:
        for s in (1, -1, 2, -2, 3, -3):
            a = [t.narrow(axis, max(s, 0), length - abs(s)) for t in q_t]
            b = [t.narrow(axis, max(-s, 0), length - abs(s)) for t in k_t]
            if agree(a, b) or agree(a, b[::-1]):
                shift = s
                break
    where = f"k is rotated at the positions of q {'+' if shift > 0 else '-'} {abs(shift)}" if shift else \
        "the angles that rotate k are not those that rotate q"
    return (f"q and k are rotated by tables of other positions: {where} (an offset given to one side only: "
            "position_ids shifted for the keys, a cache position off by one)")


def rotation_off_the_tokens(trace: Trace, length: int) -> str | None:
    """For a run on one token repeated at every position: is q or k, as it reaches the first attention core, rotated
    like rotary positions (the rotation read along some axis) yet the same at every position? Then the cos and sin
    tables run along another axis than the tokens (built for (B, H, L, D) and applied to (B, L, H, D): along the
    heads), turn q and k alike everywhere, and the scores carry no position: what that is, or None."""
    for role, (tid, value) in zip("qk", _core_pairs(trace), strict=False):
        axes = [i for i, size in enumerate(value.shape) if size == length]
        if not axes or value.shape[-1] == length:
            continue
        t = value.double()
        size = 1e-9 * (1 + float(t.abs().max()))
        if bool(t.any()) and all(float((t - t.narrow(a, 0, 1)).abs().max()) <= size for a in axes):
            turned = rotary(trace, tid, value)
            if turned is not None:
                return (f"{role} is rotated ({turned}) but, for one token repeated at every position, the same at "
                        "every position: the cos/sin tables run along another axis than the tokens (the heads?), "
                        "so the scores carry no position")
    return None


def positions_added(one: tuple[Tensor, Tensor], other: tuple[Tensor, Tensor], length: int, rtol: float) -> bool:
    """For the score operands (q, k) of two runs, each on one token repeated at every position (two tokens): is
    every position's term added to q and to k (Conditional DETR's ``q_content_proj(x) + q_pos_proj(pos)``), the
    same whatever the token? Then q(t1) - q(t2) is one vector at every position, as it is for k; a rotation by
    position (right or wrong) turns that difference with the position."""
    for a, b in zip(one, other, strict=True):
        axes = [i for i, size in enumerate(a.shape) if size == length]
        if a.shape != b.shape or len(axes) != 1:
            return False
        diff = (a - b).movedim(axes[0], 0)
        if not bool(diff[0].abs().max() > rtol * (1 + float(a.abs().max()))) or \
                float((diff - diff[:1]).abs().max()) > rtol * (1 + float(a.abs().max())):
            return False
    return True


def _scaled_per_query(r: Tensor, length: int, atol: float) -> bool:
    """For scores of one token repeated at every position: is each query row one factor of its position (the same in
    every head and item, Qwen's log-n attention scaling of q past the training length) times scores that are
    relative (each diagonal constant)?"""
    flat = r.reshape(-1, length, length).double()
    diag = flat.diagonal(dim1=-2, dim2=-1)
    if bool((diag[:, :1].abs() <= atol).any()):
        return False
    factor = diag / diag[:, :1]
    if bool((factor <= 0).any()) or float((factor - factor[:1]).abs().max()) > 1e-6 * float(factor.abs().max()):
        return False
    rows = flat / factor[:, :, None]
    return all(float((band - band[..., :1]).abs().max()) <= atol
               for band in (rows.diagonal(offset=d, dim1=-2, dim2=-1) for d in range(1 - length, length)))


def unshifted_relative(trace: Trace, length: int, grid: tuple[int, ...] | None = None,
                       by_distance: bool = False, without: Trace | None = None) -> str | None:
    """For a run on one token repeated at every position: where a core's scores are not the same for two pairs of
    tokens the same distance apart (a relative-position term indexed by the key's own position: a ``rel_shift``
    missing or wrong, a 2-D table's axes swapped); None when they are, or no scores could be read. ``grid``: the
    tokens are an (H, W) image, or a (D, H, W) volume, row-major, whose distances are 2-D or 3-D. Hidden scores
    (below -1e4) are not compared.

    Only a module that holds positions by distance (a table or product over 2L - 1 of them, or 2H - 1 and 2W - 1 on
    an image) is judged: one whose position term is over the L positions themselves (WeNet's and ESPnet's legacy
    relative attention, with the absolute positions' embedding) is that design; ``by_distance``: the module holds a
    table sized for distances (over 2M - 1 of them, M >= L), which stands for that; ``without``: the same run with
    that table at 0, whose scores are taken away first (what the table adds is judged, not positions beside it)."""
    sides = {length} if grid is None else set(grid)
    spans = {2 * n - 1 for n in sides if n > 1}
    if not by_distance and not any(spans & {*t.shape} for op in trace.ops for t in [*op.inputs, *op.outputs]
                                   if isinstance(t, Tensor)):
        return None
    bases = [op for op in without.ops if op.name in SOFTMAX and op.inputs] if without is not None else None
    for op in trace.ops:
        if op.name not in SOFTMAX or not op.inputs:
            continue
        scores = op.inputs[0].double()
        base_scores = None
        if bases is not None:
            if not bases:  # the runs differ in their softmaxes: nothing to take away
                return None
            base_scores = bases.pop(0).inputs[0].double()
        # keys beyond the tokens (learned memory keys put first, or a cache's later keys): the tokens' are the first
        # L or the last L; relative on either is relative
        cuts = [slice(None)]
        if scores.dim() >= 2 and scores.shape[-2] == length and scores.shape[-1] > length and \
                list(scores.shape).count(length) == 1:
            cuts = [slice(None, length), slice(scores.shape[-1] - length, None)]
        found = [_not_relative_between(scores[..., cut], None if base_scores is None else base_scores[..., cut],
                                       length, grid) for cut in cuts]
        if any(f == "" for f in found):
            continue
        if any(f is None for f in found):
            return None
        return found[0]
    return None


def _not_relative_between(scores: Tensor, base_scores: Tensor | None, length: int,
                          grid: tuple[int, ...] | None) -> str | None:
    """:func:`unshifted_relative` on one softmax's scores (``base_scores``: those of the run without the table):
    why they are not relative, "" when they are or cannot be read, None when the runs cannot be compared."""
    s = _query_key_last(scores, length)
    if s is None or length < 3:
        return ""
    s = s.reshape(-1, length, length)
    seen = torch.isfinite(s) & (s > -1e4)
    if base_scores is not None:
        base = _query_key_last(base_scores, length)
        if base is None or base.numel() != s.numel():
            return None
        base = base.reshape(s.shape)
        seen = seen & torch.isfinite(base) & (base > -1e4)
        s = torch.where(seen, s - base, torch.zeros((), dtype=s.dtype))
    size = 1 + float(s[seen].abs().max()) if bool(seen.any()) else 1.0
    extent: tuple[int, ...] = grid or (length,)
    for axis in reversed(range(len(extent))):  # along a row, then down a column (then to the next frame)
        step = math.prod(extent[axis + 1:])
        i = torch.arange(length)
        i = i[(i // step) % extent[axis] < extent[axis] - 1]  # the next token along this axis is in the grid
        a, b = s[:, i][:, :, i], s[:, i + step][:, :, i + step]
        both = seen[:, i][:, :, i] & seen[:, i + step][:, :, i + step]
        differ = (a - b).abs().masked_fill(~both, 0)
        if float(differ.max()) > 1e-6 * size:
            where = "one token further along each" if step == 1 else \
                "one row further down each" if axis == len(extent) - 2 else "one frame further on each"
            return (f"with the same token at every position, the score of a query and a key changes by "
                    f"{float(differ.max()):.3g} (scores up to {size - 1:.3g}) when both move {where}: the "
                    "position term depends on where the key is, not on its distance to the query (a rel_shift "
                    "missing or wrong, or a 2-D table's axes swapped)")
    return ""


def _axes(op: Op, position: int, role: str) -> tuple[int, int] | None:
    """(token axis, feature axis) of the operand at ``position`` of the product ``op``: of q and k in the score
    product, of v in the product with the weights; None when the layout cannot be told."""
    eq = _equation(op)
    if eq is None:  # a matmul, bmm or baddbmm (its matrices: q (..., L, D) @ k^T (..., D, L), or weights @ v)
        return {"q": (-2, -1), "k": (-1, -2), "v": (-2, -1)}[role]
    (sa, sb), out = eq
    mine, other = (sa, sb) if position == 0 else (sb, sa)
    if role in "qk":
        token = [c for c in mine if c in out and c not in other]
        feature = [c for c in mine if c in other and c not in out]
        if len(token) > 1 and len(out) >= 2:  # q's heads against one shared key head ("bhid,bjd->bhij": multi-query)
            token = [c for c in token if c == out[-2 if role == "q" else -1]]  # the scores' query (key) axis
    else:
        token = [c for c in mine if c in other and c not in out]
        feature = [c for c in mine if c in out and c not in other]
    if len(token) != 1 or len(feature) != 1:
        return None
    return mine.index(token[0]) - len(mine), mine.index(feature[0]) - len(mine)


def core_operands(trace: Trace) -> list[tuple[str, int, tuple[int, int]]]:
    """(role, identity, (token axis, feature axis)) of the q, k and v operands of every attention core in the record
    (the score product's two operands and the values of the product after the softmax; an SDPA call's first
    three); a core the record cannot follow gives none."""
    found: list[tuple[str, int, tuple[int, int]]] = []
    for op in trace.ops:
        if op.name == "scaled_dot_product_attention":
            found += [(role, tid, (-2, -1)) for role, tid in zip("qkv", op.in_ids, strict=False)]
        elif op.name == "multi_head_attention_forward":  # torch's functional MHA: query, key, value (L, B, E)
            found += [(role, tid, (0, -1)) for role, tid in zip("qkv", op.in_ids, strict=False)]
        elif op.name in SOFTMAX:
            try:
                product, _ = _score_chain(trace, op.in_ids[0])
            except Unrecognised:
                continue
            pairs = _operands(product)
            for position, role in enumerate("qk"[:len(pairs)]):
                axes = _axes(product, position, role)
                if axes is not None:
                    found.append((role, pairs[position][0], axes))
            after = _product_after(trace, op.out_ids[0])
            if after is not None:
                values = [(position, tid) for position, (tid, _) in enumerate(_operands(after[0])) if tid != after[1]]
                axes = _axes(after[0], values[0][0], "v") if values else None
                if axes is not None:
                    found.append(("v", values[0][1], axes))
    return found

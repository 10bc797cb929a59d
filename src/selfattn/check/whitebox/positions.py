"""Position terms and norms found on the way to the scores: rotary positions (standard frequencies, on all or
part of the head dim), rotary-like code that is not a rotation, and q/k normalisation.

Shape legend: B batch, H heads, L length, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .trace import LAYOUT, PRODUCTS, Op, Origin, Trace

__all__ = [
    "ROPE_BASES",
    "normalised",
    "normalised_off_the_head",
    "normalised_over_tokens",
    "rope",
    "rotary",
    "rotated_from",
    "rotation_on_the_way",
    "rotation_problem",
    "rotation_tables",
    "scale_origin",
    "unit_before_gains",
    "unit_over_tokens",
]

ROPE_BASES = (10000.0, 500000.0, 1000000.0)


def rope(t: Tensor, base: float, interleaved: bool | str) -> Tensor:
    """Rotary positions 0..L-1 applied to t (..., L, D): rotate-half (Llama), interleaved pairs, or
    ``interleaved="to halves"``: interleaved pairs rotated and laid out as halves (DeepSeek-V3's)."""
    d, length = t.shape[-1], t.shape[-2]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(length, dtype=torch.float64)[:, None] * inv  # (L, D/2)
    t = t.double()
    if interleaved:
        a, b = t[..., 0::2], t[..., 1::2]
        turned = (a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos())
        return torch.cat(turned, -1) if interleaved == "to halves" else torch.stack(turned, -1).flatten(-2)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    half = torch.cat((-t[..., d // 2:], t[..., : d // 2]), -1)
    return t * cos + half * sin


def rotary(trace: Trace, tid: int, value: Tensor, reach: int = 8) -> str | None:
    """The rotary positions a score operand was given: a tensor it was made from (the operand, or a part of it
    for partial rotary; one of the ``reach`` nearest) equals one of its ancestors a few operations back rotated by
    the standard frequencies; None if none does."""
    near: list[tuple[int, Tensor]] = []  # the operand and the tensors it was made from, nearest first
    todo, seen = [tid], {tid}
    while todo and len(near) < 48:
        cur = todo.pop(0)
        got = value if cur == tid else trace.value(cur)
        if got is not None:
            near.append((cur, got))
        found = trace.maker(cur)
        if found is not None:
            for i in found[0].in_ids:
                if i not in seen:
                    seen.add(i)
                    todo.append(i)
    for index, (_, t) in enumerate(near[:reach]):
        if t.dim() < 2 or t.shape[-1] % 2 or t.is_complex():
            continue
        for _, source in near[index + 1:]:
            if source.shape != t.shape or source.is_complex() or torch.allclose(source.double(), t.double()):
                continue  # a copy is no rotation (positions 0 only: windows of one row)
            # the positions on the second-to-last axis, on the third ((B, L, H, D), as GPT-J's), or on any other
            # (sequence first, (L, B, H, D), as Megatron's and ChatGLM's)
            axes = [a for a in range(-2, -t.dim() - 1, -1) if t.shape[a] > 1]
            for axis, base, interleaved in ((a, b, i) for a in axes for b in ROPE_BASES
                                            for i in (False, True, "to halves")):
                turned = rope(source.movedim(axis, -2), base, interleaved).movedim(-2, axis)
                if torch.allclose(turned, t.double(), rtol=1e-4, atol=1e-5):
                    part = "" if t.shape[-1] == value.shape[-1] else f", on {t.shape[-1]} of {value.shape[-1]} dims"
                    how = "rotate-half" if not interleaved else "interleaved pairs" + (
                        ", laid out as halves" if interleaved == "to halves" else "")
                    return f"rotary positions ({how}, base {base:g}{part})"
    return None


def rotation_tables(trace: Trace, tid: int, reach: int = 24) -> list[Tensor] | None:
    """The tables a score operand was rotated by, found among the ``reach`` operations nearest it: for
    ``t * c1 + f(t) * c2`` (rotate-half, or halves rotated apart: ``x1 * cos - x2 * sin``) the two tables, each
    pair of entries divided by its length (so that a factor on both, xPos's, leaves the angle); for a complex
    product (``view_as_complex(q) * freqs_cis``) the smaller factor over its modulus. None when no such operation
    is found. A table is the smaller factor of its product, with positions and features (two axes or more)."""
    todo, seen, steps = [tid], {tid}, 0
    while todo and steps < reach:
        cur = todo.pop(0)
        steps += 1
        found = trace.maker(cur)
        if found is None:
            continue
        tables = _tables_of(trace, found[0])
        if tables is not None:
            return tables
        for i in found[0].in_ids:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return None


def _table(op: Op) -> Tensor | None:
    """The smaller factor of a product of two tensors, when it has two axes or more with its last over 1."""
    if op.name != "mul" or len(op.inputs) != 2:
        return None
    a, b = op.inputs
    small = a if a.numel() < b.numel() else b if b.numel() < a.numel() else None
    return small if small is not None and small.dim() >= 2 and small.shape[-1] > 1 else None


def _past_numbers(trace: Trace, found: tuple[Op, int] | None, steps: int = 3) -> tuple[Op, int] | None:
    """The maker of a term past its multiplications by a number (rotary-embedding-torch's ``t * cos * scale``,
    its xPos scale 1 when off)."""
    while found is not None and steps and found[0].name in ("mul", "div") and len(found[0].in_ids) == 1:
        found, steps = trace.maker(found[0].in_ids[0]), steps - 1
    return found


def _tables_of(trace: Trace, op: Op) -> list[Tensor] | None:
    if op.name == "mul" and len(op.inputs) == 2 and all(t.is_complex() for t in op.inputs):
        table = _table(op)  # a rotation: of modulus 1 (freqs_cis), or one common factor along the features
        modulus = None if table is None else table.abs().double()
        if table is None or modulus is None or not bool((modulus > 0).all()) or \
                not torch.allclose(modulus, modulus[..., :1].expand_as(modulus), rtol=1e-5):
            return None
        return [table.to(torch.complex128) / modulus]
    if op.name not in ("add", "sub") or len(op.in_ids) != 2:
        return None
    makers = [_past_numbers(trace, trace.maker(i)) for i in op.in_ids]
    tables = [_table(m[0]) if m is not None else None for m in makers]
    if tables[0] is None or tables[1] is None or tables[0].is_complex() or tables[1].is_complex() or \
            tables[0].shape != tables[1].shape:
        return None
    c1, c2 = tables[0].double(), tables[1].double()
    length = (c1 ** 2 + c2 ** 2).sqrt()  # cos^2 + sin^2: 1, or one factor along the features (xPos's)
    if not bool((length > 0).all()) or not torch.allclose(length, length[..., :1].expand_as(length), rtol=1e-5):
        return None
    return [c1 / length, c2 / length]


def rotation_problem(trace: Trace, tid: int, value: Tensor) -> str | None:
    """For a score operand made like rotary positions (t * cos + f(t) * sin, on all or part of the head dim), why
    it is not a rotation; "" when it is one (with frequencies of its own: scaled, YaRN, ...); None when the
    operand is not made that way. A rotation keeps each row's norm (up to one common factor, as YaRN's), so some
    tensor of the operand's shape a few operations back (the q or k before the positions) must have the
    operand's row norms up to that factor."""
    found = trace.maker(tid)
    if found is not None and found[0].name == "cat" and found[0].in_ids:
        op = found[0]
        dim = op.kwargs.get("dim", op.args[1] if len(op.args) > 1 and isinstance(op.args[1], int) else 0)
        if dim in (-1, value.dim() - 1):
            found = trace.maker(op.in_ids[0])  # partial rotary: the rotated part comes first
        else:  # memory keys joined along the tokens (x-transformers' mem_k before the rotated keys): the tokens' part
            sizes = [t.numel() for t in op.inputs]
            if len(sizes) != len(op.in_ids) or max(sizes) * 2 <= sum(sizes):
                return None
            return rotation_problem(trace, op.in_ids[sizes.index(max(sizes))], op.inputs[sizes.index(max(sizes))])
    elif found is not None and found[0].name in ("setitem", "copy_") and found[0].in_ids:
        found = trace.maker(found[0].in_ids[-1])  # written into a part of the tokens in place (CogVideoX's image part)
    if found is None or found[0].name not in ("add", "sub") or len(found[0].in_ids) != 2:
        return None
    if any(p is None or p[0].name not in ("mul", "div", "truediv") for p in (trace.maker(i) for i in found[0].in_ids)):
        return None
    norms = value.double().norm(dim=-1)
    ratios = []
    todo, seen = [tid], {tid}
    while todo and len(seen) < 40:
        cur = todo.pop(0)
        got = trace.value(cur) if cur != tid else None
        if got is not None and got.shape == value.shape:
            ratio = _norm_ratio(norms, got)
            if ratio is None:
                continue
            if float((ratio - ratio.mean()).abs().max()) <= 1e-6 * float(ratio.mean().abs()):
                return ""
            ratios.append(ratio)
        maker = trace.maker(cur)
        for i in maker[0].in_ids if maker is not None else ():
            if i not in seen:
                seen.add(i)
                todo.append(i)
    if not ratios:
        return None
    ratio = ratios[-1]
    return "the rotary positions are not a rotation: t * cos + f(t) * sin changes the norm of q or k row by row " \
           f"(by {float(ratio.min()):.3g} to {float(ratio.max()):.3g}; a sign lost in rotate_half?)"


def _norm_ratio(norms: Tensor, before: Tensor) -> Tensor | None:
    """Each row's norm ``norms`` over the norm of the same row of ``before``, on the rows that are not zero there
    (padding); None when there are none, or when a zero row became one that is not zero."""
    was = before.double().norm(dim=-1)
    rows = was > 1e-12 * float(was.max()) if was.numel() else was.bool()
    zeros = norms[~rows]
    if not bool(rows.any()) or (zeros.numel() and float(zeros.max()) > 1e-9 * float(norms.max())):
        return None
    return norms[rows] / was[rows]


def rotated_from(trace: Trace, tid: int) -> tuple[int, float] | None:
    """When the tensor ``tid`` is made like rotary positions (t * cos + f(t) * sin, on all or part of the head dim)
    and is a rotation of an ancestor of its shape a few operations back (each row's norm the ancestor's times one
    common factor): (that ancestor's key, the factor); else None."""
    value = trace.value(tid)
    found = trace.maker(tid)
    if value is None or found is None or value.is_complex() or not _made_like_a_rotation(trace, found[0]):
        return None
    norms = value.double().norm(dim=-1)
    for cur in trace.ancestors(tid, limit=40):
        got = trace.value(cur)
        if got is not None and got.shape == value.shape and not got.is_complex():
            ratio = _norm_ratio(norms, got)
            if ratio is None:
                continue
            if float((ratio - ratio.mean()).abs().max()) <= 1e-6 * float(ratio.mean().abs()):
                if torch.allclose(got.double() * float(ratio.mean()), value.double(), rtol=1e-6, atol=1e-9):
                    return None  # the same values (a copy into a cache): not rotated
                return cur, float(ratio.mean())
    return None


def scaled_rotation_source(trace: Trace, tid: int) -> int | None:
    """For ``tid`` made as t * cos * s + f(t) * sin * s (rotary positions that also scale each row: xPos), the key of
    t: the tensor of ``tid``'s shape that the first product's factors lead back to and that the second term was made
    from too; else None."""
    found = trace.maker(tid)
    value = trace.value(tid)
    if found is None or value is None or found[0].name not in _SUMS or len(found[0].in_ids) != 2:
        return None
    first, second = found[0].in_ids
    cur = first
    for _ in range(6):  # down the factors of the first term to the tensor they multiply
        made = trace.maker(cur)
        if made is None or made[0].name not in ("mul", "div", "truediv") or len(made[0].inputs) != 2 or \
                made[0].number() is not None:  # by tables (cos, sin, the scale per row), not by a number
            break
        same = [i for i, t in zip(made[0].in_ids, made[0].inputs, strict=False) if t.shape == value.shape]
        if len(same) != 1:
            break
        cur = same[0]
    made_from = trace.value(cur)
    if cur == first or made_from is None or made_from.shape != value.shape:
        return None
    return cur if cur in set(trace.ancestors(second, limit=24)) else None


def rotation_on_the_way(trace: Trace, tid: int) -> bool | None:
    """Was the score operand ``tid`` rotated (:func:`rotated_from`) somewhere between its projection and the
    product? True when some tensor it was made from is a rotation; False when the walk back reached the projection
    (a linear layer or a product) without one; None when it reached neither (keys from a cache filled before the
    call, say)."""
    todo, seen, reached = [tid], {tid}, False
    steps = 0
    while todo and steps < 48:
        cur = todo.pop(0)
        steps += 1
        if rotated_from(trace, cur) is not None:
            return True
        found = trace.maker(cur)
        if found is None:
            continue
        if found[0].name in ("linear", "addmm") or found[0].name in PRODUCTS or \
                (found[0].name == "module" and found[0].module):  # a layer with a weight of its own, hooked
            reached = True
            continue
        for i in found[0].value_inputs():  # not a template (a cache moved to q's dtype: cache.to(q))
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return False if reached else None


_SUMS = frozenset({"add", "sub", "add_", "sub_", "iadd", "isub"})


def _made_like_a_rotation(trace: Trace, op: Op) -> bool:
    """Was ``op``'s output made the way rotary code makes it: t * cos + f(t) * sin (a sum), those halves
    concatenated or stacked (and the stack flattened into pairs), written into t in place (``t[..., :d] = ...``),
    or a complex product turned real (``view_as_real(view_as_complex(t) * freqs)``)?"""
    for _ in range(3):
        if op.name in _SUMS and len(op.in_ids) == 2:
            return True
        if op.name in ("cat", "stack", "setitem", "copy_") and op.in_ids:
            inner = trace.maker(op.in_ids[-1] if op.name in ("setitem", "copy_") else op.in_ids[0])
            if inner is None:
                return False
            op = inner[0]
            continue
        if op.name in ("flatten", "view", "reshape") and op.in_ids:  # halves stacked, then flattened into pairs
            inner = trace.maker(op.in_ids[0])
            if inner is None or inner[0].name != "stack":
                return False
            op = inner[0]
            continue
        if op.name == "view_as_real" and op.in_ids:
            inner = trace.maker(op.in_ids[0])
            return inner is not None and inner[0].name in ("mul", "mul_", "imul") and inner[0].outputs[0].is_complex()
        return False
    return False


def scale_origin(trace: Trace, tid: int) -> Origin:
    """:meth:`Trace.origin` that also walks back through rotary positions: the factor of ``q / sqrt(d)`` applied
    before the rotation counts, as one applied after it does. The rotation's own common factor (YaRN's attention
    factor on cos and sin) belongs to the positions, not to the scale, and is left out."""
    factor, after = 1.0, 1.0
    for _ in range(4):
        origin = trace.origin(tid)
        factor *= origin.factor
        rotated = rotated_from(trace, origin.id) if origin.op is not None else None
        if rotated is not None and abs(rotated[1] - 1) < 1e-6:  # a factor right after a rotation of its own
            after *= origin.factor  # factor 1 (one already folded into cos and sin, then applied again, is a scale)
        if rotated is None and origin.op is not None and origin.op.name == "cat" and len(origin.op.in_ids) > 1:
            # keys joined with a learned or zero key (fairseq's bias_k, add_zero_attn): the tokens' part, the
            # largest, carries the scale the tokens' keys got
            sizes = [t.numel() for t in origin.op.inputs]
            if len(sizes) == len(origin.op.in_ids) and max(sizes) * 2 > sum(sizes):
                tid = origin.op.in_ids[sizes.index(max(sizes))]
                continue
        if rotated is None and origin.op is not None and origin.op.name in ("add", "radd", "add_", "iadd") and \
                len(origin.op.inputs) == 2 and len(origin.op.in_ids) == 2:
            # a learned bias broadcast onto q (Transformer-XL's u and v, added after icefall scales q): the scale
            # is the one the tokens' part got
            sizes = [t.numel() for t in origin.op.inputs]
            big = sizes.index(max(sizes))
            if sizes[1 - big] * 4 <= sizes[big] and origin.op.inputs[big].shape == origin.op.outputs[0].shape:
                tid = origin.op.in_ids[big]
                continue
        if rotated is None and origin.op is not None and (source := scaled_rotation_source(trace, origin.id)) is not \
                None:  # xPos: a rotation that also scales each row by s^i (q) or s^-i (k), which cancel in q . k:
            tid = source  # a factor applied before it counts as one applied after
            continue
        if rotated is None:
            return Origin(origin.id, factor, origin.op, origin.part, origin.parts, after)
        tid = rotated[0]
    return Origin(origin.id, factor, origin.op, origin.part, origin.parts, after)


_NORMS = frozenset({"rms_norm", "layer_norm", "normalize", "rsqrt", "group_norm", "l2norm"})


# what projects the tokens besides the products: a Linear, and a convolution (a 1 x 1 Conv2d making q, k and v from a
# map whose input a pre-norm normalised over its channels)
_PROJECTING = frozenset({"linear", "addmm", "conv1d", "conv2d", "conv3d"})


def _norm_op(trace: Trace, tid: int) -> tuple[Op, int] | None:
    """The normalisation (and its output's index) a score operand went through a few operations back, or None."""
    seen: set[int] = set()
    todo, steps = [tid], 0
    while todo and steps < 16:
        found = trace.maker(todo.pop(0))
        if found is None or id(found[0]) in seen:
            continue
        seen.add(id(found[0]))
        steps += 1
        if found[0].name in _NORMS or (found[0].module and "norm" in found[0].module.lower()):
            return found
        if found[0].name in PRODUCTS or found[0].name in _PROJECTING:
            return None  # the projection itself: no norm after it (a norm before it is the input's)
        todo.extend(found[0].in_ids)
    return None


def normalised(trace: Trace, tid: int) -> str | None:
    """The normalisation a score operand went through a few operations back (q/k norm), or None."""
    found = _norm_op(trace, tid)
    return None if found is None else found[0].module or found[0].name


def _proportional(v: Tensor, operand: Tensor) -> bool:
    """Is ``operand`` ``v`` times one number per leading slice (a temperature or a scale per head)?"""
    if v.shape != operand.shape:
        return False
    v, o = v.double(), operand.double()
    c = (v * o).sum((-2, -1), keepdim=True) / (v * v).sum((-2, -1), keepdim=True).clamp_min(1e-300)
    return bool(((o - c * v).abs() <= 1e-6 * (1 + o.abs().amax((-2, -1), keepdim=True))).all())


def unit_over_tokens(operand: Tensor, contracted: int | None, length: int | None = None) -> str | None:
    """When a score operand holds rows whose norms along its tokens are one number per slice (an item and head: 1,
    or a gain) while its norms along the features the product contracts are not: q or k normalised over the tokens
    by hand (``q / q.norm(dim=-2)``, ``q * rsqrt(q.pow(2).sum(-2))``); else None. The tokens are the one other axis
    of size ``length`` when there is one (an einsum's (B, L, H, D) operand), else the other of the last two."""
    if contracted is None or operand.dim() < 2 or not operand.is_floating_point():
        return None
    t = operand.double()
    contracted %= t.dim()
    sized = [a for a in range(t.dim()) if a != contracted and t.shape[a] == length]
    if len(sized) == 1:
        tokens = sized[0]
    elif contracted in (t.dim() - 1, t.dim() - 2):
        tokens = 2 * t.dim() - 3 - contracted
    else:
        return None
    if t.shape[tokens] < 3 or t.shape[contracted] < 3:
        return None
    along = t.norm(dim=tokens).movedim(contracted - (contracted > tokens), -1)  # (..., features)
    across = t.norm(dim=contracted).movedim(tokens - (tokens > contracted), -1)  # (..., tokens)
    flat_along, flat_across = along.reshape(-1, along.shape[-1]), across.reshape(-1, across.shape[-1])
    same = ((flat_along - flat_along[:, :1]).abs() <= 1e-6 * flat_along[:, :1].abs()).all()
    differ = ((flat_across - flat_across[:, :1]).abs() > 1e-3 * flat_across[:, :1].abs()).any()
    if not bool(same) or not bool(differ) or not bool((flat_along > 0).all()):
        return None
    return (f"q (or k) has one norm along its {t.shape[tokens]} tokens for every feature, and other norms along the "
            f"{t.shape[contracted]} features the scores sum over: it was normalised over the tokens, so each token's "
            "query depends on every other token, and the scores are not cosines")


def _unit_axes(trace: Trace, tid: int) -> tuple[Tensor, list[int]] | None:
    """The output of the normalisation behind a score operand, and the axes along which it has unit norm; None when
    there is no such normalisation or its output is no floating (..., a, b) tensor."""
    found = _norm_op(trace, tid)
    if found is None or found[1] >= len(found[0].outputs):
        return None
    value = found[0].outputs[found[1]]
    if not value.is_floating_point() or value.dim() < 2 or not value.numel():
        return None
    return value, [ax for ax in range(value.dim()) if bool(((value.double().norm(dim=ax) - 1).abs() < 1e-3).all())]


def normalised_over_tokens(trace: Trace, tid: int, d: int, length: int, operand: Tensor | None = None,
                           contracted: int | None = None) -> str | None:
    """When the normalisation behind a score operand made it of unit norm along the tokens (an axis of size
    ``length``) rather than along the head dim (size ``d``): what was seen, else None. Normalised over the tokens,
    each token's query (key) depends on every other token of the sequence, and the scores are no cosines.

    When the head dim and the tokens have one size (a Swin window of 16 tokens, heads of 16), sizes cannot tell the
    axes apart: ``operand`` (the product's operand) and ``contracted`` (the axis of it the product contracts, -1 or
    -2) then can, when the normalisation's output is that operand, or its transpose, up to a number per head."""
    normed = _unit_axes(trace, tid)
    if normed is None:
        return None
    value, unit = normed
    what = (f"{normalised(trace, tid)} makes q (or k) of unit norm along the {length} tokens, not along the head "
            f"dim of {d}: each token's query then depends on every other token, and the scores are not cosines")
    if d != length:
        sizes = {value.shape[ax] for ax in unit}
        return what if length in sizes and d not in sizes else None
    if operand is None or contracted not in (-1, -2) or value.shape[-2:] != (d, d):
        return None
    last_two = {ax - value.dim() for ax in unit} & {-1, -2}
    if _proportional(value, operand):
        axis = contracted
    elif _proportional(value.transpose(-1, -2), operand):
        axis = -3 - contracted  # the other of the last two
    else:
        return None
    return what if last_two == {-3 - axis} else None


def normalised_off_the_head(trace: Trace, tid: int, d: int) -> str | None:
    """When the normalisation behind a score operand made it of unit norm along axes none of which is the head dim
    (size ``d``): across the heads, or along the whole width before the heads were split. What was seen, else None.
    A cosine is of one head's q and k: normalised along another axis, the scores are not cosines."""
    normed = _unit_axes(trace, tid)
    if normed is None:
        return None
    value, unit = normed
    sizes = sorted({value.shape[ax] for ax in unit})
    if not unit or d in sizes:
        return None
    return (f"{normalised(trace, tid)} makes q (or k) of unit norm along an axis of {sizes[0]} (not along the head dim "
            f"of {d}: across the heads, or over the whole width before the heads were split), so the scores are not "
            "the cosines of each head's q and k")


_GAINS = frozenset({"mul", "rmul", "mul_", "div", "truediv", "div_", "itruediv"})


def _fixed_factor(trace: Trace, op: Op, tid: int) -> int | None:
    """For a multiplication (division) of the tensor ``tid`` by a number or by a small tensor made from no input
    of the run (a learned gain: a parameter, or one operation on parameters such as ``gamma + 1``): ``tid``'s
    operand index, else None."""
    if op.name not in _GAINS or len(op.in_ids) not in (1, 2) or tid not in op.in_ids:
        return None
    if op.number() is not None or len(op.in_ids) == 1:
        return op.in_ids.index(tid)
    at = op.in_ids.index(tid)
    other_id, other, this = op.in_ids[1 - at], op.inputs[1 - at], op.inputs[at]
    if (op.name in ("div", "truediv", "div_", "itruediv") and at != 0) or other.numel() * 4 > this.numel():
        return None
    made = trace.maker(other_id)
    if made is not None and any(trace.maker(i) is not None for i in made[0].in_ids):
        return None
    return at


# what puts rows side by side or pads them (local attention's look-around: F.pad, then slices joined by torch.cat,
# or Tensor.unfold)
_PLACING = frozenset({"pad", "cat", "concat", "concatenate", "stack", "unfold"})


def unit_before_gains(trace: Trace, tid: int, d: int) -> bool:
    """Was the score operand ``tid`` of unit norm along its head dim (size ``d``, the last axis) before a few
    multiplications by numbers and learned gains (NaViT's ``F.normalize(x) * sqrt(d) * gamma``, x-transformers'
    l2-normalised q/k times a learned scale)? Then what multiplies the scores is a temperature of that design."""
    for _ in range(8):
        turned = rotated_from(trace, tid)
        if turned is not None:  # rotary positions keep each row's norm: look at what was rotated
            tid = turned[0]
            continue
        found = trace.maker(tid)
        if found is None:
            return False
        op = found[0]
        value = op.outputs[found[1]] if found[1] < len(op.outputs) else None
        if value is not None and value.dim() >= 1 and value.shape[-1] == d and value.is_floating_point() and \
                value.numel() and bool(((value.double().norm(dim=-1) - 1).abs() < 1e-3).all()):
            return True
        src = op.main_input()
        if (op.name in LAYOUT or op.name in _PLACING) and src is not None:
            tid = src
            continue
        if not op.in_ids:
            return False
        big = op.in_ids[max(range(len(op.in_ids)), key=lambda i: op.inputs[i].numel())]
        if _fixed_factor(trace, op, big) is None:
            return False
        tid = big
    return False

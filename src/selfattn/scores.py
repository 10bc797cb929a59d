"""Score modifiers: functions of (score, b, h, i, j) applied to the scaled scores before masking.

``i`` is the query's position in key coordinates (bottom-right aligned: query row r of Lq sits at
``r + Lk - Lq``; the row index itself when Lq == Lk) and ``j`` the key's position. Modifiers are
written with broadcasting torch ops, so one definition serves every backend: the reference
applies it to the whole score matrix, the chunked backend tile by tile (with its gradient by
autograd in the backward), and a backend that only takes tensors gets additive modifiers as a
dense bias.

Shape legend: B batch, H query heads, Lq/Lk lengths.

Example:
    >>> from selfattn import scores
    >>> out = selfattn.attention(q, k, v, causal=True, score_mod=scores.alibi(scores.alibi_slopes(8)))
    >>> out = selfattn.attention(q, k, v, score_mod=scores.softcap(30.0))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ._fields import Declared

__all__ = ["ScoreMod", "alibi", "alibi_slopes", "chain", "custom", "learned_tensors", "softcap"]


class ScoreMod(Declared):
    """A score modifier. ``additive`` ones are ``score + bias(b, h, i, j)``.

    A modifier is made of its constructor's arguments (:meth:`fields`, :meth:`from_fields`): store
    each under its own name, or override both, so that ``torch.compile`` can take it apart.
    """

    additive = False

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        raise NotImplementedError

    def bias(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """``score_mod(s) - s`` of an additive modifier, computed in ``dtype`` (broadcastable to the scores)."""
        raise TypeError(f"{self!r} is not additive")

    def num_heads(self) -> int | None:
        """The number of heads this modifier is built for (None: any)."""
        return None

    def heads(self, start: int, count: int) -> ScoreMod:
        """This modifier on heads ``start:start + count`` of the call it was built for, seen as local
        heads 0..count-1: for a call that holds only those heads (one rank's heads in all-to-all
        context parallelism).

        Example:
            >>> mod = scores.alibi(scores.alibi_slopes(8)).heads(4, 4)   # slopes 4..7 for heads 0..3
        """
        for name, value in (("start", start), ("count", count)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "count" else 0):
                raise ValueError(f"heads {name} must be an int >= {1 if name == 'count' else 0}, got {value!r}")
        total = self.num_heads()
        if total is not None and start + count > total:
            raise ValueError(f"heads({start}, {count}) reaches past the {total} heads of {self!r}")
        return _Heads(self, start, count)


class _Alibi(ScoreMod):
    additive = True

    def __init__(self, slopes: Tensor) -> None:
        if not isinstance(slopes, Tensor) or slopes.dim() != 1 or not slopes.dtype.is_floating_point:
            raise TypeError(f"alibi slopes must be a 1-D float tensor (one per head), got {slopes!r}")
        self.slopes = slopes

    def bias(self, b, h, i, j, dtype=torch.float32):
        slopes = self.slopes.to(device=i.device, dtype=dtype)[h]
        return -slopes * (i - j).abs().to(dtype)

    def __call__(self, score, b, h, i, j):
        return score + self.bias(b, h, i, j, score.dtype)

    def num_heads(self) -> int:
        return self.slopes.numel()

    def __repr__(self) -> str:
        return f"alibi({self.slopes.numel()} heads)"


class _Softcap(ScoreMod):
    def __init__(self, cap: float) -> None:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
            raise ValueError(f"softcap needs a finite cap > 0, got {cap!r}")
        self.cap = float(cap)

    def __call__(self, score, b, h, i, j):
        return self.cap * torch.tanh(score / self.cap)

    def __repr__(self) -> str:
        return f"softcap({self.cap})"


class _Custom(ScoreMod):
    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor], additive: bool) -> None:
        if not callable(fn):
            raise TypeError(f"custom score modifiers need a callable (score, b, h, i, j) -> score, got {fn!r}")
        self.fn, self.additive = fn, additive

    def __call__(self, score, b, h, i, j):
        return self.fn(score, b, h, i, j)

    def bias(self, b, h, i, j, dtype=torch.float32):
        if not self.additive:
            return super().bias(b, h, i, j, dtype)
        zero = torch.zeros((1, 1, 1, 1), dtype=dtype, device=i.device)  # 4-D, so it sets the result's dtype
        return self.fn(zero, b, h, i, j)

    def __repr__(self) -> str:
        return f"custom({getattr(self.fn, '__name__', 'fn')})"


class _Chain(ScoreMod):
    def __init__(self, mods: tuple[ScoreMod, ...]) -> None:
        self.mods = mods
        self.additive = all(m.additive for m in mods)

    def __call__(self, score, b, h, i, j):
        for m in self.mods:
            score = m(score, b, h, i, j)
        return score

    def bias(self, b, h, i, j, dtype=torch.float32):
        if not self.additive:
            return super().bias(b, h, i, j, dtype)
        return sum((m.bias(b, h, i, j, dtype) for m in self.mods), torch.zeros((1, 1, 1, 1), dtype=dtype,
                                                                                device=i.device))

    def num_heads(self) -> int | None:
        sizes = {n for n in (m.num_heads() for m in self.mods) if n is not None}  # (no walrus: dynamo)
        if len(sizes) > 1:
            raise ValueError(f"chained score modifiers are built for different head counts {sorted(sizes)}")
        return sizes.pop() if sizes else None

    def __repr__(self) -> str:
        return " then ".join(map(repr, self.mods))


class _Heads(ScoreMod):
    """A modifier built for more heads, on heads start:start+count as local heads 0..count-1."""

    def __init__(self, inner: ScoreMod, start: int, count: int) -> None:
        self.inner, self.start, self.count, self.additive = inner, start, count, inner.additive

    def __call__(self, score, b, h, i, j):
        return self.inner(score, b, h + self.start, i, j)

    def bias(self, b, h, i, j, dtype=torch.float32):
        return self.inner.bias(b, h + self.start, i, j, dtype)

    def num_heads(self) -> int | None:
        return None if self.inner.num_heads() is None else self.count

    def __repr__(self) -> str:
        return f"{self.inner!r}[heads {self.start}:{self.start + self.count}]"


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi paper's geometric slopes, 2^(-8 k / n) for k = 1..n (interpolated for n not a power of 2)."""
    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (k + 1) for k in range(n)]

    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(n) + powers(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(slopes: Tensor) -> ScoreMod:
    """ALiBi: ``score - slopes[h] * |i - j|`` (with a causal mask: a linear penalty on distance).

    Args:
        slopes: float tensor (H,), one slope per query head; see :func:`alibi_slopes`.
    """
    return _Alibi(slopes)


def softcap(cap: float) -> ScoreMod:
    """Soft-capping (Gemma 2, Grok): ``cap * tanh(score / cap)``, scores stay within (-cap, cap)."""
    return _Softcap(cap)


def custom(fn: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor], *, additive: bool = False) -> ScoreMod:
    """A user modifier ``fn(score, b, h, i, j) -> score`` written with broadcasting torch ops.

    ``additive=True`` promises ``fn(s, ...) == s + fn(0, ...)``, which lets backends that only take
    tensors use it as a dense bias. Gradients flow to q, k, v, not into tensors ``fn`` closes over.
    """
    return _Custom(fn, additive)


def chain(*mods: ScoreMod) -> ScoreMod:
    """Apply modifiers in order (e.g. ALiBi, then soft-capping)."""
    for m in mods:
        if not isinstance(m, ScoreMod):
            raise TypeError(f"chain takes ScoreMod objects, got {type(m).__name__}")
    return _Chain(mods)


def _call(mod: ScoreMod, fn: Callable[..., object], args: tuple[Tensor, ...], shape: torch.Size, what: str) -> object:
    """``fn(*args)``; an error inside the user's function becomes a ValueError that names the
    modifier and the shapes it was given (out-of-memory errors pass through)."""
    try:
        return fn(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        given = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(("b", "h", "i", "j"), args[-4:], strict=True))
        raise ValueError(f"score_mod {mod!r} failed in {what} for scores of shape {tuple(shape)} (B, Hq, Lq, Lk), "
                         f"given {given}: {type(e).__name__}: {e}") from e


def _fit(mod: ScoreMod, out: object, shape: torch.Size, what: str, exact: bool) -> Tensor:
    """``out`` if it has ``shape`` (or, unless ``exact``, broadcasts to it), else a ValueError that
    names the modifier and both shapes."""
    if not isinstance(out, Tensor):
        raise TypeError(f"score_mod {mod!r} returned {type(out).__name__} from {what}; it must return a tensor")
    if out.shape == shape:
        return out
    try:
        fits = not exact and torch.broadcast_shapes(out.shape, shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"score_mod {mod!r} returned shape {tuple(out.shape)} from {what} for scores of shape "
                         f"{tuple(shape)} (B, Hq, Lq, Lk); it must return the scores' shape: write it with "
                         "broadcasting ops on (score, b, h, i, j) and don't reduce or reshape them")
    return out


def apply_score_mod(mod: ScoreMod, score: Tensor, idx: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """``mod(score, b, h, i, j)`` on a (B, Hq, rows, keys) block of scores, checked to return exactly
    the scores' shape, in their dtype; idx from :func:`selfattn.masks.positions`."""
    out = _call(mod, mod, (score, *idx), score.shape, "its call")
    return _fit(mod, out, score.shape, "its call", exact=True).to(score.dtype)


def score_mod_bias(mod: ScoreMod, idx: tuple[Tensor, Tensor, Tensor, Tensor], dtype: torch.dtype) -> Tensor:
    """The bias of an additive modifier on a block, computed in ``dtype`` and broadcastable to
    (B, Hq, rows, keys), checked like :func:`apply_score_mod`."""
    shape = torch.broadcast_shapes(*(t.shape for t in idx))
    bias = _call(mod, lambda b, h, i, j: mod.bias(b, h, i, j, dtype=dtype), idx, shape, "its bias")
    return _fit(mod, bias, shape, "its bias", exact=False).to(dtype)


def learned_tensors(mod: ScoreMod, heads: int, device: torch.device, dtype: torch.dtype, *, lq: int = 2,
                    lk: int = 2, rows: int = 2, keys: int = 2) -> tuple[Tensor, ...]:
    """The leaf tensors that need a gradient and that ``mod``'s scores depend on (a learned table, slopes,
    temperatures, whatever its function closes over), found by running it once on the first (1, heads,
    rows, keys) block of a call of lengths (lq, lk) under autograd and walking the graph back from its
    scores. A tensor reached through another (``slopes = log_slopes.exp()`` made before the call) is found
    as the leaf it comes from. Empty when grad mode is off or nothing it reads needs a gradient. A
    modifier that fails on that block raises as the call would (:func:`apply_score_mod`). Not for use
    while compiling."""
    if not torch.is_grad_enabled():
        return ()
    from .masks import positions  # masks imports this module

    rows, keys = max(1, min(rows, lq)), max(1, min(keys, lk))
    score = torch.zeros(1, heads, rows, keys, dtype=dtype, device=device, requires_grad=True)
    idx = positions(torch.arange(1), heads, 0, rows, 0, keys, lq, lk, device)
    out = apply_score_mod(mod, score, idx) if not mod.additive else score + score_mod_bias(mod, idx, dtype)
    found: dict[int, Tensor] = {}
    seen: set[int] = set()
    todo = [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf that wants a gradient
        if isinstance(variable, Tensor):
            if variable is not score:
                found[id(variable)] = variable
            continue
        todo.extend(next_node for next_node, _ in node.next_functions)
    return tuple(found.values())

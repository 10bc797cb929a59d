"""Before any work the ranks agree on the whole call.

Every rank sends every other rank its call's signature, point to point, so that each sees all of
them: a mismatch raises the same ``ValueError`` on every rank, naming each field that differs and
which ranks hold which value, and a rank that does not take part is named after ``timeout``.

What is compared:

- the shapes of this rank's q, k and v (batch, query heads, local length, head dims, k/v heads),
  their dtype (by name) and device type;
- the layout, the strategy, the ring's memory option, the local backend (all_to_all), causal, scale and
  dropout_p (to 1e-9), return_lse;
- the mask, the score modifier and the sinks, each by a fingerprint (:func:`fingerprint`): their structure
  (types and the fields they declare: numbers, strings, dtypes; functions by module, qualified
  name, bytecode, constants, defaults and the values they close over) and their tensors (shape,
  dtype and contents: every byte of a tensor of up to 2^16 elements, 2^16 evenly spaced elements
  of a larger one, in an exact integer checksum computed where the tensor lives).

Not compared: what a function reads from globals, and the elements of a large tensor between the
samples. The seed of dropout is not compared: every rank takes rank 0's.
"""

from __future__ import annotations

import enum
import hashlib
import types
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from .._fields import Declared
from ..backends import REGISTRY
from .group import Group
from .layout import LAYOUTS, Sharding
from .spec import MEMORY, STRATEGIES, Spec

__all__ = ["agree", "fingerprint"]

_SAMPLE = 1 << 16  # tensor elements a fingerprint reads at most
_DEPTH = 6  # how deep a fingerprint follows functions' closures and containers


def _checksum(t: Tensor) -> str:
    """An exact integer checksum of a tensor's bytes (all of them, or those of an evenly spaced
    sample of _SAMPLE elements), computed on its device; weights depend on the position."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n > _SAMPLE:
        flat = flat[torch.arange(_SAMPLE, device=flat.device) * (n - 1) // (_SAMPLE - 1)]
    x = flat.contiguous().view(torch.uint8).long()  # at most 8 * 2^16 bytes of < 2^8: sums stay below 2^58
    w = (torch.arange(x.numel(), device=x.device) * 0x9E3779B1 + 0x7F4A7C15) % (1 << 31)
    return f"{int((x * w).sum())}:{int(((x + 1) * (w ^ 0x5BD1E995)).sum())}"


def _feed(h: hashlib.blake2b, obj: object, depth: int) -> None:
    if isinstance(obj, Tensor):
        h.update(f"tensor{tuple(obj.shape)}{obj.dtype}:{_checksum(obj)};".encode())
    elif isinstance(obj, Declared):
        h.update(f"{type(obj).__module__}.{type(obj).__qualname__}(".encode())
        for name, value in obj.fields():
            h.update(f"{name}=".encode())
            _feed(h, value, depth)
        h.update(b")")
    elif isinstance(obj, (type(None), bool, int, float, str, torch.dtype, torch.device, enum.Enum)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    elif depth >= _DEPTH:
        h.update(f"<{type(obj).__qualname__}>".encode())
    elif isinstance(obj, (tuple, list)):
        h.update(f"{type(obj).__name__}[{len(obj)}](".encode())
        for x in obj:
            _feed(h, x, depth + 1)
        h.update(b")")
    elif isinstance(obj, types.FunctionType):
        h.update(f"fn {obj.__module__}.{obj.__qualname__}".encode())
        _feed_code(h, obj.__code__)
        _feed(h, obj.__defaults__, depth + 1)
        for cell in obj.__closure__ or ():
            try:
                _feed(h, cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                h.update(b"<empty>")
    elif isinstance(obj, types.MethodType):
        h.update(f"method of {type(obj.__self__).__qualname__}".encode())
        _feed(h, obj.__func__, depth + 1)
    else:
        h.update(f"<{type(obj).__module__}.{type(obj).__qualname__}>".encode())


def _feed_code(h: hashlib.blake2b, code: types.CodeType) -> None:
    h.update(code.co_code)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _feed_code(h, c)
        else:
            h.update(repr(c).encode())


def fingerprint(obj: object) -> int:
    """A 63-bit fingerprint of a mask or a score modifier (None included): see the module docstring
    for what it reads. Equal on every rank for equal objects, whatever the device."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, obj, 0)
    return int.from_bytes(h.digest(), "little") >> 1


@dataclass(frozen=True)
class _Field:
    """One entry of a call's signature: an int64 every rank sends, and how to show it."""

    name: str
    value: int
    show: Callable[[int], str] = str


def _named(name: str, value: str, names: tuple[str, ...]) -> _Field:
    """A field that is one of ``names``, sent as its index and shown by name (``len(names)``: another)."""
    return _Field(name, names.index(value) if value in names else len(names),
                  lambda i: names[i] if 0 <= i < len(names) else "another")


def _layout(layout: str | Sharding) -> _Field:
    """The layout: by name, or a :class:`Sharding` by a fingerprint of its chunks (every rank must hold the same)."""
    if isinstance(layout, str):
        return _named("layout", layout, LAYOUTS)
    h = hashlib.blake2b(repr((layout.kind, layout.length, layout.chunk, layout.owners)).encode(), digest_size=8)
    mine = int.from_bytes(h.digest(), "little") >> 1
    # another rank's value is only a number here: its own kind and length are not known on this rank
    return _Field("layout", mine, lambda x: f"a {layout.kind} Sharding of {layout.length} tokens (fingerprint {x:016x})"
                  if x == mine else f"another layout (fingerprint {x:016x})")


def _signature(spec: Spec, q: Tensor, k: Tensor, v: Tensor) -> list[_Field]:
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    dtype_names = tuple(str(d).removeprefix("torch.") for d in dtypes)
    backends = ("auto", *sorted(REGISTRY))
    fp: Callable[[int], str] = lambda x: f"fingerprint {x:016x}"  # noqa: E731
    return [_Field("batch size", q.shape[0]), _Field("q heads", q.shape[1]), _Field("local length", q.shape[2]),
            _Field("q head dim", q.shape[3]), _Field("k/v heads", k.shape[1]), _Field("v head dim", v.shape[3]),
            _named("dtype", str(q.dtype).removeprefix("torch."), dtype_names),
            _named("device type", q.device.type, ("cpu", "cuda", "xpu", "mps", "hpu", "meta")),
            _layout(spec.layout), _named("strategy", spec.strategy, STRATEGIES),
            _named("memory", spec.memory, MEMORY),
            _named("backend", spec.backend, backends), _Field("causal", int(spec.causal), lambda x: str(bool(x))),
            _Field("scale", round(spec.scale * 1e9), lambda x: f"{x / 1e9:g}"),
            _Field("dropout_p", round(spec.dropout_p * 1e9), lambda x: f"{x / 1e9:g}"),
            _Field("return_lse", int(spec.return_lse), lambda x: str(bool(x))),
            _Field("mask", fingerprint(spec.mask), fp), _Field("score_mod", fingerprint(spec.score_mod), fp),
            _Field("sinks", fingerprint(spec.sinks), fp)]


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]} have"


def agree(g: Group, spec: Spec, q: Tensor, k: Tensor, v: Tensor) -> Spec:
    """Exchange the call's signature with every other rank; name missing ranks and mismatches.

    Returns ``spec`` with rank 0's dropout seed. Every rank sees every signature, so a mismatch
    raises the same ValueError on every rank.
    """
    if g.world == 1:
        return spec
    fields = _signature(spec, q, k, v)
    send = torch.tensor([f.value for f in fields] + [spec.seed], dtype=torch.int64, device=q.device)
    others = {r: torch.empty_like(send) for r in range(g.world) if r != g.rank}
    ops = [dist.P2POp(dist.isend, send, g.peer(r), g.group) for r in others]
    ops += [dist.P2POp(dist.irecv, buf, g.peer(r), g.group) for r, buf in others.items()]
    g.wait(dist.batch_isend_irecv(ops), "the call's shapes and options", list(others) * 2)
    table = {r: buf.tolist() for r, buf in others.items()}
    table[g.rank] = send.tolist()
    diffs = []
    for i, f in enumerate(fields):
        holders: dict[int, list[int]] = {}
        for r in range(g.world):
            holders.setdefault(table[r][i], []).append(r)
        if len(holders) > 1:
            diffs.append(f"{f.name}: " + ", ".join(f"{_ranks(rs)} {f.show(x)}" for x, rs in holders.items()))
    if diffs:
        raise ValueError(f"selfattn.distributed.attention was called with different arguments on different "
                         f"ranks ({'; '.join(diffs)}); every rank must pass its shard of the same global tensors "
                         "with the same layout, strategy, options, mask and score_mod (of varlen_attention: "
                         "cu_seqlens, causal and window make the mask, softcap the score_mod)")
    return replace(spec, seed=table[0][-1])

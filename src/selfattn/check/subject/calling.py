"""How the module is called and at which sizes it runs.

The call style (forward(x), forward(q, k, v) or the user's adapter), a mask the forward requires
(its convention found before any other probe, so that "no mask" can be sent as the mask that hides
nothing), the layout (a module that mixes dim 0 and keeps dim 1 apart is sequence-first, as
``nn.MultiheadAttention(batch_first=False)``), and the sizes: the batch and length limits a module
has by design (a cache allocated for N rows, a causal buffer of N positions, a window of N tokens)
are found by trying and bisecting and reported as facts; failures that follow no limit are findings.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from torch import Tensor, nn

from ..findings import BATCH_MIXING, SHAPE_DEPENDENT, STATE_DEPENDENT, WRONG_OUTPUT_SHAPE, Finding
from .building import CannotRun, Sizes, WrongShape, build_keras, num_heads_of
from .caller import (
    LENGTH_NAMES,
    UNSET,
    Caller,
    MaskSpec,
    dependency,
    find_call_style,
    forward_signature,
    mask_parameters,
    module_state,
    named_like_mask,
    required_mask_parameter,
    restore,
    takes_two_sequences,
    tensors_in,
)
from .context import Outcome, close, probe_keep, tolerance

__all__ = ["KIND_ORDER", "SHAPE_ORDER", "calling", "calls_in_a_row"]

SHAPE_ORDER = ("BLL", "B1LL", "BL", "B1L", "B11L", "LL")  # per-item shapes first: padding differs per item
KIND_ORDER = ("keep", "keep-int", "keep-float", "additive")  # bool "keep" also finds bool "ignore"
_SEQUENCE_FIRST = ("sequence-first: the module takes (L, B, E) (as nn.MultiheadAttention with batch_first=False); "
                   "the doctor sends x.transpose(0, 1)")


def _randn(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


def _required_mask_caller(module: nn.Module, style: str, arg: str | None, x: Tensor,
                          adapter: Callable | None = None, stated: MaskSpec | None = None,
                          errors: list[str] | None = None, declared: str | None = None) -> Caller | None:
    """A caller for a forward (or an adapter) that requires its mask: the first (shape, kind) whose band mask
    hides exactly the band's complement (bool masks read either way), batch first or else sequence first (a
    Megatron-style [s, b, h] forward with its [b, 1, s, s] mask), else the first that runs; None if none runs
    (``errors`` then gets what the first form raised: the module's own failure, not a missing argument).
    ``declared``: the bool convention the user stated ("keep" or "ignore"), the only one a bool mask is sent in
    (torchaudio's required ``key_padding_mask``, True = padding, must get all False to hide nothing)."""
    b, length, _ = x.shape
    off = ~torch.eye(length, dtype=torch.bool)
    first: Caller | None = None
    runs: Caller | None = None
    # a bool mask read either way is found by "keep", unless its "hide nothing" hides everything (True = masked,
    # an (L, L) triu mask that a from-scratch model builds for its blocks): then "ignore" is sent as such
    kinds = {"keep": KIND_ORDER, "ignore": ("ignore", "additive")}.get(declared or "", (*KIND_ORDER, "ignore"))
    forms = [(shape, kind) for shape in SHAPE_ORDER for kind in kinds]
    if arg in LENGTH_NAMES:  # padding given as lengths (d2l's valid_lens)
        forms.insert(0, ("B", "lengths"))
    if stated is not None:  # the convention the user stated is the one the module is called with
        forms = [(stated.shape, stated.kind)]
    layouts = ("batch-first",) if adapter is not None else ("batch-first", "sequence-first")
    for layout, (shape, kind) in ((lay, form) for lay in layouts for form in forms):
        c = Caller(module, style, arg, MaskSpec(kind, shape), adapter=adapter, required=True, layout=layout)
        keep = probe_keep(b, length, c.key_only, c.at_end)
        try:
            with torch.no_grad():
                mask = c.module_mask(keep)
                if c(x, mask).shape != x.shape or c(x).shape != x.shape:
                    continue
                seen = dependency(partial(c, mask=mask), x)
                full = dependency(c, x)
        except Exception as err:  # not this shape or kind
            if errors is not None and not errors:
                errors.append(f"{type(err).__name__}: {err}"[:300])
            continue
        runs = runs or c
        if not bool(full.any()):  # its "hide nothing" mask hides everything (an additive 0 read as a bool)
            continue
        first = first or c
        k0 = keep[0]
        rows = (k0 & full & off).any(-1) & (~k0 & full & off).any(-1)
        if not bool(rows.any()):  # no row sees a kept and a hidden key: nothing to match (a layout that mixes no
            continue              # tokens, each query seeing its own key only)
        if torch.equal((seen & off)[rows], (k0 & full & off)[rows]):
            return c
        if kind == "keep" and stated is None and declared is None and \
                torch.equal((seen & off)[rows], (~k0 & full & off)[rows]):
            return c.with_mask(MaskSpec("ignore", shape), arg)
    # no form shows a dependency: an output that depends on no token (a zero-initialised output projection, which
    # the doctor re-initialises later) still runs with the first form that does
    return first or runs


# required forward parameters that carry where the tokens are (gpt-fast's input_pos, transformers' cache_position and
# position_ids, a start offset): the doctor gives them the positions of a plain call, 0..L-1 from the start; not
# "pos", which DETR-style modules take as a positional embedding
_OFFSET_NAMES = ("start_pos", "offset", "start_position", "pos_offset")
_POSITION_NAMES = ("input_pos", "cache_position", "positions", "position_ids", "input_positions")


def _positions_adapter(module: nn.Module) -> tuple[Callable, str] | None:
    """``call(module, x[, mask])`` giving each required positional-information parameter of forward its plain value
    (an offset 0; positions 0..L-1, (B, L) for ``position_ids``), and the note that says so; None when forward
    requires none (or requires anything else, which only the user's --call can give)."""
    try:
        params = list(forward_signature(module).parameters.values())
    except (TypeError, ValueError):
        return None
    rest = [p for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty]
    if not rest or any(p.name not in _OFFSET_NAMES + _POSITION_NAMES for p in rest):
        return None
    masks = [a for a in mask_parameters(module, "x") if a is not None and named_like_mask(a)]

    def positions(x: Tensor) -> dict[str, object]:
        b, n = x.shape[0], x.shape[1]
        at = torch.arange(n, device=x.device)
        return {p.name: 0 if p.name in _OFFSET_NAMES else at.expand(b, n) if p.name == "position_ids" else at
                for p in rest}

    names = ", ".join(p.name for p in rest)
    if not masks:
        def plain(m: nn.Module, x: Tensor) -> object:
            return m(x, **positions(x))
        plain.why_no_mask = "forward has no mask argument"  # type: ignore[attr-defined]  # the mask probe's note
        return plain, f"{names} given the positions of the tokens, from 0"

    def call(m: nn.Module, x: Tensor, mask: object = None) -> object:
        return m(x, **positions(x), **({} if mask is None else {masks[0]: mask}))
    return call, f"{names} given the positions of the tokens, from 0; the mask to {masks[0]}"


def _caller_for(module: nn.Module, x: Tensor, stated: MaskSpec | None = None,
                declared: str | None = None) -> tuple[Caller | None, str]:
    style, why = find_call_style(module, x)
    if style:
        return Caller(module, style), ""
    given = []
    # a mask the signature requires, or one the module cannot do without in practice
    for style in ("x", "qk", "qkv") if takes_two_sequences(module) else ("x", "qkv"):
        named = [a for a in mask_parameters(module, style) if named_like_mask(a)]
        arg = required_mask_parameter(module, style) or (named[0] if named else None)
        if arg is None and stated is not None:  # the user states a mask: the one argument forward requires beside
            arg = required_mask_parameter(module, style, any_name=True)  # x takes it (a graph's adjacency)
        if arg is not None:
            errors: list[str] = []
            found = _required_mask_caller(module, style, arg, x, stated=stated, errors=errors, declared=declared)
            if found is not None:
                return found, ""
            head = {"x": "forward(x, ", "qk": "forward(q, kv, "}.get(style, "forward(q, k, v, ")
            given += [f"{head}{arg}=...): {e}" for e in errors]
    return None, "; ".join([*given, why] if why else given)  # what the module raised first: it is what matters


def _pooled(wrong: list[tuple[tuple[int, int, int], str]]) -> str:
    """When every output was (B, Q, E) for inputs (B, L, E), Q the same at every length and below it: what that says
    (a few learned or class-token queries over the tokens); else ""."""
    outs = []
    for (b, n, e), out in wrong:
        try:
            shape = ast.literal_eval(out)
        except (ValueError, SyntaxError):
            return ""
        if not isinstance(shape, tuple) or len(shape) != 3 or shape[0] != b or shape[2] != e or shape[1] >= n or \
                shape[1] == 0:  # no row at all pools nothing: a slice that drops every token (out[:, :-0])
            return ""
        outs.append(shape[1])
    if not outs or len(set(outs)) != 1 or len(wrong) < 2:
        return ""
    return (f": it returns {outs[0]} row(s) at every length (attention pooling or class attention: learned or "
            "class-token queries over the tokens), which is no self-attention; the doctor checks attention that "
            "gives a row per token")


def _runs(call: Caller, shape: tuple[int, int, int], gen: torch.Generator, dtype: torch.dtype,
          device: torch.device) -> str | None:
    """None if the module returns (B, L, E) for this shape, else why not."""
    try:
        with torch.no_grad():
            out = call(_randn(gen, shape, dtype, device))
    except Exception as err:
        return f"{type(err).__name__}: {err}"[:300]
    return None if tuple(out.shape) == shape else f"output {tuple(out.shape)}"


def _sort_runs(call: Caller, shapes: list[tuple[int, int, int]], gen: torch.Generator, dtype: torch.dtype,
               device: torch.device) -> tuple[list, list, list]:
    """The shapes the module runs at, those it returns another shape for (with it), and those it fails at (why)."""
    ran, wrong, failed = [], [], []
    for shape in shapes:
        why = _runs(call, shape, gen, dtype, device)
        if why is None:
            ran.append(shape)
        elif why.startswith("output "):
            wrong.append((shape, why[7:]))
        else:
            failed.append((shape, why))
    return ran, wrong, failed


def runs_at(call: Caller, b: int, n: int, e: int, gen: torch.Generator, dtype: torch.dtype,
            device: torch.device) -> bool:
    """Does the module return (B, L, E) for this shape?"""
    return _runs(call, (b, n, e), gen, dtype, device) is None


def _largest(ok: int, bad: int, runs: Callable[[int], bool]) -> int:
    """The largest n in [ok, bad) for which ``runs(n)``, knowing runs(ok) and not runs(bad) (bisection)."""
    while bad - ok > 1:
        mid = (ok + bad) // 2
        ok, bad = (mid, bad) if runs(mid) else (ok, mid)
    return ok


def _image_layout(module: nn.Module, adapter: Callable | None, sizes: Sizes, e: int, gen: torch.Generator,
                  dtype: torch.dtype, device: torch.device) -> tuple[Caller, list[tuple[int, int, int]]] | None:
    """A caller sending the input channels first as (B, E, L), or as an image (channels first, then last), and the
    shapes it runs at, when the module runs on one of those (a convolutional block's attention, a diffusion model's
    attention block); None otherwise."""
    lengths = sizes.lengths or (16, 9, 12, 49)  # 7 x 7: a window or reduction of 7 (Swin's, Twins')
    shapes = [(b, n, e) for n in lengths for b in ([sizes.batch] if sizes.batch else [2, 3])]
    # (B, E, L) first: a conv1d block's; (B, 1, L, E) last: one group of tokens of a (B, G, P, E) module
    for layout in ("channels-first-1d", "channels-first", "channels-last", "grouped"):
        base = Caller(module, "adapter", adapter=adapter) if adapter is not None else Caller(module, "x")
        call = replace(base, layout=layout)
        ran = [shape for shape in shapes if _runs(call, shape, gen, dtype, device) is None]
        if ran:
            return call, ran
    return None


def _unchanged(a: Tensor, b: Tensor, rtol: float) -> bool:
    """``close``, with a NaN in the same place of both taken as no change (a row that sees no key stays NaN)."""
    both = a.isnan() & b.isnan()
    return close(a.masked_fill(both, 0), b.masked_fill(both, 0), rtol)


def _sequence_first(call: Caller, x: Tensor, gen: torch.Generator, rtol: float, unpacked_so: bool = False) -> bool:
    """Does the module keep dim 1 apart and mix dim 0 (an (L, B, E) module given (B, L, E))? ``unpacked_so``: its
    source unpacks its input length first, then batch (:func:`_source_sequence_first`), which settles a module that
    mixes along both dims (a sequence-first one with a bug of its own: no layout keeps its items apart)."""
    if x.shape[0] < 2 or x.shape[1] < 2:
        return False
    with torch.no_grad():
        out = call(x)
        x2 = x.clone()
        x2[0] = _randn(gen, x2[0].shape, x.dtype, x.device)
        if _unchanged(call(x2)[1:], out[1:], rtol):
            return False
        x3 = x.clone()
        x3[:, 0] = _randn(gen, x3[:, 0].shape, x.dtype, x.device)
        return _unchanged(call(x3)[:, 1:], out[:, 1:], rtol) or unpacked_so


_LENGTH_WORDS = frozenset({"t", "l", "n", "s", "tgt_len", "src_len", "seq_len", "seqlen", "length", "len", "time",
                           "num_tokens", "n_tokens", "tokens", "seq_length", "q_len", "query_len"})
_BATCH_WORDS = frozenset({"b", "bsz", "bs", "batch", "batch_size", "nbatches", "n_batch"})
_UNPACKED_SIZE = re.compile(r"(\w+)\s*,\s*(\w+)\s*,\s*\w+\s*=\s*\w+\.(?:size\(\)|shape)")


def _source_sequence_first(module: nn.Module) -> bool:
    """Does the module's forward unpack its input's sizes length first, then batch (fairseq's ``tgt_len, bsz,
    embed_dim = query.size()``)?"""
    try:
        source = inspect.getsource(type(module).forward)
    except Exception:  # no Python source: a built-in, a TorchScript module's compiled forward
        return False
    match = _UNPACKED_SIZE.search(source)
    return match is not None and match.group(1).lower() in _LENGTH_WORDS and match.group(2).lower() in _BATCH_WORDS


def _window_tokens(module: nn.Module) -> set[int]:
    """The token counts of the windows a module declares (``window_size = (4, 4)`` is 16 tokens; an int is a side)."""
    found = set()
    for m in module.modules():
        for name, value in vars(m).items():
            if "window" not in name.lower():
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                found |= {value, value * value}
            elif isinstance(value, (tuple, list)) and 1 < len(value) <= 3 and \
                    all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                found.add(math.prod(value))
    return found


def _pair_table(module: nn.Module, n: int) -> str | None:
    """The name of a tensor the module holds over n x n token pairs (a learned (H, n, n) score bias, an (n, n) mask
    buffer), outside its linear and convolution layers, whose (d, d) weights a per-head projection may hold; else
    None."""
    for name, m in module.named_modules():
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)):
            continue
        for own, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.dim() >= 2 and t.shape[-1] == t.shape[-2] == n:
                return f"{name}.{own}" if name else own
    return None


def _relative_window(module: nn.Module) -> int | None:
    """The tokens of the 2-D or 3-D window (a ``window_size`` tuple, at most 256 tokens) of a module that holds a
    relative-position table for it (Swin's ``relative_position_bias_table``), else None."""
    tables = any("relative_position" in name for name, _ in
                 [*module.named_parameters(), *module.named_buffers()])
    if not tables:
        return None
    for m in module.modules():
        for name, value in vars(m).items():
            if "window" in name.lower() and isinstance(value, (tuple, list)) and 1 < len(value) <= 3 and \
                    all(isinstance(v, int) and not isinstance(v, bool) and v > 1 for v in value) and \
                    math.prod(value) <= 256:
                return math.prod(value)
    return None


def _sizes_in(module: nn.Module) -> set[int]:
    """Sizes a module with a fixed length carries: its buffers' and parameters' dims, and products of int pairs
    among its attributes (a window of (7, 7) is 49 tokens)."""
    found = {d for t in (*module.buffers(), *module.parameters()) for d in t.shape}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, (tuple, list)) and 1 < len(value) <= 3 and \
                    all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                found.add(math.prod(value))
    return found


def _discover_length(module: nn.Module, adapter: Callable | None, errors: list[str], e: int, tried: set[int],
                     gen: torch.Generator, dtype: torch.dtype, device: torch.device) -> tuple[Caller, int] | None:
    """A length the module runs at, among the numbers its error messages name and the sizes it carries (a fixed
    window of N tokens)."""
    # numbers in error messages up to 256 (beyond, they are mostly element counts of the shapes tried, each costly to
    # try with a mask over L x L); the module's own sizes up to 4096
    named = {int(n) for n in re.findall(r"\d+", " ".join(errors)) if int(n) <= 256} | _sizes_in(module)
    numbers = sorted({n for n in named if 2 <= n <= 4096} - tried - {e})
    for n in numbers[:12]:
        x = _randn(gen, (2, n, e), dtype, device)
        call = Caller(module, "adapter", adapter=adapter) if adapter is not None else _caller_for(module, x)[0]
        if call is not None and _runs(call, (2, n, e), gen, dtype, device) is None:
            return call, n
        # a sequence-first module (open_clip's text blocks take (L, B, E)) with its length fixed
        # (a module whose batch is fixed at n runs on (n, 2, E) too, but keeps its dim 0 apart)
        for style in [call] if call is not None else [Caller(module, "x"), Caller(module, "qkv")]:
            call = replace(style, layout="sequence-first")
            if _runs(call, (2, n, e), gen, dtype, device) is None and _runs(call, (3, n, e), gen, dtype,
                                                                             device) is None and \
                    _sequence_first(style, _randn(gen, (n, 3, e), dtype, device), gen, tolerance(dtype)):
                return call, n
    return None


def _square_length(module: nn.Module, adapter: Callable | None, e: int, skip: set[int], gen: torch.Generator,
                   dtype: torch.dtype, device: torch.device) -> tuple[Caller, int] | None:
    """A square length (a grid of tokens: 16, 9, 25, 36, 49, 64) the module runs at, other than ``skip``."""
    for n in (16, 9, 25, 36, 49, 64):
        if n in skip or n == e:
            continue
        x = _randn(gen, (2, n, e), dtype, device)
        call = Caller(module, "adapter", adapter=adapter) if adapter is not None else _caller_for(module, x)[0]
        if call is not None and _runs(call, (2, n, e), gen, dtype, device) is None:
            return call, n
    return None


def _discover_batch(module: nn.Module, adapter: Callable | None, errors: list[str], e: int, lengths: tuple[int, ...],
                    gen: torch.Generator, dtype: torch.dtype, device: torch.device) -> tuple[Caller, int] | None:
    """A batch size the module runs at (a cache allocated for exactly N rows, as gpt-fast's), among the numbers its
    error messages name and the sizes it carries."""
    named = {int(n) for n in re.findall(r"\d+", " ".join(errors))} | _sizes_in(module)
    for b in sorted(n for n in named if 2 <= n <= 64 and n != e)[:12]:
        shape = (b, lengths[0], e)
        x = _randn(gen, shape, dtype, device)
        call = Caller(module, "adapter", adapter=adapter) if adapter is not None else _caller_for(module, x)[0]
        if call is not None and _runs(call, shape, gen, dtype, device) is None:
            return call, b
    return None


def calling(module: nn.Module, sizes: Sizes, gen: torch.Generator, adapter: Callable | None = None,
            dtype: torch.dtype = torch.float32, device: torch.device | None = None,
            stated: MaskSpec | None = None, declared: str | None = None) -> Outcome[tuple[Caller, Tensor]]:
    """Find how the module is called and which shapes it runs for; pick the probe input.

    Args:
        module: the module, in eval mode.
        sizes: E (the input's last dim), and the batch and lengths the user fixed (None: the doctor picks).
        gen: the probes' random generator (first draws).
        adapter: the user's ``call(module, x[, mask])``, used instead of guessing.
        dtype, device: the module's parameter dtype and device; the probe input is made in them.
        stated: the mask convention the user stated: a mask the forward requires is made in it.
        declared: the bool polarity the user stated ("keep" or "ignore"): a bool mask the forward requires is made
            in it.

    Returns:
        Findings wrong-output-shape, batch-mixing (runs only when sizes coincide) or shape-dependent
        (fails for some sizes without a limit); notes call, output, layout, limits and probe shape;
        value (caller without a mask, probe input x (B, L, E)).

    Raises:
        CannotRun: the module runs for no shape, or never returns a (B, L, E) output.
    """
    device = device or torch.device("cpu")
    e = sizes.embed_dim
    positions = _positions_adapter(module) if adapter is None else None
    if positions is not None:
        adapter = positions[0]
    if sizes.lengths is None and sizes.batch is None:
        shapes = [(3, 7), (2, 5), (1, 6), (2, e), (1, e)] + ([(e, e)] if e <= 64 else [])
    else:
        lengths = sizes.lengths or (7, 5, 6)
        shapes = [(b, n) for n in lengths for b in ([sizes.batch] if sizes.batch else [3, 2, 1])]
    first = torch.zeros(*shapes[0], e, dtype=dtype, device=device)

    def once() -> object:
        if adapter is None:
            return module(first)
        try:
            return adapter(module, first)
        except TypeError:  # call(module, x, mask)
            return adapter(module, first, None)

    build_keras(module, once)
    call: Caller | None = Caller(module, "adapter", adapter=adapter) if adapter is not None else None
    notes: dict = {}
    coincidence, failed_first = "", []
    ran: list[tuple[int, int, int]] = []
    wrong, failed, errors = [], [], []
    why: str | None
    for b, n in shapes:
        shape = (b, n, e)
        if call is None:
            call, why = _caller_for(module, _randn(gen, shape, dtype, device), stated, declared)
            if call is None:
                failed.append((shape, why))
                errors.append(why)
                continue
        why = _runs(call, shape, gen, dtype, device)
        if why is not None and adapter is not None and call.takes_mask and not call.required and not ran:
            needs = _required_mask_caller(module, "adapter", None, _randn(gen, shape, dtype, device), adapter,
                                          stated, declared=declared)
            if needs is not None:  # the adapter's module cannot run without a mask: send the one hiding nothing
                call = needs
                why = _runs(call, shape, gen, dtype, device)
        if why is None:
            ran.append(shape)
        elif why.startswith("output "):
            wrong.append((shape, why[7:]))
        else:
            failed.append((shape, why))
            errors.append(why)
    # an image module given (B, L, E) fails, or broadcasts it into another shape (a norm over dim 1), or runs only
    # where L = E (a channels-first block reads dim 1 as its channels)
    as_images = ""
    if not ran or (adapter is None and all(s[1] == e for s in ran)):
        image = _image_layout(module, adapter, sizes, e, gen, dtype, device)
        as_images = " (and as images: channels first (B, E, L) and (B, E, H, W), channels last (B, H, W, E), one " \
            "group (B, 1, L, E))"
        if image is not None and (not ran or any(s[1] != e for s in image[1])):
            call, ran = image
            failed, errors, wrong = [], [], []
            notes["layout"] = (f"{call.layout}: the module takes (B, E, L) channels first; the doctor sends "
                               "x.transpose(1, 2)") if call.layout == "channels-first-1d" else \
                ("grouped: the module takes groups of tokens (B, G, L, E); the doctor sends its (B, L, E) input as "
                 "one group, x.unsqueeze(1)") if call.layout == "grouped" else \
                (f"{call.layout}: the module takes an image ((B, E, H, W) channels first, (B, H, W, E) channels "
                 "last); the doctor sends its (B, L, E) input as an H x W grid")
    if not ran and not wrong and sizes.lengths is None:
        discovered = _discover_length(module, adapter, errors, e, {n for _, n in shapes}, gen, dtype, device)
        if discovered is not None:
            call, n = discovered
            notes["length"] = f"runs only at length {n} among those tried (a size its errors or tensors name; " \
                              "--length states it)"
            if call.layout == "sequence-first":
                notes["layout"] = _SEQUENCE_FIRST
            heads = num_heads_of(module)
            lined_up = {e // heads, heads} if heads else {e // h for h in (1, 2, 4, 8, 16, 32) if e % h == 0}
            lined_up |= {v for v in (getattr(m, k, None) for m in (module, getattr(module, "config", None))
                                  for k in ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads"))
                      if isinstance(v, int) and not isinstance(v, bool)}
            square = _square_length(module, adapter, e, lined_up | {n}, gen, dtype, device) if n in lined_up else None
            if square is not None:  # it runs on a square grid of tokens (it lays them out itself): not a coincidence
                call, n = square
                notes["length"] = f"runs only at square lengths among those tried (a grid of tokens it lays out " \
                                  f"itself); probed at {n}; --length states it"
            table = _pair_table(module, n) if n in lined_up else None
            if n in lined_up and n in _window_tokens(module):  # a window's tokens (Swin's 4 x 4 at head dim 16)
                notes["length"] = f"runs only at length {n}, the tokens of its window (--length states it)"
            elif table is not None:  # a learned bias over n x n token pairs fixes the length, whatever the head dim
                notes["length"] = f"runs only at length {n}, the size of its table over token pairs ({table}; " \
                                  "--length states it)"
            elif n in lined_up:  # a product whose sizes match only by accident: L x D where D x L was meant
                coincidence = f"it runs only when the length equals a head count or head dim ({n}): a product whose " \
                              "sizes match only by accident (a transpose missing?); a module with a fixed length " \
                              "equal to one of those states it with --length"
            shapes = [(b, n) for b in ([sizes.batch] if sizes.batch else [3, 2, 1])]
            failed_first = [str(shape) for shape, _ in failed]
            ran, wrong, failed = _sort_runs(call, [(b, n, e) for b, _ in shapes], gen, dtype, device)
    if (call is None or (not ran and not wrong)) and sizes.batch is None:
        found_batch = _discover_batch(module, adapter, errors, e, sizes.lengths or (7, 5, 6), gen, dtype, device)
        if found_batch is not None:
            call, b = found_batch
            notes["batch size"] = f"runs only at batch size {b} among those tried (a size its errors or tensors " \
                                  "name, as a cache allocated for it; --batch states it)"
            ran, wrong, failed = _sort_runs(call, [(b, n, e) for n in sizes.lengths or (7, 5, 6)], gen, dtype,
                                            device)
    if call is None or (not ran and not wrong):
        last = errors[-1] if errors else (failed[-1][1] if failed else "no shape tried")
        raise CannotRun(f"the module failed on every input shape tried ({', '.join(str(s) for s, _ in failed)})"
                        f"{as_images}: "
                        f"{last[:300]}. If it runs only at some sizes, state them with --length (e.g. --length 49), "
                        "--batch and --embed-dim; if it needs other arguments, give --call")
    how = {"x": "forward(x)", "qk": "forward(q, kv) with q = kv = x", "qkv": "forward(q, k, v) with q = k = v = x",
           "adapter": "your call(module, x, mask)" if call.takes_mask else "your call(module, x) (no mask)"}
    if call.required:
        how[call.style] += ", with the mask it requires" + (f" ({call.mask_arg})" if call.mask_arg else "")
    output = "tensor (a tuple's first item; of a dict's tensors, the first of the input's shape)"
    if positions is not None:
        how["adapter"] = f"forward(x, ...) with {positions[1]}"
    found = Outcome[tuple[Caller, Tensor]](notes={"call": how[call.style], "output": output, **notes})
    if coincidence:
        found.findings.append(Finding.of(SHAPE_DEPENDENT, coincidence, {"fails for": failed_first}))
    if wrong:
        found.findings.append(Finding.of(WRONG_OUTPUT_SHAPE, "the output shape differs from the input shape "
                                         "(B, L, E)", {"input -> output": {str(i): str(o) for i, o in wrong}}))
    if failed and ran and all(len({*s}) < 3 for s in ran):  # runs only where sizes coincide: an image's tokens?
        ran += [(2, n, e) for n in (16, 9, 25, 36, 49) if n != e and _runs(call, (2, n, e), gen, dtype, device) is None]
    stepped = None
    if failed and ran:
        stepped = _limits(found, call, ran, wrong, failed, gen, dtype, device)
    good = ran
    if not good:
        pooled = _pooled(wrong)
        if wrong and not pooled:  # it runs and returns something else: that is the finding
            raise WrongShape("the module never returned a (B, L, E) output", found.findings[-1])
        raise CannotRun("the module never returned a (B, L, E) output; see wrong-output-shape" + pooled)
    if call.layout in ("channels-first", "channels-last", "channels-first-1d"):  # 16 tokens or more: a strided
        # reduction keeps 2 x 2 keys
        b, n, _ = min(good, key=lambda s: (s[0] < 2, s[1] < 16, s[1], s[0]))
    elif stepped is not None:  # lengths in steps: the shortest may leave one patch per frame, one window per row
        b, n, _ = stepped
    else:
        b, n, _ = (3, 7, e) if (3, 7, e) in good else min(good, key=lambda s: (s[0] < 2, s[1] > 64, s[0], s[1]))
        if _pools_tokens(module) and n < 16 and sizes.lengths is None and runs_at(call, b, 16, e, gen, dtype, device):
            n = 16  # keys pooled from the tokens (a 1-d pooling or a strided convolution): 16 tokens keep several
        window = _relative_window(module)
        if window is not None and n != window and sizes.lengths is None and \
                runs_at(call, b, window, e, gen, dtype, device):
            # a window with a 2-D relative-position table that runs at fewer tokens by slicing its index (monai's
            # Swin): fewer tokens are no window, and along one axis its 2-D relative bias is not relative
            n = window
            found.notes["length"] = f"probed at {window}, the tokens of the window its relative positions are laid " \
                                    "out for (--length states another)"
    x = _randn(gen, (b, n, e), dtype, device)
    # a layer replayed as its model calls it (check_model's adapter says which layout) keeps the model's layout: a
    # sequence-first layer the model hands (B, L, E) attends over the batch, as it does in the model
    replayed = getattr(call.adapter, "sequence_first", None) is not None
    if call.layout == "batch-first" and not replayed and \
            _sequence_first(call, x, gen, tolerance(dtype), _source_sequence_first(module)):
        call.layout = "sequence-first"
    if call.layout == "sequence-first":
        found.notes.setdefault("layout", _SEQUENCE_FIRST)
    found.notes["probe shape"] = (b, n, e)
    found.value = (call, x)
    return found


def _pools_tokens(module: nn.Module) -> bool:
    """Has the module a pooling or a strided convolution (a sequence reduction: keys and values from fewer positions
    than the queries, as PVT's, Next-ViT's or CvT's), which a short probe would leave with one key?"""
    for m in module.modules():
        if isinstance(m, (nn.AvgPool1d, nn.MaxPool1d, nn.AvgPool2d, nn.MaxPool2d, nn.AdaptiveAvgPool1d,
                          nn.AdaptiveAvgPool2d)):
            return True
        if isinstance(m, (nn.Conv1d, nn.Conv2d)) and any(st > 1 for st in m.stride):
            return True
    return False


def _square_image(call: Caller, b: int, e: int, tried: set[int], gen: torch.Generator, dtype: torch.dtype,
                  device: torch.device) -> list[int]:
    """The further square lengths the module runs at when it fails at most other ones (a map of sqrt(L) x sqrt(L)
    tokens, whose side rounds back to some other lengths by chance); [] when it does not."""
    squares = [n for n in (16, 36, 9, 49) if n not in tried][:2]
    others = [n for n in (8, 10, 12, 14, 15) if n not in tried]
    if not all(_runs(call, (b, n, e), gen, dtype, device) is None for n in squares):
        return []
    return squares if 2 * sum(_runs(call, (b, n, e), gen, dtype, device) is None for n in others) < len(others) \
        else []


def _limits(found: Outcome, call: Caller, ran: list, wrong: list, failed: list, gen: torch.Generator,
            dtype: torch.dtype, device: torch.device) -> tuple[int, int, int] | None:
    """Explain the sizes a module fails for: a batch or length limit (a fact), sizes that line up (batch-mixing),
    or neither (shape-dependent). Returns the shape to probe with when the module runs at lengths in steps past
    the longest one tried (TimeSformer's frames x patches + 1: 5, 9, 13), else None; ``ran`` gets those
    shapes."""
    ok = ran + [s for s, _ in wrong]
    evidence = {"runs for": [str(s) for s in ok], "fails for": {str(s): why[:200] for s, why in failed}}
    lengths = sorted({s[1] for s in ok})
    if lengths == [ok[0][2]] and len({s[0] for s in ok}) > 1:  # any batch, at one length that is also E: a length
        found.notes["lengths"] = (f"runs only at length {lengths[0]}, which is also its embed dim: read as the "
                                  "module's own length (a fixed resolution: --length states it)")
        return None
    if all(len({*s}) < 3 for s in ok) and any(len({*s}) == 3 for s, _ in failed) and \
            _runs(call, (2, 2 * lengths[-1], ok[0][2]), gen, dtype, device) is not None:  # two of B, L, E coincide
        found.findings.append(Finding.of(BATCH_MIXING, "the module runs only when batch, length and embed sizes "
                                         "line up: it mixes the batch or sequence dimension with another", evidence))
        return None
    e = ok[0][2]
    bad_b, bad_n = {s[0] for s, _ in failed}, {s[1] for s, _ in failed}
    square = {n for n in lengths if math.isqrt(n) ** 2 == n}
    if square == set(lengths) and all(math.isqrt(n) ** 2 != n for n in bad_n):  # a square image's tokens
        found.notes["lengths"] = f"runs at lengths {lengths}, perfect squares, and fails at {sorted(bad_n)}: the " \
                                 "tokens of a square image (--length states one)"
        return None
    more = _square_image(call, ok[0][0], ok[0][2], set(lengths), gen, dtype, device) \
        if bad_n and all(math.isqrt(n) ** 2 != n for n in bad_n) else []
    if more:
        # every square runs, most other lengths fail, a few run where a map's side sqrt(L) rounds back to L (SAM 2's
        # axial rotary at 6 tokens): a square image's tokens, probed at a square
        others = sorted(set(lengths) - square)
        ran[:] = [shape for shape in ran if shape[1] in square] + [(ok[0][0], n, ok[0][2]) for n in more]
        found.notes["lengths"] = f"runs at the perfect squares {sorted(square | set(more))}, fails at " \
                                 f"{sorted(bad_n)} and most other lengths, runs at {others} by chance: the tokens " \
                                 "of a square image, probed at a square (--length states one)"
        return None
    if bad_n.isdisjoint(lengths) and all(runs_at(call, b, n, e, gen, dtype, device) for b, n, _ in ok[:1]) and \
            _runs(call, (2, 2 * lengths[-1], e), gen, dtype, device) is None:  # failures follow the length only
        found.notes["lengths"] = f"runs at lengths {[*lengths, 2 * lengths[-1]]}, fails at {sorted(bad_n)} (a length " \
                                 "the module's windows or patches divide)"
        return None
    max_b, max_n = max(s[0] for s in ok), max(s[1] for s in ok)
    n_ok = min(s[1] for s in ok)
    b_ok = min(s[0] for s in ok)

    def runs(b: int, n: int) -> bool:
        return _runs(call, (b, n, e), gen, dtype, device) is None

    batches = {s[0] for s in ok}
    if len(batches) == 1 and next(iter(batches)) not in bad_b and all(runs(max_b, n) for n in sorted(bad_n)[:2]):
        found.notes["batch size"] = f"runs only at batch size {max_b} (a size its cache or buffers fix; --batch " \
                                    f"states it), at every length tried"
        return None
    if len(batches) == 1:  # a cache for exactly B rows and at most N positions (gpt-fast's): both at once
        long = {s[1] for s, _ in failed if s[0] == max_b}
        others = sorted(bad_n - long)
        if long and min(long) > max_n and others and all(runs(max_b, n) for n in others[:2]) and \
                not runs(max_b, min(long)):
            limit = _largest(max_n, min(long), lambda n: runs(max_b, n))
            found.notes["batch size"] = f"runs only at batch size {max_b} (a size its cache or buffers fix; --batch " \
                                        "states it)"
            found.notes["length limit"] = f"runs for length <= {limit} (fails at {limit + 1}: " \
                                          f"{_runs(call, (max_b, limit + 1, e), gen, dtype, device)})"[:300]
            return None
    if min(bad_b) > max_b and not runs(min(bad_b), n_ok):
        limit = _largest(max_b, min(bad_b), lambda b: runs(b, n_ok))
        found.notes["batch limit"] = f"runs for batch <= {limit} (fails at {limit + 1}: " \
                                     f"{_runs(call, (limit + 1, n_ok, e), gen, dtype, device)})"[:300]
        return None
    if min(bad_n) > max_n and not runs(b_ok, min(bad_n)):
        limit = _largest(max_n, min(bad_n), lambda n: runs(b_ok, n))
        longer = [n for n in range(limit + 2, limit + 26) if runs(b_ok, n)][:3]
        if longer == [limit + 2, limit + 3, limit + 4]:  # one length fails, the next ones run: no limit
            found.findings.append(Finding.of(SHAPE_DEPENDENT, f"the module fails at length {limit + 1} and runs at "
                                             f"{limit} and at {longer}: a length that lines up with another size",
                                             evidence))
            return None
        if longer:  # not a limit: lengths its reshapes divide (frames x patches + a class token)
            found.notes["lengths"] = (f"runs at lengths {[limit, *longer]} and at none between them tried (lengths "
                                      f"its reshapes divide); probed at {longer[0]}; --length states one")
            ran.extend((b_ok, n, e) for n in longer)
            return b_ok, longer[0], e
        found.notes["length limit"] = f"runs for length <= {limit} (fails at {limit + 1}: " \
                                      f"{_runs(call, (b_ok, limit + 1, e), gen, dtype, device)})"[:300]
        return None
    found.findings.append(Finding.of(SHAPE_DEPENDENT, "the module runs for some valid shapes and fails for others, "
                                     "with no batch or length limit that explains it", evidence))
    return None


def _grew(old: object, new: object) -> bool:
    """Did a tensor grow along its dims (a cache appended to), or appear?"""
    if old is UNSET:
        return True
    return isinstance(old, Tensor) and isinstance(new, Tensor) and old.dim() == new.dim() and \
        all(a <= b for a, b in zip(old.shape, new.shape, strict=True))


def _stale(call: Caller, x: Tensor, gen: torch.Generator) -> str | None:
    """Called on x and then on other tokens of the same shape: when the second call replaces none of the module's
    state and still differs from the module as given on those tokens, what the first call stored was read as if it
    were the second's (a cache reused because the shape matches), and the difference is returned; None otherwise. A
    cache that grows or is rewritten replaces something and is a design."""
    other = _randn(gen, tuple(x.shape), x.dtype, x.device)
    kept = replace(call, keep_state=True)
    with torch.no_grad():
        fresh = call(other)
        state = module_state(call.module)
        try:
            kept(x)
            after_first = module_state(call.module)
            second = kept(other)
            stored = [m for (_, m, attrs, buffers), (_, _, now_attrs, now_buffers) in
                      zip(after_first, module_state(call.module), strict=True)
                      if any(attrs.get(k, UNSET) is not v for k, v in now_attrs.items()) or
                      any(buffers.get(k, UNSET) is not v for k, v in now_buffers.items())]
        except Exception:  # calls in a row that fail are reported by the caller
            return None
        finally:
            restore(state)
    if stored or second.shape != fresh.shape or _agree(second, fresh, tolerance(x.dtype)):
        return None
    return f"{float((second - fresh).abs().max()):.3g}"


def _agree(a: Tensor, b: Tensor, rtol: float) -> bool:
    """:func:`close`, with NaN and inf where both have them counted as agreeing (a module that gives NaN on some rows
    gives it on every call alike: that is no state)."""
    if a.shape != b.shape:
        return False
    odd_a, odd_b = ~torch.isfinite(a), ~torch.isfinite(b)
    if not torch.equal(odd_a, odd_b) or not torch.equal(a[odd_a & ~a.isnan()], b[odd_b & ~b.isnan()]):
        return False
    return close(a.masked_fill(odd_a, 0), b.masked_fill(odd_b, 0), rtol)


def _sizes(module: nn.Module) -> dict[tuple[str, str, int], int]:
    """Each attribute or buffer of the module's submodules that is a tensor (its size along each axis) or a whole
    number (its value), by (submodule, name, axis); a list of tensors also by their sizes summed (``"+"``)."""
    found: dict[tuple[str, str, int], int] = {}
    for prefix, held, attrs, buffers in module_state(module):
        # a list appended to: of tensors (keys of each call), or of (keys, values) pairs, read by their first tensor
        tensors = [t[0] for v in attrs.values() if (t := tensors_in(v))] if isinstance(held, list) else []
        if tensors and all(t.dim() == tensors[0].dim() for t in tensors):
            # the chunks' sizes together (each call's own keys), and the last one's (each call's keys so far)
            found.update({(prefix, "+", axis): sum(t.shape[axis] for t in tensors) for axis in range(tensors[0].dim())})
            found.update({(prefix, "last", axis): size for axis, size in enumerate(tensors[-1].shape)})
        for key, value in {**attrs, **buffers}.items():
            if isinstance(value, Tensor):
                found.update({(prefix, key, axis): size for axis, size in enumerate(value.shape)})
            elif isinstance(value, int) and not isinstance(value, bool):
                found[(prefix, key, -1)] = value
    return found


def _continued(call: Caller, x: Tensor) -> str | None:
    """For a causal module that carries state from call to call (a KV cache): called on the first half of the tokens,
    then on the next one alone, then on the rest, the later calls must give the rows of one call on all of them; the
    difference when they do not (a cache position never advanced, keys stored in the wrong slots, a decode step's
    rotary one position off), None when they do or cannot be compared, or when no state grows by the tokens of each
    call (a memory of the last tokens, a running statistic: no cache); ``"raises ..."`` when a later call fails where
    each part runs alone (keys appended on another axis)."""
    half = x.shape[1] // 2
    kept = replace(call, keep_state=True)
    with torch.no_grad():
        whole = call(x)
        state = module_state(call.module)
        try:  # a prompt, one token decoded alone (a decode step may take its own path), then a chunk of the rest
            kept(x[:, :half].clone())
            sizes = [_sizes(call.module)]
            outs = []
            for part in (x[:, half:half + 1], x[:, half + 1:]):
                outs.append(kept(part.clone()))
                sizes.append(_sizes(call.module))
            rest = torch.cat(outs, dim=1)
        except Exception as err:  # a module that takes no shorter call: the calls in a row say what fails
            restore(state)
            try:  # each part alone runs: continuing the first is what fails (keys appended on another axis)
                for part in (x[:, :half], x[:, half:half + 1], x[:, half + 1:]):
                    call(part.clone())
            except Exception:
                return None
            return f"raises {type(err).__name__}: {err}"[:300]
        finally:
            restore(state)
    # a cache: some state grows by the tokens of each call (keys appended, a position advanced); a memory of the
    # last tokens or a running statistic does not, and is no cache to continue a sequence with
    steps = (1, x.shape[1] - half - 1)
    if not any(all(after.get(k) is not None and before.get(k) is not None and after[k] - before[k] == n
                   for before, after, n in zip(sizes[:-1], sizes[1:], steps, strict=True)) for k in sizes[0]):
        return None
    if rest.shape != whole[:, half:].shape or _agree(rest, whole[:, half:], tolerance(x.dtype)):
        return None
    return f"{float((rest - whole[:, half:]).abs().max()):.3g}"


def calls_in_a_row(call: Caller, x: Tensor, gen: torch.Generator, dep: Tensor | None = None) -> Outcome[None]:
    """When a call replaced some of the module's own state (which every probe's call put back): the calls a user
    makes in a row (a shorter input, the probe's, a longer one, the probe's again), with the state each leaves.

    A call that then fails where the module as given runs is a state-dependent finding, unless what the calls
    replaced only grew (a cache that accumulates, by design); outputs that differ from the module as given are a
    note (the module carries state from call to call), unless the module is causal (``dep``, what each query sees
    without a mask, hides exactly the later keys) and a call on the rest of the tokens after one on the first ones
    differs from those rows of one call (:func:`_continued`): a state-dependent finding."""
    found = Outcome[None]()
    if not call.replaced:
        return found
    b, n, e = x.shape
    shapes = [s for s in [(b, max(2, n // 2), e), (b, n, e), (b, 2 * n, e), (b, n, e)]
              if s[1] == n or _runs(call, s, gen, x.dtype, x.device) is None]
    inputs = [x if s[1] == n else _randn(gen, s, x.dtype, x.device) for s in shapes]
    with torch.no_grad():
        fresh = [call(t) for t in inputs]
        state = module_state(call.module)
        kept = replace(call, keep_state=True)
        failure, differs = None, []
        try:
            for i, t in enumerate(inputs):
                try:
                    out = kept(t)
                except Exception as err:
                    failure = (i, f"{type(err).__name__}: {err}"[:300])
                    break
                if not _agree(out, fresh[i], tolerance(x.dtype)):
                    differs.append(i)
        finally:
            changes = restore(state)
    names = ", ".join(f"{name} ({before} -> {after})" for name, (before, after) in call.replaced.items())
    order = " then ".join(str(tuple(s)) for s in shapes)
    stale = None if failure is not None else _stale(call, x, gen)
    if stale is not None:
        found.findings.append(Finding.of(STATE_DEPENDENT, f"a call replaces the module's own {names}; a second call "
                                         f"of the same shape on other tokens stores nothing and gives other outputs "
                                         f"than the module as given: it reuses what the first call stored (keys or "
                                         f"values cached from another input)", {"replaced": dict(call.replaced),
                                                                               "largest difference": stale}))
        return found
    # state made by the first call (absent before it) that the very next call, a longer one, cannot use: made for the
    # first call's length (a mask cut to it and stored back), not a cache that grew
    made_for_the_first = failure is not None and failure[0] == 1 and any(old is UNSET for _, old, _ in changes)
    if failure is not None and (made_for_the_first or not all(_grew(old, new) for _, old, new in changes)):
        i, why = failure
        found.findings.append(Finding.of(STATE_DEPENDENT, f"a call replaces the module's own {names}; called in a "
                                         f"row ({order}), the call at {tuple(shapes[i])} fails, where the module as "
                                         f"given runs: {why}", {"replaced": dict(call.replaced), "calls": order,
                                                                "fails at": str(tuple(shapes[i])), "error": why}))
        return found
    causal = dep is not None and x.shape[1] >= 4 and torch.equal(dep.cpu(), torch.ones_like(dep.cpu()).tril())
    # calls in a row may also agree with the module as given while the cache grows unread (keys appended, then only
    # the call's own kept): a sequence continued through it is then no continuation either
    grown = failure is not None  # a failure where the state only grew (a cache full): the same batch continued
    continued = _continued(call, x) if causal else None  # must still run
    if continued is not None and continued.startswith("raises "):
        found.findings.append(Finding.of(STATE_DEPENDENT, f"a call replaces the module's own {names} (a cache); called "
                                         f"on the first {x.shape[1] // 2} tokens, then on the next alone, then on the "
                                         f"rest, the later calls fail where each runs alone: the cache cannot "
                                         f"continue a sequence of the same batch (keys or values appended on another "
                                         f"axis): {continued[7:]}",
                                         {"replaced": dict(call.replaced), "error": continued[7:]}))
        return found
    if continued is not None and not grown:
        found.findings.append(Finding.of(STATE_DEPENDENT, f"a call replaces the module's own {names} (a cache); called "
                                         f"on the first {x.shape[1] // 2} tokens, then on the next alone, then on the "
                                         "rest, the later calls' outputs are not those rows of one call on all the "
                                         "tokens: the cache "
                                         "continues another sequence (its position never advanced, keys or values "
                                         "stored in other slots, rotary positions restarted)",
                                         {"replaced": dict(call.replaced), "largest difference": continued}))
        return found
    if failure is not None or differs:
        where = f"the call at {tuple(shapes[failure[0]])} fails (what it replaced only grew)" \
            if failure is not None else \
            f"the calls at {', '.join(str(tuple(shapes[i])) for i in differs)} give other outputs than the module " \
            "as given"
        found.notes["state"] = (f"a call replaces the module's own {names}; called in a row ({order}), {where}: "
                                "state carried from call to call, as a cache's; every probe's call met the module "
                                "as given")
    else:
        found.notes["state"] = (f"a call replaces the module's own {names} (a cache); calls in a row ({order}) "
                                "give the module's outputs as given")
    return found

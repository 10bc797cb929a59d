"""Mutation score of the doctor: small AST edits of a correct module's source, each checked by the doctor.

``selfattn check --mutate file.py:Class`` (or :func:`score`) edits the source of the class (and of
its bases defined in the same file, and of the module-level functions of that file it calls, such
as transformers' ``eager_attention_forward``, ``rotate_half``, ``repeat_kv``) one site at a time,
with the edits attention code gets wrong: drop or change the scale (``* self.scaling``,
``self.scale = d ** -0.5``, ``scale=``/``alpha=`` arguments), swap or drop a transpose, change the
softmax dimension, flip a mask's polarity (``==``/``!=``, ``~``, ``+ mask``/``- mask``), drop a
mask, move the mask after the softmax, swap the operands of a matmul, swap einsum or einops axes,
flip SDPA's ``is_causal``, drop ``.contiguous()``, drop a negation (rotary's ``rotate_half``),
shift a causal ``triu``/``tril`` offset. Each mutant is run through :func:`selfattn.check` with the
same options as the original:

- stillborn: it cannot be built or run at all (the doctor exits 2 on it);
- equivalent: same outputs as the original on every probe input and mask (excluded from the rate);
- killed: the doctor reports an error the original does not have;
- survivor: none of those; listed with the edit.

The user's file is read, never written; the mutants are compiled in memory (no bytecode). A class
of an installed package (``score("package.module:Class")`` or the class object) is mutated the same
way: the edited definitions are executed in a copy of the defining module's namespace (its
``__name__`` and ``__package__``, so relative imports work), never written to site-packages, and
``make(cls)`` builds each mutant as the original is built.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

from ..check.subject.building import CannotRun, build, embed_dim_of, load_file, user_callable
from ..check.subject.caller import MASK_SHAPES, Caller, MaskSpec, find_call_style, parse_mask
from .operators import Mutant, mutants

__all__ = ["Mutant", "Score", "main", "mutants", "score"]

@dataclass
class Score:
    """What the doctor made of a module's mutants."""

    module: str
    original_errors: list[str]
    total: int = 0
    stillborn: int = 0
    equivalent: int = 0
    killed: int = 0
    survivors: list[dict] = field(default_factory=list)
    killed_by: dict[str, int] = field(default_factory=dict)
    relabelled: int = 0  # survivors of an edit that only permutes a projection's columns (see RELABELLING)

    @property
    def non_equivalent(self) -> int:
        """Mutants that run and differ from the original somewhere: the rate's denominator (edits that only
        relabel weights are left out: no behaviour tells them from the original with its weights permuted)."""
        return self.total - self.stillborn - self.equivalent - self.relabelled

    @property
    def rate(self) -> float:
        """killed / non-equivalent (1.0 when there is none)."""
        return self.killed / self.non_equivalent if self.non_equivalent else 1.0


# Edits that give the same module with its weights permuted when they survive: swapping the grouped axes of a head
# split or merge, (h d) for (d h), permutes the columns a projection writes or reads; swapping q and k in an SDPA
# call gives softmax(K Q^T) V, which is the module with its query and key projections exchanged wherever q and k
# are projections of the same tokens (the doctor names the swap where they are not: cross-attention, grouped
# keys, positions on one side). They are counted apart.
RELABELLING = frozenset({"einops: swap a grouped axis", "swap q and k"})


def _load(source: str, path: Path, class_name: str) -> type:
    """Execute a file's (mutated) source as a module of its own; return the class.

    The module is in ``sys.modules`` while it runs (a ``@dataclass`` config class in the file looks
    its module up there) and is removed afterwards.
    """
    module = ModuleType(f"_selfattn_mutant_{uuid.uuid4().hex}")
    module.__file__ = str(path)
    folder = str(path.parent.resolve())
    sys.path.insert(0, folder)
    sys.modules[module.__name__] = module
    try:
        exec(compile(source, str(path), "exec"), vars(module))
    finally:
        sys.path.remove(folder)
        del sys.modules[module.__name__]
    return vars(module)[class_name]


def _load_into(source: str, module: ModuleType, class_name: str) -> type:
    """Execute the (mutated) definitions in ``source`` in a copy of ``module``'s namespace; return the class.

    The copy keeps the module's ``__name__``, ``__package__`` and imports, so the definitions resolve
    names (and relative imports) as the original does, and the module itself is left untouched.
    """
    namespace = dict(vars(module))
    exec(compile(source, getattr(module, "__file__", None) or f"<{module.__name__}>", "exec"), namespace)
    return namespace[class_name]


@dataclass
class _Target:
    """Where a class to mutate comes from: its file's source, and how a mutant's source becomes a class."""

    name: str  # the class name
    source: str  # the source of the file that defines it
    load: Callable[[str], type]  # mutant source -> class
    definitions_only: bool  # mutants hold only the mutated definitions (a package's file is never executed whole)


def _target(spec: str | type) -> _Target:
    """"path/to/file.py:Class", "package.module:Class" or a class -> the :class:`_Target`."""
    if isinstance(spec, str):
        path_s, sep, name = spec.rpartition(":")
        if not sep or not path_s or not name:
            raise CannotRun(f"expected path/to/file.py:ClassName or package.module:ClassName, got {spec!r}")
        if path_s.endswith(".py") or "/" in path_s or Path(path_s).is_file():
            path = Path(path_s)
            if not path.is_file():
                raise CannotRun(f"no such file: {path}")
            return _Target(name, path.read_text(), lambda src: _load(src, path, name), False)
        try:
            spec = getattr(importlib.import_module(path_s), name)
        except (ImportError, AttributeError) as e:
            raise CannotRun(f"cannot import {name} from {path_s}: {type(e).__name__}: {e}") from e
    if not isinstance(spec, type):
        raise CannotRun(f"expected a class, got {type(spec).__name__}")
    module = sys.modules.get(spec.__module__)
    try:
        source = inspect.getsource(module) if module is not None else None
    except (OSError, TypeError):
        source = None
    if module is None or source is None:
        raise CannotRun(f"the source of {spec.__module__} (defining {spec.__name__}) is not available")
    return _Target(spec.__name__, source, lambda src: _load_into(src, module, spec.__name__), True)


def _spec_of(note: dict) -> MaskSpec:
    """The :class:`MaskSpec` a report's "mask" note describes."""
    return MaskSpec(note["kind"], next(k for k, v in MASK_SHAPES.items() if v == note["shape"]))


def _outputs(module: nn.Module, options: dict, mask_note: object, original: bool = False) -> list[object]:
    """The module's outputs on the probe inputs, with and without the masks the original takes. ``original``: the
    module the mutants are compared with, which must give some output (a mutant may raise everywhere)."""
    torch.manual_seed(0)
    e = options.get("embed_dim") or embed_dim_of(module, 16)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    lengths = options.get("length") or (7, 5)
    lengths = [lengths, lengths] if isinstance(lengths, int) else list(lengths) * (2 if len(lengths) == 1 else 1)
    xs = [torch.randn(3, lengths[0], e, dtype=dtype), torch.randn(2, lengths[1], e, dtype=dtype)]
    adapter = options.get("call")
    layout = options.get("layout", "batch-first")
    style, why = ("adapter", None) if adapter else find_call_style(module, xs[0], layout)
    required = None
    if not style and isinstance(mask_note, dict) and "kind" in mask_note:  # a forward that requires its mask
        spec = _spec_of(mask_note)
        for candidate in ("x", "qk", "qkv"):
            with_mask = Caller(module, candidate, layout=layout).with_mask(spec, mask_note.get("argument"))
            try:
                with torch.no_grad():
                    with_mask(xs[0], with_mask.module_mask(torch.ones(3, lengths[0], lengths[0], dtype=torch.bool),
                                                           dtype))
            except Exception:
                continue
            style, required = candidate, with_mask
            break
    if not style and original:
        raise CannotRun(f"the module runs on no call the mutation tool tries ({why}); give --call (and --length "
                        "for a module that runs at some lengths only)")
    call = Caller(module, style, adapter=adapter if callable(adapter) else None, layout=layout)
    if required is not None:  # "without a mask" is then the mask that hides nothing
        def plain(t: Tensor) -> Tensor:
            n = t.shape[1]
            return required(t, required.module_mask(torch.ones(t.shape[0], n, n, dtype=torch.bool), t.dtype))
        runs: list[Callable[[], Tensor]] = [partial(plain, t) for t in xs] + [lambda: plain(xs[0] * 50)]
    else:
        runs = [partial(call, t) for t in xs] + [lambda: call(xs[0] * 50)]
    if isinstance(mask_note, dict) and "kind" in mask_note:
        spec = _spec_of(mask_note)
        masked = call.with_mask(spec, mask_note.get("argument"))
        n = xs[0].shape[1]
        i = torch.arange(n)
        keeps = [torch.ones(3, n, n, dtype=torch.bool)]
        keeps[0][0, :, 5:] = False
        if not spec.key_only:
            causal = i[None, :] <= i[:, None]
            keeps += [causal.expand(3, n, n), (causal & (i[None, :] >= i[:, None] - 2)).expand(3, n, n)]

        def with_keep(k: Tensor) -> Callable[[], Tensor]:
            return lambda: masked(xs[0], masked.module_mask(k, dtype))
        runs += [with_keep(k) for k in keeps]
        half = copy.deepcopy(module).half()
        runs.append(lambda: masked.for_module(half)(xs[0].half(), masked.module_mask(keeps[0], torch.float16)))
    else:
        half = copy.deepcopy(module).half()
        runs.append(lambda: call.for_module(half)(xs[0].half()))
    outs: list[object] = []
    for run in runs:
        try:
            with torch.no_grad():
                outs.append(run().float())
        except Exception as err:  # raising is a behaviour too: the mutant must raise the same way
            outs.append(type(err).__name__)
    if original and not any(isinstance(o, Tensor) for o in outs):  # nothing to compare a mutant with
        raise CannotRun(f"the module raises on every probe input the mutation tool gives it ({outs[0]}); give --call "
                        "(and --length for a module that runs at some lengths only)")
    return outs


_LAYOUTS = ("channels-first", "channels-last", "channels-first-1d", "grouped", "sequence-first")


def _namespace_of(cls: type) -> dict:
    """The globals of the file that defined ``cls`` (a mutant's own module): a function defined in its body holds
    them; {} when none does."""
    for value in vars(cls).values():
        if inspect.isfunction(value):
            return value.__globals__
    return {}


def _same(a: list[object], b: list[object]) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            if x.shape != y.shape or not torch.allclose(x, y, rtol=1e-4, atol=1e-5 * (1 + float(
                    y.nan_to_num(0, 0, 0).abs().max())), equal_nan=True):
                return False
        elif x != y:
            return False
    return True


def score(spec: str | type, options: dict | None = None, *, seed: int = 0,
          make: Callable[[type], nn.Module] | None = None) -> Score:
    """Mutate a class and check every mutant.

    Args:
        spec: the class of a correct module: ``path/to/file.py:ClassName``, ``package.module:ClassName``
            (an installed package's class: the source of its defining module is mutated in memory) or the
            class itself.
        options: :func:`selfattn.check` keyword arguments, the same for the original and every mutant.
        seed: the doctor's seed (and the seed each module is built under).
        make: ``make(cls)`` builds the module from the class (the original or a mutant), e.g.
            ``lambda cls: cls(config, layer_idx=0)``; default: the doctor's own guess (``init``,
            ``embed_dim`` from ``options``). Each mutant then gets the original's weights.

    Returns:
        The :class:`Score`.

    Raises:
        CannotRun: the file, module or class cannot be loaded, or the original cannot be built.
    """
    from ..check import check

    options = {k: v for k, v in (options or {}).items() if v is not None and v is not False}
    options.pop("seed", None)
    target = _target(spec)
    init = options.get("init")
    embed_dim = options.get("embed_dim") or 64  # as check builds a class

    def instance(cls: type) -> nn.Module:
        torch.manual_seed(seed)
        made = make(cls) if make is not None else build(cls, init, embed_dim)[0]
        made.eval()  # not chained: some modules' train() returns None
        return made

    try:
        original = instance(target.load(target.source))
    except CannotRun:
        raise
    except Exception as e:
        raise CannotRun(f"the original {target.name} cannot be built: {type(e).__name__}: {e}") from e
    base = check(copy.deepcopy(original), seed=seed, **options)
    options.pop("factory", None)
    note = base.inferred.get("mask")
    if "mask" not in options and "mask_convention" not in options and isinstance(note, dict) and "kind" in note:
        options["mask"] = _spec_of(note)  # the original's convention is the contract its mutants must keep
    if "causal" not in options and "bidirectional" not in options:  # and so is what its queries see
        if base.inferred.get("sees every key"):
            options["bidirectional"] = True
        elif base.inferred.get("causal"):  # a causal sliding window too: no query may see a later key
            options["causal"] = True
    base_errors = {f.id for f in base.findings if f.severity == "error"}
    result = Score(spec if isinstance(spec, str) else f"{spec.__module__}:{spec.__qualname__}", sorted(base_errors))
    # the mutants run as the doctor ran the original: at its probe length and in its layout (an image, a fixed
    # window) when the default lengths would not run it
    probe = base.inferred.get("probe shape")
    said = str(base.inferred.get("layout", "")).split(":")[0]
    run = {**options, **({"layout": said} if said in _LAYOUTS else {})}
    if "length" not in options and isinstance(probe, (list, tuple)) and len(probe) == 3 and probe[1] not in (5, 7):
        run["length"] = [int(probe[1])]
    reference = _outputs(original, run, base.inferred.get("mask"), original=True)
    for m in mutants(target.source, target.name, definitions_only=target.definitions_only):
        result.total += 1
        try:
            module = instance(target.load(m.source))
            # the original's weights, not its buffers: a buffer the mutated code builds (Swin's shift mask, made in
            # __init__) is the mutant's own
            weights = dict(original.named_parameters())
            module.load_state_dict({k: v for k, v in original.state_dict().items() if k in weights}, strict=False)
            outs = _outputs(module, run, base.inferred.get("mask"))
        except Exception:  # a mutant that cannot even be built is stillborn
            result.stillborn += 1
            continue
        if _same(outs, reference):
            result.equivalent += 1
            continue
        try:
            report = check(module, seed=seed, **options)
        except CannotRun:
            result.stillborn += 1
            continue
        except Exception as e:  # the doctor itself raised on a module that runs: not a kill, listed as such
            result.survivors.append({"operator": m.operator, "where": m.where,
                                     "findings": [f"the doctor raised {type(e).__name__}: {e}"[:200]]})
            continue
        new = {f.id for f in report.findings if f.severity == "error"} - base_errors
        if new:
            result.killed += 1
            for fid in new:
                result.killed_by[fid] = result.killed_by.get(fid, 0) + 1
        elif m.operator in RELABELLING:
            result.relabelled += 1
        else:
            result.survivors.append({"operator": m.operator, "where": m.where,
                                     "findings": sorted(report.ids)})
    return result


def main(spec: str, options: dict, *, as_json: bool = False) -> int:
    """``selfattn check --mutate``: print the score; exit 0 when at least 95% of non-equivalent mutants are named."""
    try:
        if isinstance(options.get("mask"), str):
            parse_mask(options["mask"])
        make = None
        factory = options.pop("factory", None)
        if isinstance(factory, str):  # evaluated in the namespace of each mutant's file, so it builds the mutant

            def make(cls: type) -> nn.Module:
                made = user_callable(factory, _namespace_of(cls))
                return made if isinstance(made, nn.Module) else made()  # "Attention()" as well as "lambda: ..."
        if isinstance(options.get("call"), str):
            options["call"] = user_callable(options["call"], vars(load_file(spec.rpartition(":")[0])))
        s = score(spec, options, seed=options.get("seed", 0), make=make)
    except (CannotRun, ValueError) as e:
        print(json.dumps({"error": str(e)}) if as_json else f"could not run: {e}")
        return 2
    data = {**asdict(s), "non_equivalent": s.non_equivalent, "kill_rate": round(s.rate, 4)}
    if as_json:
        print(json.dumps(data, indent=1))
    else:
        print(f"{spec}: {s.total} mutants: {s.stillborn} stillborn, {s.equivalent} equivalent, {s.non_equivalent} "
              f"non-equivalent; the doctor names {s.killed} ({100 * s.rate:.1f}%)")
        print(f"  original's errors: {s.original_errors or 'none'}; ids that killed: {s.killed_by}")
        for sv in s.survivors:
            print(f"  survivor: {sv['operator']} at {sv['where']} (findings: {sv['findings'] or 'none'})")
    return 0 if s.rate >= 0.95 else 1

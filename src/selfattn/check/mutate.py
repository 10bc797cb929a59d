"""Mutation score of the doctor: small AST edits of a correct module's source, each checked by the doctor.

``selfattn check --mutate file.py:Class`` (or :func:`score`) edits the source of the class (and of
its bases defined in the same file) one site at a time, with the edits attention code gets wrong:
drop or change the scale, swap or drop a transpose, change the softmax dimension, flip a mask's
polarity (``==``/``!=``, ``~``, ``+ mask``/``- mask``), move the mask after the softmax, swap the
operands of a matmul, drop ``.contiguous()``, shift a causal ``triu``/``tril`` offset. Each mutant is
run through :func:`selfattn.check` with the same options as the original:

- stillborn: it cannot be built or run at all (the doctor exits 2 on it);
- equivalent: same outputs as the original on every probe input and mask (excluded from the rate);
- killed: the doctor reports an error the original does not have;
- survivor: none of those; listed with the edit.

The user's file is read, never written; the mutants are compiled in memory (no bytecode).

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import ast
import copy
import json
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from .target import MASK_SHAPES, Caller, CannotRun, MaskSpec, build, find_call_style, parse_mask

__all__ = ["Mutant", "Score", "main", "mutants", "score"]

_SCALE_WORDS = ("sqrt", "scale", "scaling", "**")
_MASK_WORDS = ("mask", "bias")


@dataclass
class Mutant:
    """One edit: the operator, where (line and the edited code), and the whole file's edited source."""

    operator: str
    where: str
    source: str


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

    @property
    def non_equivalent(self) -> int:
        """Mutants that run and differ from the original somewhere: the rate's denominator."""
        return self.total - self.stillborn - self.equivalent

    @property
    def rate(self) -> float:
        """killed / non-equivalent (1.0 when there is none)."""
        return self.killed / self.non_equivalent if self.non_equivalent else 1.0


def _src(node: ast.AST) -> str:
    return ast.unparse(node)


def _is_call_to(node: ast.AST, *names: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and \
        (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) in names


def _int(v: int) -> ast.expr:
    return ast.UnaryOp(ast.USub(), ast.Constant(-v)) if v < 0 else ast.Constant(v)


def _const_int(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value if isinstance(node.operand.value, int) else None
    return None


def _unscaled(node: ast.expr) -> ast.expr:
    """``sqrt(d)`` -> ``d``, ``d ** 0.5`` -> ``d``, ``d ** -0.5`` -> ``d ** -1``: the scale 1/d instead of 1/sqrt(d)."""
    class Edit(ast.NodeTransformer):
        def visit_Call(self, n: ast.Call) -> ast.AST:
            return n.args[0] if _is_call_to(n, "sqrt") and n.args else self.generic_visit(n)

        def visit_BinOp(self, n: ast.BinOp) -> ast.AST:
            if isinstance(n.op, ast.Pow) and isinstance(n.right, (ast.Constant, ast.UnaryOp)):
                exp = _src(n.right)
                if exp in ("0.5", "-0.5"):
                    return n.left if exp == "0.5" else ast.BinOp(n.left, ast.Pow(), _int(-1))
            return self.generic_visit(n)

    return Edit().visit(copy.deepcopy(node))


def _edits(node: ast.AST) -> Iterator[tuple[str, Callable[[ast.AST], ast.AST]]]:
    """(operator, edit) pairs for one node; an edit takes a copy of the node and returns its replacement."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Mult)) and \
            any(w in _src(node.right) for w in _SCALE_WORDS) and not isinstance(node.right, ast.Constant):
        yield "drop the scale", lambda n: n.left
        if _src(_unscaled(node.right)) != _src(node.right):
            yield "scale 1/d instead of 1/sqrt(d)", lambda n: ast.BinOp(n.left, n.op, _unscaled(n.right))
        yield "scale doubled", lambda n: ast.BinOp(n.left, n.op, ast.BinOp(n.right, ast.Mult() if isinstance(
            n.op, ast.Mult) else ast.Div(), ast.Constant(2)))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        yield "swap matmul operands", lambda n: ast.BinOp(n.right, n.op, n.left)
    if _is_call_to(node, "matmul", "bmm") and len(node.args) == 2:
        yield "swap matmul operands", lambda n: ast.Call(n.func, [n.args[1], n.args[0]], n.keywords)
    if _is_call_to(node, "transpose") and isinstance(node.func, ast.Attribute) and len(node.args) == 2:
        a, b = (_const_int(x) for x in node.args)
        if a is not None and b is not None and 0 not in (a, b):
            yield "transpose the batch dimension", lambda n: ast.Call(n.func, [ast.Constant(0), n.args[1]], [])
        yield "drop a transpose", lambda n: n.func.value
    if _is_call_to(node, "contiguous") and isinstance(node.func, ast.Attribute):
        yield "drop .contiguous()", lambda n: n.func.value
    if _is_call_to(node, "softmax"):
        method = isinstance(node.func, ast.Attribute) and _src(node.func.value) not in ("torch", "F", "nn.functional",
                                                                                     "torch.nn.functional")
        pos = 0 if method else 1
        for new in (-2, 0):
            def set_dim(n: ast.Call, new: int = new, pos: int = pos) -> ast.AST:
                kws = [k for k in n.keywords if k.arg != "dim"]
                if any(k.arg == "dim" for k in n.keywords) or len(n.args) <= pos:
                    return ast.Call(n.func, n.args[:pos + 1] if len(n.args) > pos else n.args,
                                    [*kws, ast.keyword("dim", _int(new))])
                return ast.Call(n.func, [*n.args[:pos], _int(new), *n.args[pos + 1:]], n.keywords)
            yield f"softmax over dim {new}", set_dim
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)) and \
            any(w in _src(node) for w in _MASK_WORDS):
        yield "flip a mask comparison", lambda n: ast.Compare(n.left, [ast.NotEq() if isinstance(n.ops[0], ast.Eq)
                                                                       else ast.Eq()], n.comparators)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        yield "drop a mask inversion (~)", lambda n: n.operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and "mask" in _src(node.right):
        yield "subtract the mask instead of adding it", lambda n: ast.BinOp(n.left, ast.Sub(), n.right)
    if _is_call_to(node, "triu", "tril"):
        for delta in (1, -1):
            def shift(n: ast.Call, delta: int = delta) -> ast.AST:
                kws = [k for k in n.keywords if k.arg != "diagonal"]
                old = n.args[0] if n.args else next((k.value for k in n.keywords if k.arg == "diagonal"), _int(0))
                value = _const_int(old)
                new = _int(value + delta) if value is not None else ast.BinOp(old, ast.Add(), _int(delta))
                return ast.Call(n.func, [new], kws)
            yield f"causal offset {delta:+d}", shift


def _assigned(stmt: ast.stmt) -> str | None:
    body = stmt.body if isinstance(stmt, ast.If) and len(stmt.body) == 1 and not stmt.orelse else [stmt]
    s = body[0]
    if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
        return s.targets[0].id
    return None


def _mask_moves(fn: ast.FunctionDef) -> Iterator[tuple[int, int, str, str]]:
    """(mask statement index, softmax statement index, S, T): ``S = <mask S>`` followed by ``T = softmax(S)``."""
    body = fn.body
    for i, stmt in enumerate(body):
        s = _assigned(stmt)
        if s is None or "mask" not in _src(stmt):
            continue
        for j in range(i + 1, len(body)):
            t = _assigned(body[j])
            if t and "softmax" in _src(body[j]) and s in {n.id for n in ast.walk(body[j]) if isinstance(n, ast.Name)}:
                yield i, j, s, t
                break


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, n: ast.Name) -> ast.Name:
        return ast.Name(self.new, n.ctx) if n.id == self.old else n


def _classes(tree: ast.Module, name: str) -> list[ast.ClassDef]:
    """The class ``name`` and its bases defined in the same file."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    if name not in defs:
        raise CannotRun(f"no class {name!r} in the file")
    out, todo = [], [name]
    while todo:
        c = defs.get(todo.pop())
        if c is not None and c not in out:
            out.append(c)
            todo += [_src(b) for b in c.bases]
    return out


def mutants(source: str, class_name: str) -> list[Mutant]:
    """Every single-site mutant of ``class_name`` (and its in-file bases) in ``source``.

    Args:
        source: the whole file's Python source.
        class_name: the class to mutate.

    Returns:
        The mutants, each with the whole file's edited source.
    """
    tree = ast.parse(source)
    classes = _classes(tree, class_name)
    nodes = [n for c in classes for n in ast.walk(c)]
    index = {id(n): i for i, n in enumerate(ast.walk(tree))}
    found: list[Mutant] = []
    for node in nodes:
        for operator, edit in _edits(node):
            twin = copy.deepcopy(tree)
            _replace(twin, list(ast.walk(twin))[index[id(node)]], edit)
            found.append(Mutant(operator, f"line {getattr(node, 'lineno', '?')}: {_src(node)[:80]}",
                                ast.unparse(ast.fix_missing_locations(twin))))
    for c in classes:
        for fn in (n for n in c.body if isinstance(n, ast.FunctionDef)):
            for i, j, s, t in _mask_moves(fn):
                twin = copy.deepcopy(tree)
                fn2 = next(n for n in ast.walk(twin) if isinstance(n, ast.FunctionDef) and n.lineno == fn.lineno)
                stmt = _Rename(s, t).visit(fn2.body.pop(i))
                fn2.body.insert(j, stmt)
                found.append(Mutant("move the mask after the softmax", f"line {fn.body[i].lineno}: "
                                    f"{_src(fn.body[i])[:80]}", ast.unparse(ast.fix_missing_locations(twin))))
    return found


def _replace(tree: ast.AST, target: ast.AST, edit: Callable[[ast.AST], ast.AST]) -> None:
    """Replace ``target`` (a node of ``tree``) by ``edit(copy of target)``, in place."""
    for parent in ast.walk(tree):
        for fname, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, fname, edit(copy.deepcopy(target)))
                return
            if isinstance(value, list) and any(v is target for v in value):
                value[next(k for k, v in enumerate(value) if v is target)] = edit(copy.deepcopy(target))
                return


def _load(source: str, path: Path, class_name: str) -> type:
    namespace = {"__name__": f"_selfattn_mutant_{uuid.uuid4().hex}", "__file__": str(path)}
    folder = str(path.parent.resolve())
    sys.path.insert(0, folder)
    try:
        exec(compile(source, str(path), "exec"), namespace)
    finally:
        sys.path.remove(folder)
    return namespace[class_name]


def _spec_of(note: dict) -> MaskSpec:
    """The :class:`MaskSpec` a report's "mask" note describes."""
    return MaskSpec(note["kind"], next(k for k, v in MASK_SHAPES.items() if v == note["shape"]))


def _outputs(module: nn.Module, options: dict, mask_note: object) -> list[object]:
    """The module's outputs on the probe inputs, with and without the masks the original takes."""
    torch.manual_seed(0)
    e = next((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), options.get("embed_dim", 16))
    xs = [torch.randn(3, 7, e), torch.randn(2, 5, e)]
    adapter = options.get("call")
    style = "adapter" if adapter else find_call_style(module, xs[0])[0]
    call = Caller(module, style, adapter=adapter if callable(adapter) else None)
    runs: list[Callable[[], Tensor]] = [lambda t=t: call(t) for t in xs] + [lambda: call(xs[0] * 50)]
    if isinstance(mask_note, dict) and "kind" in mask_note:
        spec = _spec_of(mask_note)
        masked = call.with_mask(spec, mask_note.get("argument"))
        i = torch.arange(7)
        keeps = [torch.ones(3, 7, 7, dtype=torch.bool)]
        keeps[0][0, :, 5:] = False
        if not spec.key_only:
            causal = i[None, :] <= i[:, None]
            keeps += [causal.expand(3, 7, 7), (causal & (i[None, :] >= i[:, None] - 2)).expand(3, 7, 7)]
        runs += [lambda k=k: masked(xs[0], masked.module_mask(k)) for k in keeps]
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
    return outs


def _same(a: list[object], b: list[object]) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            if x.shape != y.shape or not torch.allclose(x, y, rtol=1e-4, atol=1e-5 * (1 + float(
                    y.nan_to_num(0, 0, 0).abs().max())), equal_nan=True):
                return False
        elif x != y:
            return False
    return True


def score(spec: str, options: dict | None = None, *, seed: int = 0) -> Score:
    """Mutate the class ``path/to/file.py:Class`` and check every mutant.

    Args:
        spec: ``path/to/file.py:ClassName`` of a correct module.
        options: :func:`selfattn.check` keyword arguments, the same for the original and every mutant.
        seed: the doctor's seed.

    Returns:
        The :class:`Score`.

    Raises:
        CannotRun: the file or class cannot be loaded.
    """
    from . import check

    options = {k: v for k, v in (options or {}).items() if v is not None and v is not False}
    options.pop("seed", None)
    path_s, _, name = spec.rpartition(":")
    path = Path(path_s)
    if not path.is_file():
        raise CannotRun(f"no such file: {path}")
    source = path.read_text()
    init, embed_dim = options.get("init"), options.get("embed_dim", 16)

    def instance(cls: type) -> nn.Module:
        torch.manual_seed(seed)
        return build(cls, init, embed_dim)[0].eval()

    original = instance(_load(source, path, name))
    base = check(copy.deepcopy(original), seed=seed, **options)
    note = base.inferred.get("mask")
    if "mask" not in options and "mask_convention" not in options and isinstance(note, dict) and "kind" in note:
        options["mask"] = _spec_of(note)  # the original's convention is the contract its mutants must keep
    base_errors = {f.id for f in base.findings if f.severity == "error"}
    result = Score(spec, sorted(base_errors))
    reference = _outputs(original, options, base.inferred.get("mask"))
    for m in mutants(source, name):
        result.total += 1
        try:
            module = instance(_load(m.source, path, name))
            module.load_state_dict(original.state_dict(), strict=False)
            outs = _outputs(module, options, base.inferred.get("mask"))
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
        new = {f.id for f in report.findings if f.severity == "error"} - base_errors
        if new:
            result.killed += 1
            for fid in new:
                result.killed_by[fid] = result.killed_by.get(fid, 0) + 1
        else:
            result.survivors.append({"operator": m.operator, "where": m.where,
                                     "findings": sorted(report.ids)})
    return result


def main(spec: str, options: dict, *, as_json: bool = False) -> int:
    """``selfattn check --mutate``: print the score; exit 0 when at least 95% of non-equivalent mutants are named."""
    try:
        if isinstance(options.get("mask"), str):
            parse_mask(options["mask"])
        s = score(spec, options, seed=options.get("seed", 0))
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

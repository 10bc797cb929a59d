"""The doctor's mutation operators: single-site AST edits of an attention class's source.

:func:`mutants` edits the class (its bases defined in the same file, and the module-level functions of
that file it calls) one site at a time, with the edits attention code gets wrong: drop or change the
scale, swap or drop a transpose, change the softmax dimension, flip a mask's polarity, drop a mask,
move the mask after the softmax, swap matmul operands, swap einsum or einops axes, flip SDPA's
``is_causal``, drop ``.contiguous()``, drop a negation, shift a causal ``triu``/``tril`` offset.
:mod:`selfattn.mutation.score` runs the doctor on each.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeGuard, TypeVar

from ..check.subject.building import CannotRun

__all__ = ["Mutant", "mutants"]

_SCALE_WORDS = ("sqrt", "scale", "scaling", "**")
_MASK_WORDS = ("mask", "bias")


@dataclass
class Mutant:
    """One edit: the operator, where (line and the edited code), and the whole file's edited source."""

    operator: str
    where: str
    source: str


def _src(node: ast.AST) -> str:
    return ast.unparse(node)


def _is_call_to(node: ast.AST, *names: str) -> TypeGuard[ast.Call]:
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


_Node = TypeVar("_Node", bound=ast.AST)
_Edit = Callable[[ast.AST], ast.AST]


def _on(kind: type[_Node], edit: Callable[[_Node], ast.AST]) -> _Edit:
    """``edit``, written for a ``kind`` node, as an edit of any node: it only gets copies of the node it was for."""
    def checked(n: ast.AST) -> ast.AST:
        assert isinstance(n, kind)
        return edit(n)
    return checked


def _receiver(n: ast.Call) -> ast.expr:
    """``x`` of a method call ``x.f(...)``."""
    assert isinstance(n.func, ast.Attribute)
    return n.func.value


def _edits(node: ast.AST) -> Iterator[tuple[str, _Edit]]:
    """(operator, edit) pairs for one node; an edit takes a copy of the node and returns its replacement."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Mult)) and \
            any(w in _src(node.right) for w in _SCALE_WORDS) and not isinstance(node.right, ast.Constant):
        yield "drop the scale", _on(ast.BinOp, lambda n: n.left)
        if _src(_unscaled(node.right)) != _src(node.right):
            yield "scale 1/d instead of 1/sqrt(d)", _on(ast.BinOp, lambda n: ast.BinOp(n.left, n.op,
                                                                                        _unscaled(n.right)))
        yield "scale doubled", _on(ast.BinOp, lambda n: ast.BinOp(n.left, n.op, ast.BinOp(
            n.right, ast.Mult() if isinstance(n.op, ast.Mult) else ast.Div(), ast.Constant(2))))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        yield "swap matmul operands", _on(ast.BinOp, lambda n: ast.BinOp(n.right, n.op, n.left))
    if _is_call_to(node, "matmul", "bmm") and len(node.args) == 2:
        yield "swap matmul operands", _on(ast.Call, lambda n: ast.Call(n.func, [n.args[1], n.args[0]], n.keywords))
    if _is_call_to(node, "transpose") and isinstance(node.func, ast.Attribute) and len(node.args) == 2:
        a, b = (_const_int(x) for x in node.args)
        if a is not None and b is not None and 0 not in (a, b):
            yield "transpose the batch dimension", _on(ast.Call, lambda n: ast.Call(n.func, [ast.Constant(0),
                                                                                              n.args[1]], []))
        yield "drop a transpose", _on(ast.Call, _receiver)
    if _is_call_to(node, "contiguous") and isinstance(node.func, ast.Attribute):
        yield "drop .contiguous()", _on(ast.Call, _receiver)
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
            yield f"softmax over dim {new}", _on(ast.Call, set_dim)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)) and \
            any(w in _src(node) for w in _MASK_WORDS):
        yield "flip a mask comparison", _on(ast.Compare, lambda n: ast.Compare(
            n.left, [ast.NotEq() if isinstance(n.ops[0], ast.Eq) else ast.Eq()], n.comparators))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert):
        yield "drop a mask inversion (~)", _on(ast.UnaryOp, lambda n: n.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and "mask" in _src(node.right):
        yield "subtract the mask instead of adding it", _on(ast.BinOp, lambda n: ast.BinOp(n.left, ast.Sub(), n.right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and "mask" in _src(node.right):
        yield "drop the mask", _on(ast.BinOp, lambda n: n.left)
    if _is_call_to(node, "masked_fill") and isinstance(node.func, ast.Attribute):
        yield "drop a masked_fill", _on(ast.Call, _receiver)
    if _is_call_to(node, "Softmax") and any(k.arg == "dim" for k in node.keywords):
        for new in (-2, 0):
            def set_module_dim(n: ast.Call, new: int = new) -> ast.AST:
                return ast.Call(n.func, n.args, [*(k for k in n.keywords if k.arg != "dim"),
                                                 ast.keyword("dim", _int(new))])
            yield f"softmax over dim {new}", _on(ast.Call, set_module_dim)
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and any(
            w in _src(node.targets[0]).lower() for w in ("scale", "scaling")) and \
            not isinstance(node.value, ast.Constant) and any(w in _src(node.value) for w in ("**", "sqrt")):
        yield "drop the scale", _on(ast.Assign, lambda n: ast.Assign(n.targets, ast.Constant(1.0), lineno=n.lineno))
        if _src(_unscaled(node.value)) != _src(node.value):
            yield "scale 1/d instead of 1/sqrt(d)", _on(ast.Assign, lambda n: ast.Assign(
                n.targets, _unscaled(n.value), lineno=n.lineno))
        yield "scale doubled", _on(ast.Assign, lambda n: ast.Assign(
            n.targets, ast.BinOp(n.value, ast.Mult(), ast.Constant(2)), lineno=n.lineno))
    if isinstance(node, ast.Call):
        for i, kw in enumerate(node.keywords):
            if kw.arg in ("scale", "alpha", "softmax_scale", "scaling") and not isinstance(kw.value, ast.Constant):
                def unscaled(n: ast.Call, i: int = i) -> ast.AST:
                    return _with_keyword(n, i, ast.Constant(1.0))

                def doubled(n: ast.Call, i: int = i) -> ast.AST:
                    return _with_keyword(n, i, ast.BinOp(n.keywords[i].value, ast.Mult(), ast.Constant(2)))
                yield "drop the scale", _on(ast.Call, unscaled)
                yield "scale doubled", _on(ast.Call, doubled)
            if kw.arg == "is_causal":
                def flipped(n: ast.Call, i: int = i) -> ast.AST:
                    return _with_keyword(n, i, ast.UnaryOp(ast.Not(), n.keywords[i].value))
                yield "flip is_causal", _on(ast.Call, flipped)
            if kw.arg in ("attn_mask", "attention_mask", "mask") and _is_call_to(node, "scaled_dot_product_attention"):
                def unmasked(n: ast.Call, i: int = i) -> ast.AST:
                    return _with_keyword(n, i, ast.Constant(None))
                yield "drop the mask", _on(ast.Call, unmasked)
    if _is_call_to(node, "scaled_dot_product_attention"):
        if len(node.args) >= 2:
            yield "swap q and k", _on(ast.Call, lambda n: ast.Call(n.func, [n.args[1], n.args[0], *n.args[2:]],
                                                                    n.keywords))
        if not any(k.arg == "scale" for k in node.keywords):
            yield "drop the scale", _on(ast.Call, lambda n: ast.Call(n.func, n.args, [
                *n.keywords, ast.keyword("scale", ast.Constant(1.0))]))
        if not any(k.arg == "is_causal" for k in node.keywords):
            yield "flip is_causal", _on(ast.Call, lambda n: ast.Call(n.func, n.args, [
                *n.keywords, ast.keyword("is_causal", ast.Constant(True))]))
    if _is_call_to(node, "einsum") and node.args and isinstance(node.args[0], ast.Constant) and \
            isinstance(node.args[0].value, str) and "->" in node.args[0].value:
        ins, out = node.args[0].value.replace(" ", "").split("->")
        first, *rest = ins.split(",")
        if len(out) >= 2:
            yield "einsum: swap the output's last two axes", _on(ast.Call, lambda n: _with_arg0(
                n, f"{ins}->{out[:-2]}{out[-1]}{out[-2]}"))
        if len(first) >= 2 and rest:
            yield "einsum: transpose the first operand", _on(ast.Call, lambda n: _with_arg0(
                n, f"{','.join([first[:-2] + first[-1] + first[-2], *rest])}->{out}"))
    if _is_call_to(node, "rearrange") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
            isinstance(node.args[1].value, str):
        pattern = node.args[1].value
        swapped = re.sub(r"\((\w+) (\w+)\)", lambda g: f"({g.group(2)} {g.group(1)})", pattern, count=1)
        if swapped != pattern:
            yield "einops: swap a grouped axis", _on(ast.Call, lambda n: ast.Call(
                n.func, [n.args[0], ast.Constant(swapped), *n.args[2:]], n.keywords))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and not isinstance(node.operand, ast.Constant):
        yield "drop a negation", _on(ast.UnaryOp, lambda n: n.operand)
    if _is_call_to(node, "triu", "tril"):
        for delta in (1, -1):
            def shift(n: ast.Call, delta: int = delta) -> ast.AST:
                kws = [k for k in n.keywords if k.arg != "diagonal"]
                old = n.args[0] if n.args else next((k.value for k in n.keywords if k.arg == "diagonal"), _int(0))
                value = _const_int(old)
                new = _int(value + delta) if value is not None else ast.BinOp(old, ast.Add(), _int(delta))
                return ast.Call(n.func, [new], kws)
            yield f"causal offset {delta:+d}", _on(ast.Call, shift)


def _with_keyword(n: ast.Call, i: int, value: ast.expr) -> ast.Call:
    """``n`` with its i-th keyword argument's value replaced."""
    kws = list(n.keywords)
    kws[i] = ast.keyword(kws[i].arg, value)
    return ast.Call(n.func, n.args, kws)


def _with_arg0(n: ast.Call, text: str) -> ast.Call:
    """``n`` with its first (string) argument replaced by ``text``."""
    return ast.Call(n.func, [ast.Constant(text), *n.args[1:]], n.keywords)


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


def _functions(tree: ast.Module, roots: list[ast.ClassDef]) -> list[ast.FunctionDef]:
    """The module-level functions of the file that ``roots`` call (by name), and those they call, in file order."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    seen: set[str] = set()
    todo: list[ast.AST] = list(roots)
    while todo:
        for n in ast.walk(todo.pop()):
            if isinstance(n, ast.Name) and n.id in defs and n.id not in seen:
                seen.add(n.id)
                todo.append(defs[n.id])
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in seen]


def mutants(source: str, class_name: str, *, definitions_only: bool = False) -> list[Mutant]:
    """Every single-site mutant of ``class_name`` (its in-file bases, the file's functions it calls) in ``source``.

    Args:
        source: the whole file's Python source.
        class_name: the class to mutate.
        definitions_only: each mutant's source holds only the mutated definitions (the class, its
            in-file bases and the functions they call, in file order), not the whole file.

    Returns:
        The mutants, each with the whole file's (or the definitions') edited source.
    """
    tree = ast.parse(source)
    classes = _classes(tree, class_name)
    functions = _functions(tree, classes)
    if definitions_only:
        keep = {id(n) for n in [*classes, *functions]}
        tree = ast.Module([n for n in tree.body if id(n) in keep], [])
    nodes = [n for d in [*classes, *functions] for n in ast.walk(d)]
    index = {id(n): i for i, n in enumerate(ast.walk(tree))}
    found: list[Mutant] = []
    for node in nodes:
        for operator, edit in _edits(node):
            twin = copy.deepcopy(tree)
            _replace(twin, list(ast.walk(twin))[index[id(node)]], edit)
            found.append(Mutant(operator, f"line {getattr(node, 'lineno', '?')}: {_src(node)[:80]}",
                                ast.unparse(ast.fix_missing_locations(twin))))
    for d in [*classes, *functions]:
        for fn in (n for n in (d.body if isinstance(d, ast.ClassDef) else [d]) if isinstance(n, ast.FunctionDef)):
            for i, j, s, t in _mask_moves(fn):
                twin = copy.deepcopy(tree)
                fn2 = next(n for n in ast.walk(twin) if isinstance(n, ast.FunctionDef) and n.lineno == fn.lineno)
                stmt = _Rename(s, t).visit(fn2.body.pop(i))
                fn2.body.insert(j, stmt)
                found.append(Mutant("move the mask after the softmax", f"line {fn.body[i].lineno}: "
                                    f"{_src(fn.body[i])[:80]}", ast.unparse(ast.fix_missing_locations(twin))))
    return found


def _replace(tree: ast.AST, target: ast.AST, edit: _Edit) -> None:
    """Replace ``target`` (a node of ``tree``) by ``edit(copy of target)``, in place."""
    for parent in ast.walk(tree):
        for fname, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, fname, edit(copy.deepcopy(target)))
                return
            if isinstance(value, list) and any(v is target for v in value):
                value[next(k for k, v in enumerate(value) if v is target)] = edit(copy.deepcopy(target))
                return

"""The house's layers, read from its imports: no circle, and each layer imports only what it may.

Shape legend: none (modules and their imports).
"""

from __future__ import annotations

import ast
from pathlib import Path

import selfattn

ROOT = Path(selfattn.__file__).parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """selfattn module -> the selfattn modules it imports (at module level or in functions); ``from
    package import module`` counts as importing that module, not the package's __init__."""
    paths = {_module(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                subs = {f"{base}.{a.name}" for a in node.names} & paths.keys()
                out |= subs if len(subs) == len(node.names) else {base, *subs}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
        graph[name] = {t for t in out if t in paths and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return [*stack[stack.index(t):], t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle_between_modules():
    """catches: modules that import each other (the chunked backend and its compiled path did), so that
    neither can be read, tested or changed without the other. A package's __init__ re-exporting its
    own modules is not a circle of ideas: only circles among the other modules count."""
    graph = {m: {t for t in ts if not (m.startswith(t + ".") and t == m.rpartition(".")[0])}
             for m, ts in _imports().items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_each_layer_imports_only_what_it_may():
    """catches: functional importing the compiled path's internals, the distributed code reading the
    chunked backend's options or loops instead of its block kernel, masks or scores importing a backend."""
    graph = _imports()
    assert not any(t.startswith("selfattn.backends.chunked.") for t in graph["selfattn.functional"])
    for m in (m for m in graph if m.startswith("selfattn.distributed")):
        chunked = {t for t in graph[m] if t.startswith("selfattn.backends.chunked")}
        assert chunked <= {"selfattn.backends.chunked.kernels", "selfattn.backends.chunked.dropout"}, (m, chunked)
    assert not any(t.startswith("selfattn.backends") for t in graph["selfattn._ops"])  # shared by every compiled path
    for m in (m for m in graph if m.startswith(("selfattn.masks", "selfattn.scores"))):
        assert not any(t.startswith("selfattn.backends") for t in graph[m]), m
    kernels = graph["selfattn.backends.chunked.kernels"]
    assert {t for t in kernels if t.startswith("selfattn.backends.chunked.")} <= {"selfattn.backends.chunked.dropout"}

"""The README's Python examples run as written.

Guards against the README drifting from the API: a renamed argument, a changed return value or a
removed name in a documented example is otherwise noticed only by the first user who pastes it.
Every ```python fenced block of README.md (indented ones inside lists too) is executed; shell
blocks are not. A block runs in a fresh namespace after the Python blocks before it, because the
README's examples build on each other (the KV-cache example reuses `mha` from the first one).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    source: str


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced code block of a Markdown text, dedented by its fence's indentation."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = opening["indent"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.fullmatch(rf"{re.escape(indent)}```[ \t]*", lines[j]):
            body.append(lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"README.md:{i + 1}: fenced block is never closed")
        blocks.append(Block(i + 1, opening["lang"].lower(), textwrap.dedent("\n".join(body)) + "\n"))
        i = j + 1
    return blocks


PYTHON_BLOCKS = [b for b in fenced_blocks(README.read_text(encoding="utf-8")) if b.lang in ("python", "py")]

def _run(block: Block, namespace: dict) -> None:
    code = compile(block.source, f"README.md:{block.line}", "exec")
    exec(code, namespace)


def _namespace_before(index: int) -> dict:
    """A fresh namespace in which the runnable Python blocks before `index` have been executed."""
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__readme__"}
    for block in PYTHON_BLOCKS[:index]:
        _run(block, namespace)
    return namespace


def test_readme_has_python_examples():
    assert PYTHON_BLOCKS, "no ```python block found in README.md: the parser or the README changed"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=[f"line{b.line}" for b in PYTHON_BLOCKS])
def test_readme_python_block(index):
    namespace = _namespace_before(index)
    _run(PYTHON_BLOCKS[index], namespace)

"""Backend registry. Each backend is a module with ``NAME``, ``supports(call) -> None | reason``
and ``run(call) -> (out, lse | None, weights | None)``.

Backends trust their input (``functional`` validated it) and never pick another backend.
"""

from __future__ import annotations

from types import ModuleType

from . import chunked, flex, reference, sdpa

REGISTRY: dict[str, ModuleType] = {m.NAME: m for m in (reference, sdpa, chunked, flex)}

__all__ = ["REGISTRY"]

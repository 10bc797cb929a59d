"""The backends and their registry.

Each backend is a :class:`~selfattn.backends.base.Backend`: it declares what it supports,
lists every reason it cannot run a call (``not_supported_reasons``) and runs the calls it can.
Which backend runs is decided in one place, :mod:`selfattn.backends.dispatch`. Backends trust
their input (``functional`` validated it) and never pick another backend.
"""

from __future__ import annotations

from . import chunked, flex, reference, sdpa
from .base import Backend

REGISTRY: dict[str, Backend] = {b.name: b for b in (reference.BACKEND, sdpa.BACKEND, chunked.BACKEND, flex.BACKEND)}

__all__ = ["REGISTRY", "Backend"]

"""Test inputs, and the suite's short names for selfattn.testing's oracle and tolerance rule.

The oracle and the rule live in :mod:`selfattn.testing` (public, for users' kernels too): a
backend's error must stay within twice (outputs) or three times (gradients) the error of the same
plain math done in the input's dtype, plus a few ulps of the output's magnitude.

Shape legend: B batch, Hq/Hkv heads, Lq/Lk lengths, D/Dv head dims.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

import selfattn
from selfattn import testing
from selfattn.masks import Mask
from selfattn.testing import reference_lse, reference_mask, tolerance

__all__ = ["DTYPES", "check_against_reference", "dense_of", "lse_reference", "make_qkv", "tolerance"]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def make_qkv(b: int, hq: int, hkv: int, lq: int, lk: int, d: int, dv: int | None = None, *,
             dtype: torch.dtype = torch.float32, seed: int = 0, noncontiguous: bool = False,
             requires_grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """Random q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); optionally non-contiguous
    (built as (B, L, H, D) and transposed, the layout a module's projection gives)."""
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv

    def t(h: int, length: int, dim: int) -> Tensor:
        if noncontiguous:
            x = torch.randn(b, length, h, dim, generator=g, dtype=torch.float64).transpose(1, 2)
        else:
            x = torch.randn(b, h, length, dim, generator=g, dtype=torch.float64)
        return x.to(dtype).requires_grad_(requires_grad)

    return t(hq, lq, d), t(hkv, lk, d), t(hkv, lk, dv)


def dense_of(mask: Mask | Tensor | None, causal: bool | str, lq: int, lk: int) -> Tensor | None:
    """The call's visibility (B|1, H|1, Lq, Lk) as the oracle sees it; None when all is visible."""
    return reference_mask(lq, lk, mask=mask, causal=causal)  # type: ignore[arg-type]


def lse_reference(q: Tensor, k: Tensor, visible: Tensor | None, scale: float | None = None) -> Tensor:
    """Float64 logsumexp of each row (B, Hq, Lq), -inf on rows that see no key."""
    return reference_lse(q, k, mask=visible, scale=scale)


def check_against_reference(q: Tensor, k: Tensor, v: Tensor, *, backend: str,
                            oracle_mod: Callable[[Tensor], Tensor] | None = None, **kwargs: object) -> None:
    """Hold ``selfattn.attention(..., backend=backend)`` to the rule for out and (with ``grads``,
    the default) dq, dk, dv. ``oracle_mod`` is the test's own dense form of ``score_mod``
    ((B, Hq, Lq, Lk) scores -> same), written independently of selfattn.scores."""
    reference_mod = None if oracle_mod is None else (lambda s, b, h, i, j: oracle_mod(s))
    testing.check_against_reference(functools.partial(selfattn.attention, backend=backend), q, k, v, name=backend,
                                    reference_score_mod=reference_mod, **kwargs)  # type: ignore[arg-type]

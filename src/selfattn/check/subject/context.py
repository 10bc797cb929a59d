"""What the doctor's probes share: the :class:`Context` they read, the :class:`Outcome` they return, the
keep-masks they send and how they compare outputs.

A probe is a plain function of a :class:`Context` and of the results of earlier probes it needs,
passed in explicitly. It returns an :class:`Outcome` and changes nothing the other probes read.

Shape legend: B batch, L length, E embed dim.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from torch import Tensor, nn

from ..findings import Finding
from .caller import Caller, MaskSpec

__all__ = ["Context", "Outcome", "close", "empty_row_keep", "future", "not_verified", "padded_rows", "padding_keep",
           "probe_keep", "raised_inside_doctor", "rel", "tolerance"]

T = TypeVar("T")


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance for "the same output" in ``dtype``: 1e-4 in float32 and float64, wider in half precision."""
    return max(1e-4, 16 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-4


@dataclass(frozen=True)
class Context:
    """What every probe may read; no probe changes it, nor anything another probe reads.

    ``call`` runs the module as it is (its own dtype and device); ``exact`` runs a float64 copy of
    it when one runs and agrees with it (else the module itself), for the probes that decide which
    token a row depends on or which formula the output follows: rounding cannot hide a small
    attention weight there. The one thing probes share is ``gen``, which draws their random inputs:
    the draws follow the order :func:`~selfattn.check.doctor.examine` runs the probes in, so a report
    is reproducible from its seed.
    """

    module: nn.Module
    call: Caller  # forward(x) or forward(q, k, v) (or the user's adapter), without a mask
    x: Tensor  # (B, L, E) the probe input, in the module's dtype and on its device
    gen: torch.Generator
    declared: str | None  # the bool mask convention the user declared: "keep", "ignore" or None
    causal: bool  # the user requires a causal module
    spec: MaskSpec | None = None  # the mask kind and shape the user stated
    allow_nonstandard: bool = False  # the module says it is not textbook attention
    exact: Caller | None = None  # the caller on a float64 copy, or None when there is none
    no_mask: bool = False  # the user says the module takes no mask
    scale: float | None = None  # the score scale the user says the module uses on purpose
    bidirectional: bool = False  # the user requires every query to see every key
    normalised: bool = True  # the weights go through a softmax (False: ReLU^2, sigmoid or linear attention)

    @property
    def rtol(self) -> float:
        """Relative tolerance for comparing two outputs of the module in its own dtype."""
        return tolerance(self.x.dtype)

    @property
    def analysis(self) -> Caller:
        """The float64 copy's caller when there is one, else the module's."""
        return self.exact or self.call

    @property
    def analysis_x(self) -> Tensor:
        """The probe input in the analysis caller's dtype."""
        return self.x.double() if self.exact is not None else self.x

    @property
    def dependency_rtol(self) -> float:
        """The smallest relative change that counts as "row i depends on token j" in the analysis dtype."""
        return 1e-10 if self.exact is not None or self.x.dtype == torch.float64 else 32 * torch.finfo(self.x.dtype).eps

    def exact_of(self, caller: Caller) -> Caller:
        """``caller`` on the float64 copy (when there is one): the same style, mask and layout."""
        return caller if self.exact is None else caller.for_module(self.exact.module)

    def randn(self, *shape: int) -> Tensor:
        """Standard normal values of ``shape`` from :attr:`gen`, in the probe input's dtype and device."""
        return torch.randn(*shape, generator=self.gen).to(dtype=self.x.dtype, device=self.x.device)


@dataclass
class Outcome(Generic[T]):
    """What a probe returns: findings, notes for ``Report.inferred``, coverage, and a value later probes use."""

    findings: list[Finding] = field(default_factory=list)
    notes: dict = field(default_factory=dict)
    value: T | None = None
    coverage: dict[str, str] = field(default_factory=dict)


def not_verified(err: Exception) -> str:
    """How a probe that raised ``err`` is reported.

    Args:
        err: the exception the probe raised.

    Returns:
        "not verified: <exception type>: <message>", the part after "not verified: " cut to 200 characters;
        "not verified (doctor error): ..." when the exception was raised by the doctor's own code.
    """
    where = " (doctor error)" if raised_inside_doctor(err) else ""
    return f"not verified{where}: {f'{type(err).__name__}: {err}'[:200]}"


_DOCTOR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # selfattn/check
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def raised_inside_doctor(err: BaseException) -> bool:
    """Was ``err`` raised by the doctor's own code rather than by the module it runs? The deepest frame of the
    traceback outside torch decides (an operation of torch's that fails on what the doctor built is the doctor's)."""
    tb, deepest = err.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        name = code.co_filename
        # generated code (a dataclass's __eq__) belongs to the frame that called it; a doctor mode's
        # __torch_function__ only passes the module's operation on (what fails there is the module's)
        if not name.startswith("<") and code.co_name != "__torch_function__":
            name = os.path.abspath(name)
            if not name.startswith(_TORCH + os.sep):
                deepest = name
        tb = tb.tb_next
    return deepest is not None and deepest.startswith(_DOCTOR + os.sep)


def padded_rows(call: Caller, out: Tensor) -> Tensor | None:
    """(B, L) bool, True at the rows of ``out`` (B, L, ...) that a replayed layer's model pads through an argument
    of its call other than the mask (MPT's ``attn_bias``, T5's position bias, with the padding added in): rows the
    model never reads, which may see every key (a row with all of them hidden weighs them alike); None when the call
    carries no such padding or ``out`` is larger than the recorded call."""
    pad = getattr(call.adapter, "padded_rows", None)
    if not isinstance(pad, Tensor) or out.dim() < 2 or out.shape[0] > pad.shape[0] or out.shape[1] > pad.shape[1]:
        return None
    rows = pad[:out.shape[0], :out.shape[1]].to(out.device)  # the recorded call is cut from its start alike
    return rows if bool(rows.any()) else None


def close(a: Tensor, b: Tensor, rtol: float = 1e-4) -> bool:
    """Same shape, and every value within ``rtol`` times (1 + the largest |b|)."""
    return a.shape == b.shape and bool(((a.double() - b.double()).abs() <= rtol * (1 + b.abs().max())).all())


def rel(a: Tensor, b: Tensor) -> float:
    """The largest difference, relative to 1 + the largest |b|."""
    return float((a.double() - b.double()).abs().max() / (1 + b.double().abs().max()))


def future(length: int) -> Tensor:
    """(L, L) bool: True where the key comes after the query."""
    return torch.ones(length, length, dtype=torch.bool).triu(1)


def padding_keep(b: int, length: int) -> Tensor:
    """(B, L, L) keep-mask: the last two keys of item 0 are padding, everything else is visible."""
    keep = torch.ones(b, length, length, dtype=torch.bool)
    keep[0, :, length - 2:] = False
    return keep


def empty_row_keep(b: int, length: int, key_only: bool) -> Tensor:
    """(B, L, L) keep-mask: :func:`padding_keep` with query row 1 (key-only masks: all of item 0) seeing no key."""
    keep = padding_keep(b, length)
    if key_only:
        keep[0] = False
    else:
        keep[:, 1] = False
    return keep


def probe_keep(b: int, length: int, key_only: bool, at_end: bool = False) -> Tensor:
    """(B, L, L) keep-mask no module has built in: a band (key-only: a different set of hidden keys per item;
    ``at_end``, for masks given as lengths: the last 1 + b % 3 keys of item b)."""
    i = torch.arange(length)
    if at_end:
        counts = length - 1 - torch.arange(b) % 3
        return (i[None, :] < counts[:, None])[:, None, :].expand(b, length, length)
    if not key_only:
        band = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 2)
        return band.expand(b, length, length)
    hidden = (i[None, :] == (torch.arange(b)[:, None] + 1) % length) | (i[None, :] == (torch.arange(b)[:, None] + 4)
                                                                        % length)
    return (~hidden)[:, None, :].expand(b, length, length)

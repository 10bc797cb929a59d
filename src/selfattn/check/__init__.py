"""The attention doctor: run a user's attention module and certify it, or name each bug.

``selfattn.check(module)`` (or ``selfattn check file.py:Class``) runs black-box probes (shapes,
batch independence, permutation equivariance, mask convention over every common shape and kind,
padding, causality, fully masked rows, extreme logits, half precision, eval determinism,
gradients) and a white-box probe (Q, K, V captured from the module's linear maps, the attention
recomputed under the definition and under each known bug, rotary positions and relative-position
biases recognised). The report gives each finding a severity and each property a coverage state.
It depends on the public selfattn API only.

The layers, each importing only those before it: :mod:`.findings` (the catalogue of finding
kinds and :class:`Finding`) → :mod:`.subject` (building the module, how it is called, its sizes,
what probes share) → :mod:`.probes` (black box, masking, numerics) → :mod:`.whitebox` (trace,
projections, products, positions) → :mod:`.report` (the report and its rendering) →
:mod:`.doctor` (the declared probe table, :func:`check` and the run) → :mod:`.model` (whole
models: every attention layer found and checked with the call the model makes). The doctor's own
mutation score is apart, in :mod:`selfattn.mutation`.

Shape legend: B batch, L length, E embed dim, H heads.
"""

from __future__ import annotations

from .doctor import check
from .findings import FINDING_IDS, FIXES, SEVERITY
from .model import ModelReport, check_model, render_model
from .report import COVERED, Finding, Report, render
from .subject.building import CannotRun
from .subject.caller import MASK_KINDS, MASK_SHAPES, MaskSpec, parse_mask

__all__ = ["COVERED", "FINDING_IDS", "FIXES", "MASK_KINDS", "MASK_SHAPES", "SEVERITY", "CannotRun", "Finding",
           "MaskSpec", "ModelReport", "Report", "check", "check_model", "parse_mask", "render", "render_model"]

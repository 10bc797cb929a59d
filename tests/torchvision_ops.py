"""Make torchvision's Python package importable beside a CPU-only torch (timm, vit-pytorch, open_clip need it).

Why: the torchvision wheel built for torch 2.13.0 (torchvision 0.28.0, the only one the package index
offers for it) is a CUDA build; its C extension ``_C.so`` links ``libc10_cuda.so`` and does not load
beside the CPU torch. torchvision then still imports, without its operators, except for one thing:
``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` without the ``extension._has_ops()`` guard the others have, and
``torch.library.register_fake`` raises "operator torchvision::nms does not exist". So ``import
torchvision`` (and with it ``import timm``, ``vit_pytorch``, ``open_clip``) fails.

What: :func:`define_torchvision_ops` defines those two operator schemas (as the C extension would,
read from its ``_C.so``) when, and only when, torchvision is installed and its C extension does not
load. The attention classes the doctor's corpus checks never call them; calling one raises
("no kernel registered"), it never computes a wrong result.

Where: the tests call it from ``tests/conftest.py``; ``make`` also installs it into the dev virtualenv
with :mod:`torchvision_hook` (a ``.pth`` startup hook that calls it just before the first ``import
torchvision``), so that transformers, which imports torchvision when it is installed, works in every
process of that virtualenv (the bench's and the examples' subprocesses too). The environment variable
``SELFATTN_NO_TORCHVISION_HOOK=1`` turns the hook off.

Checked with torch 2.13.0+cpu and torchvision 0.28.0. ``tests/test_check_corpus.py`` has a test that
fails when torchvision imports without this (then delete this file and the hook) and one that fails when
it stops working.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = ["define_torchvision_ops", "torchvision_extension_loads"]

SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_library: torch.library.Library | None = None  # kept alive: the definitions go away with the Library object


def torchvision_extension_loads() -> bool | None:
    """None: torchvision is not installed; else whether its C extension (``torchvision/_C*.so``) loads."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("_C*.so"))
    if not found:
        return False
    try:
        torch.ops.load_library(str(found[0]))
    except OSError:
        return False
    return True


def _defined() -> bool:
    """Are the schemas there already (defined by another copy of this module, the startup hook's)?"""
    try:
        torch.ops.torchvision.nms.default  # noqa: B018 - looking it up is the question
    except (AttributeError, RuntimeError):
        return False
    return True


def define_torchvision_ops() -> bool:
    """Define ``torchvision::nms`` and ``torchvision::qnms`` if torchvision needs them to import.

    Call it before the first ``import torchvision`` (or of a library that imports it). Idempotent.

    Returns:
        True when the schemas are defined by this function (now or earlier), False when nothing was needed.
    """
    global _library
    if _library is not None:
        return True
    if torchvision_extension_loads() is not False:  # not installed, or the real operators are there
        return False
    if _defined():  # by the startup hook's copy of this module (looking torchvision up above runs the hook)
        return True
    _library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        _library.define(schema)
    return True

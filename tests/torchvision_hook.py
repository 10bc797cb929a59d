"""A startup hook for the dev virtualenv: define torchvision's two unguarded operator schemas just before the
first ``import torchvision`` (see :mod:`torchvision_ops`, installed beside it as ``_selfattn_torchvision_ops``).

``make`` copies this file into the virtualenv's site-packages as ``_selfattn_torchvision_hook.py`` with a
``.pth`` file that imports it; importing it costs nothing until torchvision is imported.
``SELFATTN_NO_TORCHVISION_HOOK=1`` turns it off.
"""

from __future__ import annotations

import os
import sys


class _BeforeTorchvision:
    """A meta path finder that finds nothing: it only runs the workaround when torchvision is first looked up."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            from _selfattn_torchvision_ops import define_torchvision_ops

            define_torchvision_ops()


if not os.environ.get("SELFATTN_NO_TORCHVISION_HOOK"):
    sys.meta_path.insert(0, _BeforeTorchvision())

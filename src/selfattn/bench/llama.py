"""The Llama-shaped model the ``models`` suite trains and generates with, and the attention implementations it
registers with transformers.

Hidden 512, 8 query heads, 2 key/value heads, 4 layers, vocabulary 1024 (small, so that the logits do not
dwarf attention).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HEADS", "HIDDEN", "KV_HEADS", "LAYERS", "VOCAB", "register"]

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB = 512, 8, 2, 4, 1024


def _passthrough(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """No attention: each query head takes its key/value head's value at its own position."""
    g = query.shape[1] // value.shape[1]
    return value.repeat_interleave(g, 1).transpose(1, 2).contiguous(), None


def register() -> None:
    """selfattn and the pass-through baseline ("none") as transformers attention implementations."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ..integrations import transformers as sa_hf
    sa_hf.register()
    AttentionInterface.register("none", _passthrough)
    AttentionMaskInterface.register("none", lambda *a, **k: None)

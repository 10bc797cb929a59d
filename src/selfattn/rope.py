"""Rotary position embeddings (RoPE) with explicit positions.

Pairs (x[..., i], x[..., i + D/2]) are rotated by the angle ``position * base^(-2i/D)`` (the
"half" layout of GPT-NeoX and Llama). Positions are explicit, so cached decoding, padded batches
and sequences at different positions need no special case: a token's rotation depends only on
its own position.

Shape legend: B batch, H heads, L length, D head dim (even).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rope"]


def rope(x: Tensor, positions: Tensor, *, base: float = 10000.0) -> Tensor:
    """Rotate q or k by their positions.

    Args:
        x: (B, H, L, D), D even.
        positions: int tensor (B, L) or (L,): the position of each token in its sequence.
        base: the frequency base (10000 in most models).

    Returns:
        (B, H, L, D) in x's dtype; computed in float32 (float64 for float64 input).

    Example:
        >>> q = rope(q, torch.arange(q.shape[2]))
    """
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope needs x of shape (B, H, L, D) with D even, got {tuple(x.shape)}")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    b, _, length, d = x.shape
    if positions.shape not in ((length,), (b, length), (1, length)):
        raise ValueError(f"positions must be (L,) or (B, L) = ({length},) or ({b}, {length}), "
                         f"got {tuple(positions.shape)}")
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, d, 2, device=x.device, dtype=ct) / d)  # (D/2,)
    angles = positions.to(device=x.device, dtype=ct)[..., None] * inv_freq  # (B|1, L, D/2)
    cos, sin = angles.cos().unsqueeze(-3), angles.sin().unsqueeze(-3)  # (B|1, 1, L, D/2)
    x1, x2 = x.to(ct).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

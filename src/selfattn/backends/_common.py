"""Helpers shared by backends (no backend logic here).

Shape legend: B batch, Hq query heads, Hkv key/value heads, G = Hq // Hkv, Lq/Lk lengths.
"""

from __future__ import annotations

import torch
from torch import Tensor


def split_heads(t: Tensor, hkv: int, g: int) -> Tensor:
    """(B|1, Hq|1, ...) -> (B|1, Hkv|1, G|1, ...), so GQA broadcasts K/V instead of copying them."""
    if t.shape[1] == 1:
        return t.unsqueeze(2)
    return t.reshape(t.shape[0], hkv, g, *t.shape[2:])


def safe_softmax(s: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim and its logsumexp; rows with no finite score give 0 and -inf.

    The row max is treated as a constant (softmax does not depend on it), so a row that is all
    -inf yields weights 0 and gradient 0 instead of NaN.
    """
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    lsum = p.sum(-1, keepdim=True)
    w = p / torch.where(lsum == 0, torch.ones_like(lsum), lsum)  # a NaN sum stays NaN
    lse = (m + torch.log(lsum.detach())).squeeze(-1)
    return w, lse


def additive_mask(visible: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Combine a bool visibility mask and a float bias into one additive float mask (-inf = hidden)."""
    if bias is None and visible is None:
        return None
    if bias is None:
        assert visible is not None
        zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        return zeros.masked_fill(~visible, float("-inf"))
    out = bias.to(dtype)
    if visible is not None:
        out = out.masked_fill(~visible, float("-inf"))
    return out


def unit_stride(t: Tensor) -> Tensor:
    """``t`` itself when its last dim has stride 1, else a contiguous copy: torch's raw fused CPU
    ops read the last dim as if it were unit-stride."""
    return t if t.stride(-1) == 1 else t.contiguous()




def refuse_create_graph(what: str) -> None:
    """Raise inside a custom backward run with ``create_graph=True`` (grad mode is on there): that backward
    is not itself differentiable, so its gradients would be constants to a second derivative (a gradient
    penalty, a Hessian-vector product), which would then be silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what} has no second derivative (its backward is not differentiable), so "
                           "create_graph=True cannot be honoured: run this call with backend='reference', "
                           "whose backward is autograd's own")

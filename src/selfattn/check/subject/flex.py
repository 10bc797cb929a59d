"""FlexAttention written out in plain torch operations, for the white box to read.

``torch.nn.attention.flex_attention.flex_attention`` runs its kernel through ``torch.compile`` even in eager
mode, so a recording ``TorchFunctionMode`` sees one opaque call (or makes the compile fail). While the white box
records a module, :func:`flex_written_out` puts in its place a function that computes what flex_attention
computes, in the operations the white box reads: the scores ``q @ k^T * scale``, the ``score_mod`` applied to all
of them at once (its index arguments given as broadcast ``arange`` tensors), the block mask's pattern as a
``masked_fill``, the softmax over the keys and the product with the values. Rows whose every key is hidden give 0,
as the kernel's do. What this cannot write out exactly (a block mask made for another length, auxiliary outputs, a
score_mod that needs one index at a time) is left to the real kernel.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["NO_BACKWARD_HERE", "flex_written_out"]

# what a kernel without a backward on the device it ran on says (FlexAttention on CPU, with inputs that require grad)
NO_BACKWARD_HERE = re.compile(r"does not support backward on \w+", re.I)


def _indices(batch: int, heads: int, queries: int, keys: int, device: torch.device) -> tuple[Tensor, ...]:
    """(b, h, q_idx, kv_idx) as broadcast index tensors of shape (B, 1, 1, 1), (1, H, 1, 1), (1, 1, Lq, 1) and
    (1, 1, 1, Lk)."""
    return (torch.arange(batch, device=device).view(-1, 1, 1, 1), torch.arange(heads, device=device).view(1, -1, 1, 1),
            torch.arange(queries, device=device).view(1, 1, -1, 1), torch.arange(keys, device=device).view(1, 1, 1, -1))


def _kept(block_mask: Any, shape: tuple[int, int, int, int], device: torch.device) -> Tensor | None:
    """(B or 1, H or 1, Lq, Lk) bool: the keys a block mask keeps (its blocks, and its mask_mod inside them), or None
    when it cannot be written out (made for other lengths, no mask_mod)."""
    batch, heads, queries, keys = shape
    lengths = getattr(block_mask, "seq_lengths", None)
    mask_mod = getattr(block_mask, "mask_mod", None)
    if lengths is None or tuple(lengths) != (queries, keys) or mask_mod is None:
        return None
    dense = block_mask.to_dense().to(device).bool()  # (B or 1, H or 1, blocks of queries, blocks of keys)
    rows, cols = block_mask.BLOCK_SIZE
    blocks = dense.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)[..., :queries, :keys]
    b, h, q_idx, kv_idx = _indices(batch, heads, queries, keys, device)
    inside = mask_mod(b, h, q_idx, kv_idx)
    if not isinstance(inside, Tensor):
        inside = torch.tensor(bool(inside), device=device)
    return blocks & inside.bool()


def _written_out(real: Callable[..., object]) -> Callable[..., object]:
    """flex_attention's semantics in plain operations, falling back to ``real`` where they cannot be written out."""

    def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Callable | None = None,
                       block_mask: object = None, scale: float | None = None, enable_gqa: bool = False,
                       return_lse: bool = False, kernel_options: object = None, **rest: object) -> object:
        def kernel() -> object:
            return real(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                        **rest)

        if rest.get("return_aux") is not None or query.dim() != 4:
            return kernel()
        batch, heads, queries, _ = query.shape
        keys = key.shape[-2]
        if enable_gqa and key.shape[1] != heads:
            if heads % key.shape[1]:
                return kernel()
            key = key.repeat_interleave(heads // key.shape[1], dim=1)
            value = value.repeat_interleave(heads // value.shape[1], dim=1)
        scores = query @ key.transpose(-2, -1)
        scores = scores * (query.shape[-1] ** -0.5 if scale is None else scale)
        if score_mod is not None:
            try:
                scores = score_mod(scores, *_indices(batch, heads, queries, keys, query.device))
            except Exception:  # a score_mod written for one index at a time (Python control flow on it)
                return kernel()
        kept = None
        if block_mask is not None:
            try:
                kept = _kept(block_mask, (batch, heads, queries, keys), query.device)
            except Exception:
                kept = None
            if kept is None:
                return kernel()
            scores = scores.masked_fill(~kept, float("-inf"))
        weights = scores.softmax(dim=-1)
        if kept is not None and not bool(kept.any(-1).all()):  # a row with every key hidden: 0, as the kernel's
            weights = torch.nan_to_num(weights, nan=0.0)
        out = weights @ value
        if return_lse:
            return out, scores.logsumexp(dim=-1)
        return out

    return flex_attention


@contextmanager
def flex_written_out(module: nn.Module) -> Iterator[None]:
    """While active, ``flex_attention`` as the module reaches it (torch's module attribute, the name imported into
    the module's or a submodule's file, an attribute of a submodule) is :func:`_written_out`."""
    try:
        from torch.nn.attention import flex_attention as flex_module
    except ImportError:  # a torch without FlexAttention
        yield
        return
    real = flex_module.flex_attention
    spaces = {id(vars(flex_module)): vars(flex_module)}
    for m in module.modules():
        spaces.setdefault(id(vars(m)), vars(m))
        source = sys.modules.get(type(m).__module__)
        if source is not None:
            spaces.setdefault(id(vars(source)), vars(source))
    written = _written_out(real)
    patched = [(space, name) for space in spaces.values() for name, value in list(space.items()) if value is real]
    for space, name in patched:
        space[name] = written
    try:
        yield
    finally:
        for space, name in patched:
            space[name] = real

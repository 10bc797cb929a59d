"""A key/value cache for incremental decoding, with a position per token.

Every sequence in the batch keeps its own positions: a token at position p is stored in slot p of
its sequence, and a query at position p sees the written slots j <= p of its own sequence. So
right-padded batches (sequences of different lengths), left-padded prompts (pad tokens given
position -1: never written, their attention output is 0) and speculative multi-token steps need no
special case, and a batch is never assumed to share one position.

Shape legend: B batch, G kv heads, S cache slots (max_len), T new tokens, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["KVCache", "check_fits"]

_HOW = "KVCache.for_module(module, batch_size=..., max_len=...) builds the cache a module needs"


class KVCache(nn.Module):
    """Preallocated keys and values (non-persistent buffers: not saved in state dicts).

    Args:
        batch_size: B. max_len: S, the most positions a sequence may reach.
        num_kv_heads: G. head_dim: D. dtype, device: of the buffers.

    Example:
        >>> cache = KVCache(2, 128, num_kv_heads=2, head_dim=64)      # or KVCache.for_module(mha, ...)
        >>> y = mha(prompt, cache=cache, positions=torch.arange(10).expand(2, 10))
        >>> y = mha(next_tok, cache=cache, positions=torch.tensor([[10], [10]]))
    """

    @classmethod
    def for_module(cls, module: nn.Module, *, batch_size: int, max_len: int) -> KVCache:
        """The cache of a :class:`~selfattn.MultiHeadAttention` (or any module with ``num_kv_heads``
        and ``head_dim``): its kv heads and head dim, in the dtype and on the device of its weights.

        Example:
            >>> cache = KVCache.for_module(mha, batch_size=2, max_len=512)
        """
        try:
            heads, dim = int(module.num_kv_heads), int(module.head_dim)  # type: ignore[arg-type]
            weight = next(module.parameters())
        except (AttributeError, StopIteration):
            raise TypeError(f"KVCache.for_module needs a module with num_kv_heads, head_dim and weights (a "
                            f"selfattn.MultiHeadAttention), got {type(module).__name__}") from None
        return cls(batch_size, max_len, heads, dim, dtype=weight.dtype, device=weight.device)

    k: Tensor  # (B, G, S, D), a buffer
    v: Tensor  # (B, G, S, D), a buffer
    _written: Tensor  # (B, S) bool, a buffer

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        if min(batch_size, max_len, num_kv_heads, head_dim) < 1:
            raise ValueError("batch_size, max_len, num_kv_heads and head_dim must all be >= 1, got "
                             f"{(batch_size, max_len, num_kv_heads, head_dim)}")
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # slots written outside the prefix that every sequence fills (which _fill.full tracks): a
        # decode step that extends that prefix marks nothing, one op less per layer and step
        self.register_buffer("_written", torch.zeros(batch_size, max_len, dtype=torch.bool, device=device),
                             persistent=False)
        self._fill = _Fill()

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def written(self) -> Tensor:
        """Bool (B, S): which slots of each sequence hold a token (a new tensor)."""
        full = self._fill.full
        return self._written | (torch.arange(self.max_len, device=self._written.device) < full)

    def check_fits(self, dtype: torch.dtype, device: torch.device, what: str) -> None:
        """Raise unless keys and values of ``dtype`` on ``device`` (from ``what``) can be stored here as
        they are: another device is an error, and so is another dtype unless autocast is on for that
        device (the attention then casts everything to the autocast dtype anyway)."""
        check_fits(self.k, dtype, device, what, cache="KVCache", how=_HOW)

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept)."""
        self._written.zero_()
        self._fill.used = self._fill.full = 0

    def update(self, positions: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write new keys/values at their positions and return what attention needs.

        Args:
            positions: int (B, T), the position of each new token in its sequence, distinct within a
                row; -1 = padding (not written). Any other negative position raises ValueError.
            k, v: (B, G, T, D) for the new tokens.

        Returns:
            (k, v, visible): k and v (B, G, S', D) for the first S' slots in use, and the bool
            visibility (B, 1, T, S') of those slots from each new token (True = may attend), or
            None when every new token sees every slot in use (all sequences full up to the
            lowest new position), so attention needs no mask.
        """
        # per step, this runs once per layer: buffers come straight from _buffers (not through
        # nn.Module.__getattr__), the fill state is a plain object (no nn.Module.__setattr__), and
        # the common step (the whole batch writes one run of slots) takes narrow views and copies
        # each new key/value once, into its slot
        buffers, fill = self._buffers, self._fill
        kbuf, vbuf, written = buffers["k"], buffers["v"], buffers["_written"]
        assert kbuf is not None and vbuf is not None and written is not None
        b, g, t, d = k.shape
        kshape = kbuf.shape
        if b != kshape[0] or g != kshape[1] or d != kshape[3] or v.shape != k.shape:
            raise ValueError(f"k/v of shape {tuple(k.shape)}/{tuple(v.shape)} do not fit a cache of "
                             f"(B, G, S, D) = {tuple(kshape)}")
        if positions.shape != (b, t) or positions.dtype.is_floating_point or positions.dtype == torch.bool or \
                positions.is_complex():
            raise ValueError(f"positions must be an int tensor (B, T) = ({b}, {t}), got "
                             f"{positions.dtype} {tuple(positions.shape)}")
        if t == 0:
            raise ValueError("update needs at least one new token (T >= 1)")
        if k.dtype != kbuf.dtype or k.device != kbuf.device or v.dtype != k.dtype:
            self.check_fits(k.dtype, k.device, "k")
            self.check_fits(v.dtype, v.device, "v")
        rows = positions.tolist()  # one transfer; the bookkeeping below is plain Python
        first = rows[0]
        lo = first[0]
        run = lo >= 0 and first == list(range(lo, lo + t)) and rows.count(first) == b
        if run:
            hi = lo + t - 1
        else:
            lo, hi = min(min(r) for r in rows), max(max(r) for r in rows)
            _check_positions(rows)
        if hi >= kshape[2]:
            raise ValueError(f"position {hi} does not fit a cache of max_len {kshape[2]}; "
                             "build a larger KVCache")
        if run:  # the whole batch writes slots lo..lo+T-1: one strided copy each into the buffers
            kbuf.narrow(2, lo, t).copy_(k)
            vbuf.narrow(2, lo, t).copy_(v)
            if lo <= fill.full:  # the prefix every sequence fills grows: its slots need no mark
                fill.full = max(fill.full, lo + t)
            else:
                written.narrow(1, lo, t).fill_(True)
        else:
            positions = positions.to(kbuf.device)
            bi, ti = (positions >= 0).nonzero(as_tuple=True)  # padding (-1) is not written
            slots = positions[bi, ti]
            kbuf[bi, :, slots] = k.transpose(1, 2)[bi, ti].to(kbuf.dtype)  # (N, G, D)
            vbuf[bi, :, slots] = v.transpose(1, 2)[bi, ti].to(vbuf.dtype)
            written[bi, slots] = True
        fill.used = used = max(fill.used, hi + 1, 1)
        k_all, v_all = kbuf.narrow(2, 0, used), vbuf.narrow(2, 0, used)
        if lo >= used - 1 and fill.full >= used:
            return k_all, v_all, None  # every new token is at the end of a full sequence: sees all
        positions = positions.to(kbuf.device)
        j = torch.arange(used, device=kbuf.device)
        visible = (written[:, None, :used] | (j < fill.full)) & (j <= positions[:, :, None])  # (B, T, S')
        visible &= (positions >= 0)[:, :, None]
        return k_all, v_all, visible[:, None]


def check_fits(buffer: Tensor, dtype: torch.dtype, device: torch.device, what: str, *, cache: str, how: str) -> None:
    """Raise unless keys and values of ``dtype`` on ``device`` (from ``what``) can be stored in ``buffer`` of the
    cache class ``cache`` as they are: another device is a ValueError, another dtype a TypeError unless autocast
    is on for that device. ``how`` says how to build the right cache."""
    if device != buffer.device:
        raise ValueError(f"this {cache} is on {buffer.device} but {what} is on {device}; {how} "
                         f"(or pass device={str(device)!r} to {cache})")
    if dtype != buffer.dtype and not (torch.amp.is_autocast_available(device.type)
                                      and torch.is_autocast_enabled(device.type)):
        raise TypeError(f"this {cache} holds {buffer.dtype} keys and values but {what} is {dtype}; {how} "
                        f"(or pass dtype={dtype} to {cache})")


def _check_positions(rows: list[list[int]]) -> None:
    """Positions are -1 (padding) or a slot, and a row writes each slot at most once (which write would win is
    undefined)."""
    for b, row in enumerate(rows):
        bad = [p for p in row if p < -1]
        if bad:
            raise ValueError(f"positions[{b}] holds {bad[0]}: a position is a slot >= 0, or -1 for padding "
                             "(not written); no other negative value")
        slots = [p for p in row if p >= 0]
        if len(set(slots)) != len(slots):
            twice = next(p for p in slots if slots.count(p) > 1)
            raise ValueError(f"positions[{b}] writes slot {twice} more than once in one update: give each new token "
                             "of a sequence its own position")


class _Fill:
    """How far a cache is filled; a plain object, so that each step updates it without going
    through ``nn.Module.__setattr__``."""

    __slots__ = ("full", "used")

    def __init__(self) -> None:
        self.used = 0  # slots 0..used-1 hold at least one sequence's token
        self.full = 0  # slots 0..full-1 hold a token of every sequence

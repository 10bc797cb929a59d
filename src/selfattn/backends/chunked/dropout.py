"""Dropout as a property of the call: keep-masks drawn per tile of a fixed grid over the whole call.

Each tile of the :data:`DROPOUT_TILE` x :data:`DROPOUT_TILE` grid over the (Lq, Lk) scores of a call
draws its keep-mask from a generator seeded by (seed, tile), so a block of any size, computed by
any caller (the forward, the backward, another rank of the ring, another chunked tiling), assembles
its part of one pattern, which depends on the seed alone.

Shape legend: B batch, Hq query heads, Lq/Lk lengths, R rows of a block, C its keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DROPOUT_TILE", "Dropout", "draw_seed", "dropout_pattern", "keep_mask"]

DROPOUT_TILE = 128
"""Rows and keys of one tile of the dropout grid."""


def keep_mask(seed: int, shape: tuple[int, int, int, int], p: float, qb: int, kb: int,
              device: torch.device) -> Tensor:
    """The dropout keep-mask of tile (qb, kb) of the grid: bool (B, Hq, rows, cols), True = kept.

    A pure function of (seed, tile), so forward, backward and every rank draw the same pattern.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + qb * 65_537 + kb) % (1 << 63))
    return torch.rand(shape, generator=gen, device=device) >= p


@dataclass(frozen=True)
class Dropout:
    """Dropout of one call: probability ``p``, keep-masks drawn from ``seed`` (see :func:`keep_mask`)."""

    p: float
    seed: int

    def keep(self, rows: range, keys: range, sizes: tuple[int, int], device: torch.device) -> Tensor:
        """The keep-mask of query rows ``rows`` and keys ``keys`` of a call of ``sizes`` (B, Hq): bool
        (B, Hq, R, C), assembled from the grid's tiles. Every tile is drawn whole, also past the call's
        end, so that a position's draw does not depend on the call's lengths (a context-parallel row
        padded to the layout's multiple draws what the unpadded call draws)."""
        t = DROPOUT_TILE
        strips = []
        for t0 in range(rows.start - rows.start % t, rows.stop, t):
            tiles = []
            for u0 in range(keys.start - keys.start % t, keys.stop, t):
                tile = keep_mask(self.seed, (*sizes, t, t), self.p, t0 // t, u0 // t, device)
                tiles.append(tile[..., max(keys.start, u0) - u0:min(keys.stop, u0 + t) - u0])
            strips.append(torch.cat(tiles, dim=-1)[:, :, max(rows.start, t0) - t0:min(rows.stop, t0 + t) - t0])
        return torch.cat(strips, dim=-2)


def dropout_pattern(seed: int, b: int, hq: int, lq: int, lk: int, p: float, device: torch.device) -> Tensor:
    """The whole keep-mask (B, Hq, Lq, Lk) that a call with this seed uses (for tests and debugging)."""
    return Dropout(p, seed).keep(range(lq), range(lk), (b, hq), torch.device(device))


def draw_seed() -> int:
    """The dropout seed of one call, drawn from torch's global generator (so manual_seed rules it)."""
    return int(torch.randint(0, 1 << 62, (1,)).item())

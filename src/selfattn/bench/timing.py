"""Wall-clock timing of callables, shared by the bench suites, the bench worker and scripts/gpu_check.py.

Each timed call is bracketed by a device synchronisation on CUDA, so the time covers the kernels
it launched and not just their launch. Several callables are timed in turns (interleaved), so all
of them see the same machine noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["Timing", "sync", "time_call", "time_interleaved", "time_one"]


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for elsewhere."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device: torch.device | str) -> float:
    """Seconds one call of ``fn`` takes, queued device work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Timing:
    """The repeats of one callable, in seconds."""

    times: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the repeats disagree (0 for a single repeat)."""
        return (self.max - self.min) / self.median if self.median > 0 else 0.0


def time_interleaved(fns: Mapping[str, Callable[[], object]], repeats: int, device: torch.device | str, *,
                     warmup: int = 1) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, taking turns, after ``warmup`` untimed calls of each.

    Returns:
        name -> :class:`Timing` (empty ``times`` when ``repeats`` is 0).

    Example:
        >>> t = time_interleaved({"a": f, "b": g}, repeats=20, device="cuda")
        >>> t["a"].median / t["b"].median
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_call(fn, device))
    return {name: Timing(ts) for name, ts in times.items()}


def time_one(fn: Callable[[], object], repeats: int, device: torch.device | str, *, warmup: int = 1) -> Timing:
    """:func:`time_interleaved` for a single callable."""
    return time_interleaved({"fn": fn}, repeats, device, warmup=warmup)["fn"]

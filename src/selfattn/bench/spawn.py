"""Run a function on W spawned processes with a time limit (the distributed bench points, the tests' workers)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.multiprocessing as mp

__all__ = ["spawn_and_join"]


def spawn_and_join(fn: Callable[..., None], args: tuple, world: int, limit_s: float) -> bool:
    """Run ``fn(rank, *args)`` on ``world`` spawned processes; True when all ended within ``limit_s``
    seconds (those still running then are killed, so a hung rank never hangs the caller)."""
    ctx = mp.spawn(fn, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + limit_s
    done = False
    while not done and time.monotonic() < deadline:
        try:
            done = ctx.join(timeout=1.0)
        except mp.ProcessExitedException:
            break
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    return done

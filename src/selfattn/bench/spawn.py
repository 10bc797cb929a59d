"""Run a function on W spawned processes with a time limit (the distributed bench points, the tests' workers)."""

from __future__ import annotations

import json
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp

__all__ = ["run_ranks", "spawn_and_join"]


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


def run_ranks(fn: Callable[..., None], spec: dict, world: int, limit_s: float) -> list[dict] | str:
    """``fn(rank, world, port, spec, folder)`` on ``world`` processes, each writing ``{rank}.json`` (or
    ``{rank}.err``) into ``folder``: the ranks' results, or the first error (or "timed out")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        done = spawn_and_join(fn, (world, port, spec, out), world, limit_s)
        errors = [Path(out, f"{r}.err").read_text() for r in range(world) if Path(out, f"{r}.err").exists()]
        if errors or not done:
            return (errors or ["timed out"])[0][:200]
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]

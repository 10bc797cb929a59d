"""Run a function on W spawned processes with a time limit (the distributed bench points, the tests' workers),
and a module's JSON worker in one fresh process (:func:`json_worker`)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "json_worker", "run_ranks", "spawn_and_join"]


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_entry(rank: int, world: int, port: int, spec: dict, out: str, body: Callable[[int, int, dict], dict],
                timeout_s: float) -> None:
    """One rank: a gloo group on 127.0.0.1, one CPU thread, ``body(rank, world, spec)`` written to
    ``{rank}.json`` (or its exception to ``{rank}.err``); the process then exits at once."""
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        Path(out, f"{rank}.json").write_text(json.dumps(body(rank, world, spec)))
        code = 0
    except BaseException as e:
        Path(out, f"{rank}.err").write_text(f"{type(e).__name__}: {e}")
    finally:
        os._exit(code)


def run_ranks(body: Callable[[int, int, dict], dict], spec: dict, world: int, limit_s: float,
              timeout_s: float = 600, env: dict[str, str] | None = None) -> list[dict] | str:
    """``body(rank, world, spec)`` (a module-level function) on ``world`` spawned ranks of a gloo group whose
    transfers wait at most ``timeout_s``, with ``env`` added to their environment: the ranks' results, or the
    first error (or "timed out" past ``limit_s``)."""
    with tempfile.TemporaryDirectory() as out, _environment(env or {}):
        done = spawn_and_join(_rank_entry, (world, free_port(), spec, out, body, timeout_s), world, limit_s)
        errors = [Path(out, f"{r}.err").read_text() for r in range(world) if Path(out, f"{r}.err").exists()]
        if errors or not done:
            return (errors or ["timed out"])[0][:200]
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process while processes are spawned (they copy it), then put back."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def json_worker(module: str, spec: dict) -> dict:
    """Run ``python -m module '<spec as JSON>'`` in a fresh process: the JSON of its last line of output,
    or {"error": why} (its exit status and last line of stderr)."""
    proc = subprocess.run([sys.executable, "-m", module, json.dumps(spec)], capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        return {"error": f"worker exited {proc.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


"""A process group as context parallelism uses it: ranks, peers for point-to-point, and waits that
name the rank they waited for.

Every transfer waits at most ``timeout`` seconds (``float("inf")``: as long as the process group
itself allows, its own timeout from ``init_process_group``); past it, or when the transport reports
that a peer is gone, the error names the rank that did not answer, and after such an error the
group should be destroyed.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT_S", "Group", "Stats", "current_stats", "group_of", "process_group", "record"]

DEFAULT_TIMEOUT_S = 300.0
"""How long a collective waits for the other ranks when ``timeout`` is not given."""


@dataclass
class Stats:
    """What the calls inside :func:`record` did on this rank.

    Attributes:
        compute_s: seconds spent computing blocks (forward and backward).
        wait_s: seconds spent waiting for transfers after the computation they overlap.
        blocks: (query chunk, key chunk) pairs computed.
        skipped: pairs the mask leaves empty, not computed.
        work: query-key pairs computed (rows x keys summed over blocks), the unit of causal balance.
        sent_bytes: bytes this rank sent.
    """

    compute_s: float = 0.0
    wait_s: float = 0.0
    blocks: int = 0
    skipped: int = 0
    work: int = 0
    sent_bytes: int = 0


_STATS: contextvars.ContextVar[Stats | None] = contextvars.ContextVar("selfattn_distributed_stats", default=None)


@contextlib.contextmanager
def record() -> Iterator[Stats]:
    """Count work, waiting and traffic of the distributed calls (and backwards) inside the block.

    Example:
        >>> with sad.record() as stats:
        ...     sad.attention(q_local, k_local, v_local, causal=True).sum().backward()
        >>> stats.wait_s, stats.blocks, stats.skipped
    """
    stats = Stats()
    token = _STATS.set(stats)
    try:
        yield stats
    finally:
        _STATS.reset(token)


def current_stats() -> Stats | None:
    """The :class:`Stats` of the innermost :func:`record` block, or None outside one."""
    return _STATS.get()


@dataclass(frozen=True)
class Group:
    """A process group: this rank and the world size within it, and how long a transfer may wait
    (None: no limit of our own)."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    timeout: datetime.timedelta | None

    def peer(self, group_rank: int) -> int:
        """The global rank of a group rank (P2P ops take global ranks)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def wait(self, works: Sequence[dist.Work], what: str, peers: Sequence[int]) -> float:
        """Wait for every transfer (``works[i]`` with ``peers[i]``, or all with all of ``peers``);
        a failure names the rank, and says whether it timed out or its connection broke. Returns the
        seconds waited."""
        t0 = time.perf_counter()
        for i, work in enumerate(works):
            try:
                work.wait() if self.timeout is None else work.wait(timeout=self.timeout)
            except RuntimeError as e:
                peer = peers[i] if len(works) == len(peers) else None
                who = f"rank {peer}" if peer is not None else f"one of ranks {sorted(set(peers))}"
                raise RuntimeError(f"selfattn.distributed: rank {self.rank} {self._failed(who, t0)} while "
                                   f"exchanging {what} ({type(e).__name__}: {e})") from e
        return time.perf_counter() - t0

    def _failed(self, who: str, t0: float) -> str:
        """What happened to a transfer that failed after waiting since ``t0``."""
        waited = time.perf_counter() - t0
        if self.timeout is not None and waited >= self.timeout.total_seconds():
            return (f"waited {self.timeout.total_seconds():g} s for {who} of the group, which stopped answering: "
                    "it raised, hangs, or is not calling the same selfattn.distributed function")
        return (f"lost {who} of the group after {waited:.1f} s (the transport reports it gone: it exited or "
                "crashed, or its group was destroyed)")


def process_group(group: object, mesh_dim: str | None = None) -> dist.ProcessGroup | None:
    """The process group of ``group``: a ProcessGroup or None (the default group) as it is, a
    ``DeviceMesh`` of one dimension (``mesh["cp"]``) as its group, or a mesh of several
    dimensions as the group of ``mesh_dim``."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        names = group.mesh_dim_names or ()
        if mesh_dim is not None:
            if mesh_dim not in names:
                raise ValueError(f"mesh_dim {mesh_dim!r} is not a dimension of the mesh (its dimensions: {names})")
            return group.get_group(mesh_dim)
        if group.ndim != 1:
            raise ValueError(f"a device mesh of {group.ndim} dimensions {names} needs the context-parallel one "
                             "named: pass mesh['cp'] (a one-dimensional mesh) or mesh_dim='cp'")
        return group.get_group()
    if mesh_dim is not None:
        raise ValueError("mesh_dim names a dimension of a DeviceMesh; it was given with a process group")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, a DeviceMesh or None, got "
                        f"{type(group).__name__}")
    return group


def group_of(group: object, timeout: object) -> Group:
    """The :class:`Group` of ``group`` (None: the default group; a one-dimensional ``DeviceMesh``: its
    group) with ``timeout`` seconds (None: :data:`DEFAULT_TIMEOUT_S`; ``float("inf")``: no limit of
    our own)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("selfattn.distributed needs torch.distributed initialised: call "
                           "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun does "
                           "the rendezvous), or use selfattn.attention on one process")
    group = process_group(group)
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 (float('inf') for no limit), got {timeout!r}")
    limit = None if math.isinf(timeout) else datetime.timedelta(seconds=timeout)
    return Group(group, dist.get_rank(group), dist.get_world_size(group), limit)

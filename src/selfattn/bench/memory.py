"""Peak extra memory of a stretch of code, on the CPU (the process's resident high-water mark) or CUDA."""

from __future__ import annotations

import gc

import torch

__all__ = ["MALLOC_ENV", "Memory"]

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
"""The environment of the processes a suite spawns to measure memory on the CPU: glibc's mmap threshold
fixed at 64 KiB, so that a freed tensor leaves the resident set at once and the resident peak is the
tensors' peak (what ``max_memory_allocated`` gives on CUDA). With glibc's default the threshold rises to
the largest block freed so far (up to 32 MiB), smaller blocks come from the heap, and the peak also holds
what malloc keeps of freed tensors for reuse: a figure of the allocator's history, not of the code."""


class Memory:
    """Peak extra memory of what runs between start() and stop()."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the high-water mark to the current resident size
            self.base = self._status("VmRSS")

    def stop(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base

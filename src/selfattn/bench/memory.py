"""Peak extra memory of a stretch of code, on the CPU (the process's resident high-water mark) or CUDA."""

from __future__ import annotations

import gc

import torch

__all__ = ["Memory"]


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

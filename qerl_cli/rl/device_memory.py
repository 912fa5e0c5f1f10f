"""The device's memory at run time: PyTorch's cached blocks handed back before vLLM wakes up, the free
and total bytes the plan (:mod:`qerl_cli.rl.memory`) is sized on, and each step's measured peaks.
"""

from __future__ import annotations

import gc

import torch

from qerl_cli.torch_utils import GIB


def release_cached_memory() -> dict[str, float]:
    """Give PyTorch's cached (unused) blocks back to the driver before vLLM wakes up.

    The caller drops its own references (activations, logits, losses) first: a block still
    referenced cannot be released. Returns the device's free memory after, for the metrics.
    """
    if not torch.cuda.is_available():
        return {}  # nothing to hand back, and a full gc pass costs ~0.1 s a step on a CPU
    gc.collect()  # reference cycles (autograd graphs kept alive by a traceback or a closure)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return {"memory/free_before_wake_gib": free / GIB}


def device_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the current CUDA device, None without one."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


class PeakTracker:
    """Per-step peaks: PyTorch's allocator (this process, vLLM in-process included) and the whole
    device (``mem_get_info``: every process, e.g. a ballast too), sampled at phase ends."""

    def __init__(self) -> None:
        self.min_free: int | None = None
        self.total: int | None = None

    def start_step(self) -> None:
        self.min_free = None
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.sample()

    def sample(self) -> None:
        info = device_memory()
        if info is None:
            return
        free, self.total = info
        self.min_free = free if self.min_free is None else min(self.min_free, free)

    def metrics(self) -> dict[str, float]:
        if not torch.cuda.is_available():
            return {}
        self.sample()
        out = {
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        }
        if self.min_free is not None and self.total is not None:
            out["memory/device_peak_used_gib"] = (self.total - self.min_free) / GIB
            out["memory/device_total_gib"] = self.total / GIB
        return out

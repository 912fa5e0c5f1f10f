"""Device and dtype names from configs, resolved in one place for every stage, the CPU thread count of
the CPU paths (demo, tiny-base, CPU training and evaluation), and the CPU time estimates and the way a
line says a duration or a model's size."""

from __future__ import annotations

import gc
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl_cli.errors import QerlError

# Bytes in a GiB: the unit of every memory figure (the memory plan, the base copies, the bench's cap).
GIB = 2**30
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_device(name: str, setting: str = "--device") -> torch.device:
    """The device ``name`` names (``auto``: CUDA when a GPU is visible, else the CPU), refused unless it is
    one qerl runs on (the CPU or a CUDA GPU: torch also parses ``mps``, ``meta`` and others, which no
    stage supports). Whether a GPU is there is :func:`resolve_device`'s question.

    ``setting`` is how the user spells the option (``--device``, ``train.device``) in the message.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise QerlError(f"{setting}={name} is not a device qerl runs on; use auto, cpu or cuda[:N]")
    return device


def resolve_device(name: str, setting: str = "--device") -> torch.device:
    """:func:`parse_device`, and asking for CUDA without a GPU is an error."""
    device = parse_device(name, setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QerlError(f"{setting}={name} but this machine has no CUDA GPU; use {setting}=cpu or auto")
    return device


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (strings pass through)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def device_label(device: torch.device | str) -> str:
    """What ran the numbers, for reports and figures: the GPU's name as CUDA gives it or ``CPU (x86_64)``."""
    if isinstance(device, str):
        device = resolve_device("auto") if device == "auto" else torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device.index or 0)
    return f"{device.type.upper()} ({platform.machine() or 'unknown'})"


def free_accelerator_memory() -> None:
    """Objects just dropped (a model, an engine, an optimizer) collected and PyTorch's cached GPU blocks
    given back to the driver, so the next model, engine or process sees them as free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- CPU threads ------------------------------------------------------------------------------------
# torch runs one OpenMP thread per physical core and its threads wait for each other at the end of every
# parallel op. When another process holds a core, the thread sharing it stalls all the others: on a
# 2-core machine beside one CPU-bound process, a loop of 256x256 matmuls took 21.4 s on 2 threads and
# 0.7 s on 1. So the CPU paths run on the cores that are free now, never more than torch would.
THREADS_ENV = "QERL_NUM_THREADS"
_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuLoad:
    """What the machine looks like when a CPU path starts (read by :func:`read_cpu_load`)."""

    cores: int  # CPUs this process may run on (its affinity set)
    quota_cores: float | None  # the cgroup's CPU quota in cores; None when unlimited
    busy_others: float  # cores other processes kept busy during the reading (/proc/stat less our own)
    runnable_others: int  # threads of other processes runnable right now (median of a few samples)
    torch_default: int  # what torch would use (its physical-core count, or OMP_NUM_THREADS)


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    default: int  # torch's own count, for comparison
    reason: str

    @property
    def lowered(self) -> bool:
        return self.threads < self.default


def choose_cpu_threads(load: CpuLoad, env: Mapping[str, str]) -> ThreadChoice:
    """The thread count for a CPU path: ``QERL_NUM_THREADS`` when set, torch's own count when
    ``OMP_NUM_THREADS`` is set (torch has already read it), else the cores free now.

    Free cores are the usable ones (affinity, capped by a cgroup quota) less the busier reading of
    other work now: the CPU time other processes used during a short window (our own subtracted), or
    the runnable threads of other processes seen in it. Not the load average: its one-minute mean still
    counts the command the user ran just before (a finished process, or the user's own earlier qerl
    command), which halved the demo's threads on an idle machine. A core counts as free when at least
    3/4 of it is: one thread too many costs tenfold, one too few at most the share of that core.
    """
    explicit = env.get(THREADS_ENV, "").strip()
    if explicit:
        if not explicit.isdigit() or int(explicit) < 1:
            raise QerlError(f"{THREADS_ENV} must be a positive whole number of threads, got {explicit!r}")
        return ThreadChoice(int(explicit), load.torch_default, f"{explicit} CPU threads ({THREADS_ENV})")
    if env.get("OMP_NUM_THREADS", "").strip():
        return ThreadChoice(
            load.torch_default, load.torch_default, f"{load.torch_default} CPU threads (OMP_NUM_THREADS)"
        )
    usable = float(load.cores)
    busy = max(load.busy_others, float(load.runnable_others))
    if load.quota_cores is not None and load.quota_cores < load.cores:
        # A container: the load figures describe the whole host, of which this cgroup has a share.
        busy *= load.quota_cores / load.cores
        usable = load.quota_cores
    ceiling = max(1, min(load.torch_default, math.floor(usable)))
    threads = max(1, min(ceiling, math.floor(usable - busy + 0.25)))
    reason = (
        f"{threads} CPU thread{'s' if threads > 1 else ''}: {usable:g} usable cores, {busy:.1f} busy with "
        f"other work ({THREADS_ENV}=N chooses)"
    )
    return ThreadChoice(threads, load.torch_default, reason)


def _cgroup_quota_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this container in cores (cgroup v2 ``cpu.max`` or v1 ``cfs_quota_us``)."""
    try:
        if (root / "cpu.max").is_file():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def _stat_jiffies(stat: Path = Path("/proc/stat")) -> tuple[int, int, int] | None:
    """(busy, total) CPU time of the whole machine in clock ticks, and its CPU count; None without /proc."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    fields = [int(x) for x in lines[0].split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is already inside user and nice)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    busy = sum(fields[:8]) - idle
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    return busy, busy + idle, max(1, cpus)


def _own_jiffies(stat: Path = Path("/proc/self/stat")) -> int:
    """This process's CPU time (user + system, every thread) in clock ticks."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)


def others_busy_cores(before: tuple[int, int, int], after: tuple[int, int, int], own_ticks: int) -> float:
    """Cores kept busy by other processes between two /proc/stat readings, ``own_ticks`` (this process's
    CPU time meanwhile) taken out."""
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0:
        return 0.0
    return max(0.0, (busy - own_ticks) / total * after[2])


def read_cpu_load(samples: int = 6, interval_s: float = 0.05) -> CpuLoad:
    """Read the machine's load now (about 0.25 s); without /proc (not Linux) nothing counts as busy."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    start, own_start = _stat_jiffies(), _own_jiffies()
    running = []
    for index in range(samples):
        try:
            fields = Path("/proc/loadavg").read_text().split()
        except OSError:
            break
        running.append(int(fields[3].split("/")[0]) - 1)  # less this thread, which is reading
        if index + 1 < samples:
            time.sleep(interval_s)
    end, own_end = _stat_jiffies(), _own_jiffies()
    busy = others_busy_cores(start, end, own_end - own_start) if start and end else 0.0
    others = max(0, round(statistics.median(running))) if running else 0
    return CpuLoad(cores, _cgroup_quota_cores(), busy, others, torch.get_num_threads())


_chosen: ThreadChoice | None = None


def use_free_cpu_threads(env: Mapping[str, str] | None = None) -> ThreadChoice:
    """Set torch's CPU thread count by :func:`choose_cpu_threads`, once per process (the first CPU
    path decides: a later reading would count this process's own threads as other work)."""
    global _chosen
    if _chosen is None:
        _chosen = choose_cpu_threads(read_cpu_load(), os.environ if env is None else env)
        torch.set_num_threads(_chosen.threads)
        # debug: the command says it where it matters (cli.app.use_free_cpu_threads: a lowered count), once;
        # at info it came twice under a command that logs at info (qerl compare)
        _LOG.debug("%s", _chosen.reason)
    return _chosen


def runs_on_cpu(device_name: str) -> bool:
    """Whether a config's device setting (``auto``, ``cpu``, ``cuda:1``) means the CPU on this machine."""
    return device_name.split(":")[0] == "cpu" or (device_name == "auto" and not torch.cuda.is_available())


# -- CPU time estimates ----------------------------------------------------------------------------
# What train, quantize and eval say at their start on a CPU: an estimate from the configuration, said to
# be one. The rate per thread is that of the one CPU run measured end to end (its figures and the check of
# a training step against the estimate: docs/tools.md); re-derive it there when a CPU run disagrees.
# Sampling one token at a time uses the cores far worse (small matrices, the per-token Python of generate):
# counted 4x. A 4-bit base is dequantized at every forward and backward: counted 1.5x.
CPU_FLOPS_PER_THREAD = 25e9
DECODE_COST = 4.0
FOUR_BIT_COST = 1.5


def cpu_seconds(
    params: int,
    *,
    forward_tokens: float = 0.0,
    decode_tokens: float = 0.0,
    backward_tokens: float = 0.0,
    four_bit: bool = False,
    threads: int | None = None,
) -> float:
    """Estimated CPU seconds of a model of ``params`` parameters processing that many tokens: forward
    passes (prefill, calibration, logprobs), tokens sampled one at a time, and backward passes (twice a
    forward's cost), on ``threads`` threads (torch's count by default)."""
    work = forward_tokens + DECODE_COST * decode_tokens + 2.0 * backward_tokens
    seconds = 2.0 * params * work / (CPU_FLOPS_PER_THREAD * (threads or torch.get_num_threads()))
    return seconds * (FOUR_BIT_COST if four_bit else 1.0)


def duration(seconds: float) -> str:
    """``75`` -> ``1m15s``, ``5400`` -> ``1h30m``, ``200000`` -> ``2.3 days``: how long, for a line."""
    seconds = max(0, round(seconds))
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def estimated_duration(seconds: float) -> str:
    """An estimate's duration for a line: ``~1m15s``; ``under 1s`` below a second (a tiny model's step),
    where ``~0s`` would read as nothing at all."""
    return "under 1s" if seconds < 1 else f"~{duration(seconds)}"


def parameter_count(params: int) -> str:
    """``134_515_008`` -> ``135M``, ``7_615_616_512`` -> ``7.6B``, ``620_000`` -> ``620K``, ``1_200_000``
    -> ``1.2M``, ``512`` -> ``512``: a model's size for a line, in the unit that keeps a figure (a tiny
    model's ``0M`` says nothing): one decimal below 10 of a unit, whole ones above."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        # From 99.95% of a unit on, the unit below would print 1000 (999.6K): say 1M.
        if params >= 0.9995 * scale:
            value = params / scale
            text = f"{value:.0f}" if value >= 9.95 else f"{value:.1f}".removesuffix(".0")
            return f"{text}{unit}"
    return str(params)

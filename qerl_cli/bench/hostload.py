"""Was the host busy while a benchmark measured? The host's load and the other processes on the measured
GPU, sampled at the start of a run, each time its report is written (after every case or section; ``bench
scaling``, whose report is written once, after every training step) and at its end, and the one rule
that calls a run busy.

A busy host depresses rollout figures unevenly: vLLM's decode loop needs a CPU core at every step, so a
host whose cores are taken by other work starves it, and another process on the same GPU takes its
memory bandwidth and SMs. A report says so (``host_busy``, ``host_busy_reason``, ``host_load``) so that
nobody compares its figures with an idle run's unawares. The measured GPU's clocks are read at the same
points and kept in ``host_load.gpu_clocks``, with their own verdict (:mod:`qerl_cli.bench.gpuclocks`),
beside those each case read under load (:mod:`qerl_cli.bench.gpusampler`, added by
:meth:`HostLoad.add_case_clocks`).

The readings come through :class:`HostProbes` (callables), so tests pass fakes; the defaults read
``os.getloadavg``, ``os.cpu_count``, this process's CPU time and ``nvidia-smi``. This module imports no
torch: :mod:`qerl_cli.bench.header` supplies the measured GPU's UUID.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qerl_cli.bench.gpuclocks import (
    NVIDIA_SMI_TIMEOUT_S,
    GpuClocks,
    GpuReading,
    throttle_warning,
    uuid_digits,
)

# The rule: a run is busy when the 1-minute load of *other* processes exceeds this fraction of the
# host's CPUs at any sample, or another process uses the measured GPU. Half, because os.cpu_count()
# counts logical CPUs and GPU servers commonly run two per physical core (SMT): above half every physical
# core has a runnable thread, so the engine's CPU-bound step loop (scheduler, sampler, detokenizer)
# shares its core and the GPU waits between steps. Below half a loaded host still has a core to spare.
BUSY_LOAD_FRACTION = 0.5
# The kernel's 1-minute load average decays with this time constant (seconds).
LOAD_WINDOW_S = 60.0
# The GPU's processes are listed and its clocks read at most this often (the load, which costs nothing,
# at every sample): `lora-tune` writes its report after every key, and nvidia-smi can take a second on a
# many-GPU host.
GPU_QUERY_INTERVAL_S = 10.0
NO_GPU = "no GPU measured"


# --------------------------------------------------------------------------------------------
# Default readings
# --------------------------------------------------------------------------------------------
def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (a vLLM case's worker)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def process_age_seconds(proc: str = "/proc") -> float | None:
    """Seconds since this process started (Linux's /proc), None where that cannot be read."""
    try:
        with open(f"{proc}/self/stat", encoding="utf-8", errors="replace") as handle:
            # Field 22 (start time, clock ticks after boot) counted after the ")" closing the name.
            started_ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open(f"{proc}/uptime", encoding="utf-8", errors="replace") as handle:
            uptime = float(handle.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class LoadSample:
    """One reading of the host's load averages, and this run's own estimated share of the 1-minute one.

    ``own_1m`` is this process's CPU use (with its finished children's) averaged the way the kernel
    averages the load, so a CPU benchmark that keeps every core busy itself is not called busy."""

    elapsed_s: float  # since the run's first sample
    load_1m: float
    load_5m: float
    load_15m: float
    own_1m: float

    @property
    def others_1m(self) -> float:
        return max(0.0, self.load_1m - self.own_1m)

    def to_dict(self) -> dict[str, Any]:
        return {"elapsed_s": self.elapsed_s, "load_1m": self.load_1m, "load_5m": self.load_5m,
                "load_15m": self.load_15m, "own_1m": self.own_1m}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoadSample:
        return cls(data["elapsed_s"], data["load_1m"], data["load_5m"], data["load_15m"], data["own_1m"])


@dataclass
class GpuProcess:
    """A process other than this run's on the measured GPU, as ``nvidia-smi`` lists it."""

    pid: int
    used_memory_mib: int | None  # None where nvidia-smi does not say ([N/A])

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "used_memory_mib": self.used_memory_mib}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuProcess:
        return cls(data["pid"], data.get("used_memory_mib"))

    def label(self) -> str:
        return f"pid {self.pid}" + ("" if self.used_memory_mib is None else f", {self.used_memory_mib} MiB")


@dataclass
class GpuScan:
    """One listing of the processes on the measured GPU other than this run's: ``others``, processes of
    this PID namespace, and ``unseen``, pids it does not have. nvidia-smi reports the host's pids, so
    inside a container those are another container's processes or this run's own seen from the host,
    which cannot be told apart: they are recorded and do not make a run busy."""

    others: list[GpuProcess] = field(default_factory=list)
    unseen: list[GpuProcess] = field(default_factory=list)


@dataclass(frozen=True)
class HostProbes:
    """Where the readings come from. ``gpu_processes`` lists the measured GPU's other processes and
    ``gpu_clocks`` reads its clock state (:class:`~qerl_cli.bench.gpuclocks.NvidiaSmiClocks`), or each
    says why that is unknown (no GPU, no nvidia-smi)."""

    loadavg: Callable[[], tuple[float, float, float]] = os.getloadavg
    cpu_count: Callable[[], int | None] = os.cpu_count
    own_cpu_s: Callable[[], float] = own_cpu_seconds
    process_age_s: Callable[[], float | None] = process_age_seconds
    clock: Callable[[], float] = time.monotonic
    gpu_processes: Callable[[], GpuScan | str] = lambda: NO_GPU
    gpu_clocks: Callable[[], GpuReading | str] = lambda: NO_GPU


def parent_pid(pid: int, proc: str = "/proc") -> int | None:
    """The parent of ``pid``; None where this PID namespace has no such process."""
    try:
        with open(f"{proc}/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            return int(handle.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def owner(pid: int, me: int, parent_of: Callable[[int], int | None] = parent_pid) -> str:
    """``"ours"`` (this process or a descendant: an engine's worker), ``"other"``, or ``"unseen"`` (no
    such process in this PID namespace)."""
    if pid != me and parent_of(pid) is None:
        return "unseen"
    seen: set[int] = set()
    while pid and pid not in seen:
        if pid == me:
            return "ours"
        seen.add(pid)
        pid = parent_of(pid) or 0
    return "other"


def parse_compute_apps(text: str, gpu_uuid: str) -> list[GpuProcess]:
    """The processes of ``nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid`` (CSV, no header, no
    units) on the GPU ``gpu_uuid``."""
    found = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and uuid_digits(parts[2]) == uuid_digits(gpu_uuid):
            found.append(GpuProcess(int(parts[0]), int(parts[1]) if parts[1].isdigit() else None))
    return found


def nvidia_smi_processes(
    gpu_uuid: str | None,
    run: Callable[..., Any] = subprocess.run,
    which: Callable[[str], str | None] = shutil.which,
    parent_of: Callable[[int], int | None] = parent_pid,
) -> GpuScan | str:
    """The processes on the GPU ``gpu_uuid`` that are not this run's, as nvidia-smi lists them, or why
    they are unknown."""
    if gpu_uuid is None:
        return "the measured GPU's UUID is unknown"
    exe = which("nvidia-smi")
    if exe is None:
        return "nvidia-smi not found"
    query = [exe, "--query-compute-apps=pid,used_memory,gpu_uuid", "--format=csv,noheader,nounits"]
    try:
        done = run(query, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    if done.returncode != 0:
        return f"nvidia-smi exited {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
    scan, me = GpuScan(), os.getpid()
    for process in parse_compute_apps(done.stdout, gpu_uuid):
        kind = owner(process.pid, me, parent_of)
        if kind != "ours":
            (scan.others if kind == "other" else scan.unseen).append(process)
    return scan


def _merged(before: list[GpuProcess] | None, found: list[GpuProcess]) -> list[GpuProcess]:
    """Every process seen so far, each with the most memory it was seen holding."""
    seen = {p.pid: p for p in before or []}
    for process in found:
        earlier = seen.get(process.pid)
        if earlier is None or (process.used_memory_mib or 0) > (earlier.used_memory_mib or 0):
            seen[process.pid] = process
    return sorted(seen.values(), key=lambda p: p.pid)


class _Sampler:
    """The running state behind a :class:`HostLoad`: the probes, this process's CPU time at the last
    sample and its 1-minute share, and whether the busy and throttled warnings were printed."""

    def __init__(self, probes: HostProbes, warn: Callable[[str], None]) -> None:
        self.probes = probes
        self.warn = warn
        self.warned = self.throttle_warned = False
        self.started = self.last_clock = probes.clock()
        self.last_gpu_query: float | None = None
        self.last_cpu = probes.own_cpu_s()
        # Before the first sample this process ran for its age: its CPU time spread evenly over it.
        age = probes.process_age_s()
        self.own_1m = _decayed(0.0, self.last_cpu / age, age) if age and age > 0 else 0.0

    def gpu_due(self) -> bool:
        """Whether to list the GPU's processes now (the first sample, then every GPU_QUERY_INTERVAL_S)."""
        due = self.last_gpu_query is None or self.last_clock - self.last_gpu_query >= GPU_QUERY_INTERVAL_S
        if due:
            self.last_gpu_query = self.last_clock
        return due

    def own_share(self) -> tuple[float, float]:
        """(seconds since the first sample, this run's 1-minute share of the load now)."""
        now, cpu = self.probes.clock(), self.probes.own_cpu_s()
        window = now - self.last_clock
        if window > 0:
            self.own_1m = _decayed(self.own_1m, max(0.0, cpu - self.last_cpu) / window, window)
        self.last_clock, self.last_cpu = now, cpu
        return now - self.started, self.own_1m


def _decayed(average: float, rate: float, window: float) -> float:
    """The kernel's exponential average after ``window`` seconds at a constant ``rate``."""
    keep = math.exp(-window / LOAD_WINDOW_S)
    return average * keep + rate * (1.0 - keep)


@dataclass
class HostLoad:
    """``host_load`` of a report: the CPUs, the first, last and busiest load samples, the other
    processes seen on the measured GPU, its clock readings (``gpu_clocks``, with their own verdict), and
    the verdict (``busy_reason``, None when idle), which a report writes at its top level as
    ``host_busy`` and ``host_busy_reason``.

    A record read from a file does not sample; one from :func:`start_host_load` does, at :meth:`sample`.
    """

    cpu_count: int | None
    busy_fraction: float = BUSY_LOAD_FRACTION
    start: LoadSample | None = None  # None where the platform has no load average
    end: LoadSample | None = None
    peak: LoadSample | None = None  # the sample with the highest 1-minute load of other processes
    samples: int = 0
    gpu_processes: list[GpuProcess] | None = None  # every other process seen; None: unknown (gpu_note)
    gpu_note: str | None = None  # why the GPU's other processes are unknown
    gpu_unseen: list[GpuProcess] | None = None  # pids outside this PID namespace (GpuScan)
    busy_reason: str | None = None
    gpu_clocks: GpuClocks | None = None  # None in the files of earlier versions
    sampler: _Sampler | None = field(default=None, compare=False, repr=False)

    @property
    def busy(self) -> bool:
        return self.busy_reason is not None

    def sample(self) -> None:
        """Read the load, the GPU's processes and its clocks now (a no-op for a record read from a file),
        renew the verdicts, and print each warning the first time the run is busy or throttled."""
        if self.sampler is None:
            return
        probes = self.sampler.probes
        elapsed, own = self.sampler.own_share()
        try:
            one, five, fifteen = probes.loadavg()
        except OSError:  # a platform without a load average: the GPU can still make a run busy
            reading = None
        else:
            reading = LoadSample(
                round(elapsed, 1), round(one, 2), round(five, 2), round(fifteen, 2), round(own, 2)
            )
        if reading is not None:
            self.start = self.start or reading
            self.end = reading
            if self.peak is None or reading.others_1m > self.peak.others_1m:
                self.peak = reading
        self.samples += 1
        if self.sampler.gpu_due():
            self._add_gpu_processes(probes.gpu_processes())
            self.gpu_clocks = self.gpu_clocks or GpuClocks()
            self.gpu_clocks.add(probes.gpu_clocks(), round(elapsed, 1))
        reasons = busy_reasons(self)
        self.busy_reason = "; ".join(reasons) if reasons else None
        if self.busy_reason and not self.sampler.warned:
            self.sampler.warned = True
            self.sampler.warn(busy_warning(self.busy_reason))
        throttled = self.gpu_clocks.throttled_reason if self.gpu_clocks else None
        if throttled and not self.sampler.throttle_warned:
            self.sampler.throttle_warned = True
            self.sampler.warn(throttle_warning(throttled))

    def add_case_clocks(self, started_clock_s: float, readings: list[GpuReading]) -> None:
        """Readings a case took under load (:class:`~qerl_cli.bench.gpusampler.ClockSampler`), their
        ``elapsed_s`` counted from ``started_clock_s`` on this record's clock, into ``gpu_clocks`` at their
        place in the run; the verdict and its warning follow at the next :meth:`sample`. A record read
        from a file has no clock and keeps none."""
        if self.sampler is None:
            return
        shift = started_clock_s - self.sampler.started
        clocks = self.gpu_clocks = self.gpu_clocks or GpuClocks()
        for reading in readings:
            clocks.add(reading, round(max(0.0, reading.elapsed_s + shift), 1))
        clocks.readings.sort(key=lambda r: r.elapsed_s)

    def _add_gpu_processes(self, found: GpuScan | str) -> None:
        if isinstance(found, str):  # unknown this time: keep what earlier samples saw
            if self.gpu_processes is None:
                self.gpu_note = found
            return
        self.gpu_processes, self.gpu_note = _merged(self.gpu_processes, found.others), None
        self.gpu_unseen = _merged(self.gpu_unseen, found.unseen) or None  # None when none, as read back

    def to_dict(self) -> dict[str, Any]:
        """The ``host_load`` section (the verdict is written beside it: :meth:`verdict`)."""
        processes = self.gpu_processes
        out: dict[str, Any] = {
            "cpu_count": self.cpu_count,
            "busy_fraction": self.busy_fraction,
            "samples": self.samples,
            "start": self.start.to_dict() if self.start else None,
            "end": self.end.to_dict() if self.end else None,
            "peak": self.peak.to_dict() if self.peak else None,
            "gpu_processes": None if processes is None else [p.to_dict() for p in processes],
        }
        if self.gpu_unseen:
            out["gpu_unseen"] = [p.to_dict() for p in self.gpu_unseen]
        if self.gpu_note is not None:
            out["gpu_note"] = self.gpu_note
        if self.gpu_clocks is not None:
            out["gpu_clocks"] = self.gpu_clocks.to_dict()
        return out

    def verdict(self) -> dict[str, Any]:
        """``host_busy`` and ``host_busy_reason``: a report's top-level keys."""
        return {"host_busy": self.busy, "host_busy_reason": self.busy_reason}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], busy_reason: str | None = None) -> HostLoad:
        def one(key: str) -> LoadSample | None:
            return LoadSample.from_dict(data[key]) if data.get(key) else None

        processes, clocks = data.get("gpu_processes"), data.get("gpu_clocks")
        return cls(
            cpu_count=data.get("cpu_count"),
            busy_fraction=data.get("busy_fraction", BUSY_LOAD_FRACTION),
            start=one("start"),
            end=one("end"),
            peak=one("peak"),
            samples=data.get("samples", 0),
            gpu_processes=None if processes is None else [GpuProcess.from_dict(p) for p in processes],
            gpu_note=data.get("gpu_note"),
            gpu_unseen=[GpuProcess.from_dict(p) for p in data["gpu_unseen"]]
            if "gpu_unseen" in data
            else None,
            busy_reason=busy_reason,
            gpu_clocks=GpuClocks.from_dict(clocks) if clocks is not None else None,
        )


def busy_reasons(host: HostLoad) -> list[str]:
    """The rule (``BUSY_LOAD_FRACTION`` says why): what made the run busy, empty when it was not."""
    reasons = []
    if host.peak is not None and host.cpu_count:
        limit = host.busy_fraction * host.cpu_count
        if host.peak.others_1m > limit:
            reasons.append(
                f"1-minute load of other processes {host.peak.others_1m:.1f} on {host.cpu_count} CPUs "
                f"(busy above {limit:g}, at {host.peak.elapsed_s:.0f} s)"
            )
    if host.gpu_processes:
        listed = "; ".join(p.label() for p in host.gpu_processes)
        count = len(host.gpu_processes)
        reasons.append(f"{count} other process{'es' if count > 1 else ''} on the measured GPU ({listed})")
    return reasons


def busy_warning(reason: str) -> str:
    """The one console line of a busy run."""
    return f"host busy: {reason}; these figures are not comparable with an idle run's"


def _stderr_warning(text: str) -> None:
    # stderr, flushed, as the bench's progress lines: it shows in a CI log when it happens.
    print(f"[bench] warning: {text}", file=sys.stderr, flush=True)


def start_host_load(probes: HostProbes | None = None, warn: Callable[[str], None] | None = None) -> HostLoad:
    """A sampling :class:`HostLoad` with its first sample taken (the run's start)."""
    probes = probes or HostProbes()
    host = HostLoad(cpu_count=probes.cpu_count(), sampler=_Sampler(probes, warn or _stderr_warning))
    host.sample()
    return host

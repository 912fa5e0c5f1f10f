"""The lines of a bench report about where it ran rather than what it measured: the machine, a busy
host's warning, the host load, and the measured GPU's clocks (a throttled GPU's warning or a one-line
summary). :mod:`qerl_cli.bench.report` places them in the terminal table and ``bench.md``.
"""

from __future__ import annotations

from typing import Any

from qerl_cli.bench.gpuclocks import GpuClocks, throttle_warning
from qerl_cli.bench.hostload import NO_GPU, HostLoad, busy_warning
from qerl_cli.bench.result import BenchResult


def machine_line(machine: dict[str, Any]) -> str:
    """The cores, the CPU's model, the memory and the vLLM variables set, "16 CPUs (AMD EPYC 9654 96-Core
    Processor), 128 GiB RAM, environment VLLM_ENABLE_V1_MULTIPROCESSING=1" (a report from before any of
    these has only what it recorded)."""
    ram = machine.get("ram_bytes")
    model = machine.get("cpu_model")
    environment = " ".join(
        f"{name}={value}" for name, value in (machine.get("engine_environment") or {}).items()
    )
    return (f"{machine['cpu_count']} CPUs" + (f" ({model})" if model else "")
            + (f", {ram / 2**30:.0f} GiB RAM" if ram else "")
            + (f", environment {environment}" if environment else ""))  # fmt: skip


def busy_line(report: BenchResult) -> str | None:
    """The warning of a run on a busy host (what was busy), None for an idle or unrecorded one."""
    reason = report.host_busy_reason
    return None if reason is None else f"Warning: {busy_warning(reason)}."


def host_load_line(host: HostLoad | None) -> str | None:
    """The host's 1-minute load at the start and end, the other processes' highest, and the GPU's other
    processes; None for a report from before the load was recorded."""
    if host is None:
        return None
    if host.start is None or host.end is None or host.peak is None:
        load = "load average unknown"
    else:
        load = (f"1-minute load {host.start.load_1m:.1f} at the start, {host.end.load_1m:.1f} at the end, "
                f"other processes' highest {host.peak.others_1m:.1f}")  # fmt: skip
    if host.gpu_note == NO_GPU:
        gpu = ""
    elif host.gpu_processes is None:
        gpu = f"; other processes on the GPU unknown ({host.gpu_note})"
    else:
        gpu = f"; {len(host.gpu_processes)} other process(es) on the GPU"
    if host.gpu_unseen:  # a container's view: these may be this run's own processes
        gpu += f", {len(host.gpu_unseen)} outside this PID namespace (not counted)"
    return f"Host: {host.cpu_count} CPUs, {load}{gpu}."


def _clock_range(values: list[int], unit: str) -> str:
    low, high = min(values), max(values)
    return f"{low} {unit}" if low == high else f"{low}-{high} {unit}"


def clocks_summary(clocks: GpuClocks) -> str:
    """``GPU clocks: SM 1980 MHz at start (max 1980), 345-1980 MHz across 6 readings (2 idle), 52-71 C,
    no slowdown reason.`` for a run that was not throttled."""
    readings = clocks.readings
    first, count = readings[0], len(readings)
    parts = [] if first.sm_mhz is None else [f"SM {first.sm_mhz} MHz at start"]
    if parts and first.max_sm_mhz is not None:
        parts[0] += f" (max {first.max_sm_mhz})"
    idle = sum(r.idle for r in readings)
    spread = f" across {count} reading{'s' if count > 1 else ''}" + (f" ({idle} idle)" if idle else "")
    sm = [r.sm_mhz for r in readings if r.sm_mhz is not None]
    parts.append((_clock_range(sm, "MHz") if sm else "SM clock unknown") + spread)
    temperatures = [r.temperature_c for r in readings if r.temperature_c is not None]
    if temperatures:
        parts.append(_clock_range(temperatures, "C"))
    # Not throttled: a working reading's slowdown reason can only be the power cap at the default limit, or
    # the cap while the clock held; any other came with the driver's gpu_idle.
    capped = [r for r in readings if r.busy and r.slowdowns]
    capped_sm = [r.sm_mhz for r in capped if r.sm_mhz is not None]
    if not any(r.reasons is not None for r in readings):
        parts.append("slowdown reasons unknown")
    elif capped:
        where = f" (SM {_clock_range(capped_sm, 'MHz')})" if capped_sm else ""
        parts.append(
            f"at its power limit in {len(capped)} working reading{'s' if len(capped) > 1 else ''}{where}"
        )
    else:
        parts.append(
            "slowdown reasons only while idle" if any(r.slowdowns for r in readings) else "no slowdown reason"
        )
    return f"GPU clocks: {', '.join(parts)}."


def gpu_clocks_line(host: HostLoad | None) -> tuple[str, bool] | None:
    """The measured GPU's clocks in one line, and whether it is the throttled warning; None for a CPU
    run or a report from before the clocks were read."""
    clocks = host.gpu_clocks if host else None
    if clocks is None or (not clocks.readings and clocks.note in (None, NO_GPU)):
        return None
    if not clocks.readings:
        return f"GPU clocks unknown ({clocks.note}).", False
    reason = clocks.throttled_reason
    if reason:
        return f"Warning: {throttle_warning(reason)}.", True
    return clocks_summary(clocks), False

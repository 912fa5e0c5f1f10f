"""What every ``qerl bench`` report starts with: the command that made it, when, on which device, the
versions of the stack (from :mod:`qerl_cli.envinfo`, the one reader of versions and GPUs) and whether
the host was busy (:mod:`qerl_cli.bench.hostload`: sampled when the report begins and each time it is
written, so its last write is the run's end).

``bench.json`` (:mod:`qerl_cli.bench.result`) lays these out among its own keys; the other benchmarks'
JSON files (``kernels.json``, ``update.json``, ``scaling.json``, ``quality.json``) begin with
:func:`report_header`, so every report says what produced it in the same words.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from datetime import datetime, timezone
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch

from qerl_cli import files
from qerl_cli.bench.gpuclocks import NvidiaSmiClocks
from qerl_cli.bench.gpusampler import ClockSampler
from qerl_cli.bench.hostload import HostLoad, HostProbes, nvidia_smi_processes, start_host_load
from qerl_cli.envinfo import gpu_driver, gpu_info, package_versions

VERSIONED_PACKAGES = (
    "qerl",
    "torch",
    "transformers",
    "peft",
    "vllm",
    "compressed-tensors",
    "bitsandbytes",
    "triton",
)


def created_now() -> str:
    """The report's date: UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str | None]:
    return {**package_versions(VERSIONED_PACKAGES), "python": platform.python_version()}


CPUINFO = "/proc/cpuinfo"


def cpu_model(cpuinfo: str = CPUINFO) -> str | None:
    """The CPU's model name as the kernel reports it ("AMD EPYC 9654 96-Core Processor"); None where
    there is no /proc/cpuinfo or no model name in it. A vLLM rollout whose engine thread is host-bound
    runs at that one core's speed, so two runs' figures compare only with their CPUs named."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        return None
    return None


# vLLM's environment variables that change what a bench measures, recorded where set (absent: vLLM's and
# qerl's defaults, e.g. the engine core in the bench's process): the same command in another environment
# measured 6.8k tok/s with the engine core in the process and 8.8k with it in its own (a 7B rollout at 128
# sequences), and nothing else in the report told the two apart.
ENGINE_ENVIRONMENT = (
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_ATTENTION_BACKEND",
)


def engine_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The :data:`ENGINE_ENVIRONMENT` variables set in ``environ``, with their values."""
    return {name: environ[name] for name in ENGINE_ENVIRONMENT if name in environ}


def machine_info() -> dict[str, Any]:
    """What the figures depend on: the OS, the CPU's model and cores, the memory. Not the machine's name,
    which says nothing to a reader elsewhere (the GPU, its count and driver are in :func:`gpu_summary`)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "engine_environment": engine_environment(),
    }
    try:
        info["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        info["ram_bytes"] = None
    return info


def gpu_summary() -> dict[str, Any] | None:
    """The first GPU, how many there are and the driver; None on the CPU."""
    gpus = gpu_info()
    if not gpus:
        return None

    first = gpus[0]
    return {
        "name": first.name,
        "count": len(gpus),
        "memory_bytes": first.memory_bytes,
        "capability": first.capability,
        "cuda": torch.version.cuda,
        "driver": gpu_driver(),
    }


def measured_gpu_uuid() -> str | None:
    """The UUID of the GPU the benchmark measures (torch's current device), to find the other processes
    on it; never written in a report (it names one physical board). None without CUDA."""
    if not torch.cuda.is_available():
        return None
    uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
    return str(uuid) if uuid else None


@cache
def _case_clock_probe() -> NvidiaSmiClocks | None:
    # One probe per process: it keeps the reasons field the driver answered to, so the batches of a case
    # after the first do not each pay a failed query on an older driver.
    return NvidiaSmiClocks(measured_gpu_uuid()) if torch.cuda.is_available() else None


def case_clock_sampler() -> ClockSampler:
    """A sampler of the measured GPU's clocks for the timed work of one case (in the process that runs
    it); one that reads nothing without CUDA."""
    return ClockSampler(_case_clock_probe())


def start_run_host_load(gpu: bool) -> HostLoad:
    """The host's load from now on, and on a GPU run the other processes on the measured GPU and its
    clocks."""
    if not gpu:
        return start_host_load(HostProbes())
    uuid = measured_gpu_uuid()
    probes = HostProbes(gpu_processes=partial(nvidia_smi_processes, uuid), gpu_clocks=NvidiaSmiClocks(uuid))
    return start_host_load(probes)


def report_header(schema: str, command: str) -> dict[str, Any]:
    """``schema``, ``command``, ``created``, ``device`` (the GPU's name, or ``"cpu"``), ``gpu`` (its
    details, None on the CPU), ``versions``, then ``host_busy``, ``host_busy_reason`` and ``host_load``
    (a :class:`~qerl_cli.bench.hostload.HostLoad`, which :func:`write_report` samples and writes): the
    first keys of every benchmark's JSON."""
    gpu = gpu_summary()
    host = start_run_host_load(gpu is not None)
    return {
        "schema": schema,
        "command": command,
        "created": created_now(),
        "device": gpu["name"] if gpu else "cpu",
        "gpu": gpu,
        "versions": versions(),
        **host.verdict(),
        "host_load": host,
    }


def write_report(path: str | Path, data: dict[str, Any]) -> Path:
    """A benchmark's JSON, written staged (a run cut short leaves the previous file whole).

    A report begun by :func:`report_header` has its host load sampled first (each write is a point
    between cases; the last is the run's end) and its ``host_busy`` keys renewed in ``data``."""
    host = data.get("host_load")
    if isinstance(host, HostLoad):
        host.sample()
        data.update(host.verdict())
        data = {**data, "host_load": host.to_dict()}
    return files.write_json(path, data)

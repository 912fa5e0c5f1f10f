"""`qerl env`: what this machine has, for bug reports and for CI logs.

Versions come from installed distribution metadata, so optional heavy packages (vLLM,
llm-compressor) are reported without being imported.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from qerl_cli import __version__

# What `qerl env` reports, in report order (distribution names): the core and every package an extra adds.
PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "vllm",
    "llmcompressor",
    "compressed-tensors",
    "bitsandbytes",
    "gguf",
    "liger-kernel",
    "humming-kernels",
    "math-verify",
    "datasets",
    "triton",
)


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions(dists: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    """``{distribution: installed version or None}``, in the order given (each report lists its own).

    Read from distribution metadata, so nothing is imported (vLLM stays unimported).
    """
    return {dist: package_version(dist) for dist in dists}


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as torch sees it; each report lays these out its own way."""

    index: int
    name: str
    memory_bytes: int
    capability: str  # "major.minor"


def gpu_info() -> list[GpuInfo]:
    """Every visible CUDA device, in index order; empty without CUDA."""

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(GpuInfo(index, props.name, props.total_memory, f"{props.major}.{props.minor}"))
    return gpus


# The kernel module's version line on Linux, read when NVML's Python binding is not installed.
_NVIDIA_PROC_VERSION = "/proc/driver/nvidia/version"


def _nvml_driver() -> str | None:
    try:
        import pynvml  # nvidia-ml-py, which vLLM installs
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no NVIDIA driver loaded
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return version.decode() if isinstance(version, bytes) else str(version)


def _proc_driver() -> str | None:
    try:
        with open(_NVIDIA_PROC_VERSION, encoding="utf-8") as handle:
            first = handle.readline()
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 16 ..."
    return next((word for word in first.split() if word[:1].isdigit() and "." in word), None)


def gpu_driver() -> str | None:
    """The NVIDIA driver's version ("570.86.15"), or None where there is none to read.

    A report says which driver measured its figures: torch knows only the CUDA version it was built for.
    """
    return _nvml_driver() or _proc_driver()


def collect() -> dict[str, Any]:
    return {
        "qerl": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "driver": gpu_driver(),
        "packages": package_versions(),
        "gpus": [
            {
                "index": gpu.index,
                "name": gpu.name,
                "memory_gib": round(gpu.memory_bytes / 2**30, 2),
                "compute_capability": gpu.capability,
            }
            for gpu in gpu_info()
        ],
    }

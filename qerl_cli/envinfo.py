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

# What `qerl env` reports, in report order (distribution names).
PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "vllm",
    "llmcompressor",
    "compressed-tensors",
    "bitsandbytes",
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
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(GpuInfo(index, props.name, props.total_memory, f"{props.major}.{props.minor}"))
    return gpus


def collect() -> dict[str, Any]:
    import torch

    from qerl_cli import __version__

    return {
        "qerl": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
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

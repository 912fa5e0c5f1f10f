"""`qerl env`: what this machine has, for bug reports and for CI logs.

Versions come from installed distribution metadata, so optional heavy packages (vLLM,
llm-compressor) are reported without being imported.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from collections.abc import Iterable
from typing import Any

# (label, distribution name) in report order.
PACKAGES = [
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("peft", "peft"),
    ("vllm", "vllm"),
    ("llmcompressor", "llmcompressor"),
    ("compressed-tensors", "compressed-tensors"),
    ("bitsandbytes", "bitsandbytes"),
    ("math-verify", "math-verify"),
    ("datasets", "datasets"),
    ("triton", "triton"),
]


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions_of(dists: Iterable[str]) -> dict[str, str | None]:
    """``{distribution: installed version or None}``, in the order given (each stage lists its own)."""
    return {dist: package_version(dist) for dist in dists}


def package_versions() -> dict[str, str | None]:
    return {label: package_version(dist) for label, dist in PACKAGES}


def gpu_info() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 2),
                "compute_capability": f"{props.major}.{props.minor}",
            }
        )
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
        "gpus": gpu_info(),
    }

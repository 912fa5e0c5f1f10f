"""The GPU this process uses and what is installed: the :class:`~qerl_cli.rollout.backends.Environment`
the linear backend choice (:func:`qerl_cli.rollout.backends.choose_backend`) is made for."""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version

import torch

from qerl_cli.rollout import vllm_nvfp4
from qerl_cli.rollout.backends import Environment


def current_environment(
    *,
    vllm_budget_bytes: int | None = None,
    kv_bytes_per_sequence: int | None = None,
    overhead_bytes: int = 0,
    tensor_parallel_size: int = 1,
) -> Environment:
    """The GPU this process uses and what is installed (no GPU: name and capability None)."""
    gpu = capability = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
        capability = tuple(torch.cuda.get_device_capability())
    return Environment(
        gpu_name=gpu, capability=capability,  # type: ignore[arg-type]
        humming_installed=importlib.util.find_spec("humming") is not None,
        vllm_version=_vllm_version(), vllm_budget_bytes=vllm_budget_bytes,
        kv_bytes_per_sequence=kv_bytes_per_sequence, overhead_bytes=overhead_bytes,
        tensor_parallel_size=tensor_parallel_size, engine_in_process=vllm_nvfp4.engine_in_process(),
    )  # fmt: skip


def _vllm_version() -> tuple[int, int] | None:

    try:
        parts = version("vllm").split(".")
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (PackageNotFoundError, ValueError, IndexError):
        return None

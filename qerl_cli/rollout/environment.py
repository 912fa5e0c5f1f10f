"""The GPU this process uses and what is installed: the :class:`~qerl_cli.rollout.backends.Environment`
the linear backend choice (:func:`qerl_cli.rollout.backends.choose_backend`) is made for."""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version

import torch

from qerl_cli.rollout.backends import Environment
from qerl_cli.rollout.vllm_setup import vllm_in_process


def current_environment(
    *,
    vllm_budget_bytes: int | None = None,
    kv_bytes_per_sequence: int | None = None,
    overhead_bytes: int = 0,
    tensor_parallel_size: int = 1,
    rollout_dtype: str = "bfloat16",
) -> Environment:
    """The GPU this process uses and what is installed (no GPU: name and capability None)."""
    gpu = capability = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
        capability = tuple(torch.cuda.get_device_capability())
    return Environment(
        gpu_name=gpu, capability=capability,  # type: ignore[arg-type]
        humming_installed=importlib.util.find_spec("humming") is not None,
        vllm_version=installed_vllm_version(), vllm_budget_bytes=vllm_budget_bytes,
        kv_bytes_per_sequence=kv_bytes_per_sequence, overhead_bytes=overhead_bytes,
        tensor_parallel_size=tensor_parallel_size, engine_in_process=vllm_in_process(before_import=True),
        rollout_dtype=rollout_dtype,
    )  # fmt: skip


def installed_vllm_version() -> tuple[int, int] | None:
    """(major, minor) of the installed vLLM (None: not installed or not readable)."""
    try:
        parts = version("vllm").split(".")
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (PackageNotFoundError, ValueError, IndexError):
        return None

"""Device and dtype names from configs, resolved in one place for every stage."""

from __future__ import annotations

import gc
import platform

import torch

from qerl_cli.errors import QerlError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str, setting: str = "--device") -> torch.device:
    """``auto`` is CUDA when a GPU is visible, else the CPU; asking for CUDA without one is an error.

    ``setting`` is how the user spells the option (``--device``, ``train.device``) in the message.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise QerlError(f"{setting}={name} is not a device name; use auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QerlError(f"{setting}={name} but this machine has no CUDA GPU; use {setting}=cpu or auto")
    return device


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (strings pass through)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def device_label(device: torch.device | str) -> str:
    """What ran the numbers, for reports and figures: the GPU's name (``NVIDIA H200``) or ``CPU (x86_64)``."""
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

"""FP8 (E4M3) weights with one scale per output channel: the W8A8 layout vLLM serves with its FP8 GEMMs.

qerl keeps the trainer's base in 4 bits; FP8 exists only as a *rollout* copy of that base
(``rollout.linear_backend: fp8``, :mod:`qerl_cli.rollout.fp8_rollout`): on Hopper, vLLM's FP8
CUTLASS GEMM runs on the FP8 tensor cores (twice the BF16 peak), which beats the weight-only FP4
Marlin kernel once a decode step has enough rows to be compute-bound. Activations are quantized
per token at run time by vLLM (compressed-tensors ``FP8_DYNAMIC``).

The weight is the dequantized 4-bit weight rounded once more, to E4M3 with a per-row scale
``max|w| / 448``: every element is within half an E4M3 step of the 4-bit value it came from.
"""

from __future__ import annotations

from functools import cache

import torch

from qerl_cli.formats.checkpoint import COMPRESSED_TENSORS_VERSION

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value
# Relative spacing of E4M3 normals (3 mantissa bits): rounding moves a value by at most half of it.
FP8_RELATIVE_STEP = 2.0**-3
# The smallest E4M3 subnormal step, as a multiple of the scale (2^-9): the absolute rounding floor.
FP8_SUBNORMAL_STEP = 2.0**-9
# FP8 tensor cores and the FP8 convert instruction: Ada (compute capability 8.9), Hopper (9.0) and later.
FP8_MIN_CAPABILITY = (8, 9)


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device`` (None for any other), looked up once per GPU: the
    FP8 update asks it on every GEMM."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def has_fp8_tensor_cores(device: torch.device) -> bool:
    capability = cuda_capability(device)
    return capability is not None and capability >= FP8_MIN_CAPABILITY


@cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[out, in]`` weight -> (E4M3 weight, float32 ``[out, 1]`` scale) with ``w ~= q * scale``.

    An all-zero row gets scale 1 (its codes are zeros either way), so no division by zero occurs.
    """
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_per_channel(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (codes.float() * scale.float()).to(dtype)


def rounding_bound(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element, the most E4M3 rounding may move ``weight`` (half a step, normal or subnormal)."""
    return torch.maximum(weight.float().abs() * FP8_RELATIVE_STEP / 2, scale * FP8_SUBNORMAL_STEP / 2)


def quantization_config(ignore: list[str]) -> dict:
    """config.json ``quantization_config`` of a compressed-tensors ``FP8_DYNAMIC`` checkpoint: static
    per-channel FP8 weights, dynamic per-token FP8 activations (what llm-compressor writes)."""

    def args(strategy: str, dynamic: bool) -> dict:
        return {
            "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
            "block_structure": None, "dynamic": dynamic, "actorder": None, "observer": None,
            "observer_kwargs": {},
        }  # fmt: skip

    group = {
        "targets": ["Linear"], "weights": args("channel", False), "input_activations": args("token", True),
        "output_activations": None, "format": "float-quantized",
    }  # fmt: skip
    return {
        "config_groups": {"group_0": group}, "format": "float-quantized", "global_compression_ratio": None,
        "ignore": list(ignore), "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }  # fmt: skip

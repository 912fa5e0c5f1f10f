"""Triton dequantization kernels for NVFP4, MXFP4 and NF4, with the torch reference as fallback.

Every kernel walks the packed bytes as one flat array (``BYTES`` bytes per program) and writes the two
elements of each byte next to each other. That works for all three formats because a block never
straddles a row (``in_features`` is a multiple of the block size), so the block of flat element ``i``
is simply ``i // block_size`` in the row-major scale tensor.

The arithmetic matches the torch reference (``QuantFormat.dequantize_buffers``) bit for bit in float32:
the NVFP4 block scale is divided by the global scale with a correctly rounded division, and the NF4
double-quant absmax is evaluated without FMA contraction. Only the final cast to the output dtype runs
on the kernel's rounding, which is round-to-nearest-even on GPUs (Triton's CPU interpreter truncates).

``triton`` is imported only when a kernel is first needed; without it (or off CUDA) the torch path runs.
To run the kernels on CPU tensors, set both ``TRITON_INTERPRET=1`` (before triton is first imported:
Triton picks interpreting vs compiling at import and decoration time) and ``QERL_TRITON_CPU=1`` (the
routing switch: the interpreter is far slower than the torch path, so it is never chosen by default).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from qerl_cli.formats.base import QuantFormat

BYTES_PER_PROGRAM = 1024


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and os.environ.get("QERL_TRITON_CPU", "0") == "1"


def use_triton_for(tensor: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors when the interpreter is asked for."""
    return (tensor.is_cuda or interpreter_enabled()) and triton_available()


@cache
def _kernels():  # -> the qerl_cli.kernels._triton_dequant module
    """Import the kernels on first use so importing this module never imports triton."""
    from qerl_cli.kernels import _triton_dequant

    return _triton_dequant


def triton_dequantize(
    fmt: QuantFormat,
    buffers: dict[str, torch.Tensor],
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dense ``[out, in]`` weight from QuantLinear buffers with the Triton kernel of ``fmt``."""
    k = _kernels()
    packed = buffers["weight_packed"]
    out = torch.empty((out_features, in_features), dtype=dtype, device=packed.device)
    n_bytes = packed.numel()
    grid = (-(-n_bytes // BYTES_PER_PROGRAM),)
    if fmt.fp4:
        nvfp4 = fmt.name == "nvfp4"
        scale = buffers["weight_scale"].view(torch.uint8)
        global_scale = buffers["weight_global_scale"] if nvfp4 else scale  # unused pointer for MXFP4
        k.fp4_dequant_kernel[grid](packed, scale, global_scale, out, n_bytes, BLOCK=fmt.block_size,
                                   NVFP4=nvfp4,
                    BYTES=BYTES_PER_PROGRAM)  # fmt: skip
    elif fmt.name == "nf4":
        double = "weight_nested_absmax" in buffers
        absmax = buffers["weight_absmax"]
        k.nf4_dequant_kernel[grid](
            packed, absmax, buffers["weight_quant_map"],
            buffers.get("weight_nested_absmax", absmax), buffers.get("weight_nested_quant_map", absmax),
            buffers.get("weight_nested_offset", absmax), out, n_bytes,
            DOUBLE_QUANT=double, BYTES=BYTES_PER_PROGRAM,
            # bitsandbytes rounds code * absmax and then adds the offset: no fused multiply-add.
            enable_fp_fusion=False,
        )  # fmt: skip
    else:
        raise ValueError(f"no Triton kernel for format {fmt.name!r}")
    return out


def dequantize(
    fmt: QuantFormat,
    buffers: dict[str, torch.Tensor],
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dense weight from QuantLinear buffers: Triton on CUDA (or under the interpreter), else torch."""
    if use_triton_for(buffers["weight_packed"]):
        return triton_dequantize(fmt, buffers, out_features, in_features, dtype)
    return fmt.dequantize_buffers(buffers, out_features, in_features, dtype)

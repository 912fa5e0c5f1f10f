"""Per-row FP8 (E4M3) rounding of a ``[M, K]`` tensor in one fused Triton kernel, with the torch
reference (:func:`qerl_cli.formats.fp8.quantize_per_channel`) as fallback.

The torch reference runs about six elementwise float32 passes (cast, abs, amax, divide, clamp, cast):
~30 bytes of memory traffic per element and float32 temporaries of 12 bytes an element. The kernel
reads the row twice (absmax, then rounding; the second read mostly hits L2) and writes one byte an
element and one float32 scale a row, with no temporaries.

The codes and scales are bit-identical to the reference: scale ``amax / 448`` (1 for an all-zero row)
and ``clamp(x / scale, -448, 448)`` with correctly rounded float32 divisions, then round-to-nearest-even
to E4M3. That last cast is the GPU's own FP8 convert on compute capability >= 8.9; elsewhere (older
GPUs, the CPU interpreter, whose casts truncate) an integer rounding in the kernel does it.

Routing is :func:`qerl_cli.kernels.dequant.use_triton_for`'s: CUDA tensors, or CPU tensors with both
``TRITON_INTERPRET=1`` and ``QERL_TRITON_CPU=1``.
"""

from __future__ import annotations

from functools import cache

import torch

from qerl_cli.formats.fp8 import FP8_DTYPE, has_fp8_tensor_cores, quantize_per_channel
from qerl_cli.kernels.dequant import interpreter_enabled, use_triton_for

# Elements of a row per loop step of the kernel.
BLOCK = 1024
# Elements the torch reference rounds at a time (rows are independent): its float32 temporaries (about
# 12 bytes an element) stay ~200 MB whatever the input, where a 7B MLP input of 16k tokens would
# otherwise take 3.6 GB for an instant.
REFERENCE_CHUNK = 2**24
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@cache
def _kernels():  # -> the qerl_cli.kernels._triton_fp8_rows module
    """Import the kernel on first use so importing this module never imports triton."""
    from qerl_cli.kernels import _triton_fp8_rows

    return _triton_fp8_rows


def hardware_cast(device: torch.device) -> bool:
    """Whether the kernel rounds with the GPU's FP8 convert instruction (else in integer arithmetic)."""
    # The GPU's native float32 -> E4M3 convert (cvt.rn.satfinite.e4m3x2.f32) comes with FP8 tensor cores.
    return not interpreter_enabled() and has_fp8_tensor_cores(device)


def triton_quantize_rows(x: torch.Tensor, hw_cast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_fp8` with the Triton kernel (``hw_cast`` None: per :func:`hardware_cast`)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"no FP8 rounding kernel for {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    codes = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        scale.fill_(1.0)
        return codes, scale
    if hw_cast is None:
        hw_cast = hardware_cast(x.device)
    out = codes if hw_cast else codes.view(torch.uint8)
    block = min(BLOCK, 1 << (k - 1).bit_length())
    _kernels().fp8_rows_kernel[(m,)](x, out, scale, k, x.stride(0), BLOCK=block, HW_CAST=hw_cast,
                                      num_warps=4 if block <= 1024 else 8)  # fmt: skip
    return codes, scale


def kernel_applies(x: torch.Tensor) -> bool:
    """Whether :func:`quantize_rows_fp8` takes ``x`` to the Triton kernel."""
    return x.dim() == 2 and x.dtype in SUPPORTED_DTYPES and use_triton_for(x)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` -> (contiguous E4M3 ``[M, K]``, float32 ``[M, 1]`` scales), bit-identical to
    :func:`qerl_cli.formats.fp8.quantize_per_channel`: the Triton kernel on CUDA (or under the
    interpreter), else that function on :data:`REFERENCE_CHUNK` elements at a time."""
    if kernel_applies(x):
        return triton_quantize_rows(x)
    rows = max(1, REFERENCE_CHUNK // max(1, x.shape[1]))
    if x.shape[0] <= rows:
        codes, scale = quantize_per_channel(x)
        return codes.contiguous(), scale.contiguous()
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    for begin in range(0, x.shape[0], rows):
        chunk = slice(begin, begin + rows)
        codes[chunk], scale[chunk] = quantize_per_channel(x[chunk])
    return codes, scale

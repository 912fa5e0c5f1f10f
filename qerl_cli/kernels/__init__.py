"""GPU kernels (Triton, imported lazily) with torch reference fallbacks."""

from qerl_cli.kernels.dequant import dequantize, triton_available, triton_dequantize, use_triton_for
from qerl_cli.kernels.fp8_rows import quantize_rows_fp8, triton_quantize_rows

__all__ = [
    "dequantize",
    "quantize_rows_fp8",
    "triton_available",
    "triton_dequantize",
    "triton_quantize_rows",
    "use_triton_for",
]

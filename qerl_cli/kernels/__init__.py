"""GPU kernels (Triton, imported lazily) with torch reference fallbacks."""

from qerl_cli.kernels.dequant import dequantize, triton_available, triton_dequantize, use_triton_for

__all__ = ["dequantize", "triton_available", "triton_dequantize", "use_triton_for"]

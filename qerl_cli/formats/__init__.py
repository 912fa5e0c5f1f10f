"""4-bit weight formats: NVFP4, MXFP4 and NF4, bit-compatible with their reference libraries.

>>> from qerl_cli import formats
>>> fmt = formats.get("nvfp4")
>>> tensors = fmt.quantize(weight)              # {"weight_packed", "weight_scale", "weight_global_scale"}
>>> dense = fmt.dequantize(tensors, torch.bfloat16)
"""

from __future__ import annotations

from qerl_cli.errors import QerlError
from qerl_cli.formats.base import QuantFormat
from qerl_cli.formats.mxfp4 import MXFP4Format
from qerl_cli.formats.nf4 import NF4Format
from qerl_cli.formats.nvfp4 import FUSED_GROUPS, NVFP4Format, fused_group_key, shared_global_scale

FORMATS: dict[str, QuantFormat] = {fmt.name: fmt for fmt in (NVFP4Format(), MXFP4Format(), NF4Format())}


def names() -> list[str]:
    """Registered format names, e.g. for CLI choices."""
    return list(FORMATS)


def fp4_names() -> tuple[str, ...]:
    """The formats of E2M1 elements (served by Marlin on GPUs without native FP4)."""
    return tuple(name for name, fmt in FORMATS.items() if fmt.fp4)


def get(name: str) -> QuantFormat:
    """The format called ``name`` (case-insensitive); raises QerlError listing the choices otherwise."""
    key = name.strip().lower()
    if key not in FORMATS:
        raise QerlError(f"unknown 4-bit format {name!r}; choose one of: {', '.join(FORMATS)}")
    return FORMATS[key]


__all__ = [
    "FORMATS",
    "FUSED_GROUPS",
    "MXFP4Format",
    "NF4Format",
    "NVFP4Format",
    "QuantFormat",
    "fp4_names",
    "fused_group_key",
    "get",
    "names",
    "shared_global_scale",
]

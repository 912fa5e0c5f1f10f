"""4-bit weight formats: NVFP4, MXFP4 and NF4, bit-compatible with their reference libraries.

>>> from qerl_cli import formats
>>> fmt = formats.get("nvfp4")
>>> tensors = fmt.quantize(weight)              # {"weight_packed", "weight_scale", "weight_global_scale"}
>>> dense = fmt.dequantize(tensors, torch.bfloat16)
"""

from __future__ import annotations

from collections.abc import Iterable

from qerl_cli.errors import QerlError
from qerl_cli.formats.base import QuantFormat
from qerl_cli.formats.mxfp4 import MXFP4Format
from qerl_cli.formats.nf4 import NF4Format
from qerl_cli.formats.nvfp4 import FUSED_GROUPS, NVFP4Format, fused_group_key, shared_global_scale

FORMATS: dict[str, QuantFormat] = {fmt.name: fmt for fmt in (NVFP4Format(), MXFP4Format(), NF4Format())}
# The unquantized weights every 4-bit format is made from: a model folder holds them or one of FORMATS.
DENSE = "bf16"


def names() -> list[str]:
    """Registered format names, e.g. for CLI choices."""
    return list(FORMATS)


def model_names() -> list[str]:
    """Every weights format a model folder can hold: BF16, then the registered 4-bit formats."""
    return [DENSE, *FORMATS]


def unknown_format_error(
    chosen: Iterable[str], what: str = "format", *, dense: bool = False, option: str | None = None
) -> QerlError:
    """The error for ``chosen`` format names the registry does not hold, listing the ones it does (BF16
    first with ``dense``). ``what`` says which format ("checkpoint format"); ``option``, the flag or key
    the names came from, opens the message."""
    valid = model_names() if dense else names()
    where = f"{option}: " if option else ""
    given = ", ".join(map(repr, chosen))
    return QerlError(f"{where}unknown {what} {given}; choose one of: {', '.join(valid)}")


def check_names(
    chosen: Iterable[str], what: str = "format", *, dense: bool = False, option: str | None = None
) -> None:
    """Refuse, listing the registry's names, any of ``chosen`` that is not a registered format (nor BF16
    with ``dense``). Names are compared as given: a caller that takes any case lower-cases first."""
    valid = model_names() if dense else names()
    unknown = [name for name in chosen if name not in valid]
    if unknown:
        raise unknown_format_error(unknown, what, dense=dense, option=option)


def fp4_names() -> tuple[str, ...]:
    """The formats of E2M1 elements (served by Marlin on GPUs without native FP4)."""
    return tuple(name for name, fmt in FORMATS.items() if fmt.fp4)


def get(name: str) -> QuantFormat:
    """The format called ``name`` (case-insensitive); raises QerlError listing the choices otherwise."""
    key = name.strip().lower()
    if key not in FORMATS:
        raise unknown_format_error([name], "4-bit format")
    return FORMATS[key]


__all__ = [
    "DENSE",
    "FORMATS",
    "FUSED_GROUPS",
    "MXFP4Format",
    "NF4Format",
    "NVFP4Format",
    "QuantFormat",
    "check_names",
    "fp4_names",
    "fused_group_key",
    "get",
    "model_names",
    "names",
    "shared_global_scale",
    "unknown_format_error",
]

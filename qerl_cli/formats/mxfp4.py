"""MXFP4: E2M1 values, blocks of 32 along the input dim, one E8M0 shared exponent per block.

Stored exactly like compressed-tensors' ``mxfp4-pack-quantized`` (scheme MXFP4A16):

* ``weight_packed`` uint8 ``[out, in/2]`` (low nibble = even column)
* ``weight_scale``  uint8 ``[out, in/32]``: biased exponent, scale = 2 ** (e - 127)

The block exponent follows compressed-tensors: the block absmax is rounded to a power of two
(rounding *up* only when its mantissa is >= 1.75, i.e. when the top two mantissa bits are set), then
2 is subtracted so the largest element lands near E2M1's maximum of 6. All-zero blocks get e = 0.
"""

from __future__ import annotations

import torch

from qerl_cli.formats.fp4 import PackedE2M1Format, e2m1_codes, pack_low_first

E8M0_BIAS = 127
# floor(log2(6)): the exponent offset that maps a block's max into E2M1's range.
E2M1_EXPONENT_OFFSET = 2

# (integer view dtype, mantissa bits, exponent bits) per float dtype.
_FLOAT_LAYOUT = {
    torch.bfloat16: (torch.int16, 7, 8),
    torch.float16: (torch.int16, 10, 5),
    torch.float32: (torch.int32, 23, 8),
}


def round_to_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """Round non-negative floats to a power of two the way compressed-tensors' MX observer does.

    Adding half of E2M1's last mantissa step below the kept bits and truncating the mantissa rounds
    up only mantissas >= 0.75 (values that would otherwise overflow E2M1's 6 after scaling).
    """
    int_dtype, mantissa_bits, exponent_bits = _FLOAT_LAYOUT[x.dtype]
    width = 1 + exponent_bits + mantissa_bits
    bits = x.view(int_dtype).to(torch.int64) & ((1 << width) - 1)
    # E2M1 keeps 1 mantissa bit; adding 1 << (m - 2) carries into the exponent iff the top two bits are set.
    bumped = bits + (1 << (mantissa_bits - 2))
    sign_and_exponent_mask = ((1 << (exponent_bits + 1)) - 1) << mantissa_bits
    rounded = bumped & sign_and_exponent_mask
    # Back to the signed view's range before reinterpreting the bits as a float again.
    rounded = torch.where(rounded >= 1 << (width - 1), rounded - (1 << width), rounded)
    return rounded.to(int_dtype).view(x.dtype)


def block_exponents(weight: torch.Tensor, block_size: int) -> torch.Tensor:
    """Biased E8M0 exponent (uint8) of each block of ``weight`` (``[out, in/block_size]``)."""
    block_amax = weight.unflatten(-1, (-1, block_size)).abs().amax(dim=-1)
    # Evaluated in the weight's dtype like upstream; log2(0) = -inf clamps to exponent 0.
    exponent = E8M0_BIAS + torch.floor(torch.log2(round_to_power_of_two(block_amax))) - E2M1_EXPONENT_OFFSET
    return torch.round(exponent.clamp(0, 255)).to(torch.uint8)


def exponent_scale(exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2 ** (e - 127) as ``dtype`` (float32 holds all of them, 2**-127 as a subnormal)."""
    return torch.exp2(exponents.to(torch.float32) - E8M0_BIAS).to(dtype)


class MXFP4Format(PackedE2M1Format):
    name = "mxfp4"
    block_size = 32
    scale_dtype = torch.uint8
    compressed_tensors_format = "mxfp4-pack-quantized"
    compressed_tensors_scheme = "MXFP4A16"

    def checkpoint_names(self) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale")

    def quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        if global_scale is not None:
            raise ValueError("mxfp4 has no global scale; pass global_scale=None")
        self.check_weight(weight)
        weight = weight.detach()
        exponents = block_exponents(weight, self.block_size)
        # The scale lives in the weight dtype between observer and compressor upstream. A scale that
        # underflows there (float16) becomes 1.0, as upstream's eps substitution does.
        scale = exponent_scale(exponents, weight.dtype)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        stored = (E8M0_BIAS + torch.floor(torch.log2(scale)).to(torch.int32)).to(torch.uint8)
        codes = e2m1_codes(weight.unflatten(-1, (-1, self.block_size)) / scale.unsqueeze(-1)).flatten(-2)
        return {"weight_packed": pack_low_first(codes), "weight_scale": stored}

    def block_multipliers(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        return exponent_scale(buffers["weight_scale"], torch.float32)

"""FP4 E2M1 element codes shared by NVFP4 and MXFP4.

A 4-bit code is ``sign << 3 | magnitude_index`` with magnitudes ``E2M1_MAGNITUDES``. Two codes share a
byte with the *even* column in the low nibble (compressed-tensors' and vLLM's packing).

Rounding reproduces compressed-tensors 0.19 exactly: values are clamped to +-6 and rounded to the
nearest magnitude with ties to the even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0,
2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0). The sign bit is set for every value < 0, so a small negative
value rounds to code 0x8 ("-0") while -0.0 itself gives code 0, as compressed-tensors packs them.
"""

from __future__ import annotations

from abc import abstractmethod
from functools import cache

import torch

from qerl_cli.formats.base import QuantFormat

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# (threshold, inclusive): magnitude index grows by one when |x| passes each threshold. Inclusive
# thresholds are where the tie rounds *up* to the even code.
_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 and return their 4-bit codes (uint8, same shape)."""
    magnitude = scaled.abs()
    index = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for threshold, inclusive in _THRESHOLDS:
        passed = magnitude >= threshold if inclusive else magnitude > threshold
        index += passed.to(torch.uint8)
    return index | ((scaled < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode 4-bit codes (uint8) to their float values."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitudes = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8).bool(), -magnitudes, magnitudes).to(dtype)


def pack_low_first(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` codes -> ``[rows, cols/2]`` bytes, even column in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_low_first(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_low_first`."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return pairs.flatten(-2)


@cache
def _byte_values(device: torch.device) -> torch.Tensor:
    """float32 ``[256, 2]``: the two E2M1 values each byte packs, even column (low nibble) first."""
    every_byte = torch.arange(256, dtype=torch.uint8, device=device).unsqueeze(-1)
    return e2m1_values(unpack_low_first(every_byte))


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """``[rows, cols/2]`` packed bytes -> ``[rows, cols]`` float32 E2M1 values.

    The same values as ``e2m1_values(unpack_low_first(packed))`` in one table lookup per byte: the
    torch (CPU) path dequantizes in every forward, and the unpack-then-decode chain of elementwise
    ops took ~5 times as long as this lookup (and longer than the matmul) on the tiny model.
    """
    rows = packed.shape[:-1]
    values = _byte_values(packed.device).index_select(0, packed.reshape(-1).to(torch.int32))
    return values.view(*rows, packed.shape[-1] * 2)


class PackedE2M1Format(QuantFormat):
    """NVFP4 and MXFP4: E2M1 codes two per byte (``weight_packed``) and one scale per block of
    ``block_size`` input columns (``weight_scale``, of ``scale_dtype``); nothing needs parsing, so the
    checkpoint and buffer views coincide. Subclasses say how a block's stored scale becomes a multiplier.
    """

    scale_dtype: torch.dtype
    fp4 = True
    vllm_min_capability = (8, 0)  # Marlin FP4
    rollout_backends = ("marlin", "humming", "fp8", "fp8-merged", "merged")

    @abstractmethod
    def block_multipliers(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 ``[out, in/block_size]``: what each block's E2M1 values are multiplied by."""

    def dequantize(
        self, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        packed = tensors["weight_packed"]
        return self.dequantize_buffers(tensors, packed.shape[0], packed.shape[1] * 2, dtype)

    def buffer_specs(
        self, out_features: int, in_features: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {
            "weight_packed": ((out_features, in_features // 2), torch.uint8),
            "weight_scale": ((out_features, in_features // self.block_size), self.scale_dtype),
        }

    def to_buffers(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensors[name] for name in self.checkpoint_names()}

    def dequantize_buffers(
        self, buffers: dict[str, torch.Tensor], out_features: int, in_features: int, dtype: torch.dtype
    ) -> torch.Tensor:
        values = decode_packed(buffers["weight_packed"])
        blocks = values.unflatten(-1, (-1, self.block_size)) * self.block_multipliers(buffers).unsqueeze(-1)
        return blocks.flatten(-2).to(dtype)

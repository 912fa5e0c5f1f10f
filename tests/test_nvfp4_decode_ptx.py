"""The GEMM's inline PTX decode (``_triton_nvfp4_gemm.DECODE_TWO_BYTES``), run instruction by instruction
on the CPU by a small model of the PTX it uses, for every pair of bytes and a range of scales: the
Triton interpreter runs no inline assembly, so without this the asm text would only be checked on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from qerl_cli.formats.fp4 import decode_packed
from qerl_cli.kernels.nvfp4_gemm import SCALE_BIAS, WEIGHT_EXPONENT, block_scales, code_scales

triton = pytest.importorskip("triton")

MASK32 = 0xFFFFFFFF


def _bf16_value(bits: int) -> float:
    return float(torch.tensor([bits << 16], dtype=torch.int64).to(torch.int32).view(torch.float32))


def _bf16_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float64).to(torch.bfloat16).view(torch.int16)) & 0xFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 default mode: result byte i is byte (selector nibble i & 7) of {b, a} (a bytes 0-3);
    a set nibble bit 3 replicates that byte's sign bit."""
    pool = (b << 32 | a).to_bytes(8, "little")
    out = bytearray(4)
    for i in range(4):
        nib = (selector >> (4 * i)) & 0xF
        byte = pool[nib & 7]
        out[i] = (0xFF if byte & 0x80 else 0) if nib & 8 else byte
    return int.from_bytes(out, "little")


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    halves = []
    for shift in (0, 16):
        va, vb, vc = (_bf16_value((v >> shift) & 0xFFFF) for v in (a, b, c))
        halves.append(_bf16_bits(va * vb + vc))  # products here are exact: one rounding, none needed
    return halves[0] | halves[1] << 16


def run_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Execute the decode's PTX on integers: ``operands`` maps $N to 32-bit values; returns them all."""
    regs: dict[str, int] = {f"${n}": v for n, v in operands.items()}

    def val(token: str) -> int:
        token = token.strip()
        return regs[token] if token in regs else int(token, 0) & MASK32

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = (a.strip() for a in args.split(","))
        if op == "mov.b32":
            regs[dst] = val(src[0])
        elif op == "prmt.b32":
            regs[dst] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "shl.b32":
            regs[dst] = (val(src[0]) << val(src[1])) & MASK32
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        elif op == "fma.rn.bf16x2":
            regs[dst] = _fma_bf16x2(val(src[0]), val(src[1]), val(src[2]))
        else:
            raise AssertionError(f"the model does not know {op!r}: extend it with the PTX ISA's meaning")
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def decode_asm() -> str:
    from qerl_cli.kernels import _triton_nvfp4_gemm as kernels

    asm = kernels.DECODE_TWO_BYTES
    return asm.value if hasattr(asm, "value") else asm


def test_decode_two_bytes_gives_exact_products_for_every_byte_pair() -> None:
    asm = decode_asm()
    table = code_scales("cpu")
    scale_codes = [1, 7, 8, 56, 0x38, 0x77, 0x7E, 0xB8, 0xFE]  # subnormal, 1.0, 448, negative
    values = decode_packed(torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None])  # [256, 2]
    for s_low, s_high in zip(scale_codes, reversed(scale_codes), strict=True):
        low_scale = _bf16_bits(float(table[s_low]))
        high_scale = _bf16_bits(float(table[s_high]))
        e4m3 = torch.tensor([s_low, s_high], dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        for b0 in range(256):
            b1 = (b0 * 37 + s_low) % 256  # every byte first, and second against a spread of firsts
            out = run_ptx(asm, {2: b0 | b1 << 8, 3: low_scale | low_scale << 16,
                                4: high_scale | high_scale << 16})  # fmt: skip
            for half, byte in ((0, b0), (16, b1)):
                low = _bf16_value((out[0] >> half) & 0xFFFF)
                high = _bf16_value((out[1] >> half) & 0xFFFF)
                want_low = float(values[byte, 0]) * float(e4m3[0]) * 2.0**-WEIGHT_EXPONENT
                want_high = float(values[byte, 1]) * float(e4m3[1]) * 2.0**-WEIGHT_EXPONENT
                assert (low, high) == (want_low, want_high), (hex(byte), s_low, s_high)


def test_scale_table_is_exact_in_bf16() -> None:
    """Every finite E4M3 code x 2**SCALE_BIAS is a BF16 value (the kernel rounds the table to BF16)."""
    table = code_scales("cpu")
    finite = torch.isfinite(table)
    assert int(finite.sum()) == 254  # all but the two NaN codes
    assert torch.equal(table[finite].to(torch.bfloat16).double(), table[finite].double())
    assert float(table[finite].abs().max()) < 2.0**128 and SCALE_BIAS + WEIGHT_EXPONENT == 126


def test_block_scales_hold_every_finite_code_exactly_in_bf16() -> None:
    """The kernel's per-weight BF16 scales (block_scales) are each E4M3 code's value x 2**SCALE_BIAS,
    unrounded, in the scales' own [N, K/16] shape."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    got = block_scales(codes)
    finite = torch.isfinite(codes.float())
    assert got.dtype == torch.bfloat16 and got.shape == (16, 16)
    assert torch.equal(got.double()[finite], codes.double()[finite] * 2.0**SCALE_BIAS)

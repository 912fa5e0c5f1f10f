"""Triton JIT kernel behind :mod:`qerl_cli.kernels.fp8_rows` (this module imports triton at load time).

Kernel bodies must live at module level: Triton resolves the helper ``@triton.jit`` functions they
call through the defining module's globals.
"""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # the largest finite E4M3 value
MIN_NORMAL_BITS = tl.constexpr(0x3C800000)  # float32 bits of 2**-6, the smallest E4M3 normal


@triton.jit
def _e4m3_rne(v):
    # float32 in [-448, 448] -> E4M3 byte (uint8), round to nearest even, sign of zero kept: what the
    # GPU's cvt.rn.satfinite and torch's float32 -> float8_e4m3fn cast give, in integer arithmetic
    # (Triton's CPU interpreter truncates its own casts, and GPUs before sm_89 have no FP8 convert).
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normals: drop 20 of the 23 mantissa bits with round-to-nearest-even (a carry bumps the exponent),
    # then rebias the exponent from 127 to 7: 120 << 3 = 960.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    # Subnormals (|v| < 2**-6): the code is |v| / 2**-9 rounded to an integer (0..8; 8 is 2**-6, the
    # smallest normal). The product is exact, and adding and subtracting 2**23 rounds to nearest even.
    t = mag.to(tl.float32, bitcast=True) * 512.0
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    return (sign | tl.where(mag < MIN_NORMAL_BITS, sub, normal)).to(tl.uint8)


@triton.jit
def fp8_rows_kernel(
    x_ptr, codes_ptr, scale_ptr, n_cols, x_row_stride,
    BLOCK: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    # One program per row: pass 1 the row's absmax, pass 2 the codes (the row is re-read, from L2).
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    codes_row = codes_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    amax = tl.max(acc, axis=0)
    # Correctly rounded divisions, as torch's float32 ``/`` (Triton's default division is approximate).
    scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
    tl.store(scale_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        if HW_CAST:
            tl.store(codes_row + offs, v.to(tl.float8e4nv), mask=mask)
        else:
            tl.store(codes_row + offs, _e4m3_rne(v), mask=mask)

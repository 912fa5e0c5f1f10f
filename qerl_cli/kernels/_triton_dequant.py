"""Triton JIT kernels behind :mod:`qerl_cli.kernels.dequant` (this module imports triton at load time).

Kernel bodies must live at module level: Triton resolves the helper ``@triton.jit`` functions they
call through the defining module's globals.
"""

import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    # 4-bit code -> float32 built from its bits: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
    m = code & 7
    normal = (((m >> 1) + 126) << 23) | ((m & 1) << 22)
    bits = tl.where(m >= 2, normal, tl.where(m == 1, 126 << 23, 0)) | ((code & 8) << 28)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(byte):
    # FP8 E4M3 byte -> float32 (no NaN handling: scales are finite by construction).
    e = (byte >> 3) & 15
    m = byte & 7
    bits = ((e + 120) << 23) | (m << 20)
    normal = bits.to(tl.int32).to(tl.float32, bitcast=True)
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    return tl.where((byte & 128) != 0, -magnitude, magnitude)


@triton.jit
def fp4_dequant_kernel(
    packed_ptr, scale_ptr, global_scale_ptr, out_ptr, n_bytes,
    BLOCK: tl.constexpr, NVFP4: tl.constexpr, BYTES: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    mask = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    block = (offs * 2) // BLOCK
    raw_scale = tl.load(scale_ptr + block, mask=mask, other=0).to(tl.int32)
    if NVFP4:
        scale = tl.math.div_rn(_e4m3(raw_scale), tl.load(global_scale_ptr))
    else:
        # E8M0: 2**(e-127); e == 0 is the float32 subnormal 2**-127.
        scale = tl.where(raw_scale == 0, 0x400000, raw_scale << 23).to(tl.float32, bitcast=True)
    low = _e2m1(byte & 15) * scale  # even column
    high = _e2m1(byte >> 4) * scale
    out_offs = tl.program_id(0).to(tl.int64) * (2 * BYTES) + tl.arange(0, 2 * BYTES)
    values = tl.interleave(low, high).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_offs, values, mask=out_offs < 2 * n_bytes)


@triton.jit
def nf4_dequant_kernel(
    packed_ptr, absmax_ptr, code_ptr, nested_absmax_ptr, nested_code_ptr, offset_ptr, out_ptr, n_bytes,
    DOUBLE_QUANT: tl.constexpr, BYTES: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    mask = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    block = (offs * 2) // 64
    if DOUBLE_QUANT:
        q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        nested = tl.load(nested_code_ptr + q) * tl.load(
            nested_absmax_ptr + block // 256, mask=mask, other=0.0
        )
        absmax = nested + tl.load(offset_ptr)
    else:
        absmax = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    even = tl.load(code_ptr + (byte >> 4)) * absmax  # bitsandbytes: even element in the high nibble
    odd = tl.load(code_ptr + (byte & 15)) * absmax
    out_offs = tl.program_id(0).to(tl.int64) * (2 * BYTES) + tl.arange(0, 2 * BYTES)
    values = tl.interleave(even, odd).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_offs, values, mask=out_offs < 2 * n_bytes)

"""Triton JIT kernels behind :mod:`qerl_cli.kernels.nvfp4_gemm` (this module imports triton at load time).

Kernel bodies must live at module level: Triton resolves the helper ``@triton.jit`` functions they
call through the defining module's globals.
"""

import triton
import triton.language as tl

# F32_DOT (the CPU interpreter): Triton 3.9's interpreter multiplies BF16 dot operands as their raw bits,
# and its float32 -> BF16 cast truncates. There the weight tile stays float32, rounded to BF16 values by
# _rne_bf16 (the GPU's cast), and both operands go in as float32: the same products, since BF16 x BF16
# is exact in float32, so the interpreter computes what the GPU does.

# The decode below yields each E2M1 value times 2**-14 (see _e2m1_pair); the multipliers the host passes
# are scaled by 2**14 to undo it. Both scalings are exact, so the product is the reference's float32 one.
SIGNS = tl.constexpr(-2147450880)  # 0x80008000 as an int32: the sign bits of two FP16 halves


@triton.jit
def _rne_bf16(v):
    # float32 -> the nearest BF16 value (ties to even), still as float32: integer arithmetic on the bits.
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_pair(byte):
    # One packed byte (int32) -> its (even, odd) E2M1 values as float32, each times 2**-14. The 3-bit
    # magnitude code of E2M1 is exactly the low exponent bits and top mantissa bit of an FP16 number
    # whose exponent bias is 14 more (15 vs 1), subnormal 0.5 included (FP16 keeps its subnormals,
    # where an FP32 bit trick would meet flush-to-zero). Both values are built at once as the two FP16
    # halves of one int32: b * (2**9 + 2**21) is b << 9 | b << 21 (they do not overlap, so no carry)
    # and holds both magnitudes in place, b * (2**12 + 2**24) both signs. Two multiplies and two logic
    # ops per byte: on sm_90 this took the K loop from about 12 to 9.6 instructions per weight value.
    magnitudes = (byte * 0x200200) & 0x0E000E00
    pair = ((byte * 0x1001000) & SIGNS) | magnitudes
    low = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)  # int16: the low half
    high = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _weight_halves(packed_ptr, scale_ptr, mult_ptr, offs_n, n_mask, j0, KH, K, BN: tl.constexpr,
                   BJ: tl.constexpr, EVEN: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    # The dequantized bf16 tiles W[offs_n, j0:j0+BJ] (low nibbles) and W[offs_n, KH+j0:KH+j0+BJ] (high
    # nibbles) of the half-split layout (nvfp4_gemm.split_halves). Bytes as [BN, BJ/16, 16]: one block
    # of 16 K values per middle index in either nibble, so each block's multiplier broadcasts without a
    # gather, and the merge of the last two axes into [BN, BJ] keeps every value where it is (no
    # interleave of the two nibbles, which cost a shared-memory round trip per K step).
    blocks = j0 // 16 + tl.arange(0, BJ // 16)
    byte_offs = offs_n[:, None, None] * KH + blocks[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    low_offs = offs_n[:, None] * (K // 16) + blocks[None, :]
    high_offs = low_offs + KH // 16
    if EVEN:  # every tile whole: no masks (their selects took ~7% of the loop's instructions on sm_90)
        byte = tl.load(packed_ptr + byte_offs).to(tl.int32)
        low_code = tl.load(scale_ptr + low_offs)
        high_code = tl.load(scale_ptr + high_offs)
    else:
        mask = n_mask[:, None] & (blocks[None, :] < KH // 16)
        byte = tl.load(packed_ptr + byte_offs, mask=mask[:, :, None], other=0).to(tl.int32)
        low_code = tl.load(scale_ptr + low_offs, mask=mask & (blocks[None, :] < K // 16), other=0)
        high_code = tl.load(
            scale_ptr + high_offs, mask=mask & (blocks[None, :] + KH // 16 < K // 16), other=0
        )
    # The reference's multiplier of each block, looked up by its E4M3 code in the host's table (the
    # format's own float32 scale / global scale, x 2**14): decoding E4M3 and dividing here took a fifth
    # of the K loop's instructions on sm_90.
    low_mult = tl.load(mult_ptr + low_code.to(tl.int32))[:, :, None]
    high_mult = tl.load(mult_ptr + high_code.to(tl.int32))[:, :, None]
    low, high = _e2m1_pair(byte)
    if F32_DOT:
        low, high = _rne_bf16(low * low_mult), _rne_bf16(high * high_mult)
    else:
        low, high = (low * low_mult).to(tl.bfloat16), (high * high_mult).to(tl.bfloat16)
    return tl.reshape(low, (BN, BJ)), tl.reshape(high, (BN, BJ))


@triton.jit
def _epilogue(acc, offs_m, offs_n, m_mask, n_mask, M, bias_ptr, xa_ptr, lora_b_ptr, lora_scaling, y_ptr,
              stride_ym, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RANK: tl.constexpr,
              R_PAD: tl.constexpr, XA_SPLITS: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    # acc is y^T for this tile, [BN, BM] in float32: add bias and the LoRA expansion, round once to bf16.
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_LORA:
        r = tl.arange(0, R_PAD)
        xa_offs = offs_m[None, :] * R_PAD + r[:, None]
        xa = tl.load(xa_ptr + xa_offs, mask=m_mask[None, :], other=0.0)
        for s in tl.static_range(1, XA_SPLITS):  # the shrink's K-split partials, summed in a fixed order
            xa += tl.load(xa_ptr + s * M * R_PAD + xa_offs, mask=m_mask[None, :], other=0.0)
        b = tl.load(lora_b_ptr + offs_n[:, None] * RANK + r[None, :],
                    mask=n_mask[:, None] & (r[None, :] < RANK), other=0.0).to(tl.float32)  # fmt: skip
        # acc as the dot's accumulator (the scaling on xa's few rows): no second [BN, BM] tile, whose
        # registers a 256-token tile with split K did not have (it spilled).
        acc = tl.dot(b, xa * lora_scaling, acc, input_precision="tf32")
    if F32_DOT:
        acc = _rne_bf16(acc)  # so the interpreter's truncating cast below is exact
    y_offs = offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def nvfp4_gemm_kernel(
    x_ptr, packed_ptr, scale_ptr, mult_ptr, bias_ptr, xa_ptr, lora_b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, KH, stride_xm, stride_ym, lora_scaling,
    BM: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RANK: tl.constexpr, R_PAD: tl.constexpr,
    XA_SPLITS: tl.constexpr, EVEN: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    # y^T tile [BN, BM] = W tile [BN, K] @ x^T [K, BM]: the weight is the MMA's left operand (rows of
    # 64 per warpgroup on Hopper), so a handful of tokens is the narrow right side, as small as 16.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    pid_m = pid % num_m  # M tiles of one weight tile run side by side: the weight is read once from HBM
    pid_n = pid // num_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # K is walked as the half-split layout's byte columns j: byte j holds K index j and KH + j.
    j_per_split = tl.cdiv(tl.cdiv(KH, SPLIT_K), BJ) * BJ
    j_begin = split * j_per_split
    j_end = tl.minimum(KH, j_begin + j_per_split)
    offs_j = tl.arange(0, BJ)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for j0 in range(j_begin, j_end, BJ):
        w_low, w_high = _weight_halves(packed_ptr, scale_ptr, mult_ptr, offs_n, n_mask, j0, KH, K, BN, BJ,
                                       EVEN, F32_DOT)  # fmt: skip
        ks = j0 + offs_j
        x_offs = offs_m[None, :] * stride_xm + ks[:, None]
        if EVEN:
            x_low = tl.load(x_ptr + x_offs, mask=m_mask[None, :], other=0.0)
            x_high = tl.load(x_ptr + x_offs + KH, mask=m_mask[None, :], other=0.0)
        else:
            x_low = tl.load(x_ptr + x_offs, mask=m_mask[None, :] & (ks[:, None] < K), other=0.0)
            x_high = tl.load(x_ptr + x_offs + KH, mask=m_mask[None, :] & (ks[:, None] + KH < K), other=0.0)
        if F32_DOT:
            acc = tl.dot(w_low, x_low.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(w_high, x_high.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w_low, x_low, acc)
            acc = tl.dot(w_high, x_high, acc)
    if SPLIT_K == 1:
        _epilogue(acc, offs_m, offs_n, m_mask, n_mask, M, bias_ptr, xa_ptr, lora_b_ptr, lora_scaling, y_ptr,
                  stride_ym, HAS_BIAS, HAS_LORA, RANK, R_PAD, XA_SPLITS, F32_DOT)  # fmt: skip
    else:
        # Serial split-K: every split leaves its partial in the workspace; the last one to arrive at the
        # tile's counter sums them all in split order (deterministic), runs the epilogue and resets the
        # counter for the next call. acq_rel orders the partials' stores before the counter.
        tile_offs = offs_m[None, :] * N + offs_n[:, None]
        tile_mask = n_mask[:, None] & m_mask[None, :]
        tl.store(ws_ptr + split * M * N + tile_offs, acc, mask=tile_mask)
        arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BN, BM), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(
                    ws_ptr + s * M * N + tile_offs, mask=tile_mask, other=0.0, cache_modifier=".cg"
                )
            _epilogue(total, offs_m, offs_n, m_mask, n_mask, M, bias_ptr, xa_ptr, lora_b_ptr, lora_scaling,
                      y_ptr, stride_ym, HAS_BIAS, HAS_LORA, RANK, R_PAD, XA_SPLITS, F32_DOT)  # fmt: skip
            tl.atomic_xchg(lock_ptr + pid, 0)


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, xa_ptr, M, K, stride_xm,
    RANK: tl.constexpr, R_PAD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr,
    F32_DOT: tl.constexpr,
):  # fmt: skip
    # xa[split, m, :] = x[m, k-range of split] @ A[:, k-range]^T in float32: the LoRA projection, once per
    # call; the K split spreads a few rows over many programs and the GEMM's epilogue sums the partials.
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    r = tl.arange(0, R_PAD)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLITS), BK) * BK
    k_begin = split * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    acc = tl.zeros((BM, R_PAD), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
                    mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)  # fmt: skip
        at = tl.load(
            a_ptr + r[None, :] * K + ks[:, None], mask=(r[None, :] < RANK) & (ks[:, None] < K), other=0.0
        )
        if F32_DOT:
            acc = tl.dot(x.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, at, acc)
    tl.store(xa_ptr + split * M * R_PAD + offs_m[:, None] * R_PAD + r[None, :], acc, mask=offs_m[:, None] < M)

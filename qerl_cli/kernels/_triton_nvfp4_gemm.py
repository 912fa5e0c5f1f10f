"""Triton JIT kernels behind :mod:`qerl_cli.kernels.nvfp4_gemm` (this module imports triton at load time).

Kernel bodies must live at module level: Triton resolves the helper ``@triton.jit`` functions they
call through the defining module's globals.
"""

import triton
import triton.language as tl

# F32_DOT (the CPU interpreter): Triton 3.9's interpreter multiplies BF16 dot operands as their raw bits,
# and its float32 -> BF16 cast truncates; it runs no inline PTX either. There the weight tile stays float32
# (the same exact values) and both dot operands go in as float32: BF16 x BF16 is exact in float32, so the
# interpreter computes what the GPU does.

# The weight tile holds E2M1 value x E4M3 scale x 2**-8, exactly (at most 6 significant bits, 2**-18 to
# 10.5: BF16 holds every such product); the global scale (x 2**8) multiplies the float32 accumulator in
# the epilogue. The decode places each 4-bit code in a BF16's sign, two low exponent bits and top
# mantissa bit: E2M1's exponent bias is 1 and BF16's 127, so the BF16 reads the E2M1 value x 2**-126
# (code 1, 0.5, as the BF16 subnormal 2**-127); each block's BF16 scale holds E4M3 x 2**118
# (nvfp4_gemm.block_scales), so one BF16 multiply gives E2M1 x scale x 2**-8 (nvfp4_gemm.SCALE_BIAS and
# WEIGHT_EXPONENT). No float32 round trip.


# Two packed bytes in ($2, as loaded: a thread holds two adjacent bytes of a row), out the BF16 weights
# of their low nibbles (first half of K, $0) and of their high ones (second half, $1), each pair times
# its BF16 scales ($3, $4). prmt spreads the two bytes to the two 16-bit halves of a register, so one
# shift, mask and bf16x2 FMA (with -0, i.e. a multiply, on sm_80+) serves two weights: about 3
# instructions a weight, where the float32 route (FP16 trick, convert, multiply, round) took ~5
# (its effect on the K loop and the GEMM: benchmarks/h200-2026-11-28-nvfp4-exact-decode).
def _decode_nibbles(magnitude_shift: int, sign_shift: int, out: str, scale: str) -> str:
    # One nibble of each spread byte to a BF16 (sign to bit 15, its 3-bit magnitude to bits 6-8), times
    # its scale: the low nibble's bits move by 6 and 12, the high one's (4 bits up) by 2 and 8.
    return (f"shl.b32 u, t, {magnitude_shift};\nshl.b32 v, t, {sign_shift};\nand.b32 u, u, 0x01C001C0;\n"
            f"and.b32 v, v, 0x80008000;\nor.b32 u, u, v;\nfma.rn.bf16x2 {out}, u, {scale}, z;\n")  # fmt: skip


DECODE_TWO_BYTES = tl.constexpr(
    "{\n.reg .b32 t, u, v, z;\nmov.b32 z, 0x80008000;\nprmt.b32 t, $2, 0, 0x4140;\n"
    + _decode_nibbles(6, 12, "$0", "$3")
    + _decode_nibbles(2, 8, "$1", "$4")
    + "}\n"
)
# The interpreter's float32 twin: the same bits, placed in a float32 (exponent bias 127 as BF16's, so
# the same 2**-126 factor; code 1 a float32 subnormal, which numpy keeps).
F32_SIGN = tl.constexpr(-2147483648)  # 0x80000000 as an int32


@triton.jit
def _rne_bf16(v):
    # float32 -> the nearest BF16 value (ties to even), still as float32: integer arithmetic on the bits.
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_f32(byte, low_scale, high_scale):
    # The interpreter's decode: each nibble's E2M1 value x 2**-126 as float32, times its BF16 scale.
    word = byte.to(tl.int32)
    low = (((word << 28) & F32_SIGN) | ((word & 7) << 22)).to(tl.float32, bitcast=True)
    high = (((word << 24) & F32_SIGN) | ((word & 0x70) << 18)).to(tl.float32, bitcast=True)
    return low * low_scale.to(tl.float32), high * high_scale.to(tl.float32)


@triton.jit
def _scale_tile(tiles_ptr, pid_n, j0, KH, N, BN: tl.constexpr, BJ: tl.constexpr, EVEN: tl.constexpr):
    # The BF16 block scales of the weight tile at byte column j0, low and high nibbles, each [BN, BJ/16],
    # from nvfp4_gemm.scale_tiles: [ceil(N/64), KH/16, 64, 2] (64-row groups; per block column the low and the
    # high scale of each row side by side). One K step of a 64-row group is then one contiguous run,
    # which the pipeliner copies stages ahead like the weight bytes; the [N, K/16] rows' few bytes a step
    # were plain loads it left in the loop, waited on at every step (the figures: docs/rollout.md).
    groups = pid_n * (BN // 64) + tl.arange(0, BN // 64)
    run = (j0 // 16) * 128 + tl.arange(0, (BJ // 16) * 128)
    offs = groups[:, None] * ((KH // 16) * 128) + run[None, :]
    if EVEN:
        pairs = tl.load(tiles_ptr + offs)
    else:  # past N or past KH: zeros, which the masked weight bytes multiply anyway
        live = (groups[:, None] < tl.cdiv(N, 64)) & (run[None, :] < (KH // 16) * 128)
        pairs = tl.load(tiles_ptr + offs, mask=live, other=0.0)
    pairs = tl.permute(tl.reshape(pairs, (BN // 64, BJ // 16, 64, 2)), (0, 2, 1, 3))
    return tl.split(tl.reshape(pairs, (BN, BJ // 16, 2)))


@triton.jit
def _weight_halves(packed_ptr, tiles_ptr, pid_n, offs_n, n_mask, j0, KH, N, BN: tl.constexpr,
                   BJ: tl.constexpr, EVEN: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    # The weight tiles W[offs_n, j0:j0+BJ] (low nibbles) and W[offs_n, KH+j0:KH+j0+BJ] (high nibbles)
    # of the half-split layout (nvfp4_gemm.split_halves), each x 2**-8 (the epilogue undoes it). Bytes
    # as [BN, BJ/16, 16]: one block of 16 K values per middle index in either nibble, so each block's
    # scale broadcasts without a gather, and the merge of the last two axes into [BN, BJ] keeps every
    # value where it is (no interleave of the two nibbles, which cost a shared-memory round trip).
    blocks = j0 // 16 + tl.arange(0, BJ // 16)
    byte_offs = offs_n[:, None, None] * KH + blocks[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    if EVEN:  # every tile whole: no masks (their selects took ~7% of the loop's instructions on sm_90)
        byte = tl.load(packed_ptr + byte_offs)
    else:
        mask = n_mask[:, None] & (blocks[None, :] < KH // 16)
        byte = tl.load(packed_ptr + byte_offs, mask=mask[:, :, None], other=0)
    # Each block's scale is its BF16 value x 2**118 (nvfp4_gemm.block_scales, made once per weight).
    low_scale, high_scale = _scale_tile(tiles_ptr, pid_n, j0, KH, N, BN, BJ, EVEN)
    low_scale = tl.broadcast_to(low_scale[:, :, None], (BN, BJ // 16, 16))
    high_scale = tl.broadcast_to(high_scale[:, :, None], (BN, BJ // 16, 16))
    if F32_DOT:
        low, high = _decode_f32(byte, low_scale, high_scale)
    else:
        low, high = tl.inline_asm_elementwise(
            DECODE_TWO_BYTES, "=r,=r,r,r,r", [byte, low_scale, high_scale],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2,
        )  # fmt: skip
    return tl.reshape(low, (BN, BJ)), tl.reshape(high, (BN, BJ))


@triton.jit
def _epilogue(acc, offs_m, offs_n, m_mask, n_mask, M, out_scale_ptr, bias_ptr, xa_ptr, lora_b_ptr,
              lora_scaling, y_ptr, stride_ym, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
              RANK: tl.constexpr, R_PAD: tl.constexpr, XA_SPLITS: tl.constexpr,
              F32_DOT: tl.constexpr):  # fmt: skip
    # acc is y^T for this tile, [BN, BM] in float32, of weights x 2**-8 / global scale: the one float32
    # multiply by 2**8 / global scale, then bias and the LoRA expansion, rounded once to bf16.
    acc = acc * tl.load(out_scale_ptr)
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
    x_ptr, packed_ptr, tiles_ptr, out_scale_ptr, bias_ptr, xa_ptr, lora_b_ptr, y_ptr, ws_ptr, lock_ptr,
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
        w_low, w_high = _weight_halves(packed_ptr, tiles_ptr, pid_n, offs_n, n_mask, j0, KH, N, BN, BJ, EVEN,
                                       F32_DOT)  # fmt: skip
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
        _epilogue(acc, offs_m, offs_n, m_mask, n_mask, M, out_scale_ptr, bias_ptr, xa_ptr, lora_b_ptr,
                  lora_scaling, y_ptr, stride_ym, HAS_BIAS, HAS_LORA, RANK, R_PAD, XA_SPLITS,
                  F32_DOT)  # fmt: skip
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
            _epilogue(total, offs_m, offs_n, m_mask, n_mask, M, out_scale_ptr, bias_ptr, xa_ptr,
                      lora_b_ptr, lora_scaling, y_ptr, stride_ym, HAS_BIAS, HAS_LORA, RANK, R_PAD,
                      XA_SPLITS, F32_DOT)  # fmt: skip
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

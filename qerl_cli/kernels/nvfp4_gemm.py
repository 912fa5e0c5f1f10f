"""W4A16 NVFP4 GEMM with an optional fused LoRA: ``y = x @ dequant(W)^T (+ bias) (+ s * (x @ A^T) @ B^T)``.

``x`` is ``[..., K]`` BF16; ``W`` is one linear's NVFP4 buffers exactly as the checkpoint stores them
(:mod:`qerl_cli.formats.nvfp4`: ``weight_packed`` uint8 ``[N, K/2]`` with the even column in the low
nibble, ``weight_scale`` E4M3 ``[N, K/16]``, ``weight_global_scale`` float32 ``[1]``). The Triton kernel
dequantizes each weight tile in registers (the dense weight never reaches global memory) to the exact
products E2M1 value x E4M3 scale (x 2**-8, which BF16 holds without rounding: one packed BF16 multiply
per two weights, as Marlin does) and multiplies with float32 accumulation; the global scale multiplies
the accumulator once, and the output is rounded to BF16 once, after bias and LoRA. So no weight is
rounded: the result is within one BF16 rounding per weight of the format's own
``dequantize_buffers(..., torch.bfloat16)`` (which rounds each E2M1 x float32 ``scale / global_scale``)
and closer to the checkpoint's exact values. The kernel reads the packed
weight in a layout of its own (:func:`split_halves`, made once per weight: the low nibbles hold the first
half of K, the high ones the second), so each K step is two plain dequantized tiles, each multiplied by
its half of ``x``, and no tile is re-laid-out between its load and the MMA; and the block scales as BF16
values (:func:`block_scales`: 2 bytes a block of 16 weights where the E4M3 code is 1, so the kernel reads
0.625 bytes a weight, not the format's 0.5625) in tiles of 64 rows (:func:`scale_tiles`, made once per
weight), so each K step's scales are one contiguous run copied stages ahead, as the weight bytes are.

The LoRA runs as two kernels: a small one computes ``x @ A^T`` once (float32, split over K so a few rows
still fill the GPU), and the GEMM's epilogue adds ``s * xa @ B^T`` to its float32 accumulator, so no
separate pass over ``y`` exists. When the output has fewer tiles than the GPU has SMs (a few hundred
tokens through a 7B's attention projections) the K dimension is split too: each split leaves a float32
partial in a workspace and the last to finish sums them in a fixed order (deterministic) and writes ``y``.

Tile configs are chosen by the number of rows (:data:`~qerl_cli.kernels.nvfp4_tiles.BUCKETS`).
:func:`nvfp4_linear` routes like :func:`qerl_cli.kernels.dequant.use_triton_for`: CUDA tensors (or CPU
tensors under the interpreter) to the kernel, anything else to :func:`nvfp4_linear_reference`
(dequantize, then matmul).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from qerl_cli import formats
from qerl_cli.formats.fp4 import decode_packed
from qerl_cli.kernels.dequant import use_triton_for
from qerl_cli.kernels.nvfp4_tiles import MIN_K_TILES_PER_SPLIT, SCALE_ROWS, TileConfig, config_for

BLOCK = 16  # NVFP4's block of values sharing one E4M3 scale
# The kernel's weight tile is E2M1 x E4M3 scale x 2**-WEIGHT_EXPONENT, exactly (_triton_nvfp4_gemm): its
# BF16 decode reads each code as its E2M1 value x 2**-126, and the scale table holds E4M3 x 2**SCALE_BIAS.
WEIGHT_EXPONENT = 8
SCALE_BIAS = 126 - WEIGHT_EXPONENT
MAX_RANK = 128
# The shrink kernel's K split never exceeds this: the GEMM epilogue reads every split's partial.
MAX_XA_SPLITS = 8
SHRINK_BLOCK_M = 16
SHRINK_BLOCK_K = 128


@dataclass(frozen=True)
class LoraWeights:
    """One LoRA adapter of a linear, ``y += scaling * (x @ a^T) @ b^T``: ``a`` [r, K], ``b`` [N, r]."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


def code_scales(device: torch.device | str) -> torch.Tensor:
    """float32 ``[256]``: every E4M3 scale code's value x 2**SCALE_BIAS, each exact in BF16 (E4M3's 4
    significant bits in BF16's 8, 2**109 to 448 x 2**118 in its range; the two NaN codes NaN)."""
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).view(torch.float8_e4m3fn)
    return codes.float() * 2.0**SCALE_BIAS


def block_scales(scale: torch.Tensor) -> torch.Tensor:
    """BF16 ``[N, K/16]``: each E4M3 ``scale`` code's :func:`code_scales` value (exact), the values the
    kernel's decode multiplies by, where looking each code up in a table inside the K loop made every
    step wait on the code's load first (slower, most of all at few tokens: docs/rollout.md,
    qerl-triton). BF16, not float32: half the bytes, and as fast or faster at every row count measured
    but 256 tokens of the widest linear."""
    table = code_scales(scale.device)
    return table[scale.contiguous().view(torch.uint8).int()].to(torch.bfloat16)


def scale_tiles_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """The shape of :func:`scale_tiles` for an ``n`` x ``k`` weight."""
    return (-(-n // SCALE_ROWS), -(-k // (2 * BLOCK)), SCALE_ROWS, 2)


def scale_tiles(scale: torch.Tensor) -> torch.Tensor:
    """BF16 ``[ceil(N/64), KH/16, 64, 2]``, the kernel's block scales (:func:`block_scales` values) in
    the order its K loop reads them: for each group of 64 rows and block column ``j`` of the half-split
    layout (:func:`split_halves`), the scale of K block ``j`` (low nibbles) and of ``KH/16 + j`` (high
    ones) of each row side by side; zero past ``N`` and past ``K/16``. One K step of a 64-row tile is then
    one contiguous run, which Triton's pipeliner copies stages ahead with the weight bytes; read as
    ``[N, K/16]`` rows (a few bytes a row a step) the same loads stayed in the loop, each step waiting on
    them (bit-identical outputs, 1.1-1.2x the GEMM: docs/rollout.md, qerl-triton). Made once per weight."""
    n, blocks = scale.shape
    groups, half_blocks, _, _ = scale_tiles_shape(n, blocks * BLOCK)
    padded = torch.zeros((groups * SCALE_ROWS, 2 * half_blocks), dtype=torch.bfloat16, device=scale.device)
    padded[:n, :blocks] = block_scales(scale)
    return padded.view(groups, SCALE_ROWS, 2, half_blocks).permute(0, 3, 1, 2).contiguous()


def output_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[1]``: what the kernel's accumulator is multiplied by, 2**WEIGHT_EXPONENT / global
    scale (a device tensor: no host sync, so the call can be captured in a CUDA graph)."""
    return (2.0**WEIGHT_EXPONENT / global_scale.float().reshape(1)).contiguous()


def split_halves(packed: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of ``weight_packed`` ``[N, K/2]`` (K index ``2j`` in byte ``j``'s low nibble,
    ``2j + 1`` in its high one): uint8 ``[N, KH]`` with K index ``j`` in byte ``j``'s low nibble and
    ``KH + j`` in its high one, ``KH`` = K rounded up to 32, halved (the padding holds code 0, +0).
    The GEMM then multiplies the low nibbles by ``x[:, :KH]`` and the high ones by ``x[:, KH:]``, two
    plain tiles, where the checkpoint's order needs its two nibbles interleaved into one tile on every K
    step (a shared-memory round trip on the GPU). The same bytes: made once per weight, the checkpoint
    on disk unchanged."""
    n, k = packed.shape[0], packed.shape[1] * 2
    kh = -(-k // (2 * BLOCK)) * BLOCK
    codes = torch.zeros((n, 2 * kh), dtype=torch.uint8, device=packed.device)
    codes[:, 0:k:2] = packed & 0x0F
    codes[:, 1:k:2] = packed >> 4
    return (codes[:, :kh] | (codes[:, kh:] << 4)).contiguous()


@dataclass(frozen=True)
class Nvfp4Weight:
    """One linear's NVFP4 buffers (checkpoint layout) and its sizes; ``out_scale`` is
    :func:`output_scale` of its global scale, ``halves`` :func:`split_halves` of ``packed`` and
    ``tiled_scales`` :func:`scale_tiles` of ``scale``, each computed once (None: on every call)."""

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    out_scale: torch.Tensor | None = None
    halves: torch.Tensor | None = None
    tiled_scales: torch.Tensor | None = None

    @classmethod
    def from_buffers(cls, buffers: dict[str, torch.Tensor]) -> Nvfp4Weight:
        global_scale, packed = buffers["weight_global_scale"], buffers["weight_packed"]
        scale = buffers["weight_scale"]
        return cls(
            packed, scale, global_scale, output_scale(global_scale), split_halves(packed), scale_tiles(scale)
        )

    def kernel_out_scale(self) -> torch.Tensor:
        return self.out_scale if self.out_scale is not None else output_scale(self.global_scale)

    def kernel_halves(self) -> torch.Tensor:
        return self.halves if self.halves is not None else split_halves(self.packed)

    def kernel_scales(self) -> torch.Tensor:
        return self.tiled_scales if self.tiled_scales is not None else scale_tiles(self.scale)

    def clone(self) -> Nvfp4Weight:
        """A copy in new memory, the derived tables included (the bench reads distinct copies)."""
        tensors = (self.packed, self.scale, self.global_scale, self.out_scale, self.halves, self.tiled_scales)
        return Nvfp4Weight(*(t.clone() if t is not None else None for t in tensors))

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    def buffers(self) -> dict[str, torch.Tensor]:
        return {
            "weight_packed": self.packed,
            "weight_scale": self.scale,
            "weight_global_scale": self.global_scale,
        }

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense ``[N, K]`` weight by the format's own (torch) dequantization: each value rounded to
        ``dtype`` from E2M1 x (scale / global scale)."""
        return formats.get("nvfp4").dequantize_buffers(
            self.buffers(), self.out_features, self.in_features, dtype
        )

    def exact_products(self) -> torch.Tensor:
        """float32 ``[N, K]``: E2M1 x E4M3 scale x 2**-WEIGHT_EXPONENT, exact: the kernel's weight tile,
        which the kernel's accumulator multiplies by :func:`output_scale` once."""
        values = decode_packed(self.packed).unflatten(-1, (-1, BLOCK))
        blocks = values * (self.scale.float() * 2.0**-WEIGHT_EXPONENT).unsqueeze(-1)
        return blocks.flatten(-2)

    def kernel_dequantize(self) -> torch.Tensor:
        """BF16 ``[N, K]``: what the kernel computes for an identity ``x``: the exact product times
        :func:`output_scale` in float32, rounded once to BF16 (within one BF16 rounding of the format's
        :meth:`dequantize`, which rounds the block multiplier to float32 first)."""
        return (self.exact_products() * self.kernel_out_scale().float()).to(torch.bfloat16)


@cache
def _kernels():  # -> the qerl_cli.kernels._triton_nvfp4_gemm module
    """Import the kernels on first use so importing this module never imports triton."""
    from qerl_cli.kernels import _triton_nvfp4_gemm

    return _triton_nvfp4_gemm


def check_operands(
    x: torch.Tensor, weight: Nvfp4Weight, bias: torch.Tensor | None, lora: LoraWeights | None
) -> None:
    """Shapes and dtypes the kernel needs, each failure saying what was passed and what is expected."""
    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the NVFP4 weight {k}")
    scale = weight.scale
    if (
        weight.packed.dtype != torch.uint8
        or scale.dtype != torch.float8_e4m3fn
        or scale.shape != (n, k // BLOCK)
    ):
        raise ValueError(
            f"expected weight_packed uint8 [N, K/2] and weight_scale float8_e4m3fn [N, K/{BLOCK}]; got "
            f"{weight.packed.dtype} {tuple(weight.packed.shape)} and {scale.dtype} {tuple(scale.shape)}"
        )
    tiles = weight.tiled_scales
    if tiles is not None and (tiles.dtype != torch.bfloat16 or tiles.shape != scale_tiles_shape(n, k)):
        raise ValueError(
            f"tiled_scales must be scale_tiles(weight_scale), BF16 {scale_tiles_shape(n, k)}; got "
            f"{tiles.dtype} {tuple(tiles.shape)}"
        )
    if weight.global_scale.numel() != 1:
        raise ValueError(
            f"weight_global_scale must hold one value, got shape {tuple(weight.global_scale.shape)}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if lora is not None:
        r = lora.rank
        if lora.a.shape != (r, k) or lora.b.shape != (n, r):
            raise ValueError(
                f"LoRA A must be [r, {k}] and B [{n}, r]; got {tuple(lora.a.shape)} and {tuple(lora.b.shape)}"
            )
        if not 1 <= r <= MAX_RANK:
            raise ValueError(f"LoRA rank {r} outside 1..{MAX_RANK}")


def nvfp4_linear_reference(
    x: torch.Tensor,
    weight: Nvfp4Weight,
    bias: torch.Tensor | None = None,
    lora: LoraWeights | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The kernel's arithmetic in torch: ``x`` times the exact weight products (:meth:`Nvfp4Weight.
    exact_products`) in ``dtype`` (float64 to check the kernel), times :func:`output_scale`, then bias
    and LoRA, cast back to ``x``'s dtype."""
    check_operands(x, weight, bias, lora)
    xs = x.to(dtype)
    y = (xs @ weight.exact_products().to(dtype).T) * weight.kernel_out_scale().to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    if lora is not None:
        y = y + lora.scaling * ((xs @ lora.a.to(dtype).T) @ lora.b.to(dtype).T)
    return y.to(x.dtype)


@cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: any small number makes the CPU tests take the split-K path too
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(config: TileConfig, m: int, n: int, k: int, device: torch.device) -> int:
    """K splits that bring the programs to at most ``config.programs_per_sm`` per SM, each split keeping
    at least MIN_K_TILES_PER_SPLIT K tiles (fewer would leave the pipeline nothing to overlap)."""
    k_tiles = -(-k // config.block_k)
    if config.split_k is not None:
        return max(1, min(config.split_k, k_tiles))
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    wanted = config.programs_per_sm * _sm_count(device) // tiles
    return max(1, min(wanted, k_tiles // MIN_K_TILES_PER_SPLIT))


_LOCKS: dict[torch.device, list[torch.Tensor]] = {}
# Counters a set holds at least: more than a K split ever asks on these GPUs (it splits only while the
# tiles are fewer than programs_per_sm x the SMs), so one set serves every call.
MIN_LOCKS = 4096


def _locks(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K counters, zero between calls (the reducing program resets its own); one set per
    device, so calls on one device must not overlap on different streams. A set outgrown is kept, not
    freed: a CUDA graph captured with it still points at it."""
    held = _LOCKS.setdefault(device, [])
    if not held or held[-1].numel() < tiles:
        held.append(torch.zeros(max(tiles, MIN_LOCKS), dtype=torch.int32, device=device))
    return held[-1]


def make_device_tables(device: torch.device) -> None:
    """Make the per-device table calls with a K split read (the split-K counters) now: made first
    inside a CUDA graph capture it would live in the graph's private memory."""
    if device.type == "cuda":
        _locks(device, MIN_LOCKS)


def lora_shrink(x: torch.Tensor, lora: LoraWeights) -> tuple[torch.Tensor, int]:
    """float32 K-split partials ``[splits, M, r_pad]`` of ``x @ A^T`` (summed by the GEMM's epilogue)."""
    m, k = x.shape
    r_pad = max(16, 1 << (lora.rank - 1).bit_length())
    k_tiles = -(-k // SHRINK_BLOCK_K)
    m_tiles = -(-m // SHRINK_BLOCK_M)
    # Programs up to half the SMs: every split's partial is summed in each GEMM tile's epilogue, whose
    # cost grows with the rows (at 256 tokens more splits made the fused LoRA slower, not faster).
    splits = max(1, min(MAX_XA_SPLITS, k_tiles, _sm_count(x.device) // (2 * m_tiles)))
    xa = torch.empty((splits, m, r_pad), dtype=torch.float32, device=x.device)
    a = lora.a.contiguous()
    _kernels().lora_shrink_kernel[(m_tiles, splits)](
        x, a, xa, m, k, x.stride(0), RANK=lora.rank, R_PAD=r_pad, BM=SHRINK_BLOCK_M, BK=SHRINK_BLOCK_K,
        SPLITS=splits, F32_DOT=not x.is_cuda,
    )  # fmt: skip
    return xa, splits


def triton_nvfp4_linear(
    x: torch.Tensor,
    weight: Nvfp4Weight,
    bias: torch.Tensor | None = None,
    lora: LoraWeights | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """:func:`nvfp4_linear` with the Triton kernels (``config`` None: the bucket of ``x``'s rows)."""
    check_operands(x, weight, bias, lora)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the NVFP4 GEMM takes BF16 activations, got {x.dtype}")
    if lora is not None and lora.a.dtype != torch.bfloat16:
        # The projection multiplies x by A on the tensor cores, both BF16 (as vLLM keeps its adapters).
        raise ValueError(f"the fused LoRA takes a BF16 A, got {lora.a.dtype}; cast the adapter to BF16")
    return launch_gemm(
        x, weight.kernel_halves(), weight.kernel_scales(), weight.kernel_out_scale(), weight.out_features,
        weight.in_features, bias, lora, config,
    )  # fmt: skip


def launch_gemm(
    x: torch.Tensor,
    halves: torch.Tensor,
    tiled_scales: torch.Tensor,
    out_scale: torch.Tensor,
    n: int,
    k: int,
    bias: torch.Tensor | None = None,
    lora: LoraWeights | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """The GEMM on a weight already in the kernel's layout (:func:`split_halves` of ``n`` x ``k``
    weights, ``tiled_scales`` :func:`scale_tiles`, ``out_scale`` :func:`output_scale`), operands unchecked:
    :func:`triton_nvfp4_linear` checks them first, vLLM's layers (``qerl_cli.rollout.vllm_nvfp4``)
    once at load. Nothing here syncs with the host, so vLLM captures it in CUDA graphs."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    config = config or config_for(m)
    kh = halves.shape[1]
    split = split_k_for(config, m, n, k, x.device)
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    # The workspace and counters only where K is split (the kernel reads neither otherwise): a prefill of
    # thousands of tokens has more tiles than any counter set kept.
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    locks = _locks(x.device, tiles) if split > 1 else y
    if lora is not None:
        xa, xa_splits = lora_shrink(x2, lora)
        lora_b, rank, r_pad, scaling = lora.b.contiguous(), lora.rank, xa.shape[-1], float(lora.scaling)
    else:
        xa, xa_splits, lora_b, rank, r_pad, scaling = y, 1, y, 1, 16, 0.0
    _kernels().nvfp4_gemm_kernel[(tiles, split)](
        x2, halves, tiled_scales.contiguous(), out_scale, bias if bias is not None else y, xa, lora_b, y, ws,
        locks,
        m, n, k, kh, x2.stride(0), y.stride(0), scaling,
        BM=config.block_m, BN=config.block_n, BJ=config.block_k // 2, SPLIT_K=split,
        HAS_BIAS=bias is not None, HAS_LORA=lora is not None, RANK=rank, R_PAD=r_pad, XA_SPLITS=xa_splits,
        EVEN=k == 2 * kh and kh % (config.block_k // 2) == 0 and n % config.block_n == 0,
        F32_DOT=not x.is_cuda, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y.reshape(*lead, n)


def nvfp4_linear(
    x: torch.Tensor,
    weight: Nvfp4Weight,
    bias: torch.Tensor | None = None,
    lora: LoraWeights | None = None,
) -> torch.Tensor:
    """``x @ dequant(W)^T (+ bias) (+ LoRA)``: the Triton kernel for BF16 on CUDA (or under the
    interpreter), else the torch reference in float32."""
    if x.dtype == torch.bfloat16 and use_triton_for(x):
        return triton_nvfp4_linear(x, weight, bias, lora)
    return nvfp4_linear_reference(x, weight, bias, lora)

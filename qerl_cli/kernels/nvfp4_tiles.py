"""Tile configs of qerl's NVFP4 GEMM (:mod:`qerl_cli.kernels.nvfp4_gemm`): one per bucket of rows, the
alternatives the bench's tuning pass times against it, and the K split rule's floor."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Rows of one group of the kernel's block scales (nvfp4_gemm.scale_tiles): a tile's rows are whole groups.
SCALE_ROWS = 64


@dataclass(frozen=True)
class TileConfig:
    """One launch shape of the GEMM kernel. ``split_k`` None: chosen per call (:func:`split_k_for`) to
    bring the programs to at most ``programs_per_sm`` per SM, about as many as fit on one at a time."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int | None = None
    programs_per_sm: int = 2

    def __post_init__(self) -> None:
        if self.block_n % SCALE_ROWS:
            raise ValueError(f"block_n {self.block_n} is not a multiple of the scale tiles' {SCALE_ROWS}")

    def label(self) -> str:
        split = "auto" if self.split_k is None else str(self.split_k)
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"
            f"split{split}p{self.programs_per_sm}"
        )


# (largest M of the bucket, config): the first bucket whose bound is >= M. The tokens are the MMA's narrow
# side (the kernel computes y^T, the dequantized weight being the register operand of Hopper's warpgroup MMA,
# 64 rows per 4 warps), so block_m covers every token up to 256: a weight tile is then dequantized once per
# call, not once per M tile. The 16-, 128- and 256-token buckets are the fastest of a tile and split sweep
# over the 7B's four linears (benchmarks/h200-2026-11-28-gemm-halves/; with the scales in 64-row tiles the
# 128-token one became block_k 64 at 4 stages, 7% faster than block_k 128: docs/rollout.md, qerl-triton; the
# 32- and 64-token ones lie between); each compiles to wgmma without spills in its K loop
# (tests/test_nvfp4_gemm.py). Few tokens take a block_k of 128 and more programs per SM: small stages leave
# room for several CTAs per SM, whose loads in flight hide HBM latency.
BUCKETS: tuple[tuple[int, TileConfig], ...] = (
    (16, TileConfig(16, 64, 128, num_warps=4, num_stages=4, programs_per_sm=4)),
    (32, TileConfig(32, 64, 128, num_warps=4, num_stages=4, programs_per_sm=4)),
    (64, TileConfig(64, 64, 128, num_warps=4, num_stages=4, programs_per_sm=3)),
    (128, TileConfig(128, 64, 64, num_warps=4, num_stages=4)),
    (2**62, TileConfig(256, 64, 64, num_warps=4, num_stages=3)),
)
# Alternatives per bucket (same bounds as BUCKETS) for the bench's tuning pass; each fits the 227 KiB
# of shared memory of an H100 / H200 CTA at its stages.
CANDIDATES: dict[int, tuple[TileConfig, ...]] = {
    16: (
        TileConfig(16, 128, 128, 4, 4),
        TileConfig(16, 128, 256, 4, 3),
        TileConfig(16, 64, 256, 4, 4),
        TileConfig(16, 64, 64, 4, 6),
    ),
    32: (TileConfig(32, 64, 256, 4, 3), TileConfig(32, 128, 128, 4, 4)),
    64: (TileConfig(64, 64, 256, 4, 3), TileConfig(64, 128, 128, 4, 3), TileConfig(64, 64, 64, 4, 5)),
    128: (
        TileConfig(128, 64, 128, 4, 3),
        TileConfig(128, 128, 128, 8, 3),
        TileConfig(128, 64, 128, 4, 4),
        TileConfig(128, 64, 64, 4, 6),
    ),
    2**62: (
        TileConfig(256, 128, 128, 8, 2),
        TileConfig(256, 128, 64, 8, 3),
        TileConfig(128, 128, 64, 8, 3),
        TileConfig(256, 64, 64, 4, 4),
    ),
}
# Split K until the programs fill the SMs: a CTA keeps only num_stages tiles in flight, so one per SM
# cannot cover HBM latency; a split costs a float32 workspace round trip (through L2). Rounded down, never
# up: a few programs past what fits at once make a second wave that costs about as much as the first.
MIN_K_TILES_PER_SPLIT = 4


def config_for(m: int) -> TileConfig:
    """The tile config of the bucket ``m`` rows fall in."""
    return next(config for bound, config in BUCKETS if m <= bound)


def candidates_for(m: int) -> tuple[TileConfig, ...]:
    """The bucket's config of ``m`` rows first, then its alternatives to time against it."""
    bound = next(bound for bound, _ in BUCKETS if m <= bound)
    return (config_for(m), *CANDIDATES[bound])


def with_split(config: TileConfig, split_k: int | None) -> TileConfig:
    """``config`` with a fixed (or automatic, None) K split: for sweeps and tests."""
    return replace(config, split_k=split_k)

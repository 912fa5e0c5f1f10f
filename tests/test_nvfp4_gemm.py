"""The NVFP4 GEMM (qerl_cli.kernels.nvfp4_gemm) against a float64 reference: the Triton kernel under the
CPU interpreter at every row bucket, odd shapes, bias, LoRA and split-K; on a GPU bit-exact dequantization,
the compiled kernel at real shapes, and vLLM's Marlin NVFP4 kernel on the same weights."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from qerl_cli import formats
from qerl_cli.kernels.nvfp4_gemm import (
    LoraWeights,
    Nvfp4Weight,
    check_operands,
    nvfp4_linear,
    nvfp4_linear_reference,
)
from qerl_cli.kernels.nvfp4_tiles import BUCKETS, config_for, with_split

# tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton when there is no GPU;
# the ``interpreter`` fixture then routes CPU tensors to the kernel (QERL_TRITON_CPU=1).
pytest.importorskip("triton")

ROW_BUCKETS = (1, 3, 8, 17, 64, 129, 256)


def make_case(n: int, k: int, m: int, rank: int = 5, device: str = "cpu", seed: int = 0):
    """NVFP4 weight of an ``[n, k]`` random matrix (a zero block, an outlier), x, bias and a LoRA."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn((n, k), generator=gen, device=device) * 0.05
    w[0, :16] = 0  # an all-zero block: its scale is compressed-tensors' 0.125
    w[1, 3] = 1.5
    weight = Nvfp4Weight.from_buffers(formats.get("nvfp4").quantize(w.to(torch.bfloat16)))
    x = torch.randn((m, k), generator=gen, device=device).to(torch.bfloat16)
    bias = (torch.randn((n,), generator=gen, device=device) * 0.1).to(torch.bfloat16)
    a = (torch.randn((rank, k), generator=gen, device=device) * 0.1).to(torch.bfloat16)
    b = (torch.randn((n, rank), generator=gen, device=device) * 0.1).to(torch.bfloat16)
    return weight, x, bias, LoraWeights(a, b, 1.5)


def float64_reference(x, weight, bias, lora):
    """The exact result of the kernel's inputs (E2M1 x E4M3 scale, times the output scale: no rounding
    per weight), and each term's magnitude."""
    w = weight.exact_products().double() * weight.kernel_out_scale().double()
    xd = x.double()
    y = xd @ w.T
    base_mag = xd.abs() @ w.abs().T
    lora_mag = torch.zeros_like(y)
    if bias is not None:
        y += bias.double()
        base_mag += bias.double().abs()
    if lora is not None:
        a, b = lora.a.double(), lora.b.double()
        y += lora.scaling * (xd @ a.T) @ b.T
        lora_mag = lora.scaling * (xd.abs() @ a.abs().T) @ b.abs().T
    return y, base_mag, lora_mag


def assert_within_bf16(got, x, weight, bias, lora, ulps: float) -> None:
    """``got`` within ``ulps`` BF16 units (2**-7 relative; one round-to-nearest is 0.5) of the float64
    result, plus float32 accumulation and (GPU) the epilogue's TF32 LoRA expansion."""
    ref, base_mag, lora_mag = float64_reference(x, weight, bias, lora)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    tol = ulps * 2**-7 * ref.abs() + 2**-18 * base_mag + 2**-10 * lora_mag
    err = (got.double() - ref).abs()
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), (
        f"max error {float(err.max()):.3g}; at flat index {worst}: got {float(got.flatten()[worst])}, "
        f"want {float(ref.flatten()[worst])}"
    )


# N = 40 and 72: not a multiple of any block_n; K = 48 and 160: multiples of 16, not of any block_k.
@pytest.mark.parametrize("m", ROW_BUCKETS)
@pytest.mark.parametrize("extras", ["plain", "bias+lora"])
def test_kernel_matches_float64_in_interpreter(interpreter, m, extras) -> None:
    from qerl_cli.kernels.nvfp4_gemm import triton_nvfp4_linear

    n, k = (40, 48) if m > 64 else (72, 160)
    weight, x, bias, lora = make_case(n, k, m, seed=m)
    if extras == "plain":
        bias, lora = None, None
    got = triton_nvfp4_linear(x, weight, bias, lora)
    assert_within_bf16(got, x, weight, bias, lora, ulps=0.5)


@pytest.mark.parametrize("split", [2, 3])
def test_split_k_matches_in_interpreter(interpreter, split) -> None:
    from qerl_cli.kernels.nvfp4_gemm import _LOCKS, triton_nvfp4_linear

    weight, x, bias, lora = make_case(72, 256, 17, rank=16)
    config = with_split(config_for(17), split)
    config = type(config)(16, 64, 32, split_k=split)  # 8 K tiles: every split gets some
    got = triton_nvfp4_linear(x, weight, bias, lora, config)
    assert_within_bf16(got, x, weight, bias, lora, ulps=0.5)
    assert int(_LOCKS[x.device][-1].count_nonzero()) == 0  # the reducing programs reset their counters
    assert torch.equal(triton_nvfp4_linear(x, weight, bias, lora, config), got)  # deterministic


@pytest.mark.parametrize("split", [1, 2])
def test_whole_tiles_take_the_unmasked_path_in_interpreter(interpreter, split) -> None:
    """N and K multiples of the tile (as every model's are): the kernel's mask-free variant."""
    from qerl_cli.kernels.nvfp4_gemm import triton_nvfp4_linear
    from qerl_cli.kernels.nvfp4_tiles import TileConfig

    weight, x, bias, lora = make_case(128, 256, 5, rank=16, seed=split)
    got = triton_nvfp4_linear(x, weight, bias, lora, TileConfig(16, 64, 64, split_k=split))
    assert_within_bf16(got, x, weight, bias, lora, ulps=0.5)


def test_kernel_dequantizes_exactly_in_interpreter(interpreter) -> None:
    """x = I gives the kernel's dequantized weight itself, bit for bit (as on a GPU below): the exact
    E2M1 x scale product times the output scale, rounded once; within one BF16 rounding of the format's
    own dequantization (which rounds scale / global scale to float32 first)."""
    from qerl_cli.kernels.nvfp4_gemm import triton_nvfp4_linear

    weight, _, _, _ = make_case(24, 64, 1)
    got = triton_nvfp4_linear(torch.eye(64, dtype=torch.bfloat16), weight).T
    assert torch.equal(got, weight.kernel_dequantize())
    assert_within_one_rounding(got, weight.dequantize(torch.bfloat16))


def assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Each value equal to ``want``'s or one BF16 step from it (2**-7 relative, the two roundings
    differing only where the exact value lies near a halfway point)."""
    diff = (got.double() - want.double()).abs()
    assert bool((diff <= 2**-7 * want.double().abs()).all())
    assert float((diff > 0).double().mean()) < 0.01  # rare: a double-rounding tie, not a systematic shift


def every_byte_weight(device: str = "cpu") -> Nvfp4Weight:
    """All 256 bytes (every pair of codes) under finite E4M3 scales from subnormal to 448 and an
    arbitrary global scale: ``[16, 64]``."""
    n, k = 16, 64  # 16 rows x 32 bytes = 512 bytes: every byte value twice
    packed = torch.arange(n * k // 2, dtype=torch.int32).remainder(256).to(torch.uint8).reshape(n, k // 2)
    scale_bits = torch.tensor(
        [1, 7, 8, 9, 56, 100, 126, 0x77, 0x3F, 0x40, 0x41, 0x70, 0x7E, 0x30, 0x38, 0x08]
    )
    scale = scale_bits.repeat(n * k // 16 // 16).to(torch.uint8).reshape(n, k // 16).view(torch.float8_e4m3fn)
    return Nvfp4Weight(packed.to(device), scale.to(device), torch.tensor([123.456], device=device))


def test_every_byte_and_scale_in_interpreter(interpreter) -> None:
    """Every code pair and a range of scales, subnormal E4M3 included: the kernel's exact dequantization,
    bit for bit."""
    from qerl_cli.kernels.nvfp4_gemm import triton_nvfp4_linear

    weight = every_byte_weight()
    got = triton_nvfp4_linear(torch.eye(64, dtype=torch.bfloat16), weight).T
    assert torch.equal(got, weight.kernel_dequantize())
    assert_within_one_rounding(got, weight.dequantize(torch.bfloat16))


def test_leading_dims_and_routing(monkeypatch) -> None:
    """``[..., K]`` input; CPU tensors take the torch reference unless the interpreter is asked for."""
    monkeypatch.delenv("QERL_TRITON_CPU", raising=False)
    weight, x, bias, lora = make_case(40, 48, 6)
    got = nvfp4_linear(x.reshape(2, 3, 48), weight, bias, lora)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), nvfp4_linear_reference(x, weight, bias, lora))
    assert_within_bf16(got.reshape(6, 40), x, weight, bias, lora, ulps=0.5)


def test_fused_lora_takes_a_bf16_adapter() -> None:
    from qerl_cli.kernels.nvfp4_gemm import triton_nvfp4_linear

    weight, x, bias, lora = make_case(40, 48, 2)
    with pytest.raises(ValueError, match="cast the adapter to BF16"):
        triton_nvfp4_linear(x, weight, bias, LoraWeights(lora.a.float(), lora.b, 1.0))
    with pytest.raises(ValueError, match="BF16 activations"):
        triton_nvfp4_linear(x.float(), weight)


def test_buckets_cover_every_row_count() -> None:
    bounds = [bound for bound, _ in BUCKETS]
    assert bounds == sorted(bounds) and bounds[-1] >= 2**31
    for m in (*ROW_BUCKETS, 4096):
        config = config_for(m)
        assert config.block_k % 16 == 0 and config.block_m >= 16 and config.block_n >= 16


@pytest.mark.parametrize("k", [32, 48, 160])
def test_split_halves_puts_each_k_half_in_one_nibble(k) -> None:
    """Byte j of the kernel's layout: K index j in its low nibble, KH + j in its high one, KH = K rounded
    up to 32, halved; the padding past K holds code 0."""
    from qerl_cli.kernels.nvfp4_gemm import split_halves

    codes = torch.randint(0, 16, (3, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # the checkpoint's order: 2j low, 2j + 1 high
    halves = split_halves(packed)
    kh = -(-k // 32) * 16
    assert halves.shape == (3, kh) and halves.dtype == torch.uint8
    padded = torch.zeros((3, 2 * kh), dtype=torch.uint8)
    padded[:, :k] = codes
    assert torch.equal(halves & 0x0F, padded[:, :kh]) and torch.equal(halves >> 4, padded[:, kh:])


@pytest.mark.parametrize(("n", "k"), [(70, 80), (64, 64), (128, 96)])
def test_scale_tiles_put_each_k_steps_scales_of_64_rows_together(n, k) -> None:
    """scale_tiles[g, j, r, h]: row 64g + r's BF16 scale of K block j (h = 0, the low nibbles) and of
    KH/16 + j (h = 1, the high ones); zero past N and past K/16 (a K step of a 64-row tile is then one
    contiguous run of the tensor)."""
    from qerl_cli.kernels.nvfp4_gemm import block_scales, scale_tiles, scale_tiles_shape

    codes = torch.randint(1, 120, (n, k // 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    scale = codes.view(torch.float8_e4m3fn)
    tiles, values = scale_tiles(scale), block_scales(scale)
    half = -(-k // 32)
    assert tiles.shape == scale_tiles_shape(n, k) == (-(-n // 64), half, 64, 2)
    assert tiles.dtype == torch.bfloat16 and tiles.is_contiguous()
    for g, j, r, h in torch.cartesian_prod(*(torch.arange(d) for d in tiles.shape)).tolist():
        row, column = 64 * g + r, j + h * half
        want = values[row, column] if row < n and column < k // 16 else torch.tensor(0, dtype=torch.bfloat16)
        assert tiles[g, j, r, h] == want, (g, j, r, h)


def test_tile_configs_take_whole_scale_tiles() -> None:
    """A tile of rows the scale tiles do not fill whole is refused where it is made (the shipped buckets
    and candidates are made at import, so they pass this check by existing)."""
    from qerl_cli.kernels.nvfp4_tiles import TileConfig

    with pytest.raises(ValueError, match="not a multiple of the scale tiles' 64"):
        TileConfig(16, 32, 128)


def test_split_k_fills_the_sms_without_a_second_wave(monkeypatch) -> None:
    """On 132 SMs, the 7B's linears at every bucket: at most programs_per_sm programs per SM, and as
    many splits as that allows (o at 128 tokens: 56 tiles x 4, not x 5, which spills into a second
    wave)."""
    from qerl_cli.bench.gemm import model_linears
    from qerl_cli.kernels import nvfp4_gemm
    from qerl_cli.kernels.nvfp4_gemm import split_k_for
    from qerl_cli.kernels.nvfp4_tiles import MIN_K_TILES_PER_SPLIT

    monkeypatch.setattr(nvfp4_gemm, "_sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    for m in (8, 16, 32, 64, 128, 256):
        config = config_for(m)
        for n, k in model_linears("qwen2.5-7b").values():
            split = split_k_for(config, m, n, k, cpu)
            tiles = -(-m // config.block_m) * -(-n // config.block_n)
            slots = config.programs_per_sm * 132
            assert split == 1 or tiles * split <= slots
            more = split + 1
            assert tiles * more > slots or -(-k // config.block_k) // MIN_K_TILES_PER_SPLIT < more
    assert split_k_for(config_for(128), 128, 3584, 3584, cpu) == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda w, x, b, lora: (w, x[:, :32], b, lora), "input features"),
        (lambda w, x, b, lora: (w, x, b[:3], lora), "bias must be"),
        (lambda w, x, b, lora: (w, x, b, LoraWeights(lora.a, lora.b[:4], 1.0)), "LoRA A must be"),
        (
            lambda w, x, b, lora: (Nvfp4Weight(w.packed, w.scale.float(), w.global_scale), x, b, lora),
            "float8_e4m3fn",
        ),
        (
            lambda w, x, b, lora: (Nvfp4Weight(w.packed, w.scale[:, :2], w.global_scale), x, b, lora),
            "weight_scale",
        ),
        (  # the kernel's BF16 scales made from another weight, or left in float32
            lambda w, x, b, lora: (replace(w, tiled_scales=w.kernel_scales()[:, :1]), x, b, lora),
            "tiled_scales must be scale_tiles",
        ),
        (
            lambda w, x, b, lora: (replace(w, tiled_scales=w.kernel_scales().float()), x, b, lora),
            r"tiled_scales must be .* got torch\.float32",
        ),
    ],
)
def test_bad_operands_name_what_is_wrong(change, message) -> None:
    weight, x, bias, lora = change(*make_case(40, 48, 2))
    with pytest.raises(ValueError, match=message):
        check_operands(x, weight, bias, lora)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_dequantization_bit_exact_on_gpu() -> None:
    from qerl_cli.kernels.nvfp4_gemm import triton_nvfp4_linear

    weight, _, _, _ = make_case(192, 256, 1, device="cuda")
    got = triton_nvfp4_linear(torch.eye(256, dtype=torch.bfloat16, device="cuda"), weight).T
    assert torch.equal(got, weight.kernel_dequantize())
    weight = every_byte_weight("cuda")
    got = triton_nvfp4_linear(torch.eye(64, dtype=torch.bfloat16, device="cuda"), weight).T
    assert torch.equal(got, weight.kernel_dequantize())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", (*ROW_BUCKETS, 512))
@pytest.mark.parametrize(("n", "k"), [(4608, 3584), (3584, 18944), (1000, 1040)])
def test_kernel_matches_float64_on_gpu(m, n, k) -> None:
    from qerl_cli.kernels.nvfp4_gemm import triton_nvfp4_linear

    weight, x, bias, lora = make_case(n, k, m, rank=16, device="cuda", seed=m)
    for b, adapter in ((None, None), (bias, lora)):
        assert_within_bf16(triton_nvfp4_linear(x, weight, b, adapter), x, weight, b, adapter, ulps=0.5)
    for split in (1, 3):
        config = with_split(config_for(m), split)
        assert_within_bf16(triton_nvfp4_linear(x, weight, bias, lora, config), x, weight, bias, lora, 0.5)


@pytest.mark.gpu
@pytest.mark.vllm
@gpu
@pytest.mark.parametrize("m", [8, 128])
def test_kernel_agrees_with_marlin(m) -> None:
    """vLLM's Marlin NVFP4 on the same checkpoint buffers: both near the float64 result, and each other."""
    from qerl_cli.bench.gemm import marlin_linear
    from qerl_cli.kernels.nvfp4_gemm import triton_nvfp4_linear

    weight, x, _, _ = make_case(4608, 3584, m, device="cuda")
    ref, _, _ = float64_reference(x, weight, None, None)
    ours = triton_nvfp4_linear(x, weight).double()
    marlin = marlin_linear(weight.packed, weight.scale, weight.global_scale)(x).double()
    scale = ref.abs().max()
    assert float((ours - ref).abs().max() / scale) < 2**-8
    assert float((marlin - ref).abs().max() / scale) < 2**-6  # Marlin's own BF16 scale arithmetic
    assert float((ours - marlin).abs().max() / scale) < 2**-6


# Run in a child process: this one may have Triton in interpreter mode (tests/conftest.py), where the
# kernels are not compilable JIT functions. Prints the sm_90 PTX of the GEMM kernel for each config given
# (a JSON list of [bm, bn, bk, warps, stages, split, lora]) as a JSON list. One child compiles them all:
# its imports (torch, Triton) take longer than the compiles.
COMPILE_FOR_HOPPER = """
import json
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl_cli.kernels import _triton_nvfp4_gemm as kernels

def compile_ptx(bm, bn, bk, warps, stages, split, lora):
    signature = dict.fromkeys(("x_ptr", "bias_ptr", "lora_b_ptr", "y_ptr"), "*bf16")
    signature |= {"packed_ptr": "*u8", "tiles_ptr": "*bf16", "out_scale_ptr": "*fp32",
                  "xa_ptr": "*fp32", "ws_ptr": "*fp32", "lock_ptr": "*i32", "lora_scaling": "fp32"}
    signature |= dict.fromkeys(("M", "N", "K", "KH", "stride_xm", "stride_ym"), "i32")
    constants = dict(BM=bm, BN=bn, BJ=bk // 2, SPLIT_K=split, HAS_BIAS=bool(lora), HAS_LORA=bool(lora),
                     RANK=16, R_PAD=16, XA_SPLITS=4 if lora else 1, EVEN=True,
                     F32_DOT=False)  # EVEN: the models' shapes
    signature |= dict.fromkeys(constants, "constexpr")
    order = list(kernels.nvfp4_gemm_kernel.arg_names)
    # Pointers and sizes 16-aligned, as the launcher specializes them for real shapes.
    aligned = [n for n in order if n.endswith("_ptr") or n in ("N", "K", "KH", "stride_xm", "stride_ym")]
    source = ASTSource(kernels.nvfp4_gemm_kernel, {n: signature[n] for n in order},
                       constexprs={(order.index(n),): v for n, v in constants.items()},
                       attrs={(order.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    return compiled.asm["ptx"], compiled.asm["ttgir"]


sys.stdout.write(json.dumps([compile_ptx(*config) for config in json.loads(sys.argv[1])]))
"""


HOPPER_VARIANTS = ((1, 0), (2, 1))  # (split K, LoRA and bias): plain, and with LoRA and split K


def _hopper_args(config, split: int, lora: int) -> tuple[int, ...]:
    return (config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages, split, lora)


@pytest.fixture(scope="module")
def hopper_ptx() -> dict[tuple[int, ...], tuple[str, str]]:
    """The sm_90 PTX of every bucket's config in both variants, compiled by one child process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    configs = [_hopper_args(config, *variant) for _, config in BUCKETS for variant in HOPPER_VARIANTS]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER, json.dumps(configs)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:  # every bucket's test fails on it: say which config and why, once
        pytest.fail(f"compiling the configs {configs} for sm_90 failed:\n{done.stderr[-4000:]}")
    return dict(zip(configs, json.loads(done.stdout), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("bucket", [bound for bound, _ in BUCKETS])
def test_bucket_configs_compile_to_hopper_mma(bucket, tmp_path, hopper_ptx) -> None:
    """Every bucket's config, plain and with LoRA and split K, compiles for sm_90 to warpgroup MMAs
    (the dequantized weight as their register operand) fed by asynchronous copies: what makes it a
    Hopper kernel rather than an mma.sync one. Needs no GPU, only Triton's compiler."""
    import os
    import re
    import subprocess
    from pathlib import Path

    import triton

    config = dict(BUCKETS)[bucket]
    for split, lora in HOPPER_VARIANTS:
        ptx, ttgir = hopper_ptx[_hopper_args(config, split, lora)]
        # Every load of the K loop pipelined (an asynchronous copy issued stages ahead): a plain load left
        # in the loop is waited on at every step (the block scales were, read as [N, K/16] rows: the
        # kernel's top stall on an H200, 1.1-1.2x of its time).
        loop = ttgir[ttgir.index("scf.for") : ttgir.index("scf.yield")]
        assert "tt.load" not in loop, "a load of the K loop is not pipelined"
        mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx)
        assert mmas, "no BF16 wgmma with a register A operand"
        assert "fma.rn.bf16x2" in ptx, "the decode's packed BF16 multiply is missing"
        assert "cp.async" in ptx, "the K loop's loads are not pipelined"
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
        if ptxas.exists():  # Triton's own ptxas for this PTX version: registers and spills
            ptx_file = tmp_path / "k.ptx"
            ptx_file.write_text(ptx)
            command = [str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx_file), "-o", os.devnull]
            info = subprocess.run(command, capture_output=True, text=True, check=True).stderr
            # A 256-token tile's float32 accumulator takes half the registers: its split-K reduction
            # (once per tile, after the K loop) may spill a few hundred bytes, the K loop itself not.
            if split == 1 or config.block_m < 256:
                assert " 0 bytes spill stores" in info, info

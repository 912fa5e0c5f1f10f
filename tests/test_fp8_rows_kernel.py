"""The fused FP8 row-rounding kernel against qerl_cli.formats.fp8.quantize_per_channel, bit for bit:
CPU interpreter here, the GPU's own FP8 convert in the gpu test."""

from __future__ import annotations

import pytest
import torch

from qerl_cli.formats.fp8 import FP8_MAX, quantize_per_channel

# tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton when there is no GPU;
# the ``interpreter`` fixture then routes CPU tensors to the kernel (QERL_TRITON_CPU=1).
pytest.importorskip("triton")


def sample_rows(k: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """Rows of magnitudes 2^-10 .. 2^8, one all-zero row, one with a single nonzero element."""
    gen = torch.Generator().manual_seed(0)
    mags = 2.0 ** torch.arange(-10, 9, 2, dtype=torch.float32)  # 10 rows
    x = torch.randn(len(mags) + 2, k, generator=gen)
    x[: len(mags)] *= mags[:, None]
    x[len(mags)] = 0
    x[len(mags) + 1] = 0
    x[len(mags) + 1, k // 2] = -3.0e-3
    return x.to(device=device, dtype=dtype)


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    codes, scale = got
    want_codes, want_scale = want
    assert codes.dtype == torch.float8_e4m3fn and codes.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == want_scale.shape and scale.is_contiguous()
    assert torch.equal(scale, want_scale)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


# K = 700: not a multiple of the block (a masked tail); 2500: several blocks and a tail.
@pytest.mark.parametrize("k", [1, 700, 2500])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_kernel_matches_quantize_per_channel(interpreter, dtype, k) -> None:
    from qerl_cli.kernels import triton_quantize_rows, use_triton_for

    x = sample_rows(k, dtype)
    assert use_triton_for(x)
    assert_same(triton_quantize_rows(x), quantize_per_channel(x))
    assert_same(triton_quantize_rows(x[3:4]), quantize_per_channel(x[3:4]))  # M = 1


def test_kernel_takes_a_row_strided_view(interpreter) -> None:
    from qerl_cli.kernels import triton_quantize_rows

    x = sample_rows(300, torch.bfloat16)[:, 20:250]  # rows 300 apart, 230 wide
    assert_same(triton_quantize_rows(x), quantize_per_channel(x))


def rounding_cases() -> torch.Tensor:
    """float32 values in [-448, 448] covering every bf16 value there, every E4M3 value, the midpoints
    between neighbouring E4M3 values (ties, normal and subnormal) and their float32 neighbours."""
    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16 = bf16[bf16.isfinite() & (bf16.abs() <= FP8_MAX)]
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[e4m3.isfinite()].unique()  # sorted
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # exact in float32
    near = torch.cat([mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1)])
    gen = torch.Generator().manual_seed(2)
    rand = (torch.rand(20000, generator=gen) * 2 - 1) * 2.0 ** torch.randint(-14, 9, (20000,), generator=gen)
    values = torch.cat([bf16, e4m3, near, rand, torch.tensor([-0.0, 2.0**-10, -(2.0**-10), 2.0**-130])])
    return values.clamp(-FP8_MAX, FP8_MAX)


def test_rounding_is_round_to_nearest_even_everywhere(interpreter) -> None:
    """A leading 448 makes each row's scale exactly 1, so the codes are the bare E4M3 rounding."""
    from qerl_cli.kernels import triton_quantize_rows

    values = rounding_cases()
    k = 1023
    pad = (-values.numel()) % k
    rows = torch.cat([values, torch.zeros(pad)]).reshape(-1, k)
    x = torch.cat([torch.full((rows.shape[0], 1), FP8_MAX), rows], dim=1)
    codes, scale = triton_quantize_rows(x)
    assert bool((scale == 1).all())
    assert_same((codes, scale), quantize_per_channel(x))


def test_dispatcher_uses_torch_on_cpu(monkeypatch) -> None:
    import qerl_cli.kernels.fp8_rows as fp8_rows

    monkeypatch.delenv("QERL_TRITON_CPU", raising=False)

    def fail(*args, **kwargs):
        raise AssertionError("the Triton path ran on a CPU tensor")

    monkeypatch.setattr(fp8_rows, "triton_quantize_rows", fail)
    x = sample_rows(64, torch.bfloat16)
    assert_same(fp8_rows.quantize_rows_fp8(x), quantize_per_channel(x))
    assert not fp8_rows.hardware_cast(x.device)


def test_dispatcher_routes_to_the_kernel_under_the_interpreter(interpreter, monkeypatch) -> None:
    import qerl_cli.kernels.fp8_rows as fp8_rows

    calls = []
    kernel = fp8_rows.triton_quantize_rows
    monkeypatch.setattr(fp8_rows, "triton_quantize_rows", lambda x: calls.append(x) or kernel(x))
    x = sample_rows(64, torch.bfloat16)
    assert_same(fp8_rows.quantize_rows_fp8(x), quantize_per_channel(x))
    assert len(calls) == 1


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_kernel_bit_exact_on_gpu(dtype) -> None:
    """Both roundings (the GPU's FP8 convert where it has one, and the integer one) against the CPU
    reference. Not against torch on the GPU: its division by a scalar is a multiplication by the
    reciprocal there, one ulp off the correctly rounded quotient for some rows (seen on an H100: 6-9
    scales of 12 differed, and the codes of those rows with them), while the CPU divides exactly, as the
    kernel does."""
    from qerl_cli.kernels import quantize_rows_fp8, triton_quantize_rows
    from qerl_cli.kernels.fp8_rows import hardware_cast

    def on_cpu(rounded: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return rounded[0].cpu(), rounded[1].cpu()

    for k in (1, 700, 3584, 18944):
        x = sample_rows(k, dtype, device="cuda")
        want = quantize_per_channel(x.cpu())
        assert_same(on_cpu(quantize_rows_fp8(x)), want)
        assert_same(on_cpu(triton_quantize_rows(x, hw_cast=False)), want)
        if hardware_cast(x.device):
            assert_same(on_cpu(triton_quantize_rows(x, hw_cast=True)), want)
    values = rounding_cases()
    x = torch.cat([torch.tensor([FP8_MAX]), values]).reshape(1, -1)
    assert_same(on_cpu(quantize_rows_fp8(x.cuda())), quantize_per_channel(x))
    assert_same(on_cpu(triton_quantize_rows(x.cuda(), hw_cast=False)), quantize_per_channel(x))

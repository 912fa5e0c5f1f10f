"""Triton dequant kernels against the torch reference: CPU interpreter here, bit-exact bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch

from qerl_cli import formats
from qerl_cli.formats.nf4 import NF4Format

# tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton when there is no GPU;
# the ``interpreter`` fixture then routes CPU tensors to the kernels (QERL_TRITON_CPU=1).
pytest.importorskip("triton")

FORMATS = [
    formats.get("nvfp4"),
    formats.get("mxfp4"),
    NF4Format(double_quant=True),
    NF4Format(double_quant=False),
]
# 40 x 192 = 3840 bytes packed: not a multiple of the kernel's 1024-byte tile, so the masked tail runs.
SHAPES = [(40, 192), (64, 512)]


def sample_weight(shape, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen) * 0.05
    w[0, :64] = 0  # zero blocks: scale 0.125 (NVFP4) and exponent 0 (MXFP4, a float32 subnormal)
    w[1, 3] = 4.0
    return w.to(device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_kernel_matches_torch_in_interpreter(interpreter, fmt, shape) -> None:
    from qerl_cli.kernels import triton_dequantize, use_triton_for

    buffers = fmt.to_buffers(fmt.quantize(sample_weight(shape)))
    assert use_triton_for(buffers["weight_packed"])
    # float32 output is exact: same decode, correctly rounded NVFP4 scale division, no FMA in NF4.
    ref32 = fmt.dequantize_buffers(buffers, *shape, torch.float32)
    assert torch.equal(triton_dequantize(fmt, buffers, *shape, torch.float32), ref32)
    # bf16: the interpreter's float32 -> bf16 cast truncates, so allow one bf16 ulp here (exact on GPU).
    got16 = triton_dequantize(fmt, buffers, *shape, torch.bfloat16).float()
    ref16 = fmt.dequantize_buffers(buffers, *shape, torch.bfloat16).float()
    ulp = ref16.abs().clamp(min=1e-30) * 2**-7
    assert bool(((got16 - ref16).abs() <= ulp).all())


def test_cpu_tensors_take_the_torch_path_unless_asked(monkeypatch) -> None:
    from qerl_cli.kernels import use_triton_for

    cpu = torch.zeros(2, dtype=torch.uint8)
    monkeypatch.delenv("QERL_TRITON_CPU", raising=False)
    assert not use_triton_for(cpu)  # even with TRITON_INTERPRET=1 set by conftest
    monkeypatch.setenv("QERL_TRITON_CPU", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_triton_for(cpu)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_kernel_bit_exact_on_gpu(fmt) -> None:
    from qerl_cli.kernels import triton_dequantize

    shape = (1000, 2048)
    buffers = fmt.to_buffers(fmt.quantize(sample_weight(shape, "cuda")))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ref = fmt.dequantize_buffers(buffers, *shape, dtype)
        assert torch.equal(triton_dequantize(fmt, buffers, *shape, dtype), ref), dtype


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", formats.names())
def test_quant_linear_on_gpu_matches_cpu(name) -> None:
    from torch import nn

    from qerl_cli.modeling.quant_linear import QuantLinear

    torch.manual_seed(0)
    layer = QuantLinear.from_linear(nn.Linear(256, 192, bias=True).to(torch.bfloat16), name)
    x = torch.randn(4, 7, 256, dtype=torch.bfloat16)
    cpu_out = layer(x)
    gpu_layer = layer.to("cuda")
    xg = x.cuda().requires_grad_(True)
    out = gpu_layer(xg)
    torch.testing.assert_close(out.cpu().float(), cpu_out.float(), rtol=2e-2, atol=2e-2)
    out.float().square().sum().backward()
    weight = gpu_layer.dequantized_weight(torch.bfloat16)
    expected = (2 * out.float()).to(torch.bfloat16) @ weight
    torch.testing.assert_close(xg.grad.float(), expected.float(), rtol=2e-2, atol=2e-2)

"""``rollout.linear_backend: qerl-triton`` (qerl_cli.rollout.vllm_nvfp4): qerl's Triton NVFP4 GEMM on a
stand-in of vLLM's NVFP4 layer (its inverted global scale, the kernel's layout, bit for bit against
qerl's own call and within BF16 of float64), the custom op's fake twin and its whole-graph compile, and the
registration with a stand-in of vLLM's kernel registry (the checks before vLLM starts:
``tests/test_vllm_nvfp4_checks.py``). No GPU or vLLM: the kernel runs under the Triton interpreter."""

from __future__ import annotations

import abc
import enum
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_nvfp4_gemm import assert_within_bf16, make_case

from qerl_cli.errors import QerlError
from qerl_cli.kernels.nvfp4_gemm import SCALE_BIAS, WEIGHT_EXPONENT, Nvfp4Weight, scale_tiles, split_halves
from qerl_cli.rollout import vllm_nvfp4

pytest.importorskip("triton")


def vllm_layer(weight: Nvfp4Weight) -> torch.nn.Module:
    """One NVFP4 linear as vLLM 0.26's compressed-tensors W4A16 scheme leaves it after its own loading:
    ``weight`` the packed codes, ``weight_scale`` the E4M3 block scales, ``weight_global_scale`` the
    multiplier (the inverse of the checkpoint's divisor, a 0-dim float32), and the partition sizes."""
    keep = torch.nn.Parameter
    layer = torch.nn.Module()
    layer.weight = keep(weight.packed.clone(), requires_grad=False)
    layer.weight_scale = keep(weight.scale.clone(), requires_grad=False)
    layer.weight_global_scale = keep(1.0 / weight.global_scale.max(), requires_grad=False)
    layer.input_size_per_partition = weight.in_features
    layer.output_size_per_partition = weight.out_features
    return layer


# --------------------------------------------------------------------------------------------
# The layer: prepared once, then each call through the custom op
# --------------------------------------------------------------------------------------------
# N = 72 and 40: not a multiple of any block_n; K = 160 and 48: multiples of 16, not of any block_k
# (48: not of 32 either, so the kernel's layout is padded).
@pytest.mark.parametrize("m", [1, 5, 17, 129])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepared_layer_matches_qerls_kernel_bit_for_bit_in_interpreter(
    interpreter: None, m: int, with_bias: bool
) -> None:
    """prepare_layer + apply_layer on vLLM's layer (global scale inverted) equal qerl's own call on the
    checkpoint's buffers bit for bit, and lie within BF16 rounding of the float64 result."""
    from qerl_cli.kernels.nvfp4_gemm import triton_nvfp4_linear

    n, k = (40, 48) if m > 64 else (72, 160)
    weight, x, bias, _ = make_case(n, k, m, seed=m)
    bias = bias if with_bias else None
    layer = vllm_layer(weight)
    vllm_nvfp4.prepare_layer(layer)
    got = vllm_nvfp4.apply_layer(layer, x, bias)
    want = triton_nvfp4_linear(x, Nvfp4Weight.from_buffers(weight.buffers()), bias)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert_within_bf16(got, x, weight, bias, None, ulps=0.5)


def test_prepared_layer_takes_leading_dims_in_interpreter(interpreter: None) -> None:
    """``[..., K]`` activations (vLLM passes 2-D, torch.compile may pass more) give ``[..., N]``, the
    same values as the flattened call."""
    weight, x, bias, _ = make_case(40, 48, 6, seed=3)
    layer = vllm_layer(weight)
    vllm_nvfp4.prepare_layer(layer)
    got = vllm_nvfp4.apply_layer(layer, x.reshape(2, 3, 48), bias)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), vllm_nvfp4.apply_layer(layer, x, bias))


def test_prepare_layer_relays_the_weight_and_adds_the_accumulator_scale() -> None:
    """The weight becomes the kernel's layout (the same bytes where K is a multiple of 32), the block
    scales their exact BF16 values, vLLM's multiplier stays, and ``qerl_accumulator_scale`` is float32
    ``[1]`` = 2**8 x the multiplier; all Parameters without grad (vLLM's sleep mode offloads them with the
    weights)."""
    weight, _, _, _ = make_case(72, 160, 1)
    layer = vllm_layer(weight)
    multiplier = layer.weight_global_scale.data.clone()
    vllm_nvfp4.prepare_layer(layer)
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == weight.packed.numel()
    assert torch.equal(layer.weight.data, split_halves(weight.packed))
    assert not torch.equal(layer.weight.data, weight.packed)  # re-laid-out, not kept
    # the block scales as the kernel reads them: BF16 values, each E4M3 code's exactly (x 2**118)
    assert layer.weight_scale.dtype == torch.bfloat16
    assert torch.equal(layer.weight_scale.data, scale_tiles(weight.scale))
    want = weight.scale.double() * 2.0**SCALE_BIAS
    tiles = layer.weight_scale.data  # [N/64, KH/16, 64, 2] back to rows of K blocks, the padding cut
    rows = tiles.permute(0, 2, 3, 1).reshape(-1, 2 * tiles.shape[1])[
        : weight.scale.shape[0], : weight.scale.shape[1]
    ]
    assert torch.equal(rows.double(), want)
    assert torch.equal(layer.weight_global_scale.data, multiplier)
    out_scale = layer.qerl_accumulator_scale
    assert out_scale.dtype == torch.float32 and out_scale.shape == (1,)
    assert float(out_scale) == 2.0**WEIGHT_EXPONENT * float(multiplier)
    assert float(out_scale) == pytest.approx(2.0**WEIGHT_EXPONENT / float(weight.global_scale))
    for name in ("weight", "weight_scale", "qerl_accumulator_scale"):
        param = getattr(layer, name)
        assert isinstance(param, torch.nn.Parameter) and not param.requires_grad, name


def test_prepare_layer_pads_the_kernel_layout_where_k_is_not_a_multiple_of_32() -> None:
    weight, _, _, _ = make_case(40, 48, 1)
    layer = vllm_layer(weight)
    vllm_nvfp4.prepare_layer(layer)
    assert layer.weight.shape == (40, 32)  # K 48 rounded up to 64, halved
    assert torch.equal(layer.weight.data, split_halves(weight.packed))


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("weight", lambda w: w.packed.view(torch.int8), r"uint8 \[72, 80\].*got torch\.int8 \(72, 80\)"),
        ("weight", lambda w: w.packed[:, :40], r"uint8 \[72, 80\].*got torch\.uint8 \(72, 40\)"),
        ("weight", lambda w: w.packed[:71], r"uint8 \[72, 80\].*\(71, 80\)"),
        ("weight_scale", lambda w: w.scale.float(), r"E4M3 block scales \[72, 10\]; got torch\.float32"),
        ("weight_scale", lambda w: w.scale[:, :5], r"E4M3 block scales \[72, 10\]; got .* \(72, 5\)"),
    ],
)
def test_prepare_layer_refuses_operands_vllm_did_not_lay_out_as_expected(
    name: str, value: Any, expected: str
) -> None:
    """A weight or scales of another dtype or shape: ValueError naming what was expected and got."""
    weight, _, _, _ = make_case(72, 160, 1)
    layer = vllm_layer(weight)
    setattr(layer, name, torch.nn.Parameter(value(weight), requires_grad=False))
    with pytest.raises(ValueError, match=expected):
        vllm_nvfp4.prepare_layer(layer)
    assert not hasattr(layer, "qerl_accumulator_scale")


# --------------------------------------------------------------------------------------------
# The custom op
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lead", [(7,), (2, 3)])
def test_custom_op_fake_gives_the_output_shape(lead: tuple[int, ...]) -> None:
    """Under FakeTensorMode (how torch.compile traces vLLM's model) the op runs its fake twin: BF16
    ``[*x.shape[:-1], N]``, no kernel launched."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    weight, _, _, _ = make_case(72, 160, 1)
    layer = vllm_layer(weight)
    vllm_nvfp4.prepare_layer(layer)
    op = vllm_nvfp4.nvfp4_w4a16_gemm
    x = torch.zeros((*lead, 160), dtype=torch.bfloat16)
    real = (layer.weight.data, layer.weight_scale.data, layer.qerl_accumulator_scale.data)
    mode = FakeTensorMode()
    fake_x, halves, scale, out_scale = (mode.from_tensor(t) for t in (x, *real))
    with mode:
        y = op(fake_x, halves, scale, out_scale, 160, None)
    assert isinstance(y, FakeTensor)
    assert tuple(y.shape) == (*lead, 72) and y.dtype == torch.bfloat16


def test_the_op_compiles_whole_graph_as_vllm_compiles_it_in_interpreter(interpreter) -> None:
    """torch.compile with fullgraph and dynamic token counts (vLLM's compilation of the model) calls the
    op as one opaque node and gets the eager result. (First served on an H200, the op was defined lazily
    inside the traced forward: Dynamo traced into torch.library's schema inference and refused.)"""
    weight, x, bias, _ = make_case(72, 160, 5)
    layer = vllm_layer(weight)
    vllm_nvfp4.prepare_layer(layer)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda t: vllm_nvfp4.apply_layer(layer, t, bias), backend="eager", fullgraph=True, dynamic=True
    )
    assert torch.equal(compiled(x), vllm_nvfp4.apply_layer(layer, x, bias))
    assert torch.equal(compiled(x[:3]), vllm_nvfp4.apply_layer(layer, x[:3], bias))


def test_custom_op_refuses_activations_other_than_bf16() -> None:
    weight, x, _, _ = make_case(72, 160, 3)
    layer = vllm_layer(weight)
    vllm_nvfp4.prepare_layer(layer)
    with pytest.raises(ValueError, match="BF16 activations, got torch.float16"):
        vllm_nvfp4.apply_layer(layer, x.half())


# --------------------------------------------------------------------------------------------
# The registration with vLLM's kernel registry
# --------------------------------------------------------------------------------------------
class FakeVllm:
    """What register() reads of vLLM 0.26: the linear kernel registry, its backend-name map and the
    abstract NVFP4 kernel base, and the platform enum; records each registration."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, backend_map: dict[str, set[type]]) -> None:
        self.registered: list[tuple[type, Any, str]] = []

        class NvFp4LinearKernel(abc.ABC):
            def __init__(self, config: Any) -> None:
                self.config = config

            @classmethod
            @abc.abstractmethod
            def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]: ...

            @classmethod
            @abc.abstractmethod
            def can_implement(cls, config: Any) -> tuple[bool, str | None]: ...

            @abc.abstractmethod
            def process_weights_after_loading(self, layer: torch.nn.Module) -> None: ...

            @abc.abstractmethod
            def apply_weights(
                self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor: ...

        class PlatformEnum(enum.Enum):
            CUDA = enum.auto()
            ROCM = enum.auto()

        self.base, self.platforms = NvFp4LinearKernel, PlatformEnum
        self.backend_map = backend_map
        names = ("vllm", "vllm.model_executor", "vllm.model_executor.kernels",
                 "vllm.model_executor.kernels.linear", "vllm.model_executor.kernels.linear.nvfp4",
                 "vllm.model_executor.kernels.linear.nvfp4.base", "vllm.platforms")  # fmt: skip
        modules = {name: types.ModuleType(name) for name in names}
        for name, module in modules.items():
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(modules[parent], child, module)
            monkeypatch.setitem(sys.modules, name, module)
        linear = modules["vllm.model_executor.kernels.linear"]
        linear.register_linear_kernel = self.register_linear_kernel
        linear._LINEAR_BACKEND_KERNEL_MAP = backend_map
        modules["vllm.model_executor.kernels.linear.nvfp4.base"].NvFp4LinearKernel = NvFp4LinearKernel
        modules["vllm.platforms"].PlatformEnum = PlatformEnum

    def register_linear_kernel(self, cls: type, platform: Any, kind: str) -> None:
        self.registered.append((cls, platform, kind))


@pytest.fixture
def fresh_register() -> Iterator[None]:
    """register() is cached once per process: cleared around the test, so the stand-in is the one read."""
    vllm_nvfp4.register.cache_clear()
    yield
    vllm_nvfp4.register.cache_clear()


def test_register_adds_qerls_kernel_under_vllms_triton_backend(
    monkeypatch: pytest.MonkeyPatch, fresh_register: None
) -> None:
    fake = FakeVllm(monkeypatch, {"triton": set(), "marlin": set()})
    kernel = vllm_nvfp4.register()
    assert issubclass(kernel, fake.base)
    assert fake.registered == [(kernel, fake.platforms.CUDA, "nvfp4")]
    assert fake.backend_map == {"triton": {kernel}, "marlin": set()}
    assert kernel.can_implement(object()) == (True, None)
    instance = kernel("config")  # every abstract method implemented
    assert instance.config == "config"
    assert vllm_nvfp4.register() is kernel and len(fake.registered) == 1  # once per process


def test_registered_kernel_prepares_and_applies_a_layer_in_interpreter(
    monkeypatch: pytest.MonkeyPatch, fresh_register: None, interpreter: None
) -> None:
    """The registered kernel's vLLM hooks are prepare_layer and apply_layer."""
    FakeVllm(monkeypatch, {"triton": set()})
    kernel = vllm_nvfp4.register()("config")
    weight, x, bias, _ = make_case(72, 160, 5, seed=1)
    layer = vllm_layer(weight)
    kernel.process_weights_after_loading(layer)
    assert hasattr(layer, "qerl_accumulator_scale")
    got = kernel.apply_weights(layer, x, bias)
    assert_within_bf16(got, x, weight, bias, None, ulps=0.5)


def test_register_refuses_a_vllm_without_the_triton_backend_name(
    monkeypatch: pytest.MonkeyPatch, fresh_register: None
) -> None:
    fake = FakeVllm(monkeypatch, {"marlin": set()})
    with pytest.raises(QerlError, match=r"_LINEAR_BACKEND_KERNEL_MAP.*rollout\.linear_backend=marlin"):
        vllm_nvfp4.register()
    assert fake.registered == []  # nothing left in vLLM's kernel list of the process

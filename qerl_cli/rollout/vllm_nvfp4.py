"""qerl's Triton W4A16 NVFP4 GEMM served inside vLLM: ``rollout.linear_backend: qerl-triton``.

vLLM 0.26 picks each NVFP4 layer's kernel from a registry, narrowed by its ``linear_backend`` engine
argument to the kernels registered under that name. vLLM has no Triton NVFP4 kernel of its own, so
qerl registers its kernel (:mod:`qerl_cli.kernels.nvfp4_gemm`) under vLLM's ``triton`` name and starts
vLLM with ``linear_backend="triton"``: every NVFP4 layer then runs qerl's kernel, and a layer it cannot
serve fails the load naming the backend instead of falling back to another kernel silently.

The registration is made in this process, so the engine core must run here too (qerl's default,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on one GPU (tensor-parallel workers are other processes):
:func:`unavailable_reason` says so before vLLM starts.

At load (:func:`prepare_layer`) the checkpoint's packed codes are re-laid-out once into the kernel's
layout (:func:`~qerl_cli.kernels.nvfp4_gemm.split_halves`, the same bytes, replacing vLLM's copy), the
E4M3 block scales kept, and vLLM's global multiplier (the inverse of the checkpoint's divisor, as Marlin
reads it) turned into the kernel's accumulator multiplier. Each call is one torch custom op, opaque to
torch.compile; it never syncs with the host, so vLLM captures it in its CUDA graphs. The new tensors are
made during vLLM's weight loading, so sleep mode offloads and restores them with the other weights.
vLLM's own LoRA kernels add the adapter around the op (the kernel's fused adapter is not used here), so
the in-place adapter sync and AQN's norm noise work as on Marlin.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.kernels.nvfp4_gemm import BLOCK, WEIGHT_EXPONENT, launch_gemm, make_device_tables, split_halves

BACKEND = "qerl-triton"  # qerl's rollout.linear_backend value
VLLM_BACKEND = "triton"  # vLLM's linear_backend name it is registered under
MIN_CAPABILITY = (9, 0)  # Hopper: the only GPUs it was tested and measured on (warpgroup MMA)
OP_NAME = "qerl::nvfp4_w4a16_gemm"


def unavailable_reason(
    capability: tuple[int, int] | None, tensor_parallel_size: int, in_process: bool
) -> str | None:
    """Why qerl's kernel cannot serve vLLM here (None: it can), with the fix."""
    if capability is not None and capability < MIN_CAPABILITY:
        return (
            f"needs a Hopper GPU (compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+), the only one "
            f"it was tested on; this GPU is sm{capability[0]}{capability[1]}: use marlin"
        )
    if tensor_parallel_size > 1:
        return (
            f"needs rollout.tensor_parallel_size=1 (got {tensor_parallel_size}): qerl registers its kernel "
            "with vLLM in this process, which tensor-parallel workers do not share; use marlin"
        )
    if not in_process:
        return (
            "needs vLLM's engine in this process: VLLM_ENABLE_V1_MULTIPROCESSING=1 is set, which starts "
            "vLLM's engine in another process that does not see qerl's kernel; unset it (qerl's default is 0)"
        )
    return None


def check_dtype(dtype: object) -> None:
    """The kernel computes in BF16: refuse another dtype for vLLM's activations before vLLM loads."""
    if dtype not in (None, "auto", "bfloat16", torch.bfloat16):
        raise QerlError(
            f"rollout.linear_backend={BACKEND} computes in bfloat16, but vLLM was asked for dtype {dtype}: "
            "set rollout.dtype=bfloat16 (or use marlin)"
        )


def engine_in_process() -> bool:
    """Whether the vLLM qerl starts keeps its engine here (unset: qerl sets 0 before importing vLLM)."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0"


def accumulator_scale(multiplier: torch.Tensor) -> torch.Tensor:
    """float32 ``[1]``: the kernel's accumulator multiplier from vLLM's NVFP4 global multiplier (what
    each E2M1 x E4M3 product is multiplied by; vLLM inverts the checkpoint's divisor at load). The
    kernel's weight tile is the product x 2**-WEIGHT_EXPONENT, which this undoes."""
    return (multiplier.float().reshape(1) * 2.0**WEIGHT_EXPONENT).contiguous()


def prepare_layer(layer: torch.nn.Module) -> None:
    """Turn one vLLM NVFP4 layer (after vLLM's own processing: ``weight`` uint8 ``[N, K/2]``,
    ``weight_scale`` E4M3 ``[N, K/16]``, ``weight_global_scale`` the multiplier) into the kernel's
    operands, in place: ``weight`` re-laid-out, ``qerl_accumulator_scale`` added."""
    n, k = int(layer.output_size_per_partition), int(layer.input_size_per_partition)
    packed, scale = layer.weight.data, layer.weight_scale.data
    if packed.dtype != torch.uint8 or packed.shape != (n, k // 2) or k % BLOCK:
        raise ValueError(
            f"qerl-triton expects an NVFP4 weight uint8 [{n}, {k // 2}] with K a multiple of {BLOCK}; got "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    if scale.dtype != torch.float8_e4m3fn or scale.shape != (n, k // BLOCK):
        raise ValueError(
            f"qerl-triton expects E4M3 block scales [{n}, {k // BLOCK}]; got {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    # Parameters, as vLLM's own kernels keep theirs: made here, inside vLLM's weight loading, they are
    # in the memory sleep mode offloads and restores.
    keep = torch.nn.Parameter
    layer.weight = keep(split_halves(packed), requires_grad=False)
    layer.weight_scale = keep(scale.contiguous(), requires_grad=False)
    out_scale = accumulator_scale(layer.weight_global_scale.data)
    layer.qerl_accumulator_scale = keep(out_scale, requires_grad=False)
    make_device_tables(packed.device)  # now, not first inside a CUDA graph capture


# The kernel as a torch custom op, defined once at import: torch.compile (vLLM's) traces the model
# through its fake (shape-only) twin and calls the op opaquely; defined lazily inside the traced
# forward, Dynamo would trace into torch.library's own schema inference and stop.
@torch.library.custom_op(OP_NAME, mutates_args=())
def nvfp4_w4a16_gemm(
    x: torch.Tensor,
    halves: torch.Tensor,
    scale: torch.Tensor,
    out_scale: torch.Tensor,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"qerl-triton takes BF16 activations, got {x.dtype}: serve the model in BF16")
    return launch_gemm(x, halves, scale, out_scale, halves.shape[0], in_features, bias)


@nvfp4_w4a16_gemm.register_fake
def _(x, halves, scale, out_scale, in_features, bias):  # noqa: ANN001, ANN202 (torch's signature)
    return x.new_empty((*x.shape[:-1], halves.shape[0]), dtype=torch.bfloat16)


def apply_layer(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One NVFP4 layer's GEMM on its prepared operands (:func:`prepare_layer`), through the custom op."""
    return nvfp4_w4a16_gemm(x, layer.weight, layer.weight_scale, layer.qerl_accumulator_scale,
                            int(layer.input_size_per_partition), bias)  # fmt: skip


@cache
def register() -> type:
    """Register qerl's kernel with vLLM's NVFP4 kernel registry under ``linear_backend="triton"``
    (once per process, before ``vllm.LLM`` is built); returns the kernel class."""
    from vllm.model_executor.kernels import linear as vllm_linear
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    class QerlTritonNvFp4LinearKernel(NvFp4LinearKernel):
        """NVFP4 weight-only GEMM by qerl's Triton kernel (W4A16, the weights dequantized in registers)."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            if not torch.cuda.is_available():
                return False, "qerl-triton needs a CUDA GPU"
            capability = torch.cuda.get_device_capability()
            reason = unavailable_reason(capability, 1, True)
            return reason is None, reason

        @classmethod
        def can_implement(cls, config: Any) -> tuple[bool, str | None]:
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            prepare_layer(layer)

        def apply_weights(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            return apply_layer(layer, x, bias)

    # vLLM's map is private (no API adds a backend name): checked first, so a vLLM that renames it fails
    # here with nothing registered.
    backend_map = getattr(vllm_linear, "_LINEAR_BACKEND_KERNEL_MAP", None)
    if not isinstance(backend_map, dict) or VLLM_BACKEND not in backend_map:
        raise RuntimeError(
            "this vLLM has no linear_backend registry qerl-triton can join (vLLM 0.26's "
            "_LINEAR_BACKEND_KERNEL_MAP); use rollout.linear_backend=marlin"
        )
    vllm_linear.register_linear_kernel(QerlTritonNvFp4LinearKernel, PlatformEnum.CUDA, "nvfp4")
    backend_map[VLLM_BACKEND].add(QerlTritonNvFp4LinearKernel)
    return QerlTritonNvFp4LinearKernel

"""qerl's Triton W4A16 NVFP4 GEMM served inside vLLM: ``rollout.linear_backend: qerl-triton``.

vLLM 0.26 picks each NVFP4 layer's kernel from a registry, narrowed by its ``linear_backend`` engine
argument to the kernels registered under that name. vLLM has no Triton NVFP4 kernel of its own, so
qerl registers its kernel (:mod:`qerl_cli.kernels.nvfp4_gemm`) under vLLM's ``triton`` name and starts
vLLM with ``linear_backend="triton"``: every NVFP4 layer then runs qerl's kernel, and a layer it cannot
serve fails the load naming the backend instead of falling back to another kernel silently.

The registration is made in this process, so the engine core must run here too (qerl's default,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on one GPU (tensor-parallel workers are other processes), and vLLM
must be 0.26+ (its kernel registry): :func:`unavailable_reason` says so before vLLM starts, and
:func:`check_engine_arguments` refuses the recipe's ``rollout.vllm_kwargs`` that would start other
processes or another kernel under this name. After the start :func:`check_engine` counts the NVFP4 layers
served by qerl's kernel.

At load (:func:`prepare_layer`) the checkpoint's packed codes are re-laid-out once into the kernel's layout
(:func:`~qerl_cli.kernels.nvfp4_gemm.split_halves`, the same bytes, replacing vLLM's copy), the E4M3 block
scales replaced by their BF16 values in the kernel's tiles of 64 rows
(:func:`~qerl_cli.kernels.nvfp4_gemm.scale_tiles`, exact, one more byte a block of 16 weights: ~0.41 GB more
on a 7B), and vLLM's global multiplier (the inverse of the checkpoint's divisor, as Marlin reads it) turned
into the kernel's accumulator multiplier. Each call is one torch custom op, opaque to torch.compile; it never
syncs with the host, so vLLM captures it in its CUDA graphs. The re-laid-out weights and scales are made
during vLLM's weight loading, so sleep mode offloads and restores them with the other weights; the kernel's
split-K counters are made before vLLM starts, outside its sleep-mode memory pool (they outlive the engine).
vLLM's own LoRA kernels add the adapter around the op (the kernel's fused adapter is not used here), so the
in-place adapter sync and AQN's norm noise work as on Marlin.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.kernels.nvfp4_gemm import (
    BLOCK,
    WEIGHT_EXPONENT,
    launch_gemm,
    make_device_tables,
    scale_tiles,
    split_halves,
)
from qerl_cli.rollout.lora_kernel_configs import BATCH_INVARIANT_ENV
from qerl_cli.rollout.vllm_env import MULTIPROCESSING_ENV, QERL_MULTIPROCESSING_DEFAULT, vllm_too_old

BACKEND = "qerl-triton"  # qerl's rollout.linear_backend value
VLLM_BACKEND = "triton"  # vLLM's linear_backend name it is registered under
HOPPER = 9  # the compute capability major it was tested and measured on (warpgroup MMA, 227 KiB a CTA)
MIN_VLLM = (0, 26)  # the first vLLM with the NVFP4 kernel registry it joins
OP_NAME = "qerl::nvfp4_w4a16_gemm"
# Bytes a weight takes beyond the checkpoint's in vLLM's memory: each block's one-byte E4M3 scale is held as
# its two-byte BF16 value (prepare_layer), one more byte a block of BLOCK weights (exact where N is a
# multiple of 64 and K of 32, as in every model served: scale_tiles pads to whole groups otherwise).
EXTRA_BYTES_PER_WEIGHT = 1 / BLOCK
# vLLM settings that start worker processes, which do not see this process's registration.
OTHER_PROCESS_KWARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def unavailable_reason(
    *,
    capability: tuple[int, int] | None,
    tensor_parallel_size: int = 1,
    in_process: bool = True,
    vllm_version: tuple[int, int] | None = None,
    dtype: object = "bfloat16",
) -> str | None:
    """Why qerl's kernel cannot serve vLLM here (None: it can), with the fix; None values: not known."""
    if capability is not None and capability[0] != HOPPER:
        return (
            f"runs on Hopper GPUs only (compute capability {HOPPER}.x: its tiles fill a Hopper CTA's shared "
            f"memory, and no other GPU was tested); this GPU is sm{capability[0]}{capability[1]}: use marlin"
        )
    too_old = vllm_too_old(vllm_version, MIN_VLLM, "its NVFP4 kernel registry")
    if too_old is not None:
        return too_old
    if dtype not in ("bfloat16", torch.bfloat16):
        return (
            f"computes in bfloat16, but the rollout dtype is {dtype}: set it to bfloat16 (model.dtype in a "
            "train recipe, --set dtype=bfloat16 in qerl eval; drop any vllm_kwargs dtype), or use marlin"
        )
    if tensor_parallel_size > 1:
        return (
            f"needs rollout.tensor_parallel_size=1 (got {tensor_parallel_size}): qerl registers its kernel "
            "with vLLM in this process, which tensor-parallel workers do not share; use marlin"
        )
    if not in_process:
        value = os.environ.get(MULTIPROCESSING_ENV)
        return (
            f"needs vLLM's engine in this process: {MULTIPROCESSING_ENV}={value} starts vLLM's engine in "
            f"another process, which does not see qerl's kernel; unset it (qerl's default is "
            f"{QERL_MULTIPROCESSING_DEFAULT})"
        )
    if os.environ.get(BATCH_INVARIANT_ENV, "0") not in ("", "0"):
        return (
            f"{BATCH_INVARIANT_ENV} is set, which makes vLLM pick its own NVFP4 kernel: unset it, or use "
            "marlin"
        )
    return None


def check_engine_arguments(kwargs: dict[str, Any]) -> None:
    """The final ``vllm.LLM`` arguments of a qerl-triton engine (the recipe's ``rollout.vllm_kwargs`` win
    over qerl's): refused where they would serve another kernel under this name or start vLLM's model
    in other processes."""
    if kwargs.get("linear_backend") != VLLM_BACKEND:
        raise QerlError(
            f"rollout.linear_backend={BACKEND} starts vLLM with linear_backend={VLLM_BACKEND!r}, but "
            f"rollout.vllm_kwargs sets linear_backend={kwargs.get('linear_backend')!r}, which would serve "
            "another kernel under this name: drop it from rollout.vllm_kwargs"
        )
    reason = unavailable_reason(capability=None, dtype=kwargs.get("dtype", "bfloat16"))
    if reason is not None:
        raise QerlError(f"rollout.linear_backend={BACKEND}: {reason}")
    others = {key: kwargs[key] for key in OTHER_PROCESS_KWARGS if int(kwargs.get(key) or 1) > 1}
    executor = kwargs.get("distributed_executor_backend")
    # external_launcher (torchrun data parallelism) runs vLLM's worker in this rank's own process, which
    # registers the kernel itself; a multiprocessing or Ray executor starts other processes.
    if executor not in (None, "uni", "external_launcher"):
        others["distributed_executor_backend"] = executor
    if others:
        raise QerlError(
            f"rollout.linear_backend={BACKEND} serves vLLM from this process only, but vLLM's arguments "
            f"{others} start workers in other processes, which do not see qerl's kernel: drop them, or use "
            "marlin"
        )


def prepare_engine(kwargs: dict[str, Any]) -> None:
    """Before ``vllm.LLM(**kwargs)`` of a qerl-triton engine: its arguments checked, the kernel's per-device
    split-K counters made outside vLLM's sleep-mode memory pool (module-level caches outliving an engine must
    not hold that pool's memory: the next engine's allocator would not start empty), the kernel registered
    before vLLM builds its layers, which look their kernel up."""
    check_engine_arguments(kwargs)
    make_device_tables(torch.device("cuda", torch.cuda.current_device()))
    register()


def count_served(model: torch.nn.Module) -> tuple[int, int]:
    """(vLLM's NVFP4 linear layers, those of them on qerl's kernel) of one worker's model."""
    nvfp4 = [m for m in model.modules() if hasattr(m, "weight_global_scale")]
    return len(nvfp4), sum(hasattr(m, "qerl_accumulator_scale") for m in nvfp4)


def check_engine(llm: Any) -> int:
    """After the start: every NVFP4 linear layer runs qerl's kernel (an environment variable such as
    ``VLLM_DISABLED_KERNELS`` could have chosen another); returns how many do."""
    layers, served = (sum(column) for column in zip(*llm.apply_model(count_served), strict=True))
    if served == 0 or served != layers:
        raise QerlError(
            f"rollout.linear_backend={BACKEND}: vLLM serves {served} of its {layers} NVFP4 linear layers on "
            "qerl's kernel (VLLM_DISABLED_KERNELS or another vLLM setting chose another): unset it, or use "
            "marlin"
        )
    return served


def accumulator_scale(multiplier: torch.Tensor) -> torch.Tensor:
    """float32 ``[1]``: the kernel's accumulator multiplier from vLLM's NVFP4 global multiplier (what
    each E2M1 x E4M3 product is multiplied by; vLLM inverts the checkpoint's divisor at load). The
    kernel's weight tile is the product x 2**-WEIGHT_EXPONENT, which this undoes."""
    return (multiplier.float().reshape(1) * 2.0**WEIGHT_EXPONENT).contiguous()


def prepare_layer(layer: torch.nn.Module) -> None:
    """Turn one vLLM NVFP4 layer (after vLLM's own processing: ``weight`` uint8 ``[N, K/2]``,
    ``weight_scale`` E4M3 ``[N, K/16]``, ``weight_global_scale`` the multiplier) into the kernel's
    operands, in place: ``weight`` re-laid-out (:func:`split_halves`), ``weight_scale`` the BF16 block scales
    in the kernel's tiles (:func:`scale_tiles`, ``[ceil(N/64), KH/16, 64, 2]``), ``qerl_accumulator_scale``
    added."""
    n, k = int(layer.output_size_per_partition), int(layer.input_size_per_partition)
    packed, scale = layer.weight.data, layer.weight_scale.data
    remedy = f"this vLLM lays NVFP4 layers out otherwise than vLLM {MIN_VLLM[0]}.{MIN_VLLM[1]}: use marlin"
    if packed.dtype != torch.uint8 or packed.shape != (n, k // 2) or k % BLOCK:
        raise ValueError(
            f"qerl-triton expects an NVFP4 weight uint8 [{n}, {k // 2}] with K a multiple of {BLOCK}; got "
            f"{packed.dtype} {tuple(packed.shape)}; {remedy}"
        )
    if scale.dtype != torch.float8_e4m3fn or scale.shape != (n, k // BLOCK):
        raise ValueError(
            f"qerl-triton expects E4M3 block scales [{n}, {k // BLOCK}]; got {scale.dtype} "
            f"{tuple(scale.shape)}; {remedy}"
        )
    # Parameters, as vLLM's own kernels keep theirs: made here, inside vLLM's weight loading, they are
    # in the memory sleep mode offloads and restores.
    keep = torch.nn.Parameter
    layer.weight = keep(split_halves(packed), requires_grad=False)
    layer.weight_scale = keep(scale_tiles(scale), requires_grad=False)
    out_scale = accumulator_scale(layer.weight_global_scale.data)
    layer.qerl_accumulator_scale = keep(out_scale, requires_grad=False)


# The kernel as a torch custom op, defined once at import: torch.compile (vLLM's) traces the model
# through its fake (shape-only) twin and calls the op opaquely; defined lazily inside the traced
# forward, Dynamo would trace into torch.library's own schema inference and stop.
@torch.library.custom_op(OP_NAME, mutates_args=())
def nvfp4_w4a16_gemm(
    x: torch.Tensor,
    halves: torch.Tensor,
    tiled_scales: torch.Tensor,
    out_scale: torch.Tensor,
    in_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    if x.dtype != torch.bfloat16:
        raise ValueError(f"qerl-triton takes BF16 activations, got {x.dtype}: serve the model in BF16")
    return launch_gemm(x, halves, tiled_scales, out_scale, halves.shape[0], in_features, bias)


@nvfp4_w4a16_gemm.register_fake
def _(x: torch.Tensor, halves: torch.Tensor, *operands: object) -> torch.Tensor:  # the op's arguments
    return x.new_empty((*x.shape[:-1], halves.shape[0]), dtype=torch.bfloat16)


def apply_layer(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One NVFP4 layer's GEMM on its prepared operands (:func:`prepare_layer`), through the custom op."""
    return nvfp4_w4a16_gemm(x, layer.weight, layer.weight_scale, layer.qerl_accumulator_scale,
                            int(layer.input_size_per_partition), bias)  # fmt: skip


@cache
def register() -> type[Any]:
    """Register qerl's kernel with vLLM's NVFP4 kernel registry under ``linear_backend="triton"``
    (once per process, before ``vllm.LLM`` is built); returns the kernel class."""
    try:
        from vllm.model_executor.kernels import linear as vllm_linear
        from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearKernel
        from vllm.platforms import PlatformEnum
    except ImportError as exc:
        raise QerlError(
            f"rollout.linear_backend={BACKEND} joins the NVFP4 kernel registry of vLLM "
            f"{MIN_VLLM[0]}.{MIN_VLLM[1]}+, which this vLLM lacks ({exc}): "
            f'pip install -U "vllm>={MIN_VLLM[0]}.{MIN_VLLM[1]}", or use marlin'
        ) from None

    class QerlTritonNvFp4LinearKernel(NvFp4LinearKernel):
        """NVFP4 weight-only GEMM by qerl's Triton kernel (W4A16, the weights dequantized in registers)."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            if not torch.cuda.is_available():
                return False, "qerl-triton needs a CUDA GPU"
            reason = unavailable_reason(capability=torch.cuda.get_device_capability())
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
        raise QerlError(
            f"rollout.linear_backend={BACKEND}: this vLLM has no linear_backend registry qerl's kernel can "
            "join (vLLM 0.26's _LINEAR_BACKEND_KERNEL_MAP); use rollout.linear_backend=marlin"
        )
    vllm_linear.register_linear_kernel(QerlTritonNvFp4LinearKernel, PlatformEnum.CUDA, "nvfp4")
    backend_map[VLLM_BACKEND].add(QerlTritonNvFp4LinearKernel)
    return QerlTritonNvFp4LinearKernel

"""Starting a colocated vLLM: which ``quantization`` a checkpoint needs, whether this GPU serves
it, the ``vllm.LLM`` keyword arguments, and start-up errors rephrased as advice.

Part of the vLLM rollout engine (``rollout.vllm_engine``); vLLM itself is imported lazily.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from qerl_cli import formats
from qerl_cli.errors import QerlError, install_hint
from qerl_cli.rollout import vllm_nvfp4
from qerl_cli.rollout.lora_kernel_configs import use_tuned_lora_configs
from qerl_cli.rollout.vllm_env import MULTIPROCESSING_ENV, QERL_MULTIPROCESSING_DEFAULT
from qerl_cli.rollout.vllm_env import vllm_in_process as vllm_in_process  # callers import it from here

# vLLM's LoRAConfig only accepts these ranks; a recipe's value is rounded up to the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Marlin FP4 (the kernel vLLM uses for NVFP4/MXFP4 weights without native FP4 tensor cores) needs
# Ampere; vLLM's bitsandbytes path needs Volta.
MIN_CAPABILITY = {name: fmt.vllm_min_capability for name, fmt in formats.FORMATS.items()}
# vLLM's non-KV, non-weight memory while awake: activation profile peak, CUDA graphs, LoRA slots.
VLLM_OVERHEAD = int(4.0 * 2**30)


# --------------------------------------------------------------------------------------------
# Checkpoint format -> vLLM's ``quantization`` argument
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointFormat:
    """What the checkpoint holds (``bf16``, ``nvfp4``, ``mxfp4``, ``nf4`` or ``other``) and the
    ``quantization`` value vLLM needs for it (None: vLLM reads ``quantization_config`` itself)."""

    name: str
    vllm_quantization: str | None = None
    detail: str = ""


def _compressed_tensors_format(qcfg: dict[str, Any]) -> str:
    """nvfp4 / mxfp4 from a compressed-tensors ``quantization_config`` (else ``other``)."""
    fmt = str(qcfg.get("format", ""))
    if "nvfp4" in fmt:
        return "nvfp4"
    if "mxfp4" in fmt:
        return "mxfp4"
    for group in (qcfg.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        if weights.get("num_bits") == 4 and weights.get("type") == "float":
            # NVFP4: FP8 scales per 16 + a tensor scale; MXFP4: power-of-two scales per 32.
            return "nvfp4" if weights.get("group_size") == 16 else "mxfp4"
    return "other"


def detect_checkpoint_format(model_path: str | Path) -> CheckpointFormat:
    """Read ``config.json``'s ``quantization_config`` of a local checkpoint.

    A hub id (no local folder) returns ``auto``-like ``other`` with no forced quantization: vLLM
    then reads the config itself.
    """
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return CheckpointFormat("other", None, "not a local folder; vLLM detects the format")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise QerlError(f"{config_file} is not valid JSON ({exc}); is the checkpoint complete?") from None
    qcfg = config.get("quantization_config")
    if not qcfg:
        return CheckpointFormat("bf16")
    method = str(qcfg.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return CheckpointFormat(_compressed_tensors_format(qcfg), None, method)
    if method == "bitsandbytes":
        if not qcfg.get("load_in_4bit", False) or qcfg.get("bnb_4bit_quant_type", "nf4") != "nf4":
            return CheckpointFormat("other", "bitsandbytes", "bitsandbytes (not 4-bit NF4)")
        # vLLM needs to be told: its bitsandbytes loader differs from the default loader.
        return CheckpointFormat("nf4", formats.get("nf4").vllm_quantization, method)
    return CheckpointFormat("other", None, method)


def _cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, None without one."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def _cuda_device_name() -> str | None:
    """``torch.cuda.get_device_name()`` of the current device, None without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _cuda_free_bytes() -> int | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _cuda_total_bytes() -> int | None:
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[1])


def check_gpu_supports(fmt: CheckpointFormat) -> None:
    """Fail early, with a fix, when this GPU cannot serve the checkpoint's format."""
    capability = _cuda_capability()
    if capability is None:
        raise QerlError(
            "rollout.engine=vllm needs an NVIDIA GPU (CUDA) and none is visible; "
            "use --set rollout.engine=hf on this machine"
        )
    need = MIN_CAPABILITY.get(fmt.name)
    if need is not None and capability < need:
        kernel = "Marlin FP4 kernels" if formats.get(fmt.name).fp4 else "bitsandbytes kernels"
        raise QerlError(
            f"this {fmt.name.upper()} checkpoint needs a GPU with compute capability "
            f"{need[0]}.{need[1]}+ for vLLM's {kernel}; this GPU is sm{capability[0]}{capability[1]}. "
            "Quantize to NF4 (sm70+), use the BF16 model, or use rollout.engine=hf"
        )


def _import_vllm() -> SimpleNamespace:
    """The pieces of vLLM we use, imported on first engine construction, with the engine's environment
    set first: every engine (train, eval, each bench backend) is built after this call."""
    # Keep the engine core in this process: LLM.apply_model then runs our noise function on the
    # very modules that generate, and torch.cuda memory figures include vLLM's allocations. (With
    # multiprocessing, vLLM only ships functions to its worker under VLLM_ALLOW_INSECURE_SERIALIZATION=1.)
    os.environ.setdefault(MULTIPROCESSING_ENV, QERL_MULTIPROCESSING_DEFAULT)
    # The same LoRA kernel configs for every backend, so their figures compare: qerl's tuned ones for
    # this GPU where it ships them, unless the user named a folder.
    use_tuned_lora_configs(_cuda_device_name())
    try:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    except ImportError as exc:
        raise QerlError(
            f"rollout.engine=vllm needs vLLM, which is not importable ({exc}). Install it with: "
            f"{install_hint('vllm')} (or use --set rollout.engine=hf)"
        ) from None
    return SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, LoRARequest=LoRARequest)


def _supported_lora_rank(rank: int) -> int:
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise QerlError(f"rollout.max_lora_rank={rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def start_llm(
    llm_class: Any, kwargs: dict[str, Any], model: str, utilization: float, linear_backend: str
) -> Any:
    """``vllm.LLM(**kwargs)``: for ``qerl-triton`` qerl's kernel registered first and its layers counted
    after (:mod:`qerl_cli.rollout.vllm_nvfp4`); memory errors rephrased as advice on the recipe's
    settings."""
    qerl_kernel = linear_backend == vllm_nvfp4.BACKEND
    if qerl_kernel:
        vllm_nvfp4.prepare_engine(kwargs)
    try:
        llm = llm_class(**kwargs)
    except (ValueError, RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        rephrased = _rephrase_load_error(exc, model, utilization)
        if rephrased is None:
            raise
        raise rephrased from exc
    if qerl_kernel:
        vllm_nvfp4.check_engine(llm)
    return llm


def _rephrase_load_error(exc: Exception, model: str, utilization: float) -> QerlError | None:
    """Turn vLLM's memory errors at start-up into advice on rollout.gpu_memory_utilization."""
    text = str(exc)
    lower = text.lower()
    total = _cuda_total_bytes()
    free = _cuda_free_bytes()
    gpu = (
        f" (this GPU: {total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free now)"
        if total is not None and free is not None
        else ""
    )
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if "less than desired gpu memory utilization" in lower:
        return QerlError(
            f"vLLM asked for gpu_memory_utilization={utilization} of the GPU for {model} but less is free"
            f"{gpu}: the trainer shares this GPU. Lower rollout.gpu_memory_utilization (paper: 0.2 for 3B, "
            f"0.3 for 7B, 0.45 for 14B) or free memory. vLLM said: {first_line}"
        )
    if (
        "kv cache" in lower
        or "cache blocks" in lower
        or "out of memory" in lower
        or isinstance(exc, torch.cuda.OutOfMemoryError)
    ):
        return QerlError(
            f"the GPU is too small for {model} with gpu_memory_utilization={utilization}{gpu}: the weights "
            "plus the KV cache for one full-length sequence do not fit. Raise rollout.gpu_memory_utilization "
            "(if the trainer leaves room), lower rollout.max_prompt_length + max_completion_length, or use a "
            f"4-bit checkpoint. vLLM said: {first_line}"
        )
    return None


def tmpfs_dir() -> str | None:
    """/dev/shm when writable (adapter copies never touch a disk), else the default temp dir."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def llm_kwargs(
    model_path: str,
    fmt: CheckpointFormat,
    *,
    dtype: str,
    seed: int,
    gpu_memory_utilization: float,
    enable_sleep_mode: bool,
    trust_remote_code: bool,
    revision: str | None,
    kv_cache_dtype: str,
    max_model_len: int | None,
    max_lora_rank: int | None,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for a colocated engine (``max_lora_rank`` None: no LoRA)."""
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": dtype,
        "seed": seed,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enable_sleep_mode": enable_sleep_mode,
        "trust_remote_code": trust_remote_code,
        # Temperature-scaled logprobs of the sampled token (the default "raw_logprobs" ignores
        # the temperature, which would bias truncated importance sampling at T != 1).
        "logprobs_mode": "processed_logprobs",
        "tensor_parallel_size": tensor_parallel_size,
    }
    if revision is not None:
        kwargs["revision"] = revision
    if kv_cache_dtype != "auto":
        # FP8 KV (scales computed on the fly): half the KV bytes, so twice the concurrent tokens.
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if fmt.vllm_quantization is not None:
        kwargs["quantization"] = fmt.vllm_quantization
    if max_lora_rank is not None:
        # One adapter at a time: the previous one is removed before the next is added.
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
    return kwargs

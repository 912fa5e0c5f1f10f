"""Rollouts with a colocated vLLM engine: 4-bit Marlin kernels, LoRA synced every step, AQN noise.

One ``vllm.LLM`` lives in the trainer's process and shares its GPU. A training step uses it so:

1. ``generate`` samples n completions per prompt with the current adapter and noise;
2. ``sleep`` (vLLM sleep mode, level 1) offloads its weights and drops its KV cache so the
   update phase gets the memory back;
3. after the update, ``wake_up`` restores it, then ``sync_adapter`` (or ``sync_peft_model``) loads
   the new adapter under a *new* LoRA id without merging it into the 4-bit base, and
   ``check_staleness`` compares vLLM's logprobs on a probe prompt with the trainer's;
4. ``set_norm_noise`` sets vLLM's own RMSNorm weights to clean + N(0, sigma^2) (AQN).

Why a new LoRA id every step: vLLM caches adapters by id, so re-adding an id it already holds is
a silent no-op and rollouts keep sampling the *old* adapter (or the base model). A fresh id plus
``remove_lora`` of the previous one and a prefix-cache reset (cached KV blocks were computed with
the old weights) makes each sync observable, and the staleness check proves it worked.

vLLM is imported lazily (``pip install "qerl[vllm]"``): the rest of qerl works without it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.modeling.aqn import find_norm_modules, is_rms_norm, perturb_norm_weights
from qerl_cli.rollout.base import Completion, FinishReason, RolloutResult, SamplingSpec

if TYPE_CHECKING:
    from qerl_cli.config import ModelSection, RolloutSection

log = logging.getLogger(__name__)

# vLLM's LoRAConfig only accepts these ranks; a recipe's value is rounded up to the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Marlin FP4 (the kernel vLLM uses for NVFP4/MXFP4 weights without native FP4 tensor cores) needs
# Ampere; vLLM's bitsandbytes path needs Volta.
MIN_CAPABILITY = {"nvfp4": (8, 0), "mxfp4": (8, 0), "nf4": (7, 0)}
# Attribute on vLLM's model (worker side) holding the clean norm weights, on CPU: CPU copies are
# unaffected by sleep-mode offloading and cost ~0.4 MB for a 7B model.
CLEAN_NORMS_ATTR = "_qerl_clean_norm_weights"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


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
        return CheckpointFormat("nf4", "bitsandbytes", method)
    return CheckpointFormat("other", None, method)


def _cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, None without one."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


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
        kernel = "Marlin FP4 kernels" if fmt.name in ("nvfp4", "mxfp4") else "bitsandbytes kernels"
        raise QerlError(
            f"this {fmt.name.upper()} checkpoint needs a GPU with compute capability "
            f"{need[0]}.{need[1]}+ for vLLM's {kernel}; this GPU is sm{capability[0]}{capability[1]}. "
            "Quantize to NF4 (sm70+), use the BF16 model, or use rollout.engine=hf"
        )


def _import_vllm() -> SimpleNamespace:
    """The pieces of vLLM we use, imported on first engine construction."""
    # Keep the engine core in this process: LLM.apply_model then runs our noise function on the
    # very modules that generate, and torch.cuda memory figures include vLLM's allocations. (With
    # multiprocessing, vLLM only ships functions to its worker under VLLM_ALLOW_INSECURE_SERIALIZATION=1.)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
    except ImportError as exc:
        raise QerlError(
            f"rollout.engine=vllm needs vLLM, which is not importable ({exc}). Install it with: "
            'pip install "qerl[vllm]" (or use --set rollout.engine=hf)'
        ) from None
    return SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, LoRARequest=LoRARequest)


def _supported_lora_rank(rank: int) -> int:
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise QerlError(f"rollout.max_lora_rank={rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


# --------------------------------------------------------------------------------------------
# Functions that run inside vLLM's worker (through LLM.apply_model); module level so they pickle
# --------------------------------------------------------------------------------------------
def is_vllm_norm(name: str, module: nn.Module) -> bool:
    """RMSNorm modules with a real weight (vLLM builds some with ``has_weight=False``)."""
    return is_rms_norm(name, module) and bool(getattr(module, "has_weight", True))


def worker_count_norms(model: nn.Module) -> int:
    return len(find_norm_modules(model, is_vllm_norm))


def worker_set_norm_noise(model: nn.Module, sigma: float, seed: int) -> tuple[int, float]:
    """Set each norm weight to clean + N(0, sigma^2) (sigma 0: clean). Returns (modules perturbed,
    fraction of elements that changed after casting to the weight dtype).

    The clean copies are taken on the first call and kept on the model object, so every later
    call (after any number of sleep/wake cycles) starts from them: noise never accumulates. The
    noise is drawn on CPU from ``seed``, so a call is a pure function of (clean, sigma, seed).
    """
    modules = find_norm_modules(model, is_vllm_norm)
    clean: dict[str, torch.Tensor] | None = getattr(model, CLEAN_NORMS_ATTR, None)
    if clean is None:
        if sigma == 0:
            return 0, 0.0  # never perturbed: the weights are clean already
        clean = {name: m.weight.detach().to("cpu", copy=True) for name, m in modules.items()}
        setattr(model, CLEAN_NORMS_ATTR, clean)
    if sigma == 0:
        values = clean
    else:
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
        values = perturb_norm_weights(clean, sigma, generator)
    changed = total = 0
    with torch.no_grad():
        for name, module in modules.items():
            module.weight.copy_(values[name])
            if sigma > 0:
                changed += int((values[name] != clean[name]).sum())
                total += values[name].numel()
    count = len(modules) if sigma > 0 else 0
    return count, (changed / total if total else 0.0)


# --------------------------------------------------------------------------------------------
# Output mapping
# --------------------------------------------------------------------------------------------
def _finish_reason(reason: str | None) -> FinishReason:
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop"
    # "abort" (or None) means vLLM dropped the request, e.g. it was put to sleep mid-generation.
    raise RuntimeError(f"vLLM returned an unfinished completion (finish_reason={reason!r})")


def sampled_token_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """Logprob of each sampled token from a CompletionOutput's ``logprobs``.

    With ``logprobs=0`` vLLM returns exactly the sampled token per position, either as
    ``FlatLogprobs`` (flat lists; read directly, no per-token dict is built) or as a list of
    ``{token_id: Logprob}`` dicts.
    """
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although SamplingParams(logprobs=0) asked for them")
    flat_ids = getattr(logprobs, "token_ids", None)
    flat_values = getattr(logprobs, "logprobs", None)
    if (
        isinstance(flat_values, list)
        and flat_ids is not None
        and len(flat_values) == len(token_ids)
        and list(flat_ids) == list(token_ids)
    ):
        return [float(v) for v in flat_values]
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprob positions for {len(token_ids)} tokens")
    return [float(position[token].logprob) for token, position in zip(token_ids, logprobs, strict=True)]


def _prompt_token_logprobs(token_ids: Sequence[int], prompt_logprobs: Any) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1 from a RequestOutput's ``prompt_logprobs``
    (position 0 is None: the first token has no context)."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no prompt logprobs for the staleness probe")
    return [float(prompt_logprobs[i][token_ids[i]].logprob) for i in range(1, len(token_ids))]


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


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------
class VLLMEngine:
    """A :class:`~qerl_cli.rollout.base.RolloutEngine` backed by a colocated ``vllm.LLM``."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_format: str = "auto",
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool = True,
        enable_lora: bool = True,
        max_lora_rank: int = 64,
        max_model_len: int | None = None,
        staleness_tolerance: float = 0.5,
        seed: int = 0,
        trust_remote_code: bool = False,
        revision: str | None = None,
        vllm_kwargs: dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.model_path = str(model_path)
        self.format = detect_checkpoint_format(self.model_path)
        if model_format not in ("auto", self.format.name) and self.format.name != "other":
            raise QerlError(
                f"model.format={model_format} but {self.model_path} holds a {self.format.name} checkpoint; "
                "set model.format=auto or point model.path at the right folder"
            )
        check_gpu_supports(self.format)
        self._vllm = _import_vllm()
        self.enable_sleep_mode = enable_sleep_mode
        self.enable_lora = enable_lora
        self.max_lora_rank = _supported_lora_rank(max_lora_rank)
        self.staleness_tolerance = staleness_tolerance

        kwargs: dict[str, Any] = {
            "model": self.model_path,
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
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if self.format.vllm_quantization is not None:
            kwargs["quantization"] = self.format.vllm_quantization
        if enable_lora:
            # One adapter at a time: the previous one is removed before the next is added.
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        kwargs.update(vllm_kwargs or {})  # the recipe's rollout.vllm_kwargs win
        self.llm_kwargs = kwargs
        self.enable_sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        self.enable_lora = bool(kwargs.get("enable_lora", False))
        self.max_lora_rank = int(kwargs.get("max_lora_rank", self.max_lora_rank))

        log.info("starting vLLM for %s (%s): %s", self.model_path, self.format.name, kwargs)
        started = time.perf_counter()
        try:
            self.llm = self._vllm.LLM(**kwargs)
        except (ValueError, RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            rephrased = _rephrase_load_error(exc, self.model_path, gpu_memory_utilization)
            if rephrased is None:
                raise
            raise rephrased from exc
        self.load_seconds = time.perf_counter() - started

        self._sleeping = False
        self._lora: Any = None  # the active LoRARequest
        self._pending_lora: Any = None  # loaded by sync while asleep; activated at wake_up
        self._has_pending = False
        self._next_lora_id = 1
        self._noise_sigma = 0.0
        self._noise_seed = 0
        self._noise_touched = False  # the worker holds clean copies once noise was applied
        self._warned_truncated_logprobs = False
        self._flat_logprobs = True
        self.last_staleness_gap: float | None = None
        self.last_sleep_freed_bytes: int | None = None
        self.last_perturbed_count = 0
        self.last_changed_fraction = 0.0
        self.num_syncs = 0
        self.num_norms = int(min(self.llm.apply_model(worker_count_norms)))
        self._stage_root = Path(tempfile.mkdtemp(prefix="qerl-lora-", dir=_tmpfs_dir()))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._stage_root, True)

    @classmethod
    def from_config(
        cls,
        model: ModelSection,
        rollout: RolloutSection,
        *,
        seed: int = 0,
        enable_lora: bool = True,
        max_model_len: int | None = None,
    ) -> VLLMEngine:
        """Build from the recipe's ``model`` (ModelSection) and ``rollout`` (RolloutSection)."""
        return cls(
            model.path,
            model_format=model.format,
            dtype=model.dtype,
            revision=model.revision,
            trust_remote_code=model.trust_remote_code,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            enable_sleep_mode=rollout.enable_sleep_mode,
            enable_lora=enable_lora,
            max_lora_rank=rollout.max_lora_rank,
            max_model_len=max_model_len or rollout.max_prompt_length + rollout.max_completion_length,
            staleness_tolerance=rollout.staleness_tolerance,
            seed=seed,
            vllm_kwargs=dict(rollout.vllm_kwargs),
            tensor_parallel_size=rollout.tensor_parallel_size,
        )

    # ---- state ------------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    @property
    def lora_request(self) -> Any:
        """The LoRARequest generate uses now (None: the base model)."""
        return self._lora

    def stats(self) -> dict[str, float]:
        """Engine-level figures for logs (per-rollout figures are in RolloutResult.stats)."""
        out: dict[str, float] = {
            "vllm/load_seconds": self.load_seconds,
            "vllm/lora_id": float(self._lora.lora_int_id if self._lora is not None else 0),
            "vllm/syncs": float(self.num_syncs),
            "vllm/norm_modules": float(self.num_norms),
            "vllm/perturbed_norms": float(self.last_perturbed_count),
            "vllm/noise_sigma": self._noise_sigma,
        }
        if self.last_staleness_gap is not None:
            out["vllm/staleness_gap"] = self.last_staleness_gap
        if self.last_sleep_freed_bytes is not None:
            out["vllm/sleep_freed_gib"] = self.last_sleep_freed_bytes / 2**30
        return out

    # ---- generation ---------------------------------------------------------------------------
    def sampling_params(self, n: int, sampling: SamplingSpec, seed: int | None = None) -> Any:
        """vLLM SamplingParams for one prompt (``seed`` overrides ``sampling.seed``)."""
        if (sampling.top_p < 1 or sampling.top_k > 0) and not self._warned_truncated_logprobs:
            self._warned_truncated_logprobs = True
            log.warning(
                "vLLM returns logprobs renormalised over the top-p/top-k set (top_p=%s, top_k=%s); "
                "importance weights then compare them with the trainer's full-softmax logprobs",
                sampling.top_p,
                sampling.top_k,
            )
        kwargs: dict[str, Any] = {
            "n": n,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else 0,
            "max_tokens": sampling.max_new_tokens,
            "seed": seed if seed is not None else sampling.seed,
            "ignore_eos": sampling.ignore_eos,
            "stop": list(sampling.stop) or None,
            "logprobs": 0,  # the sampled token's logprob only
        }
        if self._flat_logprobs:
            try:
                # Flat lists instead of one dict per token: far less GC work at a million tokens.
                return self._vllm.SamplingParams(**kwargs, flat_logprobs=True)
            except TypeError:  # vLLM before 0.11.1 has no flat logprobs
                self._flat_logprobs = False
        return self._vllm.SamplingParams(**kwargs)

    def generate(self, prompts: list[str], n: int, sampling: SamplingSpec) -> RolloutResult:
        if self._sleeping:
            log.info("generate() called while vLLM sleeps; waking it up first")
            self.wake_up()
        if not prompts:
            return RolloutResult(prompt_token_ids=[], completions=[], stats={"rollout/seconds": 0.0})
        if sampling.seed is None:
            params: Any = self.sampling_params(n, sampling)
        else:
            # vLLM seeds the n samples of a request with seed + j; spacing prompts n apart keeps
            # every sample's stream distinct while the batch stays reproducible.
            params = [self.sampling_params(n, sampling, sampling.seed + i * n) for i in range(len(prompts))]
        started = time.perf_counter()
        try:
            outputs = self.llm.generate(prompts, params, lora_request=self._lora, use_tqdm=False)
        except ValueError as exc:
            raise QerlError(
                f"vLLM rejected the rollout batch: {exc}. If a prompt is too long, raise "
                "rollout.max_prompt_length (the engine's max_model_len is max_prompt_length + "
                "max_completion_length) or filter the data"
            ) from exc
        seconds = time.perf_counter() - started
        result = self._to_result(outputs, n)
        tokens = result.num_generated_tokens
        result.stats.update(
            {
                "rollout/seconds": seconds,
                "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                "rollout/generated_tokens": float(tokens),
                "rollout/completions": float(len(prompts) * n),
                "rollout/noise_sigma": self._noise_sigma,
                "rollout/lora_id": float(self._lora.lora_int_id if self._lora is not None else 0),
            }
        )
        return result

    @staticmethod
    def _to_result(outputs: Sequence[Any], n: int) -> RolloutResult:
        prompt_ids: list[list[int]] = []
        groups: list[list[Completion]] = []
        for output in outputs:
            if len(output.outputs) != n:
                raise RuntimeError(
                    f"vLLM returned {len(output.outputs)} completions for a prompt, expected {n}"
                )
            prompt_ids.append(list(output.prompt_token_ids))
            group = []
            for completion in sorted(output.outputs, key=lambda c: c.index):
                token_ids = list(completion.token_ids)
                group.append(
                    Completion(
                        token_ids=token_ids,
                        text=completion.text,
                        logprobs=sampled_token_logprobs(token_ids, completion.logprobs),
                        finish_reason=_finish_reason(completion.finish_reason),
                    )
                )
            groups.append(group)
        return RolloutResult(prompt_token_ids=prompt_ids, completions=groups)

    # ---- sleep mode ---------------------------------------------------------------------------
    def sleep(self) -> None:
        """Offload weights to CPU and drop the KV cache (level 1) for the update phase."""
        if not self.enable_sleep_mode or self._sleeping:
            return
        free_before = _cuda_free_bytes()
        self.llm.sleep(level=1)
        free_after = _cuda_free_bytes()
        if free_before is not None and free_after is not None:
            self.last_sleep_freed_bytes = free_after - free_before
            log.info("vLLM sleeps: %.1f GiB freed", self.last_sleep_freed_bytes / 2**30)
        self._sleeping = True

    def wake_up(self) -> None:
        """Restore weights and KV cache, activate an adapter synced while asleep, re-apply noise.

        Sleep mode moves the weights to CPU and back; in-place norm changes are re-applied rather
        than trusted to survive (and cost one small host-to-device copy per norm).
        """
        if not self._sleeping:
            return
        self.llm.wake_up()
        self._sleeping = False
        if self._has_pending:
            self._activate(self._pending_lora)
            self._pending_lora, self._has_pending = None, False
        if self._noise_touched:
            self._apply_noise()
        self.llm.reset_prefix_cache()

    # ---- LoRA sync ----------------------------------------------------------------------------
    def _next_stage_dir(self) -> Path:
        path = self._stage_root / f"adapter-{self._next_lora_id}"
        if path.exists():
            shutil.rmtree(path)
        return path

    def sync_adapter(self, adapter_dir: str | Path | None) -> None:
        """Copy the PEFT adapter in ``adapter_dir`` to tmpfs and serve it from the next generate on,
        under a new LoRA id; ``None`` serves the base model."""
        if adapter_dir is None:
            self._load(None)
            return
        source = Path(adapter_dir)
        self._validate_adapter(source)
        staged = self._next_stage_dir()
        staged.mkdir(parents=True)
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(source / name, staged / name)
        self._load(staged)

    def sync_peft_model(self, peft_model: Any) -> None:
        """Save a PEFT model's adapter straight to tmpfs (no round trip through the output folder)
        and serve it like :meth:`sync_adapter`."""
        staged = self._next_stage_dir()
        peft_model.save_pretrained(str(staged), safe_serialization=True)
        self._validate_adapter(staged)
        self._load(staged)

    def _validate_adapter(self, folder: Path) -> None:
        if not self.enable_lora:
            raise QerlError(
                "this vLLM engine was started without LoRA (enable_lora=False); it cannot serve an adapter"
            )
        config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
        if not config_file.is_file() or not weights_file.is_file():
            raise QerlError(
                f"{folder} is not a PEFT adapter folder: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
                "(save with save_pretrained(..., safe_serialization=True))"
            )
        config = json.loads(config_file.read_text())
        rank = int(config.get("r", 0))
        if rank > self.max_lora_rank:
            raise QerlError(
                f"the adapter has rank {rank} but vLLM was started with max_lora_rank={self.max_lora_rank}; "
                f"set rollout.max_lora_rank >= lora.rank ({rank})"
            )
        from safetensors import safe_open

        with safe_open(str(weights_file), framework="pt") as handle:
            norm_keys = [k for k in handle.keys() if "norm" in k]  # noqa: SIM118
        if config.get("modules_to_save") or norm_keys:
            raise QerlError(
                f"the adapter in {folder} also trains full modules "
                f"({config.get('modules_to_save') or norm_keys[:3]}); vLLM serves LoRA matrices only, so "
                "rollouts would use stale weights. Set lora.train_norms=false or use rollout.engine=hf"
            )

    def _load(self, staged: Path | None) -> None:
        request = None
        if staged is not None:
            lora_id = self._next_lora_id
            self._next_lora_id += 1
            request = self._vllm.LoRARequest(
                lora_name=f"qerl-adapter-{lora_id}", lora_int_id=lora_id, lora_path=str(staged)
            )
        self.num_syncs += 1
        if self._sleeping:
            # Loading writes into the LoRA slots, which sleep mode has offloaded: defer to wake_up.
            if self._has_pending and self._pending_lora is not None:
                self._drop_stage(self._pending_lora)
            self._pending_lora, self._has_pending = request, True
            return
        self._activate(request)

    def _activate(self, request: Any) -> None:
        engine = self.llm.llm_engine
        previous = self._lora
        if previous is not None:
            # Removed first: with max_loras=1 the new adapter takes its slot.
            engine.remove_lora(previous.lora_int_id)
            self._drop_stage(previous)
        self._lora = None
        if request is not None:
            try:
                added = engine.add_lora(request)
            except (ValueError, RuntimeError) as exc:
                raise QerlError(
                    f"vLLM could not load the adapter {request.lora_path}: {exc}. Check that "
                    "lora.target_modules are linear layers vLLM supports for this model and that "
                    "rollout.max_lora_rank >= lora.rank"
                ) from exc
            if not added:
                raise QerlError(f"vLLM refused the adapter {request.lora_path} (add_lora returned False)")
            self._lora = request
        # Cached KV blocks were computed with the previous adapter.
        self.llm.reset_prefix_cache()

    def _drop_stage(self, request: Any) -> None:
        path = Path(request.lora_path)
        if path.parent == self._stage_root:
            shutil.rmtree(path, ignore_errors=True)

    # ---- staleness check ----------------------------------------------------------------------
    def prompt_logprobs(self, token_ids: Sequence[int], *, with_adapter: bool = True) -> list[float]:
        """vLLM's log p(token_i | tokens_<i), i >= 1, at temperature 1, with the current adapter
        (or the base model) and the current norm weights."""
        if self._sleeping:
            self.wake_up()
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        request = self._lora if with_adapter else None
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(token_ids)}], params, lora_request=request, use_tqdm=False
        )
        return _prompt_token_logprobs(token_ids, outputs[0].prompt_logprobs)

    def check_staleness(self, probe_prompt_ids: Sequence[int], trainer_logprobs: Sequence[float]) -> float:
        """Mean |vLLM - trainer| logprob gap (nats/token) on a probe prompt after a sync.

        ``trainer_logprobs[i]`` is the trainer policy's log p(probe[i + 1] | probe[:i + 1]) at
        temperature 1 without AQN noise; the check lifts vLLM's noise for the probe. A small gap
        (the 4-bit kernels' numerics) is logged; a gap above ``staleness_tolerance`` raises, since
        it means rollouts do not come from the policy being trained.
        """
        if len(probe_prompt_ids) < 2 or len(trainer_logprobs) != len(probe_prompt_ids) - 1:
            raise ValueError("check_staleness needs >= 2 probe tokens and len(probe) - 1 trainer logprobs")
        if self._sleeping:  # the adapter synced during the update is activated by wake_up
            self.wake_up()
        noised = self._noise_sigma > 0
        if noised:
            self._apply_noise(sigma=0.0)
        try:
            engine_lp = self.prompt_logprobs(probe_prompt_ids)
            gap = _mean_abs_gap(engine_lp, trainer_logprobs)
            base_lp = (
                self.prompt_logprobs(probe_prompt_ids, with_adapter=False)
                if (gap > self.staleness_tolerance and self._lora is not None)
                else None
            )
        finally:
            if noised:
                self._apply_noise()
        self.last_staleness_gap = gap
        lora_id = self._lora.lora_int_id if self._lora is not None else 0
        log.info("staleness check (LoRA id %d): vLLM vs trainer logprob gap %.4f nats/token", lora_id, gap)
        if gap > self.staleness_tolerance:
            raise QerlError(self._staleness_message(gap, engine_lp, base_lp, trainer_logprobs))
        return gap

    def _staleness_message(
        self, gap: float, engine_lp: list[float], base_lp: list[float] | None, trainer_lp: Sequence[float]
    ) -> str:
        head = (
            f"vLLM's logprobs differ from the trainer's by {gap:.3f} nats/token on the probe prompt "
            f"(rollout.staleness_tolerance={self.staleness_tolerance}): rollouts are not sampled from the "
            "policy being trained."
        )
        if self._lora is None:
            return (
                head
                + " No adapter is loaded in vLLM: call sync_adapter with the trainer's adapter after each "
                "update."
            )
        adapter_effect = _mean_abs_gap(engine_lp, base_lp or engine_lp)
        base_gap = _mean_abs_gap(base_lp or engine_lp, trainer_lp)
        if adapter_effect < 1e-4:
            cause = (
                f"vLLM gives identical logprobs with and without adapter id {self._lora.lora_int_id}: "
                "rollouts are sampling the base model (the adapter's target modules are not applied)."
            )
        else:
            cause = (
                f"The adapter changes vLLM's logprobs by {adapter_effect:.3f} and the base model is "
                f"{base_gap:.3f} from the trainer: the adapter vLLM loaded is not the one the trainer uses "
                "(stale file, wrong folder or mismatched lora.alpha/rank)."
            )
        return (
            f"{head} {cause} Check that the adapter saved after each update is the trained one; raise "
            "rollout.staleness_tolerance only if the gap is explained by quantization numerics."
        )

    # ---- AQN ----------------------------------------------------------------------------------
    def set_norm_noise(self, sigma: float, seed: int) -> int:
        """AQN on vLLM's own RMSNorm modules: weight = clean + N(0, sigma^2), never accumulated.

        Returns the number of perturbed modules (0 for sigma 0). While asleep the values are
        recorded and applied at :meth:`wake_up`.
        """
        if sigma < 0 or not math.isfinite(sigma):
            raise QerlError(f"AQN sigma must be a finite number >= 0, got {sigma}")
        if sigma > 0 and self.num_norms == 0:
            raise _no_norms_error(self.model_path)
        self._noise_sigma, self._noise_seed = float(sigma), int(seed)
        if sigma > 0:
            self._noise_touched = True
        if self._sleeping:
            return self.num_norms if sigma > 0 else 0
        if not self._noise_touched:
            return 0  # sigma 0 and never perturbed: nothing to restore
        return self._apply_noise()

    def _apply_noise(self, sigma: float | None = None) -> int:
        sigma = self._noise_sigma if sigma is None else sigma
        fn = functools.partial(worker_set_norm_noise, sigma=sigma, seed=self._noise_seed)
        results = self.llm.apply_model(fn)
        count = min(r[0] for r in results)
        if sigma > 0 and count == 0:
            raise _no_norms_error(self.model_path)
        self.last_perturbed_count = count
        self.last_changed_fraction = min(r[1] for r in results)
        # Cached KV blocks were computed with the previous norm weights.
        self.llm.reset_prefix_cache()
        return count

    # ---- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Release vLLM and the tmpfs adapter copies."""
        self.llm = None  # type: ignore[assignment]
        self._cleanup()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_norms_error(model_path: str) -> QerlError:
    return QerlError(
        f"AQN is on but vLLM's model for {model_path} has no RMSNorm module with a weight to perturb; "
        "turn AQN off (aqn.enabled=false) or use rollout.engine=hf for this architecture"
    )


def _mean_abs_gap(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1)


def _tmpfs_dir() -> str | None:
    """/dev/shm when writable (adapter copies never touch a disk), else the default temp dir."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None

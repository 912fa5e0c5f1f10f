"""Rollouts with a colocated vLLM engine: 4-bit Marlin kernels, LoRA synced every step, AQN noise.

One ``vllm.LLM`` lives in the trainer's process and shares its GPU. A training step uses it so:

1. ``generate`` samples n completions per prompt with the current adapter and noise;
2. ``sleep`` (vLLM sleep mode, level 1) offloads its weights and drops its KV cache so the
   update phase gets the memory back;
3. after the update, ``wake_up`` restores it, then ``sync_adapter`` (or ``sync_policy``) loads
   the new adapter under a *new* LoRA id without merging it into the 4-bit base (or, with
   ``merge_base``, ``rollout.linear_backend: fp8-merged``, merges it into vLLM's weights, vLLM running
   without LoRA), and ``check_staleness`` compares vLLM's logprobs on a probe prompt with the trainer's;
4. ``set_norm_noise`` sets vLLM's own RMSNorm weights to clean + N(0, sigma^2) (AQN).

vLLM is imported lazily (the ``vllm`` extra): the rest of qerl works without it. Stages
never build this class themselves: they ask :func:`qerl_cli.rollout.factory.make_engine` for an engine.

The engine is split by responsibility. Here: start-up, generation, sleep / wake and AQN noise. It is
composed of an :class:`~qerl_cli.rollout.vllm_lora.AdapterSync` (LoRA sync under a new id every step,
or merged) and a :class:`~qerl_cli.rollout.vllm_staleness.StalenessCheck`, each handed the engine on
every call. Beside it: ``vllm_setup`` (checkpoint format, GPU check, ``vllm.LLM`` keyword arguments,
start-up errors), ``vllm_worker`` (functions run in vLLM's worker: AQN noise, the merge),
``vllm_outputs`` (output mapping, logprobs, staleness figures) and ``modeling.adapter`` (adapter folder
checks). The names tests and callers import stay importable from here.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from qerl_cli.config.checks import noise_sigma
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import check_declared_format
from qerl_cli.modeling.prompt_tokens import encode_prompts
from qerl_cli.rollout.backends import BackendChoice
from qerl_cli.rollout.base import (
    COMPLETIONS,
    GENERATED_TOKENS,
    NOISE_CHANGED_FRACTION,
    NOISE_SIGMA,
    NORM_MODULES,
    NUMERICS_GAP,
    PERTURBED_NORMS,
    SECONDS,
    STALENESS_GAP,
    SYNC_SECONDS,
    TOKENS_PER_S,
    RolloutResult,
    SamplingSpec,
)
from qerl_cli.rollout.vllm_lora import AdapterSync
from qerl_cli.rollout.vllm_outputs import (
    sampled_token_logprobs,
    score_prompts,
    to_result,
    vllm_detokenizes,
)
from qerl_cli.rollout.vllm_setup import (
    MIN_CAPABILITY,
    VLLM_LORA_RANKS,
    CheckpointFormat,
    _cuda_free_bytes,
    _import_vllm,
    _supported_lora_rank,
    check_gpu_supports,
    detect_checkpoint_format,
    llm_kwargs,
    start_llm,
)
from qerl_cli.rollout.vllm_staleness import StalenessCheck
from qerl_cli.rollout.vllm_worker import (
    CLEAN_NORMS_ATTR,
    is_vllm_norm,
    no_norms_error,
    worker_count_norms,
    worker_set_norm_noise,
)

__all__ = [
    "CLEAN_NORMS_ATTR", "MIN_CAPABILITY", "VLLM_LORA_RANKS",
    "CheckpointFormat", "VLLMEngine", "check_gpu_supports", "detect_checkpoint_format", "is_vllm_norm",
    "sampled_token_logprobs", "worker_count_norms", "worker_set_norm_noise",
]  # fmt: skip

log = logging.getLogger(__name__)
LORA_ID = "rollout/lora_id"  # the vLLM LoRA id generate serves (0: the base model)


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
        kv_cache_dtype: str = "auto",
        vllm_kwargs: dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        merge_base: str | Path | None = None,
        backend_choice: BackendChoice | None = None,
    ) -> None:
        self.model_path = str(model_path)
        # fp8-merged: the trainer's base checkpoint each sync merges the adapter onto (vLLM without LoRA).
        self.merge_base = None if merge_base is None else str(merge_base)
        if self.merge_base is not None:
            enable_lora = False
        # The linear backend the factory chose (qerl_cli.rollout.backends; also logged), which the bench's
        # rows name and the staleness check's allowance for merged weights reads.
        self.backend_choice = backend_choice
        # Before vLLM starts (minutes), with the detection and message `qerl train` checks with first.
        check_declared_format(model_format, self.model_path)
        self.format = detect_checkpoint_format(self.model_path)
        check_gpu_supports(self.format)
        self.vllm = _import_vllm()  # the vLLM names (LLM, SamplingParams, LoRARequest)
        self.enable_sleep_mode = enable_sleep_mode
        self.enable_lora = enable_lora
        self.max_lora_rank = _supported_lora_rank(max_lora_rank)
        self.staleness_tolerance = staleness_tolerance

        kwargs = llm_kwargs(
            self.model_path, self.format, dtype=dtype, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
            trust_remote_code=trust_remote_code, revision=revision,
            kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
            max_lora_rank=self.max_lora_rank if enable_lora else None,
            tensor_parallel_size=tensor_parallel_size,
        )  # fmt: skip
        kwargs.update(vllm_kwargs or {})  # the recipe's rollout.vllm_kwargs win
        self.llm_kwargs = kwargs
        self.enable_sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        self.enable_lora = bool(kwargs.get("enable_lora", False))
        self.max_lora_rank = int(kwargs.get("max_lora_rank", self.max_lora_rank))
        if self.merge_base is not None and self.enable_lora:
            raise QerlError(
                "rollout.linear_backend=fp8-merged runs vLLM without LoRA, but rollout.vllm_kwargs sets "
                "enable_lora: drop it, or use rollout.linear_backend=fp8 to serve the LoRA with vLLM"
            )

        self._start(kwargs, gpu_memory_utilization)

        self._sleeping = False
        self._noise_sigma = 0.0
        self._noise_seed = 0
        self._noise_touched = False  # the worker holds clean copies once noise was applied
        self._warned_truncated_logprobs = False
        self._flat_logprobs = True
        self.staleness = StalenessCheck()
        self.last_sleep_freed_bytes: int | None = None
        self.last_perturbed_count = 0
        self.last_changed_fraction = 0.0
        self.num_norms = int(min(self.llm.apply_model(worker_count_norms)))
        # Last: a vLLM that failed to start leaves no staging folder behind.
        self.adapters = AdapterSync()

    def _start(self, kwargs: dict[str, Any], gpu_memory_utilization: float) -> None:
        """``vllm.LLM(**kwargs)`` (:func:`~qerl_cli.rollout.vllm_setup.start_llm`), timed."""
        log.info("starting vLLM for %s (%s): %s", self.model_path, self.format.name, kwargs)
        started = time.perf_counter()
        self.llm = start_llm(
            self.vllm.LLM, kwargs, self.model_path, gpu_memory_utilization, self.linear_backend
        )
        self.load_seconds = time.perf_counter() - started

    # ---- state ------------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    @property
    def linear_backend(self) -> str:
        return self.backend_choice.backend if self.backend_choice is not None else "default"

    @property
    def lora_request(self) -> Any:
        """The LoRARequest generate uses now (None: the base model)."""
        return self.adapters.lora

    @property
    def last_staleness_gap(self) -> float | None:
        return self.staleness.last_gap

    @property
    def last_numerics_gap(self) -> float | None:
        return self.staleness.last_numerics_gap

    @property
    def _stage_root(self) -> Path:
        """Where the adapters' tmpfs copies are staged (the tests check that nothing is left there)."""
        return self.adapters.stage_root

    def stats(self) -> dict[str, float]:
        """Engine-level figures for logs (per-rollout figures are in RolloutResult.stats)."""
        out: dict[str, float] = {
            "rollout/load_seconds": self.load_seconds,
            LORA_ID: float(self.adapters.lora_id),
            "rollout/syncs": float(self.adapters.num_syncs),
            NORM_MODULES: float(self.num_norms),
            PERTURBED_NORMS: float(self.last_perturbed_count),
            NOISE_SIGMA: self._noise_sigma,
        }
        if self.last_staleness_gap is not None:
            out[STALENESS_GAP] = self.last_staleness_gap
        if self.last_numerics_gap is not None:
            out[NUMERICS_GAP] = self.last_numerics_gap
        if self.last_sleep_freed_bytes is not None:
            out["rollout/sleep_freed_gib"] = self.last_sleep_freed_bytes / 2**30
        if self.adapters.last_sync_seconds is not None:
            out[SYNC_SECONDS] = self.adapters.last_sync_seconds
        if self.merge_base is not None:
            out["rollout/merged_linears"] = float(self.adapters.merged_linears)
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
            "detokenize": vllm_detokenizes(sampling),
        }
        if self._flat_logprobs:
            try:
                # Flat lists instead of one dict per token: far less GC work at a million tokens.
                return self.vllm.SamplingParams(**kwargs, flat_logprobs=True)
            except TypeError:  # vLLM before 0.11.1 has no flat logprobs
                self._flat_logprobs = False
        return self.vllm.SamplingParams(**kwargs)

    def generate(self, prompts: list[str], n: int, sampling: SamplingSpec) -> RolloutResult:
        if self._sleeping:
            log.info("generate() called while vLLM sleeps; waking it up first")
            self.wake_up()
        if not prompts:
            return RolloutResult(prompt_token_ids=[], completions=[], stats={SECONDS: 0.0})
        if sampling.seed is None:
            params: Any = self.sampling_params(n, sampling)
        else:
            # vLLM seeds the n samples of a request with seed + j; spacing prompts n apart keeps
            # every sample's stream distinct while the batch stays reproducible.
            params = [self.sampling_params(n, sampling, sampling.seed + i * n) for i in range(len(prompts))]
        # Token ids, not text: vLLM adds the tokenizer's special tokens to a text prompt, which
        # doubles BOS after a chat template that writes it. The ids are the HF engine's and the
        # trainer's (qerl_cli.modeling.prompt_tokens).
        tokenizer = self.llm.get_tokenizer()
        inputs = [{"prompt_token_ids": ids} for ids in encode_prompts(prompts, tokenizer)]
        started = time.perf_counter()
        try:
            outputs = self.llm.generate(inputs, params, lora_request=self.adapters.lora, use_tqdm=False)
        except ValueError as exc:
            raise QerlError(
                f"vLLM rejected the rollout batch: {exc}. If a prompt is too long, raise "
                "rollout.max_prompt_length (the engine's max_model_len is max_prompt_length + "
                "max_completion_length) or filter the data"
            ) from exc
        # Without vLLM's detokenizer the texts are decoded here, after generation; timed with it, as
        # vLLM's detokenizer was.
        result = to_result(outputs, n, tokenizer=None if vllm_detokenizes(sampling) else tokenizer)
        seconds = time.perf_counter() - started
        tokens = result.num_generated_tokens
        result.stats.update(
            {
                SECONDS: seconds,
                TOKENS_PER_S: tokens / seconds if seconds > 0 else 0.0,
                GENERATED_TOKENS: float(tokens),
                COMPLETIONS: float(len(prompts) * n),
                NOISE_SIGMA: self._noise_sigma,
                NOISE_CHANGED_FRACTION: self.last_changed_fraction if self._noise_sigma > 0 else 0.0,
                LORA_ID: float(self.adapters.lora_id),
            }
        )
        return result

    def prompt_logprobs(self, token_ids: Sequence[int], *, with_adapter: bool = True) -> list[float]:
        """vLLM's log p(token_i | tokens_<i), i >= 1, at temperature 1, with the current adapter
        (or the base model) and the current norm weights."""
        if self._sleeping:
            self.wake_up()
        return score_prompts(self.llm, self.vllm, [token_ids], self.lora_request if with_adapter else None)[0]

    def score(self, sequences: Sequence[Sequence[int]], *, with_adapter: bool = True) -> list[list[float]]:
        """Every list's :meth:`prompt_logprobs`, batched, on clean norms (``RolloutEngine.score``)."""
        if not with_adapter:
            self.adapters.check_base_scorable(self)
        if self._sleeping:
            self.wake_up()  # before the noise is lifted: waking re-applies it
        with self.noise_lifted():
            return score_prompts(self.llm, self.vllm, sequences, self.lora_request if with_adapter else None)

    # ---- adapter sync and the staleness check ---------------------------------------------------
    def sync_adapter(self, adapter_dir: str | Path | None) -> None:
        """Serve the PEFT adapter in ``adapter_dir`` from the next generate on (``None``: the base
        model); see :meth:`~qerl_cli.rollout.vllm_lora.AdapterSync.sync_adapter`."""
        self.adapters.sync_adapter(self, adapter_dir)

    def sync_policy(self, peft_model: Any) -> None:
        """Serve the trainer's live PEFT model's adapter, saved straight to tmpfs (merge mode: merged)."""
        self.adapters.sync_policy(self, peft_model)

    def check_staleness(
        self,
        probe_prompt_ids: Sequence[int],
        trainer_logprobs: Callable[[Sequence[int]], Sequence[float]],
        reference_logprobs: Callable[[Sequence[int]], Sequence[float]] | None = None,
    ) -> float:
        """Mean |vLLM - trainer| logprob gap on a probe prompt after a sync, raising when vLLM does not
        sample from the trained policy (:meth:`~qerl_cli.rollout.vllm_staleness.StalenessCheck.check`)."""
        return self.staleness.check(self, probe_prompt_ids, trainer_logprobs, reference_logprobs)

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
        self._check_room_to_wake()
        self.llm.wake_up()
        self._sleeping = False
        self.adapters.activate_pending(self)
        if self._noise_touched:
            self._apply_noise()
        self.llm.reset_prefix_cache()

    def _check_room_to_wake(self) -> None:
        """Fail with the numbers, not inside vLLM's allocator, when waking cannot fit.

        Waking maps back exactly what sleeping freed. PyTorch's cached blocks are released first
        (the caller should already have done so); what is still short is memory the trainer holds.
        """
        need = self.last_sleep_freed_bytes
        free = _cuda_free_bytes()
        if not need or free is None or free >= need:
            return
        torch.cuda.empty_cache()
        free = _cuda_free_bytes() or 0
        if free >= need:
            return
        gib = 2**30
        held = torch.cuda.memory_allocated() / gib
        cached = (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / gib
        raise QerlError(
            f"vLLM cannot wake up: it needs {need / gib:.1f} GiB back (what its sleep freed) but only "
            f"{free / gib:.1f} GiB of the GPU are free; this process holds {held:.1f} GiB in live tensors "
            f"and {cached:.1f} GiB in blocks PyTorch cannot release. Set rollout.gpu_memory_utilization "
            f"below {self.llm_kwargs.get('gpu_memory_utilization')} (the share this engine runs with, "
            "whether given or chosen by auto), or lower train.micro_batch_size"
        )

    # ---- AQN ----------------------------------------------------------------------------------
    def set_norm_noise(self, sigma: float, seed: int) -> int:
        """AQN on vLLM's own RMSNorm modules: weight = clean + N(0, sigma^2), never accumulated.

        Returns the number of perturbed modules (0 for sigma 0). While asleep the values are
        recorded and applied at :meth:`wake_up`.
        """
        noise_sigma("AQN sigma", sigma)
        if sigma > 0 and self.num_norms == 0:
            raise no_norms_error(self.model_path)
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
            raise no_norms_error(self.model_path)
        self.last_perturbed_count = count
        self.last_changed_fraction = min(r[1] for r in results)
        # Cached KV blocks were computed with the previous norm weights.
        self.llm.reset_prefix_cache()
        return count

    @contextmanager
    def noise_lifted(self) -> Iterator[None]:
        """Clean norm weights inside the block (the staleness probe's), this step's noise again after."""
        noised = self._noise_sigma > 0
        if noised:
            self._apply_noise(sigma=0.0)
        try:
            yield
        finally:
            if noised:
                self._apply_noise()

    # ---- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Release vLLM and the tmpfs adapter copies."""
        self.llm = None  # type: ignore[assignment]
        self.adapters.cleanup()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

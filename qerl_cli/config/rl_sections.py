"""The sections of a training recipe that shape the RL loop: ``rollout:`` (the engine and its sampling),
``algorithm:`` (GRPO / DAPO), ``aqn:`` (the noise schedule) and ``train:`` (the update). ``TrainConfig``,
with the sections of the model, LoRA, data, rewards and output, is in ``sections.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from qerl_cli.config.checks import aqn_sigmas as _aqn_sigmas
from qerl_cli.config.checks import fraction_or_auto as _fraction_or_auto
from qerl_cli.config.checks import group_size as _group_size
from qerl_cli.config.checks import key as _key
from qerl_cli.config.checks import positive as _positive
from qerl_cli.config.choices import (
    MERGED_LINEAR_BACKENDS,
    VLLM_ONLY_LINEAR_BACKENDS,
    BaseCompute,
    EngineName,
    FusedKernels,
    LinearBackend,
)
from qerl_cli.errors import QerlError


@dataclass
class RolloutSection:
    # "hf": transformers generate in the trainer's process; "vllm": a colocated vLLM engine (the vllm
    # extra: pip install -e ".[vllm]" in the qerl clone).
    engine: EngineName = "hf"
    # Completions sampled per prompt: the GRPO group size.
    num_generations: int = 8
    # Prompt tokens at most; longer prompts are left out of the dataset.
    max_prompt_length: int = 256
    # Tokens generated per completion at most (a longer one is cut off: finish reason "length").
    max_completion_length: int = 2048
    # Sampling temperature of rollouts (> 0); the trainer's logprobs use the same one.
    temperature: float = 1.0
    # Nucleus sampling of rollouts, in (0, 1]; 1: off.
    top_p: float = 1.0
    # HF engine: prompts generated per forward batch (memory knob).
    generation_batch_size: int = 64
    # vLLM engine (colocated): its share of the whole GPU's memory. Paper: 0.2 for 3B, 0.3 for 7B, 0.45
    # for 14B, 0.4 for 32B. "auto": what is free once the trainer is loaded, less a margin
    # (qerl_cli.rl.memory).
    gpu_memory_utilization: float | Literal["auto"] = 0.3
    # "fp8": vLLM keeps its KV cache in FP8 (twice the concurrent tokens). Rollout numerics then
    # differ from the trainer's, so truncated importance sampling is forced on.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    # vLLM engine: free its weights and KV cache during the update, for the trainer's memory.
    enable_sleep_mode: bool = True
    # vLLM engine: the largest LoRA rank it accepts (at least lora.rank).
    max_lora_rank: int = 64
    # vLLM engine: GPUs one rollout engine spans (tensor parallel), for bases whose rollout share does
    # not fit one GPU (e.g. a 72B BF16 baseline). Single process only; torchrun ranks use 1 each.
    tensor_parallel_size: int = 1
    # Stop with an error when vLLM's and the trainer's logprobs on a probe prompt differ by more
    # than this mean absolute gap (nats/token) after an adapter sync.
    staleness_tolerance: float = 0.5
    # Warn loudly when a step's mean |trainer - rollout| logprob over its trained tokens (the metric
    # rollout_logprob_gap, nats/token) exceeds this: the rollout numerics (an FP8 copy, a merged
    # LoRA) then differ more from the trainer's than truncated importance sampling is meant to absorb.
    logprob_gap_warn: float = 0.25
    # vLLM engine: the kernels of the rollout model's linear layers. "marlin": vLLM's default for 4-bit
    # weights (weight-only, fastest at small batches); "humming": vLLM's Humming kernels (wgmma on
    # Hopper; the humming extra); "qerl-triton": qerl's own Triton W4A16 kernel served in vLLM (NVFP4
    # bases, a Hopper GPU, vLLM 0.26+, model.dtype bfloat16, tensor_parallel_size 1, vLLM's engine in this
    # process; slower than Marlin so far, docs/rollout.md); "fp8": an FP8
    # W8A8 rollout copy of the 4-bit base, derived once (the trainer keeps the 4-bit base; TIS on);
    # "fp8-merged": that copy with the LoRA merged in
    # after every update, vLLM without LoRA (on a BF16 base: "merged"); "merged": the LoRA merged into
    # BF16 weights after every update, vLLM without LoRA: a BF16 base's own, a 4-bit base's BF16 copy
    # (derived once; 2 bytes a weight in vLLM's memory, refused where that leaves no KV cache room).
    # Both merges need tensor_parallel_size 1 and lora.train_norms off. "auto": per GPU and the
    # round's concurrency, the fastest that fits, from crossover_table (qerl_cli.rollout.backends),
    # among the kernels that keep the checkpoint's numerics unless auto_fp8 is on.
    linear_backend: LinearBackend = "auto"
    # Let "auto" choose an FP8 copy of the weights (fp8, fp8-merged; vLLM's online FP8 for a BF16 base)
    # where it was measured faster. Off: an FP8 rollout rounds weights and activations once more, which
    # widens the rollout/trainer gap and can cost accuracy (docs/rollout.md). Pinning linear_backend to
    # fp8 or fp8-merged chooses them regardless.
    auto_fp8: bool = False
    # A crossover table (crossover.json of `qerl bench --concurrency`); empty: the one shipped with qerl.
    crossover_table: str | None = None
    # vLLM engine: extra keyword arguments of vllm.LLM (they win over qerl's own).
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)

    def hf_engine_settings(self, where: str = "rollout") -> str:
        """The ``--set`` options that move this rollout to the hf engine: a backend only vLLM serves goes
        back to auto, and tensor parallelism to one GPU, which the hf engine takes (else the recipe would
        refuse the remedy)."""
        settings = f"--set {where}.engine=hf"
        if self.linear_backend in VLLM_ONLY_LINEAR_BACKENDS:
            settings += f" --set {where}.linear_backend=auto"
        if self.tensor_parallel_size > 1:
            settings += f" --set {where}.tensor_parallel_size=1"
        return settings

    def validate(self, where: str) -> None:
        _positive(
            where,
            num_generations=self.num_generations,
            max_prompt_length=self.max_prompt_length,
            max_completion_length=self.max_completion_length,
            generation_batch_size=self.generation_batch_size,
            tensor_parallel_size=self.tensor_parallel_size,
            logprob_gap_warn=self.logprob_gap_warn,
        )
        _group_size(_key(where, "num_generations"), self.num_generations)
        if self.linear_backend in VLLM_ONLY_LINEAR_BACKENDS and self.engine != "vllm":
            raise QerlError(
                f"{where}.linear_backend={self.linear_backend} chooses vLLM kernels: set {where}.engine=vllm "
                "(the hf engine runs the trainer's own layers)"
            )
        if self.linear_backend == "qerl-triton" and self.tensor_parallel_size > 1:
            raise QerlError(
                f"{where}.linear_backend=qerl-triton needs {where}.tensor_parallel_size=1 (qerl registers "
                f"its kernel with vLLM in this process, which tensor-parallel workers do not share): use "
                f"{where}.linear_backend=marlin for tensor-parallel rollouts"
            )
        if self.linear_backend in MERGED_LINEAR_BACKENDS and self.tensor_parallel_size > 1:
            raise QerlError(
                f"{where}.linear_backend={self.linear_backend} needs {where}.tensor_parallel_size=1 "
                f"(the merge writes unsharded weights): use {where}.linear_backend=fp8 for tensor-parallel "
                "rollouts"
            )
        if self.tensor_parallel_size > 1 and self.engine != "vllm":
            raise QerlError(
                f"{where}.tensor_parallel_size={self.tensor_parallel_size} needs {where}.engine=vllm "
                "(the hf engine runs on one device)"
            )
        if self.temperature <= 0:
            raise QerlError(f"{where}.temperature must be > 0 for RL sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise QerlError(f"{where}.top_p must be in (0, 1], got {self.top_p}")
        _fraction_or_auto(f"{where}.gpu_memory_utilization", self.gpu_memory_utilization)


@dataclass
class AlgorithmSection:
    # "grpo" or "dapo" (DAPO's clip-higher, dynamic sampling and overlong shaping are each also a key here).
    name: Literal["grpo", "dapo"] = "grpo"
    # grpo: per-sequence mean then batch mean; dapo: token mean over the batch; dr_grpo: token sum
    # divided by batch x max completion length.
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    # Divide each group's mean-centred rewards by the group's standard deviation.
    scale_rewards_by_std: bool = True
    # Clip range below 1 of the importance ratio: 1 - eps_low.
    eps_low: float = 0.2
    # Clip range above 1 of the importance ratio: 1 + eps_high (DAPO's clip-higher when > eps_low).
    eps_high: float = 0.28
    beta: float = 0.0  # k3 KL to the adapter-free model (>= 0); 0 disables the reference pass
    num_iterations: int = 1  # updates per rollout batch
    # Truncated importance sampling between rollout-engine and trainer logprobs. "auto": on when
    # the rollout numerics differ from the trainer's (quantized base or AQN noise).
    tis: Literal["auto", "on", "off"] = "auto"
    # Truncated importance sampling: the largest rollout-to-trainer weight kept (>= 1).
    tis_cap: float = 2.0
    # DAPO: drop groups whose completions all got the same reward and sample more prompts.
    dynamic_sampling: bool = False
    # dynamic_sampling: rollout rounds per step at most to fill prompts_per_step groups.
    max_sampling_rounds: int = 3
    # DAPO's soft overlong punishment: completions within overlong_cache_length tokens of
    # rollout.max_completion_length lose up to overlong_penalty_factor of reward.
    overlong_penalty: bool = False
    # overlong_penalty: the last tokens before the length limit over which the penalty ramps up (0: a cliff at
    # the limit).
    overlong_cache_length: int = 512
    # overlong_penalty: the penalty at (and beyond) the length limit.
    overlong_penalty_factor: float = 1.0
    # Leave completions cut off by rollout.max_completion_length out of the loss.
    mask_truncated: bool = False

    def validate(self, where: str) -> None:
        _positive(where, num_iterations=self.num_iterations, max_sampling_rounds=self.max_sampling_rounds)
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise QerlError(f"{where}: eps_low must be in [0, 1) and eps_high >= 0")
        if self.tis_cap < 1:
            raise QerlError(f"{where}.tis_cap must be >= 1, got {self.tis_cap}")
        if self.beta < 0:  # a negative KL coefficient would reward moving away from the reference
            raise QerlError(f"{where}.beta must be >= 0 (0: no KL term), got {self.beta}")
        if self.overlong_cache_length < 0:
            raise QerlError(
                f"{where}.overlong_cache_length must be >= 0 (0: a cliff at the limit), got "
                f"{self.overlong_cache_length}"
            )


@dataclass
class AQNSection:
    # Adaptive quantization noise: perturb the rollout model's RMSNorm weights, decaying over training.
    enabled: bool = True
    # How sigma decays from sigma_start to sigma_end over the noisy stages.
    schedule: Literal["exponential", "linear", "cosine", "logarithmic"] = "exponential"
    # Stages of equal length over train.max_steps, each with one sigma.
    num_stages: int = 10
    # The first noisy stage's sigma (paper: 1e-2, decaying to 5e-4). With calibrate on, the calibration
    # finds sigma_start and sigma_end keeps the ratio sigma_end / sigma_start given here, so the decay
    # keeps its shape.
    sigma_start: float = 1e-2
    # The last noisy stage's sigma, at most sigma_start; 0 (no noise at the end) with a linear, cosine or
    # logarithmic schedule, above 0 with the exponential one.
    sigma_end: float = 1e-4
    # Stage 1 runs without noise; the decay spans the other num_stages - 1.
    first_stage_noise_free: bool = True
    # Size sigma to the model: a raw sigma does not transfer between models (docs/aqn.md: the paper's
    # stopped a small model from learning). "tokens": before the first step, bisect
    # sigma_start in log space until the noise changes `target` of the greedy completion tokens of
    # `calibration_prompts` training prompts (qerl_cli.rl.aqn_calibration); "off": the sigmas as given.
    # A KL target is not offered: the engine interface returns the logprobs of sampled tokens only, and
    # a KL needs the noisy model's logprobs of the clean model's tokens.
    calibrate: Literal["off", "tokens"] = "off"
    # With calibrate=tokens, in (0, 1): the share of greedy completion tokens the first noisy stage's
    # noise should change, every token from a completion's first changed one on (rl.aqn_calibration
    # .tokens_changed). No default: it is the choice calibration exists for (docs/aqn.md: the targets a
    # recipe sweeps).
    target: float | None = None
    # Training prompts the calibration (and each noisy stage's measurement, aqn_tokens_changed) decodes:
    # the first ones of the seeded prompt stream, read without moving it.
    calibration_prompts: int = 8
    # Greedy tokens per calibration completion; null: rollout.max_completion_length (what the target
    # means: a share of a rollout's length).
    calibration_max_tokens: int | None = None
    # calibrate=tokens: sigmas the bisection may try (each one greedy pass over the calibration prompts;
    # 10 narrow 1e-5..1e-1 to a bracket whose ends differ by a factor of about 1.01).
    calibration_probes: int = 10
    # calibrate=tokens: the bisection stops early once |effect - target| <= tolerance x target.
    calibration_tolerance: float = 0.2

    def validate(self, where: str) -> None:
        _positive(where, num_stages=self.num_stages)
        if self.enabled:
            _aqn_sigmas(where, self.sigma_start, self.sigma_end, self.schedule)
        _positive(
            where,
            calibration_prompts=self.calibration_prompts,
            calibration_probes=self.calibration_probes,
            calibration_tolerance=self.calibration_tolerance,
        )
        if self.calibration_max_tokens is not None:
            _positive(where, calibration_max_tokens=self.calibration_max_tokens)
        calibrating = self.enabled and self.calibrate == "tokens"
        if calibrating and not (self.target is not None and 0 < self.target < 1):
            raise QerlError(
                f"{where}.target must be in (0, 1) with {where}.calibrate=tokens: the share of greedy "
                f"completion tokens the noise should change, e.g. 0.03; got {self.target}"
            )


@dataclass
class TrainSection:
    # AdamW learning rate of the LoRA parameters.
    learning_rate: float = 1e-5
    # GRPO steps (one rollout batch and its update each).
    max_steps: int = 100
    # Prompts per step; each gets rollout.num_generations completions.
    prompts_per_step: int = 16
    # Sequences per forward/backward; "auto": the largest that fits the GPU (qerl_cli.rl.memory).
    micro_batch_size: int | Literal["auto"] = 8
    # Learning-rate schedule after warmup_steps.
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    # Steps of linear learning-rate warmup; 0: none (the first step takes the full rate).
    warmup_steps: int = 0
    # AdamW weight decay.
    weight_decay: float = 0.0
    # AdamW beta1.
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999  # QeRL's scripts use 0.99
    # Gradients are clipped to this global norm (> 0).
    max_grad_norm: float = 1.0
    # Consecutive steps whose loss or gradient norm is NaN/inf that are skipped (gradients zeroed, no
    # optimizer step, the record marked skipped_update and nonfinite_loss / nonfinite_grad) before the
    # next one ends the run with an error; 0: the first such step ends it.
    max_nonfinite_steps: int = 3
    # "auto": off when a large enough micro-batch fits without it (a third less compute).
    gradient_checkpointing: bool | Literal["auto"] = True
    # Completion tokens per LM-head chunk when computing logprobs (each costs chunk x vocab x 12 bytes:
    # float32 logits, softmax, gradient); 0: the whole micro-batch's [rows, length, vocab] logits at once.
    # "auto": 1024, or when memory is tight a smaller power of two down to 128 where that lets the
    # memory plan keep a large micro-batch or checkpointing off (qerl_cli.rl.memory).
    logprob_chunk_tokens: int | Literal["auto"] = "auto"
    # Fused RMSNorm / SwiGLU / RoPE kernels in the update (qerl_cli.modeling.fused_kernels). "auto":
    # Liger's when liger-kernel is installed and the model trains on a GPU; "liger": insist on them.
    fused_kernels: FusedKernels = "auto"
    # Concatenate a micro-batch's sequences into one row without padding (position ids restart at
    # each sequence, the attention kept within it): no compute on padding. Pays with a variable-length
    # attention (flash-attention); with SDPA the attention of a packed row is computed densely.
    pack_sequences: bool = False
    # The frozen 4-bit base's GEMMs in the update (qerl_cli.modeling.base_compute). bf16: dequantize the
    # packed weight per GEMM. fp8: FP8 E4M3 GEMMs (per-token activation scales) on two FP8 copies of
    # large base weight (>= 2^25 weights; smaller layers keep BF16), derived once and held all run: 2
    # bytes per such weight (the memory plan counts them), an error without a GPU of FP8 tensor cores
    # (compute capability >= 8.9) or no layer that large. auto: bf16 (fp8's measured gain was not worth
    # its memory: docs/train.md). A BF16 base always computes in BF16.
    base_compute: BaseCompute = "auto"
    # The fraction of the GPU's memory this run may use: the memory plan (qerl_cli.rl.memory) sizes
    # the micro-batch, checkpointing and vLLM's "auto" share within it. Below 1 when runs share a GPU
    # (`qerl compare --jobs N` sets it for each run); 1: the whole GPU, as measured free.
    gpu_fraction: float = 1.0
    # Seed of every random choice: the prompt order, sampling, the LoRA init (qerl_cli.rl.stream).
    seed: int = 0
    # "auto": CUDA when present, else the CPU; or cpu, cuda, cuda:N.
    device: str = "auto"

    def validate(self, where: str) -> None:
        _positive(
            where,
            learning_rate=self.learning_rate,
            max_steps=self.max_steps,
            prompts_per_step=self.prompts_per_step,
            max_grad_norm=self.max_grad_norm,  # clipped to <= 0, every gradient is zeroed or flipped
        )
        if self.micro_batch_size != "auto":
            _positive(where, micro_batch_size=self.micro_batch_size)
        if self.base_compute not in get_args(BaseCompute):
            raise QerlError(
                f"{where}.base_compute must be auto, bf16 or fp8 (the update's base GEMMs), got "
                f"{self.base_compute!r}: set it to auto unless you need one of them"
            )
        if self.logprob_chunk_tokens != "auto" and self.logprob_chunk_tokens < 0:
            raise QerlError(f"{where}.logprob_chunk_tokens must be >= 0 (0: no chunking) or auto")
        if self.warmup_steps < 0:
            raise QerlError(f"{where}.warmup_steps must be >= 0 (0: no warmup), got {self.warmup_steps}")
        if self.max_nonfinite_steps < 0:
            raise QerlError(
                f"{where}.max_nonfinite_steps must be >= 0, got {self.max_nonfinite_steps}: it is how many "
                "steps in a row with a NaN/inf loss or gradient norm are skipped; set 0 to stop at the first"
            )
        if not 0 < self.gpu_fraction <= 1:
            raise QerlError(
                f"{where}.gpu_fraction must be in (0, 1] (the fraction of the GPU's memory this run may "
                f"use; 1: all of it), got {self.gpu_fraction}"
            )

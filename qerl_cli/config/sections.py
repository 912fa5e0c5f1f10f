"""The sections of a training recipe (``model:``, ``lora:``, ``rollout:``, ...) and ``TrainConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from qerl_cli.config.checks import fraction_or_auto as _fraction_or_auto
from qerl_cli.config.checks import positive as _positive
from qerl_cli.errors import QerlError

QuantFormat = Literal["nvfp4", "mxfp4", "nf4"]
ModelFormat = Literal["auto", "bf16", "nvfp4", "mxfp4", "nf4"]
EngineName = Literal["hf", "vllm"]
LORA_TARGETS_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BENCHMARKS_ALL = ["gsm8k", "math500", "aime24", "aime25", "amc23"]
RESOLVED_CONFIG_NAME = "config.yaml"


# --------------------------------------------------------------------------------------------
# Sections shared by several stages
# --------------------------------------------------------------------------------------------
@dataclass
class ModelSection:
    # A hub id or a local folder (BF16, or a qerl / compressed-tensors / bitsandbytes 4-bit output).
    path: str = ""
    # "auto" reads the checkpoint's quantization_config; set it to insist on one format.
    format: ModelFormat = "auto"
    # Compute dtype of activations, LoRA and non-quantized layers.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    revision: str | None = None
    trust_remote_code: bool = False


@dataclass
class LoraSection:
    rank: int = 32
    alpha: int = 64
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS_ALL))
    # Train the RMSNorm weights too (the paper keeps them frozen; AQN perturbs the rollout copy).
    train_norms: bool = False
    # The adapter's start. "zeros": PEFT's (B = 0, so step 0 is the bare 4-bit base). "eora": B A starts
    # at the rank-r correction of the 4-bit rounding error W - deq(Q(W)) weighted by the calibration
    # activations (EoRA, arXiv 2410.21271), so step 0 is close to the BF16 model; "svd": the plain SVD
    # of that error. Both read <model.path>/lora_init/, written by `qerl quantize --lora-init eora|svd`;
    # the KL reference is then base + initial adapter (qerl_cli.rl.policy).
    init: Literal["zeros", "eora", "svd"] = "zeros"

    def validate(self, where: str) -> None:
        _positive(where, rank=self.rank, alpha=self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise QerlError(f"{where}.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class RolloutSection:
    engine: EngineName = "hf"
    num_generations: int = 8
    max_prompt_length: int = 256
    max_completion_length: int = 2048
    temperature: float = 1.0
    top_p: float = 1.0
    # HF engine: prompts generated per forward batch (memory knob).
    generation_batch_size: int = 64
    # vLLM engine (colocated). Paper: 0.2 for 3B, 0.3 for 7B, 0.45 for 14B, 0.4 for 32B. "auto":
    # what is free once the trainer is loaded, less a margin (qerl_cli.rl.memory).
    gpu_memory_utilization: float | Literal["auto"] = 0.3
    # "fp8": vLLM keeps its KV cache in FP8 (twice the concurrent tokens). Rollout numerics then
    # differ from the trainer's, so truncated importance sampling is forced on.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    enable_sleep_mode: bool = True
    max_lora_rank: int = 64
    # vLLM engine: GPUs one rollout engine spans (tensor parallel), for bases whose rollout share does
    # not fit one GPU (e.g. a 72B BF16 baseline). Single process only; torchrun ranks use 1 each.
    tensor_parallel_size: int = 1
    # Stop with an error when vLLM's and the trainer's logprobs on a probe prompt differ by more
    # than this mean absolute gap (nats/token) after an adapter sync.
    staleness_tolerance: float = 0.5
    # vLLM engine: the kernels of the rollout model's linear layers. "marlin": vLLM's default for 4-bit
    # weights (weight-only, fastest at small batches); "humming": vLLM's Humming kernels (wgmma on
    # Hopper; pip install "qerl[humming]"); "fp8": an FP8 W8A8 rollout copy of the 4-bit base, derived
    # once (the trainer keeps the 4-bit base; TIS on); "auto": per GPU and the round's concurrency, the
    # fastest that fits, from crossover_table (qerl_cli.rollout.backends).
    linear_backend: Literal["auto", "marlin", "humming", "fp8"] = "auto"
    # A crossover table (crossover.json of `qerl bench --concurrency`); empty: the one shipped with qerl.
    crossover_table: str | None = None
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)

    def validate(self, where: str) -> None:
        _positive(
            where,
            num_generations=self.num_generations,
            max_prompt_length=self.max_prompt_length,
            max_completion_length=self.max_completion_length,
            generation_batch_size=self.generation_batch_size,
            tensor_parallel_size=self.tensor_parallel_size,
        )
        if self.linear_backend in ("humming", "fp8") and self.engine != "vllm":
            raise QerlError(
                f"{where}.linear_backend={self.linear_backend} chooses vLLM kernels: set {where}.engine=vllm "
                "(the hf engine runs the trainer's own layers)"
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
    name: Literal["grpo", "dapo"] = "grpo"
    # grpo: per-sequence mean then batch mean; dapo: token mean over the batch; dr_grpo: token sum
    # divided by batch x max completion length.
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    scale_rewards_by_std: bool = True
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0  # k3 KL to the adapter-free model; 0 disables the reference pass
    num_iterations: int = 1  # updates per rollout batch
    # Truncated importance sampling between rollout-engine and trainer logprobs. "auto": on when
    # the rollout numerics differ from the trainer's (quantized base or AQN noise).
    tis: Literal["auto", "on", "off"] = "auto"
    tis_cap: float = 2.0
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    overlong_penalty: bool = False
    overlong_cache_length: int = 512
    overlong_penalty_factor: float = 1.0
    mask_truncated: bool = False

    def validate(self, where: str) -> None:
        _positive(where, num_iterations=self.num_iterations, max_sampling_rounds=self.max_sampling_rounds)
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise QerlError(f"{where}: eps_low must be in [0, 1) and eps_high >= 0")
        if self.tis_cap < 1:
            raise QerlError(f"{where}.tis_cap must be >= 1, got {self.tis_cap}")


@dataclass
class AQNSection:
    enabled: bool = True
    schedule: Literal["exponential", "linear", "cosine", "logarithmic"] = "exponential"
    num_stages: int = 10
    # The first noisy stage's sigma and the last one's (paper: 1e-2 -> 5e-4). With calibrate on, the
    # calibration finds sigma_start and sigma_end keeps the ratio sigma_end / sigma_start given here,
    # so the decay keeps its shape.
    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    first_stage_noise_free: bool = True
    # Size sigma to the model: a raw sigma does not transfer between models (on Gemma 3 270M the paper's
    # 1e-2 stopped learning, held-out 0.3% vs 17.1% without AQN). "tokens": before the first step, bisect
    # sigma_start in log space until the noise changes `target` of the greedy completion tokens of
    # `calibration_prompts` training prompts (qerl_cli.rl.aqn_calibration); "off": the sigmas as given.
    # A KL target is not offered: the engine interface returns the logprobs of sampled tokens only, and
    # a KL needs the noisy model's logprobs of the clean model's tokens.
    calibrate: Literal["off", "tokens"] = "off"
    # With calibrate=tokens, in (0, 1): the share of greedy completion tokens the first noisy stage's
    # noise should change, every token from a completion's first changed one on (modeling.aqn
    # .tokens_changed). No default: it is the choice calibration exists for (the Gemma sweep tries
    # 0.01, 0.03 and 0.10).
    target: float | None = None
    # Training prompts the calibration (and each noisy stage's measurement, aqn_tokens_changed) decodes:
    # the first ones of the seeded prompt stream, read without moving it.
    calibration_prompts: int = 8
    # Greedy tokens per calibration completion; None: rollout.max_completion_length (what the target
    # means: a share of a rollout's length).
    calibration_max_tokens: int | None = None
    # Sigmas the bisection may try (each one greedy pass over the calibration prompts; 10 narrow
    # 1e-5..1e-1 to a bracket 1% wide) and when it stops early: |effect - target| <= tolerance x target.
    calibration_probes: int = 10
    calibration_tolerance: float = 0.2

    def validate(self, where: str) -> None:
        _positive(where, num_stages=self.num_stages)
        if self.enabled and not self.sigma_start >= self.sigma_end > 0:
            raise QerlError(
                f"{where}: need sigma_start >= sigma_end > 0 (got {self.sigma_start}, {self.sigma_end})"
            )
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
class DataSection:
    # A registered name (gsm8k, bigmath, synthetic-addition, ...), a hub id, or a .jsonl/.parquet file.
    dataset: str = "gsm8k"
    split: str = "train"
    prompt_field: str | None = None  # None: the registered dataset's own field
    answer_field: str | None = None
    # BigMath difficulty levels to keep (e.g. [3, 4, 5]); empty keeps all.
    levels: list[int] = field(default_factory=list)
    max_samples: int | None = None
    template: str = "qerl"  # prompt template name, shared with eval
    system_prompt: str | None = None
    shuffle: bool = True


@dataclass
class RewardSection:
    correctness_weight: float = 1.0
    format_weight: float = 0.0
    # Extra reward functions by import path ("pkg.module:function") -> weight.
    extra: dict[str, float] = field(default_factory=dict)
    grader_timeout_s: float = 5.0
    grader_workers: int = 2


@dataclass
class TrainSection:
    learning_rate: float = 1e-5
    max_steps: int = 100
    prompts_per_step: int = 16
    # Sequences per forward/backward; "auto": the largest that fits the GPU (qerl_cli.rl.memory).
    micro_batch_size: int | Literal["auto"] = 8
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999  # QeRL's scripts use 0.99
    max_grad_norm: float = 1.0
    # "auto": off when a large enough micro-batch fits without it (a third less compute).
    gradient_checkpointing: bool | Literal["auto"] = True
    # Completion tokens per LM-head chunk when computing logprobs (0: the whole micro-batch's
    # [rows, length, vocab] logits at once).
    logprob_chunk_tokens: int = 1024
    # Fused RMSNorm / SwiGLU / RoPE kernels in the update (qerl_cli.modeling.fused_kernels). "auto":
    # Liger's when liger-kernel is installed and the model trains on a GPU; "liger": insist on them.
    fused_kernels: Literal["auto", "liger", "off"] = "auto"
    # Concatenate a micro-batch's sequences into one row without padding (position ids restart at
    # each sequence, the attention kept within it): no compute on padding. Pays with a variable-length
    # attention (flash-attention); with SDPA the attention of a packed row is computed densely.
    pack_sequences: bool = False
    # The fraction of the GPU's memory this run may use: the memory plan (qerl_cli.rl.memory) sizes
    # the micro-batch, checkpointing and vLLM's "auto" share within it. Below 1 when runs share a GPU
    # (`qerl compare --jobs N` sets it for each run); 1: the whole GPU, as measured free.
    gpu_fraction: float = 1.0
    seed: int = 0
    device: str = "auto"

    def validate(self, where: str) -> None:
        _positive(
            where,
            learning_rate=self.learning_rate,
            max_steps=self.max_steps,
            prompts_per_step=self.prompts_per_step,
        )
        if self.micro_batch_size != "auto":
            _positive(where, micro_batch_size=self.micro_batch_size)
        if self.logprob_chunk_tokens < 0:
            raise QerlError(f"{where}.logprob_chunk_tokens must be >= 0 (0: no chunking)")
        if not 0 < self.gpu_fraction <= 1:
            raise QerlError(
                f"{where}.gpu_fraction must be in (0, 1] (the fraction of the GPU's memory this run may "
                f"use; 1: all of it), got {self.gpu_fraction}"
            )


@dataclass
class OutputSection:
    dir: str = "runs/qerl"
    save_steps: int = 50
    save_total_limit: int | None = 3
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "qerl"
    # Prompt groups a step whose completions (text, reward, finish reason) go to completions.jsonl: a
    # record of what the reward paid for. On Gemma 3 270M GRPO learned to answer "94 + 58" (graded equal
    # to 152) within 40 steps, and only the held-out evaluation showed it (issue 22). 0: none.
    log_completions: int = 1

    def validate(self, where: str) -> None:
        if self.log_completions < 0:
            raise QerlError(f"{where}.log_completions must be >= 0 (0: none), got {self.log_completions}")


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    aqn: AQNSection = field(default_factory=AQNSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    train: TrainSection = field(default_factory=TrainSection)
    output: OutputSection = field(default_factory=OutputSection)
    # `qerl compare` settings (arms, threshold, held-out size; see qerl_cli.compare.arms). Ignored by
    # `qerl train`, so one recipe serves both.
    compare: dict[str, Any] = field(default_factory=dict)

    def validate(self, where: str = "") -> None:
        if not self.model.path:
            raise QerlError("model.path is empty: set it in the recipe or with --set model.path=DIR")
        share, fraction = self.rollout.gpu_memory_utilization, self.train.gpu_fraction
        if self.rollout.engine == "vllm" and share != "auto" and float(share) > fraction:
            raise QerlError(
                f"rollout.gpu_memory_utilization={share} (a fraction of the whole GPU) is more than "
                f"train.gpu_fraction={fraction}, the part of the GPU this run may use: lower it to at "
                "most the fraction, or set it to auto"
            )

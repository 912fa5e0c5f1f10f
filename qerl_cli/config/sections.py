"""The sections of a training recipe (``model:``, ``lora:``, ``data:``, ``reward:``, ``output:``) and
``TrainConfig``, which holds them with the sections of the RL loop (``rollout:``, ``algorithm:``, ``aqn:``,
``train:``), defined in ``rl_sections.py`` and importable from here as before."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from qerl_cli.config.checks import empty_means, needs_items
from qerl_cli.config.checks import positive as _positive
from qerl_cli.config.choices import (
    LORA_TARGETS_ALL,
    MERGED_LINEAR_BACKENDS,
    LoraInit,
    ModelFormat,
)
from qerl_cli.config.rl_sections import AlgorithmSection, AQNSection, RolloutSection, TrainSection
from qerl_cli.errors import QerlError


# --------------------------------------------------------------------------------------------
# Sections shared by several stages
# --------------------------------------------------------------------------------------------
@dataclass
class ModelSection:
    # A hub id, a local folder (BF16, or a qerl / compressed-tensors / bitsandbytes 4-bit output), a .gguf
    # file or a model alias (qerl models).
    path: str = ""
    # "auto" reads the checkpoint's quantization_config; set it to insist on one format.
    format: ModelFormat = "auto"
    # Compute dtype of activations, LoRA and non-quantized layers.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # Hub revision (branch, tag or commit) of model.path; null: the default branch.
    revision: str | None = None
    # Run the model repository's own modeling code (Hugging Face trust_remote_code).
    trust_remote_code: bool = False


@dataclass
class LoraSection:
    # LoRA rank r of every adapted layer.
    rank: int = 32
    # LoRA alpha: the update B A is scaled by alpha / rank.
    alpha: int = 64
    # Dropout on the LoRA input, in [0, 1).
    dropout: float = 0.0
    # Linear layers that get an adapter, by module name (default: every attention and MLP projection).
    target_modules: list[str] = field(
        default_factory=lambda: list(LORA_TARGETS_ALL),
        metadata=needs_items("module", f"e.g. q_proj,v_proj; the default: {','.join(LORA_TARGETS_ALL)}"),
    )
    # Train the RMSNorm weights too (the paper keeps them frozen; AQN perturbs the rollout copy). The hf
    # engine only: vLLM serves an adapter's LoRA matrices only, so rollout.engine=vllm refuses it.
    train_norms: bool = False
    # The adapter's start. "zeros": PEFT's (B = 0, so step 0 is the bare 4-bit base). "eora": B A starts
    # at the rank-r correction of the 4-bit rounding error W - deq(Q(W)) weighted by the calibration
    # activations (EoRA, arXiv 2410.21271), so step 0 is close to the BF16 model; "svd": the plain SVD
    # of that error. Both read <model.path>/lora_init/, written by `qerl quantize --lora-init eora|svd`;
    # the KL reference is then base + initial adapter (qerl_cli.rl.policy).
    init: LoraInit = "zeros"

    def validate(self, where: str) -> None:
        _positive(where, rank=self.rank, alpha=self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise QerlError(f"{where}.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class DataSection:
    # A registered name (gsm8k, bigmath, synthetic-addition, ...), a hub id, or a .jsonl/.parquet file.
    dataset: str = "gsm8k"
    # Split of the dataset to train on.
    split: str = "train"
    # Field holding the question; null: the registered dataset's own field.
    prompt_field: str | None = None
    # Field holding the gold answer; null: the registered dataset's own field.
    answer_field: str | None = None
    # BigMath difficulty levels to keep (e.g. [3, 4, 5]); empty keeps all.
    levels: list[int] = field(default_factory=list, metadata=empty_means("every level is kept"))
    # Use only the first N problems; null: all.
    max_samples: int | None = None
    template: str = "qerl"  # prompt template name, shared with eval
    # System message of the chat prompt; null: the template's own.
    system_prompt: str | None = None
    # Shuffle the prompts (seeded by train.seed); off: the dataset's order.
    shuffle: bool = True


@dataclass
class RewardSection:
    # Weight of the correctness reward (1 when the graded answer equals the gold one).
    correctness_weight: float = 1.0
    # Weight of the format reward (1 when the completion has the template's answer format, e.g. QeRL's tags).
    format_weight: float = 0.0
    # Extra reward functions by import path ("pkg.module:function") -> weight.
    extra: dict[str, float] = field(default_factory=dict)
    # Seconds a grader may take on one answer before it is killed and the answer scored wrong.
    grader_timeout_s: float = 5.0
    # Grader worker processes.
    grader_workers: int = 2

    def validate(self, where: str) -> None:
        # Refused here, not by the grader pool once the model has loaded.
        _positive(where, grader_timeout_s=self.grader_timeout_s, grader_workers=self.grader_workers)


@dataclass
class OutputSection:
    # Folder of the run: checkpoints, metrics.jsonl, config.yaml, the final adapter.
    dir: str = "runs/qerl"
    # Write a checkpoint (what --resume starts from) every N steps; 0: none during the run, so it cannot
    # be resumed (the final adapter is still written at the end).
    save_steps: int = 50
    # Checkpoints kept, at least 1 (the oldest are deleted); null: all.
    save_total_limit: int | None = 3
    # Also log the metrics to TensorBoard (under dir).
    tensorboard: bool = False
    # Also log the metrics to Weights & Biases.
    wandb: bool = False
    # wandb: the project name.
    wandb_project: str = "qerl"
    # Prompt groups a step whose completions (text, reward, finish reason) go to completions.jsonl: a
    # record of what the reward paid for: a reward hack shows there, not in the reward curve
    # (docs/rewards.md). 0: none.
    log_completions: int = 1

    def validate(self, where: str) -> None:
        if self.save_steps < 0:
            raise QerlError(f"{where}.save_steps must be >= 0 (0: no checkpoints), got {self.save_steps}")
        if self.log_completions < 0:
            raise QerlError(f"{where}.log_completions must be >= 0 (0: none), got {self.log_completions}")
        if self.save_total_limit is not None and self.save_total_limit < 1:  # else all were kept
            raise QerlError(
                f"{where}.save_total_limit must be >= 1 (null: all checkpoints kept; output.save_steps=0 "
                f"writes none), got {self.save_total_limit}"
            )


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
    # `qerl compare` settings (arms, threshold, held-out problems and samples, the verdicts' reference
    # and margin, batch-invariant vLLM; see qerl_cli.compare.arms). Ignored by `qerl train`, so one
    # recipe serves both.
    compare: dict[str, Any] = field(default_factory=dict)

    def validate(self, where: str = "") -> None:
        if not self.model.path:
            raise QerlError("model.path is empty: set it in the recipe or with --set model.path=DIR")
        if self.rollout.engine == "vllm" and self.lora.train_norms:
            backend = self.rollout.linear_backend
            serves = (
                f"rollout.linear_backend={backend} merges the LoRA factors only"
                if backend in MERGED_LINEAR_BACKENDS
                else "vLLM serves an adapter's LoRA matrices only"
            )
            raise QerlError(
                f"lora.train_norms=true with rollout.engine=vllm: {serves}, so the trained norms would stay "
                "stale in the rollouts: set lora.train_norms=false, or sample on the trainer's own layers "
                f"with {self.rollout.hf_engine_settings()}"
            )
        share, fraction = self.rollout.gpu_memory_utilization, self.train.gpu_fraction
        if self.rollout.engine == "vllm" and share != "auto" and float(share) > fraction:
            raise QerlError(
                f"rollout.gpu_memory_utilization={share} (a fraction of the whole GPU) is more than "
                f"train.gpu_fraction={fraction}, the part of the GPU this run may use: lower it to at "
                "most the fraction, or set it to auto"
            )

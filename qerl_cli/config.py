"""Typed configuration for every stage: recipe YAML + ``--set a.b=value`` overrides, validated.

A recipe is a YAML mapping of sections (``model:``, ``train:``, ...) onto the dataclasses below.
Loading is strict: an unknown key fails with the closest valid name, a wrong type names the key,
the value and the expected type. Values are converted to the field's type where that is lossless
and unsurprising (``"2e-5"`` -> 2e-5 for a float field, since YAML 1.1 reads ``2e-5`` as a string).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

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
    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    first_stage_noise_free: bool = True

    def validate(self, where: str) -> None:
        _positive(where, num_stages=self.num_stages)
        if self.enabled and not self.sigma_start >= self.sigma_end > 0:
            raise QerlError(
                f"{where}: need sigma_start >= sigma_end > 0 (got {self.sigma_start}, {self.sigma_end})"
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


@dataclass
class OutputSection:
    dir: str = "runs/qerl"
    save_steps: int = 50
    save_total_limit: int | None = 3
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "qerl"


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


# --------------------------------------------------------------------------------------------
# Quantize, eval, bench
# --------------------------------------------------------------------------------------------
@dataclass
class QuantizeConfig:
    model: str = ""
    format: QuantFormat = "nvfp4"
    method: Literal["awq", "rtn"] = "awq"
    calib: str = "open-thoughts/OpenThoughts-114k"
    calib_split: str = "train"
    # Field holding chat messages (rendered with the model's chat template) or plain text.
    calib_field: str | None = None
    num_samples: int = 256
    seq_len: int = 2048
    output: str | None = None  # default ./<model-name>-<FORMAT>
    overwrite: bool = False
    skip_incompatible: bool = False
    eval_ppl: bool = False
    seed: int = 42
    device: str = "auto"
    trust_remote_code: bool = False

    def validate(self, where: str = "") -> None:
        if not self.model:
            raise QerlError("no model given: pass a hub id or a local folder")
        _positive(where or "quantize", num_samples=self.num_samples, seq_len=self.seq_len)


@dataclass
class EvalConfig:
    model: str = ""
    adapter: str | None = None
    benchmarks: list[str] = field(default_factory=lambda: list(BENCHMARKS_ALL))
    # Samples per problem; 0 takes the benchmark's default (4 for gsm8k/math500, 16 for aime/amc).
    samples: int = 0
    engine: EngineName = "vllm"
    data_files: dict[str, str] = field(default_factory=dict)
    output: str = "eval_results"
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 4096
    max_problems: int | None = None
    seed: int = 0
    template: str = "qerl"
    system_prompt: str | None = None
    grader_timeout_s: float = 5.0
    grader_workers: int = 2
    gpu_memory_utilization: float = 0.85
    # The linear kernels under vLLM, as rollout.linear_backend (qerl_cli.rollout.backends). "marlin" by
    # default: an evaluation scores the 4-bit weights exactly as trained; "auto" / "fp8" may serve the FP8
    # copy (faster at high concurrency, one more rounding of every weight).
    linear_backend: Literal["auto", "marlin", "humming", "fp8"] = "marlin"
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    rescore: str | None = None
    baseline: str | None = None
    trust_remote_code: bool = False
    # HF engine: device ("auto": CUDA when present), compute dtype, sequences per generate call.
    device: str = "auto"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    generation_batch_size: int = 64

    def validate(self, where: str = "") -> None:
        unknown = [
            b
            for b in self.benchmarks
            if b not in BENCHMARKS_ALL and b not in self.data_files and not b.startswith("synthetic-")
        ]
        if unknown:
            raise QerlError(
                f"unknown benchmark(s) {unknown}: choose from {BENCHMARKS_ALL} "
                "or give a file with --data-file NAME=PATH"
            )
        if not self.rescore and not self.model:
            raise QerlError("no model given: pass a hub id or a local folder (or --rescore DIR)")


@dataclass
class BenchConfig:
    # A SHAPE name (qwen2.5-0.5b ... qwen2.5-72b, tiny), a hub id or a local folder. Empty: qwen2.5-7b
    # on a GPU with vLLM, the tiny shape with the HF engine elsewhere.
    model: str = ""
    # Defaults sized for a CI job (issue 11: within 10 minutes on one H100): three engine starts, 512
    # generated tokens. On Hopper vLLM serves MXFP4 through the same Marlin FP4 kernels as NVFP4 (add it
    # with --formats); RL lengths are --gen-len 2048 or 4096, and --e2e --e2e-recipe for a whole step.
    formats: list[str] = field(default_factory=lambda: ["bf16", "nf4", "nvfp4"])
    batch: list[int] = field(default_factory=lambda: [2, 8])
    prompt_len: int = 256
    gen_len: int = 512
    lora_rank: int = 16
    engine: EngineName | Literal["auto"] = "auto"
    e2e: bool = False
    output: str = "bench_results"
    baseline: str | None = None
    tolerance: float = 0.1
    warmup: int = 1
    repeats: int = 3
    gpu_memory_utilization: float = 0.85
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    # --e2e: completions per prompt, prompts per step (0: the largest --batch) and vLLM's share of
    # the GPU when colocated with the trainer (paper: 0.3 for 7B; "auto": rl.memory decides), the
    # same for every format. ``e2e_recipe``: a training recipe whose step shape (prompts per step,
    # generations, prompt and completion lengths, micro-batch, checkpointing, KV dtype) the e2e
    # step takes; flags given explicitly win over it.
    e2e_generations: int = 8
    e2e_prompts_per_step: int = 0
    e2e_gpu_memory_utilization: float | Literal["auto"] | None = None  # None: the recipe's, else 0.3
    e2e_recipe: str | None = None
    # --e2e: rollout.linear_backend of the timed steps (the recipe's when it sets one).
    e2e_linear_backend: Literal["auto", "marlin", "humming", "fp8"] | None = None
    # --concurrency: sequences generated at once (instead of --batch), each measured on every linear
    # backend of ``backends`` the format has (qerl_cli.rollout.backends); writes crossover.json, the
    # table rollout.linear_backend=auto reads, and each figure's fraction of the GPU's roofline.
    concurrency: list[int] = field(default_factory=list)
    backends: list[str] = field(default_factory=lambda: ["marlin", "humming", "fp8"])

    def validate(self, where: str = "") -> None:
        _positive(where or "bench", prompt_len=self.prompt_len, gen_len=self.gen_len, repeats=self.repeats)
        if not self.batch or any(b <= 0 for b in self.batch):
            raise QerlError(f"--batch needs positive integers, got {self.batch}")
        if any(c <= 0 for c in self.concurrency):
            raise QerlError(f"--concurrency needs positive integers, got {self.concurrency}")
        unknown = sorted(set(self.backends) - {"marlin", "humming", "fp8"})
        if unknown:
            raise QerlError(f"--backends: unknown {unknown}; choose from marlin, humming, fp8")
        _positive(where or "bench", e2e_generations=self.e2e_generations)
        if self.e2e_prompts_per_step < 0:
            raise QerlError(
                f"--prompts-per-step must be >= 0 (0: the largest --batch), got {self.e2e_prompts_per_step}"
            )
        if self.e2e_gpu_memory_utilization is not None:
            _fraction_or_auto("e2e_gpu_memory_utilization", self.e2e_gpu_memory_utilization)


# --------------------------------------------------------------------------------------------
# Machinery: dict -> dataclass with strict checking, overrides, dumping
# --------------------------------------------------------------------------------------------
C = TypeVar("C")


def _fraction_or_auto(name: str, value: float | str) -> None:
    if value != "auto" and not 0 < float(value) < 1:
        raise QerlError(f"{name} must be in (0, 1) or auto, got {value}")


def _positive(where: str, **values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise QerlError(f"{where}.{name} must be > 0, got {value}")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    """Raised internally when a value does not fit a type; turned into a QerlError with the key.

    ``detail`` says which part of a list or mapping was wrong ("item 2 ('abc') is not int")."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail


def _coerce(value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise _Mismatch
    if origin in (typing.Union, types.UnionType):
        details = []
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg)
            except _Mismatch as exc:
                details.append(exc.detail)
        raise _Mismatch(next((d for d in details if d), ""))
    if tp is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # --set train.batch=2,8 and CLI lists
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise _Mismatch
        items = []
        for index, v in enumerate(value, 1):
            try:
                items.append(_coerce(_scalar(v) if isinstance(v, str) else v, item))
            except _Mismatch:
                raise _Mismatch(f"item {index} ({v!r}) is not {_type_name(item)}") from None
        return items
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _Mismatch
        entries = {}
        for k, v in value.items():
            try:
                entries[_coerce(k, key_tp)] = _coerce(v, val_tp)
            except _Mismatch:
                raise _Mismatch(f"entry {k!r}: {v!r} is not {_type_name(val_tp)}") from None
        return entries
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads 1e-5 (no dot) as a string
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # e.g. a numeric revision or dataset split name
        raise _Mismatch
    raise TypeError(f"unsupported config type {tp!r}")


def _scalar(text: str) -> Any:
    """Parse one ``--set`` value the way YAML would (``true``, ``3``, ``[1, 2]``, ``null``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for name, tp in _field_types(cls).items():
        path = f"{prefix}{name}"
        keys.append(path)
        if dataclasses.is_dataclass(tp):
            keys.extend(_all_keys(tp, f"{path}."))
    return keys


def _unknown_key(root: type, root_prefix: str, path: str) -> QerlError:
    close = difflib.get_close_matches(path, _all_keys(root, root_prefix), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return QerlError(f"unknown config key '{path}'{hint}")


def from_dict(
    cls: type[C], data: dict[str, Any], *, prefix: str = "", _root: tuple[type, str] | None = None
) -> C:
    """Build dataclass ``cls`` from a nested mapping, strictly (unknown keys and bad types fail).

    ``prefix``: where the mapping sits in a larger file (``"compare."``), for the keys that errors name.
    """
    root = _root or (cls, prefix)
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the recipe"
        raise QerlError(f"{where} must be a mapping of keys to values, got {type(data).__name__}")
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in types_:
            raise _unknown_key(*root, path)
        tp = types_[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value if value is not None else {}, prefix=f"{path}.", _root=root)
            continue
        try:
            kwargs[key] = _coerce(value, tp)
        except _Mismatch as exc:
            detail = f": {exc.detail}" if exc.detail else ""
            raise QerlError(
                f"config key '{path}' has value {value!r} ({type(value).__name__}); "
                f"expected {_type_name(tp)}{detail}"
            ) from None
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def apply_overrides(data: dict[str, Any], overrides: list[str], root: type) -> dict[str, Any]:
    """Apply ``a.b=value`` strings to a nested mapping (validated later by ``from_dict``)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise QerlError(f"--set expects KEY=VALUE (e.g. train.learning_rate=2e-5), got '{item}'")
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise QerlError(f"--set {key}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
            node = child
        node[parts[-1]] = _scalar(raw)
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise QerlError(f"recipe file not found: {path} (recipes/ holds the shipped ones)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise QerlError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise QerlError(f"{path} must hold a mapping of sections (model:, train:, ...)")
    return data


def validate(config: Any, prefix: str = "") -> None:
    """Run ``validate(where)`` on the config and every nested section that defines one."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            validate(value, f"{prefix}{f.name}.")
    check = getattr(config, "validate", None)
    if check is not None:
        check(prefix.rstrip(".") or type(config).__name__)


def load_config(
    cls: type[C], recipe: str | Path | None = None, overrides: list[str] | None = None, **values: Any
) -> C:
    """Recipe file (optional) < keyword values (CLI flags, None = not given) < ``--set`` overrides."""
    data = read_yaml(recipe) if recipe else {}
    for key, value in values.items():
        if value is not None:
            data[key] = value
    data = apply_overrides(data, list(overrides or []), cls)
    config = from_dict(cls, data)
    validate(config)
    return config


def dump_yaml(config: Any) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)


def save_resolved_config(config: Any, out_dir: str | Path) -> Path:
    """Every run keeps the exact configuration it ran with beside its outputs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESOLVED_CONFIG_NAME
    path.write_text(dump_yaml(config))
    return path

"""The settings of ``qerl bench kernels``, ``update`` and ``quality``: what ``--config`` / ``--set`` and
their flags resolve to, each field documented by the comment above it, each class checking its own values
(``validate``, a :class:`~qerl_cli.config.checks.ConfigValueError` naming the key, which the CLI turns
into the flag that set it).

They live here, apart from the benchmarks that run them, because those modules import torch and the
settings are read and checked before it is (``bench.json``'s three use ``config.BenchConfig`` and
:class:`E2EConfig`, here too, with a recipe's step shape). Values with a choice are
typed with the config's aliases (``BaseCompute``, ``FusedKernels``), their one home.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from qerl_cli.config import BenchConfig, QuantFormat, QuantMethod, TrainConfig, checks, load_config
from qerl_cli.config.checks import ConfigValueError, key
from qerl_cli.config.choices import BaseCompute, FusedKernels, LinearBackend
from qerl_cli.errors import QerlError

# bench quality's rows when none are given (its AWQ row only where llm-compressor is installed).
DEFAULT_QUALITY_ROWS = ["nvfp4-rtn", "nvfp4-awq", "mxfp4-rtn", "nf4-rtn"]
CHECKPOINTING = {"auto": "auto", "on": True, "off": False}
# Prompt and completion tokens of the default bench on the CPU (the tiny model, the HF engine), unless
# given: the GPU's 256 + 512 are ten times the decode steps (a run of them printed nothing for a quarter
# of an hour); with these the default bench took 86 s on a 2-core machine shared with other work. Applied
# by bench/plan.apply_cpu_lengths; here, torch-free, for the flags' --help to say.
CPU_LENGTHS = {"prompt_len": 64, "gen_len": 32}


def auto_last(alias: Any) -> list[str]:
    """An alias's values as the bench's messages list them: the explicit ones, then ``auto``."""
    values = list(get_args(alias))
    return [v for v in values if v != "auto"] + [v for v in values if v == "auto"]


def report_settings(settings: Any) -> dict[str, Any]:
    """The settings a report records: all but the output folder (the report is in it)."""
    return {k: v for k, v in asdict(settings).items() if k != "output"}


def positive_ints(where: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigValueError(key(where, name), f"must be a positive integer, got {value}")


def check_choices(flag: str, given: str | None, alias: Any) -> list[str] | None:
    """A flag's comma list checked against the config alias of its values (None: not given); the
    message lists them. (A --set or --config value is checked by the config's typed loading.)"""
    if given is None:
        return None
    chosen = [v.strip() for v in given.split(",") if v.strip()]
    if not chosen or set(chosen) - set(get_args(alias)):
        raise QerlError(f"{flag} takes a comma list of {', '.join(auto_last(alias))}; got {given!r}")
    return chosen


@dataclass
class KernelsSettings:
    # SHAPE (qwen2.5-7b, tiny, ...; random weights in each format) or a BF16 folder; null: qwen2.5-7b on
    # a GPU, else tiny.
    model: str | None = None
    # The 4-bit formats (and bf16) measured.
    formats: list[str] = field(
        default_factory=lambda: ["nvfp4", "mxfp4", "nf4"], metadata=checks.needs_items("format", "e.g. nvfp4")
    )
    # Sequences through the layer.
    batch: int = 8
    # Tokens per sequence.
    seq_len: int = 1024
    # Timed calls per figure (the median is reported).
    iters: int = 10
    # auto, cpu or cuda[:N].
    device: str = "auto"
    # Folder of kernels.json.
    output: str = "bench_results"

    def validate(self, where: str = "") -> None:
        self.formats = [f.lower() for f in self.formats]
        positive_ints(where, batch=self.batch, seq_len=self.seq_len, iters=self.iters)


@dataclass
class UpdateSettings:
    # SHAPE (qwen2.5-7b, tiny, ...; random weights in each format) or a BF16 folder; null: qwen2.5-7b on
    # a GPU, else tiny.
    model: str | None = None
    # The base formats measured.
    formats: list[str] = field(
        default_factory=lambda: ["bf16", "nvfp4"], metadata=checks.needs_items("format", "e.g. bf16,nvfp4")
    )
    # train.fused_kernels per case; null: off,liger with liger-kernel installed, else off.
    fused: list[FusedKernels] | None = field(
        default=None, metadata=checks.needs_items("kind", "e.g. off,liger")
    )
    # train.base_compute per case (the 4-bit base's GEMMs): bf16,fp8 measures both side by side.
    base_compute: list[BaseCompute] = field(
        default_factory=lambda: ["bf16"], metadata=checks.needs_items("kind", "e.g. bf16,fp8")
    )
    # Rollouts in the batch.
    sequences: int = 32
    # Completions per prompt.
    group: int = 8
    # Prompt tokens.
    prompt_len: int = 256
    # Completion tokens.
    gen_len: int = 2048
    # Sequences per micro-batch, or auto (the memory plan's).
    micro_batch: int | str = "auto"
    # Gradient checkpointing: auto, on or off (on / off resolve to true / false).
    checkpointing: bool | str = "auto"
    # Pack sequences (train.pack_sequences).
    pack: bool = False
    # LoRA rank.
    lora_rank: int = 16
    # Also the GPU time by kernel category (CUDA profiler; a GPU only).
    profile: bool = False
    # auto, cpu or cuda[:N].
    device: str = "auto"
    # Seed of the random rollouts.
    seed: int = 0
    # Folder of update.json.
    output: str = "bench_results"

    def validate(self, where: str = "") -> None:
        self.formats = [f.lower() for f in self.formats]
        positive_ints(where, sequences=self.sequences, group=self.group, prompt_len=self.prompt_len,
                      gen_len=self.gen_len, lora_rank=self.lora_rank)  # fmt: skip
        if self.sequences % self.group:  # GRPO's groups: every prompt has `group` completions
            raise ConfigValueError(key(where, "sequences"), f"({self.sequences}) must be a multiple of "
                                   f"--group ({self.group})")  # fmt: skip
        if self.micro_batch != "auto":
            text = str(self.micro_batch)
            if not text.isdigit():
                raise ConfigValueError(
                    key(where, "micro_batch"), f"takes a positive integer or auto, got {text!r}"
                )
            self.micro_batch = int(text)
            positive_ints(where, micro_batch=self.micro_batch)
        if isinstance(self.checkpointing, str):
            if self.checkpointing not in CHECKPOINTING:
                raise ConfigValueError(
                    key(where, "checkpointing"), f"takes auto, on or off; got {self.checkpointing!r}"
                )
            self.checkpointing = CHECKPOINTING[self.checkpointing]


@dataclass
class QualitySettings:
    # The BF16 model (folder, .gguf or alias).
    model: str = ""
    # The bases to make and measure, FORMAT-METHOD each; null: the default rows (the awq row only with
    # llm-compressor installed).
    rows: list[str] | None = field(
        default=None, metadata=checks.needs_items("FORMAT-METHOD", "e.g. nvfp4-rtn")
    )
    # Calibration rows of qerl-text (awq, gptq).
    calib_samples: int = 48
    # Tokens per row.
    seq_len: int = 256
    # Held-out rows the bases are measured on.
    heldout_rows: int = 64
    # auto, cpu or cuda[:N].
    device: str = "auto"
    # Folder of quality.json and quality.md.
    output: str = "bench_results"

    def validate(self, where: str = "") -> None:
        if self.rows is not None:
            self.rows = [r.lower() for r in self.rows]
        positive_ints(where, calib_samples=self.calib_samples, heldout_rows=self.heldout_rows)
        if self.seq_len < 2:
            raise ConfigValueError(key(where, "seq_len"), f"must be >= 2, got {self.seq_len}")


@dataclass
class E2EConfig(BenchConfig):
    """``qerl bench e2e``'s settings: the bench keys it shares with ``rollout`` (model, formats, lengths,
    LoRA rank, engine, output, the gate, warm-up and repeats) and the GRPO step's own below."""

    # Completions per prompt (the group size of the timed steps).
    generations: int = 8
    # Prompts per step (0: the largest batch, 8 by default).
    prompts_per_step: int = 0
    # vLLM's share of the GPU colocated with the trainer, the same for every format (paper: 0.3 for 7B;
    # "auto": rl.memory decides); null: the recipe's, else 0.3.
    gpu_memory_utilization: float | Literal["auto"] | None = None  # type: ignore[assignment]
    # A training recipe whose step shape (prompts per step, generations, prompt and completion lengths,
    # micro-batch, checkpointing, KV dtype) the step takes; flags given explicitly win over it.
    recipe: str | None = None
    # rollout.linear_backend of the timed steps: one, or a list timed side by side in this run (each
    # format on every backend that applies to it, once: bench/e2e_backends.py); null: the recipe's
    # when it sets one, else auto. The hf engine has none: only auto.
    linear_backend: list[LinearBackend] | None = field(
        default=None, metadata=checks.needs_items("backend", "e.g. marlin,fp8")
    )
    # train.base_compute of the timed steps (the recipe's when it sets one, else auto).
    base_compute: BaseCompute | None = None

    def validate(self, where: str = "") -> None:
        super().validate(where)
        checks.group_size(checks.key(where, "generations"), self.generations)
        if self.prompts_per_step < 0:
            raise checks.ConfigValueError(
                checks.key(where, "prompts_per_step"),
                f"must be >= 0 (0: the largest batch), got {self.prompts_per_step}",
            )
        if self.gpu_memory_utilization is not None:
            checks.fraction_or_auto(checks.key(where, "gpu_memory_utilization"), self.gpu_memory_utilization)


def recipe_config(recipe: str, model_dir: str) -> TrainConfig:
    """A training recipe read for ``qerl bench e2e --recipe`` (YAML only: read before torch is imported)."""
    return load_config(TrainConfig, recipe, [f"model.path={model_dir or 'unused'}"])


def recipe_shape(recipe: str) -> dict[str, Any]:
    """E2EConfig values of a training recipe's step shape (for flags the user did not give)."""
    train = recipe_config(recipe, "")
    r = train.rollout
    return {"prompt_len": r.max_prompt_length, "gen_len": r.max_completion_length,
            "generations": r.num_generations, "prompts_per_step": train.train.prompts_per_step,
            "lora_rank": train.lora.rank}  # fmt: skip


def parse_row(row: str) -> tuple[str, str]:
    """``FORMAT-METHOD`` -> (format, method), both known to ``qerl quantize``."""
    fmt, sep, method = row.strip().lower().partition("-")
    formats, methods = get_args(QuantFormat), get_args(QuantMethod)
    if not sep or fmt not in formats or method not in methods:
        raise QerlError(
            f"--rows: {row!r} is not FORMAT-METHOD with FORMAT one of {', '.join(formats)} and METHOD one of "
            f"{', '.join(methods)} (e.g. nvfp4-rtn)"
        )
    return fmt, method


def prompts_per_step(cfg: E2EConfig) -> int:
    """The prompts of one timed GRPO step: ``prompts_per_step``, else the largest ``batch``."""
    return cfg.prompts_per_step or max(cfg.batch)

"""The settings of the other stages: ``qerl quantize``, ``qerl eval`` and ``qerl bench``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from qerl_cli.config.checks import ConfigValueError, empty_means, needs_items
from qerl_cli.config.checks import key as _key
from qerl_cli.config.checks import positive as _positive
from qerl_cli.config.choices import (
    BENCHMARKS_ALL,
    CALIBRATED_METHODS,
    LORA_INIT_ALIASES,
    EngineName,
    LinearBackend,
    LoraInit,
    QuantFormat,
    QuantMethod,
)
from qerl_cli.errors import QerlError, closest, qerl_command

# The linear backends a concurrency sweep measures: rollout.linear_backend's values but auto.
SWEPT_BACKENDS = tuple(b for b in get_args(LinearBackend) if b != "auto")


# --------------------------------------------------------------------------------------------
# Quantize, eval, bench
# --------------------------------------------------------------------------------------------
@dataclass
class QuantizeConfig:
    # The BF16 model to quantize: a hub id, a local folder, a .gguf file or a model alias (qerl models).
    model: str = ""
    # The 4-bit format: nvfp4, mxfp4 or nf4.
    format: QuantFormat = "nvfp4"
    # gptq (error-compensating rounding) | awq (calibrated smoothing), both calibrated on calib | rtn
    # (round to nearest).
    method: QuantMethod = "awq"
    # Calibration dataset: hub id, .jsonl or .parquet.
    calib: str = "open-thoughts/OpenThoughts-114k"
    # Split of a hub calibration dataset.
    calib_split: str = "train"
    # Field holding chat messages (rendered with the model's chat template) or plain text.
    calib_field: str | None = None
    # Calibration samples.
    num_samples: int = 256
    # Tokens per calibration sample.
    seq_len: int = 2048
    # Folder of the 4-bit checkpoint; null: ./<model-name>-<FORMAT>.
    output: str | None = None
    # Replace an existing output folder.
    overwrite: bool = False
    # Leave the layers the format cannot tile in BF16 instead of failing.
    skip_incompatible: bool = False
    # Measure perplexity of the BF16 model and the 4-bit one.
    eval_ppl: bool = False
    # zeros | eora | svd: write OUTPUT/lora_init/, a LoRA start that corrects the rounding error (read
    # by lora.init: eora|svd). eora factors W - deq(Q(W)) weighted by the calibration activations' second
    # moments (EoRA), svd the plain weight-space SVD (not with awq); zeros, as lora.init, writes nothing
    # ("none", its old spelling, is still accepted).
    lora_init: Literal[LoraInit, "none"] = "zeros"
    # Rank of the lora_init start (eora or svd; refused beside zeros, which writes none).
    lora_init_rank: int = 16
    # Seed of the calibration samples' choice.
    seed: int = 42
    # auto | cpu | cuda.
    device: str = "auto"
    # Run the model repository's own modeling code.
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        # One spelling from here on, however the config was made (flag, --set, YAML, a constructor).
        self.lora_init = LORA_INIT_ALIASES.get(self.lora_init, self.lora_init)  # type: ignore[assignment]

    def validate(self, where: str = "") -> None:
        if not self.model:
            raise QerlError("no model given: pass a hub id or a local folder")
        _positive(
            where or "quantize",
            num_samples=self.num_samples,
            seq_len=self.seq_len,
            lora_init_rank=self.lora_init_rank,
        )

    @property
    def calibrates(self) -> bool:
        """Whether calibration samples are taken: a calibrated method, or a ``lora_init`` start (weighted by
        the calibration activations, even for rtn)."""
        return self.method in CALIBRATED_METHODS or self.lora_init != "zeros"

    def check_settings_used(self, given: dict[str, str]) -> None:
        """A setting the user gave (``given``: each key set, by the flag or key that set it; one left at its
        default is no choice of theirs) that this job would ignore in silence is refused, naming what reads
        it: ``lora_init_rank`` beside ``zeros``, the calibration settings beside rtn without a start."""
        if "lora_init_rank" in given and self.lora_init == "zeros":
            flag = given["lora_init_rank"]
            raise QerlError(
                f"{flag} {self.lora_init_rank} sizes the error-compensating LoRA start, but "
                "--lora-init is zeros, which writes no start, so the rank would be ignored: add "
                f"--lora-init eora or --lora-init svd (with --method gptq or rtn), or drop {flag}"
            )
        if self.calibrates:
            return
        # each calibration key, and whether --eval-ppl reads it too (its held-out rows come from --calib)
        readers = dict(
            calib=True, calib_split=True, calib_field=True, seq_len=True, seed=True, num_samples=False
        )
        unused = [key for key, ppl in readers.items() if key in given and not (ppl and self.eval_ppl)]
        if unused:
            flags = ", ".join(given[key] for key in unused)
            ppl = " (--calib and its split, field and --seq-len also give --eval-ppl its held-out rows)"
            raise QerlError(
                f"{flags}: --method {self.method} rounds to nearest and reads no calibration samples, so "
                f"{'it' if len(unused) == 1 else 'they'} would be ignored; calibration samples are read by "
                f"--method {' or '.join(CALIBRATED_METHODS)} and by a --lora-init eora|svd start{ppl}: drop "
                f"{flags}, or choose one of those"
            )


# The eval keys that only generating reads: --rescore re-grades saved answers and generates nothing, so
# each is refused beside it where the user set it (EvalConfig.check_rescore_unused). The others serve a
# rescore too: rescore, output and baseline; benchmarks (which saved samples are re-graded) and
# data_files (a file's NAME makes --benchmarks NAME a known one); the grader's timeout and workers;
# template (the stop strings, for samples saved without their prompt record). model has its own check
# (evaluation.preflight.rescore_model): the model the answers came from may stay.
GENERATION_ONLY = (
    "adapter", "samples", "engine", "temperature", "top_p", "max_new_tokens", "max_problems", "seed",
    "system_prompt", "gpu_memory_utilization", "kv_cache_from_share", "linear_backend", "vllm_kwargs",
    "trust_remote_code", "device", "dtype", "generation_batch_size",
)  # fmt: skip


@dataclass
class EvalConfig:
    # A hub id, a local folder (BF16 or qerl 4-bit), a .gguf file or a model alias (qerl models). Left out
    # with rescore, which loads none (given, it must be the model the saved answers came from).
    model: str = ""
    # LoRA adapter folder (PEFT format) on the model; null: the bare model.
    adapter: str | None = None
    # Benchmarks to score: gsm8k, math500, aime24, aime25, amc23, synthetic-*, or names of data_files.
    benchmarks: list[str] = field(
        default_factory=lambda: list(BENCHMARKS_ALL),
        metadata=needs_items(
            "benchmark", f"choose from {', '.join(BENCHMARKS_ALL)}, a synthetic-* task or a --data-file NAME"
        ),
    )
    # Samples per problem; 0 takes the benchmark's default (4 for gsm8k/math500, 16 for aime/amc).
    samples: int = 0
    # auto | vllm | hf; auto: vLLM where a GPU and vLLM are present, else the HF engine.
    engine: EngineName | Literal["auto"] = "auto"
    # A benchmark's local data file, by benchmark name (--data-file NAME=PATH, repeatable).
    data_files: dict[str, str] = field(default_factory=dict)
    # Folder of results.json and the samples.
    output: str = "eval_results"
    # Sampling temperature.
    temperature: float = 0.6
    # Nucleus sampling, in (0, 1].
    top_p: float = 0.95
    # Most tokens generated per sample.
    max_new_tokens: int = 4096
    # Evaluate only the first N problems of each benchmark; null: all.
    max_problems: int | None = None
    # Seed of sampling.
    seed: int = 0
    # Prompt template name, as data.template in training.
    template: str = "qerl"
    # System message of the chat prompt; null: the template's own.
    system_prompt: str | None = None
    # Seconds a grader may take on one answer before it is killed and the answer scored wrong.
    grader_timeout_s: float = 5.0
    # Grader worker processes.
    grader_workers: int = 2
    # vLLM engine: its share of the GPU's memory.
    gpu_memory_utilization: float = 0.85
    # vLLM engine: size its KV cache from that share (the share of the whole GPU less the model) instead
    # of by profiling the device's free memory, which other processes sharing the GPU change meanwhile
    # (qerl compare's runs evaluating beside their neighbours).
    kv_cache_from_share: bool = False
    # The linear kernels under vLLM, as rollout.linear_backend (qerl_cli.rollout.backends). "marlin" by
    # default: an evaluation scores the 4-bit weights exactly as trained; "auto" / "fp8" may serve the FP8
    # copy (faster at high concurrency, one more rounding of every weight).
    linear_backend: LinearBackend = "marlin"
    # vLLM engine: extra keyword arguments of vllm.LLM.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    # Re-grade the samples saved in this folder instead of generating.
    rescore: str | None = None
    # A results.json to compare against, paired per problem.
    baseline: str | None = None
    # Run the model repository's own modeling code.
    trust_remote_code: bool = False
    # HF engine: the device ("auto": CUDA when present).
    device: str = "auto"
    # HF engine: compute dtype.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # HF engine: sequences per generate call.
    generation_batch_size: int = 64

    def __post_init__(self) -> None:
        # The docs write the benchmarks as names (GSM8K, MATH500): a built-in one in any case is that one,
        # unless a --data-file gives that very name.
        builtin = [b for b in self.benchmarks if b not in self.data_files and b.lower() in BENCHMARKS_ALL]
        self.benchmarks = [b.lower() if b in builtin else b for b in self.benchmarks]

    def validate(self, where: str = "") -> None:
        unknown = [
            b
            for b in self.benchmarks
            if b not in BENCHMARKS_ALL and b not in self.data_files and not b.startswith("synthetic-")
        ]
        if unknown:
            meant = {b: closest(b, BENCHMARKS_ALL) for b in unknown}
            named = [f"{b} (did you mean {meant[b]}?)" if meant[b] else b for b in unknown]
            raise ConfigValueError(
                _key(where, "benchmarks"),
                f"has unknown benchmark(s) {', '.join(named)}: choose from "
                f"{', '.join(BENCHMARKS_ALL)}, a synthetic-* task, or give a file with --data-file NAME=PATH",
            )
        twice = sorted({b for b in self.benchmarks if self.benchmarks.count(b) > 1})
        if twice:  # else evaluated twice (the time of both), its first results replaced by the second's
            raise ConfigValueError(
                _key(where, "benchmarks"), f"names {', '.join(twice)} twice: give each benchmark once"
            )
        unused = [name for name in self.data_files if name not in self.benchmarks]
        if unused and not self.rescore:  # a rescore's benchmarks are those saved (the default: all)
            raise ConfigValueError(
                _key(where, "data_files"),
                f"names {', '.join(unused)}, not among the benchmarks evaluated "
                f"({', '.join(self.benchmarks)}): add it to --benchmarks, or leave its file out",
            )
        if not self.rescore and not self.model:
            raise QerlError(
                "no model given: pass a hub id, a local folder, a .gguf file or a model alias (qerl models), "
                "or --rescore DIR"
            )
        _positive(where, grader_timeout_s=self.grader_timeout_s, grader_workers=self.grader_workers)
        if not self.rescore:
            self._check_generating(where)

    def _check_generating(self, where: str) -> None:
        """The generating settings, as the engines would refuse them once the model has loaded (or take in
        silence: a top_p outside (0, 1]), so that --dry-run refuses them too."""
        _positive(where, max_new_tokens=self.max_new_tokens, generation_batch_size=self.generation_batch_size)
        ranges = {
            "samples": (self.samples >= 0, "must be >= 1 (0: each benchmark's default)"),
            "max_problems": (self.max_problems is None or self.max_problems >= 1, "must be >= 1 (null: all)"),
            "temperature": (self.temperature >= 0, "must be >= 0 (0: greedy)"),
            "top_p": (0 < self.top_p <= 1, "must be in (0, 1] (1: off)"),
            "gpu_memory_utilization": (0 < self.gpu_memory_utilization <= 1, "must be in (0, 1]"),
        }
        for name, (held, rule) in ranges.items():
            if not held:
                raise ConfigValueError(_key(where, name), f"{rule}, got {getattr(self, name)}")

    def check_rescore_unused(self, given: dict[str, str]) -> None:
        """With ``rescore``, refuse the generation settings the user set (``given``: {key: the flag or key
        that set it}): they were ignored in silence, so a rescore read as one at, say, another temperature
        or with an adapter re-graded the saved answers of whatever generated them."""
        unused = [given[name] for name in GENERATION_ONLY if name in given]
        if self.rescore and unused:
            what, it = ("these settings", "them") if len(unused) > 1 else ("this setting", "it")
            raise QerlError(
                f"{', '.join(unused)}: --rescore re-grades the answers saved in {self.rescore} and generates "
                f"nothing, so {what} of generating would be ignored: drop {it} "
                f"(`{qerl_command('eval', '--rescore', self.rescore)}`), or leave --rescore out to generate "
                f"with {it}"
            )


@dataclass
class BenchConfig:
    # A SHAPE name (qwen2.5-0.5b ... qwen2.5-72b, tiny), a hub id or a local folder. Empty: qwen2.5-7b
    # on a GPU with vLLM, the tiny shape with the HF engine elsewhere.
    model: str = ""
    # Formats timed: bf16, nf4, nvfp4, mxfp4. The defaults are sized for a CI job on one GPU (the
    # measured runs: docs/bench.md): three engine starts, 512 generated tokens. On Hopper vLLM serves
    # MXFP4 through the same Marlin FP4 kernels as NVFP4 (add it with --formats); RL lengths are --gen-len
    # 2048 or 4096; whole GRPO steps are `qerl bench e2e` (its settings:
    # qerl_cli.bench.settings.E2EConfig, these keys and the step's own).
    formats: list[str] = field(
        default_factory=lambda: ["bf16", "nf4", "nvfp4"], metadata=needs_items("format", "e.g. bf16,nvfp4")
    )
    # Batch sizes timed (sequences generated at once).
    batch: list[int] = field(default_factory=lambda: [2, 8], metadata=needs_items("batch size", "e.g. 2,8"))
    # Prompt tokens per sequence.
    prompt_len: int = 256
    # Tokens generated per sequence.
    gen_len: int = 512
    # LoRA rank of the LoRA cases (0: no LoRA cases).
    lora_rank: int = 16
    # vllm | hf | auto ("auto": vLLM on a GPU with vLLM installed, else hf).
    engine: EngineName | Literal["auto"] = "auto"
    # auto, cpu or cuda[:N]: where the transformers engine (and e2e's trainer) runs; vLLM needs a GPU,
    # so "cpu" makes engine auto the transformers engine.
    device: str = "auto"
    # Folder of bench.json and the report.
    output: str = "bench_results"
    # A bench.json to gate against: exit non-zero on a regression beyond tolerance.
    baseline: str | None = None
    # Allowed relative regression against baseline (0.1: a tenth worse).
    tolerance: float = 0.1
    # Untimed runs before the timed ones.
    warmup: int = 1
    # Timed runs per case (the median is reported).
    repeats: int = 3
    # vLLM engine: its share of the GPU's memory.
    gpu_memory_utilization: float = 0.85
    # vLLM engine: extra keyword arguments of vllm.LLM.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    # Seed of the random checkpoints, LoRA weights and rewards.
    seed: int = 0
    # --concurrency: sequences generated at once (instead of --batch), each measured on every linear
    # backend of ``backends`` the format has (qerl_cli.rollout.backends); writes crossover.json, the
    # table rollout.linear_backend=auto reads, and each figure's fraction of the GPU's roofline.
    concurrency: list[int] = field(
        default_factory=list,
        metadata=empty_means("bench rollout times batch; bench concurrency sweeps its default"),
    )
    # --concurrency: the linear backends measured (marlin, humming, qerl-triton, fp8, fp8-merged, merged).
    backends: list[str] = field(
        default_factory=lambda: ["marlin", "humming", "fp8"],
        metadata=needs_items("backend", f"choose from {', '.join(SWEPT_BACKENDS)}"),
    )
    # GiB of GPU memory the benchmark may use: a helper process holds the rest, so the engines and the
    # trainer see a smaller GPU (a smaller card's budget on a larger one). null: the whole GPU.
    memory_cap_gib: float | None = None

    def validate(self, where: str = "") -> None:
        # Each key is named as the user wrote it: the CLI turns a key given by a flag into the flag.
        _positive(where, prompt_len=self.prompt_len, gen_len=self.gen_len, repeats=self.repeats)
        if self.warmup < 0:  # else fewer steps than repeats run, or none (an error far from the cause)
            raise ConfigValueError(
                _key(where, "warmup"), f"must be >= 0 (0: no untimed run), got {self.warmup}"
            )
        for name, sizes in (("batch", self.batch), ("concurrency", self.concurrency)):
            bad = [str(size) for size in sizes if size <= 0]
            if bad:
                raise ConfigValueError(_key(where, name), f"needs positive integers, got {', '.join(bad)}")
            twice = sorted({size for size in sizes if sizes.count(size) > 1})
            if twice:  # else measured twice, the time of both, for one row of figures
                sizes_twice = ", ".join(str(size) for size in twice)
                raise ConfigValueError(_key(where, name), f"names {sizes_twice} twice: give each size once")
        unknown = sorted(set(self.backends) - set(SWEPT_BACKENDS))
        if unknown:
            raise ConfigValueError(
                _key(where, "backends"),
                f"has unknown backend(s) {', '.join(unknown)}; choose from {', '.join(SWEPT_BACKENDS)}",
            )
        if self.memory_cap_gib is not None and self.memory_cap_gib <= 0:
            raise ConfigValueError(
                _key(where, "memory_cap_gib"), f"must be > 0 GiB, got {self.memory_cap_gib}"
            )

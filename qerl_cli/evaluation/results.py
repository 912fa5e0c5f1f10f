"""Evaluation files: ``results.json`` (and :class:`EvalResult`, its typed form) and one
``samples_<bench>.jsonl`` per benchmark.

A samples line is one problem: its prompt and gold answer, then per-sample lists (completion text,
extracted answer, extraction method, correctness, finish reason, token count, timeout, extraction
failure). ``--rescore`` and ``--baseline`` work from these files alone.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.envinfo import package_versions
from qerl_cli.errors import QerlError, holding_folder_hint
from qerl_cli.files import (
    GZIP_SUFFIX,
    atomic_write_text,
    file_given_for_folder,
    read_json_report,
    read_text_maybe_gzip,
    readable_text_file,
    write_json,
)

RESULTS_NAME = "results.json"
MARKDOWN_NAME = "results.md"
SAMPLES_PREFIX = "samples_"
_PACKAGES = (
    "qerl",
    "torch",
    "transformers",
    "peft",
    "vllm",
    "datasets",
    "math-verify",
    "latex2sympy2_extended",
)


def samples_path(out_dir: str | Path, benchmark: str) -> Path:
    return Path(out_dir) / f"{SAMPLES_PREFIX}{benchmark}.jsonl"


def versions() -> dict[str, str | None]:
    """Installed versions of what decides the numbers (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version(), **package_versions(_PACKAGES)}
    torch = sys.modules.get("torch")  # only if already imported: rescoring should stay light
    if torch is not None and torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def write_samples(path: Path, records: Iterable[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The records of a samples file: ``path``, or ``path.gz`` beside it (benchmarks/ keeps them gzip'd)."""
    found = readable_text_file(path)
    if found is None:
        raise QerlError(f"samples file not found: {path}")
    try:
        text = read_text_maybe_gzip(found)
    except (OSError, EOFError) as exc:  # a truncated or foreign .gz
        raise QerlError(f"{found} cannot be read ({exc}); the file is damaged") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise QerlError(f"{found}:{number} is not valid JSON ({exc}); the file is damaged") from None
    return records


# The files an eval writes in its output folder: one of them given for the folder names the folder.
_EVAL_FILES = ("results.json", "samples_*.jsonl", f"samples_*.jsonl{GZIP_SUFFIX}")


def find_sample_files(directory: str | Path) -> dict[str, Path]:
    """``{benchmark: samples file}`` for every ``samples_<bench>.jsonl`` (or ``.jsonl.gz``) in ``directory``.

    Where both are there (a gzip'd folder rescored in place), the plain file is the newer grading.
    """
    folder = Path(directory)
    if folder.is_file():  # its results.json or a samples file, given for the folder that holds them
        raise file_given_for_folder(
            folder,
            "",
            "the output folder of an earlier `qerl eval` run, the one that holds results.json and "
            "samples_<benchmark>.jsonl" + holding_folder_hint("--rescore", folder, _EVAL_FILES),
        )
    if not folder.is_dir():
        raise QerlError(f"{folder}: no such folder; give the output folder of an earlier `qerl eval` run")
    found: dict[str, Path] = {}
    for suffix in (f".jsonl{GZIP_SUFFIX}", ".jsonl"):  # plain last, so that it wins
        for p in folder.glob(f"{SAMPLES_PREFIX}*{suffix}"):
            found[p.name[len(SAMPLES_PREFIX) : -len(suffix)]] = p
    files = dict(sorted(found.items()))
    if not files:
        raise QerlError(f"{folder} holds no {SAMPLES_PREFIX}<benchmark>.jsonl files to rescore")
    return files


def write_results(out_dir: str | Path, results: EvalResult) -> Path:
    # default=str: the config record may hold values JSON has no type for (paths)
    return write_json(Path(out_dir) / RESULTS_NAME, results.to_dict(), default=str)


def read_results(path: str | Path) -> EvalResult:
    """A results.json (or the folder holding one)."""
    data = read_json_report(path, RESULTS_NAME, "the results.json of an earlier `qerl eval` run")
    if "benchmarks" not in data:
        raise QerlError(f"{path} is not a qerl eval results file (no 'benchmarks')")
    try:
        return EvalResult.from_dict(data)
    except (KeyError, TypeError, AttributeError) as exc:  # a benchmark entry without its figures
        raise QerlError(f"{path} is not a complete qerl eval results file (missing {exc})") from None


# --------------------------------------------------------------------------------------------
# The typed results (what run_eval returns and results.json holds)
# --------------------------------------------------------------------------------------------
# The file's keys are the public layout (other tools and committed benchmarks read them), so every
# type maps its fields to them by hand: ``to_dict`` writes exactly the keys, in the order, that
# results.json has always had, and ``from_dict`` reads files of earlier qerl versions too.


@dataclass
class BenchmarkMetrics:
    """One benchmark's figures (``metrics`` of a benchmark in results.json)."""

    num_problems: int
    samples_per_problem: int | None  # None: problems have different sample counts
    num_samples: int
    pass_at_1: float
    pass_at_1_se: float | None  # None with fewer than two problems
    pass_at_k: dict[str, float]  # {"1": ..., "2": ..., "4": ...}: k as a string, as in the file
    truncation_rate: float
    extraction_failure_rate: float
    grader_timeouts: int
    grader_timeout_rate: float
    mean_length: float
    max_length: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_problems": self.num_problems,
            "samples_per_problem": self.samples_per_problem,
            "num_samples": self.num_samples,
            "pass@1": self.pass_at_1,
            "pass@1_se": self.pass_at_1_se,
            "pass@k": dict(self.pass_at_k),
            "truncation_rate": self.truncation_rate,
            "extraction_failure_rate": self.extraction_failure_rate,
            "grader_timeouts": self.grader_timeouts,
            "grader_timeout_rate": self.grader_timeout_rate,
            "mean_length": self.mean_length,
            "max_length": self.max_length,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchmarkMetrics:
        return cls(
            num_problems=data["num_problems"],
            samples_per_problem=data.get("samples_per_problem"),
            num_samples=data["num_samples"],
            pass_at_1=data["pass@1"],
            pass_at_1_se=data.get("pass@1_se"),
            pass_at_k=dict(data.get("pass@k") or {}),
            truncation_rate=data["truncation_rate"],
            extraction_failure_rate=data["extraction_failure_rate"],
            grader_timeouts=data["grader_timeouts"],
            grader_timeout_rate=data["grader_timeout_rate"],
            mean_length=data["mean_length"],
            max_length=data["max_length"],
        )


@dataclass
class GenerationTiming:
    """Where a generated benchmark's time went (``timing``; a rescored one has none)."""

    generation_seconds: float
    grading_seconds: float
    generated_tokens: int
    tokens_per_second: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # the field names are the file's keys

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationTiming:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


@dataclass
class PairedDifference:
    """Current minus baseline pass rate over the problems both runs share, with its standard error."""

    num_paired: int
    only_current: int
    only_baseline: int
    diff: float | None  # None: no shared problem
    diff_se: float | None
    ci95: list[float | None]  # [low, high]; [None, None] without a standard error
    current_pass_at_1: float | None
    baseline_pass_at_1: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_paired": self.num_paired,
            "only_current": self.only_current,
            "only_baseline": self.only_baseline,
            "diff": self.diff,
            "diff_se": self.diff_se,
            "ci95": list(self.ci95),
            "current_pass@1": self.current_pass_at_1,
            "baseline_pass@1": self.baseline_pass_at_1,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PairedDifference:
        return cls(
            num_paired=data["num_paired"],
            only_current=data["only_current"],
            only_baseline=data["only_baseline"],
            diff=data.get("diff"),
            diff_se=data.get("diff_se"),
            ci95=list(data.get("ci95") or [None, None]),
            current_pass_at_1=data.get("current_pass@1"),
            baseline_pass_at_1=data.get("baseline_pass@1"),
        )


@dataclass
class BaselineComparison:
    """``--baseline``: paired differences per shared benchmark, and whether the runs are alike."""

    path: str
    same_prompt: bool
    same_sampling: bool
    benchmarks: dict[str, PairedDifference]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "same_prompt": self.same_prompt,
            "same_sampling": self.same_sampling,
            "benchmarks": {name: d.to_dict() for name, d in self.benchmarks.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BaselineComparison:
        return cls(
            path=data["path"],
            same_prompt=data["same_prompt"],
            same_sampling=data["same_sampling"],
            benchmarks={k: PairedDifference.from_dict(v) for k, v in data["benchmarks"].items()},
        )


@dataclass
class BenchmarkScore:
    """One benchmark of a run: where its problems came from, its samples file and its figures."""

    source: str
    samples_file: str  # the file name, beside results.json
    samples_per_problem: int | None
    metrics: BenchmarkMetrics
    per_problem: dict[str, list[int]] | None = None  # {problem id: [correct, samples]}; older files lack it
    timing: GenerationTiming | None = None  # None when rescored (nothing was generated)
    previous_pass_at_1: float | None = None  # a rescore: the pass@1 before re-grading

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": self.source,
            "samples_file": self.samples_file,
            "samples_per_problem": self.samples_per_problem,
            "metrics": self.metrics.to_dict(),
        }
        if self.per_problem is not None:
            out["per_problem"] = {key: list(counts) for key, counts in self.per_problem.items()}
        if self.timing is not None:
            out["timing"] = self.timing.to_dict()
        if self.previous_pass_at_1 is not None:
            out["previous_pass@1"] = self.previous_pass_at_1
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchmarkScore:
        timing = data.get("timing")
        return cls(
            source=data["source"],
            samples_file=data["samples_file"],
            samples_per_problem=data.get("samples_per_problem"),
            metrics=BenchmarkMetrics.from_dict(data["metrics"]),
            per_problem=data.get("per_problem"),
            timing=GenerationTiming.from_dict(timing) if timing is not None else None,
            previous_pass_at_1=data.get("previous_pass@1"),
        )


# The keys results.json has always written, in their order; any others (a newer qerl's) are kept.
_EVAL_KEYS = (
    "format", "created", "model", "adapter", "engine", "config", "versions", "prompt", "sampling",
    "grading", "rescored_from", "rescored", "benchmarks", "baseline",
)  # fmt: skip


@dataclass
class EvalResult:
    """What ``qerl eval`` measured (``results.json``): the run's record, then one score per benchmark.

    ``created``, ``engine``, ``config`` and ``sampling`` record the generating run; results rebuilt
    by ``--rescore`` from samples alone have none of them (None, and absent from the file).
    """

    format: int
    model: str | None
    benchmarks: dict[str, BenchmarkScore]
    created: str | None = None
    adapter: str | None = None
    engine: str | None = None
    config: dict[str, Any] | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    prompt: dict[str, Any] | None = None  # the prompt record (data.prompts.prompt_record)
    sampling: dict[str, Any] | None = None
    grading: dict[str, Any] | None = None
    rescored_from: str | None = None
    rescored: str | None = None
    baseline: BaselineComparison | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as read

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format}
        if self.created is not None:
            out["created"] = self.created
        out["model"] = self.model
        if self.engine is not None:  # the adapter is recorded with the engine that applied it
            out.update(adapter=self.adapter, engine=self.engine)
        optional = {"config": self.config, "versions": self.versions, "prompt": self.prompt,
                    "sampling": self.sampling, "grading": self.grading,
                    "rescored_from": self.rescored_from, "rescored": self.rescored}  # fmt: skip
        out.update({key: value for key, value in optional.items() if value is not None})
        out.update(self.extra)
        out["benchmarks"] = {name: score.to_dict() for name, score in self.benchmarks.items()}
        if self.baseline is not None:
            out["baseline"] = self.baseline.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalResult:
        baseline = data.get("baseline")
        return cls(
            format=data.get("format", 1),
            model=data.get("model"),
            benchmarks={name: BenchmarkScore.from_dict(b) for name, b in data["benchmarks"].items()},
            created=data.get("created"),
            adapter=data.get("adapter"),
            engine=data.get("engine"),
            config=data.get("config"),
            versions=dict(data.get("versions") or {}),
            prompt=data.get("prompt"),
            sampling=data.get("sampling"),
            grading=data.get("grading"),
            rescored_from=data.get("rescored_from"),
            rescored=data.get("rescored"),
            baseline=BaselineComparison.from_dict(baseline) if baseline is not None else None,
            extra={key: value for key, value in data.items() if key not in _EVAL_KEYS},
        )

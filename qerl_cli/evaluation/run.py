"""``qerl eval``: sample n completions per benchmark problem, grade them, write and compare results.

The prompt comes from :func:`qerl_cli.data.prompts.render_prompt` (the training function), the
adapter is applied by the engine (PEFT on the HF engine, a LoRARequest on vLLM), grading goes
through the math-verify worker pool with hard timeouts. Every benchmark's samples are written as
soon as it is done, so a long run that dies keeps what it finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from qerl_cli.config import BENCHMARKS_ALL, EvalConfig
from qerl_cli.data.benchmarks import benchmark_source, default_samples, load_benchmark
from qerl_cli.data.problem import Problem
from qerl_cli.data.prompts import get_template, prompt_record, render_prompt
from qerl_cli.errors import QerlError
from qerl_cli.evaluation.metrics import benchmark_metrics, paired_difference, per_problem_counts
from qerl_cli.evaluation.report import results_markdown
from qerl_cli.evaluation.results import (
    MARKDOWN_NAME,
    RESULTS_NAME,
    find_sample_files,
    read_results,
    read_samples,
    samples_path,
    versions,
    write_results,
    write_samples,
)
from qerl_cli.files import append_step_summary, ensure_output_dir
from qerl_cli.rewards.grading import GradeResult
from qerl_cli.rewards.pool import Grader
from qerl_cli.rollout.base import Completion, RolloutEngine, SamplingSpec

Log = Callable[[str], None]
EXTRACTION_ORDER = "answer tag > last \\boxed{} > anchored phrase > bare answer"
RESULTS_FORMAT = 1


def _default_log() -> Log:
    from rich.console import Console

    console = Console(stderr=True)
    return lambda message: console.print(message, highlight=False, markup=False)  # paths hold [...]


def samples_for(cfg: EvalConfig, benchmark: str) -> int:
    n = cfg.samples or default_samples(benchmark)
    if n < 1:
        raise QerlError(f"--samples must be >= 1, got {n}")
    return n


# --------------------------------------------------------------------------------------------
# Engine and tokenizer
# --------------------------------------------------------------------------------------------
def build_engine(cfg: EvalConfig, tokenizer: Any) -> RolloutEngine:
    """The engine for ``cfg.engine`` with the adapter applied (through the rollout factory)."""
    from qerl_cli.modeling.adapter import rank as adapter_rank
    from qerl_cli.rollout import factory

    rank = adapter_rank(cfg.adapter)
    if cfg.engine == "vllm":
        request = factory.EngineRequest(
            "vllm",
            cfg.model,
            adapter=cfg.adapter,
            dtype=cfg.dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=False,  # nothing else shares the GPU during evaluation
            enable_lora=rank is not None,
            max_lora_rank=rank or 16,
            seed=cfg.seed,
            trust_remote_code=cfg.trust_remote_code,
            linear_backend=cfg.linear_backend,
            vllm_kwargs=dict(cfg.vllm_kwargs),
        )
    else:
        request = factory.EngineRequest(
            "hf",
            cfg.model,
            adapter=cfg.adapter,
            dtype=cfg.dtype,
            device=cfg.device,
            tokenizer=tokenizer,
            generation_batch_size=cfg.generation_batch_size,
            trust_remote_code=cfg.trust_remote_code,
        )
    return factory.make_engine(request)


def load_eval_tokenizer(cfg: EvalConfig) -> Any:
    from qerl_cli.modeling.loading import load_tokenizer

    try:
        return load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise QerlError(f"cannot load the tokenizer of {cfg.model}: {exc}") from None


# --------------------------------------------------------------------------------------------
# One benchmark
# --------------------------------------------------------------------------------------------
def _record(
    problem: Problem, prompt: str, completions: Sequence[Completion], grades: Sequence[GradeResult]
) -> dict[str, Any]:
    return {
        "id": problem.id,
        "question": problem.question,
        "gold": problem.answer,
        "prompt": prompt,
        "completions": [c.text for c in completions],
        "finish_reasons": [c.finish_reason for c in completions],
        "num_tokens": [len(c.token_ids) for c in completions],
        **_grade_fields(grades),
    }


def _grade_fields(grades: Sequence[GradeResult]) -> dict[str, Any]:
    return {
        "extracted": [g.extracted for g in grades],
        "extraction_methods": [g.method for g in grades],
        "correct": [g.correct for g in grades],
        "extraction_failed": [g.extraction_failed for g in grades],
        "timed_out": [g.timed_out for g in grades],
        "grade_errors": [g.error for g in grades],
        "num_correct": sum(g.correct for g in grades),
        "num_samples": len(grades),
    }


def evaluate_benchmark(
    engine: RolloutEngine,
    grader: Grader,
    problems: Sequence[Problem],
    prompts: Sequence[str],
    n: int,
    sampling: SamplingSpec,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Sample ``n`` completions per prompt, grade them; (per-problem records, timing)."""
    start = time.perf_counter()
    rollout = engine.generate(list(prompts), n, sampling)
    generated = time.perf_counter()
    if len(rollout.completions) != len(problems) or any(len(g) != n for g in rollout.completions):
        raise RuntimeError(
            f"the engine returned a wrong number of completions (expected {len(problems)} x {n})"
        )
    flat = rollout.flat()
    grades = grader.grade_many([c.text for _, c in flat], [problems[i].answer for i, _ in flat])
    graded = time.perf_counter()
    records = [
        _record(problem, prompt, rollout.completions[i], grades[i * n : (i + 1) * n])
        for i, (problem, prompt) in enumerate(zip(problems, prompts, strict=True))
    ]
    tokens = rollout.num_generated_tokens
    timing = {
        "generation_seconds": generated - start,
        "grading_seconds": graded - generated,
        "generated_tokens": tokens,
        "tokens_per_second": tokens / (generated - start) if generated > start else 0.0,
    }
    return records, timing


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------
def _header(cfg: EvalConfig, tokenizer: Any, engine_name: str) -> dict[str, Any]:
    return {
        "format": RESULTS_FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": cfg.model,
        "adapter": cfg.adapter,
        "engine": engine_name,
        "config": dataclasses.asdict(cfg),
        "versions": versions(),
        "prompt": prompt_record(cfg.template, cfg.system_prompt, tokenizer),
        "sampling": {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_new_tokens": cfg.max_new_tokens,
            "seed": cfg.seed,
        },
        "grading": {
            "grader": "math-verify",
            "timeout_s": cfg.grader_timeout_s,
            "workers": cfg.grader_workers,
            "extraction": EXTRACTION_ORDER,
        },
        "benchmarks": {},
    }


def _benchmark_entry(
    records: list[dict[str, Any]], source: str, samples_file: Path, n: int | None
) -> dict[str, Any]:
    return {
        "source": source,
        "samples_file": samples_file.name,
        "samples_per_problem": n,
        "metrics": benchmark_metrics(records),
        "per_problem": per_problem_counts(records),
    }


def _finish(results: dict[str, Any], out_dir: Path, cfg: EvalConfig, log: Log) -> dict[str, Any]:
    if cfg.baseline:
        results["baseline"] = compare_with_baseline(results, cfg.baseline)
    write_results(out_dir, results)
    markdown = results_markdown(results)
    (out_dir / MARKDOWN_NAME).write_text(markdown, encoding="utf-8")
    summary = append_step_summary(markdown)
    log(f"wrote {out_dir / RESULTS_NAME}" + (f" (and the job summary {summary})" if summary else ""))
    return results


def compare_with_baseline(results: dict[str, Any], baseline: str | Path) -> dict[str, Any]:
    """Paired per-problem differences against a baseline results.json (or its folder)."""
    base = read_results(baseline)
    base_dir = Path(baseline) if Path(baseline).is_dir() else Path(baseline).parent
    comparison: dict[str, Any] = {
        "path": str(baseline),
        "same_prompt": (base.get("prompt") or {}).get("template_hash")
        == (results.get("prompt") or {}).get("template_hash"),
        "same_sampling": base.get("sampling") == results.get("sampling"),
        "benchmarks": {},
    }
    for name, bench in results["benchmarks"].items():
        if name not in base["benchmarks"]:
            continue
        theirs = base["benchmarks"][name].get("per_problem")
        if theirs is None:  # an older results file: rebuild the counts from its samples
            theirs = per_problem_counts(read_samples(samples_path(base_dir, name)))
        comparison["benchmarks"][name] = paired_difference(bench["per_problem"], theirs)
    if not comparison["benchmarks"]:
        raise QerlError(f"the baseline {baseline} shares no benchmark with this run")
    return comparison


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------
def run_eval(
    cfg: EvalConfig,
    engine: RolloutEngine | None = None,
    tokenizer: Any = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """Evaluate ``cfg.model`` (+ ``cfg.adapter``) on ``cfg.benchmarks``; returns the results dict.

    ``engine``: generate with this engine instead of building one from ``cfg.engine`` (tests, or a
    caller that holds a model already); ``cfg.adapter`` is then applied with ``engine.sync_adapter``.
    ``tokenizer``: the one whose chat template renders prompts (default: the engine's, else the
    model's). ``cfg.rescore`` re-grades a previous run's samples instead of generating.
    """
    cfg.validate()
    log = log or _default_log()
    if cfg.rescore:
        return rescore(cfg, log)
    from qerl_cli.modeling.adapter import check_folder as check_adapter_folder
    from qerl_cli.modeling.source_checks import check_model_source

    if engine is None:  # the model and adapter paths first: a typo must not wait for a dataset download
        check_model_source(
            cfg.model,
            what="model",
            trust_remote_code=cfg.trust_remote_code,
            trust_hint="--set trust_remote_code=true",
        )
        if cfg.adapter:  # a caller's engine syncs the adapter itself
            check_adapter_folder(cfg.adapter)
    out_dir = ensure_output_dir(cfg.output, "--output")
    # Data next: a missing benchmark file should fail before minutes of model loading.
    suites = {
        name: load_benchmark(name, cfg.data_files.get(name), cfg.max_problems) for name in cfg.benchmarks
    }
    with contextlib.ExitStack() as stack:
        grader = stack.enter_context(Grader(workers=cfg.grader_workers, timeout_s=cfg.grader_timeout_s))
        grader.start()  # workers boot while the model loads
        tokenizer = tokenizer or getattr(engine, "tokenizer", None) or load_eval_tokenizer(cfg)
        if engine is None:
            log(
                f"loading {cfg.model} on the {cfg.engine} engine"
                + (f" with {cfg.adapter}" if cfg.adapter else "")
            )
            engine = build_engine(cfg, tokenizer)
            engine_name = cfg.engine
            # An engine built here is released here (vLLM holds most of the GPU until closed).
            stack.callback(getattr(engine, "close", lambda: None))
        else:
            if cfg.adapter:
                engine.sync_adapter(cfg.adapter)
            engine_name = type(engine).__name__
        results = _header(cfg, tokenizer, engine_name)
        sampling = SamplingSpec(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=cfg.seed,
            stop=get_template(cfg.template).stop,  # as in training
        )
        for name, problems in suites.items():
            n = samples_for(cfg, name)
            log(f"{name}: {len(problems)} problems x {n} samples")
            prompts = [
                render_prompt(p.question, tokenizer, cfg.template, cfg.system_prompt) for p in problems
            ]
            records, timing = evaluate_benchmark(engine, grader, problems, prompts, n, sampling)
            path = samples_path(out_dir, name)
            write_samples(path, records)
            entry = _benchmark_entry(records, benchmark_source(name, cfg.data_files.get(name)), path, n)
            entry["timing"] = timing
            results["benchmarks"][name] = entry
            m = entry["metrics"]
            log(
                f"{name}: pass@1 {100 * m['pass@1']:.1f}% ({timing['generation_seconds']:.0f} s generating, "
                f"{timing['grading_seconds']:.0f} s grading, {m['grader_timeouts']} grader timeouts)"
            )
            write_results(out_dir, results)  # partial results survive a crash in a later benchmark
    return _finish(results, out_dir, cfg, log)


def _rescore_selection(cfg: EvalConfig, files: dict[str, Path]) -> dict[str, Path]:
    if list(cfg.benchmarks) == list(BENCHMARKS_ALL):  # the default: everything that was saved
        return files
    chosen = {b: p for b, p in files.items() if b in cfg.benchmarks}
    if not chosen:
        raise QerlError(f"none of {cfg.benchmarks} has saved samples; found {sorted(files)}")
    return chosen


def rescore(cfg: EvalConfig, log: Log | None = None) -> dict[str, Any]:
    """Re-grade the samples saved in ``cfg.rescore`` (no generation) and rewrite the results.

    Results go to ``cfg.output`` when it was changed from the default, else back into the rescored
    folder (its samples files get the new grades; the completions are untouched).
    """
    log = log or _default_log()
    source = Path(str(cfg.rescore))
    files = _rescore_selection(cfg, find_sample_files(source))
    old = read_results(source) if (source / RESULTS_NAME).is_file() else {}
    out_dir = Path(cfg.output) if cfg.output != EvalConfig().output else source
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {key: value for key, value in old.items() if key not in ("benchmarks", "baseline")}
    results.setdefault("format", RESULTS_FORMAT)
    results.update(
        rescored_from=str(source),
        rescored=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        grading={
            "grader": "math-verify",
            "timeout_s": cfg.grader_timeout_s,
            "workers": cfg.grader_workers,
            "extraction": EXTRACTION_ORDER,
        },
        versions=versions(),
        benchmarks={},
    )
    if "prompt" not in results:
        first = read_samples(next(iter(files.values())))
        results["prompt"] = {
            "name": None,
            "template_hash": None,
            "note": "no results.json next to the samples",
        }
        results["model"] = results.get("model") or f"samples in {source} ({len(first)} problems)"
    old_benchmarks = old.get("benchmarks", {})
    with Grader(workers=cfg.grader_workers, timeout_s=cfg.grader_timeout_s) as grader:
        for name, path in files.items():
            records = read_samples(path)
            completions = [c for r in records for c in r["completions"]]
            golds = [r["gold"] for r in records for _ in r["completions"]]
            grades = grader.grade_many(completions, golds)
            start = 0
            for r in records:
                r.update(_grade_fields(grades[start : start + len(r["completions"])]))
                start += len(r["completions"])
            target = samples_path(out_dir, name)
            write_samples(target, records)
            previous = old_benchmarks.get(name, {})
            counts = {len(r["completions"]) for r in records}
            entry = _benchmark_entry(
                records, previous.get("source", str(path)), target, counts.pop() if len(counts) == 1 else None
            )
            if "metrics" in previous:
                entry["previous_pass@1"] = previous["metrics"].get("pass@1")
            results["benchmarks"][name] = entry
            pass1 = 100 * entry["metrics"]["pass@1"]
            log(f"{name}: re-graded {len(completions)} completions, pass@1 {pass1:.1f}%")
    return _finish(results, out_dir, cfg, log)


__all__ = ["build_engine", "compare_with_baseline", "evaluate_benchmark", "rescore", "run_eval"]

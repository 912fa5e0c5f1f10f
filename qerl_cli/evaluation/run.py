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

from rich.console import Console

from qerl_cli.config import EvalConfig
from qerl_cli.data.benchmarks import benchmark_source, default_samples, load_benchmark
from qerl_cli.data.problem import Problem
from qerl_cli.data.prompts import get_template, prompt_record, render_prompt
from qerl_cli.errors import QerlError
from qerl_cli.evaluation.metrics import benchmark_metrics, paired_difference, per_problem_counts
from qerl_cli.evaluation.preflight import output_dir, preflight, rescore_selection, resolve_engine
from qerl_cli.evaluation.report import results_markdown
from qerl_cli.evaluation.results import (
    MARKDOWN_NAME,
    RESULTS_NAME,
    BaselineComparison,
    BenchmarkScore,
    EvalResult,
    GenerationTiming,
    find_sample_files,
    read_results,
    read_samples,
    samples_path,
    versions,
    write_results,
    write_samples,
)
from qerl_cli.files import append_step_summary, ensure_output_dir
from qerl_cli.modeling.adapter import rank as adapter_rank
from qerl_cli.modeling.loading import load_tokenizer
from qerl_cli.rewards.extract import cut_at_stop
from qerl_cli.rewards.grading import GradeResult
from qerl_cli.rewards.pool import Grader
from qerl_cli.rollout import factory
from qerl_cli.rollout.base import Completion, RolloutEngine, SamplingSpec

Log = Callable[[str], None]
EXTRACTION_ORDER = "answer tag > last \\boxed{} > anchored phrase > bare answer"
RESULTS_FORMAT = 1


def _default_log() -> Log:
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

    common = dict(adapter=cfg.adapter, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    if cfg.engine == "vllm":
        rank = adapter_rank(cfg.adapter)
        request = factory.EngineRequest(
            "vllm", cfg.model, **common, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=False,  # nothing else shares the GPU during evaluation
            enable_lora=rank is not None, max_lora_rank=rank or 16, seed=cfg.seed,
            linear_backend=cfg.linear_backend, vllm_kwargs=dict(cfg.vllm_kwargs),
            kv_cache_from_share=cfg.kv_cache_from_share,
        )  # fmt: skip
    else:
        request = factory.EngineRequest(
            "hf", cfg.model, **common, device=cfg.device, tokenizer=tokenizer,
            generation_batch_size=cfg.generation_batch_size,
        )  # fmt: skip
    return factory.make_engine(request)


def load_eval_tokenizer(cfg: EvalConfig) -> Any:
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
) -> tuple[list[dict[str, Any]], GenerationTiming]:
    """Sample ``n`` completions per prompt, grade them; (per-problem records, timing)."""
    start = time.perf_counter()
    rollout = engine.generate(list(prompts), n, sampling)
    generated = time.perf_counter()
    if len(rollout.completions) != len(problems) or any(len(g) != n for g in rollout.completions):
        raise RuntimeError(
            f"the engine returned a wrong number of completions (expected {len(problems)} x {n})"
        )
    flat = rollout.flat()
    texts = [cut_at_stop(c.text, sampling.stop) for _, c in flat]  # graded as in training
    grades = grader.grade_many(texts, [problems[i].answer for i, _ in flat])
    graded = time.perf_counter()
    records = [
        _record(problem, prompt, rollout.completions[i], grades[i * n : (i + 1) * n])
        for i, (problem, prompt) in enumerate(zip(problems, prompts, strict=True))
    ]
    tokens = rollout.num_generated_tokens
    timing = GenerationTiming(
        generation_seconds=generated - start,
        grading_seconds=graded - generated,
        generated_tokens=tokens,
        tokens_per_second=tokens / (generated - start) if generated > start else 0.0,
    )
    return records, timing


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------
def _grading(cfg: EvalConfig) -> dict[str, Any]:
    return {
        "grader": "math-verify",
        "timeout_s": cfg.grader_timeout_s,
        "workers": cfg.grader_workers,
        "extraction": EXTRACTION_ORDER,
    }


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _header(cfg: EvalConfig, tokenizer: Any, engine_name: str) -> EvalResult:
    """The run's record, before any benchmark is scored."""
    return EvalResult(
        format=RESULTS_FORMAT,
        created=_now(),
        model=cfg.model,
        adapter=cfg.adapter,
        engine=engine_name,
        config=dataclasses.asdict(cfg),
        versions=versions(),
        prompt=prompt_record(cfg.template, cfg.system_prompt, tokenizer),
        sampling={
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_new_tokens": cfg.max_new_tokens,
            "seed": cfg.seed,
        },
        grading=_grading(cfg),
        benchmarks={},
    )


def _score(records: list[dict[str, Any]], source: str, samples_file: Path, n: int | None) -> BenchmarkScore:
    return BenchmarkScore(
        source=source,
        samples_file=samples_file.name,
        samples_per_problem=n,
        metrics=benchmark_metrics(records),
        per_problem=per_problem_counts(records),
    )


def _finish(results: EvalResult, out_dir: Path, cfg: EvalConfig, log: Log) -> EvalResult:
    if cfg.baseline:
        results.baseline = compare_with_baseline(results, cfg.baseline)
    write_results(out_dir, results)
    markdown = results_markdown(results)
    (out_dir / MARKDOWN_NAME).write_text(markdown, encoding="utf-8")
    summary = append_step_summary(markdown)
    log(f"wrote {out_dir / RESULTS_NAME}" + (f" (and the job summary {summary})" if summary else ""))
    return results


def compare_with_baseline(results: EvalResult, baseline: str | Path) -> BaselineComparison:
    """Paired per-problem differences against a baseline results.json (or its folder)."""
    base = read_results(baseline)
    base_dir = Path(baseline) if Path(baseline).is_dir() else Path(baseline).parent
    comparison = BaselineComparison(
        path=str(baseline),
        same_prompt=(base.prompt or {}).get("template_hash") == (results.prompt or {}).get("template_hash"),
        same_sampling=base.sampling == results.sampling,
        benchmarks={},
    )
    for name, bench in results.benchmarks.items():
        if name not in base.benchmarks:
            continue
        theirs = base.benchmarks[name].per_problem
        if theirs is None:  # an older results file: rebuild the counts from its samples
            theirs = per_problem_counts(read_samples(samples_path(base_dir, name)))
        comparison.benchmarks[name] = paired_difference(bench.per_problem or {}, theirs)
    if not comparison.benchmarks:
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
    *,
    guard_output: bool = False,
    checked: Callable[[], None] | None = None,
) -> EvalResult:
    """Evaluate ``cfg.model`` (+ ``cfg.adapter``) on ``cfg.benchmarks``; returns the results.

    ``engine``: generate with this engine instead of building one from ``cfg.engine`` (tests, or a
    caller that holds a model already); ``cfg.adapter`` is then applied with ``engine.sync_adapter``.
    ``tokenizer``: the one whose chat template renders prompts (default: the engine's, else the
    model's). ``cfg.rescore`` re-grades a previous run's samples instead of generating.
    ``guard_output`` (``qerl eval``): refuse an output folder holding another model's evaluation.
    ``checked``: called once the checks have passed, before any work (``qerl eval`` says its CPU time
    estimate there, so that a refusal is never preceded by an estimate of work that will not run).
    """
    log = log or _default_log()
    # Model, adapter, benchmarks' data, baseline, output folder: checked before minutes of loading.
    plan = preflight(cfg, engine_given=engine is not None, guard_output=guard_output)
    if checked is not None:
        checked()
    if cfg.rescore:
        return rescore(cfg, log)
    if engine is None:
        cfg = dataclasses.replace(cfg, engine=plan.engine)
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
        for name, problems in suites.items():
            results.benchmarks[name] = _run_benchmark(
                cfg, name, problems, engine, grader, tokenizer, out_dir, log
            )
            write_results(out_dir, results)  # partial results survive a crash in a later benchmark
    return _finish(results, out_dir, cfg, log)


def _run_benchmark(
    cfg: EvalConfig, name: str, problems: Sequence[Problem], engine: RolloutEngine, grader: Grader,
    tokenizer: Any, out_dir: Path, log: Log,
) -> BenchmarkScore:  # fmt: skip
    """Generate, grade and score one benchmark; its samples file is written before it returns."""
    n = samples_for(cfg, name)
    log(f"{name}: {len(problems)} problems x {n} samples")
    prompts = [render_prompt(p.question, tokenizer, cfg.template, cfg.system_prompt) for p in problems]
    sampling = SamplingSpec(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seed=cfg.seed,
        stop=get_template(cfg.template).stop,  # as in training
    )
    records, timing = evaluate_benchmark(engine, grader, problems, prompts, n, sampling)
    path = samples_path(out_dir, name)
    write_samples(path, records)
    score = _score(records, benchmark_source(name, cfg.data_files.get(name)), path, n)
    score.timing = timing
    m = score.metrics
    log(
        f"{name}: pass@1 {100 * m.pass_at_1:.1f}% ({timing.generation_seconds:.0f} s generating, "
        f"{timing.grading_seconds:.0f} s grading, {m.grader_timeouts} grader timeouts)"
    )
    return score


def rescore(cfg: EvalConfig, log: Log | None = None) -> EvalResult:
    """Re-grade the samples saved in ``cfg.rescore`` (no generation) and rewrite the results.

    Results go to ``cfg.output`` when it was changed from the default, else back into the rescored
    folder (``preflight.output_dir``).
    """
    log = log or _default_log()
    source = Path(str(cfg.rescore))
    files = rescore_selection(cfg, find_sample_files(source))
    old = read_results(source) if (source / RESULTS_NAME).is_file() else None
    out_dir = output_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = _rescored_record(cfg, source, old, files)
    # Graded as generated: the stop strings of the samples' prompt record, else of --template's.
    recorded = old.prompt if old and old.prompt and old.prompt.get("name") else None
    stop = tuple(recorded.get("stop", ())) if recorded else get_template(cfg.template).stop
    with Grader(workers=cfg.grader_workers, timeout_s=cfg.grader_timeout_s) as grader:
        for name, path in files.items():
            previous = old.benchmarks.get(name) if old else None
            results.benchmarks[name] = _regrade(name, path, previous, grader, out_dir, log, stop)
    return _finish(results, out_dir, cfg, log)


def _rescored_record(
    cfg: EvalConfig, source: Path, old: EvalResult | None, files: dict[str, Path]
) -> EvalResult:
    """The rescored run's record: the original run's (kept as it was), with the new grading."""
    base = old or EvalResult(format=RESULTS_FORMAT, model=None, benchmarks={})
    results = dataclasses.replace(
        base, rescored_from=str(source), rescored=_now(), grading=_grading(cfg), versions=versions(),
        benchmarks={}, baseline=None,
    )  # fmt: skip
    if results.prompt is None:  # samples alone (or a results file of before the prompt record)
        first = read_samples(next(iter(files.values())))
        results.prompt = {"name": None, "template_hash": None, "note": "no results.json next to the samples"}
        results.model = results.model or f"samples in {source} ({len(first)} problems)"
    return results


def _regrade(
    name: str, path: Path, previous: BenchmarkScore | None, grader: Grader, out_dir: Path, log: Log,
    stop: tuple[str, ...],
) -> BenchmarkScore:  # fmt: skip
    """Grade one benchmark's saved completions again and write its samples file with the new grades."""
    records = read_samples(path)
    completions = [cut_at_stop(c, stop) for r in records for c in r["completions"]]
    golds = [r["gold"] for r in records for _ in r["completions"]]
    grades = grader.grade_many(completions, golds)
    start = 0
    for r in records:
        r.update(_grade_fields(grades[start : start + len(r["completions"])]))
        start += len(r["completions"])
    target = samples_path(out_dir, name)
    write_samples(target, records)
    counts = {len(r["completions"]) for r in records}
    score = _score(
        records,
        previous.source if previous else str(path),
        target,
        counts.pop() if len(counts) == 1 else None,
    )
    score.previous_pass_at_1 = previous.metrics.pass_at_1 if previous else None
    log(f"{name}: re-graded {len(completions)} completions, pass@1 {100 * score.metrics.pass_at_1:.1f}%")
    return score


__all__ = [
    "build_engine", "compare_with_baseline", "evaluate_benchmark", "rescore", "run_eval",
    "resolve_engine",  # its home is preflight; compare's held-out evaluation reaches it here
]  # fmt: skip

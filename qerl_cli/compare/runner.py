"""Run every (arm, seed) of an ablation, resumably, then summarise.

Layout of ``--output DIR``::

    DIR/bases/<format>-awq/       the 4-bit counterpart of a BF16 base (AWQ; RTN: <format>/), made once
    DIR/<arm>/seed-<s>/           one `qerl train` run (checkpoints, metrics.jsonl, adapter)
    DIR/<arm>/seed-<s>/heldout/   `qerl eval` of its adapter on the held-out split
    DIR/<arm>/seed-<s>/result.json   written last: a run with it is finished and skipped next time
    DIR/base-heldout/<base>/      `qerl eval` of an untrained base (no adapter), once per distinct base
    DIR/compare.json, compare.md, compare.png

A run without ``result.json`` but with a checkpoint resumes from it (``qerl train --resume``).
Runs are sequential in this process, or ``jobs`` child processes at a time (one per run). vLLM runs
always get a child process each; ``jobs`` of them at a time share the GPU, each planning its memory
within ``train.gpu_fraction`` = 0.92 / jobs of it, started ``compare.start_interval_s`` apart.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli import config as cfg
from qerl_cli.compare.arms import CompareSettings, as_set_strings, read_settings, select_arms
from qerl_cli.compare.bases import base_labels, prepare_bases
from qerl_cli.compare.results import BaseHeldout, CompareReport, CompareResult, HeldoutScore, RunResult
from qerl_cli.errors import QerlError
from qerl_cli.files import write_json
from qerl_cli.torch_utils import free_accelerator_memory

log = logging.getLogger(__name__)
RESULT_NAME = "result.json"
# Of the GPU's memory, what vLLM runs sharing it divide among themselves (the rest: CUDA contexts,
# fragmentation, what a run holds beyond its plan).
SHARED_GPU_FRACTION = 0.92
DEFAULT_START_INTERVAL_S = 45.0
# Set in a run's child process: it trains in-process (a vLLM run is given its own process once, not again).
CHILD_ENV = "QERL_COMPARE_CHILD"
BASE_RESULT_NAME = "heldout.json"


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"seed-{seed}"


def load_recipe(recipe: str | Path, sets: list[str] | None = None) -> tuple[dict[str, Any], CompareSettings]:
    """The recipe without its compare: section, and that section (``--set compare.X=...`` applied)."""
    data = cfg.read_yaml(recipe)
    data = cfg.apply_overrides(data, [s for s in sets or [] if s.startswith("compare.")], None)
    settings = read_settings(data.pop("compare", None))
    return data, settings


def _train_sets(sets: list[str]) -> list[str]:
    return [s for s in sets if not s.startswith("compare.")]


def arm_config(
    data: dict[str, Any], arm_overrides: dict[str, Any], sets: list[str], seed: int, out: Path, arm: str,
    bases: dict[str, str],
) -> cfg.TrainConfig:  # fmt: skip
    """recipe < --set < arm overrides < this run's seed, output dir and base path."""
    merged = cfg.apply_overrides(
        copy.deepcopy(data), [*sets, *as_set_strings(arm_overrides)], cfg.TrainConfig
    )
    merged = cfg.apply_overrides(
        merged, [f"train.seed={seed}", f"output.dir={run_dir(out, arm, seed)}"], None
    )
    fmt = str((merged.get("model") or {}).get("format", "auto"))
    if fmt in bases and "model.path" not in arm_overrides:  # an arm's own model.path wins
        merged["model"]["path"] = bases[fmt]
    conf = cfg.from_dict(cfg.TrainConfig, merged)
    cfg.validate(conf)
    return conf


def run_one(conf: cfg.TrainConfig, settings: CompareSettings, arm: str, progress: bool) -> RunResult:
    """Train (or resume) one run, evaluate it on the held-out split, write its result.json."""
    from qerl_cli.rl.checkpoint import list_checkpoints
    from qerl_cli.rl.tracking import read_metrics
    from qerl_cli.rl.trainer import train
    from qerl_cli.torch_utils import device_label

    out = Path(conf.output.dir)
    done = out / RESULT_NAME
    if done.is_file():
        return RunResult.from_dict(json.loads(done.read_text()))
    start = time.perf_counter()
    resume = str(out) if out.is_dir() and list_checkpoints(out) else None
    summary = train(conf, resume=resume, progress=progress)
    heldout = evaluate_heldout(conf, settings, summary.adapter, out / "heldout")
    records = read_metrics(out / "metrics.jsonl")
    result = RunResult(
        arm=arm,
        seed=conf.train.seed,
        model=conf.model.path,
        aqn=conf.aqn.enabled,
        device=device_label(conf.train.device),
        steps=summary.steps,
        resumed_from=summary.resumed_from or resume,
        reward=[float(r.get("reward_mean", float("nan"))) for r in records],
        entropy=[float(r.get("entropy", float("nan"))) for r in records],
        zero_std_group_fraction=[float(r.get("zero_std_group_fraction", float("nan"))) for r in records],
        heldout=heldout,
        seconds=time.perf_counter() - start,
    )
    write_json(done, result.to_dict())
    return result


def heldout_benchmark(conf: cfg.TrainConfig) -> str:
    from qerl_cli.data.benchmarks import benchmark_spec

    name = conf.data.dataset
    if name.startswith("synthetic-") or benchmark_spec(name) is not None:
        return name
    raise QerlError(
        f"qerl compare evaluates on a held-out split; data.dataset={name!r} has none built in "
        "(use a synthetic-* task or a registered benchmark)"
    )


def evaluate_heldout(
    conf: cfg.TrainConfig, settings: CompareSettings, adapter: str | None, out: Path
) -> HeldoutScore:
    """pass@1 (with its standard error) on the held-out split, via qerl eval (no adapter: the base)."""
    from qerl_cli.evaluation import run_eval

    bench = heldout_benchmark(conf)
    eval_cfg = cfg.EvalConfig(
        model=conf.model.path, adapter=adapter, benchmarks=[bench], samples=settings.heldout_samples,
        engine="hf", output=str(out), temperature=settings.heldout_temperature, top_p=1.0,
        max_new_tokens=conf.rollout.max_completion_length, max_problems=settings.heldout_problems,
        seed=conf.train.seed, template=conf.data.template, system_prompt=conf.data.system_prompt,
        grader_workers=max(1, conf.reward.grader_workers), device=conf.train.device, dtype=conf.model.dtype,
        generation_batch_size=conf.rollout.generation_batch_size,
    )  # fmt: skip
    results = run_eval(eval_cfg, log=lambda message: log.info("%s", message))
    metrics = results.benchmarks[bench].metrics
    return HeldoutScore(
        benchmark=bench,
        pass_at_1=metrics.pass_at_1,
        pass_at_1_se=metrics.pass_at_1_se,
        problems=metrics.num_problems,
        samples=settings.heldout_samples,
    )


def _base_eval_key(conf: cfg.TrainConfig, settings: CompareSettings) -> dict[str, Any]:
    """Everything an untrained base's held-out figures depend on: a change to any of it re-evaluates."""
    d, r = conf.data, conf.rollout
    return {
        "model": conf.model.path, "dtype": conf.model.dtype, "dataset": d.dataset, "template": d.template,
        "system_prompt": d.system_prompt, "max_completion_length": r.max_completion_length,
        "seed": conf.train.seed, "heldout_problems": settings.heldout_problems,
        "heldout_samples": settings.heldout_samples, "heldout_temperature": settings.heldout_temperature,
        "entropy_prompts": ENTROPY_PROMPTS, "entropy_samples": ENTROPY_SAMPLES,
    }  # fmt: skip


def evaluate_bases(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], sets: list[str], seed: int, out: Path,
    bases: dict[str, str], settings: CompareSettings,
) -> tuple[dict[str, BaseHeldout | None], list[str]]:  # fmt: skip
    """({arm: held-out pass@1 and entropy of its base before training, None when that failed},
    failures): where each arm started.

    Evaluated once per distinct (base, evaluation settings): arms differing only in AQN share one
    (evaluation adds no noise). Kept in ``DIR/base-heldout`` with the settings it was made with, so a
    resumed compare does not evaluate again unless they changed. A base that cannot be evaluated is
    reported as a failure; the others and the report go on.
    """
    from qerl_cli.torch_utils import device_label

    by_key: dict[str, BaseHeldout | None] = {}
    found: dict[str, BaseHeldout | None] = {}
    failures: list[str] = []
    for arm, overrides in arms.items():
        conf = arm_config(data, overrides, sets, seed, out, arm, bases)
        key = _base_eval_key(conf, settings)
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]
        if digest not in by_key:
            target = out / "base-heldout" / f"{Path(conf.model.path).name}-{digest}"
            done = target / BASE_RESULT_NAME
            if done.is_file():
                by_key[digest] = BaseHeldout.from_dict(json.loads(done.read_text()))
            else:
                log.info("%s: evaluating its base %s before training", arm, conf.model.path)
                try:
                    figures = evaluate_heldout(conf, settings, None, target)
                    entropy = base_entropy(conf, settings)
                except Exception as exc:  # noqa: BLE001 - one base must not cost the report
                    log.error("%s: its base could not be evaluated: %s", arm, exc)
                    failures.append(f"the base of {arm} ({type(exc).__name__}: {exc})")
                    by_key[digest] = None
                    free_accelerator_memory()
                else:
                    result = BaseHeldout(
                        conf.model.path, device_label(conf.train.device), figures, entropy, key
                    )
                    by_key[digest] = result
                    write_json(done, result.to_dict())
        found[arm] = by_key[digest]
    return found, failures


# The paper's entropy claim, measured on each untrained base: held-out prompts x samples at temperature 1.
ENTROPY_PROMPTS = 32
ENTROPY_SAMPLES = 4


def base_entropy(conf: cfg.TrainConfig, settings: CompareSettings) -> dict[str, Any]:
    """Rollout entropy of ``conf``'s base (no adapter, no noise) on the first held-out prompts."""
    from qerl_cli.compare.entropy import rollout_entropy
    from qerl_cli.data.benchmarks import load_benchmark
    from qerl_cli.data.prompts import render_prompt
    from qerl_cli.modeling.loading import load_tokenizer

    problems = load_benchmark(heldout_benchmark(conf), None, min(ENTROPY_PROMPTS, settings.heldout_problems))
    tokenizer = load_tokenizer(conf.model.path)
    data = conf.data
    prompts = [render_prompt(p.question, tokenizer, data.template, data.system_prompt) for p in problems]
    figures = rollout_entropy(
        conf.model.path, prompts, ENTROPY_SAMPLES, conf.rollout.max_completion_length, seed=conf.train.seed,
        device=conf.train.device, dtype=conf.model.dtype, batch=conf.rollout.generation_batch_size,
        trust_remote_code=conf.model.trust_remote_code,
    )  # fmt: skip
    free_accelerator_memory()
    return {"prompts": len(prompts), "samples_per_prompt": ENTROPY_SAMPLES, "temperature": 1.0, **figures}


def _child_command(
    recipe: str, arm: str, seed_count: int, only: str, out: Path, sets: list[str]
) -> list[str]:
    command = [sys.executable, "-m", "qerl_cli.cli", "compare", str(recipe), "--arms", arm]
    command += ["--seeds", str(seed_count), "--only", only, "--output", str(out), "--no-summary"]
    for item in sets:
        command += ["--set", item]
    return command


def _run_parallel(
    jobs: list[tuple[str, int]], recipe: str, seed_count: int, out: Path, sets: list[str], width: int,
    start_interval_s: float = 0.0,
) -> list[str]:  # fmt: skip
    """One child process per run, ``width`` at a time, started at least ``start_interval_s`` apart;
    the CPU threads are shared out evenly.

    Returns the runs that failed (each with where its log is); the others run to the end regardless.
    """
    threads = max(1, (os.cpu_count() or 1) // width)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), CHILD_ENV: "1"}
    pending = list(jobs)
    running: list[tuple[subprocess.Popen, str, Any]] = []
    failures = []
    last_start: float | None = None
    while pending or running:
        while pending and len(running) < width:
            if last_start is not None and time.monotonic() - last_start < start_interval_s:
                break  # the previous run's vLLM may still be measuring the free memory
            arm, seed = pending.pop(0)
            folder = run_dir(out, arm, seed)
            folder.mkdir(parents=True, exist_ok=True)
            handle = (folder / "compare.log").open("a")
            command = _child_command(recipe, arm, seed_count, f"{arm}/{seed}", out, sets)
            proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
            last_start = time.monotonic()
            running.append((proc, f"{arm}/seed-{seed}", handle))
        time.sleep(0.5)
        for item in list(running):
            proc, name, handle = item
            if proc.poll() is not None:
                handle.close()
                running.remove(item)
                if proc.returncode:
                    failures.append(f"{name} (exit {proc.returncode}, see {out / name / 'compare.log'})")
    return failures


@dataclass
class _Ablation:
    """One invocation's settled inputs: the recipe (without its compare: section), its settings, the
    arms chosen, where it all goes, and the base each arm trains on."""

    recipe: str
    data: dict[str, Any]
    settings: CompareSettings
    all_sets: list[str]  # what child processes get: every --set, compare.* included
    sets: list[str]  # the training ones
    arms: dict[str, dict[str, Any]]
    seeds: int
    base_seed: int
    out: Path
    bases: dict[str, str] = field(default_factory=dict)  # {format: base folder}, once prepared

    def config(self, arm: str, seed: int) -> cfg.TrainConfig:
        return arm_config(self.data, self.arms[arm], self.sets, seed, self.out, arm, self.bases)

    def finished(self, arm: str, seed: int) -> bool:
        return (run_dir(self.out, arm, seed) / RESULT_NAME).is_file()


def _thousandths(fraction: float, parts: int) -> float:
    """``fraction / parts`` rounded down to thousandths (0.92 / 3 -> 0.306)."""
    return round(fraction * 1000) // parts / 1000


def _shared_gpu_sets(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], all_sets: list[str], todo: list[tuple[str, int]],
    out: Path, bases: dict[str, str], confs: list[cfg.TrainConfig], width: int,
) -> list[str]:  # fmt: skip
    """The children's ``--set`` list when ``width`` vLLM runs share the GPU: each gets
    ``train.gpu_fraction`` = SHARED_GPU_FRACTION / width, or keeps the user's if it is at most 1 / width.
    Every run's config is checked with it now (e.g. an explicit vLLM share above it), not in a child."""
    given = (
        "gpu_fraction" in (data.get("train") or {})
        or any(s.split("=", 1)[0].strip() == "train.gpu_fraction" for s in all_sets)
        or any("train.gpu_fraction" in arms[a] for a, _ in todo)
    )
    if given:
        most = max(conf.train.gpu_fraction for conf in confs)
        if most > 1 / width:
            raise QerlError(
                f"train.gpu_fraction={most} is more than 1/{width} of the GPU, but --jobs runs {width} "
                f"runs on it at once: set it to at most {_thousandths(1.0, width)}, or leave it out "
                f"(compare then gives each {_thousandths(SHARED_GPU_FRACTION, width)})"
            )
        sets, fraction = list(all_sets), most
    else:
        fraction = _thousandths(SHARED_GPU_FRACTION, width)
        sets = [*all_sets, f"train.gpu_fraction={fraction}"]
    train_sets = _train_sets(sets)
    for arm, seed in todo:
        arm_config(data, arms[arm], train_sets, seed, out, arm, bases)
    log.info(
        "%d vLLM runs share the GPU at a time: each plans its memory within train.gpu_fraction=%s of it",
        width, fraction,
    )  # fmt: skip
    return sets


def run_compare(
    recipe: str | Path, arms: list[str], seeds: int, output: str | Path | None = None, *,
    sets: list[str] | None = None, only: list[str] | None = None, jobs: int = 1, summarize: bool = True,
    threshold: float | None = None, progress: bool = False,
) -> CompareResult:  # fmt: skip
    """Run the ablation (skipping finished runs) and, unless ``summarize`` is off, write its report."""
    if seeds < 1:
        raise QerlError(f"--seeds must be >= 1, got {seeds}")
    if jobs < 1:
        raise QerlError(f"--jobs must be >= 1, got {jobs}")
    ablation = _ablation(recipe, arms, seeds, output, list(sets or []))
    plan = _plan(ablation, arms, only)
    ablation.bases = prepare_bases(
        ablation.data, ablation.arms, ablation.sets, ablation.out, ablation.settings.base_method
    )
    todo = [(a, s) for a, s in plan if not ablation.finished(a, s)]
    for arm, seed in plan:
        if (arm, seed) not in todo:
            log.info("%s seed %d: finished before, skipped", arm, seed)
    failures = _train(ablation, todo, jobs, progress)
    finished = [(a, s) for a, s in plan if ablation.finished(a, s)]
    result = CompareResult(output=str(ablation.out), runs=len(plan), ran=len(todo))
    if not summarize or not finished:
        if failures:
            raise QerlError(f"{len(failures)} of {len(plan)} runs failed: " + "; ".join(failures))
        return result
    result.report, base_failures = _summarize(ablation, finished, skipped=len(plan) - len(todo),
                                              threshold=threshold)  # fmt: skip
    if failures or base_failures:
        runs = f"{len(failures)} of {len(plan)} runs failed: {'; '.join(failures)}. " if failures else ""
        evals = f"Not evaluated: {'; '.join(base_failures)}. " if base_failures else ""
        raise QerlError(
            f"{runs}{evals}{ablation.out / 'compare.md'} covers the {len(finished)} finished runs (its seeds "
            "column says how many per arm); run the same command again to resume what failed"
        )
    return result


def _ablation(
    recipe: str | Path, arms: list[str], seeds: int, output: str | Path | None, all_sets: list[str]
) -> _Ablation:
    data, settings = load_recipe(recipe, all_sets)
    sets = _train_sets(all_sets)
    out = Path(output) if output else Path("runs") / f"compare-{Path(recipe).stem}"
    out.mkdir(parents=True, exist_ok=True)
    base_seed = cfg.from_dict(
        cfg.TrainConfig, cfg.apply_overrides(copy.deepcopy(data), sets, None)
    ).train.seed
    return _Ablation(
        recipe=str(recipe), data=data, settings=settings, all_sets=all_sets, sets=sets,
        arms=select_arms(settings, arms), seeds=seeds, base_seed=base_seed, out=out,
    )  # fmt: skip


def _plan(ablation: _Ablation, arms: list[str], only: list[str] | None) -> list[tuple[str, int]]:
    """Every (arm, seed) of the ablation, or those ``--only`` names."""
    plan = [(arm, ablation.base_seed + i) for arm in ablation.arms for i in range(ablation.seeds)]
    if only:
        wanted = set(only)
        plan = [(a, s) for a, s in plan if f"{a}/{s}" in wanted]
        if not plan:
            raise QerlError(
                f"--only {sorted(wanted)} matches no run; runs are ARM/SEED like "
                f"{arms[0]}/{ablation.base_seed}"
            )
    return plan


def _train(ablation: _Ablation, todo: list[tuple[str, int]], jobs: int, progress: bool) -> list[str]:
    """Train and evaluate the runs not finished yet, here or in child processes; returns the failures."""
    confs = [ablation.config(a, s) for a, s in todo]
    engines = {conf.rollout.engine for conf in confs}
    recipe, seeds, out, all_sets = ablation.recipe, ablation.seeds, ablation.out, ablation.all_sets
    interval = ablation.settings.start_interval_s
    if "vllm" in engines and not os.environ.get(CHILD_ENV):
        # An in-process vLLM does not give its GPU memory back when closed: one child process per run,
        # even a single one (the bases' evaluation runs in this process afterwards).
        width = max(1, min(jobs, len(todo)))
        if width == 1:
            return _run_parallel(todo, recipe, seeds, out, all_sets, 1, 0.0)
        child_sets = _shared_gpu_sets(
            ablation.data, ablation.arms, all_sets, todo, out, ablation.bases, confs, width
        )
        # Staggered starts: each vLLM engine profiles the GPU's memory while the others stand still.
        wait = DEFAULT_START_INTERVAL_S if interval is None else interval
        return _run_parallel(todo, recipe, seeds, out, child_sets, width, wait)
    if jobs > 1 and len(todo) > 1:
        return _run_parallel(todo, recipe, seeds, out, all_sets, jobs, interval or 0.0)
    failures = []
    for arm, seed in todo:
        log.info("%s seed %d: training", arm, seed)
        try:
            run_one(ablation.config(arm, seed), ablation.settings, arm, progress)
        except Exception as exc:  # noqa: BLE001 - a diverged, broken or OOM run must not cost the others
            # A QerlError says what to do; anything else is unexpected: keep its traceback in the log.
            log.error("%s seed %d failed: %s", arm, seed, exc, exc_info=not isinstance(exc, QerlError))
            why = str(exc) if isinstance(exc, QerlError) else f"{type(exc).__name__}: {exc}"
            failures.append(f"{arm}/seed-{seed} ({why})")
            free_accelerator_memory()
    return failures


def _summarize(
    ablation: _Ablation, finished: list[tuple[str, int]], *, skipped: int, threshold: float | None
) -> tuple[CompareReport, list[str]]:
    """Evaluate the arms' bases (once each), then write the report of the finished runs; returns it
    and the bases that could not be evaluated."""
    from qerl_cli.compare.summary import write_report

    a = ablation
    _warn_of_other_bases(a.data, a.arms, a.sets, a.out, a.bases, finished)
    start, base_failures = evaluate_bases(a.data, a.arms, a.sets, a.base_seed, a.out, a.bases, a.settings)
    paths = {arm: a.config(arm, a.base_seed).model.path for arm in a.arms}
    labels = base_labels(paths, a.bases, a.out, a.settings.base_method)
    seeds = list(range(a.base_seed, a.base_seed + a.seeds))
    report = write_report(a.out, a.arms, seeds, a.settings, threshold, skipped=skipped, recipe=a.recipe,
                          base_heldout=start, base_labels=labels)  # fmt: skip
    for warning in report.warnings:
        log.warning("%s", warning)
    return report, base_failures


def _warn_of_other_bases(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], sets: list[str], out: Path,
    bases: dict[str, str], finished: list[tuple[str, int]],
) -> None:  # fmt: skip
    """Finished runs trained on another base than their arm's now (e.g. compare.base_method changed
    between two invocations on one output folder) would be reported side by side: say so."""
    for arm, seed in finished:
        result = RunResult.from_dict(json.loads((run_dir(out, arm, seed) / RESULT_NAME).read_text()))
        now = arm_config(data, arms[arm], sets, seed, out, arm, bases).model.path
        if result.model and result.model != now:
            log.warning(
                "%s seed %d was trained on %s, but the arm's base is now %s: the report mixes the two "
                "(use another --output, or remove %s to train it again)", arm, seed, result.model, now,
                run_dir(out, arm, seed),
            )  # fmt: skip

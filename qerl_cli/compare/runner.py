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
always get a child process each; ``jobs`` of them at a time share the GPU (:func:`_shared_gpu_sets`):
each plans its memory within ``train.gpu_fraction`` = 0.92 / jobs of it, runs vLLM without sleep mode
and with an explicit share of its own (half its fraction, or the recipe's if smaller), and starts once
the previous run's vLLM engine is up (its ``engine_ready`` file), at least ``compare.start_interval_s``
after it. vLLM measures the whole device's memory while it starts and around ``sleep()``, so a
neighbour that allocates meanwhile breaks it: a negative KV cache at start, ``Memory usage increased
after sleeping`` mid-run.
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
# The least gap between two vLLM runs' starts on one GPU; each also waits for the previous one's engine.
DEFAULT_START_INTERVAL_S = 10.0
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


@dataclass
class _Child:
    """A run's child process, and whether its rollout engine has reported (or is taken to be) up."""

    proc: subprocess.Popen
    name: str
    handle: Any
    folder: Path
    started: float
    engine_up: bool = False


def _engines_up(running: list[_Child], now: float, timeout_s: float, marker: str) -> bool:
    """Whether every running child's vLLM engine is up: its ``marker`` file is in its run folder, or it
    has been starting for ``timeout_s`` (then the next run starts regardless, with a warning)."""
    for child in running:
        if child.engine_up:
            continue
        if (child.folder / marker).is_file():
            child.engine_up = True
            log.info("%s: its rollout engine is up after %.0f s", child.name, now - child.started)
        elif now - child.started >= timeout_s:
            child.engine_up = True
            log.warning(
                "%s: no %s after %.0f s (compare.engine_ready_timeout_s); starting the next run regardless",
                child.name, marker, now - child.started,
            )  # fmt: skip
        else:
            return False
    return True


def _run_parallel(
    jobs: list[tuple[str, int]], recipe: str, seed_count: int, out: Path, sets: list[str], width: int,
    start_interval_s: float = 0.0, ready_timeout_s: float | None = None,
) -> list[str]:  # fmt: skip
    """One child process per run, ``width`` at a time, started at least ``start_interval_s`` apart;
    the CPU threads are shared out evenly. With ``ready_timeout_s`` (vLLM runs sharing the GPU) a run
    starts only once every running one's rollout engine is up (``rl.setup.ENGINE_READY_FILE`` in its
    folder, which the child writes), or has been starting for that long.

    Returns the runs that failed (each with where its log is); the others run to the end regardless.
    """
    from qerl_cli.rl.setup import ENGINE_READY_FILE

    threads = max(1, (os.cpu_count() or 1) // width)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), CHILD_ENV: "1"}
    pending = list(jobs)
    running: list[_Child] = []
    failures = []
    last_start: float | None = None
    while pending or running:
        while pending and len(running) < width:
            now = time.monotonic()
            if last_start is not None and now - last_start < start_interval_s:
                break
            starting = ready_timeout_s is not None and not _engines_up(
                running, now, ready_timeout_s, ENGINE_READY_FILE
            )
            if starting:
                break  # a vLLM engine still measuring the GPU's memory: the next start would skew it
            arm, seed = pending.pop(0)
            folder = run_dir(out, arm, seed)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / ENGINE_READY_FILE).unlink(missing_ok=True)  # an earlier invocation's
            handle = (folder / "compare.log").open("a")
            command = _child_command(recipe, arm, seed_count, f"{arm}/{seed}", out, sets)
            proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
            last_start = time.monotonic()
            running.append(_Child(proc, f"{arm}/seed-{seed}", handle, folder, last_start))
        time.sleep(0.5)
        for child in list(running):
            if child.proc.poll() is not None:
                child.handle.close()
                running.remove(child)
                if child.proc.returncode:
                    failures.append(
                        f"{child.name} (exit {child.proc.returncode}, see {out / child.name / 'compare.log'})"
                    )
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


def _set_key(item: str) -> str:
    return item.split("=", 1)[0].strip()


def _set_value(item: str) -> Any:
    import yaml

    return yaml.safe_load(item.split("=", 1)[1]) if "=" in item else None


def _explicit(
    key: str, arms: dict[str, dict[str, Any]], sets: list[str], todo: list[tuple[str, int]]
) -> list[tuple[str, Any]]:
    """Where this invocation sets ``key`` itself (``--set`` or an arm's override), with the value."""
    found = [("--set", _set_value(s)) for s in sets if _set_key(s) == key]
    found += [(f"arm {a}", arms[a][key]) for a in dict.fromkeys(a for a, _ in todo) if key in arms[a]]
    return found


def _child_vllm_share(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], all_sets: list[str], todo: list[tuple[str, int]],
    fraction: float, width: int,
) -> tuple[float | None, str]:  # fmt: skip
    """vLLM's share (a fraction of the whole GPU) each run sharing it gets, and why: half its
    ``fraction``, or the recipe's smaller explicit share; None where ``--set`` gives one (kept, checked).
    An arm's own share is kept (checked). With sleep mode off the share must be a number."""
    key = "rollout.gpu_memory_utilization"
    half = _thousandths(fraction, 2)
    for where, value in _explicit(key, arms, all_sets, todo):
        if value == "auto":
            raise QerlError(
                f"{key}=auto ({where}) with --jobs {width}: vLLM runs sharing the GPU run without sleep "
                f"mode, and then need an explicit share. Leave it out (each vLLM then gets {half}, half of "
                f"its train.gpu_fraction={fraction}) or give a fraction of the whole GPU of at most "
                f"{fraction}"
            )
        if isinstance(value, int | float) and value > fraction:
            raise QerlError(
                f"{key}={value} ({where}) is more than train.gpu_fraction={fraction}, the part of the GPU "
                f"each of the {width} runs sharing it may use: give at most {fraction}, or leave it out "
                f"(each vLLM then gets {half}, half of its fraction)"
            )
    if any(_set_key(s) == key for s in all_sets):
        return None, "--set's"
    recipe = cfg.from_dict(
        cfg.TrainConfig, cfg.apply_overrides(copy.deepcopy(data), _train_sets(all_sets), None)
    ).rollout.gpu_memory_utilization
    if recipe != "auto" and float(recipe) <= half:
        return float(recipe), "the recipe's"
    why = "the recipe's auto needs sleep mode" if recipe == "auto" else f"the recipe's {recipe} is larger"
    return half, f"half of train.gpu_fraction; {why}"


def _shared_gpu_sets(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], all_sets: list[str], todo: list[tuple[str, int]],
    out: Path, bases: dict[str, str], confs: list[cfg.TrainConfig], width: int,
) -> list[str]:  # fmt: skip
    """The children's ``--set`` list when ``width`` vLLM runs share the GPU: each gets
    ``train.gpu_fraction`` = SHARED_GPU_FRACTION / width (or keeps the user's if it is at most 1 / width),
    vLLM's sleep mode off and an explicit vLLM share inside that fraction (:func:`_child_vllm_share`): the
    trainer plans its update within what the share leaves of the slice.

    Sleep mode cannot stay on: vLLM's ``sleep()`` compares the whole device's free memory before and
    after, and stops the run when a neighbour allocated meanwhile. A user who turns it on explicitly
    (``--set`` or an arm) is refused (exit 2) rather than overridden. Every run's config is checked with
    these settings now, not in a child."""
    given = (
        "gpu_fraction" in (data.get("train") or {})
        or any(_set_key(s) == "train.gpu_fraction" for s in all_sets)
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
    for where, value in _explicit("rollout.enable_sleep_mode", arms, all_sets, todo):
        if value is True:
            raise QerlError(
                f"rollout.enable_sleep_mode=true ({where}) with --jobs {width}: vLLM runs sharing the GPU "
                "cannot sleep. vLLM's sleep() compares the whole device's free memory before and after, and "
                "stops the run ('Memory usage increased after sleeping') when a neighbour allocated "
                "meanwhile; compare turns sleep mode off for each of them (vLLM keeps an explicit share "
                "through the update). Remove the setting, or run one at a time (--jobs 1) to keep sleep mode"
            )
    # Arms may give different fractions: the share fits the smallest.
    smallest = min(conf.train.gpu_fraction for conf in confs) if given else fraction
    share, why = _child_vllm_share(data, arms, all_sets, todo, smallest, width)
    sets.append("rollout.enable_sleep_mode=false")
    if share is not None:
        sets.append(f"rollout.gpu_memory_utilization={share}")
    train_sets = _train_sets(sets)
    for arm, seed in todo:
        arm_config(data, arms[arm], train_sets, seed, out, arm, bases)
    if share is None:  # the user's --set (the last one wins)
        share = _explicit("rollout.gpu_memory_utilization", {}, all_sets, [])[-1][1]
    log.info(
        "%d vLLM runs share the GPU at a time: each plans its memory within train.gpu_fraction=%s of it, "
        "with vLLM's sleep mode off and its share rollout.gpu_memory_utilization=%s of the whole GPU (%s); "
        "each starts once the previous one's vLLM engine is up",
        width, fraction, share, why,
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
        # One vLLM start at a time: each waits until the previous run's engine is up, at least `gap` later.
        gap = DEFAULT_START_INTERVAL_S if interval is None else interval
        timeout = ablation.settings.engine_ready_timeout_s
        return _run_parallel(todo, recipe, seeds, out, child_sets, width, gap, timeout)
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

"""Run every (arm, seed) of an ablation, resumably, then summarise.

Layout of ``--output DIR``::

    DIR/bases/<format>-awq/       the 4-bit counterpart of a BF16 base (AWQ; RTN: <format>/), made once
    DIR/<arm>/seed-<s>/           one `qerl train` run (checkpoints, metrics.jsonl, adapter)
    DIR/<arm>/seed-<s>/heldout/   `qerl eval` of its adapter on the held-out split
    DIR/<arm>/seed-<s>/result.json   written last: a run with it is finished and skipped next time
    DIR/base-heldout/<base>/      `qerl eval` of an untrained base (no adapter), once per distinct base
    DIR/compare.json, compare.md, compare.png

A run without ``result.json`` but with a checkpoint resumes from it (``qerl train --resume``).
Runs are sequential in this process, or ``jobs`` child processes at a time (one per run,
:mod:`~qerl_cli.compare.parallel`). vLLM runs always get a child process each; ``jobs`` of them at a
time share the GPU (:mod:`~qerl_cli.compare.gpu_share`): each plans its memory within
``train.gpu_fraction`` = 0.92 / jobs of it, runs vLLM without sleep mode and with an explicit share of
its own (half its fraction, or the recipe's if smaller), its KV cache sized from that share, and starts
once the previous run's vLLM engine is up (its ``engine_ready`` file) or has been starting for
``compare.engine_ready_timeout_s``, at least ``compare.start_interval_s`` after it. vLLM's own profiling
and ``sleep()`` measure the whole device's memory, so a neighbour that allocates meanwhile breaks them (a
negative KV cache at start, ``Memory usage increased after sleeping`` mid-run): neither is used. Each run's
and each base's held-out figures come from :mod:`~qerl_cli.compare.heldout`; where runs live and their
configs, from :mod:`~qerl_cli.compare.runs`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli.compare import heldout
from qerl_cli.compare import runs as run_folders
from qerl_cli.compare.arms import select_arms
from qerl_cli.compare.base_identity import base_identity
from qerl_cli.compare.bases import base_labels, check_base_formats, prepare_bases, recorded_bases
from qerl_cli.compare.gpu_share import SHARE_KEY, planning_sets, shared_gpu_sets
from qerl_cli.compare.parallel import (
    CHILD_ENV,
    DEFAULT_START_INTERVAL_S,
    check_gpus_given,
    child_environment,
    invocation_id,
    run_parallel,
    runs_per_gpu,
    visible_gpus,
)
from qerl_cli.compare.results import CompareReport, CompareResult, RunResult
from qerl_cli.compare.runs import RESULT_NAME, STOP_HINT, arm_config, load_recipe, run_dir, train_sets
from qerl_cli.compare.settings import CompareSettings
from qerl_cli.compare.summary import write_report
from qerl_cli.compare.verdict import DEFAULT_REFERENCE, check_margin, verdict_line
from qerl_cli.config import TrainConfig, apply_overrides, from_dict
from qerl_cli.envinfo import gpu_info
from qerl_cli.errors import Checked, QerlError
from qerl_cli.files import check_writable_folder, write_json
from qerl_cli.rl import preflight
from qerl_cli.rl import trainer as trainer_mod
from qerl_cli.rl.checkpoint import list_checkpoints
from qerl_cli.rl.importance import LOGPROB_GAP
from qerl_cli.rl.tracking import read_metrics
from qerl_cli.torch_utils import device_label, free_accelerator_memory

log = logging.getLogger(__name__)


def run_one(
    conf: TrainConfig, settings: CompareSettings, arm: str, progress: bool, invocation: str | None = None, *,
    compare_dir: Path,
) -> RunResult:  # fmt: skip
    """Train (or resume) one run, evaluate it on the held-out split, write its result.json (with its base
    by its portable identity in the comparison ``compare_dir``, the device, the GPUs seen and
    ``invocation``, the compare invocation that trained it)."""

    out = Path(conf.output.dir)
    done = out / RESULT_NAME
    if done.is_file():
        return RunResult.from_dict(json.loads(done.read_text()))
    start = time.perf_counter()
    resume = str(out) if out.is_dir() and list_checkpoints(out) else None
    # Without a checkpoint, what the folder holds is a failed attempt of this same run: start it over.
    summary = trainer_mod.train(conf, resume=resume, progress=progress, overwrite=resume is None)
    # A vLLM evaluation serves the adapter with the kernels the run's rollouts used (auto's choice).
    figures = heldout.evaluate_heldout(
        conf, settings, summary.adapter, out / "heldout", summary.linear_backend
    )
    records = read_metrics(out / "metrics.jsonl")
    result = RunResult(
        arm=arm,
        seed=conf.train.seed,
        model=base_identity(conf.model.path, compare_dir),
        aqn=conf.aqn.enabled,
        device=device_label(conf.train.device),
        gpus=len(gpu_info()),
        invocation=invocation,
        steps=summary.steps,
        resumed_from=summary.resumed_from or resume,
        reward=[float(r.get("reward_mean", float("nan"))) for r in records],
        entropy=[float(r.get("entropy", float("nan"))) for r in records],
        zero_std_group_fraction=[float(r.get("zero_std_group_fraction", float("nan"))) for r in records],
        logprob_gap=[float(r.get(LOGPROB_GAP, float("nan"))) for r in records],
        heldout=figures,
        seconds=time.perf_counter() - start,
    )
    write_json(done, result.to_dict())
    return result


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
    invocation: str  # this invocation's id (a child's: its parent's), recorded by every run it trains
    bases: dict[str, str] = field(default_factory=dict)  # {arm: base folder}, once prepared

    def config(self, arm: str, seed: int) -> TrainConfig:
        return arm_config(self.data, self.arms[arm], self.sets, seed, self.out, arm, self.bases)

    def finished(self, arm: str, seed: int) -> bool:
        return (run_dir(self.out, arm, seed) / RESULT_NAME).is_file()

    def check_finished(self, plan: list[tuple[str, int]]) -> None:
        """The finished runs of ``plan`` were trained with the settings this invocation gives them."""
        finished = {(a, s): self.config(a, s) for a, s in plan if self.finished(a, s)}
        run_folders.check_finished_settings(self.out, finished)


def run_compare(
    recipe: str | Path, arms: list[str], seeds: int, output: str | Path | None = None, *,
    sets: list[str] | None = None, only: list[str] | None = None, jobs: int = 1, summarize: bool = True,
    threshold: float | None = None, progress: bool = False, gpus: str = "auto", reference: str | None = None,
    margin: float | None = None, report_only: bool = False,
) -> CompareResult:  # fmt: skip
    """Run the ablation (skipping finished runs) and, unless ``summarize`` is off, write its report.
    ``gpus`` (``auto`` or a comma list of GPU ids): the GPUs child runs are spread over. ``reference``
    and ``margin`` (points) override ``compare.reference`` and ``compare.margin`` for the verdicts.
    ``report_only``: no training, no base made or evaluated: the report of the finished runs, with the
    bases their runs recorded and whatever base figures were kept beside them (runs made elsewhere)."""
    ablation, plan = _settle(
        recipe, arms, seeds, output, sets, only, jobs, gpus, reference, margin, summarize
    )
    if report_only:
        return _report_only(ablation, plan, threshold)
    if ablation.settings.heldout_engine != "hf":  # refused before any base is made or run trains
        heldout.check_heldout_engine(ablation.settings, _rollout_engines(ablation))
    _input_checks(ablation)  # --dry-run's checks of the inputs, before any base is made (each raises)
    ablation.check_finished(plan)
    ablation.out.mkdir(parents=True, exist_ok=True)
    ablation.bases = prepare_bases(
        ablation.data, ablation.arms, ablation.sets, ablation.out, ablation.settings.base_method
    )
    todo = [(a, s) for a, s in plan if not ablation.finished(a, s)]
    for arm, seed in plan:
        if (arm, seed) not in todo:
            log.info("%s seed %d: finished before, skipped", arm, seed)
    failures = _train(ablation, todo, jobs, progress, gpus)
    finished = [(a, s) for a, s in plan if ablation.finished(a, s)]
    result = CompareResult(output=str(ablation.out), runs=len(plan), ran=len(todo))
    if not summarize or not finished:
        if failures:
            raise QerlError(
                f"{len(failures)} of {len(plan)} runs failed: {'; '.join(failures)}. Once fixed, {STOP_HINT}"
            )
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


def check_compare(
    recipe: str | Path, arms: list[str], seeds: int, output: str | Path | None = None, *,
    sets: list[str] | None = None, only: list[str] | None = None, jobs: int = 1, gpus: str = "auto",
    reference: str | None = None, margin: float | None = None,
) -> list[Checked]:  # fmt: skip
    """What ``qerl compare --dry-run`` checks, as :func:`run_compare` does before any work (recipe, arms,
    seeds, ``--only``, reference, margin, held-out engine), and what a run needs that would otherwise fail
    only after a base was made (output folder, model, dataset, engines); nothing is made or written."""
    ablation, plan = _settle(recipe, arms, seeds, output, sets, only, jobs, gpus, reference, margin, True)
    engines = _rollout_engines(ablation)
    if ablation.settings.heldout_engine != "hf":
        heldout.check_heldout_engine(ablation.settings, engines)
    out = ablation.out
    ablation.check_finished(plan)
    todo = [(a, s) for a, s in plan if not ablation.finished(a, s)]
    resumed = sum(bool(list_checkpoints(run_dir(out, a, s))) for a, s in todo)
    seeds_run = ", ".join(str(s) for s in sorted({s for _, s in plan}))
    arm_names = ", ".join(dict.fromkeys(a for a, _ in plan))
    checked = [Checked(
        "runs", f"{len(plan)} ({arm_names} x seeds {seeds_run}): "
        f"{len(plan) - len(todo)} finished (skipped), {resumed} resume from a checkpoint, "
        f"{len(todo) - resumed} new",
    )]  # fmt: skip
    checked += _input_checks(ablation)
    # The engines each run checks again in its own process before it trains (a child may have a GPU).
    probes = _probes(ablation)
    checked.extend(dict.fromkeys(preflight.engine(conf) for conf in probes))
    checked.append(preflight.grader())
    return checked


def _input_checks(ablation: _Ablation) -> list[Checked]:
    """The output folder (each arm's apart from its model's, as ``qerl train`` checks), and each arm's model
    and dataset (on the recipe's model or the arm's own model.path: the 4-bit bases made from it come
    later): checked by ``--dry-run`` and by a run before it makes a base, so a wrong one is named first."""
    out = ablation.out
    writable = check_writable_folder(out, "--output", "choose another with -o DIR")
    found = "writable" if writable else "a new folder (made when the ablation starts)"
    checked = [Checked("--output", f"{out}: {found}")]
    probes = _probes(ablation)
    for conf in probes:
        preflight.output_apart_from_model(conf)
    for check in (preflight.model_source, preflight.dataset):
        checked.extend(dict.fromkeys(check(conf) for conf in probes))  # one line per distinct finding
    checked.extend(dict.fromkeys(preflight.extra_rewards(conf) for conf in probes if conf.reward.extra))
    method = ablation.settings.base_method
    # A base made before from another model or with other settings is refused here, before any work.
    trains_on, any_made = check_base_formats(ablation.data, ablation.arms, ablation.sets, method, out)
    where = "; ".join(f"{arm}: {base}" for arm, base in trains_on.items())
    made = f" (under {out / 'bases'}; compare.base_method={method})" if any_made else ""
    checked.append(Checked("bases", where + made))
    return checked


def _probes(ablation: _Ablation) -> list[TrainConfig]:
    """Each arm's config at the first seed, to check its model, dataset and engine. vLLM's share is left
    on auto: runs sharing a GPU get theirs from the parent (gpu_share.shared_gpu_sets, which checks a
    given one), so the recipe's default would be refused here against a smaller train.gpu_fraction."""
    sets = [*ablation.sets, f"{SHARE_KEY}=auto"]
    return [arm_config(ablation.data, ablation.arms[arm], sets, ablation.base_seed, ablation.out, arm,
                       ablation.bases) for arm in ablation.arms]  # fmt: skip


def _settle(
    recipe: str | Path, arms: list[str], seeds: int, output: str | Path | None, sets: list[str] | None,
    only: list[str] | None, jobs: int, gpus: str, reference: str | None, margin: float | None,
    summarize: bool,
) -> tuple[_Ablation, list[tuple[str, int]]]:  # fmt: skip
    """The ablation and its (arm, seed) plan, with every flag checked; nothing written."""
    if seeds < 1:
        raise QerlError(f"--seeds must be >= 1, got {seeds}")
    if jobs < 1:
        raise QerlError(f"--jobs must be >= 1, got {jobs}")
    if gpus != "auto":
        check_gpus_given(gpus)  # a malformed list, or GPUs on a machine with none, stops here
    ablation = _ablation(recipe, arms, seeds, output, list(sets or []))
    if margin is not None:
        ablation.settings.margin = check_margin(margin)
    if summarize:  # a run's child (--no-summary) compares nothing: its single arm needs no reference
        ablation.settings.reference = _reference(reference or ablation.settings.reference, ablation.arms)
    return ablation, _plan(ablation, arms, only)


def _ablation(
    recipe: str | Path, arms: list[str], seeds: int, output: str | Path | None, all_sets: list[str]
) -> _Ablation:
    data, settings = load_recipe(recipe, all_sets)
    sets = train_sets(all_sets)
    # Made by run_compare once checked (not here: --dry-run and a refused invocation write nothing).
    out = Path(output) if output else Path("runs") / f"compare-{Path(recipe).stem}"
    base_seed = from_dict(TrainConfig, apply_overrides(copy.deepcopy(data), sets, None)).train.seed
    return _Ablation(
        recipe=str(recipe), data=data, settings=settings, all_sets=all_sets, sets=sets,
        arms=select_arms(settings, arms), seeds=seeds, base_seed=base_seed, out=out,
        invocation=invocation_id(),
    )  # fmt: skip


def _rollout_engines(ablation: _Ablation) -> dict[str, str]:
    """{arm: its rollout.engine}, read on the recipe's model before the bases are made (an arm's engine
    does not depend on its base), with the vLLM share planning leaves to compare (as :func:`_train`)."""
    planning = planning_sets(ablation.sets)
    return {
        arm: arm_config(
            ablation.data, overrides, planning, ablation.base_seed, ablation.out, arm, {}
        ).rollout.engine
        for arm, overrides in ablation.arms.items()
    }


def _reference(asked: str | None, arms: dict[str, dict[str, Any]]) -> str | None:
    """The arm the verdicts compare with: the one asked for (which must be among the arms), else
    bf16-lora if it is among them, else none (no verdicts)."""
    if asked is None:
        return DEFAULT_REFERENCE if DEFAULT_REFERENCE in arms else None
    if asked not in arms:
        raise QerlError(
            f"the verdicts' reference arm {asked!r} is not among the arms ({', '.join(arms)}): add it to "
            "--arms, or name one of them with --reference (compare.reference)"
        )
    return asked


def _plan(ablation: _Ablation, arms: list[str], only: list[str] | None) -> list[tuple[str, int]]:
    """Every (arm, seed) of the ablation, or those ``--only`` names, seed by seed: every arm's first
    seed runs before any arm's second, so an ablation stopped part way still compares every arm."""
    plan = [(arm, ablation.base_seed + i) for i in range(ablation.seeds) for arm in ablation.arms]
    if only:
        wanted = set(only)
        plan = [(a, s) for a, s in plan if f"{a}/{s}" in wanted]
        if not plan:
            seeds = f"{ablation.base_seed}..{ablation.base_seed + ablation.seeds - 1}"
            raise QerlError(
                f"--only {','.join(sorted(wanted))} matches no run; runs are ARM/SEED of the arms "
                f"{','.join(ablation.arms)} and the seeds {seeds} (like {arms[0]}/{ablation.base_seed})"
            )
    return plan


def _train(
    ablation: _Ablation, todo: list[tuple[str, int]], jobs: int, progress: bool, gpus: str = "auto"
) -> list[str]:
    """Train and evaluate the runs not finished yet, here or in child processes; returns the failures."""
    planning = planning_sets(ablation.sets)  # the vLLM share left to gpu_share where --set gives none
    confs = [
        arm_config(ablation.data, ablation.arms[arm], planning, seed, ablation.out, arm, ablation.bases)
        for arm, seed in todo
    ]
    engines = {conf.rollout.engine for conf in confs}
    recipe, seeds, out, all_sets = ablation.recipe, ablation.seeds, ablation.out, ablation.all_sets
    interval = ablation.settings.start_interval_s
    # What every child gets: the invocation its run records, and vLLM's batch-invariant mode if asked.
    environment = child_environment(ablation.settings.batch_invariant)
    if ablation.settings.batch_invariant and "vllm" not in engines and todo:
        log.warning("compare.batch_invariant is vLLM's mode: these runs' hf engine does not use it")
    child = {"invocation": ablation.invocation, "environment": environment}
    children = not os.environ.get(CHILD_ENV)
    width = max(1, min(jobs, len(todo)))
    devices = visible_gpus(gpus) if children and (width > 1 or "vllm" in engines) else []
    if devices:
        log.info("%d runs at a time over %d GPUs (%s): at most %d on each", width, len(devices),
                 ",".join(devices), runs_per_gpu(width, devices))  # fmt: skip
    if "vllm" in engines and children:
        # An in-process vLLM does not give its GPU memory back when closed: one child process per run,
        # even a single one (the bases' evaluation runs in this process afterwards).
        sharing = runs_per_gpu(width, devices)
        if sharing == 1:  # each run alone on its GPU: the recipe as is (sleep mode, measured share)
            for arm, seed in todo:  # its share checked now, not in a child
                ablation.config(arm, seed)
            return run_parallel(todo, recipe, seeds, out, all_sets, width, 0.0, None, devices, **child)
        child_sets = shared_gpu_sets(
            ablation.data, ablation.arms, all_sets, todo, out, ablation.bases, confs, sharing
        )
        # Staggered starts: each waits for the previous run's engine on its GPU (at most `timeout`), and
        # starts `gap` after the last start at least.
        gap = DEFAULT_START_INTERVAL_S if interval is None else interval
        timeout = ablation.settings.engine_ready_timeout_s
        return run_parallel(todo, recipe, seeds, out, child_sets, width, gap, timeout, devices, **child)
    if jobs > 1 and len(todo) > 1:
        return run_parallel(todo, recipe, seeds, out, all_sets, jobs, interval or 0.0, None, devices, **child)
    failures = []
    for arm, seed in todo:
        log.info("%s seed %d: training", arm, seed)
        try:
            run_one(ablation.config(arm, seed), ablation.settings, arm, progress, ablation.invocation,
                    compare_dir=ablation.out)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a diverged, broken or OOM run must not cost the others
            # A QerlError says what to do; anything else is unexpected: keep its traceback in the log.
            log.error("%s seed %d failed: %s", arm, seed, exc, exc_info=not isinstance(exc, QerlError))
            why = str(exc) if isinstance(exc, QerlError) else f"{type(exc).__name__}: {exc}"
            failures.append(f"{arm}/seed-{seed} ({why})")
            free_accelerator_memory()
    return failures


def _report_only(ablation: _Ablation, plan: list[tuple[str, int]], threshold: float | None) -> CompareResult:
    """The report of ``plan``'s finished runs as they are: each arm's base is the one its runs recorded
    (made where they ran, perhaps not here), its untrained figures those kept in ``DIR/base-heldout``."""
    finished = [(a, s) for a, s in plan if ablation.finished(a, s)]
    if not finished:
        raise QerlError(
            f"--report-only: no finished run of these arms and seeds under {ablation.out} (each has "
            "ARM/seed-S/result.json): give -o the folder the runs are in, or run without --report-only"
        )
    ablation.bases = recorded_bases(ablation.out, finished)
    asked = list(ablation.arms)  # an arm without a finished run is left out of the report, and named
    arms = {a for a, _ in finished}
    ablation.arms = {a: o for a, o in ablation.arms.items() if a in arms}
    if ablation.settings.reference not in ablation.arms:
        ablation.settings.reference = None
    report, _ = _summarize(
        ablation, finished, skipped=len(finished), threshold=threshold, evaluate=False, asked=asked
    )
    return CompareResult(output=str(ablation.out), runs=len(plan), ran=0, report=report)


def _summarize(
    ablation: _Ablation, finished: list[tuple[str, int]], *, skipped: int, threshold: float | None,
    evaluate: bool = True, asked: list[str] | None = None,
) -> tuple[CompareReport, list[str]]:  # fmt: skip
    """Evaluate the arms' bases (once each; with ``evaluate`` off only the figures kept before), then
    write the report of the finished runs, naming the runs of the ``asked`` arms (default: the ablation's)
    it lacks; returns it and the bases that could not be evaluated."""

    a = ablation
    _warn_of_other_bases(a.data, a.arms, a.sets, a.out, a.bases, finished)
    start, base_failures = heldout.evaluate_bases(
        a.data, a.arms, a.sets, a.base_seed, a.out, a.bases, a.settings, evaluate=evaluate
    )
    paths = {arm: a.config(arm, a.base_seed).model.path for arm in a.arms}
    labels = base_labels(paths, a.arms, a.bases, a.out, a.settings.base_method)
    seeds = list(range(a.base_seed, a.base_seed + a.seeds))
    missing = [(arm, seed) for arm in asked or a.arms for seed in seeds if not a.finished(arm, seed)]
    report = write_report(a.out, a.arms, seeds, a.settings, threshold, skipped=skipped, recipe=a.recipe,
                          base_heldout=start, base_labels=labels, missing=missing)  # fmt: skip
    for verdict in report.verdicts:
        log.info("%s", verdict_line(verdict))
    for warning in report.warnings:
        log.warning("%s", warning)
    return report, base_failures


def _warn_of_other_bases(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], sets: list[str], out: Path,
    bases: dict[str, str], finished: list[tuple[str, int]],
) -> None:  # fmt: skip
    """Finished runs trained on another base than their arm's now (e.g. compare.base_method changed
    between two invocations on one output folder, or seed ranges made on machines with different bases)
    would be reported side by side: say so. Bases compare by their portable identity, so the same base
    reached through another copy of the folder or another cache is not a change."""
    for arm, seed in finished:
        result = RunResult.from_dict(json.loads((run_dir(out, arm, seed) / RESULT_NAME).read_text()))
        now = arm_config(data, arms[arm], sets, seed, out, arm, bases).model.path
        if result.model and base_identity(result.model, out) != base_identity(now, out):
            log.warning(
                "%s seed %d was trained on %s, but the arm's base is now %s: the report mixes the two "
                "(use another --output, or remove %s to train it again)", arm, seed, result.model, now,
                run_dir(out, arm, seed),
            )  # fmt: skip

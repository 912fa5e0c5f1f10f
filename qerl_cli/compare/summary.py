"""The ablation's table: per arm, over seeds, from each run's ``result.json``.

- final reward: mean training reward over the last 10% of steps (at least one step);
- base pass@1: the same held-out evaluation of the arm's base before training (no adapter);
- held-out accuracy: pass@1 on the held-out split; its standard error is the spread over seeds
  (sd / sqrt(seeds)), which contains the evaluation's own sampling error; with one seed, the
  evaluation's standard error. An evaluation re-graded since (``qerl eval --rescore`` of a run's
  ``heldout/`` or a base's ``base-heldout/<base>/`` folder) counts with its new grades;
- steps to threshold: first step at which the trailing mean reward (window: 10% of steps) reaches
  the threshold; averaged over the seeds that reach it ("k/n" says how many did). Default threshold:
  halfway between the mean reward of the first window (all runs) and the best arm's final reward;
- early entropy: mean rollout entropy (-E[log p] of sampled tokens) over the first 20% of steps.
- base entropy (T=1): the untrained base's mean next-token entropy over its own completions of the first
  held-out prompts, sampled at temperature 1 with no adapter and no noise (``compare.entropy``): the
  paper's "quantization raises entropy" claim, before any training.
- start reward and no-spread groups: the mean training reward, and the share of prompt groups whose
  rewards were all equal, over the first 10% of steps (at least one). They come from the runs' own
  ``metrics.jsonl`` rather than from the base's held-out evaluation, because that evaluation gives a
  problem one greedy answer or a few samples while GRPO learns only from groups of
  ``rollout.num_generations`` samples at the training temperature that differ in reward: the training's
  first steps are that measurement.
  AQN's first stage is noise-free, so those steps see the base as it is. An arm whose groups have a
  reward spread in fewer than :data:`MIN_SIGNAL_FRACTION` of cases is named in ``warnings``: its
  base starts with too little signal for GRPO.
- base: the format of the arm's base and how it was quantized (AWQ or RTN), in every report.
- logprob gap: the mean |trainer - rollout| logprob of the trained tokens over every step of a run
  (``rollout_logprob_gap``, nats/token), averaged over the arm's seeds (± their sd): how far the
  rollout kernels' numerics (Marlin, qerl-triton, an FP8 or BF16 merged copy) sit from the trainer's. On
  AQN arms it includes the rollout's noise (the trainer runs without it).
- vs the reference and verdict: each arm's held-out pass@1 minus the reference arm's, in points, with its
  95% interval, and the verdict at the margin (:mod:`~qerl_cli.compare.verdict` says how).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from qerl_cli.compare.arms import QUANTIZED_FORMATS
from qerl_cli.compare.curves import EARLY_FRACTION, FINAL_FRACTION, trailing_mean
from qerl_cli.compare.curves import window as _window
from qerl_cli.compare.plot import plot_curves
from qerl_cli.compare.results import ArmRow, BaseHeldout, CompareReport, RunResult, SeedCurve
from qerl_cli.compare.runs import run_dir
from qerl_cli.compare.settings import CompareSettings
from qerl_cli.compare.verdict import (
    arm_verdicts,
    verdict_cells,
    verdict_headers,
    verdict_section,
    verdict_warnings,
)
from qerl_cli.config import RESOLVED_CONFIG_NAME, read_yaml
from qerl_cli.errors import QerlError
from qerl_cli.files import atomic_write_text, write_json
from qerl_cli.rl.signal import MIN_SIGNAL_FRACTION, RELATIVE_SIGNAL, remedies
from qerl_cli.stats import mean, present, sd

START_FRACTION = FINAL_FRACTION  # the first steps: start reward, no-spread groups


def _sd(values: list[float | None]) -> float | None:
    """The sd over seeds of the figures measured; None under two."""
    return sd(present(values))


def steps_to(rewards: list[float], threshold: float) -> int | None:
    smooth = trailing_mean(rewards, _window(len(rewards), FINAL_FRACTION))
    return next((i + 1 for i, r in enumerate(smooth) if r >= threshold), None)


@dataclass(frozen=True)
class RunFigures:
    """One run's figures of the table, from its per-step curves and its held-out evaluation."""

    final_reward: float | None
    first_reward: float | None
    start_reward: float | None
    start_no_spread: float | None  # None: a result of an older qerl, without the per-step shares
    early_entropy: float | None
    heldout: float
    heldout_se: float | None
    logprob_gap: float | None  # over every step: the rollout kernels' numerics, not a learning figure


def run_figures(result: RunResult) -> RunFigures:
    rewards, entropy = result.reward, result.entropy
    steps = len(rewards)
    no_spread = result.zero_std_group_fraction
    return RunFigures(
        final_reward=mean(present(rewards[-_window(steps, FINAL_FRACTION) :]), empty=None),
        first_reward=mean(present(rewards[: _window(steps, FINAL_FRACTION)]), empty=None),
        start_reward=mean(present(rewards[: _window(steps, START_FRACTION)]), empty=None),
        start_no_spread=mean(present(no_spread[: _window(steps, START_FRACTION)]), empty=None),
        early_entropy=mean(present(entropy[: _window(steps, EARLY_FRACTION)]), empty=None),
        heldout=result.heldout.pass_at_1,
        heldout_se=result.heldout.pass_at_1_se,
        logprob_gap=mean(present(result.logprob_gap), empty=None),
    )


def load_results(out: Path, arms: list[str], seeds: list[int]) -> dict[str, list[RunResult]]:
    found: dict[str, list[RunResult]] = {}
    for arm in arms:
        for seed in seeds:
            path = out / arm / f"seed-{seed}" / "result.json"
            if path.is_file():
                run = RunResult.from_dict(json.loads(path.read_text()))
                run.heldout = run.heldout.rescored(path.parent / "heldout")
                found.setdefault(arm, []).append(run)
    if not found:
        raise QerlError(f"no finished run under {out}: nothing to summarise")
    return found


def arm_rows(
    results: dict[str, list[RunResult]], threshold: float | None,
    base_heldout: dict[str, BaseHeldout | None] | None = None, base_labels: dict[str, str] | None = None,
) -> tuple[list[ArmRow], float]:  # fmt: skip
    figures = {arm: [run_figures(r) for r in runs] for arm, runs in results.items()}
    if threshold is None:
        start = mean(present([f.first_reward for runs in figures.values() for f in runs]), empty=None) or 0.0
        best = max(
            (mean(present([f.final_reward for f in runs]), empty=None) or 0.0) for runs in figures.values()
        )
        threshold = start + 0.5 * (best - start)
    rows = []
    for arm, runs in results.items():
        figs = figures[arm]
        reached = [steps_to(r.reward, threshold) for r in runs]
        heldout = [f.heldout for f in figs]
        se = _sd(heldout)
        base = (base_heldout or {}).get(arm)  # None: not evaluated (or it failed)
        rows.append(
            ArmRow(
                arm=arm,
                base=(base_labels or {}).get(arm),
                seeds=len(runs),
                steps=max(len(r.reward) for r in runs),
                final_reward=mean(present([f.final_reward for f in figs]), empty=None),
                final_reward_sd=_sd([f.final_reward for f in figs]),
                base_heldout_accuracy=base.heldout.pass_at_1 if base else None,
                base_heldout_se=base.heldout.pass_at_1_se if base else None,
                base_entropy=base.entropy.get("exact_entropy") if base else None,
                heldout_accuracy=mean(present(heldout), empty=None),
                heldout_se=se / math.sqrt(len(heldout)) if se is not None else figs[0].heldout_se,
                heldout_per_seed=heldout,
                heldout_seeds=[r.seed for r in runs],
                steps_to_threshold=mean(present(reached), empty=None),
                reached_threshold=f"{sum(s is not None for s in reached)}/{len(runs)}",
                early_entropy=mean(present([f.early_entropy for f in figs]), empty=None),
                early_entropy_sd=_sd([f.early_entropy for f in figs]),
                start_reward=mean(present([f.start_reward for f in figs]), empty=None),
                start_no_spread_fraction=mean(present([f.start_no_spread for f in figs]), empty=None),
                logprob_gap=mean(present([f.logprob_gap for f in figs]), empty=None),
                logprob_gap_sd=_sd([f.logprob_gap for f in figs]),
            )
        )
    return rows, threshold


def missing_warnings(missing: list[tuple[str, int]], seeds: list[int]) -> list[str]:
    """The runs of the ablation (``seeds`` an arm) the report leaves out for want of a result (not run
    yet, interrupted, failed), by arm and seed; an arm with none is named as left out."""
    if not missing:
        return []
    by_arm: dict[str, list[int]] = {}
    for arm, seed in missing:
        by_arm.setdefault(arm, []).append(seed)
    parts = [f"{arm} (no seed: the arm is left out)" if len(s) >= len(seeds)
             else f"{arm} seed{'s' if len(s) > 1 else ''} {', '.join(str(x) for x in sorted(s))}"
             for arm, s in by_arm.items()]  # fmt: skip
    several = len(missing) > 1
    runs = f"{len(missing)} runs of this ablation have" if several else "1 run of this ablation has"
    left_out = "; ".join(parts)
    return [f"{runs} no result (ARM/seed-S/result.json) and {'are' if several else 'is'} left out of this "
            f"report: {left_out}"]  # fmt: skip


def samples_per_prompt(out: Path, results: dict[str, list[RunResult]]) -> dict[str, int]:
    """{arm: its runs' rollout.num_generations}, read from each run's config.yaml, for the arms whose
    runs all recorded the same."""
    found = {}
    for arm, runs in results.items():
        values = set()
        for run in runs:
            saved = run_dir(out, arm, run.seed) / RESOLVED_CONFIG_NAME
            rollout = ((read_yaml(saved) or {}).get("rollout") or {}) if saved.is_file() else {}
            values.add(rollout.get("num_generations"))
        if len(values) == 1 and isinstance(value := values.pop(), int):
            found[arm] = value
    return found


def signal_warnings(rows: list[ArmRow], samples: dict[str, int] | None = None) -> list[str]:
    """One line per arm whose first steps had a reward spread in under MIN_SIGNAL_FRACTION of groups, or
    (a 4-bit arm) in under RELATIVE_SIGNAL of what the BF16 arm's had: the base lost the skill GRPO
    starts from. Each names the remedies the arm does not use yet, more samples per prompt from the arm's
    own (``samples``: {arm: rollout.num_generations}) where known."""
    bf16 = [
        r.start_no_spread_fraction
        for r in rows
        if r.base == "bf16" and r.start_no_spread_fraction is not None
    ]
    bf16_spread = 1.0 - min(bf16) if bf16 else None
    out = []
    for row in rows:
        no_spread = row.start_no_spread_fraction
        if no_spread is None:
            continue
        spread, base = round(1.0 - no_spread, 9), row.base or ""  # 1 - 0.9 is 0.0999...
        quantized = base.split(" ")[0] in QUANTIZED_FORMATS
        starved = spread < MIN_SIGNAL_FRACTION
        behind = quantized and bf16_spread is not None and spread < RELATIVE_SIGNAL * bf16_spread
        if not (starved or behind):
            continue
        than = f" (the BF16 arm's: {100 * bf16_spread:.1f}%)" if behind else ""
        fixes = remedies(
            quantized=quantized, gptq="GPTQ" in base, error_start="start" in base,
            num_generations=(samples or {}).get(row.arm),
        )  # fmt: skip
        out.append(
            f"{row.arm}{f' (base {base})' if base else ''} starts with too little signal for GRPO: "
            f"{100 * spread:.1f}% of its groups had a reward spread over the first steps{than}, start reward "
            f"{_fmt(row.start_reward)}. Try {fixes}"
        )
    return out


def _fmt(value: float | None, digits: int = 3, sd: float | None = None) -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    return text + (f" ± {sd:.{digits}f}" if sd is not None else "")


def _percent(value: float | None, se: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}% ± {100 * (se or 0):.1f}"


def _cells(row: ArmRow, report: CompareReport) -> list[str]:
    no_spread = row.start_no_spread_fraction
    return [
        row.arm,
        row.base or "-",
        str(row.seeds),
        _fmt(row.final_reward, sd=row.final_reward_sd),
        _percent(row.base_heldout_accuracy, row.base_heldout_se),
        _percent(row.heldout_accuracy, row.heldout_se),
        f"{_fmt(row.steps_to_threshold, 1)} ({row.reached_threshold})",
        _fmt(row.early_entropy, sd=row.early_entropy_sd),
        _fmt(row.base_entropy),
        _fmt(row.start_reward),
        "-" if no_spread is None else f"{100 * no_spread:.1f}%",
        _fmt(row.logprob_gap, 4, row.logprob_gap_sd),
        *verdict_cells(row.arm, report.verdicts, report.reference),
    ]


HEADERS = [
    "arm", "base", "seeds", "final reward", "base pass@1 ± SE", "held-out pass@1 ± SE", "steps to threshold",
    "early entropy", "base entropy (T=1)", "start reward", "no-spread groups (start)", "logprob gap",
]  # fmt: skip


def _headers(report: CompareReport) -> list[str]:
    return [*HEADERS, *verdict_headers(report.reference)]


def markdown(report: CompareReport) -> str:
    lines = [
        f"# qerl compare: {report.recipe}",
        "",
        f"Threshold {report.threshold:.3f} (trailing mean reward); final reward over the last 10% of "
        "steps; "
        "early entropy over the first 20%; ± is the sd over seeds (SE for held-out pass@1; base pass@1: "
        "the untrained base, the evaluation's own SE). Start reward and no-spread groups (all rewards of "
        "a prompt's group equal: no GRPO signal) over the first 10% of steps. Logprob gap: the mean "
        "|trainer - rollout| logprob of the trained tokens over every step (nats/token; the rollout "
        "kernels' numerics against the trainer's; on AQN arms the noise too). "
        f"4-bit bases made here: {_method_text(report.base_method)} unless the base column says otherwise. "
        f"Ran on: {', '.join(report.devices or ['unrecorded device'])}.",
        "",
        "| " + " | ".join(_headers(report)) + " |",
        "| " + " | ".join("---" for _ in _headers(report)) + " |",
    ]
    lines += ["| " + " | ".join(_cells(row, report)) + " |" for row in report.arms]
    lines += ["", *verdict_section(report.verdicts, report.reference, report.margin)]
    warnings = report.warnings
    lines += ["", *(f"**Warning**: {w}." for w in warnings)] if warnings else []
    return "\n".join(lines) + "\n"


def _method_text(method: str | None) -> str:
    return {
        "gptq": "GPTQ (llm-compressor, qerl-text calibration)",
        "awq": "AWQ (llm-compressor, qerl-text calibration)",
        "rtn": "RTN (round to nearest, no calibration)",
    }.get(method or "", "method unrecorded")


def compare_table(report: CompareReport):  # -> rich.table.Table
    table = Table(title=f"qerl compare (threshold {report.threshold:.3f})")
    for header in _headers(report):
        table.add_column(header, justify="left" if header == "arm" else "right")
    for row in report.arms:
        table.add_row(*_cells(row, report))
    verdicts = (
        f"Verdicts: held-out pass@1 against {report.reference}'s, 95% Welch interval, "
        f"{report.margin:g}-point margin (compare.md has each with its permutation p). "
        if report.reference and report.margin is not None
        else ""
    )
    table.caption = (
        f"4-bit bases made here: {_method_text(report.base_method)} unless the base column says otherwise. "
        f"{verdicts}{report.output}: compare.json, compare.md, compare.png"
    )
    return table


def write_report(
    out: Path, arms: dict[str, Any], seeds: list[int], settings: CompareSettings, threshold: float | None,
    skipped: int = 0, recipe: str = "", base_heldout: dict[str, BaseHeldout | None] | None = None,
    base_labels: dict[str, str] | None = None, missing: list[tuple[str, int]] | None = None,
) -> CompareReport:  # fmt: skip
    """``missing``: the (arm, seed) runs of the ablation without a result, named in a warning."""
    results = load_results(out, list(arms), seeds)
    rows, used = arm_rows(
        results, threshold if threshold is not None else settings.threshold, base_heldout, base_labels
    )
    unknown = "unrecorded device"
    trained = {r.device or unknown for runs in results.values() for r in runs}
    # A base with no held-out figure (None: not evaluated, e.g. --report-only without base-heldout/) ran
    # nowhere: it adds no device, where an evaluated one that did not record its device counts as unrecorded.
    bases = {b.device or unknown for b in (base_heldout or {}).values() if b is not None}
    reference = settings.reference
    verdicts = arm_verdicts(results, reference, settings.margin) if reference else []
    plot = plot_curves(results, out / "compare.png", ", ".join(sorted(trained)), verdicts)
    report = CompareReport(
        recipe=recipe or out.name,
        output=str(out),
        threshold=used,
        arms=rows,
        base_method=settings.base_method,
        warnings=[
            *missing_warnings(missing or [], seeds),
            *signal_warnings(rows, samples_per_prompt(out, results)),
            *verdict_warnings(verdicts),
        ],
        overrides={arm: arms[arm] for arm in results},
        skipped_finished_runs=skipped,
        # Runs written before result.json recorded its device say so rather than guess.
        devices=sorted(trained | bases),
        curves={arm: [SeedCurve(r.seed, r.reward, r.entropy) for r in runs] for arm, runs in results.items()},
        plot=str(plot) if plot else None,
        reference=reference,
        margin=settings.margin if reference else None,
        verdicts=verdicts,
    )
    write_json(out / "compare.json", report.to_dict())
    atomic_write_text(out / "compare.md", markdown(report))
    return report

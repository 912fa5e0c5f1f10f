"""`qerl compare`'s verdicts: each arm's held-out pass@1 against the reference arm's, the margin's edges,
the seeds an unresolved one needs, the refusal under 2 seeds, and where and when the runs were made."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from test_compare import TINY_SETS, _recipe, _score

from qerl_cli import stats
from qerl_cli.compare import heldout as heldout_mod
from qerl_cli.compare import parallel, runner
from qerl_cli.compare.arms import read_settings
from qerl_cli.compare.results import NEEDS_SEEDS, CompareReport, RunResult
from qerl_cli.compare.summary import compare_table, markdown
from qerl_cli.compare.verdict import (
    arm_verdicts,
    decide,
    interval_cell,
    no_scatter,
    verdict_cell,
    verdict_line,
    verdict_section,
    verdict_warnings,
    verdict_words,
)
from qerl_cli.config import save_resolved_config
from qerl_cli.errors import QerlError


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [
        (0.1, 9.0, "better"),
        (0.0, 9.0, "not worse"),  # low = 0 is not above 0: not better
        (-4.99, 3.0, "not worse"),
        (-5.0, 3.0, "unresolved"),  # low = -margin is not above it: not shown not worse
        (-3.0, -1.0, "not worse"),  # below 0 but by less than the margin: the margin is the claim
        (-9.0, -0.01, "worse"),
        (-9.0, 0.0, "unresolved"),  # high = 0 is not below 0: not worse either
        (-5.0, -0.01, "worse"),
    ],
)
def test_verdicts_at_the_margins_edges(low: float, high: float, verdict: str) -> None:
    assert decide(low, high, 5.0) == verdict


def test_verdict_wording() -> None:
    assert verdict_words("not worse", 5.0) == "not worse by more than 5 points"
    assert verdict_words("not worse", 2.5) == "not worse by more than 2.5 points"
    assert verdict_words("unresolved", 5.0) == "unresolved at a 5-point margin"
    assert verdict_words("better", 5.0) == "better" and verdict_words("worse", 5.0) == "worse"


def _run(
    arm: str, seed: int, pass_at_1: float, device: str = "NVIDIA H200", invocation: str = "i1"
) -> RunResult:
    return RunResult(arm, seed, [0.1, 0.2], [1.0, 1.0], _score(pass_at_1, 0.02), device=device,
                     invocation=invocation)  # fmt: skip


def test_an_arm_well_above_the_reference_is_better_with_its_interval_and_p() -> None:
    results = {
        "bf16-lora": [_run("bf16-lora", s, p) for s, p in enumerate((0.30, 0.32, 0.31))],
        "nvfp4-aqn": [_run("nvfp4-aqn", s, p) for s, p in enumerate((0.40, 0.42, 0.41))],
    }
    (verdict,) = arm_verdicts(results, "bf16-lora", 5.0)
    interval = stats.welch_interval([40.0, 42.0, 41.0], [30.0, 32.0, 31.0])
    assert verdict.difference == pytest.approx(10.0) and verdict.low == pytest.approx(interval.low)
    assert verdict.verdict == "better" and verdict.seeds_needed is None
    # 3 + 3 seeds: C(6, 3) = 20 relabelings, enumerated; only the observed one and its mirror reach 10.
    assert (verdict.p_value, verdict.p_exact, verdict.p_relabelings) == (pytest.approx(0.1), True, 20)
    line = verdict_line(verdict)
    assert line.startswith("nvfp4-aqn vs bf16-lora: +10.0 points, 95% interval [+")
    assert "permutation p = 0.100 (exact, 20 relabelings): better" in line
    assert verdict.notes == [] and verdict_warnings([verdict]) == []


def test_an_unresolved_verdict_says_how_many_seeds_would_resolve_it() -> None:
    """Pooled sd ~10 points (Gemma 3 270M's scatter): 3 seeds cannot tell 5 points."""
    bf16, nvfp4 = (30.0, 45.0, 38.0), (28.0, 47.0, 33.0)
    results = {
        "bf16-lora": [_run("bf16-lora", s, p / 100) for s, p in enumerate(bf16)],
        "nvfp4-lora": [_run("nvfp4-lora", s, p / 100) for s, p in enumerate(nvfp4)],
    }
    (verdict,) = arm_verdicts(results, "bf16-lora", 5.0)
    assert verdict.verdict == "unresolved"
    assert verdict.seeds_needed == stats.seeds_for_half_width(stats.sd(nvfp4), stats.sd(bf16), 5.0)
    assert verdict.seeds_needed > 3
    needed = (
        f"unresolved at a 5-point margin; {verdict.seeds_needed} seeds per arm at this scatter would narrow"
    )
    assert needed in verdict_line(verdict)
    # At d = -1.7 the ±5 interval would still hold -5: ±3.3 resolves it, at more seeds, given after.
    assert verdict.seeds_to_resolve > verdict.seeds_needed
    counts = f"{verdict.seeds_needed} seeds/arm for ±5, ≈{verdict.seeds_to_resolve}"
    assert verdict_cell(verdict) == f"unresolved ({counts} at a -1.7 difference)"
    # SDs from 3 seeds are rough: the count to plan for, at their 80% upper bound, is far larger, and
    # compare.md says both with the --seeds to run.
    assured = stats.seeds_with_assurance(stats.sd(nvfp4), 3, stats.sd(bf16), 3, 5.0)
    assert verdict.seeds_needed_assured == assured and assured > verdict.seeds_needed
    section = "\n".join(verdict_section([verdict], "bf16-lora", 5.0))
    assert (
        f"- nvfp4-lora: {verdict.seeds_needed} seeds per arm at the scatter seen, {assured} at its 80% upper "
        f"bound (run --seeds {assured} to reach ±5 about 80% of the time; now 3 vs 3)"
    ) in section


def test_under_two_seeds_an_arm_gets_no_verdict_and_says_why() -> None:
    results = {
        "bf16-lora": [_run("bf16-lora", s, 0.3 + s / 100) for s in range(3)],
        "nvfp4-aqn": [_run("nvfp4-aqn", 0, 0.35)],
    }
    (verdict,) = arm_verdicts(results, "bf16-lora", 5.0)
    assert verdict.verdict == NEEDS_SEEDS and verdict.difference is None
    assert verdict_cell(verdict) == NEEDS_SEEDS
    assert "1 seed(s) against 3; an interval needs ≥2 seeds in both arms" in verdict_line(verdict)
    alone = arm_verdicts({"nvfp4-aqn": results["nvfp4-aqn"] * 2, "bf16-lora": results["bf16-lora"][:1]},
                         "bf16-lora", 5.0)  # fmt: skip
    assert alone[0].verdict == NEEDS_SEEDS  # the reference's single seed refuses it too


def test_runs_of_two_machine_kinds_are_warned_of_and_two_invocations_noted() -> None:
    results = {
        "bf16-lora": [_run("bf16-lora", s, 0.3, device="NVIDIA H100") for s in range(2)],
        "nvfp4-aqn": [_run("nvfp4-aqn", s, 0.3 + s / 100, invocation=f"i{s}") for s in range(2)],
    }
    (verdict,) = arm_verdicts(results, "bf16-lora", 5.0)
    assert verdict.notes == ["mixed machines: NVIDIA H100, NVIDIA H200", "runs from 2 invocations"]
    notes = "(mixed machines: NVIDIA H100, NVIDIA H200) (runs from 2 invocations)"
    assert verdict_line(verdict).endswith(notes)
    (warning,) = verdict_warnings([verdict])
    assert warning.startswith("nvfp4-aqn vs bf16-lora mixes runs made on NVIDIA H100, NVIDIA H200")
    same = {arm: [_run(arm, s, 0.3, invocation=f"i{s}") for s in range(2)] for arm in results}
    (noted,) = arm_verdicts(same, "bf16-lora", 5.0)
    assert noted.notes == ["runs from 2 invocations"] and verdict_warnings([noted]) == []


def test_settings_take_a_reference_and_a_positive_margin() -> None:
    settings = read_settings({"reference": "nvfp4-lora", "margin": 3})
    assert (settings.reference, settings.margin) == ("nvfp4-lora", 3.0)
    assert read_settings(None).margin == 5.0 and read_settings(None).reference is None
    for bad in (0, -2, float("inf")):
        with pytest.raises(QerlError, match="margin must be a positive number of points"):
            read_settings({"margin": bad})


def _fake_runs(
    monkeypatch: pytest.MonkeyPatch,
    figures: Mapping[str, Sequence[float]],
    device: str = "CPU (test)",
    *,
    keep_config: bool = False,
    zero_std: list[float] | None = None,
):
    """run_one without training: arm's seed s scores figures[arm][s], recording device and invocation
    (``keep_config``: the run's config.yaml too, as `qerl train` writes it; ``zero_std``: its groups'
    zero-std fractions)."""
    ran = []

    def fake_run(conf, settings, arm, progress, invocation=None, *, compare_dir):
        seed = conf.train.seed
        ran.append((arm, seed))
        result = RunResult(arm, seed, [0.1, 0.3], [1.0, 0.9], _score(figures[arm][seed], 0.05), device=device,
                           gpus=0, invocation=invocation, zero_std_group_fraction=zero_std or [])  # fmt: skip
        Path(conf.output.dir).mkdir(parents=True, exist_ok=True)
        if keep_config:
            save_resolved_config(conf, conf.output.dir)
        (Path(conf.output.dir) / "result.json").write_text(json.dumps(result.to_dict()))
        return result

    monkeypatch.setattr(runner, "run_one", fake_run)
    monkeypatch.setattr(heldout_mod, "base_entropy", lambda *a: {"exact_entropy": 1.5})
    monkeypatch.setattr(heldout_mod, "evaluate_heldout", lambda *a: _score(0.25, 0.05))
    return ran


def test_the_report_carries_verdicts_and_every_seeds_heldout_figure(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = {"bf16-lora": [0.30, 0.34, 0.32], "nvfp4-aqn": [0.31, 0.33, 0.35]}
    _fake_runs(monkeypatch, figures)
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    report = runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 3, out, sets=TINY_SETS, margin=4).report
    saved = json.loads((out / "compare.json").read_text())
    assert (saved["reference"], saved["margin"]) == ("bf16-lora", 4.0)
    assert [a["heldout_per_seed"] for a in saved["arms"]] == list(figures.values())
    assert [a["heldout_seeds"] for a in saved["arms"]] == [[0, 1, 2], [0, 1, 2]]
    (verdict,) = saved["verdicts"]
    assert verdict["arm"] == "nvfp4-aqn" and verdict["difference"] == pytest.approx(1.0)
    assert verdict["verdict"] == report.verdicts[0].verdict == decide(verdict["low"], verdict["high"], 4.0)
    assert CompareReport.from_dict(saved).to_dict() == saved
    md = (out / "compare.md").read_text()
    assert "## Verdicts" in md and f"- {verdict_line(report.verdicts[0])}" in md
    assert "| vs bf16-lora, points [95% CI] | verdict |" in md and "| reference | - |" in md
    table = compare_table(report)
    assert "against bf16-lora's, 95% Welch interval, 4-point margin" in str(table.caption)
    assert table.columns[-1].header == "verdict" and list(table.columns[-2].cells) == [
        "reference", interval_cell(report.verdicts[0])
    ]  # fmt: skip


def test_one_seed_reports_its_want_of_seeds_rather_than_failing(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_runs(monkeypatch, {"bf16-lora": [0.3], "nvfp4-aqn": [0.35]})
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    report = runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 1, out, sets=TINY_SETS).report
    assert report.verdicts[0].verdict == NEEDS_SEEDS
    assert "| - | needs ≥2 seeds |" in markdown(report)


def test_a_reference_not_among_the_arms_is_refused_and_none_without_bf16(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_runs(monkeypatch, {"nvfp4-aqn": [0.3, 0.4], "nvfp4-lora": [0.3, 0.4]})
    recipe = _recipe(tmp_path, tiny_model_dir)
    with pytest.raises(QerlError, match="reference arm 'bf16-lora' is not among the arms"):
        runner.run_compare(recipe, ["nvfp4-aqn"], 2, tmp_path / "a", sets=TINY_SETS, reference="bf16-lora")
    with pytest.raises(QerlError, match="margin must be a positive number"):
        runner.run_compare(recipe, ["nvfp4-aqn"], 2, tmp_path / "a", sets=TINY_SETS, margin=0)
    report = runner.run_compare(recipe, ["nvfp4-aqn", "nvfp4-lora"], 2, tmp_path / "b", sets=TINY_SETS).report
    assert report.reference is None and report.verdicts == []  # bf16-lora not run: no verdicts
    assert "None: no reference arm" in markdown(report)
    chosen = runner.run_compare(recipe, ["nvfp4-aqn", "nvfp4-lora"], 2, tmp_path / "b", sets=TINY_SETS,
                                reference="nvfp4-lora").report  # fmt: skip
    assert [(v.arm, v.reference) for v in chosen.verdicts] == [("nvfp4-aqn", "nvfp4-lora")]


def test_more_seeds_later_run_only_the_new_ones_and_the_verdict_notes_two_invocations(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--seeds 2, then --seeds 4 into the same folder: seeds 0-1 are kept, 2-3 run, all four compared."""
    figures = {"bf16-lora": [0.30, 0.34, 0.32, 0.31], "nvfp4-aqn": [0.31, 0.33, 0.35, 0.30]}
    ran = _fake_runs(monkeypatch, figures)
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    first = runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 2, out, sets=TINY_SETS).report
    assert first.verdicts[0].notes == []  # one invocation, one machine
    ran.clear()
    report = runner.run_compare(recipe, ["bf16-lora", "nvfp4-aqn"], 4, out, sets=TINY_SETS).report
    assert sorted(ran) == [("bf16-lora", 2), ("bf16-lora", 3), ("nvfp4-aqn", 2), ("nvfp4-aqn", 3)]
    (verdict,) = report.verdicts
    assert verdict.seeds == verdict.reference_seeds == [0, 1, 2, 3]
    assert verdict.notes == ["runs from 2 invocations"] and len(set(verdict.invocations)) == 2
    saved = json.loads((out / "bf16-lora" / "seed-3" / "result.json").read_text())
    assert saved["invocation"] in verdict.invocations and saved["gpus"] == 0


def test_children_record_their_parents_invocation_and_get_batch_invariant_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    envs: list[dict[str, str]] = []

    class FakeProc:
        returncode = 0

        def __init__(self, command, **kwargs) -> None:
            envs.append(kwargs["env"])

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(parallel.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(parallel.time, "sleep", lambda s: None)
    environment = parallel.child_environment(True)
    assert environment == {"VLLM_BATCH_INVARIANT": "1"} and parallel.child_environment(False) == {}
    parallel.run_parallel([("a", 0)], "r.yaml", 1, tmp_path, [], 1, invocation="parent-1",
                          environment=environment)  # fmt: skip
    (env,) = envs
    assert env[parallel.INVOCATION_ENV] == "parent-1" and env["VLLM_BATCH_INVARIANT"] == "1"
    monkeypatch.setenv(parallel.INVOCATION_ENV, "parent-1")
    assert parallel.invocation_id() != "parent-1"  # not a child: its own invocation
    monkeypatch.setenv(parallel.CHILD_ENV, "1")
    assert parallel.invocation_id() == "parent-1"


def test_a_recorded_runs_verdict_is_its_readmes_and_the_documented_one() -> None:
    """The five seeds a side of benchmarks/gemma3-270m-verdict-h200-2026-11-28 (its result.json files):
    the README worked it out as -6.8 [-13.9, +0.4], df 5.5, exact p 0.048 over 252 relabelings, 9 seeds
    for ±5; docs/compare.md shows the line."""
    from qerl_cli.compare.summary import load_results

    repo = Path(__file__).resolve().parents[1]
    runs = repo / "benchmarks" / "gemma3-270m-verdict-h200-2026-11-28" / "runs"
    results = load_results(runs, ["bf16-lora", "nvfp4-lora"], list(range(5)))
    (verdict,) = arm_verdicts(results, "bf16-lora", 5.0)
    assert (round(verdict.difference, 1), round(verdict.low, 1), round(verdict.high, 1)) == (-6.8, -13.9, 0.4)
    assert round(verdict.df, 1) == 5.5 and round(verdict.p_value, 3) == 0.048 and verdict.p_relabelings == 252
    assert verdict.verdict == "unresolved" and verdict.seeds_needed == 9
    assert verdict.notes == [] and verdict.devices == ["NVIDIA H200"]
    docs = (repo / "docs" / "compare.md").read_text()
    assert f"\n{verdict_line(verdict)}\n" in docs
    assert stats.seeds_for_half_width(9.7, 9.7, 5.0) == 31 and "is 31 seeds an arm" in docs


GEMMA_VERDICTS, SMOL_VERDICTS = "gemma3-270m-verdict-h200-2026-11-28", "smollm2-verdict-h200-2026-11-28"
SMOL_100_STEPS = "smollm2-vllm-verdict-h200-2026-11-28"


@pytest.mark.parametrize(
    ("folder", "arms", "seeds", "verdict", "documented_in"),
    [
        (GEMMA_VERDICTS, ["bf16-lora", "nvfp4-lora"], 9, "unresolved", "docs/compare.md"),
        (GEMMA_VERDICTS, ["bf16-lora", "nvfp4-lora"], 18, "unresolved", "docs/compare.md"),
        (GEMMA_VERDICTS, ["bf16-lora", "nvfp4-lora"], 28, "unresolved", "docs/compare.md"),
        (GEMMA_VERDICTS, ["nvfp4-lora", "nvfp4-fp8merged"], 28, "worse", None),
        (GEMMA_VERDICTS, ["nvfp4-lora", "nvfp4-aqn-t10pct-awq"], 28, "unresolved", None),
        (GEMMA_VERDICTS, ["nvfp4-lora", "nvfp4-merged"], 28, "unresolved", None),
        (SMOL_VERDICTS, ["bf16-lora", "nvfp4-lora"], 10, "worse", None),
        (SMOL_100_STEPS, ["bf16-lora", "nvfp4-lora"], 10, "not worse", "docs/compare.md"),
    ],
)
def test_the_recorded_verdicts_are_the_ones_their_readmes_and_docs_print(
    folder: str, arms: list[str], seeds: int, verdict: str, documented_in: str | None
) -> None:
    """The verdict lines the benchmark READMEs (and docs) quote are what qerl's arithmetic gives from the
    committed result.json files (the first arm is the reference)."""
    from qerl_cli.compare.summary import load_results

    repo = Path(__file__).resolve().parents[1]
    results = load_results(repo / "benchmarks" / folder / "runs", arms, list(range(seeds)))
    (found,) = arm_verdicts(results, arms[0], 5.0)
    assert found.verdict == verdict
    line = verdict_line(found)
    assert f"- {line}\n" in (repo / "benchmarks" / folder / "README.md").read_text()
    if documented_in:
        docs = (repo / documented_in).read_text()
        assert f"\n{line}\n" in docs or f"\n  {line}\n" in docs  # a code block, or one inside a list item


def test_the_plot_draws_each_arms_interval_of_the_difference(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from qerl_cli.compare.plot import plot_curves

    results = {
        "bf16-lora": [_run("bf16-lora", s, 0.3 + s / 50) for s in range(3)],
        "nvfp4-aqn": [_run("nvfp4-aqn", s, 0.32 + s / 50) for s in range(3)],
        "nvfp4-lora": [_run("nvfp4-lora", 0, 0.2)],
    }
    verdicts = arm_verdicts(results, "bf16-lora", 5.0)
    assert [v.verdict for v in verdicts] == ["not worse", NEEDS_SEEDS]
    path = plot_curves(results, tmp_path / "compare.png", "CPU", verdicts)
    assert path is not None and path.stat().st_size > 0


def test_batch_invariant_runs_get_vllms_mode_and_hf_runs_are_told_it_does_nothing(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    handed: list[dict] = []
    monkeypatch.setattr(runner, "run_parallel", lambda *a, **kw: handed.append(kw) or [])
    recipe = _recipe(tmp_path, tiny_model_dir)
    sets = [*TINY_SETS, "rollout.engine=vllm", "compare.batch_invariant=true"]
    runner.run_compare(recipe, ["bf16-lora"], 1, tmp_path / "v", sets=sets, summarize=False)
    (kw,) = handed
    assert kw["environment"] == {"VLLM_BATCH_INVARIANT": "1"}
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", kw["invocation"])
    _fake_runs(monkeypatch, {"bf16-lora": [0.3]})
    with caplog.at_level("WARNING"):
        runner.run_compare(
            recipe, ["bf16-lora"], 1, tmp_path / "h", sets=[*TINY_SETS, "compare.batch_invariant=true"]
        )
    assert "compare.batch_invariant is vLLM's mode: these runs' hf engine does not use it" in caplog.text


@pytest.mark.slow
def test_the_documented_tiny_example_runs_as_written(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/compare.md's `qerl compare tiny ...` (minutes on 2 cores), from a folder where `qerl tiny-base`
    wrote runs/tiny-base/bf16: here the tests' tiny model stands in for its warm-started one."""
    import shlex
    import shutil

    from qerl_cli.cli import main

    docs = (Path(__file__).resolve().parents[1] / "docs" / "compare.md").read_text()
    text = re.search(r"^(qerl compare tiny .*)$", docs.replace("\\\n", " "), re.M)
    assert text is not None
    command = shlex.split(text.group(1))
    shutil.copytree(tiny_model_dir, tmp_path / "runs" / "tiny-base" / "bf16")
    monkeypatch.chdir(tmp_path)
    assert main(command[1:]) == 0
    report = CompareReport.from_dict(json.loads((tmp_path / "runs" / "cmp" / "compare.json").read_text()))
    assert [row.seeds for row in report.arms] == [2, 2]
    (verdict,) = report.verdicts
    assert (verdict.arm, verdict.reference) == ("nvfp4-aqn", "bf16-lora") and verdict.difference is not None
    # An interval exactly where the seeds scattered: the stand-in model's seeds may all score alike, and
    # then the verdict is unresolved without one (never a zero-wide interval).
    scattered = any(len(set(row.heldout_per_seed)) > 1 for row in report.arms)
    if scattered:
        assert verdict.low is not None and verdict.low < verdict.high, verdict
    else:
        assert verdict.verdict == "unresolved" and no_scatter(verdict) and verdict.low is None, verdict


def test_report_only_reports_runs_made_elsewhere_without_making_or_evaluating_a_base(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seed ranges trained on other machines and copied together: their bases are not here (the runs
    recorded where they were), nothing is trained, made or evaluated, and the report still says which
    base each arm had."""
    figures = {"bf16-lora": [0.30, 0.34, 0.32], "nvfp4-lora": [0.20, 0.26, 0.23]}
    _fake_runs(monkeypatch, figures)
    made, recipe = tmp_path / "made", _recipe(tmp_path, tiny_model_dir)
    runner.run_compare(recipe, list(figures), 3, made, sets=TINY_SETS)
    for arm, path in (("bf16-lora", "/elsewhere/bf16-model"), ("nvfp4-lora", "/elsewhere/cmp/bases/nvfp4")):
        for result in made.glob(f"{arm}/seed-*/result.json"):  # each base's path where the runs were made
            result.write_text(json.dumps({**json.loads(result.read_text()), "model": path}))

    def refuse(*args, **kwargs):
        raise AssertionError("--report-only must not train, make or evaluate anything")

    for module, name in ((runner, "run_one"), (runner, "prepare_bases"), (heldout_mod, "evaluate_heldout")):
        monkeypatch.setattr(module, name, refuse)
    report = runner.run_compare(
        recipe, [*figures, "nvfp4-aqn"], 3, made, sets=TINY_SETS, report_only=True
    ).report  # nvfp4-aqn has no run: left out, not trained
    assert [row.arm for row in report.arms] == list(figures)
    assert [row.base for row in report.arms] == ["bf16", "nvfp4 RTN"]
    # "Ran on" names where the runs ran; the bases evaluated nowhere here add no "unrecorded device".
    assert report.devices == sorted({json.loads(p.read_text()).get("device") or "unrecorded device"
                                     for p in made.glob("*/seed-*/result.json")})  # fmt: skip
    (verdict,) = report.verdicts
    assert (verdict.arm, verdict.difference) == ("nvfp4-lora", pytest.approx(-9.0))
    with pytest.raises(QerlError, match="--report-only: no finished run"):
        runner.run_compare(recipe, list(figures), 3, tmp_path / "empty", sets=TINY_SETS, report_only=True)


def test_report_only_and_no_summary_exclude_each_other(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from qerl_cli.cli import main

    assert main(["compare", str(_recipe(tmp_path, tiny_model_dir)), "--report-only", "--no-summary"]) == 2
    assert "exclude each other" in capsys.readouterr().err


@pytest.mark.parametrize("ref_score", [0.30, 0.20])
def test_arms_whose_seeds_all_scored_alike_get_no_zero_width_interval(ref_score: float) -> None:
    """Two seeds an arm, each arm's seeds scoring alike: Welch's interval has zero width, which says the
    seeds did not scatter, not that the difference is known. No verdict is read from it."""
    results = {
        "bf16-lora": [_run("bf16-lora", s, ref_score) for s in range(2)],
        "nvfp4-lora": [_run("nvfp4-lora", s, 0.30) for s in range(2)],
    }
    (verdict,) = arm_verdicts(results, "bf16-lora", 5.0)
    assert verdict.verdict == "unresolved" and verdict.low is None and verdict.high is None
    difference = 100 * (0.30 - ref_score)
    assert verdict.difference == pytest.approx(difference)
    assert verdict_cell(verdict) == "unresolved at 2 seeds (no scatter)"
    assert interval_cell(verdict) == f"{difference:+.1f} [no interval]"
    line = verdict_line(verdict)
    assert "[+0.0, +0.0]" not in line and "not worse" not in line and "better" not in line
    assert "unresolved at 2 vs 2 seeds: every seed of both arms scored the same" in line
    assert "run more seeds" in line
    section = "\n".join(verdict_section([verdict], "bf16-lora", 5.0))
    assert "Seeds to plan for" not in section  # no scatter to size a count on

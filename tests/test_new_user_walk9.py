"""A new user's walk, round 9: `qerl compare` interrupted and resumed, `qerl bench e2e` on the CPU, `qerl
demo`, `qerl tiny-base` run again and a run folder after each kind of failure, each stumble held by the test
that would have caught it."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_runner import run_cli, usage_error
from test_compare import TINY_SETS, _recipe
from test_compare_verdict import _fake_runs

from qerl_cli.compare import runner
from qerl_cli.errors import QerlError


# -- qerl bench e2e ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["e2e", "rollout"])
def test_bench_refuses_a_negative_warmup(capsys: pytest.CaptureFixture[str], command: str) -> None:
    """`--set warmup=-1` passed the dry run; e2e then timed one step fewer than `repeats` (silently), or with
    `repeats=1` stopped after the checkpoints were made on "max_samples must be >= 1, got 0"."""
    rc, _, err = run_cli(capsys, "bench", command, "--device", "cpu", "--set", "warmup=-1", "--dry-run")
    assert usage_error(rc, err) and "warmup must be >= 0" in err, err


def test_bench_e2e_refuses_one_generation_a_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    """`qerl bench e2e --generations 1` passed the dry run and stopped after the checkpoints were made, at
    the first step, on "group_size (generations per prompt) must be at least 2", which names no flag."""
    rc, _, err = run_cli(capsys, "bench", "e2e", "--device", "cpu", "--generations", "1", "--dry-run")
    assert usage_error(rc, err) and "--generations must be at least 2" in err, err


# -- qerl demo / qerl train on few steps --------------------------------------------------------------------
SHORT_RUN = [
    "model.dtype=float32", "rollout.num_generations=4", "rollout.max_completion_length=8",
    "train.prompts_per_step=2", "train.micro_batch_size=8", "train.device=cpu", "lora.rank=4",
    "lora.alpha=8", "output.save_steps=0", "reward.grader_workers=1",
]  # fmt: skip


def test_a_short_run_s_first_and_last_rewards_are_different_steps(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`qerl demo --steps 4` (and `qerl train` of 4 steps) gave the "first / last 10 steps" rewards as the
    mean of the same 4 steps, twice: equal figures that read as no learning. A run under 20 steps now
    averages its first and its last half, and says how many steps."""
    out = tmp_path / "run"
    sets = [*SHORT_RUN, "train.max_steps=4", f"model.path={tiny_model_dir}", f"output.dir={out}"]
    rc, table, err = run_cli(capsys, "train", "tiny", *(arg for s in sets for arg in ("--set", s)))
    assert rc == 0, err
    rewards = [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 4
    assert "mean reward, first 2 steps" in table and "mean reward, last 2 steps" in table, table
    assert f"{sum(rewards[:2]) / 2:.3f}" in table and f"{sum(rewards[2:]) / 2:.3f}" in table, (rewards, table)


@pytest.mark.parametrize(("steps", "window"), [(0, 1), (1, 1), (3, 1), (4, 2), (19, 9), (20, 10), (60, 10)])
def test_reward_window(steps: int, window: int) -> None:
    from qerl_cli.rl.result import reward_window

    assert reward_window(steps) == window


# -- qerl compare: what a report leaves out ------------------------------------------------------------------
def test_a_report_names_the_runs_it_leaves_out(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl compare --arms a,b,c --seeds 3 --report-only` over a folder with seeds 0-1 of a and b reported
    2 seeds each and no c, with no word that a third of the ablation was missing (the same after a run that
    failed or was stopped): compare.md, compare.json and the log now name the runs left out."""
    figures = {"bf16-lora": [0.30, 0.34, 0.32], "nvfp4-lora": [0.20, 0.26, 0.23]}
    _fake_runs(monkeypatch, figures)
    out, recipe = tmp_path / "cmp", _recipe(tmp_path, tiny_model_dir)
    runner.run_compare(recipe, list(figures), 2, out, sets=TINY_SETS)
    assert not json.loads((out / "compare.json").read_text())["warnings"]  # nothing missing: nothing said
    for arm, path in (("bf16-lora", "/elsewhere/bf16-model"), ("nvfp4-lora", "/elsewhere/cmp/bases/nvfp4")):
        for result in out.glob(f"{arm}/seed-*/result.json"):  # the bases the runs recorded
            result.write_text(json.dumps({**json.loads(result.read_text()), "model": path}))
    report = runner.run_compare(
        recipe, [*figures, "nvfp4-aqn"], 3, out, sets=TINY_SETS, report_only=True
    ).report
    (missing,) = [w for w in report.warnings if "left out of this report" in w]
    assert "bf16-lora seed 2; nvfp4-lora seed 2; nvfp4-aqn (no seed: the arm is left out)" in missing, missing
    assert missing.startswith("5 runs of this ablation have no result"), missing
    assert missing in json.loads((out / "compare.json").read_text())["warnings"]
    assert missing in (out / "compare.md").read_text()
    one = runner.run_compare(recipe, ["bf16-lora"], 3, out, sets=TINY_SETS, report_only=True).report.warnings
    assert "1 run of this ablation has no result (ARM/seed-S/result.json) and is left out" in one[0], one


@pytest.mark.parametrize("stop", ["ctrl-c", "disk-full"])
def test_a_stopped_compare_says_how_to_resume(
    stop: str, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Ctrl-C in `qerl compare` printed "interrupted" alone (a full disk: "free space or choose another
    output folder"), though running the same command again resumes and loses nothing."""

    def halt(*args, **kwargs):
        if stop == "ctrl-c":
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, "No space left on device", "cmp/bf16-lora/seed-0/metrics.jsonl")

    monkeypatch.setattr(runner, "run_one", halt)
    recipe = _recipe(tmp_path, tiny_model_dir)
    argv = ["compare", str(recipe), "--arms", "bf16-lora", "--seeds", "1", "-o", str(tmp_path / "cmp")]
    rc, _, err = run_cli(capsys, *argv, *(arg for s in TINY_SETS for arg in ("--set", s)))
    assert rc == (130 if stop == "ctrl-c" else 2), err
    assert "run the same command again to resume" in err and "--resume" not in err, err


# -- qerl tiny-base run again --------------------------------------------------------------------------------
def test_tiny_base_says_how_to_add_a_format(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`qerl tiny-base --formats nf4` beside a built base said "pass --overwrite to rebuild it"; doing so
    removed bf16/ and nvfp4/ (the tiny recipe's model), leaving only nf4/. The refusal names what to give."""
    out = tmp_path / "tiny-base"
    for fmt in ("bf16", "nvfp4"):
        (out / fmt).mkdir(parents=True)
        (out / fmt / "config.json").write_text("{}")
    rc, _, err = run_cli(capsys, "tiny-base", str(out), "--formats", "nf4")
    assert usage_error(rc, err), err
    assert f"qerl tiny-base {out} --formats bf16,nvfp4,nf4 --overwrite" in err, err
    assert "removes the others" in err and sorted(p.name for p in out.iterdir()) == ["bf16", "nvfp4"]
    rc, _, err = run_cli(capsys, "tiny-base", str(out), "--formats", "nvfp4")  # nothing new asked for
    assert usage_error(rc, err) and "it is built; to rebuild it, add --overwrite" in err, err


# -- a run folder after a failure ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("reward.extra={nosuch.module:fn: 1.0}", "reward.extra: cannot import module 'nosuch.module'"),
        ("reward.extra={os:getcwdd: 1.0}", "reward.extra: module 'os' has no attribute 'getcwdd'"),
        ("reward.grader_timeout_s=0", "reward.grader_timeout_s must be > 0"),
        ("reward.grader_workers=0", "reward.grader_workers must be > 0"),
    ],
)
def test_a_bad_reward_setting_fails_the_dry_run(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, setting: str, said: str
) -> None:
    """Each passed `qerl train --dry-run` and stopped the run once its model had loaded (the grader pool's
    "grader timeout must be > 0 seconds", the reward function's import)."""
    rc, _, err = run_cli(
        capsys, "train", "tiny", "--set", f"model.path={tiny_model_dir}",
        "--set", f"output.dir={tmp_path / 'r'}", "--set", setting, "--dry-run",
    )  # fmt: skip
    assert usage_error(rc, err) and said in err, err
    assert not (tmp_path / "r").exists()


def test_resume_after_a_cut_metrics_line(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A full disk cut the last line of metrics.jsonl / completions.jsonl short; the `--resume auto` the
    error named then stopped on "internal error: JSONDecodeError". The cut line is no record: dropped."""
    out = tmp_path / "run"
    sets = [*SHORT_RUN, "train.max_steps=3", "output.save_steps=2", f"model.path={tiny_model_dir}",
            f"output.dir={out}"]  # fmt: skip
    flags = [arg for s in sets for arg in ("--set", s)]
    assert run_cli(capsys, "train", "tiny", *flags)[0] == 0
    for name in ("metrics.jsonl", "completions.jsonl"):
        with (out / name).open("a") as fh:
            fh.write('{"step": 4, "reward_me')  # a write the disk ran out during
    rc, _, err = run_cli(capsys, "train", "tiny", *flags, "--set", "train.max_steps=4", "--resume", "auto")
    assert rc == 0, err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    for line in (out / "completions.jsonl").read_text().splitlines():
        json.loads(line)


def test_a_damaged_metrics_line_is_named(tmp_path: Path) -> None:
    from qerl_cli.rl.tracking import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "reward\n{"step": 3}\n')
    with pytest.raises(QerlError, match=r"metrics.jsonl line 2 is not a JSON record"):
        read_metrics(path)


def test_the_stop_hint_without_checkpoints_reads(tmp_path: Path) -> None:
    """It read "no checkpoint in DIR (one is written never (output.save_steps=0))"."""
    from qerl_cli.rl.run_folder import stop_hint

    assert f"no checkpoint in {tmp_path} (output.save_steps=0 writes none)" in stop_hint(tmp_path, 0)
    assert f"no checkpoint in {tmp_path} (one is written every 5 steps)" in stop_hint(tmp_path, 5)


def test_a_copied_run_s_config_does_not_train_into_the_original(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`qerl train COPY/config.yaml --resume auto` (the remedy qerl names for a run's own settings) of a run
    folder copied elsewhere resumed the original folder named by its output.dir, rewriting that run's
    metrics, adapter and config, and left the copy as it was."""
    out, copy = tmp_path / "run", tmp_path / "copy"
    sets = [*SHORT_RUN, "train.max_steps=2", "output.save_steps=1", f"model.path={tiny_model_dir}",
            f"output.dir={out}"]  # fmt: skip
    assert run_cli(capsys, "train", "tiny", *(arg for s in sets for arg in ("--set", s)))[0] == 0
    shutil.copytree(out, copy)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    rc, _, err = run_cli(capsys, "train", str(copy / "config.yaml"), "--resume", "auto")
    assert usage_error(rc, err) and f"add --set output.dir={copy}" in err, err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    # Given, output.dir is the user's: a new run with a finished run's settings trains where it says.
    rc, _, err = run_cli(
        capsys, "train", str(copy / "config.yaml"), "--set", f"output.dir={tmp_path / 'new'}"
    )
    assert rc == 0, err


@pytest.mark.parametrize(
    ("step", "streak", "held", "good"),
    [(4, 4, "from step 1 on (newest checkpoint-4)", None),
     (4, 5, "every checkpoint (newest checkpoint-4)", None),  # steps 1-5 skipped: no weights of this run
     (8, 2, "from step 7 on (newest checkpoint-8)", 6), (6, 3, "from step 4 on (newest checkpoint-6)", 2),
     (6, 1, None, 6)],  # one NaN step alone may be its batch's: the checkpoint before it is named
)  # fmt: skip
def test_a_diverged_run_does_not_call_its_diverged_checkpoints_good(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    step: int,
    streak: int,
    held: str | None,
    good: int | None,
) -> None:
    """At learning rate 1e6 on the tiny base the first update made every later gradient NaN; the skipped
    steps take no update, so checkpoint-4 held the weights that diverged. The error called it "the last good
    checkpoint", and resuming from it (at any learning rate) diverged again at once."""
    from qerl_cli.rl import checkpoint, step_loop

    for n in range(2, step + 1, 2):  # save_steps=2
        (tmp_path / f"checkpoint-{n}").mkdir()
        (tmp_path / f"checkpoint-{n}" / checkpoint.STATE_FILE).write_text("")
    monkeypatch.setattr(checkpoint, "checkpoint_problem", lambda path: None)
    trainer = SimpleNamespace(step=step, nonfinite_streak=streak, out_dir=tmp_path)
    said = step_loop.diverged_message(trainer, "the gradient norm is nan")
    assert said.startswith(f"training diverged at step {step + 1}: the gradient norm is nan"), said
    if held:
        held = held.replace("checkpoint-", f"{tmp_path}/checkpoint-")
        assert (held if held.startswith("every") else f"the checkpoints {held}") + " hold" in said, said
    else:
        assert "hold the weights" not in said, said
    if good:
        assert f"the last good checkpoint is {tmp_path / f'checkpoint-{good}'}." in said, said
    else:
        assert "no checkpoint comes before them: start over (--overwrite)" in said, said


# -- qerl bench --baseline that cannot gate ----------------------------------------------------------------
def _bench_cfg(tmp_path: Path, baseline: Path | None, **changes: object):
    from qerl_cli.config import BenchConfig

    values = {"model": "tiny", "formats": ["bf16"], "batch": [1], "prompt_len": 8, "gen_len": 3,
              "lora_rank": 0, "engine": "hf", "output": str(tmp_path / "out"),
              "baseline": baseline and str(baseline), **changes}  # fmt: skip
    return BenchConfig(**values)


@pytest.fixture
def bf16_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from qerl_cli.bench import run_bench

    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    made = _bench_cfg(tmp_path, None, output=str(tmp_path / "baseline"))
    run_bench(made)
    return tmp_path / "baseline" / "bench.json"


def test_a_baseline_that_cannot_gate_is_refused_before_any_measurement(
    tmp_path: Path, bf16_baseline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl bench e2e --formats nf4 --baseline` of a bf16,nvfp4 run measured every step, then stopped on
    "the baseline shares no measurement with this run" (or on other settings) and wrote no bench.json: the
    whole run lost. Other settings and no format in common are refused before anything is measured."""
    from qerl_cli.bench import models, run_bench

    def no_work(*args, **kwargs):
        raise AssertionError("measured with a baseline that cannot gate it")

    with monkeypatch.context() as patch:
        patch.setattr(models, "prepare_checkpoints", no_work)
        with pytest.raises(QerlError, match="the baseline measured bf16 and this run measures nf4: nothing"):
            run_bench(_bench_cfg(tmp_path, bf16_baseline, formats=["nf4"]))
        with pytest.raises(QerlError, match="the baseline was measured with other settings"):
            run_bench(_bench_cfg(tmp_path, bf16_baseline, gen_len=4))
    assert not (tmp_path / "out").exists()
    # What only the figures tell (no row in common) is found after the run, whose figures are kept.
    from qerl_cli.bench import run as bench_run_mod

    def shares_nothing(*args, **kwargs):
        raise QerlError("the baseline shares no measurement with this run")

    monkeypatch.setattr(bench_run_mod, "check_regressions", shares_nothing)
    with pytest.raises(QerlError, match=r"shares no measurement.*this run's figures are in .*bench.json"):
        run_bench(_bench_cfg(tmp_path, bf16_baseline))
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["rollout"]


def test_compare_checks_the_extra_rewards_before_any_base(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A misspelt reward.extra passed `qerl compare --dry-run`, and each run failed once its model loaded."""
    recipe = _recipe(tmp_path, tiny_model_dir)
    argv = ["compare", str(recipe), "--arms", "bf16-lora", "--seeds", "1", "-o", str(tmp_path / "cmp")]
    sets = [*TINY_SETS, "reward.extra={os:getcwdd: 1.0}"]
    for dry in (["--dry-run"], []):
        rc, _, err = run_cli(capsys, *argv, *(arg for s in sets for arg in ("--set", s)), *dry)
        assert usage_error(rc, err) and "reward.extra: module 'os' has no attribute 'getcwdd'" in err, err
    assert not (tmp_path / "cmp").exists()

"""A new user's walk, round 9: `qerl compare` interrupted and resumed, `qerl bench e2e` on the CPU, `qerl
demo`, `qerl tiny-base` run again and a run folder after each kind of failure, each stumble held by the test
that would have caught it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error


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

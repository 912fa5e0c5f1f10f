"""A new user's walk, round 9: `qerl compare` interrupted and resumed, `qerl bench e2e` on the CPU, `qerl
demo`, `qerl tiny-base` run again and a run folder after each kind of failure, each stumble held by the test
that would have caught it."""

from __future__ import annotations

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

"""The training phase a process is in (``rl.phase``): the context manager sets it and gives back the one
before, raised or not, and a GRPO round generates in the ``rollout`` phase and grades outside it."""

from __future__ import annotations

from typing import Any

import pytest

from qerl_cli.config import TrainConfig, load_config
from qerl_cli.data.problem import Problem
from qerl_cli.rl.phase import OTHER, ROLLOUT, UPDATE, in_phase, phase_state
from qerl_cli.rl.rollouts import rollout_round
from qerl_cli.rollout.base import Completion, RolloutResult, SamplingSpec


def test_a_phase_holds_within_its_block_and_the_one_before_comes_back() -> None:
    assert phase_state()[0] == OTHER
    with in_phase(ROLLOUT):
        assert phase_state()[0] == ROLLOUT
        with in_phase(UPDATE):
            assert phase_state()[0] == UPDATE
        assert phase_state()[0] == ROLLOUT
    assert phase_state()[0] == OTHER


def test_a_block_that_raises_gives_the_phase_back() -> None:
    with in_phase(ROLLOUT):
        with pytest.raises(RuntimeError, match="out of memory"), in_phase(UPDATE):
            raise RuntimeError("out of memory")
        assert phase_state()[0] == ROLLOUT
    assert phase_state()[0] == OTHER


class PhaseWatchingEngine:
    """Generates one fixed completion per sample and notes the phase it generated in."""

    def __init__(self) -> None:
        self.phases: list[str] = []

    def generate(self, prompts: list[str], n: int, sampling: SamplingSpec) -> RolloutResult:
        self.phases.append(phase_state()[0])
        completions = [[Completion([5, 6], "x", [-1.0, -1.0], "stop") for _ in range(n)] for _ in prompts]
        return RolloutResult([[1, 2]] * len(prompts), completions)


def test_a_round_generates_in_the_rollout_phase_and_grades_outside_it() -> None:
    cfg = load_config(TrainConfig, None, ["model.path=m", "rollout.num_generations=2"])
    engine, graded_in = PhaseWatchingEngine(), []

    def reward_fn(texts: list[str], problems: list[Any]) -> tuple[list[float], dict[str, float]]:
        graded_in.append(phase_state()[0])
        return [1.0] * len(texts), {}

    problems = [Problem(id="p", question="1+1", answer="2")]
    spec = SamplingSpec(max_new_tokens=2, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
    rollouts, stats = rollout_round(cfg, engine, reward_fn, {"p": "1+1="}, problems, spec)
    assert engine.phases == [ROLLOUT] and graded_in == [OTHER]
    assert len(rollouts) == 2 and stats["rollout_tokens"] == 4.0
    assert phase_state()[0] == OTHER

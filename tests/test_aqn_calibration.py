"""AQN sized to the model (``aqn.calibrate``): the effect measure, the sigma search, the schedule's
calibrated state, the config rule, calibration on the tiny model through the HF engine, the per-stage
measurement, resume without recalibrating, and the Gemma recipe's sweep arms."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from qerl_cli.config import TrainConfig, load_config
from qerl_cli.data.problem import Problem
from qerl_cli.errors import QerlError
from qerl_cli.rl.aqn_calibration import (
    SIGMA_SEARCH_RANGE,
    TOKENS_CHANGED_METRIC,
    NoiseProbe,
    search_sigma,
    tokens_changed,
)
from qerl_cli.rl.aqn_schedule import AQNSchedule
from qerl_cli.rl.checkpoint import STATE_FILE
from qerl_cli.rl.distributed import Distributed
from qerl_cli.rl.stream import PromptStream
from qerl_cli.rollout.base import NOISE_SIGMA, SamplingSpec

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- the measure and the search


def test_tokens_changed_counts_every_token_from_the_first_divergence() -> None:
    assert tokens_changed([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 0.0
    # Differs at position 1: positions 1-3 changed, even the 4 that matches again at its position.
    assert tokens_changed([[1, 2, 3, 4]], [[1, 9, 3, 4]]) == pytest.approx(3 / 4)
    # One stops early: its missing tail changed, over the longer completion.
    assert tokens_changed([[1, 2, 3, 4]], [[1, 2]]) == pytest.approx(2 / 4)
    assert tokens_changed([[1, 2]], [[1, 2, 7, 7, 7, 7]]) == pytest.approx(4 / 6)
    # Pairs add up by tokens, not by completions.
    assert tokens_changed([[1, 2, 3, 4], [5, 6]], [[1, 2, 3, 4], [0, 6]]) == pytest.approx(2 / 6)
    assert tokens_changed([[]], [[]]) == 0.0
    with pytest.raises(QerlError, match="pairs"):
        tokens_changed([[1]], [])


def _smooth_effect(sigma: float) -> float:
    """A monotone effect: 3% of tokens at sigma 2e-3, saturating at 1."""
    return 1.0 - math.exp(-0.03 * (sigma / 2e-3) ** 1.5)


@pytest.mark.parametrize("target", [0.01, 0.03, 0.1, 0.5])
def test_search_hits_the_target_of_a_monotone_effect(target: float) -> None:
    found = search_sigma(_smooth_effect, target, max_probes=10, tolerance=0.05)
    assert found.converged and len(found.probes) <= 10
    assert abs(found.effect - target) <= 0.05 * target
    assert found.effect == pytest.approx(_smooth_effect(found.sigma))
    # The probes are bisection midpoints in log space: each one inside the range, the first its middle.
    assert found.probes[0][0] == pytest.approx(math.sqrt(SIGMA_SEARCH_RANGE[0] * SIGMA_SEARCH_RANGE[1]))
    assert all(SIGMA_SEARCH_RANGE[0] < s < SIGMA_SEARCH_RANGE[1] for s, _ in found.probes)


def test_search_stops_at_the_first_probe_within_tolerance_and_reports_a_miss() -> None:
    seen: list[float] = []

    def effect(sigma: float) -> float:
        seen.append(sigma)
        return _smooth_effect(sigma)

    found = search_sigma(effect, _smooth_effect(1e-3), tolerance=0.01)  # the first probe is 1e-3
    assert seen == [pytest.approx(1e-3)] and found.converged
    # A step the target falls into: no probe within tolerance, the closest one is returned.
    step = search_sigma(lambda s: 0.0 if s < 4e-3 else 0.4, 0.1, max_probes=8)
    assert not step.converged and len(step.probes) == 8 and step.effect == 0.0
    assert step.sigma < 4e-3 < step.sigma * 1.1  # the bracket closed in on the step
    # Unreachable: even the top of the range changes too little.
    capped = search_sigma(lambda s: 0.0, 0.03, max_probes=6)
    assert not capped.converged and capped.sigma > 0.05
    assert "target 0.03" in capped.summary() and "6 probes" in capped.summary()
    with pytest.raises(QerlError):
        search_sigma(_smooth_effect, 0.0)


def test_a_missed_target_says_which_side_it_fell_on() -> None:
    from qerl_cli.rl.aqn_calibration import _miss_hint

    below_floor = search_sigma(lambda s: 0.11, 0.03, max_probes=4)  # any noise changes 11% (Gemma)
    assert not below_floor.converged and "below what any perturbation does" in _miss_hint(below_floor)
    deaf = search_sigma(lambda s: 0.0, 0.03, max_probes=4)
    assert "hardly moves" in _miss_hint(deaf)
    assert _miss_hint(search_sigma(lambda s: 0.0 if s < 4e-3 else 0.4, 0.1, max_probes=4)) == ""


# ---------------------------------------------------------------- the schedule's calibrated state


def test_calibrating_keeps_the_decay_ratio_and_is_saved_in_the_state() -> None:
    s = AQNSchedule(total_steps=100, sigma_start=1e-2, sigma_end=5e-4)
    before = s.stage_sigmas()
    s.calibrate(2e-3)
    assert s.calibrated and s.sigma_start == 2e-3 and s.sigma_end == pytest.approx(1e-4)
    assert s.stage_sigmas() == pytest.approx([b * 0.2 for b in before])  # the same shape, scaled
    restored = AQNSchedule(total_steps=100)
    restored.load_state_dict(s.state_dict())
    assert restored == s and restored.calibrated
    # A checkpoint written before calibration existed has no "calibrated" key: not calibrated.
    old = {k: v for k, v in AQNSchedule(total_steps=100).state_dict().items() if k != "calibrated"}
    fresh = AQNSchedule(total_steps=100)
    fresh.load_state_dict(old)
    assert not fresh.calibrated
    with pytest.raises(QerlError):
        s.calibrate(0.0)


def test_first_steps_of_noisy_stages() -> None:
    s = AQNSchedule(total_steps=10, num_stages=5)  # stages of 2 steps, stage 0 noise-free
    assert [t for t in range(12) if s.starts_noisy_stage(t)] == [2, 4, 6, 8]
    all_noisy = AQNSchedule(total_steps=4, num_stages=2, first_stage_noise_free=False)
    assert [t for t in range(4) if all_noisy.starts_noisy_stage(t)] == [0, 2]


# ---------------------------------------------------------------- config


def _cfg(*sets: str) -> TrainConfig:
    return load_config(TrainConfig, None, ["model.path=m", *sets])


def test_config_rule_for_the_target() -> None:
    cfg = _cfg("aqn.calibrate=tokens", "aqn.target=0.03")
    assert cfg.aqn.calibrate == "tokens" and cfg.aqn.target == 0.03 and cfg.aqn.calibration_prompts == 8
    for bad in ([], ["aqn.target=0"], ["aqn.target=1.0"], ["aqn.target=3"]):
        with pytest.raises(QerlError, match=r"aqn\.target must be in \(0, 1\) with aqn\.calibrate=tokens"):
            _cfg("aqn.calibrate=tokens", *bad)
    # Off, or AQN off (a compare arm over a calibrating recipe): no target needed.
    assert _cfg().aqn.calibrate == "off"
    assert _cfg("aqn.enabled=false", "aqn.calibrate=tokens").aqn.target is None
    with pytest.raises(QerlError, match="calibrate"):
        _cfg("aqn.calibrate=kl", "aqn.target=0.1")  # not offered: the engines return no such logprobs
    with pytest.raises(QerlError, match="calibration_prompts"):
        _cfg("aqn.calibration_prompts=0")
    with pytest.raises(QerlError, match="calibration_max_tokens"):
        _cfg("aqn.calibration_max_tokens=0")


def test_calibration_prompts_come_from_a_copy_of_the_stream() -> None:
    problems = [Problem(str(i), f"q{i}", str(i)) for i in range(20)]
    prompts = {p.id: f"prompt {p.id}" for p in problems}
    cfg = _cfg("aqn.calibrate=tokens", "aqn.target=0.05", "aqn.calibration_prompts=5", "train.seed=3")
    probe = NoiseProbe.for_run(cfg, problems, prompts)
    first = PromptStream(problems, 3).take(5)  # the run's first five prompts, its position untouched
    assert probe.prompts == [prompts[p.id] for p in first] and probe.target == 0.05
    assert probe.spec.temperature == 0.0 and probe.spec.max_new_tokens == cfg.rollout.max_completion_length
    assert (
        NoiseProbe.for_run(_cfg("aqn.calibration_max_tokens=16"), problems, prompts).spec.max_new_tokens == 16
    )
    assert NoiseProbe.for_run(_cfg(), problems, prompts).target is None  # calibrate off: measure only
    assert len(NoiseProbe.for_run(cfg, problems[:3], prompts).prompts) == 3  # never a prompt twice


# ---------------------------------------------------------------- the tiny model, HF engine


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_tokenizer
    from qerl_cli.rollout.hf import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return HFEngine(model, load_tokenizer(str(tiny_model_dir)))


def test_calibrated_sigma_changes_the_target_share_on_the_tiny_model(hf_engine) -> None:
    """On the random tiny model, 8 prompts x 8 greedy tokens: sigma 1e-2 changes about an eighth of the
    tokens, 1e-1 most of them; the calibration finds one that changes half."""
    from qerl_cli.rl.stream import derive_seed

    prompts = [f"What is {i} + {2 * i + 3}?" for i in range(8)]
    spec = SamplingSpec(max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0)
    probe = NoiseProbe(prompts, spec, target=0.5)
    cfg = _cfg("aqn.calibrate=tokens", "aqn.target=0.5", "aqn.calibration_probes=8",
               "aqn.calibration_tolerance=0.25")  # fmt: skip
    schedule = AQNSchedule(total_steps=10, sigma_start=1e-2, sigma_end=5e-4)
    found = probe.calibrate(hf_engine, schedule, cfg, Distributed())
    assert found.converged and schedule.calibrated and schedule.sigma_start == found.sigma
    assert schedule.sigma_end / schedule.sigma_start == pytest.approx(5e-4 / 1e-2)
    assert hf_engine.stats()["rollout/noise_sigma"] == 0.0  # the engine is left without noise
    # The configured 1e-2 (the search's second probe) misses the target.
    assert [e for s, e in found.probes if s == pytest.approx(1e-2)][0] < 0.375
    # Measured afresh with the calibration's noise draw: the share is within tolerance of the target.
    share = probe.tokens_changed(
        hf_engine, schedule.sigma_start, derive_seed(cfg.train.seed, "aqn-calibration")
    )
    assert share == found.effect and abs(share - 0.5) <= 0.25 * 0.5


def test_a_run_calibrates_once_logs_each_stage_and_resumes_without_recalibrating(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_trainer import FakeReward, tiny_cfg

    from qerl_cli.rl.aqn_calibration import NoiseProbe as Probe
    from qerl_cli.rl.trainer import train

    calls: list[float] = []
    real = Probe.calibrate

    def counting(self, engine, schedule, cfg, dist):
        calls.append(schedule.sigma_start)
        return real(self, engine, schedule, cfg, dist)

    monkeypatch.setattr(Probe, "calibrate", counting)
    sets = ("train.max_steps=2", "output.save_steps=1", "aqn.calibrate=tokens", "aqn.target=0.3",
            "aqn.calibration_prompts=2", "aqn.calibration_probes=3")  # fmt: skip
    out = tmp_path / "run"
    train(tiny_cfg(tiny_model_dir, out, *sets), progress=False, reward_fn=FakeReward())
    first = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    saved = json.loads((out / "checkpoint-1" / STATE_FILE).read_text())["aqn"]
    assert calls == [1e-2] and saved["calibrated"]  # measured once, from the configured sigma
    # Step 1 is the noise-free stage; step 2 starts the noisy one at the calibrated sigma, measured.
    assert TOKENS_CHANGED_METRIC not in first[0] and 0.0 <= first[1][TOKENS_CHANGED_METRIC] <= 1.0
    assert first[1][NOISE_SIGMA] == pytest.approx(saved["sigma_start"]) and saved["sigma_start"] != 1e-2

    train(tiny_cfg(tiny_model_dir, out, *sets), resume=str(out / "checkpoint-1"), progress=False,
          reward_fn=FakeReward())  # fmt: skip
    again = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert calls == [1e-2]  # the checkpoint's calibrated schedule, not a new calibration
    for key in (NOISE_SIGMA, TOKENS_CHANGED_METRIC, "reward_mean", "loss"):
        assert again[1][key] == pytest.approx(first[1][key], rel=1e-6), key


# ---------------------------------------------------------------- compare arms


def test_the_gemma_recipe_sweeps_calibrated_targets(tmp_path: Path) -> None:
    from qerl_cli.compare import runs as runs_mod

    recipe = REPO / "recipes" / "gemma3_270m_wordproblems.yaml"
    data, settings = runs_mod.load_recipe(recipe)
    for arm, target in (("nvfp4-aqn-t1pct", 0.01), ("nvfp4-aqn-t3pct", 0.03), ("nvfp4-aqn-t10pct", 0.10)):
        # With its base made (before, the arm is checked on the recipe's model: format auto).
        bases = {arm: str(tmp_path / "base")}
        conf = runs_mod.arm_config(data, settings.arms[arm], [], 0, tmp_path, arm, bases)
        assert conf.model.format == "nvfp4" and conf.aqn.enabled
        assert conf.aqn.calibrate == "tokens" and conf.aqn.target == pytest.approx(target)
        assert conf.aqn.calibration_prompts == 64  # completions of ~24 tokens: 8 prompts measure coarsely
        assert conf.aqn.sigma_end / conf.aqn.sigma_start == pytest.approx(5e-4 / 1e-2)  # the ratio kept


def test_a_raw_sigma_on_an_awq_base_is_warned_about_with_the_fix() -> None:
    """AWQ divides smoothed norms by its scales, so a raw sigma is larger there (Gemma 3 270M, vLLM: 1e-2
    changed 99% of the greedy tokens on the AWQ base, 15% on the GPTQ base)."""
    from qerl_cli.rl.aqn_calibration import raw_sigma_warning

    warning = raw_sigma_warning(_cfg("aqn.enabled=true"), "awq")
    assert warning is not None and "aqn.sigma_start=0.01" in warning and "aqn.calibrate: tokens" in warning
    for method in ("gptq", "rtn", None):  # norms keep their scale
        assert raw_sigma_warning(_cfg("aqn.enabled=true"), method) is None
    calibrated = _cfg("aqn.enabled=true", "aqn.calibrate=tokens", "aqn.target=0.1")
    assert raw_sigma_warning(calibrated, "awq") is None
    assert raw_sigma_warning(_cfg("aqn.enabled=false"), "awq") is None


def test_a_target_near_the_engines_own_floor_is_warned_about() -> None:
    """vLLM's greedy decoding repeated itself only to 5-7% of the tokens on Gemma 3 270M; a 10% target
    then calibrated sigma anywhere from 1e-3 to 1.8e-2."""
    from qerl_cli.rl.aqn_calibration import floor_warning

    assert floor_warning(0.0, 0.1) is None  # a repeatable engine (the HF engine on a CPU)
    near = floor_warning(0.065, 0.1)
    assert near is not None and "0.065 of the tokens" in near and "aqn.target >= 0.2" in near
    far = floor_warning(0.02, 0.1)
    assert far is not None and "measured on top of that" in far and ">=" not in far

"""The start-of-run reward-spread check that `qerl train` warns with, and the remedies it names."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from qerl_cli.config import TrainConfig
from qerl_cli.modeling.loading import quantized_with
from qerl_cli.rl.signal import StartSignal, remedies, start_steps
from qerl_cli.rl.step_loop import start_signal


def test_the_warning_comes_once_after_the_first_tenth_of_the_run_and_only_when_starved() -> None:
    assert start_steps(60) == 6 and start_steps(3) == 1
    check = StartSignal(20, quantized=True, gptq=False, error_start=False)
    assert check.observe({"zero_std_group_fraction": 0.95}) is None  # step 1 of 2
    warning = check.observe({"zero_std_group_fraction": 0.93})
    assert warning is not None and "reward spread in 6.0% of prompt groups" in warning
    assert "--method gptq" in warning and "--lora-init eora" in warning
    assert "num_generations: 16" in warning
    assert check.observe({"zero_std_group_fraction": 1.0}) is None  # said once
    fed = StartSignal(20, quantized=True, gptq=False, error_start=False)
    # A tenth of groups with a spread is enough.
    assert [fed.observe({"zero_std_group_fraction": f}) for f in (0.9, 0.9)] == [None, None]


def test_remedies_leave_out_what_the_run_already_uses() -> None:
    both = remedies(quantized=True, gptq=True, error_start=True)
    assert "GPTQ" not in both and "lora.init" not in both and "num_generations" in both
    assert "GPTQ" not in remedies(quantized=False, gptq=False, error_start=False)  # a BF16 run


def test_more_samples_names_the_runs_own_num_generations() -> None:
    """A run at 2 samples per prompt is told 4 instead of 2, not the recorded ablation's 8 -> 16."""
    check = StartSignal(10, quantized=False, gptq=False, error_start=False, num_generations=2)
    warning = check.observe({"zero_std_group_fraction": 1.0})
    assert warning is not None and "rollout.num_generations: 4 instead of this run's 2" in warning
    at_eight = remedies(quantized=False, gptq=False, error_start=False, num_generations=8)
    assert "rollout.num_generations: 16 instead of 8 doubled" in at_eight and "this run's" not in at_eight
    assert "32 instead of this run's 16" in remedies(
        quantized=False, gptq=False, error_start=False, num_generations=16
    )


def test_the_trainer_tells_the_check_its_base_method_and_lora_start(tmp_path: Path) -> None:
    assert quantized_with(tmp_path) is None  # no record: a BF16 model, or one made elsewhere
    (tmp_path / "qerl_quant.json").write_text(json.dumps({"method": "gptq", "format": "nvfp4"}))
    assert quantized_with(tmp_path) == "gptq"
    cfg = TrainConfig()
    cfg.model.path, cfg.train.max_steps, cfg.lora.init = str(tmp_path), 60, "eora"
    check = start_signal(SimpleNamespace(cfg=cfg, policy=SimpleNamespace(is_quantized=True)))
    assert (check.window, check.quantized, check.gptq, check.error_start) == (6, True, True, True)
    assert check.num_generations == cfg.rollout.num_generations
    (tmp_path / "qerl_quant.json").write_text("not json")
    assert quantized_with(tmp_path) is None

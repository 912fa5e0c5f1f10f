"""The CPU estimates train, eval and quantize print at their start read sensibly on a tiny model: a step under
a second is "under 1s", not "~0s", and a model under a million parameters is counted in K, not "0M"."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qerl_cli.cli.progress import eval_cpu_estimate
from qerl_cli.config import EvalConfig, QuantizeConfig, TrainConfig, load_config
from qerl_cli.quantize.run import _cpu_estimate
from qerl_cli.rl.preflight import cpu_estimate, model_parameters
from qerl_cli.torch_utils import estimated_duration, parameter_count


@pytest.mark.parametrize(
    ("params", "text"),
    [
        (512, "512"),
        (1_000, "1K"),
        (620_412, "620K"),
        (999_499, "999K"),
        (999_500, "1M"),  # not 1000K
        (1_240_000, "1.2M"),
        (9_960_000, "10M"),
        (134_515_008, "135M"),
        (999_600_000, "1B"),  # not 1000M
        (7_615_616_512, "7.6B"),
        (72_706_203_648, "73B"),
    ],
)
def test_parameter_counts_keep_their_figure(params: int, text: str) -> None:
    assert parameter_count(params) == text


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "under 1s"), (0.7, "under 1s"), (1, "~1s"), (75, "~1m15s")]
)
def test_an_estimate_under_a_second_says_so(seconds: float, text: str) -> None:
    assert estimated_duration(seconds) == text


def test_train_and_eval_estimates_on_a_tiny_model(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The estimates scale with torch's threads, which a loaded machine's CLI run before this one may have set
    # to 1 (where the eval line reads "~1s per 100 completions"): fix them at this machine's 2 cores.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    sized = model_parameters(str(tiny_model_dir))
    assert sized is not None and sized[0] < 1_000_000  # the tiny model: the case this guards
    size = f"{parameter_count(sized[0])} parameters"
    assert size.endswith("K parameters")
    one_step = ["train.max_steps=1", "train.prompts_per_step=1", "rollout.num_generations=2"]
    overrides = [f"model.path={tiny_model_dir}", *one_step, "rollout.max_completion_length=8"]
    line = cpu_estimate(load_config(TrainConfig, "tiny", overrides))
    assert line is not None and "under 1s a step at most, under 1s for 1 step (" in line and size in line
    # A resumed run trains only the steps its checkpoint has not: at step 30 of 40, 10 (it said 40).
    resumed = load_config(TrainConfig, "tiny", [*overrides, "train.max_steps=40"])
    assert "for 10 steps (resumed after step 30) (" in (cpu_estimate(resumed, done=30) or "")
    assert "for 0 steps (resumed after step 40) (" in (cpu_estimate(resumed, done=40) or "")
    line = eval_cpu_estimate(EvalConfig(model=str(tiny_model_dir), max_new_tokens=8, max_problems=1))
    assert line is not None and size in line and "under 1s per 100 completions" in line
    assert "~0s" not in line and "0M parameters" not in line


def test_the_quantize_estimate_on_a_tiny_model() -> None:
    job = SimpleNamespace(bf16_bytes=2 * 620_000, method="gptq")
    line = _cpu_estimate(job, QuantizeConfig(model="m", method="gptq", num_samples=1, seq_len=16))
    assert "): under 1s (gptq on 1 x 16 calibration tokens, 620K parameters;" in line

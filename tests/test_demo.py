"""Synthetic tasks, the tiny warm start and in-memory quantization, and (slow) that recipes/tiny.yaml
learns: ``qerl demo`` on its NVFP4 base, and the recipe on its BF16 base."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from qerl_cli.config import TrainConfig, load_config, to_dict
from qerl_cli.data.synthetic import make_problems, reference_completion, task_names
from qerl_cli.errors import QerlError

REPO = Path(__file__).resolve().parents[1]


# -- synthetic tasks ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", task_names())
def test_synthetic_tasks_are_deterministic_with_disjoint_splits(name: str) -> None:
    train = make_problems(name, "train", seed=3)
    assert [p.question for p in make_problems(name, "train", 10, seed=3)] == [p.question for p in train[:10]]
    assert [p.question for p in make_problems(name, "train", 10, seed=4)] != [p.question for p in train[:10]]
    test = make_problems(name, "test", seed=3)
    assert test and not {p.question for p in train} & {p.question for p in test}
    assert len({p.id for p in train}) == len(train)


def test_synthetic_answers_are_right_and_gradeable() -> None:
    from qerl_cli.rewards import format_reward, is_correct

    for problem in make_problems("synthetic-mixed", "test", 12, seed=0):
        a, op, b = problem.meta["a"], problem.meta["op"], problem.meta["b"]
        assert int(problem.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        completion = reference_completion(problem)
        assert is_correct(completion, problem.answer)
        assert format_reward(completion) == 1.0
        assert not is_correct(reference_completion(problem, str(int(problem.answer) + 1)), problem.answer)


def test_synthetic_errors_are_user_errors() -> None:
    with pytest.raises(QerlError, match="unknown synthetic task"):
        make_problems("synthetic-division")
    with pytest.raises(QerlError, match="splits"):
        make_problems("synthetic-addition", "validation")
    with pytest.raises(QerlError, match="asked for"):
        make_problems("synthetic-addition", "test", 10_000)


def test_registered_through_load_problems() -> None:
    from qerl_cli.data.datasets import load_problems

    problems = load_problems("synthetic-addition", split="test", max_samples=5, seed=0)
    assert len(problems) == 5 and all(p.meta["op"] == "+" for p in problems)


# -- warm start and quantization --------------------------------------------------------------------
def test_warm_start_lowers_the_loss_and_reports_its_phases() -> None:
    from qerl_cli.modeling.tiny import build_tiny_model, build_tokenizer
    from qerl_cli.rl.warmstart import WarmStartConfig, supervised_warm_start

    model = build_tiny_model(0).float()
    cfg = WarmStartConfig(max_steps=30, check_every=30, noisy_steps=5, batch_size=8, probe_size=4)
    lines: list[str] = []
    result = supervised_warm_start(
        model, build_tokenizer(), make_problems("synthetic-addition", "train"), cfg, lines.append
    )
    assert (result.clean_steps, result.noisy_steps) == (30, 5)
    # Progress a log can show: the probe check, then the noisy phase.
    assert lines[0].startswith("warm start step 30: probe accuracy ") and "done at 70%" in lines[0]
    assert lines[1] == "warm start: 5 steps on worked additions with slips"
    assert sum(result.losses[-5:]) < sum(result.losses[:5])
    assert 0.0 <= result.final_accuracy <= 1.0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantize_folder_loads_as_quant_linear(tiny_model_dir: Path, tmp_path: Path, fmt: str) -> None:
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.loading import load_policy_model
    from qerl_cli.modeling.quant_linear import QuantLinear
    from qerl_cli.rl.warmstart import quantize_folder

    folder = quantize_folder(tiny_model_dir, tmp_path / fmt, fmt)
    model, found = load_policy_model(folder, dtype=torch.float32)
    assert found == fmt
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14  # 7 projections x 2 layers
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        quantized, dense = model(ids).logits, reference(ids).logits
    # 4-bit weights move the logits a little, not a lot (a random tiny model's logits are ~1).
    assert 0 < (quantized - dense).abs().max() < 0.5


def test_demo_config_is_the_tiny_recipe() -> None:
    from qerl_cli.demo import demo_train_config

    recipe = load_config(TrainConfig, REPO / "recipes" / "tiny.yaml")
    demo = demo_train_config(recipe.model.path, recipe.output.dir, steps=recipe.train.max_steps, seed=0)
    differing = {
        section: {
            k: (v, getattr(getattr(recipe, section), k))
            for k, v in to_dict(getattr(demo, section)).items()
            if to_dict(getattr(recipe, section))[k] != v
        }
        for section in (f.name for f in dataclasses.fields(TrainConfig))
        if dataclasses.is_dataclass(getattr(recipe, section))
    }
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    plain = [name for name in fields if not dataclasses.is_dataclass(getattr(recipe, name))]
    assert {name: getattr(demo, name) for name in plain} == {name: getattr(recipe, name) for name in plain}
    # Checkpointing differs on purpose (the demo keeps one at the end); everything else is the recipe.
    assert {s: d for s, d in differing.items() if d and s != "output"} == {}


# -- the tiny recipe learns (slow: minutes on 2 cores) -----------------------------------------------
@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The warm-started base of recipes/tiny.yaml and `qerl demo` (BF16 and NVFP4 folders), built once
    for both tests below: its warm start is minutes of CPU."""
    from qerl_cli.rl.warmstart import prepare_tiny_base

    return prepare_tiny_base(tmp_path_factory.mktemp("tiny-base"))


@pytest.mark.slow
def test_demo_learns_and_its_adapter_beats_the_base_under_qerl_eval(
    tiny_base: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`qerl demo`: the shipped tiny recipe's settings (test_demo_config_is_the_tiny_recipe) on the NVFP4
    base with AQN. The training reward rises, and `qerl eval` of the adapter over the NVFP4 base scores
    higher than the base alone on held-out problems: the tiny recipe's acceptance."""
    import importlib.util
    import shutil

    from qerl_cli.cli import main
    from qerl_cli.demo import DEMO_TASK
    from qerl_cli.evaluation import read_results
    from qerl_cli.rl import warmstart
    from qerl_cli.rl.tracking import PLOT_FILE, read_metrics

    def prebuilt(
        out_dir: Path, cfg: warmstart.WarmStartConfig, *, formats: tuple[str, ...], report=None
    ) -> dict:
        # The base the demo asks for is the module's (its default settings), built once.
        assert cfg == warmstart.WarmStartConfig() and formats == ("nvfp4",)
        for fmt, folder in tiny_base["paths"].items():
            shutil.copytree(folder, Path(out_dir) / fmt)
        return {**tiny_base, "paths": {"nvfp4": Path(out_dir) / "nvfp4"}}

    monkeypatch.setattr(warmstart, "prepare_tiny_base", prebuilt)
    out = tmp_path / "demo"
    assert main(["demo", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy, sampled" in printed and "done in" in printed
    rewards = [r["reward_mean"] for r in read_metrics(out / "train" / "metrics.jsonl") if "reward_mean" in r]
    assert len(rewards) == 60 and sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.3, rewards

    def sampled(name: str) -> float:
        return read_results(out / name / "sampled").benchmarks[DEMO_TASK].metrics.pass_at_1

    assert sampled("eval_after") > sampled("eval_before") + 0.1
    assert (out / "train" / "adapter" / "adapter_model.safetensors").is_file()
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (out / "train" / PLOT_FILE).is_file() == has_matplotlib


@pytest.mark.slow
def test_tiny_recipe_reward_rises_on_a_bf16_base(tiny_base: dict, tmp_path: Path) -> None:
    """The BF16 LoRA baseline learns too: recipes/tiny.yaml itself on the BF16 base."""
    from qerl_cli.rl.trainer import train

    cfg = load_config(
        TrainConfig,
        REPO / "recipes" / "tiny.yaml",
        [f"model.path={tiny_base['paths']['bf16']}", f"output.dir={tmp_path / 'bf16'}"],
    )
    assert cfg.aqn.enabled
    result = train(cfg, progress=False)
    assert result.reward_last10 - result.reward_first10 >= 0.3, result


def test_demo_refuses_an_unwritable_output_before_any_work(tmp_path: Path) -> None:
    from qerl_cli.demo import run_demo

    (tmp_path / "blocker").write_text("keep me")
    with pytest.raises(QerlError, match="--output .*blocker/demo cannot be written"):
        run_demo(tmp_path / "blocker" / "demo", steps=1)
    assert (tmp_path / "blocker").read_text() == "keep me"

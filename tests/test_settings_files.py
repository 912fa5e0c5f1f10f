"""A training recipe given where a command takes its own settings (`--config`, `--set`): named as a recipe's
section, not matched to a close key of the command (`lora` read as `lora_init`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error

RECIPE_SECTION = "unknown config key 'lora': a section of a training recipe (qerl train, qerl compare)"


@pytest.mark.parametrize("command", [["eval", "MODEL"], ["quantize", "MODEL"], ["bench"]])
def test_a_training_recipe_as_settings_is_named_as_one(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, command: list[str]
) -> None:
    """`qerl quantize MODEL --config recipes/tiny.yaml` said "unknown config key 'lora'; did you mean
    lora_init?"; `qerl bench --config recipes/tiny.yaml` that `model` should be a string."""
    recipe = Path(__file__).parents[1] / "recipes" / "tiny.yaml"
    argv = [a.replace("MODEL", str(tiny_model_dir)) for a in command]
    rc, _, err = run_cli(capsys, *argv, "--config", str(recipe), "--dry-run")
    assert usage_error(rc, err) and RECIPE_SECTION in err and "did you mean" not in err, err


def test_a_recipe_key_set_on_eval_is_named_as_one(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    rc, _, err = run_cli(capsys, "eval", str(tiny_model_dir), "--set", "lora.rank=8", "--dry-run")
    assert usage_error(rc, err) and RECIPE_SECTION in err, err

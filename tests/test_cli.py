from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qerl_cli.cli import main

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


COMMANDS = {
    "quantize", "train", "eval", "bench", "compare", "demo", "env", "models", "tiny-model", "tiny-base",
}  # fmt: skip


def test_help_lists_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    """The exact set of commands, read from the rows of --help's Commands panel (a word such as
    "train" elsewhere in the help does not count): deleting or renaming a command fails here."""
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    panel = out.split("Commands", 1)[1].split("╰", 1)[0]
    rows = [
        line.strip("│ ").split()[0]
        for line in panel.splitlines()
        if line.startswith("│ ") and not line.startswith("│  ")  # continuation lines are indented further
    ]
    assert sorted(rows) == sorted(COMMANDS)
    from typer.main import get_command

    from qerl_cli.cli import app

    assert set(get_command(app).commands) == COMMANDS  # registered, help text or not


def test_env_json_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "env", "--json")
    assert rc == 0
    info = json.loads(out)
    assert info["packages"]["torch"]
    assert {"transformers", "peft", "vllm", "llmcompressor", "triton", "math-verify"} <= set(info["packages"])
    assert isinstance(info["gpus"], list)


def test_train_dry_run_prints_the_override(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(
        capsys,
        "train",
        str(REPO / "recipes/bigmath_14b.yaml"),
        "--dry-run",
        "--set",
        "train.learning_rate=2e-5",
    )
    assert rc == 0
    resolved = yaml.safe_load(out)
    assert resolved["train"]["learning_rate"] == 2e-5
    assert resolved["algorithm"]["name"] == "dapo"


def test_misspelled_key_exits_2_with_suggestion(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run", "--set", "train.lerning_rate=2e-5")
    assert rc == 2
    assert "did you mean train.learning_rate?" in " ".join(err.split())


def test_wrong_type_exits_2_naming_the_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\ntrain:\n  max_steps: many\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run")
    assert rc == 2
    assert "train.max_steps" in err and "expected int" in err


def test_tiny_model_command_writes_a_loadable_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, out, _ = run(capsys, "tiny-model", str(tmp_path / "tiny"), "--seed", "3")
    assert rc == 0
    assert (tmp_path / "tiny" / "model.safetensors").is_file()


def test_unexpected_errors_exit_1_without_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import qerl_cli.envinfo

    def boom() -> dict:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(qerl_cli.envinfo, "collect", boom)
    rc, _, err = run(capsys, "env")
    assert rc == 1
    assert "kaboom" in err and "Traceback" not in err

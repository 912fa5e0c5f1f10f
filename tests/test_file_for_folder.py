"""A file given where a folder is expected (an output folder, `--resume`, `--rescore`, an adapter, a model)
is named as a file, with what to give instead: one helper, `files.file_given_for_folder`, says it."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error

from qerl_cli.errors import QerlError
from qerl_cli.files import file_given_for_folder


def test_the_message_names_the_setting_the_file_and_what_to_give() -> None:
    error = file_given_for_folder(Path("runs/a/config.yaml"), "--resume", "the run's folder (runs/a?)")
    assert isinstance(error, QerlError)
    assert (
        str(error) == "--resume runs/a/config.yaml is a file, not a folder: give the run's folder (runs/a?)"
    )


def test_without_a_setting_and_with_a_kind_of_folder() -> None:
    assert str(file_given_for_folder("m.bin", "", "a model folder", kind="model folder")) == (
        "m.bin is a file, not a model folder: give a model folder"
    )


@pytest.mark.parametrize("command", [["bench"], ["bench", "kernels"]])
def test_bench_model_that_is_a_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str]
) -> None:
    """It was "no such folder" of a file that is there (or, without a path prefix, a hub id)."""
    weights = tmp_path / "model.safetensors"
    weights.write_text("")
    rc, _, err = run_cli(capsys, *command, "--model", str(weights), "--dry-run")
    assert usage_error(rc, err), err
    assert f"--model {weights} is a file, not a folder: give a model folder, a hub id or a shape name" in err
    assert "no such folder" not in err


def test_bench_model_that_is_a_gguf_file_is_planned_as_one(tmp_path: Path) -> None:
    """A .gguf file is a model the run converts at the start: the plan says so (it was "no such folder")."""
    from qerl_cli.bench.preflight import describe_model

    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_text("")
    assert describe_model(str(gguf)) == f"{gguf} (a GGUF file, converted to a model folder at the start)"

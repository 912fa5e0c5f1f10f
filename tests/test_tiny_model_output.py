"""`qerl tiny-model -o DIR`, as every other command writing files takes its folder: the same refusals
before the model is built (a file in the way, a model's folder without --overwrite, a folder of other
files even with it), each naming the flag the user typed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error

from qerl_cli.modeling import tiny


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders the tiny model was written to (not built: the refusals come before it)."""
    folders: list[Path] = []
    monkeypatch.setattr(tiny, "write_tiny_model", lambda out, seed=0: folders.append(out) or out)
    return folders


def test_dash_o_writes_a_loadable_tiny_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "runs" / "tiny"
    rc, stdout, err = run_cli(capsys, "tiny-model", "-o", str(out), "--seed", "1")
    assert rc == 0, err
    assert f"wrote tiny Qwen2 model to {out}" in " ".join(stdout.split())
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("flag", ["-o", "--output"])
def test_dash_o_refuses_a_models_folder_unless_overwrite(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, written: list[Path], flag: str
) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    rc, _, err = run_cli(capsys, "tiny-model", flag, str(model))
    assert usage_error(rc, err) and f"--output {model} already holds a model (config.json)" in err, err
    assert not written and (model / "config.json").read_text() == '{"model_type": "llama"}'
    assert run_cli(capsys, "tiny-model", flag, str(model), "--overwrite")[0] == 0 and written == [model]


@pytest.mark.parametrize(("how", "label"), [(["-o"], "--output"), ([], "OUT")])
def test_a_folder_of_other_files_is_refused_even_with_overwrite(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, written: list[Path], how: list[str], label: str
) -> None:
    """`qerl tiny-model -o runs` would have mixed a model's files into a folder of other work."""
    runs = tmp_path / "runs"
    (runs / "run-1").mkdir(parents=True)
    (runs / "notes.md").write_text("x")
    for extra in ([], ["--overwrite"]):
        rc, _, err = run_cli(capsys, "tiny-model", *how, str(runs), *extra)
        assert usage_error(rc, err) and f"{label} {runs} holds notes.md, run-1/, not a model" in err, err
    assert not written and sorted(p.name for p in runs.iterdir()) == ["notes.md", "run-1"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli(capsys, "tiny-model", *how, str(empty))[0] == 0 and written == [empty]


def test_dash_o_onto_a_file_names_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, written: list[Path]
) -> None:
    in_the_way = tmp_path / "notes.md"
    in_the_way.write_text("x")
    rc, _, err = run_cli(capsys, "tiny-model", "-o", str(in_the_way))
    assert usage_error(rc, err) and f"--output {in_the_way} is a file, not a folder" in err, err
    assert not written and in_the_way.read_text() == "x"


def test_the_folder_is_given_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, written: list[Path]
) -> None:
    rc, _, err = run_cli(capsys, "tiny-model", str(tmp_path / "a"), "-o", str(tmp_path / "b"))
    assert usage_error(rc, err) and "give the folder once, as -o DIR" in err, err
    rc, _, err = run_cli(capsys, "tiny-model")
    assert usage_error(rc, err) and "qerl tiny-model -o DIR" in err, err
    assert not written

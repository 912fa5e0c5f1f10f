"""A folder given where a data file is expected (`qerl quantize --calib`, `data.dataset`, `qerl eval
--data-file`) is named as a folder, with the data files in it, not as "no such file", an unknown dataset
name or a Hub dataset that cannot be reached."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error


@pytest.fixture
def data_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "data" / "problems"  # with a "/": it was looked for on the Hub
    folder.mkdir(parents=True)
    for name in ("train.jsonl", "test.parquet", "notes.txt"):
        (folder / name).write_text("")
    return folder


def test_calib_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, data_folder: Path
) -> None:
    rc, _, err = run_cli(
        capsys, "quantize", str(tiny_model_dir), "--calib", str(data_folder), "-o", str(tmp_path / "q"),
        "--dry-run",
    )  # fmt: skip
    assert usage_error(rc, err), err
    assert f"--calib {data_folder} is a folder (it holds test.parquet, train.jsonl)" in err
    assert "no such file" not in err


@pytest.mark.parametrize("hub_reachable", [False, True])
def test_dataset_folder(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path,
    data_folder: Path, hub_reachable: bool,
) -> None:  # fmt: skip
    from qerl_cli.modeling import source_checks

    monkeypatch.setattr(source_checks, "hub_reachable", lambda *a, **k: hub_reachable)
    rc, _, err = run_cli(
        capsys, "train", "tiny", "--set", f"model.path={tiny_model_dir}",
        "--set", f"data.dataset={data_folder}", "--set", f"output.dir={tmp_path / 'run'}", "--dry-run",
    )  # fmt: skip
    assert usage_error(rc, err), err
    assert f"data.dataset {data_folder} is a folder (it holds test.parquet, train.jsonl)" in err
    assert "Hugging Face Hub" not in err


def test_eval_data_file_folder(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    monkeypatch.chdir(tiny_model_dir.parent)
    (tiny_model_dir.parent / "mydata").mkdir(exist_ok=True)  # no "/": it was called an unknown dataset
    rc, _, err = run_cli(capsys, "eval", str(tiny_model_dir), "--data-file", "gsm8k=mydata", "--dry-run")
    assert usage_error(rc, err), err
    assert "mydata is a folder; give a .jsonl/.json/.parquet/.csv file in it" in err
    assert "unknown dataset" not in err

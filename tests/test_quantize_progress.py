"""`qerl quantize` says what it does as it does it (a line per stage, on stderr, with a CPU time estimate
before the long one), says at its start that the default calibration set comes from the Hub, and refuses a
Hub calibration set at once while offline, naming the shipped one."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_cli.cli import main
from qerl_cli.errors import QerlError
from qerl_cli.quantize.preflight import calibration_source


def test_quantize_prints_its_stages(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "nf4"
    argv = [
        "quantize",
        str(tiny_model_dir),
        "--format",
        "nf4",
        "--method",
        "rtn",
        "--device",
        "cpu",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    stages = [
        "loading the BF16 model",
        "quantizing 14 linear layers (rtn) on cpu",
        "estimate on this CPU",
        "quantized and saved in",
        "done in",
    ]
    found = [next(i for i, line in enumerate(lines) if stage in line) for stage in stages]
    assert found == sorted(found)  # in the order they happen


def test_a_hub_calibration_set_offline_is_refused_at_once(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = [
        "quantize",
        str(tiny_model_dir),
        "--format",
        "nvfp4",
        "--method",
        "gptq",
        "--device",
        "cpu",
        "-o",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--calib open-thoughts/OpenThoughts-114k is a Hugging Face Hub dataset" in err
    assert "--calib qerl-text (shipped with qerl)" in err
    assert not (tmp_path / "o").exists()


def test_the_calibration_source_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "qerl-text (shipped with qerl, offline)" in calibration_source("qerl-text", "train", 48)
    rows = tmp_path / "calib.jsonl"
    rows.write_text('{"text": "x"}\n')
    assert f"from the file {rows}" in calibration_source(str(rows), "train", 8)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("qerl_cli.modeling.source_checks.hub_reachable", lambda *a, **k: True)
    said = calibration_source("open-thoughts/OpenThoughts-114k", "train", 256)
    assert "streamed from the Hugging Face Hub; offline, use --calib qerl-text" in said
    monkeypatch.setattr("qerl_cli.modeling.source_checks.hub_reachable", lambda *a, **k: False)
    with pytest.raises(
        QerlError, match="the Hub cannot be reached: calibrate offline with --calib qerl-text"
    ):
        calibration_source("open-thoughts/OpenThoughts-114k", "train", 256)

"""`qerl quality`: KL, top-1 agreement and perplexity of 4-bit bases against their BF16 model."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_cli.errors import QerlError
from qerl_cli.quantize.quality import Candidate, measure_quality, parse_candidate


def test_candidates_parse_with_label_and_adapter() -> None:
    assert parse_candidate("out/base") == Candidate("base", "out/base", None)
    assert parse_candidate("g=out/base+out/base/lora_init") == Candidate(
        "g", "out/base", "out/base/lora_init"
    )
    with pytest.raises(QerlError, match="no model folder"):
        parse_candidate("label=")


def test_a_coarser_format_keeps_less_and_the_reference_keeps_everything(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from qerl_cli.quantize.native import write_rtn_checkpoint

    nvfp4 = write_rtn_checkpoint(str(tiny_model_dir), tmp_path / "nvfp4", "nvfp4")
    report = measure_quality(
        str(tiny_model_dir),
        [Candidate("self", str(tiny_model_dir)), Candidate("nvfp4", str(nvfp4))],
        device="cpu", rows=4, seq_len=32,
    )  # fmt: skip
    same, rounded = report.rows
    assert same.kl_to_reference == pytest.approx(0.0, abs=1e-6) and same.top1_agreement == 1.0
    assert same.perplexity == pytest.approx(report.reference_perplexity)
    assert rounded.kl_to_reference > 1e-4 and rounded.top1_agreement < 1.0
    assert report.text["rows"] == 4 and report.to_dict()["rows"][1]["label"] == "nvfp4"


def test_the_cli_prints_and_writes_the_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json

    from qerl_cli.cli import main

    out = tmp_path / "q.json"
    argv = ["quality", str(tiny_model_dir), f"same={tiny_model_dir}", "--rows", "2", "--seq-len", "16"]
    assert main([*argv, "--device", "cpu", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["top1_agreement"] == 1.0
    assert main(["quality", str(tiny_model_dir)]) == 2  # no candidate: a usage error


def test_a_refused_candidate_is_named_once(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The label taken from the path is not printed beside that path ("candidate pkl pkl holds")."""
    from qerl_cli.cli import main

    pkl = tmp_path / "pkl"
    pkl.mkdir()
    (pkl / "config.json").write_text("{}")
    (pkl / "pytorch_model.bin").write_bytes(b"")  # only its name is read: the checks refuse it unloaded
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QERL_ALLOW_PICKLE", raising=False)
    for given, named in (("pkl", "candidate pkl holds"), (str(pkl), f"candidate {pkl} holds"),
                         (f"gptq={pkl}", f"candidate gptq {pkl} holds")):  # fmt: skip
        assert main(["quality", str(tiny_model_dir), given, "--device", "cpu"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"{named} only pickle weights" in err, err

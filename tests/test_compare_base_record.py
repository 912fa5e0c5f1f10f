"""A base `qerl compare` made before is reused only when it is the one this invocation would make: the
same source model (its qerl_quant.json's source record), format, method and LoRA start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from qerl_cli.compare import runner
from qerl_cli.compare.bases import prepare_bases
from qerl_cli.errors import QerlError
from qerl_cli.modeling.tiny import write_tiny_model
from qerl_cli.quantize.native import write_rtn_checkpoint
from qerl_cli.quantize.report import REPORT_NAME, read_report, source_record
from tests.cli_runner import run_cli, usage_error

SETS = ["train.device=cpu", "model.dtype=float32"]
ARMS = {"nvfp4-lora": {"model.format": "nvfp4", "aqn.enabled": False}}


def _recipe(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        yaml.safe_dump({"model": {"path": str(model)}, "data": {"dataset": "synthetic-addition"}})
    )
    return path


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model (seed 1): the model an earlier invocation's base was made from."""
    return write_tiny_model(tmp_path_factory.mktemp("other") / "model", seed=1)


def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("a refused comparison made a base or trained")

    monkeypatch.setattr(runner, "prepare_bases", fail)
    monkeypatch.setattr(runner, "run_one", fail)


def test_an_rtn_base_records_its_source(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = write_rtn_checkpoint(tiny_model_dir, tmp_path / "nvfp4", "nvfp4")
    saved = read_report(base)
    assert (saved.format, saved.method) == ("nvfp4", "rtn") and saved.weight_error.layers > 0
    assert saved.source == source_record(tiny_model_dir)
    assert saved.source.path == str(tiny_model_dir.resolve()) and saved.source.weights


def test_a_base_made_from_another_model_is_refused_before_any_work(
    tiny_model_dir: Path, other_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    out = tmp_path / "cmp"
    prepare_bases({"model": {"path": str(other_model)}}, ARMS, SETS, out, method="rtn")
    (out / "nvfp4-lora" / "seed-0").mkdir(parents=True)
    (out / "nvfp4-lora" / "seed-0" / "result.json").write_text("{}")  # a finished run on the old base
    _no_work(monkeypatch)
    recipe = str(_recipe(tmp_path, tiny_model_dir))
    for dry in ([], ["--dry-run"]):
        rc, _, err = run_cli(
            capsys, "compare", recipe, "--arms", "nvfp4-lora", "--seeds", "1", "-o", str(out),
            "--set", "compare.base_method=rtn", "--set", "model.dtype=float32", *dry,
        )  # fmt: skip
        assert usage_error(rc, err), err
        assert f"{out / 'bases' / 'nvfp4'} was made from another model" in err
        assert f"source model: {other_model.resolve()} -> {tiny_model_dir.resolve()}" in err
        assert "-o DIR" in err and f"remove {out / 'bases' / 'nvfp4'}" in err
        assert "finished runs on the old base (nvfp4-lora/seed-0) are a different experiment" in err
    assert read_report(out / "bases" / "nvfp4").source == source_record(other_model)  # nothing changed


def test_the_same_model_reuses_its_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    out, data = tmp_path / "cmp", {"model": {"path": str(tiny_model_dir)}}
    base = Path(prepare_bases(data, ARMS, SETS, out, method="rtn")["nvfp4-lora"])
    stamp = (base / "config.json").stat().st_mtime_ns
    assert prepare_bases(data, ARMS, SETS, out, method="rtn")["nvfp4-lora"] == str(base)
    assert (base / "config.json").stat().st_mtime_ns == stamp  # reused, not made again
    runner.check_compare(_recipe(tmp_path, tiny_model_dir), ["nvfp4-lora"], 1, out,
                         sets=["compare.base_method=rtn", *SETS])  # fmt: skip


def test_a_base_of_an_older_qerl_is_checked_by_what_it_records(
    tiny_model_dir: Path, other_model: Path, tmp_path: Path
) -> None:
    out, data = tmp_path / "cmp", {"model": {"path": str(tiny_model_dir)}}
    base = Path(prepare_bases(data, ARMS, SETS, out, method="rtn")["nvfp4-lora"])
    record = json.loads((base / REPORT_NAME).read_text())
    # An older llm-compressor base: qerl_quant.json with the model as given, no source record.
    del record["source"]
    (base / REPORT_NAME).write_text(json.dumps(record))
    prepare_bases(data, ARMS, SETS, out, method="rtn")  # its recorded path is this model's: reused
    (base / REPORT_NAME).write_text(json.dumps({**record, "model": str(other_model)}))
    with pytest.raises(
        QerlError, match=r"source model: .*model -> .* \(an older qerl recorded its path only\)"
    ):
        prepare_bases(data, ARMS, SETS, out, method="rtn")
    # An older qerl's own RTN base: no qerl_quant.json at all.
    (base / REPORT_NAME).unlink()
    with pytest.raises(QerlError) as refused:
        prepare_bases(data, ARMS, SETS, out, method="rtn")
    message = str(refused.value)
    assert f"{base} records no source model" in message and "made by an older qerl" in message
    assert f"remove {base} to have it made again from {tiny_model_dir.resolve()}" in message
    shutil.rmtree(base)  # as the message says: made again, with its record
    prepare_bases(data, ARMS, SETS, out, method="rtn")
    assert read_report(base).source == source_record(tiny_model_dir)


def test_a_changed_method_or_lora_start_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    out, data = tmp_path / "cmp", {"model": {"path": str(tiny_model_dir)}}
    base = Path(prepare_bases(data, ARMS, SETS, out, method="rtn")["nvfp4-lora"])
    awq = out / "bases" / "nvfp4-awq"  # an AWQ base copied in, whose record says it is RTN
    shutil.copytree(base, awq)
    with pytest.raises(QerlError, match=r"nvfp4-awq was made .*\(method: rtn -> awq\)"):
        prepare_bases(data, ARMS, SETS, out, method="awq")

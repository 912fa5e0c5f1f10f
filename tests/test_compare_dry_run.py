"""`qerl compare --dry-run`: the ablation's checks before any work and the runs it would train; no writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from qerl_cli.compare import runner
from tests.cli_runner import run_cli, usage_error


def _recipe(tmp_path: Path, model: Path | str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        yaml.safe_dump({"model": {"path": str(model)}, "data": {"dataset": "synthetic-addition"}})
    )
    return path


def test_dry_run_checks_and_plans_without_writing(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("--dry-run trained or made a base")

    monkeypatch.setattr(runner, "prepare_bases", no_training)
    monkeypatch.setattr(runner, "run_one", no_training)
    out = tmp_path / "cmp"
    rc, _, err = run_cli(
        capsys, "compare", str(_recipe(tmp_path, tiny_model_dir)), "--arms", "bf16-lora,nvfp4-aqn",
        "--seeds", "2", "-o", str(out), "--set", "compare.base_method=rtn", "--dry-run",
    )  # fmt: skip
    assert rc == 0, err
    assert "runs: 4 (bf16-lora, nvfp4-aqn x seeds 0, 1): 0 finished (skipped), 0 resume" in err
    assert f"--output: {out}: a new folder" in err
    assert f"model.path: {tiny_model_dir}" in err and "compare.base_method=rtn" in err
    assert not out.exists()  # a dry run writes nothing, not even the output folder


def test_dry_run_names_a_missing_model_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    rc, _, err = run_cli(
        capsys, "compare", str(_recipe(tmp_path, tmp_path / "no-model")), "-o", str(out), "--dry-run"
    )
    assert usage_error(rc, err) and "no-model: no such folder" in err
    assert not out.exists()


def test_a_refused_compare_leaves_no_output_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    rc, _, err = run_cli(
        capsys, "compare", str(_recipe(tmp_path, tmp_path)), "--arms", "nvfp5", "-o", str(out)
    )
    assert usage_error(rc, err) and "unknown arm(s) nvfp5" in err
    assert not out.exists()  # a typo of an arm used to leave an empty runs folder behind


@pytest.mark.parametrize(("flag", "value"), [("--jobs", "0"), ("--seeds", "0")])
def test_dry_run_checks_the_counts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, flag: str, value: str
) -> None:
    rc, _, err = run_cli(capsys, "compare", str(_recipe(tmp_path, tiny_model_dir)), flag, value, "--dry-run")
    assert usage_error(rc, err) and f"{flag} must be >= 1, got 0" in err, err


@pytest.mark.parametrize("problem", ["output is a file", "unknown dataset"])
def test_a_run_makes_the_dry_runs_checks_before_any_base_is_made(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    problem: str,
) -> None:  # fmt: skip
    """The run itself refuses what --dry-run would: an output path that is a file (it was an internal
    FileExistsError) and a dataset that does not exist (it was found only after a base was made)."""

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("a base was made or a run trained before the checks")

    monkeypatch.setattr(runner, "prepare_bases", no_work)
    monkeypatch.setattr(runner, "run_one", no_work)
    recipe, out = _recipe(tmp_path, tiny_model_dir), tmp_path / "cmp"
    args = ["--arms", "nvfp4-lora", "--set", "compare.base_method=rtn", "-o", str(out)]
    if problem == "output is a file":
        out.write_text("not a folder")
    else:
        args += ["--set", "data.dataset=nosuchdataset"]
    rc, _, err = run_cli(capsys, "compare", str(recipe), *args)
    assert usage_error(rc, err), err
    assert ("is a file" in err) if problem == "output is a file" else ("nosuchdataset" in err)


def test_a_bf16_arm_on_a_4bit_recipe_model_fails_the_dry_run(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`qerl compare tiny --arms bf16-lora,nvfp4-aqn --dry-run` (the tiny recipe's model is its NVFP4 base)
    passed; the run then refused the bf16-lora arm, after making the output folder."""
    base = tmp_path / "nvfp4"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (base / "config.json").write_text(json.dumps(config))
    out = tmp_path / "cmp"
    for extra in (["--dry-run"], []):
        rc, _, err = run_cli(capsys, "compare", str(_recipe(tmp_path, base)), "--arms", "bf16-lora,nvfp4-aqn",
                             "--seeds", "1", "-o", str(out), *extra)  # fmt: skip
        assert usage_error(rc, err), err
        assert f"arm bf16-lora needs a bf16 base but the recipe's model {base} is nvfp4" in err
        assert not out.exists()

"""An adapter folder that is not there (`qerl eval --adapter`, a `qerl quality` candidate's adapter): the
error says where `qerl train` writes adapters, not only "no such folder", and exits 2 before anything
loads. (`--resume`'s missing folder: tests/test_new_user.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error

ADAPTER_REMEDY = (
    "give the adapter folder of a `qerl train` run, OUTPUT/adapter where OUTPUT is its recipe's output.dir"
)


def eval_dry_run(
    capsys: pytest.CaptureFixture[str], model: Path, adapter: Path, tmp_path: Path
) -> tuple[int, str]:
    """`qerl eval MODEL --adapter ADAPTER --dry-run` on the CPU's HF engine: its exit code and stderr."""
    rc, _, err = run_cli(
        capsys, "eval", str(model), "--adapter", str(adapter), "--engine", "hf",
        "--benchmarks", "synthetic-addition", "-o", str(tmp_path / "e"), "--dry-run",
    )  # fmt: skip
    return rc, err


def test_eval_adapter_missing_says_where_train_writes_adapters(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "runs" / "tiny" / "adaptr"
    rc, err = eval_dry_run(capsys, tiny_model_dir, missing, tmp_path)
    assert usage_error(rc, err), err
    assert f"--adapter {missing}: no such folder; {ADAPTER_REMEDY}" in err
    assert "`qerl train tiny` writes runs/tiny/adapter" in err and "OUTPUT/checkpoint-N/adapter" in err


def test_eval_adapter_given_a_run_folder_names_the_adapter_inside(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The run's folder (runs/tiny) in place of its adapter (runs/tiny/adapter) is the likely slip."""
    run = tmp_path / "runs" / "tiny"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    rc, err = eval_dry_run(capsys, tiny_model_dir, run, tmp_path)
    assert usage_error(rc, err), err
    assert f"(no adapter_config.json); it holds a run's adapter: --adapter {run}/adapter" in err


def test_a_quality_candidates_missing_adapter_says_where_adapters_are(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "nope"
    rc, _, err = run_cli(capsys, "quality", str(tiny_model_dir), f"q={tiny_model_dir}+{missing}")
    assert usage_error(rc, err), err
    assert f"candidate q's adapter {missing}: no such folder; {ADAPTER_REMEDY}" in err

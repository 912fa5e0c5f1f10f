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


def _finished_run(tmp_path: Path) -> Path:
    """A `qerl train` run's folder as it ends: its adapter, config and weights, under runs/tiny."""
    run = tmp_path / "runs" / "tiny"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    return run


def test_eval_adapter_given_a_run_folder_names_the_adapter_inside(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The run's folder (runs/tiny) in place of its adapter (runs/tiny/adapter) is the likely slip."""
    run = _finished_run(tmp_path)
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


def eval_on_cpu(
    capsys: pytest.CaptureFixture[str], model: Path, adapter: Path, tmp_path: Path
) -> tuple[int, str]:
    """`qerl eval MODEL --adapter ADAPTER` for real on the CPU's HF engine (which says a time estimate)."""
    rc, _, err = run_cli(
        capsys, "eval", str(model), "--adapter", str(adapter), "--engine", "hf", "--set", "device=cpu",
        "--benchmarks", "synthetic-addition", "--max-problems", "1", "-o", str(tmp_path / "e"),
    )  # fmt: skip
    return rc, err


def test_eval_refuses_a_run_folder_before_any_estimate(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """No CPU time estimate of an evaluation that will not run is said before its refusal."""
    run = _finished_run(tmp_path)
    rc, err = eval_on_cpu(capsys, tiny_model_dir, run, tmp_path)
    assert usage_error(rc, err), err
    assert f"it holds a run's adapter: --adapter {run}/adapter" in err
    assert "per 100 completions" not in err and "estimate" not in err.lower()


def test_eval_says_its_estimate_once_the_checks_pass(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The estimate still comes, after the checks and before the work (stopped at its first step here)."""
    import torch
    from safetensors.torch import save_file

    from qerl_cli.errors import QerlError
    from qerl_cli.evaluation import run as eval_run

    def stop(*args: object) -> None:
        raise QerlError("stopped at the data")

    monkeypatch.setattr(eval_run, "load_benchmark", stop)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    save_file({"unused": torch.zeros(1)}, str(adapter / "adapter_model.safetensors"))  # the checks read names
    rc, err = eval_on_cpu(capsys, tiny_model_dir, adapter, tmp_path)
    assert rc == 2 and "per 100 completions" in err, err
    assert err.index("per 100 completions") < err.index("stopped at the data")

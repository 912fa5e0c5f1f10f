"""A new-user walk's findings on `--resume`, `--rescore` and `qerl compare`'s checks: each test failed
before its fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from qerl_cli.compare import runner
from qerl_cli.errors import QerlError
from qerl_cli.rl.checkpoint import find_last_checkpoint
from tests.cli_runner import run_cli, usage_error


def _compare_recipe(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    recipe = {"model": {"path": str(model)}, "data": {"dataset": "synthetic-addition"}}
    path.write_text(yaml.safe_dump(recipe))
    return path


def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("a refused compare trained or made a base")

    monkeypatch.setattr(runner, "prepare_bases", no_training)
    monkeypatch.setattr(runner, "run_one", no_training)


@pytest.mark.parametrize("dry_run", [True, False])
def test_compare_refuses_to_train_into_the_models_folder(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    dry_run: bool,
) -> None:  # fmt: skip
    """`qerl compare ... --set model.path=mcopy -o mcopy` trained into mcopy/bf16-lora/seed-0 (rc 0)."""
    _no_work(monkeypatch)
    model = tmp_path / "mcopy"
    shutil.copytree(tiny_model_dir, model)
    before = sorted(p.name for p in model.iterdir())
    rc, _, err = run_cli(
        capsys, "compare", str(_compare_recipe(tmp_path, model)), "--arms", "bf16-lora", "--seeds", "1",
        "-o", str(model), "--no-summary", *(["--dry-run"] if dry_run else []),
    )  # fmt: skip
    assert usage_error(rc, err), err
    assert f"is inside the folder of model.path {model}" in err and "--set output.dir=DIR" in err
    assert sorted(p.name for p in model.iterdir()) == before  # nothing written into the model


def test_compare_gpus_on_a_machine_without_one_fails_the_dry_run(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`qerl compare ... --gpus 0 --dry-run` passed on a machine with no GPU, where the run would fail."""
    _no_work(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU seen
    out = tmp_path / "cmp"
    rc, _, err = run_cli(
        capsys, "compare", str(_compare_recipe(tmp_path, tiny_model_dir)), "--arms", "bf16-lora",
        "--seeds", "1", "-o", str(out), "--gpus", "0", "--dry-run",
    )  # fmt: skip
    assert usage_error(rc, err), err
    assert "--gpus 0: this machine sees no GPU" in err and "Leave --gpus out" in err
    assert not out.exists()


def test_resume_of_a_finished_run_without_a_checkpoint_does_not_suggest_overwrite(tmp_path: Path) -> None:
    """A finished run (adapter/, metrics) with no checkpoint was called stopped, and --overwrite (which
    deletes it) suggested."""
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"x")
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(QerlError) as caught:
        find_last_checkpoint(run)
    message = str(caught.value)
    assert "the run there finished" in message and "--set output.dir=DIR" in message
    assert "--overwrite" not in message and "stopped" not in message


def test_resume_of_a_stopped_run_says_what_overwrite_deletes(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(QerlError, match="stopped before its first one.*adding --overwrite") as caught:
        find_last_checkpoint(tmp_path)
    assert f"it deletes the metrics, completions and checkpoints in {tmp_path}" in str(caught.value)


def test_resume_of_a_checkpoint_the_run_never_wrote_lists_its_checkpoints(tmp_path: Path) -> None:
    """`--resume runs/t2/checkpoint-9` answered with a hard-coded "runs/tiny for `qerl train tiny`"."""
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    with pytest.raises(QerlError) as caught:
        find_last_checkpoint(tmp_path / "checkpoint-9")
    message = str(caught.value)
    assert f"the checkpoints of {tmp_path} are checkpoint-2, checkpoint-4" in message
    assert f"--resume {tmp_path / 'checkpoint-4'}" in message and "runs/tiny" not in message


def test_a_file_of_no_run_gets_no_garbled_folder_hint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--resume afile` and `--rescore afile` (a file in the working folder) said "(.?)"."""
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("x")
    rc, _, err = run_cli(
        capsys, "train", "tiny", "--set", f"model.path={tiny_model_dir}", "--resume", "afile", "--dry-run"
    )
    assert usage_error(rc, err) and "--resume afile is a file" in err and "?)" not in err, err
    rc, _, err = run_cli(capsys, "eval", "--rescore", "afile")
    assert usage_error(rc, err) and "afile is a file" in err and "?)" not in err, err

"""A training run's folder is never overwritten silently: a fresh `qerl train` into a folder holding a
run refuses (exit 2, naming --resume auto, --overwrite and a fresh folder) and leaves every file of the
old run byte-identical; --overwrite clears the old run's files first; --resume still continues, in the
run's own folder only; a failed start leaves no empty folder behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_trainer import FakeReward, tiny_cfg

from qerl_cli.cli import main
from qerl_cli.config import TrainConfig, dump_yaml, load_config
from qerl_cli.errors import QerlError
from qerl_cli.rl import checkpoint as ckpt
from qerl_cli.rl.run_folder import check_fresh_start, clear_run, missing_folders, remove_if_empty
from qerl_cli.rl.tracking import read_metrics
from qerl_cli.rl.trainer import train


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, Path]:
    """A finished 2-step run (a checkpoint a step, metrics, completions, adapter) and its recipe."""
    out = tmp_path_factory.mktemp("finished") / "run"
    cfg = tiny_cfg(tiny_model_dir, out, "train.max_steps=2", "output.save_steps=1")
    train(cfg, progress=False, reward_fn=FakeReward())
    recipe = out.parent / "recipe.yaml"
    recipe.write_text(dump_yaml(cfg))
    return out, recipe


def test_a_rerun_without_resume_refuses_and_touches_nothing(
    finished_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out, recipe = finished_run
    before = snapshot(out)
    kept = {
        "metrics.jsonl",
        "completions.jsonl",
        "checkpoint-2/trainer_state.json",
        "adapter/adapter_config.json",
    }
    assert kept <= set(before)
    assert main(["train", str(recipe)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"output.dir {out} already holds a training run" in err
    assert "nothing was changed" in err
    assert "--resume auto" in err and "--overwrite" in err and "output.dir=DIR" in err
    assert snapshot(out) == before  # byte-identical: metrics, completions, checkpoints, adapter


def test_resume_and_overwrite_together_are_refused(
    finished_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out, recipe = finished_run
    before = snapshot(out)
    assert main(["train", str(recipe), "--resume", "auto", "--overwrite"]) == 2
    assert "give one of them" in " ".join(capsys.readouterr().err.split())
    assert snapshot(out) == before


def test_overwrite_clears_the_old_run_and_resume_continues(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(tiny_cfg(tiny_model_dir, out, "train.max_steps=2", "output.save_steps=1"), progress=False,
          reward_fn=FakeReward())  # fmt: skip
    (out / "result.json").write_text("{}")  # what qerl compare writes beside a finished run
    (out / "notes.txt").write_text("mine")  # not the run's: kept
    with pytest.raises(QerlError, match="already holds a training run"):
        train(tiny_cfg(tiny_model_dir, out, "train.max_steps=1"), progress=False, reward_fn=FakeReward())
    one_step = tiny_cfg(tiny_model_dir, out, "train.max_steps=1", "output.save_steps=1")
    train(one_step, progress=False, reward_fn=FakeReward(), overwrite=True)
    assert [step for step, _ in ckpt.list_checkpoints(out)] == [1]  # checkpoint-2 of the old run is gone
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert not (out / "result.json").exists() and (out / "notes.txt").read_text() == "mine"
    # --resume continues the new run from its checkpoint, as before.
    two_steps = tiny_cfg(tiny_model_dir, out, "train.max_steps=2", "output.save_steps=1")
    result = train(two_steps, resume=str(out), progress=False, reward_fn=FakeReward())
    assert result.steps == 2 and result.resumed_from.endswith("checkpoint-1")
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_a_folder_without_a_run_is_fine_and_unknown_files_stay(tmp_path: Path) -> None:
    (tmp_path / "README").write_text("x")
    (tmp_path / "metrics.jsonl").write_text("")  # an empty file is no run's results
    check_fresh_start(tmp_path, overwrite=False)
    (tmp_path / "checkpoint-3").mkdir()  # no state file: not a checkpoint, but a run's leftover
    check_fresh_start(tmp_path, overwrite=False)
    assert {p.name for p in clear_run(tmp_path)} == {"metrics.jsonl", "checkpoint-3"}
    assert [p.name for p in tmp_path.iterdir()] == ["README"]


def test_a_run_without_checkpoints_is_told_there_is_nothing_to_resume(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(QerlError, match=r"no checkpoint to continue from.*--overwrite") as info:
        check_fresh_start(tmp_path, overwrite=False)
    assert "--resume auto" not in str(info.value)
    message = str(info.value)
    assert "To keep it, train into a fresh folder with --set output.dir=DIR (it has no checkpoint" in message


def test_a_failed_start_leaves_no_empty_folder(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "new"
    cfg = tiny_cfg(tmp_path / "no-model", out)
    with pytest.raises(QerlError):
        train(cfg, progress=False, reward_fn=FakeReward())
    assert not (tmp_path / "runs").exists()


def test_only_empty_created_folders_are_removed(tmp_path: Path) -> None:
    created = missing_folders(tmp_path / "a" / "b")
    assert created == [tmp_path / "a" / "b", tmp_path / "a"]
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "keep").write_text("x")
    remove_if_empty(created)
    assert not (tmp_path / "a" / "b").exists() and (tmp_path / "a" / "keep").is_file()


def test_resuming_another_folders_run_is_refused_and_touches_nothing(
    finished_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `qerl train RECIPE --resume OTHER` wrote OTHER's continuation into the recipe's output.dir: the
    # finished run there lost its metrics after the resumed step, its last checkpoint and its adapter.
    out, recipe = finished_run
    other = tmp_path / "other"
    shutil.copytree(out, other)
    before = snapshot(out)
    for resume in (other, other / "checkpoint-1"):
        for dry_run in ([], ["--dry-run"]):
            assert main(["train", str(recipe), "--resume", str(resume), *dry_run]) == 2
            err = " ".join(capsys.readouterr().err.split())
            assert f"continues the run in {other}, but output.dir is {out}" in err
            assert "over the training run it holds" in err and "nothing was changed" in err
            assert f"qerl train {other / 'config.yaml'} --resume auto" in err
            assert f"--set output.dir={other}" in err
    assert snapshot(out) == before
    with pytest.raises(QerlError, match="continues the run in"):  # the library refuses it too
        train(load_config(TrainConfig, recipe, []), resume=str(other), progress=False, reward_fn=FakeReward())
    assert snapshot(out) == before


def test_a_checkpoint_past_max_steps_is_refused_before_anything_loads(
    finished_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # It passed --dry-run and failed after the model had loaded, without saying what to do.
    out, recipe = finished_run
    before = snapshot(out)
    for dry_run in ([], ["--dry-run"]):
        argv = ["train", str(recipe), "--resume", "auto", "--set", "train.max_steps=1", *dry_run]
        assert main(argv) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "is at step 2, beyond train.max_steps=1" in err
        assert "raise train.max_steps above 2" in err and f"earlier checkpoint-N of {out} (N <= 1)" in err
        assert "estimate" not in err  # refused before the run's start
    assert snapshot(out) == before

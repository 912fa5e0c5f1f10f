"""What a stopped command (Ctrl-C, a full disk) tells the user fits that command: only `qerl train`
speaks of --resume auto, and only once a checkpoint exists; before it, it says nothing was saved yet."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from qerl_cli.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, " ".join(capsys.readouterr().err.split())


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", "out/model.safetensors")


@pytest.mark.parametrize("stop", [interrupt, disk_full], ids=["ctrl-c", "disk-full"])
def test_other_commands_do_not_speak_of_resume(
    stop, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qerl_cli.modeling.tiny as tiny

    monkeypatch.setattr(tiny, "write_tiny_model", stop)
    rc, err = run(capsys, "tiny-model", str(tmp_path / "m"))
    assert rc == (130 if stop is interrupt else 2) and "--resume" not in err and "qerl train" not in err
    assert ("interrupted" in err) if rc == 130 else ("cannot write out/model.safetensors" in err)


def _recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: m\ntrain:\n  device: cuda\noutput:\n  dir: {tmp_path / 'run'}\n")
    return recipe


def test_train_stopped_before_its_first_checkpoint_says_nothing_was_saved(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qerl_cli.rl.trainer as trainer_mod

    monkeypatch.setattr("qerl_cli.rl.preflight.preflight", lambda *args, **kwargs: [])  # no model "m" here
    monkeypatch.setattr(trainer_mod, "train", interrupt)
    rc, err = run(capsys, "train", str(_recipe(tmp_path)))
    assert rc == 130 and "interrupted" in err
    assert "nothing was saved yet" in err and "re-run the same command, with --overwrite" in err
    assert "--resume auto" not in err


@pytest.mark.parametrize("stop", [interrupt, disk_full], ids=["ctrl-c", "disk-full"])
def test_train_stopped_after_a_checkpoint_says_resume(
    stop, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qerl_cli.rl.trainer as trainer_mod

    checkpoint = tmp_path / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    monkeypatch.setattr("qerl_cli.rl.preflight.preflight", lambda *args, **kwargs: [])  # no model "m" here
    monkeypatch.setattr(trainer_mod, "train", stop)
    rc, err = run(capsys, "train", str(_recipe(tmp_path)))
    assert rc == (130 if stop is interrupt else 2)
    # The run's own config.yaml: the recipe with --resume auto resumes the recipe's output.dir, which a
    # --set output.dir or an edit since makes another folder.
    assert (
        f"continue from its last checkpoint with: qerl train {tmp_path / 'run' / 'config.yaml'} --resume auto"
        in err
    )


def test_resume_auto_without_a_checkpoint_says_to_start_again(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from qerl_cli.errors import QerlError
    from qerl_cli.rl.checkpoint import find_last_checkpoint

    with pytest.raises(QerlError, match="nothing to resume from.*without --resume, adding --overwrite"):
        find_last_checkpoint(tmp_path)

"""Fault injection into a training run: a full disk, damaged checkpoints, a NaN loss, a real SIGKILL or
SIGINT; each case checks the exit code, the message, and that no finished work was lost.

In-process through ``qerl_cli.cli.main`` or the library wherever possible; the two cases that need a
real signal run a subprocess and are marked ``slow``. The tiny-model fixtures come from conftest.py
and the training helpers from test_trainer.py.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import SafetensorError
from test_trainer import FakeReward, tiny_cfg

from qerl_cli.cli import main
from qerl_cli.config import dump_yaml
from qerl_cli.errors import QerlError
from qerl_cli.rl import checkpoint as ckpt
from qerl_cli.rl.trainer import train

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    _, err = capsys.readouterr()
    return rc, " ".join(err.split())


# -- a full disk ---------------------------------------------------------------------------------
def test_a_full_disk_during_a_checkpoint_keeps_the_last_good_one(
    tiny_model_dir, tmp_path, monkeypatch
) -> None:
    out = tmp_path / "run"
    real = ckpt.save_file

    def full_at_step_2(tensors, path, *args, **kwargs):
        if ".checkpoint-2.tmp" in str(path):  # what safetensors raises on a full disk (not an OSError)
            raise SafetensorError(
                "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                'message: "No space left on device" })'
            )
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", full_at_step_2)
    cfg = tiny_cfg(tiny_model_dir, out, "output.save_steps=1", "train.max_steps=2")
    with pytest.raises(
        QerlError, match=r"could not write checkpoint-2.*No space left.*checkpoint-1, is intact"
    ):
        train(cfg, progress=False, reward_fn=FakeReward())
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [1]
    assert ckpt.checkpoint_problem(out / "checkpoint-1") is None
    assert not list(out.glob(".checkpoint-*"))  # the partial write was cleaned up
    monkeypatch.setattr(ckpt, "save_file", real)  # space freed: the run continues
    result = train(cfg, resume=str(out), progress=False, reward_fn=FakeReward())
    assert result.steps == 2 and result.resumed_from.endswith("checkpoint-1")


def test_a_full_disk_under_a_report_keeps_the_old_file(tmp_path: Path, monkeypatch) -> None:
    import qerl_cli.files as files

    target = files.write_json(tmp_path / "results.json", {"old": True})

    class FullHandle:
        def __init__(self, fd, *args, **kwargs):
            os.close(fd)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fdopen", FullHandle)
    with pytest.raises(OSError, match="No space left"):
        files.write_json(target, {"new": True})
    assert json.loads(target.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temp file left behind


def test_a_full_disk_is_a_user_error_at_the_cli(capsys, monkeypatch) -> None:
    import qerl_cli.envinfo

    def full() -> dict:
        raise OSError(errno.ENOSPC, "No space left on device", "/data/[run]/metrics.jsonl")

    monkeypatch.setattr(qerl_cli.envinfo, "collect", full)
    rc, err = run(capsys, "env")
    assert rc == 2 and "cannot write /data/[run]/metrics.jsonl: No space left on device" in err
    assert "internal error" not in err


# -- damaged checkpoints, through the trainer -------------------------------------------------------
def test_resume_auto_over_a_damaged_checkpoint_continues_exactly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    straight = FakeReward()  # the run itself went through uninterrupted: its batches are the reference
    train(tiny_cfg(tiny_model_dir, out), progress=False, reward_fn=straight)
    optimizer = out / "checkpoint-4" / "optimizer.safetensors"
    data = bytearray(optimizer.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit-pattern, same size: only the checksum sees it
    optimizer.write_bytes(bytes(data))
    resumed = FakeReward()
    result = train(tiny_cfg(tiny_model_dir, out), resume=str(out), progress=False, reward_fn=resumed)
    assert result.resumed_from.endswith("checkpoint-2")
    assert resumed.batches == straight.batches[2:]  # the same next batches as the uninterrupted run


def test_every_checkpoint_damaged_is_a_clear_user_error(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tiny_cfg(tiny_model_dir, out, "train.max_steps=2", "output.save_steps=1")
    train(cfg, progress=False, reward_fn=FakeReward())
    for _, folder in ckpt.list_checkpoints(out):
        (folder / ckpt.MANIFEST_FILE).unlink()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(dump_yaml(cfg))
    rc, err = run(capsys, "train", str(recipe), "--resume", "auto")
    assert rc == 2 and "every checkpoint is damaged" in err and "manifest.json is missing" in err
    assert "SafetensorError" not in err and "internal error" not in err
    assert (out / "adapter" / "adapter_model.safetensors").is_file()  # the finished adapter is untouched


# -- NaN loss ---------------------------------------------------------------------------------------
class NanAtStep(FakeReward):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def __call__(self, completions, problems):
        rewards, stats = super().__call__(completions, problems)
        if len(self.batches) == self.step:
            rewards = [float("nan")] * len(rewards)
        return rewards, stats


def test_a_nan_loss_mid_run_stops_and_keeps_the_last_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tiny_cfg(tiny_model_dir, out, "train.max_nonfinite_steps=0")  # the first NaN step ends the run
    with pytest.raises(QerlError, match=r"diverged at step 3.*last good checkpoint is .*checkpoint-2"):
        train(cfg, progress=False, reward_fn=NanAtStep(3))
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [2]
    assert ckpt.checkpoint_problem(out / "checkpoint-2") is None
    result = train(tiny_cfg(tiny_model_dir, out), resume=str(out), progress=False, reward_fn=FakeReward())
    assert result.steps == 4


def test_a_nan_gradient_under_a_finite_loss_names_the_tensors(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on an H200 once: a finite loss, one tensor's gradient NaN. The message names that tensor only."""
    from qerl_cli.rl.distributed import Distributed

    original = Distributed.all_reduce_gradients
    poisoned_name = []

    def poison_one(self, params):
        original(self, params)
        name, param = params[3]
        param.grad.view(-1)[0] = float("nan")
        poisoned_name.append(name)

    monkeypatch.setattr(Distributed, "all_reduce_gradients", poison_one)
    with pytest.raises(QerlError) as caught:
        cfg = tiny_cfg(tiny_model_dir, tmp_path / "run", "train.max_nonfinite_steps=0")
        train(cfg, progress=False, reward_fn=FakeReward())
    message = str(caught.value)
    assert "diverged at step 1: the gradient norm is nan (non-finite gradients in 1 of " in message
    assert f"tensors: {poisoned_name[0]})" in message and "lora_" in poisoned_name[0]


# -- signals (subprocesses: a real SIGKILL / SIGINT) ----------------------------------------------
SCRIPT = """
import sys, time, pathlib
sys.path[:0] = [{repo!r}, {tests!r}]
from test_trainer import FakeReward
import qerl_cli.rewards
qerl_cli.rewards.build_reward_fn = lambda cfg, **kw: FakeReward()
mark = pathlib.Path({mark!r})
{patch}
from qerl_cli.cli import main
sys.exit(main(["train", {recipe!r}]))
"""
SLOW_MANIFEST = """
from qerl_cli.rl import checkpoint as ckpt
real = ckpt.write_manifest
def slow(folder):
    if folder.name == ".checkpoint-4.tmp":
        mark.write_text("saving")
        time.sleep(120)
    return real(folder)
ckpt.write_manifest = slow
"""
SLOW_ROLLOUT = """
from qerl_cli.rollout.hf import HFEngine
real = HFEngine.generate
def slow(self, *args, **kwargs):
    if (mark.parent / "run" / "checkpoint-2").is_dir():
        mark.write_text("generating")
        time.sleep(120)
    return real(self, *args, **kwargs)
HFEngine.generate = slow
"""


def _as_from_a_terminal() -> None:
    """The child starts with Ctrl-C as a shell gives it (default action, not blocked). An ignored or
    blocked SIGINT is inherited across exec; in two full runs the SIGINT test below waited out its
    timeout while passing alone, which this reading would explain (not established)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start(tmp_path: Path, tiny_model_dir: Path, patch: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(dump_yaml(tiny_cfg(tiny_model_dir, out)))
    mark = tmp_path / "mark"
    script = SCRIPT.format(
        repo=str(REPO), tests=str(REPO / "tests"), mark=str(mark), recipe=str(recipe), patch=patch
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    deadline = time.monotonic() + 240
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached the fault point"
        time.sleep(0.05)
    return proc, out


@pytest.fixture(scope="module")
def straight_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[FakeReward, Path]:
    """An uninterrupted run of the config the faulted runs below use: its batches (what a resume must
    reproduce) and its folder (metrics.jsonl). Made once for both; neither writes to it."""
    out = tmp_path_factory.mktemp("straight") / "run"
    reward = FakeReward()
    train(tiny_cfg(tiny_model_dir, out), progress=False, reward_fn=reward)
    return reward, out


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_then_resume_at_the_cli(
    capsys, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, straight_run
) -> None:
    """`qerl train` SIGKILLed while writing checkpoint-4, then `qerl train --resume`: the same next
    batches, and every step's metrics equal those of the uninterrupted run."""
    import qerl_cli.rewards

    straight, straight_dir = straight_run
    proc, out = _start(tmp_path, tiny_model_dir, SLOW_MANIFEST)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert (out / ".checkpoint-4.tmp").is_dir() and not (out / "checkpoint-4").exists()
    assert ckpt.find_last_checkpoint(out).name == "checkpoint-2"
    resumed = FakeReward()
    monkeypatch.setattr(qerl_cli.rewards, "build_reward_fn", lambda cfg, **kwargs: resumed)
    rc, err = run(capsys, "train", str(tmp_path / "r.yaml"), "--resume", str(out))
    assert rc == 0, err
    assert resumed.batches == straight.batches[2:]  # resumed at step 3, with identical next batches
    assert not (out / ".checkpoint-4.tmp").exists() and ckpt.checkpoint_problem(out / "checkpoint-4") is None
    a = [json.loads(x) for x in (straight_dir / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # steps 3 and 4 of the killed run were redone once
    for ra, rb in zip(a, b, strict=True):
        for key in ("reward_mean", "entropy", "loss", "grad_norm", "data_position"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-9), (ra["step"], key)


@pytest.mark.slow
def test_sigint_during_a_rollout_exits_cleanly_and_resumes(
    tiny_model_dir: Path, tmp_path: Path, straight_run
) -> None:
    straight, _ = straight_run
    proc, out = _start(tmp_path, tiny_model_dir, SLOW_ROLLOUT)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [2] and not list(out.glob(".checkpoint-*"))
    assert ckpt.checkpoint_problem(out / "checkpoint-2") is None
    resumed = FakeReward()
    result = train(tiny_cfg(tiny_model_dir, out), resume=str(out), progress=False, reward_fn=resumed)
    assert result.steps == 4 and resumed.batches == straight.batches[2:]

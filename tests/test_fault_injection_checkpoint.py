"""Fault injection: each case breaks one thing a real run meets (bad input, a damaged or full disk, a
crashed grader, a signal) and checks the exit code, the message, and that nothing was lost.

In-process through ``qerl_cli.cli.main`` or the library wherever possible; the two cases that need a
real signal run a subprocess and are marked ``slow``. The tiny-model fixtures come from conftest.py
and the training helpers from test_trainer.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
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


def train_argv(model: Path | str, out: Path, *sets: str) -> list[str]:
    args = [
        "train",
        str(REPO / "recipes" / "tiny.yaml"),
        f"--set=model.path={model}",
        f"--set=output.dir={out}",
    ]
    return args + [f"--set={s}" for s in ("train.max_steps=1", "train.prompts_per_step=2", *sets)]


# -- recipes: a wrong type in every section --------------------------------------------------------
WRONG_TYPES = {
    "model": ("trust_remote_code", "maybe", "expected bool"),
    "lora": ("rank", "big", "expected int"),
    "rollout": ("temperature", "hot", "expected float"),
    "algorithm": ("eps_low", [0.2], "expected float"),
    "aqn": ("enabled", "sometimes", "expected bool"),
    "data": ("levels", [3, "hard"], "item 2 ('hard') is not int"),
    "reward": ("extra", {"pkg.mod:fn": "lots"}, "is not float"),
    "train": ("max_steps", 1.5, "expected int"),
    "output": ("save_total_limit", "three", "expected int | null"),
}


@pytest.mark.parametrize("section", sorted(WRONG_TYPES))
def test_a_wrong_type_in_each_recipe_section(capsys, tmp_path: Path, section: str) -> None:
    key, value, expected = WRONG_TYPES[section]
    out = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        json.dumps({"model": {"path": "m"}, "output": {"dir": str(out)}, section: {key: value}})
    )
    rc, err = run(capsys, "train", str(recipe))
    assert rc == 2
    assert f"'{section}.{key}'" in err and expected in err
    assert not out.exists()  # nothing was started


# -- model folders ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pickle_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qerl_cli.modeling.tiny import build_tiny_model, build_tokenizer

    out = tmp_path_factory.mktemp("pickle") / "model"

    model = build_tiny_model(seed=0)
    out.mkdir()
    model.config.save_pretrained(out)
    torch.save(model.state_dict(), out / "pytorch_model.bin")  # how older checkpoints were shared
    build_tokenizer().save_pretrained(out)
    assert not list(out.glob("*.safetensors"))
    return out


def test_pickle_only_weights_are_refused(capsys, pickle_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("QERL_ALLOW_PICKLE", raising=False)
    rc, err = run(capsys, *train_argv(pickle_model_dir, tmp_path / "run"))
    assert rc == 2 and "only pickle weights" in err and "QERL_ALLOW_PICKLE=1" in err
    assert not (tmp_path / "run" / "adapter").exists()


def test_pickle_weights_load_when_the_user_opts_in(pickle_model_dir: Path, monkeypatch) -> None:

    from qerl_cli.modeling.loading import load_base_model

    monkeypatch.setenv("QERL_ALLOW_PICKLE", "1")
    model, fmt = load_base_model(str(pickle_model_dir), "auto", torch.float32, torch.device("cpu"))
    assert fmt == "bf16" and sum(p.numel() for p in model.parameters()) > 0


@pytest.fixture
def remote_code_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_model_that_needs_its_own_code_says_how_to_opt_in(
    capsys, remote_code_model_dir: Path, tmp_path
) -> None:
    rc, err = run(capsys, *train_argv(remote_code_model_dir, tmp_path / "run"))
    assert rc == 2 and "needs its own Python code" in err and "--set model.trust_remote_code=true" in err
    rc, err = run(
        capsys, "eval", str(remote_code_model_dir), "--benchmarks", "gsm8k", "-o", str(tmp_path / "e")
    )
    assert rc == 2 and "--set trust_remote_code=true" in err


def test_trust_remote_code_passes_the_check_when_asked(remote_code_model_dir: Path) -> None:
    from qerl_cli.modeling.source_checks import check_model_source

    check_model_source(remote_code_model_dir, trust_remote_code=True)  # no error: the user asked


def test_a_model_path_that_is_a_file(capsys, tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    rc, err = run(capsys, "eval", str(weights), "--benchmarks", "gsm8k", "-o", str(tmp_path / "e"))
    assert rc == 2 and "is a file; give the model's folder" in err
    assert weights.read_bytes() == b"x"


def test_an_offline_hub_id_for_train_fails_fast(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    rc, err = run(capsys, *train_argv("nobody/no-such-model", tmp_path / "run"))
    assert rc == 2 and "Hugging Face Hub id, HF_HUB_OFFLINE=1 is set" in err
    assert time.monotonic() - start < 10


def test_an_offline_hub_dataset_names_the_local_file_option(capsys, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rc, err = run(capsys, *train_argv(tiny_model_dir, tmp_path / "run", "data.dataset=nobody/no-such-data"))
    assert rc == 2 and "offline" in err and "data.dataset=PATH" in err


# -- output folders --------------------------------------------------------------------------------
def test_train_output_folder_that_is_a_file(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.write_text("keep me")
    rc, err = run(capsys, *train_argv(tiny_model_dir, target))
    assert rc == 2 and f"output.dir {target} is a file" in err
    assert target.read_text() == "keep me"


def test_eval_output_folder_that_is_a_file(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "results"
    target.write_text("keep me")
    rc, err = run(
        capsys, "eval", str(tiny_model_dir), "--benchmarks", "synthetic-addition", "-o", str(target)
    )
    assert rc == 2 and f"--output {target} is a file" in err
    assert target.read_text() == "keep me"


def test_an_output_folder_under_a_file(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("keep me")
    rc, err = run(capsys, *train_argv(tiny_model_dir, tmp_path / "blocker" / "run"))
    assert rc == 2 and "cannot be written" in err and "blocker" in err
    assert (tmp_path / "blocker").read_text() == "keep me"


def test_an_unwritable_output_folder(capsys, tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Root ignores chmod, so the refusal is simulated where the probe write happens."""
    import qerl_cli.files

    real = qerl_cli.files.tempfile.mkstemp

    def refuse(*args, dir=None, **kwargs):  # noqa: A002 - mkstemp's own keyword
        if dir is not None and Path(dir) == tmp_path / "ro":
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(qerl_cli.files.tempfile, "mkstemp", refuse)
    rc, err = run(capsys, *train_argv(tiny_model_dir, tmp_path / "ro"))
    assert rc == 2 and f"output.dir {tmp_path / 'ro'} cannot be written: Permission denied" in err


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
    assert result["steps"] == 2 and result["resumed_from"].endswith("checkpoint-1")


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
    assert result["resumed_from"].endswith("checkpoint-2")
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
    with pytest.raises(QerlError, match=r"diverged at step 3.*last good checkpoint is .*checkpoint-2"):
        train(tiny_cfg(tiny_model_dir, out), progress=False, reward_fn=NanAtStep(3))
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [2]
    assert ckpt.checkpoint_problem(out / "checkpoint-2") is None
    result = train(tiny_cfg(tiny_model_dir, out), resume=str(out), progress=False, reward_fn=FakeReward())
    assert result["steps"] == 4


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
        train(tiny_cfg(tiny_model_dir, tmp_path / "run"), progress=False, reward_fn=FakeReward())
    message = str(caught.value)
    assert "diverged at step 1: the gradient norm is nan (non-finite gradients in 1 of " in message
    assert f"tensors: {poisoned_name[0]})" in message and "lora_" in poisoned_name[0]


# -- graders and data ---------------------------------------------------------------------------
def crash_on_seven(completion: str, gold: str) -> bool:
    """A grader that kills its own worker process (a segfault in a native library, say)."""
    if "7" in completion:
        os._exit(3)
    return completion.strip() == gold


def test_a_grader_that_kills_its_worker_scores_zero_and_the_pool_goes_on() -> None:
    from qerl_cli.rewards import Grader

    with Grader(workers=1, timeout_s=5.0, grade_fn=f"{__name__}:crash_on_seven") as grader:
        results = grader.grade_many(["1", "7", "3"], ["1", "7", "3"])
        assert [r.correct for r in results] == [True, False, True]
        assert results[1].error or results[1].timed_out
        assert grader.grade_many(["5"], ["5"])[0].correct  # the pool replaced the dead worker


def test_rows_without_an_answer_are_skipped_and_counted(tmp_path: Path, caplog) -> None:
    from qerl_cli.data.datasets import load_problems

    data = tmp_path / "d.jsonl"
    rows = [
        {"question": "1+1?", "answer": "2"},
        {"question": "no answer"},
        {"question": "empty", "answer": "  "},
        {"question": "word answer?", "answer": "seven"},
        {"question": "null", "answer": None},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    with caplog.at_level("WARNING"):
        problems = load_problems(str(data), shuffle=False)
    assert [p.question for p in problems] == ["1+1?", "word answer?"]  # every gradeable row kept
    assert "skipped 3 of 5 rows" in caplog.text and "rows 1, 2, 4" in caplog.text


def test_a_non_numeric_gold_is_graded_not_crashed() -> None:
    from qerl_cli.rewards.grading import grade

    assert grade("<answer>seven</answer>", "seven").correct
    result = grade("<answer>7</answer>", "seven")
    assert not result.correct and result.error is None


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
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached the fault point"
        time.sleep(0.05)
    return proc, out


def _uninterrupted_then_start(tmp_path: Path, model: Path, fault: str) -> tuple[FakeReward, Any, Path]:
    """The batches of an uninterrupted run (what a resume must reproduce), then the run to interrupt,
    started and waiting at its fault point."""
    straight = FakeReward()
    train(tiny_cfg(model, tmp_path / "straight"), progress=False, reward_fn=straight)
    return (straight, *_start(tmp_path, model, fault))


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_then_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    straight, proc, out = _uninterrupted_then_start(tmp_path, tiny_model_dir, SLOW_MANIFEST)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert (out / ".checkpoint-4.tmp").is_dir() and not (out / "checkpoint-4").exists()
    assert ckpt.find_last_checkpoint(out).name == "checkpoint-2"
    resumed = FakeReward()
    result = train(tiny_cfg(tiny_model_dir, out), resume=str(out), progress=False, reward_fn=resumed)
    assert result["resumed_from"].endswith("checkpoint-2") and result["steps"] == 4
    assert resumed.batches == straight.batches[2:]  # identical next batches
    assert not (out / ".checkpoint-4.tmp").exists() and ckpt.checkpoint_problem(out / "checkpoint-4") is None


@pytest.mark.slow
def test_sigint_during_a_rollout_exits_cleanly_and_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    straight, proc, out = _uninterrupted_then_start(tmp_path, tiny_model_dir, SLOW_ROLLOUT)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [2] and not list(out.glob(".checkpoint-*"))
    assert ckpt.checkpoint_problem(out / "checkpoint-2") is None
    resumed = FakeReward()
    result = train(tiny_cfg(tiny_model_dir, out), resume=str(out), progress=False, reward_fn=resumed)
    assert result["steps"] == 4 and resumed.batches == straight.batches[2:]

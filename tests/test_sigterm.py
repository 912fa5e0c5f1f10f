"""SIGTERM (a scheduler's preemption, `timeout`, `docker stop`) stops `qerl train` as Ctrl-C does: the
"interrupted" line and its resume hint, the run's clean-up, exit 143 (128 + SIGTERM), and a run that
`--resume auto` continues. It used to end the process at once, silently. The hint names the run's own
config.yaml: the recipe with `--resume auto` resumed the recipe's output.dir, not a `--set output.dir`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_runner import tiny_cpu_recipe

from qerl_cli.cli.interrupt import interrupt_exit_code, reset_interrupt, sigterm_interrupts
from qerl_cli.errors import Terminated

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS = 3


def _recipe(tmp_path: Path, model: Path) -> Path:
    return tiny_cpu_recipe(
        tmp_path / "recipe.yaml", model, tmp_path / "recipe-run", max_steps=MAX_STEPS, save_steps=1
    )


def _train(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "QERL_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "qerl_cli", "train", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.slow  # two tiny runs in subprocesses: about 20 s on two cores
def test_sigterm_mid_run_stops_as_ctrl_c_and_the_run_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"  # not the recipe's output.dir: the hint must name this run's own config
    proc = _train(tmp_path, str(_recipe(tmp_path, tiny_model_dir)), "--set", f"output.dir={out}")
    deadline = time.monotonic() + 300
    # The first checkpoint is on disk (its manifest written last): the run is between steps 1 and 3.
    while not (out / "checkpoint-1" / "manifest.json").is_file():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    err = " ".join(err.split())
    assert proc.returncode == 128 + signal.SIGTERM, err
    # The hint names this run's config (output.dir from --set), not the recipe, whose output.dir differs.
    said = re.search(
        r"interrupted \(continue from its last checkpoint with: qerl train (\S+) --resume auto\)", err
    )
    assert said is not None and said.group(1) == str(out / "config.yaml"), err
    assert "internal error" not in err and "Traceback" not in err, err
    assert not (out / "adapter").exists()  # stopped before its end, not finished
    resumed = _train(tmp_path, said.group(1), "--resume", "auto")  # the command the hint gives
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, MAX_STEPS + 1)) and (out / "adapter").is_dir(), steps


def test_the_handler_is_the_block_s_alone() -> None:
    """Installed for the run only: the previous handler is back after it, raised or not."""
    before = signal.getsignal(signal.SIGTERM)
    reset_interrupt()
    with pytest.raises(KeyboardInterrupt) as stopped, sigterm_interrupts():
        assert signal.getsignal(signal.SIGTERM) is not before
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at once; reaching the end of this is the failure
    assert isinstance(stopped.value, Terminated) and interrupt_exit_code() == 143
    assert signal.getsignal(signal.SIGTERM) is before
    reset_interrupt()
    assert interrupt_exit_code() == 130  # Ctrl-C's own KeyboardInterrupt


def test_outside_the_main_thread_nothing_changes() -> None:
    """Python sets handlers from the main thread only: a command run in another thread trains as it did."""
    before, seen = signal.getsignal(signal.SIGTERM), []

    def work() -> None:
        with sigterm_interrupts():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [before]


def test_compare_jobs_pass_sigterm_on_to_their_children(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """SIGTERM reaches `qerl compare --jobs N` alone (Ctrl-C reaches the process group): each running child
    is sent SIGTERM and waited for, its log closed, and the interruption goes on to the caller."""
    from qerl_cli.compare import parallel

    class FakeChild:
        def __init__(self, *args: object, **kwargs: object) -> None:
            self.calls: list[str] = []
            started.append(self)

        def poll(self) -> None:
            return None  # still training

        def terminate(self) -> None:
            self.calls.append("terminate")

        def wait(self) -> int:
            self.calls.append("wait")
            return -15

    started: list[FakeChild] = []
    monkeypatch.setattr(parallel.subprocess, "Popen", FakeChild)

    def sigterm_arrives(seconds: float) -> None:
        raise Terminated

    monkeypatch.setattr(parallel.time, "sleep", sigterm_arrives)
    with pytest.raises(Terminated):
        parallel.run_parallel([("bf16", 0), ("nvfp4", 0)], "recipe.yaml", 1, tmp_path, [], width=2)
    assert len(started) == 2
    assert all(child.calls == ["terminate", "wait"] for child in started)
    logs = [tmp_path / run / "compare.log" for run in ("bf16/seed-0", "nvfp4/seed-0")]
    assert all(log.is_file() for log in logs)

"""Runs in child processes (``qerl compare --only ARM/SEED`` each), ``width`` at a time, started
staggered; vLLM runs sharing a GPU start once the previous one's engine is up or has been starting for a
while (``compare.engine_ready_timeout_s``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl_cli.compare.runs import run_dir

log = logging.getLogger(__name__)
# The least gap between two vLLM runs' starts on one GPU; each also waits for the previous one's engine.
DEFAULT_START_INTERVAL_S = 10.0
# Set in a run's child process: it trains in-process (a vLLM run is given its own process once, not again).
CHILD_ENV = "QERL_COMPARE_CHILD"


def _child_command(
    recipe: str, arm: str, seed_count: int, only: str, out: Path, sets: list[str]
) -> list[str]:
    command = [sys.executable, "-m", "qerl_cli.cli", "compare", str(recipe), "--arms", arm]
    command += ["--seeds", str(seed_count), "--only", only, "--output", str(out), "--no-summary"]
    for item in sets:
        command += ["--set", item]
    return command


@dataclass
class _Child:
    """A run's child process, and whether its rollout engine has reported (or is taken to be) up."""

    proc: subprocess.Popen
    name: str
    handle: Any
    folder: Path
    started: float
    engine_up: bool = False


def _engines_up(running: list[_Child], now: float, timeout_s: float, marker: str) -> bool:
    """Whether every running child's vLLM engine is up: its ``marker`` file is in its run folder, or it
    has been starting for ``timeout_s`` (then the next run starts regardless, with a warning)."""
    for child in running:
        if child.engine_up:
            continue
        if (child.folder / marker).is_file():
            child.engine_up = True
            log.info("%s: its rollout engine is up after %.0f s", child.name, now - child.started)
        elif now - child.started >= timeout_s:
            child.engine_up = True
            log.info(
                "%s: no %s after %.0f s (compare.engine_ready_timeout_s); starting the next run alongside",
                child.name, marker, now - child.started,
            )  # fmt: skip
        else:
            return False
    return True


def run_parallel(
    jobs: list[tuple[str, int]], recipe: str, seed_count: int, out: Path, sets: list[str], width: int,
    start_interval_s: float = 0.0, ready_timeout_s: float | None = None,
) -> list[str]:  # fmt: skip
    """One child process per run, ``width`` at a time, started at least ``start_interval_s`` apart;
    the CPU threads are shared out evenly. With ``ready_timeout_s`` (vLLM runs sharing the GPU) a run
    starts only once every running one's rollout engine is up (``rl.setup.ENGINE_READY_FILE`` in its
    folder, which the child writes), or has been starting for that long.

    Returns the runs that failed (each with where its log is); the others run to the end regardless.
    """
    from qerl_cli.rl.setup import ENGINE_READY_FILE

    threads = max(1, (os.cpu_count() or 1) // width)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), CHILD_ENV: "1"}
    pending = list(jobs)
    running: list[_Child] = []
    failures = []
    last_start: float | None = None
    while pending or running:
        while pending and len(running) < width:
            now = time.monotonic()
            if last_start is not None and now - last_start < start_interval_s:
                break
            starting = ready_timeout_s is not None and not _engines_up(
                running, now, ready_timeout_s, ENGINE_READY_FILE
            )
            if starting:
                break  # the previous engine is still starting: its compile cache may serve this run
            arm, seed = pending.pop(0)
            folder = run_dir(out, arm, seed)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / ENGINE_READY_FILE).unlink(missing_ok=True)  # an earlier invocation's
            handle = (folder / "compare.log").open("a")
            command = _child_command(recipe, arm, seed_count, f"{arm}/{seed}", out, sets)
            proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
            last_start = time.monotonic()
            running.append(_Child(proc, f"{arm}/seed-{seed}", handle, folder, last_start))
        time.sleep(0.5)
        for child in list(running):
            if child.proc.poll() is not None:
                child.handle.close()
                running.remove(child)
                if child.proc.returncode:
                    failures.append(
                        f"{child.name} (exit {child.proc.returncode}, see {out / child.name / 'compare.log'})"
                    )
    return failures

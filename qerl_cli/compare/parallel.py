"""Runs in child processes (``qerl compare --only ARM/SEED`` each), ``width`` at a time, started
staggered; vLLM runs sharing a GPU start once the previous one's engine is up or has been starting for a
while (``compare.engine_ready_timeout_s``). On a machine of several GPUs the children are spread over them
(``--gpus``): each child sees one GPU (``CUDA_VISIBLE_DEVICES``), the least busy one when it starts."""

from __future__ import annotations

import logging
import math
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_cli.compare.runs import run_dir
from qerl_cli.errors import QerlError, Terminated
from qerl_cli.rl.setup import ENGINE_READY_FILE
from qerl_cli.rollout.lora_kernel_configs import BATCH_INVARIANT_ENV

log = logging.getLogger(__name__)
# The least gap between two vLLM runs' starts on one GPU; each also waits for the previous one's engine.
DEFAULT_START_INTERVAL_S = 10.0
# Set in a run's child process: it trains in-process (a vLLM run is given its own process once, not again).
CHILD_ENV = "QERL_COMPARE_CHILD"
# Set in a run's child process: the `qerl compare` invocation that started it, which the run's
# result.json records (the parent's, not the child's own).
INVOCATION_ENV = "QERL_COMPARE_INVOCATION"


def child_environment(batch_invariant: bool) -> dict[str, str]:
    """What a run's child process gets on top of this one's environment: ``compare.batch_invariant``
    turns on vLLM's batch-invariant mode (its kernels then give a sequence the same numerics whatever
    it is batched with, so a seed reproduces its run), which vLLM reads from its environment."""
    return {BATCH_INVARIANT_ENV: "1"} if batch_invariant else {}


def invocation_id() -> str:
    """This invocation's id: a run's child inherits its parent's, else a new one, its UTC start time and
    six random hex digits ("20261128T103000Z-1a2b3c"), so two invocations in one second differ."""

    inherited = os.environ.get(INVOCATION_ENV)
    if inherited and os.environ.get(CHILD_ENV):
        return inherited
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"


def visible_gpus(spec: str) -> list[str]:
    """The GPUs to spread runs over: ``auto`` = every GPU this process sees (``CUDA_VISIBLE_DEVICES`` where
    set, else torch's count; none on a CPU machine), or a comma list of GPU ids as ``CUDA_VISIBLE_DEVICES``
    names them (indices, ``GPU-``/``MIG-`` UUIDs). An empty list: the children inherit this process's
    devices."""
    spec = spec.strip()
    if spec != "auto":
        ids = [part.strip() for part in spec.split(",")]
        bad = [i for i in ids if not (i.isdigit() or i.startswith(("GPU-", "MIG-")))]
        if not ids or bad or len(set(ids)) != len(ids):
            raise QerlError(
                f"--gpus {spec!r}: give 'auto' or distinct GPU ids as CUDA_VISIBLE_DEVICES names them, e.g. "
                "--gpus 0,1,2,3 (nvidia-smi -L lists them)"
            )
        return ids
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [part.strip() for part in visible.split(",") if part.strip() and part.strip() != "-1"]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def check_gpus_given(spec: str) -> list[str]:
    """``--gpus`` other than ``auto``: well formed, and on a machine that sees a GPU (the runs it spreads
    could use none, as the run would find); checked by ``--dry-run`` and by a run before any work."""
    ids = visible_gpus(spec)
    if not visible_gpus("auto"):
        raise QerlError(
            f"--gpus {spec}: this machine sees no GPU (torch finds none, or CUDA_VISIBLE_DEVICES hides them) "
            "so no run can be spread over GPUs; nothing was written. Leave --gpus out (auto: every "
            "GPU there is, none here), or run on a machine with GPUs (nvidia-smi -L lists them)"
        )
    return ids


def runs_per_gpu(width: int, gpus: list[str]) -> int:
    """How many of ``width`` concurrent runs share one GPU when spread evenly over ``gpus``."""
    return math.ceil(width / len(gpus)) if gpus else width


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
    gpu: str | None = None
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


def _next_gpu(
    running: list[_Child], slots: list[str | None], per_gpu: int, now: float,
    last_start: dict[str | None, float], gap_s: float, ready_timeout_s: float | None,
) -> tuple[bool, str | None]:  # fmt: skip
    """Where the next child may start now: ``(True, gpu)`` for the least busy of ``slots`` (the first on a
    tie) that has room (fewer than ``per_gpu`` children), started none in the last ``gap_s`` and whose
    children's engines are up (with ``ready_timeout_s``); ``(False, None)`` when none may. A GPU whose
    engine is still starting does not hold back the others: the gap and the wait are each GPU's own."""
    load = {slot: 0 for slot in slots}
    for child in running:
        load[child.gpu] = load.get(child.gpu, 0) + 1
    for slot in sorted(slots, key=lambda g: load[g]):  # stable: the first on a tie
        if load[slot] >= per_gpu or now - last_start.get(slot, -math.inf) < gap_s:
            continue
        neighbours = [c for c in running if c.gpu == slot]
        if ready_timeout_s is None or _engines_up(neighbours, now, ready_timeout_s, ENGINE_READY_FILE):
            return True, slot
    return False, None


def run_parallel(
    jobs: list[tuple[str, int]], recipe: str, seed_count: int, out: Path, sets: list[str], width: int,
    start_interval_s: float = 0.0, ready_timeout_s: float | None = None, gpus: list[str] | None = None,
    invocation: str | None = None, environment: dict[str, str] | None = None,
) -> list[str]:  # fmt: skip
    """One child process per run, ``width`` at a time, started at least ``start_interval_s`` apart on each
    GPU; the CPU threads are shared out evenly. With ``gpus``, the children are spread over them, at most
    :func:`runs_per_gpu` on each, and each sees only its own (``CUDA_VISIBLE_DEVICES``). With
    ``ready_timeout_s`` (vLLM runs sharing a GPU) a run starts on a GPU only once every run already on
    it has its rollout engine up (``rl.setup.ENGINE_READY_FILE`` in its folder, which the child writes),
    or has been starting for that long.

    The children record ``invocation`` as theirs and get ``environment`` on top of this process's.

    Returns the runs that failed (each with where its log is); the others run to the end regardless.
    """

    threads = max(1, (os.cpu_count() or 1) // width)
    env = {**os.environ, **(environment or {}), "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads), CHILD_ENV: "1"}  # fmt: skip
    if invocation:
        env[INVOCATION_ENV] = invocation
    per_gpu = runs_per_gpu(width, gpus or [])
    slots: list[str | None] = list(gpus) if gpus else [None]  # None: the children see what this process sees
    pending = list(jobs)
    running: list[_Child] = []
    failures = []
    last_start: dict[str | None, float] = {}
    try:
        while pending or running:
            while pending and len(running) < width:
                # A GPU whose previous engine is still starting waits (its compile cache may serve this run).
                now = time.monotonic()
                free, gpu = _next_gpu(
                    running, slots, per_gpu, now, last_start, start_interval_s, ready_timeout_s
                )
                if not free:
                    break
                arm, seed = pending.pop(0)
                folder = run_dir(out, arm, seed)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / ENGINE_READY_FILE).unlink(missing_ok=True)  # an earlier invocation's
                handle = (folder / "compare.log").open("a")
                command = _child_command(recipe, arm, seed_count, f"{arm}/{seed}", out, sets)
                child_env = env if gpu is None else {**env, "CUDA_VISIBLE_DEVICES": gpu}
                proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=child_env)
                last_start[gpu] = time.monotonic()
                name = f"{arm}/seed-{seed}"
                if gpu is not None:
                    log.info("%s: started on GPU %s", name, gpu)
                running.append(_Child(proc, name, handle, folder, last_start[gpu], gpu))
            time.sleep(0.5)
            for child in list(running):
                if child.proc.poll() is not None:
                    child.handle.close()
                    running.remove(child)
                    if child.proc.returncode:
                        log_file = out / child.name / "compare.log"
                        failures.append(f"{child.name} (exit {child.proc.returncode}, see {log_file})")
    except Terminated:
        # SIGTERM (docker stop, timeout) reached this process alone, where Ctrl-C reaches the whole process
        # group: passed on, each child stops as a Ctrl-C'd run does (its checkpoints kept), and is waited for.
        for child in running:
            child.proc.terminate()
        for child in running:
            child.proc.wait()
            child.handle.close()
        raise
    return failures

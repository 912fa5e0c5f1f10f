"""A pool of grading worker processes with a hard per-item timeout.

math-verify hands answers to SymPy, and some model outputs make SymPy run for minutes or forever
(``10^{10^{10^{10}}}``, huge factorials, pathological simplifications), sometimes inside C code
that no signal interrupts. So each item is graded in a worker process; when an item runs past
``timeout_s`` its worker is killed and replaced, the item scores 0 and is counted as a timeout.
The caller never waits much longer than ``timeout_s`` for any item.

Workers are fresh interpreters (``python -c`` running :func:`qerl_cli.rewards.worker.main`) talking
over their stdin/stdout pipes, not ``multiprocessing`` children: a fork of the trainer (CUDA, many
threads) is unsafe, and ``spawn``/``forkserver`` children re-import the caller's ``__main__`` (the
whole CLI, or a user script without a ``__main__`` guard). A worker imports only math-verify and
starts in about half a second, in the background; the clock for an item starts when a ready worker
receives it, so start-up is never charged as a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from qerl_cli.errors import QerlError
from qerl_cli.rewards.grading import GradeResult, require_math_verify
from qerl_cli.rewards.worker import READY, SYS_PATH_ENV, resolve_callable

GradeFn = Callable[[str, str], "GradeResult | bool"]
DEFAULT_GRADE_FN = "qerl_cli.rewards.grading:grade"
# A worker that has not reported ready after this long is broken (an import that hangs).
STARTUP_TIMEOUT_S = 120.0
_WORKER_BOOT = "from qerl_cli.rewards.worker import main; main()"

__all__ = ["DEFAULT_GRADE_FN", "Grader", "resolve_callable"]


def grade_fn_ref(grade_fn: GradeFn | str) -> str:
    """A worker imports its grade function by path: ``"module:function"``."""
    if isinstance(grade_fn, str):
        resolve_callable(grade_fn)  # fail here, with a clear message, rather than in every worker
        return grade_fn
    module, name = getattr(grade_fn, "__module__", None), getattr(grade_fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise QerlError(
            f"grade function {grade_fn!r} must be a module-level function of an importable module"
        )
    return f"{module}:{name}"


@dataclass
class _Worker:
    process: subprocess.Popen
    send: Connection  # to the worker's stdin
    recv: Connection  # from the worker's stdout
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    item: int | None = None  # index being graded
    deadline: float = 0.0

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        # An unkillable process (uninterruptible I/O) is left for the OS to reap.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self.send.close()
        self.recv.close()


def _stop_workers(workers: list[_Worker]) -> None:
    for w in workers:
        if w.item is None and w.process.poll() is None:
            with contextlib.suppress(OSError):
                w.send.send(None)  # polite exit for idle workers
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.process.wait(timeout=0.5)
        w.kill()
    workers.clear()


class Grader:
    """Grades (completion, gold) pairs in ``workers`` processes, each item within ``timeout_s``.

    Use as a context manager or call :meth:`close`. ``grade_fn`` (a module-level function or a
    ``"module:function"`` path, ``(completion, gold) -> GradeResult | bool``) replaces the
    math-verify grader, e.g. for tests.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 5.0,
        grade_fn: GradeFn | str = DEFAULT_GRADE_FN,
    ) -> None:
        if workers < 1:
            raise QerlError(f"grader workers must be >= 1, got {workers}")
        if timeout_s <= 0:
            raise QerlError(f"grader timeout must be > 0 seconds, got {timeout_s}")
        self.num_workers = workers
        self.timeout_s = float(timeout_s)
        self._grade_fn = grade_fn_ref(grade_fn)
        if self._grade_fn == DEFAULT_GRADE_FN:
            require_math_verify()
        self._workers: list[_Worker] = []
        self.total_timeouts = 0
        self.total_restarts = 0
        self._closed = False
        # Kill the workers even when the owner forgets close() (garbage collection, exit).
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._finalizer()

    def _start_worker(self) -> _Worker:
        env = dict(os.environ)
        # The worker sees the caller's import path, so a grade function defined in a test module
        # or a user package imports there as it does here.
        env[SYS_PATH_ENV] = json.dumps([p for p in sys.path if p])
        process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        # Connection frames (length-prefixed pickles) over the pipes; it also works with wait().
        send = Connection(os.dup(process.stdin.fileno()), readable=False)
        recv = Connection(os.dup(process.stdout.fileno()), writable=False)
        process.stdin.close()
        process.stdout.close()
        worker = _Worker(process, send, recv)
        # If it died at once, _collect sees the closed pipe and reports why.
        with contextlib.suppress(OSError):
            send.send(self._grade_fn)
        self._workers.append(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)
        self.total_restarts += 1
        self._start_worker()

    def start(self) -> Grader:
        """Start the workers now (they boot in the background while the caller does other work)."""
        if self._closed:
            raise RuntimeError("Grader is closed")
        while len(self._workers) < self.num_workers:
            self._start_worker()
        return self

    # -- grading -----------------------------------------------------------------------------
    def grade(self, completion: str, gold: str) -> GradeResult:
        return self.grade_many([completion], [gold])[0]

    def grade_many(self, completions: Sequence[str], golds: Sequence[str]) -> list[GradeResult]:
        """One GradeResult per pair, in order. Timed-out items are ``GradeResult.timeout()``."""
        if self._closed:
            raise RuntimeError("Grader is closed")
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} gold answers")
        results: list[GradeResult | None] = [None] * len(completions)
        pending = deque(range(len(completions)))
        self.start()
        while pending or any(w.item is not None for w in self._workers):
            self._dispatch(pending, completions, golds)
            self._collect(results)
            self._enforce_deadlines(results)
        return [r if r is not None else GradeResult.timeout() for r in results]

    def _dispatch(self, pending: deque[int], completions: Sequence[str], golds: Sequence[str]) -> None:
        for w in list(self._workers):
            if not pending:
                return
            if w.ready and w.item is None:
                index = pending.popleft()
                try:
                    w.send.send((index, str(completions[index]), str(golds[index])))
                except OSError:  # the worker died while idle: requeue the item, replace the worker
                    pending.appendleft(index)
                    self._replace(w)
                    continue
                w.item = index
                w.deadline = time.monotonic() + self.timeout_s

    def _collect(self, results: list[GradeResult | None]) -> None:
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.item is not None]
        wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.05
        ready = wait([w.recv for w in self._workers], timeout=wait_s)
        by_conn = {id(w.recv): w for w in self._workers}
        for conn in ready:
            worker = by_conn[id(conn)]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._handle_death(worker, results)
                continue
            if message == READY:
                worker.ready = True
            else:
                index, result = message
                results[index] = result
                worker.item = None
        for worker in list(self._workers):
            if not worker.ready and time.monotonic() - worker.started > STARTUP_TIMEOUT_S:
                raise RuntimeError(f"a grader worker did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def _handle_death(self, worker: _Worker, results: list[GradeResult | None]) -> None:
        if not worker.ready:
            code = worker.process.wait(timeout=10)
            self.close()
            raise RuntimeError(
                f"a grader worker exited during start-up (exit code {code}); "
                f"check that the grade function {self._grade_fn!r} imports"
            )
        if worker.item is not None:  # it crashed on this item (e.g. a segfault in a C extension)
            results[worker.item] = GradeResult(False, None, "none", False, error="grader worker crashed")
            worker.item = None
        self._replace(worker)

    def _enforce_deadlines(self, results: list[GradeResult | None]) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.item is not None and now >= worker.deadline:
                results[worker.item] = GradeResult.timeout()
                self.total_timeouts += 1
                worker.item = None
                self._replace(worker)

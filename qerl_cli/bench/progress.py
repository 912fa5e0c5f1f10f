"""Progress of a benchmark, one line per case, for logs: a CI job piping ``qerl bench`` to a file used
to see nothing for a quarter of an hour.

Each line says what was done, how many of how many, the time since the benchmark began and a
rough estimate of the time left (the mean of the cases so far times those left, labelled ``eta ~``)::

    [bench 2/6] nf4 LoRA 16: done in 41 s; elapsed 1m32s, eta ~3m04s

Lines go to stderr, flushed at once, so they interleave with a worker process's own output in
order and stay out of the way of a report printed on stdout. A run that is not a terminal (CI,
``| tee``) gets exactly these lines; in a terminal they are the same, which costs nothing and keeps
one code path.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def clock(seconds: float) -> str:
    """``1h02m``, ``3m04s``, ``41 s``: short, for a log line."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Counts the ``total`` cases of one benchmark and prints a line as each starts and ends."""

    def __init__(
        self, what: str, total: int, *, started: float | None = None, stream: TextIO | None = None
    ) -> None:
        self.what = what
        self.total = max(total, 0)
        self.done = 0
        # time.perf_counter() when the benchmark began (elapsed counts from there), else now
        self.started = time.perf_counter() if started is None else started
        self._stream = stream
        self._case_started: float | None = None
        self._case_seconds: list[float] = []

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def say(self, text: str) -> None:
        print(f"[{self.what}] {text}", file=self.stream, flush=True)

    def start(self, label: str) -> None:
        """A case begins (its line says which, so a run that hangs shows where)."""
        self._case_started = time.perf_counter()
        self.say(f"{self.done + 1}/{self.total} {label}: started; elapsed {clock(self.elapsed())}")

    def finish(self, label: str, outcome: str = "done", seconds: float | None = None) -> None:
        """A case ended (``outcome``: ``done``, or ``failed: why``); ``seconds`` it took when it was
        timed elsewhere (no :meth:`start`). A failure reads ``failed after 3 s: why`` (not ``failed: why
        in 3 s``, whose time seemed to belong to the reason)."""
        now = time.perf_counter()
        spent = seconds if seconds is not None else now - (self._case_started or now)
        self._case_seconds.append(spent)
        self._case_started = None
        self.done += 1
        failed = outcome.startswith("failed")
        took = (
            f"failed after {clock(spent)}{outcome[len('failed') :]}"
            if failed
            else f"{outcome} in {clock(spent)}"
        )
        self.say(f"{self.done}/{self.total} {label}: {took}; elapsed {clock(self.elapsed())}{self.eta()}")

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def eta(self) -> str:
        left = self.total - self.done
        if left <= 0 or not self._case_seconds:
            return ""
        mean = sum(self._case_seconds) / len(self._case_seconds)
        return f", eta ~{clock(mean * left)}"

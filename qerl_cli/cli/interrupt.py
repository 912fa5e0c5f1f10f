"""SIGTERM taken as Ctrl-C while a command trains (``qerl train``, ``qerl compare``).

A scheduler's preemption (Slurm), ``timeout``, ``docker stop`` and ``kill`` send SIGTERM, whose default
action ends the process at once: no "interrupted" line, no resume hint, and none of the clean-up a Ctrl-C
gets (the metrics file flushed and closed, grader workers and a vLLM engine closed, an empty new run
folder removed). :func:`sigterm_interrupts` makes SIGTERM raise :class:`~qerl_cli.errors.Terminated`, a
``KeyboardInterrupt``, so every ``finally`` and ``except BaseException`` on the way out runs as for
Ctrl-C, and ``cli/main.py`` prints the same line and hint. Which signal stopped the command is recorded
here because typer turns any ``KeyboardInterrupt`` into ``Exit(130)``, losing the exception's class:
:func:`interrupt_exit_code` gives the conventional 128 + signal number (130 for Ctrl-C, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from qerl_cli.errors import Terminated

# The signal that interrupted the current command (None: none yet, or Ctrl-C's own KeyboardInterrupt).
_state: dict[str, int | None] = {"signal": None}


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    _state["signal"] = signum
    raise Terminated(f"stopped by {signal.Signals(signum).name}")


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """For the block's duration SIGTERM raises :class:`Terminated`; the previous handler comes back
    after. Python lets only the main thread set a handler (and delivers signals to it alone), so in any
    other thread (a command run from a worker thread, as a test or an embedding may) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        # None: a handler set outside Python (signal.signal refuses None back); the default is what it was.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def reset_interrupt() -> None:
    """Forget an earlier command's signal (several commands run in one process: tests, notebooks)."""
    _state["signal"] = None


def interrupt_exit_code() -> int:
    """The exit code of an interrupted command: 128 + the signal's number, by the shells' convention."""
    return 128 + (_state["signal"] or signal.SIGINT)

"""The training phase this process is in now: ``rollout`` while the engine generates (the span timed as
``time_rollout_s`` in :func:`qerl_cli.rl.rollouts.rollout_round`), ``update`` while the policy trains
on a batch (the span timed as ``time_update_s`` in :func:`qerl_cli.rl.update.update_policy`), ``other``
elsewhere. The RL code marks those spans with :func:`in_phase`; a watcher on another thread, such as
the bench's GPU clock sampler (``qerl_cli.bench.gpusampler``), reads :func:`phase_state` to tag what
it sees with the work it saw. This module imports nothing of qerl and no torch, so every layer that may
import ``rl`` (the bench, the CLI) may read it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

Phase = Literal["rollout", "update", "other"]
ROLLOUT: Phase = "rollout"
UPDATE: Phase = "update"
OTHER: Phase = "other"

# One value per process, not per thread: the reader is another thread (the sampler) and must see the
# training thread's phase. The training thread is its only writer. Storing or loading a module global
# that holds an immutable str is a single reference store or load, atomic under the GIL (and in a
# free-threaded build, where reference stores are atomic too), so a reader gets the old phase or the
# new one, never a torn value; a lock would add cost to every span and buy nothing, since a reading
# taken at a change of phase is ambiguous anyway (the sampler tags such a reading ``other``).
_current: Phase = OTHER
# When the phase last changed (time.monotonic): a watcher whose figure covers a window before it reads (a
# GPU's utilization covers its last sampling period) can tell a reading that straddles a change. Written
# before the phase itself, so a reader that sees the new phase sees this change's time or a later one.
_changed_at: float = float("-inf")


def phase_state() -> tuple[Phase, float]:
    """The phase now and when it last changed (``time.monotonic``; minus infinity before any change)."""
    return _current, _changed_at


def _set(phase: Phase) -> None:
    global _current, _changed_at
    _changed_at = time.monotonic()
    _current = phase


@contextmanager
def in_phase(phase: Phase) -> Iterator[None]:
    """Mark the block as ``phase``; the phase before it comes back when the block ends, raised or not
    (a failed update must not leave the rest of the step tagged as an update)."""
    before = _current
    _set(phase)
    try:
        yield
    finally:
        _set(before)

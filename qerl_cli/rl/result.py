"""What ``qerl train`` returns: :class:`TrainResult`, the run's summary.

The run's files (``metrics.jsonl``, the adapter, checkpoints) are its record; this is the summary the
CLI prints and ``qerl compare`` and the demo read, so it is typed rather than a dict of names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainResult:
    """One training run, finished (every rank of a torchrun job returns the same)."""

    output_dir: str
    adapter: str  # the final adapter folder
    steps: int
    world_size: int
    resumed_from: str | None  # the checkpoint this invocation continued from
    reward_first10: float  # mean training reward of the first reward_window steps (nan: no step recorded)
    reward_last10: float
    plot: str | None  # training_curves.png; None without matplotlib or without steps
    # The rollout's linear kernels as the engine resolved rollout.linear_backend (auto's choice).
    linear_backend: str | None = None
    # The last step's metrics.jsonl record: its keys are the trainer's metric names, which grow with
    # the trainer, so they stay a mapping.
    final: dict[str, Any] = field(default_factory=dict)
    # Steps skipped for a NaN/inf loss or gradient norm (train.max_nonfinite_steps), resumed parts included.
    nonfinite_steps: int = 0
    # The steps each of reward_first10 / reward_last10 averages: 10, or half the steps of a shorter run, so
    # the two never share a step (a 6-step run: the first 3 and the last 3).
    reward_window: int = 10

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # the field names are the summary's keys

    @property
    def reward_window_label(self) -> str:
        """The steps the first / last rewards average, in words: "10 steps", "1 step"."""
        return f"{self.reward_window} step{'s' if self.reward_window != 1 else ''}"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainResult:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def reward_window(steps: int) -> int:
    """The steps the first and the last mean rewards each cover: 10, or half of a shorter run's steps (at
    least 1), so that a short run's two figures come from different steps rather than the same ones."""
    return max(1, min(10, steps // 2))

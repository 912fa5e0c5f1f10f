"""The AQN sigma schedule: sigma per training step, K equal stages, the first noise-free, then a decay.

Matching NVlabs/QeRL ``trl_trainer/noise_scheduler.py`` and ``grpo_trainer.py``: the training steps are
split into ``num_stages`` (K) equal stages; stage 0 is noise-free (only the quantization noise acts) and
stages 1..K-1 use K-1 sigma values going from ``sigma_start`` to ``sigma_end``. The reference code
only implements the exponential (geometric) decay
``sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))``; the paper's Fig. 15 also compares
linear, cosine and logarithmic decay without formulas, so those three are defined here (see
:func:`_decay_fraction`) to share the same end points.

The reference computes the stage with float division (``int(step // (total / K))``); we use the integer
form ``step * K // total``, the same value without rounding surprises.

:meth:`AQNSchedule.calibrate` moves the schedule to a sigma sized to the model
(:mod:`qerl_cli.rl.aqn_calibration`); the noise itself is applied by :mod:`qerl_cli.modeling.aqn`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from qerl_cli.config.checks import aqn_sigmas
from qerl_cli.errors import QerlError

SCHEDULE_KINDS = ("exponential", "linear", "cosine", "logarithmic")


def _decay_fraction(kind: str, u: float, num_noisy_stages: int) -> float:
    """Fraction of the way from sigma_start (0) to sigma_end (1) at position ``u`` in [0, 1].

    Used for the non-exponential shapes: linear ``u``; cosine ``(1 - cos(pi u)) / 2`` (slow at both
    ends); logarithmic ``ln(1 + (n - 1) u) / ln(n)`` with n noisy stages, which at noisy stage j
    (1-based) is ``ln(j) / ln(n)``: a sharp early drop that flattens out, as the paper describes.
    """
    if kind == "linear":
        return u
    if kind == "cosine":
        return (1.0 - math.cos(math.pi * u)) / 2.0
    if kind == "logarithmic":
        if num_noisy_stages < 2:
            return 0.0
        return math.log1p((num_noisy_stages - 1) * u) / math.log(num_noisy_stages)
    raise QerlError(f"unknown AQN schedule {kind!r}; choose one of {', '.join(SCHEDULE_KINDS)}")


@dataclass(kw_only=True)
class AQNSchedule:
    """Sigma per training step: K equal stages, the first noise-free, then a decay.

    ``step`` is the 0-based index of the training step about to roll out; steps at or beyond
    ``total_steps`` stay in the last stage. With ``first_stage_noise_free=False`` all K stages are
    noisy and the decay runs over K values instead of K-1.
    """

    total_steps: int
    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    num_stages: int = 10
    kind: str = "exponential"
    first_stage_noise_free: bool = True
    # Set by :meth:`calibrate`: sigma_start was sized to the model at the start of the run. Part of the
    # state, so a resumed run keeps the calibrated schedule instead of measuring again.
    calibrated: bool = False

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise QerlError(f"unknown AQN schedule {self.kind!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
        if self.total_steps < 1:
            raise QerlError(f"AQN needs total_steps >= 1, got {self.total_steps}")
        if self.num_stages < 1:
            raise QerlError(f"AQN needs num_stages >= 1, got {self.num_stages}")
        if self.first_stage_noise_free and self.num_stages < 2:
            raise QerlError(
                "AQN with num_stages=1 and a noise-free first stage never adds noise; "
                "set num_stages >= 2 or turn AQN off"
            )
        # The recipe's rule (its errors name the recipe's aqn keys, where these values come from), so a
        # calibrated or resumed schedule is held to what the recipe was.
        aqn_sigmas("aqn", self.sigma_start, self.sigma_end, self.kind)

    @property
    def num_noisy_stages(self) -> int:
        return self.num_stages - 1 if self.first_stage_noise_free else self.num_stages

    def stage(self, step: int) -> int:
        """Stage index in [0, num_stages) of a 0-based training step."""
        if step < 0:
            raise QerlError(f"AQN step must be >= 0, got {step}")
        return min(step * self.num_stages // self.total_steps, self.num_stages - 1)

    def stage_sigma(self, stage: int) -> float:
        """Sigma of one stage (0 for the noise-free first stage)."""
        if not 0 <= stage < self.num_stages:
            raise QerlError(f"AQN stage must be in [0, {self.num_stages}), got {stage}")
        j = stage - 1 if self.first_stage_noise_free else stage  # index among the noisy stages
        if j < 0:
            return 0.0
        n = self.num_noisy_stages
        u = j / (n - 1) if n > 1 else 0.0
        if self.kind == "exponential":
            return self.sigma_start * (self.sigma_end / self.sigma_start) ** u
        return self.sigma_start + (self.sigma_end - self.sigma_start) * _decay_fraction(self.kind, u, n)

    def sigma(self, step: int) -> float:
        return self.stage_sigma(self.stage(step))

    def stage_sigmas(self) -> list[float]:
        """Sigma of every stage, for logs and plots."""
        return [self.stage_sigma(k) for k in range(self.num_stages)]

    def starts_noisy_stage(self, step: int) -> bool:
        """Whether ``step`` is the first step of a noisy stage (where the trainer measures the noise's
        effect). Steps past ``total_steps`` stay in the last stage and start none."""
        stage = self.stage(step)
        first = step == 0 or self.stage(step - 1) != stage
        return first and self.stage_sigma(stage) > 0

    def calibrate(self, sigma_start: float) -> None:
        """Start the decay at ``sigma_start`` (found by a calibration) and scale ``sigma_end`` by the same
        factor: the ratio sigma_end / sigma_start, hence the shape of the schedule, is kept."""
        sigma_end = sigma_start * (self.sigma_end / self.sigma_start)
        aqn_sigmas("aqn", sigma_start, sigma_end, self.kind)  # before the schedule changes
        self.sigma_end, self.sigma_start = sigma_end, sigma_start
        self.calibrated = True
        self._validate()

    def state_dict(self) -> dict[str, Any]:
        # The schedule is a pure function of its settings and the step, so its settings are its state;
        # saving them lets --resume continue on the schedule the run started with.
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - set(asdict(self))
        if unknown:
            raise QerlError(f"AQN state has unknown keys {sorted(unknown)}; was it saved by another version?")
        for key, value in state.items():
            setattr(self, key, value)
        self._validate()

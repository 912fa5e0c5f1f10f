"""Per-step training curves smoothed the one way both the ablation's table (``compare.summary``)
and its plot (``compare.plot``) read them: a trailing mean over a window of 10% of the steps."""

from __future__ import annotations

import math

EARLY_FRACTION = 0.2
FINAL_FRACTION = 0.1


def window(steps: int, fraction: float) -> int:
    """``fraction`` of ``steps``, rounded up, at least one step."""
    return max(1, math.ceil(steps * fraction))


def trailing_mean(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out

"""The unit of data every stage shares: a math problem with its gold answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    # Stable id within its dataset (index or the dataset's own id): used for paired comparisons,
    # resume positions and sample files.
    id: str
    question: str
    # Gold answer as a string math-verify can parse ("72", "\\frac{1}{2}", "$x^2$").
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)

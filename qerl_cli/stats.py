"""Plain-Python statistics over lists of figures (no torch), for every layer: the one mean helper.

Callers differ in what the mean of nothing is (NaN in a step's metrics, 0.0 for a reward mean, None
for a missing figure of a report), so :func:`mean` takes it as ``empty``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar, overload

_Empty = TypeVar("_Empty")


@overload
def mean(values: Sequence[float]) -> float: ...
@overload
def mean(values: Sequence[float], *, empty: _Empty) -> float | _Empty: ...
def mean(values: Sequence[float], *, empty: object = math.nan) -> object:
    """The arithmetic mean of ``values``; ``empty`` (NaN unless given) when there are none."""
    return sum(values) / len(values) if values else empty


def present(values: Iterable[float | None]) -> list[float]:
    """The figures that were measured: None and NaN (a missing figure) left out."""
    return [v for v in values if v is not None and not math.isnan(v)]

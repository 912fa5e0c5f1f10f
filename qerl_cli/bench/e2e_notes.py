"""The notes on the e2e table (and the host-bound line of the rollout table too), what its rows' medians
cannot say on their own: the most any rollout
speed-up could buy each row, whether its rollouts kept the GPU busy (the mean GPU utilization of the
readings :mod:`qerl_cli.bench.gpusampler` took while the trainer generated), and how far its rollout
speed moved between its timed steps. The row's per-step fields (:func:`step_rate_fields`, written by
:func:`qerl_cli.bench.e2e.measure_pair`), and the columns and lines :mod:`qerl_cli.bench.report` shows.
This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qerl_cli.bench.gpusampler import row_rollout_busy_pct
from qerl_cli.bench.labels import e2e_label

ROLLOUT_BUSY_COLUMN = "rollout GPU busy %"
STEP_RATES_COLUMN = "rollout tok/s per step"
# A row's rollout tokens/s of each timed step, in order, and their spread (highest over lowest, less 1).
RATES_KEY = "rollout_tokens_per_s_steps"
SPREAD_KEY = "rollout_tokens_per_s_spread"
# Below this busy share while generating (the readings' mean: gpusampler.PhaseClocks.busy_pct), a row's
# rollouts left the GPU idle part of the time, waiting on the host (scheduling, sampling, detokenising,
# the launches between kernels), so their tokens/s measure the host as much as the kernels. Work that
# keeps the GPU fed reads close to 100% (an update's GEMMs did, benchmarks/h200-2026-11-29-grpo-step-rerun);
# 80 leaves room for the coarseness of nvidia-smi's utilization without calling such a rollout host-bound.
HOST_BOUND_BUSY_PCT = 80.0
# A row whose timed steps' rollout tokens/s differ by more than this (highest over lowest, less 1) is
# named below the table: the step ratios between rows are often a few tens of percent, and a spread of
# this size within one row, in one process, is of their order, so a ratio inside it is not a verdict.
STEP_SPREAD_FRACTION = 0.10


def rate_spread(rates: Sequence[float]) -> float | None:
    """Highest over lowest, less 1; None under two rates or with one of 0 (a step that generated nothing)."""
    if len(rates) < 2 or min(rates) <= 0:
        return None
    return max(rates) / min(rates) - 1


def step_rate_fields(timed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A row's RATES_KEY and SPREAD_KEY, from its timed steps' records (``rollout_tokens_per_s``)."""
    rates = [float(r["rollout_tokens_per_s"]) for r in timed if "rollout_tokens_per_s" in r]
    return {RATES_KEY: rates, SPREAD_KEY: rate_spread(rates)}


def row_step_rates(row: Mapping[str, Any]) -> list[float]:
    """A row's RATES_KEY; for a row from before it, the same from its ``steps`` (every step's figures,
    the warm-up first, then its ``steps_timed`` timed ones); empty where neither has them."""
    if RATES_KEY in row:
        return [float(rate) for rate in row[RATES_KEY]]
    timed = row.get("steps_timed") or 0
    return step_rate_fields((row.get("steps") or [])[-timed:] if timed else [])[RATES_KEY]


def _rates_cell(row: Mapping[str, Any]) -> str:
    rates = row_step_rates(row)
    return " / ".join(f"{rate:.0f}" for rate in rates) if rates else "-"


def caveat_columns(rows: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The columns some row has a figure for (a report from before them has none, and shows neither)."""
    rates = any(row_step_rates(r) for r in rows)
    return (*((ROLLOUT_BUSY_COLUMN,) if has_busy(rows) else ()), *((STEP_RATES_COLUMN,) if rates else ()))


def has_busy(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any row has a GPU busy share while generating (rows of earlier versions have none)."""
    return any(row_rollout_busy_pct(r) is not None for r in rows)


def busy_cell(row: Mapping[str, Any]) -> str:
    """The row's ROLLOUT_BUSY_COLUMN cell (an e2e or a rollout row), ``-`` without a figure."""
    busy = row_rollout_busy_pct(row)
    return "-" if busy is None else f"{busy:.0f}"


def caveat_cells(row: Mapping[str, Any], columns: tuple[str, ...]) -> tuple[str, ...]:
    """The row's cells of ``columns`` (:func:`caveat_columns`), ``-`` where it has no figure."""
    cells = {ROLLOUT_BUSY_COLUMN: busy_cell(row), STEP_RATES_COLUMN: _rates_cell(row)}
    return tuple(cells[column] for column in columns)


def host_bound_line(
    rows: Sequence[Mapping[str, Any]], label: Callable[[Any], str] = e2e_label, table: str = ""
) -> str | None:
    """The rows (of the e2e table, or of the rollout table, named with ``table``) whose rollouts kept the
    GPU busy less than HOST_BOUND_BUSY_PCT, or None. A rollout row's tok/s and its share of the roofline
    are then the host's limit as much as the kernels': what a kernel comparison must not read past."""
    parts = _flagged(
        rows,
        row_rollout_busy_pct,
        lambda busy: busy < HOST_BOUND_BUSY_PCT,
        lambda r, busy: f"{label(r)} {busy:.0f}%",
    )
    if parts is None:
        return None
    return (
        f"Host-bound rollouts{table} (GPU busy below {HOST_BOUND_BUSY_PCT:.0f}% while generating): {parts}. "
        "These rows' rollouts left the GPU idle part of the time, waiting on the host, so their rollout "
        "speed is not the kernels' alone."
    )


def _flagged(
    rows: Sequence[Mapping[str, Any]],
    figure: Callable[[Any], float | None],
    flag: Callable[[float], bool],
    describe: Callable[[Any, float], str],
) -> str | None:
    """The rows with a ``figure`` that ``flag`` picks, each described with it and joined by "; "; None
    where no row is picked (a row without the figure is not)."""
    found = [describe(r, value) for r in rows if (value := figure(r)) is not None and flag(value)]
    return "; ".join(found) if found else None


def _spread(row: Mapping[str, Any]) -> float | None:
    """The row's stored spread; a row from before it was stored, from its steps' rates."""
    stored = row.get(SPREAD_KEY)
    return stored if stored is not None else rate_spread(row_step_rates(row))


def rollout_ceiling_line(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """Each e2e row's step were generation free, against BF16 + vLLM-LoRA's step: the ceiling of any
    rollout speed-up (None without rows or without that reference: ``bench.report.add_speedups``)."""
    rows = [r for r in rows if r.get("rollout_ceiling_vs_bf16") is not None]
    if not rows:
        return None
    parts = [f"{e2e_label(r)} {r['step_without_generation_s']:.1f} s "
             f"({r['rollout_ceiling_vs_bf16']:.2f}x BF16 + LoRA's step)" for r in rows]  # fmt: skip
    return "Were generation free (the ceiling of any rollout speed-up): " + "; ".join(parts) + "."


def step_spread_line(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The rows whose rollout tokens/s varied between timed steps by more than STEP_SPREAD_FRACTION
    (none: None)."""
    parts = _flagged(
        rows,
        _spread,
        lambda spread: spread > STEP_SPREAD_FRACTION,
        lambda r, spread: f"{e2e_label(r)} {spread:.0%} ({_rates_cell(r)} tok/s)",
    )
    if parts is None:
        return None
    return (
        f"Rollout speed varied between timed steps by more than {STEP_SPREAD_FRACTION:.0%}: {parts}. "
        "Step ratios within that spread are not a verdict: more timed steps (--set repeats=N) or repeated "
        "runs would be needed."
    )

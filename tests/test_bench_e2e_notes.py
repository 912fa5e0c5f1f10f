"""The notes on the e2e table (``bench.e2e_notes``): each timed step's rollout tokens/s and their spread
on a row, the "rollout GPU busy %" and "rollout tok/s per step" columns, the lines naming host-bound
rollouts and rows whose rollout speed moved between steps, and reports from before these fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from qerl_cli.bench.e2e_notes import (
    HOST_BOUND_BUSY_PCT,
    RATES_KEY,
    ROLLOUT_BUSY_COLUMN,
    SPREAD_KEY,
    STEP_RATES_COLUMN,
    STEP_SPREAD_FRACTION,
    host_bound_line,
    rate_spread,
    step_rate_fields,
    step_spread_line,
)
from qerl_cli.bench.gpusampler import ROW_KEY, CaseClocks, PhaseClocks
from qerl_cli.bench.report import SM_CLOCK_COLUMN, bench_table, e2e_columns, to_markdown
from qerl_cli.bench.result import SCHEMA, BenchResult, read_report, write_json
from qerl_cli.rl.phase import ROLLOUT, UPDATE

SETTINGS = {"model": "tiny", "engine": "vllm", "prompt_len": 8, "gen_len": 8, "repeats": 2,
            "formats": ["bf16", "nvfp4"], "one_engine_per_format": True, "e2e_shape": None}  # fmt: skip


def clocks(rollout_busy: float | None) -> dict[str, Any]:
    """A row's gpu_clocks: a busy median of 1755 MHz, and the rollout phase's readings where given."""
    phases = {UPDATE: PhaseClocks(3, 100.0, 1650.0, 699.0)}
    if rollout_busy is not None:
        phases[ROLLOUT] = PhaseClocks(4, rollout_busy, 1980.0, 380.0)
    return CaseClocks(7, 7, 1755.0, 1650, 70, 699.0, ["sw_power_cap"], phases=phases).to_dict()


def e2e_row(fmt: str, backend: str, rates: list[float] | None, rollout_busy: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"format": fmt, "backend": backend, "step_s": 30.0, "step_vs_bf16": 1.0}
    if rates is not None:  # a row of this version: its steps' rates, and the clocks of each phase
        row.update({RATES_KEY: rates, SPREAD_KEY: rate_spread(rates), ROW_KEY: clocks(rollout_busy)})
    return row


def bench(e2e: list[dict[str, Any]]) -> BenchResult:
    return BenchResult(schema=SCHEMA, created="2026-11-29T00:00:00+00:00", device="gpu",
                       figures_label="GPU figures", machine={"cpu_count": 64}, gpu=None, versions={},
                       settings=dict(SETTINGS), rollout=[], e2e=e2e)  # fmt: skip


def terminal(result: BenchResult) -> str:
    console = Console(record=True, width=500)
    console.print(bench_table(result))
    return console.export_text()


def measured() -> BenchResult:
    return bench([
        e2e_row("bf16", "default", [8057.0, 5621.0], rollout_busy=62.0),  # host-bound, and 43% apart
        e2e_row("nvfp4", "fp8", [7000.0, 7100.0], rollout_busy=93.0),  # busy, and 1.4% apart
        e2e_row("nvfp4", "marlin", [6000.0, 6900.0], rollout_busy=None),  # 15% apart; no rollout reading
    ])  # fmt: skip


# --------------------------------------------------------------------------------------------
# The row's fields
# --------------------------------------------------------------------------------------------
def test_a_row_keeps_every_timed_steps_rollout_speed_and_their_spread() -> None:
    timed = [{"time_step_s": 30.0, "rollout_tokens_per_s": 8057.0}, {"rollout_tokens_per_s": 5621.0}]
    fields = step_rate_fields(timed)
    assert fields[RATES_KEY] == [8057.0, 5621.0]
    assert fields[SPREAD_KEY] == pytest.approx(8057 / 5621 - 1)
    # One step, or one that generated nothing, has no spread.
    assert step_rate_fields(timed[:1]) == {RATES_KEY: [8057.0], SPREAD_KEY: None}
    assert rate_spread([0.0, 100.0]) is None and rate_spread([]) is None


# --------------------------------------------------------------------------------------------
# The table and the lines under it
# --------------------------------------------------------------------------------------------
def test_the_e2e_table_shows_each_rows_rollout_busy_share_and_steps_rates() -> None:
    result = measured()
    assert e2e_columns(result)[-3:] == (SM_CLOCK_COLUMN, ROLLOUT_BUSY_COLUMN, STEP_RATES_COLUMN)
    markdown = to_markdown(result)
    assert "| 30.00 | 1.00 | 1755 | 62 | 8057 / 5621 |" in markdown
    assert "| 30.00 | 1.00 | 1755 | 93 | 7000 / 7100 |" in markdown
    assert "| 30.00 | 1.00 | 1755 | - | 6000 / 6900 |" in markdown
    assert ROLLOUT_BUSY_COLUMN in terminal(result) and STEP_RATES_COLUMN in terminal(result)


def test_host_bound_rollouts_and_a_wide_step_spread_are_named_under_the_table() -> None:
    result = measured()
    host_bound = host_bound_line(result.e2e or [])
    spread = step_spread_line(result.e2e or [])
    assert host_bound is not None and spread is not None
    assert host_bound.startswith(f"Host-bound rollouts (GPU busy below {HOST_BOUND_BUSY_PCT:.0f}%")
    assert "bf16 / default 62%" in host_bound and "nvfp4" not in host_bound  # 93% busy: GPU-bound
    assert "not the kernels' alone" in host_bound
    assert f"by more than {STEP_SPREAD_FRACTION:.0%}: " in spread
    assert "bf16 / default 43% (8057 / 5621 tok/s); nvfp4 / marlin 15% (6000 / 6900 tok/s)." in spread
    assert "nvfp4 / fp8" not in spread and "not a verdict" in spread
    for rendering in (to_markdown(result), terminal(result)):
        assert host_bound in rendering and spread in rendering


def test_rows_within_the_bounds_get_no_line() -> None:
    calm = bench([e2e_row("bf16", "default", [7000.0, 7500.0], rollout_busy=85.0)])
    assert host_bound_line(calm.e2e or []) is None and step_spread_line(calm.e2e or []) is None
    markdown = to_markdown(calm)
    assert "Host-bound" not in markdown and "varied between timed steps" not in markdown
    assert "| 85 | 7000 / 7500 |" in markdown


def test_a_report_from_before_these_fields_renders_without_them(tmp_path: Path) -> None:
    old = bench([e2e_row("bf16", "default", None, None), e2e_row("nvfp4", "marlin", None, None)])
    (tmp_path / "bench.json").write_text(json.dumps(old.to_dict()))
    read = read_report(tmp_path)
    markdown = to_markdown(read)
    assert "| bf16 | default |" in markdown
    for absent in (ROLLOUT_BUSY_COLUMN, STEP_RATES_COLUMN, "Host-bound", "varied between timed steps"):
        assert absent not in markdown and absent not in terminal(read)
    # A row from before the field whose steps kept their figures: its timed ones (the last steps_timed).
    steps = [{"time_step_s": 40.0, "rollout_tokens_per_s": 3000.0}]  # the warm-up
    steps += [{"time_step_s": 30.0, "rollout_tokens_per_s": rate} for rate in (8057.0, 5621.0)]
    earlier = to_markdown(
        bench([{**e2e_row("bf16", "default", None, None), "steps": steps, "steps_timed": 2}])
    )
    assert "| 30.00 | 1.00 | 8057 / 5621 |" in earlier and "bf16 / default 43% (8057 / 5621 tok/s)" in earlier
    assert ROLLOUT_BUSY_COLUMN not in earlier and "Host-bound" not in earlier
    # Beside a row of this version, an old one shows dashes.
    mixed = to_markdown(bench([*(measured().e2e or []), e2e_row("nvfp4", "humming", None, None)]))
    assert "| nvfp4 | humming | - | - | - | - | - | - | - | - | - | 30.00 | 1.00 | - | - | - |" in mixed


def test_the_new_fields_survive_the_json(tmp_path: Path) -> None:
    result = measured()
    write_json(result, tmp_path)
    again = read_report(tmp_path)
    assert again == result and to_markdown(again) == to_markdown(result)
    row = (again.e2e or [])[0]
    assert row[RATES_KEY] == [8057.0, 5621.0]
    assert CaseClocks.from_dict(row[ROW_KEY]).phases[ROLLOUT] == PhaseClocks(4, 62.0, 1980.0, 380.0)

"""The rollout table's "vs BF16 merged" column: each row against BF16 with the LoRA merged (the fastest BF16
rollout, which a 4-bit rollout has to beat), read from the committed idle H200 sweep."""

from __future__ import annotations

from pathlib import Path

from qerl_cli.bench.charts import throughput_series
from qerl_cli.bench.report import add_speedups, memory_rows, rollout_columns, rollout_rows
from qerl_cli.bench.result import read_report

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "h200-2026-11-28-rollout-idle"


def rows_by_label(path: Path) -> tuple[tuple[str, ...], dict[tuple[str, str, str], dict[str, str]]]:
    report = read_report(path)
    add_speedups(report)
    columns = rollout_columns(report)
    return columns, {row[:3]: dict(zip(columns, row, strict=True)) for row in rollout_rows(report)}


def test_a_sweep_with_bf16_merged_shows_each_row_against_it() -> None:
    columns, rows = rows_by_label(RUN / "concurrency-tuned-configs.json")
    assert columns.index("vs BF16 merged") == columns.index("vs BF16") + 1
    # The NVFP4 base's merged copy at 128 sequences against BF16 merged, both with the LoRA.
    assert rows[("nvfp4 / merged", "r16", "128")]["vs BF16 merged"] == "1.03x"
    assert rows[("nvfp4", "r16", "128")]["vs BF16 merged"] == "0.78x"  # Marlin + LoRA
    assert rows[("nvfp4", "r16", "128")]["vs BF16"] == "0.93x"  # against BF16 + vLLM's LoRA
    assert rows[("bf16 / merged", "r16", "8")]["vs BF16 merged"] == "1.00x"


def test_a_sweep_without_bf16_merged_has_no_such_column() -> None:
    columns, rows = rows_by_label(RUN / "concurrency-default-configs.json")
    assert "vs BF16 merged" not in columns
    assert all(len(row) == len(columns) for row in rows.values())


def test_each_backend_of_a_format_keeps_its_own_memory_row_and_chart_bars() -> None:
    """A sweep measures one format on several backends: the NVFP4 base on Marlin (5.9 GB of weights) and its
    merged BF16 copy (15.2 GB). The memory table and the throughput chart named both "nvfp4", and the
    chart's bars kept whichever row came last."""
    report = read_report(RUN.parent / "h200-2026-11-29-detokenizer-off" / "sweep.json")
    weights = {(row[0], row[1]): row[2] for row in memory_rows(report)}
    assert weights[("nvfp4", "r16")] == "5.86 GB" and weights[("nvfp4 / merged", "r16")] == "15.24 GB"
    assert len(weights) == len(report.memory)  # no two rows share a label
    series = throughput_series(report.rollout)
    rounded = {label: {b: round(v, 1) for b, v in bars.items()} for label, bars in series.items()}
    assert rounded["nvfp4 LoRA r16"] == {8: 1433.2, 128: 8889.1}  # Marlin + LoRA
    assert rounded["nvfp4 / merged LoRA r16"] == {8: 1321.4, 128: 13404.6}
    assert len(series) == 8 and list(series)[:4] == [
        "bf16 LoRA none", "bf16 / merged LoRA none", "nvfp4 LoRA none", "nvfp4 / merged LoRA none"
    ]  # fmt: skip

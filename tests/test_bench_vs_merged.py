"""The rollout table's "vs BF16 merged" column: each row against BF16 with the LoRA merged (the fastest BF16
rollout, which a 4-bit rollout has to beat), read from the committed idle H200 sweep."""

from __future__ import annotations

from pathlib import Path

from qerl_cli.bench.report import add_speedups, rollout_columns, rollout_rows
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

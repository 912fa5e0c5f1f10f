"""What the commands print that no stage renders itself: the training summary, the bench's closing
lines, the environment and the model aliases. (Each stage renders its own result: ``eval_table``,
``bench_table``, ``quantize_table``, ``compare_table``.)"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from qerl_cli.cli.app import console, err_console

if TYPE_CHECKING:  # the stages are imported inside the commands: `qerl --help` stays fast
    from qerl_cli.bench.result import BenchFiles, BenchResult
    from qerl_cli.rl.result import TrainResult


def train_summary(result: TrainResult) -> Table:
    table = Table(title="qerl train", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = [
        ("steps", result.steps),
        ("resumed from", result.resumed_from or "-"),
        (f"mean reward, first {result.reward_window_label}", result.reward_first10),
        (f"mean reward, last {result.reward_window_label}", result.reward_last10),
        ("adapter", result.adapter),
        ("outputs", result.output_dir),
        ("plot", result.plot or "-"),
    ]
    if result.nonfinite_steps:  # the row only when it happened: a clean run's table stays as it was
        rows.insert(1, ("steps skipped (NaN/inf loss or gradients)", result.nonfinite_steps))
    for label, value in rows:
        table.add_row(label, f"{value:.3f}" if isinstance(value, float) else escape(str(value)))
    return table


def print_bench(report: BenchResult) -> bool:
    """The bench's tables, wall clock, failed cases and regressions; returns True when the command
    must exit 1 (a case without figures, or a metric that regressed past ``--baseline``)."""
    from qerl_cli.bench import bench_table, failed_cases, gate_failures, wall_clock_line

    console.print(bench_table(report))
    console.print(wall_clock_line(report))
    if report.files is not None:  # where the report went, as `qerl bench kernels` / `update` say it
        console.print(escape(_written(report.files)), highlight=False, soft_wrap=True)  # a path stays whole
    failed = failed_cases(report)
    for line in failed:  # a case without figures (vLLM cannot serve a format, OOM at wake-up, ...)
        err_console.print(f"[red]failed[/red]: {escape(line)}")
    failures = gate_failures(report)
    if failures:  # --baseline regression gate: CI fails, naming each metric that regressed
        for line in failures:
            err_console.print(f"[red]regression[/red]: {escape(line)}")
    return bool(failures or failed)


def _written(written: BenchFiles) -> str:
    """``wrote bench_results/bench.json (and bench.md, throughput.png, ...)``: the others sit beside it."""
    others = [Path(name).name for name in (written.markdown, *written.charts, written.crossover) if name]
    return f"wrote {written.json}" + (f" (and {', '.join(others)} beside it)" if others else "")


def env_table(info: dict[str, Any]) -> Table:
    table = Table(title="qerl environment", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key in ("qerl", "python", "platform", "torch_cuda"):
        table.add_row(key, str(info[key]))
    for name, version in info["packages"].items():
        table.add_row(name, version or "[dim]not installed[/dim]")
    if not info["gpus"]:
        table.add_row("GPUs", "[dim]none (CPU only)[/dim]")
    for gpu in info["gpus"]:
        table.add_row(
            f"GPU {gpu['index']}",
            f"{gpu['name']}, {gpu['memory_gib']} GiB, compute capability {gpu['compute_capability']}",
        )
    return table


def print_models(rows: list[dict[str, Any]]) -> None:
    table = Table(title="qerl models (every command taking a model accepts an alias, a .gguf or a folder)")
    # The alias is what a user copies: never wrapped; the other columns give way (fold long tokens).
    table.add_column("alias", no_wrap=True, min_width=max((len(row["alias"]) for row in rows), default=5))
    for column in ("description", "get it", "status"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["alias"], row["description"], row["get_it"], row["status"])
    console.print(table)
    for row in rows:
        # One folder a line: a log keeps each path whole and the list stays readable at any width.
        folders = "".join(f"\n  {escape(folder)}" for folder in row["looks_in"])
        console.print(f"[dim]{row['alias']} is looked for in:{folders}[/dim]")

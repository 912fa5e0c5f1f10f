"""Bench renderings: the rich table, ``bench.md`` and the wall-clock line, and the figures derived from
a report's rows (speed-ups, e2e step-time ratios). The report itself is
:class:`~qerl_cli.bench.result.BenchResult`; the regression gate is ``bench.gate``, the charts
``bench.charts``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from qerl_cli import files
from qerl_cli.bench.concurrency import ROOFLINE_COLUMNS, roofline_rows
from qerl_cli.bench.e2e_backends import REFERENCE_FORMAT, FoldedBackend
from qerl_cli.bench.e2e_notes import (
    ROLLOUT_BUSY_COLUMN,
    busy_cell,
    caveat_cells,
    caveat_columns,
    has_busy,
    host_bound_line,
    rollout_ceiling_line,
    step_spread_line,
)
from qerl_cli.bench.gate import gate_caveat
from qerl_cli.bench.gpusampler import row_sm_mhz
from qerl_cli.bench.labels import (
    e2e_backend_label,
    e2e_label,
    format_label,
    lora_label,
    rollout_label,
    row_backend,
)
from qerl_cli.bench.report_host import busy_line, gpu_clocks_line, host_load_line, machine_line
from qerl_cli.bench.result import BenchResult
from qerl_cli.rollout.backends import DENSE_MERGED

MARKDOWN_NAME = "bench.md"
# The parts of a step in bench e2e's rows (bench.e2e.PHASE_METRICS, then "other_s"); they add up to step_s.
E2E_PHASES = ("aqn_s", "generation_s", "reward_s", "sleep_s", "logprobs_s", "update_s", "wake_s", "sync_s",
              "other_s")  # fmt: skip


# --------------------------------------------------------------------------------------------
# Derived figures
# --------------------------------------------------------------------------------------------
def _key(row: dict[str, Any], *fields: str) -> tuple:
    return tuple(row.get(f) for f in fields)


def _rollout_speedups(report: BenchResult, field: str, backend: str) -> None:
    """``field`` on every rollout row: its tokens/s over BF16's on ``backend`` at the same LoRA rank and
    batch in this run (None without that row)."""
    reference = {
        _key(r, "lora_rank", "batch"): r
        for r in report.rollout
        if r["format"] == REFERENCE_FORMAT and r.get("backend", "default") == backend
    }
    for row in report.rollout:
        ref = reference.get(_key(row, "lora_rank", "batch"))
        row[field] = (
            row["output_tokens_per_s"] / ref["output_tokens_per_s"]
            if ref and ref.get("output_tokens_per_s")
            else None
        )


def add_speedups(report: BenchResult) -> None:
    """``speedup_vs_bf16`` on every rollout and e2e row, and ``speedup_vs_bf16_merged`` on every rollout
    row where the run measured BF16 with the LoRA merged (the fastest BF16 rollout a 4-bit one must beat):
    ratios within this one run only."""
    _rollout_speedups(report, "speedup_vs_bf16", "default")
    _rollout_speedups(report, "speedup_vs_bf16_merged", DENSE_MERGED)
    e2e = [r for r in report.e2e or [] if "error" not in r]
    reference = e2e_reference(e2e)
    ref_step = reference.get("step_s") if reference else None
    for row in e2e:
        step = row.get("step_s")
        row["speedup_vs_bf16"] = ref_step / step if ref_step and step else None
        # The step time against BF16 + vLLM-LoRA's (below 1: a shorter step).
        row["step_vs_bf16"] = step / ref_step if ref_step and step else None
        # What the step would take were generation free, and BF16 + vLLM-LoRA's step over that: the
        # most any rollout kernel or backend could buy this row, the update and syncs being what they are.
        generation = row.get("generation_s")
        rest = step - generation if step and generation is not None else None
        row["step_without_generation_s"] = rest
        row["rollout_ceiling_vs_bf16"] = ref_step / rest if ref_step and rest else None


# The backends a BF16 base runs on its own BF16 GEMMs with the LoRA served beside them: vLLM's default
# (asked for as such, or what auto chose) and the HF engine's trainer layers.
BF16_OWN_GEMMS = ("default", "trainer")


def e2e_reference(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The e2e row every step time is set against: BF16 on its own GEMMs with the LoRA served by the
    engine (vLLM's ``default``; the HF engine's layers), the pair asked for as ``default`` before one
    that ``auto`` resolved to it; None when the run has no such row."""
    bf16 = [r for r in rows if r["format"] == REFERENCE_FORMAT and "error" not in r]
    asked = [r for r in bf16 if row_backend(r) == "default"]
    ran = [r for r in bf16 if r.get("linear_backend", "default") in BF16_OWN_GEMMS]
    return next(iter(asked + ran), None)


# --------------------------------------------------------------------------------------------
# Human-readable renderings
# --------------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _bytes(value: Any) -> str:
    if value is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def _speedup(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}x"


ROLLOUT_COLUMNS = ("format", "LoRA", "batch", "output tok/s", "vs BF16", "prefill tok/s", "decode ms/tok")
MEMORY_COLUMNS = ("format", "LoRA", "weights", "peak allocated", "peak reserved", "KV cache", "measured by")
E2E_COLUMNS = ("format", "backend", "AQN s", "generation s", "reward s", "sleep s", "logprobs s", "update s",
               "wake s", "sync s", "other s", "step s", "step / BF16")  # fmt: skip


# The column of a row's SM clock under load (the busy median of bench.gpusampler's readings).
SM_CLOCK_COLUMN = "SM MHz"


def _has_merged_reference(report: BenchResult) -> bool:
    return any(r.get("speedup_vs_bf16_merged") is not None for r in report.rollout)


def _has_sm_clock(rows: list[dict[str, Any]]) -> bool:
    """Whether any row has its case's SM clock under load (rows of earlier versions have none)."""
    return any(row_sm_mhz(r) is not None for r in rows)


def _sm_clock_cell(row: dict[str, Any], shown: bool) -> tuple[str, ...]:
    return (_fmt(row_sm_mhz(row), ".0f"),) if shown else ()


def _busy_cell(row: dict[str, Any], shown: bool) -> tuple[str, ...]:
    return (busy_cell(row),) if shown else ()


def rollout_columns(report: BenchResult) -> tuple[str, ...]:
    """The rollout table's columns: with "vs BF16 merged" where the run measured BF16 merged, the SM clock
    and the GPU's busy share while generating where a row has them."""
    columns = ROLLOUT_COLUMNS
    if _has_merged_reference(report):
        at = ROLLOUT_COLUMNS.index("vs BF16") + 1
        columns = (*ROLLOUT_COLUMNS[:at], "vs BF16 merged", *ROLLOUT_COLUMNS[at:])
    clock, busy = _has_sm_clock(report.rollout), has_busy(report.rollout)
    return (*columns, *((SM_CLOCK_COLUMN,) if clock else ()), *((ROLLOUT_BUSY_COLUMN,) if busy else ()))


def rollout_rows(report: BenchResult) -> list[tuple[str, ...]]:
    merged, clock, busy = (
        _has_merged_reference(report),
        _has_sm_clock(report.rollout),
        has_busy(report.rollout),
    )
    return [
        (
            format_label(r),
            lora_label(r["lora_rank"]),
            str(r["batch"]),
            _fmt(r["output_tokens_per_s"]),
            _speedup(r.get("speedup_vs_bf16")),
            *((_speedup(r.get("speedup_vs_bf16_merged")),) if merged else ()),
            _fmt(r["prefill_tokens_per_s"]),
            _fmt(r["decode_ms_per_token"], ".2f"),
            *_sm_clock_cell(r, clock),
            *_busy_cell(r, busy),
        )
        for r in report.rollout
    ]


def memory_rows(report: BenchResult) -> list[tuple[str, ...]]:
    return [
        (
            format_label(r),  # a sweep holds one format on several backends (the merged copy's weights)
            lora_label(r["lora_rank"]),
            _bytes(r.get("weight_bytes")),
            _bytes(r.get("peak_allocated_bytes")),
            _bytes(r.get("peak_reserved_bytes")),
            _bytes(r.get("kv_cache_bytes")),
            str(r.get("method", "-")),
        )
        for r in report.memory
    ]


def _e2e_measured(report: BenchResult) -> list[dict[str, Any]]:
    return [r for r in report.e2e or [] if "error" not in r]


def e2e_columns(report: BenchResult) -> tuple[str, ...]:
    """The e2e table's columns: with the SM clock, the rollouts' GPU busy share and each timed step's
    rollout tokens/s where a row has them."""
    measured = _e2e_measured(report)
    clock = (SM_CLOCK_COLUMN,) if _has_sm_clock(measured) else ()
    return (*E2E_COLUMNS, *clock, *caveat_columns(measured))


def e2e_rows(report: BenchResult) -> list[tuple[str, ...]]:
    measured = _e2e_measured(report)
    clock, caveats = _has_sm_clock(measured), caveat_columns(measured)
    return [
        (
            r["format"],
            e2e_backend_label(r),
            *(_fmt(r.get(p), ".2f") for p in E2E_PHASES),
            _fmt(r.get("step_s"), ".2f"),
            _fmt(r.get("step_vs_bf16"), ".2f"),
            *_sm_clock_cell(r, clock),
            *caveat_cells(r, caveats),
        )
        for r in measured
    ]


def folded_line(report: BenchResult) -> str | None:
    """The e2e backends folded into the name their format serves them under (run once), or None."""
    folded = report.settings.get("e2e_folded") or []
    if not folded:
        return None
    pairs = "; ".join(FoldedBackend(**f).line() for f in folded)
    return f"Backends folded (each run once, under the name its format serves it): {pairs}."


def notes(report: BenchResult) -> list[str]:
    """The lines under the tables, in both renderings: the rollout rows whose GPU waited on the host, the
    folded backends, then what the e2e rows' figures can and cannot say (the rollout ceiling, host-bound
    rollouts, the steps' spread)."""
    measured = _e2e_measured(report)
    rollout_rows = host_bound_line(report.rollout, rollout_label, " in the rollout table")
    lines = (rollout_rows, folded_line(report), rollout_ceiling_line(measured), host_bound_line(measured),
             step_spread_line(measured))  # fmt: skip
    return [line for line in lines if line]


def failed_cases(report: BenchResult) -> list[str]:
    """Cases that produced no figures, each with why (e.g. a format vLLM cannot serve here)."""
    lines = [f"{e['format']} LoRA {lora_label(e['lora_rank'])}: {e['error']}" for e in report.errors]
    lines += [f"e2e {e2e_label(r)}: {r['error']}" for r in report.e2e or [] if "error" in r]
    return lines


def _tables(report: BenchResult) -> list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]]:
    """(title, columns, rows) of every table, for both the terminal and the Markdown rendering."""

    return [
        ("Rollout throughput", rollout_columns(report), rollout_rows(report)),
        ("Rollout against the GPU's roofline", ROOFLINE_COLUMNS, roofline_rows(report)),
        ("Memory", MEMORY_COLUMNS, memory_rows(report)),
        ("End-to-end GRPO step (seconds)", e2e_columns(report), e2e_rows(report)),
    ]


def _title(report: BenchResult) -> str:
    s = report.settings
    return (
        f"qerl bench: {s['model']} on {s['engine']}, prompt {s['prompt_len']} / gen {s['gen_len']} tokens, "
        f"median of {s['repeats']}"
    )


def bench_table(report: BenchResult):  # -> rich.console.Group
    """Rich renderable: rollout, memory, e2e tables and the regression outcome."""

    parts: list[Any] = [Text(_title(report), style="bold"), Text(report.figures_label, style="yellow")]
    busy = busy_line(report)
    if busy:
        parts.append(Text(busy, style="bold yellow"))
    clocks = gpu_clocks_line(report.host_load)
    if clocks:
        parts.append(Text(clocks[0], style="bold yellow" if clocks[1] else ""))
    for title, columns, rows in _tables(report):
        if not rows:
            continue
        table = Table(title=title, title_justify="left")
        for i, column in enumerate(columns):
            table.add_column(column, justify="left" if i < 2 else "right")
        for row in rows:
            table.add_row(*row)
        parts.append(table)
    parts.extend(Text(line) for line in notes(report))
    failed = failed_cases(report)
    if failed:
        parts.append(Text("Cases without figures:", style="bold red"))
        parts.extend(Text(f"  {line}", style="red") for line in failed)
    regression = report.regression
    if regression:
        if regression.passed:
            passed = f"Regression gate passed ({regression.compared} figures compared)."
            parts.append(Text(passed, style="green"))
        else:
            parts.append(Text("Regression gate FAILED:", style="bold red"))
            parts.extend(Text(f"  {f}", style="red") for f in regression.failures)
    caveat = gate_caveat(report)
    if caveat:
        parts.append(Text(f"Warning: {caveat}", style="yellow"))
    return Group(*parts)


def _markdown_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return [*lines, ""]


def to_markdown(report: BenchResult) -> str:
    gpu = report.gpu
    versions = report.versions
    busy, host = busy_line(report), host_load_line(report.host_load)
    clocks = gpu_clocks_line(report.host_load)
    # A throttled GPU's warning stands at the top beside a busy host's; a summary beside the Host line.
    throttled, summary = (clocks[0], None) if clocks and clocks[1] else (None, clocks and clocks[0])
    lines = [
        f"## {_title(report)}",
        "",
        f"**{report.figures_label}**",
        "",
        *([f"**{busy}**", ""] if busy else []),
        *([f"**{throttled}**", ""] if throttled else []),
        f"Machine: {machine_line(report.machine)}"
        + (f", GPU: {gpu['name']} x{gpu['count']}, CUDA {gpu['cuda']}" if gpu else ", no GPU")
        + (f", driver {gpu['driver']}" if gpu and gpu.get("driver") else ""),
        "",
        *([host, ""] if host else []),
        *([summary, ""] if summary else []),
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        "",
    ]
    for title, columns, rows in _tables(report):
        if rows:
            lines += [f"### {title}", "", *_markdown_table(columns, rows)]
    for line in (*notes(report), wall_clock_line(report)):
        if line:
            lines += [line, ""]
    failed = failed_cases(report)
    if failed:
        lines += ["Cases without figures:", *[f"- {line}" for line in failed], ""]
    regression = report.regression
    if regression:
        if regression.passed:
            lines.append(f"Regression gate: **passed** ({regression.compared} figures compared).")
        else:
            lines.append("Regression gate: **FAILED**")
            lines += [f"- {f}" for f in regression.failures]
        lines.append("")
    caveat = gate_caveat(report)
    if caveat:
        lines += [f"Warning: {caveat}", ""]
    return "\n".join(lines)


def wall_clock_line(report: BenchResult) -> str | None:
    """Where the command's time went (``timings``), for a CI budget; None for reports without it."""
    timings = report.timings
    if not timings:
        return None
    parts = [f"random checkpoints {timings.checkpoints_s:.0f} s"]
    parts += [f"{fmt} {seconds:.0f} s" for fmt, seconds in timings.formats_s.items()]
    if timings.e2e_s is not None:
        parts.append(f"e2e {timings.e2e_s:.0f} s")
    return f"Wall clock: {timings.total_s:.0f} s ({', '.join(parts)}; start-up and imports not included)."


def write_markdown(report: BenchResult, out_dir: str | Path) -> Path:
    """``bench.md`` in the output folder, appended to ``$GITHUB_STEP_SUMMARY`` when set (CI)."""
    text = to_markdown(report)
    path = Path(out_dir) / MARKDOWN_NAME
    path.write_text(text)
    files.append_step_summary(text)
    return path

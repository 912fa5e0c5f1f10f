"""Bench outputs: ``bench.json``, the rich table, Markdown and the regression gate (charts: ``charts.py``).

The report is a plain dict (what ``bench.json`` holds) so a baseline file read back from disk and a
fresh report are the same kind of object. Its layout (``SCHEMA``):

* ``machine``, ``gpu`` (None on CPU), ``versions``, ``settings``;
* ``device``: ``"gpu"`` or ``"cpu"`` and ``figures_label``, which says how far the figures can be
  trusted (CPU figures are only good for ratios between formats of the same run);
* ``rollout``: one row per (format, LoRA rank, batch) with throughput and latency;
* ``memory``: one row per (format, LoRA rank) with weight bytes, peaks, KV-cache budget and how
  they were measured;
* ``e2e``: one row per format with GRPO step seconds per phase (``None`` without ``--e2e``);
* ``regression``: the outcome of ``--baseline`` (``None`` without it);
* ``timings``: seconds of the whole measurement, of writing the random checkpoints, of each format
  (engine start and cases) and of ``--e2e``.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from qerl_cli import files
from qerl_cli.bench.labels import format_label, lora_label
from qerl_cli.envinfo import versions_of
from qerl_cli.errors import QerlError

SCHEMA = "qerl-bench/1"
REPORT_NAME = "bench.json"
MARKDOWN_NAME = "bench.md"
REFERENCE_FORMAT = "bf16"

# Metrics the regression gate watches: name -> +1 when higher is better, -1 when lower is better.
ROLLOUT_GATED = {"output_tokens_per_s": +1, "prefill_tokens_per_s": +1}
MEMORY_GATED = {"weight_bytes": -1, "peak_allocated_bytes": -1, "peak_reserved_bytes": -1}
E2E_GATED = {"step_s": -1}
# A baseline measured with other settings is not comparable; these must agree.
COMPARABLE_SETTINGS = ("model", "engine", "prompt_len", "gen_len", "one_engine_per_format", "e2e_shape")
E2E_PHASES = ("generation_s", "logprobs_s", "update_s", "sync_s")

_VERSIONED_PACKAGES = (
    "qerl", "torch", "transformers", "peft", "vllm", "compressed-tensors", "bitsandbytes", "triton",
)


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------
def package_versions() -> dict[str, str | None]:
    """Installed versions from package metadata (no imports: vLLM must stay unimported here)."""
    return {**versions_of(_VERSIONED_PACKAGES), "python": platform.python_version()}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        info["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        info["ram_bytes"] = None
    return info


def gpu_info() -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "memory_bytes": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "cuda": torch.version.cuda,
    }


def new_report(settings: dict[str, Any]) -> dict[str, Any]:
    """The report skeleton: environment and settings, no figures yet."""
    gpu = gpu_info()
    device = "gpu" if gpu else "cpu"
    label = (
        f"GPU figures ({gpu['name']})"
        if gpu
        else "CPU figures: only the ratios between formats of this run mean anything; absolute "
        "times say nothing about a GPU"
    )
    return {
        "schema": SCHEMA,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "figures_label": label,
        "machine": machine_info(),
        "gpu": gpu,
        "versions": package_versions(),
        "settings": settings,
        "rollout": [],
        "memory": [],
        "e2e": None,
        "regression": None,
    }


# --------------------------------------------------------------------------------------------
# Derived figures
# --------------------------------------------------------------------------------------------
def _key(row: dict[str, Any], *fields: str) -> tuple:
    return tuple(row.get(f) for f in fields)


def add_speedups(report: dict[str, Any]) -> None:
    """``speedup_vs_bf16`` on every rollout and e2e row: ratios within this one run only."""
    reference = {
        _key(r, "lora_rank", "batch"): r
        for r in report["rollout"]
        if r["format"] == REFERENCE_FORMAT and r.get("backend", "default") == "default"
    }
    for row in report["rollout"]:
        ref = reference.get(_key(row, "lora_rank", "batch"))
        row["speedup_vs_bf16"] = (
            row["output_tokens_per_s"] / ref["output_tokens_per_s"]
            if ref and ref.get("output_tokens_per_s")
            else None
        )
    e2e = [r for r in report.get("e2e") or [] if "error" not in r]
    ref_step = next((r["step_s"] for r in e2e if r["format"] == REFERENCE_FORMAT), None)
    for row in e2e:
        row["speedup_vs_bf16"] = ref_step / row["step_s"] if ref_step and row.get("step_s") else None


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------
def write_json(report: dict[str, Any], out_dir: str | Path) -> Path:
    return files.write_json(Path(out_dir) / REPORT_NAME, report)


def read_report(path: str | Path) -> dict[str, Any]:
    """Read a ``bench.json`` (the baseline of ``--baseline``), checking it is one."""
    data = files.read_json_report(path, REPORT_NAME, "the bench.json of an earlier `qerl bench` run")
    if data.get("schema") != SCHEMA:
        raise QerlError(f"{path} is not a qerl bench report (expected schema {SCHEMA!r})")
    return data


# --------------------------------------------------------------------------------------------
# Regression gate
# --------------------------------------------------------------------------------------------
def _compare(
    section: str,
    new_rows: Iterable[dict[str, Any]],
    old_rows: Iterable[dict[str, Any]],
    key_fields: tuple[str, ...],
    gated: dict[str, int],
    tolerance: float,
) -> tuple[list[str], int]:
    old_by_key = {_key(r, *key_fields): r for r in old_rows}
    failures, compared = [], 0
    for row in new_rows:
        old = old_by_key.get(_key(row, *key_fields))
        if old is None:
            continue
        where = f"{section} " + " ".join(f"{f}={row.get(f)}" for f in key_fields)
        for metric, direction in gated.items():
            new_value, old_value = row.get(metric), old.get(metric)
            numbers = isinstance(new_value, int | float) and isinstance(old_value, int | float)
            if not numbers or old_value <= 0:
                continue
            compared += 1
            change = new_value / old_value - 1.0
            if direction > 0 and change < -tolerance:
                failures.append(
                    f"{where}: {metric} dropped {-change:.1%} ({new_value:.4g} vs baseline {old_value:.4g}, "
                    f"tolerance {tolerance:.0%})"
                )
            elif direction < 0 and change > tolerance:
                failures.append(
                    f"{where}: {metric} rose {change:.1%} ({new_value:.4g} vs baseline {old_value:.4g}, "
                    f"tolerance {tolerance:.0%})"
                )
    return failures, compared


def _lost_cases(report: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Cases the baseline measured that failed in this run: a format that stopped working is the
    worst regression, and without this its missing rows would simply not be compared."""
    failed_now = {(e["format"], e["lora_rank"]): e["error"] for e in report.get("errors") or []}
    rows_before = [*(baseline.get("rollout") or []), *(baseline.get("memory") or [])]
    measured_before = {(r["format"], r["lora_rank"]) for r in rows_before}
    lost = [
        f"{fmt} LoRA {lora_label(rank)}: measured in the baseline, failed now ({failed_now[fmt, rank]})"
        for fmt, rank in sorted(failed_now.keys() & measured_before)
    ]
    e2e_failed = {r["format"]: r["error"] for r in report.get("e2e") or [] if "error" in r}
    e2e_before = {r["format"] for r in baseline.get("e2e") or [] if "error" not in r}
    lost += [
        f"e2e {fmt}: measured in the baseline, failed now ({e2e_failed[fmt]})"
        for fmt in sorted(e2e_failed.keys() & e2e_before)
    ]
    return lost


def check_regressions(report: dict[str, Any], baseline: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """Compare a fresh report with a baseline; returns the ``regression`` section of the report.

    Throughput may not drop, and memory and step time may not rise, by more than ``tolerance``
    (a fraction). Raises ``QerlError`` when the two runs are not comparable at all, because a gate
    that silently compares nothing would always pass.
    """
    if tolerance < 0:
        raise QerlError(f"--tolerance must be >= 0 (a fraction, 0.1 = 10%), got {tolerance}")
    mismatched = [
        f"{name}: {baseline['settings'].get(name)!r} vs {report['settings'].get(name)!r}"
        for name in COMPARABLE_SETTINGS
        if baseline.get("settings", {}).get(name) != report["settings"].get(name)
    ]
    if baseline.get("device") != report["device"]:
        mismatched.append(f"device: {baseline.get('device')!r} vs {report['device']!r}")
    if mismatched:
        raise QerlError(
            "the baseline was measured with other settings (baseline vs now): "
            + "; ".join(mismatched)
            + ". Rerun the baseline with the same --model/--engine/--prompt-len/--gen-len (and e2e shape) "
            "on the same kind of machine and qerl version."
        )
    failures: list[str] = []
    compared = 0
    for section, key_fields, gated in (
        ("rollout", ("format", "lora_rank", "batch"), ROLLOUT_GATED),
        ("memory", ("format", "lora_rank"), MEMORY_GATED),
        ("e2e", ("format",), E2E_GATED),
    ):
        now, before = _gated_rows(report, section), _gated_rows(baseline, section)
        found, n = _compare(section, now, before, key_fields, gated, tolerance)
        failures.extend(found)
        compared += n
    lost = _lost_cases(report, baseline)
    failures.extend(lost)
    compared += len(lost)
    if compared == 0:
        raise QerlError(
            "the baseline shares no measurement with this run (other formats, batches or LoRA rank); "
            "run with the baseline's --formats and --batch"
        )
    return {"tolerance": tolerance, "compared": compared, "failures": failures, "passed": not failures}


def _gated_rows(report: dict[str, Any], section: str) -> list[dict[str, Any]]:
    """The rows the gate compares: each format on its default kernels (a --concurrency sweep's other
    backends are measurements, not a contract)."""
    return [r for r in report.get(section) or [] if r.get("backend") in (None, "default", "marlin")]


def gate_failures(report: dict[str, Any]) -> list[str]:
    """The regression failures of a report (empty without ``--baseline`` or when it passed)."""
    return list((report.get("regression") or {}).get("failures") or [])


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


ROLLOUT_COLUMNS = (
    "format", "LoRA", "batch", "output tok/s", "vs BF16", "prefill tok/s", "decode ms/tok",
)
MEMORY_COLUMNS = (
    "format", "LoRA", "weights", "peak allocated", "peak reserved", "KV cache", "measured by",
)
E2E_COLUMNS = ("format", "generation s", "logprobs s", "update s", "sync s", "step s", "vs BF16")


def rollout_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    return [
        (
            format_label(r),
            lora_label(r["lora_rank"]),
            str(r["batch"]),
            _fmt(r["output_tokens_per_s"]),
            _speedup(r.get("speedup_vs_bf16")),
            _fmt(r["prefill_tokens_per_s"]),
            _fmt(r["decode_ms_per_token"], ".2f"),
        )
        for r in report["rollout"]
    ]


def memory_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    return [
        (
            r["format"],
            lora_label(r["lora_rank"]),
            _bytes(r.get("weight_bytes")),
            _bytes(r.get("peak_allocated_bytes")),
            _bytes(r.get("peak_reserved_bytes")),
            _bytes(r.get("kv_cache_bytes")),
            str(r.get("method", "-")),
        )
        for r in report["memory"]
    ]


def e2e_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    return [
        (r["format"], *(_fmt(r.get(p), ".2f") for p in E2E_PHASES), _fmt(r.get("step_s"), ".2f"),
         _speedup(r.get("speedup_vs_bf16")))
        for r in report.get("e2e") or []
        if "error" not in r
    ]


def failed_cases(report: dict[str, Any]) -> list[str]:
    """Cases that produced no figures, each with why (e.g. a format vLLM cannot serve here)."""
    errors = report.get("errors") or []
    lines = [f"{e['format']} LoRA {lora_label(e['lora_rank'])}: {e['error']}" for e in errors]
    lines += [f"e2e {r['format']}: {r['error']}" for r in report.get("e2e") or [] if "error" in r]
    return lines


def _tables(report: dict[str, Any]) -> list[tuple[str, tuple[str, ...], list[tuple[str, ...]]]]:
    """(title, columns, rows) of every table, for both the terminal and the Markdown rendering."""
    from qerl_cli.bench.concurrency import ROOFLINE_COLUMNS, roofline_rows

    return [
        ("Rollout throughput", ROLLOUT_COLUMNS, rollout_rows(report)),
        ("Rollout against the GPU's roofline", ROOFLINE_COLUMNS, roofline_rows(report)),
        ("Memory", MEMORY_COLUMNS, memory_rows(report)),
        ("End-to-end GRPO step (seconds)", E2E_COLUMNS, e2e_rows(report)),
    ]


def _title(report: dict[str, Any]) -> str:
    s = report["settings"]
    return (
        f"qerl bench: {s['model']} on {s['engine']}, prompt {s['prompt_len']} / gen {s['gen_len']} tokens, "
        f"median of {s['repeats']}"
    )


def bench_table(report: dict[str, Any]):  # -> rich.console.Group
    """Rich renderable: rollout, memory, e2e tables and the regression outcome."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(_title(report), style="bold"), Text(report["figures_label"], style="yellow")]
    for title, columns, rows in _tables(report):
        if not rows:
            continue
        table = Table(title=title, title_justify="left")
        for i, column in enumerate(columns):
            table.add_column(column, justify="left" if i < 2 else "right")
        for row in rows:
            table.add_row(*row)
        parts.append(table)
    failed = failed_cases(report)
    if failed:
        parts.append(Text("Cases without figures:", style="bold red"))
        parts.extend(Text(f"  {line}", style="red") for line in failed)
    regression = report.get("regression")
    if regression:
        if regression["passed"]:
            passed = f"Regression gate passed ({regression['compared']} figures compared)."
            parts.append(Text(passed, style="green"))
        else:
            parts.append(Text("Regression gate FAILED:", style="bold red"))
            parts.extend(Text(f"  {f}", style="red") for f in regression["failures"])
    return Group(*parts)


def _markdown_table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return [*lines, ""]


def to_markdown(report: dict[str, Any]) -> str:
    gpu = report.get("gpu")
    versions = report["versions"]
    lines = [
        f"## {_title(report)}",
        "",
        f"**{report['figures_label']}**",
        "",
        f"Machine: {report['machine']['hostname']} ({report['machine']['cpu_count']} CPUs)"
        + (f", GPU: {gpu['name']} x{gpu['count']}, CUDA {gpu['cuda']}" if gpu else ", no GPU"),
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        "",
    ]
    for title, columns, rows in _tables(report):
        if rows:
            lines += [f"### {title}", "", *_markdown_table(columns, rows)]
    wall = wall_clock_line(report)
    if wall:
        lines += [wall, ""]
    failed = failed_cases(report)
    if failed:
        lines += ["Cases without figures:", *[f"- {line}" for line in failed], ""]
    regression = report.get("regression")
    if regression:
        if regression["passed"]:
            lines.append(f"Regression gate: **passed** ({regression['compared']} figures compared).")
        else:
            lines.append("Regression gate: **FAILED**")
            lines += [f"- {f}" for f in regression["failures"]]
        lines.append("")
    return "\n".join(lines)


def wall_clock_line(report: dict[str, Any]) -> str | None:
    """Where the command's time went (``timings``), for a CI budget; None for reports without it."""
    timings = report.get("timings")
    if not timings:
        return None
    parts = [f"random checkpoints {timings['checkpoints_s']:.0f} s"]
    parts += [f"{fmt} {seconds:.0f} s" for fmt, seconds in timings["formats_s"].items()]
    if timings.get("e2e_s") is not None:
        parts.append(f"e2e {timings['e2e_s']:.0f} s")
    return f"Wall clock: {timings['total_s']:.0f} s ({', '.join(parts)}; start-up and imports not included)."


def write_markdown(report: dict[str, Any], out_dir: str | Path) -> Path:
    """``bench.md`` in the output folder, appended to ``$GITHUB_STEP_SUMMARY`` when set (CI)."""
    text = to_markdown(report)
    path = Path(out_dir) / MARKDOWN_NAME
    path.write_text(text)
    files.append_step_summary(text)
    return path

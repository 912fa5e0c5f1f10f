"""The ``--baseline`` regression gate of ``qerl bench``: a fresh report against an earlier one.

Throughput may not drop, and memory and step time may not rise, by more than the tolerance; a case
the baseline measured that failed now is a regression too. Each rollout format is compared on its
default kernels only (a ``--concurrency`` sweep's other backends are measurements, not a contract);
each e2e row by its format and linear backend (every pair of ``qerl bench e2e`` was asked for by name).

A run or baseline measured on a busy host (:mod:`qerl_cli.bench.hostload`) or a throttled GPU
(:mod:`qerl_cli.bench.gpuclocks`) is still gated, since a regression may be real either way, but the
outcome says the comparison is not clean (:func:`gate_caveat`): a drop may be the host's or the GPU's,
and a busy or throttled baseline hides one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qerl_cli.bench.labels import e2e_backend_label, e2e_label, lora_label, row_backend
from qerl_cli.bench.result import BenchResult, RegressionOutcome
from qerl_cli.errors import QerlError

# Metrics the regression gate watches: name -> +1 when higher is better, -1 when lower is better.
ROLLOUT_GATED = {"output_tokens_per_s": +1, "prefill_tokens_per_s": +1}
MEMORY_GATED = {"weight_bytes": -1, "peak_allocated_bytes": -1, "peak_reserved_bytes": -1}
E2E_GATED = {"step_s": -1}
# A baseline measured with other settings is not comparable; these must agree.
COMPARABLE_SETTINGS = ("model", "engine", "prompt_len", "gen_len", "one_engine_per_format", "e2e_shape")


def _key(row: dict[str, Any], *fields: str) -> tuple:
    return tuple(row.get(f) for f in fields)


def _where(section: str, row: dict[str, Any], key_fields: tuple[str, ...]) -> str:
    """A gated row as the gate's messages name it: its key fields, an e2e row's backend as the bench table
    shows it (``trainer`` on the HF engine, not the ``auto`` it asked for)."""
    shown = {**row, "backend": e2e_backend_label(row)} if section == "e2e" else row
    return f"{section} " + " ".join(f"{f}={shown.get(f)}" for f in key_fields)


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
        where = _where(section, row, key_fields)
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


def _lost_cases(report: BenchResult, baseline: BenchResult) -> list[str]:
    """Cases the baseline measured that failed in this run: a format that stopped working is the
    worst regression, and without this its missing rows would simply not be compared."""
    failed_now = {(e["format"], e["lora_rank"]): e["error"] for e in report.errors}
    rows_before = [*baseline.rollout, *baseline.memory]
    measured_before = {(r["format"], r["lora_rank"]) for r in rows_before}
    lost = [
        f"{fmt} LoRA {lora_label(rank)}: measured in the baseline, failed now ({failed_now[fmt, rank]})"
        for fmt, rank in sorted(failed_now.keys() & measured_before)
    ]
    e2e_failed = {(r["format"], row_backend(r)): r for r in report.e2e or [] if "error" in r}
    e2e_before = {(r["format"], row_backend(r)) for r in baseline.e2e or [] if "error" not in r}
    for pair in sorted(e2e_failed.keys() & e2e_before):
        row = e2e_failed[pair]
        lost.append(f"e2e {e2e_label(row)}: measured in the baseline, failed now ({row['error']})")
    return lost


def check_comparable(settings: dict[str, Any], device: str, baseline: BenchResult) -> None:
    """Raise ``QerlError`` when ``baseline`` cannot gate a report of ``settings`` measured on ``device``
    (a report's ``device``): other settings or device, or no format in common. It reads the settings
    alone, so the plan asks it before anything is measured, for the dry run and the run alike (a wrong
    baseline was found only after the whole run, and a dry run passed it)."""
    mismatched = [
        f"{name}: {baseline.settings.get(name)!r} vs {settings.get(name)!r}"
        for name in COMPARABLE_SETTINGS
        if baseline.settings.get(name) != settings.get(name)
    ]
    if baseline.device != device:
        mismatched.append(f"device: {baseline.device!r} vs {device!r}")
    if mismatched:
        raise QerlError(
            "the baseline was measured with other settings (baseline vs now): "
            + "; ".join(mismatched)
            + ". Rerun the baseline with the same --model/--engine/--prompt-len/--gen-len (and e2e shape) "
            "on the same kind of machine and qerl version."
        )
    formats = set(settings.get("formats") or [])
    measured = {r.get("format") for r in [*baseline.rollout, *baseline.memory, *(baseline.e2e or [])]}
    if formats and measured and not formats & measured:
        raise QerlError(
            f"the baseline measured {', '.join(sorted(str(f) for f in measured))} and this run measures "
            f"{', '.join(sorted(formats))}: nothing to compare; run with the baseline's --formats"
        )


def check_regressions(report: BenchResult, baseline: BenchResult, tolerance: float) -> RegressionOutcome:
    """Compare a fresh report with a baseline; returns the ``regression`` section of the report.

    Throughput may not drop, and memory and step time may not rise, by more than ``tolerance``
    (a fraction). Raises ``QerlError`` when the two runs are not comparable at all, because a gate
    that silently compares nothing would always pass.
    """
    if tolerance < 0:
        raise QerlError(f"--tolerance must be >= 0 (a fraction, 0.1 = 10%), got {tolerance}")
    check_comparable(report.settings, report.device, baseline)
    failures: list[str] = []
    compared = 0
    for section, key_fields, gated in (
        ("rollout", ("format", "lora_rank", "batch"), ROLLOUT_GATED),
        ("memory", ("format", "lora_rank"), MEMORY_GATED),
        ("e2e", ("format", "backend"), E2E_GATED),
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
    return RegressionOutcome(tolerance=tolerance, compared=compared, failures=failures, passed=not failures,
                             baseline_host_busy=baseline.host_busy_reason,
                             baseline_gpu_throttled=baseline.gpu_throttled_reason)  # fmt: skip


def _gated_rows(report: BenchResult, section: str) -> list[dict[str, Any]]:
    """The rows the gate compares: each rollout format on its default kernels (a --concurrency sweep's
    other backends are measurements, not a contract); every e2e row, its backend filled in for a report
    from before rows recorded it."""
    if section == "e2e":
        return [{**r, "backend": row_backend(r)} for r in report.e2e or []]
    rows = {"rollout": report.rollout, "memory": report.memory}[section]
    return [r for r in rows if r.get("backend") in (None, "default", "marlin")]


def gate_caveat(report: BenchResult) -> str | None:
    """Why the ``--baseline`` comparison is not clean (this run's or the baseline's host was busy or
    GPU throttled), or None: a clean comparison, or no gate. A warning, never a failure of the gate."""
    regression = report.regression
    if regression is None:
        return None
    busy = {"this run's": report.host_busy_reason, "the baseline's": regression.baseline_host_busy}
    throttled = {"this run's": report.gpu_throttled_reason,
                 "the baseline's": regression.baseline_gpu_throttled}  # fmt: skip
    found = [f"{whose} host was busy ({why})" for whose, why in busy.items() if why]
    found += [f"{whose} GPU was throttled ({why})" for whose, why in throttled.items() if why]
    if not found:
        return None
    return (
        "the regression gate's comparison is not clean: " + "; ".join(found) + ". A change may be the "
        "host's or the GPU's, not qerl's; rerun on an idle host and an unthrottled GPU before trusting it."
    )


def gate_failures(report: BenchResult) -> list[str]:
    """The regression failures of a report (empty without ``--baseline`` or when it passed)."""
    return list(report.regression.failures) if report.regression else []

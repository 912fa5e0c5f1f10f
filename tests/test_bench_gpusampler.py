"""The measured GPU's clocks read under load within a case: the sampler's thread (fake probes and clock, no
real sleeping), each reading's training phase, a failing probe kept as a note, each row's summary (and
each phase's), the readings merged into the run's with their times shifted (and the throttled verdict
they can give), the "SM MHz" column, and old reports."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from qerl_cli.bench.e2e_notes import ROLLOUT_BUSY_COLUMN
from qerl_cli.bench.gpuclocks import GpuClocks, GpuReading
from qerl_cli.bench.gpusampler import (
    READINGS_KEY,
    ROW_KEY,
    UTILIZATION_WINDOW_S,
    CaseClocks,
    ClockSampler,
    PhaseClocks,
    SampledClocks,
    keep_case_clocks,
    row_rollout_busy_pct,
    take_case_clocks,
)
from qerl_cli.bench.hostload import NO_GPU, HostLoad, HostProbes, start_host_load
from qerl_cli.bench.report import SM_CLOCK_COLUMN, bench_table, e2e_columns, rollout_columns, to_markdown
from qerl_cli.bench.result import SCHEMA, BenchResult, read_report, write_json
from qerl_cli.rl.phase import OTHER, ROLLOUT, UPDATE, in_phase


def reading(sm: int | None, reasons: list[str] | None = None, utilization: int | None = 95,
            elapsed_s: float = 0.0, temperature: int = 60, power: float = 500.0,
            phase: str | None = None) -> GpuReading:  # fmt: skip
    return GpuReading(elapsed_s, sm, 1980, temperature, power, 700.0, utilization, list(reasons or []), phase)


IDLE = reading(345, ["gpu_idle"], utilization=0, temperature=40, power=90.0)


def counting_probe(answers: list[GpuReading | str | Exception], enough: threading.Event) -> Any:
    """A probe answering ``answers`` in turn, then the last one again; ``enough`` is set once it has
    answered them all."""
    calls = itertools.count(1)

    def probe() -> GpuReading | str:
        call = next(calls)
        if call >= len(answers):
            enough.set()
        answer = answers[min(call, len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return probe


# --------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------
def test_the_sampler_reads_from_its_start_until_it_stops() -> None:
    enough = threading.Event()
    probe = counting_probe([reading(1980), reading(1900), reading(1850)], enough)
    ticks = itertools.count(100.0, 2.5)  # the start, then one tick per reading
    with ClockSampler(probe, interval_s=0.0, clock=lambda: next(ticks)) as sampler:
        assert enough.wait(timeout=30)
    assert sampler._thread is not None and not sampler._thread.is_alive()
    record = sampler.record()
    assert record is not None and record.started_clock_s == 100.0 and record.note is None
    assert [(r.sm_mhz, r.elapsed_s) for r in record.readings[:3]] == [(1980, 2.5), (1900, 5.0), (1850, 7.5)]
    # A reading that comes back after the stop (one in flight when the case ended) is not kept.
    after = len(record.readings)
    sampler.sample()
    assert len(sampler.record().readings) == after


def test_a_failing_or_raising_probe_becomes_the_note_and_never_reaches_the_case() -> None:
    enough = threading.Event()
    answers: list[GpuReading | str | Exception] = [
        reading(1980), RuntimeError("boom"), "nvidia-smi exited 9: driver mismatch", reading(1970)
    ]  # fmt: skip
    with ClockSampler(counting_probe(answers, enough), interval_s=0.0) as sampler:
        assert enough.wait(timeout=30)
    record = sampler.record()
    assert record.note == "nvidia-smi exited 9: driver mismatch"  # the last failure
    assert [r.sm_mhz for r in record.readings[:2]] == [1980, 1970]
    always = threading.Event()
    with ClockSampler(counting_probe([OSError("gone")], always), interval_s=0.0) as broken:
        assert always.wait(timeout=30)
    assert broken.record().readings == []
    assert broken.record().note == "the clock probe raised OSError: gone"


def test_each_reading_carries_the_phase_the_process_was_in_when_it_was_taken() -> None:
    now: list[Any] = [OTHER, float("-inf")]  # the phase as the sampler sees it, and when it last changed
    first = threading.Event()
    script: list[tuple[GpuReading, str | None]] = [
        (reading(1000), None),  # the thread's own reading at the start (it then waits an hour)
        (reading(1980, utilization=40), None),
        (reading(1755, utilization=100), None),
        (reading(1900, utilization=70), OTHER),  # the update ended during this reading
        (reading(1870, utilization=50), ROLLOUT),  # and a rollout began during this one
    ]
    answers = iter(script)

    def probe() -> GpuReading:
        found, then = next(answers)
        if then is not None:
            now[0] = then
        first.set()
        return found

    with ClockSampler(probe, interval_s=3600.0, phase=lambda: (now[0], now[1])) as sampler:
        assert first.wait(timeout=30)  # the thread's reading first, so the script's order is the calls'
        now[0] = ROLLOUT
        sampler.sample()
        now[0] = UPDATE
        sampler.sample()
        sampler.sample()
        sampler.sample()
        record = sampler.record()
    assert record is not None
    tagged = [(r.sm_mhz, r.phase) for r in record.readings]
    assert tagged == [(1000, OTHER), (1980, ROLLOUT), (1755, UPDATE), (1900, OTHER), (1870, OTHER)]
    # By default the sampler reads the trainer's phase (qerl_cli.rl.phase), and keeps it in the JSON.
    with ClockSampler(lambda: reading(1980), interval_s=3600.0) as default, in_phase(ROLLOUT):
        default.clock = lambda: time.monotonic() + 10.0  # read well after the phase began
        default.sample()
    kept = default.record()
    assert kept is not None and ROLLOUT in [r.phase for r in kept.readings]
    assert SampledClocks.from_dict(json.loads(json.dumps(kept.to_dict()))) == kept


def test_a_reading_taken_just_after_a_change_of_phase_is_neither_phases() -> None:
    """nvidia-smi's utilization covers the driver's last sampling period: a reading taken within that of a
    change measures the phase before it too."""
    clock = [100.0]
    changed = [99.5]
    with ClockSampler(lambda: reading(1980), interval_s=3600.0, clock=lambda: clock[0],
                      phase=lambda: (ROLLOUT, changed[0])) as sampler:  # fmt: skip
        sampler.sample()  # 0.5 s after the rollout began: still the update's utilization in part
        changed[0] = 100.0 - UTILIZATION_WINDOW_S - 0.1
        sampler.sample()
    record = sampler.record()
    assert record is not None and [r.phase for r in record.readings][-2:] == [OTHER, ROLLOUT]


def test_without_a_probe_nothing_is_read_and_the_row_gets_no_key() -> None:
    with ClockSampler(None) as sampler:
        pass
    assert sampler._thread is None and sampler.record() is None
    row: dict[str, Any] = {"batch": 8}
    kept: list[dict[str, Any]] = []
    keep_case_clocks(row, sampler.record(), kept)
    assert row == {"batch": 8} and kept == []


# --------------------------------------------------------------------------------------------
# The row's summary
# --------------------------------------------------------------------------------------------
def test_the_rows_summary_comes_from_the_working_gpus_readings_only() -> None:
    sampled = SampledClocks(7.0, [
        reading(1980, temperature=65, power=610.0),
        reading(1755, ["sw_power_cap", "sync_boost"], temperature=71, power=699.0),
        reading(1830, temperature=69),
        IDLE,  # a low clock and a cooler GPU: not the case's work
        reading(300, ["gpu_idle", "hw_slowdown"], utilization=None),  # the driver's idle: its reasons too
        GpuReading(9.0, 1200, None, None, None, None, None, None),  # neither mask nor utilization: unknown
    ], note="nvidia-smi failed: timed out")  # fmt: skip
    summary = sampled.summary()
    assert summary == CaseClocks(
        readings=6, busy_readings=3, sm_mhz_median=1830.0, sm_mhz_min=1755, temperature_c_max=71,
        power_w_max=699.0, slowdowns=["sw_power_cap"], note="nvidia-smi failed: timed out",
    )  # fmt: skip
    assert CaseClocks.from_dict(json.loads(json.dumps(summary.to_dict()))) == summary
    idle_only = SampledClocks(0.0, [IDLE]).summary()
    assert (idle_only.busy_readings, idle_only.sm_mhz_median, idle_only.slowdowns) == (0, None, [])
    assert "note" not in idle_only.to_dict()
    assert summary.phases == {} and idle_only.phases == {}  # readings without a phase: none summarised


def test_each_phase_is_summarised_from_its_own_readings_idle_ones_included() -> None:
    sampled = SampledClocks(0.0, [
        reading(1980, utilization=30, power=250.0, phase=ROLLOUT),
        reading(1980, utilization=87, power=410.0, phase=ROLLOUT),
        reading(1965, ["gpu_idle"], utilization=0, power=120.0, phase=ROLLOUT),  # the GPU waited on the host
        reading(1650, ["sw_power_cap"], utilization=100, power=700.0, phase=UPDATE),
        reading(1700, ["sw_power_cap"], utilization=100, power=699.0, phase=UPDATE),
        reading(345, ["gpu_idle"], utilization=0, power=90.0, phase=OTHER),  # a sleep: not summarised
    ])  # fmt: skip
    summary = sampled.summary()
    # (readings, median utilization %, SM MHz, power W, mean utilization %) of each phase
    assert summary.phases == {
        ROLLOUT: PhaseClocks(3, 30.0, 1980.0, 250.0, 39.0),
        UPDATE: PhaseClocks(2, 100.0, 1675.0, 699.5, 100.0),
    }
    # The busy median mixes the phases; the rollout's own shows the clock held while the GPU waited.
    assert summary.sm_mhz_median == 1840.0
    assert CaseClocks.from_dict(json.loads(json.dumps(summary.to_dict()))) == summary
    # A phase whose readings lack a figure has None for it; a row from before the phases has none.
    unknown = SampledClocks(0.0, [GpuReading(0.0, None, None, None, None, None, None, None, ROLLOUT)])
    assert unknown.summary().phases[ROLLOUT] == PhaseClocks(1, None, None, None)
    old = {k: v for k, v in summary.to_dict().items() if k != "phases"}
    assert CaseClocks.from_dict(old).phases == {}


def test_the_busy_share_is_the_mean_so_an_idle_stretch_shows() -> None:
    """Measured on an H200 with vLLM's engine core in its own process: the GPU ran flat out, then sat
    idle while the front end caught up; the median (98%) hid the idle third, the mean does not."""
    utilizations = [98, 100, 100, 0, 0, 0, 93, 99, 98, 100, 0]
    sampled = SampledClocks(0.0, [reading(1845, utilization=u, phase=ROLLOUT) for u in utilizations])
    rollout = sampled.summary().phases[ROLLOUT]
    assert rollout.utilization_pct_median == 98.0
    assert rollout.busy_pct == pytest.approx(sum(utilizations) / len(utilizations))  # 62.5
    row = {"gpu_clocks": sampled.summary().to_dict()}
    assert row_rollout_busy_pct(row) == pytest.approx(62.5, abs=0.1)
    # A phase summary written before the mean was recorded reads back key for key, and its busy share
    # is its median.
    before = {
        "readings": 11,
        "utilization_pct_median": 98.0,
        "sm_mhz_median": 1845.0,
        "power_w_median": 690.0,
    }
    assert PhaseClocks.from_dict(before).to_dict() == before
    assert PhaseClocks.from_dict(before).busy_pct == 98.0


# --------------------------------------------------------------------------------------------
# Into the run's readings
# --------------------------------------------------------------------------------------------
def host_with_clock(ticks: list[float], between_cases: list[GpuReading]) -> tuple[HostLoad, list[str]]:
    clock, found = iter(ticks), iter(between_cases)
    probes = HostProbes(loadavg=lambda: (0.1, 0.1, 0.1), cpu_count=lambda: 64, own_cpu_s=lambda: 0.0,
                        process_age_s=lambda: None, clock=lambda: next(clock),
                        gpu_processes=lambda: NO_GPU, gpu_clocks=lambda: next(found))  # fmt: skip
    warnings: list[str] = []
    return start_host_load(probes, warn=warnings.append), warnings


def test_a_cases_readings_join_the_runs_at_their_time_and_a_busy_one_can_throttle_it() -> None:
    # The run starts at 1000 s on the clock; the host's own readings (between cases) find the GPU idle.
    host, warnings = host_with_clock([1000.0, 1000.0, 1060.0], [IDLE, IDLE])
    case = SampledClocks(1012.0, [reading(1980, elapsed_s=0.0),
                                  reading(1410, ["hw_thermal_slowdown"], elapsed_s=35.04)])  # fmt: skip
    payload: dict[str, Any] = {"rollout": [], READINGS_KEY: [case.to_dict()]}
    take_case_clocks(payload, host)
    assert READINGS_KEY not in payload  # the rows and the report keep only the summaries
    assert [r.elapsed_s for r in host.gpu_clocks.readings] == [0.0, 12.0, 47.0]
    assert warnings == []  # the verdict follows at the host's next sample, as the report is written
    host.sample()
    assert [r.elapsed_s for r in host.gpu_clocks.readings] == [0.0, 12.0, 47.0, 60.0]
    (warning,) = warnings
    assert warning.startswith("GPU throttled: SM 1410 MHz at 47 s (60 C, 500/700 W): hw_thermal_slowdown")
    # Without the in-case readings the same run's readings (all idle) give no verdict.
    assert GpuClocks([IDLE, IDLE]).throttled_reason is None


def test_readings_are_taken_out_of_a_row_even_without_a_host_and_a_read_record_keeps_none() -> None:
    row: dict[str, Any] = {"format": "bf16", READINGS_KEY: [SampledClocks(5.0, [reading(1980)]).to_dict()]}
    take_case_clocks(row, None)
    assert row == {"format": "bf16"}
    read = HostLoad.from_dict(HostLoad(cpu_count=8).to_dict())
    read.add_case_clocks(5.0, [reading(1980)])
    assert read.gpu_clocks is None


# --------------------------------------------------------------------------------------------
# The reports
# --------------------------------------------------------------------------------------------
SETTINGS = {"model": "tiny", "engine": "vllm", "prompt_len": 8, "gen_len": 8, "repeats": 3,
            "formats": ["bf16", "nvfp4"], "one_engine_per_format": True, "e2e_shape": None}  # fmt: skip


def rollout_row(fmt: str, clocks: CaseClocks | None) -> dict[str, Any]:
    row = {"format": fmt, "lora_rank": 0, "batch": 8, "backend": "default", "output_tokens_per_s": 10500.0,
           "prefill_tokens_per_s": 1000.0, "decode_ms_per_token": 1.0}  # fmt: skip
    return row if clocks is None else {**row, ROW_KEY: clocks.to_dict()}


def e2e_row(fmt: str, clocks: CaseClocks | None) -> dict[str, Any]:
    row = {"format": fmt, "backend": "default", "step_s": 30.0, "step_vs_bf16": 1.0}
    return row if clocks is None else {**row, ROW_KEY: clocks.to_dict()}


def bench(rollout: list[dict[str, Any]], e2e: list[dict[str, Any]] | None = None) -> BenchResult:
    return BenchResult(schema=SCHEMA, created="2026-11-29T00:00:00+00:00", device="gpu",
                       figures_label="GPU figures", machine={"cpu_count": 64}, gpu=None, versions={},
                       settings=dict(SETTINGS), rollout=rollout, e2e=e2e)  # fmt: skip


def terminal(result: BenchResult) -> str:
    console = Console(record=True, width=400)
    console.print(bench_table(result))
    return console.export_text()


HOT = CaseClocks(4, 3, 1755.0, 1410, 83, 699.1, ["sw_power_cap"])
IDLE_ONLY = CaseClocks(1, 0, None, None, None, None)


def test_the_sm_clock_column_shows_each_rows_busy_median_or_a_dash() -> None:
    result = bench([rollout_row("bf16", HOT), rollout_row("nvfp4", IDLE_ONLY)],
                   [e2e_row("bf16", None), e2e_row("nvfp4", HOT)])  # fmt: skip
    assert rollout_columns(result)[-1] == SM_CLOCK_COLUMN and e2e_columns(result)[-1] == SM_CLOCK_COLUMN
    markdown = to_markdown(result)
    assert "| bf16 | none | 8 | 10500.0 | - | 1000.0 | 1.00 | 1755 |" in markdown
    assert "| nvfp4 | none | 8 | 10500.0 | - | 1000.0 | 1.00 | - |" in markdown
    assert "| bf16 | default | - | - | - | - | - | - | - | - | - | 30.00 | 1.00 | - |" in markdown
    assert markdown.count(f"| {SM_CLOCK_COLUMN} |") == 2
    assert terminal(result).count(SM_CLOCK_COLUMN) == 2


def test_a_rollout_rows_gpu_busy_share_while_generating_has_its_column() -> None:
    generating = replace(HOT, phases={ROLLOUT: PhaseClocks(3, 52.0, 1980.0, 430.0)})
    result = bench([rollout_row("bf16", generating), rollout_row("nvfp4", HOT)], [])
    assert rollout_columns(result)[-2:] == (SM_CLOCK_COLUMN, ROLLOUT_BUSY_COLUMN)
    markdown = to_markdown(result)
    assert "| bf16 | none | 8 | 10500.0 | - | 1000.0 | 1.00 | 1755 | 52 |" in markdown
    assert "| nvfp4 | none | 8 | 10500.0 | - | 1000.0 | 1.00 | 1755 | - |" in markdown
    # Rows without a rollout-phase reading (earlier files, cases outside any phase): no column.
    assert ROLLOUT_BUSY_COLUMN not in rollout_columns(bench([rollout_row("bf16", HOT)], []))


def test_a_host_bound_rollout_row_is_named_under_the_tables() -> None:
    """A 7B rollout at 128 sequences kept the GPU busy about half the time (vLLM's detokenizer held the
    engine's thread): its tok/s and share of the roofline were the host's limit, not the kernels'."""
    waiting = replace(HOT, phases={ROLLOUT: PhaseClocks(15, 56.0, 1980.0, 415.0, 51.7)})
    busy = replace(HOT, phases={ROLLOUT: PhaseClocks(11, 98.0, 1845.0, 690.0, 96.0)})
    rows = [
        rollout_row("bf16", waiting),
        {**rollout_row("nvfp4", busy), "backend": "merged", "lora_rank": 16},
    ]
    line = ("Host-bound rollouts in the rollout table (GPU busy below 80% while generating): "
            "bf16, LoRA none, 8 seqs 52%.")  # fmt: skip
    assert line in to_markdown(bench(rows, [])) and line in terminal(bench(rows, []))
    assert "Host-bound" not in to_markdown(bench(rows[1:], []))


def test_without_a_busy_reading_on_any_row_there_is_no_sm_clock_column() -> None:
    result = bench([rollout_row("bf16", IDLE_ONLY), rollout_row("nvfp4", None)], [e2e_row("bf16", None)])
    assert SM_CLOCK_COLUMN not in rollout_columns(result) + e2e_columns(result)
    assert SM_CLOCK_COLUMN not in to_markdown(result) and SM_CLOCK_COLUMN not in terminal(result)


def test_a_bench_json_with_or_without_the_rows_clocks_reads_back(tmp_path: Path) -> None:
    old = bench([rollout_row("bf16", None)], [e2e_row("bf16", None)]).to_dict()
    (tmp_path / "bench.json").write_text(json.dumps(old))  # a file from before the rows had gpu_clocks
    read = read_report(tmp_path)
    assert json.dumps(read.to_dict()) == json.dumps(old)
    assert SM_CLOCK_COLUMN not in to_markdown(read)
    new = bench([rollout_row("bf16", HOT)], [e2e_row("bf16", HOT)])
    write_json(new, tmp_path)
    again = read_report(tmp_path)
    assert again == new and CaseClocks.from_dict(again.e2e[0][ROW_KEY]) == HOT

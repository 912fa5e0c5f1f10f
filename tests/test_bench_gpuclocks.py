"""A benchmark knows when its GPU was clocked down: nvidia-smi's readings parsed, the throttled rule at its
edges, the readings taken with the host load (fake probes), what the reports print, and old reports
without the readings still reading."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from rich.console import Console

from qerl_cli.bench.gate import check_regressions, gate_caveat
from qerl_cli.bench.gpuclocks import (
    CLOCK_DROP_FRACTION,
    FULLY_BUSY_PCT,
    QUERIES,
    GpuClocks,
    GpuReading,
    NvidiaSmiClocks,
    decode_reasons,
    parse_gpu_query,
    throttle_findings,
    throttle_warning,
)
from qerl_cli.bench.hostload import NO_GPU, HostLoad, HostProbes, start_host_load
from qerl_cli.bench.report import bench_table, to_markdown
from qerl_cli.bench.report_host import gpu_clocks_line
from qerl_cli.bench.result import SCHEMA, BenchResult, read_report, write_json

GPU_UUID = "GPU-1a2b3c4d-0000-1111-2222-333344445555"
OTHER_UUID = "GPU-ffffffff-0000-1111-2222-333344445555"
NVIDIA_SMI = "/usr/bin/nvidia-smi"


def reading(sm: int | None, reasons: list[str] | tuple[()] | None = (), utilization: int | None = 90,
            elapsed_s: float = 0.0, temperature: int | None = 60, enforced: float | None = 700.0,
            default_limit: float | None = 700.0) -> GpuReading:  # fmt: skip
    """A reading of an H200 at 500 of its 700 W, the limit in force its default unless ``enforced`` says
    otherwise; ``reasons`` None: the mask unknown."""
    mask = None if reasons is None else list(reasons)
    return GpuReading(elapsed_s, sm, 1980, temperature, 500.0, 700.0, utilization, mask,
                      power_default_limit_w=default_limit, power_enforced_limit_w=enforced)  # fmt: skip


# --------------------------------------------------------------------------------------------
# nvidia-smi's output
# --------------------------------------------------------------------------------------------
def test_the_reasons_mask_decodes_to_the_documented_names_and_keeps_unknown_bits() -> None:
    assert decode_reasons(0) == []
    assert decode_reasons(0x1) == ["gpu_idle"]
    assert decode_reasons(0x44) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_reasons(0x1FF) == [
        "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
        "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "display_clock_setting",
    ]  # fmt: skip
    assert decode_reasons(0x808) == ["hw_slowdown", "0x800"]


def test_the_measured_gpus_line_is_parsed_with_its_hex_mask_and_na_fields() -> None:
    text = (
        f"{OTHER_UUID}, 1410, 1980, 83, 699.10, 700.00, 100, 700.00, 700.00, 0x0000000000000004\n"
        f"{GPU_UUID}, 1755, 1980, 71, 612.45, 700.00, 98, 700.00, 600.00, 0x0000000000000024\n"
    )
    capped = ["sw_power_cap", "sw_thermal_slowdown"]
    assert parse_gpu_query(text, GPU_UUID.removeprefix("GPU-")) == GpuReading(
        0.0,
        1755,
        1980,
        71,
        612.45,
        700.0,
        98,
        capped,
        power_default_limit_w=700.0,
        power_enforced_limit_w=600.0,
    )
    unsupported = f"{GPU_UUID}, 345, [N/A], [N/A], [Not Supported], [N/A], [N/A], [N/A], [N/A], [N/A]\n"
    assert parse_gpu_query(unsupported, GPU_UUID) == GpuReading(0.0, 345, None, None, None, None, None, None)
    assert parse_gpu_query("not a line\n" + text.splitlines()[0], GPU_UUID) is None
    # A driver asked without the limit fields: the same reading, the limits unknown.
    without = f"{GPU_UUID}, 1755, 1980, 71, 612.45, 700.00, 98, 0x0000000000000024\n"
    assert parse_gpu_query(without, GPU_UUID, QUERIES[2]) == GpuReading(
        0.0, 1755, 1980, 71, 612.45, 700.0, 98, capped
    )


def run_answering(*answers: tuple[int, str, str] | BaseException) -> tuple[Any, list[list[str]]]:
    """A fake subprocess.run answering each query in turn (rc, stdout, stderr) or raising; and the
    queries it was given."""
    queries: list[list[str]] = []
    pending = iter(answers)

    def run(query: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert kwargs["timeout"] and kwargs["check"] is False
        queries.append(query)
        answer = next(pending)
        if isinstance(answer, BaseException):
            raise answer
        return subprocess.CompletedProcess(query, *answer)

    return run, queries


def test_a_driver_without_the_newer_field_name_is_asked_with_the_older_once() -> None:
    line = f"{GPU_UUID}, 1980, 1980, 45, 118.52, 700.00, 0, 700.00, 700.00, 0x0000000000000001\n"
    invalid = (2, 'Field "clocks_event_reasons.active" is not a valid field to query.', "")
    run, queries = run_answering(invalid, (0, line, ""), (0, line, ""))
    probe = NvidiaSmiClocks(GPU_UUID, run=run, which=lambda name: NVIDIA_SMI)
    limits = {"power_default_limit_w": 700.0, "power_enforced_limit_w": 700.0}
    assert probe() == GpuReading(0.0, 1980, 1980, 45, 118.52, 700.0, 0, ["gpu_idle"], **limits)
    assert probe().sm_mhz == 1980
    asked = [q[1].rsplit(",", 1)[1] for q in queries]
    # The name that answered is kept: the second reading asks with it first.
    assert asked == [
        "clocks_event_reasons.active",
        "clocks_throttle_reasons.active",
        "clocks_throttle_reasons.active",
    ]
    assert queries[0][1].startswith("--query-gpu=uuid,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,")


def test_a_driver_without_the_power_limit_fields_is_asked_without_them_once() -> None:
    line = f"{GPU_UUID}, 1980, 1980, 45, 118.52, 700.00, 0, 0x0000000000000001\n"
    invalid = (2, 'Field "power.default_limit" is not a valid field to query.', "")
    run, queries = run_answering(invalid, invalid, (0, line, ""), (0, line, ""))
    probe = NvidiaSmiClocks(GPU_UUID, run=run, which=lambda name: NVIDIA_SMI)
    assert probe() == GpuReading(0.0, 1980, 1980, 45, 118.52, 700.0, 0, ["gpu_idle"])
    assert probe().sm_mhz == 1980
    with_default = ["power.default_limit" in q[1] for q in queries]
    assert with_default == [True, True, False, False]  # the query that answered is asked first next time


def test_nvidia_smi_missing_failing_or_hanging_is_recorded_as_why_never_raised() -> None:
    def never(*args: object, **kwargs: object) -> object:
        raise AssertionError("nvidia-smi must not run")

    assert NvidiaSmiClocks(GPU_UUID, run=never, which=lambda name: None)() == "nvidia-smi not found"
    assert NvidiaSmiClocks(None, run=never)() == "the measured GPU's UUID is unknown"
    hangs, queries = run_answering(subprocess.TimeoutExpired(["nvidia-smi"], 10))
    assert NvidiaSmiClocks(GPU_UUID, run=hangs, which=lambda name: NVIDIA_SMI)().startswith(
        "nvidia-smi failed: Command"
    )
    assert len(queries) == 1  # a hung driver is not asked again with the other name
    broken, queries = run_answering((9, "", "driver mismatch"))
    probe = NvidiaSmiClocks(GPU_UUID, run=broken, which=lambda name: NVIDIA_SMI)
    assert probe() == "nvidia-smi exited 9: driver mismatch"
    assert len(queries) == 1  # a broken driver is not asked the other queries: they would fail alike
    elsewhere, _ = run_answering((0, f"{OTHER_UUID}, 1980, 1980, 45, 100, 700, 0, 700, 700, 0x1\n", ""))
    probe = NvidiaSmiClocks(GPU_UUID, run=elsewhere, which=lambda name: NVIDIA_SMI)
    assert probe() == "nvidia-smi did not list the measured GPU"  # and not its UUID


# --------------------------------------------------------------------------------------------
# The rule
# --------------------------------------------------------------------------------------------
def test_a_slowdown_reason_on_a_working_gpu_is_throttling_other_reasons_are_not() -> None:
    assert throttle_findings([reading(1980, ["sync_boost", "applications_clocks_setting"])]) == []
    (found,) = throttle_findings([reading(1980), reading(1800, ["sw_thermal_slowdown"], elapsed_s=340)])
    assert found == "SM 1800 MHz at 340 s (60 C, 500/700 W): sw_thermal_slowdown"
    # The driver calling the GPU idle: its clocks are its own, whatever else the mask holds.
    assert throttle_findings([reading(345, ["gpu_idle", "sw_power_cap"], utilization=0)]) == []
    # Idle by utilization only, the mask set: the driver's slowdown still counts.
    assert throttle_findings([reading(1400, ["hw_slowdown"], utilization=0)]) != []


def test_a_busy_clock_more_than_a_tenth_below_the_runs_highest_is_throttling() -> None:
    edge = round(1980 * (1 - CLOCK_DROP_FRACTION))  # 1782: exactly a tenth below is not
    assert throttle_findings([reading(1980), reading(edge)]) == []
    (found,) = throttle_findings([reading(1700, elapsed_s=30), reading(1980, elapsed_s=60)])
    assert found.startswith("SM 1700 MHz at 30 s") and found.endswith("14% below the run's highest 1980 MHz")
    # Both a reason and the drop: one finding naming both.
    (both,) = throttle_findings([reading(1980), reading(1200, ["hw_power_brake_slowdown"])])
    assert "hw_power_brake_slowdown, 39% below" in both


def test_a_reasonless_drop_on_a_partly_busy_gpu_is_boost_not_throttling() -> None:
    """The readings an H200 gave between power-capped decodes (default 700 W limit): 1605-1740 MHz at
    63-73% utilization with an empty reasons mask. GPU Boost lowers the clock of a GPU between work; the
    same drop at full utilization, with a slowdown reason or with the mask unknown is throttling."""
    partly = [
        reading(1635, [], utilization=63, elapsed_s=127),
        reading(1605, [], utilization=73, elapsed_s=697),
    ]
    assert throttle_findings([reading(1980), *partly]) == []
    (full,) = throttle_findings([reading(1980), reading(1635, [], utilization=100, elapsed_s=127)])
    assert full.endswith("17% below the run's highest 1980 MHz")
    (unknown,) = throttle_findings([reading(1980), reading(1635, [], utilization=None, elapsed_s=127)])
    assert "17% below" in unknown  # a utilization not read: judged as before
    # The mask not read: no telling a throttle from Boost, so the drop counts at any utilization.
    (no_mask,) = throttle_findings([reading(1980), reading(1400, None, utilization=70)])
    assert no_mask.endswith("29% below the run's highest 1980 MHz")
    # The edge: busy the whole period from FULLY_BUSY_PCT on.
    assert throttle_findings([reading(1980), reading(1635, [], utilization=FULLY_BUSY_PCT - 1)]) == []
    assert throttle_findings([reading(1980), reading(1635, [], utilization=FULLY_BUSY_PCT)]) != []
    (hard,) = throttle_findings([reading(1980), reading(1635, ["hw_slowdown"], utilization=63)])
    assert hard.endswith("hw_slowdown, 17% below the run's highest 1980 MHz")


def test_the_power_cap_at_the_boards_default_limit_is_a_loaded_gpu_not_throttling() -> None:
    """A board at its default power limit under dense GEMMs holds the limit with sw_power_cap set below its
    boost clock: not throttling, with or without the drop. The same drop under a lower limit in force (a
    user's, the host's, a datacenter's), or with either limit unknown, is throttling, as a drop the driver
    gives no reason for is."""
    assert throttle_findings([reading(1980), reading(1900, ["sw_power_cap"], elapsed_s=10)]) == []
    assert throttle_findings([reading(1980), reading(1530, ["sw_power_cap"], elapsed_s=20)]) == []
    (lowered,) = throttle_findings(
        [reading(1980), reading(1500, ["sw_power_cap"], elapsed_s=20, enforced=500)]
    )
    assert lowered.endswith(
        "sw_power_cap at a lowered limit (500 W of its default 700 W), 24% below the run's highest 1980 MHz"
    )
    (alone,) = throttle_findings([reading(1500, ["sw_power_cap"], enforced=500)])  # its maximum, alone
    assert alone.endswith("24% below its maximum 1980 MHz")
    # Unknown limits (an older driver or report): the drop under the cap still counts, as it always did.
    for unknown in (
        reading(1530, ["sw_power_cap"], default_limit=None),
        reading(1530, ["sw_power_cap"], enforced=None),
    ):
        (found,) = throttle_findings([reading(1980), unknown])
        assert found.endswith("sw_power_cap, 23% below the run's highest 1980 MHz")
    # A lowered limit holding the clock is no slowdown; a thermal reason beside the cap still is one.
    assert throttle_findings([reading(1980), reading(1900, ["sw_power_cap"], enforced=500)]) == []
    (thermal,) = throttle_findings([reading(1980), reading(1500, ["sw_power_cap", "sw_thermal_slowdown"])])
    assert thermal.endswith("sw_thermal_slowdown, 24% below the run's highest 1980 MHz")


def test_an_idle_gpus_low_clock_is_not_throttling() -> None:
    idle_by_driver = reading(345, ["gpu_idle"], utilization=None)
    idle_by_utilization = reading(210, [], utilization=0)
    unknown = reading(300, None, utilization=None)  # neither the mask nor the utilization: not judged
    assert throttle_findings([reading(1980), idle_by_driver, idle_by_utilization, unknown]) == []
    assert not unknown.busy and idle_by_driver.idle and idle_by_utilization.idle


def test_the_verdict_names_three_readings_then_counts_the_rest() -> None:
    clocks = GpuClocks([reading(1980)] + [reading(1500, elapsed_s=t) for t in (10, 20, 30, 40, 50)])
    reason = clocks.throttled_reason
    assert reason.count("SM 1500 MHz") == 3 and reason.endswith("; and 2 more reading(s)")
    assert GpuClocks([reading(1980), reading(1900)]).throttled_reason is None


# --------------------------------------------------------------------------------------------
# Taken with the host load
# --------------------------------------------------------------------------------------------
def clock_probes(found: list[GpuReading | str], clocks: list[float]) -> HostProbes:
    readings, ticks = iter(found), iter(clocks)
    return HostProbes(loadavg=lambda: (0.1, 0.1, 0.1), cpu_count=lambda: 64, own_cpu_s=lambda: 0.0,
                      process_age_s=lambda: None, clock=lambda: next(ticks),
                      gpu_processes=lambda: NO_GPU, gpu_clocks=lambda: next(readings))  # fmt: skip


def test_the_clocks_are_read_with_the_gpu_listing_and_warned_of_once() -> None:
    found = ["nvidia-smi not found", reading(1980), reading(1500), reading(1450)]
    warnings: list[str] = []
    host = start_host_load(clock_probes(found, [0, 0, 5, 10, 20, 30]), warn=warnings.append)
    assert (host.gpu_clocks.readings, host.gpu_clocks.note) == ([], "nvidia-smi not found")
    for _ in range(4):  # 5 s: not read (GPU_QUERY_INTERVAL_S); 10, 20, 30 s: read
        host.sample()
    assert [r.elapsed_s for r in host.gpu_clocks.readings] == [10.0, 20.0, 30.0]
    assert host.gpu_clocks.note is None and not host.busy  # throttled is not busy: its own verdict
    assert warnings == [throttle_warning("SM 1500 MHz at 20 s (60 C, 500/700 W): 24% below the run's "
                                         "highest 1980 MHz")]  # fmt: skip


def test_a_cpu_run_records_no_gpu_and_prints_no_clock_line() -> None:
    host = start_host_load(HostProbes(loadavg=lambda: (0.1, 0.1, 0.1), cpu_count=lambda: 8))
    assert host.gpu_clocks == GpuClocks(note=NO_GPU) and gpu_clocks_line(host) is None
    assert gpu_clocks_line(None) is None


# --------------------------------------------------------------------------------------------
# The reports
# --------------------------------------------------------------------------------------------
SETTINGS = {"model": "tiny", "engine": "vllm", "prompt_len": 8, "gen_len": 8, "repeats": 3,
            "formats": ["bf16"], "one_engine_per_format": True, "e2e_shape": None}  # fmt: skip


def report(clocks: GpuClocks | None) -> BenchResult:
    load = HostLoad(cpu_count=64, samples=1, gpu_processes=[], gpu_clocks=clocks)
    row = {"format": "bf16", "lora_rank": 0, "batch": 8, "backend": "default",
           "output_tokens_per_s": 10500.0, "prefill_tokens_per_s": 1000.0,
           "decode_ms_per_token": 1.0}  # fmt: skip
    return BenchResult(schema=SCHEMA, created="2026-11-29T00:00:00+00:00", device="gpu",
                       figures_label="GPU figures", machine={"cpu_count": 64}, gpu=None, versions={},
                       settings=dict(SETTINGS), rollout=[row], host_load=load)  # fmt: skip


def terminal(result: BenchResult) -> str:
    console = Console(record=True, width=400)
    console.print(bench_table(result))
    return console.export_text()


def test_an_unthrottled_run_prints_one_clock_summary_line() -> None:
    readings = [reading(1980, temperature=52), reading(1855, temperature=71),
                reading(345, ["gpu_idle"], utilization=0, temperature=55)]  # fmt: skip
    line = ("GPU clocks: SM 1980 MHz at start (max 1980), 345-1980 MHz across 3 readings (1 idle), 52-71 C, "
            "no slowdown reason.")  # fmt: skip
    result = report(GpuClocks(readings))
    assert gpu_clocks_line(result.host_load) == (line, False)
    assert line in terminal(result) and f"\n{line}\n" in to_markdown(result)
    unknown = GpuClocks([GpuReading(0.0, None, None, None, None, None, None, None)])
    assert clocks_line(unknown) == "GPU clocks: SM clock unknown across 1 reading, slowdown reasons unknown."
    assert clocks_line(GpuClocks(note="nvidia-smi not found")) == "GPU clocks unknown (nvidia-smi not found)."
    idle_cap = GpuClocks([reading(1980), reading(345, ["gpu_idle", "sw_power_cap"], utilization=0)])
    assert clocks_line(idle_cap).endswith("(1 idle), 60 C, slowdown reasons only while idle.")
    # A board at its default power limit under load: not throttled, and the summary says where it sat.
    update = GpuClocks([reading(1980), reading(1530, ["sw_power_cap"]), reading(1875, ["sw_power_cap"]),
                        reading(345, ["gpu_idle", "sw_power_cap"], utilization=0)])  # fmt: skip
    assert update.throttled_reason is None
    assert clocks_line(update).endswith(
        "(1 idle), 60 C, at its power limit in 2 working readings (SM 1530-1875 MHz)."
    )


def clocks_line(clocks: GpuClocks) -> str:
    found = gpu_clocks_line(report(clocks).host_load)
    assert found is not None
    return found[0]


def test_a_throttled_run_prints_the_warning_at_the_top_naming_the_readings() -> None:
    result = report(GpuClocks([reading(1980), reading(1410, ["hw_thermal_slowdown"], elapsed_s=340)]))
    line = (
        "Warning: GPU throttled: SM 1410 MHz at 340 s (60 C, 500/700 W): hw_thermal_slowdown, 29% below the "
        "run's highest 1980 MHz; these figures are not comparable with an unthrottled run's."
    )
    assert gpu_clocks_line(result.host_load) == (line, True)
    assert line in terminal(result) and "GPU clocks:" not in terminal(result)
    markdown = to_markdown(result)
    assert f"**{line}**" in markdown and markdown.index(line) < markdown.index("Host: 64 CPUs")


def test_the_clocks_round_trip_through_bench_json(tmp_path: Path) -> None:
    capped = reading(1500, ["sw_power_cap"], elapsed_s=12.5, enforced=500.0)
    clocks = GpuClocks([reading(1980, elapsed_s=0.0), capped,
                        GpuReading(20.0, 345, None, None, None, None, None, None)])  # fmt: skip
    assert GpuClocks.from_dict(json.loads(json.dumps(clocks.to_dict()))) == clocks
    result = report(clocks)
    write_json(result, tmp_path)
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    written = on_disk["host_load"]["gpu_clocks"]
    assert written["throttled"] is True and written["throttled_reason"] == clocks.throttled_reason
    assert written["drop_fraction"] == CLOCK_DROP_FRACTION and len(written["readings"]) == 3
    assert written["readings"][1]["reasons"] == ["sw_power_cap"] and "note" not in written
    again = read_report(tmp_path)
    assert again == result and json.dumps(again.to_dict()) == json.dumps(on_disk)


def test_a_bench_json_from_before_the_clocks_reads_and_writes_back_unchanged(tmp_path: Path) -> None:
    old = report(None).to_dict()
    assert "gpu_clocks" not in old["host_load"]  # the layout before the clocks were read
    (tmp_path / "bench.json").write_text(json.dumps(old))
    read = read_report(tmp_path)
    assert read.host_load is not None and read.host_load.gpu_clocks is None
    assert json.dumps(read.to_dict()) == json.dumps(old) and gpu_clocks_line(read.host_load) is None
    assert "GPU clocks" not in to_markdown(read) and "GPU throttled" not in to_markdown(read)


def test_gating_from_or_against_a_throttled_run_warns_but_does_not_fail() -> None:
    throttled = GpuClocks([reading(1980), reading(1410, ["hw_thermal_slowdown"], elapsed_s=340)])
    unthrottled = GpuClocks([reading(1980), reading(1950)])
    against = report(unthrottled)
    against.regression = check_regressions(against, report(throttled), 0.1)
    assert (
        against.regression.passed and against.regression.baseline_gpu_throttled == throttled.throttled_reason
    )
    assert against.regression.to_dict()["baseline_gpu_throttled"] == throttled.throttled_reason
    caveat = gate_caveat(against)
    assert caveat.startswith(
        "the regression gate's comparison is not clean: the baseline's GPU was throttled"
    )
    assert "this run's" not in caveat
    from_throttled = report(throttled)
    from_throttled.regression = check_regressions(from_throttled, report(unthrottled), 0.1)
    assert "this run's GPU was throttled (SM 1410 MHz at 340 s" in gate_caveat(from_throttled)
    # Neither throttled: a clean comparison, and no new key in the regression section.
    clean = report(unthrottled)
    clean.regression = check_regressions(clean, report(unthrottled), 0.1)
    assert gate_caveat(clean) is None and "baseline_gpu_throttled" not in clean.regression.to_dict()

"""A benchmark knows when its host was busy: the rule at its edges, the sampling with fake readings, what
a busy run's reports carry, and the gate's warning (old reports without the fields still read and gate)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
from rich.console import Console

from qerl_cli.bench import header
from qerl_cli.bench.gate import check_regressions, gate_caveat
from qerl_cli.bench.hostload import (
    NO_GPU,
    GpuProcess,
    GpuScan,
    HostLoad,
    HostProbes,
    LoadSample,
    busy_reasons,
    busy_warning,
    nvidia_smi_processes,
    owner,
    parse_compute_apps,
    start_host_load,
)
from qerl_cli.bench.report import bench_table, to_markdown
from qerl_cli.bench.result import SCHEMA, BenchResult, read_report, write_json

GPU_UUID = "GPU-1a2b3c4d-0000-1111-2222-333344445555"


def sample(load_1m: float, own_1m: float = 0.0, elapsed_s: float = 0.0) -> LoadSample:
    return LoadSample(elapsed_s, load_1m, load_1m, load_1m, own_1m)


def host(load_1m: float | None, cpus: int | None = 64, own_1m: float = 0.0,
         gpu: list[GpuProcess] | None = None) -> HostLoad:  # fmt: skip
    reading = None if load_1m is None else sample(load_1m, own_1m)
    return HostLoad(cpu_count=cpus, start=reading, end=reading, peak=reading, samples=1, gpu_processes=gpu)


# --------------------------------------------------------------------------------------------
# The rule
# --------------------------------------------------------------------------------------------
def test_the_load_rule_is_strictly_above_half_the_cpus_of_other_processes_load() -> None:
    assert busy_reasons(host(32.0)) == []  # exactly half of 64: not busy
    (reason,) = busy_reasons(host(32.01))
    assert reason.startswith("1-minute load of other processes 32.0 on 64 CPUs (busy above 32")
    # This run's own share does not count: a CPU benchmark keeping its cores busy is not a busy host.
    assert busy_reasons(host(40.0, own_1m=8.0)) == []
    assert busy_reasons(host(40.0, own_1m=7.9)) != []
    # No load average or no CPU count: the load cannot make a run busy.
    assert busy_reasons(host(None)) == [] and busy_reasons(host(500.0, cpus=None)) == []


def test_another_process_on_the_measured_gpu_makes_a_run_busy_an_unknown_list_does_not() -> None:
    assert busy_reasons(host(1.0, gpu=[])) == [] and busy_reasons(host(1.0, gpu=None)) == []
    (one,) = busy_reasons(host(1.0, gpu=[GpuProcess(4242, 20480)]))
    assert one == "1 other process on the measured GPU (pid 4242, 20480 MiB)"
    both = busy_reasons(host(48.0, gpu=[GpuProcess(7, None), GpuProcess(8, 100)]))
    assert len(both) == 2 and both[1] == "2 other processes on the measured GPU (pid 7; pid 8, 100 MiB)"


def test_the_warning_says_what_was_busy_and_that_the_figures_are_not_comparable() -> None:
    assert busy_warning("X") == "host busy: X; these figures are not comparable with an idle run's"


# --------------------------------------------------------------------------------------------
# Sampling, with fake readings
# --------------------------------------------------------------------------------------------
class FakeHost:
    """Readings in turn: each sample takes the next load, clock, own CPU seconds and GPU list."""

    def __init__(self, loads: Iterable[float], clocks: Iterable[float], cpu: Iterable[float],
                 gpus: Iterable[GpuScan | str] | None = None, cpus: int = 4) -> None:  # fmt: skip
        self.loads, self.clocks, self.cpu = iter(loads), iter(clocks), iter(cpu)
        self.gpus = iter(gpus) if gpus is not None else None
        self.cpus = cpus
        self.warnings: list[str] = []

    def probes(self) -> HostProbes:
        def load() -> tuple[float, float, float]:
            one = next(self.loads)
            return one, one / 2, one / 4

        return HostProbes(
            loadavg=load,
            cpu_count=lambda: self.cpus,
            own_cpu_s=lambda: next(self.cpu),
            process_age_s=lambda: None,
            clock=lambda: next(self.clocks),
            gpu_processes=(lambda: next(self.gpus)) if self.gpus is not None else (lambda: NO_GPU),
        )

    def start(self) -> HostLoad:
        return start_host_load(self.probes(), warn=self.warnings.append)


def test_samples_keep_the_start_the_end_and_the_busiest_and_warn_once() -> None:
    fake = FakeHost(loads=[1.0, 2.5, 3.0, 1.5], clocks=[0, 0, 10, 20, 30], cpu=[0, 0, 0, 0, 0])
    load = fake.start()
    assert (load.start.load_1m, load.busy, fake.warnings) == (1.0, False, [])
    for _ in range(3):
        load.sample()
    assert (load.start.load_1m, load.end.load_1m, load.peak.load_1m, load.samples) == (1.0, 1.5, 3.0, 4)
    assert (load.end.elapsed_s, load.peak.elapsed_s) == (30.0, 20.0)
    # Busy from the 2.5 on 4 CPUs on; the warning is printed once, the verdict stays.
    assert load.busy and load.busy_reason.startswith("1-minute load of other processes 3.0 on 4 CPUs")
    assert fake.warnings == [
        busy_warning("1-minute load of other processes 2.5 on 4 CPUs (busy above 2, at 10 s)")
    ]
    assert load.verdict() == {"host_busy": True, "host_busy_reason": load.busy_reason}


def test_this_runs_own_cpu_use_is_taken_out_of_the_load_as_the_kernel_averages_it() -> None:
    # 60 s at two cores' worth of CPU: the 1-minute average of this run's own load is 2 (1 - 1/e).
    fake = FakeHost(loads=[0.0, 3.0], clocks=[0, 0, 60], cpu=[0, 0, 120])
    load = fake.start()
    load.sample()
    assert load.end.own_1m == pytest.approx(2 * (1 - math.exp(-1)), abs=0.01)
    assert load.end.others_1m == pytest.approx(3.0 - load.end.own_1m, abs=0.01) and not load.busy


def test_the_gpus_other_processes_are_unknown_until_listed_then_every_one_seen_is_kept() -> None:
    gpus = ["nvidia-smi not found", GpuScan([GpuProcess(9, 100)]),
            GpuScan([GpuProcess(9, 300), GpuProcess(3, None)]), "gone"]  # fmt: skip
    fake = FakeHost(loads=[0.1] * 4, clocks=range(0, 50, 10), cpu=[0] * 5, gpus=gpus)
    load = fake.start()
    assert (load.gpu_processes, load.gpu_note, load.busy) == (None, "nvidia-smi not found", False)
    for _ in range(3):
        load.sample()
    assert load.gpu_processes == [GpuProcess(3, None), GpuProcess(9, 300)] and load.gpu_note is None
    assert load.busy_reason == "2 other processes on the measured GPU (pid 3; pid 9, 300 MiB)"
    assert len(fake.warnings) == 1  # busy from the second sample on, warned once


def test_processes_outside_this_pid_namespace_are_recorded_and_not_counted(tmp_path: Path) -> None:
    # A container: nvidia-smi gives the host's pids, among them maybe this run's own.
    gpus = [GpuScan(unseen=[GpuProcess(40170, 185)]), GpuScan(), GpuScan()]
    load = FakeHost(loads=[0.1] * 3, clocks=range(0, 40, 10), cpu=[0] * 4, gpus=gpus).start()
    load.sample()
    assert (load.gpu_processes, load.gpu_unseen, load.busy) == ([], [GpuProcess(40170, 185)], False)
    idle = report(14500.0, load)
    write_json(idle, tmp_path)
    assert read_report(tmp_path) == idle and "1 outside this PID namespace (not counted)" in to_markdown(idle)


def test_the_gpu_is_listed_at_the_first_sample_then_at_most_every_ten_seconds() -> None:
    gpus = [GpuScan(), GpuScan([GpuProcess(5, 1)]), GpuScan([GpuProcess(6, 1)])]
    fake = FakeHost(loads=[0.1] * 4, clocks=[0, 0, 9.9, 10, 19.9], cpu=[0] * 5, gpus=gpus)
    load = fake.start()  # listed at 0
    load.sample()  # 9.9 s: not yet
    assert load.gpu_processes == []
    load.sample()  # 10 s: listed
    load.sample()  # 19.9 s: not yet (a third listing would be pid 6)
    assert load.gpu_processes == [GpuProcess(5, 1)] and load.samples == 4


def test_the_default_warning_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    probes = FakeHost(loads=[9.0], clocks=[0, 0], cpu=[0, 0], cpus=2).probes()
    start_host_load(probes)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("[bench] warning: host busy: 1-minute load")


def test_a_platform_without_a_load_average_records_none_and_is_not_busy() -> None:
    def no_load() -> tuple[float, float, float]:
        raise OSError("no load average")

    probes = HostProbes(
        loadavg=no_load, cpu_count=lambda: 8, own_cpu_s=lambda: 0.0, process_age_s=lambda: None
    )
    load = start_host_load(probes, warn=pytest.fail)
    assert (load.start, load.samples, load.busy) == (None, 1, False)


# --------------------------------------------------------------------------------------------
# nvidia-smi
# --------------------------------------------------------------------------------------------
def test_compute_apps_are_filtered_to_the_measured_gpu_and_to_other_processes() -> None:
    text = (
        f"100, 20480, {GPU_UUID}\n"
        "101, 512, GPU-ffffffff-0000-1111-2222-333344445555\n"  # another GPU of the host
        f"102, [N/A], {GPU_UUID.lower()}\n"
        f"555, 1024, {GPU_UUID}\n"  # this run's own worker
        "not a line\n"
    )
    found = parse_compute_apps(text, GPU_UUID.removeprefix("GPU-"))
    assert found == [GpuProcess(100, 20480), GpuProcess(102, None), GpuProcess(555, 1024)]


def test_this_process_and_its_descendants_are_ours_a_pid_this_namespace_lacks_is_unseen() -> None:
    parents = {30: 20, 20: 10, 10: 1, 40: 1, 50: 51, 51: 50}
    assert owner(10, 10, parents.get) == owner(30, 10, parents.get) == "ours"
    assert owner(40, 10, parents.get) == owner(50, 10, parents.get) == "other"  # a cycle ends
    assert owner(40170, 10, parents.get) == "unseen"


def test_nvidia_smi_splits_the_measured_gpus_processes_by_owner() -> None:
    me = os.getpid()
    listing = f"{me}, 900, {GPU_UUID}\n{me + 1}, 64, {GPU_UUID}\n77777777, 185, {GPU_UUID}\n"
    parents = {me: 1, me + 1: 1}

    def run(query: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(query, 0, listing, "")

    scan = nvidia_smi_processes(
        GPU_UUID, run=run, which=lambda name: "/usr/bin/nvidia-smi", parent_of=parents.get
    )
    assert scan == GpuScan(others=[GpuProcess(me + 1, 64)], unseen=[GpuProcess(77777777, 185)])


def test_without_nvidia_smi_the_processes_are_unknown_not_an_error() -> None:
    def run(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        raise AssertionError("nvidia-smi must not run")

    assert nvidia_smi_processes(GPU_UUID, run=run, which=lambda name: None) == "nvidia-smi not found"
    assert nvidia_smi_processes(None, run=run).startswith("the measured GPU's UUID is unknown")


def test_nvidia_smi_failures_are_recorded_as_unknown() -> None:
    def failing(rc: int, out: str) -> object:
        return lambda query, **kwargs: subprocess.CompletedProcess(query, rc, out, "driver mismatch")

    def hangs(query: list[str], **kwargs: object) -> object:
        raise subprocess.TimeoutExpired(query, 10)

    which = lambda name: "/usr/bin/nvidia-smi"  # noqa: E731
    assert (
        nvidia_smi_processes(GPU_UUID, run=failing(9, ""), which=which)
        == "nvidia-smi exited 9: driver mismatch"
    )
    assert nvidia_smi_processes(GPU_UUID, run=hangs, which=which).startswith("nvidia-smi failed:")
    listed = nvidia_smi_processes(GPU_UUID, run=failing(0, f"1, 64, {GPU_UUID}\n"), which=which)
    assert listed == GpuScan(others=[GpuProcess(1, 64)])  # pid 1 (init) is never this run's


# --------------------------------------------------------------------------------------------
# What a busy run's reports carry
# --------------------------------------------------------------------------------------------
SETTINGS = {"model": "tiny", "engine": "vllm", "prompt_len": 8, "gen_len": 8, "repeats": 3,
            "formats": ["bf16"], "one_engine_per_format": True, "e2e_shape": None}  # fmt: skip


def report(tokens_per_s: float, load: HostLoad | None) -> BenchResult:
    row = {"format": "bf16", "lora_rank": 0, "batch": 8, "backend": "default",
           "output_tokens_per_s": tokens_per_s, "prefill_tokens_per_s": 1000.0,
           "decode_ms_per_token": 1.0}  # fmt: skip
    return BenchResult(schema=SCHEMA, created="2026-11-28T00:00:00+00:00", device="gpu",
                       figures_label="GPU figures", machine={"cpu_count": 64}, gpu=None, versions={},
                       settings=dict(SETTINGS), rollout=[row], host_load=load)  # fmt: skip


def busy_load() -> tuple[HostLoad, list[str]]:
    fake = FakeHost(loads=[43.0, 29.0], clocks=[0, 0, 100], cpu=[0, 0, 1], cpus=64)
    return fake.start(), fake.warnings


def test_a_busy_runs_bench_json_carries_the_flag_the_reason_and_the_load(tmp_path: Path) -> None:
    load, warnings = busy_load()
    busy = report(6900.0, load)
    write_json(busy, tmp_path)  # samples again: the run's end
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert on_disk["host_busy"] is True and on_disk["host_busy_reason"] == load.busy_reason
    assert "1-minute load of other processes 43.0 on 64 CPUs" in on_disk["host_busy_reason"]
    host_load = on_disk["host_load"]
    assert (host_load["cpu_count"], host_load["samples"], host_load["busy_fraction"]) == (64, 2, 0.5)
    assert (host_load["start"]["load_1m"], host_load["end"]["load_1m"], host_load["peak"]["load_1m"]) == (
        43,
        29,
        43,
    )
    assert host_load["gpu_processes"] is None and host_load["gpu_note"] == NO_GPU
    assert read_report(tmp_path) == busy and json.dumps(read_report(tmp_path).to_dict()) == json.dumps(
        on_disk
    )
    assert warnings == [busy_warning(load.busy_reason)]
    # The table and bench.md say it too.
    console = Console(record=True, width=300)
    console.print(bench_table(busy))
    line = f"Warning: {busy_warning(load.busy_reason)}."
    assert line in console.export_text() and f"**{line}**" in to_markdown(busy)
    assert "Host: 64 CPUs, 1-minute load 43.0 at the start, 29.0 at the end" in to_markdown(busy)


def test_an_idle_run_says_nothing_of_a_busy_host(tmp_path: Path) -> None:
    idle = report(14500.0, FakeHost(loads=[3.0, 4.0], clocks=[0, 0, 9], cpu=[0, 0, 0], cpus=64).start())
    write_json(idle, tmp_path)
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert (on_disk["host_busy"], on_disk["host_busy_reason"]) == (False, None)
    assert "host busy" not in to_markdown(idle) and "Host: 64 CPUs" in to_markdown(idle)


def test_every_other_benchmarks_json_samples_at_each_write(tmp_path: Path) -> None:
    data = header.report_header("qerl-test/1", "qerl bench kernels")
    assert list(data)[-3:] == ["host_busy", "host_busy_reason", "host_load"]
    data["host_load"], warnings = busy_load()
    header.write_report(tmp_path / "kernels.json", data)
    on_disk = json.loads((tmp_path / "kernels.json").read_text())
    assert on_disk["host_busy"] is True and data["host_busy"] is True  # the caller's dict is renewed
    assert on_disk["host_load"]["samples"] == 2 and len(warnings) == 1


# --------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------
def test_an_old_bench_json_without_the_fields_still_reads_and_gates(tmp_path: Path) -> None:
    old = report(14500.0, None).to_dict()
    assert "host_busy" not in old and "host_load" not in old  # the layout before they were recorded
    (tmp_path / "bench.json").write_text(json.dumps(old))
    baseline = read_report(tmp_path)
    assert baseline.host_load is None and baseline.host_busy_reason is None
    assert json.dumps(baseline.to_dict()) == json.dumps(old)
    now = report(14400.0, None)
    now.regression = check_regressions(now, baseline, 0.1)
    assert now.regression.passed and now.regression.baseline_host_busy is None and gate_caveat(now) is None
    assert "baseline_host_busy" not in now.regression.to_dict()


def test_gating_from_or_against_a_busy_run_warns_but_does_not_fail() -> None:
    busy, _ = busy_load()
    idle = FakeHost(loads=[1.0], clocks=[0, 0], cpu=[0, 0], cpus=64).start()
    against_busy = report(14500.0, idle)
    against_busy.regression = check_regressions(against_busy, report(6900.0, busy), 0.1)
    assert against_busy.regression.passed and against_busy.regression.baseline_host_busy == busy.busy_reason
    caveat = gate_caveat(against_busy)
    assert caveat.startswith(
        "the regression gate's comparison is not clean: the baseline's host was busy (1-minute"
    )
    assert "this run's" not in caveat
    assert against_busy.regression.to_dict()["baseline_host_busy"] == busy.busy_reason

    from_busy = report(6900.0, busy)
    from_busy.regression = check_regressions(from_busy, report(14500.0, idle), 0.1)
    assert (
        not from_busy.regression.passed and len(from_busy.regression.failures) == 1
    )  # the drop is still named
    assert "this run's host was busy" in gate_caveat(from_busy)
    assert f"Warning: {gate_caveat(from_busy)}" in to_markdown(from_busy)


def test_bench_md_says_what_the_final_bench_json_says_though_the_load_moves(tmp_path: Path) -> None:
    """The run's outputs are written as bench.json, bench.md, then bench.json again listing the files:
    the second write takes no new sample, so the host line of bench.md is the final file's (a load that
    moved between the writes made them differ, and the tests comparing them fail on a busy machine)."""
    from qerl_cli.bench import run as bench_run_module
    from qerl_cli.bench.result import new_report
    from qerl_cli.bench.settings import BenchConfig

    fake = FakeHost(loads=[1.0, 2.0, 3.0, 4.0, 5.0], clocks=[0, 0, 10, 20, 30, 40], cpu=[0] * 6)
    report = new_report({"model": "tiny", "engine": "hf", "prompt_len": 4, "gen_len": 2, "repeats": 1})
    report.host_load = fake.start()
    bench_run_module._write_outputs(BenchConfig(), "hf", report, tmp_path, {})
    on_disk = read_report(tmp_path)
    assert (tmp_path / "bench.md").read_text() == to_markdown(on_disk)
    assert on_disk.host_load is not None and on_disk.host_load.end.load_1m == 2.0  # one sample: the end

"""A report records the machine by what its figures depend on, never by the machine's name."""

from __future__ import annotations

import socket

import pytest

from qerl_cli import envinfo
from qerl_cli.bench import header
from qerl_cli.bench.report import to_markdown
from qerl_cli.bench.report_host import machine_line
from qerl_cli.bench.result import new_report


def test_machine_info_has_the_cores_and_memory_not_the_host_name() -> None:
    info = header.machine_info()
    assert "hostname" not in info
    assert info["cpu_count"] and info["cpu_count"] >= 1
    assert socket.gethostname() not in {str(value) for value in info.values()}


def test_the_markdown_names_cores_memory_gpu_and_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = {"name": "NVIDIA H100 80GB HBM3", "count": 2, "memory_bytes": 80 * 2**30, "capability": "9.0",
           "cuda": "12.8", "driver": "570.86.15"}  # fmt: skip
    monkeypatch.setattr("qerl_cli.bench.result.gpu_summary", lambda: gpu)
    settings = {"model": "tiny", "engine": "hf", "prompt_len": 8, "gen_len": 8, "repeats": 3}
    report = new_report(settings, command="qerl bench rollout")
    report.machine = {"cpu_count": 16, "ram_bytes": 128 * 2**30, "platform": "Linux", "processor": "x86_64"}
    text = to_markdown(report)
    assert "Machine: 16 CPUs, 128 GiB RAM, GPU: NVIDIA H100 80GB HBM3 x2, CUDA 12.8, driver 570.86.15" in text
    # A report written before the memory was recorded still reads.
    assert machine_line({"cpu_count": 16}) == "16 CPUs"
    report.machine["cpu_model"] = "AMD EPYC 9654 96-Core Processor"
    assert "Machine: 16 CPUs (AMD EPYC 9654 96-Core Processor), 128 GiB RAM, GPU: NVIDIA H100" in to_markdown(
        report
    )


def test_the_cpu_model_is_the_kernels_model_name(tmp_path) -> None:
    """A host-bound rollout runs at one core's speed: the report names the CPU."""
    cpuinfo = tmp_path / "cpuinfo"
    epyc = "AMD EPYC 9654 96-Core Processor"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: {epyc}\n")
    assert header.cpu_model(str(cpuinfo)) == epyc
    cpuinfo.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")  # e.g. an Arm kernel: no model name
    assert header.cpu_model(str(cpuinfo)) is None
    assert header.cpu_model(str(tmp_path / "absent")) is None
    assert "cpu_model" in header.machine_info()


def test_the_driver_is_read_from_the_kernel_module_without_nvml(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(envinfo, "_nvml_driver", lambda: None)
    version_file = tmp_path / "version"
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 16 2025\n")
    monkeypatch.setattr(envinfo, "_NVIDIA_PROC_VERSION", str(version_file))
    assert envinfo.gpu_driver() == "570.86.15"
    monkeypatch.setattr(envinfo, "_NVIDIA_PROC_VERSION", str(tmp_path / "absent"))
    assert envinfo.gpu_driver() is None


def test_the_vllm_variables_that_change_the_figures_are_recorded_and_shown() -> None:
    """The same bench command ran 6.8k tok/s with vLLM's engine core in the process and 8.8k with it in its
    own (VLLM_ENABLE_V1_MULTIPROCESSING=1); nothing else in the report told the two rows apart."""
    environ = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_SITE": "/somewhere", "PATH": "/usr/bin"}
    assert header.engine_environment(environ) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert header.engine_environment({}) == {}
    machine = {"cpu_count": 16, "engine_environment": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}
    assert machine_line(machine) == "16 CPUs, environment VLLM_ENABLE_V1_MULTIPROCESSING=1"
    assert machine_line({"cpu_count": 16, "engine_environment": {}}) == "16 CPUs"

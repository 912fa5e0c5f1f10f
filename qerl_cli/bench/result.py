"""What ``qerl bench rollout``, ``concurrency`` and ``e2e`` measured: :class:`BenchResult`, the typed
form of ``bench.json`` (the environment comes from :mod:`qerl_cli.bench.header`).

Layout of ``bench.json`` (``SCHEMA``), in the order of the file:

* ``schema``, ``created``, ``command`` (the ``qerl bench`` command line; absent in files of qerl before
  the bench subcommands), ``device`` (``"gpu"`` or ``"cpu"``) and ``figures_label``, which says how far
  the figures can be trusted (CPU figures are only good for ratios between formats of the same run);
* ``host_busy`` and ``host_busy_reason``: whether other work on the host or the GPU made the figures
  incomparable with an idle run's (:mod:`qerl_cli.bench.hostload`'s rule; absent in earlier files);
* ``machine``, ``host_load`` (the load, the GPU's other processes and its clocks, ``gpu_clocks``, with
  whether it was throttled: :mod:`qerl_cli.bench.gpuclocks`; sampled at the start, after every case and
  at the end, with the readings each case took under load; absent in earlier files, as is ``gpu_clocks``
  in files from before it was read), ``gpu`` (None on CPU), ``versions``, ``settings``;
* ``rollout``: one row per (format, backend, LoRA rank, batch) with throughput and latency, and on a GPU
  ``gpu_clocks``, the measured GPU's clocks while the row's generations ran
  (:class:`~qerl_cli.bench.gpusampler.CaseClocks`; absent in earlier files), as on an ``e2e`` row (its
  timed steps);
* ``memory``: one row per (format, backend, LoRA rank) with weight bytes, peaks, KV-cache budget and
  how they were measured;
* ``e2e``: one row per (format, linear backend) pair of ``qerl bench e2e`` with GRPO step seconds per
  phase, its ``format`` and ``backend`` (the name the pair ran under; rows of earlier versions have
  no ``backend``: :func:`~qerl_cli.bench.labels.row_backend`) and the step time against BF16's
  (``None`` for the other benchmarks);
* ``regression``: the outcome of ``--baseline`` (``None`` without it; ``baseline_host_busy`` when the
  baseline's host was busy, ``baseline_gpu_throttled`` when its GPU was throttled);
* ``errors``: the cases that produced no figures, with why;
* ``complete: false`` while the run is still measuring (the file is rewritten after every case);
* ``timings``: seconds of the whole measurement, of writing the random checkpoints, of each format
  (engine start and cases) and of ``--e2e``;
* ``files``: what the run wrote.

The rows stay mappings: their keys differ by engine (a vLLM memory row has a KV-cache budget, an HF
one a process RSS), grow as figures are derived (``speedup_vs_bf16``, ``roofline``), and the gate and
the baseline from disk compare them by name. ``bench.json`` is read by other tools and kept in
committed benchmarks, so ``to_dict`` writes exactly its keys in their order, and ``from_dict`` reads
the files of earlier qerl versions (a ``--baseline``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli import files
from qerl_cli.bench.header import created_now, gpu_summary, machine_info, start_run_host_load, versions
from qerl_cli.bench.hostload import HostLoad
from qerl_cli.envinfo import gpu_info
from qerl_cli.errors import QerlError

SCHEMA = "qerl-bench/1"
REPORT_NAME = "bench.json"


@dataclass
class RegressionOutcome:
    """``--baseline``: how many figures were compared and which regressed beyond the tolerance, and
    whether the baseline's host was busy or its GPU throttled (the reason; the comparison is then not
    clean)."""

    tolerance: float
    compared: int
    failures: list[str]
    passed: bool
    baseline_host_busy: str | None = None
    baseline_gpu_throttled: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"tolerance": self.tolerance, "compared": self.compared, "failures": list(self.failures),
               "passed": self.passed}  # fmt: skip
        if self.baseline_host_busy is not None:
            out["baseline_host_busy"] = self.baseline_host_busy
        if self.baseline_gpu_throttled is not None:
            out["baseline_gpu_throttled"] = self.baseline_gpu_throttled
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegressionOutcome:
        return cls(data["tolerance"], data["compared"], list(data["failures"]), data["passed"],
                   data.get("baseline_host_busy"), data.get("baseline_gpu_throttled"))  # fmt: skip


@dataclass
class BenchTimings:
    """Where the command's wall clock went (for a CI budget)."""

    checkpoints_s: float  # writing the random checkpoints (once per machine)
    formats_s: dict[str, float] = field(default_factory=dict)  # each format: engine start and cases
    e2e_s: float | None = None  # None without --e2e
    total_s: float | None = None  # set when the measurement is done

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoints_s": self.checkpoints_s, "formats_s": dict(self.formats_s), "e2e_s": self.e2e_s,
                "total_s": self.total_s}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchTimings:
        return cls(data["checkpoints_s"], dict(data.get("formats_s") or {}), data.get("e2e_s"),
                   data.get("total_s"))  # fmt: skip


@dataclass
class BenchFiles:
    """The files a finished run wrote."""

    json: str
    markdown: str | None = None
    charts: list[str] = field(default_factory=list)
    crossover: str | None = None  # --concurrency on vLLM only

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"json": self.json, "markdown": self.markdown, "charts": list(self.charts)}
        if self.crossover is not None:
            out["crossover"] = self.crossover
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchFiles:
        return cls(data["json"], data.get("markdown"), list(data.get("charts") or []), data.get("crossover"))


_BENCH_KEYS = (
    "schema", "created", "command", "device", "figures_label", "host_busy", "host_busy_reason", "machine",
    "host_load", "gpu", "versions", "settings", "rollout", "memory", "e2e", "regression", "errors",
    "complete", "timings", "files",
)  # fmt: skip


@dataclass
class BenchResult:
    """A bench run's report (``bench.json``): the environment and settings, then the figures."""

    schema: str
    created: str
    device: str  # "gpu" or "cpu"
    figures_label: str
    machine: dict[str, Any]
    gpu: dict[str, Any] | None
    versions: dict[str, str | None]
    settings: dict[str, Any]  # the run's settings, by name (the gate compares some with the baseline's)
    rollout: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    e2e: list[dict[str, Any]] | None = None
    regression: RegressionOutcome | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    complete: bool | None = None  # False in the file rewritten while measuring; absent when done
    timings: BenchTimings | None = None
    files: BenchFiles | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as read
    command: str | None = None  # the command line; None in the files of earlier versions
    host_load: HostLoad | None = None  # None in the files of earlier versions

    @property
    def host_busy_reason(self) -> str | None:
        """What made the host busy during the run; None when it was idle or not recorded."""
        return self.host_load.busy_reason if self.host_load else None

    @property
    def gpu_throttled_reason(self) -> str | None:
        """Which readings showed the measured GPU throttled; None when none did or none were taken."""
        clocks = self.host_load.gpu_clocks if self.host_load else None
        return clocks.throttled_reason if clocks else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": self.schema,
            "created": self.created,
            **({"command": self.command} if self.command is not None else {}),
            "device": self.device,
            "figures_label": self.figures_label,
            **(self.host_load.verdict() if self.host_load else {}),
            "machine": self.machine,
            **({"host_load": self.host_load.to_dict()} if self.host_load else {}),
            "gpu": self.gpu,
            "versions": self.versions,
            "settings": self.settings,
            "rollout": self.rollout,
            "memory": self.memory,
            "e2e": self.e2e,
            "regression": self.regression.to_dict() if self.regression else None,
            "errors": self.errors,
        }
        if self.complete is not None:
            out["complete"] = self.complete
        if self.timings is not None:  # written once the measurement is done (older files lack it)
            out["timings"] = self.timings.to_dict()
        if self.files is not None:
            out["files"] = self.files.to_dict()
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchResult:
        regression, timings, written = data.get("regression"), data.get("timings"), data.get("files")
        host = data.get("host_load")
        return cls(
            schema=data["schema"],
            created=data.get("created", ""),
            device=data.get("device", ""),
            figures_label=data.get("figures_label", ""),
            machine=dict(data.get("machine") or {}),
            gpu=data.get("gpu"),
            versions=dict(data.get("versions") or {}),
            settings=dict(data.get("settings") or {}),
            rollout=list(data.get("rollout") or []),
            memory=list(data.get("memory") or []),
            e2e=data.get("e2e"),
            regression=RegressionOutcome.from_dict(regression) if regression else None,
            errors=list(data.get("errors") or []),
            complete=data.get("complete"),
            timings=BenchTimings.from_dict(timings) if timings else None,
            files=BenchFiles.from_dict(written) if written else None,
            extra={key: value for key, value in data.items() if key not in _BENCH_KEYS},
            command=data.get("command"),
            host_load=HostLoad.from_dict(host, data.get("host_busy_reason")) if host else None,
        )


def report_device() -> str:
    """What a report's ``device`` says of this machine (a baseline must have been measured on the same
    kind): ``gpu`` when CUDA sees one, else ``cpu``."""
    return "gpu" if gpu_info() else "cpu"


def new_report(settings: dict[str, Any], command: str | None = None) -> BenchResult:
    """The report skeleton: the command, environment and settings, no figures yet."""
    gpu = gpu_summary()
    label = (
        f"GPU figures ({gpu['name']})"
        if gpu
        else "CPU figures: only the ratios between formats of this run mean anything; absolute "
        "times say nothing about a GPU"
    )
    return BenchResult(
        schema=SCHEMA,
        created=created_now(),
        device=report_device(),
        figures_label=label,
        machine=machine_info(),
        gpu=gpu,
        versions=versions(),
        settings=settings,
        command=command,
        host_load=start_run_host_load(gpu is not None),
    )


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------
def write_json(report: BenchResult, out_dir: str | Path, *, sample: bool = True) -> Path:
    """``bench.json``; the host load is sampled first (each write follows a case; the last is the run's
    end), in place, so a copy of the report made for a partial write samples the original's. ``sample``
    False: written again without a new sample (the same end, so bench.md, made from the report between
    the two writes, keeps saying what bench.json says)."""
    if sample and report.host_load is not None:
        report.host_load.sample()
    return files.write_json(Path(out_dir) / REPORT_NAME, report.to_dict())


def read_report(path: str | Path) -> BenchResult:
    """Read a ``bench.json`` (the baseline of ``--baseline``), checking it is one."""
    data = files.read_json_report(path, REPORT_NAME, "the bench.json of an earlier `qerl bench` run")
    if data.get("schema") != SCHEMA:
        raise QerlError(f"{path} is not a qerl bench report (expected schema {SCHEMA!r})")
    return BenchResult.from_dict(data)

"""The measured GPU's clocks read while a case runs: :class:`ClockSampler`, a background thread that
reads an :class:`~qerl_cli.bench.gpuclocks.NvidiaSmiClocks` probe every ``SAMPLE_INTERVAL_S`` around
the timed work of one case (a rollout batch in :func:`qerl_cli.bench.engines.measure_case`, the timed
steps of an e2e pair in :func:`qerl_cli.bench.e2e.measure_pair`, each in its child process where vLLM
runs), each reading tagged with the training phase it was taken in (``qerl_cli.rl.phase``: an e2e
step's rollouts and update), the row's summary of what it read (:class:`CaseClocks`, a row's
``gpu_clocks``, with each phase's own figures: :class:`PhaseClocks`), and the hand-over
of every reading to the report's ``host_load.gpu_clocks``, where the run's throttled rule reads them.

The host load's own readings are taken between cases, when the GPU is mostly idle and its clocks say
little about the clocks under load; these are taken under load. This module imports no torch: the
caller builds the probe (:func:`qerl_cli.bench.header.case_clock_sampler`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from qerl_cli.bench.gpuclocks import NVIDIA_SMI_TIMEOUT_S, GpuReading
from qerl_cli.bench.hostload import HostLoad
from qerl_cli.rl.phase import OTHER, ROLLOUT, UPDATE, Phase, phase_state

# One reading is an nvidia-smi subprocess, run on a spare core while the GPU works: cheap next to a
# case of many seconds, and often enough to see a clock fall within one case.
SAMPLE_INTERVAL_S = 5.0
# Stopping waits this long for a reading in flight (nvidia-smi's own timeout bounds it); a hung one
# is left behind in its daemon thread, and what it reads after the stop is not kept.
STOP_TIMEOUT_S = NVIDIA_SMI_TIMEOUT_S
# A row's summary of its case's readings, and the readings themselves on their way to the parent (a
# case's payload or an e2e row; the parent takes them out: take_case_clocks).
ROW_KEY = "gpu_clocks"
READINGS_KEY = "gpu_clock_readings"

Probe = Callable[[], GpuReading | str]
# The training phases a row's summary describes on their own (qerl_cli.rl.phase): generation, where the
# GPU may wait on the host, and the update, where it works at its power cap. ``other`` (the syncs, the
# engine's sleep and wake, bookkeeping, and every reading of a case outside training) is not summarised.
SUMMARISED_PHASES: tuple[Phase, ...] = (ROLLOUT, UPDATE)


@dataclass
class SampledClocks:
    """What one :class:`ClockSampler` read: its start on its clock (``time.monotonic``, one clock for a
    parent and its children), each reading with ``elapsed_s`` from that start, and the last failure."""

    started_clock_s: float
    readings: list[GpuReading] = field(default_factory=list)
    note: str | None = None  # why the last reading failed; None when none did

    def summary(self) -> CaseClocks:
        """The row's summary, from the readings of a working GPU (an idle GPU lowers its own clocks), and
        each summarised phase's from its own readings."""
        busy = [r for r in self.readings if r.busy]
        sm = _known([r.sm_mhz for r in busy])
        temperatures, powers = _known([r.temperature_c for r in busy]), _known([r.power_w for r in busy])
        phases: dict[str, PhaseClocks] = {}
        for phase in SUMMARISED_PHASES:
            found = PhaseClocks.of([r for r in self.readings if r.phase == phase])
            if found is not None:
                phases[phase] = found
        slowdowns = sorted({name for r in busy for name in r.slowdowns})
        return CaseClocks(
            readings=len(self.readings),
            busy_readings=len(busy),
            sm_mhz_median=_median(sm),
            sm_mhz_min=min(sm, default=None),
            temperature_c_max=max(temperatures, default=None),
            power_w_max=max(powers, default=None),
            slowdowns=slowdowns,
            note=self.note,
            phases=phases,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"started_clock_s": self.started_clock_s, "readings": [r.to_dict() for r in self.readings],
                "note": self.note}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SampledClocks:
        readings = [GpuReading.from_dict(r) for r in data.get("readings") or []]
        return cls(data["started_clock_s"], readings, data.get("note"))


def _known(values: list[Any]) -> list[Any]:
    return [v for v in values if v is not None]


def _median(values: list[Any]) -> float | None:
    known = _known(values)
    return float(statistics.median(known)) if known else None


def _mean(values: list[Any]) -> float | None:
    known = _known(values)
    return float(statistics.fmean(known)) if known else None


@dataclass
class PhaseClocks:
    """The readings of one training phase (``qerl_cli.rl.phase``) within a case: how many, the median
    GPU utilization, SM clock and power over all of them, and the mean utilization: the readings are
    evenly spaced, so the mean is the share of the phase's time a kernel ran, where the median hides an
    idle stretch shorter than half the phase (a rollout with vLLM's engine core in its own process read
    98% median and 62.5% mean: busy, then idle while the front end caught up). Idle readings count:
    a GPU that sat idle during a rollout was waiting on the host, which is what the utilization is read
    for. ``utilization_pct_mean`` is None in files written before it was recorded."""

    readings: int
    utilization_pct_median: float | None
    sm_mhz_median: float | None
    power_w_median: float | None
    utilization_pct_mean: float | None = None

    @classmethod
    def of(cls, readings: list[GpuReading]) -> PhaseClocks | None:
        """The summary of ``readings`` (one phase's); None without any."""
        if not readings:
            return None
        utilization = [r.utilization_pct for r in readings]
        return cls(len(readings), _median(utilization), _median([r.sm_mhz for r in readings]),
                   _median([r.power_w for r in readings]), _mean(utilization))  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.utilization_pct_mean is None:  # a file from before the mean: read back key for key
            del out["utilization_pct_mean"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PhaseClocks:
        return cls(data["readings"], data.get("utilization_pct_median"), data.get("sm_mhz_median"),
                   data.get("power_w_median"), data.get("utilization_pct_mean"))  # fmt: skip

    @property
    def busy_pct(self) -> float | None:
        """The share of the phase's time the GPU ran a kernel: the mean where recorded, else the median."""
        return (
            self.utilization_pct_mean
            if self.utilization_pct_mean is not None
            else self.utilization_pct_median
        )


@dataclass
class CaseClocks:
    """A row's ``gpu_clocks``: how many readings its case took and how many found the GPU working, and
    the working GPU's SM clock (median, lowest), hottest temperature, highest power and the slowdown
    reasons the driver named; each None (empty) where no working reading gave it. ``note``: why a
    reading failed. ``phases``: each summarised training phase's own figures, for the phases the case
    had readings of (none for a case outside training, or a row from before readings had a phase)."""

    readings: int
    busy_readings: int
    sm_mhz_median: float | None
    sm_mhz_min: int | None
    temperature_c_max: int | None
    power_w_max: float | None
    slowdowns: list[str] = field(default_factory=list)
    note: str | None = None
    phases: dict[str, PhaseClocks] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "readings": self.readings, "busy_readings": self.busy_readings,
            "sm_mhz_median": self.sm_mhz_median, "sm_mhz_min": self.sm_mhz_min,
            "temperature_c_max": self.temperature_c_max, "power_w_max": self.power_w_max,
            "slowdowns": list(self.slowdowns),
            "phases": {name: phase.to_dict() for name, phase in self.phases.items()},
        }  # fmt: skip
        if self.note is not None:
            out["note"] = self.note
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CaseClocks:
        phases = {name: PhaseClocks.from_dict(p) for name, p in (data.get("phases") or {}).items()}
        return cls(data["readings"], data["busy_readings"], data.get("sm_mhz_median"), data.get("sm_mhz_min"),
                   data.get("temperature_c_max"), data.get("power_w_max"), list(data.get("slowdowns") or []),
                   data.get("note"), phases)  # fmt: skip


def row_sm_mhz(row: Mapping[str, Any]) -> float | None:
    """A row's busy median SM clock; None for a row without one (no working reading, an earlier file)."""
    found = row.get(ROW_KEY)
    return CaseClocks.from_dict(found).sm_mhz_median if found else None


def row_phase_clocks(row: Mapping[str, Any], phase: Phase) -> PhaseClocks | None:
    """A row's figures of one training phase; None for a row without readings in it (a case outside
    training, an earlier file)."""
    found = row.get(ROW_KEY)
    return CaseClocks.from_dict(found).phases.get(phase) if found else None


def row_rollout_busy_pct(row: Mapping[str, Any]) -> float | None:
    """A row's GPU busy share while generating (:attr:`PhaseClocks.busy_pct` of the rollout phase's
    readings: a trainer's rollouts, a rollout batch's timed generations); None without a reading then
    (an earlier file)."""
    clocks = row_phase_clocks(row, ROLLOUT)
    return clocks.busy_pct if clocks else None


# How far back a reading's utilization reaches: nvidia-smi reports it over the driver's last sampling
# period, between 1/6 s and 1 s depending on the GPU.
UTILIZATION_WINDOW_S = 1.0


class ClockSampler:
    """Reads ``probe`` at once and then every ``interval_s`` in a daemon thread, from entering to
    leaving the ``with`` block, each reading tagged with the training phase ``phase`` says the process
    is in (:func:`qerl_cli.rl.phase.phase_state`: the phase and when it last changed, on ``clock``). It
    never raises into the case: a probe that fails or raises becomes ``note``. With no probe (no GPU
    measured) it reads nothing and :meth:`record` is None."""

    def __init__(
        self,
        probe: Probe | None,
        interval_s: float = SAMPLE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        phase: Callable[[], tuple[Phase, float]] = phase_state,
    ) -> None:
        self.probe, self.interval_s, self.clock, self.phase = probe, interval_s, clock, phase
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._record: SampledClocks | None = None

    def __enter__(self) -> ClockSampler:
        if self.probe is None:
            return self
        self._record = SampledClocks(started_clock_s=self.clock())
        self._thread = threading.Thread(target=self._run, name="qerl-gpu-clocks", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:  # no thread to be had: the case runs unsampled
            self._record.note = f"no sampling thread: {exc}"
            self._thread = None
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        """One reading (or why there is none), kept unless the sampler has stopped meanwhile."""
        assert self.probe is not None and self._record is not None
        before, changed_at = self.phase()
        asked_at = self.clock()
        try:
            found = self.probe()
        except Exception as exc:  # noqa: BLE001 - a broken probe must not end the case it watches
            found = f"the clock probe raised {type(exc).__name__}: {exc}"
        after, _ = self.phase()
        # A reading covers a window before it is read (the utilization, the driver's last sampling
        # period): one whose phase changed within that window or while nvidia-smi ran is of both phases,
        # and belongs to neither phase's figures.
        straddles = before != after or asked_at - changed_at < UTILIZATION_WINDOW_S
        phase = OTHER if straddles else before
        elapsed = round(asked_at - self._record.started_clock_s, 1)
        with self._lock:
            if self._stop.is_set():
                return
            if isinstance(found, str):
                self._record.note = found
            else:
                self._record.readings.append(replace(found, elapsed_s=elapsed, phase=phase))

    def record(self) -> SampledClocks | None:
        """A copy of what was read (None without a probe)."""
        with self._lock:
            if self._record is None:
                return None
            return replace(self._record, readings=list(self._record.readings))


def keep_case_clocks(row: dict[str, Any], sampled: SampledClocks | None, kept: list[dict[str, Any]]) -> None:
    """The row's ``gpu_clocks`` summary of ``sampled``, and its readings appended to ``kept`` (what
    goes to the parent under READINGS_KEY); nothing without a record (no GPU measured)."""
    if sampled is None:
        return
    row[ROW_KEY] = sampled.summary().to_dict()
    kept.append(sampled.to_dict())


def take_case_clocks(holder: dict[str, Any], host: HostLoad | None) -> None:
    """Take READINGS_KEY out of a case's payload or an e2e row and add its readings to ``host``'s
    ``gpu_clocks`` at their place in the run (none is kept without a sampling host)."""
    for data in holder.pop(READINGS_KEY, None) or []:
        if host is not None:
            sampled = SampledClocks.from_dict(data)
            host.add_case_clocks(sampled.started_clock_s, sampled.readings)

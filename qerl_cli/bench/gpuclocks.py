"""Was the measured GPU clocked down while a benchmark measured? Its SM clock, temperature, power and the
driver's clock event ("throttle") reasons, read through ``nvidia-smi --query-gpu`` at the host load's
sample points (:mod:`qerl_cli.bench.hostload` takes the readings and writes them in ``host_load``), and
the rule that calls a run throttled.

A GPU held below its clocks by a power cap or its temperature runs every case slower, and a long run
that heats it slows the cases measured late more than the early ones, which biases the ratios between
them. A report says so, so that nobody compares a throttled run's figures with an unthrottled one's.

The host load's readings are taken when a report is written, between cases, so many of them find the GPU
idle: an idle GPU lowers its own clocks, which is not throttling, and the rule leaves such readings out of
the clock comparison. Each case also reads the clocks under load (:mod:`qerl_cli.bench.gpusampler`), and
those readings join the run's. This module imports no torch.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from qerl_cli.rl.phase import Phase

# nvidia-smi answers within a second or so; a hung driver must not hang the benchmark.
NVIDIA_SMI_TIMEOUT_S = 10.0
# A busy reading's SM clock this far below the highest SM clock of the run is throttling even when the
# driver names no reason, on a GPU busy the whole sampling period (FULLY_BUSY_PCT): a working GPU with
# headroom stays near its boost clock (GPU Boost moves it by a few percent with load and temperature), so a
# tenth is well past that drift and about the size of the differences between backends that a run is read
# for. Idle readings are left out: an idle GPU lowers its own clocks.
CLOCK_DROP_FRACTION = 0.10
# The bits of clocks_event_reasons.active (NVML's nvmlClocksEventReason* / nvmlClocksThrottleReason*).
REASON_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# The reasons that hold a working GPU below its clocks. The others are not a slowdown of the work: idle,
# clocks a user set, sync boost (a group of GPUs kept at one clock), the display clock.
SLOWDOWN_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)
# The reason a GPU at its power limit shows. Where the limit in force is the board's default, it is the
# board's normal power management under a heavy load, not throttling, even where it trades clock for power
# (dense GEMMs at the limit run below the boost clock on every board of a kind). Where the limit in force
# is lower (set by a user, or by a host or datacenter power cap) or either limit is unknown, the cap with
# a clock drop is throttling (throttle_findings).
POWER_CAP_REASONS = frozenset({"sw_power_cap"})
# A limit in force this far below the default is a lowered one; drivers round limits to a watt or so.
LOWERED_LIMIT_FRACTION = 0.98
# Drivers from R535 on name the field clocks_event_reasons and keep clocks_throttle_reasons as an alias;
# older ones know only the latter. The newer name first: the alias may go.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
QUERY_FIELDS = ("uuid", "clocks.sm", "clocks.max.sm", "temperature.gpu", "power.draw", "power.limit",
                "utilization.gpu")  # fmt: skip
# Asked too where the driver knows them: the board's default power limit and the limit in force (the lowest
# of every limiter: a user's, the host's, a datacenter's), by which the rule tells a lowered limit; a driver
# that does not is asked without them, once, as for the reasons field's older name.
DEFAULT_LIMIT_FIELD = "power.default_limit"
ENFORCED_LIMIT_FIELD = "enforced.power.limit"
# What nvidia-smi says of a field this driver does not know ('Field "X" is not a valid field to query.').
UNKNOWN_FIELD = "is not a valid field to query"
# The queries the probe tries, in order, each QUERY_FIELDS plus what the driver may or may not know.
LIMIT_FIELDS = (DEFAULT_LIMIT_FIELD, ENFORCED_LIMIT_FIELD)
QUERIES = tuple((*QUERY_FIELDS, *extra, reasons) for extra in (LIMIT_FIELDS, ()) for reasons in REASON_FIELDS)
# A throttled verdict names this many readings, then counts the rest.
NAMED_READINGS = 3
# A clock drop the driver names no reason for counts only at this utilization or above. A GPU that ran
# kernels for part of nvidia-smi's sampling period is between work (a case's prefill and decode, a
# generation's tail, the next engine's load), and GPU Boost lowers the clock for that load by itself: at
# its default power limit, around power-capped decodes, a GPU read 1605-1740 MHz at 63-73% utilization
# with an empty reasons mask (the run: benchmarks/h200-2026-11-29-detokenizer-off). Where the mask is
# unknown the drop counts as before: a throttle would go unseen. (Higher than the 80% below which a
# rollout is called host-bound, bench/e2e_notes.py: a drop is judged per reading, a phase by its mean.)
FULLY_BUSY_PCT = 90


def uuid_digits(text: str) -> str:
    """A GPU UUID's hex digits: nvidia-smi writes ``GPU-`` before them, torch may not."""
    return "".join(c for c in text.lower() if c in "0123456789abcdef")


def decode_reasons(mask: int) -> list[str]:
    """The names of the bits set in a clock event reasons mask; a bit this version does not know is
    kept as its hex value."""
    names = [name for bit, name in REASON_BITS.items() if mask & bit]
    unknown = mask & ~sum(REASON_BITS)
    bit = 1
    while unknown >= bit:
        if unknown & bit:
            names.append(hex(bit))
        bit <<= 1
    return names


@dataclass
class GpuReading:
    """One reading of the measured GPU. Each figure is None where nvidia-smi does not give it ([N/A]);
    ``reasons`` is None where the mask is unknown, else the decoded names (empty: none active)."""

    elapsed_s: float  # since the run's first sample
    sm_mhz: int | None
    max_sm_mhz: int | None
    temperature_c: int | None
    power_w: float | None
    power_limit_w: float | None
    utilization_pct: int | None
    reasons: list[str] | None
    # The training phase the reading was taken in (``qerl_cli.rl.phase``), where a case's sampler knew
    # it (bench.gpusampler); None for the host load's readings between cases.
    phase: Phase | None = None
    # The board's default power limit and the limit in force; None where unknown (readings from before
    # they were asked, a driver without the fields).
    power_default_limit_w: float | None = None
    power_enforced_limit_w: float | None = None

    @property
    def idle(self) -> bool:
        """The driver says the GPU is idle, or no kernel ran over its last sampling period."""
        return "gpu_idle" in (self.reasons or []) or self.utilization_pct == 0

    @property
    def busy(self) -> bool:
        """Working, as far as is known: a reading with neither the mask nor the utilization is not."""
        return not self.idle and (self.reasons is not None or self.utilization_pct is not None)

    @property
    def fully_busy(self) -> bool:
        """Working through the whole sampling period, as far as is known (an unknown utilization counts)."""
        return self.busy and (self.utilization_pct is None or self.utilization_pct >= FULLY_BUSY_PCT)

    @property
    def at_default_limit(self) -> bool:
        """The power limit in force is the board's default, as far as is known: False where either is
        unknown, or the limit in force is lower (a user's, a host's or a datacenter's cap)."""
        if self.power_enforced_limit_w is None or self.power_default_limit_w is None:
            return False
        return self.power_enforced_limit_w >= LOWERED_LIMIT_FRACTION * self.power_default_limit_w

    @property
    def slowdowns(self) -> list[str]:
        return [name for name in self.reasons or [] if name in SLOWDOWN_REASONS]

    def to_dict(self) -> dict[str, Any]:
        out = {"elapsed_s": self.elapsed_s, "sm_mhz": self.sm_mhz, "max_sm_mhz": self.max_sm_mhz,
               "temperature_c": self.temperature_c, "power_w": self.power_w,
               "power_limit_w": self.power_limit_w, "utilization_pct": self.utilization_pct,
               "reasons": self.reasons}  # fmt: skip
        if self.phase is not None:  # only a case's readings have one: the host's keep their old shape
            out["phase"] = self.phase
        for name in ("power_default_limit_w", "power_enforced_limit_w"):  # older readings keep their shape
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuReading:
        reasons = data.get("reasons")
        return cls(data["elapsed_s"], data.get("sm_mhz"), data.get("max_sm_mhz"), data.get("temperature_c"),
                   data.get("power_w"), data.get("power_limit_w"), data.get("utilization_pct"),
                   None if reasons is None else list(reasons), data.get("phase"),
                   data.get("power_default_limit_w"), data.get("power_enforced_limit_w"))  # fmt: skip

    def label(self) -> str:
        """``SM 1410 MHz at 340 s``, with the temperature and power where known."""
        sm = "SM clock unknown" if self.sm_mhz is None else f"SM {self.sm_mhz} MHz"
        extra = [] if self.temperature_c is None else [f"{self.temperature_c} C"]
        if self.power_w is not None:
            limit = "" if self.power_limit_w is None else f"/{self.power_limit_w:.0f}"
            extra.append(f"{self.power_w:.0f}{limit} W")
        return f"{sm} at {self.elapsed_s:.0f} s" + (f" ({', '.join(extra)})" if extra else "")


def _number(text: str, kind: Callable[[str], Any]) -> Any:
    """A CSV field as ``kind``; None for nvidia-smi's [N/A], [Not Supported] and the like."""
    try:
        return kind(text)
    except ValueError:
        return None


def parse_gpu_query(text: str, gpu_uuid: str, fields: tuple[str, ...] = QUERIES[0]) -> GpuReading | None:
    """The reading of the GPU ``gpu_uuid`` in the output of ``nvidia-smi --query-gpu=`` ``fields`` (one of
    QUERIES; CSV, no header, no units), its ``elapsed_s`` 0; None where it is not listed."""
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != len(fields) or uuid_digits(parts[0]) != uuid_digits(gpu_uuid):
            continue
        value = dict(zip(fields, parts, strict=True))
        code = _number(value[fields[-1]], lambda text: int(text, 16))  # the reasons field comes last
        return GpuReading(
            elapsed_s=0.0,
            sm_mhz=_number(value["clocks.sm"], int),
            max_sm_mhz=_number(value["clocks.max.sm"], int),
            temperature_c=_number(value["temperature.gpu"], int),
            power_w=_number(value["power.draw"], float),
            power_limit_w=_number(value["power.limit"], float),
            utilization_pct=_number(value["utilization.gpu"], int),
            reasons=None if code is None else decode_reasons(code),
            power_default_limit_w=_number(value.get(DEFAULT_LIMIT_FIELD, ""), float),
            power_enforced_limit_w=_number(value.get(ENFORCED_LIMIT_FIELD, ""), float),
        )
    return None


class NvidiaSmiClocks:
    """The probe: the measured GPU's reading through nvidia-smi, or why it is unknown. It keeps the query
    that answered, so a driver that knows only the reasons field's older name, or no default power limit,
    costs its failed queries once."""

    def __init__(
        self,
        gpu_uuid: str | None,
        run: Callable[..., Any] = subprocess.run,
        which: Callable[[str], str | None] = shutil.which,
    ) -> None:
        self.gpu_uuid, self.run, self.which = gpu_uuid, run, which
        self.queries = list(QUERIES)

    def __call__(self) -> GpuReading | str:
        if self.gpu_uuid is None:
            return "the measured GPU's UUID is unknown"
        exe = self.which("nvidia-smi")
        if exe is None:
            return "nvidia-smi not found"
        failure = ""
        for fields in list(self.queries):
            query = [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
            try:
                done = self.run(
                    query, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:  # the other queries would hang or fail alike
                return f"nvidia-smi failed: {exc}"
            if done.returncode == 0:
                self.queries = [fields, *(other for other in self.queries if other != fields)]
                reading = parse_gpu_query(done.stdout, self.gpu_uuid, fields)
                # Not the UUID: a report never names one physical board.
                return reading if reading is not None else "nvidia-smi did not list the measured GPU"
            failure = f"nvidia-smi exited {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
            if UNKNOWN_FIELD not in failure:  # a broken driver: the other queries would fail alike
                return failure
        return failure


def throttle_findings(readings: list[GpuReading], drop_fraction: float = CLOCK_DROP_FRACTION) -> list[str]:
    """The rule: each reading that shows throttling, labelled with why; empty when none does. A reading
    the driver marks ``gpu_idle`` never counts. Otherwise it counts when the driver names a thermal or
    hardware slowdown, or when the GPU was working (:attr:`GpuReading.busy`: a low clock of an idle GPU
    is its own choice) and its SM clock is more than ``drop_fraction`` below the highest working clock
    of the run (or its own maximum clock), unless the driver says the GPU is at its power limit and that
    limit is the board's default (:attr:`GpuReading.at_default_limit`, POWER_CAP_REASONS). A drop with
    the reasons mask read and empty counts only on a GPU busy the whole sampling period (FULLY_BUSY_PCT)."""
    highest = max((r.sm_mhz for r in readings if r.busy and r.sm_mhz is not None), default=None)
    found = []
    for reading in readings:
        if "gpu_idle" in (reading.reasons or []):
            continue
        top = max((v for v in (highest, reading.max_sm_mhz) if v is not None), default=None)
        low = (reading.busy and reading.sm_mhz is not None and top is not None
               and reading.sm_mhz < (1.0 - drop_fraction) * top)  # fmt: skip
        hard = [name for name in reading.slowdowns if name not in POWER_CAP_REASONS]
        capped = any(name in POWER_CAP_REASONS for name in reading.slowdowns)
        why = list(hard)
        if low and capped and not reading.at_default_limit:
            why.append(_cap_label(reading))
        unexplained = reading.reasons is not None and not hard and not capped  # the mask read, and empty
        if low and (
            hard
            or (capped and not reading.at_default_limit)
            or (unexplained and reading.fully_busy)
            or reading.reasons is None
        ):
            why.append(f"{1 - reading.sm_mhz / top:.0%} below {_top_label(top, highest)}")
        if why:
            found.append(f"{reading.label()}: {', '.join(why)}")
    return found


def _cap_label(reading: GpuReading) -> str:
    enforced, default = reading.power_enforced_limit_w, reading.power_default_limit_w
    if enforced is None or default is None:  # as reports before the limits were read name it
        return "sw_power_cap"
    return f"sw_power_cap at a lowered limit ({enforced:.0f} W of its default {default:.0f} W)"


def _top_label(top: int, highest: int | None) -> str:
    return f"the run's highest {top} MHz" if top == highest else f"its maximum {top} MHz"


def throttle_warning(reason: str) -> str:
    """The one console line of a throttled run."""
    return f"GPU throttled: {reason}; these figures are not comparable with an unthrottled run's"


@dataclass
class GpuClocks:
    """``host_load.gpu_clocks`` of a report: every reading of the measured GPU, in the order taken (at
    most one each GPU_QUERY_INTERVAL_S when a report is written, and one each SAMPLE_INTERVAL_S of
    :mod:`qerl_cli.bench.gpusampler` while a case runs), why there is none (``note``), and the verdict,
    which is derived from the readings."""

    readings: list[GpuReading] = field(default_factory=list)
    note: str | None = None  # why there are no readings (the last failure); None once one is read
    drop_fraction: float = CLOCK_DROP_FRACTION

    def add(self, found: GpuReading | str, elapsed_s: float) -> None:
        """Keep a reading, taken ``elapsed_s`` after the run's first sample, or why there is none."""
        if isinstance(found, str):  # unknown this time: what earlier samples read still stands
            if not self.readings:
                self.note = found
            return
        self.readings.append(replace(found, elapsed_s=elapsed_s))
        self.note = None

    @property
    def throttled_reason(self) -> str | None:
        """The readings that show throttling (the first NAMED_READINGS, then a count); None when none do."""
        found = throttle_findings(self.readings, self.drop_fraction)
        if not found:
            return None
        more = len(found) - NAMED_READINGS
        return "; ".join(found[:NAMED_READINGS]) + (f"; and {more} more reading(s)" if more > 0 else "")

    def to_dict(self) -> dict[str, Any]:
        reason = self.throttled_reason
        out: dict[str, Any] = {
            "throttled": reason is not None,
            "throttled_reason": reason,
            "drop_fraction": self.drop_fraction,
            "readings": [r.to_dict() for r in self.readings],
        }
        if self.note is not None:
            out["note"] = self.note
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GpuClocks:
        """The verdict keys are not read: the rule is applied to the readings again."""
        readings = [GpuReading.from_dict(r) for r in data.get("readings") or []]
        return cls(readings, data.get("note"), data.get("drop_fraction", CLOCK_DROP_FRACTION))

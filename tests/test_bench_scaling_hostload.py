"""`qerl bench scaling` records the host's load as every benchmark does (`bench/hostload.py`): from the
run's start, after every step (the others: after every case) and at its end. It sampled once, after
training, so a load that came and went during the steps left the run called idle."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from qerl_cli.bench import header, scaling
from qerl_cli.bench.hostload import HostLoad, HostProbes, start_host_load
from qerl_cli.config import TrainConfig
from qerl_cli.modeling.run_layout import METRICS_FILE
from qerl_cli.rl.result import TrainResult

STEPS = 3


def test_scaling_samples_the_host_from_its_start_through_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 CPUs, busy above a 1-minute load of 2 from other processes: only during step 2.
    loads = iter([0.5, 0.5, 9.0, 0.5, 0.5])
    clock = itertools.count(0.0, 10.0)
    probes = HostProbes(
        loadavg=lambda: (load := next(loads), load, load),
        cpu_count=lambda: 4,
        own_cpu_s=lambda: 0.0,
        process_age_s=lambda: None,
        clock=lambda: next(clock),
    )
    warnings: list[str] = []
    started: list[HostLoad] = []

    def start(gpu: bool) -> HostLoad:
        started.append(start_host_load(probes, warn=warnings.append))
        return started[-1]

    def fake_train(cfg: TrainConfig, *, on_step: Any, **kwargs: Any) -> TrainResult:
        assert started and started[0].samples == 1  # the header was begun before the first step
        run_dir = Path(cfg.output.dir)
        run_dir.mkdir(parents=True)
        rows = [
            {"step": s, "time_step_s": 1.0, "time_rollout_s": 0.5, "rollout_tokens": 100} for s in (1, 2, 3)
        ]
        with (run_dir / METRICS_FILE).open("w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
                on_step(row["step"], row)
        return TrainResult(str(run_dir), str(run_dir / "adapter"), STEPS, 1, None, 0.0, 0.0, None)

    monkeypatch.setattr(header, "start_run_host_load", start)
    monkeypatch.setattr(scaling, "train", fake_train)
    monkeypatch.delenv("RANK", raising=False)
    cfg = scaling.scaled_config(TrainConfig(), tmp_path, STEPS, None, 1)
    report = scaling.run_scaling(cfg, tmp_path, command="qerl bench scaling tiny", steps=STEPS)

    on_disk = json.loads((tmp_path / scaling.REPORT_NAME).read_text())
    host = on_disk["host_load"]
    assert host["samples"] == 1 + STEPS + 1  # the start, each step, the end
    start, end, peak = (host[key]["elapsed_s"] for key in ("start", "end", "peak"))
    assert (end - start, peak - start) == (40.0, 20.0)  # the start, 4 samples later the end; step 2's peak
    assert host["peak"]["load_1m"] == 9.0
    assert on_disk["host_busy"] is True and report["host_busy"] is True
    assert on_disk["host_busy_reason"].startswith("1-minute load of other processes 9.0 on 4 CPUs")
    assert len(warnings) == 1  # said as it happened, once

"""A new user's walk, round 10: the bench's rollout dry runs, the memory plan on the transformers engine,
the e2e rows' backend label, and `qerl demo -o` given a training run's folder, each stumble held by the
test that would have caught it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli


# -- qerl bench rollout / concurrency / e2e --dry-run -----------------------------------------------------
@pytest.mark.parametrize("command", ["rollout", "concurrency", "e2e"])
def test_bench_rollout_dry_runs_list_their_checks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    """`qerl bench rollout|concurrency|e2e --dry-run` printed the YAML and the plan alone, where every other
    dry run (the stages, `bench update|kernels|quality`) lists what it checked."""
    out_dir = tmp_path / "bench"
    rc, out, err = run_cli(capsys, "bench", command, "--device", "cpu", "-o", str(out_dir), "--dry-run")
    assert rc == 0, err
    assert yaml.safe_load(out)["device"] == "cpu"  # stdout stays a --config file
    assert "checked, nothing loaded or written:" in err
    assert f"--output: {out_dir}: a folder that can be written" in err
    assert "--device: cpu" in err and "--engine: auto -> hf" in err and "--model: tiny" in err
    assert "--formats:" in err
    assert not out_dir.exists()


# -- the memory plan's log line ---------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", id="colocated")])
def test_the_memory_plan_names_vllm_only_where_it_runs(caplog: pytest.LogCaptureFixture, engine: str) -> None:
    """`qerl train` on the transformers engine logged "vLLM share 0.300" (and an auto
    gpu_memory_utilization), where no vLLM runs."""
    from types import SimpleNamespace

    from qerl_cli.config import TrainConfig
    from qerl_cli.modeling.tiny import build_tiny_config
    from qerl_cli.rl.memory import plan_for_run

    cfg = TrainConfig()
    cfg.rollout.engine, cfg.rollout.gpu_memory_utilization = engine, "auto"
    model = SimpleNamespace(config=build_tiny_config())
    with caplog.at_level("INFO", logger="qerl_cli.rl.memory"):
        plan_for_run(cfg, model, "nvfp4")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan")]
    if engine == "vllm":
        assert "vLLM share" in line and "gpu_memory_utilization" in line, line
    else:
        assert "vLLM" not in line and "gpu_memory_utilization" not in line, line


# -- the e2e rows' backend label ----------------------------------------------------------------------------
def test_an_e2e_rows_backend_reads_the_same_in_the_table_and_the_gate() -> None:
    """On the transformers engine an e2e row read `trainer` in the bench table and `backend=auto` in the
    gate's message about the same row."""
    import copy

    from qerl_cli.bench.gate import check_regressions
    from qerl_cli.bench.report import e2e_rows
    from qerl_cli.bench.result import BenchResult

    def report(step_s: float) -> BenchResult:
        row = {"format": "nvfp4", "backend": "auto", "linear_backend": "trainer", "step_s": step_s}
        return BenchResult(schema="qerl-bench/1", created="", device="cpu", figures_label="", machine={},
                           gpu=None, versions={}, settings={"model": "tiny"}, e2e=[row])  # fmt: skip

    now, baseline = report(10.0), report(5.0)
    (table_row,) = e2e_rows(now)
    assert table_row[:2] == ("nvfp4", "trainer")
    (failure,) = check_regressions(now, copy.deepcopy(baseline), tolerance=0.1).failures
    assert failure.startswith("e2e format=nvfp4 backend=trainer: step_s rose"), failure

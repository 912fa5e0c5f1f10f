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
    from qerl_cli.rl.run_memory import plan_for_run

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


# -- qerl demo -o a training run's folder ------------------------------------------------------------
def _training_run(folder: Path) -> Path:
    (folder / "adapter").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "config.yaml").write_text("model: {}\n")
    return folder


def test_demo_refuses_a_training_runs_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`qerl demo -o runs/mine` (a `qerl train` run's folder) mixed the demo's base/, train/ and eval_*
    into that run's files without a word."""
    from cli_runner import usage_error

    run = _training_run(tmp_path / "mine")
    before = sorted(p.name for p in run.iterdir())
    rc, _, err = run_cli(capsys, "demo", "-o", str(run), "--steps", "1")
    assert usage_error(rc, err), err
    assert f"--output {run} already holds a training run (adapter/, metrics.jsonl)" in err, err
    assert "nothing was changed" in err and "a fresh folder" in err, err
    assert sorted(p.name for p in run.iterdir()) == before


def test_demo_refuses_a_folder_of_other_files_but_takes_its_own(tmp_path: Path) -> None:
    from qerl_cli.demo import check_demo_folder
    from qerl_cli.errors import QerlError

    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("x")
    with pytest.raises(QerlError, match=r"holds todo.txt, which is not the demo's"):
        check_demo_folder(other)
    earlier = tmp_path / "demo"
    for name in ("base", "eval_before", "train", "eval_after"):
        (earlier / name).mkdir(parents=True)
    check_demo_folder(earlier)  # an earlier demo's output: the demo runs again over it
    check_demo_folder(tmp_path / "new")  # not there yet

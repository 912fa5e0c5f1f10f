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

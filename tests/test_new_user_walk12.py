"""A new user's walk, round 12: `qerl eval` and the run folders it is given, paths with spaces and
accents, and a run stopped part-way, each stumble held by the test that would have caught it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error


def _run_folder(root: Path, base: Path) -> Path:
    """What `qerl train` leaves in its output.dir: config.yaml, metrics.jsonl, the final adapter."""
    run = root / "my run ü"
    (run / "adapter").mkdir(parents=True)
    (run / "config.yaml").write_text("model: {path: x}\n")
    (run / "metrics.jsonl").write_text("")
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    (run / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    return run


# -- the commands an error suggests, with a path holding a space --------------------------------------------
def test_eval_of_a_run_folder_suggests_commands_that_paste(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`qerl eval "my run ü"` (a run's folder given for the model) answered with the commands that evaluate
    its adapter and resume it, but wrote their paths bare: `qerl eval tiny q --adapter my run ü/adapter`
    pasted into a shell gave eval four arguments. Now every path in them is quoted for the shell."""
    base = tmp_path / "tiny q"
    run = _run_folder(tmp_path, base)
    rc, _, err = run_cli(capsys, "eval", str(run), "--benchmarks", "synthetic-addition", "--dry-run")
    assert usage_error(rc, err), err
    message = " ".join(err.split())
    evaluate = shlex.join(["qerl", "eval", str(base), "--adapter", str(run / "adapter")])
    resume = shlex.join(["qerl", "train", str(run / "config.yaml"), "--resume", "auto"])
    assert f"`{evaluate}`" in message and f"`{resume}`" in message, message

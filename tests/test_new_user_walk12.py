"""A new user's walk, round 12: `qerl eval` and the run folders it is given, paths with spaces and
accents, and a run stopped part-way, each stumble held by the test that would have caught it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error

from qerl_cli.config import TrainConfig, load_config
from qerl_cli.rl import policy, trainer


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


# -- a run killed while writing its final adapter ------------------------------------------------------
def test_a_half_written_final_adapter_is_passed_over_for_the_newest_checkpoint(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A run killed while `qerl train` wrote OUTPUT/adapter left its adapter_config.json without weights;
    `qerl eval BASE --adapter OUTPUT` then named OUTPUT/adapter, which has no weights, and `qerl eval OUTPUT`
    told the user to evaluate it. Now both name the newest checkpoint's adapter, which is whole."""
    base = tmp_path / "base"
    run = _run_folder(tmp_path, base)
    (run / "adapter" / "adapter_model.safetensors").unlink()
    whole = run / "checkpoint-3" / "adapter"
    whole.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (whole / name).write_bytes((run / "adapter" / "adapter_config.json").read_bytes())
    rc, _, err = run_cli(capsys, "eval", str(run), "--benchmarks", "synthetic-addition", "--dry-run")
    assert usage_error(rc, err), err
    message = " ".join(err.split())
    assert shlex.quote(str(whole)) in message and f"{run / 'adapter'} " not in message, message
    rc, _, err = run_cli(capsys, "eval", str(base), "--adapter", str(run), "--dry-run")
    assert usage_error(rc, err), err
    assert f"--adapter {shlex.quote(str(whole))}" in " ".join(err.split()), err


def test_train_writes_its_final_adapter_whole_or_not_at_all(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final adapter was written in place, so a run killed part-way through left OUTPUT/adapter with a
    config and no weights. It is now staged and renamed: a failed write leaves no adapter/ at all."""

    def dies_half_way(self, out_dir):  # the config written, then the process killed
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "adapter_config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(policy.Policy, "save_adapter", dies_half_way)
    recipe = Path(__file__).parents[1] / "recipes" / "tiny.yaml"
    out = tmp_path / "run"
    sets = [f"model.path={tiny_model_dir}", f"output.dir={out}", "train.max_steps=1", "output.save_steps=0",
            "train.prompts_per_step=2", "rollout.num_generations=2",
            "rollout.max_completion_length=4"]  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        trainer.train(load_config(TrainConfig, recipe, sets))
    assert (out / "metrics.jsonl").is_file() and not (out / "adapter").exists()

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qerl_cli.cli import main

REPO = Path(__file__).resolve().parents[1]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


COMMANDS = {
    "quantize", "train", "eval", "bench", "compare", "demo", "env", "models", "tiny-model", "tiny-base",
}  # fmt: skip


def test_help_lists_every_stage(capsys: pytest.CaptureFixture[str]) -> None:
    """The exact set of commands, read from the rows of --help's Commands panel (a word such as
    "train" elsewhere in the help does not count): deleting or renaming a command fails here."""
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    panel = out.split("Commands", 1)[1].split("╰", 1)[0]
    rows = [
        line.strip("│ ").split()[0]
        for line in panel.splitlines()
        if line.startswith("│ ") and not line.startswith("│  ")  # continuation lines are indented further
    ]
    assert sorted(rows) == sorted(COMMANDS)
    from typer.main import get_command

    from qerl_cli.cli import app

    assert set(get_command(app).commands) == COMMANDS  # registered, help text or not


def test_env_json_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "env", "--json")
    assert rc == 0
    info = json.loads(out)
    assert info["packages"]["torch"]
    assert {"transformers", "peft", "vllm", "llmcompressor", "triton", "math-verify"} <= set(info["packages"])
    assert isinstance(info["gpus"], list)


def test_train_dry_run_prints_the_override(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(
        capsys,
        "train",
        str(REPO / "recipes/bigmath_14b.yaml"),
        "--dry-run",
        "--set",
        "train.learning_rate=2e-5",
    )
    assert rc == 0
    resolved = yaml.safe_load(out)
    assert resolved["train"]["learning_rate"] == 2e-5
    assert resolved["algorithm"]["name"] == "dapo"


def test_misspelled_key_exits_2_with_suggestion(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run", "--set", "train.lerning_rate=2e-5")
    assert rc == 2
    assert "did you mean train.learning_rate?" in " ".join(err.split())


def test_wrong_type_exits_2_naming_the_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  path: m\ntrain:\n  max_steps: many\n")
    rc, _, err = run(capsys, "train", str(recipe), "--dry-run")
    assert rc == 2
    assert "train.max_steps" in err and "expected int" in err


def test_tiny_model_command_writes_a_loadable_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, out, _ = run(capsys, "tiny-model", str(tmp_path / "tiny"), "--seed", "3")
    assert rc == 0
    assert (tmp_path / "tiny" / "model.safetensors").is_file()


def test_unexpected_errors_exit_1_without_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import qerl_cli.envinfo

    def boom() -> dict:
        raise RuntimeError("kaboom")

    monkeypatch.setattr(qerl_cli.envinfo, "collect", boom)
    rc, _, err = run(capsys, "env")
    assert rc == 1
    assert "kaboom" in err and "Traceback" not in err


# -- each stage's typed result, rendered by the CLI -------------------------------------------------
# As qerl printed it when train returned a dict (rich pads the title line; compared without it).
TRAIN_TABLE = [
    "                   qerl train",
    "┌─────────────────────────────┬────────────────┐",
    "│ steps                       │ 4              │",
    "│ resumed from                │ -              │",
    "│ mean reward, first 10 steps │ 0.125          │",
    "│ mean reward, last 10 steps  │ 0.500          │",
    "│ adapter                     │ runs/x/adapter │",
    "│ outputs                     │ runs/x         │",
    "│ plot                        │ -              │",
    "└─────────────────────────────┴────────────────┘",
]


def test_train_renders_its_summary(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import qerl_cli.rl.trainer as trainer_mod
    from qerl_cli.rl.result import TrainResult

    result = TrainResult(
        output_dir="runs/x", adapter="runs/x/adapter", steps=4, world_size=1, resumed_from=None,
        reward_first10=0.125, reward_last10=0.5, plot=None, final={"step": 4},
    )  # fmt: skip
    seen = []
    monkeypatch.setattr(trainer_mod, "train", lambda conf, resume=None: seen.append(resume) or result)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: m\ntrain:\n  device: cuda\noutput:\n  dir: {tmp_path / 'run'}\n")
    rc, out, _ = run(capsys, "train", str(recipe), "--resume", "auto")
    assert rc == 0 and seen == [str(tmp_path / "run")]
    assert [line.rstrip() for line in out.splitlines()] == TRAIN_TABLE


def test_bench_renders_its_report_and_exits_1_on_a_regression(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    import qerl_cli.bench as bench_mod
    from qerl_cli.bench.result import RegressionOutcome, read_report

    report = read_report(REPO / "benchmarks" / "h100-2026-11-24" / "sweep-fp8-humming" / "bench.json")
    monkeypatch.setattr(bench_mod, "run_bench", lambda conf: report)
    rc, out, err = run(capsys, "bench")
    assert rc == 0 and "Rollout throughput" in out and "Wall clock:" in out and err == ""
    failures = ["rollout format=nvfp4: slower"]
    regressed = dataclasses.replace(report, regression=RegressionOutcome(0.1, 3, failures, passed=False))
    monkeypatch.setattr(bench_mod, "run_bench", lambda conf: regressed)
    rc, out, err = run(capsys, "bench")
    assert rc == 1 and "Regression gate FAILED" in out and "regression: rollout format=nvfp4: slower" in err


def test_compare_renders_its_report(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import qerl_cli.compare as compare_mod
    from qerl_cli.compare.results import CompareReport, CompareResult

    data = json.loads((REPO / "benchmarks" / "smollm2-h200-2026-11-23" / "compare.json").read_text())
    report = CompareReport.from_dict(data)
    results = iter([CompareResult(output="out", runs=9, ran=0, report=report), CompareResult("out", 9, 0)])
    monkeypatch.setattr(compare_mod, "run_compare", lambda *a, **k: next(results))
    recipe = str(REPO / "recipes" / "tiny.yaml")
    rc, out, _ = run(capsys, "compare", recipe)
    assert rc == 0 and "qerl compare (threshold 0.216)" in out and "compare.json, compare.md" in out
    rc, out, _ = run(capsys, "compare", recipe, "--no-summary")  # nothing to render
    assert rc == 0 and out == ""

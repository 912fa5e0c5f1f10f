"""A benchmark never writes its report over the report it compares with: `qerl bench rollout --baseline
bench_results/bench.json` (the default -o) gated against the baseline, then replaced it with the new run's
bench.json, so the baseline was gone. Every subcommand with such an input refuses it (exit 2) before any
work, --dry-run included, however the path is spelled."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error

REPO = Path(__file__).resolve().parents[1]
# A recorded bench.json (qerl-bench/1), read as a baseline is: the gate reads it before the check.
RECORDED = REPO / "benchmarks" / "h200-2026-11-23" / "bench_0.5b_smoke" / "bench.json"
SMALL = ["--model", "tiny", "--engine", "hf", "--formats", "bf16", "--lora-rank", "0"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def baseline_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``bench_results/`` (the default output folder) in the working folder, holding a baseline."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "bench_results"
    folder.mkdir()
    (folder / "bench.json").write_bytes(RECORDED.read_bytes())
    return folder


@pytest.mark.parametrize("subcommand", ["rollout", "concurrency", "e2e"])
@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize(
    ("baseline", "output"),
    [
        ("bench_results/bench.json", None),  # the default -o
        ("bench_results", None),  # the folder, read as its bench.json
        ("ABS/bench.json", "./bench_results/"),  # absolute against relative
        ("bench_results/bench.json", "link"),  # a symlink to the folder
    ],
)
def test_a_baseline_the_run_would_write_over_is_refused(
    capsys: pytest.CaptureFixture[str], baseline_dir: Path, subcommand: str, dry_run: bool,
    baseline: str, output: str | None,
) -> None:  # fmt: skip
    (baseline_dir.parent / "link").symlink_to(baseline_dir)
    given = baseline.replace("ABS", str(baseline_dir))
    before = digest(baseline_dir / "bench.json")
    argv = ["bench", subcommand, *SMALL, "--baseline", given, *(["-o", output] if output else [])]
    rc, _, err = run_cli(capsys, *argv, *(["--dry-run"] if dry_run else []))
    assert usage_error(rc, err), err
    written_to = output or "bench_results"
    assert f"--baseline {given}: this run writes its bench.json into {written_to}, over the baseline" in err
    assert "write this run elsewhere with --output DIR (-o), or copy the baseline out of" in err
    assert digest(baseline_dir / "bench.json") == before
    assert sorted(os.listdir(baseline_dir)) == ["bench.json"]


def test_a_baseline_set_in_a_config_file_is_refused_too(
    capsys: pytest.CaptureFixture[str], baseline_dir: Path
) -> None:
    settings = baseline_dir.parent / "settings.yaml"
    settings.write_text("baseline: bench_results/bench.json\n")
    rc, _, err = run_cli(capsys, "bench", "rollout", *SMALL, "--config", str(settings), "--dry-run")
    assert usage_error(rc, err) and "over the baseline" in err, err


def test_a_baseline_in_another_folder_is_gated_against(
    capsys: pytest.CaptureFixture[str], baseline_dir: Path
) -> None:
    """Another folder's baseline is read, not refused as written over: one of this run's settings gates
    it; the recorded one (a vLLM run on a GPU) is refused as the run refuses it, by the dry run too."""
    baseline = ["--baseline", "bench_results/bench.json"]
    argv = ["bench", "rollout", *SMALL, *baseline, "-o", "elsewhere", "--dry-run"]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and "the baseline was measured with other settings (baseline vs now): model:" in err, err
    report = json.loads((baseline_dir / "bench.json").read_text())  # as this CPU run's settings are
    report["device"] = "cpu"
    report["settings"] |= {"model": "tiny", "engine": "hf", "prompt_len": 256, "gen_len": 512,
                           "one_engine_per_format": False}  # fmt: skip
    (baseline_dir / "bench.json").write_text(json.dumps(report))
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0, err


def test_a_scaling_reference_the_run_would_write_over_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "one"
    out.mkdir()
    reference = out / "scaling.json"
    reference.write_text(json.dumps({"schema": "qerl-bench-scaling/1", "run": {"gpus": 1}}))
    before = digest(reference)
    argv = ["bench", "scaling", "tiny", "--reference", "one", "-o", str(out), "--dry-run"]
    rc, _, err = run_cli(capsys, *argv)
    assert usage_error(rc, err), err
    assert f"--reference one: this run writes its scaling.json into {out}, over the reference run" in err
    assert digest(reference) == before and sorted(os.listdir(out)) == ["scaling.json"]

"""A new user's walk, round 8: the leftovers of round 7 and the stumbles of `qerl quantize`, `qerl quality`,
`qerl compare`, the `qerl bench` tools' dry runs, `qerl env` and `qerl demo --help` on a CPU machine, each
held by the test that would have caught it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from cli_runner import run_cli, usage_error

from qerl_cli import torch_utils

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    from qerl_cli.modeling.tiny import write_tiny_model

    return write_tiny_model(tmp_path / "tiny")


# -- round 7's leftovers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["update", "kernels"])
def test_bench_tool_dry_runs_list_their_checks(capsys: pytest.CaptureFixture[str], command: str) -> None:
    """`qerl bench update --dry-run` printed the YAML alone; every other dry run lists what it checked."""
    rc, out, err = run_cli(capsys, "bench", command, "--device", "cpu", "--dry-run")
    assert rc == 0, err
    assert yaml.safe_load(out)["device"] == "cpu"  # stdout stays a --config file
    assert "checked, nothing loaded or written:" in err
    assert "--output: bench_results" in err and "--device: cpu" in err and "--model: tiny" in err


def test_library_progress_bars_stay_out_of_a_log(tmp_path: Path) -> None:
    """`qerl tiny-model` (and `qerl quality`) printed transformers' "Writing model shards" bars into a log;
    the bench kept them out. One place now, for every command: the CLI's entry."""
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-m", "qerl_cli", "tiny-model", str(tmp_path / "m")],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Writing model shards" not in done.stderr and "it/s" not in done.stderr, done.stderr


@pytest.mark.parametrize("given", ["GSM8K", "Gsm8k", "AIME24"])
def test_eval_benchmark_names_in_any_case(capsys: pytest.CaptureFixture[str], tiny: Path, given: str) -> None:
    rc, out, err = run_cli(capsys, "eval", str(tiny), "--benchmarks", given, "--dry-run")
    assert "unknown benchmark" not in err
    assert yaml.safe_load(out.split("# ")[0])["benchmarks"] == [given.lower()], err


def test_eval_names_the_benchmark_a_typo_meant(capsys: pytest.CaptureFixture[str], tiny: Path) -> None:
    rc, _, err = run_cli(capsys, "eval", str(tiny), "--benchmarks", "gsm8,math50", "--dry-run")
    assert usage_error(rc, err)
    assert "gsm8 (did you mean gsm8k?)" in err and "math50 (did you mean math500?)" in err


def test_a_data_file_keeps_its_own_name_in_upper_case(capsys: pytest.CaptureFixture[str], tiny: Path) -> None:
    data = tiny.parent / "GSM8K.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    rc, out, err = run_cli(
        capsys, "eval", str(tiny), "--benchmarks", "GSM8K", "--data-file", f"GSM8K={data}", "--dry-run"
    )
    assert rc == 0, err
    assert yaml.safe_load(out)["benchmarks"] == ["GSM8K"]


def test_one_close_match_rule() -> None:
    """Every "did you mean" asks errors.closest (difflib was called in six modules, each its own way)."""
    from qerl_cli.errors import closest

    assert closest("GSM8", ["gsm8k", "math500"]) == "gsm8k"
    assert closest("zzz", ["gsm8k"]) is None
    users = [p for p in (REPO / "qerl_cli").rglob("*.py") if "difflib" in p.read_text(encoding="utf-8")]
    assert [p.relative_to(REPO).as_posix() for p in users] == ["qerl_cli/errors.py"]


def test_report_only_says_nothing_of_cpu_threads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`qerl compare --report-only` printed the CPU-thread notice twice (the library's log line under the
    command's INFO logging, and the CLI's), for a report that trains nothing."""
    monkeypatch.setattr(torch_utils, "_chosen", None)
    monkeypatch.setenv("QERL_NUM_THREADS", "1")
    before = torch.get_num_threads()
    try:
        rc, _, err = run_cli(capsys, "compare", "tiny", "--report-only", "-o", str(tmp_path))
    finally:
        torch.set_num_threads(before)
    assert usage_error(rc, err) and "no finished run" in err
    assert "CPU thread" not in err


def test_the_thread_choice_is_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library logs its reason at debug only: the CLI prints it (when lowered), so a command that logs at
    INFO does not say it twice."""
    monkeypatch.setattr(torch_utils, "_chosen", None)
    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="qerl_cli"):
            torch_utils.use_free_cpu_threads({"QERL_NUM_THREADS": "1"})
    finally:
        torch.set_num_threads(before)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "thread" in r.getMessage()]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--calib", "missing.jsonl"], "--calib"),
        (["--num-samples", "8"], "--num-samples"),
        (["--seq-len", "64", "--calib-split", "test"], "--calib-split, --seq-len"),
        (["--set", "calib=qerl-text"], "calib"),
        (["--eval-ppl", "--calib", "qerl-text", "--num-samples", "8"], "--num-samples"),
    ],
)
def test_rtn_refuses_calibration_settings_it_ignores(
    capsys: pytest.CaptureFixture[str], tiny: Path, argv: list[str], named: str
) -> None:
    """`qerl quantize --method rtn --calib missing.jsonl` passed in silence: rtn reads no calibration."""
    rc, _, err = run_cli(capsys, "quantize", str(tiny), "--method", "rtn", *argv, "--dry-run")
    assert usage_error(rc, err), err
    assert f"error: {named}: --method rtn" in err and "gptq or awq" in err and "--lora-init eora|svd" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--method", "gptq", "--calib", "qerl-text", "--format", "nvfp4"],
        ["--method", "rtn", "--lora-init", "eora", "--calib", "qerl-text", "--num-samples", "4"],
        ["--method", "rtn", "--eval-ppl", "--calib", "qerl-text", "--seq-len", "64"],
    ],
)
def test_calibration_settings_where_they_are_read_pass(
    capsys: pytest.CaptureFixture[str], tiny: Path, argv: list[str]
) -> None:
    rc, _, err = run_cli(capsys, "quantize", str(tiny), *argv, "-o", str(tiny.parent / "q"), "--dry-run")
    assert "rounds to nearest" not in err
    assert rc == 0, err  # the dev extra installs llm-compressor, which gptq needs


# -- qerl quality -------------------------------------------------------------------------------------
@pytest.fixture
def nf4_base(tiny: Path) -> Path:
    from qerl_cli.config import QuantizeConfig
    from qerl_cli.quantize import run_quantize

    out = tiny.parent / "tiny-nf4"
    run_quantize(QuantizeConfig(model=str(tiny), format="nf4", method="rtn", output=str(out), device="cpu"))
    return out


def test_quality_refuses_a_4bit_reference(capsys: pytest.CaptureFixture[str], nf4_base: Path) -> None:
    """`qerl quality BASE OTHER` (the BF16 model left out) measured against the 4-bit base and labelled it
    "BF16 (reference)"."""
    rc, _, err = run_cli(capsys, "quality", str(nf4_base), str(nf4_base), "--rows", "2", "--seq-len", "8")
    assert usage_error(rc, err)
    assert f"BF16_MODEL {nf4_base} is a 4-bit base (nf4)" in err and "qerl_quant.json" in err


def test_quality_refuses_one_label_twice(capsys: pytest.CaptureFixture[str], tiny: Path) -> None:
    """Two candidates labelled alike made two rows no one could tell apart (and so in the JSON)."""
    rc, _, err = run_cli(
        capsys, "quality", str(tiny), f"a={tiny}", f"a={tiny}", "--rows", "2", "--seq-len", "8"
    )
    assert usage_error(rc, err)
    assert "the label a names two candidates" in err


# -- qerl compare --------------------------------------------------------------------------------------
def test_compare_names_the_arm_a_typo_meant_among_the_recipe_s_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An unknown arm listed the built-in arms only, not the recipe's own (compare.arms), and no guess."""
    rc, _, err = run_cli(
        capsys, "compare", "gemma3_270m_wordproblems", "--arms", "bf16-lora,nvfp4-fp8merge", "--dry-run"
    )
    assert usage_error(rc, err)
    assert "nvfp4-fp8merge (did you mean nvfp4-fp8merged?)" in err
    assert "nvfp4-aqn-t10pct-awq" in err  # one of the recipe's own arms, named among the choices


# -- qerl env ------------------------------------------------------------------------------------------
def test_env_lists_every_package_an_extra_adds() -> None:
    """The README sends a user to `qerl env` for what is installed; gguf, liger-kernel and humming-kernels
    (extras the README lists) were not in it."""
    import re

    from qerl_cli.envinfo import PACKAGES

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    added = {
        re.split(r"[<>=\[; ]", spec)[0].lower()
        for name, specs in extras.items()
        if name != "dev"
        for spec in specs
    }
    assert added <= {p.lower() for p in PACKAGES}

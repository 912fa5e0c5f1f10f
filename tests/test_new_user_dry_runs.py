"""What a new user's `--dry-run`s print: the config as YAML (a `--config` file as it stands), then the plan
as YAML comments in words, the same way for every benchmark; no Python repr (`[8, 128]`, `None`, `True`,
`('a', 'b')`) anywhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from cli_runner import run_cli

# A Python list, tuple or constant as repr() writes it, where words were meant.
REPR = re.compile(r"\[['\d]|\('|\bNone\b|\bTrue\b|\bFalse\b")


def plan_of(out: str) -> list[str]:
    """The dry run's comment lines (the plan), after checking the rest is the YAML of a settings file."""
    comments = [line for line in out.splitlines() if line.startswith("#")]
    assert isinstance(yaml.safe_load(out), dict)  # the comments do not stop it being a --config file
    return comments


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "kernels"],
        ["bench", "kernels", "--gemm-shapes", "qwen2.5-7b", "--gemm-rows", "8,128", "--no-gemm-tune"],
        ["bench", "concurrency"],
    ],
)
def test_a_bench_dry_run_prints_its_plan_in_words(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    """`qerl bench kernels --dry-run` printed `# --gemm-rows: [8, 16, ...]` and `# --gemm-tune: True`."""
    rc, out, err = run_cli(capsys, *argv, "-o", str(tmp_path / "out"), "--dry-run")
    assert rc == 0, err
    plan = plan_of(out)
    assert plan[0] == "# plan:" and all(line.startswith("#   ") for line in plan[1:]), plan
    assert not [line for line in plan if REPR.search(line)], plan


def test_the_kernels_plan_names_the_gemm_flags_and_whether_the_section_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_dir = str(tmp_path / "out")
    rc, out, _ = run_cli(
        capsys, "bench", "kernels", "--gemm-rows", "8,128", "--no-gemm-tune", "-o", out_dir, "--dry-run"
    )
    plan = plan_of(out)
    assert rc == 0 and "#   --gemm-rows: 8, 128" in plan and "#   --gemm-tune: off" in plan
    assert "#   GEMM section: on a CUDA GPU (skipped on the CPU)" in plan
    rc, out, _ = run_cli(capsys, "bench", "kernels", "--formats", "nf4", "-o", out_dir, "--dry-run")
    assert "#   GEMM section: skipped (nvfp4 is not among --formats)" in plan_of(out)
    rc, out, _ = run_cli(capsys, "bench", "kernels", "--device", "cpu", "-o", out_dir, "--dry-run")
    assert any(line.startswith("#   GEMM section: skipped (--device cpu") for line in plan_of(out))

"""Repository hygiene: the README's commands are the ones CI runs, and the code is ruff-clean."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\s*(bash scripts/setup\.sh .+)$", quick, flags=re.M)


def test_readme_quick_start_has_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert "qerl demo" in demo
    assert "pytest" in tests
    assert tests in (REPO / ".ci/run").read_text()


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff") or str(Path(__import__("sys").executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (it comes with qerl[dev])")
    result = subprocess.run(
        [ruff, "check", "qerl_cli", "tests", "scripts"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_changelog_follows_keep_a_changelog() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert "keepachangelog.com" in text

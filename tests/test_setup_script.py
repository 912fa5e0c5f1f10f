"""`bash scripts/setup.sh` run again on an up-to-date .venv installs nothing (no editable wheel rebuilt),
and installs again when pyproject.toml changed or the .venv's qerl is another checkout's; pyproject's
license is an SPDX string (a table made setuptools print a deprecation warning on every install)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A stand-in for .venv/bin/python: logs each call; says qerl_cli lives where QERL_FAKE_HOME points.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/calls.log"
case "$*" in
  *"import pathlib, qerl_cli"*) echo "$QERL_FAKE_HOME" ;;
  *"import torch, qerl_cli"*) echo "qerl setup ok: torch fake" ;;
esac
"""


def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "qerl"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / "constraints-cpu.txt", root / "constraints-cpu.txt")
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return root.resolve()


def setup(root: Path, home: Path) -> tuple[str, list[str]]:
    log = root / ".venv" / "bin" / "calls.log"
    log.unlink(missing_ok=True)
    env = {"PATH": "/usr/bin:/bin", "QERL_FAKE_HOME": str(home)}
    done = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return done.stdout, [call for call in calls if "pip install" in call]


def test_a_rerun_on_an_up_to_date_venv_installs_nothing(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    out, installs = setup(root, root)
    assert len(installs) == 3 and "-e .[dev]" in installs[-1]  # pip, torch, qerl: the first run
    out, installs = setup(root, root)
    assert installs == [] and "up to date" in out
    (root / "pyproject.toml").write_text((root / "pyproject.toml").read_text() + "\n# changed\n")
    _, installs = setup(root, root)
    assert len(installs) == 3  # the dependencies may have changed: install again
    _, installs = setup(root, tmp_path / "another-checkout")
    assert len(installs) == 3  # the .venv's qerl is another checkout's editable install


def test_the_license_is_an_spdx_string() -> None:
    lines = (REPO / "pyproject.toml").read_text().splitlines()  # no tomllib on Python 3.10
    assert 'license = "Apache-2.0"' in lines
    assert any(line.startswith('requires = ["setuptools>=77"]') for line in lines)  # PEP 639 expressions

"""Install hints work when copied: qerl is not on PyPI, so every message about a missing optional package
names an editable install of the clone's extras (``errors.install_hint``), never the distribution qerl."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
from cli_runner import run_cli as run

from qerl_cli.errors import EXTRAS, install_hint

REPO = Path(__file__).resolve().parents[1]
# `pip install "qerl[vllm]"`, `pip install qerl[vllm]`, `pip install -U 'qerl[vllm]'`: PyPI has no qerl.
FROM_PYPI = re.compile(r"""pip install[^"'\n]*?["']?qerl\[""")


def test_no_source_tells_a_user_to_install_qerl_from_pypi() -> None:
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted((REPO / "qerl_cli").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FROM_PYPI.search(line)
    ]
    assert found == []


def test_the_scan_finds_each_spelling_of_the_pypi_command() -> None:
    for line in ('pip install "qerl[vllm]"', "pip install qerl[vllm]", "pip install -U 'qerl[nf4]'"):
        assert FROM_PYPI.search(line), line
    assert not FROM_PYPI.search(install_hint("vllm"))


def test_the_hint_installs_the_clone_with_its_extras() -> None:
    assert install_hint("vllm") == 'pip install -e ".[vllm]" in the qerl clone'
    assert install_hint("vllm", "liger") == 'pip install -e ".[vllm,liger]" in the qerl clone'


def test_the_hint_knows_pyprojects_extras_and_refuses_others() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert set(pyproject["project"]["optional-dependencies"]) == EXTRAS
    with pytest.raises(ValueError, match="vlm"):
        install_hint("vlm")
    with pytest.raises(ValueError):
        install_hint()


def test_eval_with_vllm_missing_prints_the_hint(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hide_packages
) -> None:
    monkeypatch.chdir(tmp_path)
    hide_packages("vllm")
    rc, _, err = run(
        capsys, "eval", "m", "--engine", "vllm", "--benchmarks", "synthetic-addition", "--dry-run"
    )
    assert rc == 2
    assert '--engine vllm: vLLM is not installed (pip install -e ".[vllm]" in the qerl clone)' in err

"""Running the qerl CLI in-process from a test, as the checks-before-work tests do."""

from __future__ import annotations

import pytest

from qerl_cli.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The exit code, stdout as written (a dry run's YAML), and stderr with its whitespace folded to single
    spaces: rich wraps long messages at the console's width, which a test's substring must not depend on."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())

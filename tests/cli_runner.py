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


def usage_error(rc: int, err: str) -> bool:
    """Exit 2 with qerl's error line, not a crash. ``err`` as :func:`run_cli` folds it: the error need not
    come first, since on a loaded machine the CPU-thread notice may be printed before it."""
    return rc == 2 and "error:" in err and "internal error" not in err and "Traceback" not in err

"""llm-compressor's log lines go to stderr: its logger's console sink is whatever ``sys.stdout`` is when
it is imported, and one line comes at import already (on a CPU: no accelerator), so ``qerl quantize >
out`` held them ahead of its results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IMPORT_AND_LOG = """
from qerl_cli.quantize.pipeline import require_llmcompressor
require_llmcompressor()
from loguru import logger
logger.warning("a line of llm-compressor's logger")
print("the command's result")
"""


def test_llmcompressor_logs_to_stderr_not_into_the_results() -> None:
    pytest.importorskip("llmcompressor")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", IMPORT_AND_LOG], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the command's result\n", done.stdout
    assert "a line of llm-compressor's logger" in done.stderr

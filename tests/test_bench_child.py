"""bench.child.run_child: a measurement in a fresh process, its JSON result or None with the exit code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qerl_cli.bench.child import run_child
from qerl_cli.rollout import vllm_env

CHILD = """
import json, os, sys
spec = json.loads(open(sys.argv[1]).read())
if spec.get("write"):
    json.dump({"echo": spec, "env": os.environ.get(spec["variable"])}, open(sys.argv[2], "w"))
sys.exit(spec.get("code", 0))
"""


@pytest.fixture()
def child_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "qerl_test_child.py").write_text(CHILD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv(vllm_env.MULTIPROCESSING_ENV, raising=False)
    return "qerl_test_child"


def test_the_childs_result_comes_back_with_its_exit_code(child_module: str) -> None:
    spec = {"write": True, "x": [1, 2], "variable": vllm_env.MULTIPROCESSING_ENV}
    result, code = run_child(child_module, spec, "qerl-test-")
    assert code == 0 and result is not None and result["echo"] == spec
    # vLLM's engine core in the child's own process: its torch.cuda figures see the engine
    assert result["env"] == vllm_env.QERL_MULTIPROCESSING_DEFAULT


def test_a_child_that_wrote_nothing_gives_none_and_its_code(child_module: str) -> None:
    assert run_child(child_module, {"write": False, "code": 3}, "qerl-test-") == (None, 3)

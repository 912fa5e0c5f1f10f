"""One bench measurement in a fresh Python process: ``python -m MODULE SPEC.json OUT.json``.

An in-process ``vllm.LLM`` does not give all of its GPU memory back when deleted, so a bench that starts
several engines starts each in a child process of its own (a second engine in one process would see less
memory, and its peak figures would include the first one's leftovers). The child reads its spec from
SPEC.json and writes its result, or ``{"error": message}``, to OUT.json. vLLM's engine core stays in the
child's own process (qerl's multiprocessing default), so ``torch.cuda`` there sees its memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from qerl_cli.rollout import vllm_env


def run_child(module: str, spec: dict[str, Any], prefix: str) -> tuple[dict[str, Any] | None, int]:
    """Run ``python -m module`` on ``spec``; its JSON result (None: it wrote none, e.g. killed for
    memory; its own output, on this process's console, says why) and its exit code."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        spec_file, out = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.setdefault(vllm_env.MULTIPROCESSING_ENV, vllm_env.QERL_MULTIPROCESSING_DEFAULT)
        command = [sys.executable, "-m", module, str(spec_file), str(out)]
        proc = subprocess.run(command, env=env, check=False)
        return (json.loads(out.read_text()) if out.is_file() else None), proc.returncode

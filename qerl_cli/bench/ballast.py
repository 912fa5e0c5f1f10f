"""``memory_cap_gib``: run a benchmark as if the GPU had only that much memory.

A helper process allocates everything above the cap and sleeps until the benchmark ends. It must be a
separate process: the engines and the trainer then see the cap through ``torch.cuda.mem_get_info``
exactly as on the smaller GPU, while their own ``torch.cuda`` peaks do not include the held memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.torch_utils import GIB

START_TIMEOUT_S = 120


@contextmanager
def memory_cap(cap_gib: float | None) -> Iterator[dict[str, Any] | None]:
    """Hold the GPU's free memory above ``cap_gib`` while the block runs; yields what was held (GiB
    held, free and total), None without a cap."""
    if cap_gib is None:
        yield None
        return

    if not torch.cuda.is_available():
        raise QerlError("memory_cap_gib needs a CUDA GPU (it holds GPU memory); drop it on the CPU")
    with tempfile.TemporaryDirectory(prefix="qerl-ballast-") as tmp:
        ready = Path(tmp) / "ready.json"
        proc = subprocess.Popen([sys.executable, "-m", "qerl_cli.bench.ballast", str(cap_gib), str(ready)])
        try:
            held = _wait_ready(proc, ready)
            yield held
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen, ready: Path) -> dict[str, Any]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready.is_file():
            return json.loads(ready.read_text())
        if proc.poll() is not None:
            raise QerlError(f"the process holding GPU memory for memory_cap_gib exited ({proc.returncode})")
        time.sleep(0.5)
    raise QerlError(f"the process holding GPU memory for memory_cap_gib did not start in {START_TIMEOUT_S} s")


def _hold(cap_gib: float, ready: Path) -> None:
    free, total = torch.cuda.mem_get_info()
    hold = max(0, free - int(cap_gib * GIB))
    block = torch.empty(hold, dtype=torch.uint8, device="cuda") if hold else None
    free_now, _ = torch.cuda.mem_get_info()
    ready.write_text(
        json.dumps({"held_gib": hold / GIB, "free_gib": free_now / GIB, "total_gib": total / GIB})
    )
    while block is not None or hold == 0:  # until terminated by memory_cap
        time.sleep(3600)


if __name__ == "__main__":
    _hold(float(sys.argv[1]), Path(sys.argv[2]))

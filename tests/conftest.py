"""Shared fixtures: every test runs offline, and the tiny model is built once per session."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist the workers share the cores: one worker's torch (and the processes its tests
# start) takes its share of threads, not all of them. Read by torch when it is imported.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Triton chooses interpreting vs compiling when it is imported, and bitsandbytes or transformers may
# import it first: set the interpreter before any of them so the Triton kernels run on the CPU in
# tests/test_kernels.py. CPU tensors still take the torch path unless QERL_TRITON_CPU=1.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the Triton kernels of CPU tensors under the interpreter (tests/test_kernels.py and the FP8
    rounding kernel's tests); skipped with a GPU, whose compiled kernels the gpu tests cover."""
    if not _no_cuda():
        pytest.skip("kernels are compiled for the GPU in this process; the gpu tests cover them")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 must be set before triton is imported (tests/conftest.py does)")
    monkeypatch.setenv("QERL_TRITON_CPU", "1")


@pytest.fixture
def hide_packages(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``hide_packages("vllm", ...)``: ``importlib.util.find_spec`` reports those packages as not installed
    for the rest of the test (every other lookup as it is), as on a machine without them."""
    import importlib.util

    real = importlib.util.find_spec

    def hide(*names: str) -> None:
        def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
            return None if name in names else real(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return hide


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 model folder (seed 0), shared read-only by the whole session."""
    from qerl_cli.modeling.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU tests without CUDA and vLLM tests without vLLM, saying why; put the files holding `slow`
    tests first.

    xdist (``--dist loadfile --no-loadscope-reorder``, pyproject.toml) hands whole files to the workers in
    this order. The files with slow tests hold the minutes-long ones (tests/test_demo.py alone is about a
    third of the suite's CPU time): handed out first, they are spread over the workers while the many short
    files fill in after them, so the workers finish close together. Handed out last (xdist's own order puts
    files with few tests last, as these are), one worker would run one of them alone at the end."""
    import importlib.util

    import torch

    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file's own order is kept

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    no_vllm = pytest.mark.skip(reason="needs vLLM (the vllm extra, on a GPU machine)")
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(no_vllm)


CALIB_WORDS = ("add", "two", "numbers", "what", "is", "plus", "minus", "times", "answer", "seven", "the")


@pytest.fixture(scope="module")  # test_quantize.py, test_error_init.py
def calib_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small OpenThoughts-shaped .jsonl: a system prompt and from/value conversations."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    with path.open("w") as handle:
        for i in range(10):
            question = " ".join(rng.choice(CALIB_WORDS) for _ in range(12))
            record = {
                "system": "Think step by step.",
                "conversations": [
                    {"from": "user", "value": question},
                    {"from": "assistant", "value": f"The answer is {i * 7}."},
                ],
            }
            handle.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def calib_ids(tiny_model_dir: Path, calib_file: Path):  # -> torch.Tensor
    """Token ids of the calibration conversations' turns joined without the chat template (the
    calibration samples are rendered with it): text like the calibration text, cut to one width."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [json.loads(line) for line in calib_file.read_text().splitlines()]
    texts = [" ".join(turn["value"] for turn in row["conversations"]) for row in rows]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"][:48] for text in texts]
    width = min(len(row) for row in ids)
    return torch.tensor([row[:width] for row in ids])

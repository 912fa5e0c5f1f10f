"""Evaluation files: ``results.json`` and one ``samples_<bench>.jsonl`` per benchmark.

A samples line is one problem: its prompt and gold answer, then per-sample lists (completion text,
extracted answer, extraction method, correctness, finish reason, token count, timeout, extraction
failure). ``--rescore`` and ``--baseline`` work from these files alone.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from qerl_cli.envinfo import versions_of
from qerl_cli.errors import QerlError
from qerl_cli.files import atomic_write_text, read_json_report, write_json

RESULTS_NAME = "results.json"
MARKDOWN_NAME = "results.md"
SAMPLES_PREFIX = "samples_"
_PACKAGES = (
    "qerl",
    "torch",
    "transformers",
    "peft",
    "vllm",
    "datasets",
    "math-verify",
    "latex2sympy2_extended",
)


def samples_path(out_dir: str | Path, benchmark: str) -> Path:
    return Path(out_dir) / f"{SAMPLES_PREFIX}{benchmark}.jsonl"


def versions() -> dict[str, str | None]:
    """Installed versions of what decides the numbers (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version(), **versions_of(_PACKAGES)}
    torch = sys.modules.get("torch")  # only if already imported: rescoring should stay light
    if torch is not None and torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def write_samples(path: Path, records: Iterable[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def read_samples(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise QerlError(f"samples file not found: {path}")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise QerlError(f"{path}:{number} is not valid JSON ({exc}); the file is damaged") from None
    return records


def find_sample_files(directory: str | Path) -> dict[str, Path]:
    """``{benchmark: samples file}`` for every ``samples_<bench>.jsonl`` in ``directory``."""
    folder = Path(directory)
    if not folder.is_dir():
        raise QerlError(f"not a directory: {folder}")
    files = {
        p.name[len(SAMPLES_PREFIX) : -len(".jsonl")]: p
        for p in sorted(folder.glob(f"{SAMPLES_PREFIX}*.jsonl"))
    }
    if not files:
        raise QerlError(f"{folder} holds no {SAMPLES_PREFIX}<benchmark>.jsonl files to rescore")
    return files


def write_results(out_dir: str | Path, results: dict[str, Any]) -> Path:
    return write_json(Path(out_dir) / RESULTS_NAME, results, default=str)


def read_results(path: str | Path) -> dict[str, Any]:
    """A results.json (or the folder holding one)."""
    data = read_json_report(path, RESULTS_NAME, "the results.json of an earlier `qerl eval` run")
    if "benchmarks" not in data:
        raise QerlError(f"{path} is not a qerl eval results file (no 'benchmarks')")
    return data

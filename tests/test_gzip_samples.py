"""Per-sample files kept gzip'd in benchmarks/ (``samples_<bench>.jsonl.gz``) read as the plain ones do.

Stages write them plain; the repository keeps large ones compressed, and ``qerl eval --rescore`` /
``--baseline`` and the benchmark scripts take a run folder as it is.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from qerl_cli.config import EvalConfig
from qerl_cli.errors import QerlError
from qerl_cli.evaluation import run_eval
from qerl_cli.evaluation.results import find_sample_files, read_samples, samples_path
from qerl_cli.files import read_text_maybe_gzip

REPO = Path(__file__).resolve().parents[1]
# 32 problems x 8 samples of the untrained Gemma 3 270M (BF16), graded by the final grader.
COMMITTED = REPO / "benchmarks" / "gemma3-270m-ablation-h100-2026-11-24" / "signal-cpu" / "bf16-t0.7"


def quiet(_: str) -> None:
    pass


def write_gz(path: Path, records: list[dict]) -> Path:
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    return path


def test_rescoring_a_committed_gzipped_folder_gives_its_recorded_grades(tmp_path: Path) -> None:
    folder = shutil.copytree(COMMITTED, tmp_path / "run")
    assert {p.name for p in folder.iterdir()} == {"results.json", "samples_synthetic-wordproblems.jsonl.gz"}
    recorded = json.loads((folder / "results.json").read_text())["benchmarks"]["synthetic-wordproblems"]

    rescored = run_eval(EvalConfig(rescore=str(folder), grader_workers=1), log=quiet)

    score = rescored.benchmarks["synthetic-wordproblems"]
    assert score.per_problem == recorded["per_problem"] and len(score.per_problem) == 32
    assert score.metrics.pass_at_1 == pytest.approx(recorded["metrics"]["pass@1"])
    # The new grades go to a plain file beside the gzip'd one, which a later rescore then reads.
    assert (folder / "samples_synthetic-wordproblems.jsonl").is_file()
    assert find_sample_files(folder)["synthetic-wordproblems"].name == "samples_synthetic-wordproblems.jsonl"


def test_a_samples_file_is_found_and_read_plain_or_gzipped(tmp_path: Path) -> None:
    old = [{"id": "p1", "gold": "1", "completions": ["1"]}]
    write_gz(tmp_path / "samples_demo.jsonl.gz", old)
    assert find_sample_files(tmp_path) == {"demo": tmp_path / "samples_demo.jsonl.gz"}
    assert read_samples(samples_path(tmp_path, "demo")) == old  # the plain name finds the .gz beside it

    new = [{"id": "p1", "gold": "1", "completions": ["2"]}]
    samples_path(tmp_path, "demo").write_text(json.dumps(new[0]) + "\n")
    assert find_sample_files(tmp_path) == {"demo": tmp_path / "samples_demo.jsonl"}  # the newer, plain
    assert read_samples(samples_path(tmp_path, "demo")) == new


def test_a_damaged_or_missing_samples_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "samples_demo.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(QerlError, match="samples_demo.jsonl.gz cannot be read .* damaged"):
        read_samples(samples_path(tmp_path, "demo"))
    with pytest.raises(QerlError, match="samples file not found"):
        read_samples(samples_path(tmp_path, "other"))
    with pytest.raises(FileNotFoundError, match=r"other.jsonl \(or other.jsonl.gz\) not found"):
        read_text_maybe_gzip(tmp_path / "other.jsonl")

"""How many stored completions change grade between two versions of qerl's grader.

Reads ``samples_<bench>.jsonl`` files (``qerl eval`` writes them; give files or folders, searched
recursively), grades every completion with the grader of this checkout ("new") and with an older
one ("old": a git revision given by ``--old-rev``, or else the grades stored in the files), and
prints how many completions went wrong -> right and right -> wrong, by where the answer was found,
with examples. ``--output FILE`` writes the same as JSON.

Each side grades in its own process through that version's worker pool (math-verify, hard
per-item timeout), so the old code is run as it was, not imitated.

    python benchmarks/gemma3-270m-ablation-h100-2026-11-24/regrade_samples.py runs/eval-smollm2 \
        --old-rev b8cf92e --output regrade.json

It made this folder's ``regrade_smollm2_with_fixed_grader.json`` (``run.sh regrade``) and
``first-reward/regrade_with_fixed_grader.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # the checkout: benchmarks/<run>/this file
# Runs inside the grading subprocess, with the chosen version of qerl_cli first on sys.path.
_GRADE_SCRIPT = """
import json, sys
from qerl_cli.rewards import Grader
pairs = json.load(sys.stdin)
with Grader(workers={workers}, timeout_s={timeout}) as grader:
    results = grader.grade_many([c for c, _ in pairs], [g for _, g in pairs])
json.dump([[r.correct, r.extracted, r.method] for r in results], sys.stdout)
"""


@dataclass
class Sample:
    file: str
    problem: str
    gold: str
    completion: str
    stored_correct: bool | None


def find_sample_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(sorted(path.rglob("samples_*.jsonl")))
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"error: {path} is neither a samples file nor a folder")
    return files


def read_samples(files: list[Path]) -> list[Sample]:
    samples = []
    for file in files:
        for line in file.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            stored = record.get("correct") or [None] * len(record["completions"])
            for completion, correct in zip(record["completions"], stored, strict=True):
                samples.append(Sample(str(file), str(record["id"]), str(record["gold"]), completion, correct))
    return samples


def source_at(revision: str, into: Path) -> Path:
    """qerl_cli as it was at ``revision`` (``git archive``), unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", revision, "qerl_cli"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def grade_with(source: Path, samples: list[Sample], workers: int, timeout_s: float) -> list[list[Any]]:
    """[correct, extracted, method] per sample, graded by the qerl_cli found under ``source``."""
    env = dict(os.environ, PYTHONPATH=str(source))
    script = _GRADE_SCRIPT.format(workers=workers, timeout=timeout_s)
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([[s.completion, s.gold] for s in samples]),
        capture_output=True,
        text=True,
        env=env,
        cwd=source,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"error: grading with {source} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def compare(samples: list[Sample], old: list[list[Any]], new: list[list[Any]], examples: int) -> dict:
    gained: list[dict] = []
    lost: list[dict] = []
    by_method: Counter[str] = Counter()
    for sample, (old_ok, old_text, _), (new_ok, new_text, new_method) in zip(samples, old, new, strict=True):
        if old_ok == new_ok:
            continue
        entry = {
            "file": sample.file,
            "problem": sample.problem,
            "gold": sample.gold,
            "completion_end": sample.completion[-160:],
            "old_extracted": old_text,
            "new_extracted": new_text,
            "method": new_method,
        }
        (gained if new_ok else lost).append(entry)
        by_method[f"{'gained' if new_ok else 'lost'}:{new_method}"] += 1
    total = len(samples)
    return {
        "completions": total,
        "files": sorted({s.file for s in samples}),
        "old_correct": sum(bool(o[0]) for o in old),
        "new_correct": sum(bool(n[0]) for n in new),
        "wrong_to_right": len(gained),
        "right_to_wrong": len(lost),
        "changed_fraction": (len(gained) + len(lost)) / total if total else 0.0,
        "changes_by_method": dict(sorted(by_method.items())),
        "examples_wrong_to_right": gained[:examples],
        "examples_right_to_wrong": lost[:examples],
    }


def print_report(report: dict, old_label: str) -> None:
    n = report["completions"]
    print(f"{n} completions in {len(report['files'])} file(s); old grader: {old_label}")
    print(f"correct: old {report['old_correct']} ({report['old_correct'] / max(n, 1):.1%}), "
          f"new {report['new_correct']} ({report['new_correct'] / max(n, 1):.1%})")  # fmt: skip
    print(f"changed: {report['wrong_to_right']} wrong -> right, {report['right_to_wrong']} right -> wrong "
          f"({report['changed_fraction']:.1%} of completions)")  # fmt: skip
    for key, count in report["changes_by_method"].items():
        print(f"  {key}: {count}")
    for title in ("examples_wrong_to_right", "examples_right_to_wrong"):
        for e in report[title]:
            print(f"[{title[9:]}] gold {e['gold']!r}: old {e['old_extracted']!r} -> new "
                  f"{e['new_extracted']!r} ({e['method']}); ends {e['completion_end'][-80:]!r}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="samples_<bench>.jsonl files or folders holding them")
    parser.add_argument("--old-rev", help="git revision whose grader is 'old' (default: the stored grades)")
    parser.add_argument("--output", help="write the report as JSON here")
    parser.add_argument("--examples", type=int, default=5, help="examples of each kind of change")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args(argv)

    samples = read_samples(find_sample_files(args.paths))
    if not samples:
        raise SystemExit("error: no completions found in the samples files given")
    new = grade_with(REPO, samples, args.workers, args.timeout_s)
    if args.old_rev:
        with tempfile.TemporaryDirectory(prefix="qerl-old-grader-") as folder:
            old = grade_with(source_at(args.old_rev, Path(folder)), samples, args.workers, args.timeout_s)
        old_label = f"git {args.old_rev}"
    else:
        if any(s.stored_correct is None for s in samples):
            raise SystemExit("error: some samples carry no stored grade: give --old-rev")
        old = [[s.stored_correct, None, None] for s in samples]
        old_label = "stored grades"
    report = compare(samples, old, new, args.examples)
    report["old_grader"] = old_label
    print_report(report, old_label)
    if args.output:
        text = json.dumps(report, indent=1, ensure_ascii=False) + "\n"
        Path(args.output).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

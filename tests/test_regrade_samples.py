"""The regrade tool of benchmarks/gemma3-270m-ablation-h100-2026-11-24: counts the completions whose grade
the answer normalisation changes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "benchmarks" / "gemma3-270m-ablation-h100-2026-11-24" / "regrade_samples.py"


def _script():
    spec = importlib.util.spec_from_file_location("regrade_samples", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_regrade_counts_changes_against_the_stored_grades(tmp_path: Path, capsys) -> None:
    records = [
        # stored grades as the grader before the answer normalisation gave them
        {"id": "p1", "gold": "72", "completions": ["<answer>72.</answer>", "The answer is 71."],
         "correct": [False, False]},
        {"id": "p2", "gold": "1000", "completions": ["\\boxed{1\\,000}", "The answer is 1000."],
         "correct": [False, True]},
        {"id": "p3", "gold": "5", "completions": ["<answer>5</answer>"], "correct": [True]},
    ]  # fmt: skip
    folder = tmp_path / "eval" / "run-a"
    folder.mkdir(parents=True)
    (folder / "samples_demo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "regrade.json"
    assert _script().main([str(tmp_path / "eval"), "--output", str(out), "--workers", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["completions"] == 5
    assert (report["old_correct"], report["new_correct"]) == (2, 4)
    assert (report["wrong_to_right"], report["right_to_wrong"]) == (2, 0)
    assert report["changes_by_method"] == {"gained:answer_tag": 1, "gained:boxed": 1}
    assert {e["new_extracted"] for e in report["examples_wrong_to_right"]} == {"72", "1000"}
    assert "2 wrong -> right, 0 right -> wrong" in capsys.readouterr().out

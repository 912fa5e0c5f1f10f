"""Re-grade the training completions the runs logged (`completions.jsonl`, kept here gzip'd as
`completions.jsonl.gz`: one prompt group a step) with this checkout's reward grading, and count the
rewarded ones it now grades wrong (and the reverse).

    G=benchmarks/gemma3-270m-ablation-h100-2026-11-24/fixed-reward
    .venv/bin/python $G/reward-hacks/regrade_training.py $G benchmarks/smollm2-awq-h200-2026-11-24/runs \
        > $G/reward-hacks/regrade_training_completions.json

Completions are cut at the stop strings of the run's prompt template (its `prompt.json`) first, as the
training reward does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from qerl_cli.files import read_text_maybe_gzip
from qerl_cli.rewards import Grader
from qerl_cli.rewards.extract import cut_at_stop


def regrade(folder: Path, grader: Grader) -> dict[str, object]:
    stop = tuple(json.loads((folder / "prompt.json").read_text()).get("stop", ()))  # the run's template's
    text = read_text_maybe_gzip(folder / "completions.jsonl")  # or its .gz
    groups = [json.loads(line) for line in text.splitlines() if line]
    steps = [g["step"] for g in groups for _ in g["completions"]]
    texts = [cut_at_stop(text, stop) for g in groups for text in g["completions"]]
    golds = [g["gold"] for g in groups for _ in g["completions"]]
    before = [reward > 0 for g in groups for reward in g["rewards"]]
    now = [grade.correct for grade in grader.grade_many(texts, golds)]
    graded = list(zip(steps, texts, before, now, strict=True))
    lost = [(step, text) for step, text, was, is_ in graded if was and not is_]
    return {
        "completions": len(texts),
        "rewarded": sum(before),
        "rewarded_now_wrong": len(lost),
        "wrong_now_right": sum(is_ and not was for was, is_ in zip(before, now, strict=True)),
        "first_step_now_wrong": min((step for step, _ in lost), default=None),
        "examples_now_wrong": [text for _, text in lost[:3]],
    }


def main(roots: list[str]) -> None:
    found = sorted({f.parent for root in roots for f in Path(root).glob("**/seed-*/completions.jsonl*")})
    with Grader(workers=2, timeout_s=5.0) as grader:
        report = {str(folder): regrade(folder, grader) for folder in found}
    print(json.dumps(report, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1:])

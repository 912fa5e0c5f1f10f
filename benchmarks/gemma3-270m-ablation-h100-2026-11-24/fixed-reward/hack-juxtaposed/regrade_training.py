"""Re-grade the training completions the runs logged (`completions.jsonl`: one prompt group a step) with
this checkout's reward grading, and count the rewarded ones it now grades wrong (and the reverse).

    .venv/bin/python benchmarks/gemma3-270m-ablation-h100-2026-11-24/fixed-reward/hack-juxtaposed/regrade_training.py \
        benchmarks/gemma3-270m-ablation-h100-2026-11-24/fixed-reward benchmarks/smollm2-awq-h200-2026-11-24/runs \
        > regrade_training_completions.json

Completions are cut at the stop strings of the run's prompt template (its `prompt.json`) first, as the
training reward does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from qerl_cli.rewards import Grader
from qerl_cli.rewards.extract import cut_at_stop


def regrade(folder: Path, grader: Grader) -> dict[str, object]:
    stop = tuple(json.loads((folder / "prompt.json").read_text()).get("stop", ()))  # the run's template's
    groups = [json.loads(line) for line in (folder / "completions.jsonl").read_text().splitlines() if line]
    flat = [(g["step"], text, g["gold"], old) for g in groups for text, old in zip(g["completions"], g["rewards"])]
    new = grader.grade_many([cut_at_stop(text, stop) for _, text, _, _ in flat], [gold for *_, gold, _ in flat])
    lost = [(step, text) for (step, text, _, old), g in zip(flat, new) if old > 0 and not g.correct]
    return {
        "completions": len(flat),
        "rewarded": sum(old > 0 for *_, old in flat),
        "rewarded_now_wrong": len(lost),
        "wrong_now_right": sum(old == 0 and g.correct for (*_, old), g in zip(flat, new)),
        "first_step_now_wrong": min((step for step, _ in lost), default=None),
        "examples_now_wrong": [text for _, text in lost[:3]],
    }


def main(roots: list[str]) -> None:
    found = sorted(f.parent for root in roots for f in Path(root).glob("**/seed-*/completions.jsonl"))
    with Grader(workers=2, timeout_s=5.0) as grader:
        report = {str(folder): regrade(folder, grader) for folder in found}
    print(json.dumps(report, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1:])

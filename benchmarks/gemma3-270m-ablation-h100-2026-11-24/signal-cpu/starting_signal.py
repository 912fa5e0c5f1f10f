"""Reward signal before training, from `qerl eval` samples (8 a problem): groups with a correct answer,
and groups with a reward spread (what GRPO learns from).

    python starting_signal.py DIR [DIR ...]   # each DIR: a `qerl eval -o DIR` output with samples_*.jsonl

The folders here keep their samples gzip'd (`samples_*.jsonl.gz`); either is read.
"""

import json
import sys
from pathlib import Path

from qerl_cli.evaluation.results import find_sample_files, read_samples


def signal(folder: Path) -> dict[str, float]:
    samples = read_samples(next(iter(find_sample_files(folder).values())))
    per_problem = samples[0]["num_samples"]
    correct = [s["num_correct"] for s in samples]
    n = len(correct)
    return {
        "problems": n,
        "samples_per_problem": per_problem,
        "sample_accuracy": sum(correct) / (n * per_problem),
        "groups_with_a_correct_answer": sum(c > 0 for c in correct) / n,
        "groups_with_reward_spread": sum(0 < c < per_problem for c in correct) / n,
    }


if __name__ == "__main__":
    print(json.dumps({Path(d).name: signal(Path(d)) for d in sys.argv[1:]}, indent=2))

"""Tables of this run's figures (summary.md) from its run folders: each base's kept quality, held-out
pass@1 per arm and GPU kind, what AQN's noise did, and the two-GPU data-parallel steps.

    python benchmarks/gemma3-270m-learning-gap-2026-11-27/summarize.py
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = {"4x H200": HERE / "h200x4" / "runs", "4x H100": HERE / "h100x4" / "runs"}
START_STEPS = 6  # the first 10% of the recipe's 60 steps, as qerl compare's start columns


def _jsonl(path: Path) -> list[dict]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as handle:
            text = handle.read()
    else:
        text = path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and its standard error over seeds (None for one seed)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return m, sd / math.sqrt(len(values))


def _pct(m: float, se: float | None) -> str:
    return f"{100 * m:.1f}%" + (f" ± {100 * se:.1f}" if se is not None else "")


def heldout() -> dict[str, dict[str, dict[int, float]]]:
    """{arm: {gpu kind: {seed: pass@1}}}."""
    found: dict[str, dict[str, dict[int, float]]] = {}
    for kind, root in RUNS.items():
        for result in sorted(root.glob("*/seed-*/result.json")):
            r = json.loads(result.read_text())
            found.setdefault(r["arm"], {}).setdefault(kind, {})[r["seed"]] = r["heldout"]["pass@1"]
    return found


def heldout_table() -> list[str]:
    lines = [
        "| arm | 4x H200, seeds 0-2 | per seed | 4x H100 | per seed | all seeds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for arm, kinds in sorted(heldout().items()):
        cells = []
        for kind in RUNS:
            seeds = kinds.get(kind, {})
            values = list(seeds.values())
            cells += [_pct(*mean_se(values)) if values else "-",
                      " ".join(f"{s}: {100 * v:.1f}" for s, v in sorted(seeds.items())) or "-"]  # fmt: skip
        pooled = [v for seeds in kinds.values() for v in seeds.values()]
        cells.append(f"{_pct(*mean_se(pooled))} ({len(pooled)})")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def _avg(runs: list[list[dict]], key: str, part: slice) -> float:
    values = [s[key] for steps in runs for s in steps[part]]
    return sum(values) / len(values)


def start_table() -> list[str]:
    lines = ["| arm | runs | start reward | no-spread groups (start) | final reward (last 6 steps) |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    arms: dict[str, list[list[dict]]] = {}
    for root in RUNS.values():
        for path in sorted(root.glob("*/seed-*/metrics.jsonl")):
            arms.setdefault(path.parts[-3], []).append(_jsonl(path))
    for arm, runs in sorted(arms.items()):
        first, last = slice(0, START_STEPS), slice(-START_STEPS, None)
        lines.append(
            f"| {arm} | {len(runs)} | {_avg(runs, 'reward_mean', first):.3f} | "
            f"{100 * _avg(runs, 'zero_std_group_fraction', first):.1f}% | "
            f"{_avg(runs, 'reward_mean', last):.3f} |"
        )
    return lines


CALIBRATION = re.compile(
    r"target ([\d.]+), sigma ([\d.e-]+) measured ([\d.]+).*without noise ([\d.]+) changed"
)


def aqn_table() -> list[str]:
    lines = [
        "| run | GPU | target | sigma_start used | its effect | noise-free repeat "
        "| tokens changed, stages 1-9 | held-out |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, root in RUNS.items():
        for metrics in sorted(root.glob("nvfp4-aqn*/seed-*/metrics.jsonl")):
            run = metrics.parent
            notes = (run / "run_notes.log").read_text() if (run / "run_notes.log").is_file() else ""
            found = CALIBRATION.search(notes)
            target, sigma, effect, floor = found.groups() if found else ("- (raw)", "", "", "")
            steps = _jsonl(metrics)
            if not sigma:
                sigma = f"{max(s.get('rollout/noise_sigma', 0.0) for s in steps):g}"
            changed = [s["aqn_tokens_changed"] for s in steps if "aqn_tokens_changed" in s]
            result = json.loads((run / "result.json").read_text())["heldout"]["pass@1"]
            lines.append(
                f"| {run.parent.name}/{run.name} | {kind} | {target} | {sigma} | {effect or '-'} | "
                f"{floor or '-'} | {' '.join(f'{c:.2f}' for c in changed)} | {100 * result:.1f}% |"
            )
    return lines


def quality_table(path: Path) -> list[str]:
    report = json.loads(path.read_text())
    lines = [
        f"{report['text']['rows']} held-out qerl-text rows, {report['text']['tokens']} tokens "
        f"({report['device']}).",
        "",
        "| base | KL to BF16 (nats/token) | top-1 agreement | perplexity |",
        "| --- | --- | --- | --- |",
        f"| BF16 (reference) | 0 | 1 | {report['reference_perplexity']:.2f} |",
    ]
    for row in report["rows"]:
        lines.append(f"| {row['label']} | {row['kl_to_reference']:.4f} | {row['top1_agreement']:.3f} | "
                     f"{row['perplexity']:.2f} |")  # fmt: skip
    return lines


def data_parallel_table() -> list[str]:
    steps = _jsonl(HERE / "h100x4" / "dp" / "metrics.jsonl")
    lines = [
        "| step | GPUs | completions (both ranks) | rollout s | update s | step s "
        "| rollout tokens/s (both ranks) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in steps:
        lines.append(
            f"| {s['step']} | {s['world_size']} | {int(s['num_sequences'])} | "
            f"{s['time_rollout_s']:.2f} | {s['time_update_s']:.2f} | {s['time_step_s']:.2f} | "
            f"{s['rollout_tokens_per_s']:.0f} |"
        )
    return lines


def main() -> None:
    text = "\n".join([
        "# Summary (written by summarize.py)", "",
        "## Held-out pass@1 (256 problems, greedy)", "", *heldout_table(), "",
        "## Start and end of training", "", *start_table(), "",
        "## AQN: the noise's measured effect", "", *aqn_table(), "",
        "## Quality kept by each base (4x H200 run)", "",
        *quality_table(HERE / "h200x4" / "quality.json"), "",
        "## Two-GPU data-parallel GRPO steps (4x H100 run, GPUs 2-3)", "", *data_parallel_table(), "",
    ])  # fmt: skip
    (HERE / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

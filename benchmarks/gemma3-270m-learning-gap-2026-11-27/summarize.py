"""Tables of this run's figures (summary.md): each base's kept quality, and the training reward of each run
beside the same seeds of the 2026-11-24 ablation (same recipe, data and seeds; AWQ bases).

    python benchmarks/gemma3-270m-learning-gap-h100-2026-11-27/summarize.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
EARLIER = HERE.parent / "gemma3-270m-ablation-h100-2026-11-24" / "fixed-reward"
START_STEPS = 6  # the first 10% of the recipe's 60 steps, as qerl compare's start columns
LATE = (40, 52)  # steps 41-52: the last steps every seed-0 run of this session reached


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if pct else f"{value:.3f}"


def run_row(label: str, steps: list[dict]) -> str:
    reward = [s["reward_mean"] for s in steps]
    no_spread = [s["zero_std_group_fraction"] for s in steps]
    blocks = " ".join(_fmt(_mean(reward[i : i + 10])) for i in range(0, len(reward), 10))
    late = _mean(reward[LATE[0] : LATE[1]]) if len(reward) >= LATE[1] else None
    return (
        f"| {label} | {len(steps)} | {_fmt(_mean(reward[:START_STEPS]))} | "
        f"{_fmt(_mean(no_spread[:START_STEPS]), pct=True)} | {_fmt(late)} | {blocks} |"
    )


def quality_table() -> list[str]:
    report = json.loads((HERE / "quality.json").read_text())
    lines = [
        f"Held-out text: {report['text']['rows']} qerl-text rows, {report['text']['tokens']} tokens "
        f"({report['device']}).",
        "",
        "| base | KL to BF16 (nats/token) | top-1 agreement | perplexity |",
        "| --- | --- | --- | --- |",
        f"| BF16 (reference) | 0 | 1 | {report['reference_perplexity']:.2f} |",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['label']} | {row['kl_to_reference']:.4f} | {row['top1_agreement']:.3f} | "
            f"{row['perplexity']:.2f} |"
        )
    return lines


def training_table() -> list[str]:
    lines = [
        "| run | steps | start reward | no-spread groups (start) | reward, steps 41-52 | reward per 10 steps"
        " |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for path in sorted((HERE / "runs").glob("*/seed-*/metrics.jsonl")):
        lines.append(run_row(f"{path.parts[-3]}/{path.parts[-2]} (this run)", _metrics(path)))
    for arm in ("bf16-lora", "nvfp4-lora", "nvfp4-lora-rtn"):
        for path in sorted((EARLIER / arm).glob("seed-*/metrics.jsonl")):
            lines.append(run_row(f"{arm}/{path.parts[-2]} (2026-11-24)", _metrics(path)))
    return lines


def main() -> None:
    text = "\n".join(["## Quality kept by each base", "", *quality_table(), "", "## Training reward", "",
                      *training_table(), ""])  # fmt: skip
    (HERE / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

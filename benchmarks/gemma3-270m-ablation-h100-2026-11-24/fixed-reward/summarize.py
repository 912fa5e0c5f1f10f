"""Rebuild this folder's compare.md/.json/.png from its runs, on a CPU.

The runs here came from six H100 machines (`qerl compare`'s own summary needs the bases it trained on,
which were on the device): this writes the same report with `qerl compare`'s own code, the untrained
bases' held-out figures taken from `base-heldout/` (each evaluated on the device by `qerl compare`). A
run's held-out figure is its `heldout/results.json`: the device's evaluation re-graded by `qerl eval
--rescore` with this checkout's grading (the device's own is `heldout_results.json`); where a run has no
`heldout/` (`nvfp4-lora-rtn`: its samples were lost with the machine), the device's own, in its `result.json`.

    .venv/bin/python benchmarks/gemma3-270m-ablation-h100-2026-11-24/fixed-reward/summarize.py
"""

from __future__ import annotations

import os
from pathlib import Path

from qerl_cli.compare.arms import select_arms
from qerl_cli.compare.heldout import read_base_heldout
from qerl_cli.compare.runs import load_recipe
from qerl_cli.compare.summary import write_report

# Relative to where it is run (the repository root), so the report names no machine's folders.
HERE = Path(os.path.relpath(Path(__file__).resolve().parent))
RECIPE = "recipes/gemma3_270m_wordproblems.yaml"
# Arm -> (its untrained base's folder under base-heldout/ or None, that base's label in the table)
BASES: dict[str, tuple[str | None, str]] = {
    "bf16-lora": ("gemma-3-270m-q4_k_m-c1d3c160", "bf16"),
    "nvfp4-lora": ("nvfp4-awq-7ae4ea09", "nvfp4 AWQ"),
    "nvfp4-aqn": ("nvfp4-awq-7ae4ea09", "nvfp4 AWQ"),
    "nf4-lora": ("nf4-awq-62753d77", "nf4 AWQ"),
    "bf16-lora-lr3e-4": ("gemma-3-270m-q4_k_m-c1d3c160", "bf16"),
    "nvfp4-aqn-lr3e-4": ("nvfp4-awq-7ae4ea09", "nvfp4 AWQ"),
    "nvfp4-lora-g16": ("nvfp4-awq-7ae4ea09", "nvfp4 AWQ"),
    "bf16-lora-g16": ("gemma-3-270m-q4_k_m-c1d3c160", "bf16"),
    "nvfp4-lora-t1": ("nvfp4-awq-7ae4ea09", "nvfp4 AWQ"),
    "nvfp4-dequant-lora": ("nvfp4-awq-dequantized-3abc8174", "nvfp4 AWQ dequantized to BF16"),
    # The run stopped before the RTN base's own held-out evaluation ran (training had finished).
    "nvfp4-lora-rtn": (None, "nvfp4 RTN"),
}


def main() -> None:
    _, settings = load_recipe(RECIPE)
    arms = select_arms(settings, list(BASES))
    bases = HERE / "base-heldout"
    base_heldout = {
        arm: read_base_heldout(bases / folder) if folder else None for arm, (folder, _) in BASES.items()
    }
    labels = {arm: label for arm, (_, label) in BASES.items()}
    report = write_report(HERE, arms, [0, 1, 2], settings, None, recipe=RECIPE, base_heldout=base_heldout,
                          base_labels=labels)  # fmt: skip
    for warning in report.warnings:
        print("warning:", warning)
    print((HERE / "compare.md").read_text())


if __name__ == "__main__":
    main()

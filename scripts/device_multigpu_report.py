"""Summary of ``scripts/device_multigpu.sh``: step time, rollout tokens/s per GPU, scaling efficiency.

    python scripts/device_multigpu_report.py OUT_DIR --gpus 1,2,4 --scaling weak --engine vllm \
        --status 1=0 --status 2=0 --status 4=124 --status tp2=0

reads ``OUT_DIR/metrics-<N>gpu.jsonl`` (one training run on N GPUs each) and ``OUT_DIR/tp2.json``, and
writes ``OUT_DIR/multigpu.json``. Step 1 of each run is left out of the means (CUDA graphs, autotuning,
vLLM's first sleep). Throughput is generated rollout tokens (summed over ranks) per second of whole steps,
so runs that generate different amounts (weak scaling: the same prompts per GPU; completions that end at
EOS) are compared fairly.

Scaling efficiency of N GPUs against the one-GPU run, for weak scaling (prompts per step grow with N) and
strong scaling (the same global batch) alike: throughput_N / (N x throughput_1). With equal tokens per step
(strong scaling) that is step_s_1 / (N x step_s_N).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def run_summary(metrics: Path, gpus: int) -> dict[str, Any]:
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if metrics.is_file()
        else []
    )
    if not rows:
        return {"gpus": gpus, "steps": 0}
    timed = rows[1:] or rows

    def mean(key: str) -> float:
        return statistics.mean(float(r.get(key, 0.0)) for r in timed)

    step_s, rollout_s, tokens = mean("time_step_s"), mean("time_rollout_s"), mean("rollout_tokens")
    return {
        "gpus": gpus,
        "steps": len(rows),
        "steps_timed": len(timed),
        "world_size": rows[-1].get("world_size"),
        "step_s": step_s,
        "rollout_s": rollout_s,
        "update_s": mean("time_update_s"),
        "rollout_tokens_per_step": tokens,
        "rollout_tokens_per_s": tokens / max(rollout_s, 1e-9),
        "rollout_tokens_per_s_per_gpu": tokens / max(rollout_s, 1e-9) / gpus,
        "step_tokens_per_s": tokens / max(step_s, 1e-9),
        "device_peak_used_gib": max(float(r.get("memory/device_peak_used_gib", 0.0)) for r in rows),
    }


def scaling_efficiency(one: dict[str, Any], many: dict[str, Any]) -> float | None:
    """Efficiency of ``many`` against ``one`` (1.0 = linear); None when either run has no timed step."""
    if not one.get("step_tokens_per_s") or not many.get("step_tokens_per_s"):
        return None
    return many["step_tokens_per_s"] / (many["gpus"] * one["step_tokens_per_s"])


def build_report(
    out: Path, gpus: list[int], scaling: str, engine: str, status: dict[str, str]
) -> dict[str, Any]:
    runs = [run_summary(out / f"metrics-{n}gpu.jsonl", n) for n in gpus]
    one = next((r for r in runs if r["gpus"] == 1), {})
    for run in runs:
        if run["gpus"] > 1:
            run["scaling_efficiency"] = scaling_efficiency(one, run)
    report: dict[str, Any] = {"engine": engine, "shape": "qwen2.5-7b", "format": "nvfp4", "scaling": scaling,
                              "exit_status": status, "runs": runs}  # fmt: skip
    tp2 = out / "tp2.json"
    if tp2.is_file():
        report["tp2_rollout"] = json.loads(tp2.read_text())
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="device_multigpu_report")
    parser.add_argument("out", type=Path)
    parser.add_argument("--gpus", required=True, help="comma list of GPU counts, e.g. 1,2,4")
    parser.add_argument("--scaling", choices=("weak", "strong"), default="weak")
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--status", action="append", default=[], help="NAME=EXIT_STATUS, repeatable")
    args = parser.parse_args(argv)
    status = dict(item.split("=", 1) for item in args.status)
    report = build_report(args.out, [int(n) for n in args.gpus.split(",")], args.scaling, args.engine, status)
    (args.out / "multigpu.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    failed = [name for name, code in status.items() if code not in ("0", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

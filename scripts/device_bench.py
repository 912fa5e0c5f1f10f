"""The device acceptance of ``qerl bench`` on the lent H200 (issue 8), one step per device call.

Each step is ``qerl bench`` with the flags shown, run through the Python API because the device's
stripped vLLM also needs ``vllm_kwargs={"attention_backend": "TRITON_ATTN"}``, which ``qerl bench``
takes from a recipe/``--set`` rather than a flag. Install vLLM first (three calls, see
../shared/tools/device-vllm/README.md), then on the same warm machine, one call per step:

    export PYTHONPATH=/tmp/vllm-site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 QERL_CACHE_DIR=/tmp/qerl-cache
    python scripts/device_bench.py prepare        # random 7B checkpoints (bf16, nvfp4): ~2 min
    python scripts/device_bench.py rollout        # ~7 min; compare with the README's raw vLLM table
    python scripts/device_bench.py e2e            # GRPO step phases, BF16 LoRA vs NVFP4
    python scripts/device_bench.py prepare-32b && python scripts/device_bench.py 32b

Each step writes ``$OUT/<step>/`` (bench.json, bench.md, PNGs) when ``$OUT`` is set, and prints the
table, the Markdown, and for ``rollout`` the comparison with the raw vLLM figures (within 10%).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from qerl_cli.bench.result import BenchResult
from qerl_cli.config import BenchConfig

DEVICE_VLLM = {"attention_backend": "TRITON_ATTN"}
# ../shared/tools/device-vllm/README.md, output tokens/s, 256 prompt / 512 generated tokens.
RAW_VLLM = {
    ("bf16", 0): {1: 209, 2: 395, 8: 1397},
    ("nvfp4", 0): {1: 299, 2: 558, 8: 1892},
    ("bf16", 16): {1: 158, 2: 315, 8: 1137},
    ("nvfp4", 16): {1: 206, 2: 411, 8: 1441},
}
# Each step is the qerl bench command in its comment (plus the device's vllm_kwargs).
STEPS: dict[str, dict] = {
    # qerl bench --model qwen2.5-7b --formats bf16,nvfp4 --batch 1,2,8 --prompt-len 256 --gen-len 512
    #            --lora-rank 16
    "rollout": dict(model="qwen2.5-7b", formats=["bf16", "nvfp4"], batch=[1, 2, 8], prompt_len=256,
                    gen_len=512, lora_rank=16),
    # qerl bench --model qwen2.5-7b --formats bf16,nvfp4 --batch 8 --prompt-len 256 --gen-len 256
    #            --lora-rank 16 --e2e   (e2e: 8 prompts x 8 generations per GRPO step)
    "e2e": dict(model="qwen2.5-7b", formats=["bf16", "nvfp4"], batch=[8], prompt_len=256, gen_len=256,
                lora_rank=16, e2e=True),
    # qerl bench --model qwen2.5-32b --formats nvfp4 --batch 2,8 --prompt-len 256 --gen-len 512 --lora-rank 16
    "32b": dict(model="qwen2.5-32b", formats=["nvfp4"], batch=[2, 8], prompt_len=256, gen_len=512,
                lora_rank=16),
}  # fmt: skip


def _prepare(shape: str, formats: list[str]) -> None:
    from qerl_cli.bench.models import prepare_checkpoints

    for fmt, folder in prepare_checkpoints(shape, formats).items():
        print(f"{shape} {fmt}: {folder}")


def _compare_with_raw(report: BenchResult) -> list[str]:
    lines = [
        "| weights | LoRA | batch | qerl bench tok/s | raw vLLM tok/s | ratio | within 10% |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report.rollout:
        raw = RAW_VLLM.get((row["format"], row["lora_rank"]), {}).get(row["batch"])
        if raw is None:
            continue
        ratio = row["output_tokens_per_s"] / raw
        within = "yes" if abs(ratio - 1) <= 0.1 else "NO"
        lines.append(
            f"| {row['format']} | {row['lora_rank'] or 'none'} | {row['batch']} "
            f"| {row['output_tokens_per_s']:.0f} | {raw} | {ratio:.3f} | {within} |"
        )
    return lines


def main(step: str) -> int:
    if step == "prepare":
        _prepare("qwen2.5-7b", ["bf16", "nvfp4"])
        return 0
    if step == "prepare-32b":
        _prepare("qwen2.5-32b", ["nvfp4"])
        return 0
    if step not in STEPS:
        print(f"usage: {sys.argv[0]} prepare|rollout|e2e|prepare-32b|32b", file=sys.stderr)
        return 2
    from qerl_cli.bench import bench_table, run_bench
    from qerl_cli.bench.report import to_markdown

    out = Path(os.environ.get("OUT", "bench_results")) / step
    report = run_bench(BenchConfig(**STEPS[step], engine="vllm", output=str(out), vllm_kwargs=DEVICE_VLLM))
    try:
        from rich.console import Console

        Console(width=160).print(bench_table(report))
    except ImportError:  # the device image may lack rich; the Markdown below says the same
        pass
    print(to_markdown(report))
    if step == "rollout":
        comparison = _compare_with_raw(report)
        print("\n".join(comparison))
        (out / "vs_raw_vllm.md").write_text("\n".join(comparison) + "\n")
    files = report.files.to_dict() if report.files else None
    print(json.dumps({"errors": report.errors, "files": files}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))

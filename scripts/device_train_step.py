"""Device figures for issue 5: one GRPO step of a Qwen2.5-7B-shaped NVFP4 model on the HF engine.

    python scripts/device_train_step.py                 # writes $OUT/device_train_step.json
    python scripts/device_train_step.py --shape tiny    # the same plumbing on a CPU (smoke test)

Setup: a random-weight Qwen2.5-7B-shaped checkpoint in NVFP4 (compressed-tensors layout, written by
``qerl_cli.modeling.random_checkpoint`` on the GPU), loaded packed into QuantLinear layers, LoRA r16
on all seven projections, AQN on, TIS on. 8 prompts x 8 generations, prompts of 256 tokens,
completions of exactly 256 tokens (random weights almost never sample EOS; ``min_tokens`` is not
forced). Two steps run: the first includes one-time costs (allocator growth, kernel autotuning) and
the second is the figure to quote. Random weights make correctness meaningless, so a hash of each
completion gives 0/1 rewards: groups differ and every step runs a real update.

Reported per step: seconds for rollout, reward, logprob and update phases, rollout tokens/s, and
peak GPU memory (``torch.cuda.max_memory_allocated``), plus the packed weight size and load time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_TOKENS = 256
COMPLETION_TOKENS = 256
GIB = 2**30


def hash_reward(completions: list[str], problems: list[Any]) -> tuple[list[float], dict[str, float]]:
    rewards = [float(hashlib.sha256(c.encode()).digest()[0] % 2) for c in completions]
    return rewards, {
        "accuracy": sum(rewards) / max(1, len(rewards)),
        "format_rate": 0.0,
        "grader_timeouts": 0.0,
    }


def write_prompts(path: Path, count: int, tokenizer: Any) -> None:
    """``count`` problems whose rendered prompt (plain template) is exactly PROMPT_TOKENS tokens."""
    from qerl_cli.data.prompts import render_prompt

    overhead = len(
        tokenizer(render_prompt("", tokenizer, template="plain"), add_special_tokens=False)["input_ids"]
    )
    with path.open("w") as fh:
        for i in range(count):
            # The byte-level tokenizer gives one token per ASCII character.
            body = f"Problem {i}: " + "add the numbers 12 and 30 " * 20
            question = body[: PROMPT_TOKENS - overhead]
            fh.write(json.dumps({"question": question, "answer": "42"}) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-7b")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--workdir", default=os.environ.get("TMPDIR", "/tmp") + "/qerl-train-step")
    args = parser.parse_args(argv)

    from qerl_cli.config import TrainConfig, load_config
    from qerl_cli.modeling.random_checkpoint import write_random_checkpoint
    from qerl_cli.modeling.tiny import build_tokenizer
    from qerl_cli.rl.tracking import MetricsLogger
    from qerl_cli.rl.trainer import Trainer

    cuda = torch.cuda.is_available()
    workdir = Path(args.workdir)
    model_dir = workdir / f"{args.shape}-nvfp4"
    tokenizer = build_tokenizer()  # real shapes come without one; the byte-level tokenizer fits any vocab
    t0 = time.perf_counter()
    if not (model_dir / "config.json").is_file():
        tokenizer_dir = workdir / "tokenizer"
        tokenizer.save_pretrained(tokenizer_dir)
        write_random_checkpoint(
            model_dir,
            args.shape,
            "nvfp4",
            seed=0,
            device="cuda" if cuda else "cpu",
            tokenizer_from=tokenizer_dir,
        )
    write_seconds = time.perf_counter() - t0
    data_file = workdir / "prompts.jsonl"
    write_prompts(data_file, 64, tokenizer)

    cfg = load_config(
        TrainConfig,
        None,
        [
            f"model.path={model_dir}",
            "model.dtype=bfloat16" if cuda else "model.dtype=float32",
            "lora.rank=16",
            "lora.alpha=32",
            "rollout.engine=hf",
            "rollout.num_generations=8",
            f"rollout.max_prompt_length={PROMPT_TOKENS}",
            f"rollout.max_completion_length={COMPLETION_TOKENS}",
            "rollout.generation_batch_size=64",
            f"data.dataset={data_file}",
            "data.template=plain",
            "train.prompts_per_step=8",
            "train.micro_batch_size=8",
            f"train.max_steps={args.steps}",
            "train.gradient_checkpointing=true",
            f"train.device={'cuda' if cuda else 'cpu'}",
            "aqn.enabled=true",
            "aqn.num_stages=2",
            f"output.dir={workdir / 'run'}",
            "output.save_steps=0",
        ],
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg, reward_fn=hash_reward)
    load_seconds = time.perf_counter() - t0
    load_peak = torch.cuda.max_memory_allocated() / GIB if cuda else 0.0
    metrics = MetricsLogger(workdir / "run")
    steps = []
    for _ in range(args.steps):
        record = trainer.train_step()
        metrics.log(record)
        steps.append(
            {
                k: record.get(k)
                for k in (
                    "step",
                    "aqn_sigma",
                    "time_rollout_s",
                    "time_reward_s",
                    "time_logprobs_s",
                    "time_update_s",
                    "time_step_s",
                    "rollout_tokens",
                    "rollout_tokens_per_s",
                    "completion_length_mean",
                    "memory/peak_allocated_gib",
                    "memory/device_peak_used_gib",
                    "tis_weight_mean",
                    "tis_raw_weight_max",
                    "grad_norm",
                    "loss",
                )
            }
        )
        print(json.dumps(steps[-1]), flush=True)
    packed = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    report = {
        "shape": args.shape,
        "format": "nvfp4",
        "engine": "hf",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "prompts_x_generations": "8x8",
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": COMPLETION_TOKENS,
        "lora_rank": 16,
        "checkpoint_gib": packed / GIB,
        "checkpoint_write_s": write_seconds,
        "trainer_build_s": load_seconds,
        "peak_gpu_memory_after_load_gib": load_peak,
        "steps": steps,
    }
    out = Path(os.environ.get("OUT", workdir))
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_train_step.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""vLLM rollout tokens/s with a generator per request (what training does) against one engine generator
reseeded each round (``reseed.diff`` applied), and whether the reseed reproduces a batch.

Random-weight Qwen2.5-7B in BF16 (no LoRA, no trainer in the process), 16 prompts x 8 = 128 sequences,
256 + 2048 tokens. Run from the repository root with vLLM importable and ``reseed.diff`` applied:
``VLLM_USE_FLASHINFER_SAMPLER=0 PAIRS=1 python3 benchmarks/h200-2026-11-29-grpo-step-rerun/seeding.py``.
"""

import json
import os
import time

import torch

from qerl_cli.bench.models import shape_checkpoint
from qerl_cli.bench.rollout import PromptMaker
from qerl_cli.rollout.base import SamplingSpec
from qerl_cli.rollout.vllm_engine import VLLMEngine

OUT = os.environ.get("OUTJ", "rollout-seeding.json")
GEN = int(os.environ.get("GEN", "2048"))
out: dict = {"gpu": torch.cuda.get_device_name(), "shape": "qwen2.5-7b bf16 random", "prompts": 16, "n": 8,
             "prompt_len": 256, "gen_len": GEN, "runs": []}  # fmt: skip


def save() -> None:
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)


start = time.perf_counter()
engine = VLLMEngine(
    shape_checkpoint("qwen2.5-7b", "bf16"), gpu_memory_utilization=0.85, enable_sleep_mode=False,
    enable_lora=False, max_model_len=256 + GEN + 64, seed=0, vllm_kwargs={"max_num_seqs": 128},
)  # fmt: skip
out["load_s"] = round(time.perf_counter() - start, 1)
prompts = PromptMaker(engine.llm.get_tokenizer(), seed=0).batch(16, 256, seed=1)


def generate(mode: str, tokens: int, seed: int) -> tuple:
    engine.seed_each_request = mode == "per-request"
    spec = SamplingSpec(tokens, temperature=1.0, top_p=1.0, seed=seed, ignore_eos=True)
    torch.cuda.synchronize()
    began = time.perf_counter()
    result = engine.generate(prompts, n=8, sampling=spec)
    torch.cuda.synchronize()
    return result, time.perf_counter() - began


def tokens_of(result) -> list[list[int]]:
    return [c.token_ids for group in result.completions for c in group]


generate("reseed", 64, 0)  # warm-up
seen = {}
for mode, seed, tag in (("reseed", 3, "a"), ("reseed", 3, "b"), ("reseed", 4, "c"),
                        ("per-request", 3, "a"), ("per-request", 3, "b")):  # fmt: skip
    seen[mode, tag] = tokens_of(generate(mode, 64, seed)[0])
out["repro_summary"] = {
    "reseed same seed identical": seen["reseed", "a"] == seen["reseed", "b"],
    "reseed other seed differs": seen["reseed", "a"] != seen["reseed", "c"],
    "per-request same seed identical": seen["per-request", "a"] == seen["per-request", "b"],
}
save()
for pair in range(int(os.environ.get("PAIRS", "2"))):
    for mode in ("per-request", "reseed"):
        result, seconds = generate(mode, GEN, 10 + pair)
        tokens = result.num_generated_tokens
        out["runs"].append({"mode": mode, "round": pair, "tokens": tokens, "seconds": round(seconds, 2),
                            "tok_s": round(tokens / seconds, 1)})  # fmt: skip
        save()

"""The GRPO update phase alone on a GPU: seconds, tokens/s and MFU per base format and kernel setting,
and where the time goes (the profiler's top CUDA kernels by category).

Run on a lent GPU from the repository root (random-weight checkpoints of a Qwen2.5 shape are written
into $QERL_CACHE_DIR first):

    python scripts/device_update_profile.py --model qwen2.5-7b --formats bf16,nvfp4 \
        --fused off,liger --sequences 32 --out $OUT/update_profile.json

Each case: the trainer's policy (QuantLinear or BF16 base, LoRA r16 on every projection), a batch of
``--sequences`` rollouts of exactly prompt + completion tokens (random ids, random rewards: every
group has a reward spread), the memory plan's micro-batch and checkpointing for the whole GPU minus
what a sleeping vLLM keeps, one warm-up micro-batch, then ``update_policy`` timed once. MFU counts
the useful FLOPs (forward 2N + input-gradient backward 2N per token, attention included, recomputation
not) against the GPU's dense BF16 peak (qerl_cli.bench.roofline).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qerl_cli.bench.models import prepare_checkpoints  # noqa: E402
from qerl_cli.bench.roofline import gpu_spec, update_flops  # noqa: E402
from qerl_cli.config import TrainConfig  # noqa: E402
from qerl_cli.modeling.model_shape import ModelShape  # noqa: E402
from qerl_cli.rl.memory import VLLM_ASLEEP_RESERVE, choose_micro_batch  # noqa: E402
from qerl_cli.rl.policy import build_policy, enable_gradient_checkpointing  # noqa: E402
from qerl_cli.rl.rollouts import Rollouts  # noqa: E402
from qerl_cli.rl.update import update_policy  # noqa: E402
from qerl_cli.rollout.base import Completion  # noqa: E402

CATEGORIES = (("gemm", ("gemm", "cutlass", "sm90", "xmma", "ampere_bf16", "cublas", "nvjet")),
              ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
              ("dequant", ("dequant", "_nvfp4", "e2m1")), ("liger", ("_rms_norm", "_swiglu", "_rope")),
              ("softmax/logprob", ("softmax", "log_softmax", "gather", "scatter")))  # fmt: skip


def categorise(name: str) -> str:
    lower = name.lower()
    for category, keys in CATEGORIES:
        if any(k in lower for k in keys):
            return category
    return "elementwise/other"


def fake_rollouts(sequences: int, group: int, prompt_len: int, gen_len: int, vocab: int) -> Rollouts:
    rng = random.Random(0)
    batch = Rollouts(group_size=group)
    for _ in range(sequences):
        batch.problems.append(None)  # type: ignore[arg-type]
        batch.prompt_ids.append([rng.randrange(100, vocab - 100) for _ in range(prompt_len)])
        ids = [rng.randrange(100, vocab - 100) for _ in range(gen_len)]
        batch.completions.append(Completion(ids, "", [-1.0] * gen_len, "length"))
        batch.rewards.append(float(rng.random() < 0.5))
    return batch


def run_case(args: argparse.Namespace, fmt: str, folder: Path, fused: str) -> dict:
    cfg = TrainConfig()
    cfg.model.path = str(folder)
    cfg.lora.rank, cfg.lora.alpha = 16, 32
    cfg.train.fused_kernels = fused
    cfg.train.gradient_checkpointing = "auto"
    cfg.train.pack_sequences = args.pack
    cfg.rollout.num_generations = 8
    cfg.rollout.max_completion_length = args.gen_len
    policy = build_policy(cfg, torch.device("cuda"))
    shape = ModelShape.from_config(policy.model.get_base_model().config.to_dict())
    free, _ = torch.cuda.mem_get_info()
    seq_len = args.prompt_len + args.gen_len
    budget = free - VLLM_ASLEEP_RESERVE - 2 * 2**30
    plan = choose_micro_batch(shape, fmt, seq_len, budget, max_micro_batch=args.sequences,
                              checkpointing=args.ckpt, micro_batch=args.micro)  # fmt: skip
    if plan.gradient_checkpointing:
        enable_gradient_checkpointing(policy.model)
    params = policy.named_trainable_parameters()
    optimizer = torch.optim.AdamW([p for _, p in params], lr=1e-6)
    batch = fake_rollouts(args.sequences, 8, args.prompt_len, args.gen_len, shape.vocab)
    warm = fake_rollouts(8, 8, args.prompt_len, args.gen_len, shape.vocab)  # one group
    update_policy(cfg, policy, optimizer, params, warm, tis_on=True, micro_batch_size=plan.micro_batch_size)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    stats = update_policy(cfg, policy, optimizer, params, batch, tis_on=True,
                          micro_batch_size=plan.micro_batch_size)  # fmt: skip
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    flops = update_flops(shape, args.sequences, seq_len, lora_rank=16, completion_len=args.gen_len)
    spec = gpu_spec(torch.cuda.get_device_name())
    row = {
        "format": fmt, "fused_kernels": policy.fused_kernels, "pack_sequences": args.pack,
        "sequences": args.sequences, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "micro_batch_size": plan.micro_batch_size, "gradient_checkpointing": plan.gradient_checkpointing,
        "update_s": seconds, "tokens_per_s": args.sequences * seq_len / seconds, "useful_flops": flops,
        "mfu_bf16": flops / seconds / spec.bf16_flops if spec else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss_tokens": stats.get("num_tokens"),
    }  # fmt: skip
    if args.profile:
        row["profile"] = profile_one(cfg, policy, optimizer, params, warm, plan.micro_batch_size)
    del policy, optimizer, params
    gc.collect()
    torch.cuda.empty_cache()
    return row


def profile_one(cfg, policy, optimizer, params, batch, micro) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        update_policy(cfg, policy, optimizer, params, batch, tis_on=True, micro_batch_size=micro)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        if us <= 0:
            continue
        kernels.append((us, event.key))
        cat = categorise(event.key)
        totals[cat] = totals.get(cat, 0.0) + us
    kernels.sort(reverse=True)
    whole = sum(totals.values()) or 1.0
    return {"category_share": {k: v / whole for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [(name[:120], us / 1000) for us, name in kernels[:15]],
            "total_cuda_ms": whole / 1000}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--formats", default="bf16,nvfp4")
    parser.add_argument("--fused", default="off,liger")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-len", type=int, default=2048)
    parser.add_argument("--micro", default="auto")
    parser.add_argument("--ckpt", default="auto")
    parser.add_argument("--pack", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.micro = int(args.micro) if args.micro != "auto" else "auto"
    args.ckpt = {"on": True, "off": False}.get(args.ckpt, "auto")
    formats = args.formats.split(",")
    folders = prepare_checkpoints(args.model, formats)
    report = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}  # fmt: skip
    # Kernel settings outer: Liger patches transformers' module classes for the whole process, so every
    # case without it runs before the first case with it.
    for fused in args.fused.split(","):
        for fmt in formats:
            try:
                row = run_case(args, fmt, folders[fmt], fused)
            except Exception as exc:  # one failing case must not lose the others' figures
                row = {"format": fmt, "fused_kernels": fused, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            report["rows"].append(row)
            Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

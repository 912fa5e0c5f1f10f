"""``qerl bench update``: the GRPO update phase alone, per base format, fused-kernel setting and base
compute (``train.base_compute``: the 4-bit base's GEMMs in BF16 or FP8) (``update.json``): seconds,
tokens/s, MFU and peak memory, and with ``profile`` where the GPU's time goes (the profiler's CUDA
kernels by category).

Each case is the trainer's policy (a 4-bit base in QuantLinear layers, or BF16; LoRA on every
projection), a batch of ``sequences`` rollouts of exactly ``prompt_len + gen_len`` random tokens with
random 0/1 rewards (every group has a reward spread), one warm-up update of one group, then
``update_policy`` timed once. On a GPU the micro-batch, checkpointing and logprob chunk come from the
memory plan (``qerl_cli.rl.memory``) for the whole GPU minus what a sleeping vLLM keeps; on the CPU
``auto`` is every sequence in one micro-batch without checkpointing, at the largest chunk. MFU counts
the useful FLOPs (forward and input-gradient backward of the base, attention, LoRA, the LM head;
recomputation not) against the GPU's dense BF16 peak (:mod:`qerl_cli.bench.roofline`), ``mfu_bf16``;
``mfu_fp8`` is the same FLOPs against the dense FP8 peak (half the fraction on Hopper), the ceiling of
an ``fp8`` row's base GEMMs.
A BF16 base has no FP8 GEMMs: its ``fp8`` cases are skipped.

Fused-kernel settings are the outer loop: Liger patches transformers' classes for the process while a
policy holds them, so every case without it runs before the first case with it.
"""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from qerl_cli.bench.header import report_header, write_report
from qerl_cli.bench.models import prepare_checkpoints
from qerl_cli.bench.progress import Progress
from qerl_cli.bench.roofline import gpu_spec, update_flops
from qerl_cli.bench.settings import UpdateSettings, report_settings
from qerl_cli.config import TrainConfig
from qerl_cli.errors import QerlError
from qerl_cli.modeling.model_shape import ModelShape
from qerl_cli.rl.memory import VLLM_ASLEEP_RESERVE, choose_micro_batch, logprob_chunks
from qerl_cli.rl.policy import Policy, build_policy, enable_gradient_checkpointing
from qerl_cli.rl.rollouts import Rollouts
from qerl_cli.rl.update import update_policy
from qerl_cli.rollout.base import Completion
from qerl_cli.torch_utils import resolve_device

SCHEMA = "qerl-bench-update/1"
REPORT_NAME = "update.json"
HEADROOM = 2 * 2**30  # GPU memory the plan leaves free beside the sleeping engine's reserve
CATEGORIES = (
    ("gemm", ("gemm", "cutlass", "sm90", "xmma", "ampere_bf16", "cublas", "nvjet")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("dequant", ("dequant", "_nvfp4", "e2m1")),
    ("liger", ("_rms_norm", "_swiglu", "_rope")),
    ("softmax/logprob", ("softmax", "log_softmax", "gather", "scatter")),
)


def categorise(kernel: str) -> str:
    lower = kernel.lower()
    for category, keys in CATEGORIES:
        if any(k in lower for k in keys):
            return category
    return "elementwise/other"


def random_rollouts(
    sequences: int, group: int, prompt_len: int, gen_len: int, vocab: int, seed: int
) -> Rollouts:
    """``sequences`` rollouts of exact lengths: random token ids, 0/1 rewards."""
    rng = random.Random(seed)
    batch = Rollouts(group_size=group)
    low, high = min(100, vocab // 4), max(vocab - 100, vocab // 2)  # clear of special tokens
    for _ in range(sequences):
        batch.problems.append(None)  # type: ignore[arg-type]
        batch.prompt_ids.append([rng.randrange(low, high) for _ in range(prompt_len)])
        ids = [rng.randrange(low, high) for _ in range(gen_len)]
        batch.completions.append(Completion(ids, "", [-1.0] * gen_len, "length"))
        batch.rewards.append(float(rng.random() < 0.5))
    return batch


def case_config(
    settings: UpdateSettings, folder: Path, fused: str, cuda: bool, base_compute: str = "bf16"
) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.path = str(folder)
    cfg.model.dtype = "bfloat16" if cuda else "float32"  # float32: the CPU's fast path
    cfg.lora.rank, cfg.lora.alpha = settings.lora_rank, 2 * settings.lora_rank
    cfg.train.fused_kernels = fused  # type: ignore[assignment]
    cfg.train.base_compute = base_compute  # type: ignore[assignment]
    cfg.train.gradient_checkpointing = "auto"
    cfg.train.pack_sequences = settings.pack
    cfg.train.device = "cuda" if cuda else "cpu"
    cfg.rollout.num_generations = settings.group
    cfg.rollout.max_completion_length = settings.gen_len
    # The random rollouts carry made-up rollout logprobs: their gap to the trainer's means nothing here.
    cfg.rollout.logprob_gap_warn = float("inf")
    return cfg


def _plan(settings: UpdateSettings, shape: ModelShape, fmt: str, cuda: bool) -> tuple[int, bool, int]:
    """(micro-batch, checkpointing, logprob chunk): the memory plan's on a GPU, the settings' (or all,
    none, the largest chunk) on the CPU."""
    if not cuda:
        micro = settings.sequences if settings.micro_batch == "auto" else int(settings.micro_batch)
        return micro, settings.checkpointing is True, logprob_chunks("auto")[0]
    free, _ = torch.cuda.mem_get_info()
    plan = choose_micro_batch(
        shape,
        fmt,
        settings.prompt_len + settings.gen_len,
        free - VLLM_ASLEEP_RESERVE - HEADROOM,
        max_micro_batch=settings.sequences,
        checkpointing=settings.checkpointing,
        micro_batch=settings.micro_batch,
    )
    return plan.micro_batch_size, plan.gradient_checkpointing, plan.logprob_chunk


def run_case(
    settings: UpdateSettings,
    fmt: str,
    folder: Path,
    fused: str,
    device: torch.device,
    base_compute: str = "bf16",
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    cfg = case_config(settings, folder, fused, cuda, base_compute)
    policy = build_policy(cfg, device)
    try:
        shape = ModelShape.from_config(policy.model.get_base_model().config.to_dict())
        micro, checkpointing, chunk = _plan(settings, shape, fmt, cuda)
        if checkpointing:
            enable_gradient_checkpointing(policy.model)
        params = policy.named_trainable_parameters()
        optimizer = torch.optim.AdamW([p for _, p in params], lr=1e-6)
        batch = random_rollouts(
            settings.sequences,
            settings.group,
            settings.prompt_len,
            settings.gen_len,
            shape.vocab,
            settings.seed,
        )
        warm = random_rollouts(
            settings.group,
            settings.group,
            settings.prompt_len,
            settings.gen_len,
            shape.vocab,
            settings.seed + 1,
        )
        update_policy(cfg, policy, optimizer, params, warm, tis_on=True, micro_batch_size=micro,
                      logprob_chunk=chunk)  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        stats = update_policy(cfg, policy, optimizer, params, batch, tis_on=True, micro_batch_size=micro,
                              logprob_chunk=chunk)  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        seq_len = settings.prompt_len + settings.gen_len
        flops = update_flops(
            shape, settings.sequences, seq_len, lora_rank=settings.lora_rank, completion_len=settings.gen_len
        )
        spec = gpu_spec(torch.cuda.get_device_name(device)) if cuda else None
        row = {
            "format": fmt,
            "fused_kernels": policy.fused_kernels,
            "base_compute": policy.base_compute,
            "pack_sequences": settings.pack,
            "sequences": settings.sequences,
            "prompt_len": settings.prompt_len,
            "gen_len": settings.gen_len,
            "micro_batch_size": micro,
            "gradient_checkpointing": checkpointing,
            "logprob_chunk_tokens": chunk,
            "update_s": seconds,
            "tokens_per_s": settings.sequences * seq_len / seconds,
            "useful_flops": flops,
            "mfu_bf16": flops / seconds / spec.bf16_flops if spec else None,
            "mfu_fp8": flops / seconds / spec.fp8_flops if spec and spec.fp8_flops else None,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "loss_tokens": stats.get("num_tokens"),
        }
        if settings.profile:
            row["profile"] = profile_update(cfg, policy, optimizer, params, warm, micro, chunk)
        return row
    finally:
        policy.close()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def profile_update(
    cfg: TrainConfig, policy: Policy, optimizer: Any, params: Any, batch: Rollouts, micro: int, chunk: int
) -> dict[str, Any]:
    """One update under the CUDA profiler: each kernel category's share of GPU time, the top kernels."""

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        update_policy(cfg, policy, optimizer, params, batch, tis_on=True, micro_batch_size=micro,
                      logprob_chunk=chunk)  # fmt: skip
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if us <= 0:
            continue
        kernels.append((us, event.key))
        totals[categorise(event.key)] = totals.get(categorise(event.key), 0.0) + us
    kernels.sort(reverse=True)
    whole = sum(totals.values()) or 1.0
    return {
        "category_share": {k: v / whole for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": [[name[:120], us / 1000] for us, name in kernels[:15]],
        "total_cuda_ms": whole / 1000,
    }


def run_update(settings: UpdateSettings, *, command: str) -> dict[str, Any]:
    """Every (fused setting, format, base compute) case; ``update.json`` is rewritten after each, so a
    run cut short keeps what it measured. A failing case is recorded as its error and the next one runs."""

    device = resolve_device(settings.device)
    if settings.profile and device.type != "cuda":
        raise QerlError(
            "--profile reads the CUDA profiler's kernels: it needs a GPU (leave it out on the CPU)"
        )
    folders = prepare_checkpoints(settings.model, settings.formats, settings.seed)
    report: dict[str, Any] = {
        **report_header(SCHEMA, command),
        "settings": report_settings(settings),
        "rows": [],
    }
    path = Path(settings.output) / REPORT_NAME
    write_report(path, report)
    progress = Progress("bench update", len(settings.fused) * len(cases(settings)))
    for fused in settings.fused:
        for fmt, compute in cases(settings):
            label = f"{fmt}, fused {fused}, base compute {compute}"
            progress.start(label)
            try:
                row = run_case(settings, fmt, folders[fmt], fused, device, compute)
            except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others' figures
                row = {"format": fmt, "fused_kernels": fused, "base_compute": compute,
                       "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip
            progress.finish(label, f"failed ({row['error'][:200]})" if "error" in row else "done")
            report["rows"].append(row)
            write_report(path, report)
    return report


def cases(settings: UpdateSettings) -> list[tuple[str, str]]:
    """(format, base compute) pairs, each format's base computes side by side; a BF16 base only in BF16."""
    return [(fmt, compute) for fmt in settings.formats for compute in settings.base_compute
            if fmt != "bf16" or compute != "fp8"]  # fmt: skip


def update_table(report: dict[str, Any]):  # -> rich.table.Table
    table = Table(title=f"GRPO update on {report['device']} ({report['settings']['model']})")
    columns = ("format", "fused", "base", "micro-batch", "ckpt", "update s", "tokens/s", "MFU (BF16 peak)",
               "MFU (FP8 peak)", "peak GiB")  # fmt: skip
    for name in columns:
        table.add_column(name)
    for row in report["rows"]:
        compute = row.get("base_compute", "bf16")  # reports written before base_compute: BF16
        if "error" in row:
            table.add_row(row["format"], row["fused_kernels"], compute, "-", "-", "error", row["error"][:60],
                          "-", "-", "-")  # fmt: skip
            continue
        mfu, mfu_fp8, peak = row["mfu_bf16"], row.get("mfu_fp8"), row["peak_allocated_gib"]
        table.add_row(
            row["format"],
            row["fused_kernels"],
            compute,
            str(row["micro_batch_size"]),
            str(row["gradient_checkpointing"]),
            f"{row['update_s']:.3f}",
            f"{row['tokens_per_s']:.0f}",
            f"{mfu:.1%}" if mfu is not None else "-",
            f"{mfu_fp8:.1%}" if mfu_fp8 is not None else "-",
            f"{peak:.1f}" if peak is not None else "-",
        )
    return table

"""The memory plan of a training run for its loaded policy (:func:`qerl_cli.rl.memory.plan_memory` on
the run's settings and the GPU's memory measured now), and the log line that says it."""

from __future__ import annotations

import logging
from typing import Any

import torch

from qerl_cli.modeling.model_shape import ModelShape
from qerl_cli.rl.device_memory import device_memory, release_cached_memory
from qerl_cli.rl.memory import CHUNK_FIGURE, MemoryPlan, plan_memory
from qerl_cli.rl.policy import enable_gradient_checkpointing

log = logging.getLogger("qerl_cli.rl.memory")  # the plan's line where it always was logged


def plan_for_run(
    cfg: Any, model: torch.nn.Module, base_format: str, static_extra_bytes: int = 0
) -> MemoryPlan:
    """The memory plan of a training run (``cfg``: TrainConfig) for its loaded policy ``model``,
    measured now (after the trainer loaded, before vLLM starts); turns checkpointing on if chosen.
    ``static_extra_bytes``: as in :func:`plan_memory`."""

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    shape = ModelShape.from_config(base.config.to_dict())
    rollout, train = cfg.rollout, cfg.train
    release_cached_memory()
    info = device_memory()
    fraction = train.gpu_fraction
    used = int(torch.cuda.memory_reserved()) if info and fraction < 1 else 0
    plan = plan_memory(
        shape=shape, fmt=base_format, lora_rank=cfg.lora.rank, lora_targets=list(cfg.lora.target_modules),
        seq_len=rollout.max_prompt_length + rollout.max_completion_length,
        sequences_per_step=train.prompts_per_step * rollout.num_generations,
        micro_batch=train.micro_batch_size, checkpointing=train.gradient_checkpointing,
        gpu_memory_utilization=rollout.gpu_memory_utilization, logprob_chunk=train.logprob_chunk_tokens,
        total_bytes=info[1] if info else None, free_bytes=info[0] if info else None,
        engine=rollout.engine, kv_dtype=rollout.kv_cache_dtype, sleep_mode=rollout.enable_sleep_mode,
        gpu_fraction=fraction, used_bytes=used, static_extra_bytes=static_extra_bytes,
        rollout_backend=rollout.linear_backend,
    )  # fmt: skip
    if train.gradient_checkpointing == "auto" and plan.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    log.info("%s", plan_line(cfg, plan))
    return plan


def plan_line(cfg: Any, plan: MemoryPlan) -> str:
    """The log's line of a run's memory plan: the settings chosen (which were ``auto``), and the figures.
    vLLM's share (and ``rollout.gpu_memory_utilization``) only where a vLLM engine runs beside the trainer:
    the transformers engine has none."""
    rollout, train = cfg.rollout, cfg.train
    colocated = rollout.engine == "vllm"
    settings = [("micro_batch_size", train.micro_batch_size),
                ("gradient_checkpointing", train.gradient_checkpointing),
                ("logprob_chunk_tokens", train.logprob_chunk_tokens)]  # fmt: skip
    if colocated:
        settings.append(("gpu_memory_utilization", rollout.gpu_memory_utilization))
    auto = [name for name, value in settings if value == "auto"]
    share = f", vLLM share {plan.gpu_memory_utilization:.3f}" if colocated else ""
    head = "memory plan" + (f" (auto: {', '.join(auto)})" if auto else "")
    if train.gpu_fraction < 1:
        head += f" within train.gpu_fraction={train.gpu_fraction} of the GPU"
    figures = ", ".join(f"{k.split('/')[-1]} {v:.1f}" for k, v in plan.figures.items() if k != CHUNK_FIGURE)
    checkpointing = "on" if plan.gradient_checkpointing else "off"
    return (
        f"{head}: micro-batch {plan.micro_batch_size}, gradient checkpointing {checkpointing}, "
        f"logprob chunk {plan.logprob_chunk} tokens{share}; {figures}"
    )

"""Run setup: the pieces a :class:`~qerl_cli.rl.trainer.Trainer` is built from (rollout engine,
optimizer and learning-rate schedule, AQN schedule, seeding) and the run's records written beside
its outputs (the prompt template, a warning when a resume changes settings)."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from qerl_cli.config import TrainConfig, changed_keys
from qerl_cli.data.prompts import prompt_record
from qerl_cli.errors import QerlError
from qerl_cli.modeling.quant_linear import fp8_cache_nbytes
from qerl_cli.rl.aqn_schedule import AQNSchedule
from qerl_cli.rl.distributed import Distributed
from qerl_cli.rl.memory import MemoryPlan
from qerl_cli.rl.policy import Policy
from qerl_cli.rl.run_memory import plan_for_run
from qerl_cli.rollout import factory
from qerl_cli.rollout.backends import rollout_weight_format
from qerl_cli.rollout.base import RolloutEngine

log = logging.getLogger(__name__)


# vLLM's default for offline engines on GPUs of 70 GiB and more (256 on smaller ones): a round larger than
# this keeps vLLM's own limit (its KV cache bounds the concurrency anyway).
VLLM_DEFAULT_MAX_NUM_SEQS = 1024
# Written in the run's output folder once its vLLM engine is built (weights loaded, KV cache allocated):
# `qerl compare --jobs N` starts the next run sharing the GPU only then, since a vLLM start measures the
# device's memory, which a neighbour starting at the same time changes.
ENGINE_READY_FILE = "engine_ready"


def make_engine(
    cfg: TrainConfig,
    policy: Policy,
    *,
    gpu_memory_utilization: float,
    distributed: bool = False,
    world_size: int = 1,
) -> RolloutEngine:
    """The rollout engine of ``cfg.rollout.engine``: HF shares the policy's model, vLLM loads its own
    copy of the base (the caller syncs the adapter) and takes ``gpu_memory_utilization`` of the GPU
    (the memory plan's resolution of the recipe's value, ``auto`` included). Once a vLLM engine is built,
    :data:`ENGINE_READY_FILE` is written in ``output.dir``.

    Within a slice of the GPU (``train.gpu_fraction`` below 1: runs sharing it) vLLM's KV cache is sized
    from its share (``kv_cache_from_share``) rather than by vLLM's profiling of the device's free memory,
    which the other runs' steps change while this one starts.

    ``distributed``: this process is one rank of a torchrun job. vLLM then runs in-process on the
    rank's GPU through its ``external_launcher`` executor, which joins the existing process group
    instead of starting workers of its own (a recipe's ``rollout.vllm_kwargs`` still win).

    vLLM's ``max_num_seqs`` is what one rollout round submits on this rank (its share of
    ``prompts_per_step`` x ``num_generations``), at most 1024: with vLLM's default a 32B engine
    captured CUDA graphs for 51 batch sizes up to 512 at start-up (48 s, 1.6 GiB of a tight 80 GB
    budget) for a step of 8 sequences. A recipe's ``rollout.vllm_kwargs.max_num_seqs`` wins.
    """

    if cfg.rollout.engine == "hf":
        request = factory.EngineRequest(
            "hf",
            cfg.model.path,
            model=policy.model,
            tokenizer=policy.tokenizer,
            device=policy.device,
            generation_batch_size=cfg.rollout.generation_batch_size,
        )
        return factory.make_engine(request)
    per_round = -(-cfg.train.prompts_per_step // world_size) * cfg.rollout.num_generations
    request = factory.EngineRequest(
        "vllm",
        cfg.model.path,
        dtype=cfg.model.dtype,
        model_format=cfg.model.format,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_dtype=cfg.rollout.kv_cache_dtype,
        enable_sleep_mode=cfg.rollout.enable_sleep_mode,
        max_lora_rank=cfg.rollout.max_lora_rank,
        max_model_len=cfg.rollout.max_prompt_length + cfg.rollout.max_completion_length,
        staleness_tolerance=cfg.rollout.staleness_tolerance,
        seed=cfg.train.seed,
        trust_remote_code=cfg.model.trust_remote_code,
        revision=cfg.model.revision,
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        linear_backend=cfg.rollout.linear_backend,
        concurrency=per_round,
        merge_ok=not cfg.lora.train_norms,  # a merge serves LoRA factors only; factory checks the rest
        auto_fp8=cfg.rollout.auto_fp8,
        crossover_table=cfg.rollout.crossover_table,
        max_num_seqs=min(per_round, VLLM_DEFAULT_MAX_NUM_SEQS),
        external_launcher=distributed,
        kv_cache_from_share=cfg.train.gpu_fraction < 1,
        vllm_kwargs=dict(cfg.rollout.vllm_kwargs),
    )
    engine = factory.make_engine(request)
    mark_engine_ready(cfg.output.dir)
    return engine


def mark_engine_ready(out_dir: str | Path) -> None:
    """Say, in ``out_dir``, that this run's rollout engine is up (what ``qerl compare`` waits for before
    starting the next run on the same GPU). A marker that cannot be written costs the run nothing."""
    try:
        (Path(out_dir) / ENGINE_READY_FILE).write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
    except OSError as exc:
        log.warning("could not write %s in %s: %s", ENGINE_READY_FILE, out_dir, exc)


def check_parallel_settings(cfg: TrainConfig, dist: Distributed) -> None:
    """What a data-parallel job of ``dist.world_size`` ranks can run; clear errors for the rest."""
    if not dist.enabled:
        return
    if cfg.train.prompts_per_step < dist.world_size:
        raise QerlError(
            f"train.prompts_per_step={cfg.train.prompts_per_step} is smaller than the {dist.world_size} "
            "processes: every rank needs at least one prompt (whole groups are never split). Raise "
            "train.prompts_per_step or start fewer processes"
        )
    if cfg.rollout.tensor_parallel_size > 1:
        raise QerlError(
            f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} with {dist.world_size} "
            "torchrun processes is not supported: under torchrun every rank runs its own colocated vLLM "
            "on its own GPU (tensor_parallel_size 1). Tensor-parallel rollouts run in a single process "
            "(plain `qerl train`, without torchrun), where vLLM starts its own workers on "
            "tensor_parallel_size GPUs"
        )


def plan_with_base_compute(cfg: TrainConfig, policy: Policy) -> MemoryPlan:
    """The run's memory plan (``rl.run_memory.plan_for_run``) with the FP8 base copies of
    ``train.base_compute=fp8`` (``modeling.base_compute``) counted in the trainer's static memory; a
    plan that does not fit with them fails with the plan's error (``auto`` never holds them)."""
    held = fp8_cache_nbytes(policy.model)
    return plan_for_run(cfg, policy.model, policy.base_format, static_extra_bytes=held)


def make_aqn_schedule(cfg: TrainConfig) -> AQNSchedule | None:
    aqn = cfg.aqn
    if not aqn.enabled:
        return None
    return AQNSchedule(
        total_steps=cfg.train.max_steps,
        sigma_start=aqn.sigma_start,
        sigma_end=aqn.sigma_end,
        num_stages=aqn.num_stages,
        kind=aqn.schedule,
        first_stage_noise_free=aqn.first_stage_noise_free,
    )


def tis_enabled(cfg: TrainConfig, policy: Policy, linear_backend: str) -> bool:
    """Whether truncated importance sampling corrects the rollout/trainer mismatch. ``linear_backend`` is
    what the engine resolved ``rollout.linear_backend`` to: ``auto`` may choose the FP8 copy, and
    ``fp8-merged`` holds FP8 weights for a 4-bit base (``merged``, a BF16 base's, stays BF16)."""
    mode = cfg.algorithm.tis
    fp8_weights = rollout_weight_format(linear_backend, policy.base_format) == "fp8"  # fp8-merged too
    causes = (("an FP8 KV cache", cfg.rollout.kv_cache_dtype == "fp8"),
              ("FP8 rollout weights", fp8_weights))  # fmt: skip
    fp8 = [what for what, on in causes if on]
    if fp8:
        if mode == "off":
            log.warning("algorithm.tis=off overridden: %s changes the rollout numerics", " and ".join(fp8))
        return True
    if mode != "auto":
        return mode == "on"
    # Rollout numerics differ from the trainer's forward: 4-bit base, AQN noise, or another engine.
    return policy.is_quantized or cfg.aqn.enabled or cfg.rollout.engine != "hf"


def make_optimizer(
    cfg: TrainConfig, params: list[tuple[str, nn.Parameter]]
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    t = cfg.train
    optimizer = torch.optim.AdamW(
        [p for _, p in params],
        lr=t.learning_rate,
        weight_decay=t.weight_decay,
        betas=(t.adam_beta1, t.adam_beta2),
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW's moments now, as the zeros its first step would create.

    Colocated with vLLM this must happen before vLLM takes its share: created lazily inside the
    first ``optimizer.step()``, the small moment tensors are carved out of the large cached blocks
    that held the update's activations, pin them, and ``empty_cache`` can then not give those
    blocks back before vLLM wakes up (the out-of-memory error it caused: docs/memory.md).
    Identical numerics: ``AdamW`` skips its own initialisation for a parameter whose state is set.
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            on_cpu = torch.tensor(0.0, dtype=scalar)
            state["step"] = torch.zeros((), dtype=scalar, device=p.device) if on_device else on_cpu
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    warmup, total, kind = cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.lr_scheduler

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return factor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def record_prompts(cfg: TrainConfig, tokenizer: Any, example: str, path: Path) -> None:
    """The prompt template of the run (shared with ``qerl eval``) and its first prompt, verbatim."""

    record = prompt_record(cfg.data.template, cfg.data.system_prompt, tokenizer)
    record["example"] = example
    path.write_text(json.dumps(record, indent=2))


def warn_on_config_change(cfg: TrainConfig, saved: Path) -> None:
    """A resumed run continues exactly only with the settings it started with; say what changed."""
    if not saved.is_file():
        return

    changed = changed_keys(yaml.safe_load(saved.read_text()) or {}, cfg)
    if changed:
        log.warning("resuming with settings that differ from the run's %s: %s", saved, "; ".join(changed))

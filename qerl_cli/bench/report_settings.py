"""The ``settings`` of a ``bench.json`` (what a run measured, and what a ``--baseline`` must share with it
to gate it): built once by :func:`report_settings`, for the plan's check of the baseline and for the
report the run writes."""

from __future__ import annotations

from typing import Any

from qerl_cli.bench.e2e_backends import E2EPlan
from qerl_cli.bench.models import describe_source, model_label
from qerl_cli.bench.rollout import TEMPERATURE, TOP_P
from qerl_cli.bench.settings import E2EConfig, prompts_per_step
from qerl_cli.config import BenchConfig


def _e2e_shape(cfg: E2EConfig) -> dict[str, Any]:
    return {"prompts_per_step": prompts_per_step(cfg), "generations": cfg.generations,
            "prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len, "recipe": cfg.recipe}  # fmt: skip


def report_settings(cfg: BenchConfig, model: str, engine: str, formats: list[str],
                    e2e: E2EPlan | None = None) -> dict[str, Any]:  # fmt: skip
    """The report's ``settings``: what the run measures, as the report records it."""
    steps = isinstance(cfg, E2EConfig)
    settings = {
        "model": model_label(model),
        "model_source": describe_source(model),
        "engine": engine,
        "formats": formats,
        "batch": list(cfg.concurrency or cfg.batch),
        "concurrency": list(cfg.concurrency),
        "backends": list(cfg.backends) if cfg.concurrency else None,
        "prompt_len": cfg.prompt_len,
        "gen_len": cfg.gen_len,
        "lora_rank": cfg.lora_rank,
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "ignore_eos": True,
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "statistic": "median",
        "gpu_memory_utilization": cfg.gpu_memory_utilization if engine == "vllm" else None,
        "vllm_kwargs": rollout_vllm_kwargs(cfg) if engine == "vllm" else None,  # the rollout cases'
        # The user's; the trainer adds max_num_seqs from the step's shape (recorded in e2e_shape).
        "e2e_vllm_kwargs": dict(cfg.vllm_kwargs) if engine == "vllm" and steps else None,
        # The report's two kinds of figures: rollout cases (rollout, concurrency) or GRPO steps (e2e).
        "rollouts": not steps,
        "e2e": steps,
        "e2e_shape": _e2e_shape(cfg) if isinstance(cfg, E2EConfig) else None,
        # vLLM: the without-LoRA rows come from the LoRA-enabled engine, with no adapter active.
        "one_engine_per_format": engine == "vllm",
        "seed": cfg.seed,
        "memory_cap_gib": cfg.memory_cap_gib,
    }
    if e2e is not None:  # the backends asked for and those folded (the rows carry the pairs)
        settings.update(e2e.settings())
    return settings


def rollout_vllm_kwargs(cfg: BenchConfig) -> dict[str, Any]:
    """vLLM settings of the rollout cases: ``max_num_seqs`` is the largest ``--batch`` unless given.

    vLLM captures a CUDA graph for every batch size up to twice ``max_num_seqs`` (at most 512): with its
    default that is dozens of graphs per engine start, of which the bench uses two. The measured
    batches run the same graphs either way. (The e2e step's engine is the trainer's, which sizes
    ``max_num_seqs`` from the step's sequences: ``qerl_cli.rl.setup``.)
    """
    return {"max_num_seqs": max(cfg.concurrency or cfg.batch), **cfg.vllm_kwargs}

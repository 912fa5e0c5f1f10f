"""Build the rollout engine for one bench case (format x LoRA), measure it, and free it.

HF: ``without LoRA`` is the plain base model, ``with LoRA`` a second case with LoRA layers.
vLLM: one engine serves both (``Case.lora_phases`` = [0, rank]): it starts with LoRA enabled, is
measured with no adapter active, then loads the random PEFT adapter through its own
``sync_adapter`` (the path training uses) and is measured again. Starting an engine takes 1-3
minutes, so this halves the bench's start-up time; the rows say ``engine_lora_enabled`` because an
engine with LoRA enabled but no adapter active is a little slower than one started without LoRA.

vLLM cases run in a fresh child process (``python -m qerl_cli.bench.worker``): an in-process
``vllm.LLM`` does not give all of its GPU memory back when deleted, so a second engine in the same
process would see less memory, and its peak figures would include the first engine's leftovers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from qerl_cli.bench.child import run_child
from qerl_cli.bench.gpusampler import READINGS_KEY, keep_case_clocks
from qerl_cli.bench.header import case_clock_sampler
from qerl_cli.bench.memory import (
    MemoryProbe,
    checkpoint_tensor_bytes,
    kv_bytes_per_token,
    module_tensor_bytes,
    read_model_config,
    vllm_kv_cache,
)
from qerl_cli.bench.rollout import PromptMaker, RolloutSettings, measure_rollout
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import check_declared_format, load_base_model
from qerl_cli.modeling.lora import attach_lora
from qerl_cli.rollout import factory
from qerl_cli.rollout.vllm_setup import vllm_in_process
from qerl_cli.torch_utils import free_accelerator_memory, resolve_device


@dataclass
class Case:
    """One engine configuration to measure at every batch size."""

    engine: str  # "hf" | "vllm"
    format: str
    model_dir: str
    lora_rank: int = 0  # 0: no LoRA
    lora_dir: str | None = None
    batches: list[int] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # RolloutSettings fields
    gpu_memory_utilization: float = 0.85
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    # LoRA ranks measured on this one engine, in order (0: no adapter active). Empty: [lora_rank].
    lora_phases: list[int] = field(default_factory=list)
    # vLLM: the linear kernels (qerl_cli.rollout.backends); "default" for formats that have no choice.
    linear_backend: str = "marlin"
    # The transformers engine's device (auto, cpu, cuda[:N]); vLLM runs on the GPU.
    device: str = "auto"

    def phases(self) -> list[int]:
        return list(self.lora_phases) or [self.lora_rank]


# --------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------
@contextmanager
def open_engine(case: Case) -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """(engine, tokenizer, memory info) from the rollout factory; the engine is freed on exit."""

    settings = RolloutSettings(**case.settings)
    if case.engine == "hf":
        model = _hf_model(case)
        engine: Any = factory.make_engine(factory.EngineRequest(
            "hf", case.model_dir, model=model, adapter=case.lora_dir, model_format=case.format,
            device=next(model.parameters()).device, generation_batch_size=max(case.batches),
        ))  # fmt: skip
        tokenizer = engine.tokenizer
        info: dict[str, Any] = {
            "weight_bytes": module_tensor_bytes(engine.model),
            "weight_bytes_source": "model tensors (in memory)",
        }
    else:
        engine = factory.make_engine(factory.EngineRequest(
            "vllm", case.model_dir, adapter=case.lora_dir if case.phases()[0] else None,
            model_format=case.format,
            gpu_memory_utilization=case.gpu_memory_utilization,
            # Sleep mode routes allocations through vLLM's own pool; the bench never sleeps.
            enable_sleep_mode=False,
            enable_lora=bool(case.lora_rank),
            max_lora_rank=max(case.lora_rank, 1),
            max_model_len=settings.prompt_len + settings.gen_len,
            seed=settings.seed,
            linear_backend=case.linear_backend if case.linear_backend != "default" else "auto",
            concurrency=max(case.batches),
            # The largest batch: vLLM captures CUDA graphs for the batch sizes measured, not dozens more
            # (``case.vllm_kwargs`` says the same unless the user set max_num_seqs, and it wins).
            max_num_seqs=max(case.batches),
            vllm_kwargs=case.vllm_kwargs,
        ))  # fmt: skip
        tokenizer = engine.llm.get_tokenizer()
        info = _vllm_info(engine, case)
    try:
        yield engine, tokenizer, info
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()
        del engine
        free_accelerator_memory()


def _hf_model(case: Case) -> Any:
    """The base model, wrapped in LoRA layers of the case's rank (weights loaded by the engine).

    qerl's own LoRA wrapper is used because PEFT alone does not know QuantLinear layers.
    """

    # The case names its format (never auto), so a folder holding another is refused, with `qerl train`'s
    # message (check_declared_format, its one home), before the weights load rather than after.
    check_declared_format(case.format, case.model_dir)
    model, _ = load_base_model(case.model_dir, case.format, torch.bfloat16, resolve_device(case.device))
    if case.lora_rank:
        model = attach_lora(model, r=case.lora_rank, alpha=2 * case.lora_rank)
    return model.eval()


def _vllm_info(engine: Any, case: Case) -> dict[str, Any]:
    kv_bytes, kv_tokens = vllm_kv_cache(engine.llm, read_model_config(case.model_dir))
    # vLLM's own module tensors when its model lives in this process; else the checkpoint's.
    weight_bytes = None
    if vllm_in_process():
        try:
            weight_bytes = int(min(engine.llm.apply_model(module_tensor_bytes)))
        except Exception:  # noqa: BLE001 - the checkpoint gives the figure instead
            weight_bytes = None
    source = "vLLM model tensors (in memory)"
    if weight_bytes is None:
        weight_bytes, source = checkpoint_tensor_bytes(case.model_dir), "checkpoint tensors"
    return {
        "weight_bytes": weight_bytes,
        "weight_bytes_source": source,
        "kv_cache_bytes": kv_bytes,
        "kv_cache_tokens": kv_tokens,
        "kv_cache_source": "vLLM num_gpu_blocks x block_size" if kv_bytes is not None else None,
        "load_seconds": getattr(engine, "load_seconds", None),
    }


# --------------------------------------------------------------------------------------------
# One case, in this process
# --------------------------------------------------------------------------------------------
def measure_case(case: Case) -> dict[str, Any]:
    """{"rollout": rows, "memory": [one row per LoRA phase], READINGS_KEY: the GPU's clock readings of
    each batch (:mod:`qerl_cli.bench.gpusampler`; the caller takes them into the report's host load)}
    for one case, measured in this process."""
    settings = RolloutSettings(**case.settings)
    in_process = case.engine == "hf" or vllm_in_process()
    model_config = read_model_config(case.model_dir)
    probe = MemoryProbe(in_process=in_process)
    probe.start()
    rollout_rows: list[dict[str, Any]] = []
    memory_rows: list[dict[str, Any]] = []
    clock_readings: list[dict[str, Any]] = []
    with open_engine(case) as (engine, tokenizer, info):
        probe.sample()
        _complete_kv_info(info, case, settings, model_config)
        # One maker for every batch and LoRA phase: the prompts depend on the tokenizer and seeds only.
        prompts = PromptMaker(tokenizer, seed=settings.seed, vocab_size=model_config.get("vocab_size"))
        for phase, rank in enumerate(case.phases()):
            if phase and rank:  # the second phase of a shared vLLM engine (the first got it at start)
                engine.sync_adapter(case.lora_dir)
            rows = []
            for batch in case.batches:  # each batch's clocks under load beside its figures
                with case_clock_sampler() as sampler:
                    (row,) = measure_rollout(engine, prompts, [batch], settings, on_sample=probe.sample)
                keep_case_clocks(row, sampler.record(), clock_readings)
                rows.append(row)
            shared = len(case.phases()) > 1
            backend = _backend_label(engine, case)
            labels = {"format": case.format, "backend": backend, "lora_rank": rank}
            rollout_rows += [{**labels, **row} for row in rows]
            memory_rows.append({
                "format": case.format, "backend": backend, "lora_rank": rank,
                "checkpoint_bytes": checkpoint_tensor_bytes(case.model_dir), **info, **probe.result(),
                **({"engine_lora_enabled": True} if shared and not _merges(engine) else {}),
            })  # fmt: skip
    return {"rollout": rollout_rows, "memory": memory_rows, READINGS_KEY: clock_readings}


def _merges(engine: Any) -> bool:
    """Whether the engine merges the adapter into its weights (started without LoRA)."""
    return bool(getattr(getattr(engine, "backend_choice", None), "merges_lora", False))


def _backend_label(engine: Any, case: Case) -> str:
    """The backend the engine runs (the factory's choice under vLLM); HF runs the trainer's layers."""
    choice = getattr(engine, "backend_choice", None)
    if case.engine != "vllm" or choice is None:
        return "default"
    return str(choice.backend)


def _complete_kv_info(
    info: dict[str, Any], case: Case, settings: RolloutSettings, model_config: dict[str, Any]
) -> None:
    if info.get("kv_cache_bytes") is None:
        # The HF engine has no preallocated cache: its budget is what the largest batch needs.
        tokens = max(case.batches) * (settings.prompt_len + settings.gen_len)
        info["kv_cache_tokens"] = tokens
        info["kv_cache_bytes"] = tokens * kv_bytes_per_token(model_config)
        info["kv_cache_source"] = "computed: largest batch x (prompt + gen) tokens x bytes per token"


# --------------------------------------------------------------------------------------------
# One case, in a child process
# --------------------------------------------------------------------------------------------
def measure_case_isolated(case: Case) -> dict[str, Any]:
    """Run :func:`measure_case` in ``python -m qerl_cli.bench.worker`` (:func:`~qerl_cli.bench.child.
    run_child`) and read its JSON back."""
    payload, code = run_child("qerl_cli.bench.worker", asdict(case), "qerl-bench-")
    label = f"{case.format} (LoRA {case.lora_rank or 'none'})"
    if payload is None:
        raise RuntimeError(
            f"the bench worker for {label} exited with code {code} and no result; its output above says why"
        )
    if "error" in payload:
        raise QerlError(f"{label}: {payload['error']}")
    return payload


def run_case(case: Case, *, isolate: bool) -> dict[str, Any]:
    return measure_case_isolated(case) if isolate else measure_case(case)

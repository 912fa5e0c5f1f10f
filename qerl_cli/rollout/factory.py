"""Build a rollout engine by name: ``hf`` (transformers, any device) or ``vllm`` (GPU, optional).

Training passes its live PEFT model (``model=``) so the HF engine generates with the current
adapter; evaluation and benchmarks pass a path and let the factory load the model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.modeling import adapter as adapter_folder
from qerl_cli.rollout.backends import (
    FORMAT_BACKENDS,
    BackendChoice,
    choose_backend,
    current_environment,
    load_table,
)
from qerl_cli.rollout.base import RolloutEngine
from qerl_cli.torch_utils import DTYPES, resolve_device
from qerl_cli.torch_utils import dtype_name as torch_dtype_name

ENGINES = ("hf", "vllm")
log = logging.getLogger(__name__)


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype

    if dtype not in DTYPES:
        raise QerlError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def make_engine(
    kind: str,
    model_path: str | Path | None,
    *,
    adapter: str | Path | None = None,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "auto",
    tokenizer: Any = None,
    model: Any = None,
    generation_batch_size: int = 64,
    model_format: str = "auto",
    trust_remote_code: bool = False,
    **vllm_opts: Any,
) -> RolloutEngine:
    """A :class:`~qerl_cli.rollout.base.RolloutEngine`.

    ``hf``: uses ``model`` (and ``tokenizer``) when given, else loads ``model_path`` with qerl's
    4-bit-aware loader, plus the PEFT ``adapter`` folder if any. ``vllm``: starts a colocated vLLM
    engine on ``model_path`` (``vllm_opts`` go to ``VLLMEngine``); it loads the adapter itself.
    """
    if kind not in ENGINES:
        raise QerlError(f"unknown rollout engine '{kind}'; choose one of {', '.join(ENGINES)}")
    if kind == "vllm":
        if trust_remote_code:
            vllm_opts["trust_remote_code"] = True
        return _make_vllm(model_path, adapter=adapter, dtype=dtype, model_format=model_format, **vllm_opts)
    if vllm_opts:
        raise QerlError(f"options {sorted(vllm_opts)} only apply to the vllm engine")
    from qerl_cli.modeling.loading import load_base_model, load_tokenizer
    from qerl_cli.rollout.hf import HFEngine

    torch_device = resolve_device(device) if isinstance(device, str) else device
    if model is None:
        if model_path is None:
            raise QerlError("make_engine('hf') needs a model_path or a loaded model")
        model, _ = load_base_model(
            str(model_path), model_format, _torch_dtype(dtype), torch_device,
            trust_remote_code=trust_remote_code, trust_hint="--set trust_remote_code=true",
        )  # fmt: skip
        model.eval()
        if adapter is not None:
            model = adapter_folder.attach_to_base(model, adapter).eval()
    elif adapter is not None:
        adapter_folder.load_weights(model, adapter)
    if tokenizer is None:
        if model_path is None:
            raise QerlError("make_engine('hf') with a model object needs its tokenizer or a model_path")
        tokenizer = load_tokenizer(str(model_path), trust_remote_code=trust_remote_code)
    return HFEngine(model, tokenizer, generation_batch_size=generation_batch_size, device=torch_device)


def _make_vllm(
    model_path: str | Path | None,
    *,
    adapter: str | Path | None,
    dtype: str | torch.dtype,
    model_format: str,
    linear_backend: str = "auto",
    concurrency: int = 0,
    crossover_table: str | None = None,
    **vllm_opts: Any,
) -> RolloutEngine:
    """A colocated vLLM engine on ``model_path`` whose linear layers run the backend that
    ``linear_backend`` resolves to (:mod:`qerl_cli.rollout.backends`) for a round of ``concurrency``
    sequences (0: ``max_num_seqs`` of the vLLM settings, else 256)."""
    import importlib.util

    from qerl_cli.modeling.shapes import check_vllm_shapes
    from qerl_cli.modeling.sources import resolve_model_source

    if model_path is not None:
        model_path = resolve_model_source(model_path)
        check_vllm_shapes(model_path)  # fail now, naming the layers, not deep inside vLLM's Marlin setup
    if importlib.util.find_spec("vllm") is None:
        raise QerlError(
            'rollout engine "vllm" needs vLLM, which is not installed: pip install "qerl[vllm]" '
            "(GPU machines), or use the hf engine"
        )
    if model_path is None:
        raise QerlError("the vllm engine loads the model itself: pass model_path")
    from qerl_cli.rollout.vllm_engine import VLLMEngine

    user_kwargs = dict(vllm_opts.pop("vllm_kwargs", None) or {})
    concurrency = concurrency or int(user_kwargs.get("max_num_seqs") or 256)
    choice = choose_rollout_backend(
        str(model_path), linear_backend, concurrency=concurrency, crossover_table=crossover_table,
        lora=bool(vllm_opts.get("enable_lora", True)), max_model_len=vllm_opts.get("max_model_len"),
        gpu_memory_utilization=vllm_opts.get("gpu_memory_utilization"),
        kv_cache_dtype=str(vllm_opts.get("kv_cache_dtype", "auto")),
    )  # fmt: skip
    served = str(model_path)
    if choice.needs_fp8_copy:
        from qerl_cli.modeling.fp8_rollout import fp8_rollout_checkpoint
        from qerl_cli.modeling.sources import cache_root

        served = str(fp8_rollout_checkpoint(model_path, cache_root()))
        model_format = "auto"  # vLLM serves the FP8 copy; the trainer keeps the 4-bit base
    vllm_opts["vllm_kwargs"] = {**choice.vllm_kwargs(), **user_kwargs}  # the recipe's vllm_kwargs win
    dtype_name = torch_dtype_name(dtype)
    engine = VLLMEngine(served, model_format=model_format, dtype=dtype_name, **vllm_opts)
    engine.backend_choice = choice
    if adapter is not None:
        engine.sync_adapter(str(adapter))
    return engine


def choose_rollout_backend(
    model_path: str,
    requested: str,
    *,
    concurrency: int,
    crossover_table: str | None = None,
    lora: bool = True,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_dtype: str = "auto",
) -> BackendChoice:
    """``rollout.linear_backend`` resolved for the checkpoint at ``model_path`` on this GPU, with vLLM's
    memory budget (``gpu_memory_utilization`` of the device) and the KV cache of one full-length
    sequence weighed against each backend's rollout weights."""
    from qerl_cli.modeling.model_shape import ModelShape, weight_bytes
    from qerl_cli.rollout.vllm_setup import VLLM_OVERHEAD, _cuda_total_bytes, detect_checkpoint_format

    fmt = detect_checkpoint_format(model_path).name
    if fmt == "other":
        if requested not in ("auto", "marlin"):
            raise QerlError(
                f"rollout.linear_backend={requested} needs a local BF16 or qerl 4-bit checkpoint; "
                f"{model_path} is not one (quantize it with qerl quantize, or use linear_backend=auto)"
            )
        return BackendChoice("default", fmt, "a checkpoint qerl does not read: vLLM's default", concurrency)
    sizes: dict[str, int] | None = None
    kv = budget = None
    try:  # a config without the usual dimensions is served all the same, without the memory check
        shape = ModelShape.from_config(json.loads((Path(model_path) / "config.json").read_text()))
    except QerlError:
        shape = None
    total = _cuda_total_bytes()
    if shape is not None and total and isinstance(gpu_memory_utilization, float):
        sizes = {b: weight_bytes(shape, "fp8" if b == "fp8" else fmt) for b in FORMAT_BACKENDS.get(fmt, ())}
        budget = int(total * gpu_memory_utilization)
        kv = shape.kv_bytes_per_token(kv_cache_dtype) * max_model_len if max_model_len else None
    env = current_environment(
        vllm_budget_bytes=budget, kv_bytes_per_sequence=kv, overhead_bytes=VLLM_OVERHEAD
    )
    choice = choose_backend(requested, fmt, concurrency=concurrency, env=env,
                            table=load_table(crossover_table), weight_bytes=sizes, lora=lora)  # fmt: skip
    log.info("rollout linear backend: %s (%s)", choice.backend, choice.reason)
    return choice

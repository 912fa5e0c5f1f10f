"""The one factory of rollout engines: a stage describes the engine it needs in an
:class:`EngineRequest` and :func:`make_engine` builds it, ``hf`` (transformers, any device) or ``vllm``
(GPU, optional).

Every stage maps its own settings onto a request (``rl/setup.make_engine``, ``evaluation/run.build_engine``,
``bench/engines.open_engine``); only this module turns a request into an engine class, chooses the vLLM
linear backend and writes vLLM's keyword arguments. Training passes its live PEFT model (``model``) so
the HF engine generates with the current adapter; evaluation and benchmarks pass a path and let the
factory load the model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError, install_hint
from qerl_cli.modeling import adapter as adapter_folder
from qerl_cli.modeling.loading import load_base_model, load_tokenizer
from qerl_cli.modeling.model_shape import WEIGHT_BYTES, ModelShape
from qerl_cli.modeling.shapes import check_vllm_shapes, marlin_problems
from qerl_cli.modeling.sources import cache_root, resolve_model_source
from qerl_cli.rollout import hf as hf_engine
from qerl_cli.rollout import (
    vllm_engine,  # module: tests stand a fake in for VLLMEngine
    vllm_setup,  # module: tests patch _cuda_total_bytes
)
from qerl_cli.rollout.backends import (
    DENSE_MERGED,
    FORMAT_BACKENDS,
    BackendChoice,
    Environment,
    MeasuredModel,
    choose_backend,
    load_table,
    rollout_weight_bytes,
    sequences_that_fit,
)
from qerl_cli.rollout.base import RolloutEngine
from qerl_cli.rollout.environment import current_environment
from qerl_cli.rollout.fp8_rollout import bf16_rollout_checkpoint, fp8_rollout_checkpoint
from qerl_cli.torch_utils import DTYPES, resolve_device
from qerl_cli.torch_utils import dtype_name as torch_dtype_name

ENGINES = ("hf", "vllm")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRequest:
    """The rollout engine a stage needs, in qerl's terms (never vLLM's keyword arguments).

    The defaults are the vLLM engine's own (``rollout.vllm_engine.VLLMEngine``), so a field a stage
    leaves out behaves as it did when the stage called the engine itself.
    """

    kind: str  # one of ENGINES
    model_path: str | Path | None = None  # a folder, hub id or alias (resolved by modeling.sources)
    adapter: str | Path | None = None  # a PEFT adapter folder to serve from the start
    model_format: str = "auto"  # what the recipe says the checkpoint holds; checked against it
    dtype: str | torch.dtype = "bfloat16"
    trust_remote_code: bool = False

    # -- the HF engine ---------------------------------------------------------------------------
    model: Any = None  # a live (PEFT) model to generate with (training); None: load model_path
    tokenizer: Any = None  # None: model_path's
    device: str | torch.device = "auto"
    generation_batch_size: int = 64  # sequences per generate call

    # -- the vLLM engine (an HF request leaves these at their defaults) ----------------------------
    gpu_memory_utilization: float = 0.3  # vLLM's share of the GPU
    enable_sleep_mode: bool = True  # off where nothing else needs the GPU between rollouts
    enable_lora: bool = True
    max_lora_rank: int = 64  # rounded up to a rank vLLM accepts
    max_model_len: int | None = None  # prompt + completion tokens; None: the model's own
    kv_cache_dtype: str = "auto"
    staleness_tolerance: float = 0.5  # nats/token, engine vs trainer after a sync
    seed: int = 0
    revision: str | None = None
    tensor_parallel_size: int = 1
    linear_backend: str = "auto"  # rollout.linear_backend (rollout.backends)
    # Sequences one rollout round submits, which the backend choice is weighed for (0: max_num_seqs,
    # else 256).
    concurrency: int = 0
    # auto may choose a merged backend (the LoRA merged into vLLM's weights each sync): only the trainer's
    # engine, whose policy the merge can serve (LoRA factors only, one GPU per engine), says so.
    merge_ok: bool = False
    # auto may choose an FP8 copy of the weights (rollout.auto_fp8); pinned FP8 backends run regardless.
    auto_fp8: bool = False
    crossover_table: str | None = None  # None: the shipped crossover table
    # vLLM's max_num_seqs (None: vLLM's default): sized to a round, vLLM captures CUDA graphs only for
    # batch sizes the stage submits.
    max_num_seqs: int | None = None
    # This process is one rank of a torchrun job: vLLM joins its process group (``external_launcher``)
    # instead of starting workers of its own.
    external_launcher: bool = False
    # Size vLLM's KV cache from its share (``kv_cache_memory_bytes``: the share of the GPU less the rollout
    # weights and VLLM_OVERHEAD) instead of letting vLLM profile the device's free memory, which other
    # processes on the GPU change while it starts (runs sharing one GPU).
    kv_cache_from_share: bool = False
    vllm_kwargs: Mapping[str, Any] = field(default_factory=dict)  # the recipe's own; they win


# Fields the HF engine reads; every other field is the vLLM engine's.
_HF_FIELDS = frozenset(
    {"kind", "model_path", "adapter", "model_format", "dtype", "trust_remote_code", "model", "tokenizer",
     "device", "generation_batch_size"}
)  # fmt: skip


def _default(spec: dataclasses.Field[Any]) -> Any:
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def vllm_only_settings(request: EngineRequest) -> list[str]:
    """The vLLM-only fields a request sets to other than their defaults (an HF request must set none:
    silently ignoring them would hide a stage's mistake)."""
    return sorted(
        spec.name
        for spec in dataclasses.fields(request)
        if spec.name not in _HF_FIELDS and getattr(request, spec.name) != _default(spec)
    )


def requested_vllm_kwargs(request: EngineRequest) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments a request adds to the engine's own: the executor of a torchrun
    rank, ``max_num_seqs``, then the recipe's ``vllm_kwargs``, which win over both."""
    kwargs: dict[str, Any] = {}
    if request.external_launcher:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if request.max_num_seqs is not None:
        kwargs["max_num_seqs"] = request.max_num_seqs
    return {**kwargs, **request.vllm_kwargs}


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype

    if dtype not in DTYPES:
        raise QerlError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def make_engine(request: EngineRequest) -> RolloutEngine:
    """The :class:`~qerl_cli.rollout.base.RolloutEngine` a stage's request describes.

    ``hf``: uses ``request.model`` (and its tokenizer) when given, else loads ``model_path`` with qerl's
    4-bit-aware loader, plus the PEFT ``adapter`` folder if any. ``vllm``: starts a colocated vLLM engine
    on ``model_path`` with the linear backend chosen for it; it loads the adapter itself.
    """
    if request.kind not in ENGINES:
        raise QerlError(f"unknown rollout engine '{request.kind}'; choose one of {', '.join(ENGINES)}")
    if request.kind == "vllm":
        return _make_vllm(request)
    misplaced = vllm_only_settings(request)
    if misplaced:
        raise QerlError(f"options {misplaced} only apply to the vllm engine")
    return _make_hf(request)


def _make_hf(request: EngineRequest) -> RolloutEngine:
    device, model_path, adapter = request.device, request.model_path, request.adapter
    torch_device = resolve_device(device) if isinstance(device, str) else device
    model, tokenizer = request.model, request.tokenizer
    if model is None:
        if model_path is None:
            raise QerlError("an hf engine request needs a model_path or a loaded model")
        model, _ = load_base_model(
            str(model_path), request.model_format, _torch_dtype(request.dtype), torch_device,
            trust_remote_code=request.trust_remote_code, trust_hint="--set trust_remote_code=true",
        )  # fmt: skip
        model.eval()
        if adapter is not None:
            model = adapter_folder.attach_to_base(model, adapter).eval()
    elif adapter is not None:
        adapter_folder.load_weights(model, adapter)
    if tokenizer is None:
        if model_path is None:
            raise QerlError("an hf engine request with a model object needs its tokenizer or a model_path")
        tokenizer = load_tokenizer(str(model_path), trust_remote_code=request.trust_remote_code)
    return hf_engine.HFEngine(
        model, tokenizer, generation_batch_size=request.generation_batch_size, device=torch_device
    )


def _make_vllm(request: EngineRequest) -> RolloutEngine:
    """A colocated vLLM engine on ``model_path`` whose linear layers run the backend that
    ``linear_backend`` resolves to (:mod:`qerl_cli.rollout.backends`) for a round of ``concurrency``
    sequences (0: ``max_num_seqs`` of the vLLM settings, else 256)."""
    if request.model_path is None:
        raise QerlError("the vllm engine loads the model itself: pass model_path")
    model_path = resolve_model_source(request.model_path)
    user_kwargs = requested_vllm_kwargs(request)
    concurrency = request.concurrency or int(user_kwargs.get("max_num_seqs") or 256)
    choice = choose_rollout_backend(
        str(model_path), request.linear_backend, concurrency=concurrency,
        crossover_table=request.crossover_table, lora=request.enable_lora,
        max_model_len=request.max_model_len, gpu_memory_utilization=request.gpu_memory_utilization,
        kv_cache_dtype=request.kv_cache_dtype,
        merge_ok=request.merge_ok and request.tensor_parallel_size == 1, fp8_ok=request.auto_fp8,
        tensor_parallel_size=request.tensor_parallel_size,
        dtype=str(user_kwargs.get("dtype", torch_dtype_name(request.dtype))),
    )  # fmt: skip
    if choice.backend == "marlin":  # vLLM's Marlin serves the checkpoint itself (no FP8 or BF16 copy)
        check_vllm_shapes(model_path)  # fail now, naming the layers, not deep inside vLLM's Marlin setup
    if importlib.util.find_spec("vllm") is None:
        raise QerlError(
            f'rollout engine "vllm" needs vLLM, which is not installed: {install_hint("vllm")} '
            "(GPU machines), or use the hf engine"
        )
    merge_base = None
    if choice.merges_lora:
        check_mergeable(request)
        # vLLM serves the FP8 copy, the BF16 copy or the BF16 folder without LoRA; every sync merges the
        # adapter onto the trainer's base (its layers, or its checkpoint read from model_path), never onto
        # the served weights, so roundings never accumulate.
        merge_base = str(model_path)
    served, model_format = str(model_path), request.model_format
    if choice.needs_fp8_copy or choice.needs_bf16_copy:
        derive = fp8_rollout_checkpoint if choice.needs_fp8_copy else bf16_rollout_checkpoint
        served = str(derive(model_path, cache_root()))
        model_format = "auto"  # vLLM serves the copy; the trainer keeps the 4-bit base
    fixed_kv: dict[str, Any] = {}
    if request.kv_cache_from_share and "kv_cache_memory_bytes" not in user_kwargs:
        fixed_kv = kv_cache_from_share(str(model_path), choice, request)
    engine = vllm_engine.VLLMEngine(
        served, model_format=model_format, dtype=torch_dtype_name(request.dtype),
        gpu_memory_utilization=request.gpu_memory_utilization,
        enable_sleep_mode=request.enable_sleep_mode, enable_lora=request.enable_lora and merge_base is None,
        max_lora_rank=request.max_lora_rank, max_model_len=request.max_model_len,
        staleness_tolerance=request.staleness_tolerance, seed=request.seed,
        trust_remote_code=request.trust_remote_code, revision=request.revision,
        kv_cache_dtype=request.kv_cache_dtype, tensor_parallel_size=request.tensor_parallel_size,
        vllm_kwargs={**choice.vllm_kwargs(), **fixed_kv, **user_kwargs},  # the recipe's vllm_kwargs win
        merge_base=merge_base, backend_choice=choice,
    )  # fmt: skip
    if request.adapter is not None:
        engine.sync_adapter(str(request.adapter))
    return engine


def check_mergeable(request: EngineRequest) -> None:
    """What a merged backend (``fp8-merged``, ``merged``) cannot serve, refused before vLLM starts: its
    merge writes whole output rows of one GPU's weights (tensor-parallel shards split them across GPUs)."""
    if request.tensor_parallel_size > 1:
        raise QerlError(
            f"rollout.linear_backend={request.linear_backend} needs rollout.tensor_parallel_size=1 (got "
            f"{request.tensor_parallel_size}): the merge writes unsharded weights. Use "
            "rollout.linear_backend=fp8 (the LoRA served by vLLM) for tensor-parallel rollouts"
        )


def _read_config(model_path: str) -> dict[str, Any]:
    return json.loads((Path(model_path) / "config.json").read_text())


def _model_shape(config: dict[str, Any]) -> Any:
    """The config's ModelShape, or None for a config without the usual dimensions."""
    try:
        return ModelShape.from_config(config)
    except QerlError:
        return None


def kv_cache_from_share(model_path: str, choice: BackendChoice, request: EngineRequest) -> dict[str, Any]:
    """``{"kv_cache_memory_bytes": N}``: vLLM's share of the GPU (``gpu_memory_utilization`` x its total)
    less the rollout weights (in the chosen backend's format) and ``VLLM_OVERHEAD`` (activations, CUDA
    graphs, LoRA slots). With it vLLM skips its memory profiling, which reads the whole device's free
    memory and so goes wrong (a negative KV cache, a failed assertion) when another process on the GPU
    allocates or frees while this engine starts. Empty (vLLM profiles as usual) where the sizes are not
    known: no GPU, tensor parallel, a checkpoint qerl does not read. QerlError when the share leaves no
    room for one full-length sequence."""
    total = vllm_setup._cuda_total_bytes()
    fmt = choice.weight_format
    if not total or request.tensor_parallel_size > 1 or fmt not in WEIGHT_BYTES:
        return {}
    shape = _model_shape(_read_config(model_path))
    if shape is None:
        return {}
    share = int(total * request.gpu_memory_utilization)
    weights = rollout_weight_bytes(shape, choice.backend, choice.fmt)
    kv = share - weights - vllm_setup.VLLM_OVERHEAD
    one = shape.kv_bytes_per_token(request.kv_cache_dtype) * (request.max_model_len or 0)
    if kv < max(one, 1):
        gib = 2**30
        raise QerlError(
            f"vLLM's share of this run's slice of the GPU (rollout.gpu_memory_utilization="
            f"{request.gpu_memory_utilization}: {share / gib:.1f} GiB) leaves no KV cache room for one "
            f"full-length sequence ({one / gib:.2f} GiB) after its {fmt} weights ({weights / gib:.1f} GiB) "
            f"and {vllm_setup.VLLM_OVERHEAD / gib:.0f} GiB of activations and CUDA graphs: give vLLM a "
            "larger share, run fewer runs on the GPU at once (qerl compare --jobs), or shorten "
            "rollout.max_completion_length"
        )
    log.info(
        "vLLM's KV cache: %.2f GiB, sized from its share (%.1f GiB) less its weights (%.1f GiB) and %.0f GiB "
        "overhead, without profiling the GPU's memory (other runs share it)",
        kv / 2**30, share / 2**30, weights / 2**30, vllm_setup.VLLM_OVERHEAD / 2**30,
    )  # fmt: skip
    return {"kv_cache_memory_bytes": int(kv)}


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
    merge_ok: bool = False,
    fp8_ok: bool = False,
    tensor_parallel_size: int = 1,
    dtype: str = "bfloat16",
) -> BackendChoice:
    """``rollout.linear_backend`` resolved for the checkpoint at ``model_path`` on this GPU, with vLLM's
    memory budget (``gpu_memory_utilization`` of the device) and the KV cache of one full-length
    sequence weighed against each backend's rollout weights."""
    fmt = vllm_setup.detect_checkpoint_format(model_path).name
    if fmt == "other":
        if requested not in ("auto", "marlin"):
            raise QerlError(
                f"rollout.linear_backend={requested} needs a local BF16 or qerl 4-bit checkpoint; "
                f"{model_path} is not one (quantize it with qerl quantize, or use linear_backend=auto)"
            )
        return BackendChoice("default", fmt, "a checkpoint qerl does not read: vLLM's default", concurrency)
    sizes: dict[str, int] | None = None
    kv = budget = None
    config = _read_config(model_path)
    shape = _model_shape(config)  # None: served all the same, without the memory check
    # What the table's entries are weighed against: one measured on a model of another size is not used.
    model = MeasuredModel.from_config(config, name=Path(model_path).name)
    total = vllm_setup._cuda_total_bytes()
    if shape is not None and total and isinstance(gpu_memory_utilization, float):
        sizes = {b: rollout_weight_bytes(shape, b, fmt) for b in FORMAT_BACKENDS.get(fmt, ())}
        budget = int(total * gpu_memory_utilization)
        kv = shape.kv_bytes_per_token(kv_cache_dtype) * max_model_len if max_model_len else None
    env = current_environment(
        vllm_budget_bytes=budget,
        kv_bytes_per_sequence=kv,
        overhead_bytes=vllm_setup.VLLM_OVERHEAD,
        tensor_parallel_size=tensor_parallel_size,
        rollout_dtype=dtype,
    )
    choice = choose_backend(requested, fmt, concurrency=concurrency, env=env,
                            table=load_table(crossover_table), weight_bytes=sizes, lora=lora, model=model,
                            unknown_model_ok=crossover_table is not None, merge_ok=merge_ok,
                            fp8_ok=fp8_ok)  # fmt: skip
    if requested == "auto" and choice.backend == "marlin" and merge_ok and lora:
        choice = _around_marlin_refusals(model_path, choice, sizes, env)
    log.info("rollout linear backend: %s (%s)", choice.backend, choice.reason)
    return choice


def _around_marlin_refusals(
    model_path: str, choice: BackendChoice, sizes: dict[str, int] | None, env: Environment
) -> BackendChoice:
    """``auto``'s Marlin on a checkpoint whose layers Marlin refuses (widths, on a GPU without native FP4):
    the merged BF16 copy of the dequantized base instead, the trainer's own numerics (no FP8 rounding), unless
    it is known not to fit vLLM's budget; then Marlin stays and the engine refuses it, naming the remedies."""
    fmt, problems = marlin_problems(model_path)
    if not problems:
        return choice
    if sizes and DENSE_MERGED in sizes and sequences_that_fit(sizes[DENSE_MERGED], env) == 0:
        return choice
    reason = (
        f"vLLM's Marlin {fmt.upper()} kernels refuse {len(problems)} of this checkpoint's fused layers on "
        f"this GPU (e.g. {problems[0]}): a BF16 copy of the dequantized base, the LoRA merged at every sync"
    )
    return BackendChoice(DENSE_MERGED, choice.fmt, reason, choice.concurrency)

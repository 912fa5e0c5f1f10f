"""GPU memory of colocated training: what the trainer holds, what vLLM may take, what to free when.

A colocated step has two phases that share one GPU:

* **rollout**: vLLM is awake (its weights, KV cache, CUDA graphs); the trainer holds only its
  *static* memory: the frozen base, the LoRA parameters, their gradients' storage and AdamW's state;
* **update**: vLLM sleeps (level 1: weights offloaded to CPU, KV cache dropped; a residue such as
  CUDA-graph pools stays), the trainer adds activations and the logprob chunks.

So vLLM's share is what is free once the trainer is loaded, minus a margin, and the trainer's
activations must fit in that same free memory minus what a sleeping vLLM keeps. Neither works if the
trainer keeps its activation blocks cached in PyTorch's allocator when vLLM wakes up (vLLM's
``wake_up`` then fails with ``CUDA Error: out of memory``): :func:`release_cached_memory` gives them
back first.

The arithmetic is in pure functions of sizes (:func:`trainer_static_bytes`,
:func:`update_activation_bytes`, :func:`choose_micro_batch`, :func:`vllm_memory_share`), tested
on the CPU on given model shapes; :func:`plan_memory` feeds them the GPU's measured free memory.
The activation figures are estimates (coefficients below, with margin); the per-step metrics
(:class:`qerl_cli.rl.device_memory.PeakTracker`) show the measured peaks next to them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from qerl_cli.errors import QerlError
from qerl_cli.modeling.model_shape import ModelShape, weight_bytes
from qerl_cli.rollout.backends import rollout_weight_bytes, rollout_weight_format
from qerl_cli.rollout.vllm_setup import VLLM_OVERHEAD
from qerl_cli.torch_utils import GIB

log = logging.getLogger(__name__)

# PEFT keeps LoRA weights in float32; each has a float32 gradient and AdamW's two float32 moments.
LORA_BYTES_PER_PARAM = 4 + 4 + 8
# Activations kept for backward per token and decoder layer, in units of hidden / intermediate
# size x 2 bytes (BF16). Counted from Qwen2's layer with LoRA on every projection: norm inputs
# (kept in float32 by HF's RMSNorm), q/k/v and rotary outputs, SDPA outputs, LoRA inputs, the MLP's
# gate/up/act/product; rounded up for temporaries.
ACT_HIDDEN_UNITS = 18
ACT_INTER_UNITS = 5
# Sequences' tokens per micro-batch above which a larger micro-batch no longer speeds up an
# update on a datacenter GPU (the matmuls are already large): below it, checkpointing with a
# larger micro-batch is preferred over no checkpointing with a tiny one.
SATURATING_TOKENS = 4096
# Tokens per micro-batch beyond which "auto" stops growing it: the matmuls gain nothing more and
# every extra token is peak memory an estimate could get wrong.
MAX_AUTO_TOKENS = 32768
# Memory vLLM keeps while asleep at level 1 (CUDA-graph pools, sampler and LoRA buffers).
VLLM_ASLEEP_RESERVE = int(3.0 * GIB)
# Left free on the device in every phase (allocator fragmentation, NCCL, the CUDA context).
DEFAULT_MARGIN = int(2.0 * GIB)
# Left out of vLLM's share on top of that: what this process holds more at vLLM's wake-up than when
# the share was measured, and empty_cache cannot return (blocks pinned by small tensors that vLLM's
# rollout and the update leave behind; the measurement it is sized on: docs/memory.md). Raise it when a
# wake-up stops short of memory.
WAKE_HEADROOM = int(5.0 * GIB)
# Tokens per logprob chunk of train.logprob_chunk_tokens=auto when memory allows: chunk x vocab float32
# logits, plus softmax and gradient in backward (a 262k vocabulary: 3 GiB).
DEFAULT_LOGPROB_CHUNK = 1024
# The smallest chunk "auto" halves down to when a smaller chunk lets a larger micro-batch (or no
# checkpointing) fit. A 128-row chunk is still one full row of the LM-head GEMM's usual 128-row tiles,
# over vocab / 128 column tiles, enough to fill the GPU; below it the tiles run part empty, and each
# halving doubles the per-chunk kernels (the head's matmul, softmax, gather, and their recomputation
# in backward) to save only chunk x vocab x 12 bytes.
MIN_AUTO_LOGPROB_CHUNK = 128
# The plan's figure of the chosen chunk (a token count among the GiB figures).
CHUNK_FIGURE = "memory/logprob_chunk_tokens"


def gib(n: float | int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


# --------------------------------------------------------------------------------------------
# Model sizes
# --------------------------------------------------------------------------------------------
def trainer_static_bytes(shape: ModelShape, fmt: str, rank: int, targets: list[str]) -> int:
    """What the trainer holds in every phase: the frozen base, LoRA, its gradients, AdamW state."""
    return weight_bytes(shape, fmt) + shape.lora_params(rank, targets) * LORA_BYTES_PER_PARAM


def update_activation_bytes(
    shape: ModelShape,
    fmt: str,
    micro_batch: int,
    seq_len: int,
    *,
    checkpointing: bool,
    logprob_chunk: int = DEFAULT_LOGPROB_CHUNK,
) -> int:
    """Peak bytes the update adds to the static memory for one micro-batch of ``seq_len`` tokens.

    With checkpointing, each layer keeps only its input and one layer's activations live again
    during its backward; without, every layer keeps its own. The logprobs of ``logprob_chunk``
    tokens at a time (0: the whole micro-batch) cost chunk x vocab float32 three times (logits,
    softmax, gradient). A 4-bit layer dequantizes its weight to BF16 for the matmul (twice: the
    forward of the recomputation and the backward).
    """
    tokens = micro_batch * seq_len
    per_layer = tokens * (ACT_HIDDEN_UNITS * shape.hidden + ACT_INTER_UNITS * shape.intermediate) * 2
    layer_input = tokens * shape.hidden * 2
    # Checkpointing: every layer's input, plus one layer's activations during its recomputation.
    layers = shape.layers * layer_input + per_layer if checkpointing else shape.layers * per_layer
    chunk = tokens if logprob_chunk <= 0 else min(logprob_chunk, tokens)
    logprobs = chunk * shape.vocab * 4 * 3 + 2 * layer_input
    dequant = 0
    if fmt != "bf16":
        dequant = 2 * max(a * b for a, b in shape.linear_shapes().values()) * 2
    return int(layers + logprobs + dequant)


# --------------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MicroBatchChoice:
    micro_batch_size: int
    gradient_checkpointing: bool
    activation_bytes: int
    logprob_chunk: int


def logprob_chunks(setting: int | str) -> list[int]:
    """The logprob chunks the plan may choose from, largest first: a given ``train.logprob_chunk_tokens``
    alone, or for ``auto`` :data:`DEFAULT_LOGPROB_CHUNK` halved down to :data:`MIN_AUTO_LOGPROB_CHUNK`."""
    if setting != "auto":
        return [int(setting)]
    sizes = [DEFAULT_LOGPROB_CHUNK]
    while sizes[-1] // 2 >= MIN_AUTO_LOGPROB_CHUNK:
        sizes.append(sizes[-1] // 2)
    return sizes


def choose_micro_batch(
    shape: ModelShape,
    fmt: str,
    seq_len: int,
    budget_bytes: int,
    *,
    max_micro_batch: int,
    checkpointing: bool | str = "auto",
    micro_batch: int | str = "auto",
    logprob_chunk: int | str = "auto",
) -> MicroBatchChoice:
    """The micro-batch size, checkpointing and logprob chunk for updates within ``budget_bytes`` of
    activations.

    Settings given as values are kept (and checked); ``"auto"`` picks the fastest that fits, in this
    order: no checkpointing (a third less compute) with a micro-batch of at least ``SATURATING_TOKENS``
    tokens (or all the step's sequences), at the largest chunk that allows it; then the same with
    checkpointing; only then the largest micro-batch that fits (with checkpointing unless it is off),
    at the largest chunk that allows that size. A smaller chunk costs a little speed, a smaller
    micro-batch or checkpointing much more. Raises QerlError, with the numbers, when not even one
    sequence fits.
    """
    top = max(1, min(max_micro_batch, MAX_AUTO_TOKENS // max(seq_len, 1)))
    sizes = [micro_batch] if micro_batch != "auto" else list(range(top, 0, -1))
    modes = [bool(checkpointing)] if checkpointing != "auto" else [False, True]
    chunks = logprob_chunks(logprob_chunk)

    def need(m: int, ckpt: bool, chunk: int) -> int:
        return update_activation_bytes(shape, fmt, m, seq_len, checkpointing=ckpt, logprob_chunk=chunk)

    def largest(ckpt: bool, chunk: int) -> int | None:
        return next((int(m) for m in sizes if need(int(m), ckpt, chunk) <= budget_bytes), None)

    def choice(m: int, ckpt: bool, chunk: int) -> MicroBatchChoice:
        return MicroBatchChoice(m, ckpt, need(m, ckpt, chunk), chunk)

    for ckpt in modes:
        for chunk in chunks:
            m = largest(ckpt, chunk)
            # A given micro-batch, or one big enough to saturate the GPU: take it.
            if m is not None and (micro_batch != "auto" or m >= top or m * seq_len >= SATURATING_TOKENS):
                return choice(m, ckpt, chunk)
    # No micro-batch that large fits: the largest that does, at the largest chunk that allows it.
    fits = [(m, chunk) for chunk in chunks if (m := largest(modes[-1], chunk)) is not None]
    if fits:
        m, chunk = max(fits)
        return choice(m, modes[-1], chunk)
    smallest = need(int(min(sizes)), modes[-1], chunks[-1])
    raise _does_not_fit(
        int(min(sizes)), seq_len, smallest, budget_bytes, modes[-1], micro_batch, logprob_chunk
    )


def _does_not_fit(
    sequences: int, seq_len: int, need_bytes: int, budget_bytes: int, checkpointing: bool,
    micro_batch: int | str, logprob_chunk: int | str,
) -> QerlError:  # fmt: skip
    """The error of an update that does not fit even at its smallest settings, with what to change."""
    advice = ["lower rollout.max_prompt_length + max_completion_length"]
    if not checkpointing:
        advice.append("set train.gradient_checkpointing to true or auto")
    if micro_batch != "auto" and int(micro_batch) > 1:
        advice.append(f"set train.micro_batch_size below {micro_batch}, or to auto")
    if logprob_chunk != "auto" and not 0 < int(logprob_chunk) <= MIN_AUTO_LOGPROB_CHUNK:
        advice.append(
            f"set train.logprob_chunk_tokens to auto (down to {MIN_AUTO_LOGPROB_CHUNK} when needed)"
        )
    advice.append("give vLLM a smaller rollout.gpu_memory_utilization or use a GPU with more memory")
    return QerlError(
        f"the update does not fit: one micro-batch of {sequences} x {seq_len} tokens needs about "
        f"{gib(need_bytes)} of activations{' even with gradient checkpointing' if checkpointing else ''}, "
        f"and only {gib(budget_bytes)} are left for them. To fix: " + "; ".join(advice)
    )


def vllm_min_bytes(
    shape: ModelShape, fmt: str, max_model_len: int, kv_dtype: str = "auto", backend: str = "default"
) -> int:
    """The least vLLM can run with: the weights it holds for a ``fmt`` base on its linear ``backend``
    (:func:`~qerl_cli.rollout.backends.rollout_weight_bytes`: an FP8 or BF16 copy, qerl's BF16 scales),
    its overhead, and KV for one full-length sequence."""
    held = rollout_weight_bytes(shape, backend, fmt)
    return held + VLLM_OVERHEAD + max_model_len * shape.kv_bytes_per_token(kv_dtype)


def vllm_memory_share(
    total_bytes: int, free_bytes: int, need_bytes: int, *, margin_bytes: int = DEFAULT_MARGIN
) -> float:
    """vLLM's ``gpu_memory_utilization`` (a fraction of the *whole* GPU, as vLLM defines it): what
    is free after the trainer loaded (``free_bytes``) minus ``margin_bytes``.

    vLLM refuses to start when less than utilization x total is free, and it sizes its KV cache
    from that budget minus its own weights and activations, so the share must come from the free
    memory (which also excludes other processes, e.g. a ballast capping the GPU), not the total.
    """
    if total_bytes <= 0:
        raise QerlError("the GPU reports no memory")
    available = free_bytes - margin_bytes
    if available < need_bytes:
        raise QerlError(
            f"vLLM does not fit next to the trainer: it needs at least {gib(need_bytes)} (weights, "
            f"overhead and the KV cache of one full-length sequence) but {gib(free_bytes)} of the GPU's "
            f"{gib(total_bytes)} are free after loading the trainer, less a {gib(margin_bytes)} margin. "
            "Use a 4-bit checkpoint, lower rollout.max_prompt_length + max_completion_length, set "
            "rollout.kv_cache_dtype=fp8, or use a GPU with more memory"
        )
    return math.floor(available / total_bytes * 1000) / 1000


@dataclass
class MemoryPlan:
    """The resolved settings of a run and the figures they came from (in the log, and in the bench's
    e2e rows). The update runs on these, not on the recipe's ``auto``: ``logprob_chunk`` is the
    chunk of its LM head (``train.logprob_chunk_tokens``)."""

    micro_batch_size: int
    gradient_checkpointing: bool
    gpu_memory_utilization: float
    logprob_chunk: int
    figures: dict[str, float] = field(default_factory=dict)


def _in_slice(exc: QerlError, gpu_fraction: float) -> QerlError:
    """A plan's error as is on the whole GPU; within a slice, saying so."""
    if gpu_fraction >= 1:
        return exc
    return QerlError(
        f"{exc} (free here means within train.gpu_fraction={gpu_fraction} of the GPU: run fewer runs on it "
        "at once, e.g. a smaller qerl compare --jobs)"
    )


def plan_memory(
    *,
    shape: ModelShape,
    fmt: str,
    lora_rank: int,
    lora_targets: list[str],
    seq_len: int,
    sequences_per_step: int,
    micro_batch: int | str,
    checkpointing: bool | str,
    gpu_memory_utilization: float | str,
    logprob_chunk: int | str,
    total_bytes: int | None,
    free_bytes: int | None,
    engine: str,
    kv_dtype: str = "auto",
    margin_bytes: int = DEFAULT_MARGIN,
    sleep_mode: bool = True,
    gpu_fraction: float = 1.0,
    used_bytes: int = 0,
    static_extra_bytes: int = 0,
    rollout_backend: str = "default",
) -> MemoryPlan:
    """Resolve the ``auto`` settings from sizes and the GPU's memory (``free_bytes`` is measured
    after the trainer's model is loaded and before vLLM starts; None on a CPU).

    Without ``sleep_mode`` vLLM keeps its whole share through the update, so the update's budget is
    what the share leaves, and the share cannot be ``auto`` (it would leave the update nothing).

    With ``gpu_fraction`` below 1 (runs sharing one GPU) the plan stays within that slice of the total:
    what is free is the slice less ``used_bytes`` (what this process already holds on the device), not
    the device's free memory (other runs take theirs). vLLM's share stays a fraction of the whole GPU,
    as vLLM defines it: at most ``gpu_fraction``.

    ``static_extra_bytes``: what the trainer holds beyond the base and LoRA (the FP8 weight copies of
    ``train.base_compute: fp8``), in the static estimate; already held, so ``free_bytes`` excludes it."""
    colocated = engine == "vllm"
    if colocated and not sleep_mode:
        _check_share_without_sleep(gpu_memory_utilization)
    figures: dict[str, float] = {"memory/trainer_static_estimate_gib": (trainer_static_bytes(
        shape, fmt, lora_rank, lora_targets) + static_extra_bytes) / GIB}  # fmt: skip
    if static_extra_bytes:
        figures["memory/fp8_base_copies_gib"] = static_extra_bytes / GIB
    if total_bytes is None or free_bytes is None:
        return _cpu_plan(micro_batch, checkpointing, gpu_memory_utilization, sequences_per_step,
                         logprob_chunk, figures)  # fmt: skip
    if gpu_fraction < 1:
        free_bytes = _free_in_slice(
            total_bytes, used_bytes, gpu_fraction, gpu_memory_utilization if colocated else "auto", figures
        )
    figures["memory/gpu_total_gib"] = total_bytes / GIB
    figures["memory/free_after_trainer_gib"] = free_bytes / GIB
    reserve = 0
    if colocated:
        reserve = VLLM_ASLEEP_RESERVE if sleep_mode else int(float(gpu_memory_utilization) * total_bytes)
    budget = free_bytes - reserve - margin_bytes
    try:
        choice = choose_micro_batch(
            shape, fmt, seq_len, budget, max_micro_batch=sequences_per_step, checkpointing=checkpointing,
            micro_batch=micro_batch, logprob_chunk=logprob_chunk,
        )  # fmt: skip
    except QerlError as exc:
        raise _in_slice(exc, gpu_fraction) from None
    figures["memory/activation_estimate_gib"] = choice.activation_bytes / GIB
    figures[CHUNK_FIGURE] = choice.logprob_chunk
    share = 0.0
    if colocated:
        share = _vllm_share(shape, fmt, seq_len, kv_dtype, gpu_memory_utilization, total_bytes, free_bytes,
                            margin_bytes, gpu_fraction, rollout_backend)  # fmt: skip
        figures["memory/vllm_budget_gib"] = share * total_bytes / GIB
    return MemoryPlan(
        choice.micro_batch_size, choice.gradient_checkpointing, share, choice.logprob_chunk, figures
    )


def _check_share_without_sleep(gpu_memory_utilization: float | str) -> None:
    """Without sleep mode vLLM holds its share through the update: ``auto`` would leave the update nothing."""
    if gpu_memory_utilization == "auto":
        raise QerlError(
            "rollout.gpu_memory_utilization=auto needs rollout.enable_sleep_mode=true: without sleep mode "
            "vLLM holds its share during the update too. Set an explicit share (e.g. 0.3) or turn sleep "
            "mode on"
        )


def _cpu_plan(
    micro_batch: int | str, checkpointing: bool | str, gpu_memory_utilization: float | str,
    sequences_per_step: int, logprob_chunk: int | str, figures: dict[str, float],
) -> MemoryPlan:  # fmt: skip
    """No device limit to plan against (a CPU): the defaults of the recipe format (the largest chunk)."""
    micro = 8 if micro_batch == "auto" else int(micro_batch)
    ckpt = True if checkpointing == "auto" else bool(checkpointing)
    share = 0.3 if gpu_memory_utilization == "auto" else float(gpu_memory_utilization)
    chunk = logprob_chunks(logprob_chunk)[0]
    figures[CHUNK_FIGURE] = chunk
    return MemoryPlan(min(micro, max(1, sequences_per_step)), ckpt, share, chunk, figures)


def _free_in_slice(
    total_bytes: int, used_bytes: int, gpu_fraction: float, vllm_share: float | str, figures: dict[str, float]
) -> int:
    """What is free within this run's ``gpu_fraction`` of the GPU: the slice less what this process
    holds. ``vllm_share`` (``auto`` where no vLLM runs beside the trainer) must fit in the slice."""
    if vllm_share != "auto" and float(vllm_share) > gpu_fraction:
        raise QerlError(
            f"rollout.gpu_memory_utilization={vllm_share} (a fraction of the whole GPU) is "
            f"more than train.gpu_fraction={gpu_fraction}, the part of the GPU this run may use"
        )
    slice_bytes = int(total_bytes * gpu_fraction)
    figures["memory/gpu_fraction"] = gpu_fraction
    figures["memory/gpu_slice_gib"] = slice_bytes / GIB
    return slice_bytes - used_bytes


def _vllm_share(
    shape: ModelShape, fmt: str, seq_len: int, kv_dtype: str, gpu_memory_utilization: float | str,
    total_bytes: int, free_bytes: int, margin_bytes: int, gpu_fraction: float, backend: str,
) -> float:  # fmt: skip
    """vLLM's share of the whole GPU: the recipe's, or (``auto``) sized from what is free within this
    run's slice, with room to wake up."""
    if gpu_memory_utilization != "auto":
        return float(gpu_memory_utilization)
    need = vllm_min_bytes(shape, fmt, seq_len, kv_dtype, backend)
    headroom = margin_bytes + WAKE_HEADROOM
    try:
        return vllm_memory_share(total_bytes, free_bytes, need, margin_bytes=headroom)
    except QerlError as exc:
        held = rollout_weight_format(backend, fmt)
        if held != fmt:  # a copy in another format: serving the checkpoint's own weights needs less
            exc = QerlError(f"{exc}; rollout.linear_backend={backend} holds a {held} copy of the {fmt} "
                            "weights: marlin (or auto) serves the checkpoint's own")  # fmt: skip
        raise _in_slice(exc, gpu_fraction) from None

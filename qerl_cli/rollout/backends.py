"""Which kernels run the rollout model's linear layers (``rollout.linear_backend``).

* ``marlin``: vLLM's default for 4-bit weights (no setting passed): weights dequantized in registers,
  fastest while a decode step is bound by reading them;
* ``humming``: vLLM's Humming kernels (the ``humming`` extra);
* ``qerl-triton``: qerl's own Triton W4A16 NVFP4 GEMM served inside vLLM
  (:mod:`qerl_cli.rollout.vllm_nvfp4`; Hopper, one GPU, vLLM's engine in this process);
* ``fp8``: an FP8 W8A8 rollout copy of the 4-bit base (:mod:`qerl_cli.rollout.fp8_rollout`), for a BF16
  base vLLM's online FP8; the trainer keeps its packed 4-bit base and truncated importance sampling
  corrects the extra rounding;
* ``merged``: the LoRA merged into BF16 rollout weights after every update, vLLM running without LoRA:
  a BF16 base's own weights, or for a 4-bit base a BF16 copy of its dequantized weights (written once
  and cached like the FP8 copy), so one recipe serves both arms of a comparison on BF16 rollouts. The
  copy takes 2 bytes a weight of vLLM's memory: pinned where that leaves no KV cache room it is
  refused, naming the bytes and the remedies (``fp8-merged``, ``marlin``);
* ``fp8-merged``: the LoRA merged into the FP8 copy of a 4-bit base (:mod:`qerl_cli.rollout.fp8_merge`);
  for a BF16 base it means ``merged``. Both merges refuse tensor parallelism and trained norms;
* ``auto``: the backend with the highest rollout tokens/s at the run's concurrency in a crossover table
  ``qerl bench --concurrency`` measures, among those installed whose weights leave the KV cache room for
  the round; the FP8 copies only with ``rollout.auto_fp8`` (one more rounding, which can cost accuracy),
  a 4-bit base's BF16 copy only where vLLM's memory budget is known and holds it. Without an entry for
  this GPU and format, or for a comparable model, it keeps vLLM's default.

The crossover depends on the model's layer widths, so every table entry names its model
(:class:`MeasuredModel`) and ``auto`` uses one only for a comparable model (:func:`comparable_models`);
an entry naming none only from the recipe's own ``rollout.crossover_table``. The measurements behind
the shipped table and what each copy costs: ``docs/rollout.md``.

This module only decides (for the GPU and packages :mod:`qerl_cli.rollout.environment` finds);
:func:`qerl_cli.rollout.factory.make_engine` applies the choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, get_args

from qerl_cli import formats
from qerl_cli.config.choices import MERGED_LINEAR_BACKENDS, LinearBackend
from qerl_cli.errors import QerlError, install_hint
from qerl_cli.formats.fp8 import FP8_MIN_CAPABILITY
from qerl_cli.modeling.model_shape import ModelShape, weight_bytes
from qerl_cli.rollout import vllm_nvfp4

# The crossover table's names, which callers import from here (one import for the whole choice).
from qerl_cli.rollout.crossover_table import COMPARABLE_FACTOR as COMPARABLE_FACTOR
from qerl_cli.rollout.crossover_table import MODEL_FIELD as MODEL_FIELD
from qerl_cli.rollout.crossover_table import SHIPPED_TABLE as SHIPPED_TABLE
from qerl_cli.rollout.crossover_table import MeasuredModel as MeasuredModel
from qerl_cli.rollout.crossover_table import comparable_models as comparable_models
from qerl_cli.rollout.crossover_table import entry_backends as entry_backends
from qerl_cli.rollout.crossover_table import entry_model as entry_model
from qerl_cli.rollout.crossover_table import gpu_entry as gpu_entry
from qerl_cli.rollout.crossover_table import interpolate as interpolate
from qerl_cli.rollout.crossover_table import key_entries as key_entries
from qerl_cli.rollout.crossover_table import load_table as load_table
from qerl_cli.rollout.crossover_table import merge_tables as merge_tables
from qerl_cli.rollout.crossover_table import pick_entry as pick_entry
from qerl_cli.rollout.crossover_table import table_key as table_key
from qerl_cli.rollout.vllm_env import vllm_too_old
from qerl_cli.torch_utils import GIB

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = get_args(LinearBackend)  # rollout.linear_backend's values
# The backends that merge the LoRA into the rollout weights (vLLM without LoRA): into the FP8 copy of a
# 4-bit base; into BF16 weights (a BF16 base's own, a 4-bit base's BF16 copy).
FP8_MERGED, DENSE_MERGED = MERGED_LINEAR_BACKENDS
MERGED_BACKENDS = MERGED_LINEAR_BACKENDS
# The backends each checkpoint format can be served with (first: vLLM's default), a trait of each format
# on the registry. NF4 only runs on vLLM's bitsandbytes kernels (or its FP8 and BF16 copies); a BF16
# base runs BF16 GEMMs or vLLM's online FP8. Pinning a 4-bit FP kernel (marlin, humming) for a base that
# has no such weights keeps its default, so one recipe serves the BF16 and the 4-bit arms of a comparison.
FORMAT_BACKENDS: dict[str, tuple[str, ...]] = {
    **{name: fmt.rollout_backends for name, fmt in formats.FORMATS.items()},
    formats.DENSE: ("default", "fp8", DENSE_MERGED),
}
# The checkpoint formats without FP4 weights, which the FP4 kernels (FP4_KERNELS) cannot serve.
NOT_FP4_FORMATS = (formats.DENSE, *(name for name, fmt in formats.FORMATS.items() if not fmt.fp4))
HUMMING_VLLM = (0, 26)  # the first vLLM with linear_backend="humming"


@dataclass(frozen=True)
class BackendChoice:
    """What the rollout engine runs: ``backend`` for a checkpoint of ``fmt``, why, and the figure
    (tokens/s predicted from the crossover table at ``concurrency``) when there was one."""

    backend: str
    fmt: str
    reason: str
    concurrency: int = 0
    predicted_tokens_per_s: float | None = None
    candidates: dict[str, float | None] = field(default_factory=dict)

    def vllm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments ``vllm.LLM`` needs for this backend (the FP8 model path is separate)."""
        if self.backend == "humming":
            return {"linear_backend": "humming"}
        if self.backend == vllm_nvfp4.BACKEND:
            return {"linear_backend": vllm_nvfp4.VLLM_BACKEND}
        if self.backend == "fp8" and self.fmt == "bf16":
            return {"quantization": "fp8"}
        return {}

    @property
    def needs_fp8_copy(self) -> bool:
        return self.backend in ("fp8", FP8_MERGED) and self.fmt != formats.DENSE

    @property
    def needs_bf16_copy(self) -> bool:
        """vLLM serves a BF16 copy of the dequantized 4-bit base (``merged`` on a 4-bit base)."""
        return needs_bf16_copy(self.backend, self.fmt)

    @property
    def merges_lora(self) -> bool:
        """vLLM runs without LoRA; each sync merges the adapter into its weights."""
        return self.backend in MERGED_BACKENDS

    @property
    def weight_format(self) -> str:
        """The format of the weights vLLM holds (what its memory is sized for)."""
        return rollout_weight_format(self.backend, self.fmt)

    def as_record(self) -> dict[str, Any]:
        return {"backend": self.backend, "format": self.fmt, "reason": self.reason,
                "concurrency": self.concurrency, "predicted_tokens_per_s": self.predicted_tokens_per_s,
                "candidates": dict(self.candidates)}  # fmt: skip


@dataclass(frozen=True)
class Environment:
    """What the choice depends on besides the table: the GPU, what is installed, the memory vLLM gets."""

    gpu_name: str | None
    capability: tuple[int, int] | None
    humming_installed: bool
    vllm_version: tuple[int, int] | None
    # vLLM's memory budget and the bytes one full-length sequence's KV cache takes; None: not checked.
    vllm_budget_bytes: int | None = None
    kv_bytes_per_sequence: int | None = None
    overhead_bytes: int = 0
    # What qerl's own kernel (qerl-triton) needs: one GPU, vLLM's engine in this process, BF16.
    tensor_parallel_size: int = 1
    engine_in_process: bool = True
    rollout_dtype: str = "bfloat16"


def rollout_weight_format(backend: str, fmt: str) -> str:
    """The format of the weights vLLM holds for a ``fmt`` base on ``backend`` (what its memory is sized
    for, what truncated importance sampling and the bench's roofline read): FP8 for the FP8 copies
    (vLLM's online FP8 of a BF16 base too), BF16 for ``merged`` (a BF16 base's own weights or a 4-bit
    base's BF16 copy), else the checkpoint's own."""
    if backend == "fp8" or (backend == FP8_MERGED and fmt != formats.DENSE):
        return "fp8"
    if backend == DENSE_MERGED:
        return formats.DENSE
    return fmt


def rollout_weight_bytes(shape: ModelShape, backend: str, fmt: str) -> int:
    """Bytes of the weights vLLM holds for a ``fmt`` base on ``backend``: the rollout format's
    (:func:`rollout_weight_format`), plus what qerl's kernel adds to an NVFP4 base (its BF16 block
    scales, ``vllm_nvfp4.EXTRA_BYTES_PER_WEIGHT``)."""
    held = weight_bytes(shape, rollout_weight_format(backend, fmt))
    if backend == vllm_nvfp4.BACKEND and fmt == "nvfp4":
        held += int(shape.decoder_linear_params() * vllm_nvfp4.EXTRA_BYTES_PER_WEIGHT)
    return held


def needs_bf16_copy(backend: str, fmt: str) -> bool:
    """Whether ``backend`` serves vLLM a BF16 copy of a ``fmt`` base (``merged`` on a 4-bit base)."""
    return backend == DENSE_MERGED and fmt != formats.DENSE


# --------------------------------------------------------------------------------------------
# Availability and memory
# --------------------------------------------------------------------------------------------
def unavailable_reason(backend: str, fmt: str, env: Environment) -> str | None:
    """Why ``backend`` cannot serve a ``fmt`` checkpoint here (None: it can), with the fix."""
    allowed = FORMAT_BACKENDS.get(fmt, ("default",))
    if backend == vllm_nvfp4.BACKEND and backend not in allowed and fmt not in NOT_FP4_FORMATS:
        return (f"qerl's kernel reads NVFP4's 16-value blocks and E4M3 scales only; a {fmt} checkpoint runs "
                f"on {', '.join(allowed)}")  # fmt: skip
    if backend not in allowed:
        return (f"a {fmt} checkpoint runs only on {', '.join(allowed)}: vLLM has no {backend} kernel for it"
                + (f"; quantize the base to {' or '.join(map(str.upper, formats.fp4_names()))} for the FP4 "
                   "backends" if fmt in NOT_FP4_FORMATS else ""))  # fmt: skip
    if backend == "humming":
        if not env.humming_installed:
            return f"needs the humming-kernels package: {install_hint('humming')}"
        too_old = vllm_too_old(env.vllm_version, HUMMING_VLLM, "linear_backend='humming'")
        if too_old is not None:
            return too_old
    if backend == vllm_nvfp4.BACKEND:
        return vllm_nvfp4.unavailable_reason(
            capability=env.capability, tensor_parallel_size=env.tensor_parallel_size,
            in_process=env.engine_in_process, vllm_version=env.vllm_version, dtype=env.rollout_dtype,
        )  # fmt: skip
    fp8_weights = rollout_weight_format(backend, fmt) == "fp8"
    if fp8_weights and env.capability is not None and env.capability < FP8_MIN_CAPABILITY:
        return (f"needs FP8 tensor cores (compute capability 8.9+, Ada or Hopper); this GPU is "
                f"sm{env.capability[0]}{env.capability[1]}")  # fmt: skip
    return None


def format_merge(backend: str, fmt: str) -> str:
    """A merge backend as this base serves it: ``fp8-merged`` on a BF16 base is ``merged`` (its own BF16
    weights: there is no 4-bit base to copy to FP8); ``merged`` is BF16 merged weights on every base (a
    4-bit base's through its BF16 copy); any other backend unchanged."""
    if backend == FP8_MERGED and fmt == formats.DENSE:
        return DENSE_MERGED
    return backend


# The FP4 kernels, which a base without FP4 weights does not run (qerl-triton: NVFP4 only, an MXFP4 base
# refuses it by FORMAT_BACKENDS).
FP4_KERNELS = ("marlin", "humming", vllm_nvfp4.BACKEND)


def served_backend(requested: str, fmt: str) -> str:
    """The backend a ``fmt`` base serves a pinned ``requested`` as: a merge name as this base's merge
    (:func:`format_merge`), an FP4 kernel on a base without FP4 weights as the format's default; ``auto``
    and every other backend as asked. ``choose_backend`` keeps a pinned backend by it, and the bench
    folds the pairs that would run the same kernels by it."""
    backend = format_merge(requested, fmt)
    if backend in FP4_KERNELS and fmt in NOT_FP4_FORMATS:
        return FORMAT_BACKENDS.get(fmt, ("default",))[0]
    return backend


def sequences_that_fit(weight_bytes: int, env: Environment) -> int | None:
    """Full-length sequences whose KV cache fits beside ``weight_bytes`` in vLLM's budget (None: not
    known)."""
    if env.vllm_budget_bytes is None or not env.kv_bytes_per_sequence:
        return None
    free = env.vllm_budget_bytes - weight_bytes - env.overhead_bytes
    return max(0, free // env.kv_bytes_per_sequence)


# --------------------------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------------------------
def choose_backend(
    requested: str,
    fmt: str,
    *,
    concurrency: int,
    env: Environment,
    table: dict[str, Any],
    weight_bytes: dict[str, int] | None = None,
    lora: bool = True,
    model: MeasuredModel | None = None,
    unknown_model_ok: bool = True,
    merge_ok: bool = False,
    fp8_ok: bool = False,
) -> BackendChoice:
    """Resolve ``rollout.linear_backend`` for a ``fmt`` checkpoint and a round of ``concurrency`` sequences.

    A pinned backend is checked and kept (QerlError with the fix when it cannot run here). ``auto``
    predicts each available backend's tokens/s at the concurrency its weights leave KV room for
    (``weight_bytes``: per backend) and takes the best, from the table's entry for this GPU and format
    measured on a model comparable to ``model`` (the run's); an entry that names no model only when
    ``unknown_model_ok`` (the recipe named the table itself). With no such measurements it keeps vLLM's
    default, and the reason says why. ``auto`` weighs the merged backends only with ``merge_ok`` (the
    trainer's engine, LoRA on): they serve a LoRA policy by rewriting vLLM's weights at every sync,
    and the FP8 copies (weights and activations rounded once more) only with ``fp8_ok``
    (``rollout.auto_fp8``); the reason names a faster FP8 copy it passed over.
    """
    if requested not in BACKENDS:
        raise QerlError(
            f"rollout.linear_backend={requested!r} is unknown; choose one of {', '.join(BACKENDS)}"
        )
    default = FORMAT_BACKENDS.get(fmt, ("default",))[0]
    if requested != "auto":
        served = served_backend(requested, fmt)
        requested = format_merge(requested, fmt)
        if served != requested:  # an FP4 kernel on a base without FP4 weights
            return BackendChoice(served, fmt, f"{requested} serves FP4 weights only: a {fmt} base keeps "
                                 f"vLLM's default", concurrency)  # fmt: skip
        reason = unavailable_reason(requested, fmt, env)
        if reason is not None:
            raise QerlError(f"rollout.linear_backend={requested}: {reason}")
        _check_fits(requested, fmt, weight_bytes, env)
        return BackendChoice(requested, fmt, "pinned by rollout.linear_backend", concurrency)

    what = f"{fmt}{' + LoRA' if lora else ''} on {env.gpu_name or 'this GPU'}"
    entries = key_entries(gpu_entry(table, env.gpu_name), table_key(fmt, lora))
    measured, source, why_not = pick_entry(entries, model, unknown_model_ok, what)
    candidates: dict[str, float | None] = {}
    passed_over: dict[str, float] = {}  # FP8 copies auto may not choose (fp8_ok off), as predicted
    for backend in FORMAT_BACKENDS.get(fmt, ("default",)):
        if unavailable_reason(backend, fmt, env) is not None or backend not in measured:
            continue
        if backend in MERGED_BACKENDS and not (merge_ok and lora):
            continue
        fits = sequences_that_fit((weight_bytes or {}).get(backend, 0), env) if weight_bytes else None
        if fits == 0 or (fits is None and needs_bf16_copy(backend, fmt)):
            continue  # a BF16 copy of a 4-bit base (2 bytes a weight) only where it is known to fit
        predicted = interpolate(measured[backend], min(concurrency, fits or concurrency))
        if rollout_weight_format(backend, fmt) == "fp8" and not fp8_ok:
            if predicted is not None:
                passed_over[backend] = predicted
            continue
        candidates[backend] = predicted
    scored = {b: v for b, v in candidates.items() if v is not None}
    if default not in scored:  # an alternative is only chosen against a measured default
        why = why_not or (f"no crossover measurements for {what}" if not measured
                          else f"vLLM's default ({default}) was not measured for {what}")  # fmt: skip
        reason = f"{why}: vLLM's default ({default})"
        return BackendChoice(default, fmt, reason, concurrency, None, candidates)
    best = max(scored, key=lambda b: scored[b])
    ranked = sorted(scored.items(), key=lambda kv: -kv[1])
    reason = f"fastest measured at {concurrency} sequences on {env.gpu_name} ({source}): " + ", ".join(
        f"{b} {v:.0f} tok/s" for b, v in ranked
    )
    faster = {b: v for b, v in passed_over.items() if v > scored[best]}
    if faster:
        reason += (
            "; not the FP8 copies (rollout.auto_fp8 off: they round weights and activations once more), "
            + ", ".join(f"{b} {v:.0f} tok/s" for b, v in sorted(faster.items(), key=lambda kv: -kv[1]))
        )
    return BackendChoice(best, fmt, reason, concurrency, scored[best], candidates)


def _check_fits(backend: str, fmt: str, weight_bytes: dict[str, int] | None, env: Environment) -> None:
    if not weight_bytes or backend not in weight_bytes:
        return
    fits = sequences_that_fit(weight_bytes[backend], env)
    if fits == 0:
        assert env.vllm_budget_bytes is not None  # fits is None otherwise
        if needs_bf16_copy(backend, fmt):
            raise QerlError(bf16_copy_refusal(fmt, weight_bytes[backend], env))
        raise QerlError(
            f"rollout.linear_backend={backend}: its rollout weights for the {fmt} base "
            f"({weight_bytes[backend] / GIB:.1f} GiB) leave no room for one full-length sequence's KV "
            "cache in vLLM's "
            f"{env.vllm_budget_bytes / GIB:.1f} GiB; pick rollout.linear_backend=auto or marlin, raise "
            "rollout.gpu_memory_utilization, or shorten rollout.max_completion_length"
        )


def bf16_copy_refusal(fmt: str, copy_bytes: int, env: Environment) -> str:
    """Why a pinned ``merged`` cannot serve a ``fmt`` base here: its BF16 copy, one full-length sequence's
    KV cache and vLLM's overhead need more than vLLM's budget (the bytes of each), and the remedies."""
    assert env.vllm_budget_bytes is not None and env.kv_bytes_per_sequence is not None
    needed = copy_bytes + env.kv_bytes_per_sequence + env.overhead_bytes
    return (
        f"rollout.linear_backend={DENSE_MERGED} serves vLLM a BF16 copy of the {fmt} base: its weights "
        f"({copy_bytes / GIB:.1f} GiB, 2 bytes a weight), one full-length sequence's KV cache "
        f"({env.kv_bytes_per_sequence / GIB:.2f} GiB) and vLLM's overhead "
        f"({env.overhead_bytes / GIB:.1f} GiB) need {needed / GIB:.1f} GiB, but vLLM's budget is "
        f"{env.vllm_budget_bytes / GIB:.1f} GiB (rollout.gpu_memory_utilization of this GPU). Use "
        "rollout.linear_backend=fp8-merged (the LoRA merged into an FP8 copy, 1 byte a weight) or marlin "
        "(the 4-bit weights, the LoRA served by vLLM), or raise rollout.gpu_memory_utilization"
    )

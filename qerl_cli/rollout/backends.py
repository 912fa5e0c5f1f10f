"""Which kernels run the rollout model's linear layers (``rollout.linear_backend``).

On Hopper, vLLM serves NVFP4 / MXFP4 weight-only checkpoints with Marlin (``mma.sync``, weights
dequantized in registers): fastest while a decode step is bound by reading the weights, but
compute-bound above ~64 rows, where BF16's ``wgmma`` GEMMs overtake it. The alternatives:

* ``marlin``: vLLM's default for 4-bit weights (no setting passed);
* ``humming``: vLLM 0.26's Humming kernels (``linear_backend="humming"``, ``wgmma`` on Hopper;
  ``pip install "qerl[humming]"``);
* ``fp8``: an FP8 W8A8 rollout copy of the 4-bit base (:mod:`qerl_cli.modeling.fp8_rollout`),
  served by vLLM's FP8 tensor-core GEMMs at twice the BF16 peak; for a BF16 base, vLLM's online FP8.
  The trainer keeps its packed 4-bit base: truncated importance sampling corrects the extra rounding.
* ``auto``: per GPU and the run's concurrency (sequences one rollout round submits), the backend with
  the highest rollout tokens/s in a crossover table that ``qerl bench --concurrency`` measures, among
  those installed and whose weights leave the KV cache room for the round. Without measurements for
  this GPU and format it keeps vLLM's default.

This module only decides; :func:`qerl_cli.rollout.factory.make_engine` applies the choice.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_cli import formats
from qerl_cli.errors import QerlError

log = logging.getLogger(__name__)

BACKENDS = ("auto", "marlin", "humming", "fp8")
# The backends each checkpoint format can be served with (first: vLLM's default). NF4 only runs on
# vLLM's bitsandbytes kernels (or its FP8 copy); a BF16 base runs BF16 GEMMs or vLLM's online FP8.
# Pinning a 4-bit FP kernel (marlin, humming) for a base that has no such weights keeps its default, so
# one recipe serves the BF16 and the 4-bit arms of a comparison.
FORMAT_BACKENDS: dict[str, tuple[str, ...]] = {
    **{name: fmt.rollout_backends for name, fmt in formats.FORMATS.items()},
    "bf16": ("default", "fp8"),
}
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on
HUMMING_VLLM = (0, 26)  # the first vLLM with linear_backend="humming"
SHIPPED_TABLE = Path(__file__).with_name("crossover.json")


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
        if self.backend == "fp8" and self.fmt == "bf16":
            return {"quantization": "fp8"}
        return {}

    @property
    def needs_fp8_copy(self) -> bool:
        return self.backend == "fp8" and self.fmt != "bf16"

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


# --------------------------------------------------------------------------------------------
# The crossover table
# --------------------------------------------------------------------------------------------
def table_key(fmt: str, lora: bool) -> str:
    return f"{fmt}+lora" if lora else fmt


def load_table(path: str | Path | None = None) -> dict[str, Any]:
    """A crossover table: ``{"gpus": {GPU name: {"nvfp4+lora": {backend: {concurrency: tok/s}}}}}``.

    ``path`` None: the table shipped with qerl (measured by ``qerl bench --concurrency``).
    """
    file = Path(path) if path else SHIPPED_TABLE
    if not file.is_file():
        if path:
            raise QerlError(f"rollout.crossover_table: {file} does not exist; write one with qerl bench "
                            "--concurrency (its crossover.json) or leave the setting empty")  # fmt: skip
        return {"gpus": {}}
    try:
        table = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise QerlError(f"{file} is not valid JSON ({exc}); write it with qerl bench --concurrency") from None
    if not isinstance(table, dict) or not isinstance(table.get("gpus"), dict):
        raise QerlError(f"{file} is not a crossover table (no 'gpus' mapping); qerl bench --concurrency "
                        "writes one as crossover.json")  # fmt: skip
    return table


def merge_tables(*tables: dict[str, Any]) -> dict[str, Any]:
    """One table from several (sweeps of other backends or machines): later measurements of the same
    GPU, format, backend and concurrency win."""
    merged: dict[str, Any] = {"gpus": {}}
    for table in tables:
        for gpu, entry in table.get("gpus", {}).items():
            for key, by_backend in entry.items():
                for backend, points in by_backend.items():
                    into = merged["gpus"].setdefault(gpu, {}).setdefault(key, {})
                    into.setdefault(backend, {}).update(points)
        if "measured" in table:
            merged.setdefault("measured", []).append(table["measured"])
    return merged


def gpu_entry(table: dict[str, Any], gpu_name: str | None) -> dict[str, Any] | None:
    """The table's measurements for ``gpu_name``: an exact name, else one contained in it (``H100``)."""
    if not gpu_name:
        return None
    gpus = table.get("gpus", {})
    if gpu_name in gpus:
        return gpus[gpu_name]
    matches = [name for name in gpus if name.lower() in gpu_name.lower() or gpu_name.lower() in name.lower()]
    return gpus[max(matches, key=len)] if matches else None


def interpolate(points: dict[Any, float], concurrency: int) -> float | None:
    """Tokens/s at ``concurrency`` from measured ``{concurrency: tokens/s}``: linear in log2 of the
    concurrency between measured points, the nearest measured value outside them."""
    measured = sorted((int(c), float(v)) for c, v in points.items() if v is not None and float(v) > 0)
    if not measured:
        return None
    if concurrency <= measured[0][0]:
        return measured[0][1]
    if concurrency >= measured[-1][0]:
        return measured[-1][1]
    for (c0, v0), (c1, v1) in zip(measured, measured[1:], strict=False):
        if c0 <= concurrency <= c1:
            t = (math.log2(concurrency) - math.log2(c0)) / (math.log2(c1) - math.log2(c0))
            return v0 + t * (v1 - v0)
    return None  # unreachable: the loop covers every interval


# --------------------------------------------------------------------------------------------
# Availability and memory
# --------------------------------------------------------------------------------------------
def unavailable_reason(backend: str, fmt: str, env: Environment) -> str | None:
    """Why ``backend`` cannot serve a ``fmt`` checkpoint here (None: it can), with the fix."""
    allowed = FORMAT_BACKENDS.get(fmt, ("default",))
    if backend not in allowed:
        return (f"a {fmt} checkpoint runs only on {', '.join(allowed)}: vLLM has no {backend} kernel for it"
                + ("; quantize the base to NVFP4 or MXFP4 for the FP4 backends" if fmt in ("bf16", "nf4")
                   else ""))  # fmt: skip
    if backend == "humming":
        if not env.humming_installed:
            return 'needs the humming-kernels package: pip install "qerl[humming]"'
        if env.vllm_version is not None and env.vllm_version < HUMMING_VLLM:
            have = ".".join(map(str, env.vllm_version))
            return (f"needs vLLM {HUMMING_VLLM[0]}.{HUMMING_VLLM[1]}+ (linear_backend='humming'); this is "
                    f"vLLM {have}: pip install -U \"qerl[vllm]\"")  # fmt: skip
    if backend == "fp8" and env.capability is not None and env.capability < FP8_CAPABILITY:
        return (f"needs FP8 tensor cores (compute capability 8.9+, Ada or Hopper); this GPU is "
                f"sm{env.capability[0]}{env.capability[1]}")  # fmt: skip
    return None


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
) -> BackendChoice:
    """Resolve ``rollout.linear_backend`` for a ``fmt`` checkpoint and a round of ``concurrency`` sequences.

    A pinned backend is checked and kept (QerlError with the fix when it cannot run here). ``auto``
    predicts each available backend's tokens/s at the concurrency its weights leave KV room for
    (``weight_bytes``: per backend) and takes the best; with no measurements it keeps vLLM's default.
    """
    if requested not in BACKENDS:
        raise QerlError(
            f"rollout.linear_backend={requested!r} is unknown; choose one of {', '.join(BACKENDS)}"
        )
    default = FORMAT_BACKENDS.get(fmt, ("default",))[0]
    if requested != "auto":
        if requested in ("marlin", "humming") and fmt in ("bf16", "nf4"):
            return BackendChoice(default, fmt, f"{requested} serves FP4 weights only: a {fmt} base keeps "
                                 f"vLLM's default", concurrency)  # fmt: skip
        reason = unavailable_reason(requested, fmt, env)
        if reason is not None:
            raise QerlError(f"rollout.linear_backend={requested}: {reason}")
        _check_fits(requested, fmt, weight_bytes, env)
        return BackendChoice(requested, fmt, "pinned by rollout.linear_backend", concurrency)

    entry = gpu_entry(table, env.gpu_name)
    measured = (entry or {}).get(table_key(fmt, lora)) or {}
    candidates: dict[str, float | None] = {}
    for backend in FORMAT_BACKENDS.get(fmt, ("default",)):
        if unavailable_reason(backend, fmt, env) is not None or backend not in measured:
            continue
        fits = sequences_that_fit((weight_bytes or {}).get(backend, 0), env) if weight_bytes else None
        if fits == 0:
            continue
        candidates[backend] = interpolate(measured[backend], min(concurrency, fits or concurrency))
    scored = {b: v for b, v in candidates.items() if v is not None}
    if default not in scored:  # an alternative is only chosen against a measured default
        what = f"{fmt}{' + LoRA' if lora else ''} on {env.gpu_name or 'this GPU'}"
        why = (f"no crossover measurements for {what}" if not measured
               else f"vLLM's default ({default}) was not measured for {what}")  # fmt: skip
        reason = f"{why}: vLLM's default ({default})"
        return BackendChoice(default, fmt, reason, concurrency, None, candidates)
    best = max(scored, key=lambda b: scored[b])
    ranked = sorted(scored.items(), key=lambda kv: -kv[1])
    reason = f"fastest measured at {concurrency} sequences on {env.gpu_name}: " + ", ".join(
        f"{b} {v:.0f} tok/s" for b, v in ranked
    )
    return BackendChoice(best, fmt, reason, concurrency, scored[best], candidates)


def _check_fits(backend: str, fmt: str, weight_bytes: dict[str, int] | None, env: Environment) -> None:
    if not weight_bytes or backend not in weight_bytes:
        return
    fits = sequences_that_fit(weight_bytes[backend], env)
    if fits == 0:
        assert env.vllm_budget_bytes is not None  # fits is None otherwise
        raise QerlError(
            f"rollout.linear_backend={backend}: its rollout weights for the {fmt} base "
            f"({weight_bytes[backend] / 2**30:.1f} GiB) leave no room for one full-length sequence's KV "
            "cache in vLLM's "
            f"{env.vllm_budget_bytes / 2**30:.1f} GiB; pick rollout.linear_backend=auto or marlin, raise "
            "rollout.gpu_memory_utilization, or shorten rollout.max_completion_length"
        )


# --------------------------------------------------------------------------------------------
# The environment of this process
# --------------------------------------------------------------------------------------------
def current_environment(
    *, vllm_budget_bytes: int | None = None, kv_bytes_per_sequence: int | None = None, overhead_bytes: int = 0
) -> Environment:
    """The GPU this process uses and what is installed (no GPU: name and capability None)."""
    import torch

    gpu = capability = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name()
        capability = tuple(torch.cuda.get_device_capability())
    return Environment(
        gpu_name=gpu, capability=capability,  # type: ignore[arg-type]
        humming_installed=importlib.util.find_spec("humming") is not None,
        vllm_version=_vllm_version(), vllm_budget_bytes=vllm_budget_bytes,
        kv_bytes_per_sequence=kv_bytes_per_sequence, overhead_bytes=overhead_bytes,
    )  # fmt: skip


def _vllm_version() -> tuple[int, int] | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        parts = version("vllm").split(".")
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (PackageNotFoundError, ValueError, IndexError):
        return None

"""Which kernels run the rollout model's linear layers (``rollout.linear_backend``).

* ``marlin``: vLLM's default for 4-bit weights (no setting passed): weights dequantized in registers,
  fastest while a decode step is bound by reading them;
* ``humming``: vLLM's Humming kernels (``pip install "qerl[humming]"``);
* ``fp8``: an FP8 W8A8 rollout copy of the 4-bit base (:mod:`qerl_cli.rollout.fp8_rollout`), for a BF16
  base vLLM's online FP8; the trainer keeps its packed 4-bit base and truncated importance sampling
  corrects the extra rounding;
* ``fp8-merged`` / ``merged``: the LoRA merged into the FP8 copy / a BF16 base after every update
  (:mod:`qerl_cli.rollout.fp8_merge`, ``rollout.vllm_lora``), vLLM running without LoRA; either name
  pinned for a base of the other kind means that base's merge, and tensor parallelism and trained norms
  are refused;
* ``auto``: the backend with the highest rollout tokens/s at the run's concurrency in a crossover table
  ``qerl bench --concurrency`` measures, among those installed whose weights leave the KV cache room for
  the round; the FP8 copies only with ``rollout.auto_fp8`` (one more rounding, which can cost accuracy).
  Without an entry for this GPU and format, or for a comparable model, it keeps vLLM's default.

The crossover depends on the model's layer widths, so every table entry names its model
(:class:`MeasuredModel`) and ``auto`` uses one only for a comparable model (:func:`comparable_models`);
an entry naming none only from the recipe's own ``rollout.crossover_table``. Crossovers and what the FP8
copy cost: ``benchmarks/h100-2026-11-24``, ``benchmarks/gemma3-270m-h100-2026-11-24``.

This module only decides (for the GPU and packages :mod:`qerl_cli.rollout.environment` finds);
:func:`qerl_cli.rollout.factory.make_engine` applies the choice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from qerl_cli import formats
from qerl_cli.config.sections import MERGED_LINEAR_BACKENDS, LinearBackend
from qerl_cli.errors import QerlError
from qerl_cli.formats.fp8 import FP8_MIN_CAPABILITY
from qerl_cli.modeling.model_shape import ModelShape

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = get_args(LinearBackend)  # rollout.linear_backend's values
# The backends each checkpoint format can be served with (first: vLLM's default). NF4 only runs on
# vLLM's bitsandbytes kernels (or its FP8 copy); a BF16 base runs BF16 GEMMs or vLLM's online FP8.
# Pinning a 4-bit FP kernel (marlin, humming) for a base that has no such weights keeps its default, so
# one recipe serves the BF16 and the 4-bit arms of a comparison.
FORMAT_BACKENDS: dict[str, tuple[str, ...]] = {
    **{name: fmt.rollout_backends for name, fmt in formats.FORMATS.items()},
    formats.DENSE: ("default", "fp8", "merged"),
}
# The backends that merge the LoRA into the rollout weights (vLLM without LoRA): into the FP8 copy of a
# 4-bit base, into a BF16 base's own weights.
FP8_MERGED, DENSE_MERGED = MERGED_LINEAR_BACKENDS
MERGED_BACKENDS = MERGED_LINEAR_BACKENDS
# The checkpoint formats without FP4 weights, which the FP4 kernels (marlin, humming) cannot serve.
NOT_FP4_FORMATS = (formats.DENSE, *(name for name, fmt in formats.FORMATS.items() if not fmt.fp4))
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
        return self.backend in ("fp8", FP8_MERGED) and self.fmt != formats.DENSE

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


def rollout_weight_format(backend: str, fmt: str) -> str:
    """The format of the weights vLLM holds for a ``fmt`` base on ``backend``: FP8 for the FP8 copies
    (vLLM's online FP8 of a BF16 base too), BF16 for a BF16 base with the LoRA merged."""
    if backend == "fp8" or (backend == FP8_MERGED and fmt != formats.DENSE):
        return "fp8"
    return fmt


# --------------------------------------------------------------------------------------------
# The crossover table
# --------------------------------------------------------------------------------------------
# Parameter counts within this factor of each other are of a comparable size (a table entry measured on
# one is used for the other).
COMPARABLE_FACTOR = 2.0
MODEL_FIELD = "model"  # the key, beside the backends' names, of the model an entry was measured on


@dataclass(frozen=True)
class MeasuredModel:
    """The model a crossover entry was measured on (or a run's model, to compare with it)."""

    name: str | None = None
    parameters: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    layers: int | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str | None = None) -> MeasuredModel | None:
        """From a transformers ``config.json`` dict (None when it lacks the usual dimensions)."""
        try:
            shape = ModelShape.from_config(config)
        except QerlError:
            return None
        return cls(name, shape.parameters(), shape.hidden, shape.intermediate, shape.layers)

    @classmethod
    def from_dict(cls, data: Any) -> MeasuredModel | None:
        if not isinstance(data, dict):
            return None

        def number(key: str) -> int | None:
            value = data.get(key)
            return int(value) if isinstance(value, int | float) and value > 0 else None

        name = data.get("name")
        return cls(str(name) if name is not None else None, number("parameters"), number("hidden_size"),
                   number("intermediate_size"), number("layers"))  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def label(self) -> str:
        size = f"{self.parameters / 1e9:.2g}B parameters" if self.parameters else None
        if size is None and self.hidden_size:
            size = f"hidden {self.hidden_size}" + (f", {self.layers} layers" if self.layers else "")
        if self.name and size:
            return f"{self.name} ({size})"
        return self.name or size or "a model of unknown size"


def comparable_models(run: MeasuredModel | None, measured: MeasuredModel | None) -> bool:
    """Whether a table entry measured on ``measured`` may steer a run of ``run``: parameter counts within
    ``COMPARABLE_FACTOR`` of each other, or (either count unknown, or not within it) the same hidden and
    MLP widths, which are the GEMM shapes whose compute-bound point the crossover is. Unknown on either
    side: not comparable."""
    if run is None or measured is None:
        return False
    if run.parameters and measured.parameters:
        ratio = run.parameters / measured.parameters
        if 1 / COMPARABLE_FACTOR <= ratio <= COMPARABLE_FACTOR:
            return True
    widths = (run.hidden_size, run.intermediate_size)
    return all(widths) and widths == (measured.hidden_size, measured.intermediate_size)


def table_key(fmt: str, lora: bool) -> str:
    return f"{fmt}+lora" if lora else fmt


def key_entries(measurements: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The entries of one GPU's ``key`` (``nvfp4+lora``): each ``{"model": {...}, backend: {concurrency:
    tokens/s}, ...}``. A key measured on one model holds one entry (a mapping), on several a list of them
    (what :func:`merge_tables` writes)."""
    value = (measurements or {}).get(key)
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list):
        return [e for e in value if isinstance(e, dict)]
    return []


def entry_backends(entry: dict[str, Any]) -> dict[str, dict[str, float]]:
    """An entry's ``{backend: {concurrency: tokens/s}}``, without its model."""
    return {b: points for b, points in entry.items() if b != MODEL_FIELD and isinstance(points, dict)}


def entry_model(entry: dict[str, Any]) -> MeasuredModel | None:
    return MeasuredModel.from_dict(entry.get(MODEL_FIELD))


def load_table(path: str | Path | None = None) -> dict[str, Any]:
    """A crossover table: ``{"gpus": {GPU name: {"nvfp4+lora": {"model": {name, parameters, hidden_size,
    intermediate_size, layers}, backend: {concurrency: tok/s}}}}}`` (a key measured on several models:
    a list of such entries).

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
    GPU, format, model, backend and concurrency win; measurements of another model are kept beside
    (the key then holds a list of entries, one per model)."""
    merged: dict[str, Any] = {"gpus": {}}
    for table in tables:
        for gpu, measurements in table.get("gpus", {}).items():
            into_gpu = merged["gpus"].setdefault(gpu, {})
            for key in measurements:
                entries = into_gpu.setdefault(key, [])
                for entry in key_entries(measurements, key):
                    model = entry_model(entry)
                    target = next((e for e in entries if entry_model(e) == model), None)
                    if target is None:
                        target = {MODEL_FIELD: model.to_dict()} if model is not None else {}
                        entries.append(target)
                    for backend, points in entry_backends(entry).items():
                        target.setdefault(backend, {}).update(points)
        if "measured" in table:
            measured = table["measured"]
            merged.setdefault("measured", []).extend(measured if isinstance(measured, list) else [measured])
    for measurements in merged["gpus"].values():
        for key, entries in measurements.items():
            measurements[key] = entries[0] if len(entries) == 1 else entries
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
                + (f"; quantize the base to {' or '.join(map(str.upper, formats.fp4_names()))} for the FP4 "
                   "backends" if fmt in NOT_FP4_FORMATS else ""))  # fmt: skip
    if backend == "humming":
        if not env.humming_installed:
            return 'needs the humming-kernels package: pip install "qerl[humming]"'
        if env.vllm_version is not None and env.vllm_version < HUMMING_VLLM:
            have = ".".join(map(str, env.vllm_version))
            return (f"needs vLLM {HUMMING_VLLM[0]}.{HUMMING_VLLM[1]}+ (linear_backend='humming'); this is "
                    f"vLLM {have}: pip install -U \"qerl[vllm]\"")  # fmt: skip
    fp8_weights = rollout_weight_format(backend, fmt) == "fp8"
    if fp8_weights and env.capability is not None and env.capability < FP8_MIN_CAPABILITY:
        return (f"needs FP8 tensor cores (compute capability 8.9+, Ada or Hopper); this GPU is "
                f"sm{env.capability[0]}{env.capability[1]}")  # fmt: skip
    return None


def format_merge(backend: str, fmt: str) -> str:
    """A merge backend named for a base of the other kind, as this base's merge (``merged`` for a BF16
    base, ``fp8-merged`` for a 4-bit one); any other backend unchanged."""
    if backend not in MERGED_BACKENDS:
        return backend
    return DENSE_MERGED if fmt == formats.DENSE else FP8_MERGED


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
        requested = format_merge(requested, fmt)
        if requested in ("marlin", "humming") and fmt in NOT_FP4_FORMATS:
            return BackendChoice(default, fmt, f"{requested} serves FP4 weights only: a {fmt} base keeps "
                                 f"vLLM's default", concurrency)  # fmt: skip
        reason = unavailable_reason(requested, fmt, env)
        if reason is not None:
            raise QerlError(f"rollout.linear_backend={requested}: {reason}")
        _check_fits(requested, fmt, weight_bytes, env)
        return BackendChoice(requested, fmt, "pinned by rollout.linear_backend", concurrency)

    what = f"{fmt}{' + LoRA' if lora else ''} on {env.gpu_name or 'this GPU'}"
    entries = key_entries(gpu_entry(table, env.gpu_name), table_key(fmt, lora))
    measured, source, why_not = _pick_entry(entries, model, unknown_model_ok, what)
    candidates: dict[str, float | None] = {}
    passed_over: dict[str, float] = {}  # FP8 copies auto may not choose (fp8_ok off), as predicted
    for backend in FORMAT_BACKENDS.get(fmt, ("default",)):
        if unavailable_reason(backend, fmt, env) is not None or backend not in measured:
            continue
        if backend in MERGED_BACKENDS and not (merge_ok and lora):
            continue
        fits = sequences_that_fit((weight_bytes or {}).get(backend, 0), env) if weight_bytes else None
        if fits == 0:
            continue
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


def _pick_entry(
    entries: list[dict[str, Any]], model: MeasuredModel | None, unknown_model_ok: bool, what: str
) -> tuple[dict[str, dict[str, float]], str | None, str | None]:
    """(``{backend: points}`` of the entry measured on the model closest to ``model`` among the comparable
    ones, where it came from, why none was taken)."""
    known = [(e, m) for e in entries if (m := entry_model(e)) is not None]
    fitting = [(e, m) for e, m in known if comparable_models(model, m)]
    if fitting:

        def distance(pair: tuple[dict[str, Any], MeasuredModel]) -> float:
            theirs = pair[1].parameters
            mine = model.parameters if model else None
            return abs(math.log(mine / theirs)) if mine and theirs else 0.0

        entry, measured_on = min(fitting, key=distance)
        return entry_backends(entry), f"measured on {measured_on.label()}", None
    unnamed = [e for e in entries if entry_model(e) is None]
    if unnamed and unknown_model_ok:
        return entry_backends(unnamed[-1]), "measured on a model the table does not name", None
    if known:
        on = "; ".join(m.label() for _, m in known)
        this = model.label() if model is not None else "a model of unknown size"
        return {}, None, (
            f"the crossover measurements for {what} are of {on}, not comparable to this model ({this}); "
            f"auto uses those of a model within {COMPARABLE_FACTOR:g}x of its parameter count or of the same "
            "hidden and MLP widths (measure this one with qerl bench --concurrency and point "
            "rollout.crossover_table at its crossover.json)"
        )  # fmt: skip
    if unnamed:
        return {}, None, (
            f"the crossover measurements for {what} do not name the model they were measured on (a table "
            "written before entries named theirs); only a table the recipe names itself "
            "(rollout.crossover_table) is used without one"
        )  # fmt: skip
    return {}, None, None


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

"""The crossover table ``rollout.linear_backend: auto`` reads: rollout tokens/s per GPU, format (with
or without LoRA), linear backend and concurrency, each entry naming the model it was measured on
(``qerl bench --concurrency`` writes one as ``crossover.json``; :mod:`qerl_cli.rollout.backends`
chooses from it).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.modeling.model_shape import ModelShape
from qerl_cli.torch_utils import parameter_count

SHIPPED_TABLE = Path(__file__).with_name("crossover.json")  # measured by qerl bench --concurrency
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
        size = f"{parameter_count(self.parameters)} parameters" if self.parameters else None
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
    """The table's measurements for ``gpu_name``: an exact name, else one contained in it (a table
    keyed by the short model name serves every variant of it)."""
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


def pick_entry(
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

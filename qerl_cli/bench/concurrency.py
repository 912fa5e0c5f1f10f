"""``qerl bench --concurrency 8,32,128,256``: rollout tokens/s per format x linear backend x LoRA at
the concurrency RL runs, each figure against the GPU's roofline, and the crossover table that
``rollout.linear_backend: auto`` reads (``crossover.json``).

A vLLM engine is started per (format, backend): BF16 on its own GEMMs (and on vLLM's online FP8 when
``fp8`` is among the backends), a 4-bit base on each of Marlin, Humming and its FP8 rollout copy
(:mod:`qerl_cli.rollout.backends`). Every engine serves its without- and with-LoRA cases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qerl_cli.bench.labels import lora_label
from qerl_cli.bench.result import BenchResult
from qerl_cli.bench.roofline import decode_bound, fractions, gpu_spec
from qerl_cli.modeling.model_shape import ModelShape
from qerl_cli.rollout.backends import (
    FORMAT_BACKENDS,
    MERGED_BACKENDS,
    MODEL_FIELD,
    MeasuredModel,
    format_merge,
    rollout_weight_format,
    table_key,
)

CROSSOVER_FILE = "crossover.json"
ROOFLINE_COLUMNS = ("format", "backend", "LoRA", "sequences", "output tok/s", "bound tok/s", "of bandwidth",
                    "of tensor cores", "limited by")  # fmt: skip


def backends_for(fmt: str, requested: list[str]) -> list[str]:
    """The backends a ``fmt`` base is measured on: those of ``requested`` it has (a merge name as this
    base's merge: ``fp8-merged`` and ``merged`` both measure it once); BF16 and NF4 always on their
    default kernels too."""
    allowed = FORMAT_BACKENDS.get(fmt, ("default",))
    chosen = list(dict.fromkeys(b for b in (format_merge(r, fmt) for r in requested) if b in allowed))
    if "default" in allowed:
        chosen = ["default", *[b for b in chosen if b != "default"]]
    return chosen or [allowed[0]]


def add_roofline(report: BenchResult, model_configs: dict[str, dict[str, Any]]) -> None:
    """``roofline`` on every rollout row: its bounds on this GPU and the fractions measured."""
    spec = gpu_spec((report.gpu or {}).get("name"))
    settings = report.settings
    for row in report.rollout:
        config = model_configs.get(row["format"])
        if spec is None or config is None:
            row["roofline"] = None  # a CPU run or a GPU the table does not know: no bound to state
            continue
        bound = decode_bound(
            ModelShape.from_config(config), spec,
            weight_format=rollout_weight_format(row.get("backend", "default"), row["format"]),
            concurrency=row["batch"], prompt_len=settings["prompt_len"], gen_len=settings["gen_len"],
            # A merged backend serves the adapter inside the weights: no LoRA bytes to read.
            lora_rank=0 if row.get("backend") in MERGED_BACKENDS else row["lora_rank"],
        )  # fmt: skip
        row["roofline"] = {**bound, **fractions(row["output_tokens_per_s"], bound)}


def crossover_table(report: BenchResult, model: MeasuredModel | None = None) -> dict[str, Any]:
    """``{"gpus": {GPU: {"nvfp4+lora": {"model": {...}, backend: {concurrency: tokens/s}}}}}`` from the
    rollout rows, each entry naming the ``model`` it was measured on (``rollout.linear_backend: auto``
    uses it only for a model of comparable size), with where it came from."""
    gpu = (report.gpu or {}).get("name") or "cpu"
    entry: dict[str, dict[str, Any]] = {}
    for row in report.rollout:
        key = table_key(row["format"], bool(row["lora_rank"]))
        backend = row.get("backend", "default")
        if key not in entry and model is not None:
            entry[key] = {MODEL_FIELD: model.to_dict()}
        points = entry.setdefault(key, {}).setdefault(backend, {})
        points[str(row["batch"])] = round(row["output_tokens_per_s"], 1)
    settings = report.settings
    return {
        "gpus": {gpu: entry},
        "measured": {"created": report.created, "model": settings.get("model"),
                     "prompt_len": settings.get("prompt_len"), "gen_len": settings.get("gen_len"),
                     "lora_rank": settings.get("lora_rank"), "versions": report.versions},
    }  # fmt: skip


def measured_model(name: str | None, config: dict[str, Any]) -> MeasuredModel | None:
    """What a sweep's table entries name: the benchmarked model's label and size (every format's
    checkpoint is of the same model)."""
    return MeasuredModel.from_config(config, name=name)


def write_crossover(report: BenchResult, out_dir: str | Path, model: MeasuredModel | None = None) -> Path:
    path = Path(out_dir) / CROSSOVER_FILE
    path.write_text(json.dumps(crossover_table(report, model), indent=2))
    return path


def roofline_rows(report: BenchResult) -> list[tuple[str, ...]]:
    rows = []
    for r in report.rollout:
        roof = r.get("roofline")
        if not roof:
            continue
        rows.append((r["format"], r.get("backend", "default"), lora_label(r["lora_rank"]), str(r["batch"]),
                     f"{r['output_tokens_per_s']:.0f}", f"{roof['bound_tokens_per_s']:.0f}",
                     f"{roof['of_bandwidth_bound']:.0%}", f"{roof['of_compute_bound']:.0%}",
                     roof["limited_by"]))  # fmt: skip
    return rows

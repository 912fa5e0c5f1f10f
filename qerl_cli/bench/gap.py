"""``qerl bench gap``: the rollout/trainer logprob gap of each rollout linear backend, teacher-forced on
the same token sequences, side by side.

Between two training runs the sampled completions and the policies drift apart, so the
``rollout_logprob_gap`` they log compares backends only roughly. Here every backend scores exactly the
same token ids: the trainer side (:mod:`~qerl_cli.bench.gap_trainer`) builds the recipe's policy, writes
the adapter, samples one completion per prompt with the transformers engine and takes the trainer's
logprobs; then each backend (:mod:`~qerl_cli.bench.gap_worker`; a vLLM one in a child process of its
own) scores the sequences with its engine; the figures and the verdict are
:mod:`~qerl_cli.bench.gap_report`'s. Writes ``sequences.json`` and ``trainer_logprobs.json`` first, each
backend's logprobs in ``logprobs/BACKEND.json``, then ``gap.json`` and ``gap.md``.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qerl_cli.bench.gap_report import (
    MARKDOWN_NAME,
    REPORT_NAME,
    SCHEMA,
    GapReport,
    build_ratios,
    build_rows,
    gap_markdown,
)
from qerl_cli.bench.gap_settings import GapSettings
from qerl_cli.bench.gap_trainer import SEQUENCES_FILE, TrainerSide, gap_train_config, prepare_trainer_side
from qerl_cli.bench.gap_worker import (
    HF_BACKEND,
    BackendSpec,
    error_result,
    measure_in_process,
    measure_isolated,
)
from qerl_cli.bench.header import report_header, write_report
from qerl_cli.bench.progress import Progress
from qerl_cli.bench.settings import report_settings
from qerl_cli.config import TrainConfig
from qerl_cli.config.loading import to_dict
from qerl_cli.errors import install_hint
from qerl_cli.files import atomic_write_text, write_json
from qerl_cli.torch_utils import free_accelerator_memory

LOGPROBS_DIR = "logprobs"


def backend_unavailable(backend: str) -> str | None:
    """Why a vLLM backend cannot run on this machine before a child process is spent on it (None: try)."""
    if backend == HF_BACKEND:
        return None
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed ({install_hint('vllm')}, on a GPU machine)"
    import torch

    if not torch.cuda.is_available():
        return "vLLM needs a CUDA GPU and none is visible"
    return None


def measure(spec: BackendSpec) -> dict[str, Any]:
    """One backend's result: ``hf`` in this process, a vLLM backend in a child process."""
    why = backend_unavailable(spec.backend)
    if why is not None:
        return error_result(spec, why)
    if spec.backend == HF_BACKEND:
        result = measure_in_process(spec)
        free_accelerator_memory()  # its model's cached blocks, before a vLLM engine measures free memory
        return result
    return measure_isolated(spec)


def trainer_figures(cfg: TrainConfig, side: TrainerSide) -> dict[str, Any]:
    """The report's ``trainer`` section: the model, the sequences and what the trainer side resolved."""
    lengths = [len(s.completion_ids) for s in side.sequences]
    finishes = [s.finish_reason for s in side.sequences]
    return {
        "model": cfg.model.path,
        "base_format": side.base_format,
        "dtype": cfg.model.dtype,
        "lora": {
            "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha,
            "target_modules": list(cfg.lora.target_modules),
        },
        "adapter_dir": side.adapter_dir,
        "gpu_memory_utilization": side.gpu_memory_utilization,
        "sequences": len(side.sequences),
        "tokens": sum(lengths),
        "completion_tokens_max": max(lengths),
        "stopped": sum(f == "stop" for f in finishes),
        "seconds": side.seconds,
    }


def run_gap(
    settings: GapSettings,
    recipe: TrainConfig,
    *,
    command: str,
    measure_backend: Callable[[BackendSpec], dict[str, Any]] = measure,
) -> GapReport:
    """The whole benchmark; writes its files in ``settings.output`` and returns the report.
    ``measure_backend``: how one backend's result is had (tests stand the HF engine in for vLLM)."""
    out = Path(settings.output)
    out.mkdir(parents=True, exist_ok=True)
    cfg = gap_train_config(recipe, settings)
    progress = Progress("bench gap", 1 + len(settings.backends))
    report = GapReport(report_header(SCHEMA, command), report_settings(settings), {})
    progress.start("trainer: sequences and logprobs")
    side = prepare_trainer_side(cfg, settings, out)
    report.trainer = trainer_figures(cfg, side)
    progress.finish("trainer: sequences and logprobs", f"{report.trainer['tokens']} completion tokens")
    results: list[dict[str, Any]] = []
    for backend in settings.backends:
        progress.start(backend)
        spec = BackendSpec(backend, to_dict(cfg), str(out / SEQUENCES_FILE), side.adapter_dir,
                           side.gpu_memory_utilization, str(out / "engines" / backend))  # fmt: skip
        result = measure_backend(spec)
        if "logprobs" in result:
            write_json(
                out / LOGPROBS_DIR / f"{backend}.json", {"backend": backend, "logprobs": result["logprobs"]}
            )
        results.append(result)
        progress.finish(backend, f"failed: {result['error']}" if "error" in result else "done")
        report.rows = build_rows(results, side.trainer_logprobs)
        write_report(out / REPORT_NAME, report.to_dict())  # a run cut short keeps the backends done
    report.ratios = build_ratios(report.rows, settings.margin, settings.seed)
    write_report(out / REPORT_NAME, report.to_dict())
    atomic_write_text(out / MARKDOWN_NAME, gap_markdown(report))
    return report


def read_gap_report(path: str | Path) -> GapReport:
    """A written ``gap.json`` (a folder holding one will do)."""
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_NAME
    return GapReport.from_dict(json.loads(path.read_text()))

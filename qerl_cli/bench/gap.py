"""``qerl bench gap``: the rollout/trainer logprob gap of each rollout linear backend, teacher-forced on
the same token sequences, side by side.

Between two training runs the sampled completions and the policies drift apart, so the
``rollout_logprob_gap`` they log compares backends only roughly. Here every backend scores exactly the
same token ids: the trainer side (:mod:`~qerl_cli.bench.gap_trainer`) builds the recipe's policy, writes
the adapter, samples one completion per prompt with training's transformers engine and sampling, takes the
trainer's logprobs and (``hf``) that engine's; then each vLLM backend (:mod:`~qerl_cli.bench.gap_worker`,
in a child process of its own) scores the sequences with its engine; the figures and the verdict are
:mod:`~qerl_cli.bench.gap_report`'s. Every side scores at temperature 1 (the completions are sampled at the
recipe's). Writes ``sequences.json``, ``trainer_logprobs.json`` and ``adapter/`` first, ``gap.json``
after the trainer side and again after each backend (a run cut short keeps the backends done), each
backend's logprobs in ``logprobs/BACKEND.json`` (a vLLM backend's engine files under ``engines/``), then
``gap.md``; a reused folder's files of an earlier gap run are removed first. The folder is made only once
the prompts are chosen, and a run that fails before its trainer side is done leaves no file of its own
(nor the folder, when it made it). Paths are recorded as given (``trainer.model``, ``adapter_dir``), as
every bench records them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from qerl_cli.bench.gap_report import (
    MARKDOWN_NAME,
    REPORT_NAME,
    SCHEMA,
    BackendResult,
    GapReport,
    TrainerFigures,
    build_ratios,
    build_rows,
    gap_markdown,
)
from qerl_cli.bench.gap_settings import HF_BACKEND, GapSettings
from qerl_cli.bench.gap_trainer import (
    ADAPTER_DIR,
    SEQUENCES_FILE,
    TRAINER_FILE,
    TrainerSide,
    chosen_prompts,
    gap_train_config,
    prepare_trainer_side,
)
from qerl_cli.bench.gap_worker import BackendSpec, error_result, measure_isolated
from qerl_cli.bench.header import report_header, write_report
from qerl_cli.bench.preflight import VLLM_EXTRA, gpu_available, vllm_available
from qerl_cli.bench.progress import Progress
from qerl_cli.bench.settings import report_settings
from qerl_cli.config import TrainConfig
from qerl_cli.config.loading import to_dict
from qerl_cli.errors import Checked, QerlError
from qerl_cli.files import atomic_write_text, remove_path, write_json
from qerl_cli.modeling.run_layout import is_run_folder
from qerl_cli.rl.run_folder import missing_folders, remove_if_empty

LOGPROBS_DIR = "logprobs"
ENGINES_DIR = "engines"
# What a gap run writes in its folder: an earlier run's are removed first (the folder may hold others').
log = logging.getLogger(__name__)
GAP_OUTPUTS = (
    REPORT_NAME,
    MARKDOWN_NAME,
    SEQUENCES_FILE,
    TRAINER_FILE,
    LOGPROBS_DIR,
    ADAPTER_DIR,
    ENGINES_DIR,
)


def backend_unavailable(backend: str) -> str | None:
    """Why a vLLM backend cannot run on this machine before a child process is spent on it (None: try)."""
    if not vllm_available():
        return f"vLLM is not installed ({VLLM_EXTRA}, on a GPU machine)"
    if not gpu_available():
        return "vLLM needs a CUDA GPU and none is visible"
    return None


def measure(spec: BackendSpec) -> BackendResult:
    """One vLLM backend's result, in a child process (``hf`` is the trainer side's). The command refused
    a backend that cannot run here before work (:func:`check_backends`); :func:`run_gap` called on its
    own skips that check, so an error row here still spares it the child process."""
    why = backend_unavailable(spec.backend)
    if why is not None:
        return error_result(spec, why)
    return measure_isolated(spec)


Chosen = tuple[list[str], list[str]]  # chosen_prompts: (problem ids, rendered prompts)


def check_inputs(
    recipe: TrainConfig, settings: GapSettings, device_key: str = "train.device"
) -> tuple[list[Checked], Chosen]:
    """What the run would refuse, checked without loading the model: each vLLM backend's package and GPU
    (:func:`check_backends`), then what ``qerl train``'s checks before work (:mod:`qerl_cli.rl.preflight`)
    would refuse on the recipe as the benchmark runs it: the device a device name (and a GPU where it
    names one; ``device_key``: how the user gave it, for the message), ``model.path`` there, the data
    reachable and holding ``--sequences`` prompts (the tokenizer renders them), the output folder. Run
    before the dry run's listing and before the run's folder is made; each input is listed once."""
    from qerl_cli.rl import preflight
    from qerl_cli.torch_utils import resolve_device

    cfg = gap_train_config(recipe, settings)
    checks = [check_backends(settings)]  # first: the trainer side takes minutes before a backend runs
    device = resolve_device(cfg.train.device, device_key)
    checks += [Checked(device_key, f"{cfg.train.device} -> {device}"), preflight.model_source(cfg)]
    checks.append(preflight.dataset(cfg))
    chosen = chosen_prompts(cfg, settings.sequences)
    checks.append(Checked("--sequences", f"{settings.sequences}: the recipe's data has as many prompts"))
    checks.append(check_output_folder(Path(settings.output)))
    return checks, chosen


def check_backends(settings: GapSettings) -> Checked:
    """Every vLLM backend asked for can run here: without vLLM or a GPU each would fail after the trainer
    side's sampling and scoring, so the run would spend minutes and end without a figure of theirs."""
    names = vllm_backends(settings)
    if not names:
        return Checked("--backends", "hf: the trainer side's transformers engine, no vLLM needed")
    why = backend_unavailable(names[0])  # the same for every vLLM backend: vLLM and a GPU
    if why is not None:
        raise QerlError(
            f"--backends {', '.join(names)} cannot run on this machine: {why}. Give --backends hf to "
            "measure the transformers engine alone here, or run them on a GPU machine with vLLM installed"
        )
    return Checked("--backends", f"{', '.join(names)}: vLLM installed, a GPU visible")


def is_gap_report(path: Path) -> bool:
    """Whether ``path`` is a ``gap.json`` an earlier ``qerl bench gap`` run wrote."""
    try:
        return str(json.loads(path.read_text()).get("schema", "")).startswith("qerl-bench-gap/")
    except (OSError, ValueError, AttributeError):
        return False


def check_output_folder(out: Path) -> Checked:
    """``-o`` may hold an earlier gap run, whose files the run replaces, but no other files of the names
    it writes: a ``qerl train`` run's folder holds the run's trained ``adapter/``. That it can be written
    :func:`~qerl_cli.bench.preflight.check_output` has checked before: this line says both, once."""
    if is_run_folder(out):
        raise QerlError(
            f"-o {out} is a qerl train run's folder: bench gap writes {ADAPTER_DIR}/ there and would replace "
            "the run's adapter; give a folder of its own"
        )
    held = [name for name in GAP_OUTPUTS if (out / name).exists() or (out / name).is_symlink()]
    if held and not is_gap_report(out / REPORT_NAME):
        raise QerlError(
            f"-o {out} holds {', '.join(held)} of no bench gap run (no {REPORT_NAME} of one): the run would "
            "replace them; give a folder of its own or move them"
        )
    found = "holding an earlier gap run's files, to be replaced" if held else "free of other runs' files"
    return Checked("--output", f"{out}: a folder that can be written, {found}")


def trainer_figures(cfg: TrainConfig, side: TrainerSide, settings: GapSettings) -> TrainerFigures:
    """The report's ``trainer`` section: the model, the sequences and what the trainer side resolved
    (vLLM's share of the GPU only where a vLLM backend runs: null for ``hf`` alone)."""
    lengths = [len(s.completion_ids) for s in side.sequences]
    finishes = [s.finish_reason for s in side.sequences]
    lora = {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "target_modules": list(cfg.lora.target_modules)}
    return TrainerFigures(
        model=cfg.model.path,
        base_format=side.base_format,
        dtype=cfg.model.dtype,
        lora=lora,
        adapter_dir=side.adapter_dir,
        gpu_memory_utilization=side.gpu_memory_utilization if vllm_backends(settings) else None,
        sequences=len(side.sequences),
        tokens=sum(lengths),
        completion_tokens_max=max(lengths),
        stopped=sum(f == "stop" for f in finishes),
        seconds=side.seconds,
        sample_temperature=cfg.rollout.temperature,
        sample_top_p=cfg.rollout.top_p,
    )


def vllm_backends(settings: GapSettings) -> list[str]:
    return [b for b in settings.backends if b != HF_BACKEND]


def clear_earlier_run(out: Path) -> None:
    """Remove what an earlier gap run wrote in ``out`` (stale logprobs, adapter, report), nothing else;
    :func:`check_output_folder` refused a folder whose files of those names are not a gap run's."""
    for name in GAP_OUTPUTS:
        remove_path(out / name)


def run_gap(
    settings: GapSettings,
    recipe: TrainConfig,
    *,
    command: str,
    chosen: Chosen | None = None,
    measure_backend: Callable[[BackendSpec], BackendResult] = measure,
) -> GapReport:
    """The whole benchmark; writes its files in ``settings.output`` and returns the report.
    ``measure_backend``: how a vLLM backend's result is had (tests stand the HF engine in for vLLM)."""
    out = Path(settings.output)
    cfg = gap_train_config(recipe, settings)
    if chosen is None:  # check_inputs took them: before the folder is made, too few fails at once
        chosen = chosen_prompts(cfg, settings.sequences)
    progress = Progress("bench gap", 1 + len(settings.backends))
    report = GapReport(report_header(SCHEMA, command), report_settings(settings), TrainerFigures())
    progress.start("trainer: sequences and logprobs")
    check_output_folder(out)  # again, right before anything in it is replaced
    made = missing_folders(out)
    out.mkdir(parents=True, exist_ok=True)
    clear_earlier_run(out)
    try:
        side = prepare_trainer_side(cfg, settings, out, chosen)
    except BaseException:  # an error or Ctrl-C: no adapter/ alone, no empty folder left behind
        try:
            clear_earlier_run(out)
            remove_if_empty(made)
        except OSError:  # the failure that got here is the one to report
            log.warning("bench gap: could not remove the partial run in %s", out, exc_info=True)
        raise
    report.trainer = trainer_figures(cfg, side, settings)
    write_report(out / REPORT_NAME, report.to_dict())
    progress.finish("trainer: sequences and logprobs", f"{report.trainer.tokens} completion tokens")
    results: list[BackendResult] = []
    for backend in settings.backends:
        progress.start(backend)
        spec = BackendSpec(backend, to_dict(cfg), str(out / SEQUENCES_FILE), side.adapter_dir,
                           side.gpu_memory_utilization, str(out / ENGINES_DIR / backend))  # fmt: skip
        result = side.hf if backend == HF_BACKEND and side.hf is not None else measure_backend(spec)
        if result.logprobs is not None:
            write_json(
                out / LOGPROBS_DIR / f"{backend}.json", {"backend": backend, "logprobs": result.logprobs}
            )
        results.append(result)
        report.rows = build_rows(results, side.trainer_logprobs)
        error = report.rows[-1].error
        progress.finish(backend, f"failed: {error}" if error is not None else "done")
        write_report(out / REPORT_NAME, report.to_dict())  # a run cut short keeps the backends done
    report.ratios = build_ratios(report.rows, settings.margin, settings.seed)
    write_report(out / REPORT_NAME, report.to_dict())
    atomic_write_text(out / MARKDOWN_NAME, gap_markdown(report))
    return report


def written_files(out: Path) -> list[str]:
    """What this run wrote in ``out`` (folders with a slash), for the line under the table."""
    return [str(out / name) + "/" * (out / name).is_dir() for name in GAP_OUTPUTS if (out / name).exists()]


def read_gap_report(path: str | Path) -> GapReport:
    """A written ``gap.json`` (a folder holding one will do)."""
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_NAME
    return GapReport.from_dict(json.loads(path.read_text()))

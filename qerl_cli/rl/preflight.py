"""What `qerl train` checks before it loads anything: the cheap questions whose answer would otherwise
come after 40 s of model loading (an unreachable dataset, a missing vLLM) or after minutes of work (an
output folder that cannot be written). ``qerl train --dry-run`` runs exactly these and says what each
found.

Each check raises the QerlError that names what is wrong and what to do; :func:`preflight` returns
what was checked, in order, for ``--dry-run`` to print.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from qerl_cli.config import TrainConfig
from qerl_cli.data.datasets import check_reachable
from qerl_cli.errors import Checked, QerlError, install_hint
from qerl_cli.files import check_writable_folder
from qerl_cli.modeling.model_shape import ModelShape
from qerl_cli.modeling.source_checks import missing_model_hint, model_source_found
from qerl_cli.modeling.sources import resolve_model_source
from qerl_cli.rewards.grading import require_math_verify
from qerl_cli.rl.checkpoint import find_last_checkpoint
from qerl_cli.rl.run_folder import check_fresh_start, run_entries
from qerl_cli.torch_utils import cpu_seconds, estimated_duration, parameter_count, resolve_device


def preflight(cfg: TrainConfig, *, resume: str | None, overwrite: bool) -> list[Checked]:
    """Every cheap check of a training run, in the order its costs would come; nothing is written."""

    checked = [output_folder(cfg.output.dir, resume=resume, overwrite=overwrite)]
    if resume is not None:
        checked.append(resume_checkpoint(resume))
    device = resolve_device(cfg.train.device, "train.device")  # a GPU where the config names one
    checked.append(Checked("train.device", f"{cfg.train.device} -> {device}"))
    checked.append(model_source(cfg))
    checked.append(dataset(cfg))
    checked.append(engine(cfg))
    checked.append(grader())
    return checked


def output_folder(out_dir: str | Path, *, resume: str | None, overwrite: bool) -> Checked:
    """``output.dir`` can be made and written (checked on it or on the nearest folder above that
    exists: nothing is created here), and holds no other run unless ``--resume`` or ``--overwrite``."""
    out = Path(out_dir)
    if not check_writable_folder(out, "output.dir", "choose another with --set output.dir=DIR"):
        return Checked("output.dir", f"{out}: a new folder (made when the run starts)")
    if resume is not None:
        return Checked("output.dir", f"{out}: writable; --resume continues the run there")
    if overwrite and run_entries(out):
        return Checked("output.dir", f"{out}: holds a run, which --overwrite deletes when the run starts")
    check_fresh_start(out, overwrite=False)  # refuses a folder holding a run
    return Checked("output.dir", f"{out}: writable, holds no run")


def resume_checkpoint(resume: str | Path) -> Checked:
    """The checkpoint ``--resume`` continues from, found and verified now: a folder that is not there, or
    holds no complete checkpoint, would otherwise be found only once the model has loaded."""
    return Checked("--resume", f"{find_last_checkpoint(resume)}: verifies")


def model_source(cfg: TrainConfig) -> Checked:
    path = cfg.model.path
    found = model_source_found(
        path,
        what="model.path",
        trust_remote_code=cfg.model.trust_remote_code,
        hint=missing_model_hint(path, cfg.model.format),
    )
    return Checked("model.path", found)


def dataset(cfg: TrainConfig) -> Checked:
    return Checked("data.dataset", check_reachable(cfg.data.dataset))


def engine(cfg: TrainConfig) -> Checked:
    """The rollout engine's package is importable, and vLLM has a GPU (found without importing it)."""
    name = cfg.rollout.engine
    if name != "vllm":
        return Checked("rollout.engine", f"{name}: built in")
    if importlib.util.find_spec("vllm") is None:
        raise QerlError(
            f"rollout.engine=vllm needs vLLM, which is not installed: {install_hint('vllm')} (GPU "
            "machines), or use the HF engine with --set rollout.engine=hf"
        )

    if not torch.cuda.is_available():
        raise QerlError(
            "rollout.engine=vllm needs a CUDA GPU and this machine has none: use the HF engine with "
            "--set rollout.engine=hf"
        )
    return Checked("rollout.engine", "vllm: installed, GPU visible")


def grader() -> Checked:
    require_math_verify()
    return Checked("reward grader", "math-verify installed")


def model_parameters(path: str) -> tuple[int, bool] | None:
    """(parameter count, whether 4-bit) from a local model folder's config.json; None for a Hub id or
    a config qerl cannot size (then no estimate is said)."""

    config_file = Path(resolve_model_source(path)) / "config.json"
    try:
        config = json.loads(config_file.read_text())
        return ModelShape.from_config(config).parameters(), bool(config.get("quantization_config"))
    except (OSError, ValueError, QerlError):
        return None


def cpu_estimate(cfg: TrainConfig) -> str | None:
    """What a CPU run of ``cfg`` should take, from its configuration (steps x prompts x generations x
    tokens on the model's parameters; ``torch_utils.cpu_seconds``), labelled as an estimate."""

    sized = model_parameters(cfg.model.path)
    if sized is None:
        return None
    params, four_bit = sized
    completions = cfg.train.prompts_per_step * cfg.rollout.num_generations
    prompt, answer = cfg.rollout.max_prompt_length, cfg.rollout.max_completion_length
    trained = completions * (prompt + answer) * cfg.algorithm.num_iterations
    step = cpu_seconds(
        params,
        forward_tokens=completions * prompt + trained,
        decode_tokens=completions * answer,
        backward_tokens=trained,
        four_bit=four_bit,
    )

    steps, prompts, generations = cfg.train.max_steps, cfg.train.prompts_per_step, cfg.rollout.num_generations
    run = f"{steps} step{'s' * (steps != 1)}"
    return (
        f"estimate on this CPU ({torch.get_num_threads()} threads): {estimated_duration(step)} a step at "
        f"most, {estimated_duration(step * steps)} for {run} ({prompts} prompts x {generations} completions "
        f"of up to {answer} tokens on {parameter_count(params)} parameters; worked out from the "
        "configuration, it may be off 2x either way: the step lines show the real pace)"
    )

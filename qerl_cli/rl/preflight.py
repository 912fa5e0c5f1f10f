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
from qerl_cli.data.prompts import template_found
from qerl_cli.errors import Checked, QerlError, install_hint
from qerl_cli.files import check_writable_folder
from qerl_cli.formats.fp8 import cuda_capability
from qerl_cli.modeling.base_compute import check_fp8_device
from qerl_cli.modeling.error_init import find_lora_init
from qerl_cli.modeling.fused_kernels import check_liger
from qerl_cli.modeling.loading import check_declared_format, folder_format
from qerl_cli.modeling.model_shape import ModelShape
from qerl_cli.modeling.source_checks import missing_model_hint, model_source_found
from qerl_cli.modeling.sources import gguf_source, resolve_model_source
from qerl_cli.rewards.grading import require_math_verify
from qerl_cli.rewards.reward_fn import EXTRA_SIGNATURE, resolve_extra_reward
from qerl_cli.rl.checkpoint import check_within_max_steps, checkpoint_step, find_last_checkpoint
from qerl_cli.rl.run_folder import check_fresh_start, check_resume_target, run_entries
from qerl_cli.rollout import backends, vllm_nvfp4
from qerl_cli.rollout.environment import installed_vllm_version
from qerl_cli.rollout.vllm_setup import vllm_in_process
from qerl_cli.torch_utils import cpu_seconds, estimated_duration, parameter_count, resolve_device


def preflight(cfg: TrainConfig, *, resume: str | None, overwrite: bool) -> list[Checked]:
    """Every cheap check of a training run, in the order its costs would come; nothing is written."""

    checked = [output_folder(cfg.output.dir, resume=resume, overwrite=overwrite)]
    if resume is not None:
        checked.append(resume_checkpoint(resume, cfg))
    else:  # a run already there continues where it is
        output_apart_from_model(cfg)
    device = resolve_device(cfg.train.device, "train.device")  # a GPU where the config names one
    checked.append(Checked("train.device", f"{cfg.train.device} -> {device}"))
    checked.append(model_source(cfg))
    # Settings that would fail only once the model has loaded: said only when asked for.
    checked.extend(c for c in (lora_init(cfg), fused_kernels(cfg), base_compute(cfg, device)) if c)
    checked.append(Checked("data.template", template_found(cfg.data.template, "data.template")))
    checked.append(dataset(cfg))
    checked.append(engine(cfg))
    checked.append(grader())
    if cfg.reward.extra:
        checked.append(extra_rewards(cfg))
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


def output_apart_from_model(cfg: TrainConfig) -> None:
    """A new run's ``output.dir`` is not the folder of ``model.path`` nor inside it, as ``qerl quantize``
    refuses its input model's folder for its output: the run's files would be mixed into the model's."""
    model = Path(cfg.model.path).expanduser()
    if not cfg.model.path or not model.is_dir():
        return
    out, model = Path(cfg.output.dir).expanduser().resolve(), model.resolve()
    if out.is_relative_to(model):
        where = "the folder of" if out == model else "inside the folder of"
        raise QerlError(
            f"output.dir {cfg.output.dir} is {where} model.path {cfg.model.path}: the run's adapter/, "
            "checkpoints and metrics would be mixed into the model's files (and replacing the model, as "
            "qerl quantize --overwrite does, would delete them); nothing was written. Train into a folder of "
            "its own with --set output.dir=DIR"
        )


def resume_checkpoint(resume: str | Path, cfg: TrainConfig) -> Checked:
    """The checkpoint ``--resume`` continues from, found and verified now: a folder that is not there,
    holds no complete checkpoint, is another run's than ``output.dir``'s or is past ``train.max_steps``
    would otherwise be found only once the model has loaded."""
    found = find_last_checkpoint(resume)
    check_resume_target(resume, cfg.output.dir)
    check_within_max_steps(found, checkpoint_step(found), cfg.train.max_steps)
    return Checked("--resume", f"{found}: verifies")


def model_source(cfg: TrainConfig) -> Checked:
    """``model.path`` is there (a folder, Hub id, GGUF file or alias) and, where its config.json can be
    read, holds the format ``model.format`` names: a mismatch was otherwise found once the weights had
    loaded (and, for vLLM, after its start-up)."""
    path = cfg.model.path
    found = model_source_found(
        path,
        what="model.path",
        trust_remote_code=cfg.model.trust_remote_code,
        hint=missing_model_hint(path, cfg.model.format),
    )
    held = check_declared_format(cfg.model.format, path)
    return Checked("model.path", found if held is None else f"{found}; its config.json says {held}")


def declared_format(cfg: TrainConfig) -> str | None:
    """The base's format (bf16, nvfp4, ...) as model.format or the folder's config.json says it; None
    where it cannot be known before the model loads (a Hub id, a config qerl cannot read). A GGUF file
    loads as a BF16 model."""
    if cfg.model.format != "auto":
        return cfg.model.format
    if gguf_source(cfg.model.path) is not None:
        return "bf16"
    return folder_format(cfg.model.path)


def lora_init(cfg: TrainConfig) -> Checked | None:
    """``lora.init`` eora / svd: the start `qerl quantize --lora-init` wrote beside the base is there.
    A GGUF base is converted when it loads, so its folder is looked in then."""
    if cfg.lora.init == "zeros":
        return None
    if gguf_source(cfg.model.path) is not None:
        return Checked("lora.init", f"{cfg.lora.init}: looked for beside the GGUF model once it is converted")
    folder, info = find_lora_init(cfg.lora.init, cfg.lora.rank, cfg.model.path, cfg.model.path,
                                  declared_format(cfg) or "nvfp4")  # fmt: skip
    return Checked("lora.init", f"{folder}: a {info.method} start of rank {info.rank}")


def fused_kernels(cfg: TrainConfig) -> Checked | None:
    """``train.fused_kernels=liger``: liger-kernel is installed (found without importing it)."""
    if cfg.train.fused_kernels != "liger":
        return None
    check_liger(cfg.train.fused_kernels)
    return Checked(
        "train.fused_kernels", "liger: liger-kernel installed (the model's family is checked when it loads)"
    )


def base_compute(cfg: TrainConfig, device: torch.device) -> Checked | None:
    """``train.base_compute=fp8`` on a 4-bit base: training runs on a GPU with FP8 tensor cores. The
    layer sizes it needs are checked when the model loads; a BF16 base computes in BF16 anyway."""
    if cfg.train.base_compute != "fp8":
        return None
    fmt = declared_format(cfg)
    if fmt is None:
        return Checked(
            "train.base_compute", "fp8: checked when the model loads (its format is not known before)"
        )
    if fmt == "bf16":
        return Checked("train.base_compute", "fp8: the base is BF16, which computes in BF16")
    where = check_fp8_device(cuda_capability(device))
    return Checked("train.base_compute", f"fp8: a {fmt} base on {where}, which has FP8 tensor cores")


def dataset(cfg: TrainConfig) -> Checked:
    """The problems can come, and a local file's rows have the fields the recipe reads them by."""
    fields = (cfg.data.prompt_field, cfg.data.answer_field)
    return Checked("data.dataset", check_reachable(cfg.data.dataset, fields=fields))


def engine(cfg: TrainConfig) -> Checked:
    """The rollout engine's package is importable, and vLLM has a GPU (found without importing it)."""
    name = cfg.rollout.engine
    if name != "vllm":
        return Checked("rollout.engine", f"{name}: built in")
    if importlib.util.find_spec("vllm") is None:
        raise QerlError(
            f"rollout.engine=vllm needs vLLM, which is not installed: {install_hint('vllm')} (GPU "
            f"machines), or use the HF engine with {cfg.rollout.hf_engine_settings()}"
        )

    if not torch.cuda.is_available():
        raise QerlError(
            "rollout.engine=vllm needs a CUDA GPU and this machine has none: use the HF engine with "
            f"{cfg.rollout.hf_engine_settings()}"
        )
    if cfg.rollout.linear_backend == vllm_nvfp4.BACKEND:  # its needs, before the trainer's model loads
        fmt = declared_format(cfg)
        dtype = cfg.rollout.vllm_kwargs.get("dtype", cfg.model.dtype)  # the recipe's vLLM arguments win
        env = backends.Environment(  # the GPU's capability alone: the choice's other inputs do not apply
            gpu_name=None,
            capability=cuda_capability(torch.device("cuda")),
            humming_installed=False,
            vllm_version=installed_vllm_version(),
            tensor_parallel_size=cfg.rollout.tensor_parallel_size,
            engine_in_process=vllm_in_process(before_import=True),
            rollout_dtype=dtype,
        )
        # As the engine asks it for the base's format (an MXFP4 base refused); a base without FP4 weights
        # keeps vLLM's default there, and one whose format is known only once loaded (a Hub id) is asked
        # when the engine starts.
        if fmt is None:
            return Checked("rollout.engine", "vllm: installed, GPU visible (qerl-triton: checked when the "
                           "engine starts, the base's format being known only once loaded)")  # fmt: skip
        if fmt in backends.NOT_FP4_FORMATS:
            return Checked("rollout.engine", f"vllm: installed, GPU visible (qerl-triton serves FP4 weights "
                           f"only: this {fmt} base keeps vLLM's default)")  # fmt: skip
        reason = backends.unavailable_reason(vllm_nvfp4.BACKEND, fmt, env)
        if reason is not None:
            raise QerlError(f"rollout.linear_backend={vllm_nvfp4.BACKEND}: {reason}")
        # The recipe's vLLM arguments as the engine will pass them (they win over qerl's).
        vllm_nvfp4.check_engine_arguments(
            {"linear_backend": vllm_nvfp4.VLLM_BACKEND, **cfg.rollout.vllm_kwargs, "dtype": dtype}
        )
    return Checked("rollout.engine", "vllm: installed, GPU visible")


def grader() -> Checked:
    require_math_verify()
    return Checked("reward grader", "math-verify installed")


def extra_rewards(cfg: TrainConfig) -> Checked:
    """Each ``reward.extra`` function imports and takes the reward's call, ``fn(completion, problem)``, as
    the run's reward function will need once the model has loaded (a typo there cost the load; a wrong
    signature, the load and the first rollout)."""
    for path in cfg.reward.extra:
        try:
            resolve_extra_reward(path)
        except QerlError as exc:
            raise QerlError(f"reward.extra: {exc}") from None
    return Checked(
        "reward.extra", f"{', '.join(cfg.reward.extra)}: importable, callable as {EXTRA_SIGNATURE}"
    )


def model_parameters(path: str) -> tuple[int, bool] | None:
    """(parameter count, whether 4-bit) from a local model folder's config.json; None for a Hub id or
    a config qerl cannot size (then no estimate is said)."""

    config_file = Path(resolve_model_source(path)) / "config.json"
    try:
        config = json.loads(config_file.read_text())
        return ModelShape.from_config(config).parameters(), bool(config.get("quantization_config"))
    except (OSError, ValueError, QerlError):
        return None


def cpu_estimate(cfg: TrainConfig, done: int = 0) -> str | None:
    """What a CPU run of ``cfg`` should take, from its configuration (steps x prompts x generations x
    tokens on the model's parameters; ``torch_utils.cpu_seconds``), labelled as an estimate. ``done``: the
    steps a resumed run has behind it (its checkpoint's), which it does not train again."""

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
    steps = max(steps - done, 0)
    run = f"{steps} step{'s' * (steps != 1)}" + (f" (resumed after step {done})" if done else "")
    return (
        f"estimate on this CPU ({torch.get_num_threads()} threads): {estimated_duration(step)} a step at "
        f"most, {estimated_duration(step * steps)} for {run} ({prompts} prompts x {generations} completions "
        f"of up to {answer} tokens on {parameter_count(params)} parameters; worked out from the "
        "configuration, it may be off 2x either way: the step lines show the real pace)"
    )

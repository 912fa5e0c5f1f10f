"""What a benchmark needs, checked before its first measurement: the engine's package and a GPU, each
format's and linear backend's packages, numbers that mean something, a writable output folder.

A GPU runner without vLLM used to measure the tiny model on the transformers engine and pass CI with
figures that say nothing about rollouts; a runner without bitsandbytes spent minutes on BF16 before the
NF4 cases failed. Each check here raises :class:`~qerl_cli.errors.QerlError` (exit 2) naming what is
missing and the extra that installs it, before any checkpoint is written or any engine started.

Importing this module imports no torch: the GPU probe (:func:`gpu_available`) imports it when asked.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl_cli import files
from qerl_cli.errors import Checked, QerlError, closest, install_hint

VLLM_EXTRA = install_hint("vllm")


@dataclass(frozen=True)
class Requirement:
    """A Python package a case needs, and the qerl extra (pyproject) that installs it."""

    module: str  # the import name
    extra: str  # qerl's optional-dependency group
    why: str  # what needs it, for the message

    def missing(self) -> bool:
        return not package_available(self.module)

    def message(self) -> str:
        return (
            f"{self.why} needs the {self.module} package, which is not installed: {install_hint(self.extra)}"
        )


def package_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def vllm_available() -> bool:
    """Whether vLLM is installed (the availability helper every bench path asks)."""
    return package_available("vllm")


def gpu_available() -> bool:
    """Whether a CUDA GPU is visible (the GPU probe every bench path asks; imports torch)."""
    import torch

    return torch.cuda.is_available()


def resolve_engine(engine: str, device: str = "auto") -> str:
    """``--engine`` resolved: ``hf`` as asked; ``vllm`` needs a GPU and vLLM; ``auto`` is vLLM on a GPU
    and the transformers engine on a CPU (``--device cpu`` asks for the CPU on any machine).

    On a GPU without vLLM, ``auto`` is refused: the transformers engine's figures on a GPU say nothing
    about rollouts (a CI runner missing the extra would pass with meaningless numbers). ``--engine hf``
    measures it on purpose."""
    check_device(device)  # "cpux" would pass for the CPU below, "gpu" fail after the checkpoints
    if device.startswith("cpu"):
        if engine == "vllm":
            raise QerlError("--engine vllm needs a GPU, and --device cpu runs on the CPU: leave one out")
        return "hf"
    gpu = gpu_available()
    if device.startswith("cuda") and not gpu:
        raise QerlError(
            f"--device {device} needs a GPU (CUDA) and none is visible; use --device cpu (or leave it out)"
        )
    if engine == "hf":
        return "hf"
    if engine == "vllm" and not gpu:
        raise QerlError("--engine vllm needs a CUDA GPU and none is visible; use --engine hf here")
    if engine == "auto" and not gpu:
        return "hf"
    if not vllm_available():
        raise QerlError(
            "a GPU is visible but vLLM is not installed, so the rollout figures would be the transformers "
            f"engine's, which say nothing about rollouts on this GPU: {VLLM_EXTRA} (or give --engine hf to "
            "measure the transformers engine on purpose)"
        )
    return "vllm"


def engine_found(asked: str, engine: str, device: str) -> str:
    """What ``--engine`` came to (:func:`resolve_engine` has checked it) and why, for a dry run's list."""
    if engine == "vllm":
        why = "vLLM installed, a GPU visible"
    elif asked == "hf":
        why = "the transformers engine, as asked"
    else:
        why = "--device cpu" if device.startswith("cpu") else "no GPU visible"
    return f"{asked} -> {engine} ({why})" if asked != engine else f"{engine} ({why})"


def requirements_found(names: list[str], requirements: list[Requirement]) -> str:
    """The packages ``names`` (formats or backends) need, found installed by :func:`check_requirements`."""
    packages = sorted({r.module for r in requirements})
    needs = f"{', '.join(packages)} installed" if packages else "no optional package needed"
    return f"{', '.join(names)}: {needs}"


def format_requirements(engine: str, formats: list[str]) -> list[Requirement]:
    """The packages the formats need on ``engine``: vLLM serves NF4 through bitsandbytes (the format
    registry's ``vllm_quantization``); qerl's own layers (the transformers engine, the trainer) need
    none."""
    if engine != "vllm":
        return []
    from qerl_cli import formats as registry

    needs = []
    for name in formats:
        if name in registry.FORMATS and registry.get(name).vllm_quantization == "bitsandbytes":
            needs.append(Requirement("bitsandbytes", "nf4", f"the {name} case on vLLM"))
    return needs


def backend_requirements(engine: str, formats: list[str], backends: list[str]) -> list[Requirement]:
    """The packages the linear backends of a ``--concurrency`` sweep (or of ``e2e``'s
    ``--linear-backend``) need for these formats."""
    if engine != "vllm":
        return []
    from qerl_cli.bench.concurrency import backends_for

    if any("humming" in backends_for(fmt, backends) for fmt in formats):
        return [Requirement("humming", "humming", "the humming linear backend")]
    return []


def check_requirements(requirements: list[Requirement]) -> None:
    """Refuse, naming every missing package and its extra, before any work."""
    missing = list(dict.fromkeys(r.message() for r in requirements if r.missing()))
    if missing:
        raise QerlError("; ".join(missing) + " (or leave that case out)")


def check_tolerance(tolerance: float, flag: str = "--tolerance") -> None:
    if not tolerance >= 0:  # also refuses NaN
        raise QerlError(f"{flag} is a fraction >= 0 (0.1: 10% regression allowed), got {tolerance}")


def check_output(path: str | Path, flag: str = "--output") -> None:
    """The output folder can be made and written (its nearest existing parent is writable)."""
    files.check_writable_folder(path, flag, "give a folder you can write to")


def check_device(device: str, setting: str = "--device") -> None:
    """Refuse a device name no stage runs on (``gpu``, ``cpux``), naming the setting and the accepted
    names, before any work; the resolver's own rule (:func:`qerl_cli.torch_utils.parse_device`)."""
    from qerl_cli.torch_utils import parse_device  # imports torch: not at this module's import

    parse_device(device, setting)


def check_tool(
    output: str, device: str, model: str | None, gpu_only: str | None = None, device_flag: str | None = None
) -> list[Checked]:
    """What a benchmark with its own report can check before any work (--dry-run included): the output
    folder, the device's name where ``device_flag`` names the flag it came from (None: the caller checks
    it under its own name), a GPU where ``--device cuda`` (or ``gpu_only``, a flag) asks for one, the
    model (None: none of its own). Returns what each found, for ``--dry-run`` to list as every stage's
    dry run does."""
    check_output(output)
    if device_flag is not None:
        check_device(device, device_flag)
    if gpu_only and device.startswith("cpu"):
        raise QerlError(f"{gpu_only} needs a GPU, and --device {device} runs on the CPU: leave one out")
    if (device.startswith("cuda") or gpu_only) and not gpu_available():
        what = gpu_only or f"--device {device}"
        raise QerlError(f"{what} needs a GPU (CUDA) and none is visible; use --device cpu (or leave it out)")
    checks = [
        Checked("--output", f"{output}: a folder that can be written"),
        Checked("--device", device_found(device)),
    ]
    if model is not None:
        checks.append(Checked("--model", describe_model(model)))
    return checks


def device_found(device: str) -> str:
    """What ``--device`` comes to here (a GPU was checked to be visible where it asks for one)."""
    if device.startswith("cuda"):
        return f"{device}, a GPU visible"
    if device == "auto":
        return f"auto -> {'cuda' if gpu_available() else 'cpu'}"
    return device


def describe_model(model: str, formats: list[str] | None = None) -> str:
    """How the bench will get ``model`` (checked without reading its weights or downloading it); a
    local folder's checkpoint format must serve ``formats``."""
    from qerl_cli.bench.models import MODEL_CHOICES, check_folder_formats, is_shape
    from qerl_cli.modeling.source_checks import check_model_config
    from qerl_cli.modeling.sources import GGUF_SUFFIX

    if is_shape(model):
        return f"{model.lower()} (a random-weight shape, written once per format into the cache)"
    path = Path(model).expanduser()
    if path.is_dir():
        check_model_config(path, "--model", MODEL_CHOICES)  # a run's or adapter's folder is named so
        own = check_folder_formats(model, path, formats) if formats else None
        return f"{path} (a local {own or 'model'} folder)"
    if path.is_file():
        if path.suffix.lower() == GGUF_SUFFIX:  # resolve_model_source converts it at the start
            return f"{path} (a GGUF file, converted to a model folder at the start)"
        raise files.file_given_for_folder(model, "--model", MODEL_CHOICES)
    if model.startswith((".", "/", "~")):
        raise QerlError(f"--model {model}: no such folder; give {MODEL_CHOICES}")
    return f"{model} ({_hub_id_or_alias(model)})"


def _hub_id_or_alias(model: str) -> str:
    """A --model that is no folder and no shape: a hub id in the cache or on a reachable Hub, or an alias
    on this machine (a GGUF file), else refused now, naming the shape meant (``qwen2.5-7``)."""
    from qerl_cli.bench.models import shape_names
    from qerl_cli.modeling.source_checks import looks_like_hub_id, model_source_found

    hint = ""
    if not looks_like_hub_id(model):
        close = closest(model, shape_names())
        guess = f"did you mean the shape {close}? " if close else ""
        hint = f"{guess}the shapes: {', '.join(shape_names())}"
    return model_source_found(model, what="--model", hint=hint).partition(": ")[2]


def summary(items: dict[str, Any]) -> list[str]:
    """``key: value`` lines of a plan, each value in words (:func:`plan_value`); None: no line."""
    return [f"{key}: {plan_value(value)}" for key, value in items.items() if value is not None]


def plan_value(value: Any) -> str:
    """A plan's value as a reader writes it: a list as its items with commas (not ``['a', 'b']``), a
    flag as on or off (not ``True``)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)

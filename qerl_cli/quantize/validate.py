"""Checks on `qerl quantize` input that must fail fast, before any model is loaded or written.

Every failure is a :class:`~qerl_cli.errors.QerlError` whose message names the bad value and says
what to do about it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import torch

from qerl_cli import formats
from qerl_cli.config.choices import QuantMethod
from qerl_cli.errors import QerlError
from qerl_cli.files import TargetExistsError, file_given_for_folder, staged_folder
from qerl_cli.modeling.error_init import INIT_DIR
from qerl_cli.modeling.loading import QUANT_RECORD
from qerl_cli.modeling.sources import resolve_model_source
from qerl_cli.modeling.work_folders import check_not_other_work, check_replaceable_model

# gptq: second-order error-compensating rounding (llm-compressor's GPTQModifier); awq: activation-aware
# smoothing scales, then round to nearest; rtn: round to nearest, no calibration. The config's alias is
# their one list.
SUPPORTED_METHODS = get_args(QuantMethod)
# Layers never quantized: the output head is kept in BF16, as in the paper and llm-compressor's examples.
ALWAYS_IGNORED = ("lm_head",)


def check_format(name: str) -> str:
    """The registered 4-bit format ``name`` names (any case), else the registry's error listing them."""
    return formats.get(name).name


def check_method(name: str) -> str:
    key = name.strip().lower()
    if key not in SUPPORTED_METHODS:
        raise QerlError(
            f"unknown method {name!r}: choose gptq (error-compensating rounding), awq (calibrated "
            "smoothing scales) or rtn (round to nearest, no calibration)"
        )
    return key


def check_method_for_format(method: str, fmt: str) -> None:
    """NF4 is rounded by qerl's own code (bitsandbytes' code book), for which llm-compressor has no
    GPTQ scheme."""
    if fmt == "nf4" and method == "gptq":
        raise QerlError("--method gptq has no NF4 scheme (llm-compressor): use --method awq or rtn for nf4")


@dataclass(frozen=True)
class ModelSource:
    """Where the BF16 model comes from: ``ref`` is what ``from_pretrained`` gets."""

    ref: str
    name: str  # last path component, used for the default output folder
    is_local: bool


def _looks_like_path(text: str) -> bool:
    # A hub id is "name" or "org/name"; anything with a leading ./, /, ~ or several slashes is a path.
    return text.startswith((".", "/", "~")) or text.count("/") > 1 or os.sep != "/" and os.sep in text


def resolve_model(model: str, revision: str | None = None, trust_remote_code: bool = False) -> ModelSource:
    """A local folder with ``config.json``, or a hub id whose config the Hub serves.

    Only the config is fetched here, so a typo or an unreachable Hub fails in seconds, not after a
    multi-gigabyte download.
    """
    if not model:
        raise QerlError("no model given: pass a hub id (e.g. Qwen/Qwen2.5-7B-Instruct) or a local folder")

    model = resolve_model_source(model)  # a .gguf file, a folder with one, or an alias: converted BF16
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QerlError(f"{path} has no config.json: pass a model folder saved by transformers")
        return ModelSource(ref=str(path), name=path.resolve().name, is_local=True)
    if path.exists() or _looks_like_path(model):
        raise QerlError(f"model folder {model!r} not found: check the path")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:  # OSError, HTTP and offline errors all mean "cannot get it from here"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QerlError(
            f"model {model!r} is not a local folder and the Hugging Face Hub could not provide it "
            f"({reason}). Check the id, or, if the Hub is unreachable from this machine (offline, "
            "firewall, HF_HUB_OFFLINE=1), download the model elsewhere and pass its local folder."
        ) from None
    return ModelSource(ref=model, name=model.rstrip("/").rsplit("/", 1)[-1], is_local=False)


def default_output(source: ModelSource, fmt: str) -> Path:
    """``./<model-name>-<FORMAT>``, e.g. ``./Qwen2.5-7B-Instruct-NVFP4``."""
    return Path.cwd() / f"{source.name}-{fmt.upper()}"


def check_output(output: Path, source: ModelSource, overwrite: bool) -> Path:
    output = output.expanduser()
    target = output.resolve()
    if source.is_local:
        model_dir = Path(source.ref).resolve()
        if target == model_dir:
            raise QerlError(f"output {output} is the input model folder: choose another --output")
        # --overwrite removes the old output folder, and with it everything inside it.
        if target in model_dir.parents:
            raise QerlError(
                f"output {output} contains the input model {source.ref}: replacing it would delete the "
                "model; choose another --output"
            )
    if target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise QerlError(
            f"output {output} is the current folder or one above it; replacing it would delete your "
            "working folder: choose a new sub-folder as --output"
        )
    if output.exists() and not output.is_dir():
        raise file_given_for_folder(output, "output", "another --output, or remove the file")
    if output.exists():
        # First: --overwrite is no remedy for a folder of other work.
        check_not_other_work(output, "output", "give a new sub-folder as --output")
        if overwrite:  # the whole folder is replaced: only a model's files, and this writer's, may go
            written = {QUANT_RECORD, INIT_DIR}
            check_replaceable_model(output, "output", written, "give a new sub-folder as --output")
        else:
            raise QerlError(
                f"output folder {output} already exists: pass --overwrite to replace it, or give another "
                "--output"
            )
    return output  # a parent folder not there yet is made, as train and eval make theirs


def incompatible_layers(model: torch.nn.Module, block_size: int) -> list[str]:
    """Linear layers (other than the ignored ones) whose input width is not a multiple of the block."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and name.rsplit(".", 1)[-1] not in ALWAYS_IGNORED
        and module.in_features % block_size
    ]


def check_layers(model: torch.nn.Module, fmt: str, block_size: int, skip_incompatible: bool) -> list[str]:
    """Names of layers to leave in BF16; raises when some do not fit and skipping was not asked for."""
    bad = incompatible_layers(model, block_size)
    if bad and not skip_incompatible:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise QerlError(
            f"{len(bad)} layer(s) have an input width that is not a multiple of the {fmt} block size "
            f"{block_size}: {shown}. Pass --skip-incompatible to leave them in BF16."
        )
    return bad


def quantized_linear_names(model: torch.nn.Module, skipped: list[str]) -> list[str]:
    """The linear layers that will be stored in 4 bits."""
    skip = set(skipped)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and name.rsplit(".", 1)[-1] not in ALWAYS_IGNORED
        and name not in skip
    ]


@contextmanager
def staged_output(output: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``output``, on failure it is removed
    (``files.staged_folder``). An existing output (allowed by ``overwrite``) is removed only once the
    new one is complete; one that appears meanwhile without ``overwrite`` is refused."""
    try:
        with staged_folder(output, existing="replace" if overwrite else "refuse") as staging:
            yield staging
    except TargetExistsError as exc:  # created by someone else while we worked
        raise QerlError(
            f"output folder {output} appeared while quantizing: pass --overwrite to replace it"
        ) from exc

"""Resolve ``--model`` and ``--engine`` into one local checkpoint folder per format.

* A SHAPE name (``qwen2.5-0.5b`` ... ``qwen2.5-72b``, ``tiny``) needs no download: a random-weight
  checkpoint of that shape is written directly in each format (packed, no calibration: quantizing
  random weights measures nothing but time) into a cache folder and reused by later runs.
* A local folder or a hub id is used as is for its own format. A BF16 model asked for in 4-bit
  formats is quantized with round-to-nearest (``qerl quantize --method rtn``: speed and memory do
  not depend on calibration) into the cache. A folder that is already 4-bit serves its own format
  only.

Default with no ``--model``: ``qwen2.5-7b`` with vLLM on a GPU, ``tiny`` with the HF engine elsewhere.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from huggingface_hub import snapshot_download

from qerl_cli import formats as format_registry
from qerl_cli.config import QuantizeConfig
from qerl_cli.errors import QerlError
from qerl_cli.files import file_given_for_folder, write_folder_once
from qerl_cli.modeling.random_checkpoint import SHAPES, write_random_checkpoint
from qerl_cli.modeling.source_checks import check_model_config
from qerl_cli.modeling.sources import (
    cache_root,  # noqa: F401 - re-exported for bench
    resolve_model_source,
)
from qerl_cli.modeling.tiny import build_tokenizer
from qerl_cli.quantize import run_quantize
from qerl_cli.rollout.vllm_setup import detect_checkpoint_format

GPU_DEFAULT_MODEL = "qwen2.5-7b"
CPU_DEFAULT_MODEL = "tiny"

# What --model takes (bench's messages about it end with it, here and in bench.preflight).
MODEL_CHOICES = "a model folder, a hub id or a shape name"


def shape_names() -> list[str]:
    return list(SHAPES)


def is_shape(name: str) -> bool:
    return name.lower() in shape_names()


def default_model(engine: str) -> str:
    return GPU_DEFAULT_MODEL if engine == "vllm" else CPU_DEFAULT_MODEL


def normalize_formats(formats: list[str]) -> list[str]:
    """Lower-case, de-duplicated, known format names, in the order given."""
    seen: list[str] = []
    for name in (f.strip().lower() for f in formats):
        format_registry.check_names([name], dense=True, option="--formats")
        if name not in seen:
            seen.append(name)
    if not seen:
        raise QerlError(f"--formats is empty; give some of {', '.join(format_registry.model_names())}")
    return seen


def benchable_format(folder: Path) -> str:
    """bf16 / nvfp4 / mxfp4 / nf4 from a checkpoint's ``quantization_config``; a quantization the bench
    does not time is refused (unlike ``modeling.loading.folder_format``, which answers None for it)."""

    found = detect_checkpoint_format(folder).name
    if found == "other":
        raise QerlError(
            f"{folder} holds a quantization qerl does not benchmark; give a BF16, NVFP4, MXFP4 or NF4 model"
        )
    return found


def shape_tokenizer() -> Path:
    """A tokenizer folder for the real-size shapes: qerl's byte-level tiny tokenizer.

    Random weights make any tokenizer as good as Qwen's for timing (cost depends on token counts,
    not on which tokens), and this one needs no download. Ids the model generates beyond its 259
    tokens decode to nothing, in transformers and in vLLM's detokenizer alike.
    """

    target = cache_root() / "bench" / "tokenizer"
    return write_folder_once(target, lambda tmp: _save_tokenizer(build_tokenizer(), tmp))


def _save_tokenizer(tokenizer, folder: Path) -> None:
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text("{}")  # AutoTokenizer looks for a config beside the tokenizer


def shape_checkpoint_path(shape: str, fmt: str, seed: int = 0) -> Path:
    """Where :func:`shape_checkpoint` keeps ``shape`` in ``fmt`` (written or not)."""
    return cache_root() / "bench" / shape.lower() / f"{fmt}-seed{seed}"


def shape_checkpoint(shape: str, fmt: str, seed: int = 0) -> Path:
    """The cached random-weight checkpoint of ``shape`` in ``fmt`` (written on first use)."""

    name = shape.lower()
    tokenizer_from = None if name == "tiny" else shape_tokenizer()  # tiny gets its own from the writer
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random 32B weights: minutes on CPU

    def write(tmp: Path) -> None:
        write_random_checkpoint(tmp, name, fmt, seed=seed, device=device, tokenizer_from=tokenizer_from)

    return write_folder_once(shape_checkpoint_path(name, fmt, seed), write)


def _local_folder(model: str) -> Path:
    path = Path(resolve_model_source(model)).expanduser()
    if path.is_dir():
        check_model_config(path, "--model", MODEL_CHOICES)  # a run's or adapter's folder is named so
        return path
    if path.is_file():  # a .gguf file resolved to its converted folder above
        raise file_given_for_folder(model, "--model", MODEL_CHOICES)
    if path.exists() or model.startswith((".", "/", "~")):
        raise QerlError(f"--model {model}: no such folder; give {MODEL_CHOICES}")
    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as exc:  # noqa: BLE001 - any hub failure becomes one user-facing message
        raise QerlError(
            f"--model {model} is neither a folder, nor a shape ({', '.join(shape_names())}), "
            f"nor a reachable hub id: {exc}"
        ) from None


def _rtn_checkpoint(source: Path, fmt: str) -> Path:
    digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    target = cache_root() / "bench" / "rtn" / f"{source.name}-{digest}" / fmt

    def write(tmp: Path) -> None:
        config = QuantizeConfig(model=str(source), format=fmt, method="rtn", output=str(tmp), overwrite=True)
        run_quantize(config)

    return write_folder_once(target, write)


def check_folder_formats(model: str, folder: Path, formats: list[str]) -> str:
    """The format of the checkpoint in ``folder``; a 4-bit one serves its own format only (a BF16 one
    is quantized to the others)."""
    own = benchable_format(folder)
    others = [f for f in formats if f != own]
    if own != "bf16" and others:
        raise QerlError(
            f"{model} is already a {own} checkpoint, so only --formats {own} can be measured from it "
            f"(not {', '.join(others)}); give the BF16 model to compare formats"
        )
    return own


def prepare_checkpoints(model: str, formats: list[str], seed: int = 0) -> dict[str, Path]:
    """{format: local folder} for every requested format."""
    if is_shape(model):
        return {fmt: shape_checkpoint(model, fmt, seed) for fmt in formats}
    folder = _local_folder(model)
    own = check_folder_formats(model, folder, formats)
    if own != "bf16":
        return {own: folder}
    return {fmt: folder if fmt == "bf16" else _rtn_checkpoint(folder, fmt) for fmt in formats}


def model_label(model: str) -> str:
    """How the report names the model (a folder's name, a shape or a hub id)."""
    return model.lower() if is_shape(model) else model


def describe_source(model: str) -> str:
    if is_shape(model):
        return "shape (random weights, written in each format)"
    return "folder" if Path(model).expanduser().is_dir() else "hub"


def model_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())

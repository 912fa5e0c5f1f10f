"""The PEFT LoRA adapter folder: the one module that reads, checks and writes it.

A folder holds ``adapter_config.json`` (PEFT's ``LoraConfig``) and ``adapter_model.safetensors``
(the LoRA matrices, and trained norms when ``lora.train_norms`` is on). Training writes it
(:func:`save_peft_model`), evaluation and the HF engine load it into a base (:func:`attach_to_base`,
:func:`load_weights`), the vLLM engine stages a copy (:func:`copy_folder`) after checking that vLLM
can serve it (:func:`check_servable`), and the bench writes a random one from shapes alone
(:func:`write_tensors`). Pickle weights (``adapter_model.bin``) are never loaded.
"""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.files import file_given_for_folder, honour_umask
from qerl_cli.modeling.lora import attach_lora
from qerl_cli.modeling.run_layout import ADAPTER_DIR, checkpoint_folders

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_WEIGHTS = "adapter_model.bin"
# Where a missing adapter folder is to be found (`qerl train` writes OUTPUT/adapter, OUTPUT being output.dir).
WHERE_ADAPTERS_ARE = (
    "give the adapter folder of a `qerl train` run, OUTPUT/adapter where OUTPUT is its recipe's output.dir "
    "(`qerl train tiny` writes runs/tiny/adapter; `qerl train RECIPE --dry-run` prints output.dir), or a "
    "checkpoint's OUTPUT/checkpoint-N/adapter"
)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
def check_folder(path: str | Path, what: str = "--adapter") -> Path:
    """A PEFT LoRA adapter folder (config + safetensors weights) as a Path, or a QerlError."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise QerlError(f"{what} {path}: no such folder; {WHERE_ADAPTERS_ARE}")
    if not folder.is_dir():
        raise file_given_for_folder(path, what, "the adapter folder (e.g. OUTPUT/adapter)")
    if not (folder / ADAPTER_CONFIG).is_file():
        # A training run's folder given for its adapter: name the adapter inside it.
        inner = run_adapter(folder) or checkpoint_adapter(folder)
        hint = f"; it holds a run's adapter: {what} {shlex.quote(str(inner))}" if inner is not None else ""
        raise QerlError(f"{what} {path} is not a PEFT adapter folder (no {ADAPTER_CONFIG}){hint}")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        pickle = (folder / PICKLE_WEIGHTS).is_file()
        raise QerlError(
            f"{what} {path} has no {ADAPTER_WEIGHTS}"
            + (f" (only a pickle {PICKLE_WEIGHTS}, which qerl does not load)" if pickle else "")
        )
    return folder


def is_adapter_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a PEFT adapter's config (the weights are :func:`check_folder`'s to judge)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def _has_weights(folder: Path) -> bool:
    """Whether ``folder`` holds a whole adapter, config and weights: one a run was killed while writing
    (its config alone) is no adapter to point a user to."""
    return is_adapter_folder(folder) and (folder / ADAPTER_WEIGHTS).is_file()


def run_adapter(folder: str | Path) -> Path | None:
    """The trained adapter a `qerl train` run's folder holds (``OUTPUT/adapter``), None where it has none."""
    inner = Path(folder) / ADAPTER_DIR
    return inner if _has_weights(inner) else None


def checkpoint_adapter(folder: str | Path) -> Path | None:
    """The adapter of the newest checkpoint in a `qerl train` run's folder (``OUTPUT/checkpoint-N/adapter``),
    None where none holds one: what a run stopped before its final adapter has trained."""
    for _, checkpoint in reversed(checkpoint_folders(folder)):
        if _has_weights(checkpoint / ADAPTER_DIR):
            return checkpoint / ADAPTER_DIR
    return None


def base_model(folder: str | Path) -> str | None:
    """The base model an adapter folder records (PEFT's ``base_model_name_or_path``), None if none."""
    try:
        return json.loads((Path(folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or None
    except (OSError, ValueError, AttributeError):  # unreadable: the adapter's own checks say so later
        return None


def check_servable(folder: str | Path, *, enable_lora: bool, max_lora_rank: int) -> None:
    """Raise QerlError unless vLLM (started with ``enable_lora`` / ``max_lora_rank``) can serve it.

    vLLM serves LoRA matrices only: an adapter that also trains full modules (norms) would be
    served without them, so rollouts would silently come from a stale policy.
    """
    if not enable_lora:
        raise QerlError(
            "this vLLM engine was started without LoRA (enable_lora=False); it cannot serve an adapter"
        )
    folder = Path(folder)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise QerlError(
            f"{folder} is not a PEFT adapter folder: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
            "(save with save_pretrained(..., safe_serialization=True))"
        )
    config = read_config(folder)
    rank = int(config.get("r", 0))
    if rank > max_lora_rank:
        raise QerlError(
            f"the adapter has rank {rank} but vLLM was started with max_lora_rank={max_lora_rank}; "
            f"set rollout.max_lora_rank >= lora.rank ({rank})"
        )
    norm_keys = [k for k in weight_names(folder) if "norm" in k]
    if config.get("modules_to_save") or norm_keys:
        raise QerlError(
            f"the adapter in {folder} also trains full modules "
            f"({config.get('modules_to_save') or norm_keys[:3]}); vLLM serves LoRA matrices only, so "
            "rollouts would use stale weights. Set lora.train_norms=false or use rollout.engine=hf"
        )


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def read_config(folder: str | Path, what: str = "--adapter") -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` as a dict."""
    config_file = Path(folder) / ADAPTER_CONFIG
    if not config_file.is_file():
        raise QerlError(f"{what} {folder} is not a PEFT adapter folder (no {ADAPTER_CONFIG})")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise QerlError(f"{config_file} is not valid JSON ({exc}); re-save the adapter") from exc


def rank(folder: str | Path | None) -> int | None:
    """The largest LoRA rank in the adapter (``r`` or a ``rank_pattern`` entry); None for no adapter."""
    if not folder:
        return None
    config = read_config(folder)
    ranks = [int(config.get("r") or 0), *(int(v) for v in (config.get("rank_pattern") or {}).values())]
    return max(ranks) or None


def target_modules(config: Mapping[str, Any]) -> list[str] | str:
    """The config's target modules: a sorted list, or PEFT's regex string as given."""
    targets = config.get("target_modules") or []
    return sorted(targets) if isinstance(targets, list | set | tuple) else targets


def weights_file(folder: str | Path) -> Path:
    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise QerlError(f"{folder} holds no {ADAPTER_WEIGHTS}; pass a PEFT adapter folder")
    return path


def weight_names(folder: str | Path) -> list[str]:
    """The tensor names in the adapter's weights, read from the header only."""
    with safe_open(str(weights_file(folder)), framework="pt") as handle:
        return list(handle.keys())  # noqa: SIM118 (a safetensors handle is not a dict)


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:

    return load_file(str(weights_file(folder)))


# --------------------------------------------------------------------------------------------
# Loading into a model
# --------------------------------------------------------------------------------------------
def load_weights(model: nn.Module, folder: str | Path) -> None:
    """Load a saved adapter's weights into a PEFT model's active adapter (safetensors only)."""
    from peft import set_peft_model_state_dict

    tensors = read_weights(folder)
    if not hasattr(model, "peft_config"):
        raise QerlError(
            "the rollout model has no LoRA adapter to load weights into; build it with an adapter"
        )
    result = set_peft_model_state_dict(model, tensors)
    unexpected = list(getattr(result, "unexpected_keys", None) or [])
    missing = [k for k in getattr(result, "missing_keys", None) or [] if "lora_" in k]
    if unexpected or missing:
        raise QerlError(
            f"adapter {folder} does not match the model (unexpected keys {unexpected[:3]}, missing LoRA "
            f"keys {missing[:3]}): was it trained on another base or with other lora settings?"
        )


def attach_to_base(model: nn.Module, folder: str | Path) -> Any:
    """Wrap a base model (QuantLinear or nn.Linear layers) with the saved LoRA adapter.

    PEFT's own ``PeftModel.from_pretrained`` does not know QuantLinear, so the LoRA layers are
    created by qerl's ``attach_lora`` from the adapter's config and the weights loaded after.
    """
    folder = Path(folder)
    config = read_config(folder)
    if config.get("peft_type", "LORA") != "LORA":
        raise QerlError(
            f"{folder} holds a {config.get('peft_type')} adapter; only LoRA adapters are supported"
        )
    peft_model = attach_lora(
        model,
        r=int(config["r"]),
        alpha=int(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout", 0.0)),
        target_modules=target_modules(config),
    )
    if config.get("modules_to_save"):  # trained norms (lora.train_norms)
        from peft.utils.other import set_additional_trainable_modules

        peft_config = peft_model.peft_config["default"]
        peft_config.modules_to_save = list(config["modules_to_save"])
        set_additional_trainable_modules(
            peft_model, peft_config, peft_model.base_model.model.config, "default"
        )
    load_weights(peft_model, folder)
    return peft_model


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def save_peft_model(peft_model: Any, folder: str | Path) -> Path:
    """Write a PEFT model's active adapter (config + safetensors) with the user's file modes.

    PEFT's default ``save_embedding_layers="auto"`` looks the base model up on every save (its folder's
    ``config.json`` read again, or for a hub id a request to the Hub and the config fetched) to see
    whether the vocabulary was resized. qerl never resizes it, so unless the adapter targets an embedding
    layer the answer is always "no embeddings": it is given, and a save (once per step in the vLLM sync)
    reads nothing of the base and the same files are written.
    """
    out = Path(folder)
    peft_model.save_pretrained(
        str(out), safe_serialization=True, save_embedding_layers=_embedding_layers_setting(peft_model)
    )
    return honour_umask(out)  # safetensors writes 0600 files


def _embedding_layers_setting(peft_model: Any) -> bool | str:
    """False where no adapter of ``peft_model`` targets an embedding layer by name; PEFT's "auto" (its own
    decision) otherwise, and for a regex ``target_modules``, which only PEFT's module walk resolves."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    for config in getattr(peft_model, "peft_config", {}).values():
        targets = getattr(config, "target_modules", None)
        if isinstance(targets, str) or any(name in (targets or ()) for name in EMBEDDING_LAYER_NAMES):
            return "auto"
    return False


def write_tensors(
    folder: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    rank: int,
    alpha: int,
    target_modules: Sequence[str],
    base_model: str,
) -> Path:
    """Write an adapter from its tensors alone (no model in memory). The config is written by
    peft's own ``LoraConfig``, so its fields match the installed peft."""
    from peft import LoraConfig

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    ).save_pretrained(str(out))
    save_file(dict(tensors), str(out / ADAPTER_WEIGHTS))
    return out


def copy_folder(source: str | Path, dest: str | Path) -> Path:
    """Copy the two files that make an adapter (nothing else the folder may hold) to ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copyfile(Path(source) / name, dest / name)
    return dest

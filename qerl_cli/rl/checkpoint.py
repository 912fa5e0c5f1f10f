"""Training checkpoints: everything ``--resume`` needs to continue a run exactly, without pickle.

``OUTPUT/checkpoint-N/`` (N = training steps completed) holds

- ``adapter/``: the PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``), which
  PEFT, ``qerl eval`` and vLLM load as is;
- ``optimizer.safetensors`` + ``optimizer.json``: every optimizer state tensor, and the
  parameter groups and scalar state as JSON, with the trainable parameter names so that a resume
  with a different LoRA layout fails clearly instead of loading mismatched moments;
- ``scheduler.json``: the learning-rate scheduler's state (its lambdas are rebuilt from the config);
- ``rng.safetensors`` + ``trainer_state.json``: torch CPU/CUDA generator states, Python's and
  NumPy's generator states, the step, the data position, the AQN schedule state and the metrics
  needed to continue.

The directory is written as ``.checkpoint-N.tmp`` and renamed when complete; a rename is atomic,
so a run killed mid-save leaves either the previous checkpoints or a complete new one, never a
half-written ``checkpoint-N``. ``trainer_state.json`` is written last inside the temp directory and
is the completeness marker :func:`find_last_checkpoint` checks.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from qerl_cli.errors import QerlError

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"
ADAPTER_DIR = "adapter"
FORMAT_VERSION = 1


@dataclass
class TrainingState:
    """The trainer's own progress (everything that is not a module, optimizer or RNG state)."""

    step: int  # training steps completed
    data_position: int  # prompts consumed from the data stream
    aqn: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None


# --------------------------------------------------------------------------------------------
# Optimizer and scheduler state <-> safetensors + JSON
# --------------------------------------------------------------------------------------------
def optimizer_to_files(
    optimizer: torch.optim.Optimizer, param_names: list[str]
) -> tuple[dict[str, torch.Tensor], dict]:
    """Split ``optimizer.state_dict()`` into tensors (keyed ``state.<param>.<key>``) and JSON."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    meta = {"param_groups": state["param_groups"], "scalars": scalars, "param_names": param_names}
    return tensors, meta


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, Any]:
    """Rebuild a state dict that ``optimizer.load_state_dict`` accepts."""
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for index, entry in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entry)
    return {"state": state, "param_groups": meta["param_groups"]}


def _scheduler_state(scheduler: Any) -> dict[str, Any]:
    # LambdaLR keeps its lambdas in the state (as None for plain functions); they come from the
    # config on resume, so only the counters and learning rates are stored.
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


# --------------------------------------------------------------------------------------------
# RNG states
# --------------------------------------------------------------------------------------------
def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    return tensors, meta


def restore_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) != torch.cuda.device_count():
            log.warning(
                "checkpoint has %d CUDA RNG states, this machine %d GPUs; restoring what matches",
                len(cuda_states),
                torch.cuda.device_count(),
            )
        for i, state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(state, i)
    py = meta["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npm = meta["numpy"]
    np.random.set_state(
        (
            npm["kind"],
            np.array(npm["keys"], dtype=np.uint32),
            npm["pos"],
            npm["has_gauss"],
            npm["cached_gaussian"],
        )
    )


# --------------------------------------------------------------------------------------------
# Save / find / load
# --------------------------------------------------------------------------------------------
def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def save_checkpoint(
    out_dir: str | Path,
    state: TrainingState,
    *,
    save_adapter: Callable[[Path], Any],
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: Any,
    save_total_limit: int | None = None,
) -> Path:
    """Write ``out_dir/checkpoint-<state.step>`` atomically; prune old ones beyond the limit."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / f"checkpoint-{state.step}"
    tmp = out / f".checkpoint-{state.step}.tmp"
    if tmp.exists():  # left by a run killed while saving
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_adapter(tmp / ADAPTER_DIR)
    opt_tensors, opt_meta = optimizer_to_files(optimizer, param_names)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    _write_json(tmp / "optimizer.json", opt_meta)
    _write_json(tmp / "scheduler.json", _scheduler_state(scheduler))
    rng_tensors, rng_meta = capture_rng()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    _write_json(
        tmp / STATE_FILE,
        {
            "format_version": FORMAT_VERSION,
            "step": state.step,
            "data_position": state.data_position,
            "aqn": state.aqn,
            "extra": state.extra or {},
            "rng": rng_meta,
        },
    )
    if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune_checkpoints(out, save_total_limit)
    return final


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``run_dir``, oldest first."""
    run = Path(run_dir)
    if not run.is_dir():
        return []
    found = []
    for child in run.iterdir():
        match = CHECKPOINT_RE.match(child.name)
        if match and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def prune_checkpoints(run_dir: Path, save_total_limit: int | None) -> None:
    if save_total_limit is None or save_total_limit <= 0:
        return
    for _, path in list_checkpoints(run_dir)[:-save_total_limit]:
        shutil.rmtree(path, ignore_errors=True)


def find_last_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a complete checkpoint, else its last complete ``checkpoint-N``."""
    path = Path(path)
    if CHECKPOINT_RE.match(path.name) and (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        if not path.exists():
            raise QerlError(f"--resume {path}: no such directory")
        raise QerlError(
            f"--resume {path}: no complete checkpoint-N/ inside; nothing to resume from "
            "(checkpoints are written every output.save_steps steps)"
        )
    return found[-1][1]


def load_checkpoint(
    ckpt: Path,
    *,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: Any,
    load_adapter: Callable[[Path], Any],
    restore_rng_states: bool = True,
) -> TrainingState:
    """Load every part of ``ckpt`` into the given live objects; return the trainer's state."""
    meta = json.loads((ckpt / STATE_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise QerlError(
            f"{ckpt} was written by an incompatible qerl version (format {meta.get('format_version')})"
        )
    opt_meta = json.loads((ckpt / "optimizer.json").read_text())
    if opt_meta["param_names"] != param_names:
        raise QerlError(
            f"{ckpt} was trained with other trainable parameters ({len(opt_meta['param_names'])} vs "
            f"{len(param_names)} now); resume with the run's own config (its config.yaml)"
        )
    load_adapter(ckpt / ADAPTER_DIR)
    optimizer.load_state_dict(optimizer_from_files(load_file(str(ckpt / "optimizer.safetensors")), opt_meta))
    scheduler_state = json.loads((ckpt / "scheduler.json").read_text())
    scheduler.load_state_dict({**scheduler.state_dict(), **scheduler_state})
    if restore_rng_states:
        restore_rng(load_file(str(ckpt / "rng.safetensors")), meta["rng"])
    return TrainingState(
        step=meta["step"], data_position=meta["data_position"], aqn=meta.get("aqn"), extra=meta.get("extra")
    )

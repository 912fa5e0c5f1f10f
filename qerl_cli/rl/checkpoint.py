"""Training checkpoints: everything ``--resume`` needs to continue a run exactly, without pickle.

``OUTPUT/checkpoint-N/`` (N = training steps completed) holds

- ``adapter/``: the PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``), which
  PEFT, ``qerl eval`` and vLLM load as is;
- ``optimizer.safetensors`` + ``optimizer.json``: every optimizer state tensor, and the
  parameter groups and scalar state as JSON, with the trainable parameter names so that a resume
  with a different LoRA layout fails clearly instead of loading mismatched moments;
- ``scheduler.json``: the learning-rate scheduler's state (its lambdas are rebuilt from the config);
- ``rng.safetensors`` + ``trainer_state.json``: torch CPU/CUDA generator states, Python's and
  NumPy's generator states, the step, the data position, the AQN schedule state, the count of
  non-finite steps in a row (``train.max_nonfinite_steps``) and the metrics needed to continue.

- ``manifest.json``, written last: the size and SHA-256 of every other file.

The directory is written as ``.checkpoint-N.tmp`` and renamed when complete; a rename is atomic,
so a run killed mid-save leaves either the previous checkpoints or a complete new one, never a
half-written ``checkpoint-N``. The manifest catches what the rename cannot: a file damaged after
the save (a full disk during a copy, a truncated sync, bit rot). :func:`find_last_checkpoint`
verifies it and falls back to the newest checkpoint that verifies, saying which it skipped and why.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from qerl_cli.errors import QerlError
from qerl_cli.files import honour_umask, sha256_file, staged_folder
from qerl_cli.modeling.run_layout import (
    ADAPTER_DIR,
    CHECKPOINT_RE,
    CHECKPOINT_STATE_FILE,
    OPTIMIZER_WEIGHTS,
    checkpoint_folders,
)
from qerl_cli.rl.resume_hints import no_checkpoint_error

log = logging.getLogger(__name__)

STATE_FILE = CHECKPOINT_STATE_FILE
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


@dataclass
class TrainingState:
    """The trainer's own progress (everything that is not a module, optimizer or RNG state)."""

    step: int  # training steps completed
    data_position: int  # prompts consumed from the data stream
    aqn: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None
    # Steps in a row skipped for a NaN/inf loss or gradient norm: a resumed run counts on from it
    # (restarted at 0, it gave each resume of a diverging run a fresh train.max_nonfinite_steps allowance).
    nonfinite_streak: int = 0


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


def write_manifest(folder: Path) -> Path:
    """``manifest.json``: size and SHA-256 of every file in ``folder`` (written last, after them)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    entries = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files
    }
    path = folder / MANIFEST_FILE
    _write_json(path, {"format_version": FORMAT_VERSION, "files": entries})
    return path


def is_legacy_checkpoint(ckpt: Path) -> bool:
    """A checkpoint of qerl 0.1.0: no manifest, and a state file that does not promise one."""
    if (ckpt / MANIFEST_FILE).is_file():
        return False
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and "manifest" not in state


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from (naming the file), or None when its manifest verifies."""
    manifest = ckpt / MANIFEST_FILE
    if not manifest.is_file():
        if is_legacy_checkpoint(ckpt):
            return None  # written before manifests: nothing to verify against (loading still checks)
        return f"{MANIFEST_FILE} is missing (the save did not finish, or the folder was altered)"
    try:
        entries = json.loads(manifest.read_text())["files"]
        if not isinstance(entries, dict):
            raise TypeError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({exc})"
    for name, entry in sorted(entries.items()):
        file = ckpt / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {entry.get('bytes')}"
        if sha256_file(file) != entry.get("sha256"):
            return f"{name} does not match its checksum in the manifest"
    if STATE_FILE not in entries:
        return f"the manifest does not list {STATE_FILE}"
    return None


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
    """Write ``out_dir/checkpoint-<state.step>`` atomically; prune old ones beyond the limit.

    A write that fails (a full disk, a quota) removes the partial temp folder and is a QerlError
    naming the newest intact checkpoint, which is left untouched.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / f"checkpoint-{state.step}"
    # A fixed staging name: one left by a run killed while saving is cleared by the next save.
    # Re-saving the same step (e.g. after a resume) replaces the old folder whole.
    staging = out / f".checkpoint-{state.step}.tmp"
    try:
        with staged_folder(final, existing="replace", staging=staging) as tmp:
            _write_checkpoint_files(tmp, state, save_adapter, optimizer, param_names, scheduler)
    # safetensors reports a failed write (ENOSPC, EDQUOT) as SafetensorError, not OSError.
    except (OSError, SafetensorError) as exc:
        good = newest_good_checkpoint(out)
        raise QerlError(
            f"could not write checkpoint-{state.step} in {out}: {getattr(exc, 'strerror', None) or exc}. "
            + (f"The last good checkpoint, {good}, is intact" if good else "No earlier checkpoint exists")
            + "; free space (or fix the folder) and continue with --resume auto"
        ) from exc
    prune_checkpoints(out, save_total_limit)
    return final


def _write_checkpoint_files(
    tmp: Path,
    state: TrainingState,
    save_adapter: Callable[[Path], Any],
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: Any,
) -> None:
    save_adapter(tmp / ADAPTER_DIR)
    opt_tensors, opt_meta = optimizer_to_files(optimizer, param_names)
    save_file(opt_tensors, str(tmp / OPTIMIZER_WEIGHTS))
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
            "nonfinite_streak": state.nonfinite_streak,
            "rng": rng_meta,
            # A checkpoint that says it has a manifest but lacks one was altered; one that does not
            # say so was written before manifests (qerl 0.1.0) and is resumed unverified.
            "manifest": MANIFEST_FILE,
        },
    )
    honour_umask(tmp)  # safetensors writes 0600 files; a checkpoint is readable like any output
    write_manifest(tmp)


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Checkpoint folders in ``run_dir`` with a state file, oldest first (not yet verified: see
    :func:`checkpoint_problem`)."""
    return [(step, path) for step, path in checkpoint_folders(run_dir) if (path / STATE_FILE).is_file()]


def prune_checkpoints(run_dir: Path, save_total_limit: int | None) -> None:
    if save_total_limit is None or save_total_limit <= 0:
        return
    for _, path in list_checkpoints(run_dir)[:-save_total_limit]:
        shutil.rmtree(path, ignore_errors=True)


def newest_good_checkpoint(
    run_dir: str | Path, *, skip: Path | None = None, before: int | None = None
) -> Path | None:
    """The newest checkpoint in ``run_dir`` whose manifest verifies (``skip`` excluded; with ``before``,
    only those of earlier steps), or None."""
    for step, candidate in reversed(list_checkpoints(run_dir)):
        if before is not None and step >= before:
            continue
        if candidate != skip and checkpoint_problem(candidate) is None:
            return candidate
    return None


def resumed_step(path: str | Path) -> int:
    """The steps behind the checkpoint ``--resume path`` continues from (:func:`find_last_checkpoint`'s)."""
    return checkpoint_step(find_last_checkpoint(path))


def checkpoint_step(found: Path) -> int:
    """The steps behind the checkpoint folder ``found`` (``checkpoint-N``: N)."""
    match = CHECKPOINT_RE.match(found.name)
    return int(match.group(1)) if match else 0


def check_within_max_steps(found: Path, step: int, max_steps: int) -> None:
    """A checkpoint past ``train.max_steps`` has nothing left to train: refused, naming both remedies."""
    if step > max_steps:
        raise QerlError(
            f"--resume {found} is at step {step}, beyond train.max_steps={max_steps}: to train on from it, "
            f"raise train.max_steps above {step} (--set train.max_steps=N); or give --resume an earlier "
            f"checkpoint-N of {found.parent} (N <= {max_steps})"
        )


def find_last_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint that verifies, else the newest ``checkpoint-N`` inside
    it that verifies; the damaged ones passed over are logged with the reason."""
    path = Path(path)
    if CHECKPOINT_RE.match(path.name) and path.is_dir():
        problem = checkpoint_problem(path)
        if problem is None:
            _warn_if_legacy(path)
            return path
        good = newest_good_checkpoint(path.parent, skip=path)
        hint = (
            f"the newest good checkpoint is {good}: --resume {good}"
            if good
            else f"no other checkpoint in {path.parent} verifies"
        )
        raise QerlError(f"--resume {path}: the checkpoint is damaged: {problem}; {hint}")
    found = list_checkpoints(path)
    if not found:
        raise no_checkpoint_error(path, list_checkpoints(path.parent))
    skipped = []
    for _, candidate in reversed(found):
        problem = checkpoint_problem(candidate)
        if problem is None:
            for name, why in skipped:
                log.warning("--resume: skipped %s, which is damaged: %s", name, why)
            if skipped:
                log.warning("--resume: using %s, the newest checkpoint that verifies", candidate)
            _warn_if_legacy(candidate)
            return candidate
        skipped.append((candidate.name, problem))
    reasons = "; ".join(f"{name}: {why}" for name, why in skipped)
    raise QerlError(f"--resume {path}: every checkpoint is damaged ({reasons}); start a new run")


def _warn_if_legacy(ckpt: Path) -> None:
    if is_legacy_checkpoint(ckpt):
        log.warning("--resume: %s was written before checkpoint manifests; resuming it unverified", ckpt)


def load_checkpoint(
    ckpt: Path,
    *,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: Any,
    load_adapter: Callable[[Path], Any],
    restore_rng_states: bool = True,
) -> TrainingState:
    """Load every part of ``ckpt`` into the given live objects; return the trainer's state.

    A file that fails to parse (damaged after its manifest was checked, or a checkpoint written
    before manifests) is a QerlError naming the file, never a raw safetensors/JSON error.
    """
    try:
        return _load_checkpoint(
            ckpt,
            optimizer=optimizer,
            param_names=param_names,
            scheduler=scheduler,
            load_adapter=load_adapter,
            restore_rng_states=restore_rng_states,
        )
    except QerlError:
        raise
    except SafetensorError as exc:
        raise QerlError(f"cannot load the checkpoint {ckpt}: a damaged safetensors file ({exc})") from exc
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise QerlError(f"cannot load the checkpoint {ckpt}: {type(exc).__name__}: {exc}") from exc


def _load_checkpoint(
    ckpt: Path,
    *,
    optimizer: torch.optim.Optimizer,
    param_names: list[str],
    scheduler: Any,
    load_adapter: Callable[[Path], Any],
    restore_rng_states: bool,
) -> TrainingState:
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
        step=meta["step"],
        data_position=meta["data_position"],
        aqn=meta.get("aqn"),
        extra=meta.get("extra"),
        # A checkpoint written before the streak was kept: 0, what every resume assumed then.
        nonfinite_streak=int(meta.get("nonfinite_streak", 0)),
    )

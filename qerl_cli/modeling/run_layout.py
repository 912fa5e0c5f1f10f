"""The folder a `qerl train` run writes (its ``output.dir``): the names of its entries, and how to tell
one from a model folder.

``OUTPUT/adapter/`` is the final adapter, ``OUTPUT/checkpoint-N/`` a checkpoint (with its own
``adapter/``, :mod:`qerl_cli.rl.checkpoint`), ``OUTPUT/metrics.jsonl`` the step records
(:mod:`qerl_cli.rl.tracking`) and ``OUTPUT/config.yaml`` the run's resolved config
(``config.RESOLVED_CONFIG_NAME``), ``OUTPUT/prompt.json`` the prompt template it trained with. The
names live here, below ``rl`` which writes them and imports them from here, so that the model-source
checks (:mod:`qerl_cli.modeling.source_checks`) recognise a run's folder given for a model by the very
names the trainer writes, finished or interrupted, and an evaluation of a run's adapter finds the
template it was trained with.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from qerl_cli.config import RESOLVED_CONFIG_NAME

ADAPTER_DIR = "adapter"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
METRICS_FILE = "metrics.jsonl"
PROMPTS_FILE = "prompt.json"
# A checkpoint-N/ folder's trainer state and optimizer weights (rl.checkpoint writes them).
CHECKPOINT_STATE_FILE = "trainer_state.json"
OPTIMIZER_WEIGHTS = "optimizer.safetensors"


def checkpoint_folders(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``checkpoint-N`` folder in ``run_dir``, oldest first; whether one is
    complete is the checkpoint's own question (``rl.checkpoint.list_checkpoints`` and its manifest)."""
    run = Path(run_dir)
    if not run.is_dir():
        return []
    found = []
    for child in run.iterdir():
        match = CHECKPOINT_RE.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def is_run_folder(folder: str | Path) -> bool:
    """Whether ``folder`` looks like a `qerl train` run's by its layout: a checkpoint, or the records and
    config snapshot every run writes at its start (a run stopped before its first checkpoint has only
    those). A final adapter is :func:`qerl_cli.modeling.adapter.run_adapter`'s to find (it reads the
    adapter's files; an empty ``adapter/`` is no run's)."""
    path = Path(folder)
    if checkpoint_folders(path):
        return True
    return (path / METRICS_FILE).is_file() and (path / RESOLVED_CONFIG_NAME).is_file()


def trained_template(adapter_dir: str | Path) -> tuple[str, Path] | None:
    """The prompt template the run that wrote ``adapter_dir`` trained with, and the record saying so:
    the run's ``prompt.json`` beside its final ``adapter/`` or above its ``checkpoint-N/adapter/``.
    None for an adapter from elsewhere, or a record that cannot be read."""
    adapter = Path(adapter_dir)
    run = adapter.parent.parent if CHECKPOINT_RE.match(adapter.parent.name) else adapter.parent
    record = run / PROMPTS_FILE
    try:
        name = json.loads(record.read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return (name, record) if isinstance(name, str) else None

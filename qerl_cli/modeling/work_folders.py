"""Output folders that hold trained work, which no command writing a model there may replace, with
``--overwrite`` or without: a PEFT adapter, a ``qerl train`` checkpoint or run folder. Their weights are
``*.safetensors`` too, so "it holds .safetensors" alone (:func:`qerl_cli.files.model_files`) would let
``--overwrite`` delete them as a model. Here, above ``files`` (which may not import the model's layers)
and beside the names it reads: ``run_layout``'s and ``adapter``'s."""

from __future__ import annotations

from pathlib import Path

from qerl_cli.errors import QerlError
from qerl_cli.files import MODEL_SIDE_FILES, model_files
from qerl_cli.modeling import run_layout


def other_work(folder: Path) -> str | None:
    """What trained work ``folder`` holds (a PEFT adapter, a `qerl train` checkpoint or run folder), named
    with the files that say so; None where it holds none."""
    from qerl_cli.modeling.adapter import is_adapter_folder  # torch: not at this module's import

    if is_adapter_folder(folder):
        return "a PEFT adapter"
    markers = {
        run_layout.CHECKPOINT_STATE_FILE: "a `qerl train` checkpoint",
        run_layout.OPTIMIZER_WEIGHTS: "a `qerl train` checkpoint",
    }
    for marker, kind in markers.items():
        if (folder / marker).is_file():
            return f"{kind} ({marker})"
    if run_layout.is_run_folder(folder):  # the trainer's own layout: checkpoint-N/, or its records
        return "a `qerl train` run's folder (checkpoint-N/ or metrics.jsonl and config.yaml)"
    if is_adapter_folder(folder / run_layout.ADAPTER_DIR):
        return f"a `qerl train` run's folder (its final {run_layout.ADAPTER_DIR}/)"
    return None


def check_not_other_work(folder: Path, what: str, remedy: str = "give a new or empty folder") -> None:
    """Refuse an output ``folder`` (named ``what``; ``remedy`` says what to give instead) that holds trained
    work (:func:`other_work`), or files but no model: a command writing a model there would delete the
    work or mix its files in, and --overwrite replaces only a model's files, never other work."""
    # Hidden files (.gitkeep, .DS_Store) are not work: a folder holding only those counts as empty.
    entries = sorted(entry.name + "/" * entry.is_dir() for entry in folder.iterdir() if entry.name[0] != ".")
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    keep = "--overwrite replaces only an earlier output, a model folder, never a folder of other files"
    if (work := other_work(folder)) is not None:
        raise QerlError(
            f"{what} {folder} is {work}, not a model (it holds {shown}); nothing was written: {remedy} "
            f"({keep})"
        )
    if not entries or model_files(folder):
        return
    raise QerlError(
        f"{what} {folder} holds {shown}, not a model (no config.json); nothing was written: {remedy} ({keep})"
    )


# What a model folder holds that a model writer wrote: its config, the index of its *.safetensors shards
# (the weights: files.model_files), the files describing it (files.MODEL_SIDE_FILES), llm-compressor's recipe.
MODEL_FOLDER_FILES = frozenset(
    {"config.json", "model.safetensors.index.json", "recipe.yaml", *MODEL_SIDE_FILES}
)


def check_replaceable_model(folder: Path, what: str, written: set[str], remedy: str) -> None:
    """Refuse replacing the model folder ``folder`` whole (``--overwrite`` of a writer that swaps in a new
    folder) where it also holds what no model writer wrote there: notes, an evaluation, a run beside the
    model would go with it. ``written``: the writer's own names beyond a model's (``qerl_quant.json``,
    ``lora_init``). Hidden files (``.gitkeep``) are left out of the count."""
    own = MODEL_FOLDER_FILES | written
    foreign = sorted(
        entry.name + "/" * entry.is_dir()
        for entry in folder.iterdir()
        if not entry.name.startswith(".")
        and entry.name not in own
        and not (entry.is_file() and entry.name.endswith(".safetensors"))
    )
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise QerlError(
            f"{what} {folder} holds {shown} beside the model, which --overwrite would delete with the old "
            f"model (it replaces the whole folder); nothing was written: {remedy}, or move them out first"
        )

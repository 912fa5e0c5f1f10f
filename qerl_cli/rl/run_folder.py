"""A training run's folder: what in it belongs to a run, the refusal to train over a finished or
interrupted run unless asked, clearing it when asked (``--overwrite``), and not leaving an empty folder
behind when a run fails before writing anything.

A run that starts in a folder holding another run's files would truncate its ``metrics.jsonl`` and
``completions.jsonl`` and leave its checkpoints and adapter beside the new run's, where ``--resume``
and readers would take them for the new run's own. So a fresh run (no ``--resume``) starts only in a
folder without them; ``overwrite=True`` removes them first. ``--resume`` continues a run in its own
folder only: a checkpoint of another folder would write over ``output.dir`` the same way.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qerl_cli.config import RESOLVED_CONFIG_NAME
from qerl_cli.errors import QerlError, qerl_command
from qerl_cli.modeling.run_layout import ADAPTER_DIR, CHECKPOINT_RE, METRICS_FILE, PROMPTS_FILE
from qerl_cli.rl.checkpoint import list_checkpoints
from qerl_cli.rl.tracking import COMPLETIONS_FILE, PLOT_FILE

# What `qerl compare` writes beside a run's own files (its per-run result and held-out evaluation):
# named here by their file names, as this layer cannot import compare's constants.
COMPARE_RESULT, COMPARE_HELDOUT = "result.json", "heldout"
# A run's results: a folder holding any of these holds a run that a fresh start would damage.
RESULT_ENTRIES = (METRICS_FILE, COMPLETIONS_FILE, ADAPTER_DIR, COMPARE_RESULT)
# Everything a run writes, removed by --overwrite (checkpoint-N folders are matched by CHECKPOINT_RE).
RUN_ENTRIES = (
    *RESULT_ENTRIES,
    PLOT_FILE,
    RESOLVED_CONFIG_NAME,
    PROMPTS_FILE,
    "tensorboard",
    "wandb",
    COMPARE_HELDOUT,
)
# Staged writes an interrupted run may leave (files.atomic_write_text's ".NAME.*.tmp").
_STAGED = re.compile(r"^\..+\.tmp$")


def check_resume_or_overwrite(resume: str | Path | None, overwrite: bool) -> None:
    """``--resume`` continues a run in its folder, ``--overwrite`` deletes it: not both."""
    if resume is not None and overwrite:
        raise QerlError(
            "--resume continues the run in its folder and --overwrite deletes it: give one of them"
        )


def resumed_run(resume: str | Path) -> Path:
    """The run folder ``--resume`` names: a ``checkpoint-N`` folder's parent, else the folder itself."""
    path = Path(resume)
    return path.parent if CHECKPOINT_RE.match(path.name) else path


def check_resume_target(resume: str | Path, out_dir: str | Path) -> None:
    """``--resume`` continues a run in its own folder: a checkpoint of another folder than ``output.dir``
    is refused, as the run would write its metrics, checkpoints and adapter into ``output.dir``, cutting
    the metrics of a run held there back to the resumed step and replacing its adapter."""
    run, out = resumed_run(resume), Path(out_dir)
    if not list_checkpoints(run) or run.expanduser().resolve() == out.expanduser().resolve():
        return  # nothing to resume there is checkpoint.find_last_checkpoint's to say
    held = " (over the training run it holds)" if run_entries(out) else ""
    recipe = run / RESOLVED_CONFIG_NAME
    set_dir = shlex.join(["--set", f"output.dir={run}"])
    resume_run = qerl_command("train", recipe, "--resume", "auto")
    again = (
        f"`{resume_run}` (the run's own recorded settings) or add {set_dir}"
        if recipe.is_file()
        else f"add {set_dir} (with that run's other settings)"
    )
    raise QerlError(
        f"--resume {resume} continues the run in {run}, but output.dir is {out}: the run would write "
        f"there{held}; nothing was changed. To continue {run}, {again}"
    )


def check_config_home(recipe: str | Path, out_dir: str | Path) -> None:
    """A run's own ``config.yaml`` given as the recipe, beside that run's files, whose ``output.dir`` (from
    the file) names another folder: the run folder was copied or moved, and training from it would write
    into ``output.dir`` (resuming or cutting back the run there), not beside the config. Refused, naming
    both."""
    path = Path(recipe)
    home = path.parent
    if path.name != RESOLVED_CONFIG_NAME or not run_entries(home):
        return
    if home.expanduser().resolve() == Path(out_dir).expanduser().resolve():
        return
    raise QerlError(
        f"{path} is the config of the run in {home}, but its output.dir is {out_dir} (the folder was copied "
        f"or moved): this command would train into {out_dir}. To continue the run in {home}, add --set "
        f"output.dir={home}; to train into {out_dir}, give its own config.yaml"
    )


def run_entries(out_dir: str | Path) -> list[Path]:
    """The entries of ``out_dir`` that hold a run's results: non-empty metrics or completions, an
    adapter, a compare result, checkpoint folders. Empty when the folder is new or holds none."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = [path for _, path in list_checkpoints(out)]
    for name in RESULT_ENTRIES:
        path = out / name
        if path.is_dir() or (path.is_file() and path.stat().st_size > 0):
            found.append(path)
    return found


def check_fresh_start(out_dir: str | Path, *, overwrite: bool, clear: bool = True) -> None:
    """Before a fresh run (no ``--resume``) trains into ``out_dir``: refuse when it holds another run,
    unless ``overwrite``, which removes that run's files (and only them) first when ``clear`` (rank 0
    of a data-parallel run: the other ranks leave the folder to it)."""
    out = Path(out_dir)
    found = run_entries(out)
    if not found:
        return
    if not overwrite:
        names = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in found))
        keep = (
            "continue it with --resume auto, or train into a fresh folder with --set output.dir=DIR"
            if list_checkpoints(out)
            else "train into a fresh folder with --set output.dir=DIR (it has no checkpoint to continue from)"
        )
        raise QerlError(
            f"output.dir {out} already holds a training run ({names}); nothing was changed. To keep it, "
            f"{keep}; to replace it, add --overwrite (its metrics, completions, checkpoints and adapter are "
            "deleted)"
        )
    if clear:
        clear_run(out)


def stop_hint(out_dir: str | Path, save_steps: int) -> str:
    """How to go on after a run into ``out_dir`` stopped (Ctrl-C, SIGTERM, a full disk): resume from its
    last checkpoint, or, before the first one, start over (``--resume auto`` would find nothing).

    The command given resumes from the run's own ``config.yaml`` (written before its first step, so
    there with any checkpoint): the recipe with ``--resume auto`` resumes the recipe's ``output.dir``,
    which is another folder when this run's came from ``--set`` or the recipe was edited since."""
    if list_checkpoints(out_dir):
        config = Path(out_dir) / RESOLVED_CONFIG_NAME
        return f"continue from its last checkpoint with: {qerl_command('train', config, '--resume', 'auto')}"
    every = (
        f"one is written every {save_steps} steps" if save_steps > 0 else "output.save_steps=0 writes none"
    )
    return (
        f"nothing was saved yet: no checkpoint in {out_dir} ({every}); re-run the same command, with "
        "--overwrite if the run got as far as writing metrics"
    )


def clear_run(out_dir: str | Path) -> list[Path]:
    """Remove every file and folder a run writes in ``out_dir`` (nothing else); returns what went."""
    out = Path(out_dir)
    removed = []
    for child in sorted(out.iterdir()) if out.is_dir() else []:
        if child.name in RUN_ENTRIES or CHECKPOINT_RE.match(child.name) or _STAGED.match(child.name):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
            removed.append(child)
    return removed


def missing_folders(path: str | Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what creating it makes."""
    out, missing = Path(path).absolute(), []
    while not out.exists() and out != out.parent:
        missing.append(out)
        out = out.parent
    return missing


def remove_if_empty(folders: list[Path]) -> None:
    """After a failed start: the folders it created (deepest first) that are still empty go, so a
    failure leaves no empty ``runs/NAME/`` behind."""
    for folder in folders:
        try:
            folder.rmdir()  # only an empty folder: anything written stays
        except OSError:
            return


@contextmanager
def run_folder(out_dir: str | Path, *, resume: str | Path | None, overwrite: bool) -> Iterator[Path]:
    """Around a training run into ``out_dir``: a fresh run (no ``resume``) refuses a folder holding
    another run unless ``overwrite``, which clears it (rank 0 alone, under torchrun: every rank refuses
    alike); a run that fails before writing anything leaves no empty folder behind."""
    check_resume_or_overwrite(resume, overwrite)
    if resume is not None:
        check_resume_target(resume, out_dir)
    out = Path(out_dir)
    created = missing_folders(out)
    if resume is None:
        check_fresh_start(out, overwrite=overwrite, clear=int(os.environ.get("RANK", "0")) == 0)
    try:
        yield out
    except BaseException:
        remove_if_empty(created)
        raise

"""What ``--resume PATH`` says when PATH holds no checkpoint to continue from: a path that is not there
(a checkpoint-N the run never wrote: the ones it did), a file given for the run's folder, a run that
finished without a checkpoint (which ``--resume`` cannot extend and ``--overwrite`` would delete), and a
run stopped before its first checkpoint."""

from __future__ import annotations

from pathlib import Path

from qerl_cli.config import RESOLVED_CONFIG_NAME
from qerl_cli.errors import QerlError, holding_folder_hint
from qerl_cli.files import file_given_for_folder
from qerl_cli.modeling.adapter import run_adapter
from qerl_cli.modeling.run_layout import CHECKPOINT_RE, METRICS_FILE, PROMPTS_FILE

# The files a run writes beside its checkpoints: one of them given for the run's folder names the folder.
RUN_FILES = (RESOLVED_CONFIG_NAME, METRICS_FILE, PROMPTS_FILE, "completions.jsonl*", "*.log")


def no_checkpoint_error(path: Path, beside: list[tuple[int, Path]]) -> QerlError:
    """The error for ``--resume path`` where ``path`` holds no complete checkpoint; ``beside``: the
    complete checkpoints of its parent folder (a ``checkpoint-N`` not there is one of theirs mistyped)."""
    if not path.exists():
        if CHECKPOINT_RE.match(path.name) and beside:
            names = ", ".join(found.name for _, found in beside)
            return QerlError(
                f"--resume {path}: no such checkpoint; the checkpoints of {path.parent} are {names}: give "
                f"one of them (--resume {beside[-1][1]}), or --resume {path.parent} for its newest"
            )
        return QerlError(
            f"--resume {path}: no such directory; give the output.dir of an earlier `qerl train` run "
            "(the folder of its checkpoint-N/ folders: runs/tiny for `qerl train tiny`), or --resume "
            "auto for the recipe's own output.dir"
        )
    if not path.is_dir():  # a run's file (its config.yaml, metrics.jsonl) given for its folder
        return file_given_for_folder(
            path,
            "--resume",
            "the output.dir of an earlier `qerl train` run, the folder of its checkpoint-N/ folders, or "
            "--resume auto for the recipe's own" + holding_folder_hint("--resume", path, RUN_FILES),
        )
    if run_adapter(path) is not None:
        return QerlError(
            f"--resume {path}: no complete checkpoint-N/ inside: the run there finished (its adapter/ is "
            "there) without writing a checkpoint (they are written every output.save_steps steps), so "
            "--resume cannot extend it; to train further, start a new run into another folder with --set "
            "output.dir=DIR, which leaves this one as it is"
        )
    return QerlError(
        f"--resume {path}: no complete checkpoint-N/ inside; nothing to resume from (checkpoints are "
        "written every output.save_steps steps): the run there stopped before its first one. Start the run "
        "again without --resume, adding --overwrite to replace what the stopped run left there (it deletes "
        f"the metrics, completions and checkpoints in {path}), or train into another folder with --set "
        "output.dir=DIR"
    )

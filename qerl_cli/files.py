"""Writing the reports every stage leaves behind: JSON files and the CI job summary.

One place so that every ``*.json`` a stage writes is complete or absent (never half written when a
run is interrupted) and every stage appends to ``$GITHUB_STEP_SUMMARY`` the same way.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qerl_cli.errors import QerlError


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: the only portable way is to set it and put it back
    os.umask(mask)
    return mask


def honour_umask(path: str | Path) -> Path:
    """Give ``path`` (a file, or a folder and everything under it) the modes a plain ``open`` or
    ``mkdir`` would: 0666 / 0777 minus the umask.

    ``tempfile.mkstemp`` (and libraries that write through it, such as safetensors' ``save_file``
    and so PEFT's ``save_pretrained``) create files 0600, which a rename keeps: on a shared machine
    nobody else could read an adapter or a checkpoint. Every folder a stage hands to the user goes
    through this once it is complete.
    """
    path = Path(path)
    mask = current_umask()
    targets = [path, *path.rglob("*")] if path.is_dir() else [path]
    for target in targets:
        if target.is_symlink():
            continue
        os.chmod(target, (0o777 if target.is_dir() else 0o666) & ~mask)
    return path


# What to give instead of a file in an output folder's place (both output checks below say it).
ANOTHER_OUTPUT = "another path or move the file"


def ensure_output_dir(path: str | Path, what: str) -> Path:
    """Create the output folder ``path`` (``what`` names its setting) and prove it is writable.

    A file in the way, a parent that is a file, or a folder this process cannot write to is a
    QerlError now, naming the path, instead of an OSError after minutes of work.
    """

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise file_given_for_folder(path, what, ANOTHER_OUTPUT)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".qerl-write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise QerlError(f"{what} {path} cannot be written: {exc.strerror or exc}") from None
    return path


def check_writable_folder(path: str | Path, what: str, remedy: str) -> bool:
    """Whether the output folder ``path`` exists, once it is known it can be made and written: checked on
    it or on the nearest folder above it that exists, creating nothing (the checks before work, and
    ``--dry-run``, write nothing: a probe folder made there is removed at once; the permission bits alone
    pass ``/proc/x`` for root). ``what`` names its setting, ``remedy`` how to give another
    ("choose another with --output DIR")."""

    out = Path(path).expanduser()
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == out and not out.is_dir():
        raise file_given_for_folder(path, what, ANOTHER_OUTPUT)
    if not existing.is_dir():
        raise QerlError(f"{what} {path} cannot be written: {existing} is a file, not a folder; {remedy}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise QerlError(f"{what} {path} cannot be written: {existing} is not writable by this user; {remedy}")
    try:  # the permission bits say yes for root everywhere, and /proc or a full disk refuse all the same
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".qerl-write-probe-"))
    except OSError as exc:
        why = f"{existing} takes no new folder ({exc.strerror or exc})"
        raise QerlError(f"{what} {path} cannot be written: {why}; {remedy}") from None
    return existing == out


def check_writable_file(path: str | Path, what: str, remedy: str) -> bool:
    """Whether the output file ``path`` exists, once it is known it can be written: not a folder, and its
    folder can be made and written (:func:`check_writable_folder`, creating nothing). ``remedy`` says what
    to give instead of a folder ("give a file for the JSON report")."""

    path = Path(path).expanduser()
    if path.is_dir():
        raise QerlError(f"{what} {path} is a folder, not a file: {remedy}")
    check_writable_folder(path.parent, what, remedy)
    return path.exists()


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write through a temporary file and rename, so an interrupted run never leaves half a file.

    The file gets the mode of a plain write (0666 minus the umask), not mkstemp's 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, data: Any, *, default: Callable[[Any], Any] | None = None) -> Path:
    """``data`` as indented UTF-8 JSON with a trailing newline, written atomically.

    ``default`` converts objects JSON cannot hold (e.g. ``str``); without it they raise TypeError.
    """
    return atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False, default=default) + "\n")


def append_step_summary(markdown: str) -> Path | None:
    """Append to ``$GITHUB_STEP_SUMMARY`` when it is set (GitHub Actions job summary), else nothing."""
    target = os.environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    path = Path(target)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(markdown + "\n")
    return path


GZIP_SUFFIX = ".gz"


def gzip_sibling(path: str | Path) -> Path:
    """``path`` with ``.gz`` appended: where a committed copy of a large per-sample file is kept."""
    path = Path(path)
    return path.with_name(path.name + GZIP_SUFFIX)


def folder_given_for_file(
    folder: str | Path, what: str, suffixes: tuple[str, ...], alternative: str
) -> QerlError:
    """The error for a folder given where a data file is expected (``--calib``, ``data.dataset``): it names
    the folder and the files of the kinds asked for in it, the likely meant ones, and ``alternative``."""
    folder = Path(folder)
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
    inside = f" (it holds {', '.join(files[:4])}{', ...' if len(files) > 4 else ''})" if files else ""
    kinds = "/".join(suffixes)
    return QerlError(f"{what} {folder} is a folder{inside}; give a {kinds} file in it, or {alternative}")


def file_given_for_folder(path: str | Path, what: str, instead: str, kind: str = "folder") -> QerlError:
    """The error for a file given where a folder is expected (an output folder, ``--resume``, ``--rescore``,
    an adapter or a model folder), the counterpart of :func:`folder_given_for_file`: it names the file and
    what to give ``instead`` ("the adapter folder (e.g. OUTPUT/adapter)"). ``what`` names the setting (""
    where the caller has none to name), ``kind`` the folder expected ("model folder")."""
    label = f"{what} {path}" if what else str(path)
    return QerlError(f"{label} is a file, not a {kind}: give {instead}")


def readable_text_file(path: str | Path) -> Path | None:
    """The file that holds ``path``'s text: ``path`` itself, else its gzip'd sibling ``path.gz``, else None.

    Stages write per-sample files (``completions.jsonl``, ``samples_<bench>.jsonl``) plain; the copies
    kept in the repository's ``benchmarks/`` are gzip'd, and every reader of a run folder takes either.
    """
    path = Path(path)
    if path.is_file():
        return path
    packed = gzip_sibling(path)
    return packed if path.suffix != GZIP_SUFFIX and packed.is_file() else None


def read_text_maybe_gzip(path: str | Path) -> str:
    """UTF-8 text of ``path`` (or of ``path.gz`` when only that exists); a ``.gz`` file is decompressed.

    FileNotFoundError names ``path`` when neither exists.
    """
    found = readable_text_file(path)
    if found is None:
        raise FileNotFoundError(f"{path} (or {gzip_sibling(path).name}) not found")
    if found.suffix == GZIP_SUFFIX:
        with gzip.open(found, "rt", encoding="utf-8") as handle:
            return handle.read()
    return found.read_text(encoding="utf-8")


def read_json_report(path: str | Path, file_name: str, what: str) -> dict[str, Any]:
    """Read a report JSON object from ``path`` or from ``path/file_name`` when ``path`` is a folder.

    ``what`` names the file in the messages (e.g. "the bench.json of an earlier `qerl bench` run").
    Callers check the report's own shape; this only guarantees a JSON object.
    """

    path = Path(path)
    if path.is_dir():
        path = path / file_name
    if not path.is_file():
        raise QerlError(f"{path} not found: give {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise QerlError(f"{path} is not valid JSON ({exc}): give {what}") from None
    if not isinstance(data, dict):
        raise QerlError(f"{path} holds no JSON object: give {what}")
    return data


def check_input_not_replaced(
    given: str | Path, flag: str, file_name: str, out_dir: str | Path, what: str = "the baseline"
) -> None:
    """Refuse a report to compare against (``flag``: ``--baseline``; ``what`` names it) that this run's
    ``out_dir/file_name`` would be written over: the run would compare with it, then lose it. ``given`` may
    name the file or its folder, read as :func:`read_json_report` reads it. Paths are compared resolved (a
    relative path, a symlinked folder) and as the entry the write replaces (a link in ``out_dir`` to the
    file), so no spelling of the same file slips through."""

    source = Path(given).expanduser()
    if source.is_dir():
        source = source / file_name
    target = Path(out_dir).expanduser() / file_name
    same_entry = source.parent.resolve() / source.name == target.parent.resolve() / target.name
    if same_entry or source.resolve() == target.resolve():
        raise QerlError(
            f"{flag} {given}: this run writes its {file_name} into {out_dir}, over {what}; write this run "
            f"elsewhere with --output DIR (-o), or copy {what} out of {out_dir} first"
        )


COMPLETE_MARKER = ".qerl-complete"  # written last: a folder without it is a crashed write


def remove_path(path: Path) -> bool:
    """Remove ``path``: a folder with what it holds, a file, a link (never what a link points to).
    Returns whether anything was there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    else:
        return False
    return True


def sha256_file(path: str | Path) -> str:
    """The file's SHA-256 (hex), read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def is_complete_folder(folder: str | Path) -> bool:
    return (Path(folder) / COMPLETE_MARKER).is_file()


EXISTING = ("replace", "refuse", "keep", "merge")


class TargetExistsError(FileExistsError):
    """A folder appeared at a staged write's target while it was being written (``existing="refuse"``)."""


@contextmanager
def staged_folder(
    target: str | Path, *, existing: str = "replace", staging: str | Path | None = None
) -> Iterator[Path]:
    """Write a folder under a sibling staging name and rename it to ``target`` once complete.

    Yields the fresh, empty staging folder. When the block finishes, the folder is given the
    umask's modes (safetensors and ``mkstemp`` write 0600 files; an output is for everyone to read)
    and renamed to ``target``; if the block raises, it is removed and the error goes on. The
    sibling lives on the same filesystem, so the rename is atomic: nothing half written ever sits
    at ``target``, and an interrupted write leaves at most the staging folder.

    ``existing`` says what a folder already at ``target`` at rename time means: ``replace`` (it is
    removed, only now that the new one is complete), ``refuse`` (TargetExistsError, for the caller
    to word), ``keep`` (another writer finished first: theirs stays, this copy is dropped) or
    ``merge`` (each entry of the staging folder replaces its namesake in ``target``, one rename
    each; the rest of ``target`` stays).
    ``staging`` fixes the staging folder's path, for a single writer that clears its own leftovers
    (one left there by a killed run is removed first); by default each call stages under its own
    name, so concurrent writers never share one.
    """
    if existing not in EXISTING:
        raise ValueError(f"existing must be one of {EXISTING}, got {existing!r}")
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(staging) if staging else target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        yield stage
        honour_umask(stage)
        _publish(stage, target, existing)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _publish(stage: Path, target: Path, existing: str) -> None:
    if existing == "merge":
        target.mkdir(exist_ok=True)
        for entry in sorted(stage.iterdir()):
            old = target / entry.name
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            elif old.exists() or old.is_symlink():
                old.unlink()
            os.replace(entry, old)
        return
    if target.exists():
        if existing == "refuse":
            raise TargetExistsError(f"{target} appeared while it was being written")
        if existing == "replace":
            shutil.rmtree(target)
    try:
        os.replace(stage, target)
    except OSError:  # "keep": another writer renamed a complete folder there first
        if existing != "keep" or not target.exists():
            raise


def write_folder_once(target: str | Path, write: Callable[[Path], object]) -> Path:
    """``target``, written by ``write(staging)`` into a sibling staging folder that is marked complete,
    given the umask's modes and renamed, unless a complete ``target`` exists already (then it is
    returned as is).

    A crash leaves no half folder under ``target``; several processes may ask for the same folder at
    once (each stages under its own name, and the first rename wins).
    """
    target = Path(target)
    if is_complete_folder(target):
        return target
    with staged_folder(target, existing="keep") as staging:
        write(staging)
        (staging / COMPLETE_MARKER).write_text("")
        if target.exists() and not is_complete_folder(target):
            shutil.rmtree(target)  # the leftover of a crash before this marker existed
    return target


# What marks a folder as a model (an earlier output, another model): what --overwrite may replace. Anything
# else is someone's other work: `-o runs --overwrite` would have deleted every run.
MODEL_MARKERS = ("config.json", "qerl_quant.json")
# Files that describe a model rather than hold its weights (transformers' generation config and tokenizer):
# copied beside a derived copy's weights, and a model writer's own in its folder.
MODEL_SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
    "added_tokens.json",
)  # fmt: skip


def model_files(folder: Path) -> list[str]:
    """The files in ``folder`` that make it a model (its markers, its .safetensors): empty when none."""
    return sorted(
        entry.name
        for entry in folder.iterdir()
        if entry.is_file() and (entry.name in MODEL_MARKERS or entry.name.endswith(".safetensors"))
    )

"""The one exception type for mistakes a user can fix, what a check that passed found, the command
that installs a missing optional package, and the qerl command a message tells the user to run.

Every "did you mean" of qerl asks :func:`closest` for the name meant.

The CLI prints a ``QerlError`` as a short red message and exits 2; anything else is a bug and
exits 1 (with a traceback under ``--debug``). The checks each stage makes before any work (``train``,
``quantize``, ``eval``; ``--dry-run`` lists them) raise a ``QerlError`` when they fail and return a
:class:`Checked` when they pass.
"""

import difflib
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

# qerl's optional-dependency groups (pyproject's [project.optional-dependencies]; a test holds the two
# equal), so that a hint never names an extra pip would not find.
EXTRAS = frozenset({"vllm", "quantize", "nf4", "gguf", "humming", "liger", "dev"})


class QerlError(Exception):
    """A user-facing error: the message says what was wrong and what to do about it."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where a command takes it as Ctrl-C (``cli/interrupt.sigterm_interrupts``): every
    clean-up runs as for a ``KeyboardInterrupt``; what must pass the signal on (``qerl compare``'s child
    runs, which SIGTERM did not reach as Ctrl-C reaches the whole process group) tells the two apart."""


@dataclass(frozen=True)
class Checked:
    """One check that passed: what was checked, and what was found."""

    what: str
    found: str


def closest(word: object, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The choice a mistyped ``word`` most likely meant (difflib's ratio at least ``cutoff``, case
    ignored: ``GSM8`` means ``gsm8k``), or None: the one close-match rule of every "did you mean"."""
    folded = {choice.lower(): choice for choice in choices}
    found = difflib.get_close_matches(str(word).lower(), list(folded), n=1, cutoff=cutoff)
    return folded[found[0]] if found else None


def install_hint(*extras: str) -> str:
    """The command that installs qerl's extras, for a message about a missing package.

    qerl is not on PyPI, so a hint naming the distribution qerl (with its extras) fails when copied:
    extras come from an editable install of the clone, run in its folder (the README's "Install").
    """
    unknown = sorted(set(extras) - EXTRAS)
    if not extras or unknown:
        raise ValueError(f"install_hint takes qerl's extras ({', '.join(sorted(EXTRAS))}), got {extras!r}")
    return f'pip install -e ".[{",".join(extras)}]" in the qerl clone'


def qerl_command(*words: object) -> str:
    """A ``qerl`` command for a message to suggest, each word quoted for the shell where it needs it
    (a path with a space or an accent): the line pastes and runs as written."""
    return shlex.join(["qerl", *(str(word) for word in words)])


def holding_folder_hint(flag: str, given: object, its_files: Iterable[str]) -> str:
    """For a file given where a folder is expected: the folder that holds it as the flag's value, where
    the file is one of the files such a folder holds (``its_files``, fnmatch patterns: a run's
    ``config.yaml``), else "" (a file of any other name says nothing of its folder)."""
    import fnmatch
    from pathlib import Path

    path = Path(str(given))
    if not any(fnmatch.fnmatch(path.name, pattern) for pattern in its_files):
        return ""
    return f" ({path.name} is one of such a folder's files: {flag} {shlex.quote(str(path.parent))})"

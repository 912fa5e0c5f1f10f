"""The one exception type for mistakes a user can fix, and what a check that passed found.

The CLI prints a ``QerlError`` as a short red message and exits 2; anything else is a bug and
exits 1 (with a traceback under ``--debug``). The checks each stage makes before any work (``train``,
``quantize``, ``eval``; ``--dry-run`` lists them) raise a ``QerlError`` when they fail and return a
:class:`Checked` when they pass.
"""

from dataclasses import dataclass


class QerlError(Exception):
    """A user-facing error: the message says what was wrong and what to do about it."""


@dataclass(frozen=True)
class Checked:
    """One check that passed: what was checked, and what was found."""

    what: str
    found: str

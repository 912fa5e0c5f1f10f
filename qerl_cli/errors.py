"""The one exception type for mistakes a user can fix.

The CLI prints a ``QerlError`` as a short red message and exits 2; anything else is a bug and
exits 1 (with a traceback under ``--debug``).
"""


class QerlError(Exception):
    """A user-facing error: the message says what was wrong and what to do about it."""

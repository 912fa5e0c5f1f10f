"""The grading worker process (see :mod:`qerl_cli.rewards.pool`).

Protocol over stdin/stdout, in ``multiprocessing.connection`` frames: the first message is the
grade function's import path; the worker answers ``READY``, then for every ``(index, completion,
gold)`` it sends ``(index, GradeResult)``; ``None`` or a closed pipe ends it.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.rewards.grading import GradeResult

READY = "ready"
SYS_PATH_ENV = "QERL_GRADER_SYS_PATH"


def resolve_callable(ref: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function (a QerlError says what is wrong)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise QerlError(f"'{ref}' is not an import path: write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise QerlError(f"cannot import module '{module_name}' named in '{ref}': {exc}") from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise QerlError(f"module '{module_name}' has no attribute '{attr}' (from '{ref}')") from None
    if not callable(target):
        raise QerlError(f"'{ref}' is not callable")
    return target


def _serve(inbox: Connection, outbox: Connection) -> None:
    fn = resolve_callable(inbox.recv())
    # Import math-verify and warm its caches before READY: the first item's clock must not pay it.
    importlib.import_module("qerl_cli.rewards._preload")
    outbox.send(READY)
    while True:
        try:
            message = inbox.recv()
        except (EOFError, OSError):
            return  # the parent went away
        if message is None:
            return
        index, completion, gold = message
        try:
            value = fn(completion, gold)
            if not isinstance(value, GradeResult):  # a plain bool grader
                value = GradeResult(bool(value), None, "none", extraction_failed=False)
            result = value
        except Exception as exc:  # a grader bug must not take the pool down; the item scores 0
            result = GradeResult(False, None, "none", False, error=f"grader error: {exc!r}")
        outbox.send((index, result))


def main() -> None:
    # Ctrl-C reaches the whole process group; the parent handles it and closes the pool, so a
    # worker ignores it instead of printing a traceback mid-item.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    extra_path = json.loads(os.environ.get(SYS_PATH_ENV, "[]"))
    sys.path[:0] = [p for p in extra_path if p not in sys.path]
    # Frames go to the original stdout; anything a grade function prints goes to stderr instead
    # of corrupting the protocol.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    inbox = Connection(os.dup(0), writable=False)
    outbox = Connection(out_fd, readable=False)
    _serve(inbox, outbox)

"""Grade functions that tests hand to the grader pool, which its worker processes import by path.

They live apart from the test modules that use them: a worker imports its grade function's module
when it starts and again each time it is replaced (after a hang or a crash), and those test modules
import torch and transformers (about 4 s of CPU a start), this one nothing heavy.
"""

from __future__ import annotations

import os
import time


def hang_on_some_answers(completion: str, gold: str) -> bool:
    """Never returns for about half of the completions, like SymPy on a pathological expression
    (which half depends only on the text, so a test using it is deterministic)."""
    if sum(map(ord, completion)) % 2 == 0:
        time.sleep(600)
    return False


def hang_if_marked(completion: str, gold: str) -> bool:
    """Hangs on completions marked ``HANG`` (a stand-in for a SymPy blow-up), grades the others."""
    from qerl_cli.rewards.grading import grade

    if "HANG" in completion:
        time.sleep(600)
    return grade(completion, gold)


def crash_on_seven(completion: str, gold: str) -> bool:
    """Kills its own worker process (a segfault in a native library, say)."""
    if "7" in completion:
        os._exit(3)
    return completion.strip() == gold

"""Synthetic arithmetic tasks made in code, for tiny models, tests and ``qerl demo``.

A task name is ``synthetic-<kind>`` (``synthetic-addition``, ``synthetic-subtraction``,
``synthetic-multiplication``, ``synthetic-mixed``, and ``synthetic-wordproblems``: two-digit additions
told as a short story, for small pretrained chat models such as the ``smollm2-135m-instruct`` alias).
Problems are a pure function of ``(name, split, n, seed)``: the same call always returns the same list,
offline.

Train and test never share a problem: every operand pair is assigned to one split by a hash of the
pair, so a held-out evaluation really is held out. Gold answers are plain integers, which
math-verify parses directly.

:func:`reference_completion` writes the answer in the think/answer format the QeRL prompt asks
for; it is what the supervised warm start (``qerl_cli.rl.warmstart``) imitates.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from qerl_cli.data.problem import Problem
from qerl_cli.errors import QerlError

PREFIX = "synthetic-"
SPLITS = ("train", "test")
# One pair in TEST_SHARE goes to the test split: enough held-out pairs for an evaluation while the
# training pool stays large.
TEST_SHARE = 8


@dataclass(frozen=True)
class ArithmeticTask:
    symbol: str
    first: range
    second: range
    apply: Callable[[int, int], int]


TASKS: dict[str, ArithmeticTask] = {
    "addition": ArithmeticTask("+", range(10, 100), range(10), lambda a, b: a + b),
    "subtraction": ArithmeticTask("-", range(10, 100), range(10), lambda a, b: a - b),
    "multiplication": ArithmeticTask("*", range(13), range(13), lambda a, b: a * b),
}
MIXED = "mixed"
WORD = "wordproblems"
# (story, unit): "{name}" and the two numbers are filled in; the answer is always a + b.
WORD_TEMPLATES = (
    ("{name} has {a} apples and picks {b} more. How many apples does {name} have now?", "apples"),
    ("A shelf holds {a} books. {name} puts {b} more books on it. How many books are on the shelf?", "books"),
    ("{name} walked {a} minutes in the morning and {b} minutes in the evening. How many minutes did "
     "{name} walk in total?", "minutes"),
    ("There are {a} red marbles and {b} blue marbles in a bag. How many marbles are in the bag?", "marbles"),
    ("{name} scored {a} points in the first game and {b} points in the second. What is the total score?",
     "points"),
    ("A farm has {a} chickens. It buys {b} more chickens. How many chickens does the farm have?",
     "chickens"),
    ("{name} saved {a} dollars in May and {b} dollars in June. How many dollars did {name} save?",
     "dollars"),
    ("A bus carries {a} people. At the next stop {b} more people get on and nobody gets off. How many "
     "people are on the bus?", "people"),
)  # fmt: skip
WORD_NAMES = ("Mia", "Leo", "Ava", "Sam", "Noah", "Zoe", "Omar", "Lena")
WORD_OPERANDS = range(10, 100)


def task_names() -> list[str]:
    return [PREFIX + kind for kind in (*TASKS, MIXED, WORD)]


def is_synthetic(name: str) -> bool:
    return name.startswith(PREFIX)


def _split_of(kind: str, a: int, b: int) -> str:
    # A hash, not the RNG: the split of a pair must not depend on the seed or on n.
    digest = hashlib.sha256(f"{kind}:{a}:{b}".encode()).digest()
    return "test" if digest[0] % TEST_SHARE == 0 else "train"


def _pool(kind: str, split: str) -> list[tuple[str, int, int]]:
    if kind == WORD:
        return [(kind, a, b) for a in WORD_OPERANDS for b in WORD_OPERANDS if _split_of(kind, a, b) == split]
    task = TASKS[kind]
    return [(kind, a, b) for a in task.first for b in task.second if _split_of(kind, a, b) == split]


def _word_problem(index: int, a: int, b: int, split: str) -> Problem:
    # The story and the name are a function of the pair, so a problem never changes between runs.
    digest = hashlib.sha256(f"{WORD}-story:{a}:{b}".encode()).digest()
    story, unit = WORD_TEMPLATES[digest[1] % len(WORD_TEMPLATES)]
    return Problem(
        id=f"{WORD}-{split}-{index}",
        question=story.format(name=WORD_NAMES[digest[2] % len(WORD_NAMES)], a=a, b=b),
        answer=str(a + b),
        meta={"task": WORD, "a": a, "b": b, "op": "+", "unit": unit},
    )


def _problem(index: int, kind: str, a: int, b: int, split: str) -> Problem:
    if kind == WORD:
        return _word_problem(index, a, b, split)
    task = TASKS[kind]
    return Problem(
        id=f"{kind}-{split}-{index}",
        question=f"What is {a} {task.symbol} {b}?",
        answer=str(task.apply(a, b)),
        meta={"task": kind, "a": a, "b": b, "op": task.symbol},
    )


def make_problems(name: str, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
    """``n`` distinct problems of task ``name`` from ``split`` (all of the split when ``n`` is None),
    in a seeded random order."""
    if not is_synthetic(name):
        raise QerlError(f"'{name}' is not a synthetic task; choose one of {', '.join(task_names())}")
    kind = name[len(PREFIX) :]
    if kind not in (MIXED, WORD) and kind not in TASKS:
        raise QerlError(f"unknown synthetic task '{name}'; choose one of {', '.join(task_names())}")
    if split not in SPLITS:
        raise QerlError(f"synthetic tasks have splits {SPLITS}, got '{split}'")
    kinds = list(TASKS) if kind == MIXED else [kind]
    pool = [item for k in kinds for item in _pool(k, split)]
    # The seed string includes the name and split so that two tasks never share an order.
    rng = random.Random(f"{name}:{split}:{seed}")
    rng.shuffle(pool)
    if n is not None:
        if n < 0:
            raise QerlError(f"number of synthetic problems must be >= 0, got {n}")
        if n > len(pool):
            raise QerlError(f"'{name}' has {len(pool)} {split} problems; asked for {n}")
        pool = pool[:n]
    return [_problem(i, k, a, b, split) for i, (k, a, b) in enumerate(pool)]


def reference_completion(problem: Problem, answer: str | None = None) -> str:
    """The worked answer in the QeRL output format: ``<think>...</think><answer>...</answer>``.

    ``answer`` replaces the gold result (the warm start uses it to write deliberately wrong work).
    """
    meta = problem.meta
    if "a" not in meta or "op" not in meta:
        raise QerlError(f"problem {problem.id} is not a synthetic arithmetic problem")
    result = problem.answer if answer is None else answer
    return f"<think>{meta['a']} {meta['op']} {meta['b']} = {result}</think><answer>{result}</answer>"

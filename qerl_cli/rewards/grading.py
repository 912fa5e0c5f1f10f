"""Answer correctness with math-verify: gold parsed first, then the extracted answer.

The original QeRL GSM8K scorer compared the extracted answer with the gold one character at a
time (``zip`` over two strings), so gold "12" matched the answer "1". Here both sides become
SymPy objects (or normalised strings) and math-verify compares them: "1,000" = "1000",
"\\frac{1}{2}" = "0.5" = "1/2", "25\\%" = "25", "\\dfrac{\\sqrt3}{2}" = "\\frac{\\sqrt{3}}{2}".

math-verify also evaluates what it reads, and reads generously: "50 + 83" equals gold 133, and so do
numbers side by side ("50 83", which its LaTeX parser adds up; "2 1/2" reads as 3/2) and numbers with
a stray math delimiter between them ("50 $ 83"). GRPO on word problems finds each of these within tens
of steps and is then paid for answering every question with its two numbers (the ablation that showed
it: ``docs/rewards.md``). So where the gold answer is a number, the answer must be one number
(:func:`not_one_number`): the value after its last "=" holds exactly one numeral, a fraction of two
integers or a number with comma thousands separators counting as one ("1,000 dollars"), and an integer
gold takes no fraction. Units and prose around it ("72 apples") are left to math-verify. A mixed
number ("3 \\frac{1}{2}") counts as two: math-verify reads the juxtaposition as a sum, which is the hack.

:func:`grade` has no timeout of its own beyond math-verify's signal alarms (used only on the main
thread); the hard limit is the worker pool in :mod:`qerl_cli.rewards.pool`, which kills a stuck
worker. Call :func:`is_correct` directly only for a few trusted strings.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Any

from qerl_cli.errors import QerlError
from qerl_cli.rewards.extract import (
    Extraction,
    ExtractionMethod,
    clean_candidate,
    extract_structured,
    normalize_prose,
)

# math-verify logs a warning when its own signal timeouts are off, and again for every parse
# failure of malformed model output; neither helps a user reading training logs.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# math-verify's own alarm-based limit (seconds, whole numbers) when running on the main thread.
SOFT_TIMEOUT_S = 5


def require_math_verify() -> None:
    """Refuse, before any model or GPU work, a Python that cannot import math-verify: otherwise each
    grader worker dies at start-up and the pool can only report an exit code."""
    if importlib.util.find_spec("math_verify") is None:
        raise QerlError(
            f"the math grader needs math-verify, which this Python ({sys.executable}) cannot import: "
            "pip install 'math-verify>=0.8' (a qerl dependency; where vLLM comes as a separate bundle, "
            "install it there too)"
        )


@dataclass(frozen=True)
class GradeResult:
    correct: bool
    # The answer text that was graded (after extraction); None when nothing was found.
    extracted: str | None
    method: ExtractionMethod
    # Nothing parseable: no answer found, or math-verify could not read it.
    extraction_failed: bool
    timed_out: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def timeout(cls) -> GradeResult:
        return cls(False, None, "none", extraction_failed=False, timed_out=True, error="grader timeout")


# A fraction of two integers, "3/4" or "\\frac{-1}{2}": one number, in a gold answer and in an answer.
_FRACTION_PATTERN = r"\d+\s*/\s*\d+|\\[dt]?frac\{-?\d+\}\{-?\d+\}"
# A gold answer that is one number: an integer or decimal (sign allowed), or a fraction of two integers.
_NUMBER_LITERAL = re.compile(rf"^\s*-?(?:\d+(?:\.\d+)?|{_FRACTION_PATTERN})\s*$")
_INTEGER_LITERAL = re.compile(r"^\s*-?\d+\s*$")
# Counting the numbers of an answer to a numeric gold. A fraction of integers is one number (its numerator
# or denominator may be negative); so is a decimal, and a number with comma thousands separators, which
# math-verify reads as one ("90,160 apples" is 90160). Other separators are not joined here: math-verify
# adds "94\\,158 apples" up to 252, the sum hack again (a lone "1\\,000" was joined by clean_candidate).
# A unit's power ("m^2") is no number.
_FRACTION = re.compile(_FRACTION_PATTERN)
_GROUPED = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)")
_UNIT_POWER = re.compile(r"(?<=[A-Za-z}])\^\{?\d+\}?")
_NUMERAL = re.compile(r"\d+(?:\.\d+)?")


def is_number_literal(text: str) -> bool:
    """Whether ``text`` is one number as written: "133", "-2.5", "1/2", "\\frac{3}{4}"."""
    return bool(_NUMBER_LITERAL.match(text))


def not_one_number(answer: str, *, integer_gold: bool = False) -> bool:
    """Whether the answer's value (after its last "=", a trailing one aside) holds other than exactly one
    number: a calculation left undone ("94 + 58", "6 \\times 4", "10^3", "x = 20 + 4"), numbers side by
    side ("90 16", "88 $ 75", "94\\frac{58}{1}", a mixed number "2 1/2") or none; for an ``integer_gold``
    also a fraction ("304/2": a division left undone). "152", "-2.5", "1/2", "\\frac{-1}{2}", "1,000
    dollars", "25 m^2" and "94 + 58 = 152" hold one."""
    value = answer.strip().rstrip("=").rsplit("=", 1)[-1]  # "... = 110 =": 110
    value = _UNIT_POWER.sub(" ", _GROUPED.sub(" 1 ", value))
    fractions = len(_FRACTION.findall(value))
    numerals = len(_NUMERAL.findall(_FRACTION.sub(" ", value)))
    return fractions + numerals != 1 or (integer_gold and fractions > 0)


def _soft_timeout() -> int | None:
    # signal.alarm only works on the main thread; elsewhere math-verify would raise.
    return SOFT_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(text: str, *, anchored_only: bool = False) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    if anchored_only:
        config = [
            LatexExtractionConfig(try_extract_without_anchor=False, boxed_match_priority=-1),
            ExprExtractionConfig(try_extract_without_anchor=False),
        ]
        return parse(text, extraction_config=config, parsing_timeout=_soft_timeout())
    return parse(text, parsing_timeout=_soft_timeout())


def _has_free_symbols(parsed: list) -> bool:
    value = parsed[0] if parsed else None
    return bool(getattr(value, "free_symbols", None))


def parse_answer(text: str) -> list:
    """Parse an extracted answer string (no delimiters needed): "\\frac{1}{2}", "1/2", "72 apples".

    Wrapping in ``\\boxed{}`` makes math-verify read the whole string as LaTeX. Prose left in the
    answer ("72 dollars") then parses into a product of one-letter symbols; in that case the plain
    parse, which picks the expression out of the text, is used instead.
    """
    boxed = _parse(f"\\boxed{{{text}}}")
    if boxed and not _has_free_symbols(boxed):
        return boxed
    plain = _parse(text)
    return plain or boxed


def _verify(gold_parsed: list, answer_parsed: list) -> bool:
    from math_verify import verify

    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=_soft_timeout()))


def extract(completion: str) -> Extraction:
    """The structured extraction, then math-verify's anchored phrases ("the answer is 7")."""
    found = extract_structured(completion)
    if found.method != "none":
        return found
    anchored = _parse(normalize_prose(completion), anchored_only=True)
    if anchored:
        # math-verify's matched text can carry what follows the number ("72**." before the prose
        # was normalised, "72." at a sentence end): cleaned like any other extracted answer.
        return Extraction(clean_candidate(str(anchored[-1])) or None, "anchor")
    return Extraction(None, "none")


def grade(completion: str, gold: str) -> GradeResult:
    """Grade one completion against one gold answer ("72", "\\frac{1}{2}", "$x^2$"; parsed first)."""
    gold_text = clean_candidate(str(gold))
    found = extract(completion)
    if found.text is None:
        return GradeResult(False, None, found.method, extraction_failed=True)
    integer_gold = bool(_INTEGER_LITERAL.match(gold_text))
    if integer_gold and _INTEGER_LITERAL.match(found.text):
        # Two integers as written: math-verify reads both as exact SymPy integers (leading zeros and a
        # minus zero included) and compares their values, which int() does without its parse, the
        # milliseconds of each grade (most of the grading in arithmetic training and evaluation).
        return GradeResult(
            int(found.text) == int(gold_text), found.text, found.method, extraction_failed=False
        )
    gold_parsed = parse_answer(gold_text)
    if is_number_literal(gold_text) and not_one_number(found.text, integer_gold=integer_gold):
        return GradeResult(False, found.text, found.method, extraction_failed=False)  # no need to parse it
    answer_parsed = parse_answer(found.text)
    if not answer_parsed:
        return GradeResult(False, found.text, found.method, extraction_failed=True)
    if not gold_parsed:
        # A gold answer math-verify cannot read is a data problem, not the model's failure to answer.
        return GradeResult(False, found.text, found.method, False, error=f"unparseable gold answer {gold!r}")
    return GradeResult(_verify(gold_parsed, answer_parsed), found.text, found.method, extraction_failed=False)


def is_correct(completion: str, gold: str) -> bool:
    """True when the completion's final answer equals ``gold`` mathematically.

    In-process and without a hard timeout: training and evaluation grade through
    :class:`qerl_cli.rewards.pool.Grader`, which runs this in killable worker processes.
    """
    return grade(completion, gold).correct

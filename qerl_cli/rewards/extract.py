"""Find the final answer inside a completion, before any math parsing.

Order (the first that applies wins):

1. the last complete ``<answer>...</answer>`` block (the QeRL output format); when it holds a
   ``\\boxed{}``, the last boxed content inside it;
2. the last ``\\boxed{...}`` (or ``\\fbox{...}``) anywhere, braces balanced;
3. an anchored phrase ("the answer is 72", "Final answer: 72"), found by math-verify in
   :mod:`qerl_cli.rewards.grading`;
4. the whole completion when it is a bare short answer ("72", "1/2"), as tiny models answer.

There is deliberately no "last number anywhere" fallback: it hands credit to truncated or
rambling completions that mention the right number on the way, which inflates accuracy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ExtractionMethod = Literal["answer_tag", "boxed", "anchor", "bare", "none"]

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOX_COMMANDS = ("\\boxed", "\\fbox")
# A number written with thousands separators and nothing else: "1,000", "$12,345.50", "1,000\%".
_THOUSANDS_NUMBER = re.compile(r"^\s*(\\?\$)?\s*-?\d{1,3}(,\d{3})+(\.\d+)?\s*(\\?%)?\s*$")
# What a bare answer may look like: one short line without sentence words.
BARE_ANSWER_MAX_CHARS = 40
_WORD = re.compile(r"[A-Za-z]{2,}")


@dataclass(frozen=True)
class Extraction:
    """The answer text to parse, and where it came from (``method`` "none": nothing found)."""

    text: str | None
    method: ExtractionMethod


def extract_answer_tag(completion: str) -> str | None:
    """Content of the last complete ``<answer>...</answer>`` block, stripped; None if there is none."""
    blocks = _ANSWER_BLOCK.findall(completion)
    return blocks[-1].strip() if blocks else None


def extract_last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}``, with nested braces balanced.

    A box whose braces never close (a truncated completion) is ignored, as is ``\\boxed`` used
    without braces.
    """
    starts = [m.end() for cmd in _BOX_COMMANDS for m in re.finditer(re.escape(cmd) + r"\s*\{", text)]
    for start in sorted(starts, reverse=True):
        content = _balanced_content(text, start)
        if content is not None:
            return content.strip()
    return None


def _balanced_content(text: str, start: int) -> str | None:
    """Text from ``start`` (just after an opening brace) up to its matching closing brace."""
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # an escaped brace (\{ or \}) is literal text, not nesting
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def strip_math_delimiters(text: str) -> str:
    """``$x$``, ``$$x$$``, ``\\(x\\)``, ``\\[x\\]`` -> ``x`` (only when they wrap the whole text)."""
    t = text.strip()
    for left, right in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$")):
        if len(t) > len(left) + len(right) and t.startswith(left) and t.endswith(right):
            inner = t[len(left) : -len(right)]
            # "$5 and $6" is not one delimited expression
            if left == "$" and "$" in inner:
                continue
            return inner.strip()
    return t


def normalize_thousands(text: str) -> str:
    """Drop thousands separators from a lone number ("1,000" -> "1000").

    Only when the whole text is one such number: "1,2,3" stays a list and "(1,000)" is left alone,
    since commas inside other expressions separate elements.
    """
    if _THOUSANDS_NUMBER.match(text):
        return text.replace(",", "")
    return text


def clean_candidate(text: str) -> str:
    return normalize_thousands(strip_math_delimiters(text))


def looks_bare(completion: str) -> bool:
    """True when the whole completion is a short answer with no prose around it."""
    t = completion.strip()
    if not t or len(t) > BARE_ANSWER_MAX_CHARS or "\n" in t:
        return False
    if any(cmd in t for cmd in _BOX_COMMANDS) or "<answer>" in t:
        return False  # an unclosed box or answer tag is a truncated answer, not a bare one
    # \frac, \sqrt and friends are LaTeX, not words
    without_commands = re.sub(r"\\[A-Za-z]+", "", t)
    return _WORD.search(without_commands) is None


def extract_structured(completion: str) -> Extraction:
    """Steps 1, 2 and 4 of the module docstring (step 3 needs math-verify and lives in grading)."""
    tagged = extract_answer_tag(completion)
    if tagged is not None:
        boxed_inside = extract_last_boxed(tagged)
        text = boxed_inside if boxed_inside is not None else tagged
        return Extraction(clean_candidate(text) or None, "answer_tag")
    boxed = extract_last_boxed(completion)
    if boxed is not None:
        return Extraction(clean_candidate(boxed) or None, "boxed")
    if looks_bare(completion):
        return Extraction(clean_candidate(completion), "bare")
    return Extraction(None, "none")

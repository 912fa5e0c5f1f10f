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

The text found is then normalised (:func:`clean_candidate`) before math-verify compares it, so that
the way an answer is *written* does not decide its grade: trailing sentence punctuation ("72."),
markdown emphasis or code marks ("**72**", "`72`"), math delimiters ("$72$") and thousands
separators in a lone number ("1,000", "1 000", "1\\,000", "1{,}000", a thin space) are removed.
Only what cannot change the value is removed: "72.5" stays 72.5, "72!" stays a factorial, "1,2"
stays a list and "7 2" stays two numbers (graded wrong against 72 and against 14).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ExtractionMethod = Literal["answer_tag", "boxed", "anchor", "bare", "none"]

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOX_COMMANDS = ("\\boxed", "\\fbox")
# Thousands separators: a comma, LaTeX spacing (\, \; \: "\ " ~) or the braced comma {,}, and the
# plain, no-break, thin and narrow no-break spaces.
_GROUP_SEPARATOR = r"(?:,|\\[,;: ]|~|\{,\}|[ \u00a0\u2009\u202f])"
# A number written with thousands separators and nothing else: "1,000", "$12,345.50", "1 000\%",
# "1\,000". One separator throughout (the backreference), groups of exactly three digits.
_THOUSANDS_NUMBER = re.compile(
    rf"^\s*(?P<currency>\\?\$)?\s*(?P<sign>-?)"
    rf"(?P<integer>\d{{1,3}}(?P<sep>{_GROUP_SEPARATOR})\d{{3}}(?:(?P=sep)\d{{3}})*)"
    rf"(?P<fraction>\.\d+)?\s*(?P<percent>\\?%)?\s*$"
)
# Inside prose (the anchored phrase), only separators that are never anything else join digits:
# LaTeX spacing, {,} and the no-break / thin spaces. A comma or a plain space there may separate
# two numbers, and math-verify already reads "1,000" in prose.
_PROSE_GROUP_SEPARATOR = re.compile(r"(?<=\d)(?:\\[,;: ]|\{,\}|[\u00a0\u2009\u202f])(?=\d{3}(?!\d))")
# Sentence punctuation after an answer ("72.", "1/2;"). "!" is not among them: "5!" is a factorial.
_TRAILING_PUNCTUATION = re.compile(r"(?<!\\)[\s.,;:?]+$")  # "\," is LaTeX spacing
# Markdown marks around a whole answer: **x**, __x__, *x*, _x_, `x`, ```x```.
_WRAPPING_MARKS = ("```", "**", "__", "`", "*", "_")
# The same marks around a span inside prose, as markdown reads them: no space just inside the
# marks and no word character just outside, so "3*4*5" and "a_1_b" are left alone.
_PROSE_EMPHASIS = re.compile(
    r"(?<![\w*`\\^])(?P<mark>\*\*|__|\*|_|`)(?=[^\s*_`])(?P<body>[^\n*_`]+?)(?<=[^\s*_`])(?P=mark)(?![\w*`])"
)
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
    """Drop thousands separators from a lone number ("1,000", "1 000", "1\\,000" -> "1000").

    Only when the whole text is one such number, with one kind of separator and groups of three
    digits: "1,2,3" stays a list, "7 2" stays two numbers and "(1,000)" is left alone, since commas
    inside other expressions separate elements.
    """
    match = _THOUSANDS_NUMBER.match(text)
    if match is None:
        return text
    digits = re.sub(r"\D", "", match.group("integer"))
    sign = (match.group("currency") or "") + match.group("sign")
    return sign + digits + (match.group("fraction") or "") + (match.group("percent") or "")


def strip_markdown(text: str) -> str:
    """``**x**``, ``__x__``, ``*x*``, ``_x_``, `` `x` `` -> ``x`` (only when they wrap the whole text)."""
    t = text.strip()
    for mark in _WRAPPING_MARKS:
        if len(t) > 2 * len(mark) and t.startswith(mark) and t.endswith(mark):
            return t[len(mark) : -len(mark)].strip()
    return t


def strip_trailing_punctuation(text: str) -> str:
    """``72.`` -> ``72``, ``1/2;`` -> ``1/2``; a decimal point followed by digits is never touched."""
    return _TRAILING_PUNCTUATION.sub("", text)


def clean_candidate(text: str) -> str:
    """The extracted answer as math-verify should read it (see the module docstring)."""
    previous = None
    t = text.strip()
    while t != previous:  # "**$72$**." needs several passes, in whichever order the marks nest
        previous = t
        t = strip_math_delimiters(strip_markdown(strip_trailing_punctuation(t)))
    return normalize_thousands(t)


def normalize_prose(text: str) -> str:
    """A completion prepared for math-verify's anchored phrases ("The answer is **1\\,000**.").

    Markdown marks around a span are dropped and digit groups joined across separators that never
    mean anything else, so the phrase's number is read whole.
    """
    unmarked = _PROSE_EMPHASIS.sub(lambda m: m.group("body"), text)
    return _PROSE_GROUP_SEPARATOR.sub("", unmarked)


def cut_at_stop(completion: str, stop: Sequence[str]) -> str:
    """The completion before the first of the prompt template's stop strings, which one engine keeps at
    the end of its text (transformers) and another drops (vLLM): training and evaluation grade alike."""
    for marker in stop:
        cut = completion.find(marker) if marker else -1
        if cut >= 0:
            completion = completion[:cut]
    return completion


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

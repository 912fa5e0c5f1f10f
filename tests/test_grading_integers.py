"""The grader's fast path for an integer answer to an integer gold: the same verdicts as math-verify."""

from __future__ import annotations

import pytest

from qerl_cli.rewards import grading
from qerl_cli.rewards.grading import grade

PAIRS = [
    ("7", "7"), ("7", "07"), ("7", "007"), ("0", "-0"), ("-0", "0"), ("00", "0"), ("10", "010"),
    ("12", "13"), ("-5", "5"), ("-5", "-5"), ("1000000", "1000001"), ("133", "1330"),
    ("123456789012345", "123456789012346"), ("99999999999999999999", "99999999999999999998"),
]  # fmt: skip


@pytest.mark.parametrize(("gold", "answer"), PAIRS)
def test_integer_answers_grade_as_math_verify_reads_them(gold: str, answer: str) -> None:
    slow = grading._verify(grading.parse_answer(gold), grading.parse_answer(answer))
    result = grade(f"<answer>{answer}</answer>", gold)
    assert result.correct == slow
    assert (result.extracted, result.extraction_failed) == (answer, False)


def test_integer_answers_skip_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> list:
        raise AssertionError("math-verify parsed an integer answer to an integer gold")

    monkeypatch.setattr(grading, "parse_answer", refuse)
    assert grade("<answer>47</answer>", "47").correct
    assert not grade("<answer>48</answer>", "47").correct
    # Anything else is math-verify's to read.
    with pytest.raises(AssertionError, match="math-verify parsed"):
        grade("<answer>47.0</answer>", "47")

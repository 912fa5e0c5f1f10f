"""A correct answer is graded correct however it is written, and a wrong one stays wrong.

Each kind of writing (sentence punctuation, markdown marks, thousands separators) has cases in each
place an answer is found (answer tag, box, anchored phrase, bare answer) and negatives next to them.
"""

from __future__ import annotations

import pytest

from qerl_cli.rewards import grade
from qerl_cli.rewards.extract import clean_candidate, normalize_prose, normalize_thousands

THIN_SPACE = "\u2009"
NARROW_NO_BREAK_SPACE = "\u202f"


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        # trailing sentence punctuation (math-verify reads "72." as text)
        ("<answer>72.</answer>", "72"),
        ("<answer>-3.</answer>", "-3"),
        ("<answer>0.5.</answer>", "\\frac{1}{2}"),
        ("<answer>72 apples.</answer>", "72"),
        ("<answer>x = 72;</answer>", "72"),
        ("72.", "72"),  # bare
        ("\\boxed{72.}", "72"),
        # markdown emphasis and code marks
        ("<answer>**72**</answer>", "72"),
        ("<answer>*72*</answer>", "72"),
        ("<answer>__72__</answer>", "72"),
        ("<answer>`72`</answer>", "72"),
        ("<answer>**$72$**.</answer>", "72"),  # nested, in whichever order
        ("<answer>**72.**</answer>", "72"),
        ("**72**", "72"),  # bare
        ("The answer is **72**.", "72"),  # anchored phrase: math-verify alone reads "72**."
        ("The answer is *72*.", "72"),
        ("The answer is `72`.", "72"),
        ("**Answer:** 72", "72"),
        # thousands separators: LaTeX spacing, thin spaces, plain spaces, commas, {,}
        ("\\boxed{1\\,000}", "1000"),  # math-verify alone reads 0
        ("<answer>1\\ 000</answer>", "1000"),
        ("<answer>1{,}000</answer>", "1000"),
        (f"<answer>1{THIN_SPACE}000</answer>", "1000"),
        (f"<answer>1{NARROW_NO_BREAK_SPACE}000{NARROW_NO_BREAK_SPACE}000</answer>", "1000000"),
        ("<answer>1 000</answer>", "1000"),
        ("<answer>12 345</answer>", "12345"),
        ("<answer>1,000,000</answer>", "1000000"),
        ("<answer>$1\\,000$</answer>", "1000"),
        ("<answer>-1\\,000.5</answer>", "-1000.5"),
        ("1 000", "1000"),  # bare
        ("The answer is 1\\,000.", "1000"),  # math-verify alone reads 1
        (f"The answer is 1{THIN_SPACE}000.", "1000"),
        ("The answer is 1,000.", "1000"),
        ("The answer is **1\\,000**.", "1000"),
    ],
)
def test_a_correct_answer_is_correct_however_it_is_written(completion: str, gold: str) -> None:
    result = grade(completion, gold)
    assert result.correct, result


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("<answer>72.5</answer>", "72"),  # a decimal point followed by digits is part of the number
        ("<answer>72.5.</answer>", "72"),
        ("<answer>**72.5**</answer>", "72"),
        ("<answer>72!</answer>", "72"),  # "!" is a factorial, not punctuation
        ("<answer>**73**</answer>", "72"),
        ("The answer is **73**.", "72"),
        ("<answer>7 2</answer>", "72"),  # two numbers, neither 72 ...
        ("<answer>7 2</answer>", "14"),  # ... nor their product
        ("<answer>1,2</answer>", "12"),  # a list, not twelve
        ("<answer>1,00</answer>", "100"),  # groups of three digits only
        ("<answer>1,000 000</answer>", "1000000"),  # one kind of separator per number
        ("<answer>12,3456</answer>", "123456"),
        ("\\boxed{1\\,000}", "1"),
        ("\\boxed{1\\,000}", "0"),
        ("The answer is 1\\,000.", "1"),
        ("The answer is 1\\,0000.", "10000"),  # not a thousands group: left alone, not read as 10000
    ],
)
def test_a_wrong_answer_stays_wrong(completion: str, gold: str) -> None:
    result = grade(completion, gold)
    assert not result.correct, result


def test_factorial_and_lists_keep_their_meaning() -> None:
    assert grade("<answer>5!</answer>", "120").correct
    assert grade("<answer>1,2</answer>", "1,2").correct
    # Single stars between digits are products, not markdown: kept, and equal to a symbolic gold; for a
    # numeric gold the product is a calculation left undone (below).
    assert grade("<answer>3*4*5</answer>", "3 \\cdot 4 \\cdot 5").correct
    assert grade("<answer>3*4*5</answer>", "60").extracted == "3*4*5"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("72.", "72"),
        ("72.5", "72.5"),
        ("72...", "72"),
        ("**`72`**", "72"),
        ("$72$.", "72"),
        ("\\frac{1}{2};", "\\frac{1}{2}"),
        ("72\\,", "72\\,"),  # a trailing LaTeX space is not a comma to strip
        ("z^*", "z^*"),  # a conjugate's star is not markdown
        ("1\\;000", "1000"),
        ("1~000", "1000"),
        ("\\$1,000", "\\$1000"),
        ("1 000\\%", "1000\\%"),
        ("7 2", "7 2"),
        ("1,2,3", "1,2,3"),
        ("(1,000)", "(1,000)"),
    ],
)
def test_clean_candidate(text: str, expected: str) -> None:
    assert clean_candidate(text) == expected


def test_thousands_need_one_separator_and_groups_of_three() -> None:
    assert normalize_thousands("1,234,567") == "1234567"
    assert normalize_thousands("1,234 567") == "1,234 567"
    assert normalize_thousands("1234,567") == "1234,567"
    assert normalize_thousands("-12 345.25") == "-12345.25"


def test_prose_keeps_products_and_plain_spaces() -> None:
    assert normalize_prose("so 3*4*5 = 60 and a_1_b") == "so 3*4*5 = 60 and a_1_b"
    assert normalize_prose("The answer is **72**.") == "The answer is 72."
    # a plain space in prose can separate two numbers ("add 12 345 times"): left to math-verify
    assert normalize_prose("from 12 345 up") == "from 12 345 up"
    assert normalize_prose("has 1\\,000\\,000 and 2\\,5") == "has 1000000 and 2\\,5"


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        # Gemma 3 270M's hack under GRPO (2026-11-24): the sum stated, not computed; math-verify evaluates it
        (" 94 + 58 = 18. The answer is 94 + 58.\n\nQuestion:", "152"),
        ("The answer is 50 + 83.", "133"),
        ("\\boxed{6 \\times 4}", "24"),
        ("<answer>6*4</answer>", "24"),
        ("\\boxed{x = 20 + 4}", "24"),  # an equation whose result side is still a sum
        ("\\boxed{10^3}", "1000"),
        ("The answer is (50) - (8).", "42"),
        # Gemma's NF4 LoRA's hack (2026-11-24): the question's two numbers, which math-verify adds up
        (" 90 16", "106"),
        ("\\boxed{84 29}", "113"),
        ("<answer>3 4 5</answer>", "12"),
        ("\\boxed{x = 90\\,16}", "106"),
        ("\\boxed{2 1/2}", "5/2"),  # a mixed number: math-verify reads it as 3/2
        # ... and its second (2026-11-24): a stray math delimiter between them, "88 $ 75" read as 163
        (" 88 $ 75", "163"),
        ("<answer>50 $ 83</answer>", "133"),
        ("\\boxed{50 \\text{ and } 83}", "133"),
        ("\\boxed{94\\frac{58}{1}}", "152"),  # a mixed number of the two: read as their sum
        ("<answer>3 \\frac{1}{2}</answer>", "3.5"),  # a mixed number is two numbers (see grading.py)
        ("\\boxed{\\frac{1}{2}\\frac{1}{2}}", "0.25"),
        ("<answer>304/2</answer>", "152"),  # an integer gold takes no fraction: a division left undone
        ("<answer>90 160</answer>", "250"),  # read as thousands (90160), not as the sum
        ("<answer>94\\,158 apples</answer>", "252"),  # math-verify sums across a LaTeX thin space
    ],
)
def test_a_calculation_left_for_the_grader_is_not_a_numeric_answer(completion: str, gold: str) -> None:
    result = grade(completion, gold)
    assert not result.correct and not result.extraction_failed, result


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("94 + 58 = 152. The answer is 152.", "152"),  # working shown, then the number
        ("\\boxed{94 + 58 = 152}", "152"),  # an equation ending in its result
        ("The answer is 1/2.", "0.5"),  # a fraction of integers is a number
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
        ("The answer is -5.", "-5"),
        ("\\boxed{1+\\sqrt{2}}", "1+\\sqrt{2}"),  # a gold that is an expression takes expressions
        ("\\boxed{2 + 2\\sqrt{3}}", "2(1+\\sqrt{3})"),
        (" 12 345", "12345"),  # thousands groups are one number, not numbers side by side
        ("The answer is 1 000.", "1000"),
        ("\\boxed{1\\,000\\,000}", "1000000"),
        ("<answer>72 apples</answer>", "72"),  # one number with its unit
        (" 20 + 90 = 110 =", "110"),  # a trailing "=" leaves the value before it
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("The answer is 0.5.", "1/2"),
        ("<answer>1,000 dollars</answer>", "1000"),  # thousands groups with a unit: one number
        ("<answer>$1,200 per month</answer>", "1200"),
        ("<answer>1,000.5 dollars</answer>", "1000.5"),
        ("<answer>25 m^2</answer>", "25"),  # a unit's power is not a number
        ("\\boxed{\\frac{-1}{2}}", "-0.5"),
    ],
)
def test_numbers_and_symbolic_answers_stay_correct(completion: str, gold: str) -> None:
    assert grade(completion, gold).correct


def test_cut_at_stop_ignores_an_empty_stop_string() -> None:
    from qerl_cli.rewards.extract import cut_at_stop

    assert cut_at_stop(" 12\nQuestion: next", ("", "\nQuestion:")) == " 12"
    assert cut_at_stop(" 12", ("",)) == " 12"

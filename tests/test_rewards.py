"""Rewards: extraction, math-verify correctness, format reward, the timed worker pool."""

from __future__ import annotations

import functools
import signal
import time
from pathlib import Path

import pytest
from cli_runner import run_cli, usage_error

from qerl_cli.config import RewardSection
from qerl_cli.data.problem import Problem
from qerl_cli.errors import QerlError
from qerl_cli.rewards import (
    Grader,
    build_reward_fn,
    extract_answer_tag,
    extract_last_boxed,
    format_reward,
    grade,
    is_correct,
)


# -- hooks the worker processes import by path (module-level on purpose) ----------------------
def hanging_grade(completion: str, gold: str) -> bool:
    """Stands in for a SymPy computation that never returns."""
    if "HANG" in completion:
        time.sleep(600)
    return completion.strip() == gold.strip()


def exploding_grade(completion: str, gold: str) -> bool:
    raise ZeroDivisionError("grader bug")


def length_bonus(completion: str, problem: Problem) -> float:
    return len(completion) / 100


# reward.extra functions the reward cannot call as fn(completion, problem), and some it can.
def one_argument_bonus(completion: str) -> float:
    return len(completion) / 100


def keyword_problem_bonus(completion: str, *, problem: Problem) -> float:
    return 0.0


async def async_bonus(completion: str, problem: Problem) -> float:
    return 0.0


def scaled_bonus(completion: str, problem: Problem, scale: float = 2.0) -> float:
    return scale * len(completion) / 100


def any_bonus(*args: object, **kwargs: object) -> float:
    return 0.0


class Scorer:
    def __call__(self, completion: str, problem: Problem) -> float:
        return 1.0


SCORER = Scorer()
HALF_BONUS = functools.partial(scaled_bonus, scale=0.5)


# -- extraction -------------------------------------------------------------------------------
def test_answer_tag_takes_the_last_complete_block() -> None:
    text = "<answer>1</answer> then <answer> 2 </answer> and <answer>3"
    assert extract_answer_tag(text) == "2"
    assert extract_answer_tag("no tags") is None


def test_boxed_balances_nested_braces_and_takes_the_last() -> None:
    assert extract_last_boxed(r"\boxed{1} and \boxed{\frac{1}{\sqrt{2}}}") == r"\frac{1}{\sqrt{2}}"
    assert extract_last_boxed(r"\fbox{x^{2}}") == "x^{2}"
    # an unclosed (truncated) box is skipped in favour of an earlier complete one
    assert extract_last_boxed(r"\boxed{7} ... \boxed{\frac{1}{2") == "7"
    assert extract_last_boxed("nothing boxed") is None


# -- correctness: the one-character bug of the original GSM8K scorer ---------------------------
@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("<think>..</think><answer>1</answer>", "12"),  # zip("1", "12") compared one character
        ("<answer>12</answer>", "125"),
        ("<answer>125</answer>", "12"),
        ("<answer>-4</answer>", "4"),
        ("<answer>12 or 13</answer>", "12"),  # hedging is not an answer
        ("<answer>\\frac{1}{3}</answer>", "0.33"),
    ],
)
def test_wrong_answers_are_wrong(completion: str, gold: str) -> None:
    assert not is_correct(completion, gold)


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("<think>7*6</think><answer>42</answer>", "42"),
        ("<answer>1,000</answer>", "1000"),  # thousands separators
        ("<answer>$12,345.50$</answer>", "12345.5"),
        ("<answer>10,000,000</answer>", "10000000"),
        ("so the result is \\boxed{\\frac{1}{2}}", "0.5"),  # fractions
        ("<answer>1/2</answer>", "\\frac12"),
        ("<answer>0.5</answer>", "\\frac{1}{2}"),
        ("<answer>25\\%</answer>", "25"),  # percentages
        ("<answer>0.25</answer>", "25\\%"),
        ("<answer>\\dfrac{\\sqrt3}{2}</answer>", "\\frac{\\sqrt{3}}{2}"),  # LaTeX
        ("<answer>\\left( 3, \\frac{\\pi}{2} \\right)</answer>", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("<answer>x = 3</answer>", "3"),
        ("<answer>72 dollars</answer>", "72"),
        ("<answer>The final answer is \\boxed{5}</answer> \\boxed{6}", "5"),  # box inside the tag wins
        ("The answer is 72.", "72"),  # anchored phrase
        ("72", "72"),  # bare answer (tiny models)
        ("<answer>\\$18.00</answer>", "18"),
    ],
)
def test_right_answers_are_right(completion: str, gold: str) -> None:
    assert is_correct(completion, gold)


def test_gold_is_parsed_first_and_symmetric_cases_differ() -> None:
    # GSM8K-style gold with commas is cleaned too
    assert is_correct("<answer>1000</answer>", "1,000")


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "I have no idea",
        "<answer></answer>",
        "<think>2+2 is",  # truncated before any answer
        "\\boxed{\\frac{1}{2",  # truncated box is not a bare answer
        "We add 3 apples and 4 apples and get 7 apples in the basket",  # no anchor: no credit
    ],
)
def test_malformed_output_is_an_extraction_failure(completion: str) -> None:
    result = grade(completion, "7")
    assert not result.correct
    assert result.extraction_failed


def test_grade_reports_where_the_answer_came_from() -> None:
    assert grade("<answer>3</answer>", "3").method == "answer_tag"
    assert grade("thus \\boxed{3}", "3").method == "boxed"
    assert grade("The answer is 3", "3").method == "anchor"
    assert grade(" 3 ", "3").method == "bare"


# -- format -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>7*6=42</think><answer>42</answer>", 1.0),
        ("\n<think>\nwork\n</think>\n<answer>\n42\n</answer>\n", 1.0),
        ("<answer>42</answer>", 0.0),  # no reasoning block
        ("<think>a</think><answer>42</answer> and more text", 0.0),  # trailing text
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),  # two answers
        ("<think>a</think><answer>  </answer>", 0.0),  # empty answer
        ("preamble <think>a</think><answer>1</answer>", 0.0),
        ("<think>a</think><answer>4", 0.0),  # truncated
    ],
)
def test_format_reward(completion: str, expected: float) -> None:
    assert format_reward(completion) == expected


# -- the worker pool ----------------------------------------------------------------------------
def test_pool_grades_in_order() -> None:
    completions = ["<answer>12</answer>", "<answer>1</answer>", "\\boxed{1/2}", "junk words"]
    golds = ["12", "12", "0.5", "3"]
    with Grader(workers=2, timeout_s=10) as grader:
        results = grader.grade_many(completions, golds)
    assert [r.correct for r in results] == [True, False, True, False]
    assert [r.extraction_failed for r in results] == [False, False, False, True]


def test_pool_kills_a_hanging_grade_and_keeps_going() -> None:
    timeout = 1.0
    with Grader(workers=1, timeout_s=timeout, grade_fn=hanging_grade) as grader:
        grader.grade_many(["warm"], ["warm"])
        hung_worker = grader._workers[0].process  # the one worker grades "1", then hangs on the first HANG
        start = time.monotonic()
        results = grader.grade_many(["1", "HANG", "3", "HANG"], ["1", "2", "3", "4"])
        elapsed = time.monotonic() - start
        # Each hang is cut at the timeout and its item scored as one; the items after it are graded.
        assert [r.correct for r in results] == [True, False, True, False]
        assert [r.timed_out for r in results] == [False, True, False, True]
        assert grader.total_timeouts == 2
        # The hanging worker was killed (not left sleeping) and replaced, once per hang.
        assert hung_worker.returncode == -signal.SIGKILL
        assert grader.total_restarts == 2
        assert grader.grade_many(["5"], ["5"])[0].correct  # the pool still works afterwards
        # Only a guard against the kill not happening (a hang sleeps 600 s); the time a busy machine
        # takes to start a replacement worker is no part of what is checked.
        assert elapsed < 120


def test_pool_survives_a_grader_exception() -> None:
    with Grader(workers=1, timeout_s=5, grade_fn=exploding_grade) as grader:
        (result,) = grader.grade_many(["1"], ["1"])
    assert not result.correct and "grader bug" in (result.error or "")


def test_pool_rejects_bad_settings_and_closes() -> None:
    with pytest.raises(QerlError):
        Grader(workers=0)
    with pytest.raises(QerlError):
        Grader(timeout_s=0)
    with pytest.raises(QerlError, match="import path"):
        Grader(grade_fn="no_colon_here")
    grader = Grader(workers=1, timeout_s=5)
    grader.grade_many(["<answer>1</answer>"], ["1"])
    processes = [w.process for w in grader._workers]
    grader.close()
    assert all(p.poll() is not None for p in processes)
    with pytest.raises(RuntimeError):
        grader.grade_many(["1"], ["1"])


# -- the training reward ------------------------------------------------------------------------
def test_reward_fn_combines_weights_and_reports_stats() -> None:
    cfg = RewardSection(
        correctness_weight=1.0,
        format_weight=0.5,
        extra={f"{__name__}:length_bonus": 2.0},
        grader_timeout_s=10,
        grader_workers=1,
    )
    problems = [Problem("a", "q", "42"), Problem("b", "q", "7"), Problem("c", "q", "1")]
    completions = ["<think>x</think><answer>42</answer>", "<answer>8</answer>", "no answer"]
    with build_reward_fn(cfg) as reward_fn:
        rewards, stats = reward_fn(completions, problems)
    bonus = [2.0 * len(c) / 100 for c in completions]
    assert rewards == pytest.approx([1.0 + 0.5 + bonus[0], bonus[1], bonus[2]])
    assert stats["accuracy"] == pytest.approx(1 / 3)
    assert stats["format_rate"] == pytest.approx(1 / 3)
    assert stats["extraction_failures"] == 1.0
    assert stats["grader_timeouts"] == 0.0


def test_reward_fn_counts_timeouts_as_zero() -> None:
    cfg = RewardSection(grader_timeout_s=0.5, grader_workers=1)
    grader = Grader(workers=1, timeout_s=0.5, grade_fn=hanging_grade)
    with build_reward_fn(cfg, grader=grader) as reward_fn:
        rewards, stats = reward_fn(["HANG", "5"], [Problem("a", "q", "5"), Problem("b", "q", "5")])
    assert rewards == [0.0, 1.0]
    assert stats["grader_timeouts"] == 1.0


def test_reward_fn_rejects_bad_extra_paths() -> None:
    with pytest.raises(QerlError, match="cannot import"):
        build_reward_fn(RewardSection(extra={"no_such_module_xyz:fn": 1.0}))
    with pytest.raises(QerlError, match="no attribute"):
        build_reward_fn(RewardSection(extra={f"{__name__}:missing_fn": 1.0}))
    with pytest.raises(QerlError, match="weight"):
        build_reward_fn(RewardSection(correctness_weight=0.0, format_weight=0.0))


def test_a_python_without_math_verify_is_refused_before_any_model_loads(
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir,
    tmp_path,
    capsys: pytest.CaptureFixture[str],
    hide_packages,
) -> None:
    """A device image without math-verify once showed only "a grader worker exited during start-up",
    after the model and vLLM had loaded; now the grader pool and `qerl train` say what to install first."""

    from qerl_cli.cli import main

    hide_packages("math_verify")
    with pytest.raises(QerlError, match="pip install 'math-verify>=0.8'"):
        Grader(workers=1)
    Grader(workers=1, grade_fn="test_rewards:hanging_grade").close()  # a grader of one's own needs none

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the check")

    monkeypatch.setattr("qerl_cli.rl.trainer.build_policy", no_model)
    out = tmp_path / "run"
    rc = main(["train", "tiny", "--set", f"model.path={tiny_model_dir}", "--set", f"output.dir={out}"])
    assert rc == 2 and "math-verify" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("one_argument_bonus", "has the signature (completion), which cannot take (completion, problem): "
         "too many positional arguments"),
        ("keyword_problem_bonus", "has the signature (completion, *, problem), which cannot take "
         "(completion, problem): too many positional arguments"),
        ("async_bonus", "is an async or generator function"),
    ],
)  # fmt: skip
def test_an_extra_reward_of_the_wrong_signature_is_refused_when_built(name: str, said: str) -> None:
    with pytest.raises(QerlError) as caught:
        build_reward_fn(RewardSection(extra={f"{__name__}:{name}": 1.0}))
    message = str(caught.value)
    assert message.startswith(f"'{__name__}:{name}' {said}"), message
    assert "once per completion as fn(completion: str, problem) -> float" in message
    assert f"`def {name}(completion: str, problem) -> float`" in message


@pytest.mark.parametrize("name", ["length_bonus", "scaled_bonus", "any_bonus", "SCORER", "HALF_BONUS"])
def test_extra_rewards_that_take_completion_and_problem_are_accepted(name: str) -> None:
    reward_fn = build_reward_fn(RewardSection(extra={f"{__name__}:{name}": 1.0}), grader=Grader(workers=1))
    with reward_fn:
        assert len(reward_fn.extras) == 1


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_wrong_extra_reward_signature_is_refused_before_any_model_loads(
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    dry_run: bool,
) -> None:
    """A reward.extra function taking only the completion passed `qerl train --dry-run`; the run failed at
    step 1, once the model had loaded and the first rollout was generated."""

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the check")

    monkeypatch.setattr("qerl_cli.rl.trainer.build_policy", no_model)
    out = tmp_path / "run"
    rc, _, err = run_cli(
        capsys, "train", "tiny", "--set", f"model.path={tiny_model_dir}", "--set", f"output.dir={out}",
        "--set", f"reward.extra={{{__name__}:one_argument_bonus: 1.0}}", *(["--dry-run"] if dry_run else []),
    )  # fmt: skip
    assert usage_error(rc, err), err
    assert (
        f"reward.extra: '{__name__}:one_argument_bonus' has the signature (completion), which cannot take "
        "(completion, problem): too many positional arguments" in err
    ), err
    assert "`def one_argument_bonus(completion: str, problem) -> float`" in err, err
    assert not out.exists()

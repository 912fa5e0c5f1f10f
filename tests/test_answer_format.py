"""format_rate measures the answer shape the prompt asked for.

On SmolLM2 it read 0 at every step: it counted ``<think>/<answer>`` tags while the recipe's system
prompt asks the model to "end with: The answer is N".
"""

from __future__ import annotations

import pytest

from qerl_cli.config import DataSection, RewardSection
from qerl_cli.data.problem import Problem
from qerl_cli.data.prompts import reward_settings
from qerl_cli.rewards import build_reward_fn, grade
from qerl_cli.rewards.format import FORMAT_CHECKS, ends_with_answer_is, format_reward, has_answer_format

SMOLLM2_SYSTEM_PROMPT = "Solve the math word problem. Show the sum, then end with: The answer is N."


class InlineGrader:
    """The math-verify grader without worker processes (what the pool runs, minus the timeout)."""

    def grade_many(self, completions, golds):
        return [grade(c, g) for c, g in zip(completions, golds, strict=True)]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("23 + 45 = 68. The answer is 68.", True),
        ("Mia has 23 + 45 = 68 apples.\nThe answer is 68", True),
        ("The answer is **68**.", True),
        ("So the final answer is: 68.", True),
        ("the answer is $68$.", True),
        ("The answer is 68. Now a harder question: what is 2 + 2?", False),  # does not end with it
        ("23 + 45 = 68.", False),
        ("The answer is", False),
        ("The answer is .", False),
        ("The answer is\n68", False),  # the number belongs on the same line
        ("<think>23+45</think><answer>68</answer>", False),
    ],
)
def test_ends_with_answer_is(completion: str, expected: bool) -> None:
    assert ends_with_answer_is(completion) is expected


def test_each_format_accepts_its_own_shape_only() -> None:
    shapes = {
        "think_answer": "<think>23 + 45</think><answer>68</answer>",
        "boxed": "23 + 45 = \\boxed{68}",
        "answer_is": "23 + 45 = 68. The answer is 68.",
    }
    for name, completion in shapes.items():
        for other, other_completion in shapes.items():
            assert has_answer_format(other_completion, name) is (name == other), (name, other)
        assert has_answer_format(completion, "any")
    assert has_answer_format("68", "any") and not has_answer_format("I think it is big", "any")
    assert set(FORMAT_CHECKS) == {"think_answer", "boxed", "answer_is", "any"}
    assert format_reward(shapes["think_answer"]) == 1.0  # the default stays the QeRL tags


def test_smollm2_recipe_format_rate_counts_the_answer_is_sentence() -> None:
    problems = [Problem(str(i), "q", "68") for i in range(4)]
    completions = [
        "23 + 45 = 68. The answer is 68.",  # right, in the asked format
        "23 + 45 = 67. The answer is 67.",  # wrong, in the asked format
        "The sum is 68.",  # not in the format
        "<think>23+45</think><answer>68</answer>",  # right, in another format
    ]
    data = DataSection(template="plain", system_prompt=SMOLLM2_SYSTEM_PROMPT)
    cfg = RewardSection(format_weight=0.5)
    reward_fn = build_reward_fn(cfg, grader=InlineGrader(), **reward_settings(data))
    rewards, stats = reward_fn(completions, problems)
    assert stats["format_rate"] == pytest.approx(2 / 4)
    assert rewards == pytest.approx([1.5, 0.5, 0.0, 1.0])
    # what the metric read before: the QeRL tags, which this prompt never asks for
    _, legacy = build_reward_fn(cfg, grader=InlineGrader())(completions, problems)
    assert legacy["format_rate"] == pytest.approx(1 / 4)


def test_fewshot_completions_are_cut_at_the_next_question() -> None:
    # The HF engine keeps the stop string at the end of the text, vLLM drops it; both grade alike,
    # and a model that went on past it is judged on its answer, not on the example it began.
    problems = [Problem("a", "q", "19"), Problem("b", "q", "19"), Problem("c", "q", "19")]
    completions = [
        " 12 + 7 = 19. The answer is 19.\nQuestion:",
        " 12 + 7 = 19. The answer is 19.",
        " 12 + 7 = 19. The answer is 19.\nQuestion: Ann has 3 pens. The answer is 3.",
    ]
    reward_fn = build_reward_fn(
        RewardSection(), grader=InlineGrader(), **reward_settings(DataSection(template="qerl-fewshot"))
    )
    rewards, stats = reward_fn(completions, problems)
    assert rewards == [1.0, 1.0, 1.0]
    assert stats["format_rate"] == 1.0

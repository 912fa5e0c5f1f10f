"""Rewards: math-verify correctness in killable worker processes, format, and user functions."""

from qerl_cli.rewards.extract import extract_answer_tag, extract_last_boxed
from qerl_cli.rewards.format import format_reward, has_think_answer_format
from qerl_cli.rewards.grading import GradeResult, grade, is_correct
from qerl_cli.rewards.pool import Grader
from qerl_cli.rewards.reward_fn import RewardFunction, build_reward_fn

__all__ = [
    "GradeResult",
    "Grader",
    "RewardFunction",
    "build_reward_fn",
    "extract_answer_tag",
    "extract_last_boxed",
    "format_reward",
    "grade",
    "has_think_answer_format",
    "is_correct",
]

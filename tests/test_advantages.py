"""Group-relative advantages against hand-computed values."""

import math

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.rl.advantages import group_advantages, group_reward_stats


def test_std_scaled_advantages_match_hand_values() -> None:
    # Group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025.
    # Group 2: all equal -> 0 everywhere (no NaN from the zero std).
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4)
    a = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_two_member_group() -> None:
    # mean 2, unbiased std sqrt(2) -> +-1/sqrt(2).
    adv = group_advantages(torch.tensor([3.0, 1.0]), 2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)]))


def test_dr_grpo_drops_std_scaling() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 0.0])
    adv = group_advantages(rewards, 4, scale_by_std=False)
    # Group 2 mean is 1.5.
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.5, 0.5, 0.5, -1.5]))


def test_advantages_are_detached_constants() -> None:
    rewards = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not group_advantages(rewards, 2).requires_grad


def test_bad_layouts_fail_loudly() -> None:
    with pytest.raises(QerlError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(QerlError, match="at least 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(QerlError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)


def test_group_reward_stats() -> None:
    stats = group_reward_stats(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]), 4)
    assert stats["reward_mean"] == pytest.approx(0.75)
    assert stats["reward_std"] == pytest.approx(math.sqrt(0.75 * 0.25))
    assert stats["group_std_mean"] == pytest.approx(math.sqrt(1 / 3) / 2)
    assert stats["zero_std_group_fraction"] == pytest.approx(0.5)

"""DAPO dynamic sampling, overlong shaping and truncation masking against hand-computed values."""

import logging

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.rl.sampling import DynamicSampler, filter_groups, overlong_penalty, truncation_mask


def test_filter_groups_drops_all_equal_groups() -> None:
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5 + 1e-7])
    # The last group differs only by float noise, below the tolerance.
    assert filter_groups(rewards, 3).tolist() == [False, True, False, False]
    assert filter_groups(rewards, 3, tol=0.0).tolist() == [False, True, False, True]


def test_dynamic_sampler_fills_the_batch_and_trims_the_surplus() -> None:
    sampler = DynamicSampler(target_groups=3, group_size=2, max_rounds=3)
    # Round 1: group 0 all-equal (dropped), groups 1 and 2 kept.
    kept = sampler.add(torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0]), ["a0", "a1", "a2", "a3", "a4", "a5"])
    assert kept.tolist() == [2, 3, 4, 5]
    assert sampler.groups_kept == 2 and sampler.needs_more
    # Round 2: groups 1 and 2 qualify but only one more is needed; group 2 is surplus.
    kept = sampler.add(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0]), ["b0", "b1", "b2", "b3", "b4", "b5"])
    assert kept.tolist() == [2, 3]
    assert not sampler.needs_more
    rewards, items = sampler.result()
    assert rewards.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert items == ["a2", "a3", "a4", "a5", "b2", "b3"]
    assert sampler.stats() == {
        "dynamic_sampling_rounds": 2.0,
        "dynamic_sampling_groups_kept": 3.0,
        "dynamic_sampling_groups_dropped": 2.0,
        "dynamic_sampling_groups_surplus": 1.0,
        "dynamic_sampling_hit_round_limit": 0.0,
    }


def test_dynamic_sampler_round_limit_is_flagged_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    sampler = DynamicSampler(target_groups=2, group_size=2, max_rounds=2)
    with caplog.at_level(logging.WARNING, logger="qerl_cli.rl.sampling"):
        sampler.add(torch.tensor([1.0, 1.0, 0.0, 0.0]))
        assert not sampler.hit_round_limit
        sampler.add(torch.tensor([0.0, 1.0, 1.0, 1.0]))
    assert sampler.hit_round_limit and not sampler.needs_more
    assert "max_rounds=2" in caplog.text and "1 of 2 groups" in caplog.text
    rewards, items = sampler.result()
    assert rewards.tolist() == [0.0, 1.0] and items == []
    with pytest.raises(RuntimeError):
        sampler.add(torch.tensor([0.0, 1.0, 0.0, 1.0]))


def test_dynamic_sampler_checks_items_length() -> None:
    sampler = DynamicSampler(target_groups=1, group_size=2, max_rounds=1)
    with pytest.raises(QerlError, match="match one to one"):
        sampler.add(torch.tensor([0.0, 1.0]), ["only one"])


def test_overlong_penalty_values() -> None:
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # Soft zone starts at 20 - 4 = 16: 17 -> -1/4, 18 -> -2/4, 20 -> -1, beyond -> -1.
    assert overlong_penalty(lengths, 20, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 20, 4, penalty=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    assert overlong_penalty(lengths, 20, 0).tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, -1.0]
    with pytest.raises(QerlError, match="cache_len"):
        overlong_penalty(lengths, 20, 21)


def test_truncation_mask_zeroes_length_finished_rows() -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    out = truncation_mask(["stop", "length", "stop"], mask)
    assert out.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    assert out.dtype == mask.dtype
    bool_out = truncation_mask(["length", "stop", "stop"], mask.bool())
    assert bool_out.dtype == torch.bool and bool_out.tolist() == [[False, False], [True, False], [True, True]]
    with pytest.raises(QerlError):
        truncation_mask(["stop"], mask)

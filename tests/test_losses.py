"""policy_loss and tis_weights against hand-computed values."""

import math

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.rl.importance import tis_weights
from qerl_cli.rl.losses import NonFiniteLossError, policy_loss


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


def test_clip_higher_asymmetry() -> None:
    # One token per sequence, old logprob 0, so ratio = exp(logprob).
    ratios = [1.5, 1.5, 0.5, 0.5, 1.25]
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    lp = _leaf([[math.log(r)] for r in ratios])
    old = torch.zeros(5, 1)
    mask = torch.ones(5, 1)
    loss, stats = policy_loss(lp, old, adv, mask, loss_type="dapo")
    # Per token -min(r A, clip(r, 0.8, 1.28) A):
    #   A=+1, r=1.5  -> clipped high at 1.28: -1.28 (no gradient)
    #   A=-1, r=1.5  -> min(-1.5, -1.28) = -1.5, unclipped: +1.5
    #   A=-1, r=0.5  -> clipped low at 0.8: +0.8 (no gradient)
    #   A=+1, r=0.5  -> min(0.5, 0.8) = 0.5, unclipped: -0.5
    #   A=+1, r=1.25 -> inside [0.8, 1.28] thanks to clip-higher: -1.25
    assert loss.item() == pytest.approx((-1.28 + 1.5 + 0.8 - 0.5 - 1.25) / 5)
    assert stats["clip_fraction_high"] == pytest.approx(1 / 5)
    assert stats["clip_fraction_low"] == pytest.approx(1 / 5)
    assert stats["clip_fraction"] == pytest.approx(2 / 5)
    assert stats["ratio_max"] == pytest.approx(1.5) and stats["ratio_min"] == pytest.approx(0.5)
    loss.backward()
    # d/dlp of -r A is -A r; mean over 5 tokens.
    torch.testing.assert_close(lp.grad.flatten(), torch.tensor([0.0, 1.5, 0.0, -0.5, -1.25]) / 5)

    # A symmetric clip range (eps_high = eps_low = 0.2) would cut the r=1.25 token at 1.2.
    sym_loss, _ = policy_loss(lp, old, adv, mask, loss_type="dapo", eps_high=0.2)
    assert sym_loss.item() == pytest.approx((-1.2 + 1.5 + 0.8 - 0.5 - 1.2) / 5)


def _two_lengths() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence 0 has 1 token with advantage 2; sequence 1 has 4 tokens with advantage -1. Ratio 1,
    so per-token losses are -2 and +1. Padding holds garbage that must not leak into anything."""
    lp = torch.tensor([[0.0, float("-inf"), float("nan"), 5.0], [0.0, 0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    return lp, mask, torch.tensor([2.0, -1.0])


def test_grpo_is_sequence_mean_then_batch_mean() -> None:
    lp, mask, adv = _two_lengths()
    loss, _ = policy_loss(lp, lp, adv, mask, loss_type="grpo")
    assert loss.item() == pytest.approx((-2.0 + 1.0) / 2)
    loss.backward()
    # Each sequence weighs 1/2, split over its tokens: -2/1/2 and +1/4/2.
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0, 0, 0], [0.125, 0.125, 0.125, 0.125]]))


def test_dapo_is_token_mean_over_the_batch() -> None:
    lp, mask, adv = _two_lengths()
    loss, stats = policy_loss(lp, lp, adv, mask, loss_type="dapo")
    assert loss.item() == pytest.approx((-2.0 + 4 * 1.0) / 5)
    assert stats["num_tokens"] == 5
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.4, 0, 0, 0], [0.2, 0.2, 0.2, 0.2]]))


def test_dr_grpo_divides_by_batch_times_max_length() -> None:
    lp, mask, adv = _two_lengths()
    loss, _ = policy_loss(lp, lp, adv, mask, loss_type="dr_grpo")
    assert loss.item() == pytest.approx(2.0 / (2 * 4))  # max_completion_length defaults to T = 4
    loss, _ = policy_loss(lp, lp, adv, mask, loss_type="dr_grpo", max_completion_length=8)
    assert loss.item() == pytest.approx(2.0 / (2 * 8))
    with pytest.raises(QerlError, match="max_completion_length"):
        policy_loss(lp, lp, adv, mask, loss_type="dr_grpo", max_completion_length=3)


def test_normalizer_override_and_empty_sequences() -> None:
    lp, mask, adv = _two_lengths()
    loss, _ = policy_loss(lp, lp, adv, mask, loss_type="dapo", normalizer=10.0)
    assert loss.item() == pytest.approx(2.0 / 10)
    # A fully masked third sequence (a truncated completion) does not dilute the GRPO mean.
    lp3 = torch.cat([lp.detach(), torch.zeros(1, 4)])
    mask3 = torch.cat([mask, torch.zeros(1, 4)])
    loss, _ = policy_loss(lp3, lp3, torch.tensor([2.0, -1.0, 5.0]), mask3, loss_type="grpo")
    assert loss.item() == pytest.approx(-0.5)


def test_k3_kl_value_and_gradient() -> None:
    lp = _leaf([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    # k3 = exp(ref - lp) - (ref - lp) - 1 = 0.5 + ln 2 - 1
    k3 = 0.5 + math.log(2) - 1
    loss, stats = policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 1), beta=0.1, ref_logprobs=ref)
    assert stats["kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3)
    loss.backward()
    # d k3 / d lp = 1 - exp(ref - lp) = 0.5, times beta.
    assert lp.grad.item() == pytest.approx(0.05)
    # beta = 0 with a reference only reports the KL.
    loss0, stats0 = policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 1), ref_logprobs=ref)
    assert loss0.item() == 0.0 and stats0["kl"] == pytest.approx(k3)
    with pytest.raises(QerlError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.zeros(1), torch.ones(1, 1), beta=0.1)


def test_tis_weights_cap() -> None:
    old = torch.tensor([[math.log(0.5), 0.0, math.log(3.0), 0.0]])
    rollout = torch.tensor([[0.0, 0.0, 0.0, float("-inf")]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, stats = tis_weights(old, rollout, mask, cap=2.0)
    # Ratios 0.5, 1, 3 -> 3 capped at 2; the padded position is 0, never exp(+inf).
    torch.testing.assert_close(weights, torch.tensor([[0.5, 1.0, 2.0, 0.0]]))
    assert stats["tis_weight_mean"] == pytest.approx(3.5 / 3)
    assert stats["tis_weight_max"] == pytest.approx(2.0)
    assert stats["tis_raw_weight_max"] == pytest.approx(3.0)
    assert stats["tis_capped_fraction"] == pytest.approx(1 / 3)
    # The logprob gap: mean |log ratio| over the three kept tokens, the padded one left out.
    assert stats["rollout_logprob_gap"] == pytest.approx((math.log(2.0) + 0.0 + math.log(3.0)) / 3)
    with pytest.raises(QerlError, match="cap"):
        tis_weights(old, rollout, mask, cap=0.0)


def test_tis_weight_multiplies_the_token_loss_without_gradient() -> None:
    lp = _leaf([[math.log(0.5), 0.0, math.log(3.0)]])
    rollout = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    loss, stats = policy_loss(
        lp, lp, torch.ones(1), mask, loss_type="dapo", rollout_logprobs=rollout, tis_cap=2.0
    )
    # Ratio 1, advantage 1: per-token -1 times weights 0.5, 1, 2.
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 2.0) / 3)
    assert stats["tis_capped_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, -torch.tensor([[0.5, 1.0, 2.0]]) / 3)
    # Rollout logprobs without a cap: no correction, mismatch still reported.
    loss_off, stats_off = policy_loss(lp, lp, torch.ones(1), mask, loss_type="dapo", rollout_logprobs=rollout)
    assert loss_off.item() == pytest.approx(-1.0)
    assert stats_off["tis_raw_weight_max"] == pytest.approx(3.0)


def test_second_update_on_one_rollout_batch_clips() -> None:
    """num_iterations = 2: old_logprobs fixed from the first update, ratio and clipping act next."""
    lp = _leaf([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3)
    old = lp.detach().clone()  # what the trainer stores before the first update
    opt = torch.optim.SGD([lp], lr=3.0)

    loss, stats = policy_loss(lp, old, adv, mask)
    assert stats["clip_fraction"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    # Plain policy gradient: -A / (3 tokens * 2 sequences).
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 6] * 3, [1 / 6] * 3]))
    opt.step()
    opt.zero_grad()
    # lp moved by +-0.5: ratios exp(0.5) = 1.649 > 1.28 (A > 0) and exp(-0.5) = 0.607 < 0.8 (A < 0).

    loss, stats = policy_loss(lp, old, adv, mask)
    assert stats["clip_fraction_high"] == pytest.approx(0.5)
    assert stats["clip_fraction_low"] == pytest.approx(0.5)
    assert stats["ratio_max"] == pytest.approx(math.exp(0.5))
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2)
    loss.backward()
    # Every token is clipped, so the second update gets no gradient at all.
    torch.testing.assert_close(lp.grad, torch.zeros(2, 3))


def test_passing_logprobs_as_old_gives_plain_policy_gradient() -> None:
    lp = _leaf([[0.3, -0.2]])
    loss, stats = policy_loss(lp, lp, torch.tensor([2.0]), torch.ones(1, 2))
    assert stats["ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -1.0]]))


def test_non_finite_terms_fail_loudly_and_name_the_term() -> None:
    mask = torch.ones(1, 2)
    with pytest.raises(NonFiniteLossError, match="policy-gradient"):
        policy_loss(torch.tensor([[0.0, float("nan")]]), torch.zeros(1, 2), torch.ones(1), mask)
    with pytest.raises(NonFiniteLossError, match="policy-gradient"):
        # Ratio exp(100) overflows float32; with a negative advantage the loss is +inf.
        policy_loss(torch.tensor([[100.0, 0.0]]), torch.zeros(1, 2), -torch.ones(1), mask)
    with pytest.raises(NonFiniteLossError, match="KL") as info:
        policy_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1),
            mask,
            beta=0.1,
            ref_logprobs=torch.tensor([[float("inf"), 0.0]]),
        )
    assert isinstance(info.value, QerlError)


def test_argument_checks() -> None:
    lp = torch.zeros(1, 2)
    with pytest.raises(QerlError, match="loss_type"):
        policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), loss_type="ppo")
    with pytest.raises(QerlError, match="shape"):
        policy_loss(lp, torch.zeros(1, 3), torch.ones(1), torch.ones(1, 2))


def test_bool_mask_and_per_token_advantages_match_float_mask_and_per_sequence() -> None:
    lp, mask, adv = _two_lengths()
    ref_loss, _ = policy_loss(lp, lp, adv, mask, loss_type="dapo")
    loss, _ = policy_loss(lp, lp, adv.unsqueeze(1).expand(2, 4), mask.bool(), loss_type="dapo")
    assert loss.item() == pytest.approx(ref_loss.item())


def test_a_logprob_gap_above_the_bound_warns_loudly(caplog: pytest.LogCaptureFixture) -> None:
    from qerl_cli.rl.update import warn_on_logprob_gap

    with caplog.at_level("WARNING"):
        assert not warn_on_logprob_gap(0.05, 0.25)
        assert not warn_on_logprob_gap(None, 0.25)  # no rollout logprobs: nothing to gate
        assert not caplog.records
        assert warn_on_logprob_gap(0.4, 0.25)
    assert "0.400 nats/token" in caplog.text and "rollout.logprob_gap_warn=0.250" in caplog.text

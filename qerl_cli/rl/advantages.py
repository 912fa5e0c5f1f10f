"""Group-relative advantages (GRPO, DAPO, Dr.GRPO).

A rollout batch holds ``group_size`` completions per prompt, laid out consecutively: rows
``[g * group_size, (g + 1) * group_size)`` belong to prompt ``g``. Each completion's advantage is its
reward minus the mean reward of its group, optionally divided by the group's standard deviation.

- GRPO and DAPO scale by the std (``scale_by_std=True``).
- Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the std scaling because
  it over-weights groups whose rewards barely differ (nearly-solved or nearly-hopeless prompts);
  use ``scale_by_std=False``.
"""

from __future__ import annotations

import torch

from qerl_cli.errors import QerlError


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Return ``rewards`` reshaped to ``[num_groups, group_size]`` after checking the layout."""
    if rewards.dim() != 1:
        raise QerlError(f"rewards must be a 1-D tensor [B]; got shape {tuple(rewards.shape)}")
    if group_size < 2:
        # A group of one always has advantage 0: nothing would ever be learned.
        raise QerlError(
            f"group_size (generations per prompt) must be at least 2, got {group_size}; "
            "set the number of generations to 2 or more"
        )
    if rewards.numel() % group_size != 0:
        raise QerlError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}; the batch must hold "
            "exactly group_size completions per prompt"
        )
    return rewards.float().view(-1, group_size)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Mean-centred (and optionally std-scaled) advantages per group of consecutive completions.

    ``A_i = (r_i - mean(group)) / (std(group) + eps)`` with the unbiased std (as TRL and the
    QeRL reference trainer compute it), or ``A_i = r_i - mean(group)`` when ``scale_by_std`` is off.
    A group whose rewards are all equal gets advantage 0 for every member, either way.

    Returns a float32 tensor of shape ``[B]``, detached (advantages are constants in the loss).
    """
    grouped = _grouped(rewards.detach(), group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def group_reward_stats(rewards: torch.Tensor, group_size: int) -> dict[str, float]:
    """Logging figures for a rollout batch: overall reward mean/std, mean within-group std, and the
    fraction of groups whose rewards are all equal (they carry no learning signal)."""
    grouped = _grouped(rewards.detach(), group_size)
    group_std = grouped.std(dim=1)
    flat = grouped.reshape(-1)
    return {
        "reward_mean": flat.mean().item(),
        # Population std over the whole batch: a description of the batch, not an estimator.
        "reward_std": flat.std(correction=0).item(),
        "group_std_mean": group_std.mean().item(),
        "zero_std_group_fraction": (grouped.amax(dim=1) == grouped.amin(dim=1)).float().mean().item(),
    }

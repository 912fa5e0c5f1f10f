"""DAPO's batch shaping: dynamic sampling, soft overlong punishment, truncation masking.

From Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale":

- Dynamic sampling: a group whose completions all got the same reward has advantage 0 everywhere
  and contributes no gradient, only noise in the normaliser; drop it and generate more prompts
  until the batch holds enough informative groups.
- Overlong reward shaping: a completion running into the length limit gets a penalty that grows
  linearly over the last ``cache_len`` tokens, instead of an abrupt cliff at the limit.
- Truncation masking: a completion cut off by the length limit has no final answer, so its reward
  says little about its tokens; it can be excluded from the loss altogether.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from qerl_cli.errors import QerlError

log = logging.getLogger(__name__)


def filter_groups(rewards: torch.Tensor, group_size: int, *, tol: float = 1e-6) -> torch.Tensor:
    """Bool mask over groups (``[B // group_size]``): True where the group's rewards differ.

    A group is dropped when ``max - min <= tol``. The tolerance exists because std-scaled
    advantages would blow float rounding differences (1e-8) up into full-size advantages.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size != 0:
        raise QerlError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.detach().float().view(-1, group_size)
    return (grouped.amax(dim=1) - grouped.amin(dim=1)) > tol


class DynamicSampler:
    """Collect informative groups over repeated generation rounds until ``target_groups`` are kept.

    Usage, per training step::

        sampler = DynamicSampler(target_groups=prompts_per_step, group_size=n, max_rounds=5)
        while sampler.needs_more:
            rollouts, rewards = generate_and_score(next_prompts())
            kept = sampler.add(rewards, rollouts)   # indices of the sequences kept this round
        rewards, rollouts = sampler.result()

    ``items`` (optional) is any per-sequence sequence of length B (rollout records); the kept ones
    are returned by :meth:`result` in order. Groups beyond the target are discarded (DAPO trims the
    surplus too), so ``add`` may keep fewer groups than qualify. When ``max_rounds`` rounds are used
    up short of the target, ``hit_round_limit`` is set, a warning is logged, and :meth:`result`
    returns what was collected (possibly nothing: the trainer then skips the step).
    """

    def __init__(self, target_groups: int, group_size: int, max_rounds: int, *, tol: float = 1e-6) -> None:
        if target_groups < 1 or group_size < 1 or max_rounds < 1:
            raise QerlError(
                "dynamic sampling needs target_groups, group_size and max_rounds >= 1; got "
                f"{target_groups}, {group_size}, {max_rounds}"
            )
        self.target_groups = target_groups
        self.group_size = group_size
        self.max_rounds = max_rounds
        self.tol = tol
        self.rounds_used = 0
        self.groups_seen = 0
        self.groups_dropped = 0  # all-equal rewards
        self.groups_surplus = 0  # informative, but beyond the target
        self.hit_round_limit = False
        self._rewards: list[torch.Tensor] = []
        self._items: list[Any] = []

    @property
    def groups_kept(self) -> int:
        return sum(r.numel() for r in self._rewards) // self.group_size

    @property
    def needs_more(self) -> bool:
        return self.groups_kept < self.target_groups and self.rounds_used < self.max_rounds

    def add(self, rewards: torch.Tensor, items: Sequence[Any] | None = None) -> torch.Tensor:
        """Record one generation round; return the (long) indices of the sequences kept from it."""
        if not self.needs_more:
            raise RuntimeError("DynamicSampler.add called after the batch was full or the round limit hit")
        if items is not None and len(items) != rewards.numel():
            raise QerlError(f"{len(items)} items for {rewards.numel()} rewards; they must match one to one")
        keep_groups = filter_groups(rewards, self.group_size, tol=self.tol)
        self.rounds_used += 1
        self.groups_seen += keep_groups.numel()
        self.groups_dropped += int((~keep_groups).sum())

        group_ids = torch.nonzero(keep_groups).flatten()
        room = self.target_groups - self.groups_kept
        self.groups_surplus += max(0, group_ids.numel() - room)
        group_ids = group_ids[:room]
        offsets = torch.arange(self.group_size)
        seq_ids = (group_ids.unsqueeze(1) * self.group_size + offsets).flatten()

        self._rewards.append(rewards.detach()[seq_ids])
        if items is not None:
            self._items.extend(items[i] for i in seq_ids.tolist())

        if self.groups_kept < self.target_groups and self.rounds_used >= self.max_rounds:
            self.hit_round_limit = True
            log.warning(
                "dynamic sampling hit max_rounds=%d with %d of %d groups (%d of %d groups had all-equal "
                "rewards); training on the smaller batch. Raise max_rounds or make the task less "
                "uniformly easy/hard.",
                self.max_rounds,
                self.groups_kept,
                self.target_groups,
                self.groups_dropped,
                self.groups_seen,
            )
        return seq_ids

    def result(self) -> tuple[torch.Tensor, list[Any]]:
        """Kept rewards ``[groups_kept * group_size]`` (group layout preserved) and kept items."""
        rewards = torch.cat(self._rewards) if self._rewards else torch.zeros(0)
        return rewards, list(self._items)

    def stats(self) -> dict[str, float]:
        return {
            "dynamic_sampling_rounds": float(self.rounds_used),
            "dynamic_sampling_groups_kept": float(self.groups_kept),
            "dynamic_sampling_groups_dropped": float(self.groups_dropped),
            "dynamic_sampling_groups_surplus": float(self.groups_surplus),
            "dynamic_sampling_hit_round_limit": float(self.hit_round_limit),
        }


def overlong_penalty(
    lengths: torch.Tensor, max_len: int, cache_len: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward. Float tensor ``[B]``:

    - ``0`` for ``length <= max_len - cache_len``;
    - ``-penalty * (length - (max_len - cache_len)) / cache_len`` inside the last ``cache_len``
      tokens, reaching ``-penalty`` at ``max_len``;
    - ``-penalty`` beyond ``max_len``.

    ``cache_len = 0`` gives a hard cliff (0 up to ``max_len``, ``-penalty`` beyond).
    """
    if max_len < 1 or not 0 <= cache_len <= max_len:
        raise QerlError(
            f"overlong shaping needs max_len >= 1 and 0 <= cache_len <= max_len; got {max_len}, {cache_len}"
        )
    lengths = lengths.float()
    soft_start = max_len - cache_len
    if cache_len == 0:
        return torch.where(lengths > max_len, -penalty, 0.0)
    ramp = -penalty * (lengths - soft_start) / cache_len
    return ramp.clamp(min=-penalty, max=0.0)


def truncation_mask(finish_reasons: Sequence[str], mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with every row whose finish reason is ``"length"`` (cut off by the limit) zeroed."""
    if len(finish_reasons) != mask.shape[0]:
        raise QerlError(f"{len(finish_reasons)} finish reasons for {mask.shape[0]} completions")
    truncated = torch.tensor([reason == "length" for reason in finish_reasons], device=mask.device)
    return mask * (~truncated).unsqueeze(1).to(mask.dtype)

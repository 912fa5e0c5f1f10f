"""Truncated importance sampling (TIS) between the rollout engine and the trainer.

The rollout engine samples with different numerics from the trainer: a 4-bit kernel, vLLM's own
attention, or AQN-noised norm weights. The completions are therefore drawn from ``pi_rollout``
while the surrogate loss assumes they came from ``pi_old`` (the trainer's policy when the batch
was generated). Re-weighting each token by ``pi_old / pi_rollout`` corrects this; capping the
weight at ``cap`` (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
RL training"; FlashRL) bounds the variance that a rare token with a tiny rollout probability
would otherwise inject.
"""

from __future__ import annotations

import torch

from qerl_cli.errors import QerlError

# The step metric of the rollout/trainer logprob gap (``rollout.logprob_gap_warn`` gates it).
LOGPROB_GAP = "rollout_logprob_gap"


def tis_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights ``min(exp(old_logprobs - rollout_logprobs), cap)``, detached.

    All tensors are ``[B, T]``; ``mask`` marks completion tokens. Weights at masked-out positions are
    0 (padding may hold arbitrary log-probabilities, so it is never exponentiated). Stats are over
    the masked tokens: ``tis_weight_mean``, ``tis_weight_max`` (after the cap),
    ``tis_raw_weight_max`` (before it), ``tis_capped_fraction`` and ``rollout_logprob_gap`` (mean
    |old - rollout| logprob, nats/token).
    """
    if cap <= 0:
        raise QerlError(f"the truncated importance sampling cap must be positive, got {cap}")
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != mask.shape:
        raise QerlError(
            "old_logprobs, rollout_logprobs and mask must have the same [B, T] shape; got "
            f"{tuple(old_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}"
        )
    keep = mask.bool()
    zeros = torch.zeros_like(old_logprobs, dtype=torch.float32)
    log_ratio = torch.where(keep, old_logprobs.detach().float() - rollout_logprobs.detach().float(), zeros)
    raw = torch.where(keep, log_ratio.exp(), zeros)
    weights = raw.clamp(max=cap)

    n = keep.sum()
    if n == 0:
        return weights, {
            "tis_weight_mean": 0.0,
            "tis_weight_max": 0.0,
            "tis_raw_weight_max": 0.0,
            "tis_capped_fraction": 0.0,
            LOGPROB_GAP: 0.0,
        }
    stats = {
        "tis_weight_mean": (weights.sum() / n).item(),
        "tis_weight_max": weights[keep].max().item(),
        "tis_raw_weight_max": raw[keep].max().item(),
        "tis_capped_fraction": ((raw > cap) & keep).sum().item() / n.item(),
        # How far the rollout engine's numerics (FP8 copy, merged LoRA, AQN off in the trainer) are
        # from the trainer's on the tokens actually trained on: mean |log ratio|, nats/token.
        LOGPROB_GAP: (log_ratio.abs().sum() / n).item(),
    }
    return weights, stats

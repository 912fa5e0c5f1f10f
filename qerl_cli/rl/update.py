"""The policy update on one batch of rollouts: advantages, the fixed logprobs (old policy, KL
reference), then ``num_iterations`` optimizer steps, micro-batched, with the clipped surrogate,
truncated importance sampling and gradient clipping.

Every micro-batch is normalised by the whole batch's denominator (:func:`normalizer`), so the
micro-batch gradients add up to the full-batch gradient.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from qerl_cli.config import TrainConfig
from qerl_cli.rl.advantages import group_advantages
from qerl_cli.rl.losses import NonFiniteLossError, policy_loss
from qerl_cli.rl.policy import Policy, TokenBatch, batched_logprobs, completion_logprobs, make_token_batch
from qerl_cli.rl.rollouts import Rollouts
from qerl_cli.rl.sampling import truncation_mask


def update_policy(
    cfg: TrainConfig,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    params: list[tuple[str, nn.Parameter]],
    batch: Rollouts,
    *,
    tis_on: bool,
) -> dict[str, Any]:
    """Train on ``batch``; return the merged loss stats, grad norm and timings."""
    a = cfg.algorithm
    model, device = policy.model, policy.device
    temperature = cfg.rollout.temperature
    micro = cfg.train.micro_batch_size
    pad = int(policy.tokenizer.pad_token_id)
    tokens = make_token_batch(
        batch.prompt_ids,
        [c.token_ids for c in batch.completions],
        [c.logprobs for c in batch.completions],
        pad,
    )
    advantages = group_advantages(
        torch.tensor(batch.rewards), batch.group_size, scale_by_std=a.scale_rewards_by_std
    )
    mask = tokens.completion_mask
    if a.mask_truncated:
        mask = truncation_mask([c.finish_reason for c in batch.completions], mask)
    t0 = time.perf_counter()
    old_lp = batched_logprobs(model, tokens, temperature, device, micro) if a.num_iterations > 1 else None
    ref_lp = (
        batched_logprobs(model, tokens, temperature, device, micro, reference=policy) if a.beta > 0 else None
    )
    t1 = time.perf_counter()
    norm = normalizer(a.loss_type, mask, cfg.rollout.max_completion_length)
    model.train()
    parts: list[tuple[float, dict[str, float]]] = []
    grad_norms = []
    for _ in range(a.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        for begin in range(0, tokens.size, micro):
            rows = slice(begin, begin + micro)
            part: TokenBatch = tokens.rows(rows)
            lp = completion_logprobs(model, part, temperature, device)
            old = old_lp[rows].to(device) if old_lp is not None else lp.detach()
            loss, stats = policy_loss(
                lp,
                old,
                advantages[rows].to(device),
                mask[rows].to(device),
                loss_type=a.loss_type,
                eps_low=a.eps_low,
                eps_high=a.eps_high,
                beta=a.beta,
                ref_logprobs=ref_lp[rows].to(device) if ref_lp is not None else None,
                rollout_logprobs=part.rollout_logprobs.to(device),
                tis_cap=a.tis_cap if tis_on else None,
                max_completion_length=cfg.rollout.max_completion_length,
                normalizer=norm,
            )
            loss.backward()
            parts.append((stats.get("num_tokens", 0.0), stats))
        grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.train.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLossError(f"the gradient norm is {grad_norm.item()}")
        grad_norms.append(float(grad_norm))
        optimizer.step()
    t2 = time.perf_counter()
    merged = merge_stats(parts) if parts else {}
    merged["grad_norm"] = sum(grad_norms) / len(grad_norms)
    merged["num_sequences"] = float(tokens.size)
    merged["time_logprobs_s"] = t1 - t0
    merged["time_update_s"] = t2 - t1
    if a.beta == 0:
        merged.pop("kl", None)  # no reference pass was run: there is no KL figure
    return merged


def merge_stats(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Merge per-micro-batch loss stats: sums for the loss, extremes for max/min, else weighted mean."""
    total = sum(w for w, _ in parts) or 1.0
    merged: dict[str, float] = {}
    for key in parts[0][1]:
        values = [(w, s[key]) for w, s in parts if key in s]
        if key in ("loss", "policy_loss"):
            merged[key] = sum(v for _, v in values)
        elif key.endswith("_max"):
            merged[key] = max(v for _, v in values)
        elif key.endswith("_min"):
            merged[key] = min(v for _, v in values)
        elif key == "num_tokens":
            merged[key] = sum(v for _, v in values)
        else:
            merged[key] = sum(w * v for w, v in values) / total
    return merged


def normalizer(loss_type: str, mask: torch.Tensor, max_completion_length: int) -> float:
    """The whole batch's denominator, so micro-batches add up to the full-batch loss."""
    if loss_type == "grpo":
        return float(max(1, int((mask.sum(dim=1) > 0).sum())))
    if loss_type == "dapo":
        return float(max(1.0, float(mask.sum())))
    return float(mask.shape[0] * max_completion_length)

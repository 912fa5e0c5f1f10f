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
from qerl_cli.rl.distributed import Distributed
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
    micro_batch_size: int,
    dist: Distributed | None = None,
) -> dict[str, Any]:
    """Train on ``batch``; return the merged loss stats, grad norm and timings.

    With several ranks ``batch`` is this rank's share (whole groups, possibly none): the normaliser
    counts every rank's rows, the gradients are summed over ranks before clipping, and the stats
    are those of the whole batch, so every rank takes the single-process step on the same batch.
    ``micro_batch_size``: the memory plan's resolution of ``train.micro_batch_size`` (it may be ``auto``).
    """
    dist = dist or Distributed()
    a = cfg.algorithm
    model, device = policy.model, policy.device
    temperature = cfg.rollout.temperature
    micro = micro_batch_size
    chunk = cfg.train.logprob_chunk_tokens
    t0 = time.perf_counter()
    if len(batch):
        tokens = make_token_batch(
            batch.prompt_ids,
            [c.token_ids for c in batch.completions],
            [c.logprobs for c in batch.completions],
            int(policy.tokenizer.pad_token_id),
        )
        advantages = group_advantages(
            torch.tensor(batch.rewards), batch.group_size, scale_by_std=a.scale_rewards_by_std
        )
        mask = tokens.completion_mask
        if a.mask_truncated:
            mask = truncation_mask([c.finish_reason for c in batch.completions], mask)
        # One update per batch: pi_old == pi_theta, so the update's own logprobs (detached) serve as
        # the old ones and no extra forward pass is run.
        old_lp = ref_lp = None
        if a.num_iterations > 1:
            old_lp = batched_logprobs(model, tokens, temperature, device, micro, chunk_tokens=chunk)
        if a.beta > 0:
            ref_lp = batched_logprobs(
                model, tokens, temperature, device, micro, reference=policy, chunk_tokens=chunk
            )
        count = normalizer_count(a.loss_type, mask, cfg.rollout.max_completion_length)
    else:  # this rank kept no group this step; it still joins every collective
        count = 0.0
    t1 = time.perf_counter()
    norm = max(1.0, dist.sum([count])[0])
    model.train()
    parts: list[tuple[float, dict[str, float]]] = []
    grad_norms = []
    for _ in range(a.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        failure: str | None = None
        for begin in range(0, len(batch), micro):
            rows = slice(begin, begin + micro)
            part: TokenBatch = tokens.rows(rows)
            lp = completion_logprobs(model, part, temperature, device, chunk, pack=cfg.train.pack_sequences)
            old = old_lp[rows].to(device) if old_lp is not None else lp.detach()
            try:
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
            except NonFiniteLossError as exc:
                failure = str(exc)
                break
            loss.backward()
            parts.append((stats.get("num_tokens", 0.0), stats))
        # Every rank learns of a failure on any rank before the gradient all-reduce (else the
        # others would wait in it for ever).
        if dist.any(failure is not None):
            raise NonFiniteLossError(failure or "the loss of another rank was not finite")
        dist.all_reduce_gradients(params)
        # The norm first, then the check, then the clip: clipping by a NaN norm would make every
        # gradient NaN and hide which tensors were bad.
        grads = [p.grad for _, p in params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
        if not torch.isfinite(grad_norm):
            raise NonFiniteLossError(f"the gradient norm is {grad_norm.item()} {_nonfinite_grads(params)}")
        torch.nn.utils.clip_grads_with_norm_([p for _, p in params], cfg.train.max_grad_norm, grad_norm)
        grad_norms.append(float(grad_norm))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # LoRA gradients are not needed until the next update
    t2 = time.perf_counter()
    all_parts = [p for rank_parts in dist.all_gather_object(parts) for p in rank_parts]
    merged = merge_stats(all_parts) if all_parts else {}
    merged["grad_norm"] = sum(grad_norms) / len(grad_norms)
    merged["num_sequences"] = dist.sum([float(len(batch))])[0]
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
    return max(1.0, normalizer_count(loss_type, mask, max_completion_length))


def _nonfinite_grads(params: list[tuple[str, nn.Parameter]], shown: int = 3) -> str:
    """Which trainable tensors hold the NaN/inf gradients (the loss itself was finite), for the report."""
    bad = [n for n, p in params if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if not bad:
        return "(every gradient tensor is finite: the norm itself overflowed)"
    more = f" and {len(bad) - shown} more" if len(bad) > shown else ""
    return f"(non-finite gradients in {len(bad)} of {len(params)} tensors: {', '.join(bad[:shown])}{more})"


def normalizer_count(loss_type: str, mask: torch.Tensor, max_completion_length: int) -> float:
    """The loss denominator's count over ``mask``'s rows, unclamped so that ranks can add theirs:
    non-empty sequences (grpo), tokens (dapo), or rows x max completion length (dr_grpo)."""
    if loss_type == "grpo":
        return float(int((mask.sum(dim=1) > 0).sum()))
    if loss_type == "dapo":
        return float(mask.sum())
    return float(mask.shape[0] * max_completion_length)

"""The policy update on one batch of rollouts: advantages, the fixed logprobs (old policy, KL
reference), then ``num_iterations`` optimizer steps, micro-batched, with the clipped surrogate,
truncated importance sampling and gradient clipping. The stats describe one pass over the batch
(iterations averaged); with ``num_iterations > 1`` the update runs without dropout, like the old
logprobs it is compared with (:func:`matching_dropout`).

Every micro-batch is normalised by the whole batch's denominator (:func:`normalizer`), so the
micro-batch gradients add up to the full-batch gradient.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qerl_cli.config import TrainConfig
from qerl_cli.rl.advantages import group_advantages
from qerl_cli.rl.distributed import Distributed
from qerl_cli.rl.importance import LOGPROB_GAP
from qerl_cli.rl.losses import NonFiniteGradientError, NonFiniteLossError, policy_loss
from qerl_cli.rl.phase import UPDATE, in_phase
from qerl_cli.rl.policy import Policy, TokenBatch, batched_logprobs, completion_logprobs, make_token_batch
from qerl_cli.rl.rollouts import Rollouts
from qerl_cli.rl.sampling import truncation_mask

log = logging.getLogger(__name__)


@dataclass
class FixedInputs:
    """What stays fixed over the iterations on one batch: tokens, advantages, the loss mask, the
    old-policy and reference logprobs (None when not needed), this rank's normaliser count and the
    LM head's chunk (tokens) of every logprob pass."""

    tokens: TokenBatch
    advantages: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    count: float
    logprob_chunk: int


def update_policy(
    cfg: TrainConfig,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    params: list[tuple[str, nn.Parameter]],
    batch: Rollouts,
    *,
    tis_on: bool,
    micro_batch_size: int,
    logprob_chunk: int,
    dist: Distributed | None = None,
) -> dict[str, Any]:
    """Train on ``batch``; return the loss stats of one pass over it, grad norm and timings.

    With several ranks ``batch`` is this rank's share (whole groups, possibly none): the normaliser
    counts every rank's rows, the gradients are summed over ranks before clipping, and the stats
    are those of the whole batch, so every rank takes the single-process step on the same batch.
    ``micro_batch_size``: the memory plan's resolution of ``train.micro_batch_size`` (it may be ``auto``);
    ``logprob_chunk``: its resolution of ``train.logprob_chunk_tokens`` (0: no chunking).
    With ``num_iterations > 1`` each figure is the mean over the iterations (extremes: over all of
    them) and token counts are the batch's, counted once.

    A NaN/inf loss or gradient norm raises :class:`NonFiniteLossError` (:class:`NonFiniteGradientError`
    for the gradients) on every rank at once, with the gradients zeroed and that iteration's optimizer
    step not taken (iterations before it, with ``num_iterations > 1``, have stepped): the trainer
    decides whether the run goes on (``train.max_nonfinite_steps``).
    """
    dist = dist or Distributed()
    t0 = time.perf_counter()
    fixed = fixed_inputs(cfg, policy, batch, micro_batch_size, logprob_chunk) if len(batch) else None
    # A rank that kept no group this step still joins every collective.
    norm = max(1.0, dist.sum([fixed.count if fixed else 0.0])[0])
    t1 = time.perf_counter()
    policy.model.train()
    iteration_parts: list[list[tuple[float, dict[str, float]]]] = []
    grad_norms: list[float] = []
    try:
        # What a GPU watcher sees now is the update's work (the span timed as time_update_s).
        with (
            in_phase(UPDATE),
            matching_dropout(policy.model, separate_old_pass=cfg.algorithm.num_iterations > 1),
        ):
            for _ in range(cfg.algorithm.num_iterations):
                optimizer.zero_grad(set_to_none=True)
                iteration_parts.append(
                    accumulate_gradients(cfg, policy, fixed, norm, micro_batch_size, tis_on=tis_on, dist=dist)
                )
                grad_norms.append(clip_and_step(cfg, optimizer, params, dist))
    except NonFiniteLossError:
        # The bad gradients were never stepped on; drop them, so that a skipped step leaves nothing behind.
        optimizer.zero_grad(set_to_none=True)
        raise
    optimizer.zero_grad(set_to_none=True)  # LoRA gradients are not needed until the next update
    t2 = time.perf_counter()
    merged = update_stats(iteration_parts, dist)
    merged["grad_norm"] = sum(grad_norms) / len(grad_norms)
    merged["num_sequences"] = dist.sum([float(len(batch))])[0]
    merged["time_logprobs_s"] = t1 - t0
    merged["time_update_s"] = t2 - t1
    if cfg.algorithm.beta == 0:
        merged.pop("kl", None)  # no reference pass was run: there is no KL figure
    warn_on_logprob_gap(merged.get(LOGPROB_GAP), cfg.rollout.logprob_gap_warn)
    return merged


def warn_on_logprob_gap(gap: float | None, bound: float) -> bool:
    """Warn (and return True) when the rollout engine's logprobs on the trained tokens sit further
    from the trainer's than ``rollout.logprob_gap_warn``: TIS still corrects the step, but a gap this
    large means the rollout model is not the policy being trained closely enough to trust."""
    if gap is None or gap <= bound:
        return False
    log.warning(
        "!!! the rollout/trainer logprob gap is %.3f nats/token, above rollout.logprob_gap_warn=%.3f: "
        "the rollout engine samples from a model that differs from the trainer's policy (FP8 copy, "
        "merged LoRA, kernels). Check rollout.linear_backend (fp8 / fp8-merged round the weights once "
        "more; marlin does not) and the staleness probe; TIS keeps correcting the step.",
        gap, bound,
    )  # fmt: skip
    return True


def fixed_inputs(
    cfg: TrainConfig, policy: Policy, batch: Rollouts, micro_batch_size: int, chunk: int
) -> FixedInputs:
    """Tokenise the batch and take what every iteration shares (no gradient)."""
    a = cfg.algorithm
    model, device, temperature = policy.model, policy.device, cfg.rollout.temperature
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
        old_lp = batched_logprobs(model, tokens, temperature, device, micro_batch_size, chunk_tokens=chunk)
    if a.beta > 0:
        ref_lp = batched_logprobs(
            model, tokens, temperature, device, micro_batch_size, reference=policy, chunk_tokens=chunk
        )
    count = normalizer_count(a.loss_type, mask, cfg.rollout.max_completion_length)
    return FixedInputs(tokens, advantages, mask, old_lp, ref_lp, count, chunk)


@contextmanager
def matching_dropout(model: nn.Module, *, separate_old_pass: bool) -> Iterator[None]:
    """Keep the policy ratio's two sides in one dropout state.

    The old logprobs of ``num_iterations > 1`` come from a separate no-grad pass without dropout
    (``batched_logprobs``). If the update's forward applied LoRA dropout, the ratio would move
    away from 1 by dropout noise alone and the clip would cut gradients the policy never earned;
    so, as TRL's ``disable_dropout`` and verl's dropout-free actors do, the update runs without
    dropout too. The model stays in train mode (gradient checkpointing only acts in train mode):
    only its dropout modules are switched off. With one iteration the old logprobs are the
    update's own, detached, so the ratio is 1 by construction and LoRA dropout still acts.
    """
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.training]
    if not separate_old_pass:
        dropouts = []
    for module in dropouts:
        module.eval()
    try:
        yield
    finally:
        for module in dropouts:
            module.train()


def accumulate_gradients(
    cfg: TrainConfig,
    policy: Policy,
    fixed: FixedInputs | None,
    norm: float,
    micro_batch_size: int,
    *,
    tis_on: bool,
    dist: Distributed,
) -> list[tuple[float, dict[str, float]]]:
    """One pass over this rank's rows, micro-batch by micro-batch: loss, backward. Returns each
    micro-batch's (token count, stats). A non-finite loss on any rank stops every rank."""
    failure: str | None = None
    parts: list[tuple[float, dict[str, float]]] = []
    size = fixed.tokens.size if fixed is not None else 0  # a rank without rows still joins below
    for begin in range(0, size, micro_batch_size):
        assert fixed is not None
        try:
            rows = slice(begin, begin + micro_batch_size)
            loss, stats = micro_batch_loss(cfg, policy, fixed, rows, norm, tis_on=tis_on)
        except NonFiniteLossError as exc:
            failure = str(exc)
            break
        loss.backward()
        parts.append((stats.get("num_tokens", 0.0), stats))
    # Every rank learns of a failure on any rank before the gradient all-reduce (else the others
    # would wait in it for ever).
    if dist.any(failure is not None):
        raise NonFiniteLossError(failure or "the loss of another rank was not finite")
    return parts


def micro_batch_loss(
    cfg: TrainConfig, policy: Policy, fixed: FixedInputs, rows: slice, norm: float, *, tis_on: bool
) -> tuple[torch.Tensor, dict[str, float]]:
    a, device = cfg.algorithm, policy.device
    part = fixed.tokens.rows(rows)
    temperature, pack = cfg.rollout.temperature, cfg.train.pack_sequences
    lp = completion_logprobs(policy.model, part, temperature, device, fixed.logprob_chunk, pack=pack)
    old = fixed.old_logprobs[rows].to(device) if fixed.old_logprobs is not None else lp.detach()
    return policy_loss(
        lp,
        old,
        fixed.advantages[rows].to(device),
        fixed.mask[rows].to(device),
        loss_type=a.loss_type,
        eps_low=a.eps_low,
        eps_high=a.eps_high,
        beta=a.beta,
        ref_logprobs=fixed.ref_logprobs[rows].to(device) if fixed.ref_logprobs is not None else None,
        rollout_logprobs=part.rollout_logprobs.to(device),
        tis_cap=a.tis_cap if tis_on else None,
        max_completion_length=cfg.rollout.max_completion_length,
        normalizer=norm,
    )


def clip_and_step(
    cfg: TrainConfig,
    optimizer: torch.optim.Optimizer,
    params: list[tuple[str, nn.Parameter]],
    dist: Distributed,
) -> float:
    """Sum the gradients over ranks, clip them by their total norm, step; returns the norm.

    A non-finite norm raises :class:`NonFiniteGradientError` before the step. The norm is taken after
    the all-reduce, so every rank holds the same gradients, reaches the same verdict and skips together.
    """
    dist.all_reduce_gradients(params)
    # The norm first, then the check, then the clip: clipping by a NaN norm would make every
    # gradient NaN and hide which tensors were bad.
    grads = [p.grad for _, p in params if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads)
    if not torch.isfinite(grad_norm):
        raise NonFiniteGradientError(f"the gradient norm is {grad_norm.item()} {_nonfinite_grads(params)}")
    torch.nn.utils.clip_grads_with_norm_([p for _, p in params], cfg.train.max_grad_norm, grad_norm)
    optimizer.step()
    return float(grad_norm)


def update_stats(
    iteration_parts: list[list[tuple[float, dict[str, float]]]], dist: Distributed
) -> dict[str, float]:
    """The stats of one pass over the whole batch (all ranks): each iteration's micro-batches
    merged (:func:`merge_stats`), then the iterations averaged (:func:`mean_over_iterations`)."""
    gathered = dist.all_gather_object(iteration_parts)  # per rank, per iteration
    per_iteration = []
    for i in range(len(iteration_parts)):
        parts = [p for rank_parts in gathered for p in rank_parts[i]]
        if parts:
            per_iteration.append(merge_stats(parts))
    return mean_over_iterations(per_iteration)


def mean_over_iterations(stats: list[dict[str, float]]) -> dict[str, float]:
    """Iterations' stats as one pass's: extremes over all of them, every other figure (loss, token
    count, fractions) their mean, so ``num_iterations`` does not scale sums such as the loss."""
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for s in stats for k in s):
        values = [s[key] for s in stats if key in s]
        if key.endswith("_max"):
            merged[key] = max(values)
        elif key.endswith("_min"):
            merged[key] = min(values)
        else:
            merged[key] = sum(values) / len(values)
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

"""The clipped policy-gradient loss of GRPO, DAPO and Dr.GRPO.

Per completion token t of sequence i (all tensors ``[B, T]``, ``mask`` marks completion tokens):

    ratio    = exp(logprobs - old_logprobs)
    pg_t     = -min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)
    pg_t    *= min(exp(old_logprobs - rollout_logprobs), tis_cap)     # only with TIS on
    kl_t     = exp(ref - logprobs) - (ref - logprobs) - 1              # k3 estimator, only with beta
    loss     = agg(pg) + beta * agg(kl)

``eps_high > eps_low`` is DAPO's "clip-higher": a token whose probability the update raises
(positive advantage) may move further before its gradient is cut, which keeps low-probability
exploratory tokens alive and the policy entropy from collapsing.

Aggregation ``agg`` by ``loss_type``:

- ``grpo``: mean over each sequence's tokens, then mean over sequences (every sequence weighs the
  same, so each token of a long completion weighs less);
- ``dapo``: mean over every token of the batch (every token weighs the same);
- ``dr_grpo``: sum over tokens / (B * max_completion_length): a constant normaliser, so the loss
  carries no length bias at all.

Several updates on one rollout batch (``num_iterations > 1``) are the trainer's loop: it computes
``old_logprobs`` once, before the first update, and passes the same tensor to every update. This
function always detaches ``old_logprobs``; on the first update (or with a single iteration) the
trainer may simply pass ``logprobs`` itself, giving ratio 1 and the plain policy gradient, and on
later updates the ratio moves away from 1 so that clipping acts.
"""

from __future__ import annotations

import torch

from qerl_cli.errors import QerlError
from qerl_cli.rl.importance import tis_weights

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")


class NonFiniteLossError(QerlError):
    """The loss (or one of its terms) came out NaN or infinite; the message names the term.

    ``metric`` is the step record's flag for it: ``nonfinite_loss`` when the loss was caught before
    backward, ``nonfinite_grad`` (:class:`NonFiniteGradientError`) when the loss was finite and the
    gradients were not. The trainer skips such a step up to ``train.max_nonfinite_steps`` times in a row.
    """

    metric = "nonfinite_loss"


class NonFiniteGradientError(NonFiniteLossError):
    """A finite loss whose gradient norm (after the sum over ranks) is NaN or infinite."""

    metric = "nonfinite_grad"


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int | None = None,
    normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token quantity to a scalar the way ``loss_type`` prescribes.

    ``per_token`` must already be zero at masked-out positions. ``normalizer`` overrides the
    denominator so that a trainer splitting one batch into micro-batches can normalise every
    micro-batch by the whole batch's figure: the number of non-empty sequences (grpo), of tokens
    (dapo), or B * max_completion_length (dr_grpo).
    """
    mask_f = mask.to(per_token.dtype)
    if loss_type == "grpo":
        tokens_per_seq = mask_f.sum(dim=1)
        seq_means = per_token.sum(dim=1) / tokens_per_seq.clamp(min=1.0)
        # A sequence with no completion token (e.g. a truncated completion masked out of the loss)
        # is left out of the batch mean rather than counted as a zero that dilutes the others.
        denom = normalizer if normalizer is not None else (tokens_per_seq > 0).sum().clamp(min=1)
        return seq_means.sum() / denom
    if loss_type == "dapo":
        denom = normalizer if normalizer is not None else mask_f.sum().clamp(min=1.0)
        return per_token.sum() / denom
    if loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else per_token.shape[1]
        if length < per_token.shape[1]:
            raise QerlError(
                f"max_completion_length {length} is shorter than the padded completion length "
                f"{per_token.shape[1]}; pass the generation limit used for the rollouts"
            )
        denom = normalizer if normalizer is not None else per_token.shape[0] * length
        return per_token.sum() / denom
    raise QerlError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")


def _check_finite(value: torch.Tensor, term: str, hint: str) -> None:
    if not torch.isfinite(value).item():
        raise NonFiniteLossError(f"the {term} term of the loss is {value.item()}: {hint}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    max_completion_length: int | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss to minimise, and float stats for logging.

    ``logprobs`` carries the gradient; ``old_logprobs``, ``ref_logprobs`` and ``rollout_logprobs``
    are treated as constants. ``advantages`` is ``[B]`` (one per sequence) or ``[B, T]``.
    TIS re-weighting is applied when both ``rollout_logprobs`` and ``tis_cap`` are given; with only
    ``rollout_logprobs`` the mismatch is still reported in the stats. The KL term needs
    ``ref_logprobs`` when ``beta != 0``; with ``beta == 0`` a given ``ref_logprobs`` only feeds the
    ``kl`` stat. ``normalizer``: see :func:`aggregate`.

    Stats: ``loss``, ``policy_loss``, ``kl``, ``clip_fraction`` (= ``clip_fraction_low`` +
    ``clip_fraction_high``), ``ratio_mean``/``ratio_min``/``ratio_max``, ``num_tokens`` and, with
    rollout logprobs, ``tis_weight_mean``/``tis_weight_max``/``tis_raw_weight_max``/
    ``tis_capped_fraction``. Raises :class:`NonFiniteLossError` on a NaN/inf loss term.
    """
    _check_inputs(logprobs, old_logprobs, mask, ref_logprobs, rollout_logprobs,
                  loss_type=loss_type, eps_low=eps_low, eps_high=eps_high, beta=beta)  # fmt: skip
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.detach().float().expand(logprobs.shape)
    keep = mask.bool()
    mask_f = keep.float()
    # Padding may hold anything (even -inf); zero it *before* any exp so that neither the forward
    # value nor the backward pass (0 * inf = nan through torch.where) can be poisoned by it.
    lp = _masked(logprobs.float(), keep)
    ratio = torch.exp(lp - _masked(old_logprobs.detach().float(), keep))
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token_pg = -torch.min(ratio * advantages, clipped_ratio * advantages)

    stats: dict[str, float] = {}
    if rollout_logprobs is not None:
        cap = tis_cap if tis_cap is not None else float("inf")
        weights, tis_stats = tis_weights(old_logprobs, rollout_logprobs, mask, cap=cap)
        stats.update(tis_stats)
        if tis_cap is not None:
            # The weight corrects the sampling distribution of the surrogate's gradient; it is a
            # constant (no gradient flows through it). The KL regulariser below stays unweighted,
            # as in TRL's vLLM importance-sampling correction.
            per_token_pg = per_token_pg * weights

    agg_kwargs = {"max_completion_length": max_completion_length, "normalizer": normalizer}
    pg_term = aggregate(per_token_pg * mask_f, keep, loss_type, **agg_kwargs)
    _check_finite(
        pg_term,
        "policy-gradient",
        "logprobs, old_logprobs or advantages contain NaN/inf, or the ratio overflowed "
        "(old and new log-probabilities differ by > 80 nats); check the rollout batch",
    )
    loss = pg_term
    kl_mean = 0.0
    if ref_logprobs is not None:
        per_token_kl = k3_kl(lp, _masked(ref_logprobs.detach().float(), keep)) * mask_f
        if beta != 0.0:
            kl_term = aggregate(per_token_kl, keep, loss_type, **agg_kwargs)
            _check_finite(
                kl_term, "KL", "ref_logprobs or logprobs contain NaN/inf or differ too much to exponentiate"
            )
            loss = loss + beta * kl_term
        kl_mean = (per_token_kl.detach().sum() / mask_f.sum().clamp(min=1.0)).item()
    stats.update(loss=loss.item(), policy_loss=pg_term.item(), kl=kl_mean)
    stats.update(ratio_stats(ratio.detach(), advantages, keep, eps_low, eps_high))
    return loss, stats


def _check_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    rollout_logprobs: torch.Tensor | None,
    *,
    loss_type: str,
    eps_low: float,
    eps_high: float,
    beta: float,
) -> None:
    if loss_type not in LOSS_TYPES:
        raise QerlError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    if not 0.0 <= eps_low < 1.0 or eps_high < 0.0:
        raise QerlError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0; got {eps_low}, {eps_high}")
    if beta != 0.0 and ref_logprobs is None:
        raise QerlError("beta != 0 adds a KL penalty, which needs ref_logprobs from the reference model")
    for name, other in (
        ("old_logprobs", old_logprobs),
        ("mask", mask),
        ("ref_logprobs", ref_logprobs),
        ("rollout_logprobs", rollout_logprobs),
    ):
        if other is not None and other.shape != logprobs.shape:
            raise QerlError(f"{name} has shape {tuple(other.shape)}, expected {tuple(logprobs.shape)}")


def _masked(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, values, torch.zeros_like(values))


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0, unbiased)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


@torch.no_grad()
def ratio_stats(
    ratio: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor, eps_low: float, eps_high: float
) -> dict[str, float]:
    """Clip fractions (a token is clipped when the clip cuts its gradient) and the ratio's spread."""
    n = keep.sum().item()
    low = ((ratio < 1.0 - eps_low) & (advantages < 0) & keep).sum().item()
    high = ((ratio > 1.0 + eps_high) & (advantages > 0) & keep).sum().item()
    kept_ratio = ratio[keep]
    return {
        "clip_fraction_low": low / n if n else 0.0,
        "clip_fraction_high": high / n if n else 0.0,
        "clip_fraction": (low + high) / n if n else 0.0,
        "ratio_mean": kept_ratio.mean().item() if n else 0.0,
        "ratio_min": kept_ratio.min().item() if n else 0.0,
        "ratio_max": kept_ratio.max().item() if n else 0.0,
        "num_tokens": float(n),
    }

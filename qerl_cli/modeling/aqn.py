"""Adaptive Quantization Noise (AQN): the sigma schedule and the RMSNorm perturbation.

QeRL (arXiv 2510.11696, Sec. 3.3 and Appendix F) turns the static quantization error of the
4-bit rollout model into a decaying exploration signal: before each rollout, every RMSNorm
weight ``w`` of the *rollout* model becomes ``w + z`` with ``z ~ N(0, sigma^2)`` drawn per channel.
Because an RMSNorm scale multiplies the input of the following linear layers, this equals a
row-wise multiplicative noise ``(1 + z / w)`` on those (quantized) weights, without touching the
4-bit kernels.

Gemma's norms (HF ``Gemma3RMSNorm``, vLLM ``GemmaRMSNorm``) store ``w`` but scale by ``1 + w``. Adding
``z`` to the stored ``w`` gives the channel scale ``(1 + w) + z``: the same additive N(0, sigma^2) on
the scale the norm applies as ``w + z`` is for a Llama/Qwen norm, so no special case is needed (a
multiplicative ``w * (1 + z)`` would be wrong there: a stored weight near 0 would get no noise). How
much of a sigma survives the bf16 cast depends on the stored values: on Qwen, ``w`` near 1.0 rounds
sigmas below ~4e-3 mostly away (see below); Gemma 3 270M's 55,936 stored norm weights are large (median
|w| 6, 90th percentile 104), so sigma 5e-4 moves 3.9% of them, 1e-2 34%, 3e-2 50% (measured on its BF16
checkpoint, 2026-11-27); ``rollout/noise_changed_fraction`` reports this share, not a share of tokens.

Schedule (matching NVlabs/QeRL ``trl_trainer/noise_scheduler.py`` and ``grpo_trainer.py``): the
training steps are split into ``num_stages`` (K) equal stages; stage 0 is noise-free (only the
quantization noise acts) and stages 1..K-1 use K-1 sigma values going from ``sigma_start`` to
``sigma_end``. The reference code only implements the exponential (geometric) decay
``sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))``; the paper's Fig. 15 also
compares linear, cosine and logarithmic decay without formulas, so those three are defined here
(see :func:`_decay_fraction`) to share the same end points.

Sizing sigma to the model (``aqn.calibrate``, not in the paper): a raw sigma does not transfer between
models (the paper's 1e-2 stopped Gemma 3 270M from learning), so a run may state the noise as its effect
instead. :func:`tokens_changed` measures the share of greedy completion tokens noise changed,
:func:`search_sigma` bisects log(sigma) for a target share, and :meth:`AQNSchedule.calibrate` moves the
schedule there keeping sigma_end / sigma_start; ``rl.aqn_calibration`` drives the engine.

Deliberate differences from the reference code:

- The reference adds noise in place to the rollout model's norm weights every step, so the noise
  accumulates across steps (a random walk). QeRL's Algorithm 1 and Eq. 10 describe
  ``w_noise = w + Z``, i.e. always from the clean weight; we follow the paper: every draw starts
  from the clean copy and :meth:`NormNoiser.restore` puts the exact clean weights back.
- The reference computes the stage with float division (``int(step // (total / K))``); we use the
  integer form ``step * K // total`` which is the same value without rounding surprises.
- The noise is drawn in float32 and added to the float32 clean weight before casting to the
  weight's dtype (the reference casts the noise to bf16 first). Note that in bf16 a weight near 1.0
  has a spacing of 2**-7, so sigmas well below ~4e-3 mostly round away;
  :attr:`NormNoiser.last_changed_fraction` reports how many elements actually changed.

The trainer's forward must never see the noise. With the HF engine (rollout model == policy
model) the trainer wraps *only* generation in ``with noiser.noised(sigma, generator):`` (or calls
:meth:`NormNoiser.apply` before and :meth:`NormNoiser.restore` after generation); the vLLM engine
keeps its own clean copy and loads :func:`perturb_norm_weights` output into its model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from qerl_cli.config.checks import aqn_sigmas, noise_sigma
from qerl_cli.errors import QerlError

SCHEDULE_KINDS = ("exponential", "linear", "cosine", "logarithmic")


def _decay_fraction(kind: str, u: float, num_noisy_stages: int) -> float:
    """Fraction of the way from sigma_start (0) to sigma_end (1) at position ``u`` in [0, 1].

    Used for the non-exponential shapes: linear ``u``; cosine ``(1 - cos(pi u)) / 2`` (slow at both
    ends); logarithmic ``ln(1 + (n - 1) u) / ln(n)`` with n noisy stages, which at noisy stage j
    (1-based) is ``ln(j) / ln(n)``: a sharp early drop that flattens out, as the paper describes.
    """
    if kind == "linear":
        return u
    if kind == "cosine":
        return (1.0 - math.cos(math.pi * u)) / 2.0
    if kind == "logarithmic":
        if num_noisy_stages < 2:
            return 0.0
        return math.log1p((num_noisy_stages - 1) * u) / math.log(num_noisy_stages)
    raise QerlError(f"unknown AQN schedule {kind!r}; choose one of {', '.join(SCHEDULE_KINDS)}")


@dataclass(kw_only=True)
class AQNSchedule:
    """Sigma per training step: K equal stages, the first noise-free, then a decay.

    ``step`` is the 0-based index of the training step about to roll out; steps at or beyond
    ``total_steps`` stay in the last stage. With ``first_stage_noise_free=False`` all K stages are
    noisy and the decay runs over K values instead of K-1.
    """

    total_steps: int
    sigma_start: float = 1e-2
    sigma_end: float = 1e-4
    num_stages: int = 10
    kind: str = "exponential"
    first_stage_noise_free: bool = True
    # Set by :meth:`calibrate`: sigma_start was sized to the model at the start of the run. Part of the
    # state, so a resumed run keeps the calibrated schedule instead of measuring again.
    calibrated: bool = False

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise QerlError(f"unknown AQN schedule {self.kind!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
        if self.total_steps < 1:
            raise QerlError(f"AQN needs total_steps >= 1, got {self.total_steps}")
        if self.num_stages < 1:
            raise QerlError(f"AQN needs num_stages >= 1, got {self.num_stages}")
        if self.first_stage_noise_free and self.num_stages < 2:
            raise QerlError(
                "AQN with num_stages=1 and a noise-free first stage never adds noise; "
                "set num_stages >= 2 or turn AQN off"
            )
        # The recipe's rule (its errors name the recipe's aqn keys, where these values come from), so a
        # calibrated or resumed schedule is held to what the recipe was.
        aqn_sigmas("aqn", self.sigma_start, self.sigma_end, self.kind)

    @property
    def num_noisy_stages(self) -> int:
        return self.num_stages - 1 if self.first_stage_noise_free else self.num_stages

    def stage(self, step: int) -> int:
        """Stage index in [0, num_stages) of a 0-based training step."""
        if step < 0:
            raise QerlError(f"AQN step must be >= 0, got {step}")
        return min(step * self.num_stages // self.total_steps, self.num_stages - 1)

    def stage_sigma(self, stage: int) -> float:
        """Sigma of one stage (0 for the noise-free first stage)."""
        if not 0 <= stage < self.num_stages:
            raise QerlError(f"AQN stage must be in [0, {self.num_stages}), got {stage}")
        j = stage - 1 if self.first_stage_noise_free else stage  # index among the noisy stages
        if j < 0:
            return 0.0
        n = self.num_noisy_stages
        u = j / (n - 1) if n > 1 else 0.0
        if self.kind == "exponential":
            return self.sigma_start * (self.sigma_end / self.sigma_start) ** u
        return self.sigma_start + (self.sigma_end - self.sigma_start) * _decay_fraction(self.kind, u, n)

    def sigma(self, step: int) -> float:
        return self.stage_sigma(self.stage(step))

    def stage_sigmas(self) -> list[float]:
        """Sigma of every stage, for logs and plots."""
        return [self.stage_sigma(k) for k in range(self.num_stages)]

    def starts_noisy_stage(self, step: int) -> bool:
        """Whether ``step`` is the first step of a noisy stage (where the trainer measures the noise's
        effect). Steps past ``total_steps`` stay in the last stage and start none."""
        stage = self.stage(step)
        first = step == 0 or self.stage(step - 1) != stage
        return first and self.stage_sigma(stage) > 0

    def calibrate(self, sigma_start: float) -> None:
        """Start the decay at ``sigma_start`` (found by a calibration) and scale ``sigma_end`` by the same
        factor: the ratio sigma_end / sigma_start, hence the shape of the schedule, is kept."""
        sigma_end = sigma_start * (self.sigma_end / self.sigma_start)
        aqn_sigmas("aqn", sigma_start, sigma_end, self.kind)  # before the schedule changes
        self.sigma_end, self.sigma_start = sigma_end, sigma_start
        self.calibrated = True
        self._validate()

    def state_dict(self) -> dict[str, Any]:
        # The schedule is a pure function of its settings and the step, so its settings are its state;
        # saving them lets --resume continue on the schedule the run started with.
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - set(asdict(self))
        if unknown:
            raise QerlError(f"AQN state has unknown keys {sorted(unknown)}; was it saved by another version?")
        for key, value in state.items():
            setattr(self, key, value)
        self._validate()


# ---------------------------------------------------------------------------------------------
# Sizing sigma to the model: the effect measure and the search (driven by qerl_cli.rl.aqn_calibration)
# ---------------------------------------------------------------------------------------------
# Where the calibration looks for sigma_start: from 1e-5, fifty times below the paper's smallest sigma
# (5e-4; a bf16 norm weight near 1.0 rounds it away entirely), to 1e-1, ten times its largest (each
# channel scale moved by about 10%).
SIGMA_SEARCH_RANGE = (1e-5, 1e-1)


def tokens_changed(clean: Sequence[Sequence[int]], noisy: Sequence[Sequence[int]]) -> float:
    """Share of greedy completion tokens the noise changed, over pairs of completions of the same prompts.

    In each pair every token from the first position where the two differ on counts as changed, over
    the longer of the two (a completion that stops early or runs on changed its tail). Counting from the
    first divergence rather than position by position: greedy decoding is a function of its prefix, so
    each token after the first difference is generated from another context, and one that happens to
    match at its position (a space, a repeated word, text shifted back into line) is a coincidence
    whose rate depends on the text; the first divergence moves steadily earlier as sigma grows, which
    keeps the measure a near-monotone function of sigma for the search.
    """
    if len(clean) != len(noisy):
        raise QerlError(f"tokens_changed needs pairs: {len(clean)} clean and {len(noisy)} noisy completions")
    changed = total = 0
    for a, b in zip(clean, noisy, strict=True):
        longest = max(len(a), len(b))
        shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        changed += longest - shared
        total += longest
    return changed / total if total else 0.0


@dataclass(frozen=True)
class SigmaSearch:
    """What :func:`search_sigma` found: the probe closest to the target, and every probe in order."""

    sigma: float
    effect: float
    target: float
    probes: tuple[tuple[float, float], ...]  # (sigma, effect) in the order they were measured
    converged: bool  # the effect is within the tolerance of the target

    def summary(self) -> str:
        """One line for the run log: the target, the sigma found, its effect and the probes."""
        probes = ", ".join(f"{s:.3g}->{e:.3g}" for s, e in self.probes)
        outcome = (
            "within tolerance" if self.converged else "closest probe, target not reached within tolerance"
        )
        return (
            f"target {self.target:.3g}, sigma {self.sigma:.4g} measured {self.effect:.4g} ({outcome}); "
            f"{len(self.probes)} probes (sigma->effect): {probes}"
        )


def search_sigma(
    effect: Callable[[float], float],
    target: float,
    *,
    max_probes: int = 10,
    tolerance: float = 0.2,
    sigma_range: tuple[float, float] = SIGMA_SEARCH_RANGE,
) -> SigmaSearch:
    """Bisect log(sigma) in ``sigma_range`` for ``effect(sigma) == target`` (``effect`` rising with sigma).

    Each probe is the geometric midpoint of the bracket; the search stops at the first probe whose
    effect is within ``tolerance * target`` of the target, or after ``max_probes`` (10 halve the four
    decades of the default range to a bracket 1% wide). It returns the probe closest to the target either
    way; ``converged`` says whether that one is within the tolerance. A target beyond what the range
    reaches ends at the range's edge, with ``converged`` False.
    """
    low, high = sigma_range
    if not 0 < low < high:
        raise QerlError(f"the AQN sigma search range must satisfy 0 < low < high, got {sigma_range}")
    if not target > 0 or max_probes < 1 or not tolerance > 0:
        raise QerlError(
            f"search_sigma needs target > 0, max_probes >= 1 and tolerance > 0; got {target}, "
            f"{max_probes}, {tolerance}"
        )
    lo, hi = math.log(low), math.log(high)
    probes: list[tuple[float, float]] = []
    for _ in range(max_probes):
        sigma = math.exp((lo + hi) / 2)
        measured = float(effect(sigma))
        probes.append((sigma, measured))
        if abs(measured - target) <= tolerance * target:
            break
        if measured < target:
            lo = math.log(sigma)
        else:
            hi = math.log(sigma)
    # Of equally close probes the latest, the one nearest where the effect crosses the target.
    sigma, measured = min(reversed(probes), key=lambda p: abs(p[1] - target))
    return SigmaSearch(
        sigma=sigma,
        effect=measured,
        target=target,
        probes=tuple(probes),
        converged=abs(measured - target) <= tolerance * target,
    )


def is_rms_norm(name: str, module: nn.Module) -> bool:
    """Default norm predicate: the module's class name ends with ``RMSNorm`` (Qwen2RMSNorm,
    LlamaRMSNorm, Qwen3RMSNorm, Gemma3RMSNorm, vLLM's RMSNorm and GemmaRMSNorm, ...) and it has a
    weight tensor."""
    has_weight = isinstance(getattr(module, "weight", None), torch.Tensor)
    return has_weight and type(module).__name__.endswith("RMSNorm")


def find_norm_modules(
    model: nn.Module, predicate: Callable[[str, nn.Module], bool] = is_rms_norm
) -> dict[str, nn.Module]:
    """Every module of ``model`` that ``predicate`` selects, by qualified name, in model order."""
    return {name: module for name, module in model.named_modules() if predicate(name, module)}


def perturb_norm_weights(
    clean: dict[str, torch.Tensor], sigma: float, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """New tensors ``clean[name] + N(0, sigma^2)`` (one draw per element), in ``clean``'s order.

    The noise is drawn on the generator's device (default RNG of each tensor's device without a
    generator) in float32, added in float32 and cast back to each tensor's dtype and device. Given
    the same generator state and the same name order, every caller (HF or vLLM engine) gets the same
    noise. ``clean`` is never modified.
    """
    noise_sigma("AQN sigma", sigma)
    noisy: dict[str, torch.Tensor] = {}
    for name, weight in clean.items():
        device = generator.device if generator is not None else weight.device
        noise = torch.randn(weight.shape, generator=generator, device=device, dtype=torch.float32)
        noisy[name] = (weight.float() + sigma * noise.to(weight.device)).to(weight.dtype)
    return noisy


class NormNoiser:
    """Perturb a plain torch model's RMSNorm weights from a clean copy, and put them back.

    The clean copy is taken at the first :meth:`apply` after construction or after a
    :meth:`restore`, so norms that are trainable (updated between rollouts) are picked up. While
    noised, further ``apply`` calls redraw from the same clean copy: noise never accumulates. Do not
    step an optimizer on the norms while noised: :meth:`restore` would undo that step.
    """

    def __init__(self, model: nn.Module, predicate: Callable[[str, nn.Module], bool] = is_rms_norm) -> None:
        self.modules = find_norm_modules(model, predicate)
        self._clean: dict[str, torch.Tensor] | None = None
        self.last_sigma = 0.0
        self.last_changed_fraction = 0.0

    @property
    def num_modules(self) -> int:
        return len(self.modules)

    @property
    def is_noised(self) -> bool:
        return self._clean is not None

    def apply(self, sigma: float, generator: torch.Generator | None = None) -> int:
        """Set every matched norm weight to clean + N(0, sigma^2); return how many were perturbed.

        ``sigma == 0`` restores the clean weights and returns 0. Raises :class:`QerlError` when
        ``sigma > 0`` and the model has no matching norm module (AQN would silently do nothing).
        """
        noise_sigma("AQN sigma", sigma)
        self.last_sigma = sigma
        if sigma == 0:
            self.restore()
            self.last_changed_fraction = 0.0
            return 0
        if not self.modules:
            raise QerlError(
                "AQN is on (sigma > 0) but the model has no RMSNorm module to perturb; use a model with "
                "RMSNorm layers, pass a norm predicate that matches its norms, or turn AQN off"
            )
        if self._clean is None:
            self._clean = {name: m.weight.detach().clone() for name, m in self.modules.items()}
        noisy = perturb_norm_weights(self._clean, sigma, generator)
        changed = total = 0
        with torch.no_grad():
            for name, module in self.modules.items():
                module.weight.copy_(noisy[name])
                changed += int((noisy[name] != self._clean[name]).sum())
                total += noisy[name].numel()
        self.last_changed_fraction = changed / total if total else 0.0
        return len(self.modules)

    def restore(self) -> None:
        """Put the exact clean weights back (no-op when not noised)."""
        if self._clean is None:
            return
        with torch.no_grad():
            for name, module in self.modules.items():
                module.weight.copy_(self._clean[name])
        self._clean = None

    @contextmanager
    def noised(self, sigma: float, generator: torch.Generator | None = None) -> Iterator[int]:
        """``with noiser.noised(sigma, g) as n:`` generate with noised norms; clean again on exit,
        even when generation raises."""
        try:
            yield self.apply(sigma, generator)
        finally:
            self.restore()

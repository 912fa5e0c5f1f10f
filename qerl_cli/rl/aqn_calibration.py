"""AQN sized to the model: find sigma_start from a target effect, and measure the effect every stage.

A raw sigma does not transfer between models or bases: it is added to norm weights whose scale differs
(an AWQ base divides the norms it smooths by its scales, so the same sigma is larger beside them; on a
bf16 norm near 1.0 small sigmas round away). ``aqn.calibrate: tokens`` states the noise as what it does
instead: the share of greedy completion tokens it changes (``aqn.target``). What raw and calibrated sigmas
did on one model: ``docs/aqn.md``.

Before the first training step (engine built, initial adapter synced) :class:`NoiseProbe` greedy-decodes
``aqn.calibration_prompts`` training prompts once without noise and, for each probed sigma, once with
noise drawn from one fixed seed, and :func:`search_sigma` bisects log(sigma) until :func:`tokens_changed`
is within the tolerance of the target. With one seed the noise direction is fixed and only its scale
changes, so the effect is a (near-monotone) function of sigma alone. The schedule
(:class:`~qerl_cli.rl.aqn_schedule.AQNSchedule`) then starts at the sigma found and keeps its configured
ratio sigma_end / sigma_start; it is saved in the checkpoint's AQN state, so ``--resume`` does not
measure again. Sizing sigma this way is not in the paper.

At the first step of every noisy stage the same prompts are decoded with that step's own noise (the
draw its rollouts see) and the share goes to the step's metrics as ``aqn_tokens_changed``, calibrated
or not: what the schedule does to the current policy, stage by stage.

Everything goes through the :class:`~qerl_cli.rollout.base.RolloutEngine` protocol (``generate`` and
``set_norm_noise``), so the HF and vLLM engines calibrate alike. Greedy decoding draws no random
numbers and the noise has its own generator, so calibration and measurement leave the run's random
streams, data position and batches as they were.

Cost: 2 + probes greedy passes over the calibration prompts (12 at most with the defaults: the clean
pass, a second one that checks the engine repeats itself without noise, the probes), batched as one
``generate`` each, then 2 per noisy stage.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qerl_cli.config import TrainConfig
from qerl_cli.data.problem import Problem
from qerl_cli.data.prompts import get_template
from qerl_cli.errors import QerlError
from qerl_cli.rl.aqn_schedule import AQNSchedule
from qerl_cli.rl.distributed import Distributed
from qerl_cli.rl.stream import PromptStream, derive_seed
from qerl_cli.rollout.base import RolloutEngine, SamplingSpec

log = logging.getLogger(__name__)

TOKENS_CHANGED_METRIC = "aqn_tokens_changed"


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


def raw_sigma_warning(cfg: TrainConfig, base_method: str | None) -> str | None:
    """A warning when AQN adds a raw sigma to the norms of an AWQ base: AWQ divided some of them by its
    smoothing scales, so the sigma is larger beside them than the same number on an unsmoothed base."""
    if not cfg.aqn.enabled or cfg.aqn.calibrate != "off" or base_method != "awq":
        return None
    return (
        f"AQN adds aqn.sigma_start={cfg.aqn.sigma_start:g} to the norm weights of an AWQ base, whose "
        "smoothing divided some norms by its scales: the noise is larger beside them than on an "
        "unsmoothed base, and can change most greedy tokens and stop learning "
        "(docs/aqn.md). State the noise as its effect instead, "
        "aqn.calibrate: tokens with aqn.target (e.g. 0.1), or use a GPTQ or RTN base"
    )


class NoiseProbe:
    """Greedy completions of a fixed set of training prompts, with and without norm noise."""

    def __init__(self, prompts: list[str], spec: SamplingSpec, *, target: float | None = None) -> None:
        self.prompts = prompts
        self.spec = spec
        self.target = target

    @classmethod
    def for_run(cls, cfg: TrainConfig, problems: list[Problem], prompts: dict[str, str]) -> NoiseProbe:
        """The run's probe: the first ``aqn.calibration_prompts`` prompts of a fresh copy of the run's seeded
        stream (the training stream's position is not touched, so batches and resume stay as they were)."""
        aqn = cfg.aqn
        stream = PromptStream(problems, cfg.train.seed, cfg.data.shuffle)
        chosen = stream.take(min(aqn.calibration_prompts, len(problems)))  # no prompt twice
        spec = SamplingSpec(
            max_new_tokens=aqn.calibration_max_tokens or cfg.rollout.max_completion_length,
            temperature=0.0,  # greedy: the model's own choice, so only the noise can change it
            top_p=1.0,
            seed=derive_seed(cfg.train.seed, "aqn-calibration"),
            stop=get_template(cfg.data.template).stop,  # completions end where the rollouts' do
        )
        target = aqn.target if aqn.calibrate == "tokens" else None
        return cls([prompts[p.id] for p in chosen], spec, target=target)

    def greedy(self, engine: RolloutEngine, sigma: float, seed: int) -> list[list[int]]:
        """Token ids of the greedy completion of every prompt, with noise ``sigma`` drawn from ``seed``."""
        engine.set_norm_noise(sigma, seed)
        result = engine.generate(self.prompts, 1, self.spec)
        return [group[0].token_ids for group in result.completions]

    def tokens_changed(self, engine: RolloutEngine, sigma: float, seed: int) -> float:
        """Share of greedy tokens that noise ``sigma`` (drawn from ``seed``) changes; the engine is left
        without noise (the step sets its own)."""
        try:
            clean = self.greedy(engine, 0.0, seed)
            return tokens_changed(clean, self.greedy(engine, sigma, seed))
        finally:
            engine.set_norm_noise(0.0, seed)

    def calibrate(
        self, engine: RolloutEngine, schedule: AQNSchedule, cfg: TrainConfig, dist: Distributed
    ) -> SigmaSearch:
        """Find the sigma whose noise changes ``target`` of the greedy tokens, start ``schedule`` there
        (keeping its sigma_end / sigma_start), and log what was found. Every rank measures; rank 0's sigma
        is kept, so the noise stays the same on every rank."""
        if self.target is None:
            raise ValueError("NoiseProbe.calibrate needs a target (aqn.calibrate=tokens)")
        aqn = cfg.aqn
        seed = derive_seed(cfg.train.seed, "aqn-calibration")
        start = time.perf_counter()
        try:
            clean = self.greedy(engine, 0.0, seed)
            # What a second noise-free pass changes: 0 on a deterministic engine; above 0 (batch-dependent
            # kernels) the measure has that floor, and a target near it cannot be told from no noise.
            floor = tokens_changed(clean, self.greedy(engine, 0.0, seed))
            search = search_sigma(
                lambda sigma: tokens_changed(clean, self.greedy(engine, sigma, seed)),
                self.target,
                max_probes=aqn.calibration_probes,
                tolerance=aqn.calibration_tolerance,
            )
        finally:
            engine.set_norm_noise(0.0, seed)
        search = dist.all_gather_object(search)[0]
        configured = (schedule.sigma_start, schedule.sigma_end)
        schedule.calibrate(search.sigma)
        log.info(
            "AQN calibration (greedy tokens changed, %d prompts x %d tokens, %.1f s): %s; schedule "
            "%.3g -> %.3g (configured %.3g -> %.3g, ratio kept); without noise %.3g changed",
            len(self.prompts), self.spec.max_new_tokens, time.perf_counter() - start, search.summary(),
            schedule.sigma_start, schedule.sigma_end, *configured, floor,
        )  # fmt: skip
        if (warning := floor_warning(floor, self.target)) is not None:
            log.warning("%s", warning)
        if not search.converged:
            log.warning(
                "AQN calibration did not reach aqn.target=%.3g within aqn.calibration_tolerance=%.3g in %d "
                "probes: using sigma %.3g, whose noise changes %.3g of the greedy tokens%s",
                self.target, aqn.calibration_tolerance, len(search.probes), search.sigma, search.effect,
                _miss_hint(search),
            )  # fmt: skip
        return search


# A target this many times the noise-free floor or less is mostly that floor's own scatter.
FLOOR_MARGIN = 3.0


def floor_warning(floor: float, target: float) -> str | None:
    """What to tell the user when the engine's greedy decoding is not repeatable (batch-dependent
    kernels): the share of tokens two noise-free passes differ in is a floor under every measure, and a
    target close to it calibrates on that scatter (vLLM's floor and the sigmas it scattered: docs/aqn.md)."""
    if floor <= 0:
        return None
    message = (
        f"the rollout engine's greedy decoding is not repeatable: two noise-free passes differ in "
        f"{floor:.3g} of the tokens, so aqn.target={target:.3g} is measured on top of that"
    )
    if target < FLOOR_MARGIN * floor:
        message += (
            f", and it is within {FLOOR_MARGIN:g}x of it: the sigma found is mostly the floor's scatter. "
            f"Give aqn.target >= {FLOOR_MARGIN * floor:.2g}, or more aqn.calibration_prompts to lower the "
            "scatter"
        )
    return message


def _miss_hint(search: SigmaSearch) -> str:
    """Why a search missed, when every probe fell on one side of the target."""
    if all(effect > search.target for _, effect in search.probes):
        # A prompt whose greedy completion has a near-tie early flips under any noise, however small, so
        # every sigma changes at least its share of the tokens.
        return (
            ". Every probe changed more: the target is below what any perturbation does to these prompts "
            "(near-tie tokens flip whatever the sigma); raise aqn.target, or aqn.calibration_prompts for "
            "a finer measure"
        )
    if all(effect < search.target for _, effect in search.probes):
        return ". Every probe changed less: noise on this model's norms hardly moves its greedy tokens"
    return ""


def calibrate_once(
    probe: NoiseProbe | None,
    schedule: AQNSchedule | None,
    engine: RolloutEngine,
    cfg: TrainConfig,
    dist: Distributed,
) -> SigmaSearch | None:
    """Calibrate ``schedule`` if the run asks for it (``aqn.calibrate``) and it is not calibrated yet (a
    resumed run's schedule comes calibrated from its checkpoint); None when nothing was measured."""
    if probe is None or schedule is None or probe.target is None or schedule.calibrated:
        return None
    return probe.calibrate(engine, schedule, cfg, dist)


def before_rollout(
    probe: NoiseProbe | None,
    schedule: AQNSchedule | None,
    engine: RolloutEngine,
    cfg: TrainConfig,
    dist: Distributed,
    step: int,
    noise_seed: int,
) -> dict[str, float]:
    """The AQN work before step ``step``'s rollout: calibrate if the run asks for it and has not yet
    (first step of a new run), and at the first step of a noisy stage measure that stage's effect with
    the step's own noise (``noise_seed``, the draw its rollouts see). Returns the step's AQN metrics
    (empty on other steps)."""
    if probe is None or schedule is None:
        return {}
    calibrate_once(probe, schedule, engine, cfg, dist)
    if not schedule.starts_noisy_stage(step):
        return {}
    sigma = schedule.sigma(step)
    share = probe.tokens_changed(engine, sigma, noise_seed)
    log.info(
        "AQN stage %d (step %d): sigma %.3g changes %.3g of the greedy tokens",
        schedule.stage(step), step + 1, sigma, share,
    )  # fmt: skip
    return {TOKENS_CHANGED_METRIC: share}

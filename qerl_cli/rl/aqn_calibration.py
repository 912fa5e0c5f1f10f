"""AQN sized to the model: find sigma_start from a target effect, and measure the effect every stage.

A raw sigma does not transfer between models or bases: it is added to norm weights whose scale differs.
On Gemma 3 270M's AWQ base, the paper's 1e-2 changed 99% of vLLM's greedy tokens at its first noisy
stage and stopped learning (held-out 8.6%, 1 seed, H200; 0.3% in an earlier ablation), because AWQ
divides the smoothed norms by its scales (median smoothed scale 0.10: the same sigma is ten times larger
beside them); on that model's GPTQ base, whose norms keep their scale, 1e-2 changed 15%; on a bf16 Qwen
norm (weights near 1.0) sigmas below ~4e-3 mostly round away. ``aqn.calibrate: tokens`` states the
noise as what it does instead: the share of greedy completion tokens it changes (``aqn.target``).

Before the first training step (engine built, initial adapter synced) :class:`NoiseProbe` greedy-decodes
``aqn.calibration_prompts`` training prompts once without noise and, for each probed sigma, once with
noise drawn from one fixed seed, and :func:`~qerl_cli.modeling.aqn.search_sigma` bisects log(sigma)
until :func:`~qerl_cli.modeling.aqn.tokens_changed` is within the tolerance of the target. With one
seed the noise direction is fixed and only its scale changes, so the effect is a (near-monotone)
function of sigma alone. The schedule then starts at the sigma found and keeps its configured ratio
sigma_end / sigma_start; it is saved in the checkpoint's AQN state, so ``--resume`` does not measure again.

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
import time

from qerl_cli.config import TrainConfig
from qerl_cli.data.problem import Problem
from qerl_cli.modeling.aqn import AQNSchedule, SigmaSearch, search_sigma, tokens_changed
from qerl_cli.rl.distributed import Distributed
from qerl_cli.rl.stream import PromptStream, derive_seed
from qerl_cli.rollout.base import RolloutEngine, SamplingSpec

log = logging.getLogger(__name__)

TOKENS_CHANGED_METRIC = "aqn_tokens_changed"


def raw_sigma_warning(cfg: TrainConfig, base_method: str | None) -> str | None:
    """A warning when AQN adds a raw sigma to the norms of an AWQ base: AWQ divided some of them by its
    smoothing scales, so the sigma is larger beside them than the same number on an unsmoothed base."""
    if not cfg.aqn.enabled or cfg.aqn.calibrate != "off" or base_method != "awq":
        return None
    return (
        f"AQN adds aqn.sigma_start={cfg.aqn.sigma_start:g} to the norm weights of an AWQ base, whose "
        "smoothing divided some norms by its scales: the noise is larger beside them than on an "
        "unsmoothed base (on Gemma 3 270M's AWQ base 1e-2 changed 99% of the greedy tokens and stopped "
        "learning; on its GPTQ base 15%). State the noise as its effect instead, aqn.calibrate: tokens "
        "with aqn.target (e.g. 0.1), or use a GPTQ or RTN base"
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
        from qerl_cli.data.prompts import get_template

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
    target close to it calibrates on that scatter. Seen with vLLM on Gemma 3 270M (H100 and H200): a
    floor of 5-7%, and aqn.target=0.1 gave sigma 1e-3, 3.2e-3 and 1.8e-2 for three seeds."""
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
        # Seen on Gemma 3 270M (BF16, HF engine): one of 8 prompts flips at its fourth greedy token under
        # any noise, sigma 1e-5 as at 1e-2, so no sigma changed less than 11% of the tokens.
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

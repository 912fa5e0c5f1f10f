"""The staleness check of the colocated vLLM engine: after a sync, prove that vLLM samples from the
policy being trained by comparing its logprobs on a probe prompt with the trainer's.

Part of the vLLM rollout engine: :class:`qerl_cli.rollout.vllm_engine.VLLMEngine` holds one
:class:`StalenessCheck` and hands itself to each check (what the check reads of it:
:class:`ProbedEngine`); the figures and the error message are :mod:`qerl_cli.rollout.vllm_outputs`'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from qerl_cli.errors import QerlError
from qerl_cli.rollout.backends import FP8_MERGED, BackendChoice
from qerl_cli.rollout.vllm_outputs import (
    BASE_TOLERANCE_FACTOR,
    mean_abs_gap,
    merged_staleness_message,
    numerics_explain,
    staleness_message,
)

log = logging.getLogger("qerl_cli.rollout.vllm_engine")  # the engine's logger: one place to read its log


class ProbedEngine(Protocol):
    """What the staleness check reads of the vLLM engine it probes."""

    merge_base: str | None  # fp8-merged: the adapter is in vLLM's weights (no LoRARequest)
    staleness_tolerance: float
    backend_choice: BackendChoice | None

    @property
    def is_sleeping(self) -> bool: ...

    @property
    def lora_request(self) -> Any: ...

    def wake_up(self) -> None: ...

    def prompt_logprobs(self, token_ids: Sequence[int], *, with_adapter: bool = True) -> list[float]: ...

    def noise_lifted(self) -> AbstractContextManager[None]: ...


class StalenessCheck:
    """``check_staleness`` of the vLLM engine, and the gaps it last measured."""

    def __init__(self) -> None:
        self.last_gap: float | None = None  # vLLM vs the trainer, nats/token, at the last check
        self.last_numerics_gap: float | None = None  # vLLM's base vs the trainer's, when it was measured

    def check(
        self,
        engine: ProbedEngine,
        probe_prompt_ids: Sequence[int],
        trainer_logprobs: Callable[[Sequence[int]], Sequence[float]],
        reference_logprobs: Callable[[Sequence[int]], Sequence[float]] | None = None,
    ) -> float:
        """Mean |vLLM - trainer| logprob gap (nats/token) on a probe prompt after a sync.

        ``trainer_logprobs(probe)[i]`` is the trainer policy's log p(probe[i + 1] | probe[:i + 1])
        at temperature 1 without AQN noise, taken first (while vLLM may still sleep); the check
        lifts vLLM's noise for the probe. A small gap (the 4-bit kernels' numerics) is logged. A gap
        above ``staleness_tolerance`` raises, since it means rollouts do not come from the policy
        being trained, unless the rollout weights' own numerics explain it (an FP8 rollout copy):
        with ``reference_logprobs`` (the trainer with its adapter off) the adapter's effect in vLLM
        must then match its effect in the trainer, and the two base models be within twice the
        tolerance (:func:`~qerl_cli.rollout.vllm_outputs.numerics_explain`).
        """
        if len(probe_prompt_ids) < 2:
            raise ValueError("check_staleness needs a probe of >= 2 tokens")
        trainer_lp = list(trainer_logprobs(probe_prompt_ids))
        if len(trainer_lp) != len(probe_prompt_ids) - 1:
            raise ValueError("check_staleness needs len(probe) - 1 trainer logprobs")
        if engine.is_sleeping:  # the adapter synced during the update is activated by wake_up
            engine.wake_up()
        request = engine.lora_request
        # With the trainer's adapter-off logprobs the adapter's effect is compared on both sides, every
        # time: a shift of the rollout weights (an FP8 copy) could otherwise hide a stale adapter.
        compare_effects = reference_logprobs is not None and request is not None
        engine_lp, base_lp = self._probe_logprobs(engine, probe_prompt_ids, trainer_lp, compare_effects)
        gap = mean_abs_gap(engine_lp, trainer_lp)
        self.last_gap = gap
        lora_id = request.lora_int_id if request is not None else 0
        explained = None
        if compare_effects and base_lp is not None:
            reference_lp = list(reference_logprobs(probe_prompt_ids))  # type: ignore[misc]
            tolerance = engine.staleness_tolerance
            explained = numerics_explain(engine_lp, base_lp, trainer_lp, reference_lp, tolerance)
            self.last_numerics_gap = explained.base_gap
        detail = ""
        if explained is not None:
            detail = (
                f"; base models {explained.base_gap:.4f} apart, adapter effects {explained.effect_gap:.4f}"
            )
        log.info(
            "staleness check (LoRA id %d): vLLM vs trainer logprob gap %.4f nats/token%s",
            lora_id,
            gap,
            detail,
        )
        if engine.merge_base is not None:
            # FP8 merged weights carry the FP8 copy's rounding, which the fp8 backend lets the two base
            # models differ by up to twice the tolerance; with no adapter-free vLLM model to take it
            # out, the merged model gets the same allowance (what FP8 rounding moves a 7B's logprobs by:
            # docs/rollout.md).
            # A BF16 merge rounds to BF16 only: the plain tolerance.
            choice = engine.backend_choice
            fp8 = choice is None or choice.weight_format == "fp8"
            factor = BASE_TOLERANCE_FACTOR if fp8 else 1.0
            if gap <= factor * engine.staleness_tolerance:
                return gap
            backend = choice.backend if choice is not None else FP8_MERGED
            raise QerlError(merged_staleness_message(gap, engine.staleness_tolerance, factor, backend))
        if explained.ok if explained is not None else gap <= engine.staleness_tolerance:
            return gap
        raise QerlError(
            staleness_message(
                gap, engine.staleness_tolerance, lora_id or None, engine_lp, base_lp, trainer_lp, explained
            )
        )

    @staticmethod
    def _probe_logprobs(
        engine: ProbedEngine, probe_prompt_ids: Sequence[int], trainer_lp: list[float], compare_effects: bool
    ) -> tuple[list[float], list[float] | None]:
        """vLLM's probe logprobs with the adapter, and without it when the check needs them (the
        adapter's effect is compared, or the gap is too large and the message must say why), all on
        clean norms: AQN noise would add a gap of its own, so it is lifted for the probe."""
        with engine.noise_lifted():
            engine_lp = engine.prompt_logprobs(probe_prompt_ids)
            gap = mean_abs_gap(engine_lp, trainer_lp)
            base_lp = (
                engine.prompt_logprobs(probe_prompt_ids, with_adapter=False)
                if (compare_effects or gap > engine.staleness_tolerance) and engine.lora_request is not None
                else None
            )
        return engine_lp, base_lp

"""The rollout engine interface shared by training, evaluation and benchmarks.

An engine turns prompts into sampled completions with the *current* policy (adapter included)
and returns what the trainer needs for importance sampling: token ids and per-token logprobs of
the sampling distribution. The HF engine (``rollout.hf``) and the vLLM engine
(``rollout.vllm_engine``) implement it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]

# One naming scheme for every engine's figures, in ``RolloutResult.stats`` (per generate call) and
# ``RolloutEngine.stats()`` (the engine's state): ``rollout/<what>``. The trainer logs them all.
STATS_PREFIX = "rollout/"
SECONDS = "rollout/seconds"
GENERATED_TOKENS = "rollout/generated_tokens"
TOKENS_PER_S = "rollout/tokens_per_s"
COMPLETIONS = "rollout/completions"
NOISE_SIGMA = "rollout/noise_sigma"  # the AQN sigma the rollouts were sampled with
NOISE_CHANGED_FRACTION = "rollout/noise_changed_fraction"  # share of norm weights the noise moved
PERTURBED_NORMS = "rollout/perturbed_norms"
NORM_MODULES = "rollout/norm_modules"
STALENESS_GAP = "rollout/staleness_gap"  # nats/token, engine vs trainer, after the last sync
# nats/token, the engine's base model vs the trainer's (adapters off), when a gap was checked against it
NUMERICS_GAP = "rollout/numerics_gap"
# Seconds the last adapter sync took (vLLM: staging and loading the adapter, or merging it into the
# weights; a sync made while asleep counts its activation at wake-up too).
SYNC_SECONDS = "rollout/sync_seconds"
# Figures that add up over rounds and ranks; every other figure is the same on each (rank 0's is kept).
ADDITIVE_STATS = (SECONDS, GENERATED_TOKENS, COMPLETIONS)


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample. Defaults are the paper's evaluation settings."""

    max_new_tokens: int = 4096
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = -1
    seed: int | None = None
    # Benchmarks generate exactly ``max_new_tokens`` tokens regardless of EOS.
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    token_ids: list[int]
    text: str
    # log p(token) under the distribution the engine sampled from (after temperature / top-p
    # truncation is *not* applied: it is the model's log-softmax at the given temperature).
    logprobs: list[float]
    finish_reason: FinishReason


def completion_texts(tokenizer: Any, sequences: Sequence[Sequence[int]]) -> list[str]:
    """The text of each completion's token ids, decoded alone (without the prompt), special tokens (EOS)
    skipped, with the tokenizer's own clean-up setting: what rewards grade.

    The HF engine's ``Completion.text`` comes from here, and the vLLM engine's where vLLM did not
    detokenize (no stop strings), so those texts are the same for the same tokens. (vLLM's own text, kept
    with stop strings, is decoded incrementally after the prompt and without clean-up: it can differ in a
    leading space or a space before punctuation.) ``decode`` one by one, not ``batch_decode``: vLLM's
    tokenizer interface promises only ``decode``, and transformers' ``batch_decode`` loops anyway.
    """
    return [tokenizer.decode(list(ids), skip_special_tokens=True) for ids in sequences]


@dataclass
class RolloutResult:
    """``completions[i][j]`` is the j-th of n samples for ``prompts[i]``."""

    prompt_token_ids: list[list[int]]
    completions: list[list[Completion]]
    # Timing and engine-specific figures (seconds, tokens/s, noise sigma, ...), logged by callers.
    stats: dict[str, float] = field(default_factory=dict)

    def flat(self) -> list[tuple[int, Completion]]:
        """(prompt index, completion) pairs in prompt-major order: groups stay contiguous."""
        return [(i, c) for i, group in enumerate(self.completions) for c in group]

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for _, c in self.flat())


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer, ``qerl eval`` and ``qerl bench`` need from a generator."""

    def generate(self, prompts: list[str], n: int, sampling: SamplingSpec) -> RolloutResult:
        """Sample ``n`` completions for each (already chat-formatted) prompt string."""
        ...

    def sync_adapter(self, adapter_dir: str | None) -> None:
        """Make the next ``generate`` use the adapter saved in ``adapter_dir`` (PEFT format).

        ``None`` means the base model. Engines that share weights with the trainer (HF) may
        treat this as a no-op because they always see the current adapter.
        """
        ...

    def set_norm_noise(self, sigma: float, seed: int) -> int:
        """Adaptive Quantization Noise: set every RMSNorm weight of the rollout model to its
        clean value plus N(0, sigma^2) per channel (sigma 0 restores the clean weights).

        Returns the number of norm modules changed; implementations raise ``QerlError`` when
        sigma > 0 and none matched, because silent no-op noise is the bug this project fixes.
        """
        ...

    def sleep(self) -> None:
        """Free rollout memory (KV cache, and for vLLM the weights) during the update phase."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep`` before the next rollout."""
        ...

    def sync_policy(self, peft_model: Any) -> None:
        """Sample from the trainer's live PEFT model's current adapter from the next ``generate`` on.

        An engine that generates with that very model (HF in training) has nothing to do; one with
        its own copy of the weights (vLLM) loads the adapter.
        """
        ...

    def check_staleness(
        self,
        probe_ids: Sequence[int],
        trainer_logprobs: Callable[[Sequence[int]], Sequence[float]],
        reference_logprobs: Callable[[Sequence[int]], Sequence[float]] | None = None,
    ) -> float | None:
        """After a sync, prove that the engine samples from the policy being trained.

        ``trainer_logprobs(probe_ids)[i]`` is the trainer's log p(probe[i + 1] | probe[:i + 1]) at
        temperature 1 without noise; ``reference_logprobs`` the same with the adapter off, so that a
        gap the rollout weights' own numerics explain (an FP8 rollout copy) is told from a stale
        adapter. Returns the mean |engine - trainer| gap (nats/token) and
        raises ``QerlError`` above the engine's tolerance; an engine that shares the trainer's
        weights returns None without calling ``trainer_logprobs`` (nothing can be stale).
        """
        ...

    def score(self, sequences: Sequence[Sequence[int]], *, with_adapter: bool = True) -> list[list[float]]:
        """Teacher-forced logprobs: for each token-id list, log p(ids[i] | ids[:i]) for i >= 1 (one
        fewer than its ids) at temperature 1 without AQN noise, with the current adapter (``with_adapter``
        False: the base model), from this engine's own forward (``qerl bench gap`` compares them with the
        trainer's). Every list needs 2 ids at least."""
        ...

    def stats(self) -> dict[str, float]:
        """The engine's state for the step's metrics (names: ``rollout/<what>``, as above)."""
        ...

    @property
    def linear_backend(self) -> str:
        """The kernels behind the rollout's linear layers (``rollout.linear_backend`` resolved): "fp8" when
        the rollout runs on an FP8 copy of the weights, whose numerics differ from the trainer's; "trainer"
        when the engine runs the trainer's own modules."""
        ...

    def close(self) -> None:
        """Release what the engine holds (vLLM, its GPU memory, staged adapters). Idempotent."""
        ...

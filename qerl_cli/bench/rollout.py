"""Rollout throughput of one engine: output tokens/s, prefill tokens/s, per-token decode latency.

Method, the same for every engine and format so ratios are fair:

* every prompt is exactly ``prompt_len`` random tokens (checked against the token ids the engine
  reports), every completion exactly ``gen_len`` tokens (``ignore_eos``), sampled at temperature 0.6
  and top-p 0.95 (the paper's evaluation settings);
* one warm-up call (torch.compile, CUDA graphs, allocator growth) is not timed; then at least
  three timed repetitions, and the median is reported (robust to one slow outlier);
* each repetition draws *fresh* prompts, because vLLM's prefix cache would otherwise serve a
  repeated prompt from cache and the prefill would cost nothing;
* prefill is timed as a ``max_new_tokens=1`` pass; decode latency is the rest of a full
  generation divided by the ``gen_len - 1`` decode steps.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qerl_cli.config import RolloutSection
from qerl_cli.errors import QerlError
from qerl_cli.rl.phase import ROLLOUT, in_phase
from qerl_cli.rollout.base import RolloutEngine, RolloutResult, SamplingSpec

# The bench samples as a GRPO rollout does (the rollout section's defaults, which every shipped recipe
# keeps): at top_p < 1 vLLM runs its top-k/top-p sampler over the whole vocabulary every decode step and
# returns logprobs renormalised over the nucleus, neither of which such a rollout does. (Earlier reports
# sampled at temperature 0.6, top_p 0.95; each report's settings say which.)
TEMPERATURE = RolloutSection.temperature
TOP_P = RolloutSection.top_p
MIN_REPEATS = 3
# Tokens generated at least: a rollout case's decode latency needs a token after the first.
MIN_GEN_LEN = 2
GEN_LEN_RULE = f"--gen-len must be at least {MIN_GEN_LEN}: decode latency needs a token after the first"
# Warm-up generations are this long (at most): they only have to reach every code path once (CUDA
# graphs and KV blocks are set up when the engine starts), and a full-length warm-up per case cost a
# quarter of the default bench's generation time.
WARMUP_TOKENS = 64
# Candidate ids tried per prompt when building exact-length text; plenty for any real tokenizer.
_FIX_ROUNDS = 16


@dataclass(frozen=True)
class RolloutSettings:
    prompt_len: int
    gen_len: int
    warmup: int = 1
    repeats: int = MIN_REPEATS
    seed: int = 0
    # A --concurrency sweep at RL lengths may time one generation per case (10-60 s each, steady).
    min_repeats: int = MIN_REPEATS

    def check(self) -> None:
        if self.repeats < self.min_repeats:
            raise QerlError(f"--repeats must be at least {self.min_repeats} so the median means something")
        if self.warmup < 0:
            raise QerlError(f"warmup must be >= 0, got {self.warmup}")
        if self.gen_len < MIN_GEN_LEN:
            raise QerlError(GEN_LEN_RULE)


# --------------------------------------------------------------------------------------------
# Prompts of exactly prompt_len random tokens
# --------------------------------------------------------------------------------------------
class PromptMaker:
    """Random prompts whose tokenization is exactly ``length`` tokens.

    Engines take text, so random ids are decoded to text; but decode/encode does not round-trip
    for arbitrary ids (byte fragments, merges across token boundaries). The pool keeps only ids
    that round-trip alone, and each prompt is re-encoded and trimmed or topped up until its length
    is exact.
    """

    def __init__(
        self, tokenizer: Any, seed: int = 0, pool_size: int = 4096, vocab_size: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.all_special_ids or [])
        # The model's embedding may be smaller than the tokenizer (tiny shapes): stay inside both.
        vocab = min(len(tokenizer), vocab_size or len(tokenizer))
        rng = random.Random(seed)
        candidates = [i for i in rng.sample(range(vocab), min(vocab, pool_size * 2)) if i not in special]
        self.pool = [i for i in candidates if self._encode(self._decode([i])) == [i]][:pool_size]
        if len(self.pool) < 16:
            raise QerlError(
                "the tokenizer has too few tokens that decode and re-encode to themselves to build prompts"
            )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, length: int, rng: random.Random) -> str:
        ids = [rng.choice(self.pool) for _ in range(length)]
        for _ in range(_FIX_ROUNDS):
            text = self._decode(ids)
            encoded = self._encode(text)
            if len(encoded) == length:
                return text
            # Merges shortened it (or splits lengthened it): trim or top up and try again.
            ids = encoded[:length] + [rng.choice(self.pool) for _ in range(length - len(encoded))]
        raise QerlError(f"could not build a prompt of exactly {length} tokens with this tokenizer")

    def batch(self, count: int, length: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        return [self.prompt(length, rng) for _ in range(count)]


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------
def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_generate(
    engine: RolloutEngine, prompts: list[str], spec: SamplingSpec
) -> tuple[float, RolloutResult]:
    _synchronize()
    start = time.perf_counter()
    result = engine.generate(prompts, 1, spec)
    _synchronize()
    return time.perf_counter() - start, result


def _check_lengths(result: RolloutResult, prompt_len: int, new_tokens: int) -> None:
    """Wrong lengths would make every figure wrong, silently; stop instead."""
    prompt_lengths = {len(ids) for ids in result.prompt_token_ids}
    if prompt_lengths != {prompt_len}:
        raise QerlError(
            f"the engine saw prompts of {sorted(prompt_lengths)} tokens instead of exactly {prompt_len}; "
            "it adds or merges tokens (report this as a bug)"
        )
    generated = {len(c.token_ids) for _, c in result.flat()}
    if generated != {new_tokens}:
        raise QerlError(
            f"the engine generated {sorted(generated)} tokens per completion instead of exactly "
            f"{new_tokens}: it does not honour ignore_eos"
        )


def measure_batch(
    engine: RolloutEngine,
    prompts: PromptMaker,
    batch: int,
    settings: RolloutSettings,
    *,
    on_sample: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One (engine, batch) measurement: warm-up, then ``repeats`` timed full and prefill passes."""
    # Unseeded sampling: a figure needs reproducible prompts (they are), not reproducible samples. Training
    # seeds every request, for reproducible rollouts; timed side by side (one pair), that was not slower
    # (benchmarks/h200-2026-11-29-grpo-step-rerun), so these figures stand for training's as far as seeds go.
    full = SamplingSpec(settings.gen_len, temperature=TEMPERATURE, top_p=TOP_P, ignore_eos=True)
    prefill = SamplingSpec(1, temperature=TEMPERATURE, top_p=TOP_P, ignore_eos=True)

    def fresh(tag: int, rep: int) -> list[str]:
        # Seeded by (seed, batch, pass, repetition) only, so every format sees the same prompts.
        seed = ((settings.seed * 1009 + batch) * 4 + tag) * 1013 + rep
        return prompts.batch(batch, settings.prompt_len, seed=seed)

    warm = SamplingSpec(
        min(settings.gen_len, WARMUP_TOKENS), temperature=TEMPERATURE, top_p=TOP_P, ignore_eos=True
    )
    for rep in range(settings.warmup):
        _, result = _timed_generate(engine, fresh(0, rep), warm)
        _check_lengths(result, settings.prompt_len, warm.max_new_tokens)
        _, result = _timed_generate(engine, fresh(1, rep), prefill)
    generate_s, prefill_s = [], []
    for rep in range(settings.repeats):
        with in_phase(ROLLOUT):  # the GPU sampler tags these readings as a rollout's, as in training
            seconds, result = _timed_generate(engine, fresh(2, rep), full)
        _check_lengths(result, settings.prompt_len, settings.gen_len)
        generate_s.append(seconds)
        seconds, result = _timed_generate(engine, fresh(3, rep), prefill)
        _check_lengths(result, settings.prompt_len, 1)
        prefill_s.append(seconds)
        if on_sample is not None:
            on_sample()
    gen_median = statistics.median(generate_s)
    prefill_median = statistics.median(prefill_s)
    # Decode steps after the first token; clamp at 0 so a noisy prefill can't make latency negative.
    decode_s = max(gen_median - prefill_median, 0.0)
    return {
        "batch": batch,
        "output_tokens_per_s": batch * settings.gen_len / gen_median,
        "prefill_tokens_per_s": batch * settings.prompt_len / prefill_median,
        "decode_ms_per_token": 1000.0 * decode_s / (settings.gen_len - 1),
        "generate_s_median": gen_median,
        "prefill_s_median": prefill_median,
        "generate_s": generate_s,
        "prefill_s": prefill_s,
    }


def measure_rollout(
    engine: RolloutEngine,
    prompts: PromptMaker,
    batches: list[int],
    settings: RolloutSettings,
    *,
    on_sample: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Rollout rows for every batch size, on an engine already set to the adapter to measure.

    ``prompts`` is the case's one maker: its pool depends on the tokenizer and the seed only (each
    batch's prompts are seeded apart, in :func:`measure_batch`), and building it round-trips thousands
    of tokens, so a caller measuring batch by batch makes it once."""
    settings.check()
    return [measure_batch(engine, prompts, b, settings, on_sample=on_sample) for b in batches]

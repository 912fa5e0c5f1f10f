"""Whether GRPO has something to learn from at the start of a run, and what to try when it has not.

GRPO learns only from prompt groups whose samples got different rewards. A 4-bit base that lost its
BF16 model's skill starts with few such groups and learns less (the recorded bases' shares and what they
learned: ``docs/compare.md``, "When a base starts without signal"). ``qerl train``
warns after its first steps (:class:`StartSignal`), ``qerl compare`` in its report; both name the same
remedies (:func:`remedies`).
"""

from __future__ import annotations

import math
from typing import Any

# Below this share of groups with a reward spread GRPO has little to learn from: the recorded 4-bit bases
# under it learned a quarter to half of what BF16 learned, those above it about as much (docs/compare.md).
MIN_SIGNAL_FRACTION = 0.10
# A 4-bit arm under this share of the BF16 arm's spread is named too (compare): Gemma's AWQ bases had a
# third of it.
RELATIVE_SIGNAL = 0.5
# The first steps: the share of a run's steps that its start figures average over (compare's columns too).
START_FRACTION = 0.1


def start_steps(max_steps: int) -> int:
    """How many first steps the start figures average over: 10% of the run, at least one."""
    return max(1, math.ceil(START_FRACTION * max_steps))


# What more samples per prompt did in the recorded ablation (docs/compare.md), said with the remedy.
MORE_SAMPLES_RECORDED = (
    "16 instead of 8 doubled NVFP4 LoRA's held-out accuracy in the recorded ablation, to BF16 LoRA's at 8, "
    "where temperature 1.0 did not"
)


def remedies(*, quantized: bool, gptq: bool, error_start: bool, num_generations: int | None = None) -> str:
    """What keeps a base's skill for GRPO, in the order it helped in the recorded ablations (docs/compare.md),
    less what the run uses. ``num_generations``: the run's samples per prompt, which the remedy doubles
    (None: not known here, as in compare's report, whose arms may differ)."""
    fixes = []
    if quantized and not gptq:
        fixes.append("a GPTQ base (qerl quantize --method gptq; compare.base_method=gptq)")
    if quantized and not error_start:
        fixes.append(
            "a LoRA that starts from the quantization error (qerl quantize --lora-init eora, then "
            "lora.init: eora)"
        )
    if num_generations is None or num_generations == 8:
        fixes.append(f"more samples per prompt (rollout.num_generations: {MORE_SAMPLES_RECORDED})")
    else:  # the run's own value, doubled: a run at 2 is not told to go from 8 to 16
        fixes.append(
            f"more samples per prompt (rollout.num_generations: {2 * num_generations} instead of this run's "
            f"{num_generations}; {MORE_SAMPLES_RECORDED})"
        )
    return ", or ".join(fixes)


class StartSignal:
    """Watches a run's first steps' reward spread; :meth:`observe` returns the warning once, if due."""

    def __init__(
        self,
        max_steps: int,
        *,
        quantized: bool,
        gptq: bool,
        error_start: bool,
        num_generations: int | None = None,
    ) -> None:
        self.window = start_steps(max_steps)
        self.quantized, self.gptq, self.error_start = quantized, gptq, error_start
        self.num_generations = num_generations
        self._no_spread: list[float] = []
        self.done = False

    def observe(self, record: dict[str, Any]) -> str | None:
        if self.done or "zero_std_group_fraction" not in record:
            return None
        self._no_spread.append(float(record["zero_std_group_fraction"]))
        if len(self._no_spread) < self.window:
            return None
        self.done = True
        spread = 1.0 - sum(self._no_spread) / len(self._no_spread)
        if round(spread, 9) >= MIN_SIGNAL_FRACTION:  # 1 - 0.9 is 0.0999...
            return None
        fixes = remedies(
            quantized=self.quantized,
            gptq=self.gptq,
            error_start=self.error_start,
            num_generations=self.num_generations,
        )
        return (
            f"the first {self.window} steps had a reward spread in {100 * spread:.1f}% of prompt groups "
            f"(under {100 * MIN_SIGNAL_FRACTION:.0f}%): GRPO has little to learn from. Try {fixes}"
        )

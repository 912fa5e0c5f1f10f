"""``qerl bench gap``'s settings: its flags, checked before torch is imported (exit 2 naming the flag).
Not a ``--config`` file's: the benchmark's configuration is the training recipe it is given (its keys with
``--set``), as ``qerl bench scaling``'s is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

from qerl_cli.config.choices import LinearBackend
from qerl_cli.errors import QerlError

# ``qerl bench gap``'s backends: the recipe's rollout.linear_backend values, and ``hf``: training's own
# transformers rollout engine over the live policy (the trainer's modules, its base-compute settings and
# fused kernels: the measurement's floor), scored in the trainer side's process.
HF_BACKEND = "hf"
GAP_BACKENDS = (*get_args(LinearBackend), HF_BACKEND)
GAP_ADAPTERS = ("random", "none")


def reference_backend(backends: list[str]) -> str | None:
    """The ratios' reference: the first backend that is not ``hf`` (whose gap is the floor, ~0, and would
    make every ratio meaningless); None when every backend is ``hf``."""
    return next((b for b in backends if b != HF_BACKEND), None)


@dataclass
class GapSettings:
    """``qerl bench gap``'s settings (its flags; the recipe's own keys come with ``--set``)."""

    # The training recipe (a path or a shipped recipe's name).
    recipe: str
    # The backends scored, in order: the first that is not hf is the reference of the ratios.
    backends: list[str] = field(default_factory=lambda: ["marlin", "qerl-triton"])
    # Sequences scored (prompts of the recipe's training data, one completion each).
    sequences: int = 128
    # Completion tokens sampled at most per sequence.
    max_tokens: int = 256
    # random: the recipe's LoRA with seeded random nonzero B; none: the base model alone.
    adapter: str = "random"
    # Seed of the completions, the random adapter and the bootstrap.
    seed: int = 0
    # The verdict's margin: a backend's gap is "within" when its ratio's interval ends at or below 1 + margin.
    margin: float = 0.10
    # Folder of the run's files (gap.json, gap.md, sequences.json, trainer_logprobs.json, logprobs/, adapter/,
    # engines/).
    output: str = "bench_results"

    def validate(self) -> None:
        """Exit-2 errors naming the flag: unknown or no backends, too few sequences, bad numbers."""
        self.backends = [b.strip().lower() for b in self.backends if b.strip()]
        if not self.backends:
            raise QerlError(
                f"--backends needs one backend at least: a comma list of {', '.join(GAP_BACKENDS)}"
            )
        unknown = [b for b in self.backends if b not in GAP_BACKENDS]
        if unknown:
            raise QerlError(
                f"--backends: unknown backend(s) {', '.join(unknown)}; choose from {', '.join(GAP_BACKENDS)} "
                "(the first that is not hf is the reference of the ratios)"
            )
        if len(set(self.backends)) != len(self.backends):
            raise QerlError(f"--backends names a backend twice: {','.join(self.backends)}")
        if self.sequences < 2:
            raise QerlError(f"--sequences must be 2 or more (an interval needs two), got {self.sequences}")
        if self.max_tokens < 1:
            raise QerlError(f"--max-tokens must be a positive integer, got {self.max_tokens}")
        if self.adapter not in GAP_ADAPTERS:
            raise QerlError(f"--adapter takes {' or '.join(GAP_ADAPTERS)}, got {self.adapter!r}")
        if not self.margin >= 0:
            raise QerlError(f"--margin must be 0 or more (0.10: within 10%), got {self.margin}")

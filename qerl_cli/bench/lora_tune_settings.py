"""What ``qerl bench lora-tune`` (:mod:`qerl_cli.bench.lora_tune`) tunes, checked without torch so that the
CLI refuses a wrong flag before any import of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL = "qwen2.5-7b"  # the shape qerl's rollout benchmarks run on a GPU
DEFAULT_RANK = 16
# Decode steps at RL concurrency (one token per sequence, up to 256 sequences) and prefill chunks (vLLM
# splits a long batch of prompts into steps of at most max_num_batched_tokens tokens).
DEFAULT_ROWS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_OUTPUT = "lora_tune"
# qerl's engines hold one adapter at a time (rollout.vllm_setup.llm_kwargs).
MAX_LORAS = 1


@dataclass(frozen=True)
class LoraTuneSettings:
    """The model shape (a shape name or a folder with a ``config.json``), the LoRA rank, the token counts,
    the engine's ``max_loras``, where the files go and whether they are also copied into the source tree's
    shipped folder (``install``)."""

    model: str = DEFAULT_MODEL
    rank: int = DEFAULT_RANK
    rows: tuple[int, ...] = DEFAULT_ROWS
    output: str = DEFAULT_OUTPUT
    install: bool = False
    max_loras: int = MAX_LORAS

    def to_dict(self) -> dict[str, Any]:
        """``lora_tune.json``'s ``settings``."""
        return {"model": self.model, "rank": self.rank, "rows": list(self.rows), "output": self.output,
                "install": self.install, "max_loras": self.max_loras}  # fmt: skip

"""The settings of ``qerl bench lora-tune`` (:mod:`qerl_cli.bench.lora_tune`): what ``--config`` / ``--set``
and its flags resolve to, each field documented by the comment above it, checked by ``validate`` (a
:class:`~qerl_cli.config.checks.ConfigValueError` naming the key, which the CLI turns into the flag that
set it). Torch-free, so they are read and checked before torch is imported."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from qerl_cli.bench.settings import positive_ints
from qerl_cli.config.checks import ConfigValueError, key, needs_items

# Decode steps at RL concurrency (one token per sequence, up to 256 sequences) and prefill chunks (vLLM
# splits a long batch of prompts into steps of at most max_num_batched_tokens tokens).
DEFAULT_ROWS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# qerl's engines hold one adapter at a time (rollout.vllm_setup.llm_kwargs): the configs are for that.
MAX_LORAS = 1


@dataclass
class LoraTuneSettings:
    # A model SHAPE (qwen2.5-7b, ...) or a folder with a config.json: whose linears are tuned.
    model: str = "qwen2.5-7b"
    # The LoRA rank, one of vLLM's (8, 16, 32, 64, ...).
    rank: int = 16
    # Token counts per kernel call: decode batches and prefill chunks.
    rows: list[int] = field(
        default_factory=lambda: list(DEFAULT_ROWS), metadata=needs_items("token count", "e.g. 8,256")
    )
    # Also copy the config files into qerl_cli/rollout/lora_configs/ of this source tree.
    install: bool = False
    # auto or cuda[:N]: the GPU the configs are made on (and for).
    device: str = "auto"
    # Folder of the config files and lora_tune.json.
    output: str = "lora_tune"

    def validate(self, where: str = "") -> None:
        positive_ints(where, rank=self.rank)
        if any(not isinstance(m, int) or m < 1 for m in self.rows):
            raise ConfigValueError(
                key(where, "rows"), f"takes positive token counts (e.g. [8, 256]), got {self.rows}"
            )
        self.rows = sorted(set(self.rows))
        if not (self.device == "auto" or self.device.startswith("cuda")):
            raise ConfigValueError(
                key(where, "device"),
                f"is auto or cuda[:N]: vLLM's LoRA kernels run on a CUDA GPU, not {self.device}",
            )

    def to_dict(self) -> dict[str, Any]:
        """``lora_tune.json``'s ``settings``: the fields, and the ``max_loras`` the configs are for."""
        return {**asdict(self), "max_loras": MAX_LORAS}

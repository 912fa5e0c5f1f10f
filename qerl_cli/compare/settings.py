"""The settings of ``qerl compare`` (a recipe's ``compare:`` section), each documented by the comment above
its field: ``qerl compare --reference`` / ``--margin`` read their help there.

They live apart from the ablation that runs them because that imports torch, and the CLI builds its
options at start-up, before any of it is imported; :func:`qerl_cli.compare.arms.read_settings` reads and
checks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qerl_cli.config.choices import EngineName

# The three settings the QeRL paper compares, and the dequantized control (compare.arms' docstring).
BUILTIN_ARMS: dict[str, dict[str, Any]] = {
    "bf16-lora": {"model.format": "bf16", "aqn.enabled": False},
    "nvfp4-lora": {"model.format": "nvfp4", "aqn.enabled": False},
    "nvfp4-aqn": {"model.format": "nvfp4", "aqn.enabled": True},
    "nvfp4-dequant-lora": {"model.format": "nvfp4", "base.dequantized": True, "aqn.enabled": False},
}
DEFAULT_BASE_METHOD = "awq"
DEFAULT_MARGIN = 5.0  # points of held-out pass@1


@dataclass
class CompareSettings:
    threshold: float | None = None
    # Held-out problems each run and base is evaluated on (the first of the task's held-out split).
    heldout_problems: int = 64
    # Samples per held-out problem; pass@1 is each problem's share of correct samples, averaged. 1: one
    # greedy answer. k > 1: k samples at heldout_temperature (unset: the recipe's rollout.temperature and
    # top_p): the policy GRPO trains rather than its mode, and k answers a problem rather than one.
    heldout_samples: int = 1
    # Temperature of the held-out samples. Unset: 0 (greedy) with one sample, the recipe's
    # rollout.temperature with several. 0 with several samples is refused (k copies of one answer).
    heldout_temperature: float | None = None
    # The engine of the held-out evaluations (each run's adapter and each untrained base). "hf": transformers
    # generate on the trainer's own kernels (the protocol of every comparison before this setting). "vllm":
    # a vLLM engine serving the base as the arm's rollouts did (rollout.linear_backend: Marlin + LoRA, the
    # LoRA merged into BF16 or FP8 weights), at the run's vLLM share: meant to cost a run less GPU time
    # (the HF generation was its largest part: docs/compare.md), but the scores are of vLLM's kernels,
    # not the trainer's, so a comparison keeps to one. Needs rollout.engine=vllm in every arm (refused
    # otherwise).
    heldout_engine: EngineName = "hf"
    # The arm every other arm's held-out pass@1 is compared with (the verdicts of compare.md). Unset:
    # bf16-lora when it is among the arms, else no verdicts.
    reference: str | None = None
    # The verdicts' margin, in points of held-out pass@1, fixed before the runs: "not worse" is a 95%
    # interval of arm - reference whose lower end is above -margin.
    margin: float = DEFAULT_MARGIN
    # vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1 in every run's environment): a run's numerics no
    # longer depend on how vLLM batches its requests, so a seed reproduces its run. Slower; GPU only.
    batch_invariant: bool = False
    # How a BF16 recipe model's 4-bit counterparts are made: AWQ through llm-compressor on the shipped
    # qerl-text calibration set (the quantization `qerl quantize` uses by default and the paper's bases
    # have, offline) or round to nearest (qerl's own packing, seconds, no extra package). AWQ by default:
    # RTN bases of small models can start with too little reward signal for GRPO (docs/compare.md).
    base_method: str = DEFAULT_BASE_METHOD
    # The least seconds between the starts of runs that share the GPU. null: 10 when vLLM runs go
    # --jobs N > 1 at a time (each also waits until the previous run's vLLM engine is up, at most
    # engine_ready_timeout_s), else 0.
    start_interval_s: float | None = None
    # How long the next vLLM run sharing the GPU waits for the previous one's engine to be up (it writes
    # engine_ready in its folder) before it starts anyway. Runs sharing a GPU size vLLM's KV cache from
    # their share rather than by measuring the device, so their starts may overlap; the wait lets a run's
    # torch.compile cache serve the next run of the same base. Raise it when a run fails while the previous
    # one's engine is still starting (the measured starts behind the default: docs/compare.md).
    engine_ready_timeout_s: float = 45.0
    arms: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(BUILTIN_ARMS))

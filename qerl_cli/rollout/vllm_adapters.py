"""PEFT adapter folders as vLLM serves them: what a folder must hold, and the checks that keep a
trained-but-unservable adapter (too high a rank, trained norms) from silently going stale.
Part of the vLLM rollout engine (``rollout.vllm_engine``).
"""

from __future__ import annotations

import json
from pathlib import Path

from qerl_cli.errors import QerlError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def validate_adapter_folder(folder: Path, *, enable_lora: bool, max_lora_rank: int) -> None:
    """Raise QerlError unless vLLM (started with ``enable_lora`` / ``max_lora_rank``) can serve it."""
    if not enable_lora:
        raise QerlError(
            "this vLLM engine was started without LoRA (enable_lora=False); it cannot serve an adapter"
        )
    config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights_file.is_file():
        raise QerlError(
            f"{folder} is not a PEFT adapter folder: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
            "(save with save_pretrained(..., safe_serialization=True))"
        )
    config = json.loads(config_file.read_text())
    rank = int(config.get("r", 0))
    if rank > max_lora_rank:
        raise QerlError(
            f"the adapter has rank {rank} but vLLM was started with max_lora_rank={max_lora_rank}; "
            f"set rollout.max_lora_rank >= lora.rank ({rank})"
        )
    from safetensors import safe_open

    with safe_open(str(weights_file), framework="pt") as handle:
        norm_keys = [k for k in handle.keys() if "norm" in k]  # noqa: SIM118
    if config.get("modules_to_save") or norm_keys:
        raise QerlError(
            f"the adapter in {folder} also trains full modules "
            f"({config.get('modules_to_save') or norm_keys[:3]}); vLLM serves LoRA matrices only, so "
            "rollouts would use stale weights. Set lora.train_norms=false or use rollout.engine=hf"
        )

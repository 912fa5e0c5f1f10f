"""A random LoRA adapter in PEFT format, written from the model's shape alone.

Building it through ``peft.get_peft_model`` would need the base model in memory (15 GB for a 7B
shape); the adapter only depends on the linear layers' shapes, which ``config.json`` gives. The
folder is what PEFT, the HF engine and vLLM load, written by ``modeling.adapter.write_tensors``.

B is nonzero on purpose: PEFT initialises B to zeros, and an all-zero adapter could let an engine
skip the LoRA path and make the "with LoRA" figure meaningless.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qerl_cli.config import LORA_TARGETS_ALL
from qerl_cli.modeling.adapter import write_tensors
from qerl_cli.modeling.model_shape import ModelShape

RANDOM_B_SD = 0.01  # a random adapter's B ~ N(0, RANDOM_B_SD^2) (here and ``qerl bench gap``'s)

_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_random_lora(
    model_dir: str | Path,
    out_dir: str | Path,
    rank: int,
    *,
    seed: int = 0,
    target_modules: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a random rank-``rank`` LoRA adapter for the model in ``model_dir``; returns ``out_dir``.

    A ~ U(-1/sqrt(in), 1/sqrt(in)) like PEFT's Kaiming init; B ~ N(0, RANDOM_B_SD^2): small enough that the
    outputs stay finite, nonzero so the adapter does real work.
    """
    model_config = json.loads((Path(model_dir) / "config.json").read_text())
    targets = list(target_modules or LORA_TARGETS_ALL)
    shapes = ModelShape.from_config(model_config).linear_shapes()
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(model_config["num_hidden_layers"]):
        for name in targets:
            in_features, out_features = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[name]}.{name}"
            bound = in_features**-0.5
            lora_a = (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound
            lora_b = torch.randn(out_features, rank, generator=generator) * RANDOM_B_SD
            tensors[f"{prefix}.lora_A.weight"] = lora_a.to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = lora_b.to(dtype)
    return write_tensors(
        out_dir, tensors, rank=rank, alpha=2 * rank, target_modules=targets, base_model=str(model_dir)
    )

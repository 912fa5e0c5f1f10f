"""Round-to-nearest 4-bit checkpoints written by qerl's own format code, without llm-compressor.

The same packing as ``qerl_cli.modeling.random_checkpoint`` (compressed-tensors ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized``, bitsandbytes NF4), applied to a real BF16 model's weights: NVFP4 shares one
global scale across each fused group (q/k/v, gate/up), as llm-compressor does, so vLLM can fuse them.
Used where llm-compressor is absent (the GPU machine of ``scripts/device_smollm2.sh``) and by
``qerl compare`` to make the 4-bit counterpart of a BF16 base; ``qerl quantize --method rtn`` is the
llm-compressor route to an equivalent checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from qerl_cli import formats
from qerl_cli.errors import QerlError
from qerl_cli.files import is_complete_folder, write_folder_once
from qerl_cli.modeling.random_checkpoint import (
    _group_global_scales,
    _modules_with_tensors,
    _ShardWriter,
    quantization_config,
)
from qerl_cli.quantize.validate import ALWAYS_IGNORED


def write_rtn_checkpoint(source: str | Path, out_dir: str | Path, fmt: str) -> Path:
    """Quantize the BF16 model at ``source`` (folder, .gguf or alias) to ``fmt`` with RTN into ``out_dir``.

    Written to a sibling temporary folder and renamed when complete; an existing complete ``out_dir``
    is returned as is (several processes may ask for the same base at once).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_cli.modeling.sources import resolve_model_source

    out = Path(out_dir)
    if is_complete_folder(out):
        return out
    folder = resolve_model_source(source)
    qfmt = formats.get(fmt)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    if getattr(model.config, "quantization_config", None):
        raise QerlError(f"{source} is already quantized: RTN needs the BF16 model")

    def write(staging: Path) -> None:
        _write_tensors(model, qfmt, fmt, staging)
        config = model.config.to_dict()
        config["dtype"] = "bfloat16"
        config["quantization_config"] = quantization_config(fmt)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        model.generation_config.save_pretrained(staging)
        AutoTokenizer.from_pretrained(folder).save_pretrained(staging)  # chat template included

    return write_folder_once(out, write)


@torch.no_grad()
def _write_tensors(model: nn.Module, qfmt, fmt: str, out: Path) -> None:
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    writer = _ShardWriter(out, 2 * 1024**3)
    by_parent: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in _modules_with_tensors(model):
        by_parent.setdefault(name.rpartition(".")[0], []).append((name, module))
    for members in by_parent.values():
        dense = {
            name: {p: t.detach() for p, t in module.named_parameters(recurse=False)}
            for name, module in members
            if not (tied and name == "lm_head")
        }
        scales = _group_global_scales(dense, members) if fmt == "nvfp4" else {}
        for name, module in members:
            if name not in dense:
                continue
            tensors = dense.pop(name)
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear) and leaf not in ALWAYS_IGNORED:
                tensors = {**qfmt.quantize(tensors.pop("weight"), global_scale=scales.get(name)), **tensors}
            for tensor_name, tensor in tensors.items():
                writer.add(f"{name}.{tensor_name}", tensor)
    writer.finish()

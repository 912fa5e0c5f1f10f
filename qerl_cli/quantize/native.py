"""Round-to-nearest 4-bit checkpoints written by qerl's own format code, without llm-compressor.

The packer and writer of ``qerl_cli.formats.checkpoint`` (compressed-tensors ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized``, bitsandbytes NF4), applied to a real BF16 model's weights: NVFP4 shares one
global scale across each fused group (q/k/v, gate/up), as llm-compressor does, so vLLM can fuse them.
Used where llm-compressor is absent (the GPU machine of ``scripts/device_smollm2.sh``) and by
``qerl compare`` to make the 4-bit counterpart of a BF16 base; ``qerl quantize --method rtn`` is the
llm-compressor route to an equivalent checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.files import is_complete_folder, write_folder_once
from qerl_cli.formats.checkpoint import ModuleGroup, check_checkpoint_format, module_groups, write_checkpoint
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
    check_checkpoint_format(fmt)
    folder = resolve_model_source(source)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    if getattr(model.config, "quantization_config", None):
        raise QerlError(f"{source} is already quantized: RTN needs the BF16 model")

    def write(staging: Path) -> None:
        write_checkpoint(staging, _groups(model), fmt, model.config.to_dict())
        model.generation_config.save_pretrained(staging)
        AutoTokenizer.from_pretrained(folder).save_pretrained(staging)  # chat template included

    return write_folder_once(out, write)


def _groups(model: nn.Module) -> Iterator[tuple[ModuleGroup, set[str]]]:
    """The model's tensors one parent at a time, with the linears to quantize (all but lm_head)."""
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    for members in module_groups(model):
        group = {
            name: {p: t.detach() for p, t in module.named_parameters(recurse=False)}
            for name, module in members
            if not (tied and name == "lm_head")
        }
        linears = {
            name
            for name, module in members
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in ALWAYS_IGNORED
        }
        yield group, linears

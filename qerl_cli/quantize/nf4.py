"""NF4 export: bitsandbytes' pre-quantized checkpoint layout, written without bitsandbytes or a GPU.

Each quantized linear is stored as transformers saves a bitsandbytes ``Linear4bit`` (NF4, blocks of
64, double quantization of the absmax, BF16 compute dtype): ``weight`` (packed uint8),
``weight.absmax``, ``weight.quant_map``, ``weight.nested_absmax``, ``weight.nested_quant_map`` and
``weight.quant_state.bitsandbytes__nf4``. The bytes come from ``qerl_cli.formats.get("nf4")``, which
reproduces bitsandbytes' own quantizer bit for bit, and ``config.json`` carries transformers'
``BitsAndBytesConfig`` so ``from_pretrained`` and vLLM (``quantization="bitsandbytes"``) load it.

Rounding is round-to-nearest on the code book, as bitsandbytes (and the QeRL paper's NF4 baseline)
does. With ``--method awq`` the AWQ smoothing found by llm-compressor is folded into the BF16 weights
first (see ``pipeline.NF4_AWQ_PROXY``), and those smoothed weights are then rounded to NF4.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from qerl_cli import formats
from qerl_cli.quantize.validate import ALWAYS_IGNORED

WEIGHTS_NAME = "model.safetensors"


def bnb_config(skipped: list[str]):  # -> transformers.BitsAndBytesConfig
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.uint8,
        # transformers reads this list for 4-bit too: these modules stay in BF16.
        llm_int8_skip_modules=[*ALWAYS_IGNORED, *skipped],
    )


def float_state(model: torch.nn.Module, keys: set[str]) -> dict[str, torch.Tensor]:
    """The model's tensors named in ``keys`` (its BF16 state before quantization).

    After the AWQ proxy run the model also holds llm-compressor's observer scales; ``keys`` (taken
    before) filters them out. A tied output head is written once, as transformers does.
    """
    state = {name: tensor for name, tensor in model.state_dict().items() if name in keys}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


@torch.no_grad()
def nf4_state(
    state: dict[str, torch.Tensor], quantized: list[str], device: torch.device
) -> dict[str, torch.Tensor]:
    """Replace ``<layer>.weight`` of every quantized layer by its NF4 checkpoint tensors."""
    fmt = formats.get("nf4")
    targets = {f"{name}.weight": name for name in quantized}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        layer = targets.get(key)
        if layer is None:
            out[key] = tensor.detach().to("cpu").contiguous()
            continue
        for name, packed in fmt.quantize(tensor.detach().to(device)).items():
            # clone: code books may be shared cached tensors, and safetensors refuses aliased storage
            out[f"{layer}.{name}"] = packed.to("cpu").clone()
    return out


def save_nf4(
    model: torch.nn.Module,
    keys: set[str],
    quantized: list[str],
    skipped: list[str],
    out_dir: Path,
    device: torch.device,
) -> None:
    """Write config.json (with the bitsandbytes quantization_config), generation config and weights."""
    tensors = nf4_state(float_state(model, keys), quantized, device)
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    config = model.config.__class__.from_dict(model.config.to_dict())  # a copy: the caller's stays BF16
    config.quantization_config = bnb_config(skipped)
    config.save_pretrained(out_dir)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(out_dir)

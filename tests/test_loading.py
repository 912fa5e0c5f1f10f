"""Loading 4-bit checkpoints into QuantLinear: llm-compressor output gives transformers' logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl_cli import formats
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import detect_format, load_policy_model
from qerl_cli.modeling.quant_linear import QuantLinear

SCHEMES = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    from qerl_cli.modeling.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module", params=list(SCHEMES))
def llmc_checkpoint(request, tiny_source, tmp_path_factory) -> tuple[str, Path]:
    """The tiny model quantized by llm-compressor itself (RTN, weight-only, no calibration data)."""
    pytest.importorskip("llmcompressor")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_source, dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme=SCHEMES[request.param], ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    out = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(out, save_compressed=True)
    return request.param, out


def test_llmcompressor_checkpoint_loads_with_transformers_logits(llmc_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    fmt, path = llmc_checkpoint
    model, detected = load_policy_model(path, dtype=torch.bfloat16)
    assert detected == fmt
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 7 and all(m.fmt.name == fmt for m in linears)
    assert not isinstance(model.lm_head, QuantLinear)
    assert not any(name.endswith("proj.weight") for name in model.state_dict())  # no dense copy at rest

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)  # its own decompression
    ids = torch.randint(4, 100, (2, 23))
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1.6e-2, atol=1e-2)


def test_our_quantization_equals_llmcompressor_checkpoint(llmc_checkpoint, tiny_source) -> None:
    """Quantizing the source weights ourselves (fused global scales included) reproduces every byte."""
    from safetensors.torch import load_file

    fmt_name, path = llmc_checkpoint
    fmt = formats.get(fmt_name)
    source = load_file(tiny_source / "model.safetensors")
    saved = load_file(path / "model.safetensors")
    weights = {k[: -len(".weight")]: v for k, v in source.items() if k.endswith("proj.weight")}
    groups: dict[str, list[str]] = {}
    for name in weights:
        groups.setdefault(formats.fused_group_key(name) or name, []).append(name)
    for members in groups.values():
        shared = formats.shared_global_scale([weights[n] for n in members]) if fmt_name == "nvfp4" else None
        for name in members:
            ours = fmt.quantize(weights[name], global_scale=shared)
            for tensor_name, tensor in ours.items():
                expected = saved[f"{name}.{tensor_name}"]
                assert tensor.dtype == expected.dtype and torch.equal(
                    tensor.view(torch.uint8), expected.view(torch.uint8)
                ), f"{name}.{tensor_name}"


def test_bf16_folder_loads_plain(tiny_source) -> None:
    model, detected = load_policy_model(tiny_source)
    assert detected == "bf16"
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_format_detection_errors(tmp_path) -> None:
    assert detect_format({}) == "bf16"
    assert detect_format({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                  "bnb_4bit_quant_type": "nf4"}}) == "nf4"  # fmt: skip
    with pytest.raises(QerlError, match="not supported"):
        detect_format({"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(QerlError, match="not supported"):
        detect_format(
            {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized"}}
        )
    with pytest.raises(QerlError, match="nf4"):
        detect_format({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}})
    with pytest.raises(QerlError, match="config.json"):
        load_policy_model(tmp_path)


def test_missing_tensor_is_reported(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from qerl_cli.modeling.random_checkpoint import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / "m", "tiny", "nvfp4")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(QerlError, match="incomplete nvfp4"):
        load_policy_model(path)
    assert (
        json.loads((path / "config.json").read_text())["quantization_config"]["format"]
        == "nvfp4-pack-quantized"
    )

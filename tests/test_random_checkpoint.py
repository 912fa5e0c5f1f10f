"""Random-weight checkpoints: on-disk layouts transformers loads, fused NVFP4 scales, sharding, shapes."""

from __future__ import annotations

import json

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import load_policy_model
from qerl_cli.modeling.quant_linear import QuantLinear
from qerl_cli.modeling.random_checkpoint import SHAPES, model_config, write_random_checkpoint


def test_shapes_have_real_qwen25_sizes() -> None:
    from transformers import AutoModelForCausalLM

    assert set(SHAPES) == {
        "tiny",
        *(f"qwen2.5-{s}" for s in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")),
    }
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config("qwen2.5-7b"))
    assert 7.5e9 < sum(p.numel() for p in model.parameters()) < 7.7e9  # Qwen2.5-7B: 7.62B
    assert model_config("qwen2.5-72b").intermediate_size == 29568
    with pytest.raises(QerlError, match="unknown model shape"):
        model_config("qwen3-8b")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_compressed_tensors_checkpoint_loads_in_transformers_and_qerl(tmp_path, fmt) -> None:
    from transformers import AutoModelForCausalLM

    path = write_random_checkpoint(tmp_path / fmt, "tiny", fmt, seed=3)
    ours, detected = load_policy_model(path)
    assert detected == fmt and sum(isinstance(m, QuantLinear) for m in ours.modules()) == 14
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = torch.randint(4, 100, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids).logits.float(), reference(ids).logits.float(), rtol=1.6e-2, atol=1e-2
        )


def test_nf4_checkpoint_loads_in_transformers_and_qerl(tmp_path) -> None:
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    path = write_random_checkpoint(tmp_path / "nf4", "tiny", "nf4", seed=4)
    ours, detected = load_policy_model(path)
    assert detected == "nf4"
    layer = ours.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.fmt.double_quant
    try:
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    except Exception as exc:  # pragma: no cover - depends on the bitsandbytes build
        pytest.skip(f"transformers cannot load bitsandbytes 4-bit on this machine: {exc}")
    bnb_layer = reference.model.layers[0].mlp.down_proj
    import bitsandbytes.functional as bnb_functional

    dense = bnb_functional.dequantize_4bit(bnb_layer.weight.data, bnb_layer.weight.quant_state)
    assert torch.equal(layer.dequantized_weight(torch.bfloat16), dense.to(torch.bfloat16))
    ids = torch.randint(4, 100, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids).logits.float(), reference(ids).logits.float(), rtol=3e-2, atol=3e-2
        )


def test_fused_layers_share_nvfp4_global_scale_and_shards(tmp_path) -> None:
    from safetensors import safe_open

    path = write_random_checkpoint(tmp_path / "m", "tiny", "nvfp4", max_shard_bytes=100_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    scales = {}
    for file in files:
        with safe_open(str(path / file), "pt") as f:
            names = [k for k in f.keys() if k.endswith("weight_global_scale")]  # noqa: SIM118
            scales.update({k: f.get_tensor(k) for k in names})
    prefix = "model.layers.1."
    q, k, v = (scales[f"{prefix}self_attn.{p}_proj.weight_global_scale"] for p in "qkv")
    assert torch.equal(q, k) and torch.equal(q, v)
    assert torch.equal(
        scales[f"{prefix}mlp.gate_proj.weight_global_scale"],
        scales[f"{prefix}mlp.up_proj.weight_global_scale"],
    )
    assert not torch.equal(scales[f"{prefix}mlp.down_proj.weight_global_scale"], q)
    assert "lm_head.weight_packed" not in index["weight_map"] and "lm_head.weight" in index["weight_map"]
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] == "tensor_group"
    model, _ = load_policy_model(path)
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, SHAPES["tiny"]["vocab_size"])


def test_bf16_and_bad_format(tmp_path) -> None:
    path = write_random_checkpoint(tmp_path / "bf16", "tiny", "bf16")
    model, detected = load_policy_model(path)
    assert detected == "bf16" and model.model.norm.weight.eq(1).all()
    assert (path / "tokenizer.json").is_file()
    with pytest.raises(QerlError, match="unknown checkpoint format"):
        write_random_checkpoint(tmp_path / "x", "tiny", "int4")

"""vLLM's Marlin FP4 shape rule, checked before vLLM starts: tiny passes, a 576-wide model does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_cli.errors import QerlError
from qerl_cli.modeling import shapes
from qerl_cli.modeling.random_checkpoint import SHAPES, write_random_checkpoint

# SmolLM2-135M's widths (hidden 576, 9 heads of 64, 3 KV heads, MLP 1536), two layers, small vocab.
SMOL_SHAPE = dict(
    SHAPES["tiny"], model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576,
    intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def smol_nvfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("smol") / "nvfp4", SMOL_SHAPE, "nvfp4")


def test_marlin_rule_on_merged_projections() -> None:
    layer = "model.layers.0"
    problems = shapes.marlin_refusals(
        {
            f"{layer}.self_attn.q_proj": (576, 576),
            f"{layer}.self_attn.k_proj": (576, 192),
            f"{layer}.self_attn.v_proj": (576, 192),
            f"{layer}.self_attn.o_proj": (576, 576),
            f"{layer}.mlp.gate_proj": (576, 1536),
            f"{layer}.mlp.up_proj": (576, 1536),
            f"{layer}.mlp.down_proj": (1536, 576),
        }
    )
    assert problems == [
        f"{layer}.self_attn.qkv_proj (q_proj, k_proj, v_proj): input width 576 is not a multiple of 128",
        f"{layer}.self_attn.o_proj: input width 576 is not a multiple of 128",
        f"{layer}.mlp.gate_up_proj (gate_proj, up_proj): input width 576 is not a multiple of 128",
    ]  # down_proj (1536 -> 576) fits
    # Output widths are checked on the merged sum: 32 + 32 = 64 passes, 96 alone does not.
    assert shapes.marlin_refusals({"a.q_proj": (128, 32), "a.k_proj": (128, 32)}) == []
    refused = shapes.marlin_refusals({"a.o_proj": (128, 96)})
    assert refused == ["a.o_proj: output width 96 is not a multiple of 64"]


def test_check_names_layers_on_hopper_only(smol_nvfp4: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(QerlError, match=r"refuse 6 fused layer\(s\): model.layers.0.mlp.gate_up_proj") as err:
        shapes.check_vllm_shapes(smol_nvfp4, capability=(9, 0))
    assert "hf rollout engine" in str(err.value)
    shapes.check_vllm_shapes(smol_nvfp4, capability=(10, 0))  # Blackwell: native FP4, no Marlin
    tiny_nvfp4 = write_random_checkpoint(tmp_path / "tiny-nvfp4", "tiny", "nvfp4")
    shapes.check_vllm_shapes(tiny_nvfp4, capability=(9, 0))  # the tiny model's widths fit
    shapes.check_vllm_shapes(tiny_model_dir, capability=(9, 0))  # BF16: no Marlin at all


def test_vllm_engine_fails_before_vllm(smol_nvfp4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qerl_cli.rollout.factory import EngineRequest, make_engine

    monkeypatch.setattr(shapes, "_capability", lambda: (9, 0))
    with pytest.raises(QerlError, match="Marlin NVFP4"):
        make_engine(EngineRequest("vllm", smol_nvfp4))


def test_a_copy_served_backend_skips_the_marlin_check(
    smol_nvfp4: Path, monkeypatch: pytest.MonkeyPatch, hide_packages
) -> None:
    """``merged`` serves vLLM a BF16 copy of the dequantized base (and ``fp8`` an FP8 copy): Marlin never
    sees the 576-wide layers, so the run gets past the shape check (here to the missing vLLM; on an H200
    the check once refused every NVFP4 run of a merged comparison)."""
    from qerl_cli.rollout.factory import EngineRequest, make_engine

    monkeypatch.setattr(shapes, "_capability", lambda: (9, 0))
    hide_packages("vllm")
    for backend in ("merged", "fp8"):
        with pytest.raises(QerlError, match="needs vLLM, which is not installed"):
            make_engine(EngineRequest("vllm", smol_nvfp4, linear_backend=backend))
    with pytest.raises(QerlError, match=r"Marlin NVFP4.*rollout.linear_backend=merged"):
        make_engine(EngineRequest("vllm", smol_nvfp4, linear_backend="marlin"))


def test_auto_serves_a_base_marlin_refuses_as_the_merged_bf16_copy(
    smol_nvfp4: Path, monkeypatch: pytest.MonkeyPatch, hide_packages
) -> None:
    """``auto`` for the trainer's engine (LoRA, merges allowed) on a 576-wide NVFP4 base on Hopper: Marlin
    would refuse it, so the BF16 copy with the LoRA merged serves it; without merges Marlin stays (and the
    engine refuses it, naming ``merged``); on Blackwell (native FP4) nothing changes."""
    from qerl_cli.rollout.factory import EngineRequest, choose_rollout_backend, make_engine

    monkeypatch.setattr(shapes, "_capability", lambda: (9, 0))
    choice = choose_rollout_backend(str(smol_nvfp4), "auto", concurrency=128, merge_ok=True)
    assert choice.backend == "merged" and choice.needs_bf16_copy
    assert "Marlin NVFP4 kernels refuse 6 of this checkpoint's fused layers" in choice.reason
    assert choose_rollout_backend(str(smol_nvfp4), "auto", concurrency=128).backend == "marlin"
    assert choose_rollout_backend(
        str(smol_nvfp4), "auto", concurrency=128, merge_ok=True, lora=False
    ).backend == ("marlin")
    hide_packages("vllm")
    with pytest.raises(QerlError, match="needs vLLM, which is not installed"):  # past the width check
        make_engine(EngineRequest("vllm", smol_nvfp4, merge_ok=True))
    monkeypatch.setattr(shapes, "_capability", lambda: (10, 0))
    assert choose_rollout_backend(str(smol_nvfp4), "auto", concurrency=128, merge_ok=True).backend == "marlin"

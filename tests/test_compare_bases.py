"""The bases of `qerl compare` arms: per-arm quantization method and the dense (dequantized) control."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl_cli.compare import arms as arms_mod
from qerl_cli.compare import runs as runs_mod
from qerl_cli.compare.bases import base_labels, prepare_bases
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import detect_format, load_policy_model, read_config
from qerl_cli.modeling.quant_linear import QuantLinear
from qerl_cli.quantize.native import DEQUANTIZED_RECORD, write_dequantized_checkpoint, write_rtn_checkpoint

SETS = ["train.device=cpu", "model.dtype=float32"]


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_a_dequantized_copy_holds_the_4bit_models_weights_densely(
    fmt: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    packed = write_rtn_checkpoint(tiny_model_dir, tmp_path / fmt, fmt)
    dense = write_dequantized_checkpoint(packed, tmp_path / "dense", method="rtn")
    assert detect_format(read_config(dense)) == "bf16" and "quantization_config" not in read_config(dense)
    assert json.loads((dense / DEQUANTIZED_RECORD).read_text()) == {
        "source": str(packed), "format": fmt, "method": "rtn",
    }  # fmt: skip
    quant, _ = load_policy_model(packed, dtype=torch.bfloat16)
    copy, found = load_policy_model(dense, dtype=torch.bfloat16)
    assert found == "bf16" and not any(isinstance(m, QuantLinear) for m in copy.modules())
    layers = {name: m for name, m in quant.named_modules() if isinstance(m, QuantLinear)}
    assert layers, "the tiny model's linears are quantized"
    for name, layer in layers.items():  # exactly the weights QuantLinear computes with
        assert torch.equal(copy.get_submodule(name).weight, layer.dequantized_weight(torch.bfloat16)), name
    dense_only = {k: v for k, v in copy.state_dict().items() if k.rsplit(".", 1)[0] not in layers}
    for key, value in dense_only.items():  # norms, embeddings: as stored
        assert torch.equal(value, quant.state_dict()[key]), key
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    assert torch.equal(copy(ids).logits, quant(ids).logits)  # QuantLinear computes with these weights
    stamp = (dense / "config.json").stat().st_mtime_ns
    assert write_dequantized_checkpoint(packed, tmp_path / "dense") == dense  # complete: reused
    assert (dense / "config.json").stat().st_mtime_ns == stamp
    other = write_rtn_checkpoint(tiny_model_dir, tmp_path / f"{fmt}-other", fmt)
    with pytest.raises(QerlError, match=rf"is a dense copy of {packed}, not of {other}: remove it"):
        write_dequantized_checkpoint(other, tmp_path / "dense")  # a stale copy is never reused


def test_a_bf16_model_is_not_dequantized(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(QerlError, match="not a 4-bit checkpoint: there is nothing to dequantize"):
        write_dequantized_checkpoint(tiny_model_dir, tmp_path / "dense")
    assert not (tmp_path / "dense").exists()


def test_arms_choose_their_base_method_and_a_dense_copy(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = {"model": {"path": str(tiny_model_dir)}}
    arms = {
        "bf16-lora": arms_mod.BUILTIN_ARMS["bf16-lora"],
        "rtn-lora": {"model.format": "nvfp4", "aqn.enabled": False, "base.method": "rtn"},
        "rtn-dense": {"model.format": "nvfp4", "base.method": "rtn", "base.dequantized": True},
    }
    out = tmp_path / "out"
    # compare.base_method stays AWQ (needs llm-compressor, absent here): the arms' own RTN is used.
    bases = prepare_bases(data, arms, SETS, out, method="awq")
    assert bases == {
        "bf16-lora": str(tiny_model_dir),
        "rtn-lora": str(out / "bases" / "nvfp4"),
        "rtn-dense": str(out / "bases" / "nvfp4-dequantized"),
    }
    dense = runs_mod.arm_config(data, arms["rtn-dense"], SETS, 0, out, "rtn-dense", bases)
    assert dense.model.format == "bf16" and dense.model.path == bases["rtn-dense"]
    rtn = runs_mod.arm_config(data, arms["rtn-lora"], SETS, 0, out, "rtn-lora", bases)
    assert rtn.model.format == "nvfp4" and rtn.model.path == bases["rtn-lora"]
    paths = {a: runs_mod.arm_config(data, o, SETS, 0, out, a, bases).model.path for a, o in arms.items()}
    assert base_labels(paths, arms, bases, out, "awq") == {
        "bf16-lora": "bf16", "rtn-lora": "nvfp4 RTN", "rtn-dense": "nvfp4 RTN dequantized to BF16",
    }  # fmt: skip


def test_the_builtin_control_arm_dequantizes_the_nvfp4_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    control = arms_mod.BUILTIN_ARMS["nvfp4-dequant-lora"]
    choice = arms_mod.base_choice(control, "awq")
    assert (choice.format, choice.method, choice.dequantized) == ("nvfp4", "awq", True)
    assert arms_mod.config_overrides(control) == {"model.format": "nvfp4", "aqn.enabled": False}
    data = {"model": {"path": str(tiny_model_dir)}}
    out = tmp_path / "out"
    arms = {"nvfp4-dequant-lora": control, "nvfp4-lora": arms_mod.BUILTIN_ARMS["nvfp4-lora"]}
    bases = prepare_bases(data, arms, SETS, out, method="rtn")
    # One NVFP4 base, quantized once; the control trains its dense copy.
    assert bases["nvfp4-lora"] == str(out / "bases" / "nvfp4")
    assert bases["nvfp4-dequant-lora"] == str(out / "bases" / "nvfp4-dequantized")
    assert sorted(p.name for p in (out / "bases").iterdir() if not p.name.startswith(".")) == [
        "nvfp4", "nvfp4-dequantized",
    ]  # fmt: skip


def test_an_arms_base_keys_are_checked() -> None:
    def arms(**overrides: object) -> None:
        arms_mod.read_settings({"arms": {"x": {"model.format": "nvfp4", **overrides}}})

    with pytest.raises(QerlError, match=r"compare.arms.x: unknown key\(s\) \['base.methd'\]; an arm's base"):
        arms(**{"base.methd": "rtn"})
    with pytest.raises(QerlError, match="compare.arms.x: base.method must be one of gptq, awq, rtn, got 'g'"):
        arms(**{"base.method": "g"})
    with pytest.raises(QerlError, match="base.dequantized must be true or false, got 'yes'"):
        arms(**{"base.dequantized": "yes"})
    with pytest.raises(QerlError, match=r"base.dequantized needs the 4-bit base to dequantize.*\(got bf16\)"):
        arms(**{"base.dequantized": True, "model.format": "bf16"})
    arms(**{"base.method": "rtn", "base.dequantized": True})  # a valid pair
    with pytest.raises(QerlError, match=r"base.dequantized say\(s\) how compare makes the arm.s base"):
        arms(**{"base.dequantized": True, "model.path": "my-nvfp4"})  # it would train my-nvfp4 as it is


def test_a_4bit_recipe_model_is_the_arms_base_and_its_dense_copy_the_controls(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    packed = write_rtn_checkpoint(tiny_model_dir, tmp_path / "mine-nvfp4", "nvfp4")
    data = {"model": {"path": str(packed)}}
    arms = {
        "given": {"model.format": "nvfp4", "base.method": "awq"},  # nothing to make: said, not silent
        "dense": {"model.format": "nvfp4", "base.dequantized": True},
    }
    bases = prepare_bases(data, arms, SETS, tmp_path / "out", method="rtn")
    dense = tmp_path / "out" / "bases" / "nvfp4-recipe-dequantized"
    assert bases == {"given": str(packed), "dense": str(dense)}
    assert "arm given: base.method is unused: the recipe's model" in caplog.text
    assert json.loads((Path(bases["dense"]) / DEQUANTIZED_RECORD).read_text())["source"] == str(packed)


def test_a_dense_copy_records_the_method_its_source_says(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    packed = write_rtn_checkpoint(tiny_model_dir, tmp_path / "nvfp4", "nvfp4")
    report = Path(__file__).resolve().parents[1] / "benchmarks/gemma3-270m-h100-2026-11-24"
    shutil.copy(
        report / "nvfp4_awq_base_qerl_quant.json", packed / "qerl_quant.json"
    )  # a qerl quantize record
    dense = write_dequantized_checkpoint(packed, tmp_path / "dense")  # no method given: the record's
    assert json.loads((dense / DEQUANTIZED_RECORD).read_text())["method"] == "awq"
    assert base_labels({"a": str(dense)}, {"a": {}}, {}, tmp_path, "rtn") == {
        "a": "nvfp4 AWQ dequantized to BF16"
    }

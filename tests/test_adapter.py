"""The PEFT adapter folder has one home, ``qerl_cli.modeling.adapter``: what it reads, checks and writes."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.modeling import adapter

PACKAGE = Path(__file__).resolve().parents[1] / "qerl_cli"
HOME = PACKAGE / "modeling" / "adapter.py"


def _folder_file_uses(path: Path) -> list[str]:
    """Where a module names an adapter file: a string literal (docstrings aside) or the constants."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        text = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        if text and (adapter.ADAPTER_CONFIG in node.value or adapter.ADAPTER_WEIGHTS in node.value):
            found.append(f"{path.name}:{node.lineno} literal {node.value!r}")
        names = {"ADAPTER_CONFIG", "ADAPTER_WEIGHTS"}
        if isinstance(node, ast.Name) and node.id in names:
            found.append(f"{path.name}:{node.lineno} name {node.id}")
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"{path.name}:{node.lineno} attribute {node.attr}")
        if isinstance(node, ast.ImportFrom) and any(a.name in names for a in node.names):
            found.append(f"{path.name}:{node.lineno} import")
    return found


def test_no_other_module_reads_or_writes_the_adapter_files() -> None:
    uses = [use for file in PACKAGE.rglob("*.py") if file != HOME for use in _folder_file_uses(file)]
    assert uses == []


def test_the_source_check_sees_literals_and_constants(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        '"""Docs may name adapter_config.json."""\n'
        "from qerl_cli.modeling.adapter import ADAPTER_WEIGHTS\n"
        "def f(d):\n    return d / 'adapter_config.json', adapter.ADAPTER_CONFIG\n"
    )
    assert len(_folder_file_uses(source)) == 3


def _tiny_peft():
    from qerl_cli.modeling.lora import attach_lora

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("q_proj", torch.nn.Linear(8, 8))
    base.add_module("norm", torch.nn.LayerNorm(8))
    model = attach_lora(base, r=4, alpha=8, target_modules=["q_proj"], task_type=None)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # PEFT starts B at zero; a nonzero B makes the round trip visible
    return model


def test_save_then_attach_round_trips_the_weights(tmp_path: Path) -> None:
    from peft import get_peft_model_state_dict

    trained = _tiny_peft()
    folder = adapter.save_peft_model(trained, tmp_path / "a")
    assert adapter.check_folder(folder) == folder
    assert adapter.rank(folder) == 4 and adapter.target_modules(adapter.read_config(folder)) == ["q_proj"]
    fresh = _tiny_peft()
    with torch.no_grad():
        for name, param in fresh.named_parameters():
            if "lora_" in name:
                param.zero_()
    adapter.load_weights(fresh, folder)
    want, got = get_peft_model_state_dict(trained), get_peft_model_state_dict(fresh)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    copied = adapter.copy_folder(folder, tmp_path / "copy")
    assert {p.name for p in copied.iterdir()} == {adapter.ADAPTER_CONFIG, adapter.ADAPTER_WEIGHTS}


def test_folder_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(QerlError, match="no such folder"):
        adapter.check_folder(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(QerlError, match="is a file"):
        adapter.check_folder(tmp_path / "file")
    with pytest.raises(QerlError, match="no adapter_config.json"):
        adapter.check_folder(tmp_path)
    (tmp_path / adapter.ADAPTER_CONFIG).write_text(json.dumps({"r": 8, "rank_pattern": {"q_proj": 16}}))
    (tmp_path / adapter.PICKLE_WEIGHTS).write_bytes(b"x")
    with pytest.raises(QerlError, match="only a pickle adapter_model.bin"):
        adapter.check_folder(tmp_path)
    assert adapter.rank(tmp_path) == 16 and adapter.rank(None) is None
    (tmp_path / adapter.ADAPTER_CONFIG).write_text("{not json")
    with pytest.raises(QerlError, match="not valid JSON"):
        adapter.read_config(tmp_path)


def test_vllm_serving_check_refuses_high_ranks_and_trained_norms(tmp_path: Path) -> None:
    folder = adapter.save_peft_model(_tiny_peft(), tmp_path / "a")
    adapter.check_servable(folder, enable_lora=True, max_lora_rank=8)
    with pytest.raises(QerlError, match="rank 4 but vLLM was started with max_lora_rank=2"):
        adapter.check_servable(folder, enable_lora=True, max_lora_rank=2)
    with pytest.raises(QerlError, match="without LoRA"):
        adapter.check_servable(folder, enable_lora=False, max_lora_rank=8)
    config = adapter.read_config(folder)
    (folder / adapter.ADAPTER_CONFIG).write_text(json.dumps({**config, "modules_to_save": ["norm"]}))
    with pytest.raises(QerlError, match="also trains full modules"):
        adapter.check_servable(folder, enable_lora=True, max_lora_rank=8)


def test_a_mismatched_adapter_is_refused(tmp_path: Path) -> None:
    from qerl_cli.modeling.lora import attach_lora

    folder = adapter.save_peft_model(_tiny_peft(), tmp_path / "a")
    base = torch.nn.Sequential()
    base.add_module("k_proj", torch.nn.Linear(8, 8))
    other = attach_lora(base, r=4, alpha=8, target_modules=["k_proj"], task_type=None)
    with pytest.raises(QerlError, match="does not match the model"):
        adapter.load_weights(other, folder)
    with pytest.raises(QerlError, match="no LoRA adapter to load weights into"):
        adapter.load_weights(torch.nn.Linear(2, 2), folder)


def _quantized_peft(base_id: str):
    """A tiny Qwen2 with NVFP4 QuantLinear layers and LoRA on all seven linears, recording ``base_id``
    as its base (a hub id or a folder, as a training run records it)."""
    from qerl_cli.modeling.lora import attach_lora
    from qerl_cli.modeling.quant_linear import QuantLinear
    from qerl_cli.modeling.tiny import build_tiny_model

    model = build_tiny_model(seed=0)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, QuantLinear.from_linear(child, "nvfp4"))
    model.name_or_path = base_id  # what from_pretrained records, and PEFT copies into its config
    peft_model = attach_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    return peft_model


@pytest.mark.parametrize("base_id", ["example-org/not-a-local-folder", "local"])
def test_a_save_reads_nothing_of_the_base(
    base_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vLLM sync saves the adapter every step: the save must not look the base model up (PEFT's
    embedding check reads its config, from the Hub for a hub id) nor dequantize its packed weights."""
    import peft.utils.save_and_load as peft_save

    from qerl_cli.modeling import quant_linear

    if base_id == "local":
        base_id = str(tmp_path / "base")
        (tmp_path / "base").mkdir()
        (tmp_path / "base" / "config.json").write_text("{}")
    peft_model = _quantized_peft(base_id)
    assert peft_model.peft_config["default"].base_model_name_or_path == base_id

    def refused(*args, **kwargs):
        raise AssertionError("the adapter save looked at the base model")

    monkeypatch.setattr(peft_save, "check_file_exists_on_hf_hub", refused)
    monkeypatch.setattr(type(peft_model.config), "from_pretrained", classmethod(refused))
    monkeypatch.setattr(quant_linear, "kernel_dequantize", refused)
    fmt = type(peft_model.get_base_model().model.layers[0].mlp.down_proj.base_layer.fmt)
    monkeypatch.setattr(fmt, "dequantize", refused)
    monkeypatch.setattr(fmt, "dequantize_buffers", refused)

    folder = adapter.save_peft_model(peft_model, tmp_path / "a")
    names = adapter.weight_names(folder)
    assert len(names) == 2 * 7 * 2 and all(".lora_A." in k or ".lora_B." in k for k in names)


def test_the_save_writes_what_peft_writes_by_default(tmp_path: Path) -> None:
    """Telling PEFT there are no embedding layers to save changes nothing in the files it writes."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(_quantized_peft("x").config.to_json_string())
    peft_model = _quantized_peft(str(tmp_path / "base"))
    ours = adapter.save_peft_model(peft_model, tmp_path / "ours")
    # PEFT's own default, save_embedding_layers="auto":
    peft_model.save_pretrained(str(tmp_path / "peft"), safe_serialization=True)
    for name in (adapter.ADAPTER_CONFIG, adapter.ADAPTER_WEIGHTS):
        assert (ours / name).read_bytes() == (tmp_path / "peft" / name).read_bytes()


def test_an_adapter_on_embeddings_keeps_peft_s_own_choice() -> None:
    from qerl_cli.modeling.lora import attach_lora

    base = torch.nn.Sequential()
    base.add_module("q_proj", torch.nn.Linear(8, 8))
    base.add_module("lm_head", torch.nn.Linear(8, 8))
    on_linear = attach_lora(base, r=4, alpha=8, target_modules=["q_proj"], task_type=None)
    assert adapter._embedding_layers_setting(on_linear) is False
    base = torch.nn.Sequential()
    base.add_module("q_proj", torch.nn.Linear(8, 8))
    base.add_module("lm_head", torch.nn.Linear(8, 8))
    on_head = attach_lora(base, r=4, alpha=8, target_modules=["q_proj", "lm_head"], task_type=None)
    assert adapter._embedding_layers_setting(on_head) == "auto"

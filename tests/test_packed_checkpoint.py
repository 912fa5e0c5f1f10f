"""One packer writes every 4-bit checkpoint (qerl_cli.formats.checkpoint): the random-weight writer,
the RTN writer and the tiny base's quantizer give the same bytes, pinned to what they wrote before they
shared it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from qerl_cli.errors import QerlError
from qerl_cli.formats.checkpoint import pack_group, quantization_config, state_dict_groups
from qerl_cli.modeling.random_checkpoint import write_random_checkpoint
from qerl_cli.quantize.native import write_rtn_checkpoint
from qerl_cli.rl.warmstart import quantize_folder

# sha256 over (file, name, dtype, shape, bytes) of every tensor of the tiny shape, seed 3, written by
# the three separate writers before they shared formats.checkpoint (commit b8cf92e).
PINNED = {
    "bf16": "6ce8318b040a998f812a689099a5c7b74c003be143d8fc78f4d94120bad4c9b2",
    "nvfp4": "ff1bba85ec1a86bfbeb04b2f70c84bfd33d6e725fc04329e8fc713570814944d",
    "mxfp4": "c76e2838f3c5134b88f412a72a03d1ece7e3b82833c462d4f71af4e690eceef9",
    "nf4": "3c82608d1d1289f4a7e0e381c2c71ead45e59dc5951deaf5314140c35d9efbcc",
}


def tensors_digest(folder: Path) -> str:
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(file))
        for name in sorted(tensors):
            tensor = tensors[name].contiguous()
            digest.update(f"{file.name}|{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def random_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("bf16") / "m", "tiny", "bf16", seed=3)


def test_random_bf16_checkpoint_is_pinned(random_bf16: Path) -> None:
    assert tensors_digest(random_bf16) == PINNED["bf16"]
    assert "quantization_config" not in json.loads((random_bf16 / "config.json").read_text())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_every_writer_packs_the_same_bytes(fmt: str, random_bf16: Path, tmp_path: Path) -> None:
    written = {
        "random": write_random_checkpoint(tmp_path / "random", "tiny", fmt, seed=3),
        "rtn": write_rtn_checkpoint(random_bf16, tmp_path / "rtn", fmt),
        "tiny-base": quantize_folder(random_bf16, tmp_path / "folder", fmt),
    }
    assert {name: tensors_digest(folder) for name, folder in written.items()} == dict.fromkeys(
        written, PINNED[fmt]
    )
    for folder in written.values():
        config = json.loads((folder / "config.json").read_text())
        assert config["quantization_config"] == quantization_config(fmt) and config["dtype"] == "bfloat16"


def test_nvfp4_fused_siblings_share_one_global_scale() -> None:
    torch.manual_seed(0)
    state = {
        "layers.0.attn.q_proj.weight": torch.randn(32, 32),
        "layers.0.attn.k_proj.weight": torch.randn(16, 32) * 5,  # the group's absmax sits here
        "layers.0.attn.o_proj.weight": torch.randn(32, 32),
        "layers.0.norm.weight": torch.ones(32),
    }
    [group] = [g for g in state_dict_groups(state) if "layers.0.attn.q_proj" in g]
    packed = dict(pack_group(group, [f"layers.0.attn.{m}_proj" for m in "qko"], "nvfp4"))
    q, k, o = (packed[f"layers.0.attn.{m}_proj.weight_global_scale"] for m in "qko")
    assert torch.equal(q, k) and not torch.equal(q, o)
    assert q.data_ptr() != k.data_ptr()  # separate storage: safetensors refuses shared tensors
    norms = dict(pack_group({"norm": {"weight": state["layers.0.norm.weight"]}}, [], "nvfp4"))
    assert list(norms) == ["norm.weight"]  # what is not named passes through


def test_unknown_checkpoint_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(QerlError, match="unknown checkpoint format 'int4'"):
        write_random_checkpoint(tmp_path / "x", "tiny", "int4")
    assert not (tmp_path / "x").exists()

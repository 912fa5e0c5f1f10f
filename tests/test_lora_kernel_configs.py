"""Tuned vLLM LoRA kernel configs: the file names and nesting vLLM's loader looks up, qerl's shipped
folder, and ``VLLM_TUNED_CONFIG_FOLDER`` set where every engine's environment is (the user's setting
winning, nothing set without a file for the GPU). CPU only: vLLM is stood in for."""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from qerl_cli.rollout import lora_kernel_configs as lkc
from qerl_cli.rollout import vllm_setup
from qerl_cli.rollout.lora_kernel_configs import ConfigKey

GPU = "NVIDIA Test-GPU 80GB"  # spaces and a dash, as device names have
SHRINK_CONFIG = {"block_m": 16, "block_n": 16, "block_k": 128, "split_k": 32, "num_warps": 4, "num_ctas": 1,
                 "num_stages": 2, "group_size_m": 8, "max_nreg": None}  # fmt: skip


def vllm_rule_lookup(folder: Path, gpu: str, op: str, add_inputs: bool | None, key: tuple[int, ...]) -> Any:
    """vLLM's loader as its tuning README and utils describe it, written out here: the file
    ``{gpu}_{OP}[_{ADD_INPUTS}].json`` (gpu with spaces and dashes made underscores), then
    ``table[max_loras][num_slices][m][k][n]``, each level's exact key or else the nearest one
    (``num_slices`` exact)."""
    name = gpu.replace(" ", "_").replace("-", "_")
    suffix = f"_{str(add_inputs).upper()}" if op == "expand" else ""
    path = folder / f"{name}_{op.upper()}{suffix}.json"
    if not path.exists():
        return None
    level = json.loads(path.read_text())
    for depth, want in enumerate(key):
        if depth == 1:
            level = level[str(want)]
        else:
            level = level.get(str(want)) or level[min(level, key=lambda k, w=want: abs(int(k) - w))]
    return level


# -- names and layout -------------------------------------------------------------------------------
def test_file_names_follow_vllms_rule() -> None:
    assert lkc.gpu_file_prefix(GPU) == "NVIDIA_Test_GPU_80GB"
    assert lkc.config_file_name(GPU, "shrink") == "NVIDIA_Test_GPU_80GB_SHRINK.json"
    assert lkc.config_file_name(GPU, "expand", True) == "NVIDIA_Test_GPU_80GB_EXPAND_TRUE.json"
    assert lkc.config_file_name(GPU, "expand", False) == "NVIDIA_Test_GPU_80GB_EXPAND_FALSE.json"
    assert len(set(lkc.config_file_names(GPU))) == 3


def test_a_written_table_is_what_vllms_lookup_finds(tmp_path: Path) -> None:
    # qerl's engines hold one adapter; the ops look up by their LoRA-id list, one longer.
    assert lkc.lookup_max_loras(1) == 2
    small, large = dict(SHRINK_CONFIG), dict(SHRINK_CONFIG, block_m=64, split_k=8)
    table = lkc.nest([(ConfigKey(2, 3, 8, 3584, 16), small), (ConfigKey(2, 3, 256, 3584, 16), large)])
    assert table["2"]["3"]["8"]["3584"]["16"] == small
    lkc.write_table(tmp_path / lkc.config_file_name(GPU, "shrink"), table)

    def found(m: int, k: int = 3584, slices: int = 3, max_loras: int = 2) -> Any:
        return vllm_rule_lookup(tmp_path, GPU, "shrink", None, (max_loras, slices, m, k, 16))

    assert found(8) == small and found(256) == large
    assert found(12) == small and found(200) == large and found(4096) == large  # the nearest m
    assert found(8, k=18944) == small and found(8, max_loras=5) == small  # the nearest k, max_loras
    with pytest.raises(KeyError):  # a slice count the table lacks: no config for that layer kind
        found(8, slices=2)
    for m in (8, 12, 200):  # qerl's reading of a table says the same as vLLM's rule
        assert lkc.lookup(table, ConfigKey(2, 3, m, 3584, 16)) == found(m)
    text = (tmp_path / lkc.config_file_name(GPU, "shrink")).read_text()
    assert text.index('"8"') < text.index('"256"')  # numeric order, for a reader


def test_nest_writes_the_fields_given_and_no_others() -> None:
    given = {"block_m": 16, "block_n": 64, "block_k": 16, "num_warps": 4, "num_ctas": 1, "num_stages": 2}
    table = lkc.nest([(ConfigKey(2, 1, 8, 16, 3584), given)])
    # A null group_size_m would reach the shrink kernel as None; an absent one is vLLM's default.
    assert table["2"]["1"]["8"]["16"]["3584"] == given


def test_every_shipped_config_file_is_a_table_vllm_can_use_and_the_readme_names_it() -> None:
    # vLLM looks num_slices up exactly and stops at the first layer whose slice count is missing, so a
    # shipped table must hold 1, 2 and 3 (o/down, gate_up, qkv) under qerl's max_loras key.
    files = sorted(lkc.SHIPPED_FOLDER.glob("*.json"))
    assert files, "the shipped folder holds no config file"
    readme = (lkc.SHIPPED_FOLDER / "README.md").read_text()
    for path in files:
        table = lkc.read_table(path)
        assert list(table) == [str(lkc.lookup_max_loras(1))], path.name
        assert sorted(table["2"]) == ["1", "2", "3"], path.name
        for num_slices, by_m in table["2"].items():
            for m in ("8", "128", "2048"):
                config = lkc.lookup(table, ConfigKey(2, int(num_slices), int(m), *_first_kn(by_m[m])))
                assert set(config) <= set(lkc.CONFIG_FIELDS)
                assert {"block_m", "block_n", "block_k"} <= set(config)
        assert path.name in readme, f"{path.name} is shipped but the folder's README does not list it"


def _first_kn(by_k: dict) -> tuple[int, int]:
    k = next(iter(by_k))
    return int(k), int(next(iter(by_k[k])))


# -- the engine's environment -----------------------------------------------------------------------
@pytest.fixture
def shipped(tmp_path: Path) -> Path:
    folder = tmp_path / "lora_configs"
    folder.mkdir()
    (folder / lkc.config_file_name(GPU, "shrink")).write_text("{}")
    return folder


def test_the_shipped_folder_is_used_for_a_gpu_it_has_files_for(
    shipped: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, logger=lkc.__name__):
        choice = lkc.use_tuned_lora_configs(GPU, env, shipped)
    assert env == {lkc.ENV_VAR: str(shipped)} and choice.source == "shipped"
    (record,) = caplog.records  # one line: which folder and why
    assert str(shipped) in record.getMessage() and lkc.config_file_name(GPU, "shrink") in record.getMessage()
    # A second engine of the same process sees qerl's own setting, not a user's.
    assert lkc.use_tuned_lora_configs(GPU, env, shipped).source == "shipped"


def test_the_users_folder_wins(shipped: Path, tmp_path: Path) -> None:
    env = {lkc.ENV_VAR: str(tmp_path / "mine")}
    choice = lkc.use_tuned_lora_configs(GPU, env, shipped)
    assert env == {lkc.ENV_VAR: str(tmp_path / "mine")} and choice.source == "user"
    assert "set in the environment" in choice.message()


@pytest.mark.parametrize("gpu", ["NVIDIA Other GPU", None])
def test_nothing_is_set_without_a_file_for_this_gpu(shipped: Path, gpu: str | None) -> None:
    env: dict[str, str] = {}
    choice = lkc.use_tuned_lora_configs(gpu, env, shipped)
    assert env == {} and choice.source == "none" and choice.folder is None
    assert "vLLM's default LoRA kernel configs" in choice.message()


def test_batch_invariant_mode_is_named_in_the_line(shipped: Path, caplog: pytest.LogCaptureFixture) -> None:
    env = {lkc.BATCH_INVARIANT_ENV: "1"}
    with caplog.at_level(logging.INFO, logger=lkc.__name__):
        lkc.use_tuned_lora_configs(GPU, env, shipped)
    assert "ignores tuned configs in batch-invariant mode" in caplog.records[0].getMessage()


class RecordingLLM:
    """``vllm.LLM`` as far as the engine's start-up goes; records the environment it was built in."""

    built: list[tuple[dict[str, Any], str | None]] = []

    def __init__(self, **kwargs: Any) -> None:
        RecordingLLM.built.append((kwargs, os.environ.get(lkc.ENV_VAR)))

    def apply_model(self, fn: Any) -> list[int]:
        return [1]


@pytest.fixture
def recording_vllm(monkeypatch: pytest.MonkeyPatch, shipped: Path) -> list[tuple[dict[str, Any], str | None]]:
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = RecordingLLM, object
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = object
    for name, mod in (
        ("vllm", module),
        ("vllm.lora", types.ModuleType("vllm.lora")),
        ("vllm.lora.request", request),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(vllm_setup, "_cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(vllm_setup, "_cuda_device_name", lambda: GPU)
    monkeypatch.setattr(lkc, "SHIPPED_FOLDER", shipped)
    for var in (lkc.ENV_VAR, "VLLM_ENABLE_V1_MULTIPROCESSING"):  # recorded, so each test's setting is undone
        monkeypatch.setenv(var, "placeholder")
        monkeypatch.delenv(var)
    RecordingLLM.built.clear()
    return RecordingLLM.built


NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}


@pytest.mark.parametrize("quantization", [None, NVFP4], ids=["bf16+lora", "nvfp4+lora"])
def test_every_vllm_engine_starts_with_the_tuned_folder(
    recording_vllm: list, shipped: Path, tmp_path: Path, quantization: dict | None
) -> None:
    """The BF16 + LoRA baseline and the 4-bit + LoRA runs alike: each engine (train, eval and the bench's
    all build ``VLLMEngine`` through the factory) is built after the folder is set."""
    from qerl_cli.rollout.vllm_engine import VLLMEngine

    model = tmp_path / "model"
    model.mkdir()
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    if quantization:
        config["quantization_config"] = quantization
    (model / "config.json").write_text(json.dumps(config))
    engine = VLLMEngine(model, max_lora_rank=16)
    engine.close()
    (kwargs, folder), *_ = recording_vllm
    assert kwargs["enable_lora"] and folder == str(shipped)


def test_the_users_folder_reaches_the_engine(recording_vllm: list, tmp_path: Path, monkeypatch) -> None:
    from qerl_cli.rollout.vllm_engine import VLLMEngine

    monkeypatch.setenv(lkc.ENV_VAR, str(tmp_path / "mine"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    VLLMEngine(model).close()
    assert recording_vllm[0][1] == str(tmp_path / "mine")

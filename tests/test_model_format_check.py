"""A ``model.format`` the folder in ``model.path`` does not hold is refused before any work (`qerl train`
and its ``--dry-run``), with the message the load and the vLLM engine give (one home:
``modeling.loading.check_declared_format``); every arm config `qerl compare` builds passes those checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from qerl_cli.compare.bases import prepare_bases
from qerl_cli.compare.runs import arm_config
from qerl_cli.compare.settings import BUILTIN_ARMS
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import check_declared_format, load_base_model
from qerl_cli.rl import preflight
from qerl_cli.rollout.vllm_engine import VLLMEngine
from tests.cli_runner import run_cli, usage_error

TINY = ["train.device=cpu", "model.dtype=float32", "data.dataset=synthetic-addition"]


def _as_nvfp4(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A copy of the tiny BF16 folder whose config.json says NVFP4 (compressed-tensors): what the checks
    read. Its weights are BF16 still, so nothing may load it."""
    folder = tmp_path / "nvfp4"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _recipe(tmp_path: Path, model: Path, fmt: str = "auto") -> Path:
    path = tmp_path / "recipe.yaml"
    data = {"model": {"path": str(model), "format": fmt}, "output": {"dir": str(tmp_path / "runs" / "x")}}
    path.write_text(yaml.safe_dump(data))
    return path


def _train(capsys: pytest.CaptureFixture[str], recipe: Path, *extra: str) -> tuple[int, str]:
    args = [a for s in TINY for a in ("--set", s)]
    rc, _, err = run_cli(capsys, "train", str(recipe), *args, *extra)
    return rc, err


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    import qerl_cli.rl.trainer as trainer_mod

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started before the checks refused")

    monkeypatch.setattr(trainer_mod, "train", must_not_run)


@pytest.mark.parametrize(("held", "declared"), [("bf16", "nvfp4"), ("nvfp4", "bf16"), ("nvfp4", "mxfp4")])
def test_a_format_the_folder_does_not_hold_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, no_training, held: str,
    declared: str,
) -> None:  # fmt: skip
    folder = tiny_model_dir if held == "bf16" else _as_nvfp4(tmp_path, tiny_model_dir)
    for extra in (["--dry-run"], []):
        rc, err = _train(capsys, _recipe(tmp_path, folder, declared), *extra)
        assert usage_error(rc, err), err
        source = "has no quantization_config" if held == "bf16" else "has a nvfp4 quantization_config"
        assert (
            f"model.format={declared} but {folder} holds a {held} checkpoint (its config.json {source})"
            in err
        )
        assert f"set model.format={held} (or auto)" in err
        if declared == "bf16":
            assert "point model.path at the BF16 model it was quantized from" in err
        else:  # the command that writes one: from this folder where it is the BF16 model
            origin = folder if held == "bf16" else "BF16_MODEL"
            assert f"`qerl quantize {origin} --format {declared} -o DIR` writes one" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("held", ["bf16", "nvfp4"])
def test_a_format_the_folder_holds_or_auto_passes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, held: str
) -> None:
    folder = tiny_model_dir if held == "bf16" else _as_nvfp4(tmp_path, tiny_model_dir)
    for declared in (held, "auto"):
        rc, err = _train(capsys, _recipe(tmp_path, folder, declared), "--dry-run")
        assert rc == 0, err
        found = f"{folder}: a model folder (config.json, safetensors weights); its config.json says {held}"
        assert f"model.path: {found}" in err


def test_a_folder_whose_format_cannot_be_read_is_not_refused(tmp_path: Path) -> None:
    """A Hub id, a .gguf file, a folder without config.json or with a quantization qerl does not load:
    the source checks or the load say what is wrong with those, not this check."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    bare = tmp_path / "bare"
    bare.mkdir()
    other = tmp_path / "gptq"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    for path in ("Qwen/Qwen2.5-0.5B-Instruct", gguf, bare, other, tmp_path / "not-there"):
        assert check_declared_format("nvfp4", path) is None


def test_the_load_and_the_vllm_engine_refuse_with_the_same_message(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    with pytest.raises(QerlError) as early:
        check_declared_format("nvfp4", tiny_model_dir)
    with pytest.raises(QerlError) as loaded:  # after the weights have loaded
        load_base_model(str(tiny_model_dir), "nvfp4", torch.float32, torch.device("cpu"))
    assert str(loaded.value) == str(early.value)
    nvfp4 = _as_nvfp4(tmp_path, tiny_model_dir)
    with pytest.raises(QerlError) as early:
        check_declared_format("bf16", nvfp4)
    with pytest.raises(QerlError) as engine:  # before vLLM is imported or a GPU is asked for
        VLLMEngine(nvfp4, model_format="bf16")
    assert str(engine.value) == str(early.value)


def test_every_compare_arm_config_passes_the_checks_of_qerl_train(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A first version of the early check refused 18 comparisons: before its base was made, an arm's
    config held the arm's model.format (nvfp4) beside the recipe's BF16 model.path. Every arm's config,
    before and after the bases are made, now passes what `qerl train` of it checks, on a recipe whose
    model.format names another format than its BF16 model (no arm trains it: each names its own)."""
    data = {"model": {"path": str(tiny_model_dir), "format": "nvfp4"}}
    own = _as_nvfp4(tmp_path, tiny_model_dir)
    arms = {**BUILTIN_ARMS, "own": {"model.path": str(own), "model.format": "nvfp4"}}
    out = tmp_path / "cmp"
    made = prepare_bases(data, arms, TINY, out, method="rtn")
    for bases in ({}, made):  # the checks before any work, then each run's config
        for arm, overrides in arms.items():
            conf = arm_config(data, overrides, TINY, 0, out, arm, bases)
            assert preflight.preflight(conf, resume=None, overwrite=False), arm
    assert arm_config(data, arms["nvfp4-aqn"], TINY, 0, out, "nvfp4-aqn", made).model.format == "nvfp4"
    dense = arm_config(data, arms["nvfp4-dequant-lora"], TINY, 0, out, "nvfp4-dequant-lora", made)
    assert dense.model.format == "bf16" and dense.model.path == made["nvfp4-dequant-lora"]


def test_compare_refuses_an_arm_that_would_train_the_recipes_mismatch(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The built-in arms name their formats, so the recipe's model.format=nvfp4 beside its BF16 model is
    never trained and the dry run passes; an arm naming none trains the recipe's model as the recipe says,
    which `qerl train` of it refuses, and so does compare, before any base is made."""
    recipe = _recipe(tmp_path, tiny_model_dir, "nvfp4")
    data = yaml.safe_load(recipe.read_text())
    data["compare"] = {"arms": {"plain": {"aqn.enabled": True}}}
    recipe.write_text(yaml.safe_dump(data))
    out = tmp_path / "cmp"
    args = ["--seeds", "1", "-o", str(out), "--dry-run", *(a for s in TINY for a in ("--set", s))]
    rc, _, err = run_cli(capsys, "compare", str(recipe), "--arms", ",".join(BUILTIN_ARMS), *args)
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "compare", str(recipe), "--arms", "bf16-lora,plain", *args)
    assert usage_error(rc, err), err
    assert f"model.format=nvfp4 but {tiny_model_dir} holds a bf16 checkpoint" in err
    assert not out.exists()


@pytest.mark.parametrize("held", ["bf16", "nvfp4"])
def test_the_bench_refuses_a_mismatch_with_trains_message_before_loading(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
    held: str,
) -> None:  # fmt: skip
    """A bench case (which names its format: never auto) on a folder holding another format was refused
    with its own "holds a X checkpoint, not Y" after the weights had loaded; now with `qerl train`'s
    message (check_declared_format), before they load."""
    import qerl_cli.modeling.loading as loading
    from qerl_cli.bench.engines import Case, _hf_model

    def must_not_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights loaded before the format was checked")

    monkeypatch.setattr(loading, "load_policy_model", must_not_load)
    folder = tiny_model_dir if held == "bf16" else _as_nvfp4(tmp_path, tiny_model_dir)
    declared = "mxfp4" if held == "nvfp4" else "nvfp4"
    with pytest.raises(QerlError) as bench:
        _hf_model(Case(engine="hf", format=declared, model_dir=str(folder), device="cpu"))
    rc, err = _train(capsys, _recipe(tmp_path, folder, declared), "--dry-run")
    assert usage_error(rc, err), err
    assert f"error: {' '.join(str(bench.value).split())}" in err
    assert f"model.format={declared} but {folder} holds a {held} checkpoint" in str(bench.value)

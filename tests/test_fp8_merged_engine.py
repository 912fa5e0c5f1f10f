"""rollout.linear_backend: fp8-merged through the engine: the factory starts vLLM without LoRA on the
rollout copy, and every sync merges the adapter into vLLM's weights (``LLM.apply_model`` running
``worker_merge_lora``) instead of loading a LoRARequest.

vLLM is the recording stand-in of tests/test_vllm_engine.py, its model given vLLM's stacked linears (an
FP8 weight, transposed, and one scale per row) beside its norms; the merge really runs on them. What
this proves is OUR call sequence and the merged values; real vLLM (its FP8 GEMMs on the merged weights,
sleep mode's offload of them) is not exercised here.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from test_fp8_merge import LAYER, VLLM, _bases, _fake_vllm, _reference
from test_rollout_backends import (  # choose_backend: FP8 copies allowed (auto_fp8)
    QWEN7B,
    TABLE,
    choose_backend,
    env,
    fake_llm,  # noqa: F401 (a fixture)
    nvfp4_base,
)
from test_vllm_engine import SPEC, FakeLLM, fake_vllm, names, write_adapter  # noqa: F401 (a fixture)
from torch import nn

from qerl_cli import formats
from qerl_cli.cli import main
from qerl_cli.errors import QerlError
from qerl_cli.formats import fp8
from qerl_cli.modeling.adapter import save_peft_model
from qerl_cli.modeling.lora import attach_lora
from qerl_cli.modeling.quant_linear import QuantLinear
from qerl_cli.rollout.backends import FORMAT_BACKENDS, BackendChoice, rollout_weight_format
from qerl_cli.rollout.factory import EngineRequest, make_engine
from qerl_cli.rollout.fp8_merge import PolicyBases, lora_deltas
from qerl_cli.rollout.vllm_engine import VLLMEngine
from qerl_cli.rollout.vllm_worker import worker_merge_lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class MergeLLM(FakeLLM):
    """The stand-in with vLLM's stacked FP8 linears of ``options.merge_bases`` under ``model.``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model.add_module("model", _fake_vllm(self.opts.merge_bases).model)

    def apply_model(self, func: Any) -> list[Any]:
        result = super().apply_model(func)
        self.calls[-1] = ("apply_model", getattr(func, "func", func).__name__)
        return result

    def weight(self, fused: str) -> torch.Tensor:
        params = dict(self.model.named_parameters())
        row_major = params[f"{LAYER}.{fused}.weight"].t()
        return fp8.dequantize_per_channel(row_major, params[f"{LAYER}.{fused}.weight_scale"])


@pytest.fixture
def merge_vllm(fake_vllm: types.ModuleType) -> types.ModuleType:  # noqa: F811
    fake_vllm.LLM = MergeLLM
    fake_vllm.options.merge_bases = _bases()
    return fake_vllm


def base_folder(tmp_path: Path, bases: dict[str, torch.Tensor]) -> Path:
    """The trainer's BF16 base checkpoint (what each merge reads)."""
    folder = tmp_path / "base"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen2", "torch_dtype": "bfloat16"}')
    save_file({f"{k}.weight": v.contiguous() for k, v in bases.items()}, str(folder / "model.safetensors"))
    return folder


def policy(bases: dict[str, torch.Tensor], seed: int = 1, targets: list[str] = TARGETS) -> nn.Module:
    """A PEFT LoRA model over the base's linears, B non-zero (an EoRA start, or a trained step)."""
    from peft import LoraConfig, get_peft_model

    root = nn.Module()
    for name, weight in bases.items():
        parent = root
        for part in name.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data.copy_(weight)
        parent.add_module(name.split(".")[-1], linear)
    model = get_peft_model(root, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.copy_(torch.randn(param.shape, generator=g) * 0.1)
    return model


def merged_engine(tmp_path: Path, **kwargs: Any) -> tuple[VLLMEngine, MergeLLM, dict[str, torch.Tensor]]:
    bases = _bases()
    folder = base_folder(tmp_path, bases)
    engine = VLLMEngine(folder, merge_base=folder, **kwargs)
    return engine, FakeLLM.instances[-1], bases  # type: ignore[return-value]


def assert_merged(llm: MergeLLM, bases: dict[str, torch.Tensor], deltas: dict) -> None:
    for fused in VLLM:
        reference = _reference(bases, deltas, fused)
        scale = reference.abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX
        assert ((llm.weight(fused) - reference).abs() <= fp8.rounding_bound(reference, scale) + 1e-7).all()


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------
def test_merged_engine_starts_vllm_without_lora(tmp_path: Path, merge_vllm: types.ModuleType) -> None:
    engine, llm, _ = merged_engine(tmp_path)
    assert not {"enable_lora", "max_lora_rank", "max_loras"} & set(llm.kwargs)
    assert not engine.enable_lora
    with pytest.raises(QerlError, match="runs vLLM without LoRA.*enable_lora"):
        merged_engine(tmp_path / "second", vllm_kwargs={"enable_lora": True})


def test_sync_policy_merges_then_resets_the_prefix_cache_and_generate_has_no_lora(
    tmp_path: Path, merge_vllm: types.ModuleType
) -> None:
    engine, llm, bases = merged_engine(tmp_path)
    model = policy(bases)
    llm.calls.clear()
    engine.sync_policy(model)  # the trainer's first sync, right after the engine starts
    assert llm.calls == [("apply_model", worker_merge_lora.__name__), ("reset_prefix_cache",)]
    assert_merged(llm, bases, lora_deltas(model))
    engine.generate(["q"], n=1, sampling=SPEC)  # the first rollout samples the merged (EoRA) weights
    assert names(llm.calls)[-1] == "generate" and llm.calls[-1][1] is None  # no LoRARequest
    stats = engine.stats()
    assert stats["rollout/merged_linears"] == len(TARGETS) and stats["rollout/lora_id"] == 0
    assert stats["rollout/sync_seconds"] >= 0 and stats["rollout/syncs"] == 1


def test_score_without_the_adapter_refuses_once_one_is_merged(
    tmp_path: Path, merge_vllm: types.ModuleType
) -> None:
    """The merged weights are all vLLM holds: with an adapter merged, ``score(with_adapter=False)``
    would return the adapted policy's logprobs as the base's, so it raises; before a merge, or after
    ``sync_adapter(None)`` put the base back, the base is what it scores."""
    engine, _, bases = merged_engine(tmp_path)
    ids = [[5, 9, 13], [1, 2]]
    assert len(engine.score(ids, with_adapter=False)) == 2  # nothing merged yet: the base
    engine.sync_policy(policy(bases))
    assert len(engine.score(ids)) == 2  # the merged policy, as training samples it
    with pytest.raises(QerlError, match="merged the adapter into vLLM's weights.*sync_adapter\\(None\\)"):
        engine.score(ids, with_adapter=False)
    engine.sync_adapter(None)  # back to the base weights
    assert len(engine.score(ids, with_adapter=False)) == 2


def test_a_merge_made_while_asleep_waits_for_wake_up(tmp_path: Path, merge_vllm: types.ModuleType) -> None:
    engine, llm, bases = merged_engine(tmp_path)
    engine.sync_policy(policy(bases, seed=1))
    engine.set_norm_noise(0.05, seed=4)
    engine.generate(["q"], n=1, sampling=SPEC)
    engine.sleep()
    llm.calls.clear()
    trained = policy(bases, seed=2)  # the update phase: a new adapter while vLLM sleeps
    engine.sync_policy(trained)
    assert llm.calls == []  # nothing writes offloaded weights
    engine.wake_up()
    assert [c[:2] for c in llm.calls] == [
        ("wake_up", None),
        ("apply_model", worker_merge_lora.__name__),
        ("reset_prefix_cache",),
        ("apply_model", "worker_set_norm_noise"),  # the noise, re-applied after the merge
        ("reset_prefix_cache",),
        ("reset_prefix_cache",),
    ]
    assert_merged(llm, bases, lora_deltas(trained))


def test_a_linear_no_longer_targeted_goes_back_to_its_base(
    tmp_path: Path, merge_vllm: types.ModuleType
) -> None:
    engine, llm, bases = merged_engine(tmp_path)
    engine.sync_policy(policy(bases))
    only_q = policy(bases, targets=["q_proj"])
    engine.sync_policy(only_q)
    assert_merged(llm, bases, lora_deltas(only_q))  # k, v, o, MLP: the base's FP8 rounding again
    engine.sync_adapter(None)  # the base model
    assert_merged(llm, bases, {})


def test_a_saved_adapter_is_merged_from_its_tensors(tmp_path: Path, merge_vllm: types.ModuleType) -> None:
    engine, llm, bases = merged_engine(tmp_path)
    model = policy(bases)
    engine.sync_adapter(save_peft_model(model, tmp_path / "adapter"))
    assert_merged(llm, bases, lora_deltas(model))
    norm_key = "base_model.model.model.layers.0.input_layernorm.weight"
    with pytest.raises(QerlError, match="trains full modules.*lora.train_norms=false"):
        engine.sync_adapter(write_adapter(tmp_path / "norms", extra_keys=(norm_key,)))


def test_what_a_merge_cannot_serve_is_refused(tmp_path: Path, merge_vllm: types.ModuleType) -> None:
    from peft import LoraConfig, get_peft_model

    engine, _, bases = merged_engine(tmp_path)
    with_norm = policy(bases)
    layer = with_norm.get_submodule("base_model.model.model.layers.0")
    layer.add_module("input_layernorm", nn.LayerNorm(4))  # trained beside the LoRA (train_norms)
    with pytest.raises(QerlError, match="also trains .*input_layernorm.*train_norms=false"):
        engine.sync_policy(with_norm)
    root = nn.Module()
    root.add_module("q_proj", nn.Linear(8, 8))
    dora = get_peft_model(root, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    for name, param in dora.named_parameters():
        param.requires_grad_("lora_" in name)  # DoRA's magnitude is lora_magnitude_vector
    with pytest.raises(QerlError, match="DoRA.*linear_backend=fp8"):
        engine.sync_policy(dora)


def test_a_stale_merge_fails_the_staleness_check_with_the_alternative(
    tmp_path: Path, merge_vllm: types.ModuleType
) -> None:
    engine, _, bases = merged_engine(tmp_path, staleness_tolerance=0.1)
    engine.sync_policy(policy(bases))
    probe = [1, 2, 3, 4]
    assert engine.check_staleness(probe, lambda p: [-1.0 - 0.01 * t for t in p[1:]]) == pytest.approx(0.0)
    with pytest.raises(QerlError, match="merged into its weights.*linear_backend=fp8"):
        engine.check_staleness(probe, lambda p: [-0.5 - 0.01 * t for t in p[1:]])
    # The FP8 copy's own rounding may take up to twice the tolerance, as the fp8 backend's base models
    # may differ (a random-weight 7B on an H100: 0.54 nats/token against a tolerance of 0.5).
    assert engine.check_staleness(probe, lambda p: [-0.85 - 0.01 * t for t in p[1:]]) == pytest.approx(0.15)
    # A BF16 merge has no FP8 rounding to allow for: the plain tolerance, and the message says which.

    engine.backend_choice = BackendChoice("merged", "bf16", "pinned by rollout.linear_backend")
    bf16_message = r"allowed: 1 x rollout.staleness_tolerance=0.1.*linear_backend=merged"
    with pytest.raises(QerlError, match=bf16_message):
        engine.check_staleness(probe, lambda p: [-0.85 - 0.01 * t for t in p[1:]])


# --------------------------------------------------------------------------------------------
# The factory and the recipe
# --------------------------------------------------------------------------------------------
def test_every_format_has_a_merged_backend_and_it_weighs_its_weights() -> None:
    # Every base merges into BF16 weights (merged); a 4-bit base also into its FP8 copy (fp8-merged).
    assert all("merged" in allowed for allowed in FORMAT_BACKENDS.values())
    assert all(("fp8-merged" in allowed) == (fmt != "bf16") for fmt, allowed in FORMAT_BACKENDS.items())
    four = choose_backend("fp8-merged", "nvfp4", concurrency=128, env=env(), table={})
    assert four.merges_lora and four.needs_fp8_copy and four.weight_format == "fp8"
    assert four.vllm_kwargs() == {}
    # A BF16 base: merged BF16 weights (TRL's merged baseline), no FP8 copy, no online FP8; either merge
    # name means the base's own merge.
    for name in ("merged", "fp8-merged"):
        dense = choose_backend(name, "bf16", concurrency=128, env=env(capability=(8, 0)), table={})
        assert dense.backend == "merged" and dense.merges_lora and not dense.needs_fp8_copy
        assert dense.weight_format == "bf16" and dense.vllm_kwargs() == {}
    # merged on a 4-bit base: its BF16 copy, so one recipe serves both arms on BF16 rollout weights.
    copy = choose_backend("merged", "nvfp4", concurrency=8, env=env(), table={})
    assert copy.backend == "merged" and copy.needs_bf16_copy and copy.weight_format == "bf16"
    assert (
        rollout_weight_format("fp8", "bf16") == "fp8" and rollout_weight_format("marlin", "nvfp4") == "nvfp4"
    )
    with pytest.raises(QerlError, match="FP8 tensor cores"):
        choose_backend("fp8-merged", "nvfp4", concurrency=8, env=env(capability=(8, 0)), table={})
    # auto never picks it without measurements of it.
    table = {"gpus": {}}
    assert choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=table).backend != "fp8-merged"


def test_auto_picks_the_merged_backend_where_measured_fastest_if_the_run_can_merge_and_it_fits() -> None:
    entry = dict(TABLE["gpus"]["NVIDIA H100 80GB HBM3"]["nvfp4+lora"])
    entry["fp8-merged"] = {"8": 1400.0, "32": 4300.0, "128": 12000.0, "256": 13500.0}
    table = {"gpus": {"NVIDIA H100 80GB HBM3": {"nvfp4+lora": entry}}}
    merging = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=table, merge_ok=True)
    assert merging.backend == "fp8-merged" and merging.predicted_tokens_per_s == 12000.0
    assert "fp8-merged 12000 tok/s" in merging.reason
    assert choose_backend("auto", "nvfp4", concurrency=8, env=env(), table=table, merge_ok=True).backend == (
        "marlin"
    )
    # Not the trainer's engine (eval, a bench without a policy) or no LoRA: the merge has nothing to serve.
    assert choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=table).backend == "fp8"
    assert (
        choose_backend(
            "auto", "nvfp4", concurrency=128, env=env(), table=table, merge_ok=True, lora=False
        ).backend
        != "fp8-merged"
    )
    # A memory plan where the FP8 weights leave no KV room (a 32B on 80 GB): the 4-bit kernels.
    gib = 2**30
    sizes = {"marlin": 18 * gib, "humming": 18 * gib, "fp8": 33 * gib, "fp8-merged": 33 * gib}
    tight = env(vllm_budget_bytes=34 * gib, kv_bytes_per_sequence=gib)
    choice = choose_backend("auto", "nvfp4", concurrency=128, env=tight, table=table, weight_bytes=sizes,
                            merge_ok=True, model=QWEN7B)  # fmt: skip
    assert choice.backend in ("marlin", "humming") and "fp8-merged" in choice.candidates


def test_factory_serves_the_fp8_copy_without_lora_and_keeps_the_trainers_base(
    fake_llm: list[dict],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    base = nvfp4_base()
    request = EngineRequest(
        "vllm", base, linear_backend="fp8-merged", gpu_memory_utilization=0.5, max_model_len=64
    )
    make_engine(request)
    seen = fake_llm[-1]
    assert Path(seen["model"]).parent == tmp_path / "cache" / "fp8-rollout"  # the fp8 backend's copy
    assert seen["enable_lora"] is False and seen["merge_base"] == str(base)
    assert seen["model_format"] == "auto" and seen["vllm_kwargs"] == {}
    with pytest.raises(QerlError, match="tensor_parallel_size=1"):
        make_engine(dataclasses.replace(request, tensor_parallel_size=2))
    # Without fp8-merged nothing changes: LoRA served by vLLM, no merge base.
    make_engine(dataclasses.replace(request, linear_backend="fp8"))
    assert fake_llm[-1]["enable_lora"] is True and fake_llm[-1]["merge_base"] is None


def test_factory_serves_a_bf16_base_as_it_is(fake_llm: list[dict], tiny_model_dir: Path) -> None:  # noqa: F811

    make_engine(EngineRequest("vllm", tiny_model_dir, linear_backend="fp8-merged", max_model_len=64))
    seen = fake_llm[-1]
    assert seen["model"] == seen["merge_base"] == str(tiny_model_dir) and seen["enable_lora"] is False
    assert "quantization" not in seen["vllm_kwargs"]  # merged BF16, not vLLM's online FP8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.engine=hf"], "engine=vllm"),
        (["rollout.engine=vllm", "rollout.tensor_parallel_size=2"], "tensor_parallel_size=1"),
        (["rollout.engine=vllm", "lora.train_norms=true"], "train_norms=false"),
    ],
)
def test_what_fp8_merged_cannot_run_is_refused_at_config_time(
    overrides: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    sets = [arg for o in ["rollout.linear_backend=fp8-merged", *overrides] for arg in ("--set", o)]
    rc = main(["train", "recipes/tiny.yaml", *sets, "--dry-run"])
    assert rc == 2 and message in " ".join(capsys.readouterr().err.split())


# --------------------------------------------------------------------------------------------
# Where the merge reads the base
# --------------------------------------------------------------------------------------------
def test_vllm_in_process_merges_onto_the_trainers_layers_not_the_checkpoint(
    tmp_path: Path, merge_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, llm, bases = merged_engine(tmp_path)
    model = policy(bases)
    (tmp_path / "base" / "model.safetensors").unlink()  # a sync that read the checkpoint would fail
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine.sync_policy(model)
    assert_merged(llm, bases, lora_deltas(model))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM in another process: the checkpoint
    with pytest.raises(Exception, match="model.safetensors|No such file"):
        engine.sync_policy(model)


def test_policy_bases_dequantize_a_4bit_layer_exactly_as_the_checkpoint_reads() -> None:
    torch.manual_seed(0)
    dense = nn.Linear(64, 32, bias=False)
    fmt = formats.get("nvfp4")
    checkpoint = fmt.quantize(dense.weight.detach())
    root = nn.Module()
    root.add_module("q_proj", QuantLinear.from_linear(dense, fmt))
    root.add_module("norm", nn.LayerNorm(64))  # PEFT wants a parameter to place the adapter by
    bases = PolicyBases(attach_lora(root, r=4, alpha=8, target_modules=["q_proj"], task_type=None))
    assert set(bases.layers) == {"q_proj"} and bases.out_features("q_proj") == 32
    got = bases.dequantized("q_proj", torch.device("cpu"))
    torch.testing.assert_close(got, fmt.dequantize(checkpoint, torch.float32), rtol=0, atol=0)
    with pytest.raises(QerlError, match="no LoRA layer k_proj"):
        bases.dequantized("k_proj", torch.device("cpu"))

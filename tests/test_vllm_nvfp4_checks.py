"""``rollout.linear_backend: qerl-triton``: the checks before vLLM starts (GPU, vLLM version, dtype, tensor
parallelism, vLLM's engine process, batch-invariant mode, the recipe's vLLM arguments), the choice
(pinned and ``auto``), the recipe's own checks, and the count of layers served after the start. No GPU or
vLLM: every check reads what it is given."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from test_rollout_backends import H100, QWEN7B, choose_backend, env

from qerl_cli.config import TrainConfig, load_config
from qerl_cli.config.rl_sections import RolloutSection
from qerl_cli.errors import QerlError
from qerl_cli.rollout import backends, vllm_nvfp4
from qerl_cli.rollout.environment import current_environment
from qerl_cli.rollout.vllm_setup import vllm_in_process


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"capability": (8, 0)}, r"runs on Hopper GPUs only .* this GPU is sm80: use marlin"),
        ({"capability": (10, 0)}, r"runs on Hopper GPUs only .* this GPU is sm100"),
        ({"capability": (12, 0)}, r"runs on Hopper GPUs only .* this GPU is sm120"),
        (
            {"vllm_version": (0, 25)},
            r'needs vLLM 0\.26\+ .* this is vLLM 0\.25: pip install -U "vllm>=0\.26"',
        ),
        (
            {"dtype": "float16"},
            r"rollout dtype is float16: set it to bfloat16 \(model\.dtype in a train recipe",
        ),
        ({"dtype": torch.float32}, r"--set dtype=bfloat16 in qerl eval; drop any vllm_kwargs dtype\)"),
        ({"tensor_parallel_size": 2}, r"needs rollout\.tensor_parallel_size=1 \(got 2\)"),
    ],
)
def test_unavailable_reason_names_what_is_wrong_and_the_fix(settings: dict[str, Any], expected: str) -> None:
    given = {"capability": (9, 0), **settings}
    reason = vllm_nvfp4.unavailable_reason(**given)
    assert reason is not None and re.search(expected, reason), reason


@pytest.mark.parametrize(("value", "said"), [("1", "VLLM_ENABLE_V1_MULTIPROCESSING=1"), ("true", "=true")])
def test_an_engine_in_another_process_is_refused_naming_the_value(
    monkeypatch: pytest.MonkeyPatch, value: str, said: str
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", value)
    reason = vllm_nvfp4.unavailable_reason(capability=(9, 0), in_process=False)
    assert reason is not None and said in reason and "unset it" in reason


def test_batch_invariant_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's batch-invariant mode overrides linear_backend with its own NVFP4 kernel."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert "VLLM_BATCH_INVARIANT" in (vllm_nvfp4.unavailable_reason(capability=(9, 0)) or "")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert vllm_nvfp4.unavailable_reason(capability=(9, 0)) is None


def test_the_in_process_question_has_one_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before qerl's first engine an unset switch means qerl's default (in process); after, vLLM's."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert vllm_in_process(before_import=True) and not vllm_in_process()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert not vllm_in_process(before_import=True)
    assert current_environment().engine_in_process is False


BASE_KWARGS = {"model": "m", "dtype": "bfloat16", "linear_backend": "triton", "tensor_parallel_size": 1}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"linear_backend": "marlin"}, r"rollout\.vllm_kwargs sets linear_backend='marlin'.*drop it"),
        ({"dtype": "float16"}, r"rollout dtype is float16"),
        ({"dtype": "auto"}, r"rollout dtype is auto"),
        ({"pipeline_parallel_size": 2}, r"\{'pipeline_parallel_size': 2\} start workers in other processes"),
        ({"data_parallel_size": 2}, r"data_parallel_size"),
        ({"distributed_executor_backend": "mp"}, r"'distributed_executor_backend': 'mp'"),
    ],
)
def test_the_engine_arguments_the_recipe_overrides_are_checked(extra: dict[str, Any], expected: str) -> None:
    vllm_nvfp4.check_engine_arguments(BASE_KWARGS)
    vllm_nvfp4.check_engine_arguments({**BASE_KWARGS, "distributed_executor_backend": "uni"})
    # torchrun data parallelism: vLLM's worker is this rank's own process, which registers the kernel.
    vllm_nvfp4.check_engine_arguments({**BASE_KWARGS, "distributed_executor_backend": "external_launcher"})
    with pytest.raises(QerlError, match=expected):
        vllm_nvfp4.check_engine_arguments({**BASE_KWARGS, **extra})


class ServedEngine:
    """``vllm.LLM.apply_model`` of one worker whose model holds ``layers`` NVFP4 linears, ``served`` of them
    prepared for qerl's kernel."""

    def __init__(self, layers: int, served: int) -> None:
        self.model = torch.nn.Module()
        for i in range(layers):
            layer = torch.nn.Module()
            layer.weight_global_scale = torch.nn.Parameter(torch.ones(()), requires_grad=False)
            if i < served:
                layer.qerl_accumulator_scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)
            self.model.add_module(f"l{i}", layer)
        self.model.add_module("norm", torch.nn.LayerNorm(4))

    def apply_model(self, fn: Any) -> list[Any]:
        return [fn(self.model)]


def test_check_engine_counts_every_nvfp4_layer_on_qerls_kernel() -> None:
    assert vllm_nvfp4.check_engine(ServedEngine(3, 3)) == 3
    with pytest.raises(QerlError, match=r"serves 2 of its 3 NVFP4 linear layers on qerl's kernel"):
        vllm_nvfp4.check_engine(ServedEngine(3, 2))
    with pytest.raises(QerlError, match=r"serves 0 of its 0"):
        vllm_nvfp4.check_engine(ServedEngine(0, 0))


def test_pinned_qerl_triton_is_kept_on_an_nvfp4_base_and_reaches_vllm_as_triton() -> None:
    choice = choose_backend("qerl-triton", "nvfp4", concurrency=8, env=env(), table={})
    assert choice.backend == "qerl-triton" and choice.reason == "pinned by rollout.linear_backend"
    assert choice.vllm_kwargs() == {"linear_backend": "triton"}
    assert not choice.needs_fp8_copy and not choice.needs_bf16_copy and not choice.merges_lora
    assert choice.weight_format == "nvfp4"


def test_pinned_qerl_triton_is_refused_on_an_mxfp4_base() -> None:
    with pytest.raises(
        QerlError, match=r"reads NVFP4's 16-value blocks and E4M3 scales only; a mxfp4 checkpoint"
    ):
        choose_backend("qerl-triton", "mxfp4", concurrency=8, env=env(), table={})


def test_pinned_qerl_triton_on_a_bf16_base_keeps_vllms_default() -> None:
    """One recipe serves both arms of a comparison: an FP4 kernel pinned for a BF16 base keeps vLLM's
    default, as marlin does."""
    assert backends.served_backend("qerl-triton", "bf16") == "default"
    choice = choose_backend("qerl-triton", "bf16", concurrency=8, env=env(), table={})
    assert choice.backend == "default" and "serves FP4 weights only" in choice.reason
    assert choice.vllm_kwargs() == {}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"tensor_parallel_size": 2}, r"needs rollout\.tensor_parallel_size=1 \(got 2\)"),
        ({"engine_in_process": False}, "needs vLLM's engine in this process"),
        ({"capability": (8, 0)}, r"runs on Hopper GPUs only .* this GPU is sm80: use marlin"),
        ({"vllm_version": (0, 25)}, r"needs vLLM 0\.26\+"),
        ({"rollout_dtype": "float16"}, r"set it to bfloat16 \(model\.dtype"),
    ],
)
def test_pinned_qerl_triton_is_refused_where_its_kernel_cannot_serve_vllm(
    overrides: dict[str, Any], expected: str
) -> None:
    with pytest.raises(QerlError, match=rf"rollout\.linear_backend=qerl-triton: .*{expected}"):
        choose_backend("qerl-triton", "nvfp4", concurrency=8, env=env(**overrides), table={})


def test_unavailable_reason_accepts_hopper_and_an_unknown_gpu() -> None:
    assert vllm_nvfp4.unavailable_reason(capability=(9, 0), vllm_version=(0, 26)) is None
    assert vllm_nvfp4.unavailable_reason(capability=None, dtype=torch.bfloat16) is None
    assert backends.unavailable_reason("qerl-triton", "nvfp4", env()) is None


QERL_TRITON_FASTEST = {
    "gpus": {
        H100: {
            "nvfp4+lora": {
                "model": QWEN7B.to_dict(),
                "marlin": {"8": 1500.0, "32": 4000.0, "128": 7000.0},
                "qerl-triton": {"8": 1600.0, "32": 4500.0, "128": 9000.0},
            }
        }
    }
}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, "qerl-triton"),
        ({"tensor_parallel_size": 2}, "marlin"),
        ({"engine_in_process": False}, "marlin"),
        ({"capability": (8, 0)}, "marlin"),
        ({"rollout_dtype": "float16"}, "marlin"),
    ],
)
def test_auto_picks_qerl_triton_where_measured_fastest_and_it_can_serve(
    overrides: dict[str, Any], expected: str
) -> None:
    choice = choose_backend("auto", "nvfp4", concurrency=32, env=env(**overrides), table=QERL_TRITON_FASTEST)
    assert choice.backend == expected
    assert ("qerl-triton" in choice.candidates) is (expected == "qerl-triton")
    if expected == "qerl-triton":
        assert choice.predicted_tokens_per_s == 4500.0
        assert choice.vllm_kwargs() == {"linear_backend": "triton"}


def test_the_recipe_refuses_qerl_triton_off_vllm_or_tensor_parallel() -> None:
    RolloutSection(engine="vllm", linear_backend="qerl-triton").validate("rollout")
    with pytest.raises(QerlError, match=r"rollout\.linear_backend=qerl-triton chooses vLLM kernels"):
        RolloutSection(engine="hf", linear_backend="qerl-triton").validate("rollout")
    with pytest.raises(QerlError, match=r"qerl-triton needs rollout\.tensor_parallel_size=1"):
        RolloutSection(engine="vllm", linear_backend="qerl-triton", tensor_parallel_size=2).validate(
            "rollout"
        )


def test_a_training_recipe_with_qerl_triton_on_hf_is_refused_at_load() -> None:
    base = ["model.path=m", "rollout.linear_backend=qerl-triton"]
    assert (
        load_config(TrainConfig, None, [*base, "rollout.engine=vllm"]).rollout.linear_backend == "qerl-triton"
    )
    with pytest.raises(QerlError, match=r"set rollout\.engine=vllm"):
        load_config(TrainConfig, None, [*base, "rollout.engine=hf"])

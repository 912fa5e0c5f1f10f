"""VLLMEngine against a recording stand-in of the ``vllm`` API (CPU, no vLLM needed).

The stand-in below (``FakeLLM``, ``FakeSamplingParams``, ``FakeLoRARequest`` and output classes
shaped like vLLM 0.26's ``RequestOutput`` / ``CompletionOutput`` / ``FlatLogprobs``) is injected
as the ``vllm`` module. It records every call the engine makes and holds a small torch model with
RMSNorm modules that ``apply_model`` really runs our worker function on. These tests therefore
prove OUR call sequence and mapping (adapter sync with a new id each step, previous adapter
removed, prefix cache reset, sleep/wake order, AQN noise re-applied after wake without
accumulating, staleness error, ids/logprobs/finish reasons); they do not prove that vLLM itself
behaves as modelled here. On a GPU with real vLLM, ``qerl bench e2e --engine vllm`` runs the same
calls through the trainer, and every adapter sync's staleness check compares vLLM with the trainer.
"""

from __future__ import annotations

import json
import math
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.rollout import vllm_engine, vllm_setup
from qerl_cli.rollout.base import RolloutEngine, SamplingSpec
from qerl_cli.rollout.vllm_engine import VLLMEngine, detect_checkpoint_format, worker_set_norm_noise


# --------------------------------------------------------------------------------------------
# The stand-in vllm API
# --------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Shaped like vLLM's RMSNorm: a bf16 weight, or a plain tensor when has_weight=False."""

    def __init__(self, size: int, seed: int, has_weight: bool = True) -> None:
        super().__init__()
        self.has_weight = has_weight
        g = torch.Generator().manual_seed(seed)
        weight = (1.0 + 0.1 * torch.randn(size, generator=g)).to(torch.bfloat16)
        self.weight = nn.Parameter(weight) if has_weight else torch.ones(size)


class FakeModel(nn.Module):
    def __init__(self, with_norms: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for i in range(2):
            layer = nn.Module()
            layer.proj = nn.Linear(8, 8)
            if with_norms:
                layer.input_layernorm = RMSNorm(8, seed=2 * i)
                layer.post_attention_layernorm = RMSNorm(8, seed=2 * i + 1)
            self.layers.append(layer)
        if with_norms:
            self.norm = RMSNorm(8, seed=99)
            self.weightless = RMSNorm(8, seed=0, has_weight=False)  # must not count

    def norm_weights(self) -> list[torch.Tensor]:
        return [m.weight.detach().clone() for m in self.modules() if isinstance(m, RMSNorm) and m.has_weight]


class Logprob(SimpleNamespace):
    pass


class FakeFlatLogprobs:
    """vLLM's FlatLogprobs: flat token_ids / logprobs lists; indexing gives {token: Logprob}."""

    def __init__(self, token_ids: list[int], values: list[float]) -> None:
        self.token_ids, self.logprobs = list(token_ids), list(values)
        self.start_indices = list(range(len(token_ids)))
        self.end_indices = [i + 1 for i in range(len(token_ids))]

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, i: int) -> dict[int, Logprob]:
        return {self.token_ids[i]: Logprob(logprob=self.logprobs[i], rank=1)}


class CompletionOutput(SimpleNamespace):
    pass


class RequestOutput(SimpleNamespace):
    pass


SAMPLING_FIELDS = {
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "max_tokens", "logprobs", "prompt_logprobs", "flat_logprobs", "detokenize", "skip_special_tokens",
}  # fmt: skip


class FakeSamplingParams:
    """Accepts only field names vLLM 0.26's SamplingParams has (a typo fails like msgspec would)."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"unexpected keyword arguments {unknown}")
        defaults = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": None}
        defaults.update(
            ignore_eos=False, max_tokens=16, logprobs=None, prompt_logprobs=None, flat_logprobs=False
        )
        defaults.update(detokenize=True)
        defaults.update(kwargs)
        if defaults["stop"] and not defaults["detokenize"]:  # vLLM's own check, word for word
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
            )
        self.__dict__.update(defaults)


class FakeLoRARequest:
    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = "") -> None:
        if lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {lora_int_id}")
        assert lora_path, "lora_path cannot be empty"
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


class FakeLLMEngine:
    def __init__(self, llm: FakeLLM) -> None:
        self.llm = llm
        self.loras: dict[int, float] = {}  # id -> the adapter's "effect" read at load time

    def add_lora(self, request: FakeLoRARequest) -> bool:
        assert not self.llm.sleeping, "add_lora while asleep writes into offloaded LoRA slots"
        config = json.loads((Path(request.lora_path) / "adapter_config.json").read_text())
        self.llm.calls.append(("add_lora", request.lora_int_id))
        self.loras[request.lora_int_id] = float(config.get("test_effect", 0.0))
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.llm.calls.append(("remove_lora", lora_id))
        return self.loras.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loras)


class ByteTokenizer:
    """vLLM's tokenizer stand-in: one id per UTF-8 byte, no chat template, no special tokens."""

    chat_template = None

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        texts = [text] if isinstance(text, str) else text
        ids = [list(t.encode()) for t in texts]
        return {"input_ids": ids[0] if isinstance(text, str) else ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode(errors="replace")


class FakeLLM:
    """Records calls; generates deterministic outputs; runs apply_model on a real torch module."""

    instances: list[FakeLLM] = []

    def __init__(self, **kwargs: Any) -> None:
        opts = sys.modules["vllm"].options
        if opts.init_error is not None:
            raise opts.init_error
        self.kwargs = kwargs
        self.opts = opts
        self.calls: list[tuple[Any, ...]] = []
        self.model = FakeModel(with_norms=opts.with_norms)
        self.loaded_norms = self.model.norm_weights()
        self.llm_engine = FakeLLMEngine(self)
        self.sleeping = False
        FakeLLM.instances.append(self)

    def get_tokenizer(self) -> Any:
        return self.opts.tokenizer

    # -- weights
    def apply_model(self, func: Any) -> list[Any]:
        assert not self.sleeping, "apply_model while asleep touches offloaded weights"
        self.calls.append(("apply_model", getattr(func, "keywords", {}).get("sigma")))
        return [func(self.model)]

    def _norm_shift(self) -> float:
        shift = [
            (w.float() - c.float()).abs().mean()
            for w, c in zip(self.model.norm_weights(), self.loaded_norms, strict=True)
        ]
        return float(sum(shift)) if shift else 0.0

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))
        self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))
        self.sleeping = False
        if self.opts.wake_resets_weights:  # model the README's warning: in-place changes may be lost
            norms = [m for m in self.model.modules() if isinstance(m, RMSNorm) and m.has_weight]
            with torch.no_grad():
                for module, loaded in zip(norms, self.loaded_norms, strict=True):
                    module.weight.copy_(loaded)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    # -- generation
    def _adapter_effect(self, request: FakeLoRARequest | None) -> float:
        if request is None or self.opts.ignore_adapters:
            return 0.0
        assert request.lora_int_id in self.llm_engine.loras, "generate with an adapter id vLLM does not hold"
        return self.llm_engine.loras[request.lora_int_id]

    def generate(
        self, prompts: list[Any], params: Any, *, lora_request: Any = None, use_tqdm: bool = True
    ) -> list:
        assert not self.sleeping, "generate while asleep"
        assert use_tqdm is False
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        lora_id = lora_request.lora_int_id if lora_request is not None else None
        self.calls.append(("generate", lora_id, round(self._norm_shift(), 6), params_list))
        outputs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params_list, strict=True)):
            ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else list(prompt.encode())
            prompt_logprobs = None
            if sp.prompt_logprobs is not None:
                offset = (self._adapter_effect(lora_request) + 10.0 * self._norm_shift()
                          + self.opts.numerics_shift)  # fmt: skip
                prompt_logprobs = [None] + [{t: Logprob(logprob=-1.0 - 0.01 * t + offset)} for t in ids[1:]]
            completions = []
            for j in range(sp.n):
                tokens = list(self.opts.completion_ids or [100 + i, 110 + j, 120 + j])
                values = [-0.1 * (k + 1) - 0.01 * j for k in range(len(tokens))]
                logprobs = (
                    FakeFlatLogprobs(tokens, values)
                    if sp.flat_logprobs and self.opts.flat
                    else [
                        {t: Logprob(logprob=v), 7: Logprob(logprob=-9.0)}
                        for t, v in zip(tokens, values, strict=True)
                    ]
                )
                reason = self.opts.finish_reason or ("length" if j % 2 else "stop")
                text = f"c{i}{j}" if sp.detokenize else ""  # without its detokenizer vLLM leaves it empty
                completions.append(
                    CompletionOutput(
                        index=j, text=text, token_ids=tokens, logprobs=logprobs, finish_reason=reason
                    )
                )
            completions.reverse()  # vLLM does not promise index order; the engine sorts
            outputs.append(RequestOutput(prompt=prompt, prompt_token_ids=ids, prompt_logprobs=prompt_logprobs,
                                         outputs=completions))  # fmt: skip
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    module.options = SimpleNamespace(
        init_error=None,
        with_norms=True,
        ignore_adapters=False,
        flat=True,
        wake_resets_weights=True,
        finish_reason=None,
        tokenizer=ByteTokenizer(),
        numerics_shift=0.0,  # what other rollout weights (an FP8 copy) add to every logprob
        completion_ids=None,  # every completion's token ids (default: [100 + i, 110 + j, 120 + j])
    )
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    for name, mod in (("vllm", module), ("vllm.lora", lora), ("vllm.lora.request", request)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(vllm_setup, "_cuda_capability", lambda: (9, 0))
    # Recorded so that the engine's setdefault is undone after each test.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "placeholder")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    FakeLLM.instances.clear()
    return module


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def write_checkpoint(folder: Path, quantization_config: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


NVFP4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                              "group_size": 16}}},
}  # fmt: skip
MXFP4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}
    },
}
NF4_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


def write_adapter(
    folder: Path, effect: float = 0.0, rank: int = 16, extra_keys: tuple[str, ...] = ()
) -> Path:
    """A PEFT-format adapter folder; ``test_effect`` is what the stand-in adds to logprobs when
    it serves this adapter (standing in for the adapter's weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"],
              "test_effect": effect}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(rank, 8),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, rank),
    }
    tensors.update({key: torch.ones(8) for key in extra_keys})
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def same(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


def all_differ(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return all(not torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


def make_engine(tmp_path: Path, **kwargs: Any) -> VLLMEngine:
    return VLLMEngine(write_checkpoint(tmp_path / "model"), **kwargs)


def names(calls: list[tuple[Any, ...]]) -> list[str]:
    return [c[0] for c in calls]


SPEC = SamplingSpec(max_new_tokens=3, temperature=0.7, top_p=1.0, top_k=-1, seed=11, stop=("</answer>",))


# --------------------------------------------------------------------------------------------
# Construction, formats, errors
# --------------------------------------------------------------------------------------------
def test_missing_vllm_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    monkeypatch.setattr(vllm_setup, "_cuda_capability", lambda: (9, 0))
    with pytest.raises(QerlError, match=r'pip install -e "\.\[vllm\]"'):
        make_engine(tmp_path)


def test_constructor_passes_recipe_settings_and_vllm_kwargs(
    tmp_path: Path, fake_vllm: types.ModuleType
) -> None:
    engine = make_engine(
        tmp_path,
        gpu_memory_utilization=0.3,
        max_lora_rank=48,  # not a vLLM rank: rounded up to 64
        max_model_len=2304,
        vllm_kwargs={"attention_backend": "TRITON_ATTN", "max_loras": 2},
    )
    kwargs = FakeLLM.instances[-1].kwargs
    assert kwargs["model"] == str(tmp_path / "model")
    assert kwargs["gpu_memory_utilization"] == 0.3
    assert kwargs["enable_sleep_mode"] is True and kwargs["enable_lora"] is True
    assert kwargs["max_lora_rank"] == 64 and engine.max_lora_rank == 64
    assert kwargs["max_model_len"] == 2304
    assert kwargs["attention_backend"] == "TRITON_ATTN"
    assert kwargs["max_loras"] == 2  # the recipe's vllm_kwargs win over our defaults
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert "quantization" not in kwargs  # bf16
    assert engine.num_norms == 5  # 2 layers x 2 + final norm; the weightless one is not counted
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert isinstance(engine, RolloutEngine)


def test_the_recipes_rollout_section_reaches_vllm(
    tmp_path: Path, fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.machinery

    from qerl_cli.config import ModelSection, RolloutSection, TrainConfig
    from qerl_cli.rl.setup import make_engine as engine_for_run

    monkeypatch.setattr(fake_vllm, "__spec__", importlib.machinery.ModuleSpec("vllm", None))
    model = ModelSection(path=str(write_checkpoint(tmp_path / "m", NF4_CONFIG)))
    rollout = RolloutSection(
        engine="vllm", gpu_memory_utilization=0.2, enable_sleep_mode=False, max_lora_rank=16,
        max_prompt_length=100, max_completion_length=400, vllm_kwargs={"enforce_eager": True},
        tensor_parallel_size=2,
    )  # fmt: skip
    cfg = TrainConfig(model=model, rollout=rollout)
    cfg.train.seed = 3
    # The one path from a recipe to an engine (the vLLM branch needs no policy).
    engine = engine_for_run(cfg, None, gpu_memory_utilization=0.2)  # type: ignore[arg-type]
    kwargs = FakeLLM.instances[-1].kwargs
    assert kwargs["tensor_parallel_size"] == 2
    assert kwargs["quantization"] == "bitsandbytes"
    assert kwargs["max_model_len"] == 500 and kwargs["seed"] == 3 and kwargs["enforce_eager"] is True
    assert kwargs["gpu_memory_utilization"] == 0.2 and kwargs["enable_sleep_mode"] is False
    engine.sleep()  # sleep mode off: a no-op
    assert "sleep" not in names(FakeLLM.instances[-1].calls)


@pytest.mark.parametrize(
    ("qcfg", "name", "quantization"),
    [
        (None, "bf16", None),
        (NVFP4_CONFIG, "nvfp4", None),
        (MXFP4_CONFIG, "mxfp4", None),
        (NF4_CONFIG, "nf4", "bitsandbytes"),
        ({"quant_method": "awq", "bits": 4}, "other", None),
    ],
)
def test_detect_checkpoint_format(
    tmp_path: Path, qcfg: dict | None, name: str, quantization: str | None
) -> None:
    fmt = detect_checkpoint_format(write_checkpoint(tmp_path, qcfg))
    assert (fmt.name, fmt.vllm_quantization) == (name, quantization)


def test_format_unsupported_on_old_gpu(tmp_path: Path, fake_vllm: types.ModuleType, monkeypatch) -> None:
    monkeypatch.setattr(vllm_setup, "_cuda_capability", lambda: (7, 5))
    with pytest.raises(QerlError, match=r"NVFP4 .*8\.0\+.*Marlin.*sm75"):
        VLLMEngine(write_checkpoint(tmp_path / "fp4", NVFP4_CONFIG))
    VLLMEngine(write_checkpoint(tmp_path / "nf4", NF4_CONFIG))  # bitsandbytes runs on sm75
    monkeypatch.setattr(vllm_setup, "_cuda_capability", lambda: None)
    with pytest.raises(QerlError, match="rollout.engine=hf"):
        VLLMEngine(write_checkpoint(tmp_path / "bf16"))


def test_format_mismatch_with_recipe(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    with pytest.raises(QerlError, match="model.format=nf4 .* nvfp4 checkpoint"):
        VLLMEngine(write_checkpoint(tmp_path, NVFP4_CONFIG), model_format="nf4")


@pytest.mark.parametrize(
    ("message", "advice"),
    [
        (
            "Free memory on device cuda:0 (20.0/139.8 GiB) on startup is less than desired GPU memory "
            "utilization (0.3, 41.9 GiB). Decrease GPU memory utilization.",
            "Lower rollout.gpu_memory_utilization",
        ),
        (
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
            "Raise rollout",
        ),
    ],
)
def test_gpu_memory_errors_are_rephrased(
    tmp_path: Path, fake_vllm: types.ModuleType, message: str, advice: str
):
    fake_vllm.options.init_error = ValueError(message)
    with pytest.raises(QerlError, match=advice) as info:
        make_engine(tmp_path)
    assert "gpu_memory_utilization=0.3" in str(info.value)


def test_other_vllm_errors_are_not_masked(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    fake_vllm.options.init_error = ValueError("unrecognised model architecture")
    with pytest.raises(ValueError, match="architecture"):
        make_engine(tmp_path)


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flat", [True, False])
def test_generate_maps_ids_logprobs_and_finish_reasons(
    tmp_path: Path, fake_vllm: types.ModuleType, flat: bool
):
    fake_vllm.options.flat = flat
    engine = make_engine(tmp_path)
    result = engine.generate(["ab", "xyz"], n=2, sampling=SPEC)

    assert result.prompt_token_ids == [[97, 98], [120, 121, 122]]
    for i, group in enumerate(result.completions):
        assert [c.text for c in group] == [f"c{i}0", f"c{i}1"]  # sorted by vLLM's index
        for j, completion in enumerate(group):
            assert completion.token_ids == [100 + i, 110 + j, 120 + j]
            assert completion.logprobs == pytest.approx([-0.1 - 0.01 * j, -0.2 - 0.01 * j, -0.3 - 0.01 * j])
            assert completion.finish_reason == ("length" if j else "stop")
    assert result.num_generated_tokens == 12
    assert result.stats["rollout/generated_tokens"] == 12 and result.stats["rollout/tokens_per_s"] > 0

    call = FakeLLM.instances[-1].calls[-1]
    assert call[0] == "generate" and call[1] is None  # no adapter synced yet: the base model
    params = call[3]
    assert [p.seed for p in params] == [11, 13]  # seed + i * n: every sample's stream distinct
    first = params[0]
    assert (first.n, first.temperature, first.top_p, first.top_k, first.max_tokens) == (2, 0.7, 1.0, 0, 3)
    assert first.logprobs == 0 and first.stop == ["</answer>"] and first.ignore_eos is False


def test_generate_passes_token_ids_with_bos_exactly_once(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    # vLLM adds special tokens to a text prompt; the engine hands it ids with BOS already right.
    from test_prompt_tokens import bos_tokenizer

    tokenizer = bos_tokenizer()
    fake_vllm.options.tokenizer = tokenizer
    engine = make_engine(tmp_path)
    result = engine.generate(["ab", "<|endoftext|>ab"], n=1, sampling=SPEC)
    bos = tokenizer.bos_token_id
    # (text prompts would come back as their bytes: no BOS on the first, "<|endoftext|>" spelled out)
    assert result.prompt_token_ids == [[bos, 97, 98], [bos, 97, 98]]


def test_generate_without_seed_shares_one_params(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    engine = make_engine(tmp_path)
    engine.generate(["a", "b", "c"], n=1, sampling=SamplingSpec(max_new_tokens=3, seed=None, ignore_eos=True))
    params = FakeLLM.instances[-1].calls[-1][3]
    assert len({id(p) for p in params}) == 1 and params[0].seed is None and params[0].ignore_eos is True


def test_aborted_completion_is_an_error(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    fake_vllm.options.finish_reason = "abort"
    engine = make_engine(tmp_path)
    with pytest.raises(RuntimeError, match="abort"):
        engine.generate(["a"], n=1, sampling=SPEC)


# --------------------------------------------------------------------------------------------
# LoRA sync
# --------------------------------------------------------------------------------------------
def test_sync_uses_a_new_id_each_step_and_drops_the_previous(
    tmp_path: Path, fake_vllm: types.ModuleType
) -> None:
    engine = make_engine(tmp_path)
    llm = FakeLLM.instances[-1]
    source = write_adapter(tmp_path / "adapter")
    staged_paths = []
    for step in range(3):
        llm.calls.clear()
        engine.sync_adapter(source)  # the trainer overwrites the same folder every step
        staged_paths.append(Path(engine.lora_request.lora_path))
        expected = [("add_lora", 1)] if step == 0 else [("remove_lora", step), ("add_lora", step + 1)]
        assert [c for c in llm.calls if c[0] != "reset_prefix_cache"] == expected
        assert names(llm.calls)[-1] == "reset_prefix_cache"  # after the new adapter is in
        assert llm.llm_engine.list_loras() == {step + 1}
        engine.generate(["q"], n=1, sampling=SPEC)
        assert llm.calls[-1][1] == step + 1  # generate used the new id

    # Served from a tmpfs copy, not the trainer's folder; copies of dropped adapters are deleted.
    assert all(p != source and p.parent == engine._stage_root for p in staged_paths)
    assert [p.exists() for p in staged_paths] == [False, False, True]
    assert (staged_paths[-1] / "adapter_model.safetensors").read_bytes() == (
        source / "adapter_model.safetensors"
    ).read_bytes()
    if Path("/dev/shm").is_dir():
        assert str(engine._stage_root).startswith("/dev/shm/")

    engine.sync_adapter(None)  # back to the base model
    assert llm.llm_engine.list_loras() == set() and engine.lora_request is None
    engine.close()
    assert not engine._stage_root.exists()


def test_sync_rejects_bad_adapters(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    engine = make_engine(tmp_path, max_lora_rank=16)
    with pytest.raises(QerlError, match="not a PEFT adapter folder"):
        engine.sync_adapter(tmp_path / "missing")
    with pytest.raises(QerlError, match="rank 32 .* max_lora_rank=16"):
        engine.sync_adapter(write_adapter(tmp_path / "big", rank=32))
    norm_key = "base_model.model.model.layers.0.input_layernorm.weight"
    with pytest.raises(QerlError, match="train_norms=false"):
        engine.sync_adapter(write_adapter(tmp_path / "norms", extra_keys=(norm_key,)))
    no_lora = make_engine(tmp_path / "second", enable_lora=False)
    assert "enable_lora" not in FakeLLM.instances[-1].kwargs
    with pytest.raises(QerlError, match="without LoRA"):
        no_lora.sync_adapter(write_adapter(tmp_path / "ok"))


def test_sync_policy_saves_straight_to_tmpfs(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    from peft import LoraConfig, get_peft_model

    base = nn.Sequential()
    base.add_module("q_proj", nn.Linear(8, 8))
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"]))
    engine = make_engine(tmp_path)
    engine.sync_policy(peft_model)
    staged = Path(engine.lora_request.lora_path)
    assert staged.parent == engine._stage_root
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in staged.iterdir()}
    assert FakeLLM.instances[-1].llm_engine.list_loras() == {1}


# --------------------------------------------------------------------------------------------
# Sleep / wake and AQN noise
# --------------------------------------------------------------------------------------------
def test_noise_count_redraw_and_restore(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    engine = make_engine(tmp_path)
    model = FakeLLM.instances[-1].model
    clean = model.norm_weights()

    assert engine.set_norm_noise(0.05, seed=1) == 5
    first = model.norm_weights()
    assert all_differ(first, clean)
    assert 0 < engine.last_changed_fraction <= 1
    # The same draw twice, or another draw in between, gives the same weights: never accumulated.
    engine.set_norm_noise(0.05, seed=1)
    assert same(model.norm_weights(), first)
    engine.set_norm_noise(0.05, seed=2)
    second = model.norm_weights()
    engine.set_norm_noise(0.05, seed=1)
    assert same(model.norm_weights(), first)
    # The spread of (noisy - clean) is sigma, not growing with the number of calls.
    deltas = torch.cat([(a.float() - c.float()) for a, c in zip(second, clean, strict=True)])
    assert 0.02 < float(deltas.std()) < 0.1
    assert engine.set_norm_noise(0.0, seed=0) == 0
    assert same(model.norm_weights(), clean)  # exact clean weights
    assert names(FakeLLM.instances[-1].calls)[-1] == "reset_prefix_cache"


def test_worker_function_leaves_clean_model_alone_at_sigma_zero() -> None:
    model = FakeModel()
    before = model.norm_weights()
    assert worker_set_norm_noise(model, sigma=0.0, seed=0) == (0, 0.0)
    assert not hasattr(model, vllm_engine.CLEAN_NORMS_ATTR)  # no copy taken when never perturbed
    assert same(model.norm_weights(), before)


def test_noise_without_norms_stops(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    fake_vllm.options.with_norms = False
    engine = make_engine(tmp_path)
    assert engine.num_norms == 0
    assert engine.set_norm_noise(0.0, seed=0) == 0
    with pytest.raises(QerlError, match="no RMSNorm"):
        engine.set_norm_noise(0.01, seed=0)


@pytest.mark.parametrize("sigma", [-0.01, math.nan, math.inf])
def test_noise_refuses_what_every_engine_refuses(
    tmp_path: Path, fake_vllm: types.ModuleType, sigma: float
) -> None:
    engine = make_engine(tmp_path)
    with pytest.raises(QerlError, match="AQN sigma must be a finite number >= 0"):
        engine.set_norm_noise(sigma, seed=0)
    assert engine.stats()["rollout/noise_sigma"] == 0.0  # nothing applied


def test_sleep_wake_order_reapplies_noise_and_pending_adapter(
    tmp_path: Path, fake_vllm: types.ModuleType
) -> None:
    free = iter([10 * 2**30, 60 * 2**30])
    engine = make_engine(tmp_path)
    llm = FakeLLM.instances[-1]
    engine.sync_adapter(write_adapter(tmp_path / "a1"))
    engine.set_norm_noise(0.05, seed=4)
    noisy = llm.model.norm_weights()
    engine.generate(["q"], n=1, sampling=SPEC)
    noisy_shift = llm.calls[-1][2]
    assert noisy_shift > 0

    import unittest.mock

    with unittest.mock.patch.object(vllm_engine, "_cuda_free_bytes", lambda: next(free)):
        engine.sleep()
    engine.sleep()  # idempotent
    assert engine.is_sleeping and engine.last_sleep_freed_bytes == 50 * 2**30
    assert engine.stats()["rollout/sleep_freed_gib"] == 50
    # The update phase: a new adapter and the next step's sigma arrive while vLLM sleeps.
    llm.calls.clear()
    engine.sync_adapter(write_adapter(tmp_path / "a2"))
    assert engine.set_norm_noise(0.05, seed=5) == 5
    assert llm.calls == []  # nothing touches offloaded weights or LoRA slots while asleep

    engine.wake_up()
    assert [c[:2] for c in llm.calls] == [
        ("wake_up", None),
        ("remove_lora", 1),
        ("add_lora", 2),
        ("reset_prefix_cache",),
        ("apply_model", 0.05),
        ("reset_prefix_cache",),
        ("reset_prefix_cache",),
    ]
    # The stand-in reloads clean weights on wake; the engine put the (new) noise back.
    after = llm.model.norm_weights()
    assert all_differ(after, llm.loaded_norms)
    assert not same(after, noisy)  # seed 5, not seed 4
    engine.generate(["q"], n=1, sampling=SPEC)
    assert llm.calls[-1][1] == 2 and llm.calls[-1][2] > 0

    # Same seed across a sleep/wake cycle: identical weights (re-applied, not accumulated).
    engine.sleep()
    engine.wake_up()
    assert same(llm.model.norm_weights(), after)


def test_generate_while_asleep_wakes_first(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    engine = make_engine(tmp_path)
    assert names(FakeLLM.instances[-1].calls) == ["apply_model"]  # counting the norms at start-up
    engine.sleep()
    engine.generate(["q"], n=1, sampling=SPEC)
    assert names(FakeLLM.instances[-1].calls)[1:4] == ["sleep", "wake_up", "reset_prefix_cache"]
    assert not engine.is_sleeping


# --------------------------------------------------------------------------------------------
# Staleness check
# --------------------------------------------------------------------------------------------
PROBE = [5, 9, 13, 17, 21]


def trainer_logprobs(effect: float) -> Callable[[Sequence[int]], list[float]]:
    """The trainer's side of the check: a function of the probe, as the engine calls it."""
    return lambda probe: [-1.0 - 0.01 * t + effect for t in probe[1:]]


def test_staleness_gap_small_when_adapter_served(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    engine = make_engine(tmp_path, staleness_tolerance=0.1)
    llm = FakeLLM.instances[-1]
    engine.sync_adapter(write_adapter(tmp_path / "a", effect=0.7))
    engine.set_norm_noise(0.05, seed=3)
    noisy = llm.model.norm_weights()
    gap = engine.check_staleness(PROBE, trainer_logprobs(0.7))
    # The probe ran on clean norms (the noise would add a gap of its own), with the adapter ...
    probe_call = next(c for c in llm.calls if c[0] == "generate")
    assert probe_call[1] == 1 and probe_call[2] == 0.0 and probe_call[3][0].prompt_logprobs == 0
    assert gap == pytest.approx(0.0, abs=1e-9) and engine.stats()["rollout/staleness_gap"] == gap
    # ... and the noise is back afterwards.
    assert same(llm.model.norm_weights(), noisy)


def test_staleness_check_after_an_update_while_asleep(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    # The trainer's order: noise, rollout, sleep, update, sync (deferred), then the check.
    engine = make_engine(tmp_path, staleness_tolerance=0.1)
    engine.sync_adapter(write_adapter(tmp_path / "a1", effect=0.3))
    engine.set_norm_noise(0.05, seed=3)
    engine.sleep()
    engine.sync_adapter(write_adapter(tmp_path / "a2", effect=0.7))
    assert engine.check_staleness(PROBE, trainer_logprobs(0.7)) == pytest.approx(0.0, abs=1e-9)
    assert not engine.is_sleeping and engine.lora_request.lora_int_id == 2
    assert engine.last_perturbed_count == 5  # the noise lifted for the probe is back


def test_staleness_error_when_vllm_samples_the_base_model(
    tmp_path: Path, fake_vllm: types.ModuleType
) -> None:
    fake_vllm.options.ignore_adapters = True  # the failure mode: adapter loaded but not applied
    engine = make_engine(tmp_path, staleness_tolerance=0.1)
    engine.sync_adapter(write_adapter(tmp_path / "a", effect=0.7))
    with pytest.raises(QerlError, match="sampling the base model") as info:
        engine.check_staleness(PROBE, trainer_logprobs(0.7))
    assert "0.700 nats/token" in str(info.value)
    assert engine.last_staleness_gap == pytest.approx(0.7)


def test_staleness_error_when_adapter_is_not_the_trainers(
    tmp_path: Path, fake_vllm: types.ModuleType
) -> None:
    engine = make_engine(tmp_path, staleness_tolerance=0.1)
    engine.sync_adapter(write_adapter(tmp_path / "a", effect=0.2))  # a stale file
    with pytest.raises(QerlError, match="not the one the trainer uses"):
        engine.check_staleness(PROBE, trainer_logprobs(0.7))
    # Within the tolerance it is only logged.
    assert engine.check_staleness(PROBE, trainer_logprobs(0.25)) == pytest.approx(0.05)


def test_staleness_without_any_adapter(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    engine = make_engine(tmp_path, staleness_tolerance=0.1)
    with pytest.raises(QerlError, match="No adapter is loaded"):
        engine.check_staleness(PROBE, trainer_logprobs(0.7))
    with pytest.raises(ValueError, match="len\\(probe\\) - 1"):
        engine.check_staleness(PROBE, lambda probe: trainer_logprobs(0.0)(probe)[:-1])


def test_score_batches_every_sequence_in_one_call_on_clean_norms(
    tmp_path: Path, fake_vllm: types.ModuleType
) -> None:
    engine = make_engine(tmp_path)
    llm = FakeLLM.instances[-1]
    engine.sync_adapter(write_adapter(tmp_path / "a", effect=0.7))
    engine.set_norm_noise(0.05, seed=3)
    noisy = llm.model.norm_weights()
    engine.sleep()
    sequences = [[5, 9, 13], [1, 2], [7, 8, 9, 10]]
    scored = engine.score(sequences)
    calls = [c for c in llm.calls if c[0] == "generate"]
    # One call for every sequence, with the adapter, on clean norms, prompt logprobs of the tokens only ...
    assert len(calls) == 1 and calls[0][1] == 1 and calls[0][2] == 0.0 and calls[0][3][0].prompt_logprobs == 0
    assert scored == [trainer_logprobs(0.7)(ids) for ids in sequences]
    assert same(llm.model.norm_weights(), noisy)  # ... and the noise back afterwards
    assert engine.score(sequences[:1], with_adapter=False) == [trainer_logprobs(0.0)(sequences[0])]
    assert engine.score([]) == []
    with pytest.raises(ValueError, match="2 token ids"):
        engine.score([[5]])


# --------------------------------------------------------------------------------------------
# qerl bench: one engine per format
# --------------------------------------------------------------------------------------------
class FakeClockSampler:
    """Stands in for bench.header.case_clock_sampler: one busy reading, no thread."""

    def __enter__(self) -> FakeClockSampler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def record(self) -> Any:
        from qerl_cli.bench.gpuclocks import GpuReading
        from qerl_cli.bench.gpusampler import SampledClocks

        return SampledClocks(3.0, [GpuReading(1.0, 1755, 1980, 70, 600.0, 700.0, 99, [])])


def test_bench_serves_a_formats_with_and_without_lora_cases_from_one_engine(
    tmp_path: Path, fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.machinery

    from qerl_cli.bench import engines

    # The factory's find_spec must see the stand-in.
    monkeypatch.setattr(fake_vllm, "__spec__", importlib.machinery.ModuleSpec("vllm", None))
    model = write_checkpoint(tmp_path / "model", NVFP4_CONFIG)
    config = json.loads((model / "config.json").read_text())
    config.update(num_attention_heads=2, hidden_size=8, num_hidden_layers=2, vocab_size=300)
    (model / "config.json").write_text(json.dumps(config))
    adapter = write_adapter(tmp_path / "adapter", effect=0.3)
    served: list[int | None] = []

    def one_generate(engine, tokenizer, batches, settings, **kwargs):  # stands in for the timing loop
        result = engine.generate(["ab"] * batches[0], 1, SamplingSpec(max_new_tokens=3))
        served.append(engine.lora_request.lora_int_id if engine.lora_request else None)
        return [{"batch": b, "output_tokens_per_s": float(result.num_generated_tokens)} for b in batches]

    monkeypatch.setattr(engines, "measure_rollout", one_generate)
    monkeypatch.setattr(engines, "PromptMaker", lambda *args, **kwargs: None)  # one_generate makes its own
    monkeypatch.setattr(engines, "case_clock_sampler", FakeClockSampler)
    case = engines.Case(engine="vllm", format="nvfp4", model_dir=str(model), lora_rank=16,
                        lora_dir=str(adapter), batches=[2], settings={"prompt_len": 2, "gen_len": 3},
                        lora_phases=[0, 16])  # fmt: skip
    result = engines.measure_case(case)
    # Each batch's GPU clocks under load: a summary on its row, the readings for the parent's host load.
    assert [r["gpu_clocks"]["sm_mhz_median"] for r in result["rollout"]] == [1755.0, 1755.0]
    assert [len(c["readings"]) for c in result["gpu_clock_readings"]] == [1, 1]
    (llm,) = FakeLLM.instances  # one engine start for both cases
    assert llm.kwargs["enable_lora"] is True
    assert served == [None, 1]  # no adapter, then the random adapter through sync_adapter
    order = [n for n in names(llm.calls) if n in ("generate", "add_lora")]
    assert order == ["generate", "add_lora", "generate"]
    assert [(r["lora_rank"], r["batch"]) for r in result["rollout"]] == [(0, 2), (16, 2)]
    assert [(m["lora_rank"], m["engine_lora_enabled"]) for m in result["memory"]] == [(0, True), (16, True)]


def test_kv_cache_dtype_reaches_vllm(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    make_engine(tmp_path, kv_cache_dtype="fp8")
    make_engine(tmp_path / "b")
    first, second = FakeLLM.instances
    assert first.kwargs["kv_cache_dtype"] == "fp8" and "kv_cache_dtype" not in second.kwargs


def test_wake_up_without_room_fails_with_the_numbers_before_vllm_allocates(
    tmp_path: Path, fake_vllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(tmp_path)
    llm = FakeLLM.instances[-1]
    free = iter([10 * 2**30, 60 * 2**30])
    monkeypatch.setattr(vllm_engine, "_cuda_free_bytes", lambda: next(free))
    engine.sleep()
    # The update left 48 GiB in use: 20 GiB free where waking needs the 50 GiB sleep freed.
    monkeypatch.setattr(vllm_engine, "_cuda_free_bytes", lambda: 20 * 2**30)
    released: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 30 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 45 * 2**30)
    llm.calls.clear()
    expected = r"needs 50\.0 GiB back .* only 20\.0 GiB .* 30\.0 GiB in live tensors and 15\.0 GiB in blocks"
    with pytest.raises(QerlError, match=expected):
        engine.wake_up()
    assert released == [True]  # PyTorch's cache was given back before giving up
    assert ("wake_up", None) not in [c[:2] for c in llm.calls] and engine.is_sleeping
    # Enough room (e.g. after the caller lowered its micro-batch): vLLM wakes.
    monkeypatch.setattr(vllm_engine, "_cuda_free_bytes", lambda: 51 * 2**30)
    engine.wake_up()
    assert not engine.is_sleeping


def trainer_reference(probe: Sequence[int]) -> list[float]:
    """The trainer with its adapter off: the base model's logprobs."""
    return trainer_logprobs(0.0)(probe)


def test_a_gap_the_rollout_numerics_explain_passes_a_stale_adapter_does_not(
    tmp_path: Path, fake_vllm: types.ModuleType
) -> None:
    fake_vllm.options.numerics_shift = 0.4  # an FP8 rollout copy: every logprob 0.4 off the trainer's
    engine = make_engine(tmp_path, staleness_tolerance=0.25)
    engine.sync_adapter(write_adapter(tmp_path / "a", effect=0.3))
    # The adapter moves both sides alike: the 0.4 gap is the numerics, within twice the tolerance.
    assert engine.check_staleness(PROBE, trainer_logprobs(0.3), trainer_reference) == pytest.approx(0.4)
    assert engine.stats()["rollout/numerics_gap"] == pytest.approx(0.4)
    # Without the reference the same gap cannot be told from staleness.
    with pytest.raises(QerlError, match="rollouts are not sampled from the policy"):
        engine.check_staleness(PROBE, trainer_logprobs(0.3))
    # A stale adapter is still caught under the shift: vLLM applies nothing, the trainer's moves 0.3.
    fake_vllm.options.ignore_adapters = True
    with pytest.raises(QerlError, match="sampling the base model"):
        engine.check_staleness(PROBE, trainer_logprobs(0.3), trainer_reference)


def test_rollout_numerics_too_far_for_tis_stop_the_run(tmp_path: Path, fake_vllm: types.ModuleType) -> None:
    fake_vllm.options.numerics_shift = 0.7
    engine = make_engine(tmp_path, staleness_tolerance=0.25)
    engine.sync_adapter(write_adapter(tmp_path / "a", effect=0.0))  # a fresh LoRA: B is zero
    with pytest.raises(QerlError, match="linear_backend=marlin"):
        engine.check_staleness(PROBE, trainer_logprobs(0.0), trainer_reference)

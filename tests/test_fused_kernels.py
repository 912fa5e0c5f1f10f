"""Liger's patches stay with the trainer's model: models built later in the process (the held-out
evaluation ``qerl compare`` runs right after training, in the same process) run transformers' own
modules, and no model generates with Liger's RoPE where that kernel is wrong (one-token decoding
steps of a batch; see ``qerl_cli.modeling.fused_kernels``).

The first tests need no liger-kernel (a fake family module and a fake Liger, rebinding names as
liger-kernel 0.8.5 does); the last ones run the real liger-kernel on the CPU under the Triton
interpreter (tests/conftest.py sets it) and skip without it (CI does not install it)."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from qerl_cli.modeling import fused_kernels
from qerl_cli.modeling.fused_kernels import AppliedKernels, apply_fused_kernels, liger_rope_is_exact

FAMILY = "transformers.models.qerl_fake.modeling_qerl_fake"


# --------------------------------------------------------------------------------------------
# Without liger-kernel: a fake family module and a fake Liger
# --------------------------------------------------------------------------------------------
def _fake_family() -> types.ModuleType:
    family = types.ModuleType(FAMILY)

    class FakeRMSNorm(nn.Module):
        def forward(self, x):
            return x

    class FakeMLP(nn.Module):
        def forward(self, x):
            return x

    class FakeForCausalLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = types.SimpleNamespace(model_type="qerl_fake")
            self.norm = family.FakeRMSNorm()
            self.mlp = family.FakeMLP()

        def forward(self, x):
            return x

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return "transformers", q, k

    for cls in (FakeRMSNorm, FakeMLP, FakeForCausalLM):
        cls.__module__, cls.__qualname__ = FAMILY, cls.__name__
    family.FakeRMSNorm, family.FakeMLP, family.FakeForCausalLM = FakeRMSNorm, FakeMLP, FakeForCausalLM
    family.apply_rotary_pos_emb = apply_rotary_pos_emb
    return family


@pytest.fixture
def family(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A transformers family module and a Liger that patches it like liger-kernel 0.8.5 patches
    gemma3_text: module names for every later model, bound forwards on the instance."""
    module = _fake_family()
    liger = {name: types.ModuleType(name) for name in
             ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.monkey_patch",
              "liger_kernel.transformers.rope")}  # fmt: skip

    class LigerRMSNorm(nn.Module):
        pass

    class LigerMLP(nn.Module):
        pass

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return "liger", q, k

    def liger_norm_forward(self, x):
        return x + 1

    def apply(model, **kwargs):
        module.Gemma3RMSNorm_alias = LigerRMSNorm  # a name the module did not have
        module.FakeRMSNorm = LigerRMSNorm
        module.FakeMLP = LigerMLP
        module.apply_rotary_pos_emb = liger_rotary_pos_emb
        module.FakeForCausalLM.forward = lambda self, x: "liger head"  # a class attribute too
        model.norm.forward = types.MethodType(liger_norm_forward, model.norm)

    liger["liger_kernel.transformers"]._apply_liger_kernel_to_instance = apply
    liger["liger_kernel.transformers.monkey_patch"].MODEL_TYPE_TO_APPLY_LIGER_FN = {"qerl_fake": apply}
    liger["liger_kernel.transformers.rope"].liger_rotary_pos_emb = liger_rotary_pos_emb
    monkeypatch.setitem(sys.modules, FAMILY, module)
    for name, fake in liger.items():
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.setattr(fused_kernels, "liger_installed", lambda: True)
    module.liger_rotary_pos_emb = liger_rotary_pos_emb  # for the assertions
    originals = dict(vars(module))
    yield module
    fused_kernels._HELD.clear()
    module.__dict__.clear()
    module.__dict__.update(originals)


def _decode_step(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k of one decoding step as a copying q_norm leaves them: [B, H, 1, D] contiguous."""
    return torch.zeros(batch, 4, 1, 8), torch.zeros(batch, 1, 1, 8)


def test_liger_module_rebindings_do_not_outlive_the_trainers_model(family: types.ModuleType) -> None:
    original_rope = family.apply_rotary_pos_emb
    classes = (family.FakeRMSNorm, family.FakeMLP, family.FakeForCausalLM.forward)
    model = family.FakeForCausalLM()
    applied = apply_fused_kernels(model, "liger", on_gpu=True)

    assert isinstance(applied, AppliedKernels) and applied.kind == "liger"
    # The trainer's model keeps Liger's instance patches...
    assert model.norm(torch.zeros(1)).item() == 1.0
    # ...and a model built now gets transformers' classes (and no name Liger added).
    assert (family.FakeRMSNorm, family.FakeMLP, family.FakeForCausalLM.forward) == classes
    assert not hasattr(family, "Gemma3RMSNorm_alias")
    fresh = family.FakeForCausalLM()
    assert type(fresh.norm) is classes[0] and fresh(3) == 3
    assert f"{FAMILY}.FakeRMSNorm" in applied.restored
    assert f"{FAMILY}.FakeForCausalLM.forward" in applied.restored
    # RoPE, looked up at every forward, is Liger's only where Liger's kernel is exact.
    assert applied.kept == [f"{FAMILY}.apply_rotary_pos_emb"]
    rope = family.apply_rotary_pos_emb
    assert rope is not original_rope and rope is not family.liger_rotary_pos_emb
    assert rope(*_decode_step(3), None, None)[0] == "transformers"  # batched decoding step
    assert rope(*_decode_step(1), None, None)[0] == "liger"  # one row
    prefill = torch.zeros(3, 4, 5, 8), torch.zeros(3, 1, 5, 8)  # also a training forward
    assert rope(*prefill, None, None)[0] == "liger"

    applied.restore()
    assert family.apply_rotary_pos_emb is original_rope
    applied.restore()  # idempotent
    assert family.apply_rotary_pos_emb is original_rope and not fused_kernels._HELD


def test_two_patched_models_restore_in_any_order(family: types.ModuleType) -> None:
    original_rope = family.apply_rotary_pos_emb
    first = apply_fused_kernels(family.FakeForCausalLM(), "liger", on_gpu=True)
    second = apply_fused_kernels(family.FakeForCausalLM(), "liger", on_gpu=True)
    guard = family.apply_rotary_pos_emb
    assert guard.__qerl_original__ is original_rope  # not the first guard wrapped again
    first.restore()
    assert family.apply_rotary_pos_emb is guard  # the second model is still training
    second.restore()
    assert family.apply_rotary_pos_emb is original_rope


def test_off_and_cpu_patch_nothing(family: types.ModuleType) -> None:
    before = dict(vars(family))
    for mode, gpu in (("off", True), ("auto", False)):
        applied = apply_fused_kernels(family.FakeForCausalLM(), mode, on_gpu=gpu)
        assert applied.kind == "off" and not applied.kept
        applied.restore()
    assert dict(vars(family)) == before


def test_policy_close_restores_the_rope(family: types.ModuleType) -> None:
    from qerl_cli.rl.policy import Policy

    original_rope = family.apply_rotary_pos_emb
    applied = apply_fused_kernels(family.FakeForCausalLM(), "liger", on_gpu=True)
    policy = Policy(model=nn.Linear(1, 1), tokenizer=None, device=torch.device("cpu"), dtype=torch.float32,
                    base_format="bf16", fused_kernels=applied.kind, kernels=applied)  # fmt: skip
    assert family.apply_rotary_pos_emb is not original_rope
    policy.close()
    assert family.apply_rotary_pos_emb is original_rope


def test_rope_exactness_rule() -> None:
    assert not liger_rope_is_exact(*_decode_step(2))
    assert liger_rope_is_exact(*_decode_step(1))
    assert liger_rope_is_exact(torch.zeros(2, 4, 3, 8), torch.zeros(2, 1, 3, 8))
    assert not liger_rope_is_exact(torch.zeros(2, 3, 8), torch.zeros(2, 3, 8))  # not [B, H, S, D]


# --------------------------------------------------------------------------------------------
# With liger-kernel (CPU, Triton interpreter)
# --------------------------------------------------------------------------------------------
needs_liger = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None,
    reason="needs liger-kernel (the liger extra); CI does not install it",
)


def _rope_inputs(batch: int, seq: int, *, heads: int = 4, dim: int = 16):
    g = torch.Generator().manual_seed(batch * 100 + seq)
    # q and k as Gemma 3 leaves them after a q_norm / k_norm that returns a fresh tensor
    q = torch.randn(batch, heads, seq, dim, generator=g)
    k = torch.randn(batch, 1, seq, dim, generator=g)
    angle = torch.randn(batch, seq, dim // 2, generator=g)
    angle = torch.cat([angle, angle], dim=-1)
    return q, k, angle.cos(), angle.sin()


@needs_liger
@pytest.mark.parametrize(("batch", "seq"), [(3, 1), (1, 1), (3, 7)])
def test_guarded_liger_rope_equals_transformers(batch: int, seq: int) -> None:
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

    guarded = fused_kernels.guarded_rope(liger_rotary_pos_emb, apply_rotary_pos_emb)
    q, k, cos, sin = _rope_inputs(batch, seq)
    want_q, want_k = apply_rotary_pos_emb(q.clone(), k.clone(), cos, sin)
    got_q, got_k = guarded(q.clone(), k.clone(), cos, sin)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def _tiny_gemma3(seed: int = 0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
        pad_token_id=256, bos_token_id=256, eos_token_id=258, attn_implementation="eager",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(config)
        for name, param in model.named_parameters():
            if "norm" in name:  # Gemma's (1 + w) norms start at w = 0: make them count
                torch.nn.init.normal_(param, std=0.3)
    return model.float().eval()


@pytest.fixture
def gemma3_module() -> Iterator[types.ModuleType]:
    """transformers' gemma3 module, as it was, after the test whatever it did (Liger rebinds it)."""
    from transformers.models.gemma3 import modeling_gemma3

    saved = dict(vars(modeling_gemma3))
    yield modeling_gemma3
    fused_kernels._HELD.clear()
    for name in set(vars(modeling_gemma3)) - set(saved):
        delattr(modeling_gemma3, name)
    for name, value in saved.items():
        setattr(modeling_gemma3, name, value)


def _torch_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger's RMSNorm and GEGLU Triton kernels call libdevice, which the Triton interpreter lacks:
    torch stand-ins with the same results and layout. Liger's RoPE kernel runs for real.

    The layout matters: Liger's RMSNorm writes a fresh [rows, D] tensor and views it as the input's
    shape, so a decoding step's q ([B, H, 1, D]) leaves it with stride D on its size-1 sequence dim
    (transformers' norm keeps the projection's H * D there), which is what Liger's RoPE kernel then
    mis-reads."""
    from liger_kernel.transformers import geglu, rms_norm

    def fresh_rows(y: torch.Tensor) -> torch.Tensor:
        out = torch.empty(y.numel() // y.shape[-1], y.shape[-1], dtype=y.dtype)
        return out.copy_(y.reshape(-1, y.shape[-1])).view(y.shape)

    class RMSNormFunction:
        @staticmethod
        def apply(x, weight, eps, offset, casting_mode, in_place, row_mode=None):
            assert casting_mode == "gemma"
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())
            return fresh_rows(y.to(x.dtype))

    class GELUMulFunction:
        @staticmethod
        def apply(gate, up):
            return fresh_rows(nn.functional.gelu(gate, approximate="tanh") * up)

    monkeypatch.setattr(rms_norm, "LigerRMSNormFunction", RMSNormFunction)
    monkeypatch.setattr(geglu, "LigerGELUMulFunction", GELUMulFunction)


def _greedy(model) -> tuple[list[list[int]], torch.Tensor]:
    """Batched greedy generation of left-padded prompts of different lengths through qerl's HF
    engine (as the held-out evaluation runs it): tokens and their logprobs."""
    from qerl_cli.modeling.tiny import build_tokenizer
    from qerl_cli.rollout.base import SamplingSpec
    from qerl_cli.rollout.hf import HFEngine

    engine = HFEngine(model, build_tokenizer(), generation_batch_size=8, device="cpu")
    prompts = ["What is 12 + 30? Answer:", "2 + 2 =", "Tom has 7 apples and eats 3. Left:"]
    result = engine.generate(prompts, 1, SamplingSpec(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    completions = [group[0] for group in result.completions]
    return [c.token_ids for c in completions], torch.tensor([c.logprobs for c in completions])


@needs_liger
def test_generation_after_liger_training_matches_transformers(
    gemma3_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compare child's order: a trainer's model gets Liger, then a fresh model of the family is
    built and generates (the held-out evaluation); the trainer's model itself also generates (the
    HF rollout engine shares it). Both as transformers alone generates."""
    _torch_stand_ins(monkeypatch)
    want_tokens, want_logprobs = _greedy(_tiny_gemma3())

    trainer_model = _tiny_gemma3()
    applied = apply_fused_kernels(trainer_model, "liger", on_gpu=True)  # on_gpu: Liger as on the H100
    assert applied.kind == "liger"
    assert trainer_model.model.layers[0].self_attn.q_norm._get_name() == "LigerRMSNorm"  # Liger is on

    evaluated = _tiny_gemma3()
    assert type(evaluated.model.layers[0].input_layernorm) is gemma3_module.Gemma3RMSNorm
    assert gemma3_module.Gemma3RMSNorm.__module__ == gemma3_module.__name__
    assert gemma3_module.Gemma3MLP.__module__ == gemma3_module.__name__
    tokens, logprobs = _greedy(evaluated)
    assert tokens == want_tokens
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-4, atol=1e-4)

    tokens, logprobs = _greedy(trainer_model)
    assert tokens == want_tokens
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-4, atol=1e-4)

    applied.restore()
    assert gemma3_module.apply_rotary_pos_emb.__module__ == gemma3_module.__name__

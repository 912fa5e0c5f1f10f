"""The update's speed paths: packed sequences (no padding) give the padded batch's loss and LoRA
gradients; fused kernels are chosen, refused and applied as train.fused_kernels says."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from qerl_cli.config import TrainConfig
from qerl_cli.errors import QerlError
from qerl_cli.modeling import fused_kernels
from qerl_cli.rl.losses import policy_loss
from qerl_cli.rl.policy import build_policy, completion_logprobs, make_token_batch


def tiny_policy(model_dir: Path, fmt_dir: Path | None = None):
    cfg = TrainConfig()
    cfg.model.path = str(fmt_dir or model_dir)
    cfg.model.dtype = "float32"
    cfg.lora.rank = 4
    cfg.train.device = "cpu"
    cfg.train.gradient_checkpointing = False
    policy = build_policy(cfg)
    for name, param in policy.named_trainable_parameters():  # LoRA B starts at 0: give it a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return policy


def ragged_batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    completions = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (7, 2, 11, 0)]
    rollout = [[-1.0] * len(c) for c in completions]
    return make_token_batch(prompts, completions, rollout, pad_id=0)


def loss_and_grads(policy, batch, pack: bool, chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    policy.model.zero_grad(set_to_none=True)
    lp = completion_logprobs(policy.model, batch, 0.7, torch.device("cpu"), chunk, pack=pack)
    advantages = torch.tensor([1.0, -0.5, 0.25, 0.0])
    loss, _ = policy_loss(lp, lp.detach() - 0.05, advantages, batch.completion_mask, loss_type="dapo",
                          rollout_logprobs=batch.rollout_logprobs, tis_cap=2.0)  # fmt: skip
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_trainable_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("chunk", [0, 4])
def test_packed_sequences_give_the_padded_loss_and_lora_gradients(tiny_model_dir: Path, chunk: int) -> None:
    policy = tiny_policy(tiny_model_dir)
    batch = ragged_batch()
    padded_loss, padded = loss_and_grads(policy, batch, pack=False, chunk=chunk)
    packed_loss, packed = loss_and_grads(policy, batch, pack=True, chunk=chunk)
    assert padded and padded.keys() == packed.keys()
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], rtol=1e-4, atol=1e-6, msg=name)
    lp = completion_logprobs(policy.model, batch, 0.7, torch.device("cpu"), chunk, pack=True)
    assert lp.shape == batch.completion_mask.shape and not lp[batch.completion_mask == 0].any()


def test_packing_keeps_sequences_apart(tiny_model_dir: Path) -> None:
    """A sequence's logprobs do not change when another sequence is packed before it."""
    policy = tiny_policy(tiny_model_dir)
    batch = ragged_batch()
    cpu = torch.device("cpu")
    with torch.no_grad():
        alone = completion_logprobs(policy.model, batch.rows(slice(2, 3)), 1.0, cpu, pack=True)
        after = completion_logprobs(policy.model, batch.rows(slice(0, 3)), 1.0, cpu, pack=True)
    width = int(batch.completion_mask[2].sum())
    torch.testing.assert_close(after[2, :width], alone[0, :width], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Fused kernels
# --------------------------------------------------------------------------------------------
@pytest.fixture
def fake_liger(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []
    root = types.ModuleType("liger_kernel")
    transformers = types.ModuleType("liger_kernel.transformers")
    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    transformers._apply_liger_kernel_to_instance = lambda **kw: calls.append(kw)
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2": None, "llama": None}
    for name, module in (("liger_kernel", root), ("liger_kernel.transformers", transformers),
                         ("liger_kernel.transformers.monkey_patch", patch)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(fused_kernels, "liger_installed", lambda: True)
    return calls


def model_of(model_type: str) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(model_type=model_type)
    return model


def test_fused_kernels_choice_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_kernels, "liger_installed", lambda: False)
    assert fused_kernels.apply_fused_kernels(model_of("qwen2"), "off", on_gpu=True).kind == "off"
    assert fused_kernels.apply_fused_kernels(model_of("qwen2"), "auto", on_gpu=True).kind == "off"
    with pytest.raises(QerlError, match=r'pip install -e "\.\[liger\]"'):
        fused_kernels.apply_fused_kernels(model_of("qwen2"), "liger", on_gpu=True)
    with pytest.raises(QerlError, match="auto, liger, off"):
        fused_kernels.apply_fused_kernels(model_of("qwen2"), "triton", on_gpu=True)


def test_liger_is_applied_without_its_loss_head(fake_liger: list[dict]) -> None:
    model = model_of("qwen2")
    # CPU: Triton needs a GPU
    assert fused_kernels.apply_fused_kernels(model, "auto", on_gpu=False).kind == "off"
    assert fused_kernels.apply_fused_kernels(model, "auto", on_gpu=True).kind == "liger"
    (call,) = fake_liger
    assert call["model"] is model and call["rms_norm"] and call["swiglu"] and call["rope"]
    assert call["fused_linear_cross_entropy"] is False and call["cross_entropy"] is False
    assert fused_kernels.apply_fused_kernels(model_of("mamba"), "auto", on_gpu=True).kind == "off"
    with pytest.raises(QerlError, match="no kernels for model type 'mamba'"):
        fused_kernels.apply_fused_kernels(model_of("mamba"), "liger", on_gpu=True)

"""AWQ's smoothing alone (before any rounding) must leave the model's function as it was.

Tiny BF16 models built in code, with what makes real ones hard: norm scales spread over two orders of
magnitude (a few channels nearly cut, as Gemma 3's are) and a few massive residual channels. The
smoothed, unrounded model is the original with the weights ``qerl``'s llm-compressor path leaves
behind (its fake-quant forward is left out). A Llama is the control; Gemma 3's norms scale by ``1 + w``
(``qerl_cli.quantize.awq_mappings``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("llmcompressor")

from qerl_cli.quantize import awq_mappings, pipeline  # noqa: E402 - after the skip

HIDDEN, VOCAB = 128, 320


def _tiny(arch: str, folder: Path, layers: int = 1) -> torch.nn.Module:
    """A seeded BF16 model whose config is saved in ``folder`` (llm-compressor reads it back)."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
    )  # fmt: skip
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(**shape, sliding_window=16))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**shape))
    offset = 1.0 if arch == "gemma3" else 0.0  # Gemma stores w and scales by 1 + w
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norm scales: log-normal, one channel in ten nearly cut
                scale = torch.exp(torch.randn_like(param))
                scale[torch.rand_like(param) < 0.1] *= 0.02
                param.copy_(scale - offset)
            elif "embed" in name:
                param.copy_(torch.randn_like(param))
                param[:, :4] *= 30.0  # massive residual channels
            else:
                param.copy_(torch.randn_like(param) * 0.05)
    model.config.save_pretrained(folder)
    model.config._name_or_path = str(folder)
    return model.to(torch.bfloat16).eval()


def _calibration():
    from datasets import Dataset

    ids = torch.randint(0, 300, (6, 32), generator=torch.Generator().manual_seed(1)).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32 for _ in ids]})


def _smooth_only(original: torch.nn.Module, method: str = "awq") -> torch.nn.Module:
    """``original`` with the weights qerl's oneshot path leaves (smoothed, not rounded)."""
    from qerl_cli.modeling.tiny import build_tokenizer

    model = copy.deepcopy(original)
    recipe = pipeline.build_recipe("nvfp4", method, [])
    for modifier in recipe:
        if hasattr(modifier, "n_grid"):
            modifier.n_grid = 6  # a coarser grid search: the scales differ, the exactness must not
    pipeline.run_oneshot(model, build_tokenizer(), recipe, _calibration())
    smoothed = copy.deepcopy(original)
    keys = smoothed.state_dict().keys()
    smoothed.load_state_dict({k: v for k, v in model.state_dict().items() if k in keys}, strict=False)
    return smoothed


@torch.no_grad()
def _kl(reference: torch.nn.Module, other: torch.nn.Module) -> float:
    """Mean KL(reference || other) per token, both run in float32 on their BF16 weights."""
    ids = torch.randint(0, 300, (4, 40), generator=torch.Generator().manual_seed(7))
    p = copy.deepcopy(reference).float()(ids).logits.log_softmax(-1)
    q = copy.deepcopy(other).float()(ids).logits.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _changed_norms(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    other = dict(b.named_parameters())
    return [n for n, p in a.named_parameters() if p.ndim == 1 and not torch.equal(p, other[n])]


def _implied_scales(before: torch.nn.Module, after: torch.nn.Module, norm: str, linear: str) -> tuple:
    """Per channel, the scale the norm was divided by and the one its linear's input was multiplied by."""
    b, a = dict(before.named_parameters()), dict(after.named_parameters())
    offset = 1.0 if "Gemma" in type(before).__name__ else 0.0
    live = b[norm].float() + offset != 0  # a channel the norm cuts carries nothing to smooth
    from_norm = (b[norm].float() + offset)[live] / (a[norm].float() + offset)[live]
    from_linear = (a[linear].float() / b[linear].float()).median(dim=0).values[live]
    return from_norm.detach(), from_linear.detach()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_awq_smoothing_alone_keeps_the_function(arch: str, tmp_path: Path) -> None:
    """Measured on these models (KL in nats per token): Llama 6.5e-6; Gemma 3 through llm-compressor
    0.14 alone 2.8e-4, its MLP norm's scales up to 2 % off what gate_proj gained; with qerl's fix 2e-6."""
    original = _tiny(arch, tmp_path)
    smoothed = _smooth_only(original)
    mlp_norm = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    # The function: a BF16 model smoothed in BF16 keeps only its linears' BF16 rounding.
    assert _kl(original, smoothed) < 5e-5
    # Per channel, each smoothed norm lost exactly what the linear it feeds gained (up to the linear's
    # own BF16 rounding), over a real spread of scales.
    for norm, linear in (("input_layernorm", "self_attn.q_proj"), (mlp_norm, "mlp.gate_proj")):
        lost, gained = _implied_scales(
            original, smoothed, f"model.layers.0.{norm}.weight", f"model.layers.0.{linear}.weight"
        )
        assert float(lost.max() / lost.min()) > 10, norm
        assert float((lost / gained - 1).abs().max()) < 1e-2, norm
    # The norms AWQ did not smooth come back bit for bit.
    expected = {f"model.layers.0.{norm}.weight" for norm in ("input_layernorm", mlp_norm)}
    assert set(_changed_norms(original, smoothed)) == expected


def test_gemma3_norms_untouched_by_a_recipe_without_smoothing(tmp_path: Path) -> None:
    """RTN through llm-compressor smooths nothing: every Gemma norm must come back bit for bit
    (llm-compressor 0.14's own offset-norm round trip rounds 1 + w to BF16 and changed them all)."""
    original = _tiny("gemma3", tmp_path)
    assert _changed_norms(original, _smooth_only(original, method="rtn")) == []


def test_scale_norm_is_the_offset_norm_bit_for_bit() -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(HIDDEN, eps=1e-6)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.exp(torch.randn(HIDDEN)) - 1.0)
    x = torch.randn(3, 5, HIDDEN) * 10
    for dtype in (torch.bfloat16, torch.float32):
        original = copy.deepcopy(norm).to(dtype)
        assert awq_mappings.is_offset_norm(original)
        swapped = awq_mappings.ScaleRMSNorm(original)
        assert swapped.weight.dtype == torch.float32 and swapped.storage_dtype == dtype
        assert torch.equal(swapped(x.to(dtype)), original(x.to(dtype)))
        assert torch.equal(swapped.offset_weight(), original.weight.detach())  # w back, bit for bit


def test_storable_scales_survive_the_checkpoint_dtype() -> None:
    """The smoothed 1 + w, stored as a BF16 offset from 1, is exactly the scale AWQ divided by."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(HIDDEN)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.exp(torch.randn(HIDDEN) * 2) - 1.0)
        norm.weight[:4] = torch.tensor([-1.0, -1.5, 300.0, 0.0])  # cut, negative, huge, exactly 1
    swapped = awq_mappings.ScaleRMSNorm(norm.to(torch.bfloat16))
    wanted = torch.exp(torch.randn(HIDDEN) * 2)  # scales over several orders of magnitude
    wanted[4] = 1e4  # would cut the channel: (1 + w) / s under BF16's step near -1
    scales = swapped.storable_scales(wanted)
    smoothed = swapped.weight / scales  # what AWQ's smoothing writes into the norm
    stored = (smoothed - 1.0).to(torch.bfloat16)  # what the checkpoint holds
    assert torch.allclose(1.0 + stored.float(), smoothed, rtol=1e-6, atol=1e-7)
    assert scales[0] == 1 and scales[4] == 1  # a cut channel, and one the dtype cannot store, keep 1
    assert scales[1] > 0 and torch.isfinite(scales).all()
    moved = (scales / wanted - 1).abs()
    assert float(moved[5:].median()) < 5e-3  # most channels keep (nearly) the scale AWQ chose


def test_llmcompressor_finds_no_offset_norm_inside(tmp_path: Path) -> None:
    """Inside qerl's context llm-compressor's own offset-norm conversion has nothing left to convert,
    and leaving it restores the very same modules."""
    model = _tiny("gemma3", tmp_path)
    before = {n: m for n, m in model.named_modules() if awq_mappings.is_offset_norm(m)}
    assert len(before) == 7  # 6 per layer (q/k norms included) and the final norm
    with awq_mappings.exact_offset_norms(model) as names:
        assert sorted(names) == sorted(before)
        assert not any(awq_mappings.is_offset_norm(m) for m in model.modules())
        try:
            from llmcompressor.modeling.offset_norm import norm_calibration_context
        except ImportError:  # an llm-compressor before 0.14: it never converted them
            norm_calibration_context = None
        if norm_calibration_context is not None:
            with norm_calibration_context(model):
                assert all(
                    type(m) is awq_mappings.ScaleRMSNorm for n, m in model.named_modules() if n in before
                )
    assert all(dict(model.named_modules())[n] is m for n, m in before.items())


def test_gemma3_mappings_and_without_the_scale_hook_only_linear_ones(tmp_path: Path, monkeypatch) -> None:
    """Gemma 3 gets qerl's mappings (input_layernorm -> q/k/v included); with an llm-compressor whose
    scales qerl cannot make storable only the exact linear-to-linear ones stay. A Llama keeps
    llm-compressor's own either way."""
    gemma, llama = _tiny("gemma3", tmp_path / "g"), _tiny("llama", tmp_path / "l")
    assert awq_mappings.can_smooth_offset_norms()  # llm-compressor 0.14
    assert awq_mappings.mappings_for(llama) is None
    smoothed = [m.smooth_layer for m in awq_mappings.mappings_for(gemma)]
    assert smoothed == [
        "re:.*input_layernorm$",
        "re:.*v_proj$",
        "re:.*pre_feedforward_layernorm$",
        "re:.*up_proj$",
    ]
    monkeypatch.setattr(awq_mappings, "can_smooth_offset_norms", lambda: False)
    assert awq_mappings.mappings_for(llama) is None
    assert [m.smooth_layer for m in awq_mappings.mappings_for(gemma)] == ["re:.*v_proj$", "re:.*up_proj$"]


def test_a_look_alike_norm_is_left_alone() -> None:
    """A class named like an offset norm that does not compute normalize(x) * (1 + w) is not swapped."""

    class Gemma3RMSNorm(torch.nn.Module):  # e.g. remote code reusing the name for a plain RMSNorm
        def __init__(self) -> None:
            super().__init__()
            self.eps = 1e-6
            self.weight = torch.nn.Parameter(torch.rand(HIDDEN) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    model = torch.nn.Sequential(Gemma3RMSNorm())
    assert awq_mappings.is_offset_norm(model[0])
    with awq_mappings.exact_offset_norms(model) as names:
        assert names == [] and type(model[0]) is Gemma3RMSNorm

"""FP8 base GEMMs in the update (``train.base_compute``): the emulated FP8 numerics against a float64
reference, a tiny 4-bit LoRA model's loss and gradients against BF16, the choice and its errors, and
``torch._scaled_mm`` against the emulation on a GPU.

Tolerances. E4M3 keeps 3 mantissa bits: rounding moves an element by up to 2^-4 of itself (rms about
2^-4 / sqrt(3) ~ 0.036). In a K-long dot product of terms of random sign, the rounding errors add up
like the terms themselves (both as sqrt(K)), so the *relative* error of one output stays about that of
one element whatever K: ~0.03 overall, up to 0.061 on the worst output row measured (3 formats, 2
shapes, tokens and output gradients spread over 2^18 in magnitude). The bound, 0.1 on every row,
fails by 5x and more for the bugs it guards against (see ``test_the_bound_catches_wrong_scales``):
weight scales on the summed axis (1.7-3.1), the forward copy reused in backward (1.9-2.4), one scale
for all tokens (0.51-0.94).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from qerl_cli.config import TrainConfig, TrainSection, load_config
from qerl_cli.errors import QerlError
from qerl_cli.formats.fp8 import has_fp8_tensor_cores, quantize_per_channel
from qerl_cli.kernels import fp8_rows
from qerl_cli.modeling import base_compute, fp8_update
from qerl_cli.modeling.base_compute import resolve_base_compute
from qerl_cli.modeling.fp8_update import Fp8Weight, emulated_mm, quantize_rows
from qerl_cli.modeling.quant_linear import QuantLinear, fp8_cache_nbytes, set_base_compute

ROW_BOUND = 0.1  # relative error of any output row (measured at most 0.061)
WHOLE_BOUND = 0.05  # relative error of the whole output (measured ~0.03)


def spread(n: int, g: torch.Generator, octaves: float) -> torch.Tensor:
    """``n`` magnitudes log-uniform over 2^-octaves..1: rows and columns of very different sizes, so
    a scale on the wrong axis shows."""
    return 2.0 ** (torch.rand(n, generator=g) * octaves - octaves)


def layer(fmt: str, out_features: int, in_features: int, bias: bool = False) -> QuantLinear:
    g = torch.Generator().manual_seed(1)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        w = torch.randn(out_features, in_features, generator=g)
        linear.weight.copy_(spread(out_features, g, 8)[:, None] * w * spread(in_features, g, 8)[None, :])
    return QuantLinear.from_linear(linear, fmt)


def row_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().reshape(-1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1])
    return float(((got - ref).norm(dim=1) / ref.norm(dim=1)).max())


def whole_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.detach().double() - ref).norm() / ref.norm())


def inputs(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and output gradients ``[2, 33, *]``, each row of its own magnitude (2^18 apart)."""
    g = torch.Generator().manual_seed(2)
    x = spread(66, g, 18)[:, None] * torch.randn(66, in_features, generator=g)
    dy = spread(66, g, 18)[:, None] * torch.randn(66, out_features, generator=g)
    return x.reshape(2, 33, in_features), dy.reshape(2, 33, out_features)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize(("out_features", "in_features"), [(384, 512), (256, 256)])
def test_fp8_forward_and_input_gradient_match_the_dequantized_base(
    fmt: str, out_features: int, in_features: int
) -> None:
    q = layer(fmt, out_features, in_features)
    w = q.dequantized_weight(torch.float32).double()
    x, dy = inputs(out_features, in_features)
    x.requires_grad_(True)
    set_base_compute(q, "fp8")
    y = q(x)
    y.backward(dy)
    ref_y, ref_dx = x.detach().double() @ w.t(), dy.double() @ w
    assert y.shape == ref_y.shape and x.grad.shape == ref_dx.shape
    assert row_error(y, ref_y) < ROW_BOUND and whole_error(y, ref_y) < WHOLE_BOUND
    assert row_error(x.grad, ref_dx) < ROW_BOUND and whole_error(x.grad, ref_dx) < WHOLE_BOUND


def test_the_bound_catches_wrong_scales() -> None:
    """A square layer, where a swapped scale or copy would not fail on shapes: each mistake exceeds it."""
    q = layer("nvfp4", 256, 256)
    w = q.dequantized_weight(torch.float32).double()
    x, dy = inputs(256, 256)
    set_base_compute(q, "fp8")
    fp8 = q.fp8_weight()
    ref_dx = (dy.double() @ w).reshape(-1, 256)
    codes, scale = quantize_rows(dy)
    # The forward's copy used for the input gradient (its scales end up on the summed axis).
    reused = emulated_mm(codes, scale, fp8.rows.t().contiguous(), fp8.row_scale, torch.float32)
    # The transposed copy's codes with the forward copy's scales (scales on the wrong axis).
    swapped = emulated_mm(codes, scale, fp8.cols, fp8.row_scale, torch.float32)
    # One scale for every token instead of one per token.
    flat, one = quantize_per_channel(x.reshape(1, -1))
    per_tensor = (flat.float() * one).reshape(-1, 256) @ fp8.dense_rows().t()
    assert row_error(reused, ref_dx) > 5 * ROW_BOUND
    assert row_error(swapped, ref_dx) > 5 * ROW_BOUND
    assert row_error(per_tensor, x.reshape(-1, 256).double() @ w.t()) > 5 * ROW_BOUND


def test_tokens_rounded_in_chunks_round_as_all_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 50, 64) * torch.rand(3, 50, 1)
    whole_codes, whole_scale = quantize_rows(x)
    monkeypatch.setattr(fp8_rows, "REFERENCE_CHUNK", 64 * 7)  # 7 tokens a chunk: 22 chunks, one ragged
    codes, scale = quantize_rows(x)
    assert codes.is_contiguous() and codes.shape == (150, 64) and scale.shape == (150, 1)
    assert torch.equal(codes.view(torch.uint8), whole_codes.view(torch.uint8)) and torch.equal(
        scale, whole_scale
    )


def test_bias_is_added_and_the_bf16_path_is_unchanged() -> None:
    q = layer("nvfp4", 128, 256, bias=True)
    with torch.no_grad():
        q.bias.normal_()
    x = torch.randn(5, 256)
    before = q(x)
    set_base_compute(q, "fp8")
    with_bias = q(x)
    set_base_compute(q, "bf16")
    torch.testing.assert_close(q(x), before, rtol=0, atol=0)  # back to BF16: the very same numbers
    expected = emulated_mm(*quantize_rows(x), q.fp8_weight().rows, q.fp8_weight().row_scale, x.dtype) + q.bias
    torch.testing.assert_close(with_bias, expected, rtol=0, atol=0)


def test_the_cache_is_derived_once_kept_out_of_state_dict_and_redone_when_the_weight_changes() -> None:
    q = layer("nvfp4", 128, 256)

    def saved(module: nn.Module) -> dict[str, tuple]:
        return {k: (tuple(t.shape), t.dtype) for k, t in module.state_dict().items()}

    before = saved(q)
    held = set_base_compute(q, "fp8")
    assert held == Fp8Weight.bytes_for(128, 256) == fp8_cache_nbytes(q)  # 2 bytes a weight + scales
    assert saved(q) == before  # the packed buffers (and bias) only
    first = q.fp8_weight()
    q(torch.randn(3, 256))
    assert q.fp8_weight() is first  # not derived again per call
    new_weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(5))
    q.load_checkpoint_tensors(q.fmt.quantize(new_weight))  # a copy into the packed buffers
    again = q.fp8_weight()
    assert again is not first
    expected = Fp8Weight.derive(q.dequantized_weight(torch.float32))
    assert torch.equal(again.rows.view(torch.uint8), expected.rows.view(torch.uint8))
    set_base_compute(q, "bf16")
    assert fp8_cache_nbytes(q) == 0


def tiny_4bit_lora(seed: int = 0) -> nn.Module:
    """A tiny Qwen2 in float32 with NVFP4 projections and LoRA (B random, so every factor gets a
    gradient) on every projection."""
    from qerl_cli.modeling.lora import attach_lora
    from qerl_cli.modeling.tiny import build_tiny_model

    model = build_tiny_model(seed).float()
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, QuantLinear.from_linear(child, "nvfp4"))
    peft = attach_lora(model, r=4, alpha=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    return peft


def loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_a_tiny_4bit_lora_model_trains_alike_in_fp8() -> None:
    """Loss within 5e-4 relative (measured 4.5e-5) and every LoRA gradient at cosine > 0.98 (measured
    >= 0.994) of the BF16 path's. The tiny model's random weights have rows and columns of like size, so
    mistakes show less than in the layer tests above, yet still fail: the transposed copy's scales in
    the wrong order give cosine 0.93, the forward copy's 0.86 and a loss 9e-4 off."""
    model = tiny_4bit_lora()
    ids = torch.randint(5, 250, (3, 40), generator=torch.Generator().manual_seed(3))
    loss, grads = loss_and_grads(model, ids)
    set_base_compute(model, "fp8")
    fp8_loss, fp8_grads = loss_and_grads(model, ids)
    assert grads.keys() == fp8_grads.keys() and len(grads) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    assert abs(fp8_loss - loss) / abs(loss) < 5e-4
    worst = min(torch.nn.functional.cosine_similarity(grads[n].flatten(), fp8_grads[n].flatten(), dim=0)
                for n in grads)  # fmt: skip
    assert worst > 0.98, worst


# --------------------------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------------------------
def test_auto_resolves_by_device_and_base() -> None:
    # auto keeps BF16 everywhere: FP8 update GEMMs measured 0.99-1.06x of BF16 on an H100.
    for capability in (None, (8, 0), (8, 9), (9, 0)):
        mode, why = resolve_base_compute("auto", quantized=True, capability=capability)
        assert mode == "bf16" and "measured" in why
    assert resolve_base_compute("fp8", quantized=True, capability=(9, 0))[0] == "fp8"  # an H100
    assert resolve_base_compute("fp8", quantized=True, capability=(8, 9))[0] == "fp8"  # Ada
    assert resolve_base_compute("bf16", quantized=True, capability=(9, 0))[0] == "bf16"
    assert resolve_base_compute("bf16", quantized=None, capability=None)[0] == "bf16"
    # A BF16 base keeps BF16 under fp8: one recipe serves the BF16 and the 4-bit arms of a comparison.
    assert resolve_base_compute("fp8", quantized=None, capability=(9, 0))[0] == "bf16"


@pytest.mark.parametrize(
    ("quantized", "capability", "needle"),
    [(True, None, "on the CPU, and FP8 base compute needs a CUDA GPU"), (True, (8, 0), "capability 8.0"),
     (False, None, "on the CPU"),
     (False, (9, 0), "no 4-bit layer of this model has the 33,554,432 weights")],
)  # fmt: skip
def test_fp8_asked_where_it_cannot_run_is_an_error(quantized: bool, capability, needle: str) -> None:
    with pytest.raises(QerlError, match=rf"train.base_compute=fp8 cannot run: .*{needle}.*auto or bf16"):
        resolve_base_compute("fp8", quantized=quantized, capability=capability)


def test_the_policy_applies_the_choice_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_4bit_lora()
    cpu = torch.device("cpu")
    assert base_compute.apply_base_compute(model, "auto", cpu) == "bf16" and fp8_cache_nbytes(model) == 0
    monkeypatch.setattr(base_compute, "device_capability", lambda device: (9, 0))  # as on an H100
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    # The tiny model's layers are far below FP8_MIN_WEIGHTS: FP8 is on, but no layer gains from it.
    assert base_compute.apply_base_compute(model, "auto", cpu) == "bf16"
    with pytest.raises(QerlError, match="no 4-bit layer of this model has"):  # never a silent no-op
        base_compute.apply_base_compute(model, "fp8", cpu)
    assert all(m.base_compute == "bf16" for m in layers) and fp8_cache_nbytes(model) == 0
    sizes = [m.out_features * m.in_features for m in layers]
    assert min(sizes) < max(sizes)  # some layers are larger than others: the rule splits them
    monkeypatch.setattr(base_compute, "FP8_MIN_WEIGHTS", max(sizes))
    assert base_compute.apply_base_compute(model, "fp8", cpu) == "fp8"
    big = [m for m in layers if m.out_features * m.in_features >= max(sizes)]
    assert all(m.base_compute == "fp8" for m in big)
    assert all(m.base_compute == "bf16" for m in layers if m not in big)
    assert fp8_cache_nbytes(model) == sum(Fp8Weight.bytes_for(m.out_features, m.in_features) for m in big)


def test_build_policy_keeps_a_bf16_base_in_bf16_under_auto_and_fp8(tiny_model_dir: Path) -> None:
    """One recipe (or `qerl bench e2e --base-compute fp8`) serves the BF16 arm of a comparison too; the
    CPU's refusal of fp8 for a 4-bit base is resolve_base_compute's (above)."""
    from qerl_cli.rl.policy import build_policy

    cfg = TrainConfig()
    cfg.model.path, cfg.model.dtype, cfg.train.device = str(tiny_model_dir), "float32", "cpu"
    cfg.lora.rank = 4
    assert build_policy(cfg).base_compute == "bf16"
    cfg.train.base_compute = "fp8"
    assert build_policy(cfg).base_compute == "bf16"


def test_base_compute_is_validated(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: m}\ntrain: {base_compute: fp16}\n")
    with pytest.raises(QerlError, match="train.base_compute"):
        load_config(TrainConfig, recipe)
    assert load_config(TrainConfig, recipe, ["train.base_compute=fp8"]).train.base_compute == "fp8"
    with pytest.raises(QerlError, match=r"train.base_compute must be auto, bf16 or fp8.*got 'fp16'"):
        TrainSection(base_compute="fp16").validate("train")  # type: ignore[arg-type]


def test_the_memory_plan_counts_the_copies() -> None:
    from qerl_cli.modeling.model_shape import ModelShape
    from qerl_cli.rl.memory import plan_memory

    shape = ModelShape(hidden=128, intermediate=384, layers=2, heads=4, kv_heads=2, vocab=320, head_dim=32)
    common = dict(shape=shape, fmt="nvfp4", lora_rank=4, lora_targets=["q_proj"], seq_len=64,
                  sequences_per_step=8, micro_batch="auto", checkpointing="auto", gpu_memory_utilization=0.3,
                  logprob_chunk=0, total_bytes=None, free_bytes=None, engine="hf")  # fmt: skip
    plain = plan_memory(**common).figures
    counted = plan_memory(**common, static_extra_bytes=2**30).figures
    assert counted["memory/trainer_static_estimate_gib"] == pytest.approx(
        plain["memory/trainer_static_estimate_gib"] + 1
    )
    assert counted["memory/fp8_base_copies_gib"] == 1


def test_projections_sharing_an_input_round_it_once(monkeypatch) -> None:
    """q/k/v (and gate/up) take the same x: it is rounded once, again only after an in-place write,
    never kept alive by the cache, and the cache is dropped when backward starts."""
    fp8_update._LastInput.clear()
    layers = [layer("nvfp4", 32, 64) for _ in range(3)]
    for q in layers:
        set_base_compute(q, "fp8")
        q.fp8_weight()  # derived before counting the roundings of activations
    calls = []
    real = fp8_update.quantize_rows
    monkeypatch.setattr(fp8_update, "quantize_rows", lambda t: calls.append(t.shape) or real(t))
    x = torch.randn(2, 5, 64, requires_grad=True)
    h = x * 1.0  # a non-leaf activation, as a norm's output
    outs = [q(h) for q in layers]
    assert len(calls) == 1
    for q, out in zip(layers, outs, strict=True):  # the shared rounding is the right one
        fp8 = q.fp8_weight()
        want = emulated_mm(*real(h.detach()), fp8.rows, fp8.row_scale, h.dtype)
        assert torch.equal(out, want.reshape(out.shape))
    with torch.no_grad():
        h.mul_(2.0)  # a new version: rounded anew
        layers[0](h)
    assert len(calls) == 2
    other = h.clone()
    layers[1](other)  # another tensor of the same contents: rounded anew
    assert len(calls) == 3 and fp8_update._LastInput.rounded is not None
    sum(o.sum() for o in outs).backward()  # (h changed in place after use: nothing saved it)
    assert fp8_update._LastInput.rounded is None
    y = torch.randn(3, 64)
    layers[0](y)
    assert fp8_update._LastInput.rounded is not None
    del y  # the cache holds no reference to its input; its codes go with it
    assert fp8_update._LastInput.rounded is None


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_scaled_mm_matches_the_emulation_on_the_gpu() -> None:
    """torch._scaled_mm (row-wise scales, BF16 out) against the same FP8 codes multiplied in float32:
    only the accumulation order and the BF16 rounding of the output differ."""
    if not has_fp8_tensor_cores(torch.device("cuda")):
        pytest.skip("needs FP8 tensor cores (compute capability >= 8.9)")
    q = layer("nvfp4", 384, 512).cuda()
    x, dy = (t.cuda().to(torch.bfloat16) for t in inputs(384, 512))
    x.requires_grad_(True)
    set_base_compute(q, "fp8")
    y = q(x)
    y.backward(dy)
    fp8 = q.fp8_weight()
    want_y = emulated_mm(*quantize_rows(x.detach()), fp8.rows, fp8.row_scale, torch.float32)
    want_dx = emulated_mm(*quantize_rows(dy), fp8.cols, fp8.col_scale, torch.float32)
    assert row_error(y.float(), want_y.double()) < 1e-2  # BF16 output: 2^-9 relative per element
    assert row_error(x.grad.float(), want_dx.double()) < 1e-2
    w = q.dequantized_weight(torch.float32).double()
    assert row_error(y.float(), x.detach().double() @ w.t()) < ROW_BOUND
    # Under the update's autocast too (rl.policy.lora_compute), and with a ragged token count.
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = q(x[:, :7])
    assert (
        out.dtype == torch.bfloat16
        and row_error(out.float(), want_y.reshape(2, 33, -1)[:, :7].double()) < 1e-2
    )

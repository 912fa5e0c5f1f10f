"""AQN schedule values (hand-computed and against the reference code's rule) and norm noising."""

import math

import pytest
import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.modeling.aqn import NormNoiser, perturb_norm_weights
from qerl_cli.rl.aqn_schedule import AQNSchedule

# ---------------------------------------------------------------- schedules


def test_stages_split_training_into_equal_parts() -> None:
    s = AQNSchedule(total_steps=100)  # 10 stages of 10 steps
    assert [s.stage(t) for t in (0, 9, 10, 19, 50, 99, 100, 150)] == [0, 0, 1, 1, 5, 9, 9, 9]
    with pytest.raises(QerlError):
        s.stage(-1)


def test_exponential_schedule_values() -> None:
    s = AQNSchedule(total_steps=100)
    assert all(s.sigma(t) == 0.0 for t in range(10))  # stage 0 is noise-free
    # Stage k >= 1: 1e-2 * (1e-4 / 1e-2) ** ((k - 1) / 8)
    assert s.sigma(10) == pytest.approx(1e-2)
    assert s.sigma(30) == pytest.approx(1e-2 * 10**-0.5)  # k = 3: (1e-2) ** (2/8) = 10**-0.5
    assert s.sigma(50) == pytest.approx(1e-3)  # k = 5: halfway in log space
    assert s.sigma(99) == pytest.approx(1e-4)


def test_exponential_schedule_matches_reference_rule() -> None:
    """NVlabs/QeRL: sigma_trend = start * (end/start) ** (arange(K-1) / (K-2)) and
    interval = int(step // (total / K)), 0 -> no noise, else sigma_trend[min(interval-1, K-2)].
    (Restated from its description; equal to ours whenever K divides total_steps.)"""
    for total, k_stages in ((100, 10), (600, 10), (64, 8)):
        s = AQNSchedule(total_steps=total, num_stages=k_stages, sigma_start=5e-2, sigma_end=5e-4)
        trend = [5e-2 * (5e-4 / 5e-2) ** (i / (k_stages - 2)) for i in range(k_stages - 1)]
        for step in range(total + 5):
            interval = int(min(step, total) // (total / k_stages))
            expected = 0.0 if interval == 0 else trend[min(interval - 1, k_stages - 2)]
            assert s.sigma(step) == pytest.approx(expected, rel=1e-12), (total, step)


def test_linear_cosine_logarithmic_values() -> None:
    lin = AQNSchedule(total_steps=100, kind="linear")
    cos = AQNSchedule(total_steps=100, kind="cosine")
    log = AQNSchedule(total_steps=100, kind="logarithmic")
    for s in (lin, cos, log):
        assert s.sigma(5) == 0.0
        assert s.sigma(10) == pytest.approx(1e-2) and s.sigma(90) == pytest.approx(1e-4)
    # Stage 3 is u = 2/8 = 0.25 of the way; stage 5 is u = 0.5.
    assert lin.sigma(30) == pytest.approx(1e-2 - 9.9e-3 * 0.25)  # 7.525e-3
    assert lin.sigma(50) == pytest.approx(5.05e-3)
    assert cos.sigma(30) == pytest.approx(1e-2 - 9.9e-3 * (1 - math.cos(math.pi / 4)) / 2)  # 8.550e-3
    assert cos.sigma(50) == pytest.approx(5.05e-3)
    # Logarithmic: fraction ln(k) / ln(9) at stage k; stage 3 is exactly halfway.
    assert log.sigma(30) == pytest.approx(5.05e-3)
    assert log.sigma(20) == pytest.approx(1e-2 - 9.9e-3 * math.log(2) / math.log(9))


@pytest.mark.parametrize("kind", ["exponential", "linear", "cosine", "logarithmic"])
def test_every_schedule_decays_monotonically(kind: str) -> None:
    sigmas = AQNSchedule(total_steps=100, kind=kind).stage_sigmas()
    assert sigmas[0] == 0.0
    assert all(a > b for a, b in zip(sigmas[1:-1], sigmas[2:], strict=True))


def test_without_noise_free_first_stage() -> None:
    s = AQNSchedule(total_steps=100, first_stage_noise_free=False)
    assert s.sigma(0) == pytest.approx(1e-2)
    assert s.sigma(30) == pytest.approx(1e-2 * 1e-2 ** (3 / 9))
    assert s.sigma(99) == pytest.approx(1e-4)
    # Two stages, the first noise-free: the one noisy stage uses sigma_start.
    assert AQNSchedule(total_steps=10, num_stages=2).stage_sigmas() == [0.0, 1e-2]


def test_schedule_validation() -> None:
    with pytest.raises(QerlError, match="schedule"):
        AQNSchedule(total_steps=10, kind="step")
    with pytest.raises(QerlError, match="num_stages"):
        AQNSchedule(total_steps=10, num_stages=1)
    with pytest.raises(QerlError, match="aqn.sigma_end must be > 0 with aqn.schedule=exponential"):
        AQNSchedule(total_steps=10, sigma_end=0.0)
    assert AQNSchedule(total_steps=10, kind="linear", sigma_end=0.0).sigma(9) == 0.0


@pytest.mark.parametrize(
    ("start", "end", "needle"),
    [
        (-1e-3, 1e-4, "aqn.sigma_start must be a finite number > 0"),
        (math.nan, 1e-4, "aqn.sigma_start must be a finite number > 0"),
        (1e-2, math.inf, "aqn.sigma_end must be a finite number >= 0"),
        (1e-2, 1e-1, "aqn.sigma_end must be <= aqn.sigma_start"),
    ],
)
def test_the_schedule_holds_every_sigma_to_the_recipes_rule(start: float, end: float, needle: str) -> None:
    """Built, calibrated or restored from a checkpoint, the schedule refuses what the recipe refuses
    (config.checks.aqn_sigmas), with the same message naming the recipe key."""
    with pytest.raises(QerlError, match=needle):
        AQNSchedule(total_steps=10, sigma_start=start, sigma_end=end)
    restored = AQNSchedule(total_steps=10)
    with pytest.raises(QerlError, match=needle):
        restored.load_state_dict({"sigma_start": start, "sigma_end": end})


@pytest.mark.parametrize("found", [0.0, -1e-3, math.nan, math.inf])
def test_a_calibrated_sigma_is_checked_before_the_schedule_changes(found: float) -> None:
    schedule = AQNSchedule(total_steps=10, sigma_start=1e-2, sigma_end=1e-4)
    with pytest.raises(QerlError, match="aqn.sigma_start must be a finite number > 0"):
        schedule.calibrate(found)
    assert (schedule.sigma_start, schedule.sigma_end, schedule.calibrated) == (1e-2, 1e-4, False)


@pytest.mark.parametrize("sigma", [-1e-3, math.nan, math.inf])
def test_the_noise_refuses_a_sigma_that_is_not_finite_and_non_negative(sigma: float) -> None:
    needle = "AQN sigma must be a finite number >= 0"
    with pytest.raises(QerlError, match=needle):
        NormNoiser(Toy(dim=8)).apply(sigma)
    with pytest.raises(QerlError, match=needle):
        perturb_norm_weights({"w": torch.ones(4)}, sigma)


def test_schedule_state_round_trip() -> None:
    saved = AQNSchedule(total_steps=100, kind="cosine", sigma_start=5e-2, num_stages=5).state_dict()
    restored = AQNSchedule(total_steps=7)
    restored.load_state_dict(saved)
    assert restored == AQNSchedule(total_steps=100, kind="cosine", sigma_start=5e-2, num_stages=5)
    with pytest.raises(QerlError, match="unknown keys"):
        restored.load_state_dict({"total_steps": 5, "bogus": 1})


# ---------------------------------------------------------------- norm noising


class ToyRMSNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim, dtype=dtype) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Toy(nn.Module):
    def __init__(self, dim: int = 4096) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ToyRMSNorm(dim), ToyRMSNorm(dim)])
        self.ln = nn.LayerNorm(dim)  # not an RMSNorm: must stay untouched
        self.final = ToyRMSNorm(dim)


def _norm_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([model.blocks[0].weight, model.blocks[1].weight, model.final.weight]).detach().clone()


def test_apply_perturbs_each_channel_once_and_never_accumulates() -> None:
    model = Toy()
    clean = _norm_weights(model)
    ln_clean = model.ln.weight.detach().clone()
    noiser = NormNoiser(model)
    assert noiser.num_modules == 3

    assert noiser.apply(0.1, torch.Generator().manual_seed(0)) == 3
    first = _norm_weights(model) - clean
    assert first.std().item() == pytest.approx(0.1, rel=0.05)
    assert torch.equal(model.ln.weight, ln_clean)

    # A second apply redraws from the clean copy: the distance from clean is one draw (std 0.1),
    # not two accumulated draws (std 0.1 * sqrt(2) = 0.141).
    noiser.apply(0.1, torch.Generator().manual_seed(1))
    second = _norm_weights(model) - clean
    assert second.std().item() == pytest.approx(0.1, rel=0.05)
    clean_dict = {"a": clean[:4096], "b": clean[4096:8192], "c": clean[8192:]}
    expected = perturb_norm_weights(clean_dict, 0.1, torch.Generator().manual_seed(1))
    assert torch.equal(_norm_weights(model), torch.cat(list(expected.values())))

    noiser.restore()
    assert torch.equal(_norm_weights(model), clean)
    assert not noiser.is_noised


def test_noised_context_restores_even_on_error() -> None:
    model = Toy(dim=64)
    clean = _norm_weights(model)
    noiser = NormNoiser(model)
    with noiser.noised(0.01, torch.Generator().manual_seed(0)) as n:
        assert n == 3 and not torch.equal(_norm_weights(model), clean)
    assert torch.equal(_norm_weights(model), clean)
    with pytest.raises(ValueError), noiser.noised(0.01):
        raise ValueError("generation failed")
    assert torch.equal(_norm_weights(model), clean)


def test_zero_sigma_is_clean_and_trainable_norms_are_picked_up() -> None:
    model = Toy(dim=64)
    noiser = NormNoiser(model)
    noiser.apply(0.01)
    assert noiser.apply(0.0) == 0 and not noiser.is_noised
    # The norms changed between rollouts (trainable norms): the next clean copy is the new weight.
    with torch.no_grad():
        model.final.weight.add_(1.0)
    updated = _norm_weights(model)
    noiser.apply(0.01)
    noiser.restore()
    assert torch.equal(_norm_weights(model), updated)


def test_fails_loudly_when_no_norm_matches() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    noiser = NormNoiser(model)
    assert noiser.apply(0.0) == 0  # nothing to do, nothing wrong
    with pytest.raises(QerlError, match="no RMSNorm"):
        noiser.apply(0.01)
    # A predicate can select other norms.
    custom = NormNoiser(model, predicate=lambda name, m: isinstance(m, nn.LayerNorm))
    assert custom.apply(0.01) == 1
    with pytest.raises(QerlError, match=">= 0"):
        custom.apply(-1.0)


def test_qwen2_model_norms_are_found_and_restored_exactly() -> None:
    from qerl_cli.modeling.tiny import build_tiny_model

    model = build_tiny_model(seed=0).eval()
    noiser = NormNoiser(model)
    # Two norms per decoder layer plus the final norm.
    assert noiser.num_modules == 2 * model.config.num_hidden_layers + 1
    ids = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        clean_logits = model(ids).logits
        with noiser.noised(0.05, torch.Generator().manual_seed(0)):
            noisy_logits = model(ids).logits
        restored_logits = model(ids).logits
    assert not torch.allclose(clean_logits, noisy_logits)
    assert torch.equal(clean_logits, restored_logits)


def test_perturb_norm_weights_is_pure_and_deterministic() -> None:
    clean = {"x": torch.ones(256), "y": torch.ones(8, dtype=torch.bfloat16)}
    a = perturb_norm_weights(clean, 0.02, torch.Generator().manual_seed(3))
    b = perturb_norm_weights(clean, 0.02, torch.Generator().manual_seed(3))
    assert all(torch.equal(a[k], b[k]) for k in clean)
    assert torch.equal(clean["x"], torch.ones(256))
    assert a["y"].dtype == torch.bfloat16 and list(a) == ["x", "y"]


def test_bf16_rounding_swallows_tiny_sigmas() -> None:
    """bf16 spacing around 1.0 is 2**-8 .. 2**-7: sigma 1e-4 changes (almost) nothing, 1e-2 does."""
    model = Toy(dim=4096)
    for norm in (model.blocks[0], model.blocks[1], model.final):
        norm.weight.data = torch.ones(4096, dtype=torch.bfloat16)
    noiser = NormNoiser(model)
    noiser.apply(1e-4, torch.Generator().manual_seed(0))
    assert noiser.last_changed_fraction < 0.01
    noiser.apply(1e-2, torch.Generator().manual_seed(0))
    assert noiser.last_changed_fraction > 0.5


# ---------------------------------------------------------------- Gemma norms: scale 1 + w


def _tiny_gemma3() -> nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=8, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config).eval()  # norms initialised at 0, as Gemma's are: scale exactly 1


def test_gemma3_norms_are_found_and_noise_lands_on_the_scale_one_plus_w() -> None:
    model = _tiny_gemma3()
    noiser = NormNoiser(model)
    # Per layer: input, post-attention, pre- and post-feedforward norms, q_norm and k_norm; plus the final.
    assert noiser.num_modules == 6 * model.config.num_hidden_layers + 1
    assert all(type(m).__name__ == "Gemma3RMSNorm" for m in noiser.modules.values())
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(3, 32)
    normalized = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    ids = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        clean_logits = model(ids).logits
        assert torch.allclose(norm(x), normalized, atol=1e-6)  # stored 0: scale 1
        with noiser.noised(0.05, torch.Generator().manual_seed(0)):
            z = norm.weight.detach().clone()  # clean is 0, so the stored weight is the noise itself
            assert 0.03 < float(z.std()) < 0.07
            # The norm now scales channel c by 1 + z_c: additive noise on the scale it applies,
            # as the paper's w + z on a Qwen norm (a multiplicative w * (1 + z) would leave 0 unchanged).
            assert torch.allclose(norm(x), normalized * (1.0 + z), atol=1e-6)
            noisy_logits = model(ids).logits
        assert torch.equal(model(ids).logits, clean_logits)  # restored exactly
    assert not torch.allclose(noisy_logits, clean_logits)
    assert all(float(m.weight.detach().abs().max()) == 0.0 for m in noiser.modules.values())


class GemmaRMSNorm(nn.Module):
    """Shaped like vLLM 0.26's GemmaRMSNorm: weight zeros(hidden), forward x * (1 + w) in float32."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=torch.bfloat16))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return x * (self.weight.float() + 1.0)


class VLLMRMSNorm(nn.Module):
    """vLLM's RMSNorm built with has_weight=False: a plain ones tensor, never perturbed."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.has_weight = False
        self.weight = torch.ones(size)


def _fake_vllm_gemma3(layers: int = 2, hidden: int = 16, head_dim: int = 8) -> nn.Module:
    """vLLM's Gemma3ForCausalLM module tree: model.layers[i].{self_attn.{q,k}_norm, 4 norms}, model.norm."""
    root, model = nn.Module(), nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(layers):
        layer, attn = nn.Module(), nn.Module()
        attn.qkv_proj = nn.Linear(hidden, 3 * hidden)
        attn.q_norm, attn.k_norm = GemmaRMSNorm(head_dim), GemmaRMSNorm(head_dim)
        layer.self_attn = attn
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, GemmaRMSNorm(hidden))
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            setattr(layer, name, GemmaRMSNorm(hidden))
        layer.unweighted = VLLMRMSNorm(hidden)
        model.layers.append(layer)
    model.norm = GemmaRMSNorm(hidden)
    root.model = model
    return root


def test_vllm_worker_perturbs_gemma_norms_on_their_effective_scale() -> None:
    from qerl_cli.rollout.vllm_worker import CLEAN_NORMS_ATTR, worker_count_norms, worker_set_norm_noise

    model = _fake_vllm_gemma3()
    assert worker_count_norms(model) == 6 * 2 + 1  # the has_weight=False norm is skipped
    count, changed = worker_set_norm_noise(model, sigma=0.02, seed=7)
    # bf16 spacing near 0 is fine: (nearly) every element of a Gemma norm keeps its noise.
    assert count == 13 and changed > 0.99
    final = model.model.norm
    z = final.weight.detach().float().clone()
    assert 0.01 < float(z.std()) < 0.04
    x = torch.randn(4, 16)
    normalized = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(final(x), normalized * (1.0 + z), atol=1e-6)  # scale 1 + w + z
    assert torch.equal(model.model.layers[0].unweighted.weight, torch.ones(16))
    again, _ = worker_set_norm_noise(model, sigma=0.02, seed=7)  # redrawn from the clean copy
    assert again == 13 and torch.equal(final.weight.float(), z)
    assert worker_set_norm_noise(model, sigma=0.0, seed=0) == (0, 0.0)
    assert all(float(w.abs().max()) == 0 for w in getattr(model, CLEAN_NORMS_ATTR).values())
    assert float(final.weight.detach().abs().max()) == 0.0

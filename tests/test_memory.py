"""The colocated-training memory plan (rl.memory) on given model sizes, and chunked logprobs
(rl.logprobs) against the full-logits ones, values and gradients, on the tiny model."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from qerl_cli.config import LORA_TARGETS_ALL, TrainConfig, load_config
from qerl_cli.errors import QerlError
from qerl_cli.modeling.random_checkpoint import SHAPES
from qerl_cli.rl import memory as mem
from qerl_cli.rl.logprobs import LinearLogprob, head_and_decoder
from qerl_cli.rl.policy import completion_logprobs, make_token_batch

GIB = 2**30
# What a process sees on an H200 capped to an H100's 80 GB by a ballast allocation: the driver's
# total stays 141 GB (vLLM's utilization is a fraction of it), the free memory is the cap.
H200_TOTAL = int(139.8 * GIB)
H100_FREE = int(79.2 * GIB)


def shape(name: str) -> mem.ModelShape:
    return mem.ModelShape.from_config(SHAPES[name])


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------
def test_weight_bytes_match_the_real_checkpoints() -> None:
    # Qwen2.5-7B-Instruct in BF16 is 15.2 GB on the hub; the 32B NVFP4 random checkpoint ~20 GB.
    assert mem.weight_bytes(shape("qwen2.5-7b"), "bf16") == pytest.approx(15.23e9, rel=0.01)
    assert mem.weight_bytes(shape("qwen2.5-32b"), "bf16") == pytest.approx(65.5e9, rel=0.01)
    assert mem.weight_bytes(shape("qwen2.5-32b"), "nvfp4") == pytest.approx(20.7e9, rel=0.02)
    seven = shape("qwen2.5-7b")
    assert mem.weight_bytes(seven, "nvfp4") < mem.weight_bytes(seven, "bf16") / 2.5
    with pytest.raises(QerlError, match="unknown weight format"):
        mem.weight_bytes(shape("qwen2.5-7b"), "int3")


def test_lora_and_static_bytes() -> None:
    s = shape("qwen2.5-32b")
    # r x (in + out) per projection and layer: 1.69M per layer for rank 16 on all seven.
    assert s.lora_params(16, LORA_TARGETS_ALL) == 64 * 16 * (
        (5120 + 5120) * 2 + (5120 + 1024) * 2 + (5120 + 27648) * 3
    )
    static = mem.trainer_static_bytes(s, "nvfp4", 16, LORA_TARGETS_ALL)
    assert static - mem.weight_bytes(s, "nvfp4") == s.lora_params(16, LORA_TARGETS_ALL) * 16
    assert s.kv_bytes_per_token() == 2 * 64 * 8 * 128 * 2
    assert s.kv_bytes_per_token("fp8") * 2 == s.kv_bytes_per_token()


def test_activations_checkpointing_and_chunks() -> None:
    s = shape("qwen2.5-7b")
    full = mem.update_activation_bytes(s, "bf16", 8, 2304, checkpointing=False)
    ckpt = mem.update_activation_bytes(s, "bf16", 8, 2304, checkpointing=True)
    assert ckpt < full / 5  # every layer's activations vs its input only
    unchunked = mem.update_activation_bytes(s, "bf16", 8, 2304, checkpointing=True, logprob_chunk=0)
    # Full float32 logits of 8 x 2304 tokens x 152k vocab, three times: about 31 GiB more.
    assert (unchunked - ckpt) / GIB == pytest.approx(3 * 4 * 152064 * (8 * 2304 - 1024) / GIB, rel=0.01)
    assert mem.update_activation_bytes(s, "nvfp4", 1, 100, checkpointing=True) > mem.update_activation_bytes(
        s, "bf16", 1, 100, checkpointing=True
    )  # the dequantized weight tile


# --------------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------------
def test_auto_micro_batch_prefers_no_checkpointing_when_a_big_enough_batch_fits() -> None:
    s = shape("qwen2.5-7b")
    roomy = mem.choose_micro_batch(s, "nvfp4", 2304, 120 * GIB, max_micro_batch=128)
    assert not roomy.gradient_checkpointing and roomy.micro_batch_size * 2304 >= mem.SATURATING_TOKENS
    assert roomy.activation_bytes <= 120 * GIB
    # Too little room for 2 sequences without checkpointing: checkpointing, and a larger micro-batch.
    tight = mem.choose_micro_batch(s, "nvfp4", 2304, 12 * GIB, max_micro_batch=128)
    assert tight.gradient_checkpointing and tight.micro_batch_size >= 2
    # The largest that fits: one more sequence would not.
    over = mem.update_activation_bytes(s, "nvfp4", tight.micro_batch_size + 1, 2304, checkpointing=True)
    assert over > 12 * GIB
    # Never more than the step's sequences.
    assert mem.choose_micro_batch(s, "nvfp4", 2304, 120 * GIB, max_micro_batch=2).micro_batch_size == 2


def test_given_micro_batch_and_checkpointing_are_kept_or_refused() -> None:
    s = shape("qwen2.5-7b")
    kept = mem.choose_micro_batch(s, "bf16", 2304, 60 * GIB, max_micro_batch=128, micro_batch=2,
                                  checkpointing=True)  # fmt: skip
    assert (kept.micro_batch_size, kept.gradient_checkpointing) == (2, True)
    with pytest.raises(QerlError, match=r"one micro-batch of 64 x 2304 tokens needs about .* GiB"):
        mem.choose_micro_batch(
            s, "bf16", 2304, 60 * GIB, max_micro_batch=128, micro_batch=64, checkpointing=False
        )
    with pytest.raises(QerlError, match="even with gradient checkpointing"):
        mem.choose_micro_batch(s, "bf16", 100_000, 1 * GIB, max_micro_batch=8)


def test_vllm_share_comes_from_free_memory_not_total() -> None:
    need = 30 * GIB
    share = mem.vllm_memory_share(H200_TOTAL, 60 * GIB, need, margin_bytes=2 * GIB)
    assert share * H200_TOTAL == pytest.approx(58 * GIB, abs=0.15 * GIB)  # 1/1000 steps of the total
    assert share * H200_TOTAL <= 58 * GIB  # rounded down: vLLM refuses a share above what is free
    with pytest.raises(QerlError) as info:
        mem.vllm_memory_share(H200_TOTAL, 20 * GIB, need, margin_bytes=2 * GIB)
    message = str(info.value)
    assert "30.0 GiB" in message and "20.0 GiB" in message and "139.8 GiB" in message


def _plan(name: str, fmt: str, total: int, free_cap: int, **kw) -> mem.MemoryPlan:
    s = shape(name)
    free = None if free_cap is None else free_cap - mem.trainer_static_bytes(s, fmt, 16, LORA_TARGETS_ALL)
    args = dict(shape=s, fmt=fmt, lora_rank=16, lora_targets=LORA_TARGETS_ALL, seq_len=256 + 2048,
                sequences_per_step=128, micro_batch="auto", checkpointing="auto",
                gpu_memory_utilization="auto", logprob_chunk=1024, total_bytes=total, free_bytes=free,
                engine="vllm")  # fmt: skip
    args.update(kw)
    return mem.plan_memory(**args)


def test_32b_nvfp4_plan_on_an_80gb_cap() -> None:
    plan = _plan("qwen2.5-32b", "nvfp4", H200_TOTAL, H100_FREE, seq_len=1024 + 4096)
    s = shape("qwen2.5-32b")
    vllm_budget = plan.gpu_memory_utilization * H200_TOTAL
    assert vllm_budget >= mem.vllm_min_bytes(s, "nvfp4", 5120)
    free = plan.figures["memory/free_after_trainer_gib"] * GIB
    assert vllm_budget <= free - mem.DEFAULT_MARGIN
    assert plan.gradient_checkpointing  # 32B activations at 5120 tokens need it within ~55 GiB
    activations = plan.figures["memory/activation_estimate_gib"] * GIB
    assert activations <= free - mem.VLLM_ASLEEP_RESERVE - mem.DEFAULT_MARGIN
    # KV room for a few dozen 5120-token sequences at once.
    kv_tokens = (vllm_budget - mem.weight_bytes(s, "nvfp4") - mem.VLLM_OVERHEAD) / s.kv_bytes_per_token()
    assert kv_tokens > 20 * 5120


def test_72b_nvfp4_plan_on_one_h200_at_bigmath_lengths() -> None:
    """bigmath_72b's plan: one H200, 1024 + 4096 tokens, every setting on auto (not yet run on a GPU)."""
    from qerl_cli.config.loading import load_config
    from qerl_cli.config.sections import TrainConfig

    recipe = load_config(TrainConfig, "bigmath_72b", [])
    seq_len = recipe.rollout.max_prompt_length + recipe.rollout.max_completion_length
    plan = _plan("qwen2.5-72b", "nvfp4", H200_TOTAL, H200_TOTAL - GIB, seq_len=seq_len)
    s = shape("qwen2.5-72b")
    vllm_budget = plan.gpu_memory_utilization * H200_TOTAL
    assert plan.figures["memory/trainer_static_estimate_gib"] < 50  # 41.4 GiB of NVFP4 weights, LoRA, Adam
    assert plan.gradient_checkpointing and plan.micro_batch_size >= 1
    assert vllm_budget <= plan.figures["memory/free_after_trainer_gib"] * GIB - mem.DEFAULT_MARGIN
    # vLLM holds its own NVFP4 copy and KV room for at least 16 full-length sequences at once.
    kv_tokens = (vllm_budget - mem.weight_bytes(s, "nvfp4") - mem.VLLM_OVERHEAD) / s.kv_bytes_per_token()
    assert kv_tokens > 16 * seq_len
    with pytest.raises(QerlError):  # and it does not fit an 80 GB GPU
        _plan("qwen2.5-72b", "nvfp4", H200_TOTAL, H100_FREE, seq_len=seq_len)


def test_32b_bf16_does_not_fit_on_80gb_and_says_why() -> None:
    with pytest.raises(QerlError, match=r"it needs at least \d+\.\d GiB"):
        _plan("qwen2.5-32b", "bf16", H200_TOTAL, H100_FREE)


def test_7b_plans_on_80_and_141_gb() -> None:
    small = _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H100_FREE)
    large = _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL - GIB)
    assert large.gpu_memory_utilization > small.gpu_memory_utilization
    assert large.micro_batch_size >= small.micro_batch_size
    bf16 = _plan("qwen2.5-7b", "bf16", H200_TOTAL, H100_FREE)
    assert bf16.gpu_memory_utilization < small.gpu_memory_utilization  # BF16 weights leave vLLM less
    fixed = _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H100_FREE, gpu_memory_utilization=0.3, micro_batch=4,
                  checkpointing=True)  # fmt: skip
    assert fixed.gpu_memory_utilization == 0.3
    assert (fixed.micro_batch_size, fixed.gradient_checkpointing) == (4, True)


def test_cpu_plan_keeps_recipe_values() -> None:
    plan = _plan("qwen2.5-7b", "bf16", None, None, sequences_per_step=6)  # type: ignore[arg-type]
    assert (plan.micro_batch_size, plan.gradient_checkpointing, plan.gpu_memory_utilization) == (6, True, 0.3)


def test_gpu_fraction_plans_within_its_slice() -> None:
    s = shape("qwen2.5-7b")
    static = mem.trainer_static_bytes(s, "nvfp4", 16, LORA_TARGETS_ALL)
    whole = _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL - GIB)
    # f = 1: the measured free memory, exactly as without the setting (what the process holds is unused).
    same = _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL - GIB, gpu_fraction=1.0, used_bytes=static)
    assert same == whole and "memory/gpu_fraction" not in whole.figures
    # f = 0.5: free is half the GPU less what the trainer holds, whatever the device reports free.
    half = _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL - GIB, gpu_fraction=0.5, used_bytes=static)
    slice_bytes = int(H200_TOTAL * 0.5)
    assert half.figures["memory/free_after_trainer_gib"] * GIB == pytest.approx(slice_bytes - static)
    assert half.figures["memory/gpu_slice_gib"] * GIB == pytest.approx(slice_bytes)
    # The same plan as a whole GPU of half the size, with vLLM's share converted to the whole GPU.
    small_gpu = _plan("qwen2.5-7b", "nvfp4", slice_bytes, slice_bytes)
    assert (half.micro_batch_size, half.gradient_checkpointing) == (
        small_gpu.micro_batch_size, small_gpu.gradient_checkpointing,
    )  # fmt: skip
    assert half.gpu_memory_utilization == pytest.approx(small_gpu.gpu_memory_utilization * 0.5, abs=0.001)
    assert half.gpu_memory_utilization < whole.gpu_memory_utilization / 2 + 0.001
    assert half.gpu_memory_utilization * H200_TOTAL <= slice_bytes - static - mem.DEFAULT_MARGIN
    assert half.figures["memory/activation_estimate_gib"] <= whole.figures["memory/activation_estimate_gib"]
    # An explicit share is of the whole GPU: kept up to the fraction, refused above it.
    kept = _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL - GIB, gpu_fraction=0.5, used_bytes=static,
                 gpu_memory_utilization=0.2)  # fmt: skip
    assert kept.gpu_memory_utilization == 0.2
    with pytest.raises(QerlError, match=r"gpu_memory_utilization=0.6 .* train.gpu_fraction=0.5"):
        _plan(
            "qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL - GIB, gpu_fraction=0.5, gpu_memory_utilization=0.6
        )
    # A slice too small for vLLM says so, naming the fraction.
    with pytest.raises(QerlError, match=r"within train.gpu_fraction=0.05"):
        _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL - GIB, gpu_fraction=0.05, used_bytes=0)


def test_gpu_fraction_is_checked() -> None:
    base = ["model.path=x", "rollout.engine=vllm"]
    assert load_config(TrainConfig, None, base).train.gpu_fraction == 1.0
    assert load_config(TrainConfig, None, [*base, "train.gpu_fraction=0.46"]).train.gpu_fraction == 0.46
    for bad in ("0", "-0.1", "1.5"):
        with pytest.raises(QerlError, match=r"train.gpu_fraction must be in \(0, 1\]"):
            load_config(TrainConfig, None, [*base, f"train.gpu_fraction={bad}"])
    with pytest.raises(QerlError, match=r"rollout.gpu_memory_utilization=0.3 .* train.gpu_fraction=0.2"):
        load_config(
            TrainConfig, None, [*base, "train.gpu_fraction=0.2", "rollout.gpu_memory_utilization=0.3"]
        )
    ok = [*base, "train.gpu_fraction=0.2", "rollout.gpu_memory_utilization=auto"]
    assert load_config(TrainConfig, None, ok).rollout.gpu_memory_utilization == "auto"
    hf = ["model.path=x", "rollout.engine=hf", "train.gpu_fraction=0.2", "rollout.gpu_memory_utilization=0.3"]
    assert load_config(TrainConfig, None, hf).train.gpu_fraction == 0.2  # no vLLM, no share to check


def test_fp8_kv_cache_forces_tis(caplog: pytest.LogCaptureFixture) -> None:
    from qerl_cli.rl.setup import tis_enabled

    def tis(*overrides: str, backend: str = "trainer", fmt: str = "bf16") -> bool:
        base = ["model.path=x", "rollout.engine=hf", "aqn.enabled=false"]
        cfg = load_config(TrainConfig, None, [*base, *overrides])
        policy = SimpleNamespace(is_quantized=False, base_format=fmt)
        return tis_enabled(cfg, policy, backend)  # type: ignore[arg-type]

    assert tis() is False  # BF16, HF engine, no noise: the same numerics
    assert tis("rollout.kv_cache_dtype=fp8") is True
    assert tis("rollout.kv_cache_dtype=fp8", "algorithm.tis='off'") is True
    assert "overridden" in caplog.text
    # linear_backend=auto that resolved to the FP8 copy counts like a pinned fp8 (what the engine runs).
    assert tis("algorithm.tis='off'", backend="fp8") is True
    assert tis("algorithm.tis='off'", backend="marlin") is False
    # fp8-merged holds FP8 weights for a 4-bit base (forced on), merged BF16 ones for a BF16 base.
    assert tis("algorithm.tis='off'", backend="fp8-merged", fmt="nvfp4") is True
    assert tis("algorithm.tis='off'", backend="fp8-merged", fmt="bf16") is False


def test_auto_values_parse_and_bad_ones_fail() -> None:
    autos = [f"{key}=auto" for key in ("train.micro_batch_size", "train.gradient_checkpointing",
                                       "rollout.gpu_memory_utilization")]  # fmt: skip
    cfg = load_config(TrainConfig, None, ["model.path=x", *autos])
    assert (cfg.train.micro_batch_size, cfg.train.gradient_checkpointing) == ("auto", "auto")
    assert cfg.rollout.gpu_memory_utilization == "auto"
    with pytest.raises(QerlError, match="gpu_memory_utilization must be in"):
        load_config(TrainConfig, None, ["model.path=x", "rollout.gpu_memory_utilization=1.5"])
    with pytest.raises(QerlError, match="micro_batch_size"):
        load_config(TrainConfig, None, ["model.path=x", "train.micro_batch_size=0"])


# --------------------------------------------------------------------------------------------
# Chunked logprobs
# --------------------------------------------------------------------------------------------
def test_linear_logprob_gradients_match_autograd() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w: LinearLogprob.apply(h, w, targets, 0.7, 3), (hidden, weight))
    ref = torch.log_softmax(hidden @ weight.T / 0.7, dim=-1).gather(1, targets[:, None]).squeeze(1)
    assert torch.allclose(LinearLogprob.apply(hidden, weight, targets, 0.7, 2), ref, atol=1e-9)


@pytest.fixture(scope="module")
def lora_tiny(tiny_model_dir):
    from qerl_cli.modeling.lora import attach_lora
    from qerl_cli.rl.policy import load_base_model

    torch.manual_seed(0)
    base, _ = load_base_model(str(tiny_model_dir), "auto", torch.float32, torch.device("cpu"))
    model = attach_lora(base, r=4, alpha=8, dropout=0.0, target_modules=LORA_TARGETS_ALL)
    with torch.no_grad():  # LoRA B starts at zero; make the adapter matter for the gradients
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_chunked_logprobs_equal_full_logits_values_and_gradients(lora_tiny) -> None:
    model = lora_tiny
    assert head_and_decoder(model) is not None
    batch = make_token_batch(
        [[5, 6, 7, 8], [9, 10], [11, 12, 13]],
        [[20, 21, 22, 23, 24], [30, 31], [40]],
        [[0.0] * 5, [0.0] * 2, [0.0]],
        pad_id=0,
    )
    mask = batch.completion_mask
    weights = torch.linspace(-1.0, 2.0, mask.numel()).view_as(mask)
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for chunk in (0, 3, 1):  # full logits, 3-token chunks, one token at a time
        model.zero_grad(set_to_none=True)
        lp = completion_logprobs(model, batch, 0.7, torch.device("cpu"), chunk)
        (lp * mask * weights).sum().backward()
        results.append((lp.detach() * mask, [p.grad.clone() for p in params]))
    (full, full_grads), *chunked = results
    for values, grads in chunked:
        assert torch.allclose(values, full, atol=1e-5)
        for a, b in zip(grads, full_grads, strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert (full != 0).sum() == mask.sum()  # every scored token has a real logprob
    assert any(float(g.abs().sum()) > 0 for g in full_grads)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_materialized_adamw_state_is_what_the_first_step_creates(amsgrad: bool) -> None:
    """The moments exist before the first update (so they are not carved out of the update's
    activation blocks), and training is bit-identical to lazily created state."""
    from qerl_cli.rl.setup import materialize_optimizer_state

    def run(eager: bool) -> tuple[list[torch.Tensor], dict[str, Any]]:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(5))]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, amsgrad=amsgrad)
        if eager:
            materialize_optimizer_state(opt)
            assert all(len(opt.state[p]) == (4 if amsgrad else 3) for p in params)
        for step in range(3):
            for p in params:
                p.grad = torch.sin(p.detach() * (step + 1))
            opt.step()
        return [p.detach().clone() for p in params], opt.state_dict()

    lazy_params, lazy_state = run(eager=False)
    eager_params, eager_state = run(eager=True)
    assert all(torch.equal(a, b) for a, b in zip(lazy_params, eager_params, strict=True))
    for index, state in lazy_state["state"].items():
        other = eager_state["state"][index]
        assert state.keys() == other.keys()
        for key, value in state.items():
            assert value.dtype == other[key].dtype and torch.equal(value, other[key])


def test_a_logit_transform_after_the_head_falls_back_to_full_logits(lora_tiny) -> None:
    """Gemma-style soft-capping happens in ForCausalLM.forward: the chunked path must not skip it."""
    config = lora_tiny.get_base_model().config
    config.final_logit_softcapping = 30.0
    try:
        assert head_and_decoder(lora_tiny) is None
    finally:
        config.final_logit_softcapping = None
    assert head_and_decoder(lora_tiny) is not None


def test_without_sleep_mode_the_update_gets_what_vllm_leaves() -> None:
    gib = mem.GIB
    asleep = _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL, gpu_memory_utilization=0.3)
    awake = _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL, gpu_memory_utilization=0.3, sleep_mode=False)
    # vLLM's 0.3 share stays on the GPU through the update: a smaller micro-batch fits beside it.
    assert awake.micro_batch_size < asleep.micro_batch_size
    assert awake.figures["memory/activation_estimate_gib"] <= (H200_TOTAL * 0.7) / gib
    with pytest.raises(QerlError, match="auto needs rollout.enable_sleep_mode=true"):
        _plan("qwen2.5-7b", "nvfp4", H200_TOTAL, H200_TOTAL, sleep_mode=False)


def test_a_run_sharing_the_gpu_plans_its_update_within_what_vllms_share_leaves_of_its_slice() -> None:
    """What `qerl compare --jobs 3` gives each run (Gemma 3 270M's shape on an H100): train.gpu_fraction
    0.306, sleep mode off, vLLM's share half of it. The update's budget is the slice less the trainer, the
    share (vLLM keeps it through the update) and the margin."""
    gemma = mem.ModelShape(hidden=640, intermediate=2048, layers=18, heads=4, kv_heads=1, vocab=262144,
                           head_dim=256, tie_embeddings=True)  # fmt: skip
    total = int(79.2 * GIB)
    static = mem.trainer_static_bytes(gemma, "bf16", 16, LORA_TARGETS_ALL)
    args = dict(shape=gemma, fmt="bf16", lora_rank=16, lora_targets=LORA_TARGETS_ALL, seq_len=320 + 128,
                sequences_per_step=128, micro_batch="auto", checkpointing="auto", logprob_chunk=1024,
                total_bytes=total, free_bytes=total // 2, engine="vllm", gpu_fraction=0.306,
                used_bytes=static, sleep_mode=False)  # fmt: skip
    plan = mem.plan_memory(gpu_memory_utilization=0.153, **args)
    assert plan.gpu_memory_utilization == 0.153
    budget = int(total * 0.306) - static - int(0.153 * total) - mem.DEFAULT_MARGIN
    assert 0 < plan.figures["memory/activation_estimate_gib"] * GIB <= budget
    with pytest.raises(QerlError, match="auto needs rollout.enable_sleep_mode=true"):
        mem.plan_memory(gpu_memory_utilization="auto", **args)  # why compare gives each run a number


def test_vllms_floor_is_what_its_linear_backend_holds() -> None:
    """vLLM's least memory counts the weights its backend holds, not the checkpoint's: qerl's BF16 block
    scales (one more byte a block of 16), an FP8 copy, a BF16 copy; auto and marlin serve the checkpoint's
    own. A pinned copy that cannot fit beside the trainer says so and what serves the 4-bit weights."""
    s = shape("qwen2.5-32b")
    own = mem.vllm_min_bytes(s, "nvfp4", 5120)
    assert mem.vllm_min_bytes(s, "nvfp4", 5120, backend="auto") == own
    assert mem.vllm_min_bytes(s, "nvfp4", 5120, backend="marlin") == own
    assert mem.vllm_min_bytes(s, "nvfp4", 5120, backend="qerl-triton") == own + int(
        s.decoder_linear_params() / 16
    )
    fp8 = mem.weight_bytes(s, "fp8") - mem.weight_bytes(s, "nvfp4")
    assert mem.vllm_min_bytes(s, "nvfp4", 5120, backend="fp8") == own + fp8
    _plan("qwen2.5-32b", "nvfp4", H200_TOTAL, H100_FREE, seq_len=1024 + 4096)  # marlin's floor fits
    with pytest.raises(
        QerlError, match=r"rollout.linear_backend=merged holds a bf16 copy of the nvfp4 weights"
    ):
        _plan("qwen2.5-32b", "nvfp4", H200_TOTAL, H100_FREE, seq_len=1024 + 4096, rollout_backend="merged")

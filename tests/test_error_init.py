"""The error-compensating LoRA start: the factorisation (EoRA / SVD), ``qerl quantize --lora-init`` on
the tiny model, and training from it (``lora.init``): step 0, the KL reference, rank and alpha
changes, resume, refusals."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from qerl_cli.config import QuantizeConfig, TrainConfig, load_config
from qerl_cli.errors import QerlError
from qerl_cli.modeling import adapter
from qerl_cli.modeling.error_init import (
    INFO_NAME,
    INIT_DIR,
    factorise,
    find_lora_init,
    lora_key,
    read_info,
    weighted_sq_norm,
    whitening,
)
from qerl_cli.quantize import REPORT_NAME, read_report, run_quantize

RANK = 16
SEQ_LEN = 48
NUM_SAMPLES = 3


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """LAPACK's eigh / SVD with two spinning threads on a shared two-core machine ran 100x slower than
    with one (12 s vs 0.09 s for a 384x384 eigh): the tests run single-threaded, results alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------
# The factorisation
# ------------------------------------------------------------------------------------------------
def _correlated_problem(seed: int = 0, out: int = 48, width: int = 96, tokens: int = 2000):
    """An error E and activations X whose covariance has a steep spectrum and rotated axes, as real
    hidden states have (a few directions carry most of the energy)."""
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(width, width, generator=gen, dtype=torch.float64))
    spectrum = torch.logspace(1, -3, width, dtype=torch.float64)
    x = basis @ (spectrum.sqrt()[:, None] * torch.randn(width, tokens, generator=gen, dtype=torch.float64))
    error = torch.randn(out, width, generator=gen, dtype=torch.float64) * 0.05
    return error, x


def _optimal_weighted_error(error: torch.Tensor, x: torch.Tensor, rank: int) -> float:
    """min over rank-r D of ||(E - D) X||_F, dense float64: the tail singular values of E X."""
    sig = torch.linalg.svdvals(error @ x)
    return float(sig[rank:].square().sum().sqrt())


def test_eora_reaches_the_optimal_weighted_error_and_beats_svd() -> None:
    error, x = _correlated_problem()
    rank, scaling = 16, 2.0
    moment = (x @ x.T / x.shape[1]).to(torch.float32)
    a, b = factorise(error.float(), rank, scaling, whitening(moment))
    assert a.shape == (rank, 96) and b.shape == (48, rank) and a.dtype == torch.float32
    eora = float(((error - scaling * (b @ a).double()) @ x).norm())
    a_svd, b_svd = factorise(error.float(), rank, scaling, None)
    svd = float(((error - scaling * (b_svd @ a_svd).double()) @ x).norm())
    base = float((error @ x).norm())
    optimum = _optimal_weighted_error(error, x, rank)
    assert optimum <= eora <= 1.01 * optimum  # damping costs under 1 %
    assert eora < 0.6 * svd and svd < 0.7 * base  # the plain SVD ignores where the activations are
    # The plain SVD is the Frobenius-optimal rank-r approximation.
    sig = torch.linalg.svdvals(error)
    fro = float((error - scaling * (b_svd @ a_svd).double()).norm())
    assert fro == pytest.approx(float(sig[rank:].square().sum().sqrt()), rel=1e-4)


def test_undamped_eora_is_eckart_young_and_weighted_norm_is_the_trace() -> None:
    error, x = _correlated_problem(seed=1, width=64)
    moment = (x @ x.T / x.shape[1]).to(torch.float32)
    a, b = factorise(error.float(), 4, 1.0, whitening(moment, damp=0.0))
    residual = error - (b @ a).double()
    assert float((residual @ x).norm()) == pytest.approx(_optimal_weighted_error(error, x, 4), rel=1e-3)
    # tr(R C R^T) = ||R X||^2 / n
    assert weighted_sq_norm(residual.float(), moment) == pytest.approx(
        float((residual @ x).square().sum()) / x.shape[1], rel=1e-4
    )


def test_components_come_largest_first_and_rank_beyond_the_shape_is_padded() -> None:
    error, x = _correlated_problem(seed=2, out=8, width=32)
    moment = (x @ x.T / x.shape[1]).float()
    a, b = factorise(error.float(), 12, 0.5, whitening(moment))  # min(out, in) = 8 < 12
    assert torch.count_nonzero(a[8:]) == 0 and torch.count_nonzero(b[:, 8:]) == 0
    parts = [float((0.5 * b[:, k : k + 1] @ a[k : k + 1]).double().matmul(x).norm()) for k in range(8)]
    assert parts == sorted(parts, reverse=True)
    # Truncating to the first k components is the best rank-k correction.
    a4, b4 = factorise(error.float(), 4, 0.5, whitening(moment))
    torch.testing.assert_close(0.5 * b[:, :4] @ a[:4], 0.5 * b4 @ a4, atol=1e-5, rtol=1e-4)


def test_whitening_survives_unseen_directions_and_silence() -> None:
    moment = torch.zeros(16, 16)
    moment[:4, :4] = torch.eye(4)  # 12 input channels never active
    white = whitening(moment)
    assert torch.isfinite(white.inverse).all() and float(white.inverse.abs().max()) < 1e2
    torch.testing.assert_close(white.scale @ white.inverse, torch.eye(16), atol=1e-4, rtol=0)
    silent = whitening(torch.zeros(8, 8))  # an input never seen: the plain SVD
    assert torch.equal(silent.scale, torch.eye(8)) and torch.equal(silent.inverse, torch.eye(8))


# ------------------------------------------------------------------------------------------------
# qerl quantize --lora-init
# ------------------------------------------------------------------------------------------------


def _quantize_config(model: Path, out: Path, calib: Path, **overrides) -> QuantizeConfig:
    values = dict(model=str(model), output=str(out), calib=str(calib), num_samples=NUM_SAMPLES,
                  seq_len=SEQ_LEN, device="cpu", format="nvfp4", method="rtn", lora_init="eora",
                  lora_init_rank=RANK)  # fmt: skip
    values.update(overrides)
    return QuantizeConfig(**values)


@pytest.fixture(scope="module")
def eora_base(tmp_path_factory, tiny_model_dir, calib_file) -> Path:
    out = tmp_path_factory.mktemp("eora") / "out"
    run_quantize(_quantize_config(tiny_model_dir, out, calib_file))
    return out


def _kl_to_bf16(bf16: torch.nn.Module, model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        target = torch.log_softmax(bf16(input_ids=ids).logits.float(), -1)
        logq = torch.log_softmax(model.eval()(input_ids=ids).logits.float(), -1)
    return float((target.exp() * (target - logq)).sum(-1).mean())


def _base(path: Path) -> torch.nn.Module:
    from qerl_cli.modeling.loading import load_policy_model

    return load_policy_model(path, torch.float32, "cpu")[0].eval()


def _with_init(path: Path) -> torch.nn.Module:
    return adapter.attach_to_base(_base(path), path / INIT_DIR).eval()


def test_quantize_writes_the_init_and_it_brings_the_base_back_toward_bf16(
    eora_base: Path, tiny_model_dir: Path, calib_file: Path, calib_ids
) -> None:
    from transformers import AutoModelForCausalLM

    folder = eora_base / INIT_DIR
    config = adapter.read_config(folder)
    assert config["r"] == RANK and config["lora_alpha"] == 2 * RANK
    leaves = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert sorted(config["target_modules"]) == leaves
    names = adapter.weight_names(folder)
    assert len(names) == 2 * 14 and lora_key("model.layers.0.self_attn.q_proj", "A") in names
    info = read_info(folder)
    assert info.method == "eora" and info.rank == RANK and info.layers == 14 and info.passes == 1
    assert info.calibration["num_samples"] == NUM_SAMPLES and info.seconds > 0
    assert info.weights_bytes == adapter.weights_file(folder).stat().st_size
    assert info.relative_error_corrected < 0.5 * info.relative_error_base
    assert all(after < before for before, after in info.per_layer.values())

    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = calib_ids
    alone, corrected = _kl_to_bf16(bf16, _base(eora_base), ids), _kl_to_bf16(bf16, _with_init(eora_base), ids)
    assert corrected < 0.5 * alone


def test_the_report_records_the_init_and_round_trips(eora_base: Path) -> None:
    from rich.console import Console

    from qerl_cli.quantize import quantize_table

    on_disk = json.loads((eora_base / REPORT_NAME).read_text())
    result = read_report(eora_base)
    assert json.dumps(result.to_dict()) == json.dumps(on_disk)
    assert list(on_disk)[-2:] == ["lora_init", "source"]
    assert result.lora_init == read_info(eora_base / INIT_DIR)
    assert on_disk["calibration"] is None  # rtn itself is not calibrated; the init's record says what was
    console = Console(record=True, width=200)
    console.print(quantize_table(result))
    assert "LoRA init (eora r16)" in console.export_text()


def test_the_weights_size_is_the_models_not_the_adapters(eora_base: Path) -> None:
    """`--lora-init eora` reported 0.68 MiB (1.3x smaller) against 0.38 MiB (2.4x) without it: the
    weights size counted lora_init/adapter_model.safetensors. The adapter's size is a row of its own."""
    from rich.console import Console

    from qerl_cli.quantize import quantize_table

    shards = sum(p.stat().st_size for p in eora_base.glob("*.safetensors"))
    init_bytes = adapter.weights_file(eora_base / INIT_DIR).stat().st_size
    result = read_report(eora_base)
    assert result.size.weights_bytes == shards and result.size.folder_bytes >= shards + init_bytes
    assert result.lora_init is not None and result.lora_init.weights_bytes == init_bytes
    console = Console(record=True, width=200)
    console.print(quantize_table(result))
    assert "LoRA init adapter size" in console.export_text()


def test_eora_beats_svd_on_calibration_like_text(
    eora_base: Path, tmp_path: Path, tiny_model_dir: Path, calib_file: Path, calib_ids
) -> None:
    """The same 4-bit base, its error factored both ways (the rounding is the same: rtn)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_cli.quantize.calibration import load_calibration
    from qerl_cli.quantize.error_init import build_lora_init
    from qerl_cli.quantize.validate import quantized_linear_names

    svd_base = tmp_path / "svd"
    shutil.copytree(eora_base, svd_base, ignore=shutil.ignore_patterns(INIT_DIR))
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    calib = load_calibration(
        str(calib_file), AutoTokenizer.from_pretrained(tiny_model_dir), num_samples=NUM_SAMPLES,
        seq_len=SEQ_LEN, seed=42,
    )  # fmt: skip
    info = build_lora_init(
        bf16, svd_base, quantized_linear_names(bf16, []), calib.samples, method="svd", rank=RANK,
        base_model="tiny", device=torch.device("cpu"),
    )  # fmt: skip
    eora = read_info(eora_base / INIT_DIR)
    assert info.relative_error_base == pytest.approx(eora.relative_error_base, rel=1e-5)
    assert eora.relative_error_corrected < 0.5 * info.relative_error_corrected  # 0.022 vs 0.080
    assert info.relative_error_corrected < info.relative_error_base
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = calib_ids
    kl_eora = _kl_to_bf16(reference, _with_init(eora_base), ids)
    assert kl_eora < 0.5 * _kl_to_bf16(reference, _with_init(svd_base), ids)  # 1.5e-4 vs 4.4e-4


def test_second_moments_in_several_passes_equal_one_pass(tiny_model_dir: Path) -> None:
    """q/k/v and gate/up share a matrix; a small budget splits the layers over passes (each stopped
    after its last layer) without changing any matrix."""
    from transformers import AutoModelForCausalLM

    from qerl_cli.quantize.error_init import input_groups, plan_passes, second_moments
    from qerl_cli.quantize.validate import quantized_linear_names

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    names = quantized_linear_names(model, [])
    samples = [[5 + i + j for j in range(20)] for i in range(3)]
    groups = input_groups(model, names, samples[0][:8], torch.device("cpu"))
    shared = sorted(sorted(n.rsplit(".", 1)[-1] for n in g.linears) for g in groups if g.layer == 0)
    assert shared == [["down_proj"], ["gate_proj", "up_proj"], ["k_proj", "q_proj", "v_proj"], ["o_proj"]]
    whole = plan_passes(groups, budget=2**30)
    split = plan_passes(groups, budget=1)  # below one layer: one layer a pass
    assert len(whole) == 1 and len(split) == 2 and {g.layer for g in split[1]} == {1}
    moments = second_moments(model, whole[0], samples, "cpu")
    one = dict(zip((g.linears[0] for g in whole[0]), moments, strict=True))
    for group_pass in split:
        for group, moment in zip(group_pass, second_moments(model, group_pass, samples, "cpu"), strict=True):
            torch.testing.assert_close(moment, one[group.linears[0]], atol=1e-6, rtol=1e-5)


def test_nf4_takes_an_init_too(tmp_path: Path, tiny_model_dir: Path, calib_file: Path) -> None:
    """NF4 is written by qerl's own writer and read by the same loader: the init works alike."""
    out = tmp_path / "nf4"
    result = run_quantize(_quantize_config(tiny_model_dir, out, calib_file, format="nf4", lora_init="svd"))
    assert result.lora_init is not None and result.lora_init.method == "svd"
    assert result.lora_init.relative_error_corrected < result.lora_init.relative_error_base


def test_lora_init_refused_with_awq_before_any_work(tmp_path: Path, calib_file: Path) -> None:
    cfg = _quantize_config(tmp_path / "no-such-model", tmp_path / "o", calib_file, method="awq")
    with pytest.raises(QerlError, match="AWQ's smoothing also rescales the norm weights"):
        run_quantize(cfg)  # refused before the missing model is even looked at
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------
# Training from the init (lora.init)
# ------------------------------------------------------------------------------------------------
def _train_config(model: Path, out: Path, *overrides: str) -> TrainConfig:
    return load_config(
        TrainConfig,
        None,
        [
            f"model.path={model}", "model.dtype=float32", "data.dataset=synthetic-addition",
            "data.template=plain", "rollout.num_generations=4", "rollout.max_completion_length=8",
            "rollout.max_prompt_length=64", "train.prompts_per_step=2", "train.max_steps=2",
            "train.micro_batch_size=4", "train.learning_rate=1e-2", "train.device=cpu",
            "train.gradient_checkpointing=false", "lora.init=eora", f"lora.rank={RANK}",
            f"lora.alpha={2 * RANK}", f"output.dir={out}", "output.save_steps=2", "aqn.enabled=false",
            "reward.grader_workers=1", *overrides,
        ],
    )  # fmt: skip


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits.float()
    model.train(was)
    return out


def test_policy_starts_at_base_plus_init_and_the_reference_stays_there(eora_base: Path, tmp_path) -> None:
    from qerl_cli.rl.policy import build_policy

    policy = build_policy(_train_config(eora_base, tmp_path / "run"))
    expected = _logits(_with_init(eora_base))
    torch.testing.assert_close(_logits(policy.model), expected, atol=1e-5, rtol=1e-5)
    with policy.reference():
        torch.testing.assert_close(_logits(policy.model), expected, atol=1e-5, rtol=1e-5)
    with policy.bare_base():
        bare = _logits(policy.model)
    torch.testing.assert_close(bare, _logits(_base(eora_base)), atol=1e-5, rtol=1e-5)
    assert (bare - expected).abs().max() > 1e-2

    # What the vLLM engine stages at its first sync (sync_policy saves the live adapter) is base + init.
    policy.save_adapter(tmp_path / "staged")
    served = adapter.attach_to_base(_base(eora_base), tmp_path / "staged")
    torch.testing.assert_close(_logits(served), expected, atol=1e-5, rtol=1e-5)

    # "Training" moves the adapter; the reference is still the start, and the trained values come back.
    with torch.no_grad():
        for _, param in policy.named_trainable_parameters():
            param.add_(0.05 * torch.randn_like(param))
    trained = _logits(policy.model)
    assert (trained - expected).abs().max() > 1e-2
    with policy.reference():
        torch.testing.assert_close(_logits(policy.model), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_logits(policy.model), trained, atol=0, rtol=0)


def _delta(model: torch.nn.Module, name: str) -> torch.Tensor:
    layer = model.get_submodule(f"base_model.model.{name}")
    return layer.get_delta_weight("default").float()


@pytest.mark.parametrize(("rank", "alpha"), [(32, 16), (RANK, 8), (8, 8)])
def test_other_rank_or_alpha_keeps_the_correction(eora_base: Path, tmp_path, caplog, rank, alpha) -> None:
    """alpha differs: both factors rescaled, same product. A larger rank: zero columns of B behind
    PEFT's random rows of A, same product. A smaller one: the leading components, with a warning."""
    from qerl_cli.rl.policy import build_policy

    cfg = _train_config(eora_base, tmp_path / "run", f"lora.rank={rank}", f"lora.alpha={alpha}")
    with caplog.at_level(logging.WARNING, logger="qerl_cli.rl.policy"):
        policy = build_policy(cfg)
    stored = adapter.read_weights(eora_base / INIT_DIR)
    name = "model.layers.1.mlp.down_proj"
    keep = min(rank, RANK)
    a, b = stored[lora_key(name, "A")][:keep], stored[lora_key(name, "B")][:, :keep]
    torch.testing.assert_close(_delta(policy.model, name), 2.0 * b @ a, atol=1e-6, rtol=1e-4)
    layer = policy.model.get_submodule(f"base_model.model.{name}")
    if rank > RANK:
        assert torch.count_nonzero(layer.lora_B["default"].weight[:, RANK:]) == 0
        assert layer.lora_A["default"].weight[RANK:].abs().sum() > 0  # still trainable directions
    truncated = [r.message for r in caplog.records if "leading components" in r.message]
    assert len(truncated) == (1 if rank < RANK else 0)
    if rank == RANK:
        expected = _logits(_with_init(eora_base))
        torch.testing.assert_close(_logits(policy.model), expected, atol=1e-5, rtol=1e-5)


def test_target_modules_outside_the_init_start_from_zeros(eora_base: Path, tmp_path, caplog) -> None:
    from qerl_cli.rl.policy import build_policy

    cfg = _train_config(eora_base, tmp_path / "run", "lora.target_modules=[q_proj,v_proj]")
    with caplog.at_level(logging.WARNING, logger="qerl_cli.rl.policy"):
        policy = build_policy(cfg)
    warnings = [r.message for r in caplog.records]
    assert sum("leaves out" in w for w in warnings) == 1  # once, not once per layer
    assert _delta(policy.model, "model.layers.0.self_attn.q_proj").abs().max() > 0


def test_missing_or_other_init_is_refused_with_the_command(eora_base: Path, tmp_path: Path) -> None:
    from qerl_cli.rl.policy import build_policy

    bare = tmp_path / "bare"
    shutil.copytree(eora_base, bare, ignore=shutil.ignore_patterns(INIT_DIR))
    with pytest.raises(QerlError, match=r"does not exist.*qerl quantize BF16_MODEL --format nvfp4 "
                       r"--method gptq --lora-init eora --lora-init-rank 16"):  # fmt: skip
        build_policy(_train_config(bare, tmp_path / "run"))
    other = tmp_path / "other"
    shutil.copytree(eora_base, other)
    info = json.loads((other / INIT_DIR / INFO_NAME).read_text())
    (other / INIT_DIR / INFO_NAME).write_text(json.dumps({**info, "method": "svd"}))
    with pytest.raises(QerlError, match="holds a svd LoRA init, not eora.*--lora-init eora"):
        build_policy(_train_config(other, tmp_path / "run"))


def test_eora_on_a_bf16_model_says_to_quantize_it(tiny_model_dir: Path) -> None:
    """It said to quantize BF16_MODEL, "the model tm was quantized from", of a model that is BF16."""
    with pytest.raises(QerlError) as raised:
        find_lora_init("eora", 16, "tm", tiny_model_dir, "bf16")
    text = str(raised.value)
    assert "BF16_MODEL" not in text and "tm is a BF16 model" in text, text
    assert "`qerl quantize tm --format nvfp4 --lora-init eora --lora-init-rank 16 -o NEWDIR`" in text, text
    assert "--set model.path=NEWDIR" in text


def test_resume_restores_the_trained_adapter_and_the_reference_stays_the_init(
    eora_base: Path, tmp_path: Path
) -> None:
    """Two steps with a KL term (the reference pass runs), then a new trainer resumes: its adapter is
    the checkpoint's, its KL reference base + init, and its staleness probe's reference the bare base."""
    from qerl_cli.rl.trainer import Trainer, train

    def reward(completions, problems):
        rewards = [float(len(c) % 3 == 0) for c in completions]
        return rewards, {"accuracy": 0.0, "format_rate": 0.0, "grader_timeouts": 0.0}

    cfg = _train_config(eora_base, tmp_path / "run", "algorithm.beta=0.05")
    result = train(cfg, reward_fn=reward, progress=False)
    assert result.steps == 2 and "kl" in result.final
    saved = adapter.read_weights(tmp_path / "run" / "checkpoint-2" / "adapter")
    trainer = Trainer(cfg, reward_fn=reward)
    try:
        trainer.resume_from(tmp_path / "run")
        params = dict(trainer.policy.model.named_parameters())
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
        torch.testing.assert_close(params[key.replace(".weight", ".default.weight")], saved[key])
        expected = _logits(_with_init(eora_base))
        assert (_logits(trainer.policy.model) - expected).abs().max() > 1e-3  # trained, not the init
        with trainer.policy.reference():
            torch.testing.assert_close(_logits(trainer.policy.model), expected, atol=1e-5, rtol=1e-5)
        probe = trainer._probe_ids(16)
        with trainer.policy.bare_base():
            bare = trainer._prompt_logprobs(probe)
        assert trainer._reference_logprobs(probe) == pytest.approx(bare, abs=1e-6)
    finally:
        trainer.engine.close()
        trainer.policy.close()


def test_the_cli_takes_the_two_options(tiny_model_dir: Path, capsys) -> None:
    from qerl_cli.cli import main

    argv = ["quantize", str(tiny_model_dir), "--method", "rtn", "--lora-init", "svd", "--lora-init-rank", "8"]
    assert main([*argv, "--calib", "qerl-text", "--dry-run"]) == 0  # the dry run checks the calibration set
    text = capsys.readouterr().out
    assert "lora_init: svd" in text and "lora_init_rank: 8" in text

"""Rollout linear backends: the choice (pinned, auto from a crossover table and memory), its errors, what
reaches vLLM, the FP8 rollout copy of a 4-bit base, and the bench's crossover table and roofline."""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl_cli import formats
from qerl_cli.bench.concurrency import add_roofline, backends_for, crossover_table
from qerl_cli.bench.models import shape_checkpoint
from qerl_cli.bench.result import SCHEMA, BenchResult
from qerl_cli.bench.roofline import decode_bound, fractions, gpu_spec, update_flops
from qerl_cli.cli import main
from qerl_cli.errors import QerlError
from qerl_cli.formats import fp8
from qerl_cli.modeling.model_shape import ModelShape, weight_bytes
from qerl_cli.rollout import backends, factory, vllm_setup
from qerl_cli.rollout.backends import BackendChoice, Environment, MeasuredModel, interpolate
from qerl_cli.rollout.factory import EngineRequest, make_engine
from qerl_cli.rollout.fp8_rollout import write_fp8_checkpoint
from qerl_cli.rollout.vllm_setup import VLLM_OVERHEAD

H100 = "NVIDIA H100 80GB HBM3"
# The shipped table's model (random Qwen2.5-7B shape) and the one it once steered wrongly (Gemma 3 270M).
QWEN7B = MeasuredModel("qwen2.5-7b", 7_615_616_512, 3584, 18944, 28)
GEMMA = MeasuredModel("gemma3-270m", 268_093_568, 640, 2048, 18)
TABLE = {
    "gpus": {
        "NVIDIA H100 80GB HBM3": {
            "nvfp4+lora": {
                "model": QWEN7B.to_dict(),
                "marlin": {"8": 1500.0, "32": 4000.0, "128": 7000.0, "256": 8000.0},
                "humming": {"8": 1300.0, "32": 3800.0, "128": 7600.0, "256": 9500.0},
                "fp8": {"8": 1200.0, "32": 3900.0, "128": 8200.0, "256": 11000.0},
            }
        }
    }
}


def env(**overrides) -> Environment:
    values = dict(gpu_name=H100, capability=(9, 0), humming_installed=True, vllm_version=(0, 26))
    values.update(overrides)
    return Environment(**values)


def choose_backend(
    *args, model: MeasuredModel | None = QWEN7B, fp8_ok: bool = True, **kwargs
) -> BackendChoice:
    """The choice for a run of the tables' own model, FP8 copies allowed (``rollout.auto_fp8``), unless a
    test says otherwise."""
    return backends.choose_backend(*args, model=model, fp8_ok=fp8_ok, **kwargs)


# --------------------------------------------------------------------------------------------
# The choice
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("concurrency", "expected"), [(8, "marlin"), (32, "marlin"), (128, "fp8"), (256, "fp8")]
)
def test_auto_takes_the_fastest_measured_backend_at_the_runs_concurrency(
    concurrency: int, expected: str
) -> None:
    choice = choose_backend("auto", "nvfp4", concurrency=concurrency, env=env(), table=TABLE)
    assert choice.backend == expected
    assert choice.predicted_tokens_per_s == max(v for v in choice.candidates.values() if v)


def test_interpolation_is_linear_in_log_concurrency_and_clamped() -> None:
    points = {"8": 1000.0, "32": 3000.0}
    assert interpolate(points, 16) == pytest.approx(2000.0)  # halfway in log2
    assert interpolate(points, 2) == 1000.0 and interpolate(points, 512) == 3000.0
    assert interpolate({}, 16) is None


def test_auto_skips_a_backend_that_is_not_installed() -> None:
    choice = choose_backend(
        "auto", "nvfp4", concurrency=256, env=env(humming_installed=False, capability=(8, 0)), table=TABLE
    )
    assert choice.backend == "marlin"  # fp8 needs sm89+, humming is not installed
    assert set(choice.candidates) == {"marlin"}


def test_auto_weighs_the_kv_room_each_backends_weights_leave() -> None:
    gib = 2**30
    sizes = {"marlin": 5 * gib, "humming": 5 * gib, "fp8": 9 * gib}
    # 12 GiB for vLLM, 1 GiB a sequence: fp8 leaves room for 3 sequences, Marlin for 7.
    tight = env(vllm_budget_bytes=12 * gib, kv_bytes_per_sequence=gib)
    choice = choose_backend("auto", "nvfp4", concurrency=256, env=tight, table=TABLE, weight_bytes=sizes)
    assert choice.backend == "marlin"
    assert choice.candidates["fp8"] == pytest.approx(interpolate(TABLE["gpus"][H100]["nvfp4+lora"]["fp8"], 3))
    roomy = env(vllm_budget_bytes=600 * gib, kv_bytes_per_sequence=gib)
    assert (
        choose_backend("auto", "nvfp4", concurrency=256, env=roomy, table=TABLE, weight_bytes=sizes).backend
        == "fp8"
    )


def test_auto_without_measurements_keeps_vllms_default() -> None:
    choice = choose_backend(
        "auto", "nvfp4", concurrency=128, env=env(gpu_name="NVIDIA A100-SXM4-80GB"), table=TABLE
    )
    assert choice.backend == "marlin" and "no crossover measurements" in choice.reason
    assert choose_backend("auto", "bf16", concurrency=128, env=env(), table=TABLE).backend == "default"


def test_a_pinned_backend_is_kept_and_checked() -> None:
    assert choose_backend("humming", "nvfp4", concurrency=8, env=env(), table={}).backend == "humming"
    with pytest.raises(QerlError, match=r'pip install -e "\.\[humming\]"'):
        choose_backend("humming", "nvfp4", concurrency=8, env=env(humming_installed=False), table={})
    with pytest.raises(QerlError, match=r"vLLM 0\.26\+"):
        choose_backend("humming", "nvfp4", concurrency=8, env=env(vllm_version=(0, 11)), table={})
    with pytest.raises(QerlError, match="compute capability 8.9"):
        choose_backend("fp8", "nvfp4", concurrency=8, env=env(capability=(8, 0)), table={})
    gib = 2**30
    with pytest.raises(QerlError, match="leave no room for one full-length sequence"):
        choose_backend(
            "fp8",
            "nvfp4",
            concurrency=8,
            env=env(vllm_budget_bytes=10 * gib, kv_bytes_per_sequence=gib, overhead_bytes=2 * gib),
            table={},
            weight_bytes={"fp8": 8 * gib},
        )


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(QerlError, match="auto, marlin, humming, qerl-triton, fp8"):
        choose_backend("cutlass", "nvfp4", concurrency=8, env=env(), table={})


def test_fp4_kernels_pinned_for_a_bf16_base_keep_its_default() -> None:
    # One recipe pins humming for its NVFP4 arm; its BF16 arm has no FP4 weights to run it on.
    choice = choose_backend("humming", "bf16", concurrency=8, env=env(), table={})
    assert choice.backend == "default" and choice.vllm_kwargs() == {}


def test_what_each_choice_asks_of_vllm() -> None:
    assert BackendChoice("humming", "nvfp4", "").vllm_kwargs() == {"linear_backend": "humming"}
    assert BackendChoice("marlin", "nvfp4", "").vllm_kwargs() == {}
    assert BackendChoice("fp8", "bf16", "").vllm_kwargs() == {"quantization": "fp8"}
    assert (
        BackendChoice("fp8", "nvfp4", "").needs_fp8_copy
        and not BackendChoice("fp8", "bf16", "").needs_fp8_copy
    )


def test_a_crossover_table_file_is_checked(tmp_path: Path) -> None:
    with pytest.raises(QerlError, match="does not exist"):
        backends.load_table(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(QerlError, match="not a crossover table"):
        backends.load_table(bad)
    assert "gpus" in backends.load_table(None)  # the shipped one (possibly without any GPU yet)


def test_the_gpu_is_found_by_a_name_contained_in_the_devices() -> None:
    table = {"gpus": {"H100": {"x": 1}}}
    assert backends.gpu_entry(table, H100) == {"x": 1}
    assert backends.gpu_entry(table, "NVIDIA A100") is None


# --------------------------------------------------------------------------------------------
# Through the engine factory (a stand-in vLLM)
# --------------------------------------------------------------------------------------------
@pytest.fixture
def fake_llm(monkeypatch: pytest.MonkeyPatch):
    seen: list[dict] = []

    class FakeEngine:
        def __init__(self, model_path: str, **kwargs) -> None:
            seen.append({"model": model_path, **kwargs})
            self.backend_choice = kwargs.get("backend_choice")

    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(__import__("sys").modules, "vllm", module)
    monkeypatch.setattr("qerl_cli.rollout.vllm_engine.VLLMEngine", FakeEngine)
    monkeypatch.setattr(vllm_setup, "_cuda_total_bytes", lambda: 80 * 2**30)
    monkeypatch.setattr(factory, "current_environment", lambda **kw: env(**kw))
    return seen


def nvfp4_base() -> Path:
    return shape_checkpoint("tiny", "nvfp4")


def test_factory_hands_vllm_the_backend_and_the_fp8_copy(
    fake_llm: list[dict], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    base = nvfp4_base()
    humming = EngineRequest(
        "vllm", base, linear_backend="humming", gpu_memory_utilization=0.5, max_model_len=64
    )
    engine = make_engine(humming)
    assert fake_llm[-1]["vllm_kwargs"]["linear_backend"] == "humming" and fake_llm[-1]["model"] == str(base)
    assert engine.backend_choice.backend == "humming"
    make_engine(
        EngineRequest(
            "vllm",
            base,
            linear_backend="fp8",
            gpu_memory_utilization=0.5,
            max_model_len=64,
            vllm_kwargs={"max_num_seqs": 8},
        )
    )
    served = Path(fake_llm[-1]["model"])
    assert (
        served.parent == tmp_path / "cache" / "fp8-rollout" and (served / "qerl_fp8_rollout.json").is_file()
    )
    assert fake_llm[-1]["model_format"] == "auto" and fake_llm[-1]["vllm_kwargs"] == {"max_num_seqs": 8}
    monkeypatch.setattr(factory, "current_environment", lambda **kw: env(humming_installed=False, **kw))
    with pytest.raises(QerlError, match=r"\.\[humming\]"):
        make_engine(humming)


def test_unknown_backend_in_a_recipe_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["train", "recipes/tiny.yaml", "--set", "rollout.linear_backend=cutlass", "--dry-run"])
    assert rc == 2 and "linear_backend" in capsys.readouterr().err
    rc = main(["train", "recipes/tiny.yaml", "--set", "rollout.linear_backend=fp8", "--dry-run"])
    assert rc == 2 and "engine=vllm" in " ".join(capsys.readouterr().err.split())


# --------------------------------------------------------------------------------------------
# The FP8 rollout copy
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp8_copy_equals_the_dequantized_4bit_weights_within_fp8_rounding(fmt: str, tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    source = shape_checkpoint("tiny", fmt)
    out = write_fp8_checkpoint(source, tmp_path / "fp8")
    four = {k: v for f in source.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    eight = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    qfmt = formats.get(fmt)
    prefixes = sorted(k.removesuffix(".weight_packed") for k in four if k.endswith(".weight_packed"))
    assert prefixes
    for prefix in prefixes:
        dense = qfmt.dequantize({n: four[f"{prefix}.{n}"] for n in qfmt.checkpoint_names()}, torch.float32)
        codes, scale = eight[f"{prefix}.weight"], eight[f"{prefix}.weight_scale"]
        assert codes.dtype == torch.float8_e4m3fn and scale.shape == (dense.shape[0], 1)
        error = (fp8.dequantize_per_channel(codes, scale) - dense).abs()
        assert bool((error <= fp8.rounding_bound(dense, scale) + 1e-12).all()), prefix
    untouched = [k for k in four if not any(k.startswith(p + ".") for p in prefixes)]
    assert untouched and all(torch.equal(four[k], eight[k]) for k in untouched)
    config = json.loads((out / "config.json").read_text())
    parsed = QuantizationConfig.model_validate(config["quantization_config"])
    assert parsed.format == "float-quantized" and "lm_head" in parsed.ignore
    assert (out / "tokenizer_config.json").is_file()


def test_fp8_rounding_bound_is_tight() -> None:
    weight = torch.randn(64, 128)
    codes, scale = fp8.quantize_per_channel(weight)
    error = (fp8.dequantize_per_channel(codes, scale) - weight).abs()
    bound = fp8.rounding_bound(weight, scale)
    assert bool((error <= bound).all()) and float((error / bound).max()) > 0.5
    zero_codes, zero_scale = fp8.quantize_per_channel(torch.zeros(2, 16))
    assert torch.equal(zero_scale, torch.ones(2, 1)) and not zero_codes.float().any()


def test_fp8_copy_of_a_bf16_base_is_refused_with_the_alternative(tmp_path: Path) -> None:
    with pytest.raises(QerlError, match="quantization: fp8"):
        write_fp8_checkpoint(shape_checkpoint("tiny", "bf16"), tmp_path / "fp8")


# --------------------------------------------------------------------------------------------
# Roofline and the crossover table
# --------------------------------------------------------------------------------------------
TOY = ModelShape(hidden=1000, intermediate=2000, layers=2, heads=10, kv_heads=2, vocab=5000, head_dim=100)


def test_decode_bound_by_hand() -> None:
    spec = gpu_spec(H100)
    assert spec is not None and spec.name == "H100 SXM"
    bound = decode_bound(TOY, spec, weight_format="bf16", concurrency=4, prompt_len=100, gen_len=200)
    linear = 2 * (2 * 1000 * 1000 + 2 * 1000 * 200 + 3 * 1000 * 2000)  # q,o + k,v + gate,up,down per layer
    weights = 2 * linear + 2 * 5000 * 1000
    kv = (
        4 * 200 * (2 * 2 * 2 * 100 * 2)
    )  # sequences x average context x K/V x layers x kv heads x dim x bytes
    assert bound["bytes_per_step"] == pytest.approx(weights + kv)
    assert bound["bandwidth_tokens_per_s"] == pytest.approx(4 / ((weights + kv) / 3.35e12))
    flops = 4 * (2 * (linear + 5000 * 1000) + 4 * 200 * 10 * 100 * 2)
    assert bound["compute_tokens_per_s"] == pytest.approx(4 / (flops / 989.4e12))
    assert bound["limited_by"] == "memory"
    assert fractions(bound["bound_tokens_per_s"] / 2, bound)["of_roofline"] == pytest.approx(0.5)
    fp8_bound = decode_bound(TOY, spec, weight_format="fp8", concurrency=4, prompt_len=100, gen_len=200)
    assert fp8_bound["compute_peak"] == "fp8" and fp8_bound["bytes_per_step"] < bound["bytes_per_step"]


def test_gpu_names_and_unknown_gpus() -> None:
    assert gpu_spec("NVIDIA H200").bandwidth == 4.8e12
    assert gpu_spec("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert gpu_spec("cpu") is None and gpu_spec(None) is None


def test_update_flops_by_hand() -> None:
    linear = 2 * (2 * 1000 * 1000 + 2 * 1000 * 200 + 3 * 1000 * 2000)
    expected = 4 * linear * 2 * 10 + 4 * 5000 * 1000 * 2 * 6 + 3 * 2 * 2 * 10 * 10 * 1000 * 2
    assert update_flops(TOY, 2, 10, completion_len=6) == pytest.approx(expected)


def test_crossover_table_and_roofline_from_rows() -> None:
    from qerl_cli.modeling.random_checkpoint import SHAPES

    rows = [
        {"format": f, "backend": b, "lora_rank": r, "batch": c, "output_tokens_per_s": 1000.0 * c}
        for f, b in (("bf16", "default"), ("nvfp4", "marlin"), ("nvfp4", "fp8"))
        for r in (0, 16)
        for c in (8, 128)
    ]
    settings = {"prompt_len": 256, "gen_len": 2048, "model": "qwen2.5-7b", "lora_rank": 16}
    report = BenchResult(schema=SCHEMA, created="now", device="gpu", figures_label="", machine={},
                         gpu={"name": H100}, versions={}, settings=settings, rollout=rows)  # fmt: skip
    table = crossover_table(report, QWEN7B)
    assert table["gpus"][H100]["nvfp4+lora"]["fp8"] == {"8": 8000.0, "128": 128000.0}
    assert set(table["gpus"][H100]) == {"bf16", "bf16+lora", "nvfp4", "nvfp4+lora"}
    # Every entry names the model it was measured on.
    assert all(e["model"] == QWEN7B.to_dict() for e in table["gpus"][H100].values())
    # The table is what auto reads.
    assert choose_backend("auto", "nvfp4", concurrency=64, env=env(), table=table).backend in (
        "marlin",
        "fp8",
    )
    add_roofline(report, {"bf16": SHAPES["qwen2.5-7b"], "nvfp4": SHAPES["qwen2.5-7b"]})
    fp8_row = next(r for r in rows if r["backend"] == "fp8" and r["batch"] == 128)
    assert fp8_row["roofline"]["compute_peak"] == "fp8" and fp8_row["roofline"]["of_bandwidth_bound"] > 0
    cpu = dataclasses.replace(report, gpu=None, rollout=[dict(rows[0])])
    add_roofline(cpu, {"bf16": SHAPES["qwen2.5-7b"]})
    assert cpu.rollout[0]["roofline"] is None


def test_bench_measures_each_format_on_its_backends() -> None:
    assert backends_for("nvfp4", ["marlin", "fp8", "humming"]) == ["marlin", "fp8", "humming"]
    assert backends_for("bf16", ["marlin", "fp8", "humming"]) == ["default", "fp8"]
    assert backends_for("nf4", ["humming"]) == ["default"]
    # A 4-bit base measures both merges (its FP8 copy, its BF16 copy); a BF16 base its own merge, once.
    both = ["marlin", "fp8-merged", "merged"]
    assert backends_for("nvfp4", both) == ["marlin", "fp8-merged", "merged"]
    assert backends_for("bf16", both) == ["default", "merged"]


def test_a_merged_rows_bound_has_no_lora_bytes() -> None:
    from qerl_cli.modeling.random_checkpoint import SHAPES

    rows = [{"format": "nvfp4", "backend": b, "lora_rank": 16, "batch": 128, "output_tokens_per_s": 9000.0}
            for b in ("fp8", "fp8-merged")]  # fmt: skip
    report = BenchResult(schema=SCHEMA, created="now", device="gpu", figures_label="", machine={},
                         gpu={"name": H100}, versions={}, settings={"prompt_len": 256, "gen_len": 2048},
                         rollout=rows)  # fmt: skip
    add_roofline(report, {"nvfp4": SHAPES["qwen2.5-7b"]})
    lora, merged = (row["roofline"]["bound_tokens_per_s"] for row in report.rollout)
    assert merged > lora  # the same FP8 weights, without the adapter's bytes


def test_an_alternative_is_chosen_only_against_a_measured_default() -> None:
    partial = {"gpus": {H100: {"nvfp4+lora": {"fp8": {"128": 9000.0}}}}}
    choice = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=partial)
    assert choice.backend == "marlin" and "was not measured" in choice.reason


# --------------------------------------------------------------------------------------------
# Which model a table entry was measured on
# --------------------------------------------------------------------------------------------
def test_comparable_means_within_2x_of_the_parameters_or_the_same_widths() -> None:
    fourteen = MeasuredModel("qwen2.5-14b", 14_770_033_664, 5120, 13824, 48)
    three = MeasuredModel("qwen2.5-3b", 3_085_938_688, 2048, 11008, 36)
    assert backends.comparable_models(fourteen, QWEN7B) and backends.comparable_models(QWEN7B, fourteen)
    assert not backends.comparable_models(three, QWEN7B) and not backends.comparable_models(GEMMA, QWEN7B)
    # Deeper, but the same GEMMs per layer: where the kernels turn compute-bound is the same.
    deep = MeasuredModel("deep", 20 * QWEN7B.parameters, 3584, 18944, 280)
    assert backends.comparable_models(deep, QWEN7B)
    assert backends.comparable_models(MeasuredModel(hidden_size=3584, intermediate_size=18944), QWEN7B)
    assert not backends.comparable_models(None, QWEN7B) and not backends.comparable_models(QWEN7B, None)
    assert not backends.comparable_models(MeasuredModel("no size"), MeasuredModel("no size"))


def test_auto_uses_a_table_only_for_a_model_of_comparable_size() -> None:
    # The measured defect: a 7B's table picked the FP8 copy for a 270M Gemma at 128 sequences.
    choice = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=TABLE, model=GEMMA)
    assert choice.backend == "marlin" and choice.candidates == {}
    assert "are of qwen2.5-7b (7.6B parameters), not comparable to this model (gemma3-270m (268M" in (
        choice.reason
    )
    assert "vLLM's default (marlin)" in choice.reason
    fourteen = MeasuredModel("qwen2.5-14b", 14_770_033_664, 5120, 13824, 48)
    choice = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=TABLE, model=fourteen)
    assert choice.backend == "fp8" and "measured on qwen2.5-7b (7.6B parameters)" in choice.reason
    unknown = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=TABLE, model=None)
    assert unknown.backend == "marlin" and "a model of unknown size" in unknown.reason


def test_the_shipped_table_names_its_model_and_does_not_steer_a_small_one() -> None:
    shipped = backends.load_table(None)
    entries = [e for gpu in shipped["gpus"].values() for key in gpu for e in backends.key_entries(gpu, key)]
    assert entries and all(backends.entry_model(e) == QWEN7B for e in entries)
    for model, expected in ((QWEN7B, "fp8"), (GEMMA, "marlin")):
        choice = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=shipped, model=model)
        assert choice.backend == expected, choice.reason
    # The trainer's engine may merge the adapter: on the 7B, the merged FP8 copy was measured fastest
    # at both the paper's 8 sequences and RL's 128 (no LoRA kernels); a 32B, which the table does not
    # cover, keeps vLLM's Marlin kernels, as in the run that fit one 80 GB GPU.
    for n in (8, 128):
        merged = choose_backend("auto", "nvfp4", concurrency=n, env=env(), table=shipped, merge_ok=True)
        assert merged.backend == "fp8-merged", merged.reason
        dense = choose_backend("auto", "bf16", concurrency=n, env=env(), table=shipped, merge_ok=True)
        assert dense.backend == "merged", dense.reason  # TRL's baseline: BF16 with the LoRA merged
    # Without rollout.auto_fp8 (the default) the 7B keeps Marlin + LoRA and the BF16 base its merge; the
    # reason names the faster FP8 copy passed over and the setting that allows it.
    kept = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=shipped, merge_ok=True,
                          fp8_ok=False)  # fmt: skip
    assert kept.backend == "marlin" and "not the FP8 copies (rollout.auto_fp8 off" in kept.reason
    assert "fp8-merged" in kept.reason.split("not the FP8 copies")[1]
    dense = choose_backend(
        "auto", "bf16", concurrency=128, env=env(), table=shipped, merge_ok=True, fp8_ok=False
    )
    assert dense.backend == "merged", dense.reason  # the BF16 merge keeps BF16 numerics
    qwen32b = MeasuredModel("qwen2.5-32b", 32_763_876_352, 5120, 27648, 64)
    big = choose_backend("auto", "nvfp4", concurrency=8, env=env(), table=shipped, merge_ok=True,
                         model=qwen32b)  # fmt: skip
    assert big.backend == "marlin" and "not comparable" in big.reason


def test_a_table_without_models_is_used_only_when_the_recipe_names_it() -> None:
    old = {"gpus": {H100: {"nvfp4+lora": {b: p for b, p in TABLE["gpus"][H100]["nvfp4+lora"].items()
                                          if b != "model"}}}}  # fmt: skip
    named = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=old, model=GEMMA,
                           unknown_model_ok=True)  # fmt: skip
    assert named.backend == "fp8" and "a model the table does not name" in named.reason
    shipped = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=old, model=GEMMA,
                             unknown_model_ok=False)  # fmt: skip
    assert shipped.backend == "marlin" and "do not name the model they were measured on" in shipped.reason


def test_merged_tables_keep_each_models_measurements_apart() -> None:
    gemma = {"gpus": {H100: {"nvfp4+lora": {"model": GEMMA.to_dict(), "marlin": {"128": 20000.0},
                                            "fp8": {"128": 15000.0}}}},
             "measured": {"model": "gemma3-270m"}}  # fmt: skip
    more_7b = {"gpus": {H100: {"nvfp4+lora": {"model": QWEN7B.to_dict(), "fp8": {"256": 12000.0}}}},
               "measured": [{"model": "qwen2.5-7b"}]}  # fmt: skip
    merged = backends.merge_tables(TABLE, gemma, more_7b)
    entries = backends.key_entries(merged["gpus"][H100], "nvfp4+lora")
    assert [backends.entry_model(e) for e in entries] == [QWEN7B, GEMMA]
    assert entries[0]["fp8"]["256"] == 12000.0 and entries[0]["fp8"]["8"] == 1200.0  # the later point won
    assert merged["measured"] == [{"model": "gemma3-270m"}, {"model": "qwen2.5-7b"}]
    small = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=merged, model=GEMMA)
    assert small.backend == "marlin" and "measured on gemma3-270m" in small.reason
    assert small.predicted_tokens_per_s == 20000.0
    big = choose_backend("auto", "nvfp4", concurrency=128, env=env(), table=merged, model=QWEN7B)
    assert big.backend == "fp8" and big.predicted_tokens_per_s == 8200.0
    # One model per key stays a single entry, as a sweep writes it.
    assert isinstance(backends.merge_tables(TABLE, more_7b)["gpus"][H100]["nvfp4+lora"], dict)


def test_the_factory_weighs_the_table_against_the_checkpoints_size(
    fake_llm: list[dict], tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))  # the FP8 copy the old table picks
    base = nvfp4_base()  # the tiny shape: far from the shipped table's 7B
    with caplog.at_level("INFO", logger="qerl_cli.rollout.factory"):
        engine = make_engine(EngineRequest("vllm", base, gpu_memory_utilization=0.5, max_model_len=64,
                                           concurrency=128))  # fmt: skip
    assert engine.backend_choice.backend == "marlin" and "not comparable to this model" in caplog.text
    old = tmp_path / "old.json"  # a table of an unnamed model, named by the recipe: used as before
    old.write_text(json.dumps({"gpus": {H100: {"nvfp4+lora": {
        b: p for b, p in TABLE["gpus"][H100]["nvfp4+lora"].items() if b != "model"}}}}))  # fmt: skip
    request = EngineRequest("vllm", base, gpu_memory_utilization=0.5, max_model_len=64, concurrency=128,
                            crossover_table=str(old))  # fmt: skip
    assert make_engine(request).backend_choice.backend == "humming"  # rollout.auto_fp8 off: not the FP8 copy
    engine = make_engine(dataclasses.replace(request, auto_fp8=True))
    assert engine.backend_choice.backend == "fp8"


def test_an_engine_in_a_slice_of_the_gpu_sizes_its_kv_cache_from_its_share(
    fake_llm: list[dict], tmp_path: Path
) -> None:
    """Runs sharing a GPU: vLLM must not profile the device's free memory, which its neighbours change."""
    base = nvfp4_base()
    shape = ModelShape.from_config(json.loads((base / "config.json").read_text()))
    request = EngineRequest("vllm", base, gpu_memory_utilization=0.153, max_model_len=64,
                            linear_backend="marlin", kv_cache_from_share=True)  # fmt: skip
    make_engine(request)
    expected = int(80 * 2**30 * 0.153) - weight_bytes(shape, "nvfp4") - VLLM_OVERHEAD
    assert fake_llm[-1]["vllm_kwargs"]["kv_cache_memory_bytes"] == expected
    assert fake_llm[-1]["gpu_memory_utilization"] == 0.153  # still vLLM's check of the free memory at start
    # The whole GPU (no slice): vLLM profiles as before; the recipe's own value wins.
    make_engine(dataclasses.replace(request, kv_cache_from_share=False))
    assert "kv_cache_memory_bytes" not in fake_llm[-1]["vllm_kwargs"]
    make_engine(dataclasses.replace(request, vllm_kwargs={"kv_cache_memory_bytes": 2**30}))
    assert fake_llm[-1]["vllm_kwargs"]["kv_cache_memory_bytes"] == 2**30
    with pytest.raises(QerlError, match="leaves no KV cache room for one full-length sequence"):
        # 4 GiB: the overhead alone (auto: no backend fits, vLLM's default is kept and refused here)
        make_engine(dataclasses.replace(request, gpu_memory_utilization=0.05, linear_backend="auto"))


def test_qerl_tritons_bf16_scales_are_counted_in_what_vllm_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """qerl's kernel holds each block's scale as two bytes where the checkpoint has one: vLLM's weights
    are bigger by one byte a block of 16 weights, and a KV cache sized from a slice of the GPU is smaller
    by as much (counted as the format's bytes, it would overrun its slice by ~0.4 GB on a 7B)."""
    base = nvfp4_base()
    shape = ModelShape.from_config(json.loads((base / "config.json").read_text()))
    extra = int(shape.decoder_linear_params() / 16)
    assert extra > 0
    marlin_bytes = backends.rollout_weight_bytes(shape, "marlin", "nvfp4")
    assert marlin_bytes == weight_bytes(shape, "nvfp4")
    assert backends.rollout_weight_bytes(shape, "qerl-triton", "nvfp4") == marlin_bytes + extra
    assert backends.rollout_weight_bytes(shape, "fp8", "nvfp4") == weight_bytes(shape, "fp8")
    monkeypatch.setattr(vllm_setup, "_cuda_total_bytes", lambda: 80 * 2**30)
    request = EngineRequest(
        "vllm", base, gpu_memory_utilization=0.153, max_model_len=64, kv_cache_from_share=True
    )
    kv = {
        backend: factory.kv_cache_from_share(str(base), BackendChoice(backend, "nvfp4", "test", 8), request)
        for backend in ("marlin", "qerl-triton")
    }
    assert kv["marlin"]["kv_cache_memory_bytes"] - kv["qerl-triton"]["kv_cache_memory_bytes"] == extra


def test_the_shipped_h200_entries_choose_marlin_for_few_sequences_and_the_bf16_copy_for_many() -> None:
    """The H200 rows of the shipped table (one H200, vLLM 0.26 with its detokenizer off, tuned LoRA
    kernels): Marlin + LoRA is the fastest at 8 sequences, the merged BF16 copy of the 4-bit base from 9;
    the copy only where the memory plan holds it and leaves the round its KV cache."""
    shipped = backends.load_table(None)
    sizes = {"marlin": 5 * 2**30, "humming": 5 * 2**30, "fp8": 8 * 2**30, "fp8-merged": 8 * 2**30,
             "merged": 15 * 2**30}  # fmt: skip
    kv = 2304 * 57344  # one 2304-token sequence of the 7B's KV cache (BF16)
    roomy = env(gpu_name="NVIDIA H200", humming_installed=False, vllm_budget_bytes=120 * 2**30,
                kv_bytes_per_sequence=kv)  # fmt: skip
    few = choose_backend("auto", "nvfp4", concurrency=8, env=roomy, table=shipped, merge_ok=True,
                         weight_bytes=sizes, fp8_ok=False)  # fmt: skip
    assert few.backend == "marlin", few.reason
    # docs/rollout.md and docs/defaults.md say "from 9 sequences": the table's line crosses at 8.55.
    nine = choose_backend("auto", "nvfp4", concurrency=9, env=roomy, table=shipped, merge_ok=True,
                          weight_bytes=sizes, fp8_ok=False)  # fmt: skip
    assert nine.backend == "merged", nine.reason
    many = choose_backend("auto", "nvfp4", concurrency=128, env=roomy, table=shipped, merge_ok=True,
                          weight_bytes=sizes, fp8_ok=False)  # fmt: skip
    assert many.backend == "merged" and "on NVIDIA H200" in many.reason, many.reason
    assert many.predicted_tokens_per_s > 1.2 * many.candidates["marlin"]
    unknown_memory = choose_backend("auto", "nvfp4", concurrency=128, env=env(gpu_name="NVIDIA H200"),
                                    table=shipped, merge_ok=True, fp8_ok=False)  # fmt: skip
    assert unknown_memory.backend == "marlin", unknown_memory.reason
    tight = env(gpu_name="NVIDIA H200", humming_installed=False, vllm_budget_bytes=18 * 2**30,
                kv_bytes_per_sequence=kv)  # fmt: skip
    squeezed = choose_backend("auto", "nvfp4", concurrency=128, env=tight, table=shipped, merge_ok=True,
                              weight_bytes=sizes, fp8_ok=False)  # fmt: skip
    assert squeezed.backend == "marlin", squeezed.reason  # the copy leaves too few sequences KV room

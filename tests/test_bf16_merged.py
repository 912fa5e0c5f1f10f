"""``rollout.linear_backend: merged`` on a 4-bit base: vLLM serves a BF16 copy of the dequantized base
and every sync rewrites the targeted linears as deq(base) + scaling * B @ A cast once to BF16.

The merge's arithmetic against a float64 reference (stacked and plain linears, odd shapes), the copy
and its cache, the memory refusal, ``auto``'s rule (a measurement and known room first), the factory,
the recipe and the trainer's rollout weight format. The GPU run is in ``tests/test_vllm_real.py``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from test_rollout_backends import H100, QWEN7B, env, fake_llm, nvfp4_base  # noqa: F401 (fake_llm: a fixture)
from torch import nn

from qerl_cli import formats
from qerl_cli.bench.concurrency import add_roofline, backends_for
from qerl_cli.bench.result import SCHEMA, BenchResult
from qerl_cli.config import TrainConfig, load_config
from qerl_cli.errors import QerlError
from qerl_cli.modeling.loading import detect_format, read_config
from qerl_cli.modeling.model_shape import ModelShape, weight_bytes
from qerl_cli.rollout import backends, fp8_rollout
from qerl_cli.rollout.fp8_merge import CheckpointBases, DenseBases, LoraDelta, vllm_location, write_merged
from qerl_cli.rollout.fp8_rollout import bf16_rollout_checkpoint, write_bf16_checkpoint
from qerl_cli.torch_utils import GIB

NVFP4 = formats.get("nvfp4")
LAYER = "model.layers.0"
# HF linear -> (out, in): odd output widths in the stacked q/k/v and gate/up, an odd LoRA rank; inputs
# are whole NVFP4 blocks of 16.
SHAPES = {
    "self_attn.q_proj": (48, 32), "self_attn.k_proj": (17, 32), "self_attn.v_proj": (17, 32),
    "self_attn.o_proj": (32, 48), "mlp.gate_proj": (23, 32), "mlp.up_proj": (23, 32),
    "mlp.down_proj": (32, 64),
}  # fmt: skip
VLLM = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.down_proj": ("mlp.down_proj",)}  # fmt: skip
RANK = 3
# The shape of a 32B model (Qwen2.5-32B's widths): its BF16 copy is 2 bytes a weight.
SHAPE_32B = ModelShape(hidden=5120, intermediate=27648, layers=64, heads=40, kv_heads=8, vocab=152064,
                       head_dim=128)  # fmt: skip


def qwen7b_config() -> dict:
    """The random Qwen2.5-7B shape's config (QWEN7B's model)."""
    from qerl_cli.modeling.random_checkpoint import SHAPES  # imports transformers

    return SHAPES["qwen2.5-7b"]


def nvfp4_bases(seed: int = 0) -> dict[str, torch.Tensor]:
    """Each linear quantized to NVFP4 and dequantized in float32: what the trainer's base holds."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"{LAYER}.{name}": NVFP4.dequantize(
            NVFP4.quantize(torch.randn(shape, generator=g) * 0.05), torch.float32
        )
        for name, shape in SHAPES.items()
    }


def delta(out: int, inp: int, seed: int, scaling: float = 1.5) -> LoraDelta:
    g = torch.Generator().manual_seed(seed)
    return LoraDelta(
        torch.randn(RANK, inp, generator=g) * 0.2, torch.randn(out, RANK, generator=g) * 0.2, scaling
    )


def add_module(root: nn.Module, name: str, weight: torch.Tensor) -> None:
    parent = root
    for part in name.split(".")[:-1]:
        if not hasattr(parent, part):
            parent.add_module(part, nn.Module())
        parent = getattr(parent, part)
    layer = nn.Module()
    layer.weight = nn.Parameter(weight, requires_grad=False)
    parent.add_module(name.split(".")[-1], layer)


def bf16_vllm(bases: dict[str, torch.Tensor]) -> nn.Module:
    """vLLM's unquantized layout of the BF16 copy: shards stacked along the output rows, ``[out, in]``
    row-major BF16, no scale."""
    root = nn.Module()
    for fused, shards in VLLM.items():
        add_module(root, f"{LAYER}.{fused}", torch.cat([bases[f"{LAYER}.{s}"] for s in shards]).bfloat16())
    return root


def within_bf16_rounding(written: torch.Tensor, reference: torch.Tensor) -> bool:
    """``written`` is ``reference`` (float64) rounded once to BF16: half a unit in the last of its 8
    significant bits, plus float32's arithmetic on the way."""
    bound = reference.abs() * 2.0**-8 + 1e-6
    return bool(((written.double() - reference).abs() <= bound).all())


# --------------------------------------------------------------------------------------------
# The merge's arithmetic
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_rows", [1, 5, 1024])
def test_bf16_merge_is_the_dequantized_base_plus_the_lora_rounded_once(chunk_rows: int) -> None:
    bases = nvfp4_bases()
    model = bf16_vllm(bases)
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    targets = ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"]
    deltas = {f"{LAYER}.{t}": delta(*SHAPES[t], seed=i) for i, t in enumerate(targets)}
    assert write_merged(model, DenseBases(bases), deltas, chunk_rows=chunk_rows) == len(targets)
    params = dict(model.named_parameters())
    for name, d in deltas.items():
        module, index, shards = vllm_location(name)
        offset = sum(bases[s].shape[0] for s in shards[:index])
        rows = params[f"{module}.weight"][offset : offset + d.b.shape[0]]
        reference = bases[name].double() + d.scaling * d.b.double() @ d.a.double()
        assert rows.dtype == torch.bfloat16 and within_bf16_rounding(rows, reference), name
        assert torch.equal(rows, (bases[name] + d.scaling * d.b @ d.a).bfloat16()), name  # one cast
    # Shards the adapter does not target keep what vLLM loaded (k of qkv, gate of gate_up).
    qkv, k_rows = params[f"{LAYER}.self_attn.qkv_proj.weight"], slice(48, 48 + 17)
    assert torch.equal(qkv[k_rows], loaded[f"{LAYER}.self_attn.qkv_proj.weight"][k_rows])
    gate_up = params[f"{LAYER}.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up[:23], loaded[f"{LAYER}.mlp.gate_up_proj.weight"][:23])


def test_repeated_merges_start_from_the_base_so_rounding_never_accumulates() -> None:
    bases = nvfp4_bases()
    model = bf16_vllm(bases)
    name = f"{LAYER}.self_attn.k_proj"
    for seed in range(5):
        write_merged(model, DenseBases(bases), {name: delta(17, 32, seed=seed)})
    last = delta(17, 32, seed=4)
    rows = dict(model.named_parameters())[f"{LAYER}.self_attn.qkv_proj.weight"][48:65]
    assert torch.equal(rows, (bases[name] + last.scaling * last.b @ last.a).bfloat16())
    write_merged(model, DenseBases(bases), {name: LoraDelta(torch.zeros(1, 32), torch.zeros(17, 1), 0.0)})
    assert torch.equal(dict(model.named_parameters())[f"{LAYER}.self_attn.qkv_proj.weight"][48:65],
                       bases[name].bfloat16())  # fmt: skip


# --------------------------------------------------------------------------------------------
# The BF16 copy and its cache
# --------------------------------------------------------------------------------------------
def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_the_bf16_copy_is_a_plain_bf16_model_of_the_dequantized_base(tmp_path: Path) -> None:
    source = nvfp4_base()
    out = write_bf16_checkpoint(source, tmp_path / "bf16")
    four, copy = load_folder(source), load_folder(out)
    prefixes = sorted(k.removesuffix(".weight_packed") for k in four if k.endswith(".weight_packed"))
    assert prefixes and not any(k.endswith((".weight_packed", ".weight_scale")) for k in copy)
    for prefix in prefixes:
        dense = NVFP4.dequantize({n: four[f"{prefix}.{n}"] for n in NVFP4.checkpoint_names()}, torch.float32)
        assert copy[f"{prefix}.weight"].dtype == torch.bfloat16
        assert torch.equal(copy[f"{prefix}.weight"], dense.bfloat16()), prefix
    untouched = [k for k in four if not any(k.startswith(p + ".") for p in prefixes)]
    assert untouched and all(torch.equal(four[k], copy[k]) for k in untouched)
    config = read_config(out)
    assert "quantization_config" not in config and detect_format(config) == "bf16"
    assert (out / "tokenizer_config.json").is_file() and (out / "tokenizer.json").is_file()
    manifest = json.loads((out / fp8_rollout.MANIFESTS["bf16"]).read_text())
    assert manifest["weights"] == "bf16" and manifest["source_format"] == "nvfp4"
    with pytest.raises(QerlError, match="serves it as it is"):
        write_bf16_checkpoint(out, tmp_path / "again")


def test_merging_into_the_bf16_copy_from_the_4bit_checkpoint(tmp_path: Path) -> None:
    """The worker's path on the CPU: vLLM-shaped parameters loaded from the BF16 copy, the base read
    from the 4-bit checkpoint. B = 0 writes the copy's own weights back bit for bit."""
    source = nvfp4_base()
    copy = load_folder(write_bf16_checkpoint(source, tmp_path / "bf16"))
    wanted = ("q_proj.weight", "up_proj.weight", "down_proj.weight")
    targets = sorted(k.removesuffix(".weight") for k in copy if k.endswith(wanted))
    root, seen = nn.Module(), set()
    for t in targets:
        module, _, shards = vllm_location(t)
        if module not in seen:
            seen.add(module)
            add_module(root, module, torch.cat([copy[f"{s}.weight"] for s in shards]).clone())
    loaded = {n: p.detach().clone() for n, p in root.named_parameters()}
    bases = CheckpointBases(source)
    zero = {t: LoraDelta(torch.randn(RANK, copy[f"{t}.weight"].shape[1]),
                         torch.zeros(copy[f"{t}.weight"].shape[0], RANK), 2.0) for t in targets}  # fmt: skip
    write_merged(root, bases, zero, chunk_rows=7)
    assert all(torch.equal(p, loaded[n]) for n, p in root.named_parameters())
    four = load_folder(source)
    deltas = {t: delta(*copy[f"{t}.weight"].shape, seed=i) for i, t in enumerate(targets)}
    write_merged(root, bases, deltas)
    params = dict(root.named_parameters())
    for t, d in deltas.items():
        module, index, shards = vllm_location(t)
        offset = sum(copy[f"{s}.weight"].shape[0] for s in shards[:index])
        dense = NVFP4.dequantize({n: four[f"{t}.{n}"] for n in NVFP4.checkpoint_names()}, torch.float64)
        reference = dense + d.scaling * d.b.double() @ d.a.double()
        assert within_bf16_rounding(params[f"{module}.weight"][offset : offset + d.b.shape[0]], reference), t


def test_the_bf16_copy_is_cached_by_the_sources_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = Path(shutil.copytree(nvfp4_base(), tmp_path / "base"))
    writes: list[Path] = []
    write = fp8_rollout.write_rollout_copy

    def counting(src: Path, out: Path, weights: str) -> Path:
        writes.append(Path(out))
        return write(src, out, weights)

    monkeypatch.setattr(fp8_rollout, "write_rollout_copy", counting)
    cache = tmp_path / "cache"
    first = bf16_rollout_checkpoint(source, cache)
    assert first.parent == cache / "bf16-rollout" and first.name.startswith("base-")
    assert bf16_rollout_checkpoint(source, cache) == first and len(writes) == 1  # reused, not rewritten
    # A changed source (its weights rewritten: a new modification time) is a new copy.
    weights = sorted(source.glob("*.safetensors"))[0]
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = bf16_rollout_checkpoint(source, cache)
    assert second != first and len(writes) == 2 and (second / "config.json").is_file()
    # So is a changed config.
    config = read_config(source)
    (source / "config.json").write_text(json.dumps({**config, "rope_theta": 12345.0}))
    third = bf16_rollout_checkpoint(source, cache)
    assert third not in (first, second) and len(writes) == 3
    assert read_config(third)["rope_theta"] == 12345.0
    # The FP8 copy of the same base lives beside it, under its own folder.
    assert fp8_rollout.fp8_rollout_checkpoint(source, cache).parent == cache / "fp8-rollout"


# --------------------------------------------------------------------------------------------
# The choice: pinned, refused where it does not fit, and auto
# --------------------------------------------------------------------------------------------
def test_merged_on_a_4bit_base_is_the_bf16_copy_and_fp8_merged_keeps_its_meaning() -> None:
    for fmt in formats.names():
        choice = backends.choose_backend("merged", fmt, concurrency=128, env=env(), table={})
        assert (choice.backend, choice.weight_format) == ("merged", "bf16"), fmt
        assert choice.merges_lora and choice.needs_bf16_copy and not choice.needs_fp8_copy
        assert choice.vllm_kwargs() == {} and "merged" in backends.FORMAT_BACKENDS[fmt]
    eight = backends.choose_backend("fp8-merged", "nvfp4", concurrency=128, env=env(), table={})
    assert eight.backend == "fp8-merged" and eight.needs_fp8_copy and eight.weight_format == "fp8"
    for name in ("merged", "fp8-merged"):  # a BF16 base: its own weights, either name
        dense = backends.choose_backend(name, "bf16", concurrency=128, env=env(), table={})
        assert dense.backend == "merged" and not dense.needs_bf16_copy and dense.weight_format == "bf16"
    # No FP8 tensor cores needed: BF16 GEMMs run on any GPU vLLM does.
    assert backends.choose_backend("merged", "nvfp4", concurrency=8, env=env(capability=(8, 0)), table={})
    assert backends.rollout_weight_format("merged", "nf4") == "bf16"


def sizes_for(shape: ModelShape, fmt: str) -> dict[str, int]:
    return {
        b: weight_bytes(shape, backends.rollout_weight_format(b, fmt)) for b in backends.FORMAT_BACKENDS[fmt]
    }


def test_a_pinned_bf16_copy_that_does_not_fit_is_refused_with_the_bytes_and_the_remedies() -> None:
    sizes = sizes_for(SHAPE_32B, "nvfp4")
    kv = SHAPE_32B.kv_bytes_per_token("auto") * 4096
    small = env(vllm_budget_bytes=int(0.4 * 80 * GIB), kv_bytes_per_sequence=kv, overhead_bytes=4 * GIB)
    with pytest.raises(QerlError) as refused:
        backends.choose_backend("merged", "nvfp4", concurrency=128, env=small, table={}, weight_bytes=sizes)
    message = " ".join(str(refused.value).split())
    copy_gib = sizes["merged"] / GIB
    assert f"({copy_gib:.1f} GiB, 2 bytes a weight)" in message and copy_gib > 55
    assert "vLLM's budget is 32.0 GiB" in message and "need" in message
    assert "fp8-merged" in message and "marlin" in message and "gpu_memory_utilization" in message
    # The same budget serves the 4-bit weights, and a larger one the copy.
    assert backends.choose_backend("marlin", "nvfp4", concurrency=128, env=small, table={},
                                   weight_bytes=sizes).backend == "marlin"  # fmt: skip
    roomy = env(vllm_budget_bytes=int(0.8 * 140 * GIB), kv_bytes_per_sequence=kv, overhead_bytes=4 * GIB)
    assert backends.choose_backend("merged", "nvfp4", concurrency=128, env=roomy, table={},
                                   weight_bytes=sizes).needs_bf16_copy  # fmt: skip


def test_auto_takes_the_bf16_copy_only_where_measured_and_known_to_fit() -> None:
    measured = {"model": QWEN7B.to_dict(), "marlin": {"8": 1500.0, "128": 7000.0},
                "fp8-merged": {"8": 1400.0, "128": 9000.0}}  # fmt: skip
    table = {"gpus": {H100: {"nvfp4+lora": measured}}}
    sizes = sizes_for(ModelShape.from_config(qwen7b_config()), "nvfp4")  # QWEN7B's shape
    roomy = env(vllm_budget_bytes=60 * GIB, kv_bytes_per_sequence=GIB // 4, overhead_bytes=4 * GIB)

    def auto(table: dict, fmt: str = "nvfp4", **kwargs) -> backends.BackendChoice:
        settings = dict(concurrency=128, env=roomy, table=table, weight_bytes=sizes, model=QWEN7B,
                        merge_ok=True, fp8_ok=False)  # fmt: skip
        return backends.choose_backend("auto", fmt, **{**settings, **kwargs})

    # No measurement of the BF16 copy: never chosen, however much room there is.
    assert auto(table).backend == "marlin" and "merged" not in auto(table).candidates
    with_copy = {"gpus": {H100: {"nvfp4+lora": {**measured, "merged": {"8": 1450.0, "128": 11000.0}}}}}
    chosen = auto(with_copy)
    assert chosen.backend == "merged" and chosen.needs_bf16_copy and "merged 11000 tok/s" in chosen.reason
    assert auto(with_copy, merge_ok=False).backend == "marlin"  # not the trainer's engine
    assert auto(with_copy, weight_bytes=None).backend == "marlin"  # vLLM's memory not known
    tight = env(vllm_budget_bytes=10 * GIB, kv_bytes_per_sequence=GIB // 4, overhead_bytes=4 * GIB)
    assert auto(with_copy, env=tight).backend == "marlin"  # the copy leaves no KV room
    assert auto({"gpus": {}}).backend == "marlin"
    # The shipped table measures no BF16 copy of a 4-bit base: auto keeps off it at every concurrency.
    shipped = backends.load_table(None)
    for concurrency in (8, 128, 512):
        for fmt in formats.names():
            fmt_sizes = sizes_for(ModelShape.from_config(qwen7b_config()), fmt)
            choice = auto(shipped, fmt, concurrency=concurrency, weight_bytes=fmt_sizes, fp8_ok=True)
            assert not choice.needs_bf16_copy, (fmt, concurrency, choice.reason)


# --------------------------------------------------------------------------------------------
# The factory, the recipe, the trainer and the bench
# --------------------------------------------------------------------------------------------
def test_factory_serves_the_bf16_copy_without_lora_and_merges_onto_the_4bit_base(
    fake_llm: list[dict],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from qerl_cli.rollout import vllm_setup
    from qerl_cli.rollout.factory import EngineRequest, make_engine

    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "cache"))
    base = nvfp4_base()
    request = EngineRequest(
        "vllm", base, linear_backend="merged", gpu_memory_utilization=0.5, max_model_len=64
    )
    engine = make_engine(request)
    seen = fake_llm[-1]
    served = Path(seen["model"])
    assert (
        served.parent == tmp_path / "cache" / "bf16-rollout" and detect_format(read_config(served)) == "bf16"
    )
    assert seen["enable_lora"] is False and seen["merge_base"] == str(base) and seen["model_format"] == "auto"
    assert seen["vllm_kwargs"] == {} and engine.backend_choice.weight_format == "bf16"
    # Too small a share for the copy: refused before anything is written.
    monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path / "other-cache"))
    monkeypatch.setattr(vllm_setup, "_cuda_total_bytes", lambda: 4 * GIB)
    with pytest.raises(QerlError, match="BF16 copy of the nvfp4 base"):
        make_engine(request)
    assert not (tmp_path / "other-cache" / "bf16-rollout").exists()


def test_the_recipe_accepts_merged_for_a_4bit_base_on_vllm() -> None:
    cfg = load_config(
        TrainConfig, None, ["model.path=x", "rollout.engine=vllm", "rollout.linear_backend=merged"]
    )
    assert cfg.rollout.linear_backend == "merged"
    with pytest.raises(QerlError, match="engine=vllm"):
        load_config(TrainConfig, None, ["model.path=x", "rollout.engine=hf", "rollout.linear_backend=merged"])


def test_the_trainer_reads_bf16_rollout_weights_for_the_bf16_copy(caplog: pytest.LogCaptureFixture) -> None:
    from qerl_cli.rl.setup import tis_enabled

    cfg = load_config(TrainConfig, None, ["model.path=x", "rollout.engine=vllm", "algorithm.tis='off'"])
    policy = SimpleNamespace(is_quantized=True, base_format="nvfp4")
    assert tis_enabled(cfg, policy, "merged") is False  # BF16 weights: no FP8 rounding to force TIS for
    assert "overridden" not in caplog.text
    assert tis_enabled(cfg, policy, "fp8-merged") is True  # the FP8 copy: forced on


def test_the_bench_measures_the_bf16_copy_beside_the_others() -> None:
    both = ["marlin", "fp8-merged", "merged"]
    assert backends_for("nvfp4", both) == ["marlin", "fp8-merged", "merged"]
    assert backends_for("nf4", ["merged"]) == ["default", "merged"]
    assert backends_for("bf16", both) == ["default", "merged"]  # its own merge, once
    rows = [{"format": "nvfp4", "backend": b, "lora_rank": 16, "batch": 128, "output_tokens_per_s": 9000.0}
            for b in ("marlin", "merged")]  # fmt: skip
    report = BenchResult(schema=SCHEMA, created="now", device="gpu", figures_label="", machine={},
                         gpu={"name": H100}, versions={}, settings={"prompt_len": 256, "gen_len": 2048},
                         rollout=rows)  # fmt: skip
    add_roofline(report, {"nvfp4": qwen7b_config()})
    marlin, merged = (row["roofline"] for row in report.rollout)
    # The copy's BF16 weights are read every decode step: four times the NVFP4 bytes, a lower bound.
    assert merged["bound_tokens_per_s"] < marlin["bound_tokens_per_s"]

"""The merged FP8 rollout weights (rollout.linear_backend: fp8-merged), on the CPU against a dense
float32 reference and a fake module laid out like vLLM's (stacked qkv / gate_up, FP8 weight + scale)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qerl_cli import formats
from qerl_cli.bench.models import shape_checkpoint
from qerl_cli.errors import QerlError
from qerl_cli.formats import fp8
from qerl_cli.rollout.fp8_merge import (
    CheckpointBases,
    DenseBases,
    LoraDelta,
    deltas_from_tensors,
    merge_to_fp8,
    strip_peft_prefix,
    vllm_location,
    write_merged,
)
from qerl_cli.rollout.fp8_rollout import write_fp8_checkpoint
from qerl_cli.rollout.vllm_worker import MERGE_BASES_ATTR, worker_merge_lora

HIDDEN, HEADS_OUT, KV_OUT, MLP, RANK = 32, 32, 16, 48, 4
LAYER = "model.layers.0"
SHAPES = {  # HF linear -> (out, in)
    "self_attn.q_proj": (HEADS_OUT, HIDDEN), "self_attn.k_proj": (KV_OUT, HIDDEN),
    "self_attn.v_proj": (KV_OUT, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS_OUT),
    "mlp.gate_proj": (MLP, HIDDEN), "mlp.up_proj": (MLP, HIDDEN), "mlp.down_proj": (HIDDEN, MLP),
}  # fmt: skip
VLLM = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.down_proj": ("mlp.down_proj",)}  # fmt: skip


def _bases(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{LAYER}.{n}": torch.randn(shape, generator=g) * 0.05 for n, shape in SHAPES.items()}


def _delta(out: int, inp: int, seed: int, scaling: float = 2.0) -> LoraDelta:
    g = torch.Generator().manual_seed(seed)
    return LoraDelta(
        torch.randn(RANK, inp, generator=g) * 0.1, torch.randn(out, RANK, generator=g) * 0.1, scaling
    )


def _fake_vllm(bases: dict[str, torch.Tensor], *, transposed: bool = True) -> nn.Module:
    """A module with vLLM's parameter names: each linear's FP8 copy of its base (shards stacked), with
    the weight transposed as vLLM's FP8 layers keep it after loading (``transposed``)."""
    root = nn.Module()
    for fused, shards in VLLM.items():
        codes, scale = fp8.quantize_per_channel(torch.cat([bases[f"{LAYER}.{s}"] for s in shards]))
        module = nn.Module()
        weight = codes.t() if transposed else codes  # a [in, out] column-major view, as vLLM's .t()
        module.weight = nn.Parameter(weight, requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
        parent = root
        for part in f"{LAYER}.{fused}".split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(fused.split(".")[-1], module)
    return root


def _reference(bases: dict[str, torch.Tensor], deltas: dict[str, LoraDelta], fused: str) -> torch.Tensor:
    """Dense float32 base + scaling * B @ A of a vLLM module's shards, stacked in order."""
    rows = []
    for shard in VLLM[fused]:
        name = f"{LAYER}.{shard}"
        w = bases[name].clone()
        if name in deltas:
            d = deltas[name]
            w += d.scaling * d.b @ d.a
        rows.append(w)
    return torch.cat(rows)


def test_vllm_location_names_the_stacked_shard():
    assert vllm_location("model.layers.3.self_attn.k_proj") == (
        "model.layers.3.self_attn.qkv_proj", 1,
        tuple(f"model.layers.3.self_attn.{n}_proj" for n in "qkv"),
    )  # fmt: skip
    assert vllm_location("model.layers.3.mlp.up_proj")[:2] == ("model.layers.3.mlp.gate_up_proj", 1)
    assert vllm_location("model.layers.3.mlp.down_proj") == (
        "model.layers.3.mlp.down_proj",
        0,
        ("model.layers.3.mlp.down_proj",),
    )


def test_merge_matches_dense_reference_within_one_rounding():
    base = _bases()[f"{LAYER}.mlp.down_proj"]
    delta = _delta(*base.shape, seed=1, scaling=16 / RANK)
    codes, scale = merge_to_fp8(base, delta)
    reference = base + delta.scaling * delta.b @ delta.a
    assert codes.dtype == fp8.FP8_DTYPE and codes.shape == base.shape and scale.shape == (base.shape[0], 1)
    # Per-channel: each row's largest magnitude lands on the largest E4M3 value.
    torch.testing.assert_close(scale, reference.abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX)
    error = (fp8.dequantize_per_channel(codes, scale) - reference).abs()
    assert (error <= fp8.rounding_bound(reference, scale) + 1e-7).all()
    # The LoRA term matters: without it the codes decode to another weight.
    plain, plain_scale = merge_to_fp8(base, None)
    assert (fp8.dequantize_per_channel(plain, plain_scale) - reference).abs().max() > error.max() * 4


def test_alpha_over_r_scales_the_update():
    base = torch.zeros(8, 16)
    delta = _delta(8, 16, seed=2, scaling=1.0)
    half = LoraDelta(delta.a, delta.b, 0.5)
    codes, scale = merge_to_fp8(base, delta)
    codes_h, scale_h = merge_to_fp8(base, half)
    # A zero base: halving the scaling halves the scales and keeps the codes.
    assert torch.equal(codes.float(), codes_h.float())
    torch.testing.assert_close(scale_h, scale / 2)


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 10_000])
def test_chunked_merge_equals_one_shot(chunk_rows):
    base = _bases()[f"{LAYER}.mlp.gate_proj"]
    delta = _delta(*base.shape, seed=3)
    one_codes, one_scale = merge_to_fp8(base, delta, chunk_rows=base.shape[0])
    codes, scale = merge_to_fp8(base, delta, chunk_rows=chunk_rows)
    # Every row has its own scale, so chunking changes nothing but the float32 matmul's summation order
    # (one row takes BLAS's matrix-vector path): scales agree to float32 rounding, and a code can move
    # only where a value sat on an E4M3 rounding boundary.
    torch.testing.assert_close(scale, one_scale, rtol=1e-6, atol=0)
    same = codes.view(torch.uint8) == one_codes.view(torch.uint8)
    assert same.float().mean() > 0.999
    moved = (
        fp8.dequantize_per_channel(codes, scale) - fp8.dequantize_per_channel(one_codes, one_scale)
    ).abs()
    reference = base + delta.scaling * delta.b @ delta.a
    assert (moved <= 2 * fp8.rounding_bound(reference, one_scale) + 1e-7).all()


@pytest.mark.parametrize("transposed", [True, False])
def test_write_merged_into_stacked_params_in_place(transposed):
    bases = _bases()
    targets = ["self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"]
    deltas = {f"{LAYER}.{n}": _delta(*SHAPES[n], seed=10 + i, scaling=0.5 + i) for i, n in enumerate(targets)}
    model = _fake_vllm(bases, transposed=transposed)
    before = {name: (p, p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}

    written = write_merged(model, DenseBases(bases), deltas, chunk_rows=7)

    assert written == len(deltas)
    for name, (param, ptr, _old) in before.items():
        now = dict(model.named_parameters())[name]
        assert now is param and now.data_ptr() == ptr, f"{name} was reallocated"
    for fused in VLLM:
        weight = dict(model.named_parameters())[f"{LAYER}.{fused}.weight"]
        scale = dict(model.named_parameters())[f"{LAYER}.{fused}.weight_scale"]
        row_major = weight.t() if transposed else weight
        reference = _reference(bases, deltas, fused)
        expect_scale = reference.abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX
        torch.testing.assert_close(scale.data, expect_scale, rtol=1e-6, atol=0, msg=fused)
        decoded = fp8.dequantize_per_channel(row_major, scale)
        assert ((decoded - reference).abs() <= fp8.rounding_bound(reference, scale) + 1e-7).all(), fused
    # An untargeted shard (k_proj, rows 32:48 of qkv) keeps exactly what was loaded.
    qkv_old = before[f"{LAYER}.self_attn.qkv_proj.weight"][2]
    qkv_now = dict(model.named_parameters())[f"{LAYER}.self_attn.qkv_proj.weight"]
    old_rm, now_rm = (qkv_old.t(), qkv_now.t()) if transposed else (qkv_old, qkv_now)
    k_rows = slice(HEADS_OUT, HEADS_OUT + KV_OUT)
    assert torch.equal(old_rm[k_rows].float(), now_rm[k_rows].float())
    assert not torch.equal(old_rm[:HEADS_OUT].float(), now_rm[:HEADS_OUT].float())


def test_write_merged_into_a_bf16_model_casts():
    """vLLM serving a BF16 base unquantized: the merged weight in its dtype (TRL's merged baseline)."""
    bases = _bases()
    root = nn.Module()
    root.proj = nn.Module()
    root.proj.down_proj = nn.Linear(MLP, HIDDEN, bias=False).to(torch.bfloat16)
    name = "proj.down_proj"
    delta = _delta(HIDDEN, MLP, seed=4)
    ptr = root.proj.down_proj.weight.data_ptr()
    write_merged(root, DenseBases({name: bases[f"{LAYER}.mlp.down_proj"]}), {name: delta})
    expect = (bases[f"{LAYER}.mlp.down_proj"] + delta.scaling * delta.b @ delta.a).to(torch.bfloat16)
    assert root.proj.down_proj.weight.data_ptr() == ptr
    assert torch.equal(root.proj.down_proj.weight, expect)


def test_shape_mismatch_is_refused_clearly():
    bases = _bases()
    model = _fake_vllm(bases)
    # A tensor-parallel rank holds half the rows: the base's shards do not fit it.
    small = {k: v[: v.shape[0] // 2] if "qkv" not in k else v for k, v in bases.items()}
    name = f"{LAYER}.self_attn.q_proj"
    with pytest.raises(QerlError, match=r"qkv_proj.weight is \(64, 32\) in vLLM .*tensor_parallel_size=1"):
        write_merged(model, DenseBases(small), {name: _delta(HEADS_OUT // 2, HIDDEN, seed=5)})
    with pytest.raises(QerlError, match="trained on another model"):
        write_merged(model, DenseBases(bases), {name: _delta(HEADS_OUT + 1, HIDDEN, seed=5)})
    with pytest.raises(QerlError, match="no model.layers.0.self_attn.qk_proj.weight"):
        write_merged(model, DenseBases({"model.layers.0.self_attn.qk_proj": bases[name]}),
                     {"model.layers.0.self_attn.qk_proj": _delta(HEADS_OUT, HIDDEN, seed=5)})  # fmt: skip


def test_per_tensor_fp8_is_refused():
    bases = _bases()
    model = _fake_vllm(bases)
    down = model.get_submodule(f"{LAYER}.mlp.down_proj")
    down.weight_scale = nn.Parameter(torch.ones(()), requires_grad=False)  # vLLM's online FP8
    name = f"{LAYER}.mlp.down_proj"
    with pytest.raises(QerlError, match="one scale per output row"):
        write_merged(model, DenseBases(bases), {name: _delta(HIDDEN, MLP, seed=6)})


def test_deltas_from_saved_adapter_tensors():
    a, b = torch.randn(4, 8), torch.randn(6, 4)
    a2, b2 = torch.randn(2, 8), torch.randn(6, 2)
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": a2,
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": b2,
    }
    config = {"r": 4, "lora_alpha": 8, "rank_pattern": {"up_proj": 2}, "alpha_pattern": {"up_proj": 1}}
    deltas = deltas_from_tensors(tensors, config)
    assert deltas["model.layers.0.self_attn.q_proj"].scaling == 2.0
    assert deltas["model.layers.0.mlp.up_proj"].scaling == 0.5
    rs = deltas_from_tensors(tensors, {**config, "use_rslora": True, "alpha_pattern": {}})
    assert rs["model.layers.0.self_attn.q_proj"].scaling == 4.0
    with pytest.raises(QerlError, match="DoRA"):
        deltas_from_tensors(tensors, {**config, "use_dora": True})
    assert strip_peft_prefix("base_model.model.model.layers.1.mlp.up_proj") == "model.layers.1.mlp.up_proj"


def _stack_like_vllm(tensors: dict[str, torch.Tensor]) -> nn.Module:
    """vLLM's layout of an FP8 rollout copy: q/k/v and gate/up stacked, weights transposed."""
    root = nn.Module()
    fused_names = {prefix: vllm_location(prefix) for prefix in {k.rsplit(".", 1)[0] for k in tensors}}
    for module, _index, shards in {loc[0]: loc for loc in fused_names.values()}.values():
        if f"{shards[0]}.weight_scale" not in tensors:
            continue  # not an FP8 linear (norms, embeddings)
        weight = torch.cat([tensors[f"{s}.weight"] for s in shards])
        scale = torch.cat([tensors[f"{s}.weight_scale"] for s in shards])
        layer = nn.Module()
        layer.weight = nn.Parameter(weight.t(), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        parent = root
        for part in module.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(module.split(".")[-1], layer)
    return root


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_merge_from_a_4bit_checkpoint_into_its_fp8_copy(fmt: str, tmp_path) -> None:
    """The worker's path on the CPU: the 4-bit base read from its checkpoint, merged into vLLM-shaped
    parameters loaded from the ``fp8`` backend's copy. B = 0 rewrites the copy's own codes exactly."""
    from safetensors.torch import load_file

    source = shape_checkpoint("tiny", fmt)
    copy = write_fp8_checkpoint(source, tmp_path / "fp8")
    tensors = {k: v for f in copy.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    model = _stack_like_vllm(tensors)
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    targets = sorted(k.removesuffix(".weight_scale") for k in tensors if k.endswith(".weight_scale"))
    targets = [t for t in targets if t.endswith(("q_proj", "v_proj", "up_proj", "down_proj"))]
    assert targets
    bases = CheckpointBases(source)
    zero = {}
    for t in targets:
        out, inp = tensors[f"{t}.weight"].shape
        zero[t] = LoraDelta(torch.randn(RANK, inp), torch.zeros(out, RANK), 2.0)
    write_merged(model, bases, zero, chunk_rows=5)
    for name, param in model.named_parameters():
        # As values: a dequantized -0.0 plus a zero update is +0.0, another code for the same weight.
        assert torch.equal(param.float(), loaded[name].float()), name
    qfmt = formats.get(fmt)
    four = {k: v for f in source.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    deltas = {t: _delta(*tensors[f"{t}.weight"].shape, seed=i) for i, t in enumerate(targets)}
    write_merged(model, bases, deltas)
    params = dict(model.named_parameters())
    for t, delta in deltas.items():
        module, index, shards = vllm_location(t)
        offset = sum(tensors[f"{s}.weight"].shape[0] for s in shards[:index])
        rows = slice(offset, offset + delta.b.shape[0])
        dense = qfmt.dequantize({n: four[f"{t}.{n}"] for n in qfmt.checkpoint_names()}, torch.float32)
        reference = dense + delta.scaling * delta.b @ delta.a
        scale = params[f"{module}.weight_scale"][rows]
        decoded = fp8.dequantize_per_channel(params[f"{module}.weight"].t()[rows], scale)
        assert ((decoded - reference).abs() <= fp8.rounding_bound(reference, scale) + 1e-7).all(), t


def test_worker_merge_reads_the_base_checkpoint_once(tmp_path) -> None:
    """The function vLLM's worker runs (through LLM.apply_model): the checkpoint index is built on the
    first merge and kept on the model for the next."""
    from safetensors.torch import save_file

    bases = _bases()
    folder = tmp_path / "bf16"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2", "torch_dtype": "bfloat16"}')
    save_file({f"{k}.weight": v.contiguous() for k, v in bases.items()}, str(folder / "model.safetensors"))
    model = _fake_vllm(bases)
    name = f"{LAYER}.self_attn.k_proj"
    assert worker_merge_lora(model, str(folder), {name: _delta(KV_OUT, HIDDEN, seed=7)}) == 1
    index = getattr(model, MERGE_BASES_ATTR)
    assert worker_merge_lora(model, str(folder), {name: _delta(KV_OUT, HIDDEN, seed=8)}) == 1
    assert getattr(model, MERGE_BASES_ATTR) is index
    qkv = dict(model.named_parameters())[f"{LAYER}.self_attn.qkv_proj.weight"].t()
    scale = dict(model.named_parameters())[f"{LAYER}.self_attn.qkv_proj.weight_scale"]
    rows = slice(HEADS_OUT, HEADS_OUT + KV_OUT)
    delta = _delta(KV_OUT, HIDDEN, seed=8)
    reference = bases[name] + delta.scaling * delta.b @ delta.a
    decoded = fp8.dequantize_per_channel(qkv[rows], scale[rows])
    assert ((decoded - reference).abs() <= fp8.rounding_bound(reference, scale[rows]) + 1e-7).all()

"""4-bit formats: byte-for-byte against compressed-tensors 0.19 (NVFP4/MXFP4) and bitsandbytes (NF4)."""

from __future__ import annotations

import copy

import pytest
import torch

from qerl_cli import formats
from qerl_cli.errors import QerlError
from qerl_cli.formats.fp4 import decode_packed, e2m1_codes, e2m1_values, pack_low_first, unpack_low_first
from qerl_cli.formats.nf4 import NF4Format, dynamic_map

SHAPES = [(64, 128), (96, 512), (33, 256)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def hard_weight(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian weight with outliers, an all-zero row segment, a tiny block and exact E2M1 ties."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02
    w[0, :64] = 0.0  # all-zero blocks for every block size
    w[1, 5] = 1.7  # outliers
    w[2, 17] = -3.1
    w[3, :32] = torch.randn(32, generator=gen) * 1e-6  # tiny block
    w[4, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2) * 0.01
    w[5, 7] = -0.0
    return w.to(dtype)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compressed_tensors_reference(weight: torch.Tensor, scheme_name: str, global_scale=None) -> dict:
    """compressed-tensors' own compression: llm-compressor's min-max observer, then the compressor."""
    pytest.importorskip("llmcompressor")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from llmcompressor.observers.base import Observer

    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    observer = Observer.load_from_registry(
        "memoryless_minmax", base_name="weight", args=copy.deepcopy(scheme.weights)
    )
    observer(weight)
    qparams = observer.get_qparams()
    scale = qparams["scale"]
    if global_scale is not None:  # a fused group's shared scale, as llm-compressor's fused observers give
        groups = weight.unflatten(-1, (-1, scheme.weights.group_size))
        scale, _ = calculate_qparams(
            groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale
        )
    # llm-compressor keeps the scale parameter in the weight's dtype between calibration and compression.
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype)}
    if qparams["global_scale"] is not None:
        state["weight_global_scale"] = qparams["global_scale"] if global_scale is None else global_scale
    compressor = NVFP4PackedCompressor if scheme_name.startswith("NVFP4") else MXFP4PackedCompressor
    return dict(compressor.compress(state, scheme)), scheme, compressor


def test_registry() -> None:
    assert formats.names() == ["nvfp4", "mxfp4", "nf4"]
    assert formats.get("NVFP4").block_size == 16
    assert formats.get("mxfp4").block_size == 32
    assert formats.get("nf4").block_size == 64
    with pytest.raises(QerlError, match="choose one of"):
        formats.get("int4")


def test_e2m1_round_half_even_and_packing() -> None:
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 9.0, -0.1, -6.0, 0.0, -0.0])
    codes = e2m1_codes(x)
    expected = [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -6.0, 0.0, 0.0]
    assert e2m1_values(codes).tolist() == expected
    assert codes[10].item() == 0x8  # small negatives keep their sign bit, as compressed-tensors packs them
    assert codes[13].item() == 0x0  # ... but -0.0 does not
    packed = pack_low_first(codes.reshape(1, -1))
    assert packed[0, 0].item() == (codes[1].item() << 4) | codes[0].item()
    assert torch.equal(unpack_low_first(packed).reshape(-1), codes)


def test_the_byte_table_decodes_as_unpack_then_decode() -> None:
    """decode_packed (the dequantization path) gives every byte's two values, signed zeros included."""
    packed = torch.arange(256, dtype=torch.uint8).flip(0).reshape(8, 32)
    chain, table = e2m1_values(unpack_low_first(packed)), decode_packed(packed)
    assert table.shape == (8, 64) and table.dtype == torch.float32
    assert torch.equal(table, chain) and torch.equal(table.signbit(), chain.signbit())
    assert table.signbit().sum() == 256  # the nibbles 8-15, half of all, are negative (8 is -0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt_name,scheme", [("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16")])
def test_fp4_bytes_equal_compressed_tensors(fmt_name: str, scheme: str, shape, dtype) -> None:
    weight = hard_weight(shape, dtype)
    reference, ct_scheme, compressor = compressed_tensors_reference(weight, scheme)
    ours = formats.get(fmt_name).quantize(weight)
    assert set(ours) == set(reference) == set(formats.get(fmt_name).checkpoint_names())
    for name in ours:
        assert bitwise_equal(ours[name], reference[name]), name
    # Dequantization equals compressed-tensors' decompression exactly.
    dense = compressor.decompress(dict(reference), ct_scheme)["weight"]
    assert bitwise_equal(formats.get(fmt_name).dequantize(ours, torch.bfloat16), dense.to(torch.bfloat16))


def test_nvfp4_shared_global_scale_matches_fused_observers() -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.utils import generate_gparam

    q, k, v = (hard_weight((64, 128), torch.bfloat16, seed=s) * (s + 1) for s in range(3))
    shared = formats.shared_global_scale([q, k, v])
    amax = torch.stack([w.abs().amax() for w in (q, k, v)]).amax()
    assert bitwise_equal(shared, generate_gparam(-amax.reshape(1), amax.reshape(1)))
    for w in (q, k, v):
        reference, _, _ = compressed_tensors_reference(w, "NVFP4A16", global_scale=shared)
        ours = formats.get("nvfp4").quantize(w, global_scale=shared)
        for name in ours:
            assert bitwise_equal(ours[name], reference[name]), name
    assert (
        formats.fused_group_key("model.layers.3.self_attn.k_proj")
        == "model.layers.3.self_attn.q_proj|k_proj|v_proj"
    )
    assert formats.fused_group_key("model.layers.3.mlp.up_proj") == "model.layers.3.mlp.gate_proj|up_proj"
    assert formats.fused_group_key("model.layers.3.mlp.down_proj") is None


def test_all_zero_weight_and_bad_inputs() -> None:
    zero = torch.zeros(16, 64, dtype=torch.bfloat16)
    for name in formats.names():
        fmt = formats.get(name)
        assert torch.equal(fmt.dequantize(fmt.quantize(zero)), zero)
        with pytest.raises(QerlError, match="multiple of the block size"):
            fmt.quantize(torch.randn(16, 72))
        with pytest.raises(QerlError, match="NaN or Inf"):
            fmt.quantize(torch.full((16, 64), float("nan")))
    assert formats.get("nvfp4").quantize(zero)["weight_global_scale"].item() == 1.0


def _bnb():
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    try:
        bnb_functional.quantize_4bit(torch.randn(64, 64), quant_type="nf4", blocksize=64)
    except Exception as exc:  # pragma: no cover - depends on the bitsandbytes build
        pytest.skip(f"bitsandbytes cannot quantize on CPU here: {exc}")
    return bnb_functional


def _bnb_checkpoint_tensors(weight: torch.Tensor, double_quant: bool) -> tuple[dict, object]:
    bnb_functional = _bnb()
    packed, state = bnb_functional.quantize_4bit(
        weight, quant_type="nf4", blocksize=64, compress_statistics=double_quant
    )
    # The keys transformers writes for a bitsandbytes Linear4bit ("weight" + "weight.<state key>").
    tensors = {"weight": packed, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    return tensors, state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_nf4_bytes_equal_bitsandbytes(shape, dtype) -> None:
    weight = hard_weight(shape, dtype)
    reference, state = _bnb_checkpoint_tensors(weight, double_quant=False)
    ours = NF4Format(double_quant=False).quantize(weight)
    assert list(ours) == list(reference)
    for name in ours:
        assert bitwise_equal(ours[name], reference[name]), name
    bnb_dense = _bnb().dequantize_4bit(reference["weight"], state)
    assert bitwise_equal(NF4Format(False).dequantize(ours, dtype), bnb_dense)


@pytest.mark.parametrize("shape", [(64, 128), (384, 512)])
def test_nf4_double_quant_matches_bitsandbytes(shape) -> None:
    weight = hard_weight(shape, torch.bfloat16)
    reference, state = _bnb_checkpoint_tensors(weight, double_quant=True)
    fmt = formats.get("nf4")
    ours = fmt.quantize(weight)
    assert list(ours) == list(reference)
    for name in ours:
        if name != "weight.absmax":
            assert bitwise_equal(ours[name], reference[name]), name
    # The nested 8-bit absmax codes: bitsandbytes' C++ CPU kernel uses an approximate table-driven binary
    # search that sometimes returns a neighbour of the nearest code. Ours is always the nearest, so
    # where they differ ours must be at least as close, and such cases must stay rare.
    mine, theirs = ours["weight.absmax"].long(), reference["weight.absmax"].long()
    differ = (mine != theirs).nonzero().flatten()
    assert differ.numel() <= max(2, mine.numel() // 50)
    absmax = weight.float().reshape(-1, 64).abs().amax(-1)
    centred = absmax - absmax.mean()
    nested_absmax = ours["weight.nested_absmax"]
    code = dynamic_map()
    for i in differ.tolist():
        normed = centred[i] / nested_absmax[i // 256]
        assert (normed - code[mine[i]]).abs() <= (normed - code[theirs[i]]).abs()
    # And bitsandbytes dequantizes our tensors to (nearly) the same weight as its own.
    bnb_functional = _bnb()
    state_dict = {k.removeprefix("weight."): v for k, v in ours.items() if k != "weight"}
    bnb_state = type(state).from_dict(state_dict, device=torch.device("cpu"))
    from_ours = bnb_functional.dequantize_4bit(ours["weight"], bnb_state)
    assert bitwise_equal(fmt.dequantize(ours, torch.bfloat16), from_ours)
    own = bnb_functional.dequantize_4bit(reference["weight"], state)
    changed_blocks = (from_ours != own).reshape(-1, 64).any(-1).nonzero().flatten()
    assert set(changed_blocks.tolist()) <= set(differ.tolist())


def test_nf4_state_json_round_trip() -> None:
    from qerl_cli.formats.nf4 import read_state

    tensors = formats.get("nf4").quantize(torch.randn(32, 128, dtype=torch.bfloat16))
    state = read_state(tensors)
    assert state["quant_type"] == "nf4" and state["blocksize"] == 64 and state["shape"] == [32, 128]
    assert state["dtype"] == "bfloat16" and state["nested_blocksize"] == 256
    assert tensors["weight"].shape == (32 * 128 // 2, 1)


def test_format_traits_live_on_the_registry_and_the_config_literals_follow_it() -> None:
    import typing

    from qerl_cli import config, formats
    from qerl_cli.modeling.shapes import MARLIN_FORMATS
    from qerl_cli.rollout.backends import FORMAT_BACKENDS
    from qerl_cli.rollout.vllm_setup import MIN_CAPABILITY

    assert set(typing.get_args(config.QuantFormat)) == set(formats.names())
    assert set(typing.get_args(config.ModelFormat)) == {"auto", "bf16", *formats.names()}
    assert formats.fp4_names() == MARLIN_FORMATS == ("nvfp4", "mxfp4")
    for name, fmt in formats.FORMATS.items():
        assert MIN_CAPABILITY[name] == fmt.vllm_min_capability
        assert FORMAT_BACKENDS[name] == fmt.rollout_backends
    assert formats.get("nf4").vllm_quantization == "bitsandbytes" and not formats.get("nf4").fp4


def test_tables_keyed_by_format_are_built_from_the_registry_with_their_old_values() -> None:
    from qerl_cli.formats.checkpoint import check_checkpoint_format
    from qerl_cli.modeling.loading import COMPRESSED_TENSORS_FORMATS
    from qerl_cli.modeling.model_shape import WEIGHT_BYTES
    from qerl_cli.quantize.pipeline import SCHEMES
    from qerl_cli.rollout.backends import NOT_FP4_FORMATS

    assert formats.model_names() == ["bf16", *formats.names()]
    assert WEIGHT_BYTES == {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32,
                            "nf4": 0.5 + 1 / 64}  # fmt: skip
    assert COMPRESSED_TENSORS_FORMATS == {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
    assert SCHEMES == {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}
    assert NOT_FP4_FORMATS == ("bf16", "nf4")
    listed = ", ".join(formats.names())
    with pytest.raises(QerlError, match=f"unknown checkpoint format 'fp3'; choose one of: bf16, {listed}$"):
        check_checkpoint_format("fp3")
    with pytest.raises(QerlError, match=f"--x: unknown format 'fp3', 'NVFP4'; choose one of: {listed}$"):
        formats.check_names(["nvfp4", "fp3", "NVFP4"], option="--x")  # compared as given

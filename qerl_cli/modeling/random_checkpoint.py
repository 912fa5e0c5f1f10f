"""Random-weight checkpoints of real model shapes, written directly in bf16 / nvfp4 / mxfp4 / nf4.

Benchmarks and memory tests need a Qwen2.5-7B..72B-*shaped* model, not its weights. This writes one in
exactly the layout vLLM and transformers load (compressed-tensors ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized``, or bitsandbytes NF4 with double quantization), streaming one decoder layer at a
time into safetensors shards so a 72B shape never has to fit in memory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from qerl_cli import formats
from qerl_cli.errors import QerlError
from qerl_cli.files import honour_umask
from qerl_cli.formats.nvfp4 import fused_group_key, shared_global_scale

CHECKPOINT_FORMATS = ("bf16", "nvfp4", "mxfp4", "nf4")
COMPRESSED_TENSORS_VERSION = "0.19.0"

_QWEN25_COMMON = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", max_position_embeddings=32768,
    rope_theta=1000000.0, use_sliding_window=False, attention_dropout=0.0, bos_token_id=151643,
    eos_token_id=151645,
)  # fmt: skip


def _tiny_shape() -> dict:
    from qerl_cli.modeling.tiny import build_tiny_config

    config = build_tiny_config().to_dict()
    keep = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    shape = {k: config[k] for k in keep if k in config}
    shape.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    return shape


# Real Qwen2.5 dimensions (Hugging Face config.json of each size).
SHAPES: dict[str, dict] = {
    # The offline tiny model's own config (qerl_cli.modeling.tiny), so its tokenizer's ids fit.
    "tiny": _tiny_shape(),
    "qwen2.5-0.5b": dict(_QWEN25_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25_COMMON, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6,
                         tie_word_embeddings=True),
    "qwen2.5-3b": dict(_QWEN25_COMMON, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25_COMMON, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6,
                       tie_word_embeddings=False),
    "qwen2.5-14b": dict(_QWEN25_COMMON, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, rms_norm_eps=1e-5,
                        tie_word_embeddings=False),
    "qwen2.5-32b": dict(_QWEN25_COMMON, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, rms_norm_eps=1e-5,
                        tie_word_embeddings=False),
    "qwen2.5-72b": dict(_QWEN25_COMMON, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, rms_norm_eps=1e-5,
                        tie_word_embeddings=False),
}  # fmt: skip


def model_config(shape: str | dict):  # -> transformers.PretrainedConfig
    """A transformers config from a SHAPES name or a config dict (``model_type`` required)."""
    from transformers import AutoConfig

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise QerlError(f"unknown model shape {shape!r}; choose one of: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    fields = {k: v for k, v in shape.items() if k != "model_type"}
    return AutoConfig.for_model(shape["model_type"], **fields)


def quantization_config(fmt: str) -> dict | None:
    """The config.json ``quantization_config`` vLLM and transformers expect for ``fmt``."""
    if fmt == "bf16":
        return None
    if fmt in ("nvfp4", "mxfp4"):
        nvfp4 = fmt == "nvfp4"
        ct_format = f"{fmt}-pack-quantized"
        weights = {
            "actorder": None, "block_structure": None, "dynamic": False, "group_size": 16 if nvfp4 else 32,
            "num_bits": 4, "observer": "memoryless_minmax", "observer_kwargs": {},
            "scale_dtype": "torch.float8_e4m3fn" if nvfp4 else "torch.uint8",
            "strategy": "tensor_group" if nvfp4 else "group", "symmetric": True, "type": "float",
            "zp_dtype": None,
        }  # fmt: skip
        group = {"format": ct_format, "input_activations": None, "output_activations": None,
                 "targets": ["Linear"], "weights": weights}  # fmt: skip
        return {
            "config_groups": {"group_0": group}, "format": ct_format, "global_compression_ratio": None,
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION,
        }  # fmt: skip
    if fmt == "nf4":
        return {
            "quant_method": "bitsandbytes", "_load_in_8bit": False, "_load_in_4bit": True,
            "llm_int8_threshold": 6.0, "llm_int8_skip_modules": None,
            "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8", "load_in_4bit": True,
            "load_in_8bit": False,
        }  # fmt: skip
    raise QerlError(f"unknown checkpoint format {fmt!r}; choose one of: {', '.join(CHECKPOINT_FORMATS)}")


class _ShardWriter:
    """Collects tensors and flushes a safetensors shard whenever ``max_bytes`` is reached."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to("cpu").contiguous()
        self.pending[name] = tensor
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.out_dir / f"shard-{len(self.shards):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Name shards like transformers does and write the index when there is more than one."""
        self.flush()
        if len(self.shards) == 1:
            self.shards[0][0].rename(self.out_dir / "model.safetensors")
            honour_umask(self.out_dir)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            path.rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        honour_umask(self.out_dir)  # safetensors writes 0600 files


def _skeleton(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _modules_with_tensors(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules owning parameters, grouped by parent so fused siblings (q/k/v) come together."""
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            yield name, module


def write_random_checkpoint(
    out_dir: str | Path,
    shape: str | dict = "tiny",
    fmt: str = "bf16",
    seed: int = 0,
    std: float = 0.02,
    device: str | torch.device = "cpu",
    max_shard_bytes: int = 2 * 1024**3,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write a random ``shape`` model in ``fmt`` to ``out_dir``; returns ``out_dir``.

    Weights are N(0, std) (norm weights 1), generated on ``device`` (a GPU makes 72B shapes fast), one
    module at a time. ``lm_head`` and embeddings stay bf16. Tokenizer files are copied from
    ``tokenizer_from`` when given; the ``tiny`` shape gets qerl's tiny character tokenizer by default.
    """
    if fmt not in CHECKPOINT_FORMATS:
        raise QerlError(f"unknown checkpoint format {fmt!r}; choose one of: {', '.join(CHECKPOINT_FORMATS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model_config(shape)
    model = _skeleton(config)
    qfmt = None if fmt == "bf16" else formats.get(fmt)
    generator = torch.Generator(device=device).manual_seed(seed)
    writer = _ShardWriter(out_dir, max_shard_bytes)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))

    def random_like(param: torch.Tensor, name: str) -> torch.Tensor:
        if param.dim() == 1 and "norm" in name:
            return torch.ones(param.shape, dtype=torch.bfloat16, device=device)
        sample = torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32) * std
        return sample.to(torch.bfloat16)

    # Group linears by parent module so a fused group's global scale sees all its members.
    by_parent: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in _modules_with_tensors(model):
        by_parent.setdefault(name.rpartition(".")[0], []).append((name, module))
    for members in by_parent.values():
        dense: dict[str, dict[str, torch.Tensor]] = {}
        for name, module in members:
            if tied and name == "lm_head":
                continue
            dense[name] = {
                p: random_like(t, f"{name}.{p}") for p, t in module.named_parameters(recurse=False)
            }
        scales = _group_global_scales(dense, members) if fmt == "nvfp4" else {}
        for name, module in members:
            if name not in dense:
                continue
            tensors = dense.pop(name)
            quantize = qfmt is not None and isinstance(module, nn.Linear) and name != "lm_head"
            if quantize:
                quantized = qfmt.quantize(tensors.pop("weight"), global_scale=scales.get(name))
                tensors = {**quantized, **tensors}
            for tensor_name, tensor in tensors.items():
                writer.add(f"{name}.{tensor_name}", tensor)
    writer.finish()

    config_dict = config.to_dict()
    config_dict["dtype"] = "bfloat16"
    qc = quantization_config(fmt)
    if qc is not None:
        config_dict["quantization_config"] = qc
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    _write_tokenizer(out_dir, shape, tokenizer_from)
    return out_dir


def _group_global_scales(
    dense: dict[str, dict[str, torch.Tensor]], members: list[tuple[str, nn.Module]]
) -> dict[str, torch.Tensor]:
    """NVFP4: one global scale per fused group (q/k/v, gate/up), per-layer for everything else."""
    groups: dict[str, list[str]] = {}
    for name, module in members:
        if name in dense and isinstance(module, nn.Linear):
            groups.setdefault(fused_group_key(name) or name, []).append(name)
    return {
        name: shared_global_scale(dense[n]["weight"] for n in names)
        for names in groups.values()
        for name in names
    }


def _write_tokenizer(out_dir: Path, shape: str | dict, tokenizer_from: str | Path | None) -> None:
    if tokenizer_from is not None:
        source = Path(tokenizer_from)
        for pattern in ("tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt",
                        "generation_config.json"):  # fmt: skip
            for file in source.glob(pattern):
                shutil.copy(file, out_dir / file.name)
    elif shape == "tiny":
        from qerl_cli.modeling.tiny import build_tokenizer

        build_tokenizer().save_pretrained(out_dir)

"""Random-weight checkpoints of real model shapes, written directly in bf16 / nvfp4 / mxfp4 / nf4.

Benchmarks and memory tests need a Qwen2.5-7B..72B-*shaped* model, not its weights. This writes one in
exactly the layout vLLM and transformers load (compressed-tensors ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized``, or bitsandbytes NF4 with double quantization), streaming one decoder layer at a
time into safetensors shards so a 72B shape never has to fit in memory.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.formats.checkpoint import (
    ModuleGroup,
    check_checkpoint_format,
    module_groups,
    write_checkpoint,
)
from qerl_cli.modeling.tiny import build_tiny_config, build_tokenizer

_QWEN25_COMMON = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", max_position_embeddings=32768,
    rope_theta=1000000.0, use_sliding_window=False, attention_dropout=0.0, bos_token_id=151643,
    eos_token_id=151645,
)  # fmt: skip


def _tiny_shape() -> dict:

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


def _skeleton(config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


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
    check_checkpoint_format(fmt)
    config = model_config(shape)
    model = _skeleton(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))

    def random_like(param: torch.Tensor, name: str) -> torch.Tensor:
        if param.dim() == 1 and "norm" in name:
            return torch.ones(param.shape, dtype=torch.bfloat16, device=device)
        sample = torch.randn(param.shape, generator=generator, device=device, dtype=torch.float32) * std
        return sample.to(torch.bfloat16)

    def random_groups() -> Iterator[tuple[ModuleGroup, set[str]]]:
        # One parent's modules at a time: a fused group's global scale sees all its members, and
        # no more than one group is ever in memory.
        for members in module_groups(model):
            group = {
                name: {p: random_like(t, f"{name}.{p}") for p, t in module.named_parameters(recurse=False)}
                for name, module in members
                if not (tied and name == "lm_head")
            }
            yield group, {n for n, module in members if isinstance(module, nn.Linear) and n != "lm_head"}

    out_dir = write_checkpoint(
        out_dir, random_groups(), fmt, config.to_dict(), max_shard_bytes=max_shard_bytes
    )
    _write_tokenizer(out_dir, shape, tokenizer_from)
    return out_dir


def _write_tokenizer(out_dir: Path, shape: str | dict, tokenizer_from: str | Path | None) -> None:
    if tokenizer_from is not None:
        source = Path(tokenizer_from)
        for pattern in ("tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt",
                        "generation_config.json"):  # fmt: skip
            for file in source.glob(pattern):
                shutil.copy(file, out_dir / file.name)
    elif shape == "tiny":
        build_tokenizer().save_pretrained(out_dir)

"""The packed 4-bit checkpoint: one round-to-nearest packer and one writer for every path that makes one.

Three producers share it: random-weight checkpoints of real shapes (``modeling.random_checkpoint``),
RTN copies of a real BF16 model (``quantize.native``) and the tiny demo base (``rl.warmstart``).
Each hands over its tensors one *module group* at a time (the modules under one parent, so the
fused siblings q/k/v and gate/up come together) and says which modules to quantize; this module
packs them in the layout vLLM and transformers load (compressed-tensors ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized``, or bitsandbytes NF4 with double quantization) and streams them into
safetensors shards, so a 72B shape never has to fit in memory.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from qerl_cli import formats
from qerl_cli.files import honour_umask
from qerl_cli.formats import check_names, fp4_names, get
from qerl_cli.formats.nvfp4 import fused_group_key, shared_global_scale

COMPRESSED_TENSORS_VERSION = "0.19.0"
DEFAULT_SHARD_BYTES = 2 * 1024**3
# One parent's modules: module name -> {parameter name: tensor}, in the order they are written.
ModuleGroup = dict[str, dict[str, torch.Tensor]]


def check_checkpoint_format(fmt: str) -> str:
    """``fmt`` when it is one the writer can write: BF16 or a registered 4-bit format."""
    check_names([fmt], "checkpoint format", dense=True)
    return fmt


def quantization_config(fmt: str) -> dict | None:
    """The config.json ``quantization_config`` vLLM and transformers expect for ``fmt``."""
    check_checkpoint_format(fmt)
    if fmt in fp4_names():
        nvfp4 = fmt == "nvfp4"
        ct_format = get(fmt).compressed_tensors_format
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
    return None  # bf16


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------
def nvfp4_global_scales(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NVFP4: one global scale per fused group (q/k/v, gate/up) so vLLM can fuse them, as
    llm-compressor does; one per module for everything else. ``weights``: module name -> weight."""
    groups: dict[str, list[str]] = {}
    for name in weights:
        groups.setdefault(fused_group_key(name) or name, []).append(name)
    return {
        name: shared_global_scale(weights[n] for n in names) for names in groups.values() for name in names
    }


def pack_group(
    group: ModuleGroup, quantized: Collection[str], fmt: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Round-to-nearest pack the ``weight`` of each module named in ``quantized``; everything else
    (biases, norms, embeddings, ``lm_head``) passes through. Yields ``(tensor name, tensor)``."""
    check_checkpoint_format(fmt)
    qfmt = None if fmt == "bf16" else formats.get(fmt)
    quantized = [name for name in group if name in quantized] if qfmt is not None else []
    scales = nvfp4_global_scales({n: group[n]["weight"] for n in quantized}) if fmt == "nvfp4" else {}
    for name, params in group.items():
        tensors = dict(params)
        if name in quantized:
            packed = qfmt.quantize(tensors.pop("weight"), global_scale=scales.get(name))
            # clone: fused members share one global-scale tensor, which safetensors refuses to save twice
            tensors = {**{part: value.clone() for part, value in packed.items()}, **tensors}
        for tensor_name, tensor in tensors.items():
            yield f"{name}.{tensor_name}", tensor


def module_groups(model: nn.Module) -> Iterator[list[tuple[str, nn.Module]]]:
    """A model's parameter-owning modules, grouped by parent (in module order) so the members of
    a fused group (q/k/v) come together."""
    by_parent: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            by_parent.setdefault(name.rpartition(".")[0], []).append((name, module))
    yield from by_parent.values()


def state_dict_groups(state: Mapping[str, torch.Tensor]) -> Iterator[ModuleGroup]:
    """A flat state dict (``a.b.weight``) as module groups, grouped by parent in key order."""
    by_parent: dict[str, ModuleGroup] = {}
    for key, tensor in state.items():
        module, _, param = key.rpartition(".")
        by_parent.setdefault(module.rpartition(".")[0], {}).setdefault(module, {})[param] = tensor
    yield from by_parent.values()


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
class ShardWriter:
    """Collects tensors and flushes a safetensors shard whenever ``max_bytes`` is reached."""

    def __init__(self, out_dir: Path, max_bytes: int = DEFAULT_SHARD_BYTES) -> None:
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


def write_checkpoint(
    out_dir: str | Path,
    groups: Iterable[tuple[ModuleGroup, Collection[str]]],
    fmt: str,
    config: Mapping[str, Any],
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a ``fmt`` checkpoint: weights from ``groups`` (each a module group and the names of
    its modules to quantize), then ``config.json`` (the model config, computing in bfloat16, with
    the format's ``quantization_config``). Tokenizer files are the caller's."""
    check_checkpoint_format(fmt)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, max_shard_bytes)
    for group, quantized in groups:
        for name, tensor in pack_group(group, quantized, fmt):
            writer.add(name, tensor)
    writer.finish()
    config_dict = dict(config)
    config_dict["dtype"] = "bfloat16"
    qc = quantization_config(fmt)
    if qc is not None:
        config_dict["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True))
    return out

"""The FP8 rollout copy of a 4-bit base (``rollout.linear_backend: fp8``).

The trainer keeps the packed 4-bit base (QuantLinear); vLLM loads this folder instead: every quantized
linear of the 4-bit checkpoint dequantized and rounded to per-channel FP8 E4M3 (compressed-tensors
``FP8_DYNAMIC``, which vLLM serves with its FP8 tensor-core GEMMs and LoRA), everything else copied as
it is. So the rollout model is the 4-bit model plus one more rounding, never the BF16 original: the
rollout/trainer gap stays small, truncated importance sampling corrects it, and the staleness check
measures it every step.

Derived once per base and cached under ``$QERL_CACHE_DIR/fp8-rollout/`` (keyed by the base's files),
written to a staging folder and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from qerl_cli.errors import QerlError
from qerl_cli.files import write_folder_once
from qerl_cli.formats import fp8
from qerl_cli.formats.checkpoint import ShardWriter
from qerl_cli.modeling.loading import (
    checkpoint_keys,
    detect_format,
    format_for,
    quantized_prefixes,
    read_config,
    safetensors_files,
)

# Files that describe the model rather than hold its weights: copied into the FP8 folder as they are.
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
)  # fmt: skip


def source_fingerprint(source: Path) -> str:
    """Changes when the base's config or weight files change (name, size, modification time)."""
    digest = hashlib.sha256((source / "config.json").read_bytes())
    for file in safetensors_files(source):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def fp8_rollout_checkpoint(source: str | Path, cache_dir: str | Path) -> Path:
    """The FP8 rollout folder of the 4-bit checkpoint ``source``, derived on first use into
    ``cache_dir`` and reused afterwards."""
    source = Path(source)
    target = Path(cache_dir) / "fp8-rollout" / f"{source.name}-{source_fingerprint(source)}"
    return write_folder_once(target, lambda staging: write_fp8_checkpoint(source, staging))


@torch.no_grad()
def write_fp8_checkpoint(source: str | Path, out_dir: str | Path) -> Path:
    """Write the FP8 rollout copy of the 4-bit checkpoint ``source`` into ``out_dir`` (see module doc)."""
    source, out = Path(source), Path(out_dir)
    config = read_config(source)
    fmt_name = detect_format(config)
    if fmt_name == "bf16":
        raise QerlError(
            f"{source} is a BF16 checkpoint: rollout.linear_backend=fp8 derives FP8 weights from a 4-bit "
            "base. For a BF16 base let vLLM quantize online with --set "
            "'rollout.vllm_kwargs={quantization: fp8}', or pick rollout.linear_backend=auto"
        )
    qfmt = format_for(fmt_name, config)
    files = safetensors_files(source)
    prefixes = set(quantized_prefixes(checkpoint_keys(files), qfmt))
    quant_names = set(qfmt.checkpoint_names())
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out)
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a module's 4-bit tensors may span shards
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not dicts
                prefix, name = _split(key, prefixes, quant_names)
                if prefix is None:
                    writer.add(key, f.get_tensor(key))
                    continue
                parts = pending.setdefault(prefix, {})
                parts[name] = f.get_tensor(key)
                if quant_names <= parts.keys():
                    _add_fp8_linear(writer, prefix, qfmt.dequantize(pending.pop(prefix), torch.float32))
    if pending:
        raise QerlError(
            f"{source}: incomplete 4-bit tensors for {sorted(pending)[:3]}; is the checkpoint whole?"
        )
    writer.finish()
    config["quantization_config"] = fp8.quantization_config(_ignored_linears(config))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    (out / "qerl_fp8_rollout.json").write_text(
        json.dumps({"derived_from": str(source.resolve()), "source_format": fmt_name,
                    "source_fingerprint": source_fingerprint(source), "linears": len(prefixes)}, indent=2)
    )  # fmt: skip
    return out


def _split(key: str, prefixes: set[str], names: set[str]) -> tuple[str | None, str]:
    """(module prefix, tensor name) for a 4-bit linear's tensor, else (None, key)."""
    for name in names:
        prefix = key[: -len(name) - 1]
        if key.endswith("." + name) and prefix in prefixes:
            return prefix, name
    return None, key


def _add_fp8_linear(writer, prefix: str, weight: torch.Tensor) -> None:
    codes, scale = fp8.quantize_per_channel(weight)
    writer.add(f"{prefix}.weight", codes)
    writer.add(f"{prefix}.weight_scale", scale)


def _ignored_linears(config: dict) -> list[str]:
    """What the 4-bit checkpoint left in BF16 stays BF16 (the LM head at least)."""
    ignore = list((config.get("quantization_config") or {}).get("ignore") or [])
    return ignore or ["lm_head"]

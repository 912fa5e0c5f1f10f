"""The rollout copies of a 4-bit base: FP8 (``rollout.linear_backend: fp8`` / ``fp8-merged``) and BF16
(``merged``).

The trainer keeps the packed 4-bit base (QuantLinear); vLLM loads one of these folders instead, every
quantized linear of the 4-bit checkpoint dequantized and everything else copied as it is:

* FP8: each linear rounded to per-channel FP8 E4M3 (compressed-tensors ``FP8_DYNAMIC``, which vLLM
  serves with its FP8 tensor-core GEMMs and LoRA). The rollout model is the 4-bit model plus one more
  rounding, never the BF16 original: truncated importance sampling corrects the gap, and the staleness
  check measures it every step;
* BF16: each linear cast once to BF16, with no quantization config, so vLLM loads a plain BF16 model
  (dense GEMMs, no LoRA kernels: the ``merged`` backend rewrites these weights with the LoRA merged
  in after every update, :mod:`qerl_cli.rollout.fp8_merge`). It takes 2 bytes a weight of vLLM's memory,
  which :mod:`qerl_cli.rollout.backends` checks before it is written.

Each is derived once per base and cached under ``$QERL_CACHE_DIR/fp8-rollout/`` or
``$QERL_CACHE_DIR/bf16-rollout/``, keyed by the base's fingerprint (a changed source gets a new copy),
written to a staging folder and renamed when complete. Safetensors only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from qerl_cli.errors import QerlError
from qerl_cli.files import MODEL_SIDE_FILES, write_folder_once
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

FP8, BF16 = "fp8", "bf16"  # the rollout copies' weight formats
# The record each copy writes beside its weights (what it was derived from).
MANIFESTS = {FP8: "qerl_fp8_rollout.json", BF16: "qerl_bf16_rollout.json"}
# Why a BF16 source has no copy of each kind, and what to use instead.
_BF16_SOURCE = {
    FP8: "{source} is a BF16 checkpoint: rollout.linear_backend=fp8 derives FP8 weights from a 4-bit base. "
    "For a BF16 base let vLLM quantize online with --set 'rollout.vllm_kwargs={{quantization: fp8}}', or "
    "pick rollout.linear_backend=auto",
    BF16: "{source} is a BF16 checkpoint already: rollout.linear_backend=merged serves it as it is (the "
    "BF16 copy is for a 4-bit base)",
}


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
    return _cached_copy(source, cache_dir, FP8)


def bf16_rollout_checkpoint(source: str | Path, cache_dir: str | Path) -> Path:
    """The BF16 rollout folder of the 4-bit checkpoint ``source``, derived on first use into
    ``cache_dir`` and reused afterwards."""
    return _cached_copy(source, cache_dir, BF16)


def _cached_copy(source: str | Path, cache_dir: str | Path, weights: str) -> Path:
    source = Path(source)
    target = Path(cache_dir) / f"{weights}-rollout" / f"{source.name}-{source_fingerprint(source)}"
    return write_folder_once(target, lambda staging: write_rollout_copy(source, staging, weights))


def write_fp8_checkpoint(source: str | Path, out_dir: str | Path) -> Path:
    """Write the FP8 rollout copy of the 4-bit checkpoint ``source`` into ``out_dir`` (see module doc)."""
    return write_rollout_copy(source, out_dir, FP8)


def write_bf16_checkpoint(source: str | Path, out_dir: str | Path) -> Path:
    """Write the BF16 rollout copy of the 4-bit checkpoint ``source`` into ``out_dir`` (see module doc)."""
    return write_rollout_copy(source, out_dir, BF16)


@torch.no_grad()
def write_rollout_copy(source: str | Path, out_dir: str | Path, weights: str) -> Path:
    """Write the ``weights`` (``fp8`` or ``bf16``) rollout copy of the 4-bit checkpoint ``source`` into
    ``out_dir``: its quantized linears dequantized and stored in that format, the rest as it is."""
    source, out = Path(source), Path(out_dir)
    config = read_config(source)
    fmt_name = detect_format(config)
    if fmt_name == "bf16":
        raise QerlError(_BF16_SOURCE[weights].format(source=source))
    qfmt = format_for(fmt_name, config)
    files = safetensors_files(source)
    prefixes = set(quantized_prefixes(checkpoint_keys(files), qfmt))
    quant_names = set(qfmt.checkpoint_names())
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out)
    add_linear = _add_fp8_linear if weights == FP8 else _add_bf16_linear
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
                    add_linear(writer, prefix, qfmt.dequantize(pending.pop(prefix), torch.float32))
    if pending:
        raise QerlError(
            f"{source}: incomplete 4-bit tensors for {sorted(pending)[:3]}; is the checkpoint whole?"
        )
    writer.finish()
    if weights == FP8:
        config["quantization_config"] = fp8.quantization_config(_ignored_linears(config))
    else:  # a plain model (its dtype the base's, BF16 as qerl writes it): vLLM's unquantized linears
        config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    for name in MODEL_SIDE_FILES:  # copied into each copy as they are
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    (out / MANIFESTS[weights]).write_text(
        json.dumps({"derived_from": str(source.resolve()), "source_format": fmt_name, "weights": weights,
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


def _add_fp8_linear(writer: ShardWriter, prefix: str, weight: torch.Tensor) -> None:
    codes, scale = fp8.quantize_per_channel(weight)
    writer.add(f"{prefix}.weight", codes)
    writer.add(f"{prefix}.weight_scale", scale)


def _add_bf16_linear(writer: ShardWriter, prefix: str, weight: torch.Tensor) -> None:
    # Cast once from the float32 dequantization: what a merge with a zero LoRA writes, bit for bit.
    writer.add(f"{prefix}.weight", weight.to(torch.bfloat16))


def _ignored_linears(config: dict) -> list[str]:
    """What the 4-bit checkpoint left in BF16 stays BF16 (the LM head at least)."""
    ignore = list((config.get("quantization_config") or {}).get("ignore") or [])
    return ignore or ["lm_head"]

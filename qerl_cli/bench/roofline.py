"""Physical bounds for the figures ``qerl bench`` measures: what a GPU's memory bandwidth and tensor
cores allow a decode step and an update, so each measurement can be read as a fraction of its bound.

Decode (one step of ``concurrency`` sequences, each at the average context of a generation):

* bytes: every linear weight in its rollout format, the LM head (BF16), the LoRA weights, and each
  sequence's KV cache up to its context;
* FLOPs: 2 per weight per sequence, plus attention's 4 x context x heads x head-dim per layer.

The bound is ``concurrency / max(bytes / bandwidth, FLOPs / peak)``: below the crossover the weights'
bytes decide (a 4-bit format wins), above it the tensor cores do (Marlin's FP4 still computes in BF16;
an FP8 GEMM has twice the peak). Peaks are dense (no sparsity), from the vendors' data sheets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl_cli.modeling.model_shape import WEIGHT_BYTES, ModelShape


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bandwidth: float  # bytes/s of HBM
    bf16_flops: float  # dense tensor-core FLOP/s
    fp8_flops: float | None  # None: no FP8 tensor cores


# The GPUs whose bounds the bench knows, a data file beside this module (shipped as package data): each
# entry's "match" words, all found in torch.cuda.get_device_name() lowercased, tried in order (a plain
# name after its PCIe and NVL parts), with the GpuSpec fields above. Add a GPU there, from its data sheet.
GPU_TABLE = Path(__file__).with_name("gpus.json")


def _read_gpus(path: Path = GPU_TABLE) -> tuple[tuple[tuple[str, ...], GpuSpec], ...]:
    entries = json.loads(path.read_text())
    return tuple(
        (tuple(e["match"]), GpuSpec(e["name"], e["bandwidth"], e["bf16_flops"], e["fp8_flops"]))
        for e in entries
    )


GPUS = _read_gpus()


def gpu_spec(device_name: str | None) -> GpuSpec | None:
    """The spec of a GPU by its CUDA device name; None for one not in the table (no bounds then)."""
    lower = (device_name or "").lower()
    for keys, spec in GPUS:
        if all(k in lower for k in keys):
            return spec
    return None


def decode_bound(
    shape: ModelShape,
    spec: GpuSpec,
    *,
    weight_format: str,
    concurrency: int,
    prompt_len: int,
    gen_len: int,
    lora_rank: int = 0,
    kv_dtype: str = "auto",
) -> dict[str, Any]:
    """Tokens/s bounds of decoding ``concurrency`` sequences of ``prompt_len + gen_len`` tokens."""
    head = shape.vocab * shape.hidden
    lora = shape.lora_params(lora_rank)
    context = prompt_len + gen_len / 2  # the average over the generation
    weight_bytes = shape.decoder_linear_params() * WEIGHT_BYTES[weight_format] + 2 * (head + lora)
    kv_bytes = concurrency * context * shape.kv_bytes_per_token(kv_dtype)
    attention = 4 * context * shape.heads * shape.head_dim * shape.layers
    flops = concurrency * (2 * (shape.decoder_linear_params() + head + lora) + attention)
    peak = spec.fp8_flops if weight_format == "fp8" and spec.fp8_flops else spec.bf16_flops
    memory_s, compute_s = (weight_bytes + kv_bytes) / spec.bandwidth, flops / peak
    return {
        "gpu": spec.name,
        "bandwidth_tokens_per_s": concurrency / memory_s,
        "compute_tokens_per_s": concurrency / compute_s,
        "bound_tokens_per_s": concurrency / max(memory_s, compute_s),
        "limited_by": "memory" if memory_s >= compute_s else "compute",
        "bytes_per_step": weight_bytes + kv_bytes,
        "kv_share_of_bytes": kv_bytes / (weight_bytes + kv_bytes),
        "flops_per_step": flops,
        "compute_peak": "fp8" if peak != spec.bf16_flops else "bf16",
    }


def fractions(measured_tokens_per_s: float, bound: dict[str, Any]) -> dict[str, float]:
    """The measurement as a fraction of the bandwidth bound, the compute bound and the tighter one."""
    return {
        "of_bandwidth_bound": measured_tokens_per_s / bound["bandwidth_tokens_per_s"],
        "of_compute_bound": measured_tokens_per_s / bound["compute_tokens_per_s"],
        "of_roofline": measured_tokens_per_s / bound["bound_tokens_per_s"],
    }


def update_flops(shape: ModelShape, sequences: int, seq_len: int, *, lora_rank: int = 0,
                 completion_len: int | None = None) -> float:  # fmt: skip
    """Useful FLOPs of one LoRA update over ``sequences`` of ``seq_len`` tokens: the frozen base's forward
    (2 per weight per token) and input-gradient backward (2 more; no weight gradient), causal attention
    (forward and its twice-as-costly backward), LoRA's forward and full backward (6 per weight), and the
    LM head on the ``completion_len`` scored tokens. Recomputation (checkpointing) is not useful work."""
    tokens = sequences * seq_len
    scored = sequences * (completion_len if completion_len is not None else seq_len)
    base = 4 * shape.decoder_linear_params() * tokens
    head = 4 * shape.vocab * shape.hidden * scored
    attention = 3 * sequences * 2 * seq_len * seq_len * shape.heads * shape.head_dim * shape.layers
    return float(base + head + attention + 6 * shape.lora_params(lora_rank) * tokens)

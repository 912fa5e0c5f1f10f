"""LoRA merged into the rollout weights (``rollout.linear_backend: fp8-merged`` and ``merged``).

At high concurrency vLLM's LoRA kernels cost about what the 4-bit format saves. With the adapter merged
into the rollout weights vLLM runs with LoRA off: after each policy update every linear the adapter
targets is rewritten in place inside vLLM's model as

    W = deq(base) + scaling * B @ A

computed in float32 and then, by the kind of weight vLLM holds,

* ``fp8-merged`` (a 4-bit base's FP8 copy): rounded once to E4M3 with one scale per output row
  (:func:`qerl_cli.formats.fp8.quantize_per_channel`, the rounding of the ``fp8`` backend's copy, so a
  linear whose B is zero gets exactly the codes that copy holds);
* ``merged`` (a BF16 base's own weights, or a 4-bit base's BF16 copy,
  :func:`qerl_cli.rollout.fp8_rollout.bf16_rollout_checkpoint`): cast once to BF16, so a linear whose B
  is zero gets exactly what the copy holds.

``deq(base)`` comes from the trainer's own base layers on the GPU (:class:`PolicyBases`, when vLLM runs
in the trainer's process, as qerl starts it) or from its checkpoint (:class:`CheckpointBases`: the 4-bit
tensors dequantized, or a BF16 base's weight), never from the served weights, so each sync rounds once
and rounding never accumulates across steps.

vLLM stacks q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (shards concatenated along the
output rows, in that order); o_proj and down_proj are plain. A per-row scale makes every row
independent: a shard is written alone, in chunks of rows (bounded temporary memory), and a shard the
adapter does not target keeps what vLLM loaded. Two kinds of target weight are written:

* an FP8 weight with a ``weight_scale`` of one value per output row (compressed-tensors
  ``FP8_DYNAMIC``). vLLM keeps it transposed after loading (``[in, out]``, column-major, for its
  CUTLASS GEMM); it is written through the transpose, never reallocated;
* a floating weight without a scale (vLLM serving BF16 weights unquantized: a BF16 base, a 4-bit
  base's BF16 copy): the merged weight cast to its dtype, which is TRL's merged-LoRA baseline.

Everything writes with ``copy_`` into the existing tensors, so CUDA graphs captured on them stay valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.formats import fp8
from qerl_cli.modeling import loading

# HF projection name -> (vLLM's stacked module, shard index along its output rows).
STACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}  # fmt: skip
SHARDS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                      "gate_up_proj": ("gate_proj", "up_proj")}  # fmt: skip
# Rows merged at once: a [rows, in] float32 temporary (16 MiB for in = 4096).
DEFAULT_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class LoraDelta:
    """One linear's LoRA: ``scaling * b @ a`` with ``a`` ``[r, in]``, ``b`` ``[out, r]`` and PEFT's
    ``scaling`` (alpha / r; alpha / sqrt(r) with rsLoRA)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def rows(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """Rows ``start:stop`` of the float32 delta."""
        b = self.b[start:stop].to(device=device, dtype=torch.float32)
        return (b @ self.a.to(device=device, dtype=torch.float32)) * self.scaling


class BaseWeights(Protocol):
    """The base weights a merge starts from, by HF module name (``model.layers.0.self_attn.q_proj``)."""

    def out_features(self, prefix: str) -> int: ...

    def dequantized(self, prefix: str, device: torch.device) -> torch.Tensor: ...


class DenseBases:
    """Base weights already in memory (``{prefix: [out, in] tensor}``)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.weights = dict(weights)

    def out_features(self, prefix: str) -> int:
        return int(self._get(prefix).shape[0])

    def dequantized(self, prefix: str, device: torch.device) -> torch.Tensor:
        return self._get(prefix).to(device=device, dtype=torch.float32)

    def _get(self, prefix: str) -> torch.Tensor:
        if prefix not in self.weights:
            raise QerlError(f"the merge has no base weight for {prefix}; is the adapter of this base?")
        return self.weights[prefix]


class PolicyBases:
    """The trainer's own frozen linear layers (PEFT's ``base_layer`` under each LoRA linear, and the
    linears without an adapter, which a merge resets to their base when an earlier adapter targeted
    them: a 4-bit ``QuantLinear`` or a dense ``nn.Linear``), dequantized where they live. A sync then
    reads nothing from disk and copies nothing from the host, which a merge from the checkpoint does every
    sync (what that costs: docs/rollout.md). The engine must run in the trainer's process (the layers are
    not shipped to another)."""

    def __init__(self, peft_model: nn.Module) -> None:
        self.layers: dict[str, nn.Module] = {}
        for name, module in peft_model.named_modules():
            base = getattr(module, "base_layer", None)
            if base is not None and isinstance(getattr(module, "lora_A", None), nn.ModuleDict):
                self.layers[strip_peft_prefix(name)] = base
            elif _plain_linear(name, module):
                self.layers.setdefault(strip_peft_prefix(name), module)

    def out_features(self, prefix: str) -> int:
        return int(self._get(prefix).out_features)

    @torch.no_grad()
    def dequantized(self, prefix: str, device: torch.device) -> torch.Tensor:
        layer = self._get(prefix)
        if hasattr(layer, "dequantized_weight"):  # a packed 4-bit layer
            return layer.dequantized_weight(torch.float32).to(device)
        return layer.weight.detach().to(device=device, dtype=torch.float32)

    def _get(self, prefix: str) -> nn.Module:
        if prefix not in self.layers:
            raise QerlError(f"the trainer's policy has no LoRA layer {prefix} to merge; is the adapter of "
                            "this policy?")  # fmt: skip
        return self.layers[prefix]


def _plain_linear(name: str, module: nn.Module) -> bool:
    """A base linear outside any LoRA wrapper (not PEFT's own A, B or wrapped layer)."""
    if ".lora_" in f".{name}" or name.endswith("base_layer") or ".base_layer." in name:
        return False
    return isinstance(module, nn.Linear) or hasattr(module, "dequantized_weight")


class CheckpointBases:
    """Base weights read from the trainer's checkpoint folder (a qerl 4-bit or a BF16 safetensors
    checkpoint), one module at a time: safetensors maps the files, so a sync reads only what it merges."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        config = loading.read_config(self.folder)
        self.fmt_name = loading.detect_format(config)
        self.qfmt = None if self.fmt_name == "bf16" else loading.format_for(self.fmt_name, config)
        self.where: dict[str, Path] = {}  # tensor name -> its file
        for file in loading.safetensors_files(self.folder):
            for key in loading.checkpoint_keys([file]):
                self.where[key] = file
        self.shapes: dict[str, int] = {}  # out_features learnt so far

    def out_features(self, prefix: str) -> int:
        if prefix not in self.shapes:
            if self.qfmt is None:
                self.shapes[prefix] = int(self._slice(f"{prefix}.weight").get_shape()[0])
            else:  # the packed layout differs per format: the dequantized shape is the one truth
                self.shapes[prefix] = int(self.dequantized(prefix, torch.device("cpu")).shape[0])
        return self.shapes[prefix]

    def dequantized(self, prefix: str, device: torch.device) -> torch.Tensor:
        if self.qfmt is None:
            weight = self._tensor(f"{prefix}.weight").to(device=device, dtype=torch.float32)
        else:
            parts = {
                name: self._tensor(f"{prefix}.{name}").to(device) for name in self.qfmt.checkpoint_names()
            }
            weight = self.qfmt.dequantize(parts, torch.float32)
        self.shapes[prefix] = int(weight.shape[0])
        return weight

    def _file(self, key: str) -> Path:
        if key not in self.where:
            raise QerlError(
                f"{self.folder} has no tensor {key}: the adapter targets a linear this checkpoint does not "
                "hold (was it trained on another base?)"
            )
        return self.where[key]

    def _tensor(self, key: str) -> torch.Tensor:
        with safe_open(str(self._file(key)), framework="pt") as handle:
            return handle.get_tensor(key)

    def _slice(self, key: str) -> Any:
        with safe_open(str(self._file(key)), framework="pt") as handle:
            return handle.get_slice(key)


# --------------------------------------------------------------------------------------------
# The math
# --------------------------------------------------------------------------------------------
def check_delta(prefix: str, base_shape: tuple[int, int], delta: LoraDelta) -> None:
    out, inp = base_shape
    if delta.a.dim() != 2 or delta.b.dim() != 2 or delta.a.shape[0] != delta.b.shape[1]:
        raise QerlError(f"{prefix}: LoRA factors of shapes {tuple(delta.a.shape)} (A) and "
                        f"{tuple(delta.b.shape)} (B) do not multiply")  # fmt: skip
    if (delta.b.shape[0], delta.a.shape[1]) != (out, inp):
        raise QerlError(
            f"{prefix}: the LoRA update is {delta.b.shape[0]}x{delta.a.shape[1]} but the base weight is "
            f"{out}x{inp}: the adapter was trained on another model"
        )


def merged_rows(base: torch.Tensor, delta: LoraDelta | None, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of ``base + delta`` in float32."""
    rows = base[start:stop].float()
    return rows if delta is None else rows + delta.rows(start, stop, rows.device)


def merge_to_fp8(
    base: torch.Tensor, delta: LoraDelta | None, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E4M3 [out, in], float32 [out, 1] scale)`` of ``base + delta``, computed ``chunk_rows`` rows at a
    time (one shot or chunked: the same codes, since every row has its own scale)."""
    out = base.shape[0]
    if delta is not None:
        check_delta("merge", (out, base.shape[1]), delta)
    codes = torch.empty(base.shape, dtype=fp8.FP8_DTYPE, device=base.device)
    scale = torch.empty((out, 1), dtype=torch.float32, device=base.device)
    for start in range(0, out, max(1, chunk_rows)):
        stop = min(out, start + max(1, chunk_rows))
        codes[start:stop], scale[start:stop] = fp8.quantize_per_channel(merged_rows(base, delta, start, stop))
    return codes, scale


# --------------------------------------------------------------------------------------------
# Writing into vLLM's model
# --------------------------------------------------------------------------------------------
def vllm_location(prefix: str) -> tuple[str, int, tuple[str, ...]]:
    """(vLLM module, shard index, the HF names of all its shards in order) of an HF linear."""
    parent, _, leaf = prefix.rpartition(".")
    if leaf in STACKED:
        fused, index = STACKED[leaf]
        head = f"{parent}." if parent else ""
        return f"{head}{fused}", index, tuple(f"{head}{name}" for name in SHARDS[fused])
    return prefix, 0, (prefix,)


def row_major_view(weight: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` view of a linear's stored weight: vLLM's FP8 layers keep the transpose
    (column-major ``[in, out]``) after loading, which ``.t()`` turns back without a copy."""
    if weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) != 1:
        return weight.t()
    return weight


def write_merged(
    model: nn.Module,
    bases: BaseWeights,
    deltas: Mapping[str, LoraDelta],
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> int:
    """Write ``base + delta`` of every linear in ``deltas`` (HF names) into ``model``'s parameters (vLLM's
    names and stacking) in place. Returns the number of linears written."""
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    for prefix, delta in sorted(deltas.items()):
        module, index, shards = vllm_location(prefix)
        weight = tensors.get(f"{module}.weight")
        if weight is None:
            raise QerlError(
                f"vLLM's model has no {module}.weight for the adapter's {prefix}: the merged backends merge "
                "into q/k/v/o and gate/up/down projections of the usual decoder layout; use "
                "rollout.linear_backend=fp8 or marlin (LoRA served by vLLM) for this model"
            )
        scale = tensors.get(f"{module}.weight_scale")
        target = row_major_view(weight.data)
        sizes = [bases.out_features(name) for name in shards]
        offset = sum(sizes[:index])
        base = bases.dequantized(prefix, target.device)
        check_delta(prefix, (base.shape[0], base.shape[1]), delta)
        if tuple(target.shape) != (sum(sizes), base.shape[1]):
            raise QerlError(
                f"{module}.weight is {tuple(target.shape)} in vLLM but the base's shards {list(shards)} make "
                f"{(sum(sizes), base.shape[1])}: tensor parallelism (shards split across GPUs) or another "
                "model; a merged backend needs rollout.tensor_parallel_size=1 and the engine on this base"
            )
        _write_rows(target, scale, offset, base, delta, chunk_rows, f"{module}.weight")
    return len(deltas)


def _write_rows(
    target: torch.Tensor,
    scale: torch.Tensor | None,
    offset: int,
    base: torch.Tensor,
    delta: LoraDelta,
    chunk_rows: int,
    what: str,
) -> None:
    fp8_target = target.dtype == fp8.FP8_DTYPE
    if fp8_target:
        if scale is None or scale.numel() != target.shape[0]:
            have = "none" if scale is None else f"{scale.numel()} values"
            raise QerlError(
                f"{what} is FP8 without one scale per output row (weight_scale: {have}, need "
                f"{target.shape[0]}): fp8-merged needs per-channel FP8 (the compressed-tensors FP8 copy), "
                "not vLLM's online per-tensor FP8"
            )
        scale_rows = scale.data.view(-1)
    elif not target.dtype.is_floating_point or scale is not None:
        raise QerlError(f"{what} is {target.dtype} with a scale: not a layout a merged backend writes")
    step = max(1, chunk_rows)
    with torch.no_grad():
        for start in range(0, base.shape[0], step):
            stop = min(base.shape[0], start + step)
            rows = merged_rows(base, delta, start, stop)
            into = slice(offset + start, offset + stop)
            if fp8_target:
                codes, row_scale = fp8.quantize_per_channel(rows)
                target[into].copy_(codes)
                scale_rows[into].copy_(row_scale.view(-1).to(scale_rows.dtype))
            else:
                target[into].copy_(rows.to(target.dtype))


# --------------------------------------------------------------------------------------------
# The trainer's LoRA
# --------------------------------------------------------------------------------------------
def lora_deltas(peft_model: nn.Module, adapter: str = "default") -> dict[str, LoraDelta]:
    """CPU copies of the active adapter's factors by HF module name (PEFT's wrapper prefix dropped)."""
    deltas: dict[str, LoraDelta] = {}
    for name, module in peft_model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, nn.ModuleDict) or adapter not in lora_a:
            continue
        if getattr(module, "use_dora", {}).get(adapter, False):
            raise QerlError(
                f"{name} uses DoRA, which the merged backends do not merge; use rollout.linear_backend=fp8 "
                "or marlin (LoRA served by vLLM)"
            )
        a = lora_a[adapter].weight.detach().to("cpu", torch.float32, copy=True)
        b = module.lora_B[adapter].weight.detach().to("cpu", torch.float32, copy=True)
        deltas[strip_peft_prefix(name)] = LoraDelta(a, b, float(module.scaling[adapter]))
    if not deltas:
        raise QerlError(
            "the policy has no LoRA layers to merge; the merged backends need the trainer's LoRA model"
        )
    return deltas


def deltas_from_tensors(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, LoraDelta]:
    """The deltas of a saved adapter (``adapter_model.safetensors`` tensors and its config): scaling
    alpha / r, per module where ``rank_pattern`` / ``alpha_pattern`` say otherwise, sqrt(r) with rsLoRA."""
    if config.get("use_dora"):
        raise QerlError(
            "the adapter uses DoRA, which the merged backends do not merge; use rollout.linear_backend=fp8 "
            "or marlin (LoRA served by vLLM)"
        )
    deltas: dict[str, LoraDelta] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key[: -len(".lora_A.weight")]
        b = tensors.get(f"{name}.lora_B.weight")
        if b is None:
            raise QerlError(f"the adapter has {key} without its lora_B; re-save it")
        rank = int(a.shape[0])
        alpha = float(_pattern(config.get("alpha_pattern"), name, config.get("lora_alpha", rank)))
        root = rank**0.5 if config.get("use_rslora") else rank
        deltas[strip_peft_prefix(name)] = LoraDelta(a.float(), b.float(), alpha / root)
    return deltas


def _pattern(patterns: Mapping[str, Any] | None, name: str, default: Any) -> Any:
    """PEFT's per-module override: the pattern that ends the module's name (longest first)."""
    for key in sorted(patterns or {}, key=len, reverse=True):
        if name == key or name.endswith(f".{key}"):
            return patterns[key]  # type: ignore[index]
    return default


def strip_peft_prefix(name: str) -> str:
    """``base_model.model.model.layers.0...`` -> ``model.layers.0...`` (the checkpoint's names)."""
    for head in ("base_model.model.", "base_model."):
        if name.startswith(head):
            return name[len(head) :]
    return name

"""NVFP4: E2M1 values, blocks of 16 along the input dim, FP8 E4M3 block scales, FP32 global scale.

Stored exactly like compressed-tensors' ``nvfp4-pack-quantized`` (scheme NVFP4A16):

* ``weight_packed``       uint8 ``[out, in/2]`` (low nibble = even column)
* ``weight_scale``        float8_e4m3fn ``[out, in/16]``
* ``weight_global_scale`` float32 ``[1]`` = 448 * 6 / amax

The arithmetic mirrors llm-compressor's memoryless min-max observer followed by compressed-tensors'
compressor *including the intermediate dtypes* (the block absmax / 6 and 2688 / amax are evaluated in
the weight's own dtype), because that is what makes the bytes identical.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from qerl_cli.formats.fp4 import E2M1_MAX, PackedE2M1Format, e2m1_codes, pack_low_first

FP8_E4M3_MAX = 448.0
# compressed-tensors replaces an all-zero block's scale by the FP8 "eps" so the division stays finite.
ZERO_BLOCK_SCALE = 0.125

# Projections vLLM fuses into one GEMM; each group must share one NVFP4 global scale.
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_group_key(module_name: str) -> str | None:
    """``model.layers.3.self_attn.k_proj`` -> ``model.layers.3.self_attn.q_proj|k_proj|v_proj``.

    Modules with the same key must be quantized with one shared global scale; ``None`` if unfused.
    """
    parent, _, leaf = module_name.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            return f"{parent}.{'|'.join(group)}" if parent else "|".join(group)
    return None


def shared_global_scale(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """One NVFP4 global scale for a group of weights (e.g. q/k/v), float32 ``[1]``.

    Computed like llm-compressor's fused observers: 448*6 over the group's absmax, in the weights' dtype.
    """
    weights = list(weights)
    if not weights:
        raise ValueError("shared_global_scale needs at least one weight")
    dtype = weights[0].dtype
    amax = torch.stack([w.detach().abs().amax().to(dtype) for w in weights]).amax()
    amax = amax.clamp(min=torch.finfo(dtype).tiny)
    scale = (FP8_E4M3_MAX * E2M1_MAX) / amax
    # An amax so small that the division overflows falls back to "no global scaling", as upstream.
    scale = torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1)


class NVFP4Format(PackedE2M1Format):
    name = "nvfp4"
    block_size = 16
    scale_dtype = torch.float8_e4m3fn
    compressed_tensors_format = "nvfp4-pack-quantized"
    compressed_tensors_scheme = "NVFP4A16"
    # qerl-triton: qerl's own W4A16 kernel served in vLLM (qerl_cli.rollout.vllm_nvfp4), NVFP4 only.
    rollout_backends = ("marlin", "humming", "qerl-triton", "fp8", "fp8-merged", "merged")

    def checkpoint_names(self) -> tuple[str, ...]:
        return ("weight_packed", "weight_scale", "weight_global_scale")

    def quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        self.check_weight(weight)
        weight = weight.detach()
        if global_scale is None:
            global_scale = shared_global_scale([weight])
        global_scale = global_scale.to(device=weight.device, dtype=torch.float32).reshape(1)

        blocks = weight.unflatten(-1, (-1, self.block_size))
        block_amax = blocks.abs().amax(dim=-1)
        local_scale = block_amax / torch.tensor(E2M1_MAX, dtype=weight.dtype, device=weight.device)
        scale = (global_scale * local_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        scale = torch.where(scale.float() == 0, ZERO_BLOCK_SCALE, scale.float()).to(torch.float8_e4m3fn)

        # Upstream keeps the scale in the weight's dtype between observer and compressor (exact for
        # FP8 values), then divides by the global scale in float32.
        effective = scale.to(weight.dtype).unsqueeze(-1) / global_scale
        codes = e2m1_codes(blocks / effective).flatten(-2)
        return {
            "weight_packed": pack_low_first(codes),
            "weight_scale": scale,
            "weight_global_scale": global_scale,
        }

    def buffer_specs(
        self, out_features: int, in_features: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        specs = super().buffer_specs(out_features, in_features)
        return {**specs, "weight_global_scale": ((1,), torch.float32)}

    def block_multipliers(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        return buffers["weight_scale"].float() / buffers["weight_global_scale"].float()

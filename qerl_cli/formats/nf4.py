"""NF4: bitsandbytes' 16-value NormalFloat code book, blocks of 64 over the flattened weight, absmax.

Checkpoint view, exactly as transformers saves a bitsandbytes ``Linear4bit`` (and vLLM's
``quantization="bitsandbytes"`` loader reads it):

* ``weight``                               uint8 ``[out*in/2, 1]``; the *even* element in the high nibble
* ``weight.absmax``                        float32 ``[blocks]``, or uint8 with double quantization
* ``weight.quant_map``                     float32 ``[16]`` (the NF4 code book)
* ``weight.nested_absmax``                 float32 ``[ceil(blocks/256)]`` (double quantization only)
* ``weight.nested_quant_map``              float32 ``[256]`` (bitsandbytes' signed dynamic 8-bit map)
* ``weight.quant_state.bitsandbytes__nf4`` uint8 JSON: quant_type, blocksize, dtype, shape, nested_*

Double quantization (bitsandbytes' ``compress_statistics``) stores the block absmax values minus
their mean as 8-bit dynamic-map codes in blocks of 256, plus that mean (``nested_offset``).
Rounding reproduces bitsandbytes 0.50 on CPU bit for bit (see ``_nf4_codes`` / ``_dynamic_codes``).
"""

from __future__ import annotations

import json
from functools import cache

import torch

from qerl_cli.errors import QerlError
from qerl_cli.formats.base import QuantFormat
from qerl_cli.torch_utils import dtype_name

# Quantiles of N(0, 1) normalised to [-1, 1] (QLoRA, arXiv 2305.14314), as float32.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
NESTED_BLOCK_SIZE = 256
STATE_KEY = "weight.quant_state.bitsandbytes__nf4"
_ABSMAX_FLOOR = 1e-38  # keeps an all-zero block's reciprocal finite


@cache
def _dynamic_map_cpu() -> torch.Tensor:
    """bitsandbytes' signed "dynamic" 8-bit map (7 exponent bits): 256 sorted float32 values.

    For exponent i in 0..6 the magnitudes are 10**(i-6) times the midpoints of 2**i + 1 evenly spaced
    points in [0.1, 1]; both signs, plus 0 and 1.
    """
    values: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        values += ((10 ** (i - 6)) * mids).tolist()
        values += (-(10 ** (i - 6)) * mids).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


def dynamic_map(device: torch.device | str = "cpu") -> torch.Tensor:
    return _dynamic_map_cpu().to(device, copy=True)  # callers own (and may store) their copy


def nf4_code(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def _nf4_codes(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 code indices (uint8) and float32 absmax of each block, as bitsandbytes' 4-bit CPU path.

    That path multiplies by the reciprocal absmax, clamps to [-1, 1] and takes the code whose midpoint
    interval holds the value (ties to the lower code).
    """
    blocks = flat.reshape(-1, block_size)
    absmax = blocks.abs().amax(dim=-1)
    scaled = (blocks * (1.0 / absmax.clamp(min=_ABSMAX_FLOOR).unsqueeze(-1))).clamp(-1, 1).reshape(-1)
    code = nf4_code(flat.device)
    return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2).to(torch.uint8), absmax


def _dynamic_codes(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit dynamic-map indices (uint8) and absmax per block, as bitsandbytes' C++ CPU kernel.

    That kernel *divides* by the absmax, finds the code at or left of the value by binary search over
    the map with its first entry widened to -1.0, then moves right only when strictly closer. The
    last block may be partial.
    """
    n_blocks = -(-flat.numel() // block_size)
    padded = torch.nn.functional.pad(flat, (0, n_blocks * block_size - flat.numel()))
    absmax = padded.reshape(n_blocks, block_size).abs().amax(dim=-1)
    normed = (padded.reshape(n_blocks, block_size) / absmax.unsqueeze(-1)).reshape(-1)[: flat.numel()]
    code = dynamic_map(flat.device).clone()
    code[0] = -1.0
    left = (torch.searchsorted(code, normed, right=True) - 1).clamp(0, code.numel() - 1)
    right = (left + 1).clamp(max=code.numel() - 1)
    closer_right = (normed - code[right]).abs() < (normed - code[left]).abs()
    return torch.where(closer_right, right, left).to(torch.uint8), absmax


def _blockwise_values(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block_size: int
) -> torch.Tensor:
    values = code[codes.long()]
    repeat = torch.arange(values.numel(), device=values.device) // block_size
    return values * absmax[repeat]


class NF4Format(QuantFormat):
    name = "nf4"
    block_size = 64
    vllm_quantization = "bitsandbytes"  # vLLM's bitsandbytes loader differs from its default one
    vllm_min_capability = (7, 0)
    rollout_backends = ("default", "fp8", "fp8-merged", "merged")

    def __init__(self, double_quant: bool = True) -> None:
        self.double_quant = double_quant

    def __repr__(self) -> str:
        return f"<NF4Format block_size=64 double_quant={self.double_quant}>"

    def checkpoint_names(self) -> tuple[str, ...]:
        nested = ("weight.nested_absmax", "weight.nested_quant_map") if self.double_quant else ()
        return ("weight", "weight.absmax", "weight.quant_map", *nested, STATE_KEY)

    def quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        if global_scale is not None:
            raise ValueError("nf4 has no global scale; pass global_scale=None")
        self.check_weight(weight)
        device = weight.device
        codes, absmax = _nf4_codes(weight.detach().reshape(-1).float(), self.block_size)
        packed = ((codes[0::2] << 4) | codes[1::2]).unsqueeze(1)
        state = {"quant_type": "nf4", "blocksize": self.block_size, "dtype": dtype_name(weight.dtype),
                 "shape": list(weight.shape)}  # fmt: skip
        out = {"weight": packed, "weight.quant_map": nf4_code(device)}
        if self.double_quant:
            offset = absmax.mean()
            nested_codes, nested_absmax = _dynamic_codes(absmax - offset, NESTED_BLOCK_SIZE)
            out["weight.absmax"] = nested_codes
            out["weight.nested_absmax"] = nested_absmax
            out["weight.nested_quant_map"] = dynamic_map(device)
            state.update(
                nested_blocksize=NESTED_BLOCK_SIZE, nested_dtype="float32", nested_offset=offset.item()
            )
        else:
            out["weight.absmax"] = absmax
        out[STATE_KEY] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8, device=device)
        return {name: out[name] for name in self.checkpoint_names()}

    def dequantize(
        self, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        out_features, in_features = read_state(tensors)["shape"]
        return self.dequantize_buffers(self.to_buffers(tensors), out_features, in_features, dtype)

    def buffer_specs(
        self, out_features: int, in_features: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        numel = out_features * in_features
        blocks = numel // self.block_size
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "weight_packed": ((numel // 2,), torch.uint8),
            "weight_quant_map": ((16,), torch.float32),
        }
        if self.double_quant:
            specs["weight_absmax"] = ((blocks,), torch.uint8)
            specs["weight_nested_absmax"] = ((-(-blocks // NESTED_BLOCK_SIZE),), torch.float32)
            specs["weight_nested_quant_map"] = ((256,), torch.float32)
            specs["weight_nested_offset"] = ((1,), torch.float32)
        else:
            specs["weight_absmax"] = ((blocks,), torch.float32)
        return specs

    def to_buffers(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = read_state(tensors)
        if state.get("quant_type") != "nf4" or state.get("blocksize") != self.block_size:
            raise QerlError(
                f"unsupported bitsandbytes 4-bit state {state}: only nf4 with blocksize 64 is supported"
            )
        has_nested = "nested_offset" in state
        if has_nested != self.double_quant:
            raise QerlError(
                f"checkpoint double quantization is {has_nested}, format expects {self.double_quant}"
            )
        buffers = {
            "weight_packed": tensors["weight"].reshape(-1),
            "weight_quant_map": tensors["weight.quant_map"].float(),
            "weight_absmax": tensors["weight.absmax"],
        }
        if has_nested:
            buffers["weight_nested_absmax"] = tensors["weight.nested_absmax"].float()
            buffers["weight_nested_quant_map"] = tensors["weight.nested_quant_map"].float()
            buffers["weight_nested_offset"] = torch.tensor(
                [state["nested_offset"]], dtype=torch.float32, device=tensors["weight"].device
            )
        return buffers

    def block_absmax(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """Float32 absmax per 64-block, undoing double quantization if present."""
        if not self.double_quant:
            return buffers["weight_absmax"]
        nested = _blockwise_values(
            buffers["weight_absmax"], buffers["weight_nested_absmax"], buffers["weight_nested_quant_map"],
            NESTED_BLOCK_SIZE,
        )  # fmt: skip
        return nested + buffers["weight_nested_offset"]

    def dequantize_buffers(
        self, buffers: dict[str, torch.Tensor], out_features: int, in_features: int, dtype: torch.dtype
    ) -> torch.Tensor:
        packed = buffers["weight_packed"]
        codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1).reshape(-1)
        values = _blockwise_values(
            codes, self.block_absmax(buffers), buffers["weight_quant_map"], self.block_size
        )
        return values.reshape(out_features, in_features).to(dtype)


def read_state(tensors: dict[str, torch.Tensor]) -> dict:
    """Parse the JSON quant-state tensor bitsandbytes stores next to the packed weight."""
    if STATE_KEY not in tensors:
        raise QerlError(f"bitsandbytes checkpoint tensor '{STATE_KEY}' missing; only nf4 4-bit is supported")
    return json.loads(bytes(tensors[STATE_KEY].cpu().tolist()).decode())

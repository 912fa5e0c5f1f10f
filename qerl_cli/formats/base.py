"""What every 4-bit weight format offers: checkpoint tensors in, checkpoint tensors out.

Two views of the same quantized weight exist:

* the *checkpoint* view (``quantize`` output, ``dequantize`` input): tensor names exactly as the
  on-disk format stores them after the module prefix (``weight_packed``, ``weight.absmax``, ...);
* the *buffer* view (``to_buffers`` output): what :class:`~qerl_cli.modeling.quant_linear.QuantLinear`
  keeps at rest, with names that are legal module attribute names (no dots) and any JSON side
  information already parsed. For NVFP4/MXFP4 both views coincide.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from qerl_cli.errors import QerlError

FLOAT_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class QuantFormat(ABC):
    """A weight-only 4-bit format for ``nn.Linear`` weights of shape ``[out_features, in_features]``."""

    name: str
    block_size: int
    # Traits every layer reads from here, never from the format's name:
    # E2M1 (FP4) elements: vLLM serves them with Marlin on GPUs without native FP4 (its width rules apply).
    fp4: bool = False
    # vLLM's ``quantization`` argument for the checkpoint (None: vLLM reads ``quantization_config`` itself).
    vllm_quantization: str | None = None
    # The compute capability vLLM's kernels for this format need.
    vllm_min_capability: tuple[int, int] = (7, 0)
    # The rollout linear backends this format can be served with, vLLM's default first
    # (qerl_cli.rollout.backends).
    rollout_backends: tuple[str, ...] = ("default",)
    # compressed-tensors' names for the format (None: not one of its formats): the ``format`` a checkpoint's
    # quantization_config declares, and the preset scheme llm-compressor quantizes to.
    compressed_tensors_format: str | None = None
    compressed_tensors_scheme: str | None = None

    @property
    def bytes_per_weight(self) -> float:
        """Bytes a weight takes at rest, scales included: 4 bits and its share of its block's one-byte
        scale (NVFP4's per-tensor scale and NF4's nested scales of the absmax are negligible)."""
        return 0.5 + 1 / self.block_size

    @abstractmethod
    def quantize(
        self, weight: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Quantize one linear weight; returns the checkpoint tensors without the module prefix."""

    @abstractmethod
    def dequantize(
        self, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """Rebuild the dense ``[out, in]`` weight from checkpoint tensors (torch reference path)."""

    @abstractmethod
    def checkpoint_names(self) -> tuple[str, ...]:
        """Names of the checkpoint tensors of one quantized linear (without module prefix)."""

    @abstractmethod
    def buffer_specs(
        self, out_features: int, in_features: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each buffer a QuantLinear of this size holds."""

    @abstractmethod
    def to_buffers(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint view -> buffer view (see module docstring)."""

    @abstractmethod
    def dequantize_buffers(
        self, buffers: dict[str, torch.Tensor], out_features: int, in_features: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Dense weight from the buffer view (torch reference path, any device)."""

    def check_weight(self, weight: torch.Tensor) -> None:
        """Reject weights this format cannot represent, with a message saying what to do."""
        if weight.dim() != 2:
            raise QerlError(
                f"{self.name}: expected a 2-D linear weight [out, in], got shape {tuple(weight.shape)}"
            )
        if weight.dtype not in FLOAT_WEIGHT_DTYPES:
            raise QerlError(
                f"{self.name}: weight dtype {weight.dtype} unsupported; pass float32/float16/bfloat16"
            )
        if weight.shape[1] % self.block_size:
            raise QerlError(
                f"{self.name}: in_features {weight.shape[1]} is not a multiple of the block size "
                f"{self.block_size}; leave this layer unquantized (add it to the ignore list)"
            )
        if not bool(torch.isfinite(weight).all()):
            raise QerlError(f"{self.name}: weight contains NaN or Inf; fix the checkpoint before quantizing")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} block_size={self.block_size}>"

"""QuantLinear: a frozen linear layer that keeps its weight packed in 4 bits and still passes gradients.

At rest the layer holds only the format's packed buffers (e.g. NVFP4: 0.5 byte per weight plus one
FP8 scale per 16 weights) and an optional bias. Each forward dequantizes into a temporary dense weight
in the compute dtype, multiplies, and drops it. The custom autograd function saves only the packed
buffers, so backward re-dequantizes to produce the input gradient; the weight itself gets no gradient.
That is what lets LoRA adapters train on top of a 4-bit base without a BF16 copy of the base weights.

With ``base_compute = "fp8"`` (:func:`set_base_compute`, ``train.base_compute``) the layer runs both
GEMMs in FP8 instead, on two FP8 copies of its weight derived once from the packed buffers
(:mod:`qerl_cli.modeling.fp8_update`); the packed buffers stay the layer's only state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from qerl_cli import formats
from qerl_cli.formats.base import QuantFormat
from qerl_cli.kernels import dequantize as kernel_dequantize
from qerl_cli.modeling.fp8_update import Fp8LinearFunction, Fp8Weight, fp8_pays

BASE_COMPUTES = ("bf16", "fp8")


class _PackedLinearFunction(torch.autograd.Function):
    """y = x @ W^T + b with W rebuilt from packed buffers in forward and again in backward.

    The (frozen) bias goes into the same ``F.linear`` call so the result is rounded once, exactly like
    a dense ``nn.Linear`` on the dequantized weight.
    """

    @staticmethod
    def forward(ctx, x, bias, fmt, out_features, in_features, names, *buffers):  # type: ignore[override]
        weight = kernel_dequantize(
            fmt, dict(zip(names, buffers, strict=True)), out_features, in_features, x.dtype
        )
        ctx.meta = (fmt, out_features, in_features, names)
        ctx.save_for_backward(*buffers)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        fmt, out_features, in_features, names = ctx.meta
        # Unpack once: under activation checkpointing a second ctx.saved_tensors access raises.
        saved = ctx.saved_tensors
        grad_input = None
        if ctx.needs_input_grad[0]:
            weight = kernel_dequantize(
                fmt,
                dict(zip(names, saved, strict=True)),
                out_features,
                in_features,
                grad_output.dtype,
            )
            grad_input = grad_output.matmul(weight)
        return (grad_input, None, None, None, None, None, *([None] * len(saved)))


class QuantLinear(nn.Module):
    """Drop-in, frozen replacement for ``nn.Linear`` whose weight stays packed in a 4-bit format.

    ``compute_dtype`` is the dtype the matmul runs in; ``None`` follows the input's dtype.
    ``base_compute``: "bf16" (dequantize, multiply in ``compute_dtype``) or "fp8" (FP8 GEMMs on the
    cached copies of :meth:`fp8_weight`).
    """

    base_compute: str = "bf16"
    # A plain attribute, not a buffer: never in state_dict(), never in a checkpoint.
    _fp8: Fp8Weight | None = None
    # Dense copies of the weight by dtype while :func:`dense_weights` holds (None outside it).
    _dense: dict[torch.dtype, torch.Tensor] | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str | QuantFormat,
        bias: bool = False,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype | None = None,
        bias_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.fmt = formats.get(fmt) if isinstance(fmt, str) else fmt
        if in_features % self.fmt.block_size:
            raise ValueError(f"in_features {in_features} not a multiple of {self.fmt.name} block size")
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        self._packed_names = tuple(self.fmt.buffer_specs(out_features, in_features))
        for name, (shape, dtype) in self.fmt.buffer_specs(out_features, in_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.register_buffer(
            "bias", torch.empty(out_features, dtype=bias_dtype, device=device) if bias else None
        )

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        fmt: str | QuantFormat,
        global_scale: torch.Tensor | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> QuantLinear:
        """Quantize a dense ``nn.Linear`` (NVFP4 may take a shared ``global_scale``)."""
        fmt = formats.get(fmt) if isinstance(fmt, str) else fmt
        has_bias = linear.bias is not None
        layer = cls(
            linear.in_features, linear.out_features, fmt, bias=has_bias, device=linear.weight.device,
            compute_dtype=compute_dtype, bias_dtype=linear.bias.dtype if has_bias else torch.bfloat16,
        )  # fmt: skip
        layer.load_checkpoint_tensors(fmt.quantize(linear.weight.detach(), global_scale=global_scale))
        if has_bias:
            layer.bias.copy_(linear.bias.detach())
        return layer

    @torch.no_grad()
    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill the packed buffers from checkpoint-named tensors (``weight_packed``, ``weight.absmax``...)."""
        buffers = self.fmt.to_buffers(tensors)
        for name in self._packed_names:
            target = getattr(self, name)
            source = buffers[name]
            if tuple(source.shape) != tuple(target.shape) or source.dtype != target.dtype:
                raise ValueError(
                    f"{self.fmt.name} tensor {name}: checkpoint has {tuple(source.shape)} {source.dtype}, "
                    f"layer expects {tuple(target.shape)} {target.dtype}"
                )
            target.copy_(source)

    # -- use ----------------------------------------------------------------------------------------------

    def packed_buffers(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._packed_names}

    @property
    def qweight(self) -> torch.Tensor:
        """The packed weight; PEFT reads its device to place LoRA adapters (as for GPTQ layers)."""
        return self._buffers["weight_packed"]

    def dequantized_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return kernel_dequantize(self.fmt, self.packed_buffers(), self.out_features, self.in_features, dtype)

    def _packed_key(self) -> tuple:
        """Identity of the packed buffers' contents: a copy into them (version) or a move (pointer)
        changes it."""
        return tuple((buf.data_ptr(), buf._version, buf.device) for buf in self.packed_buffers().values())

    @torch.no_grad()
    def fp8_weight(self) -> Fp8Weight:
        """The FP8 copies of the weight, derived from the packed buffers on first use and again only
        when those change."""
        key = self._packed_key()
        if self._fp8 is None or self._fp8.key != key:
            self._fp8 = None  # free the stale copies before deriving the new ones
            self._fp8 = Fp8Weight.derive(self.dequantized_weight(torch.float32), key)
        return self._fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is not None and x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if self.base_compute == "fp8":
            return Fp8LinearFunction.apply(x, self.bias, self.fp8_weight())
        if self._dense is not None and not torch.is_grad_enabled():
            weight = self._dense.get(x.dtype)
            if weight is None:
                weight = self._dense[x.dtype] = self.dequantized_weight(x.dtype)
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
        return _PackedLinearFunction.apply(
            x, self.bias, self.fmt, self.out_features, self.in_features, self._packed_names,
            *self.packed_buffers().values(),
        )  # fmt: skip

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)`` / ``.half()`` must not cast packed buffers: keep their dtype, follow the device.
        The FP8 and dense copies are dropped (re-derived on the new device when next used)."""
        self._fp8 = None
        if self._dense is not None:
            self._dense = {}
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if name in self._packed_names and moved.dtype != buf.dtype:
                moved = buf.to(device=moved.device)
            self._buffers[name] = moved
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}, "
            f"bias={self.bias is not None}" + (", base_compute=fp8" if self.base_compute == "fp8" else "")
        )


def packed_nbytes(module: nn.Module) -> int:
    """Bytes held by all QuantLinear packed buffers under ``module``."""
    return sum(
        buf.numel() * buf.element_size()
        for layer in module.modules()
        if isinstance(layer, QuantLinear)
        for buf in layer.packed_buffers().values()
    )


def set_base_compute(module: nn.Module, mode: str, min_weights: int = 0) -> int:
    """Run every QuantLinear under ``module`` in ``mode`` ("bf16" or "fp8"; under "fp8" a layer of fewer
    than ``min_weights`` weights stays BF16: its GEMMs are too small to gain); returns the bytes of the
    FP8 copies now held. "fp8" derives them now (one layer at a time), so memory measured afterwards
    counts them; "bf16" drops them. No check of the device here: off an FP8 GPU the FP8 GEMMs are
    emulated (what the CPU tests use); ``train.base_compute`` is checked in ``modeling.base_compute``.
    """
    if mode not in BASE_COMPUTES:
        raise ValueError(f"base_compute must be one of {BASE_COMPUTES}, got {mode!r}")
    for layer in module.modules():
        if isinstance(layer, QuantLinear):
            large = fp8_pays(layer.out_features, layer.in_features, min_weights)
            layer.base_compute = mode if large else "bf16"
            if layer.base_compute == "fp8":
                layer.fp8_weight()
            else:
                layer._fp8 = None
    return fp8_cache_nbytes(module)


@contextmanager
def dense_weights(module: nn.Module, max_bytes: int) -> Iterator[bool]:
    """Within, every QuantLinear under ``module`` (``base_compute`` "bf16") multiplies gradient-free
    forwards by a dense copy of its weight, dequantized on first use and dropped on exit, instead of
    dequantizing at every forward: the same numbers, once per call rather than once per generated token.
    Only when those copies take at most ``max_bytes`` (counted at 4 bytes a weight): a large model keeps
    the 4-bit footprint its memory was planned on. Yields whether the copies are on."""
    layers = [m for m in module.modules() if isinstance(m, QuantLinear) and m.base_compute == "bf16"]
    on = bool(layers) and sum(4 * m.out_features * m.in_features for m in layers) <= max_bytes
    if on:
        for layer in layers:
            layer._dense = {}
    try:
        yield on
    finally:
        if on:
            for layer in layers:
                layer._dense = None


def fp8_cache_nbytes(module: nn.Module) -> int:
    """Bytes of the FP8 weight copies held by the QuantLinear layers under ``module``."""
    return sum(
        layer._fp8.nbytes for layer in module.modules() if isinstance(layer, QuantLinear) and layer._fp8
    )

"""FP8 GEMMs for the frozen base in the update (``train.base_compute: fp8``).

A 4-bit :class:`~qerl_cli.modeling.quant_linear.QuantLinear` runs two GEMMs per step: the forward
``y = x W^T`` and the input gradient ``dx = dy W`` (the frozen weight gets no gradient). In BF16 both
dequantize the packed weight and run at BF16 tensor-core speed; here both run as row-wise scaled FP8
E4M3 GEMMs (twice the BF16 peak on Hopper and Ada).

Scales. A row-wise scaled GEMM ``A @ B`` (``torch._scaled_mm``) takes one scale per row of ``A`` and
one per column of ``B``: scales may only sit on the dimensions that are *not* summed over. Hence:

* activations ``x`` ``[M, K]`` and output gradients ``dy`` ``[M, N]``: one scale per token (row),
  computed on the fly (:func:`quantize_rows`);
* forward, contraction over ``K``: ``W`` ``[N, K]`` quantized per output row (scale ``[N, 1]``);
* backward, contraction over ``N``: ``W^T`` ``[K, N]`` quantized per row, i.e. ``W`` per input column
  (scale ``[K, 1]``). Reusing the forward copy would put its scales on the summed dimension. Folding
  them into ``dy`` before its quantization would work numerically, but cuBLASLt's FP8 GEMM also needs
  ``B`` column-major, so the backward needs ``W^T`` stored row-major anyway: two copies.

Both copies (:class:`Fp8Weight`) are derived once from the dequantized 4-bit weight and kept on the
layer: 2 bytes per base weight (plus 4 bytes per row and column for the scales), against 0.5-0.6 for
the packed weight itself. They are never parameters or buffers, so no checkpoint or state dict holds
them.

On a CUDA GPU of compute capability >= 8.9 the GEMMs are ``torch._scaled_mm`` (A row-major, B
column-major, both dims of B multiples of 16, scales float32 and contiguous, BF16 output). Everywhere
else the same FP8 codes and scales are dequantized to float32 and multiplied (:func:`fp8_mm`'s
emulation): the CPU tests check the numerics the GPU runs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from qerl_cli.formats.fp8 import has_fp8_tensor_cores
from qerl_cli.kernels.fp8_rows import quantize_rows_fp8

# torch._scaled_mm wants K and N (both dims of B) to be multiples of 16.
FP8_DIM_MULTIPLE = 16
# A layer of fewer weights than this keeps BF16 GEMMs under train.base_compute=fp8: each FP8 call costs
# fixed host work (the rounding kernel's launch, torch._scaled_mm, the autograd function), which on a
# small layer outweighs the GEMM's saving; a 7B's MLP layers are above the threshold, its attention
# layers below. `qerl bench update` times the update under either base compute on a GPU.
FP8_MIN_WEIGHTS = 2**25


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` -> (contiguous E4M3 ``[M, D]``, float32 ``[M, 1]`` scales): one scale per row
    (token), the rounding of :func:`qerl_cli.formats.fp8.quantize_per_channel`, bit for bit
    (:func:`qerl_cli.kernels.fp8_rows.quantize_rows_fp8`: one fused Triton kernel on CUDA, the torch
    reference in bounded chunks elsewhere)."""
    return quantize_rows_fp8(t.reshape(-1, t.shape[-1]))


@dataclass
class Fp8Weight:
    """The two FP8 copies of one frozen ``[N, K]`` weight, and the packed buffers' identity they came
    from (``key``: data pointers and version counters; a changed key means re-derive)."""

    rows: torch.Tensor  # [N, K] E4M3, W per output row: B of the forward
    row_scale: torch.Tensor  # [N, 1] float32
    cols: torch.Tensor  # [K, N] E4M3, W^T per row (W per input column): B of the input gradient
    col_scale: torch.Tensor  # [K, 1] float32
    key: tuple

    @classmethod
    def derive(cls, weight: torch.Tensor, key: tuple = ()) -> Fp8Weight:
        """From the dense (dequantized) ``[N, K]`` weight."""
        rows, row_scale = quantize_rows(weight)
        # .contiguous() first: the elementwise ops of the rounding keep a transposed view's strides.
        cols, col_scale = quantize_rows(weight.t().contiguous())
        return cls(rows, row_scale, cols, col_scale, key)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.rows, self.row_scale, self.cols, self.col_scale)
        )

    @staticmethod
    def bytes_for(out_features: int, in_features: int) -> int:
        """What :meth:`derive` holds for an ``[out, in]`` weight: two E4M3 copies and their scales."""
        return 2 * out_features * in_features + 4 * (out_features + in_features)

    def dense_rows(self) -> torch.Tensor:
        """W as the forward's GEMM sees it (float32)."""
        return self.rows.float() * self.row_scale

    def dense_cols(self) -> torch.Tensor:
        """W^T as the input gradient's GEMM sees it (float32)."""
        return self.cols.float() * self.col_scale


def fp8_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)^T`` for E4M3 ``a`` ``[M, K]`` and ``b`` ``[N, K]`` (both
    row-major, each row with its float32 scale ``[rows, 1]``), in ``out_dtype``.

    ``b`` row-major ``[N, K]`` is exactly the column-major ``[K, N]`` operand ``torch._scaled_mm``
    wants (``b.t()``, no copy); its scales go in as the contiguous ``[1, N]`` row.
    """
    if has_fp8_tensor_cores(a.device):
        out = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.reshape(1, -1),
                               out_dtype=torch.bfloat16)  # fmt: skip
        return out.to(out_dtype)
    return emulated_mm(a, a_scale, b, b_scale, out_dtype)


def emulated_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """:func:`fp8_mm` without FP8 tensor cores: the same codes and scales, multiplied in float32."""
    # Under the update's CUDA autocast a float32 matmul would run in BF16: keep the emulation exact.
    with torch.autocast(a.device.type, enabled=False):
        return ((a.float() * a_scale) @ (b.float() * b_scale).t()).to(out_dtype)


def fp8_pays(out_features: int, in_features: int, min_weights: int = FP8_MIN_WEIGHTS) -> bool:
    """Whether an ``[out, in]`` layer's GEMMs are large enough for FP8 to beat BF16 (``FP8_MIN_WEIGHTS``)."""
    return out_features * in_features >= min_weights


def check_dims(out_features: int, in_features: int) -> str | None:
    """Why ``torch._scaled_mm`` cannot take an ``[out, in]`` weight (both dims are summed over in one
    of the two GEMMs and are a B dim in both), or None."""
    bad = [f"{name} {n}" for name, n in (("out_features", out_features), ("in_features", in_features))
           if n % FP8_DIM_MULTIPLE]  # fmt: skip
    if bad:
        return f"{', '.join(bad)} not a multiple of {FP8_DIM_MULTIPLE}"
    return None


class _LastInput:
    """The FP8 rounding of the last input :class:`Fp8LinearFunction` saw, so the projections that share
    one input (q/k/v, gate/up) round it once.

    A hit needs the very same tensor object, alive (a weak reference: the cache never keeps an input
    alive, and its codes go when the input does) and with an unchanged version counter (no in-place
    write since). One entry only; it is dropped when backward starts."""

    ref: weakref.ref | None = None
    version = -1
    rounded: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def clear(cls, _ref=None) -> None:
        if _ref is None or _ref is cls.ref:  # a dying earlier input must not clear a newer entry
            cls.ref, cls.version, cls.rounded = None, -1, None

    @classmethod
    def quantize(cls, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_inference():  # inference tensors have no version counter: no caching
            return quantize_rows(x)
        if cls.ref is not None and cls.ref() is x and cls.version == x._version and cls.rounded is not None:
            return cls.rounded
        cls.clear()
        rounded = quantize_rows(x)
        cls.ref, cls.version, cls.rounded = weakref.ref(x, cls.clear), x._version, rounded
        return rounded


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` and ``dx = dy W`` as FP8 GEMMs on a layer's :class:`Fp8Weight`.

    The weight copies live on the layer, so nothing of the weight is saved for backward; the bias is
    added to the GEMM's output in the input's dtype.
    """

    @staticmethod
    def forward(ctx, x, bias, weight: Fp8Weight):  # type: ignore[override]
        ctx.weight = weight
        codes, scale = _LastInput.quantize(x)
        out = fp8_mm(codes, scale, weight.rows, weight.row_scale, x.dtype)
        out = out.reshape(*x.shape[:-1], weight.rows.shape[0])
        return out if bias is None else out + bias.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        _LastInput.clear()
        grad_input = None
        if ctx.needs_input_grad[0]:
            weight: Fp8Weight = ctx.weight
            codes, scale = quantize_rows(grad_output)
            grad_input = fp8_mm(codes, scale, weight.cols, weight.col_scale, grad_output.dtype)
            grad_input = grad_input.reshape(*grad_output.shape[:-1], weight.cols.shape[0])
        return grad_input, None, None

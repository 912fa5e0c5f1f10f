"""What llm-compressor's AWQ needs to know per architecture, in one place: which layers it smooths,
and how a smoothing scale is folded into a norm that scales by ``1 + w``.

AWQ multiplies the input channels of the "balance" linears by a scale ``s`` and divides the layer that
feeds them (a norm, or a linear's output rows) by ``s``: the same function, with weights easier to
round. That holds only if the division is exact. Gemma, Gemma 2, Gemma 3, Qwen3-Next and Qwen3.5
RMSNorms store ``w`` and scale by ``1 + w`` ("offset norms"). llm-compressor 0.14 knows this
(``llmcompressor.modeling.offset_norm``: during ``oneshot`` it swaps them for norms that store
``1 + w``, then writes ``W - 1`` back), but it keeps ``1 + w`` in the model's dtype and writes the
smoothed scale back as a BF16 offset from 1. BF16 has 8 significant bits, so near ``|w| ~ 1`` the
stored offset moves in steps of 2^-8: a smoothed scale ``(1 + w) / s`` of 0.05 comes back up to 4 %
off, one below 2^-9 comes back 0 (the channel is cut), and every other offset norm of the model,
smoothed or not, is rounded once more on the way in and out: the smoothed model, before any 4-bit
rounding, is no longer the original, and AWQ can end further from it than round-to-nearest. With the two
fixes below the smoothed model differs from the original by the BF16 rounding of the smoothed linears
only, as on any architecture (AWQ's KL to the BF16 model before and after the fixes: the quantization
runs indexed in ``docs/quantize.md``).

:func:`exact_offset_norms` fixes both halves around ``oneshot``:

* before llm-compressor sees them, the offset norms are swapped for :class:`ScaleRMSNorm`, which holds
  ``1 + w`` in float32 and computes exactly what the original did (llm-compressor then finds no offset
  norm to convert); afterwards each original gets ``w`` back, untouched unless it was smoothed;
* AWQ's chosen scales for an offset norm are nudged, channel by channel, to the nearest ones whose
  smoothed ``1 + w`` the checkpoint's dtype stores exactly (a channel whose scale cannot be stored,
  e.g. one that would be cut to 0, keeps scale 1): the balance linears are then scaled by exactly
  what the norm lost, and only their own BF16 rounding remains, as on every other architecture.

:func:`mappings_for` names the mappings: qerl's own per model class (:data:`ARCHITECTURE_MAPPINGS`),
else ``None`` (llm-compressor's registry). Linear-to-linear mappings are exact on every architecture
(llm-compressor skips ``v_proj -> o_proj`` where grouped-query attention makes the widths differ: fewer
value outputs than o_proj inputs).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# The RMSNorm classes that scale by 1 + w: llm-compressor 0.14's list (llmcompressor.modeling.offset_norm).
OFFSET_NORM_CLASSES = frozenset(
    {
        "GemmaRMSNorm",
        "Gemma2RMSNorm",
        "Gemma3RMSNorm",
        "MuseGlimmerTextCenteredRMSNorm",
        "Qwen3NextRMSNorm",
        "Qwen3_5RMSNorm",
        "Qwen3_5MoeRMSNorm",
    }
)


def is_offset_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__ in OFFSET_NORM_CLASSES and getattr(module, "weight", None) is not None


class ScaleRMSNorm(torch.nn.Module):
    """An offset norm re-expressed as ``normalize(x) * weight``, ``weight = 1 + w`` in float32.

    The float32 sum ``1 + w`` is the one the original forward computes, so the output is the same to
    the bit; AWQ can divide ``weight`` by its scales like any other norm's.
    """

    def __init__(self, original: torch.nn.Module) -> None:
        super().__init__()
        eps = getattr(original, "eps", getattr(original, "variance_epsilon", None))
        if eps is None:
            raise ValueError(f"{type(original).__name__} has no eps")
        self.eps = float(eps)
        self.storage_dtype = original.weight.dtype  # the dtype the checkpoint will store w in
        self.weight = torch.nn.Parameter(1.0 + original.weight.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).type_as(x)

    def storable_scales(self, scales: torch.Tensor) -> torch.Tensor:
        """``scales`` moved so that ``weight / scales - 1`` is exact in ``storage_dtype``.

        Per channel the stored offset is rounded once, here, and the scale is then the exact ratio of
        the old scale ``1 + w`` to the new ``1 + w'``, so norm and balance layers stay inverse. A
        channel whose ``1 + w'`` would be 0 or change sign (a scale too large for the dtype) keeps
        scale 1, as does a channel that is 0 to begin with.
        """
        scale = self.weight.detach().float().cpu()
        wanted = scale / scales.detach().float().cpu()
        stored = (wanted - 1.0).to(self.storage_dtype).float()
        kept = 1.0 + stored
        ok = (scale != 0) & (kept != 0) & (torch.sign(kept) == torch.sign(scale)) & torch.isfinite(kept)
        exact = torch.where(ok, scale / torch.where(ok, kept, torch.ones_like(kept)), torch.ones_like(scale))
        return exact.to(scales.dtype).to(scales.device)

    def offset_weight(self) -> torch.Tensor:
        """``w`` as the original stores it (``weight - 1``, rounded once to ``storage_dtype``)."""
        return (self.weight.detach().float().cpu() - 1.0).to(self.storage_dtype)


@contextmanager
def exact_offset_norms(model: torch.nn.Module) -> Iterator[list[str]]:
    """Offset norms swapped for :class:`ScaleRMSNorm` (names yielded), AWQ's scales for them made
    storable; on exit the originals are back, their ``w`` changed only where AWQ smoothed them."""
    swapped: dict[str, tuple[torch.nn.Module, ScaleRMSNorm, torch.Tensor]] = {}
    for name, module in list(model.named_modules()):
        if is_offset_norm(module):
            replacement = ScaleRMSNorm(module).to(module.weight.device)
            if not _same_function(module, replacement):  # a look-alike class: llm-compressor's handling
                continue
            swapped[name] = (module, replacement, replacement.weight.detach().cpu().clone())
            model.set_submodule(name, replacement)
    try:
        with _storable_awq_scales():
            yield list(swapped)
    finally:
        for name, (original, replacement, entry) in swapped.items():
            if not torch.equal(replacement.weight.detach().float().cpu(), entry):
                original.weight.data = replacement.offset_weight().to(original.weight.device)
            model.set_submodule(name, original)


@torch.no_grad()
def _same_function(original: torch.nn.Module, replacement: ScaleRMSNorm) -> bool:
    """Whether ``replacement`` computes what ``original`` does, to the bit, on a probe input."""
    weight = original.weight
    probe = torch.randn(2, weight.shape[-1], generator=torch.Generator().manual_seed(0)) * 4
    probe = probe.to(device=weight.device, dtype=weight.dtype)
    try:
        return torch.equal(original(probe), replacement(probe))
    except (RuntimeError, TypeError, ValueError):
        return False


@contextmanager
def _storable_awq_scales() -> Iterator[None]:
    """While it is open, AWQ's best scales for a :class:`ScaleRMSNorm` go through
    :meth:`ScaleRMSNorm.storable_scales` before they are applied (llm-compressor 0.14's
    ``AWQModifier._compute_best_scale``; :func:`mappings_for` keeps offset norms out of AWQ's mappings
    where that method does not exist)."""
    from llmcompressor.modifiers.transform.awq import AWQModifier

    original = AWQModifier.__dict__.get("_compute_best_scale")
    if original is None:
        yield
        return

    def _compute_best_scale(self, mapping, *args: Any, **kwargs: Any) -> torch.Tensor:
        scales = original(self, mapping, *args, **kwargs)
        smooth_layer = getattr(mapping, "smooth_layer", None)
        if isinstance(smooth_layer, ScaleRMSNorm):
            scales = smooth_layer.storable_scales(scales)
        return scales

    AWQModifier._compute_best_scale = _compute_best_scale
    try:
        yield
    finally:
        AWQModifier._compute_best_scale = original


def can_smooth_offset_norms() -> bool:
    """Whether :func:`exact_offset_norms` can make AWQ's scales storable: llm-compressor's
    ``AWQModifier._compute_best_scale(mapping, ...)`` exists (0.14 has it)."""
    from llmcompressor.modifiers.transform.awq import AWQModifier

    method = AWQModifier.__dict__.get("_compute_best_scale")
    return method is not None and "mapping" in inspect.signature(method).parameters


# Mappings qerl chooses over llm-compressor's registry, by model class: (smoothed layer, balance layers).
# Gemma 3: the registry (0.14) leaves out input_layernorm -> q/k/v, dropped after AWQ degraded Gemma 3
# models (github.com/vllm-project/llm-compressor/issues/2522, pull/2571); with the smoothing exact it
# pays: AWQ + NVFP4 ends closer to the BF16 model with it than without. q_norm and k_norm act on q/k_proj's
# outputs, which the smoothing does not change. v_proj -> o_proj is kept for Gemma 3 sizes whose widths
# allow it (llm-compressor skips it under grouped-query attention).
ARCHITECTURE_MAPPINGS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "Gemma3ForCausalLM": (
        ("re:.*input_layernorm$", ("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$")),
        ("re:.*v_proj$", ("re:.*o_proj$",)),
        ("re:.*pre_feedforward_layernorm$", ("re:.*gate_proj$", "re:.*up_proj$")),
        ("re:.*up_proj$", ("re:.*down_proj$",)),
    ),
}


def mappings_for(model: torch.nn.Module) -> list[Any] | None:
    """AWQ mappings for ``model``; ``None`` leaves them to llm-compressor's registry.

    :data:`ARCHITECTURE_MAPPINGS` first. Where offset norms cannot be smoothed exactly (an
    llm-compressor without the scale hook), the mappings whose smoothed layer is an offset norm are left
    out: what remains (linear to linear) is exact.
    """
    chosen = ARCHITECTURE_MAPPINGS.get(type(model).__name__)
    offset_names = {name for name, m in model.named_modules() if is_offset_norm(m)}
    exact = not offset_names or can_smooth_offset_norms()
    if chosen is None and exact:
        return None
    from llmcompressor.modifiers.transform.awq import AWQMapping
    from llmcompressor.modifiers.transform.awq.dynamic_mappings import get_layer_mappings_from_model

    if chosen is None:
        mappings = list(get_layer_mappings_from_model(model))
    else:
        mappings = [AWQMapping(smooth, list(balance)) for smooth, balance in chosen]
    if exact:
        return mappings

    def smooths_offset_norm(mapping) -> bool:
        pattern = mapping.smooth_layer
        if pattern.startswith("re:"):
            regex = re.compile(pattern[3:])
            return any(regex.match(name) for name in offset_names)
        return pattern in offset_names

    return [m for m in mappings if not smooths_offset_norm(m)]

"""NVFP4 / MXFP4 through llm-compressor's ``oneshot``: optional AWQ smoothing, then weight-only FP4
rounding, to nearest or by GPTQ.

Recipes::

    --method gptq  GPTQModifier(targets="Linear", scheme="NVFP4A16" | "MXFP4A16", ignore=[...])
    --method awq   AWQModifier(); QuantizationModifier(same scheme)   # round to nearest
    --method rtn   QuantizationModifier(same scheme)                  # data-free

GPTQ rounds one column at a time and spreads each column's rounding error over the columns not yet
rounded, weighted by the calibration activations' second moments (the layer Hessian), so it keeps
more of the model than AWQ's round-to-nearest (KL to the BF16 model of each method: ``docs/quantize.md``;
what AWQ needs to know per architecture lives in
``awq_mappings``). The
checkpoint is saved with ``save_compressed=True`` in compressed-tensors' ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized`` layout, which transformers, vLLM and qerl's QuantLinear load.

llm-compressor is imported lazily: the rest of qerl works without it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import torch

from qerl_cli import formats
from qerl_cli.errors import QerlError, install_hint
from qerl_cli.quantize import awq_mappings
from qerl_cli.quantize.validate import ALWAYS_IGNORED

# llm-compressor's preset scheme of each format it quantizes.
SCHEMES = {
    name: fmt.compressed_tensors_scheme
    for name, fmt in formats.FORMATS.items()
    if fmt.compressed_tensors_scheme is not None
}
# AWQ needs a quantizer to search scales against. NF4 is not a compressed-tensors scheme, so for
# --format nf4 --method awq the search runs against its closest one: symmetric 4-bit integers in
# groups of 64 along the input dimension (NF4 uses absmax blocks of 64 too). Only the smoothing is
# kept; the weights are then rounded to NF4 (see nf4.py).
NF4_AWQ_PROXY = {
    "targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64},
}


LLMCOMPRESSOR_MISSING = (
    f"NVFP4/MXFP4 quantization and AWQ need llm-compressor: {install_hint('quantize')} "
    "(or use --format nf4 --method rtn, which does not)"
)


def require_llmcompressor() -> None:
    """Import llm-compressor (exit 2 with the install hint where it is missing), first of all its
    imports: it sets up its logger's console sink at import as whatever ``sys.stdout`` is then, and its
    lines (one at import already) would sit in the command's results, ``qerl quantize > out`` included;
    imported with stdout sent to stderr, they go to stderr for the whole process."""
    if "llmcompressor" in sys.modules:
        return
    try:
        with redirect_stdout(sys.stderr):
            import llmcompressor  # noqa: F401
    except ImportError:
        raise QerlError(LLMCOMPRESSOR_MISSING) from None


@contextmanager
def cpu_pin_memory_workaround() -> Iterator[None]:
    """Let llm-compressor's AWQ run on a machine without an accelerator.

    ``AWQModifier._apply_smoothing`` pins the cached activations of every mapping
    (``IntermediatesCache.pin_memory``) to speed up host->device copies during the grid search.
    Pinning needs an accelerator, so on a CPU-only machine it raises "Cannot access accelerator
    device when none is available". Seen with llm-compressor 0.14.0.1 (compressed-tensors 0.19.0,
    torch 2.13 CPU). Pinning is only an optimisation for copies that do not happen on CPU, so while
    AWQ runs *and* no accelerator exists, that one method becomes a no-op. With a GPU nothing changes.
    """
    if torch.accelerator.is_available():
        yield
        return
    require_llmcompressor()
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.__dict__.get("pin_memory")
    if original is None:  # a newer llm-compressor without the method: nothing to work around
        yield
        return

    def _skip_pinning(self, batch_index: int, input_names: list[str] | None = None) -> None:
        return None

    IntermediatesCache.pin_memory = _skip_pinning
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


def build_recipe(fmt: str, method: str, ignore: list[str]) -> list[Any]:
    """The llm-compressor modifiers for ``fmt`` (nvfp4, mxfp4, or nf4's AWQ proxy) and ``method``."""
    require_llmcompressor()
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    ignore = [*ALWAYS_IGNORED, *ignore]
    if fmt == "nf4":
        if method == "gptq":  # validate.check_method_for_format refuses this before any work
            raise QerlError("GPTQ has no NF4 scheme in compressed-tensors: use --method awq or rtn for nf4")
        quant = QuantizationModifier(config_groups={"group_0": NF4_AWQ_PROXY}, ignore=ignore)
    elif method == "gptq":
        quant = GPTQModifier(targets="Linear", scheme=SCHEMES[fmt], ignore=ignore)
    else:
        quant = QuantizationModifier(targets="Linear", scheme=SCHEMES[fmt], ignore=ignore)
    return [AWQModifier(), quant] if method == "awq" else [quant]


def run_oneshot(model: torch.nn.Module, tokenizer, recipe: list[Any], calibration=None) -> None:
    """Apply ``recipe`` to ``model`` in place (AWQ and GPTQ need ``calibration``, a tokenized Dataset).

    The model may sit on the CPU: llm-compressor's sequential pipeline onloads one decoder layer at
    a time to the accelerator if there is one.
    """
    require_llmcompressor()
    from llmcompressor import oneshot
    from llmcompressor.modifiers.transform.awq import AWQModifier

    mappings = awq_mappings.mappings_for(model)  # before the offset norms are swapped out
    for modifier in recipe:
        if isinstance(modifier, AWQModifier) and modifier.mappings is None and mappings is not None:
            modifier.mappings = mappings
    kwargs: dict[str, Any] = {}
    if calibration is not None:
        kwargs.update(
            dataset=calibration,
            num_calibration_samples=len(calibration),
            max_seq_length=max(len(ids) for ids in calibration["input_ids"]),
            # qerl already shuffled with its own seed; a second shuffle would make runs irreproducible.
            shuffle_calibration_samples=False,
        )
    # Gemma-style norms (scale 1 + w) are smoothed exactly and come back unchanged where AWQ did not
    # smooth them: see awq_mappings.
    with cpu_pin_memory_workaround(), awq_mappings.exact_offset_norms(model):
        oneshot(model=model, tokenizer=tokenizer, recipe=recipe, **kwargs)


def reference_weights(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """CPU copies of ``names``' weights as they are now: taken before GPTQ (which rounds in place) or
    after AWQ smoothing, they are the weights the 4-bit ones stand for."""
    modules = dict(model.named_modules())
    return {name: modules[name].weight.detach().to("cpu", copy=True) for name in names}


def save_compressed(model: torch.nn.Module, out_dir: Path) -> None:
    """compressed-tensors packed checkpoint (plus llm-compressor's recipe.yaml) into ``out_dir``."""
    model.save_pretrained(out_dir, save_compressed=True)

"""Round-to-nearest 4-bit checkpoints written by qerl's own format code, without llm-compressor.

The packer and writer of ``qerl_cli.formats.checkpoint`` (compressed-tensors ``nvfp4-pack-quantized`` /
``mxfp4-pack-quantized``, bitsandbytes NF4), applied to a real BF16 model's weights: NVFP4 shares one
global scale across each fused group (q/k/v, gate/up), as llm-compressor does, so vLLM can fuse them.
Used where llm-compressor is absent (``qerl bench quality``'s RTN rows on a GPU machine without it) and by
``qerl compare`` to make the 4-bit counterpart of a BF16 base; ``qerl quantize --method rtn`` is the
llm-compressor route to an equivalent checkpoint. Each is written with the ``qerl_quant.json`` that
route writes (:mod:`qerl_cli.quantize.report`), its source model recorded.

:func:`write_dequantized_checkpoint` goes the other way: a dense BF16 copy of a 4-bit checkpoint's
weights, the control base of ``qerl compare``'s ``base.dequantized`` arms.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from qerl_cli.envinfo import package_versions
from qerl_cli.errors import QerlError
from qerl_cli.files import is_complete_folder, write_folder_once, write_json
from qerl_cli.formats.checkpoint import ModuleGroup, check_checkpoint_format, module_groups, write_checkpoint
from qerl_cli.modeling.loading import DEQUANTIZED_RECORD, load_policy_model, load_pretrained_lm
from qerl_cli.modeling.quant_linear import QuantLinear
from qerl_cli.modeling.shapes import MARLIN_FORMATS, marlin_refusals, module_shapes
from qerl_cli.modeling.sources import resolve_model_source
from qerl_cli.quantize import report
from qerl_cli.quantize.report import REPORT_NAME, read_report
from qerl_cli.quantize.validate import ALWAYS_IGNORED, quantized_linear_names


def write_rtn_checkpoint(source: str | Path, out_dir: str | Path, fmt: str) -> Path:
    """Quantize the BF16 model at ``source`` (folder, .gguf or alias) to ``fmt`` with RTN into ``out_dir``.

    Written to a sibling temporary folder and renamed when complete; an existing complete ``out_dir``
    is returned as is (several processes may ask for the same base at once).
    """
    from transformers import AutoTokenizer

    out = Path(out_dir)
    if is_complete_folder(out):
        return out
    started = time.perf_counter()
    check_checkpoint_format(fmt)
    folder = resolve_model_source(source)
    model = load_pretrained_lm(folder, dtype=torch.bfloat16).eval()  # safetensors only
    if getattr(model.config, "quantization_config", None):
        raise QerlError(f"{source} is already quantized: RTN needs the BF16 model")

    def write(staging: Path) -> None:
        written = time.perf_counter()
        write_checkpoint(staging, _groups(model), fmt, model.config.to_dict())
        model.generation_config.save_pretrained(staging)
        AutoTokenizer.from_pretrained(folder).save_pretrained(staging)  # chat template included
        # The record `qerl quantize` writes, so that this base says what it was made from (compare checks
        # a base it made before against the model it would make it from now) and how far it is from BF16.
        report.write_report(staging, _rtn_result(model, source, folder, staging, fmt, started, written))

    return write_folder_once(out, write)


def _rtn_result(
    model: nn.Module, source: str | Path, folder: str, out: Path, fmt: str, started: float, written: float
) -> report.QuantizeResult:
    """The ``qerl_quant.json`` of an RTN checkpoint just written to ``out`` from ``model`` (the BF16 model
    ``source``, resolved to ``folder``), its weight errors measured on what was saved."""
    quantized = quantized_linear_names(model, [])
    modules = dict(model.named_modules())
    errors = report.weight_errors(out, fmt, {name: modules[name].weight.detach() for name in quantized})
    refused = marlin_refusals(module_shapes(model, quantized)) if fmt in MARLIN_FORMATS else []
    return report.QuantizeResult(
        model=str(source), output=str(out), format=fmt, method="rtn",
        rounding="round to nearest, qerl's own format code (no llm-compressor)", calibration=None,
        ignored_layers=["lm_head"], skipped_layers=[],
        versions=package_versions(report.VERSIONED_PACKAGES),
        size=report.SizeReport(
            report.state_bytes(model), report.weights_bytes(out), report.folder_bytes(out)
        ),
        weight_error=report.WeightError.measured("BF16 weight as rounded", errors),
        perplexity=None,
        vllm_marlin=report.MarlinRefusals(report.MARLIN_APPLIES_TO, refused),
        device="cpu", peak_gpu_bytes=None,
        timings_s=report.QuantizeTimings(written - started, time.perf_counter() - written),
        elapsed_s=time.perf_counter() - started, source=report.source_record(folder),
    )  # fmt: skip


def _groups(model: nn.Module) -> Iterator[tuple[ModuleGroup, set[str]]]:
    """The model's tensors one parent at a time, with the linears to quantize (all but lm_head)."""
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    for members in module_groups(model):
        group = {
            name: {p: t.detach() for p, t in module.named_parameters(recurse=False)}
            for name, module in members
            if not (tied and name == "lm_head")
        }
        linears = {
            name
            for name, module in members
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in ALWAYS_IGNORED
        }
        yield group, linears


def write_dequantized_checkpoint(source: str | Path, out_dir: str | Path, method: str | None = None) -> Path:
    """A dense BF16 checkpoint of the 4-bit model at ``source`` in ``out_dir``, made once.

    Every quantized linear holds the weight qerl's own dequantization gives (the one ``QuantLinear``
    computes with in training), every other tensor is copied as stored (an AWQ base's smoothed norms
    included): trained in BF16 it sees the 4-bit model's weights through BF16 kernels.
    ``qerl_dequantized.json`` records the source, its format and its quantization method (``method``,
    else what the source's ``qerl_quant.json`` says, else null).
    """
    from transformers import AutoTokenizer

    out = Path(out_dir)
    folder = Path(resolve_model_source(source))
    if is_complete_folder(out):
        made_from = json.loads((out / DEQUANTIZED_RECORD).read_text()).get("source")
        if made_from != str(folder):
            raise QerlError(
                f"{out} is a dense copy of {made_from}, not of {folder}: remove it to make the copy again, "
                "or write this one elsewhere"
            )
        return out
    model, fmt = load_policy_model(folder, dtype=torch.bfloat16, device="cpu")
    if fmt == "bf16":
        raise QerlError(f"{source} is not a 4-bit checkpoint: there is nothing to dequantize")
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            model.set_submodule(name, _dense_linear(module))
    if method is None and (folder / REPORT_NAME).is_file():
        method = read_report(folder).method

    def write(staging: Path) -> None:
        model.save_pretrained(staging)  # safetensors; the config has no quantization_config any more
        AutoTokenizer.from_pretrained(folder).save_pretrained(staging)
        write_json(staging / DEQUANTIZED_RECORD, {"source": str(folder), "format": fmt, "method": method})

    return write_folder_once(out, write)


def _dense_linear(layer: nn.Module) -> nn.Linear:
    """A BF16 ``nn.Linear`` holding a ``QuantLinear``'s dequantized weight (and its bias)."""
    has_bias = layer.bias is not None
    dense = nn.Linear(layer.in_features, layer.out_features, bias=has_bias, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(layer.dequantized_weight(torch.bfloat16))
        if has_bias:
            dense.bias.copy_(layer.bias)
    return dense

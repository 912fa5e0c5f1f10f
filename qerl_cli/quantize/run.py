"""``qerl quantize``: BF16 model folder or hub id in, 4-bit checkpoint folder out.

Order of work: every cheap check first (format, model reachable, output free, calibration file
readable, layer widths), then the expensive part inside a staging folder that only becomes the
output once it is complete.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from qerl_cli.config import QuantizeConfig
from qerl_cli.errors import QerlError
from qerl_cli.modeling.shapes import MARLIN_FORMATS, marlin_refusals, module_shapes
from qerl_cli.quantize import pipeline, report
from qerl_cli.quantize.calibration import HELD_OUT_SAMPLES, CalibrationSet, load_calibration
from qerl_cli.quantize.nf4 import save_nf4
from qerl_cli.quantize.validate import (
    check_format,
    check_layers,
    check_method,
    check_output,
    default_output,
    quantized_linear_names,
    resolve_model,
    staged_output,
)
from qerl_cli.torch_utils import resolve_device


def _load_model(ref: str, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            ref, dtype=torch.bfloat16, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise QerlError(f"could not load model {ref!r} as a causal LM: {exc}") from None
    if getattr(model.config, "quantization_config", None):
        raise QerlError(f"model {ref!r} is already quantized: start from its BF16/FP16 checkpoint")
    return model.eval()


def _load_quantized(path: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=str(device)).eval()


def _require_extras(fmt: str, method: str, eval_ppl: bool) -> None:
    if fmt != "nf4" or method == "awq":
        pipeline.require_llmcompressor()
    if fmt == "nf4" and eval_ppl:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise QerlError(
                "--eval-ppl on NF4 loads the result with bitsandbytes: pip install 'qerl[nf4]' "
                "(quantizing to NF4 itself does not need it)"
            ) from None


def run_quantize(cfg: QuantizeConfig) -> dict[str, Any]:
    """Quantize ``cfg.model`` to ``cfg.format``; returns the report also saved as qerl_quant.json."""
    from transformers import AutoTokenizer

    from qerl_cli import formats

    start = time.perf_counter()
    cfg.validate()
    fmt = check_format(cfg.format)
    method = check_method(cfg.method)
    _require_extras(fmt, method, cfg.eval_ppl)
    source = resolve_model(cfg.model, trust_remote_code=cfg.trust_remote_code)
    output = check_output(
        Path(cfg.output) if cfg.output else default_output(source, fmt), source, cfg.overwrite
    )
    device = resolve_device(cfg.device)

    tokenizer = AutoTokenizer.from_pretrained(source.ref, trust_remote_code=cfg.trust_remote_code)
    calib: CalibrationSet | None = None
    if method == "awq" or cfg.eval_ppl:
        calib = load_calibration(
            cfg.calib,
            tokenizer,
            num_samples=cfg.num_samples if method == "awq" else 0,
            seq_len=cfg.seq_len,
            seed=cfg.seed,
            split=cfg.calib_split,
            field_name=cfg.calib_field,
            held_out=HELD_OUT_SAMPLES if cfg.eval_ppl else 0,
        )
    model = _load_model(source.ref, cfg.trust_remote_code)
    skipped = check_layers(model, fmt, formats.get(fmt).block_size, cfg.skip_incompatible)
    quantized = quantized_linear_names(model, skipped)
    # Hopper-class GPUs run FP4 through vLLM's Marlin kernels, which refuse some widths: say which now.
    vllm_refused = marlin_refusals(module_shapes(model, quantized)) if fmt in MARLIN_FORMATS else []
    float_keys = set(model.state_dict())
    bf16_bytes = report.state_bytes(model)
    loaded_s = time.perf_counter() - start

    ppl: dict[str, Any] | None = None
    if cfg.eval_ppl:
        assert calib is not None
        ppl = {
            "samples": len(calib.held_out),
            "bf16": report.perplexity(model.to(device), calib.held_out, device),
        }
        model.to("cpu")  # llm-compressor onloads layer by layer from the CPU
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    with staged_output(output, cfg.overwrite) as staging:
        quant_start = time.perf_counter()
        calibration = calib.as_dataset() if method == "awq" and calib is not None else None
        if fmt == "nf4":
            if method == "awq":
                pipeline.run_oneshot(
                    model, tokenizer, pipeline.build_recipe(fmt, method, skipped), calibration
                )
            reference = pipeline.reference_weights(model, quantized)
            save_nf4(model, float_keys, quantized, skipped, staging, device)
        else:
            pipeline.run_oneshot(model, tokenizer, pipeline.build_recipe(fmt, method, skipped), calibration)
            reference = pipeline.reference_weights(model, quantized)
            pipeline.save_compressed(model, staging)
        tokenizer.save_pretrained(staging)
        quantize_s = time.perf_counter() - quant_start
        peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        del model

        errors = report.weight_errors(staging, fmt, reference, device)
        del reference
        if ppl is not None:
            assert calib is not None
            quantized_model = _load_quantized(staging, device)
            ppl["quantized"] = report.perplexity(quantized_model, calib.held_out, device)
            del quantized_model

        result = {
            "model": cfg.model,
            "output": str(output),
            "format": fmt,
            "method": method,
            "rounding": _rounding_note(fmt, method),
            "calibration": calib.spec if calib is not None and method == "awq" else None,
            "ignored_layers": ["lm_head"],
            "skipped_layers": skipped,
            "versions": report.package_versions(),
            "size": {
                "bf16_bytes": bf16_bytes,
                "weights_bytes": report.folder_bytes(staging, "*.safetensors"),
                "folder_bytes": report.folder_bytes(staging),
            },
            "weight_error": {
                "reference": "BF16 weight as rounded (after AWQ smoothing when method is awq)",
                **report.error_summary(errors),
                "per_layer": errors,
            },
            "perplexity": ppl,
            "vllm_marlin": {
                "applies_to": "vLLM on GPUs without native FP4 (compute capability < 10.0)",
                "refused_layers": vllm_refused,
            },
            "device": str(device),
            "peak_gpu_bytes": peak_gpu,
            "timings_s": {"load": loaded_s, "quantize_and_save": quantize_s},
        }
        result["elapsed_s"] = time.perf_counter() - start
        report.write_report(staging, result)
    return result


def _rounding_note(fmt: str, method: str) -> str:
    if fmt == "nf4":
        smoothing = (
            "AWQ smoothing scales (searched against an INT4 group-64 proxy) folded into the BF16 "
            "weights, then "
            if method == "awq"
            else ""
        )
        return smoothing + "round-to-nearest on the NF4 code book (bitsandbytes-compatible, double quant)"
    scheme = pipeline.SCHEMES[fmt]
    return f"llm-compressor {'AWQ + ' if method == 'awq' else ''}{scheme} (round to nearest E2M1)"

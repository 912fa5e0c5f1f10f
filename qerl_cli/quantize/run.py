"""``qerl quantize``: BF16 model folder or hub id in, 4-bit checkpoint folder out.

Order of work: every check that needs no model first (:mod:`qerl_cli.quantize.preflight`: format,
method, model reachable, output free and writable, calibration source, packages; what ``--dry-run``
runs), then the model and its layer widths, then the expensive part inside a staging folder that only
becomes the output once it is complete. With ``--lora-init`` the error-compensating LoRA start is written into
that folder too, after the checkpoint (:mod:`qerl_cli.quantize.error_init`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_cli import formats
from qerl_cli.config import QuantizeConfig
from qerl_cli.config.choices import CALIBRATED_METHODS
from qerl_cli.envinfo import package_versions
from qerl_cli.errors import QerlError
from qerl_cli.modeling.error_init import LoraInitInfo
from qerl_cli.modeling.loading import load_pretrained_lm
from qerl_cli.modeling.shapes import MARLIN_FORMATS, marlin_refusals, module_shapes
from qerl_cli.modeling.sources import resolve_model_source
from qerl_cli.quantize import error_init, pipeline, report
from qerl_cli.quantize.calibration import HELD_OUT_SAMPLES, CalibrationSet, load_calibration
from qerl_cli.quantize.nf4 import save_nf4
from qerl_cli.quantize.preflight import needs_llmcompressor, preflight
from qerl_cli.quantize.report import (
    MarlinRefusals,
    Perplexity,
    QuantizeResult,
    QuantizeTimings,
    SizeReport,
    WeightError,
)
from qerl_cli.quantize.validate import (
    check_layers,
    quantized_linear_names,
    staged_output,
)
from qerl_cli.torch_utils import cpu_seconds, duration, estimated_duration, parameter_count


def _load_model(ref: str, trust_remote_code: bool):
    try:  # safetensors only: a pickle-only model is refused with its own QerlError
        model = load_pretrained_lm(ref, dtype=torch.bfloat16, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise QerlError(f"could not load model {ref!r} as a causal LM: {exc}") from None
    if getattr(model.config, "quantization_config", None):
        raise QerlError(f"model {ref!r} is already quantized: start from its BF16/FP16 checkpoint")
    return model.eval()


def _load_quantized(path: Path, device: torch.device):
    # The checkpoint just written (safetensors), read back as any model's weights are.
    return load_pretrained_lm(path, dtype=torch.bfloat16, device_map=str(device)).eval()


@dataclass
class _Job:
    """What the cheap checks settled: the choices, where the output goes, and the BF16 model's facts."""

    fmt: str
    method: str
    source: str  # what from_pretrained gets (the BF16 model, reloaded for --lora-init)
    output: Path
    device: torch.device
    tokenizer: Any
    calib: CalibrationSet | None
    skipped: list[str]  # layers left in BF16 (--skip-incompatible)
    quantized: list[str]  # the linear layers made 4-bit
    vllm_refused: list[str]
    float_keys: set[str]  # the BF16 model's state-dict keys (the NF4 writer keeps the others as they are)
    bf16_bytes: int


Log = Callable[[str], None]


def run_quantize(cfg: QuantizeConfig, log: Log | None = None) -> QuantizeResult:
    """Quantize ``cfg.model`` to ``cfg.format``; returns the result also saved as qerl_quant.json.
    ``log`` gets a line as each stage starts and ends (what ``qerl quantize`` prints), with a CPU time
    estimate before the long one; none by default (callers that quantize as a step of their own)."""
    log = log or (lambda _line: None)
    start = time.perf_counter()
    job, model = _prepare(cfg, log)
    loaded_s = time.perf_counter() - start
    ppl_bf16 = _bf16_perplexity(job, model) if cfg.eval_ppl else None
    device = job.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    with staged_output(job.output, cfg.overwrite) as staging:
        quant_start = time.perf_counter()
        log(f"quantizing {len(job.quantized)} linear layers ({job.method}) on {device} ...")
        if device.type == "cpu":
            log(_cpu_estimate(job, cfg))
        reference = _quantize_and_save(job, model, staging)
        quantize_s = time.perf_counter() - quant_start
        log(f"quantized and saved in {duration(quantize_s)}; measuring the rounding error ...")
        peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        del model  # the measurements below load what was saved; the BF16 model's memory goes first

        errors = report.weight_errors(staging, job.fmt, reference, device)
        del reference
        if cfg.lora_init != "zeros":
            log(f"writing the {cfg.lora_init} LoRA start (rank {cfg.lora_init_rank}) ...")
        lora_init = _write_lora_init(cfg, job, staging)
        perplexity = None
        if ppl_bf16 is not None:
            log("perplexity of the 4-bit model ...")
            assert job.calib is not None
            quantized_model = _load_quantized(staging, device)
            ppl_quantized = report.perplexity(quantized_model, job.calib.held_out, device)
            del quantized_model
            perplexity = Perplexity(len(job.calib.held_out), ppl_bf16, ppl_quantized)

        result = QuantizeResult(
            model=cfg.model,
            output=str(job.output),
            format=job.fmt,
            method=job.method,
            rounding=_rounding_note(job.fmt, job.method),
            calibration=job.calib.spec
            if job.calib is not None and job.method in CALIBRATED_METHODS
            else None,
            ignored_layers=["lm_head"],
            skipped_layers=job.skipped,
            versions=package_versions(report.VERSIONED_PACKAGES),
            size=SizeReport(
                bf16_bytes=job.bf16_bytes,
                weights_bytes=report.weights_bytes(staging),
                folder_bytes=report.folder_bytes(staging),
            ),
            weight_error=WeightError.measured(
                "BF16 weight as rounded (after AWQ smoothing when method is awq; GPTQ's error "
                "compensation moves weights on purpose, so its figure is against the original weight)",
                errors,
            ),
            perplexity=perplexity,
            vllm_marlin=MarlinRefusals(
                applies_to=report.MARLIN_APPLIES_TO,
                refused_layers=job.vllm_refused,
            ),
            device=str(device),
            peak_gpu_bytes=peak_gpu,
            timings_s=QuantizeTimings(load=loaded_s, quantize_and_save=quantize_s),
            elapsed_s=time.perf_counter() - start,
            lora_init=lora_init,
            source=report.source_record(job.source),
        )
        report.write_report(staging, result)
    log(f"done in {duration(time.perf_counter() - start)}: {job.output}")
    return result


def _prepare(cfg: QuantizeConfig, log: Log) -> tuple[_Job, torch.nn.Module]:
    """Every cheap check (format, method, extras, model reachable, output free), then the tokenizer,
    the calibration set and the BF16 model with its layer checks; returns the job and the model."""
    from transformers import AutoTokenizer

    plan = preflight(cfg)  # every check that needs no model, in a second or two
    fmt, method, output, device = plan.fmt, plan.method, plan.output, plan.device
    if needs_llmcompressor(fmt, method):  # found by the checks; imported now, before the model loads
        pipeline.require_llmcompressor()
    source = resolve_model_source(plan.source.ref)  # a GGUF file is converted here, once

    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    calib: CalibrationSet | None = None
    # --lora-init weighs the rounding error by the calibration activations, even for rtn.
    calibrate = plan.calibrate
    if plan.calibration is not None:
        log(plan.calibration)
        calib = load_calibration(
            cfg.calib,
            tokenizer,
            num_samples=cfg.num_samples if calibrate else 0,
            seq_len=cfg.seq_len,
            seed=cfg.seed,
            split=cfg.calib_split,
            field_name=cfg.calib_field,
            held_out=HELD_OUT_SAMPLES if cfg.eval_ppl else 0,
        )
    log(f"loading the BF16 model {source} ...")
    model = _load_model(source, cfg.trust_remote_code)
    skipped = check_layers(model, fmt, formats.get(fmt).block_size, cfg.skip_incompatible)
    quantized = quantized_linear_names(model, skipped)
    # Hopper-class GPUs run FP4 through vLLM's Marlin kernels, which refuse some widths: say which now.
    vllm_refused = marlin_refusals(module_shapes(model, quantized)) if fmt in MARLIN_FORMATS else []
    job = _Job(
        fmt=fmt, method=method, source=source, output=output, device=device, tokenizer=tokenizer,
        calib=calib, skipped=skipped, quantized=quantized, vllm_refused=vllm_refused,
        float_keys=set(model.state_dict()), bf16_bytes=report.state_bytes(model),
    )  # fmt: skip
    return job, model


def _cpu_estimate(job: _Job, cfg: QuantizeConfig) -> str:
    """What the rounding should take on this CPU, from the model's size and the calibration tokens."""
    params = job.bf16_bytes // 2
    tokens = cfg.num_samples * cfg.seq_len if job.method in CALIBRATED_METHODS else 0
    seconds = cpu_seconds(params, forward_tokens=tokens) if tokens else 0.0
    if not tokens:
        return "estimate on this CPU: round to nearest takes seconds to minutes (no calibration)"
    threads, size = torch.get_num_threads(), parameter_count(params)
    return (
        f"estimate on this CPU ({threads} threads): {estimated_duration(seconds)} ({job.method} on "
        f"{cfg.num_samples} x {cfg.seq_len} calibration tokens, {size} parameters; worked out from the "
        "configuration, it may be off 2x either way. Fewer --num-samples / --seq-len, or --method rtn, take "
        "less)"
    )


def _write_lora_init(cfg: QuantizeConfig, job: _Job, staging: Path) -> LoraInitInfo | None:
    """``staging/lora_init/`` from the untouched BF16 model (loaded again: quantization changed the
    first copy in place) and the checkpoint just written."""
    if cfg.lora_init == "zeros":
        return None
    assert job.calib is not None
    return error_init.build_lora_init(
        _load_model(job.source, cfg.trust_remote_code), staging, job.quantized, job.calib.samples,
        method=cfg.lora_init, rank=cfg.lora_init_rank, base_model=cfg.model, device=job.device,
        calibration=job.calib.spec,
    )  # fmt: skip


def _bf16_perplexity(job: _Job, model: torch.nn.Module) -> float:
    """``--eval-ppl``'s BF16 side, measured before quantization changes the model in place."""
    assert job.calib is not None
    ppl = report.perplexity(model.to(job.device), job.calib.held_out, job.device)
    model.to("cpu")  # llm-compressor onloads layer by layer from the CPU
    return ppl


def _quantize_and_save(job: _Job, model: torch.nn.Module, staging: Path) -> dict[str, torch.Tensor]:
    """Quantize ``model`` and write the checkpoint and tokenizer into ``staging``; returns the BF16
    weights that were rounded (after AWQ smoothing; before GPTQ, which rounds in place), the reference
    of the weight errors."""
    fmt, method = job.fmt, job.method
    calibration = job.calib.as_dataset() if method in CALIBRATED_METHODS and job.calib is not None else None
    if fmt == "nf4":
        if method == "awq":  # AWQ's smoothing only (llm-compressor); the NF4 rounding is qerl's own
            pipeline.run_oneshot(
                model, job.tokenizer, pipeline.build_recipe(fmt, method, job.skipped), calibration
            )
        reference = pipeline.reference_weights(model, job.quantized)
        save_nf4(model, job.float_keys, job.quantized, job.skipped, staging, job.device)
    else:
        original = pipeline.reference_weights(model, job.quantized) if method == "gptq" else None
        pipeline.run_oneshot(
            model, job.tokenizer, pipeline.build_recipe(fmt, method, job.skipped), calibration
        )
        reference = original if original is not None else pipeline.reference_weights(model, job.quantized)
        pipeline.save_compressed(model, staging)
    job.tokenizer.save_pretrained(staging)
    return reference


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
    if method == "gptq":
        return f"llm-compressor GPTQ {scheme} (E2M1 rounding with GPTQ's error compensation)"
    return f"llm-compressor {'AWQ + ' if method == 'awq' else ''}{scheme} (round to nearest E2M1)"

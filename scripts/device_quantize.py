#!/usr/bin/env python
"""Device acceptance for `qerl quantize`: AWQ NVFP4 of a random-weight Qwen2.5-7B-shaped model.

Runs qerl's own llm-compressor path (``qerl_cli.quantize.pipeline``: AWQModifier + NVFP4A16, saved
with save_compressed=True) on a 256 x 2048 calibration set of random token ids, then measures the
saved checkpoint's weight error with ``qerl_cli.formats``. Writes ``$OUT/device_quantize.json``
(rewritten after each phase, so a run cut short still reports how far it got) with wall time per
phase and peak GPU memory. ``--vllm`` then serves the result with vLLM and generates.

    python scripts/device_quantize.py                      # full: 28 layers, 256 x 2048
    python scripts/device_quantize.py --layers 4           # shorter run; time scales ~linearly in layers
    python scripts/device_quantize.py --skip-quantize --vllm --work /tmp/qerl_q7b   # serve an earlier output

Needs a CUDA GPU, llm-compressor and compressed-tensors (the `quantize` extra); vLLM only for --vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _write(result: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "device_quantize.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), flush=True)


def build_random_model(shape: str, layers: int | None, work: Path, seed: int, device: str):
    """Random N(0, 0.02) weights (norms 1) built on the GPU, then moved to the CPU for llm-compressor.

    llm-compressor's sequential pipeline onloads one decoder layer at a time from the CPU; a config
    and tokenizer are written to ``work`` because oneshot re-reads the config from ``name_or_path``.
    """
    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.random_checkpoint import model_config
    from qerl_cli.modeling.tiny import build_tokenizer

    config = model_config(shape)
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    config.torch_dtype = "bfloat16"
    base = work / "bf16-config"
    base.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(base)
    tokenizer = build_tokenizer()  # byte-level: fine for random ids and for vLLM's detokenizer
    tokenizer.save_pretrained(base)

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02)
    model = model.to("cpu").eval()
    model.config.name_or_path = str(base)
    model.name_or_path = str(base)
    return model, tokenizer


def _peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def random_calibration(num_samples: int, seq_len: int, vocab: int, seed: int):
    from datasets import Dataset

    ids = torch.randint(0, vocab, (num_samples, seq_len), generator=torch.Generator().manual_seed(seed))
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def quantize(args: argparse.Namespace, result: dict[str, Any], out_dir: Path) -> Path:
    from qerl_cli.quantize import pipeline, report
    from qerl_cli.quantize.validate import quantized_linear_names

    start = time.perf_counter()
    model, tokenizer = build_random_model(args.shape, args.layers, args.work, args.seed, args.device)
    result["layers"] = model.config.num_hidden_layers
    result["params"] = sum(p.numel() for p in model.parameters())
    result["bf16_bytes"] = report.state_bytes(model)
    calibration = random_calibration(args.num_samples, args.seq_len, model.config.vocab_size, args.seed)
    result["timings_s"]["build_model_and_data"] = time.perf_counter() - start
    result["phase"] = "built"
    _write(result, out_dir)

    names = quantized_linear_names(model, [])
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    pipeline.run_oneshot(model, tokenizer, pipeline.build_recipe("nvfp4", "awq", []), calibration)
    result["timings_s"]["awq_oneshot"] = time.perf_counter() - start
    result["peak_gpu_bytes_oneshot"] = _peak(args.device)
    result["phase"] = "calibrated"
    _write(result, out_dir)

    reference = pipeline.reference_weights(model, names) if args.weight_error else None
    quant_dir = args.work / "nvfp4"
    start = time.perf_counter()
    pipeline.save_compressed(model, quant_dir)
    tokenizer.save_pretrained(quant_dir)
    result["timings_s"]["save"] = time.perf_counter() - start
    result["peak_gpu_bytes"] = _peak(args.device)
    result["nvfp4_bytes"] = report.folder_bytes(quant_dir, "*.safetensors")
    result["output"] = str(quant_dir)
    result["phase"] = "saved"
    _write(result, out_dir)
    del model

    if reference is not None:
        start = time.perf_counter()
        errors = report.weight_errors(quant_dir, "nvfp4", reference, args.device)
        summary = report.error_summary(errors)
        result["weight_error"] = {k: summary[k] for k in ("layers", "mean", "max", "worst_layers")}
        result["timings_s"]["weight_error"] = time.perf_counter() - start
        _write(result, out_dir)
    return quant_dir


def serve(quant_dir: Path, result: dict[str, Any], out_dir: Path) -> None:
    """Load the checkpoint with vLLM (settings of ../shared/tools/device-vllm/README.md) and generate."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=str(quant_dir),
        attention_backend="TRITON_ATTN",
        gpu_memory_utilization=0.5,
        max_model_len=1024,
        enforce_eager=True,
    )
    result["timings_s"]["vllm_load"] = time.perf_counter() - start
    prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(4)]
    params = SamplingParams(max_tokens=32, temperature=0.6, top_p=0.95, ignore_eos=True, seed=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    result["timings_s"]["vllm_generate"] = time.perf_counter() - start
    result["vllm_generated_tokens"] = [len(o.outputs[0].token_ids) for o in outputs]
    result["vllm_sample_ids"] = list(outputs[0].outputs[0].token_ids[:8])
    result["phase"] = "served"
    _write(result, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen2.5-7b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's 28)")
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/qerl_q7b"))
    parser.add_argument("--no-weight-error", dest="weight_error", action="store_false")
    parser.add_argument("--skip-quantize", action="store_true", help="reuse WORK/nvfp4 from an earlier run")
    parser.add_argument("--vllm", action="store_true", help="serve the result with vLLM and generate")
    parser.add_argument("--allow-cpu", action="store_true", help="smoke-test on a CPU (use --shape tiny)")
    args = parser.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.allow_cpu:
        raise SystemExit("device_quantize.py needs a CUDA GPU (--allow-cpu for a smoke test)")
    out_dir = Path(os.environ.get("OUT", "device_quantize_out"))
    result: dict[str, Any] = {
        "shape": args.shape,
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__,
        "timings_s": {},
        "phase": "start",
    }
    from qerl_cli.envinfo import package_versions
    from qerl_cli.quantize.report import VERSIONED_PACKAGES

    result["versions"] = package_versions(VERSIONED_PACKAGES)
    total = time.perf_counter()
    quant_dir = args.work / "nvfp4" if args.skip_quantize else quantize(args, result, out_dir)
    if args.vllm:
        serve(quant_dir, result, out_dir)
    result["timings_s"]["total"] = time.perf_counter() - total
    result["phase"] = "done"
    _write(result, out_dir)


if __name__ == "__main__":
    main()

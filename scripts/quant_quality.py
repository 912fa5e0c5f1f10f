"""Quantization quality of one BF16 model in every format: perplexity on held-out text, weight error.

    python scripts/quant_quality.py smollm2-135m-instruct --out runs/quant_quality
    python scripts/quant_quality.py MODEL --rows nvfp4-rtn,nf4-rtn --device cuda

Rows: BF16, NVFP4 RTN, NVFP4 AWQ, MXFP4 RTN, NF4 RTN. Calibration (AWQ) and held-out text both come
from ``--calib qerl-text`` (shipped prose + worked word problems, see ``qerl_cli.data.calib_text``);
the held-out rows are never calibrated on. With llm-compressor installed every row is made by ``qerl
quantize`` (``--eval-ppl``); without it, RTN rows are written by qerl's own packing code
(``qerl_cli.quantize.native``, the same RTN) and AWQ is reported as skipped. Perplexity is measured the
same way for every row: the checkpoint loaded by qerl's QuantLinear loader (what ``qerl train`` uses).
Writes ``quant_quality.json`` and ``quant_quality.md`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qerl_cli.data.calib_text import SMALL_CALIB_SAMPLES, SMALL_CALIB_SEQ_LEN  # noqa: E402

ROWS = ("nvfp4-rtn", "nvfp4-awq", "mxfp4-rtn", "nf4-rtn")


def held_out_ids(tokenizer: Any, calib_samples: int, seq_len: int) -> tuple[list[list[int]], dict]:
    from qerl_cli.quantize.calibration import HELD_OUT_SAMPLES, load_calibration

    calib = load_calibration(
        "qerl-text", tokenizer, num_samples=calib_samples, seq_len=seq_len, seed=42, field_name="text",
        held_out=HELD_OUT_SAMPLES,
    )  # fmt: skip
    return calib.held_out, calib.spec


def perplexity(folder: str, samples: list[list[int]], device: torch.device) -> float:
    from qerl_cli.modeling.loading import load_policy_model
    from qerl_cli.quantize.report import perplexity as ppl

    model, _ = load_policy_model(folder, dtype=torch.bfloat16, device=device)
    value = ppl(model.eval(), samples, device)
    del model
    return value


def make_row(row: str, source: str, out: Path, args: argparse.Namespace, bf16: str) -> dict[str, Any]:
    fmt, method = row.split("-")
    target = out / row
    start = time.perf_counter()
    if importlib.util.find_spec("llmcompressor") is not None:
        from qerl_cli.config import QuantizeConfig
        from qerl_cli.quantize import run_quantize

        report = run_quantize(
            QuantizeConfig(
                model=source, format=fmt, method=method, calib="qerl-text", calib_field="text",
                num_samples=args.calib_samples, seq_len=args.seq_len, output=str(target), overwrite=True,
                device=args.device,
            )
        )  # fmt: skip
        errors = report.weight_error
        packer = "llm-compressor" if fmt != "nf4" or method == "awq" else "qerl's NF4 packing"
        via = f"qerl quantize ({packer})"
        return {"row": row, "via": via, "folder": str(target),
                "mean_layer_error": errors.mean, "max_layer_error": errors.max,
                "vllm_marlin_refused": len(report.vllm_marlin.refused_layers),
                "seconds": time.perf_counter() - start}  # fmt: skip
    if method != "rtn":
        return {"row": row, "skipped": "llm-compressor is not installed (AWQ needs it)"}
    import shutil

    from transformers import AutoModelForCausalLM

    from qerl_cli.modeling.shapes import marlin_refusals, module_shapes
    from qerl_cli.quantize.native import write_rtn_checkpoint
    from qerl_cli.quantize.report import error_summary, weight_errors
    from qerl_cli.quantize.validate import quantized_linear_names

    shutil.rmtree(target, ignore_errors=True)
    write_rtn_checkpoint(bf16, target, fmt)
    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
    names = quantized_linear_names(model, [])
    reference = {n: m.weight.detach().clone() for n, m in model.named_modules() if n in set(names)}
    refused = marlin_refusals(module_shapes(model, names)) if fmt != "nf4" else []
    del model
    summary = error_summary(weight_errors(target, fmt, reference))
    return {"row": row, "via": "qerl_cli.quantize.native (RTN)", "folder": str(target),
            "mean_layer_error": summary["mean"], "max_layer_error": summary["max"],
            "vllm_marlin_refused": len(refused), "seconds": time.perf_counter() - start}  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Quantization quality: {result['model']}",
        "",
        f"Perplexity on {result['held_out_samples']} held-out rows of qerl-text (never calibrated on); "
        "mean/max relative Frobenius error per quantized layer; vLLM Marlin refusals on GPUs without "
        "native FP4.",
        "",
        "| format | perplexity | vs BF16 | mean layer error | max layer error | Marlin refusals | made by |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = result["bf16_perplexity"]
    lines.append(f"| BF16 | {base:.3f} | - | 0 | 0 | - | {result['source']} |")
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['row']} | - | - | - | - | - | skipped: {r['skipped']} |")
            continue
        lines.append(
            f"| {r['row']} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / base - 1):+.1f}% | "
            f"{r['mean_layer_error']:.4f} | {r['max_layer_error']:.4f} | {r['vllm_marlin_refused']} | "
            f"{r['via']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--out", default="runs/quant_quality")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--calib-samples", type=int, default=SMALL_CALIB_SAMPLES)
    parser.add_argument("--seq-len", type=int, default=SMALL_CALIB_SEQ_LEN)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from qerl_cli.files import atomic_write_text, write_json
    from qerl_cli.modeling.sources import resolve_model_source
    from qerl_cli.torch_utils import device_label, resolve_device

    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bf16 = resolve_model_source(args.model)
    samples, spec = held_out_ids(AutoTokenizer.from_pretrained(bf16), args.calib_samples, args.seq_len)
    result: dict[str, Any] = {
        "model": args.model, "source": bf16, "device": device_label(device), "calibration": spec,
        "held_out_samples": len(samples), "bf16_perplexity": perplexity(bf16, samples, device), "rows": [],
    }  # fmt: skip
    for row in [r.strip() for r in args.rows.split(",") if r.strip()]:
        try:  # one row's failure (e.g. a package missing on a GPU image) must not lose the others
            entry = make_row(row, args.model, out, args, bf16)
            if "skipped" not in entry:
                entry["perplexity"] = perplexity(entry["folder"], samples, device)
        except Exception as exc:  # noqa: BLE001 - recorded in the table, then the next row
            entry = {"row": row, "skipped": f"failed: {type(exc).__name__}: {str(exc)[:200]}"}
        result["rows"].append(entry)
        print(json.dumps(entry), flush=True)
    write_json(out / "quant_quality.json", result)
    text = markdown(result)
    atomic_write_text(out / "quant_quality.md", text)
    print(text)
    made = [r for r in result["rows"] if "skipped" not in r]
    return 0 if made else 1  # a table of skipped rows only is a failed run


if __name__ == "__main__":
    sys.exit(main())

"""``qerl bench quality``: quantize one BF16 model in every format and method asked, then measure how
much of the BF16 model each base keeps (``quality.json`` and ``quality.md``).

Each row ``FORMAT-METHOD`` (``nvfp4-rtn``, ``nvfp4-awq``, ``mxfp4-rtn``, ``nf4-rtn``, ...) is made by
``qerl quantize`` (:func:`qerl_cli.quantize.run_quantize`, calibrated on qerl-text) where its packages
are installed; without llm-compressor an RTN row is written by qerl's own packing code (the same
rounding, :func:`qerl_cli.quantize.native.write_rtn_checkpoint`) and a calibrated row is skipped,
saying why. Every base made is then measured by the library of ``qerl quality``
(:func:`qerl_cli.quantize.quality.measure_quality`): perplexity, KL to BF16 and top-1 agreement on
qerl-text's held-out rows, which no base was calibrated on. Beside them: each base's mean and worst
per-layer weight error and the layers vLLM's Marlin kernels would refuse on GPUs without native FP4.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path
from typing import Any

from qerl_cli.bench.header import report_header, write_report
from qerl_cli.bench.progress import Progress
from qerl_cli.bench.settings import QualitySettings, parse_row, report_settings
from qerl_cli.config import QuantizeConfig
from qerl_cli.files import atomic_write_text
from qerl_cli.modeling.sources import resolve_model_source
from qerl_cli.quantize import run_quantize
from qerl_cli.quantize.native import write_rtn_checkpoint
from qerl_cli.quantize.quality import Candidate, measure_quality
from qerl_cli.quantize.report import QuantizeResult, read_report

SCHEMA = "qerl-bench-quality/1"
REPORT_NAME = "quality.json"


def _native_rtn(bf16: str, target: Path, fmt: str) -> dict[str, Any]:
    """An RTN base by qerl's own writer, with the figures its ``qerl_quant.json`` records."""
    shutil.rmtree(target, ignore_errors=True)
    write_rtn_checkpoint(bf16, target, fmt)
    return {"via": "qerl's own RTN writer (llm-compressor not installed)", **_figures(read_report(target))}


def _figures(result: QuantizeResult) -> dict[str, Any]:
    """The row's weight figures from a base's report (both routes write one)."""
    return {
        "mean_layer_error": result.weight_error.mean,
        "max_layer_error": result.weight_error.max,
        "vllm_marlin_refused": len(result.vllm_marlin.refused_layers),
    }


def make_base(row: str, settings: QualitySettings, bf16: str, target: Path) -> dict[str, Any]:
    """Quantize ``bf16`` as ``row`` into ``target``; the row's record (``skipped`` when it cannot be made)."""
    fmt, method = parse_row(row)
    started = time.perf_counter()
    needs_llmcompressor = fmt != "nf4" or method != "rtn"
    if needs_llmcompressor and importlib.util.find_spec("llmcompressor") is None:
        if method != "rtn":
            return {"row": row, "skipped": f"llm-compressor is not installed ({method} needs it)"}
        record = _native_rtn(bf16, target, fmt)
    else:
        result = run_quantize(
            QuantizeConfig(
                model=bf16,
                format=fmt,
                method=method,
                calib="qerl-text",
                calib_field="text",  # type: ignore[arg-type]
                num_samples=settings.calib_samples,
                seq_len=settings.seq_len,
                output=str(target),
                overwrite=True,
                device=settings.device,
            )
        )
        record = {"via": f"qerl quantize --method {method}", **_figures(result)}
    return {"row": row, "folder": str(target), **record, "seconds": time.perf_counter() - started}


def run_quality(settings: QualitySettings, *, command: str) -> dict[str, Any]:
    """Make every row's base under ``settings.output``, measure them all, write ``quality.json`` / ``.md``."""

    for row in settings.rows:
        parse_row(row)  # every row checked before the first is made
    out = Path(settings.output)
    out.mkdir(parents=True, exist_ok=True)  # the bases are written inside it
    bf16 = str(resolve_model_source(settings.model))
    report: dict[str, Any] = {
        **report_header(SCHEMA, command),
        "settings": report_settings(settings),
        "source": bf16,
        "quality": None,
        "rows": [],
    }
    progress = Progress("bench quality", len(settings.rows) + 1)  # each base, then the measurement
    for row in settings.rows:
        progress.start(f"make {row}")
        try:  # one row's failure (e.g. a package missing on a GPU image) must not lose the others
            entry = make_base(row, settings, bf16, out / row)
        except Exception as exc:  # noqa: BLE001 - recorded in the table, then the next row
            entry = {"row": row, "skipped": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}
        progress.finish(f"make {row}", entry.get("skipped", "done"))
        report["rows"].append(entry)
        write_report(out / REPORT_NAME, report)
    made = [r for r in report["rows"] if "skipped" not in r]
    progress.start(f"measure {len(made)} base(s) against BF16")
    if made:
        quality = measure_quality(
            bf16,
            [Candidate(r["row"], r["folder"]) for r in made],
            device=settings.device,
            rows=settings.heldout_rows,
            seq_len=settings.seq_len,
        )
        report["quality"] = {k: v for k, v in quality.to_dict().items() if k != "rows"}
        for entry, measured in zip(made, quality.rows, strict=True):
            entry.update(
                perplexity=measured.perplexity,
                kl_to_bf16=measured.kl_to_reference,
                top1_agreement=measured.top1_agreement,
            )
    progress.finish(f"measure {len(made)} base(s) against BF16")
    write_report(out / REPORT_NAME, report)
    atomic_write_text(out / "quality.md", quality_markdown(report))
    return report


def quality_markdown(report: dict[str, Any]) -> str:
    quality = report["quality"] or {}
    base = quality.get("reference_perplexity")
    text = quality.get("text", {})
    lines = [
        f"# Quantization quality: {report['settings']['model']}",
        "",
        f"On {text.get('rows', 0)} held-out rows of qerl-text ({text.get('tokens', 0)} tokens, never "
        f"calibrated on), {report['device']}, {report['created']}: perplexity, KL to BF16 (nats/token), "
        "top-1 agreement; mean/max relative Frobenius error per quantized layer; vLLM Marlin refusals on "
        "GPUs without native FP4.",
        "",
        "| base | perplexity | vs BF16 | KL to BF16 | top-1 agree | mean layer error | max layer error "
        "| Marlin refusals | made by |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| BF16 | {base:.3f} | - | 0 | 1 | 0 | 0 | - | {report['source']} |" if base else "| BF16 | - |",
    ]
    for r in report["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['row']} | - | - | - | - | - | - | - | skipped: {r['skipped']} |")
            continue
        change = f"{100 * (r['perplexity'] / base - 1):+.1f}%" if base else "-"
        figures = [
            f"{r['perplexity']:.3f}",
            change,
            f"{r['kl_to_bf16']:.4f}",
            f"{r['top1_agreement']:.3f}",
            f"{r['mean_layer_error']:.4f}",
            f"{r['max_layer_error']:.4f}",
            str(r["vllm_marlin_refused"]),
        ]
        lines.append(f"| {r['row']} | " + " | ".join(figures) + f" | {r['via']} |")
    return "\n".join(lines) + "\n"

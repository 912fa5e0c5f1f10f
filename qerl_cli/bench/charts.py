"""PNG charts of a bench report: throughput per batch, memory, e2e phases (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qerl_cli.bench.labels import e2e_label, format_label, lora_label
from qerl_cli.bench.report import E2E_PHASES
from qerl_cli.bench.result import BenchResult


def _save(plt: Any, fig: Any, ax: Any, ylabel: str, title: str, path: Path) -> Path:
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def throughput_series(rows: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """The throughput chart's bars: ``{"nvfp4 / merged LoRA r16": {batch: tok/s}}``, one series per format,
    linear backend and LoRA rank (a sweep measures one format on several backends), LoRA-less first."""
    keys = sorted({(r["lora_rank"], format_label(r)) for r in rows})
    series: dict[str, dict[int, float]] = {f"{label} LoRA {lora_label(rank)}": {} for rank, label in keys}
    for r in rows:
        series[f"{format_label(r)} LoRA {lora_label(r['lora_rank'])}"][r["batch"]] = r["output_tokens_per_s"]
    return series


def write_charts(report: BenchResult, out_dir: str | Path) -> list[Path]:
    """PNG charts (throughput per batch, memory, e2e phases); none when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: CI runners and SSH sessions have no display
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = Path(out_dir)
    written: list[Path] = []
    suffix = " (CPU figures)" if report.device == "cpu" else ""

    if report.rollout:
        series = throughput_series(report.rollout)
        batches = sorted({r["batch"] for r in report.rollout})
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / len(series)
        for i, (label, by_batch) in enumerate(series.items()):
            xs = [b_i + i * width for b_i in range(len(batches))]
            ax.bar(xs, [by_batch.get(b, 0.0) for b in batches], width, label=label)
        ax.set_xticks([b_i + 0.4 - width / 2 for b_i in range(len(batches))], [f"batch {b}" for b in batches])
        title = "Rollout throughput" + suffix
        written.append(_save(plt, fig, ax, "output tokens/s", title, out / "throughput.png"))

    if report.memory:
        rows = report.memory
        labels = [f"{format_label(r)}\n{lora_label(r['lora_rank'])}" for r in rows]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        xs = range(len(rows))
        bars = ((-0.2, "weight_bytes", "weights"), (0.2, "peak_allocated_bytes", "peak allocated"))
        for offset, metric, name in bars:
            ax.bar([x + offset for x in xs], [(r.get(metric) or 0) / 1e9 for r in rows], 0.4, label=name)
        ax.set_xticks(list(xs), labels)
        written.append(_save(plt, fig, ax, "GB", "Memory" + suffix, out / "memory.png"))

    e2e_ok = [r for r in report.e2e or [] if "error" not in r]
    if e2e_ok:
        rows = e2e_ok
        fig, ax = plt.subplots(figsize=(8, 4.5))
        bottoms = [0.0] * len(rows)
        for phase in E2E_PHASES:
            heights = [r.get(phase) or 0.0 for r in rows]
            ax.bar([e2e_label(r) for r in rows], heights, bottom=bottoms, label=phase.removesuffix("_s"))
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        title = "End-to-end step" + suffix
        written.append(_save(plt, fig, ax, "seconds per GRPO step", title, out / "e2e.png"))

    roofline = [r for r in report.rollout if r.get("roofline")]
    if roofline and report.settings.get("concurrency"):
        written.append(_roofline_chart(plt, roofline, report, out / "roofline.png"))
    return written


def _roofline_chart(plt: Any, rows: list[dict[str, Any]], report: BenchResult, path: Path) -> Path:
    """Tokens/s against concurrency per format x backend (LoRA rows when measured), each with its
    roofline bound dashed in the same colour."""
    with_lora = [r for r in rows if r["lora_rank"]] or rows
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label in sorted({format_label(r) for r in with_lora}):
        series = sorted((r for r in with_lora if format_label(r) == label), key=lambda r: r["batch"])
        xs = [r["batch"] for r in series]
        (line,) = ax.plot(xs, [r["output_tokens_per_s"] for r in series], marker="o", label=label)
        ax.plot(xs, [r["roofline"]["bound_tokens_per_s"] for r in series], linestyle="--",
                color=line.get_color(), alpha=0.6)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences")
    gpu = (report.gpu or {}).get("name", "GPU")
    lora = f", LoRA r{with_lora[0]['lora_rank']}" if with_lora[0]["lora_rank"] else ""
    title = f"Rollout vs roofline (dashed) on {gpu}{lora}"
    return _save(plt, fig, ax, "output tokens/s", title, path)

"""What a quantization run produced: ``qerl_quant.json`` and the closing rich table.

Weight errors are measured on what was *saved*: every packed layer is read back from the output's
safetensors, dequantized with ``qerl_cli.formats`` (the same code QuantLinear uses) and compared to
the BF16 weight that was rounded. For ``--method awq`` that reference is the AWQ-smoothed weight:
smoothing is an exact reparametrisation of the network (the inverse scale sits in the preceding norm
or linear), so the difference isolates the 4-bit rounding; ``--eval-ppl`` measures the end-to-end
effect against the untouched BF16 model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from qerl_cli.envinfo import versions_of
from qerl_cli.files import write_json

REPORT_NAME = "qerl_quant.json"
WORST_LAYERS = 5
VERSIONED_PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "bitsandbytes", "torch")


def package_versions() -> dict[str, str | None]:
    return versions_of(VERSIONED_PACKAGES)


def folder_bytes(path: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in path.rglob(pattern) if p.is_file())


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's tensors as held in memory (BF16 before quantization); shared ones once."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def _saved_tensor_index(out_dir: Path) -> dict[str, Path]:
    from safetensors import safe_open

    index: dict[str, Path] = {}
    for file in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            index.update(dict.fromkeys(handle.keys(), file))
    return index


@torch.no_grad()
def weight_errors(
    out_dir: Path, fmt_name: str, reference: dict[str, torch.Tensor], device: torch.device | str = "cpu"
) -> dict[str, float]:
    """Relative Frobenius error ||deq(saved) - W|| / ||W|| of every quantized layer, by layer name."""
    from safetensors import safe_open

    from qerl_cli import formats

    fmt = formats.get(fmt_name)
    index = _saved_tensor_index(out_dir)
    errors: dict[str, float] = {}
    for layer, weight in reference.items():
        names = [n for n in fmt.checkpoint_names() if f"{layer}.{n}" in index]
        if not names:
            raise RuntimeError(f"saved checkpoint in {out_dir} has no {fmt_name} tensors for layer {layer}")
        tensors = {}
        for name in names:
            with safe_open(str(index[f"{layer}.{name}"]), framework="pt", device=str(device)) as handle:
                tensors[name] = handle.get_tensor(f"{layer}.{name}")
        dense = fmt.dequantize(tensors, torch.float32)
        ref = weight.to(device=device, dtype=torch.float32)
        errors[layer] = float((dense - ref).norm() / ref.norm().clamp(min=1e-30))
    return errors


def error_summary(errors: dict[str, float]) -> dict[str, Any]:
    if not errors:
        return {"layers": 0, "mean": None, "max": None, "worst_layers": []}
    worst = sorted(errors.items(), key=lambda item: item[1], reverse=True)[:WORST_LAYERS]
    return {
        "layers": len(errors),
        "mean": sum(errors.values()) / len(errors),
        "max": worst[0][1],
        "worst_layers": [{"layer": name, "relative_error": value} for name, value in worst],
    }


@torch.no_grad()
def perplexity(model: torch.nn.Module, samples: list[list[int]], device: torch.device | str) -> float:
    """Token-level perplexity of ``model`` on ``samples`` (one sequence per forward)."""
    total_nll, total_tokens = 0.0, 0
    for ids in samples:
        if len(ids) < 2:
            continue
        input_ids = torch.tensor([ids], device=device)
        logits = model(input_ids=input_ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, input_ids[0, 1:], reduction="sum")
        total_nll += float(nll)
        total_tokens += len(ids) - 1
    if total_tokens == 0:
        raise ValueError("perplexity needs held-out samples of at least two tokens")
    return math.exp(total_nll / total_tokens)


def write_report(out_dir: Path, report: dict[str, Any]) -> Path:
    return write_json(out_dir / REPORT_NAME, report)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def quantize_table(report: dict[str, Any]):  # -> rich.table.Table
    """BF16 vs 4-bit: size, weight error, perplexity and time, for the CLI to print."""
    from rich.table import Table

    fmt = str(report.get("format", "4-bit")).upper()
    table = Table(title=f"qerl quantize: {report.get('model')} -> {fmt} ({report.get('method')})")
    table.add_column("")
    table.add_column("BF16", justify="right")
    table.add_column(fmt, justify="right")
    size = report.get("size", {})
    bf16, quant = size.get("bf16_bytes"), size.get("weights_bytes")
    ratio = f" ({bf16 / quant:.1f}x smaller)" if bf16 and quant else ""
    table.add_row("weights size", _gib(bf16), _gib(quant) + ratio)
    errors = report.get("weight_error", {})
    if errors.get("layers"):
        table.add_row("rel. weight error mean / max", "0", f"{errors['mean']:.4f} / {errors['max']:.4f}")
        table.add_row("worst layer", "", errors["worst_layers"][0]["layer"])
    ppl = report.get("perplexity")
    if ppl:
        table.add_row(
            f"perplexity ({ppl['samples']} held-out)", f"{ppl['bf16']:.3f}", f"{ppl['quantized']:.3f}"
        )
    table.add_row(
        "layers quantized / kept BF16",
        "",
        f"{errors.get('layers', 0)} / {len(report.get('skipped_layers', []))}",
    )
    refused = (report.get("vllm_marlin") or {}).get("refused_layers") or []
    if refused:
        table.add_row(
            "vLLM Marlin (capability < 10) refuses", "", f"{len(refused)} fused layers, e.g. {refused[0]}"
        )
    table.add_row("time", "", f"{report.get('elapsed_s', 0):.1f} s")
    table.caption = f"saved to {report.get('output')}"
    return table

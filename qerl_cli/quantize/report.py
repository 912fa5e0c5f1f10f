"""What a quantization run produced: :class:`QuantizeResult` (``qerl_quant.json``) and the closing
rich table.

Weight errors are measured on what was *saved*: every packed layer is read back from the output's
safetensors, dequantized with ``qerl_cli.formats`` (the same code QuantLinear uses) and compared to
the BF16 weight that was rounded. For ``--method awq`` that reference is the AWQ-smoothed weight:
smoothing is an exact reparametrisation of the network (the inverse scale sits in the preceding norm
or linear), so the difference isolates the 4-bit rounding; ``--eval-ppl`` measures the end-to-end
effect against the untouched BF16 model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from safetensors import safe_open

from qerl_cli import formats
from qerl_cli.files import write_json
from qerl_cli.modeling.error_init import LoraInitInfo
from qerl_cli.modeling.loading import QUANT_RECORD
from qerl_cli.modeling.sources import weights_fingerprint

REPORT_NAME = QUANT_RECORD  # beside the checkpoint; its name lives with the loader that reads it
WORST_LAYERS = 5
# qerl_quant.json's "versions", in its order
VERSIONED_PACKAGES = ("llmcompressor", "compressed-tensors", "transformers", "bitsandbytes", "torch")


def folder_bytes(path: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in path.rglob(pattern) if p.is_file())


def weights_bytes(path: Path) -> int:
    """The model's own weights: the top-level ``*.safetensors`` shards. Not a search of subfolders, where
    ``--lora-init`` writes its adapter (``lora_init/adapter_model.safetensors``), recorded on its own."""
    return sum(p.stat().st_size for p in path.glob("*.safetensors") if p.is_file())


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


# --------------------------------------------------------------------------------------------
# The typed result (what run_quantize returns and qerl_quant.json holds)
# --------------------------------------------------------------------------------------------
# qerl_quant.json is read by other tools (and ``qerl compare`` labels its bases from it): ``to_dict``
# writes exactly its keys, in their order; ``from_dict`` also reads files of earlier versions.


@dataclass
class SizeReport:
    bf16_bytes: int  # the model's tensors in memory before quantization
    weights_bytes: int  # the output's top-level *.safetensors: the model, not the lora_init adapter
    folder_bytes: int  # the whole output folder

    def to_dict(self) -> dict[str, Any]:
        return {"bf16_bytes": self.bf16_bytes, "weights_bytes": self.weights_bytes,
                "folder_bytes": self.folder_bytes}  # fmt: skip


@dataclass
class LayerError:
    layer: str
    relative_error: float


@dataclass
class WeightError:
    """Relative Frobenius error of every quantized layer as saved, and a summary of them."""

    reference: str  # what the saved weights were compared with
    layers: int
    mean: float | None  # None: no layer quantized
    max: float | None
    worst_layers: list[LayerError] = field(default_factory=list)  # the WORST_LAYERS largest, largest first
    per_layer: dict[str, float] = field(default_factory=dict)

    @classmethod
    def measured(cls, reference: str, errors: dict[str, float]) -> WeightError:
        summary = error_summary(errors)
        worst = [LayerError(w["layer"], w["relative_error"]) for w in summary["worst_layers"]]
        return cls(reference, summary["layers"], summary["mean"], summary["max"], worst, errors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "layers": self.layers,
            "mean": self.mean,
            "max": self.max,
            "worst_layers": [
                {"layer": w.layer, "relative_error": w.relative_error} for w in self.worst_layers
            ],
            "per_layer": dict(self.per_layer),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeightError:
        worst = [LayerError(w["layer"], w["relative_error"]) for w in data.get("worst_layers") or []]
        return cls(data.get("reference", ""), data["layers"], data.get("mean"), data.get("max"), worst,
                   dict(data.get("per_layer") or {}))  # fmt: skip


@dataclass
class Perplexity:
    """``--eval-ppl``: token perplexity on held-out calibration samples, BF16 and 4-bit."""

    samples: int
    bf16: float
    quantized: float


MARLIN_APPLIES_TO = "vLLM on GPUs without native FP4 (compute capability < 10.0)"


@dataclass
class MarlinRefusals:
    """Layers vLLM's Marlin FP4 kernels (GPUs without native FP4) refuse, named before any GPU run."""

    applies_to: str
    refused_layers: list[str]


@dataclass
class QuantizeTimings:
    load: float  # seconds from the start until the BF16 model was loaded and checked
    quantize_and_save: float


@dataclass
class SourceRecord:
    """The BF16 model a 4-bit checkpoint was made from, as ``qerl compare`` checks a base it made before
    against the model it would make it from now (a changed ``model.path`` must not reuse a stale base)."""

    path: str  # the source's folder, resolved (a converted GGUF's: the converted folder); or its hub id
    weights: str | None  # modeling.sources.weights_fingerprint of that folder; None for a hub id

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "weights": self.weights}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SourceRecord:
        return cls(str(data.get("path", "")), data.get("weights"))


def source_record(ref: str | Path) -> SourceRecord:
    """The :class:`SourceRecord` of ``ref``, a model folder (a GGUF already converted: its folder) or a
    hub id; cheap (no weights read), so compare computes it on every invocation."""
    folder = Path(ref).expanduser()
    if (folder / "config.json").is_file():
        folder = folder.resolve()
        return SourceRecord(str(folder), weights_fingerprint(folder))
    return SourceRecord(str(ref), None)


@dataclass
class QuantizeResult:
    """One ``qerl quantize`` run: what was made, how, and how far the 4-bit weights are from BF16."""

    model: str
    output: str
    format: str
    method: str
    rounding: str  # how the weights were rounded, in words
    calibration: dict[str, Any] | None  # the calibration set's record (AWQ only)
    ignored_layers: list[str]  # left in BF16 by design (lm_head)
    skipped_layers: list[str]  # left in BF16 because the format cannot tile them (--skip-incompatible)
    versions: dict[str, str | None]
    size: SizeReport
    weight_error: WeightError
    perplexity: Perplexity | None
    vllm_marlin: MarlinRefusals
    device: str
    peak_gpu_bytes: int | None  # None on the CPU
    timings_s: QuantizeTimings
    elapsed_s: float
    # --lora-init: the error-compensating LoRA start written to lora_init/. Written to the file only
    # when made, so reports without one keep their exact keys.
    lora_init: LoraInitInfo | None = None
    # The model it was made from (resolved, with its weights' fingerprint), written by qerl >= this field;
    # an older file has only ``model``, as given.
    source: SourceRecord | None = None

    def to_dict(self) -> dict[str, Any]:
        ppl = self.perplexity
        data = {
            "model": self.model,
            "output": self.output,
            "format": self.format,
            "method": self.method,
            "rounding": self.rounding,
            "calibration": self.calibration,
            "ignored_layers": list(self.ignored_layers),
            "skipped_layers": list(self.skipped_layers),
            "versions": dict(self.versions),
            "size": self.size.to_dict(),
            "weight_error": self.weight_error.to_dict(),
            "perplexity": None
            if ppl is None
            else {"samples": ppl.samples, "bf16": ppl.bf16, "quantized": ppl.quantized},  # fmt: skip
            "vllm_marlin": {
                "applies_to": self.vllm_marlin.applies_to,
                "refused_layers": list(self.vllm_marlin.refused_layers),
            },  # fmt: skip
            "device": self.device,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "timings_s": {"load": self.timings_s.load, "quantize_and_save": self.timings_s.quantize_and_save},
            "elapsed_s": self.elapsed_s,
        }
        if self.lora_init is not None:
            data["lora_init"] = self.lora_init.to_dict()
        if self.source is not None:
            data["source"] = self.source.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizeResult:
        size, ppl = data["size"], data.get("perplexity")
        marlin, timings = data.get("vllm_marlin") or {}, data.get("timings_s") or {}  # older files lack them
        return cls(
            model=data["model"],
            output=data["output"],
            format=data["format"],
            method=data["method"],
            rounding=data.get("rounding", ""),
            calibration=data.get("calibration"),
            ignored_layers=list(data.get("ignored_layers") or []),
            skipped_layers=list(data.get("skipped_layers") or []),
            versions=dict(data.get("versions") or {}),
            size=SizeReport(size["bf16_bytes"], size["weights_bytes"], size["folder_bytes"]),
            weight_error=WeightError.from_dict(data["weight_error"]),
            perplexity=None if ppl is None else Perplexity(ppl["samples"], ppl["bf16"], ppl["quantized"]),
            vllm_marlin=MarlinRefusals(
                marlin.get("applies_to", ""), list(marlin.get("refused_layers") or [])
            ),
            device=data.get("device", ""),
            peak_gpu_bytes=data.get("peak_gpu_bytes"),
            timings_s=QuantizeTimings(timings.get("load", 0.0), timings.get("quantize_and_save", 0.0)),
            elapsed_s=data.get("elapsed_s", 0.0),
            lora_init=LoraInitInfo.from_dict(data["lora_init"]) if data.get("lora_init") else None,
            source=SourceRecord.from_dict(data["source"]) if data.get("source") else None,
        )


def write_report(out_dir: Path, result: QuantizeResult) -> Path:
    return write_json(out_dir / REPORT_NAME, result.to_dict())


def read_report(folder: str | Path) -> QuantizeResult:
    """The ``qerl_quant.json`` of a quantized folder."""
    return QuantizeResult.from_dict(json.loads((Path(folder) / REPORT_NAME).read_text()))


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def quantize_table(result: QuantizeResult):  # -> rich.table.Table
    """BF16 vs 4-bit: size, weight error, perplexity and time, for the CLI to print."""

    fmt = result.format.upper()
    table = Table(title=f"qerl quantize: {result.model} -> {fmt} ({result.method})")
    table.add_column("")
    table.add_column("BF16", justify="right")
    table.add_column(fmt, justify="right")
    bf16, quant = result.size.bf16_bytes, result.size.weights_bytes
    ratio = f" ({bf16 / quant:.1f}x smaller)" if bf16 and quant else ""
    table.add_row("weights size", _gib(bf16), _gib(quant) + ratio)
    errors = result.weight_error
    if errors.layers:
        table.add_row("rel. weight error mean / max", "0", f"{errors.mean:.4f} / {errors.max:.4f}")
        table.add_row("worst layer", "", errors.worst_layers[0].layer)
    ppl = result.perplexity
    if ppl:
        table.add_row(f"perplexity ({ppl.samples} held-out)", f"{ppl.bf16:.3f}", f"{ppl.quantized:.3f}")
    table.add_row("layers quantized / kept BF16", "", f"{errors.layers} / {len(result.skipped_layers)}")
    refused = result.vllm_marlin.refused_layers
    if refused:
        table.add_row(
            "vLLM Marlin (capability < 10) refuses", "", f"{len(refused)} fused layers, e.g. {refused[0]}"
        )
    init = result.lora_init
    if init is not None:
        table.add_row(
            f"act.-weighted error, + LoRA init ({init.method} r{init.rank})",
            "",
            f"{init.relative_error_base:.4f} -> {init.relative_error_corrected:.4f}",
        )
        # Apart from the weights size: the adapter is float32 factors, not part of the 4-bit model.
        table.add_row("LoRA init adapter size", "", _gib(init.weights_bytes))
    table.add_row("time", "", f"{result.elapsed_s:.1f} s")
    table.caption = f"saved to {result.output}"
    return table

"""``qerl bench kernels``: what the packed 4-bit weights cost the update, per format (``kernels.json``).

* ``dequant``: dequantizing the model's widest projection (the MLP's ``intermediate x hidden``): time,
  bytes moved per second and that as a share of a device-to-device copy (the practical ceiling of a
  dequantization kernel), and whether the kernel (Triton on a GPU, torch on the CPU) is bit-exact
  against the format's torch reference;
* ``memory``: the model loaded as the trainer loads it (:class:`~qerl_cli.modeling.quant_linear.QuantLinear`
  layers, packed at rest): bytes of its tensors, of the packed linears, and of the same model in BF16;
  on a GPU also the memory allocated by loading it and the peak while loading;
* ``layer``: forward + input-gradient backward (a frozen base, as under LoRA) of the first decoder layer
  on ``batch x seq_len`` tokens, 4-bit against the same layer holding the dequantized weights densely,
  timed in interleaved rounds so clocks and temperature affect both alike;
* ``gemm`` (on a CUDA GPU, when ``nvfp4`` is among the formats): the decode step's linears of the 7B
  and 32B shapes at 8-256 tokens, cuBLAS BF16, FP8 W8A8, vLLM's Marlin NVFP4 (with vLLM installed) and
  qerl's NVFP4 GEMM, each with and without a rank-16 adapter, against the HBM and tensor-core bounds
  (:mod:`qerl_cli.bench.gemm`).

Each section records its error and the others still run; the CLI exits 1 when one failed.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Group
from rich.table import Table

from qerl_cli import formats
from qerl_cli.bench import gemm
from qerl_cli.bench.gemm import gemm_table
from qerl_cli.bench.header import report_header, write_report
from qerl_cli.bench.models import model_config, prepare_checkpoints
from qerl_cli.bench.settings import KernelsSettings
from qerl_cli.kernels import dequantize, use_triton_for
from qerl_cli.modeling.loading import load_policy_model
from qerl_cli.modeling.quant_linear import QuantLinear, packed_nbytes
from qerl_cli.torch_utils import resolve_device

SCHEMA = "qerl-bench-kernels/1"
REPORT_NAME = "kernels.json"
ROUNDS = 3  # interleaved rounds of the layer timing; the median round is reported


def timed_ms(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn``: CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def copy_gbps(device: torch.device, nbytes: int, iters: int) -> float:
    """Bytes read + written per second by a plain copy, in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device, iters)
    return 2 * nbytes / (ms / 1e3) / 1e9


def measure_dequant(
    fmt_name: str, shape: tuple[int, int], device: torch.device, iters: int, copy_rate: float
) -> dict[str, Any]:
    out_features, in_features = shape
    fmt = formats.get(fmt_name)
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    buffers = fmt.to_buffers(fmt.quantize(weight))
    reference = fmt.dequantize_buffers(buffers, out_features, in_features, torch.bfloat16)
    got = dequantize(fmt, buffers, out_features, in_features, torch.bfloat16)
    ms = timed_ms(lambda: dequantize(fmt, buffers, out_features, in_features, torch.bfloat16), device, iters)
    moved = sum(b.numel() * b.element_size() for b in buffers.values()) + weight.numel() * 2
    rate = moved / (ms / 1e3) / 1e9
    return {
        "format": fmt_name,
        "kernel": "triton" if use_triton_for(buffers["weight_packed"]) else "torch",
        "out_features": out_features,
        "in_features": in_features,
        "ms": ms,
        "bytes_moved": moved,
        "GBps": rate,
        "of_copy": rate / copy_rate,
        "bit_exact": bool(torch.equal(reference, got)),
    }


def _tensor_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *(b for b in model.buffers() if b is not None)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _bf16_equivalent_bytes(model: torch.nn.Module) -> int:
    dense = sum(p.numel() for p in model.parameters())
    packed = sum(m.in_features * m.out_features for m in model.modules() if hasattr(m, "packed_buffers"))
    return 2 * (dense + packed)


def load_measured(folder: Path, fmt: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, dict]:
    """The model as the trainer loads it, and the ``memory`` row of ``fmt``."""

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    began = time.perf_counter()
    model, detected = load_policy_model(folder, dtype=dtype, device=device)
    if cuda:
        torch.cuda.synchronize()
    row = {
        "format": fmt,
        "detected_format": detected,
        "load_s": time.perf_counter() - began,
        "weights_bytes": _tensor_bytes(model),
        "packed_linear_bytes": packed_nbytes(model),
        "bf16_equivalent_bytes": _bf16_equivalent_bytes(model),
        "gpu_allocated_bytes": torch.cuda.memory_allocated() - before if cuda else None,
        "gpu_load_peak_bytes": torch.cuda.max_memory_allocated() - before if cuda else None,
    }
    return model, row


def measure_layer(
    model: Any, fmt: str, device: torch.device, dtype: torch.dtype, batch: int, seq_len: int, iters: int
) -> dict[str, Any]:
    """The first decoder layer's forward + input-gradient backward, 4-bit against dense."""

    config = model.config
    quant_layer = model.model.layers[0]
    dense_layer = type(quant_layer)(config, 0).to(device=device, dtype=dtype)
    with torch.no_grad():  # the same values in both: the dense layer holds the dequantized weights
        for name, module in quant_layer.named_modules():
            target = dense_layer.get_submodule(name) if name else dense_layer
            if isinstance(module, QuantLinear):
                target.weight.copy_(module.dequantized_weight(dtype))
                if module.bias is not None:
                    target.bias.copy_(module.bias)
            elif isinstance(getattr(module, "weight", None), torch.nn.Parameter):
                target.weight.copy_(module.weight)
    for param in dense_layer.parameters():
        param.requires_grad_(False)  # frozen base: only the input gradient is computed
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, dtype=dtype, generator=gen)
    grad_out = torch.randn_like(hidden)
    position_ids = torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, -1)
    position_embeddings = model.model.rotary_emb(hidden, position_ids)

    def forward(layer: Any, x: torch.Tensor) -> torch.Tensor:
        out = layer(x, position_embeddings=position_embeddings, position_ids=position_ids)
        return out[0] if isinstance(out, tuple) else out

    def step(layer: Any) -> Callable[[], None]:
        def run() -> None:
            forward(layer, hidden.detach().requires_grad_(True)).backward(grad_out)

        return run

    with torch.no_grad():  # the same weights must give the same output before the timing means anything
        diff = float(
            (forward(quant_layer, hidden).float() - forward(dense_layer, hidden).float()).abs().max()
        )
    rounds = [
        (timed_ms(step(quant_layer), device, iters), timed_ms(step(dense_layer), device, iters))
        for _ in range(ROUNDS)
    ]
    quant_ms = statistics.median(r[0] for r in rounds)
    dense_ms = statistics.median(r[1] for r in rounds)
    return {
        "format": fmt,
        "tokens": batch * seq_len,
        "ms": quant_ms,
        "dense_ms": dense_ms,
        "ratio": quant_ms / dense_ms,
        "max_abs_diff": diff,
    }


def _new_report(settings: KernelsSettings, command: str, dtype: torch.dtype, shape: tuple[int, int],
                gemm_settings: Any) -> dict[str, Any]:  # fmt: skip
    """``kernels.json`` before any figure: the header, the settings and an empty section each."""

    return {
        **report_header(SCHEMA, command),
        "settings": {
            "model": settings.model,
            "formats": settings.formats,
            "batch": settings.batch,
            "seq_len": settings.seq_len,
            "iters": settings.iters,
            "layer_dtype": str(dtype).removeprefix("torch."),
            "dequant_shape": list(shape),
            **(gemm_settings or gemm.GemmSettings()).to_dict(),
        },
        "copy_GBps": None,
        "dequant": [],
        "memory": [],
        "layer": [],
        **gemm.empty_sections(),
        "errors": [],
    }


def run_kernels(
    settings: KernelsSettings, *, command: str, seed: int = 0, gemm_settings: Any = None
) -> dict[str, Any]:
    """Every section for every 4-bit format of ``settings.formats`` (``settings.model`` a SHAPE or a
    folder, resolved); writes ``kernels.json`` into ``settings.output`` and returns it.
    ``gemm_settings``: a :class:`qerl_cli.bench.gemm.GemmSettings` (None: its defaults)."""

    torch_device = resolve_device(settings.device)
    cuda = torch_device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # float32: the CPU's fast path for the layer
    folders = prepare_checkpoints(str(settings.model), settings.formats, seed)
    config = model_config(next(iter(folders.values())))
    shape = (config["intermediate_size"], config["hidden_size"])
    report = _new_report(settings, command, dtype, shape, gemm_settings)
    formats, batch, seq_len, iters = settings.formats, settings.batch, settings.seq_len, settings.iters
    path = Path(settings.output) / REPORT_NAME

    def attempt(section: str, fmt: str | None, work: Callable[..., Any], *args: Any) -> Any:
        try:
            return work(*args)
        except Exception as exc:  # noqa: BLE001 - recorded; the other sections still run
            report["errors"].append(
                {
                    "section": section,
                    "format": fmt,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-2000:],
                }
            )
            return None
        finally:
            write_report(path, report)  # after every section: a run cut short keeps what it measured

    report["copy_GBps"] = attempt("copy", None, copy_gbps, torch_device, 2**31 if cuda else 2**26, iters)
    for fmt in formats:
        if fmt != "bf16":
            row = attempt(
                "dequant", fmt, measure_dequant, fmt, shape, torch_device, iters, report["copy_GBps"]
            )
            report["dequant"] += [row] if row else []
    for fmt, folder in folders.items():
        loaded = attempt("memory", fmt, load_measured, folder, fmt, torch_device, dtype)
        if loaded is None:
            continue
        loaded_model, row = loaded
        report["memory"].append(row)
        if fmt != "bf16":
            layer = attempt(
                "layer", fmt, measure_layer, loaded_model, fmt, torch_device, dtype, batch, seq_len, iters
            )
            report["layer"] += [layer] if layer else []
        del loaded_model
        if cuda:
            torch.cuda.empty_cache()
    attempt("gemm", "nvfp4", gemm.gemm_section, report, lambda: write_report(path, report), cuda)
    write_report(path, report)
    return report


def kernels_table(report: dict[str, Any]):  # -> a rich renderable: the formats' table (and the GEMMs')
    table = Table(title=f"4-bit kernels on {report['device']} ({report['settings']['model']})")
    for name in (
        "format",
        "dequant GB/s",
        "of copy",
        "bit-exact",
        "weights",
        "of BF16",
        "layer fwd+bwd",
        "vs dense",
    ):
        table.add_column(name)
    by_format: dict[str, dict[str, Any]] = {}
    for section in ("dequant", "memory", "layer"):
        for row in report[section]:
            by_format.setdefault(row["format"], {})[section] = row
    for fmt, rows in by_format.items():
        deq, mem, layer = rows.get("dequant"), rows.get("memory"), rows.get("layer")
        table.add_row(
            fmt,
            f"{deq['GBps']:.1f}" if deq else "-",
            f"{deq['of_copy']:.0%}" if deq else "-",
            str(deq["bit_exact"]) if deq else "-",
            f"{mem['weights_bytes'] / 2**20:.1f} MiB" if mem else "-",
            f"{mem['weights_bytes'] / mem['bf16_equivalent_bytes']:.0%}" if mem else "-",
            f"{layer['ms']:.2f} ms" if layer else "-",
            f"{layer['ratio']:.2f}x" if layer else "-",
        )
    if report.get("gemm"):
        return Group(table, gemm_table(report["gemm"], report["device"]))
    return table

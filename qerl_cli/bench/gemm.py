"""``qerl bench kernels``' ``gemm`` section: one linear of a model's decode step, per weight format and
GEMM kernel, at a few dozen to a few hundred tokens, with and without one LoRA adapter.

Backends (each row says which):

* ``bf16``: cuBLAS on the BF16 weight (``F.linear``);
* ``fp8``: W8A8, the activations rounded per row by qerl's FP8 kernel, then ``torch._scaled_mm`` on the
  per-channel E4M3 weight (``modeling.fp8_update.fp8_mm``);
* ``marlin``: vLLM's Marlin NVFP4 kernel on the same NVFP4 weight (only when vLLM is importable);
* ``qerl-nvfp4``: :mod:`qerl_cli.kernels.nvfp4_gemm`, the LoRA fused into it.

With an adapter, the first three add it the way an unfused engine does: ``x @ A^T`` and ``y += s * xa @
B^T`` as two more GEMMs (cuBLAS). The linears are the ones vLLM runs, projections fused as it fuses them
(``qkv``, ``o``, ``gate_up``, ``down``), with random weights (speed does not depend on the values).

Timing: every call of one figure reads a different copy of the weights (together over 4x the L2
cache), captured in one CUDA graph replayed many times, so the weights come from HBM as in a decode
step and launch overhead is not counted. Each row reports the time, TFLOP/s, the share of the HBM bound
(bytes read -- the weight in its format, the activations, the adapter -- over the bandwidth) and of the
tensor-core peak (BF16's; FP8's for ``fp8``) of :mod:`qerl_cli.bench.roofline`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import torch
from rich.table import Table

from qerl_cli import formats
from qerl_cli.bench.gemm_settings import BACKENDS, GemmSettings  # noqa: F401 - GemmSettings: kernels.py's
from qerl_cli.bench.roofline import GpuSpec, gpu_spec
from qerl_cli.formats.fp8 import has_fp8_tensor_cores, quantize_per_channel
from qerl_cli.kernels.fp8_rows import quantize_rows_fp8
from qerl_cli.kernels.nvfp4_gemm import LoraWeights, Nvfp4Weight, triton_nvfp4_linear
from qerl_cli.kernels.nvfp4_tiles import candidates_for
from qerl_cli.modeling.fp8_update import fp8_mm
from qerl_cli.modeling.model_shape import ModelShape
from qerl_cli.modeling.random_checkpoint import SHAPES

LORA_RANK = 16
LORA_SCALING = 2.0
L2_MULTIPLE = 4  # the copies of a weight read in one graph together exceed the L2 cache this many times
MAX_COPIES = 64
REPLAYS = 20


@dataclass(frozen=True)
class GemmRow:
    """One measured (shape, rows, backend, adapter) figure."""

    model: str
    linear: str
    n: int
    k: int
    m: int
    backend: str
    lora: bool
    us: float
    tflops: float
    bytes_read: int
    of_hbm_bound: float | None
    of_tensor_peak: float | None
    # The share of the tighter of the two bounds (the roofline's max(bytes / bandwidth, FLOPs / peak)):
    # past the crossover (about 100 tokens for a 4-bit weight on an H200) the tensor cores bound a
    # W4A16 GEMM, and its share of the HBM bound alone can no longer approach 100%.
    of_roofline: float | None
    max_rel_err: float | None  # against dequantize-then-matmul of the same weight (float32)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_linears(shape_name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each GEMM of one decoder layer as vLLM runs it: q/k/v and gate/up fused."""

    fused = ModelShape.from_config(SHAPES[shape_name]).fused_linears()
    return {name: (sum(outs), k) for name, (k, outs) in fused.items()}


def graph_us(calls: list[Callable[[], Any]], replays: int = REPLAYS) -> float:
    """Microseconds per call of ``calls`` run back to back, captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up outside the capture: compiles, workspaces, cuBLAS handles
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def marlin_available() -> bool:
    try:
        from vllm.model_executor.layers.quantization.utils import marlin_utils_fp4  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no Marlin row
        return False
    return True


def marlin_linear(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> Callable:
    """``x -> x @ dequant(W)^T`` with vLLM's Marlin NVFP4 kernel, from the checkpoint's buffers."""

    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        apply_fp4_marlin_linear,
        prepare_fp4_layer_for_marlin,
    )

    n, k = packed.shape[0], packed.shape[1] * 2
    layer = SimpleNamespace(
        output_size_per_partition=n,
        input_size_per_partition=k,
        params_dtype=torch.bfloat16,
        bias=None,
        weight=packed.clone(),
        weight_scale=scale.clone(),
        # Marlin multiplies by this value: vLLM's compressed-tensors scheme hands it 1 / the checkpoint's
        # global scale (the checkpoint divides by it).
        weight_global_scale=(1.0 / global_scale.float()).reshape(1).clone(),
    )
    prepare_fp4_layer_for_marlin(layer)
    weights = (layer.weight, layer.weight_scale, layer.weight_global_scale, layer.workspace)

    def run(x: torch.Tensor) -> torch.Tensor:
        return apply_fp4_marlin_linear(x, *weights, n, k)

    return run


class _Layer:
    """One random ``[N, K]`` weight in every backend's format, plus a rank-16 adapter."""

    def __init__(self, n: int, k: int, device: torch.device, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        dense = torch.randn((n, k), device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        self.nvfp4 = Nvfp4Weight.from_buffers(formats.get("nvfp4").quantize(dense))
        self.bf16 = self.nvfp4.dequantize(torch.bfloat16)  # the same values, so every backend is checkable
        del dense
        self.fp8 = quantize_per_channel(self.bf16)
        a = torch.randn((LORA_RANK, k), device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        b = torch.randn((n, LORA_RANK), device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        self.lora = LoraWeights(a, b, LORA_SCALING)
        self.n, self.k = n, k

    def weight_bytes(self, backend: str) -> int:
        if backend == "bf16":
            return self.bf16.numel() * 2
        if backend == "fp8":
            return self.fp8[0].numel() + self.fp8[1].numel() * 4
        return sum(t.numel() * t.element_size() for t in self.nvfp4.buffers().values())


def _copies(layer: _Layer, backend: str) -> int:
    l2 = torch.cuda.get_device_properties(layer.bf16.device).L2_cache_size
    return max(2, min(MAX_COPIES, -(-L2_MULTIPLE * l2 // layer.weight_bytes(backend))))


def _calls(
    layer: _Layer, backend: str, x: torch.Tensor, lora: bool, config: Any = None
) -> tuple[list[Callable], Callable]:
    """The calls over distinct weight copies, and one call to check the output with (``config``: the
    qerl kernel's tile config, None for its bucket's)."""

    adapter = layer.lora if lora else None

    def with_lora(base: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            y = base(x)
            if adapter is not None:
                y.addmm_(x @ adapter.a.t(), adapter.b.t(), alpha=adapter.scaling)
            return y

        return run

    def one(copy_index: int) -> Callable[[], torch.Tensor]:
        if backend == "bf16":
            w = layer.bf16 if copy_index == 0 else layer.bf16.clone()
            return with_lora(lambda t: torch.nn.functional.linear(t, w))
        if backend == "fp8":
            codes, scale = (layer.fp8[0], layer.fp8[1]) if copy_index == 0 else (t.clone() for t in layer.fp8)
            return with_lora(lambda t: fp8_mm(*quantize_rows_fp8(t), codes, scale, torch.bfloat16))
        w = layer.nvfp4
        if copy_index:
            w = w.clone()
        if backend == "marlin":
            return with_lora(marlin_linear(w.packed, w.scale, w.global_scale))
        return lambda: triton_nvfp4_linear(x, w, lora=adapter, config=config)

    calls = [one(i) for i in range(_copies(layer, backend))]
    return calls, calls[0]


def _reference(layer: _Layer, x: torch.Tensor, lora: bool) -> torch.Tensor:
    y = x.float() @ layer.bf16.float().t()
    if lora:
        y += layer.lora.scaling * (x.float() @ layer.lora.a.float().t()) @ layer.lora.b.float().t()
    return y


def measure_gemm(
    layer: _Layer, model: str, linear: str, m: int, backend: str, lora: bool, spec: Any
) -> GemmRow:
    gen = torch.Generator(device=layer.bf16.device).manual_seed(m)
    x = torch.randn((m, layer.k), device=layer.bf16.device, dtype=torch.bfloat16, generator=gen)
    calls, check = _calls(layer, backend, x, lora)
    ref = _reference(layer, x, lora)
    err = float((check().float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    us = graph_us(calls)
    del calls
    adapter_params = LORA_RANK * (layer.k + layer.n) if lora else 0
    flops = 2 * m * (layer.n * layer.k + adapter_params)
    read = layer.weight_bytes(backend) + 2 * m * layer.k + 2 * adapter_params
    of_hbm, of_peak, of_roofline = bound_shares(flops, read, us, spec, backend)
    return GemmRow(
        model=model, linear=linear, n=layer.n, k=layer.k, m=m, backend=backend, lora=lora, us=us,
        tflops=flops / us / 1e6, bytes_read=read, of_hbm_bound=of_hbm, of_tensor_peak=of_peak,
        of_roofline=of_roofline, max_rel_err=err,
    )  # fmt: skip


def bound_shares(
    flops: int, bytes_read: int, us: float, spec: GpuSpec | None, backend: str
) -> tuple[float | None, float | None, float | None]:
    """(share of the HBM bound, of the tensor-core peak, of the roofline bound) of a GEMM that took ``us``:
    the roofline's time is the larger of bytes / bandwidth and FLOPs / peak (FP8's peak for ``fp8``), so
    its share is the larger of the other two. None where the GPU is not in the bench's table."""
    if spec is None:
        return None, None, None
    peak = spec.fp8_flops if backend == "fp8" and spec.fp8_flops else spec.bf16_flops
    of_hbm = bytes_read / spec.bandwidth / (us * 1e-6)
    of_peak = flops / (us * 1e-6) / peak
    return of_hbm, of_peak, max(of_hbm, of_peak)


def tune_configs(
    layer: _Layer,
    model: str,
    linear: str,
    rows: list[int],
    tune: Callable[[dict[str, Any]], None],
    on_error: Callable[[str, str], None],
) -> None:
    """Time qerl's kernel (no adapter) in every candidate tile config of each row count's bucket."""

    for m in rows:
        x = torch.randn((m, layer.k), device=layer.bf16.device, dtype=torch.bfloat16)
        for position, config in enumerate(candidates_for(m)):
            try:
                us = graph_us(_calls(layer, "qerl-nvfp4", x, False, config)[0])
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or run is recorded
                on_error(f"tune {model} {linear} m={m} {config.label()}", f"{type(exc).__name__}: {exc}")
                continue
            tune({"model": model, "linear": linear, "n": layer.n, "k": layer.k, "m": m,
                  "config": config.label(), "bucket_default": position == 0, "us": us})  # fmt: skip


def run_gemm(
    shapes: list[str],
    rows: list[int],
    record: Callable[[dict[str, Any]], None],
    on_error: Callable[[str, str], None],
    backends: tuple[str, ...] = BACKENDS,
    seed: int = 0,
    tune: Callable[[dict[str, Any]], None] | None = None,
) -> list[str]:
    """Measure every (shape, linear, rows, backend, adapter) on the current CUDA GPU, handing each row
    to ``record`` as it is measured and each failed one to ``on_error`` (case, error); with ``tune``,
    first every candidate tile config of qerl's kernel (no adapter) to it. Returns the backends skipped
    (with why)."""

    device = torch.device("cuda")
    spec = gpu_spec(torch.cuda.get_device_name(device))
    skipped = []
    chosen = list(backends)
    if "marlin" in chosen and not marlin_available():
        chosen.remove("marlin")
        skipped.append("marlin: vLLM is not importable")
    if "fp8" in chosen and not has_fp8_tensor_cores(device):
        chosen.remove("fp8")
        skipped.append("fp8: no FP8 tensor cores (compute capability < 8.9)")
    for model in shapes:
        for index, (linear, (n, k)) in enumerate(model_linears(model).items()):
            layer = _Layer(n, k, device, seed + index)
            if tune is not None:
                tune_configs(layer, model, linear, rows, tune, on_error)
            for m, backend, lora in itertools.product(rows, chosen, (False, True)):
                try:
                    record(measure_gemm(layer, model, linear, m, backend, lora, spec).to_dict())
                except Exception as exc:  # noqa: BLE001 - recorded; the other figures still run
                    case = f"{model} {linear} m={m} {backend}{' +lora' if lora else ''}"
                    on_error(case, f"{type(exc).__name__}: {exc}")
            del layer
            torch.cuda.empty_cache()
    return skipped


def empty_sections() -> dict[str, list]:
    return {"gemm": [], "gemm_tuning": [], "gemm_skipped": []}


def gemm_section(report: dict[str, Any], save: Callable[[], None], cuda: bool) -> None:
    """``kernels.json``'s GEMM section, as its ``settings`` say (``formats`` with ``nvfp4``,
    ``gemm_shapes``, ``gemm_rows``, ``gemm_tune``, ``gemm_backends``: :class:`GemmSettings`): rows
    into ``gemm`` and ``gemm_tuning``, failed figures into ``errors``, what was left out and why into
    ``gemm_skipped``; ``save`` after each figure, so a run cut short keeps them."""
    if "nvfp4" not in report["settings"]["formats"]:
        report["gemm_skipped"].append("all: nvfp4 is not among --formats")
        return
    if not cuda:
        report["gemm_skipped"].append("all: the GEMMs are timed on a CUDA GPU only")
        return

    def keep(section: str) -> Callable[[dict[str, Any]], None]:
        def add(row: dict[str, Any]) -> None:
            report[section].append(row)
            save()

        return add

    def failed(case: str, error: str) -> None:
        report["errors"].append({"section": "gemm", "format": "nvfp4", "case": case, "error": error})

    settings = report["settings"]
    tune = keep("gemm_tuning") if settings["gemm_tune"] else None
    backends = tuple(settings.get("gemm_backends", BACKENDS))
    report["gemm_skipped"] += run_gemm(
        settings["gemm_shapes"], settings["gemm_rows"], keep("gemm"), failed, backends, tune=tune
    )


def gemm_table(rows: list[dict[str, Any]], device: str):  # -> rich.table.Table
    """One line per (model, linear, tokens): each backend's microseconds and share of its roofline bound
    (the tighter of HBM and tensor-core time), without / with the adapter. Rows of reports written before
    that share was recorded show their share of the HBM bound, marked "HBM"."""

    backends = [b for b in BACKENDS if any(r["backend"] == b for r in rows)]
    table = Table(
        title=f"Decode GEMMs on {device}: us (share of the roofline bound: max of HBM and tensor-core time), "
        "without / with LoRA r16"
    )
    for name in ("model", "linear", "N x K", "tokens", *backends):
        table.add_column(name)
    cells: dict[tuple, dict[str, dict[bool, dict[str, Any]]]] = {}
    for r in rows:
        key = (r["model"], r["linear"], f"{r['n']} x {r['k']}", str(r["m"]))
        cells.setdefault(key, {}).setdefault(r["backend"], {})[r["lora"]] = r

    def cell(pair: dict[bool, dict[str, Any]]) -> str:
        parts = []
        for lora in (False, True):
            r = pair.get(lora)
            share = ""
            if r and r.get("of_roofline") is not None:
                share = f" ({r['of_roofline']:.0%})"
            elif r and r.get("of_hbm_bound") is not None:
                share = f" (HBM {r['of_hbm_bound']:.0%})"
            parts.append(f"{r['us']:.1f}{share}" if r else "-")
        return " / ".join(parts)

    for key, by_backend in cells.items():
        table.add_row(*key, *(cell(by_backend.get(b, {})) for b in backends))
    return table

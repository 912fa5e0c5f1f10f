"""The GPU side of ``qerl bench lora-tune``: vLLM's ``lora_shrink`` / ``lora_expand`` run in a given Triton
config on the current CUDA GPU, checked against the default config's output and timed; and the run
(:func:`run_lora_tune`), which searches (:mod:`qerl_cli.bench.lora_tune`) and writes the files.

The ops are called as vLLM's punica wrapper calls them: activations ``[m, in]`` in BF16, each slice's
LoRA A ``[max_loras, rank, in]`` and B ``[max_loras, out, rank]`` in BF16, the shrink's output (the
expand's input) ``[slices, m, rank]`` in float32, the kernels' token metadata from vLLM's own
``LoRAKernelMeta`` with every token on adapter 0. A config is forced by standing in for the ops'
config lookup (``get_lora_op_configs`` in each op's module) while they launch; vLLM's defaults come from
that same lookup with no tuned folder, so the tuner's own process runs without
``VLLM_TUNED_CONFIG_FOLDER``. Timing: :func:`qerl_cli.bench.gemm.graph_us` (the calls captured in one
CUDA graph, so Python and launch overhead are not counted -- vLLM replays its decode steps as graphs).

vLLM caches each LoRA weight list's pointers and strides the first time an op sees it, so the weights of
every shape stay allocated for the whole run: a new tensor at a freed one's address would be read with
the old one's strides.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from qerl_cli import files
from qerl_cli.bench.gemm import graph_us
from qerl_cli.bench.header import report_header, write_report
from qerl_cli.bench.lora_tune import (
    REPORT_NAME,
    SCHEMA,
    KeyResult,
    Trial,
    TuneKey,
    install,
    model_shape,
    plan_keys,
    report,
    run_search,
    source_tree_folder,
    write_configs,
)
from qerl_cli.bench.lora_tune_settings import MAX_LORAS, LoraTuneSettings
from qerl_cli.bench.preflight import VLLM_EXTRA, gpu_available, vllm_available
from qerl_cli.bench.progress import Progress
from qerl_cli.errors import QerlError
from qerl_cli.rollout import lora_kernel_configs as lkc

log = logging.getLogger(__name__)
CALLS_PER_GRAPH = 10
# A candidate's output may differ from the default's by float32 summation order (split_k partial sums
# are added atomically) and one BF16 rounding; more than this share of the output's largest magnitude
# is a wrong result.
TOLERANCE = 1e-2
OPS_PACKAGE = "vllm.lora.ops.triton_ops"


def check_can_run(device: str = "auto") -> None:
    """Refuse, before anything runs, where the ops cannot: no CUDA GPU (or not the one ``device`` names),
    no vLLM, batch-invariant mode."""
    if not gpu_available():
        raise QerlError(
            "qerl bench lora-tune times vLLM's LoRA kernels on a CUDA GPU and none is visible; run it on the "
            "GPU the configs are for (--dry-run prints the plan here)"
        )
    index = device.partition(":")[2]
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise QerlError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered from 0"
        )
    if not vllm_available():
        raise QerlError(
            f"qerl bench lora-tune times vLLM's LoRA kernels, and vLLM is not installed: {VLLM_EXTRA}"
        )
    if os.environ.get(lkc.BATCH_INVARIANT_ENV, "0") not in ("", "0"):
        raise QerlError(
            f"{lkc.BATCH_INVARIANT_ENV} is set: vLLM ignores tuned LoRA configs in batch-invariant mode (and "
            "changes its defaults); unset it to tune"
        )


def _ops_modules() -> dict[str, ModuleType]:
    """vLLM's LoRA ops, the module of each (whose config lookup is stood in for) and the lookup's home."""
    try:
        package = importlib.import_module(OPS_PACKAGE)
        found = {
            "package": package,
            "shrink": importlib.import_module(f"{OPS_PACKAGE}.lora_shrink_op"),
            "expand": importlib.import_module(f"{OPS_PACKAGE}.lora_expand_op"),
            "utils": importlib.import_module(f"{OPS_PACKAGE}.utils"),
        }
    except ImportError as exc:
        raise QerlError(f"vLLM's LoRA ops are not importable ({exc}); {VLLM_EXTRA}") from None
    needed = [f"{name}.get_lora_op_configs" for name in ("shrink", "expand", "utils")
              if not hasattr(found[name], "get_lora_op_configs")]  # fmt: skip
    needed += [
        name for name in ("lora_shrink", "lora_expand", "LoRAKernelMeta") if not hasattr(package, name)
    ]
    if needed:
        raise QerlError(
            f"this vLLM's LoRA ops are laid out otherwise than qerl bench lora-tune expects ({OPS_PACKAGE}: "
            f"{', '.join(needed)} missing); run it with the vLLM qerl's engines run"
        )
    return found


@contextmanager
def _forced(module: ModuleType, config: Mapping[str, Any]) -> Iterator[None]:
    """The op of ``module`` launches in ``config`` inside the block."""
    original = module.get_lora_op_configs
    module.get_lora_op_configs = lambda *args, **kwargs: dict(config)
    try:
        yield
    finally:
        module.get_lora_op_configs = original


class VllmLoraOps:
    """vLLM's two LoRA ops on one GPU, each key's tensors made when it is first timed."""

    dtype = torch.bfloat16  # the activations' and the LoRA weights' dtype in qerl's engines

    def __init__(self, rank: int, max_loras: int, device: torch.device) -> None:
        self.mods = _ops_modules()
        self.rank, self.max_loras, self.device = rank, max_loras, device
        self._weights: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # kept for the run (see above)
        self._key: TuneKey | None = None
        self._call: Callable[[], None] | None = None
        self._out: torch.Tensor | None = None
        self._reference: torch.Tensor | None = None
        self._gen = torch.Generator(device=device).manual_seed(0)

    def default_config(self, key: TuneKey, max_loras: int) -> dict[str, Any]:
        """vLLM's own config for ``key`` (this process has no tuned folder)."""
        get = self.mods["utils"].get_lora_op_configs
        common = {"max_loras": lkc.lookup_max_loras(max_loras), "batch": key.m, "num_slices": key.num_slices}
        if key.op == "shrink":
            return dict(get("shrink", hidden_size=key.k, rank=key.n, **common))
        return dict(get("expand", hidden_size=key.n, rank=key.k, add_inputs=True, **common))

    def _randn(self, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, device=self.device, generator=self._gen) * scale).to(dtype).contiguous()

    def _weights_for(self, key: TuneKey) -> list[torch.Tensor]:
        ident = (key.op, key.in_features, key.slice_sizes)
        if ident not in self._weights:
            if key.op == "shrink":
                shapes = [(self.max_loras, self.rank, key.in_features)] * key.num_slices
            else:
                shapes = [(self.max_loras, out, self.rank) for out in key.slice_sizes]
            self._weights[ident] = [self._randn(*s, dtype=self.dtype, scale=0.02) for s in shapes]
        return self._weights[ident]

    def _prepare(self, key: TuneKey) -> None:
        """``key``'s inputs, output and metadata, and the call running its op (the previous key's freed)."""
        if self._key == key:
            return
        self._call = self._out = self._reference = None
        meta = self.mods["package"].LoRAKernelMeta.make(self.max_loras, key.m, device=self.device)
        meta.prepare_tensors(torch.zeros(key.m, dtype=torch.long, device=self.device))
        args = meta.meta_args(key.m, False)
        weights = self._weights_for(key)
        if key.op == "shrink":
            x = self._randn(key.m, key.in_features, dtype=self.dtype)
            out = torch.empty((key.num_slices, key.m, self.rank), dtype=torch.float32, device=self.device)
            op = self.mods["package"].lora_shrink

            def call() -> None:
                op(x, weights, out, *args, 1.0)
        else:
            x = self._randn(key.num_slices, key.m, self.rank, dtype=torch.float32)
            out = torch.zeros((key.m, sum(key.slice_sizes)), dtype=self.dtype, device=self.device)
            op = self.mods["package"].lora_expand

            def call() -> None:
                op(x, weights, out, *args, offset_start=0, add_inputs=True)

        self._key, self._call, self._out = key, call, out

    def _output(self) -> torch.Tensor:
        """One call's output alone (expand adds onto its output: zeroed first)."""
        assert self._call is not None and self._out is not None
        self._out.zero_()
        self._call()
        torch.cuda.synchronize()
        return self._out.float().clone()

    def trial(self, key: TuneKey, config: Mapping[str, Any], reference: Mapping[str, Any]) -> Trial:
        """``config`` on ``key``: failed (compile or launch), differs (from ``reference``'s output), or ok
        with its microseconds per call."""
        try:
            self._prepare(key)
            module = self.mods[key.op]
            if self._reference is None:
                with _forced(module, reference):
                    self._reference = self._output()
            with _forced(module, config):
                got = self._output()
                scale = float(self._reference.abs().max().clamp(min=1e-30))
                diff = float((got - self._reference).abs().max()) / scale
                if not diff <= TOLERANCE:  # NaN included
                    return Trial(
                        dict(config), "differs", detail=f"max difference {diff:.2e} of the output's scale"
                    )
                us = graph_us([self._call] * CALLS_PER_GRAPH)  # type: ignore[list-item]
        except Exception as exc:  # noqa: BLE001 - a config Triton cannot compile or launch is skipped
            text = str(exc).strip().splitlines()
            return Trial(dict(config), "failed", detail=f"{type(exc).__name__}: {text[0] if text else ''}")
        return Trial(dict(config), "ok", us)


def run_lora_tune(settings: LoraTuneSettings, command: str) -> dict[str, Any]:
    """Search every key of ``settings`` on this GPU, write the config files and ``lora_tune.json`` into
    ``settings.output`` (the report after each key, so a run cut short keeps its figures) and, with
    ``install``, copy the files into the source tree's shipped folder."""
    check_can_run(settings.device)
    shipped = source_tree_folder() if settings.install else None  # refused now, not after the run
    given = os.environ.pop(lkc.ENV_VAR, None)  # vLLM's defaults are what the candidates are timed against
    if given:
        log.info(
            "%s=%s is ignored while tuning: candidates are timed against vLLM's defaults", lkc.ENV_VAR, given
        )
    started = time.perf_counter()
    if ":" in settings.device:  # cuda:N (auto and cuda: the current GPU)
        torch.cuda.set_device(torch.device(settings.device))  # vLLM's ops launch on the current device
    device = torch.device("cuda", torch.cuda.current_device())
    out_dir = files.ensure_output_dir(settings.output, "--output")
    gpu = torch.cuda.get_device_name(device)
    ops = VllmLoraOps(settings.rank, MAX_LORAS, device)
    header = report_header(SCHEMA, command)
    total = len(plan_keys(model_shape(settings.model), settings.rank, settings.rows))
    progress = Progress("bench lora-tune", total, started=started)
    results: list[KeyResult] = []
    last = [time.perf_counter()]

    def on_key(result: KeyResult) -> None:
        results.append(result)
        outcome = result.error or f"{result.speedup:.2f}x over vLLM's default"
        progress.finish(result.key.label(), outcome, seconds=time.perf_counter() - last[0])
        last[0] = time.perf_counter()
        write_report(out_dir / REPORT_NAME, report(header, settings, results, started, []))

    run_search(settings, ops.trial, ops.default_config, on_key)
    written = write_configs(results, gpu, out_dir, MAX_LORAS)
    data = report(header, settings, results, started, written)
    if shipped is not None:
        data["installed"] = [str(p.relative_to(shipped.parents[2])) for p in install(written, shipped)]
    write_report(out_dir / REPORT_NAME, data)
    return data

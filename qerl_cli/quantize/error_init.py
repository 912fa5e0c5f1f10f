"""``qerl quantize --lora-init eora|svd``: the error-compensating LoRA start, written beside the checkpoint.

Once the 4-bit checkpoint is in the staging folder (:mod:`qerl_cli.quantize.run`):

1. the checkpoint is loaded with qerl's own loader, so ``deq(Q(W))`` is exactly what training's
   QuantLinear layers compute with (dequantized in float32);
2. the untouched BF16 model (reloaded: GPTQ and llm-compressor's compression change the first copy
   in place) runs over the calibration samples while forward hooks sum each quantized linear's input
   second moment ``C = E[x x^T]``. Linears that read one tensor (q/k/v, gate/up) share one matrix,
   found by tensor identity on a short probe forward. The matrices of a 7B model take ~45 GB in
   float32, so they are collected a group of decoder layers at a time within
   :data:`SECOND_MOMENT_BUDGET_BYTES`: one pass over the calibration set per group, each pass
   stopped as soon as its last layer has run, and each group's matrices factorised and dropped
   before the next pass;
3. each linear's error ``E = W - deq`` is factorised (:mod:`qerl_cli.modeling.error_init`) and the
   factors written as a PEFT adapter folder ``lora_init/`` (rank r, ``lora_alpha`` = 2 r) through
   :mod:`qerl_cli.modeling.adapter`, with ``error_init.json`` (:class:`LoraInitInfo`).

``lora.init: eora`` in a training recipe reads it (``qerl_cli.rl.policy``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl_cli.files import write_json
from qerl_cli.modeling import adapter
from qerl_cli.modeling.error_init import (
    DAMP,
    INFO_NAME,
    INIT_DIR,
    LoraInitInfo,
    factorise,
    lora_key,
    weighted_sq_norm,
    whitening,
)
from qerl_cli.modeling.loading import load_policy_model
from qerl_cli.modeling.quant_linear import QuantLinear, packed_nbytes

log = logging.getLogger(__name__)

# Device memory the float32 second-moment matrices of one pass may take; more layers than fit cost one
# more forward pass over the calibration set each (Qwen2.5-7B: 1.59 GB a layer, 2 layers a pass, 14
# passes, each stopped after its last layer: ~7.5 full forwards over the calibration set in all).
SECOND_MOMENT_BUDGET_BYTES = 4 * 2**30
PROBE_TOKENS = 16  # the probe forward that finds which linears share an input
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class InputGroup:
    """Quantized linears that read one input tensor, and so share one second moment."""

    linears: list[str]
    width: int  # in_features
    layer: int  # decoder layer index from the name (-1: none)

    @property
    def nbytes(self) -> int:
        return self.width * self.width * 4


def default_alpha(rank: int) -> int:
    """``lora_alpha`` of the written adapter: 2 r, the recipes' usual ratio (scaling 2)."""
    return 2 * rank


def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["input"]


@torch.no_grad()
def input_groups(
    model: nn.Module, names: Sequence[str], probe_ids: Sequence[int], device: torch.device
) -> list[InputGroup]:
    """Group ``names`` by the tensor they read in one short forward (kept alive meanwhile, so the
    identities cannot be reused); a linear the probe never reached gets a group of its own."""
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}

    def recorder(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.setdefault(name, _first_input(args, kwargs))

        return hook

    handles = [modules[n].register_forward_pre_hook(recorder(n), with_kwargs=True) for n in names]
    try:
        model(input_ids=torch.tensor([list(probe_ids)], device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    groups: list[InputGroup] = []
    by_tensor: dict[int, InputGroup] = {}
    for name in names:
        tensor = seen.get(name)
        group = by_tensor.get(id(tensor)) if tensor is not None else None
        if group is None:
            found = _LAYER_INDEX.search(name)
            group = InputGroup([], modules[name].in_features, int(found.group(1)) if found else -1)
            groups.append(group)
            if tensor is not None:
                by_tensor[id(tensor)] = group
        group.linears.append(name)
    return groups


def plan_passes(groups: Sequence[InputGroup], budget: int) -> list[list[InputGroup]]:
    """Whole decoder layers, in order, per pass, as many as fit ``budget`` (at least one a pass)."""
    layers: dict[int, list[InputGroup]] = {}
    for group in groups:
        layers.setdefault(group.layer, []).append(group)
    passes: list[list[InputGroup]] = []
    current: list[InputGroup] = []
    for index in sorted(layers):
        layer = layers[index]
        if current and sum(g.nbytes for g in current + layer) > budget:
            passes.append(current)
            current = []
        current = current + layer
    if current:
        passes.append(current)
    return passes


class _PassDone(Exception):
    """Raised by the last hook of a pass: the rest of the forward would be wasted."""


@torch.no_grad()
def second_moments(
    model: nn.Module, groups: Sequence[InputGroup], samples: Sequence[Sequence[int]], device: torch.device
) -> list[torch.Tensor]:
    """``E[x x^T]`` (float32, on ``device``) of each group's input over the token positions of
    ``samples`` (one sequence per forward, so no padding is counted)."""
    modules = dict(model.named_modules())
    sums = [torch.zeros(g.width, g.width, dtype=torch.float32, device=device) for g in groups]
    counts = [0] * len(groups)
    pending: set[int] = set()

    def accumulate(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = _first_input(args, kwargs).detach()
            x = x.reshape(-1, x.shape[-1]).to(torch.float32)
            sums[index].addmm_(x.T, x)
            counts[index] += x.shape[0]
            pending.discard(index)
            if not pending:
                raise _PassDone

        return hook

    handles = [
        modules[g.linears[0]].register_forward_pre_hook(accumulate(i), with_kwargs=True)
        for i, g in enumerate(groups)
    ]
    try:
        with _exact_tf32(model, device):
            _run_samples(model, samples, pending, len(groups), device)
    finally:
        for handle in handles:
            handle.remove()
    return [s / max(1, n) for s, n in zip(sums, counts, strict=True)]


def _run_samples(
    model: nn.Module, samples: Sequence[Sequence[int]], pending: set[int], groups: int, device: torch.device
) -> None:
    for ids in samples:
        pending.update(range(groups))
        with contextlib.suppress(_PassDone):
            model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)


@contextlib.contextmanager
def _exact_tf32(model: nn.Module, device: torch.device) -> Iterator[None]:
    """TF32 for the float32 ``x^T x`` sums of a BF16 / FP16 model on a GPU: its activations have at most
    TF32's 10 mantissa bits, so the products are exact and the sums still float32, at several times
    float32's speed on a Hopper GPU. The CPU keeps float32."""
    dtype = next(model.parameters()).dtype
    previous = torch.get_float32_matmul_precision()
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def build_lora_init(
    bf16_model: nn.Module,
    quantized_dir: Path,
    names: Sequence[str],
    samples: Sequence[Sequence[int]],
    *,
    method: str,
    rank: int,
    base_model: str,
    device: torch.device,
    calibration: dict[str, Any] | None = None,
    budget: int = SECOND_MOMENT_BUDGET_BYTES,
) -> LoraInitInfo:
    """Write ``quantized_dir/lora_init/`` for the quantized linears ``names`` and return its record.
    ``bf16_model`` is the untouched BF16 model (moved to ``device`` here)."""
    if method not in ("eora", "svd"):
        raise ValueError(f"unknown LoRA init method {method!r}")
    start = time.perf_counter()
    model = bf16_model.to(device).eval()
    quantized, _ = load_policy_model(quantized_dir, torch.bfloat16, device)
    groups = input_groups(model, names, samples[0][:PROBE_TOKENS], device)
    passes = plan_passes(groups, budget)
    log.info("LoRA init (%s, rank %d): %d pass(es) over the calibration set", method, rank, len(passes))
    alpha = default_alpha(rank)
    factors = _Factors(method, rank, alpha / rank, dict(model.named_modules()), quantized)
    for group_pass in passes:
        moments = second_moments(model, group_pass, samples, device)
        for group, moment in zip(group_pass, moments, strict=True):
            factors.add(group, moment)
        del moments
    folder = quantized_dir / INIT_DIR
    adapter.write_tensors(
        folder, factors.tensors, rank=rank, alpha=alpha, base_model=base_model,
        target_modules=sorted({n.rsplit(".", 1)[-1] for n in names}),
    )  # fmt: skip
    info = LoraInitInfo(
        method=method, rank=rank, alpha=alpha, target_modules=sorted({n.rsplit(".", 1)[-1] for n in names}),
        layers=len(names), damp=DAMP if method == "eora" else 0.0, calibration=calibration,
        relative_error_base=factors.relative("base"), relative_error_corrected=factors.relative("corrected"),
        seconds=time.perf_counter() - start,
        weights_bytes=adapter.weights_file(folder).stat().st_size,
        quantized_linear_bytes=packed_nbytes(quantized), passes=len(passes), per_layer=factors.per_layer,
    )  # fmt: skip
    write_json(folder / INFO_NAME, info.to_dict())  # modes: the staged output's, once complete
    del quantized
    return info


class _Factors:
    """The factors of every linear, and the activation-weighted errors before and after."""

    def __init__(
        self, method: str, rank: int, scaling: float, bf16: dict[str, nn.Module], quantized: nn.Module
    ) -> None:
        self.method, self.rank, self.scaling = method, rank, scaling
        self.bf16 = bf16
        self.quantized = dict(quantized.named_modules())
        self.tensors: dict[str, torch.Tensor] = {}
        self.per_layer: dict[str, list[float]] = {}
        self.totals = {"weight": 0.0, "base": 0.0, "corrected": 0.0}

    @torch.no_grad()
    def add(self, group: InputGroup, moment: torch.Tensor) -> None:
        whiten = whitening(moment) if self.method == "eora" else None
        for name in group.linears:
            layer = self.quantized.get(name)
            if not isinstance(layer, QuantLinear):
                raise RuntimeError(f"{name} is not a 4-bit layer of the checkpoint just written")
            weight = self.bf16[name].weight.to(torch.float32)
            error = weight - layer.dequantized_weight(torch.float32).to(weight.device)
            a, b = factorise(error, self.rank, self.scaling, whiten)
            residual = error - self.scaling * (b @ a)
            figures = [weighted_sq_norm(m, moment) for m in (weight, error, residual)]
            for key, value in zip(self.totals, figures, strict=True):
                self.totals[key] += value
            scale = max(figures[0], 1e-30)
            self.per_layer[name] = [(figures[1] / scale) ** 0.5, (figures[2] / scale) ** 0.5]
            self.tensors[lora_key(name, "A")] = a.cpu().contiguous()
            self.tensors[lora_key(name, "B")] = b.cpu().contiguous()

    def relative(self, which: str) -> float:
        return (self.totals[which] / max(self.totals["weight"], 1e-30)) ** 0.5

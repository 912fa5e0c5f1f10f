"""``train.base_compute``: whether the frozen 4-bit base's GEMMs run in BF16 or FP8 in the update.

The numerics are in :mod:`qerl_cli.modeling.fp8_update`; here is the choice, made in one place
(:func:`apply_base_compute`, called by ``rl.policy.build_policy``). Its memory is counted by the run's
plan (``rl.setup.plan_with_base_compute``).

* ``bf16``: dequantize the packed weight per GEMM (the path qerl always had);
* ``fp8``: FP8 GEMMs on two FP8 copies of each 4-bit weight (2 bytes per base weight, held for the
  whole run). Needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9) and a 4-bit base;
  asked for anywhere else it is an error, never a silent fallback;
* ``auto``: ``bf16``. Measured for a 7B, FP8 on every layer or on the MLP layers alone
  (:data:`FP8_MIN_WEIGHTS`) made the update no faster than BF16, for copies of many GiB that the
  rollout's KV cache would otherwise hold (the figures: ``docs/train.md``).

A BF16 base (plain ``nn.Linear``) always computes in BF16: it has no 4-bit weight to keep, and an FP8
copy beside its BF16 weight would cost memory for a speed-up this option does not aim at.
"""

from __future__ import annotations

import logging
from typing import get_args

import torch
from torch import nn

from qerl_cli.config.choices import BaseCompute
from qerl_cli.errors import QerlError
from qerl_cli.formats.fp8 import FP8_MIN_CAPABILITY
from qerl_cli.formats.fp8 import cuda_capability as device_capability  # tests stand an FP8 GPU in for it
from qerl_cli.modeling.fp8_update import FP8_MIN_WEIGHTS, check_dims, fp8_pays
from qerl_cli.modeling.quant_linear import QuantLinear, set_base_compute
from qerl_cli.torch_utils import GIB

log = logging.getLogger(__name__)

CHOICES: tuple[str, ...] = get_args(BaseCompute)


def resolve_base_compute(
    choice: str, *, quantized: bool | None, capability: tuple[int, int] | None, bad_dims: str | None = None
) -> tuple[str, str]:
    """(``bf16`` or ``fp8``, why) for ``train.base_compute=choice``; ``quantized``: the base has 4-bit
    layers large enough for FP8 GEMMs to pay (:data:`FP8_MIN_WEIGHTS`); ``capability``: the training
    GPU's (None: a CPU); ``bad_dims``: such a layer's shape FP8 GEMMs cannot take. A BF16 base keeps
    BF16 (so one recipe serves the BF16 and the 4-bit arms of a comparison); otherwise raises QerlError
    where ``fp8`` is asked for and cannot run or would run no layer."""
    if choice not in CHOICES:
        raise QerlError(f"train.base_compute must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "bf16":
        return "bf16", "train.base_compute=bf16"
    if choice == "auto":
        return "bf16", (
            "train.base_compute=auto keeps BF16: FP8 update GEMMs measured no faster than BF16 for GiB "
            "of weight copies (docs/train.md); train.base_compute=fp8 uses them"
        )
    if quantized is None:
        return "bf16", "train.base_compute=fp8: the base is BF16, which computes in BF16"
    where = check_fp8_device(capability)  # first: on the CPU no model runs FP8 GEMMs
    problem = None
    if not quantized:
        problem = (f"no 4-bit layer of this model has the {FP8_MIN_WEIGHTS:,} weights where FP8 GEMMs "
                   "beat BF16 (the largest layers of a 7B and up do)")  # fmt: skip
    elif bad_dims:
        problem = f"a base layer has {bad_dims} (FP8 GEMMs need multiples of 16)"
    if problem is not None:
        raise _cannot_run(problem)
    return "fp8", f"train.base_compute=fp8: a 4-bit base on {where} with FP8 tensor cores"


def check_fp8_device(capability: tuple[int, int] | None) -> str:
    """Where training runs (``capability``: its GPU's, None: the CPU), said for a message, when it has
    FP8 tensor cores; else the QerlError that names the GPUs FP8 base compute needs. ``qerl train``'s
    checks ask it before the model loads (``rl.preflight.base_compute``)."""
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    gpus = (
        f"a CUDA GPU with FP8 tensor cores (compute capability >= {need}: Ada, Hopper or later, e.g. "
        "L4, L40S, H100)"
    )
    if capability is None:
        raise _cannot_run(f"training runs on the CPU, and FP8 base compute needs {gpus}")
    where = f"a GPU of compute capability {capability[0]}.{capability[1]}"
    if capability < FP8_MIN_CAPABILITY:
        raise _cannot_run(f"training runs on {where}, without FP8 tensor cores: it needs {gpus}")
    return where


def _cannot_run(problem: str) -> QerlError:
    return QerlError(f"train.base_compute=fp8 cannot run: {problem}. Set train.base_compute to auto or bf16")


def apply_base_compute(model: nn.Module, choice: str, device: torch.device) -> str:
    """Resolve ``choice`` for ``model`` (the loaded base, on ``device``), set it on every 4-bit layer
    (deriving the FP8 copies now, so the memory plan measures them), log what and why; returns the
    mode."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    large = [m for m in layers if fp8_pays(m.out_features, m.in_features, FP8_MIN_WEIGHTS)]
    bad = next((why for m in large if (why := check_dims(m.out_features, m.in_features))), None)
    mode, why = resolve_base_compute(choice, quantized=bool(large) if layers else None,
                                     capability=device_capability(device), bad_dims=bad)  # fmt: skip
    held = set_base_compute(model, mode, min_weights=FP8_MIN_WEIGHTS) if layers else 0
    fp8_layers = f"; {len(large)} of {len(layers)} layers in FP8, copies {held / GIB:.2f} GiB" if held else ""
    log.info("base GEMMs in the update: %s (%s)%s", mode.upper(), why, fp8_layers)
    return mode

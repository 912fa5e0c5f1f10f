"""Fused training kernels for the trainer's model (``train.fused_kernels``): Liger's RMSNorm, SwiGLU
and RoPE (``pip install "qerl[liger]"``, the kernels TRL uses).

Why: the update runs a forward and a backward over every rollout token; between the projections
(which QuantLinear and LoRA keep) HF's RMSNorm, SiLU x up and rotary embedding are chains of small
elementwise kernels that each read and write the whole activation, and they keep float32 copies for
the backward. Liger's Triton kernels do each in one pass and keep less. The projections and the
logprob head (``rl.logprobs``, chunked, never [rows, length, vocab]) are untouched.

Patched per model instance (the module classes stay, so AQN and the norm lookups still find
``*RMSNorm`` modules); Liger's RoPE replaces the model family's ``apply_rotary_pos_emb`` function in
its transformers module, for every model of that family in this process.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Literal

from torch import nn

from qerl_cli.errors import QerlError

log = logging.getLogger(__name__)

FusedKernels = Literal["auto", "liger", "off"]
INSTALL_HINT = 'pip install "qerl[liger]"'


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def _supported_types() -> set[str]:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return set(MODEL_TYPE_TO_APPLY_LIGER_FN)


def apply_fused_kernels(model: nn.Module, mode: str, *, on_gpu: bool) -> str:
    """Patch ``model`` (the base, before LoRA is attached) per ``mode``; returns what now runs
    (``liger`` or ``off``) for the run's records.

    ``auto``: Liger when it is installed, the model runs on a GPU and Liger knows its family;
    ``liger``: the same, but a missing package or an unknown family is an error saying what to do;
    ``off``: transformers' own modules.
    """
    if mode == "off":
        return "off"
    if mode not in ("auto", "liger"):
        raise QerlError(f"train.fused_kernels={mode!r} is unknown; choose one of auto, liger, off")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not liger_installed():
        if mode == "liger":
            raise QerlError("train.fused_kernels=liger needs liger-kernel, which is not installed: "
                            f"{INSTALL_HINT} (or set train.fused_kernels=auto)")  # fmt: skip
        return "off"
    if model_type not in _supported_types():
        if mode == "liger":
            raise QerlError(f"train.fused_kernels=liger: Liger has no kernels for model type {model_type!r}; "
                            "set train.fused_kernels=auto or off")  # fmt: skip
        return "off"
    if mode == "auto" and not on_gpu:
        return "off"  # Liger's Triton kernels need a GPU; the CPU keeps transformers' modules
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    # The logprob head stays qerl's (temperature-scaled, chunked): no Liger cross-entropy.
    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
        fused_linear_cross_entropy=False,
    )  # fmt: skip
    log.info("fused kernels: Liger RMSNorm, SwiGLU and RoPE on %s", model_type)
    return "liger"

"""PEFT LoRA on QuantLinear layers (and on plain ``nn.Linear``, for BF16 baselines).

PEFT only wraps layer types it knows; QuantLinear is registered through LoraConfig's custom-module
mapping with a LoRA layer class that is PEFT's own ``lora.Linear`` minus merging (a LoRA delta cannot
be folded into packed 4-bit weights without requantizing, which would change the base model).

An adapter may start from given factors instead of PEFT's B = 0 (:func:`load_factors`: the
error-compensating start of :mod:`qerl_cli.modeling.error_init`), and a snapshot of its LoRA
matrices can be swapped back in for a while (:func:`snapshot`, :func:`swapped_in`): the KL reference
of a run that did not start from zeros.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from qerl_cli.errors import QerlError
from qerl_cli.modeling.quant_linear import QuantLinear

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quant_lora_class():
    from peft.tuners.lora.layer import Linear as LoraLinear

    class QuantLoraLinear(LoraLinear):
        """PEFT LoRA around a QuantLinear: base output from the packed weight, plus B @ A @ x."""

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            raise QerlError(
                "LoRA adapters on a 4-bit QuantLinear base cannot be merged in place; save the adapter "
                "and merge into a BF16 copy of the base model instead"
            )

        def unmerge(self) -> None:  # nothing is ever merged
            return None

    return QuantLoraLinear


def attach_lora(
    model: nn.Module,
    r: int = 32,
    alpha: int = 64,
    dropout: float = 0.0,
    target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
    autocast_adapter_dtype: bool = True,
    task_type: str | None = "CAUSAL_LM",
):  # -> peft.PeftModel
    """Wrap ``model`` in a PeftModel with LoRA on ``target_modules`` (QuantLinear or nn.Linear).

    Only LoRA parameters are trainable afterwards. With ``autocast_adapter_dtype`` PEFT keeps the
    adapter weights in float32 even when the base computes in bf16. ``task_type=None`` wraps any
    ``nn.Module`` (not only transformers causal LMs).
    """
    from peft import LoraConfig, get_peft_model

    if r <= 0:
        raise QerlError(f"LoRA rank must be positive, got {r}")
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), bias="none",
        task_type=task_type,
    )  # fmt: skip
    config._register_custom_module({QuantLinear: _quant_lora_class()})
    with warnings.catch_warnings():
        # PEFT warns that it does not know QuantLinear; the custom mapping above is how it is supported.
        warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
        return get_peft_model(model, config, autocast_adapter_dtype=autocast_adapter_dtype)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if "lora_" in name and p.requires_grad]


# --------------------------------------------------------------------------------------------
# Starting from given factors; snapshots
# --------------------------------------------------------------------------------------------
@dataclass
class FactorLoad:
    """What :func:`load_factors` did, for the caller's warnings."""

    loaded: list[str] = field(default_factory=list)  # LoRA layers started from the given factors
    missing: list[str] = field(default_factory=list)  # LoRA layers without factors: PEFT's start (B = 0)
    unused: list[str] = field(default_factory=list)  # factors of layers no LoRA layer wraps
    stored_rank: int = 0
    rank: int = 0  # the adapter's (largest) rank

    def warnings(self, source: str) -> list[str]:
        """One message per kind of mismatch between the stored factors (from ``source``) and the adapter."""
        found = []
        if self.rank < self.stored_rank:
            found.append(
                f"the LoRA rank {self.rank} is below the rank {self.stored_rank} of {source}: the adapter "
                f"starts from its {self.rank} leading components only"
            )
        if self.missing:
            found.append(
                f"{len(self.missing)} LoRA layers have no factors in {source} (e.g. {self.missing[0]}) and "
                "start from zeros: their rounding error is not corrected"
            )
        if self.unused:
            found.append(
                f"{source} also corrects {len(self.unused)} layers the adapter leaves out (e.g. "
                f"{self.unused[0]}): they keep their full rounding error"
            )
        return found


def _lora_layers(model: nn.Module, adapter: str) -> dict[str, nn.Module]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and adapter in module.lora_A
    }


@torch.no_grad()
def load_factors(
    peft_model: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    stored_scaling: float,
    adapter: str = "default",
) -> FactorLoad:
    """Start every LoRA layer named in ``tensors`` (PEFT keys ``<layer>.lora_A.weight`` / ``.lora_B
    .weight``, made for a scale ``stored_scaling`` = alpha / r) so that ``scaling * B @ A`` equals the
    stored ``stored_scaling * B_s @ A_s``: both factors are multiplied by ``sqrt(stored / scaling)``.
    A larger rank keeps PEFT's random rows of A behind zero columns of B (the product is unchanged,
    the extra directions still train); a smaller one keeps the leading components (the factors are
    stored largest first)."""
    report = FactorLoad()
    layers = _lora_layers(peft_model, adapter)
    for name, module in layers.items():
        key_a, key_b = f"{name}.lora_A.weight", f"{name}.lora_B.weight"
        if key_a not in tensors or key_b not in tensors:
            report.missing.append(name)
            continue
        a_param, b_param = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        stored_a, stored_b = tensors[key_a], tensors[key_b]
        if stored_a.shape[1] != a_param.shape[1] or stored_b.shape[0] != b_param.shape[0]:
            raise QerlError(
                f"the LoRA init of {name} is {stored_b.shape[0]}x{stored_a.shape[1]} but the layer is "
                f"{b_param.shape[0]}x{a_param.shape[1]}: the init was made for another model"
            )
        factor = (stored_scaling / float(module.scaling[adapter])) ** 0.5
        keep = min(stored_a.shape[0], a_param.shape[0])
        a_param[:keep].copy_(stored_a[:keep].to(a_param.device, a_param.dtype) * factor)
        b_param.zero_()
        b_param[:, :keep].copy_(stored_b[:, :keep].to(b_param.device, b_param.dtype) * factor)
        report.loaded.append(name)
        report.stored_rank = max(report.stored_rank, int(stored_a.shape[0]))
        report.rank = max(report.rank, int(a_param.shape[0]))
    layer_keys = {f"{name}.lora_{x}.weight" for name in layers for x in "AB"}
    report.unused = sorted({k.rsplit(".lora_", 1)[0] for k in tensors if k not in layer_keys})
    return report


def snapshot(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of every LoRA matrix (``lora_A`` / ``lora_B`` parameters), by parameter name."""
    return {
        name: param.detach().to("cpu", copy=True)
        for name, param in peft_model.named_parameters()
        if ".lora_A." in name or ".lora_B." in name
    }


@contextmanager
def swapped_in(peft_model: nn.Module, saved: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """The LoRA matrices of ``saved`` in place of the current ones for the block (no gradients): the
    parameters' storage is swapped, not copied over, so the optimizer's state and the current values
    are untouched and one extra copy of the adapter exists only meanwhile."""
    params = dict(peft_model.named_parameters())
    current = {name: params[name].data for name in saved}
    try:
        for name, tensor in saved.items():
            # A copy even on the same device: nothing inside the block may write into the snapshot.
            params[name].data = tensor.to(device=current[name].device, dtype=current[name].dtype, copy=True)
        yield
    finally:
        for name, data in current.items():
            params[name].data = data

"""PEFT LoRA on QuantLinear layers (and on plain ``nn.Linear``, for BF16 baselines).

PEFT only wraps layer types it knows; QuantLinear is registered through LoraConfig's custom-module
mapping with a LoRA layer class that is PEFT's own ``lora.Linear`` minus merging (a LoRA delta cannot
be folded into packed 4-bit weights without requantizing, which would change the base model).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

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

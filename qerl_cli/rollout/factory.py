"""Build a rollout engine by name: ``hf`` (transformers, any device) or ``vllm`` (GPU, optional).

Training passes its live PEFT model (``model=``) so the HF engine generates with the current
adapter; evaluation and benchmarks pass a path and let the factory load the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.rollout.base import RolloutEngine
from qerl_cli.torch_utils import DTYPES, resolve_device
from qerl_cli.torch_utils import dtype_name as torch_dtype_name

ENGINES = ("hf", "vllm")


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype

    if dtype not in DTYPES:
        raise QerlError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def make_engine(
    kind: str,
    model_path: str | Path | None,
    *,
    adapter: str | Path | None = None,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "auto",
    tokenizer: Any = None,
    model: Any = None,
    generation_batch_size: int = 64,
    model_format: str = "auto",
    trust_remote_code: bool = False,
    **vllm_opts: Any,
) -> RolloutEngine:
    """A :class:`~qerl_cli.rollout.base.RolloutEngine`.

    ``hf``: uses ``model`` (and ``tokenizer``) when given, else loads ``model_path`` with qerl's
    4-bit-aware loader, plus the PEFT ``adapter`` folder if any. ``vllm``: starts a colocated vLLM
    engine on ``model_path`` (``vllm_opts`` go to ``VLLMEngine``); it loads the adapter itself.
    """
    if kind not in ENGINES:
        raise QerlError(f"unknown rollout engine '{kind}'; choose one of {', '.join(ENGINES)}")
    if kind == "vllm":
        if trust_remote_code:
            vllm_opts["trust_remote_code"] = True
        return _make_vllm(model_path, adapter=adapter, dtype=dtype, model_format=model_format, **vllm_opts)
    if vllm_opts:
        raise QerlError(f"options {sorted(vllm_opts)} only apply to the vllm engine")
    from qerl_cli.modeling.loading import load_base_model, load_tokenizer
    from qerl_cli.rollout.hf import HFEngine

    torch_device = resolve_device(device) if isinstance(device, str) else device
    if model is None:
        if model_path is None:
            raise QerlError("make_engine('hf') needs a model_path or a loaded model")
        model, _ = load_base_model(
            str(model_path), model_format, _torch_dtype(dtype), torch_device,
            trust_remote_code=trust_remote_code, trust_hint="--set trust_remote_code=true",
        )  # fmt: skip
        model.eval()
        if adapter is not None:
            model = attach_saved_adapter(model, adapter).eval()
    elif adapter is not None:
        from qerl_cli.rollout.hf import load_adapter_weights

        load_adapter_weights(model, adapter)
    if tokenizer is None:
        if model_path is None:
            raise QerlError("make_engine('hf') with a model object needs its tokenizer or a model_path")
        tokenizer = load_tokenizer(str(model_path), trust_remote_code=trust_remote_code)
    return HFEngine(model, tokenizer, generation_batch_size=generation_batch_size, device=torch_device)


def attach_saved_adapter(model: Any, adapter: str | Path) -> Any:
    """Wrap a base model (QuantLinear or nn.Linear layers) with the saved PEFT LoRA adapter.

    PEFT's own ``PeftModel.from_pretrained`` does not know QuantLinear, so the LoRA layers are
    created by qerl's ``attach_lora`` from the adapter's config and the weights loaded after.
    """
    import json

    from qerl_cli.modeling.lora import attach_lora
    from qerl_cli.rollout.hf import load_adapter_weights

    folder = Path(adapter)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise QerlError(f"{folder} is not a PEFT adapter folder (no adapter_config.json)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise QerlError(
            f"{folder} holds a {config.get('peft_type')} adapter; only LoRA adapters are supported"
        )
    targets = config.get("target_modules") or []
    peft_model = attach_lora(
        model,
        r=int(config["r"]),
        alpha=int(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout", 0.0)),
        target_modules=sorted(targets) if isinstance(targets, list | set) else targets,
    )
    if config.get("modules_to_save"):  # trained norms (lora.train_norms)
        from peft.utils.other import set_additional_trainable_modules

        peft_config = peft_model.peft_config["default"]
        peft_config.modules_to_save = list(config["modules_to_save"])
        set_additional_trainable_modules(
            peft_model, peft_config, peft_model.base_model.model.config, "default"
        )
    load_adapter_weights(peft_model, folder)
    return peft_model


def _make_vllm(
    model_path: str | Path | None,
    *,
    adapter: str | Path | None,
    dtype: str | torch.dtype,
    model_format: str,
    **vllm_opts: Any,
) -> RolloutEngine:
    import importlib.util

    from qerl_cli.modeling.shapes import check_vllm_shapes
    from qerl_cli.modeling.sources import resolve_model_source

    if model_path is not None:
        model_path = resolve_model_source(model_path)
        check_vllm_shapes(model_path)  # fail now, naming the layers, not deep inside vLLM's Marlin setup
    if importlib.util.find_spec("vllm") is None:
        raise QerlError(
            'rollout engine "vllm" needs vLLM, which is not installed: pip install "qerl[vllm]" '
            "(GPU machines), or use the hf engine"
        )
    if model_path is None:
        raise QerlError("the vllm engine loads the model itself: pass model_path")
    from qerl_cli.rollout.vllm_engine import VLLMEngine

    dtype_name = torch_dtype_name(dtype)
    engine = VLLMEngine(str(model_path), model_format=model_format, dtype=dtype_name, **vllm_opts)
    if adapter is not None:
        engine.sync_adapter(str(adapter))
    return engine

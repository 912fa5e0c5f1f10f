"""Build a rollout engine by name: ``hf`` (transformers, any device) or ``vllm`` (GPU, optional).

Training passes its live PEFT model (``model=``) so the HF engine generates with the current
adapter; evaluation and benchmarks pass a path and let the factory load the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qerl_cli.errors import QerlError
from qerl_cli.modeling import adapter as adapter_folder
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
            model = adapter_folder.attach_to_base(model, adapter).eval()
    elif adapter is not None:
        adapter_folder.load_weights(model, adapter)
    if tokenizer is None:
        if model_path is None:
            raise QerlError("make_engine('hf') with a model object needs its tokenizer or a model_path")
        tokenizer = load_tokenizer(str(model_path), trust_remote_code=trust_remote_code)
    return HFEngine(model, tokenizer, generation_batch_size=generation_batch_size, device=torch_device)


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
